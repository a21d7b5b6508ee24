//! The Communicator across processes: the collective suite under `cohort
//! run` (one node, two nodes on loopback) and under `mpirun` with no
//! launcher; a crashed rank, a mismatched collective and a rank that never
//! arrives all fail the job with a clear message and no process left.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
/// Generous: a job here takes seconds, but CI machines may be loaded; the
/// bound is there so that a hang fails the test instead of stalling it.
const LIMIT: Duration = Duration::from_secs(180);

/// `cohort run <opts> -- <the suite> <args>`.
fn suite_run(opts: &[&str], args: &[&str]) -> Command {
    cohort_run_program(SUITE, opts, args)
}

#[test]
fn four_ranks_pass_the_collective_suite() {
    let out = output_within(suite_run(&["-n", "4", "--master-port", "0"], &[]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("suite passed") && stdout.contains("4 ranks × 1 devices"), "{stdout}");
    assert!(stdout.contains("self,shm,shm,shm"), "ranks of one node talk through shared memory: {stdout}");
}

#[test]
fn four_ranks_reach_the_store_through_the_node_relay_unless_it_is_off() {
    // Each rank says how it reached the store: through the relay's socket
    // the launcher handed it in COHORT_STORE_FD, or directly.
    let out = output_within(suite_run(&["-n", "4", "--master-port", "0"], &[]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    // Three relay sockets (the communicator's connection, its heartbeat's
    // and NCCL's, on GPUs), all claimed by the rank: close-on-exec, so no
    // program the rank starts holds them.
    assert_eq!(stdout.matches("store: relay, 3 sockets, 3 close-on-exec\n").count(), 4, "{stdout}");
    // A rank started through a wrapper that stays its parent (a shell that
    // waits for it) still takes its relay sockets: the launcher that made
    // them is an ancestor.
    let wrapped = format!("\"{SUITE}\"; status=$?; exit $status");
    let out = output_within(cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", &wrapped]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("store: relay, 3 sockets, 3 close-on-exec\n").count(), 2, "{stdout}");
    let mut c = suite_run(&["-n", "4", "--master-port", "0"], &[]);
    c.env("COHORT_STORE_RELAY", "0");
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("store: direct\n").count(), 4, "{stdout}");
    assert!(stdout.contains("suite passed"), "{stdout}");
    // A stale COHORT_STORE_FD in the launcher's environment never reaches
    // a rank the launcher gives no relay: one rank alone connects directly.
    let mut c = suite_run(&["-n", "1", "--master-port", "0"], &[]);
    c.env("COHORT_STORE_FD", "0");
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("store: direct\n").count(), 1, "{stdout}");
}

#[test]
fn two_ranks_of_two_devices_pass_the_suite() {
    let out = output_within(suite_run(&["-n", "2", "--master-port", "0"], &["--devices", "2"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("2 ranks × 2 devices"), "{stdout}");
}

/// Every collective × element type × operator at 0 to 4099 elements, and
/// each with a 4 MiB buffer (on GPUs: `full` alone goes to 1 GiB).
#[test]
fn three_ranks_of_two_devices_pass_the_full_matrix() {
    let out =
        output_within(suite_run(&["-n", "3", "--master-port", "0"], &["--devices", "2", "full", "4194304"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("full suite passed") && stdout.contains("3 ranks × 2 devices"), "{stdout}");
}

#[test]
fn two_launchers_form_one_eight_rank_job_over_tcp_and_shm() {
    let port = free_port().to_string();
    let node = |rank: &str| {
        let mut c = suite_run(
            &["-n", "4", "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", &port],
            &["--large", "65536"],
        );
        c.env("COHORT_JOB_SECRET", "two-node-test-secret");
        // Node 0's ranks reach the store through its relay, node 1's
        // directly: one communicator of both.
        c.env("COHORT_STORE_RELAY", if rank == "0" { "1" } else { "0" });
        c.spawn().expect("start a launcher")
    };
    let (first, second) = (node("0"), node("1"));
    let (a, b) = (wait_output(first, LIMIT), wait_output(second, LIMIT));
    let (stdout, stderr) = texts(&a);
    assert_eq!(code(a.status, &a), 0, "{stdout}\n{stderr}");
    assert_eq!(code(b.status, &b), 0, "{:?}", texts(&b));
    assert_eq!(stdout.matches("store: relay, 3 sockets, 3 close-on-exec\n").count(), 4, "{stdout}");
    assert_eq!(texts(&b).0.matches("store: direct\n").count(), 4, "{:?}", texts(&b));
    assert!(stdout.contains("8 ranks × 1 devices"), "{stdout}");
    assert!(stdout.contains("self,shm,shm,shm,tcp,tcp,tcp,tcp"), "TCP between nodes, shm within: {stdout}");
}

#[test]
fn a_rank_that_crashes_before_its_first_link_to_another_node_fails_both_nodes() {
    // TCP links between nodes connect on first use: rank 6 (node 1) exits
    // right after set-up, so its links to node 0 never form. The ranks
    // waiting on them in the first all-reduce must not wait for the
    // timeout (10 min, past LIMIT): both launchers end, no rank left.
    let port = free_port().to_string();
    let dir = temp_dir("comm-crash-two-nodes");
    let d = dir.to_str().unwrap();
    let node = |rank: &str| {
        let mut c = suite_run(
            &["-n", "4", "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", &port],
            &["--pid-dir", d, "crash", "6"],
        );
        c.env("COHORT_JOB_SECRET", "two-node-crash-secret");
        c.spawn().expect("start a launcher")
    };
    let (first, second) = (node("0"), node("1"));
    let (a, b) = (wait_output(first, LIMIT), wait_output(second, LIMIT));
    let (_, stderr_a) = texts(&a);
    let (_, stderr_b) = texts(&b);
    assert_ne!(code(a.status, &a), 0, "node 0 must fail: {stderr_a}");
    assert_eq!(code(b.status, &b), 3, "node 1 ends with the crashed rank's code: {stderr_b}");
    assert!(stderr_b.contains("rank 6 failed first") && stderr_b.contains("exited with code 3"), "{stderr_b}");
    let pids = read_pids(&dir);
    assert_eq!(pids.len(), 8, "every rank wrote its pid");
    let left = wait_all_gone(&pids, Duration::from_secs(10));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mpirun_runs_the_suite_without_a_launcher() {
    require_mpirun();
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-n", "4", SUITE]);
    for v in ["COHORT_JOB_SECRET", "COHORT_STORE_ADDR", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c.env("MASTER_PORT", free_port().to_string());
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("suite passed") && stdout.contains("4 ranks"), "{stdout}");
}

#[test]
fn a_crashed_rank_fails_the_job_with_a_summary_and_leaves_no_process() {
    let dir = temp_dir("comm-crash");
    let d = dir.to_str().unwrap();
    // The survivors wait in a collective whose timeout (10 min) is past
    // LIMIT: the job ends in time only because the launcher stops them.
    let out = output_within(suite_run(&["-n", "4", "--master-port", "0"], &["--pid-dir", d, "crash", "2"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 3, "the crashed rank's own exit code: {stderr}");
    assert!(stderr.contains("rank 2 failed first") && stderr.contains("exited with code 3"), "{stderr}");
    assert!(stderr.contains("crashing on purpose"), "the summary shows its last lines: {stderr}");
    let pids = read_pids(&dir);
    assert_eq!(pids.len(), 4);
    let left = wait_all_gone(&pids, Duration::from_secs(10));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_mismatched_collective_is_an_error_naming_both_sides() {
    let mut c = suite_run(&["-n", "4", "--master-port", "0"], &["mismatch", "1"]);
    c.env("COHORT_TIMEOUT", "30");
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert_ne!(code(out.status, &out), 0, "{stderr}");
    // Caught by the fingerprints, not the 30 s timeout.
    assert!(stderr.contains("collective mismatch") && !stderr.contains("timed out"), "{stderr}");
    assert!(stderr.contains("broadcast #1") && stderr.contains("all_reduce #1"), "both sides named: {stderr}");
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_timeout() {
    let mut c = suite_run(&["-n", "4", "--master-port", "0"], &["skip", "3"]);
    c.env("COHORT_TIMEOUT", "2");
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert_ne!(code(out.status, &out), 0, "{stderr}");
    assert!(stderr.contains("all_reduce #1 (f32 × 1024, op sum) timed out after 2.0 s"), "{stderr}");
    assert!(stderr.contains("rank(s) 3 never arrived"), "{stderr}");
}
