//! The README's main job end to end, across the crates: `data_parallel` in
//! one process over four CPU devices, and one process per device under the
//! `cohort` launcher. Each run checks its own replicas and loss and exits
//! non-zero when a check fails; this test also reads its verdict lines.
//! And the per-process bench (`rank_bench`) under the launcher, whose
//! every row checks the collective's result on every rank.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `target/<profile>`: the folder this test's executable sits two levels
/// under (`target/<profile>/deps/main_job-…`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps").to_path_buf()
}

/// Builds `args` with the cargo that runs this test, in its profile (a
/// no-op when already built).
fn build(args: &[&str]) {
    let release = profile_dir().ends_with("release");
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q"])
        .args(release.then_some("--release"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo");
    assert!(status.success(), "cargo build {args:?} failed");
}

fn checked(out: Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for check in
        ["replicas bit-identical across 4 devices: yes", "loss matches the 1-device run", "loss went down: yes"]
    {
        assert!(stdout.contains(check), "{what}: no {check:?} in\n{stdout}");
    }
    stdout
}

#[test]
fn the_main_job_trains_in_one_process_and_under_the_launcher() {
    build(&["--example", "data_parallel"]);
    build(&["-p", "cohort-launch", "--bin", "cohort"]);
    let example = profile_dir().join("examples/data_parallel");
    let launcher = profile_dir().join("cohort");
    let args = ["--epochs", "2", "--steps", "8"];

    let one = Command::new(&example).args(args).env_remove("RANK").env("COHORT_CPU_DEVICES", "4").output().unwrap();
    let stdout = checked(one, "data_parallel in one process");
    assert!(stdout.contains("4 devices in one process"), "{stdout}");

    let ranks = Command::new(&launcher)
        .args(["run", "-n", "4", "--"])
        .arg(&example)
        .args(args)
        .env_remove("COHORT_JOB_SECRET")
        .output()
        .unwrap();
    let stdout = checked(ranks, "data_parallel under cohort run -n 4");
    assert!(stdout.contains("4 processes (1 per process"), "{stdout}");
}

#[test]
fn the_per_process_bench_runs_every_collective_under_the_launcher_and_checks_it() {
    build(&["--example", "rank_bench"]);
    build(&["-p", "cohort-launch", "--bin", "cohort"]);
    let bench = profile_dir().join("examples/rank_bench");
    let launcher = profile_dir().join("cohort");
    let run = |extra: &[&str]| {
        Command::new(&launcher)
            .args(["run", "-n", "3", "--"])
            .arg(&bench)
            .args(["--backend", "cpu", "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1"])
            .args(extra)
            .env_remove("COHORT_JOB_SECRET")
            .output()
            .unwrap()
    };
    let svg = std::env::temp_dir().join(format!("rank_bench-{}.svg", std::process::id()));
    let out = run(&["--collective", "all", "--plot", svg.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "rank_bench failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("# rank_bench: 3 ranks, one cpu device each"), "{stdout}");
    // Four sizes (8 B, 256 B, 8 KiB, 64 KiB) of each of the five
    // collectives, every one checked: its last column (wrong elements
    // across the ranks) is 0.
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0]:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|cols| cols.len() == 10 && cols[0].parse::<usize>().is_ok())
        .collect();
    for name in ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"] {
        assert_eq!(rows.iter().filter(|r| r[1] == name).count(), 4, "{name}: {stdout}");
    }
    assert!(rows.iter().all(|r| r[9] == "0" && r[2] == "host"), "{stdout}");
    // Rank 0's plot: one panel title per collective and measure.
    let drawn = std::fs::read_to_string(&svg).expect("rank 0 wrote its plot");
    std::fs::remove_file(&svg).unwrap();
    for title in ["all_reduce time (us)", "all_to_all busbw (GB/s)"] {
        assert!(drawn.contains(title), "the plot has no {title:?}");
    }
    // The same on a group split from the world: every row checked.
    let out = run(&["--collective", "all_gather", "--split"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success() && stdout.contains("3 ranks (a group split from the world)"), "{stdout}");
    let checked = stdout.lines().filter(|l| l.contains("all_gather") && l.trim_end().ends_with(" 0")).count();
    assert_eq!(checked, 4, "{stdout}");
    // Nonsense asked for: one clear line, a failed run, no hang.
    let out = run(&["--collective", "all_sum"]);
    assert!(!out.status.success());
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("--collective \"all_sum\": use all_reduce"), "{text}");
}
