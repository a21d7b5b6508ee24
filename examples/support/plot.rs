//! The benches' `--plot FILE.svg`: per collective, time (µs) and busbw
//! (GB/s) against size on log axes, one line per series (a path, raw
//! NCCL, torch.distributed). Included by the examples (`#[path]`), not an
//! example itself; `tests/bench_plot.rs` checks it.

use cohort::comm::op::Collective;

/// One plotted point: collective, series, bytes (nccl-tests' size), µs,
/// busbw in GB/s.
pub type Point = (Collective, String, f64, f64, f64);

/// torch.distributed's timings as `scripts/anchors/torch_collectives.py`
/// prints them (rank 0's output: a `# torch <version> <collective> ...`
/// line before each collective's rows of `size time(us) algbw busbw`), as
/// points of the series `torch`. Other comment lines and blank lines are
/// skipped; a row before any collective's line, a row that is not four
/// numbers, or a collective the benches do not know is an error naming
/// its line.
pub fn torch_points(text: &str) -> Result<Vec<Point>, String> {
    let mut points = Vec::new();
    let mut current = None;
    for (at, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if let Some(header) = line.strip_prefix("# torch ") {
            let name = header.split_whitespace().nth(1).unwrap_or("");
            current = Some(
                Collective::parse(name).ok_or_else(|| format!("line {at}: unknown collective {name:?} in {line:?}"))?,
            );
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let coll = current.ok_or_else(|| format!("line {at}: a row before any `# torch` line: {line:?}"))?;
        let values: Vec<f64> = line
            .split_whitespace()
            .map(|v| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0))
            .collect::<Option<_>>()
            .filter(|v: &Vec<f64>| v.len() == 4)
            .ok_or_else(|| format!("line {at}: expected size, time(us), algbw and busbw, got {line:?}"))?;
        points.push((coll, "torch".to_string(), values[0], values[1], values[3]));
    }
    Ok(points)
}

/// Adds the torch.distributed timings saved in `file` (see
/// [`torch_points`]) to `points`; returns how many. Errors name the file.
pub fn add_torch(points: &mut Vec<Point>, file: &std::path::Path) -> Result<usize, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("--torch {}: {e}", file.display()))?;
    let torch = torch_points(&text).map_err(|e| format!("--torch {}: {e}", file.display()))?;
    let added = torch.len();
    points.extend(torch);
    Ok(added)
}

/// Draws, per collective, time (µs) and busbw (GB/s) against size on log
/// axes, one line per series.
pub fn plot(
    path: &std::path::Path,
    collectives: &[Collective],
    points: &[Point],
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let rows = collectives.len().max(1);
    let root = SVGBackend::new(path, (1200, 420 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((rows, 2));
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (row, &coll) in collectives.iter().enumerate() {
        let mine: Vec<&Point> = points.iter().filter(|p| p.0 == coll && p.3 > 0.0).collect();
        if mine.is_empty() {
            continue;
        }
        let mut series: Vec<&str> = Vec::new();
        for p in &mine {
            if !series.contains(&p.1.as_str()) {
                series.push(&p.1);
            }
        }
        let range = |f: fn(&Point) -> f64| {
            let values = mine.iter().map(|p| f(p)).filter(|v| *v > 0.0);
            let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
            (lo / 1.5)..(hi * 1.5)
        };
        for (col, (title, value)) in
            [("time (us)", (|p: &Point| p.3) as fn(&Point) -> f64), ("busbw (GB/s)", |p: &Point| p.4)]
                .into_iter()
                .enumerate()
        {
            let area = &panels[row * 2 + col];
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{} {title}", coll.name()), ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(55)
                .build_cartesian_2d(range(|p| p.2).log_scale(), range(value).log_scale())?;
            chart.configure_mesh().x_desc("bytes").y_desc(title).draw()?;
            for (i, name) in series.iter().enumerate() {
                let color = colors[i % colors.len()];
                let line: Vec<(f64, f64)> =
                    mine.iter().filter(|p| p.1 == *name && value(p) > 0.0).map(|p| (p.2, value(p))).collect();
                chart
                    .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                    .label(name.to_string())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
                chart.draw_series(line.into_iter().map(|xy| Circle::new(xy, 3, color.filled())))?;
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        }
    }
    root.present()?;
    Ok(())
}
