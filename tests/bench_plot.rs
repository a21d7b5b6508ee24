//! The benches' plot support (`examples/support/plot.rs`): torch.distributed's
//! timings are read as the anchor script prints them, bad input is refused
//! naming its line, and the chart draws every series.

#[path = "../examples/support/plot.rs"]
mod plot;

use cohort::comm::op::Collective;

/// Output of `scripts/anchors/torch_collectives.py` for two collectives.
const TORCH: &str = "\
# torch 2.11.0+cu130 all_reduce float sum, 2 ranks, NCCL (2, 28, 9)
#       size   time(us)   algbw   busbw
           8      46.20    0.00    0.00
        4096      41.50    0.10    0.10
# torch 2.11.0+cu130 all_gather float sum, 2 ranks, NCCL (2, 28, 9)
#       size   time(us)   algbw   busbw
           8      37.40    0.00    0.00
     8388608      36.40  230.45  115.23
";

#[test]
fn torch_timings_are_read_per_collective_as_the_anchor_script_prints_them() {
    let points = plot::torch_points(TORCH).unwrap();
    assert_eq!(points.len(), 4);
    assert_eq!(points[1], (Collective::AllReduce, "torch".to_string(), 4096.0, 41.5, 0.1));
    assert_eq!(points[3], (Collective::AllGather, "torch".to_string(), 8388608.0, 36.4, 115.23));
    assert!(plot::torch_points("").unwrap().is_empty(), "nothing to read");
    let mut points = Vec::new();
    let err = plot::add_torch(&mut points, std::path::Path::new("/nonexistent/torch.txt")).unwrap_err();
    assert!(err.starts_with("--torch /nonexistent/torch.txt: "), "{err}");
}

#[test]
fn torch_timings_that_cannot_be_read_are_refused_naming_the_line() {
    for (text, want) in [
        ("8 46.2 0.0 0.0\n", "line 1: a row before any `# torch` line"),
        ("# torch 2.11 all_sum float\n8 1 1 1\n", "line 1: unknown collective \"all_sum\""),
        ("# torch 2.11 broadcast float\n8 46.2 0.0\n", "line 2: expected size, time(us), algbw and busbw"),
        ("# torch 2.11 broadcast float\n8 nan 0 0\n", "line 2: expected"),
        ("# torch 2.11 broadcast float\n8 -1 0 0\n", "line 2: expected"),
        ("# torch 2.11 broadcast float\n8 1 2 3 4\n", "line 2: expected"),
    ] {
        let err = plot::torch_points(text).expect_err(text);
        assert!(err.contains(want), "{text:?}: {err}");
    }
}

#[test]
fn the_chart_draws_every_series_torch_among_them() {
    let mut points: Vec<plot::Point> = plot::torch_points(TORCH).unwrap();
    for (bytes, us) in [(8.0, 15.3), (4096.0, 14.8)] {
        points.push((Collective::AllReduce, "cohort auto".into(), bytes, us, bytes / us / 1e3));
        points.push((Collective::AllReduce, "raw NCCL".into(), bytes, us + 1.0, bytes / (us + 1.0) / 1e3));
    }
    let dir = std::env::temp_dir().join(format!("cohort-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("chart.svg");
    plot::plot(&path, &[Collective::AllReduce, Collective::AllGather], &points).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    for label in ["torch", "cohort auto", "raw NCCL", "all_reduce time (us)", "all_gather busbw (GB/s)"] {
        assert!(svg.contains(label), "the chart names {label:?}");
    }
}
