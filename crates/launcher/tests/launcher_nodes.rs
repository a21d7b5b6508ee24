//! End-to-end tests of `cohort run` across several launchers on loopback.

mod common;

use std::process::{Child, Command};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn node(node_rank: u32, port: u16, secret: &str, extra: &[&str], steps: &[&str]) -> Command {
    let port = port.to_string();
    let node_rank = node_rank.to_string();
    let mut opts = vec![
        "-n",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        &node_rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
    ];
    opts.extend_from_slice(extra);
    let mut cmd = cohort_run(&opts, steps);
    cmd.env("COHORT_JOB_SECRET", secret);
    cmd
}

fn start(mut cmd: Command) -> Child {
    cmd.spawn().expect("start cohort")
}

#[test]
fn two_launchers_form_one_eight_rank_job() {
    let port = free_port();
    // Node 1 first: its launcher must wait for node 0's store.
    let n1 = start(node(1, port, "shared-secret", &[], &["env", "store"]));
    std::thread::sleep(Duration::from_millis(200));
    let n0 = start(node(0, port, "shared-secret", &[], &["env", "store"]));
    let out0 = wait_output(n0, LIMIT);
    let out1 = wait_output(n1, LIMIT);
    let (stdout0, stderr0) = texts(&out0);
    let (stdout1, stderr1) = texts(&out1);
    assert_eq!(code(out0.status, &out0), 0, "{stderr0}");
    assert_eq!(code(out1.status, &out1), 0, "{stderr1}");
    let mut ranks = Vec::new();
    for (node_rank, stdout) in [(0, &stdout0), (1, &stdout1)] {
        let envs = env_lines(stdout);
        assert_eq!(envs.len(), 4, "{stdout}");
        for e in envs {
            let rank: usize = e["RANK"].parse().unwrap();
            let local: usize = e["LOCAL_RANK"].parse().unwrap();
            assert_eq!(rank, node_rank * 4 + local);
            assert_eq!(e["WORLD_SIZE"], "8");
            assert_eq!(e["LOCAL_WORLD_SIZE"], "4");
            assert_eq!(e["GROUP_RANK"], node_rank.to_string());
            assert_eq!(e["MASTER_PORT"], port.to_string());
            ranks.push(rank);
        }
        // Every rank passed one store barrier of all 8.
        assert_eq!(stdout.matches("store barrier of 8 passed").count(), 4, "{stdout}");
    }
    ranks.sort();
    assert_eq!(ranks, (0..8).collect::<Vec<_>>());
}

#[test]
fn a_failure_on_one_node_fails_every_node() {
    let port = free_port();
    // The ranks that do not fail sleep past LIMIT: both launchers end in
    // time only if they stop them.
    let steps = ["store", "exit-if-rank", "6", "7", "sleep", "600"];
    let n0 = start(node(0, port, "s3cret", &[], &steps));
    let n1 = start(node(1, port, "s3cret", &[], &steps));
    let out0 = wait_output(n0, LIMIT);
    let out1 = wait_output(n1, LIMIT);
    for out in [&out0, &out1] {
        let (_, stderr) = texts(out);
        assert_eq!(code(out.status, out), 7, "the failing rank's own exit code on every node: {stderr}");
        assert!(stderr.contains("rank 6 failed first"), "{stderr}");
        assert!(stderr.contains("exited with code 7"), "{stderr}");
        assert!(stderr.contains("on node 1"), "{stderr}");
    }
}

#[test]
fn wrong_secret_is_refused() {
    let port = free_port();
    let mut n0 = start(node(0, port, "right-secret", &["--timeout", "30"], &["env"]));
    let out1 = output_within(node(1, port, "wrong-secret", &[], &["env"]), LIMIT);
    let (stdout1, stderr1) = texts(&out1);
    assert_eq!(code(out1.status, &out1), 1, "{stderr1}");
    assert!(stderr1.contains("refused this client"), "{stderr1}");
    assert!(stderr1.contains("COHORT_JOB_SECRET"), "{stderr1}");
    assert!(stdout1.is_empty());
    // Node 0 logged the refusal with the peer's address; stop it (no rank
    // runs yet, so it exits at once).
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(n0.id() as libc::pid_t, libc::SIGTERM) };
    let status = n0.wait().unwrap();
    let mut stderr0 = String::new();
    std::io::Read::read_to_string(n0.stderr.as_mut().unwrap(), &mut stderr0).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr0}");
    assert!(stderr0.contains("does not hold the job secret"), "{stderr0}");
    assert!(stderr0.contains("peer=127.0.0.1:"), "{stderr0}");
}

#[test]
fn multi_node_needs_an_exported_secret() {
    let mut cmd =
        cohort_run(&["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29999"], &["env"]);
    cmd.env_remove("COHORT_JOB_SECRET");
    let out = output_within(cmd, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1);
    assert!(stderr.contains("export COHORT_JOB_SECRET"), "{stderr}");
}
