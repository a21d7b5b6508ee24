//! End-to-end tests of `cohort run` on one node: environment, output,
//! failures, signals, restarts and options.

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn ranks_get_torchrun_environment() {
    let out = output_within(cohort_run(&["-n", "4", "--master-port", "0", "--timeout", "30"], &["env"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    let mut envs = env_lines(&stdout);
    envs.sort_by_key(|e| e["RANK"].parse::<usize>().unwrap());
    assert_eq!(envs.len(), 4, "{stdout}");
    let port = envs[0]["MASTER_PORT"].clone();
    assert_ne!(port, "0", "the real port must be exported, not 0");
    for (i, e) in envs.iter().enumerate() {
        assert_eq!(e["RANK"], i.to_string());
        assert_eq!(e["LOCAL_RANK"], i.to_string());
        assert_eq!(e["WORLD_SIZE"], "4");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(e["GROUP_RANK"], "0");
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(e["MASTER_PORT"], port);
        assert!(e["COHORT_STORE_ADDR"].starts_with("127.0.0.1:"), "{}", e["COHORT_STORE_ADDR"]);
        assert_ne!(e["COHORT_STORE_ADDR"], format!("127.0.0.1:{port}"), "MASTER_PORT is the program's");
        assert_eq!(e["COHORT_RESTART_COUNT"], "0");
        assert_eq!(e["COHORT_TIMEOUT"], "30");
        assert_eq!(e["SECRET_LEN"], "64", "a generated secret reaches the ranks");
    }
    // The line of rank i carries rank i's prefix.
    for line in stdout.lines() {
        let (prefix, body) = line.split_once(": ").unwrap();
        let rank = body.split_once("RANK=").unwrap().1.split(' ').next().unwrap();
        assert_eq!(prefix, format!("[rank {rank}]"));
    }
}

#[test]
fn ranks_reach_the_store_and_pass_a_barrier() {
    let out = output_within(cohort_run(&["-n", "4", "--master-port", "0"], &["store"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert_eq!(stdout.matches("store barrier of 4 passed").count(), 4, "{stdout}");
}

#[test]
fn output_is_prefixed_per_stream() {
    let out = output_within(
        cohort_run(&["-n", "2", "--master-port", "0"], &["say", "hello out", "warn", "hello err"]),
        LIMIT,
    );
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    for r in 0..2 {
        assert!(stdout.contains(&format!("[rank {r}]: hello out\n")), "{stdout}");
        assert!(stderr.contains(&format!("[rank {r}]: hello err\n")), "{stderr}");
    }
    assert!(!stdout.contains("hello err") && !stderr.contains("hello out"));
}

#[test]
fn failing_rank_fails_the_job_with_a_summary_and_leaves_no_process() {
    let dir = temp_dir("fail");
    let d = dir.to_str().unwrap();
    let out = output_within(
        cohort_run(
            &["-n", "4", "--master-port", "0"],
            &["pid", d, "store", "say", "about to fail", "exit-if-rank", "2", "3", "sleep", "600"],
        ),
        LIMIT,
    );
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 3, "the failing rank's own exit code: {stderr}");
    // The others were stopped (their 600 s sleep is past LIMIT, which would
    // kill the launcher and fail the test).
    assert!(stderr.contains("rank 2 failed first"), "{stderr}");
    assert!(stderr.contains("exited with code 3"), "{stderr}");
    assert!(stderr.contains("[rank 2]: about to fail"), "the summary shows its last lines: {stderr}");
    let pids = read_pids(&dir);
    assert_eq!(pids.len(), 4);
    let left = wait_all_gone(&pids, Duration::from_secs(10));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn rank_killed_by_signal_is_named() {
    let out = output_within(
        cohort_run(&["-n", "2", "--master-port", "0"], &["signal-if-rank", "1", "9", "sleep", "60"]),
        LIMIT,
    );
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 128 + 9, "{stderr}");
    assert!(stderr.contains("rank 1 failed first"), "{stderr}");
    assert!(stderr.contains("killed by signal SIGKILL (9)"), "{stderr}");
}

#[test]
fn sigkill_of_the_launcher_leaves_no_rank() {
    let dir = temp_dir("sigkill");
    let d = dir.to_str().unwrap();
    let child = cohort_run(&["-n", "3", "--master-port", "0"], &["pid", d, "sleep", "60"]).spawn().unwrap();
    let pids = wait_pid_files(&dir, 3, Duration::from_secs(20));
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    let out = wait_output(child, LIMIT);
    assert!(out.status.code().is_none(), "the launcher was killed");
    let left = wait_all_gone(&pids, Duration::from_secs(5));
    assert!(left.is_empty(), "ranks outlived the launcher: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sigint_is_forwarded_and_stops_the_job() {
    let dir = temp_dir("sigint");
    let d = dir.to_str().unwrap();
    let child = cohort_run(&["-n", "2", "--master-port", "0"], &["pid", d, "sleep", "600"]).spawn().unwrap();
    let pids = wait_pid_files(&dir, 2, Duration::from_secs(20));
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    // Ends within LIMIT only if the ranks' 600 s sleeps were stopped.
    let out = wait_output(child, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 128 + libc::SIGINT, "{stderr}");
    assert!(stderr.contains("got SIGINT"), "{stderr}");
    assert!(wait_all_gone(&pids, Duration::from_secs(10)).is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = output_within(cohort_run(&["-n", "2", "--master-port", &port], &["env"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains(&format!("port {port}")), "{stderr}");
    assert!(stderr.contains("already in use"), "{stderr}");
    assert!(stderr.contains("--master-port") && stderr.contains("or 0"), "{stderr}");
    assert!(stdout.is_empty(), "no rank may start: {stdout}");
}

#[test]
fn max_restarts_restarts_the_group_once() {
    let out = output_within(
        cohort_run(
            &["-n", "2", "--master-port", "0", "--max-restarts", "1"],
            &["env", "fail-first-attempt", "1", "store"],
        ),
        LIMIT,
    );
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(stderr.contains("rank 1 failed first"), "{stderr}");
    assert!(stderr.contains("restarting the whole group (restart 1 of 1)"), "{stderr}");
    let envs = env_lines(&stdout);
    let second: Vec<_> = envs.iter().filter(|e| e["COHORT_RESTART_COUNT"] == "1").collect();
    assert_eq!(second.len(), 2, "both ranks ran again: {stdout}");
    assert_eq!(stdout.matches("store barrier of 2 passed").count(), 2, "{stdout}");

    // Without restarts the same job fails.
    let out = output_within(cohort_run(&["-n", "2", "--master-port", "0"], &["fail-first-attempt", "1"]), LIMIT);
    assert_eq!(code(out.status, &out), 1);
}

#[test]
fn restarts_run_out() {
    let out = output_within(
        cohort_run(&["-n", "2", "--master-port", "0", "--max-restarts", "2"], &["exit-if-rank", "0", "5"]),
        LIMIT,
    );
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 5, "{stderr}");
    assert_eq!(stderr.matches("restarting the whole group").count(), 2, "{stderr}");
    assert!(stderr.contains("all 2 restarts used"), "{stderr}");
}

#[test]
fn timeout_stops_the_job() {
    // The ranks sleep past LIMIT: only --timeout ends the job in time.
    let out = output_within(cohort_run(&["-n", "2", "--master-port", "0", "--timeout", "1"], &["sleep", "600"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 124, "{stderr}");
    assert!(stderr.contains("ran past --timeout 1 s"), "{stderr}");
    assert!(stderr.contains("ranks 0, 1 were still running"), "{stderr}");
}

#[test]
fn log_dir_tee_and_filter() {
    let dir = temp_dir("logs");
    let d = dir.to_str().unwrap();
    let steps = ["say", "to out", "warn", "to err"];
    let out = output_within(cohort_run(&["-n", "2", "--master-port", "0", "--log-dir", d], &steps), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(!stdout.contains("to out") && !stderr.contains("to err"), "files only without --tee");
    for r in 0..2 {
        let rank_dir = dir.join("attempt_0").join(format!("rank_{r}"));
        assert_eq!(std::fs::read_to_string(rank_dir.join("stdout.log")).unwrap(), "to out\n");
        assert_eq!(std::fs::read_to_string(rank_dir.join("stderr.log")).unwrap(), "to err\n");
    }
    let out = output_within(cohort_run(&["-n", "2", "--master-port", "0", "--log-dir", d, "--tee"], &steps), LIMIT);
    let (stdout, _) = texts(&out);
    assert!(stdout.contains("[rank 0]: to out") && stdout.contains("[rank 1]: to out"));

    let out = output_within(cohort_run(&["-n", "3", "--master-port", "0", "--local-ranks-filter", "1"], &steps), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(stdout, "[rank 1]: to out\n");
    assert_eq!(stderr, "[rank 1]: to err\n");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn nproc_cpu_and_gpu() {
    let mut cmd = cohort_run(&["-n", "cpu", "--master-port", "0"], &["env"]);
    cmd.env("COHORT_CPU_DEVICES", "3");
    let out = output_within(cmd, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert_eq!(env_lines(&stdout).len(), 3);

    // No nvidia-smi on the PATH and no CUDA_VISIBLE_DEVICES: no GPUs.
    let empty = temp_dir("nopath");
    let mut cmd = cohort_run(&["-n", "gpu", "--master-port", "0"], &["env"]);
    cmd.env("PATH", &empty).env_remove("CUDA_VISIBLE_DEVICES");
    let out = output_within(cmd, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1);
    assert!(stderr.contains("no GPUs found"), "{stderr}");
    let _ = std::fs::remove_dir_all(empty);
}

#[test]
fn missing_program_is_reported() {
    let mut cmd = std::process::Command::new(COHORT);
    cmd.args(["run", "-n", "2", "--master-port", "0", "--", "/no/such/program"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = output_within(cmd, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1);
    assert!(stderr.contains("cannot start") && stderr.contains("/no/such/program"), "{stderr}");
}

#[test]
fn a_ranks_final_stderr_line_is_in_the_summary_every_time() {
    // A burst of stdout, then the error on stderr, then exit 1. Two threads
    // read the two pipes; with one merged tail, the burst's lines that came
    // in after the error pushed it out of the summary (9 runs of 20).
    let script = "seq 1 1000; echo 'the final error' >&2; exit 1";
    for run in 0..20 {
        let cmd = cohort_run_program("sh", &["-n", "1", "--master-port", "0"], &["-c", script]);
        let out = output_within(cmd, LIMIT);
        let (_, stderr) = texts(&out);
        assert_eq!(code(out.status, &out), 1, "{stderr}");
        let summary = &stderr[stderr.find("cohort: job failed").expect(&stderr)..];
        let error = "last line of rank 0's stderr:\n    [rank 0]: the final error";
        assert!(summary.contains(error), "run {run}: {summary}");
        let burst = "last 20 lines of rank 0's stdout:\n    [rank 0]: 981\n";
        assert!(summary.contains(burst) && summary.contains("[rank 0]: 1000"), "run {run}: {summary}");
    }
}
