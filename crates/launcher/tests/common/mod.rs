//! Helpers shared by the launcher's end-to-end tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// The `cohort` binary under test.
pub const COHORT: &str = env!("CARGO_BIN_EXE_cohort");
/// The test rank program.
pub const RANK: &str = env!("CARGO_BIN_EXE_cohort-test-rank");

/// `cohort run <opts> -- <program> <args>`, not yet started: output piped,
/// stdin closed, and none of the variables a developer's shell may carry
/// that would change the job (its secret, log filter, timeout, store).
pub fn cohort_run_program(program: &str, opts: &[&str], args: &[&str]) -> Command {
    let mut c = Command::new(COHORT);
    c.arg("run").args(opts).arg("--").arg(program).args(args);
    for v in ["COHORT_JOB_SECRET", "COHORT_LOG", "RUST_LOG", "COHORT_TIMEOUT", "COHORT_STORE_ADDR"] {
        c.env_remove(v);
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// `cohort run <opts> -- cohort-test-rank <steps>`, not yet started, with a
/// clean environment as far as the launcher is concerned.
pub fn cohort_run(opts: &[&str], steps: &[&str]) -> Command {
    let mut c = Command::new(COHORT);
    c.arg("run").args(opts).arg("--").arg(RANK).args(steps);
    c.env_remove("COHORT_JOB_SECRET").env_remove("COHORT_LOG").env_remove("RUST_LOG");
    // Set, so the launcher does not say it sets it (tests that check that
    // remove it).
    c.env("OMP_NUM_THREADS", "1");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Runs `cmd` to completion, killing it (and failing) after `limit`.
pub fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd.spawn().expect("start cohort");
    wait_output(child, limit)
}

/// Collects `child`'s output, killing it (and failing) after `limit`.
pub fn wait_output(child: Child, limit: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait for cohort"),
        Err(_) => {
            // SAFETY: kill(2) on the pid of our own child.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("cohort did not finish within {limit:?}");
        }
    }
}

/// A fresh, empty temporary folder for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-launch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The pids the ranks wrote with the `pid` step.
pub fn read_pids(dir: &Path) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "pid") {
            if let Ok(text) = std::fs::read_to_string(&path) {
                if let Ok(pid) = text.trim().parse() {
                    pids.push(pid);
                }
            }
        }
    }
    pids
}

/// Whether `pid` is a live process (a zombie counts as dead: it runs nothing
/// and only waits for a parent, which may be a container's init that never
/// reaps).
pub fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits up to `limit` for every pid to be gone; returns those still alive.
pub fn wait_all_gone(pids: &[i32], limit: Duration) -> Vec<i32> {
    let end = Instant::now() + limit;
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || Instant::now() >= end {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to `limit` until `dir` holds `n` pid files.
pub fn wait_pid_files(dir: &Path, n: usize, limit: Duration) -> Vec<i32> {
    let end = Instant::now() + limit;
    loop {
        let pids = read_pids(dir);
        if pids.len() >= n {
            return pids;
        }
        assert!(Instant::now() < end, "only {} of {n} ranks wrote their pid", pids.len());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port that was free a moment ago, for a launcher to serve its store on.
///
/// Taken below the kernel's ephemeral range (32768 and up on Linux): a port
/// the kernel hands out for `bind(0)` can be given, before the launcher binds
/// it, to one of the many outgoing connections the tests' ranks make, which
/// leaves a job with no store. Each call of a process takes the next
/// candidate from a start that differs between processes, so tests running
/// at once do not pick the same one.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let start = std::process::id().wrapping_mul(7919) ^ nanos;
    for _ in 0..SPAN {
        let port = (LOW + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(97)) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// Stdout and stderr as text.
pub fn texts(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The lines of `stdout` that print a rank's environment, parsed.
pub fn env_lines(stdout: &str) -> Vec<std::collections::HashMap<String, String>> {
    stdout
        .lines()
        .filter(|l| l.contains(" RANK=") || l.contains("]: RANK="))
        .map(|l| {
            let body = l.split_once("]: ").expect("prefixed line").1;
            body.split(' ').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
        })
        .collect()
}

/// The exit code, or panics with the output when there is none.
pub fn code(status: ExitStatus, out: &Output) -> i32 {
    status.code().unwrap_or_else(|| panic!("cohort was killed: {:?}", texts(out)))
}

/// Fails the test when `mpirun` cannot be started: the tests that use it are
/// meant to run where Open MPI is installed (scripts/test.sh installs it), so
/// a missing `mpirun` is a broken set-up, not a reason to pass.
pub fn require_mpirun() {
    match Command::new("mpirun").arg("--version").stdin(Stdio::null()).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "`mpirun --version` failed ({}): {}; install Open MPI (scripts/test.sh installs openmpi-bin)",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!(
            "cannot run mpirun ({e}): install Open MPI (scripts/test.sh installs openmpi-bin) and put it on PATH"
        ),
    }
}
