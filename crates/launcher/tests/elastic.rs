//! Elastic jobs (`cohort run --nnodes MIN:MAX`) of launchers on loopback:
//! the job goes on without a launcher that died, restarts after a rank
//! failed, takes in a node that came late at the next restart, and stops
//! with a clear error when fewer than MIN nodes are left, with no rank left
//! running in every case.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(90);

fn node(node_rank: u32, port: u16, nnodes: &str, extra: &[&str], steps: &[&str]) -> Command {
    let (port, node_rank) = (port.to_string(), node_rank.to_string());
    let mut opts = vec!["-n", "2", "--nnodes", nnodes, "--node-rank", &node_rank];
    opts.extend_from_slice(&["--master-addr", "127.0.0.1", "--master-port", &port, "--heartbeat-timeout", "0"]);
    opts.extend_from_slice(extra);
    let mut cmd = cohort_run(&opts, steps);
    // A secret of this job's own: tests running at once cannot join each
    // other's stores should their ports meet.
    cmd.env("COHORT_JOB_SECRET", format!("elastic-secret-{port}"));
    cmd
}

fn start(mut cmd: Command) -> Child {
    cmd.spawn().expect("start cohort")
}

/// The env lines of restart `restart`.
fn attempt_env(stdout: &str, restart: u32) -> Vec<std::collections::HashMap<String, String>> {
    env_lines(stdout).into_iter().filter(|e| e["TORCHELASTIC_RESTART_COUNT"] == restart.to_string()).collect()
}

fn kill(child: &Child, sig: i32) {
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

fn no_rank_left(dir: &Path) {
    let left = wait_all_gone(&read_pids(dir), Duration::from_secs(5));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
}

#[test]
fn elastic_goes_on_without_a_launcher_that_died() {
    let dir = temp_dir("elastic-death");
    let port = free_port();
    let d = dir.to_str().unwrap();
    let steps = ["pid", d, "env", "store", "sleep-first-attempt", "120"];
    // A last call long enough for both launchers to be in attempt 0 on a
    // loaded machine (the survivor waits it out once more after the death).
    let extra = ["--max-restarts", "2", "--last-call", "5"];
    let n0 = start(node(0, port, "1:2", &extra, &steps));
    let n1 = start(node(1, port, "1:2", &extra, &steps));
    // Both nodes' ranks run attempt 0 (world of 4), then node 1's launcher dies.
    wait_pid_files(&dir, 4, LIMIT);
    kill(&n1, libc::SIGKILL);
    let out0 = wait_output(n0, LIMIT);
    let _ = wait_output(n1, LIMIT);
    let (stdout, stderr) = texts(&out0);
    assert_eq!(code(out0.status, &out0), 0, "{stderr}");
    assert!(stderr.contains("went away without a word"), "{stderr}");
    assert!(stderr.contains("attempt 1 runs on 1 node(s) (2 ranks)"), "{stderr}");
    let first = attempt_env(&stdout, 0);
    assert!(first.iter().all(|e| e["WORLD_SIZE"] == "4" && e["GROUP_WORLD_SIZE"] == "2"), "{stdout}");
    let second = attempt_env(&stdout, 1);
    assert_eq!(second.len(), 2, "{stdout}");
    for e in &second {
        assert_eq!(
            (e["WORLD_SIZE"].as_str(), e["GROUP_WORLD_SIZE"].as_str(), e["GROUP_RANK"].as_str()),
            ("2", "1", "0")
        );
        assert_eq!(e["COHORT_RESTART_COUNT"], "1");
        assert_eq!(e["ROLE_WORLD_SIZE"], "2");
    }
    let mut ranks: Vec<&str> = second.iter().map(|e| e["RANK"].as_str()).collect();
    ranks.sort();
    assert_eq!(ranks, ["0", "1"]);
    assert!(stdout.contains("store barrier of 2 passed"), "{stdout}");
    no_rank_left(&dir);
}

/// A node whose launcher was killed comes back: its replacement takes over
/// the dead launcher's registration (it once failed at once with "node rank
/// 1 is already taken", so a lost node could never return) and joins the
/// next attempt, which runs on both nodes again.
#[test]
fn elastic_replacement_of_a_killed_node_joins_the_next_attempt() {
    let dir = temp_dir("elastic-replace");
    let port = free_port();
    let d = dir.to_str().unwrap();
    let steps = ["pid", d, "env", "store", "sleep-first-attempt", "120"];
    // Attempt 1 closes as soon as both nodes are in; the last call only
    // gives the replacement time to come on a loaded machine.
    let extra = ["--max-restarts", "2", "--last-call", "60"];
    let n0 = start(node(0, port, "1:2", &extra, &steps));
    let n1 = start(node(1, port, "1:2", &extra, &steps));
    wait_pid_files(&dir, 4, LIMIT);
    kill(&n1, libc::SIGKILL);
    let _ = wait_output(n1, LIMIT);
    let replacement = start(node(1, port, "1:2", &extra, &steps));
    let out0 = wait_output(n0, LIMIT);
    let out1 = wait_output(replacement, LIMIT);
    let (stdout0, stderr0) = texts(&out0);
    let (stdout1, stderr1) = texts(&out1);
    assert_eq!(code(out1.status, &out1), 0, "the replacement: {stderr1}");
    assert_eq!(code(out0.status, &out0), 0, "{stderr0}");
    assert!(
        stderr1.contains("node 1's previous launcher (with -n 2 on host") && stderr1.contains("is gone"),
        "{stderr1}"
    );
    assert!(attempt_env(&stdout1, 0).is_empty(), "the replacement ran nothing in attempt 0: {stdout1}");
    for (stdout, group_rank) in [(&stdout0, "0"), (&stdout1, "1")] {
        let second = attempt_env(stdout, 1);
        assert_eq!(second.len(), 2, "{stdout}");
        for e in &second {
            let got = (e["WORLD_SIZE"].as_str(), e["GROUP_WORLD_SIZE"].as_str(), e["GROUP_RANK"].as_str());
            assert_eq!(got, ("4", "2", group_rank), "{stdout}");
        }
        assert!(stdout.contains("store barrier of 4 passed"), "{stdout}");
    }
    no_rank_left(&dir);
}

/// A node rank whose launcher is alive is not taken over: a second
/// launcher given it fails, saying so, and the job goes on.
#[test]
fn a_node_rank_whose_launcher_is_alive_is_refused_to_another() {
    let dir = temp_dir("elastic-taken");
    let port = free_port();
    let d = dir.to_str().unwrap();
    let steps = ["pid", d, "sleep", "120"];
    let n0 = start(node(0, port, "2", &[], &steps));
    let n1 = start(node(1, port, "2", &[], &steps));
    wait_pid_files(&dir, 4, LIMIT);
    let out = output_within(node(1, port, "2", &[], &steps), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("node rank 1 is already taken") && stderr.contains("still connected"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    // The job's own nodes were left alone.
    assert_eq!(read_pids(&dir).iter().filter(|&&p| alive(p)).count(), 4);
    kill(&n0, libc::SIGTERM);
    kill(&n1, libc::SIGTERM);
    let _ = (wait_output(n0, LIMIT), wait_output(n1, LIMIT));
    no_rank_left(&dir);
}

#[test]
fn elastic_restarts_every_node_after_a_rank_fails() {
    let dir = temp_dir("elastic-fail");
    let port = free_port();
    let d = dir.to_str().unwrap();
    let steps = ["pid", d, "env", "store", "fail-first-attempt", "3"];
    let extra = ["--max-restarts", "1", "--last-call", "30"];
    let n0 = start(node(0, port, "1:2", &extra, &steps));
    let n1 = start(node(1, port, "1:2", &extra, &steps));
    for out in [wait_output(n0, LIMIT), wait_output(n1, LIMIT)] {
        let (stdout, stderr) = texts(&out);
        assert_eq!(code(out.status, &out), 0, "{stderr}");
        assert!(stderr.contains("rank 3 failed first"), "{stderr}");
        let second = attempt_env(&stdout, 1);
        assert_eq!(second.len(), 2, "{stdout}");
        assert!(second.iter().all(|e| e["WORLD_SIZE"] == "4" && e["GROUP_WORLD_SIZE"] == "2"), "{stdout}");
    }
    no_rank_left(&dir);
}

#[test]
fn elastic_takes_in_a_late_node_at_the_next_restart() {
    let dir = temp_dir("elastic-late");
    let port = free_port();
    let go = dir.join("go");
    let (d, g) = (dir.to_str().unwrap(), go.to_str().unwrap());
    let steps = ["pid", d, "env", "wait-file", g, "fail-first-attempt", "0", "store"];
    let extra = ["--max-restarts", "1", "--last-call", "0.2"];
    let n0 = start(node(0, port, "1:2", &extra, &steps));
    // Node 0 starts alone (MIN is 1).
    wait_pid_files(&dir, 2, LIMIT);
    let n1 = start(node(1, port, "1:2", &extra, &steps));
    // Node 1 waits for the next attempt; then node 0's rank 0 fails.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&go, b"").unwrap();
    let out0 = wait_output(n0, LIMIT);
    let out1 = wait_output(n1, LIMIT);
    let (stdout0, stderr0) = texts(&out0);
    let (stdout1, stderr1) = texts(&out1);
    assert_eq!(code(out0.status, &out0), 0, "{stderr0}");
    assert_eq!(code(out1.status, &out1), 0, "{stderr1}");
    let first = attempt_env(&stdout0, 0);
    assert!(first.iter().all(|e| e["WORLD_SIZE"] == "2"), "node 0 started alone: {stdout0}");
    assert!(attempt_env(&stdout1, 0).is_empty(), "node 1 ran nothing in attempt 0: {stdout1}");
    for (stdout, group_rank) in [(&stdout0, "0"), (&stdout1, "1")] {
        let second = attempt_env(stdout, 1);
        assert_eq!(second.len(), 2, "{stdout}");
        for e in &second {
            assert_eq!((e["WORLD_SIZE"].as_str(), e["GROUP_RANK"].as_str()), ("4", group_rank), "{stdout}");
        }
        assert!(stdout.contains("store barrier of 4 passed"), "{stdout}");
    }
    no_rank_left(&dir);
}

#[test]
fn elastic_below_min_nodes_is_a_clear_error_with_nothing_left_running() {
    // Alone, with MIN 2: no rank starts.
    let port = free_port();
    let out = output_within(node(0, port, "2:3", &["--join-timeout", "1"], &["env"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("for at least 2 nodes (--nnodes 2:3)") && stderr.contains("only 1 joined"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");

    // Two nodes, MIN 2: once one dies, the other stops.
    let dir = temp_dir("elastic-min");
    let port = free_port();
    let d = dir.to_str().unwrap();
    let steps = ["pid", d, "env", "sleep", "120"];
    let extra = ["--max-restarts", "3", "--join-timeout", "1"];
    let n0 = start(node(0, port, "2:3", &extra, &steps));
    let n1 = start(node(1, port, "2:3", &extra, &steps));
    wait_pid_files(&dir, 4, LIMIT);
    kill(&n1, libc::SIGKILL);
    let out0 = wait_output(n0, LIMIT);
    let _ = wait_output(n1, LIMIT);
    let (_, stderr) = texts(&out0);
    assert_eq!(code(out0.status, &out0), 1, "{stderr}");
    assert!(stderr.contains("for at least 2 nodes") && stderr.contains("only 1 joined (node(s) 0)"), "{stderr}");
    no_rank_left(&dir);
}

/// The survivor's own ranks fail too (their peers died inside all-reduces)
/// at the moment the dead launcher's will fails the attempt: the survivor
/// must still restart (it once waited forever for a verdict it had
/// already seen).
#[test]
fn elastic_survivor_restarts_when_its_ranks_fail_with_the_dead_node() {
    const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
    let dir = temp_dir("elastic-collective");
    let port = free_port();
    // Attempt 0: all-reduce until a peer dies; attempt 1: the collective suite.
    let script = format!(
        "if [ \"$COHORT_RESTART_COUNT\" = 0 ]; then exec {SUITE} --pid-dir {d} loop; else exec {SUITE} suite; fi",
        d = dir.to_str().unwrap()
    );
    let launch = |n: u32| {
        let (port, n) = (port.to_string(), n.to_string());
        let mut c = Command::new(COHORT);
        c.args(["run", "-n", "2", "--nnodes", "1:2", "--node-rank", &n, "--max-restarts", "1", "--last-call", "5"]);
        c.args(["--master-addr", "127.0.0.1", "--master-port", &port, "--heartbeat-timeout", "0", "--no-python"]);
        c.args(["--", "sh", "-c", &script]);
        c.env("COHORT_JOB_SECRET", format!("elastic-secret-{port}"))
            .env("COHORT_TIMEOUT", "20")
            .env("OMP_NUM_THREADS", "1");
        for v in ["COHORT_LOG", "RUST_LOG", "COHORT_STORE_ADDR", "COHORT_TIMELINE"] {
            c.env_remove(v);
        }
        c.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        c.spawn().expect("start cohort")
    };
    let n0 = launch(0);
    let n1 = launch(1);
    wait_pid_files(&dir, 4, LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    kill(&n1, libc::SIGKILL);
    let out0 = wait_output(n0, LIMIT);
    let _ = wait_output(n1, LIMIT);
    let (stdout, stderr) = texts(&out0);
    assert_eq!(code(out0.status, &out0), 0, "{stderr}");
    assert!(stdout.contains("suite passed") && stdout.contains("2 ranks"), "{stdout}\n{stderr}");
    no_rank_left(&dir);
}

/// A node whose node 0 is not up says, every few seconds, that it waits
/// and for which store address (it once waited up to 900 s in silence),
/// and goes on once node 0 comes.
#[test]
fn elastic_node_waiting_for_node_0_says_what_it_waits_for() {
    use std::io::{BufRead, BufReader};
    let port = free_port();
    let mut n1 = start(node(1, port, "2:2", &[], &["env"]));
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = n1.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // The store listens on the master port + 1.
    let wanted = format!("node 1 is waiting for node 0's store at 127.0.0.1:{}", port + 1);
    let started = std::time::Instant::now();
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains(&wanted)) {
        // Within seconds (the notice comes every 5 s), not after minutes.
        let left = Duration::from_secs(60).saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => {
                kill(&n1, libc::SIGKILL);
                panic!("no line saying what node 1 waits for within 60 s; it said: {seen:?}")
            }
        }
    }
    assert!(seen.iter().any(|l| l.contains("--master-port")), "{seen:?}");
    // Node 0 comes: both run.
    let out0 = output_within(node(0, port, "2:2", &[], &["env"]), LIMIT);
    let out1 = wait_output(n1, LIMIT);
    assert_eq!(code(out0.status, &out0), 0, "{}", texts(&out0).1);
    assert_eq!(code(out1.status, &out1), 0, "{:?}", seen);
    assert_eq!(env_lines(&texts(&out1).0).len(), 2, "node 1's two ranks ran");
    let reached = rx.iter().any(|l| l.contains(&format!("node 1 reached node 0's store at 127.0.0.1:{}", port + 1)));
    assert!(reached, "node 1 says when it reached the store");
}
