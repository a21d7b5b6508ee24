//! Groups across processes under `cohort run`: a 2×4 mesh of 4 ranks × 2
//! devices all-reduces, all-gathers and groups both along each dimension
//! (checked against the host by `cohort-group-suite`) on CPU devices and on
//! wgpu (lavapipe in CI); a desync inside a group fails the job naming the
//! group and its ranks, and `cohort trace` names them too.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-group-suite");
const LIMIT: Duration = Duration::from_secs(180);

/// `cohort run <opts> -- <the suite> <args>`.
fn suite_run(opts: &[&str], args: &[&str]) -> Command {
    cohort_run_program(SUITE, opts, args)
}

#[test]
fn a_two_by_four_mesh_of_four_ranks_of_two_cpu_devices_reduces_and_gathers_along_each_dimension() {
    let out = output_within(suite_run(&["-n", "4", "--master-port", "0"], &["--devices", "2"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    // 8 members × 2 dimensions × 4 results each.
    assert!(stdout.contains("group suite passed: 4 ranks × 2 devices (cpu), 2x4 mesh, 64 checks"), "{stdout}");
}

#[test]
fn a_two_by_four_mesh_of_four_ranks_of_two_wgpu_devices_reduces_and_gathers_along_each_dimension() {
    let mut c = suite_run(&["-n", "4", "--master-port", "0"], &["--backend", "wgpu", "--devices", "2"]);
    c.env("COHORT_WGPU_DEVICES", "8");
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("group suite passed: 4 ranks × 2 devices (wgpu), 2x4 mesh, 64 checks"), "{stdout}");
}

#[test]
fn a_desync_inside_a_group_names_the_group_and_cohort_trace_names_it_too() {
    let dir = std::env::temp_dir().join(format!("cohort-group-desync-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = suite_run(&["-n", "4", "--master-port", "0"], &["--devices", "1", "desync", "3"]);
    c.env("COHORT_TIMEOUT", "30").env("COHORT_TRACE_DIR", &dir);
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert_ne!(code(out.status, &out), 0, "{stderr}");
    // Caught by the group's fingerprints (not the 30 s timeout), naming the
    // group (split 0 of comm1, color 1) and its ranks by job rank.
    assert!(stderr.contains("collective mismatch in group comm1.s0c1 (ranks 1, 3)"), "{stderr}");
    assert!(stderr.contains("broadcast #1") && stderr.contains("all_reduce #1"), "{stderr}");
    assert!(!stderr.contains("timed out"), "{stderr}");
    let trace = Command::new(COHORT).arg("trace").arg(&dir).output().expect("run cohort trace");
    let report = String::from_utf8_lossy(&trace.stdout);
    assert!(
        report.contains("in group comm1.s0c1 (ranks 1, 3)"),
        "{report}\n{}",
        String::from_utf8_lossy(&trace.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
