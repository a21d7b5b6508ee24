//! The README's main job end to end, across the crates: `data_parallel` in
//! one process over four CPU devices, and one process per device under the
//! `cohort` launcher. Each run checks its own replicas and loss and exits
//! non-zero when a check fails; this test also reads its verdict lines.

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
