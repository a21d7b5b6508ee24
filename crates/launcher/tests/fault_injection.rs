//! The fault-injection suite: every case runs ranks of `cohort-comm-suite`
//! (CPU devices) under `cohort run`, and must end within its limit with a
//! clear error, a non-zero exit and no process left behind. Timeouts are
//! short (2–3 s) so the suite stays quick on two cores.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
/// No case may take longer than this (the harness kills it and fails).
const LIMIT: Duration = Duration::from_secs(60);

/// `cohort run <opts> -- cohort-comm-suite --pid-dir <dir> <args>` with
/// COHORT_TIMEOUT=`timeout` and a trace folder under `dir`.
fn faulty(dir: &Path, timeout: &str, opts: &[&str], args: &[&str]) -> Command {
    let mut c = Command::new(COHORT);
    let trace = dir.join("trace");
    c.arg("run").args(["--master-port", "0", "--trace-dir", trace.to_str().unwrap()]).args(opts);
    c.arg("--").arg(SUITE).args(["--pid-dir", dir.to_str().unwrap()]).args(args);
    for v in ["COHORT_JOB_SECRET", "COHORT_LOG", "RUST_LOG", "COHORT_STORE_ADDR", "COHORT_TIMELINE"] {
        c.env_remove(v);
    }
    c.env("COHORT_TIMEOUT", timeout);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Runs the case; returns (exit code, stderr) after checking that every
/// rank that wrote its pid is gone. How the case ended is read from what it
/// says (which mechanism caught it), never from how long it took: the
/// machine may be loaded.
fn run_case(dir: &Path, cmd: Command) -> (i32, String) {
    let start = Instant::now();
    let out = output_within(cmd, LIMIT);
    let secs = start.elapsed().as_secs_f64();
    let (_, stderr) = texts(&out);
    let code = code(out.status, &out);
    let left = wait_all_gone(&read_pids(dir), Duration::from_secs(10));
    assert!(left.is_empty(), "ranks left alive: {left:?}\n{stderr}");
    eprintln!("case took {secs:.2} s, exit {code}:\n{stderr}");
    (code, stderr)
}

#[test]
fn fault_sigkill_inside_an_all_reduce() {
    let dir = temp_dir("fault-kill9");
    let (code, stderr) = run_case(&dir, faulty(&dir, "3", &["-n", "3"], &["kill9", "1"]));
    assert_eq!(code, 128 + 9, "{stderr}");
    assert!(stderr.contains("rank 1 failed first: it was killed by signal SIGKILL"), "{stderr}");
    assert!(stderr.contains("SIGKILL inside an all_reduce"), "its last lines: {stderr}");
    // The survivors wrote their flight recorders when asked (SIGUSR1).
    assert!(stderr.contains("first collective not finished everywhere: #"), "{stderr}");
    assert!(stderr.contains("ranks without a dump (ended before writing one?): 1"), "{stderr}");
    // `cohort trace` reads the same dumps.
    let out = Command::new(COHORT).arg("trace").arg(dir.join("trace")).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{:?}", texts(&out));
    assert!(texts(&out).0.contains("all_reduce(sum) 262144 × f32 in group comm1"), "{:?}", texts(&out));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_sigstop_is_caught_by_the_heartbeat_watchdog() {
    let dir = temp_dir("fault-stop");
    let cmd = faulty(&dir, "60", &["-n", "3", "--heartbeat-timeout", "2"], &["stop", "1"]);
    let (code, stderr) = run_case(&dir, cmd);
    assert_eq!(code, 1, "{stderr}");
    // The watchdog, not the 60 s collective timeout.
    assert!(stderr.contains("rank 1 stopped answering: no heartbeat for 2."), "{stderr}");
    assert!(!stderr.contains("timed out after"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_sigstop_without_the_watchdog_times_out_naming_the_rank() {
    let dir = temp_dir("fault-stop-timeout");
    let cmd = faulty(&dir, "2", &["-n", "3", "--heartbeat-timeout", "0"], &["stop", "1"]);
    let (code, stderr) = run_case(&dir, cmd);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("all_reduce #21 (f32 × 262144, op sum) timed out after 2.0 s"), "{stderr}");
    assert!(stderr.contains("rank(s) 1 never arrived (rank 1 last reported calling #"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_a_rank_that_exits_0_early_is_named_with_the_collective_the_others_waited_in() {
    // Rank 1 leaves with code 0 while ranks 0 and 2 wait for it in an
    // all-reduce; they fail. Before: "rank 0 failed first", rank 1 unnamed.
    let dir = temp_dir("fault-leave");
    let (code, stderr) = run_case(&dir, faulty(&dir, "3", &["-n", "3"], &["leave", "1"]));
    assert_eq!(code, 1, "{stderr}");
    let summary = &stderr[stderr.find("cohort: job failed").expect(&stderr)..];
    assert!(
        summary.starts_with("cohort: job failed: rank 1 left the job early: it exited with code 0 after"),
        "{summary}"
    );
    let waited = "while ranks 0, 2 waited for it in #1 all_reduce(sum) 1024 × f32 in group comm";
    assert!(summary.contains(waited), "{summary}");
    assert!(
        summary.contains("; then rank 0 failed: it exited with code 1")
            || summary.contains("; then rank 2 failed: it exited with code 1"),
        "{summary}"
    );
    assert!(!summary.contains("failed first"), "{summary}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_a_rank_that_exits_0_before_joining_is_named_when_the_job_is_stopped() {
    // Rank 1 exits 0 before it joins; rank 0 waits for it to join until
    // --timeout stops the job. Before: "ranks 0 were still running and
    // were stopped", rank 1 unnamed.
    let dir = temp_dir("fault-leave-before-join");
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "2", "--master-port", "0", "--timeout", "4", "--"]);
    c.args(["sh", "-c", "[ \"$RANK\" = 1 ] && exit 0; exec \"$0\" --pid-dir \"$1\" barrier", SUITE]);
    c.arg(&dir).env_remove("COHORT_JOB_SECRET").env("COHORT_TIMEOUT", "30");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let (code, stderr) = run_case(&dir, c);
    assert_eq!(code, 124, "{stderr}");
    let note = stderr.find("cohort: rank 1 exited with code 0 after").expect(&stderr);
    assert!(stderr[note..].contains("while other ranks still ran: if those waited for it"), "{stderr}");
    assert!(note < stderr.find("ran past --timeout").expect(&stderr), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_suite_sizes_are_read_as_written_or_refused_naming_them() {
    // `full 64MiB` panicked ("capacity overflow": the size read as usize::MAX).
    let dir = temp_dir("fault-sizes");
    let (refused, stderr) = run_case(&dir, faulty(&dir, "30", &["-n", "1"], &["full", "64XB"]));
    assert_eq!(refused, 2, "{stderr}");
    assert!(stderr.contains("error: full: size \"64XB\" is not a size: give bytes, or K, M, G"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = output_within(faulty(&dir, "30", &["-n", "2"], &["latency", "4KiB", "5"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(stdout.contains("all_reduce of 4096 bytes over 2 ranks"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A desync case: rank 1 differs in `what`; both sides are named.
fn desync(what: &str, mine: &str, theirs: &str) {
    let dir = temp_dir(&format!("fault-desync-{what}"));
    let (code, stderr) = run_case(&dir, faulty(&dir, "3", &["-n", "3"], &["desync", what, "1"]));
    assert_eq!(code, 1, "{stderr}");
    // Caught by the fingerprint, not the timeout.
    assert!(stderr.contains("collective mismatch"), "{stderr}");
    assert!(!stderr.contains("timed out"), "{stderr}");
    assert!(stderr.contains(mine) && stderr.contains(theirs), "both sides named: {stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_ranks_call_different_collectives() {
    desync("kind", "called all_gather #1 (f32 × 1024)", "called all_reduce #1 (f32 × 1024, op sum)");
}

#[test]
fn fault_ranks_pass_different_counts() {
    desync("count", "all_reduce #1 (f32 × 512, op sum)", "all_reduce #1 (f32 × 1024, op sum)");
}

#[test]
fn fault_ranks_pass_different_element_types() {
    desync("dtype", "all_reduce #1 (i32 × 1024, op sum)", "all_reduce #1 (f32 × 1024, op sum)");
}

#[test]
fn fault_ranks_pass_different_operators_and_roots() {
    desync("op", "all_reduce #1 (f32 × 1024, op max)", "all_reduce #1 (f32 × 1024, op sum)");
    desync("root", "reduce #1 (f32 × 1024, op sum, root 1)", "reduce #1 (f32 × 1024, op sum, root 0)");
}

#[test]
fn fault_the_store_is_killed() {
    let dir = temp_dir("fault-store");
    let mut store = Command::new(COHORT);
    store.args(["store", "--port", "0"]).env("COHORT_JOB_SECRET", "store-secret");
    store.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut store = store.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(store.stdout.take().unwrap()), &mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    let mut cmd = faulty(&dir, "3", &["-n", "3", "--store-addr", &addr], &["loop"]);
    cmd.env("COHORT_JOB_SECRET", "store-secret");
    let job = cmd.spawn().unwrap();
    wait_pid_files(&dir, 3, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
    store.kill().unwrap();
    store.wait().unwrap();
    let out = wait_output(job, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("lost the rendezvous store") && stderr.contains(&addr), "{stderr}");
    let left = wait_all_gone(&read_pids(&dir), Duration::from_secs(10));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_the_master_port_is_in_use() {
    let dir = temp_dir("fault-port");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "2", "--master-port", &port, "--", SUITE, "--pid-dir", dir.to_str().unwrap(), "barrier"]);
    c.env_remove("COHORT_JOB_SECRET").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let (code, stderr) = run_case(&dir, c);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains(&format!("port {port} on 127.0.0.1 is already in use")), "{stderr}");
    assert!(read_pids(&dir).is_empty(), "no rank starts");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_a_wrong_job_secret() {
    // One rank brings the wrong secret to a store it connects to itself
    // (no node relay): the store refuses it.
    let dir = temp_dir("fault-secret");
    let mut c = faulty(&dir, "3", &["-n", "3"], &["secret", "1"]);
    c.env("COHORT_STORE_RELAY", "0");
    let (code, stderr) = run_case(&dir, c);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("rank 1 failed first"), "{stderr}");
    assert!(stderr.contains("refused this client: its job secret is not the job's"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
    // Through the node relay a rank proves nothing: the socket the launcher
    // handed it is its credential, so the secret it holds is not consulted.
    let dir = temp_dir("fault-secret-relayed");
    let (code, stderr) = run_case(&dir, faulty(&dir, "3", &["-n", "3"], &["secret", "1"]));
    assert_eq!(code, 0, "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fault_a_malformed_environment() {
    let cases: [(&[&str], &str); 3] = [
        (&["--set-env", "RANK=7"], "rank 7 is not below the world size 2"),
        (&["--set-env", "RANK=one"], "RANK=\"one\" is not a whole number"),
        (&["--unset-env", "COHORT_STORE_ADDR", "--unset-env", "MASTER_ADDR"], "MASTER_ADDR is missing"),
    ];
    for (i, (set, message)) in cases.into_iter().enumerate() {
        let dir = temp_dir(&format!("fault-env-{i}"));
        let mut args = set.to_vec();
        args.push("barrier");
        let (code, stderr) = run_case(&dir, faulty(&dir, "3", &["-n", "2"], &args));
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("failed first") && stderr.contains(message), "{message}: {stderr}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn fault_a_rank_fails_during_set_up_and_no_shared_memory_is_left() {
    let dir = temp_dir("fault-shm");
    // Rank 1's rings are 1 GiB each and it may map only 256 MiB more than
    // it has: its mmap fails after the other ranks created their
    // shared-memory files, and they are stopped while they wait for rank 1's.
    let ring = ["--rank-env", "1", "COHORT_SHM_RING=1073741824", "--rank-mem-limit", "1", "256", "barrier"];
    let (code, stderr) = run_case(&dir, faulty(&dir, "60", &["-n", "3"], &ring));
    assert_eq!(code, 1, "{stderr}");
    let at = stderr.find("cannot create /dev/shm/cohort-").expect("rank 1 names its file")
        + "cannot create /dev/shm/cohort-".len();
    let job: String = stderr[at..].chars().take_while(|c| c.is_ascii_hexdigit()).collect();
    assert!(!job.is_empty(), "{stderr}");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&format!("cohort-{job}-")))
        .collect();
    assert!(left.is_empty(), "files of job {job} left in /dev/shm: {left:?}\n{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
