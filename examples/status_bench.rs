//! `cohort status` against a hung job: 64 ranks of `cohort-comm-suite`
//! (CPU devices) under `cohort run`, rank 5 stopped (SIGSTOP) after 20
//! all-reduces, the other 63 waiting in the 21st. Times the whole
//! `cohort status` command (start, connect, answer, print) over 10 runs
//! (goal: median ≤ 1 s), checks that it names rank 5, and, in the same
//! run, reads the same keys one `get` at a time as the baseline for the
//! one multi-get `cohort status` uses.
//!
//! Needs the launcher's binaries built with the same profile:
//! `cargo build --release -p cohort-launch --bins && cargo run --release --example status_bench`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_comm::published::{call_key, communicator_prefix, gone_key, progress_key};
use cohort_comm::store::StoreClient;

const RANKS: usize = 64;
const SECRET: &str = "status-bench-secret";

fn bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|p| p.parent()).expect("target/<profile>").join(name)
}

fn status(addr: &str) -> (Duration, String) {
    let start = Instant::now();
    let out = Command::new(bin("cohort"))
        .args(["status", "--store-addr", addr])
        .env("COHORT_JOB_SECRET", SECRET)
        .output()
        .expect("run cohort status");
    (start.elapsed(), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn stop(mut job: Child, pid_dir: &std::path::Path) {
    for entry in std::fs::read_dir(pid_dir).into_iter().flatten().flatten() {
        if let Some(pid) = std::fs::read_to_string(entry.path()).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2) has no memory-safety preconditions; the pids
            // are the ones our job's ranks wrote.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    }
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our
    // own child's (the launcher, which stops its ranks on SIGTERM).
    unsafe { libc::kill(job.id() as libc::pid_t, libc::SIGTERM) };
    let _ = job.wait();
}

fn main() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let pid_dir = std::env::temp_dir().join(format!("status-bench-{}", std::process::id()));
    std::fs::create_dir_all(&pid_dir).unwrap();
    let job = Command::new(bin("cohort"))
        .args(["run", "-n", &RANKS.to_string(), "--master-port", "0", "--store-port", &port.to_string()])
        .args(["--heartbeat-timeout", "0", "--timeout", "120", "--"])
        .arg(bin("cohort-comm-suite"))
        .args(["--pid-dir", pid_dir.to_str().unwrap(), "stop", "5"])
        .env("COHORT_JOB_SECRET", SECRET)
        .env("COHORT_CPU_DEVICES", RANKS.to_string())
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cohort run");
    // Wait until the job is hung on rank 5 (its heartbeat stale).
    let end = Instant::now() + Duration::from_secs(90);
    loop {
        let (_, text) = status(&addr);
        if text.contains(&format!("{} rank(s) wait in", RANKS - 1)) && text.contains("for 5: rank 5 (silent") {
            break;
        }
        if Instant::now() > end {
            stop(job, &pid_dir);
            panic!("the job never hung on rank 5; last status:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut times: Vec<Duration> = (0..10)
        .map(|_| {
            let (t, text) = status(&addr);
            assert!(text.contains("for 5: rank 5 (silent"), "status names rank 5:\n{text}");
            t
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];

    // Baseline: the same per-rank entries, one get each.
    let store = StoreClient::connect(addr.as_str(), SECRET, Duration::from_secs(10)).unwrap();
    let prefix = communicator_prefix(1);
    let keys: Vec<String> = (0..RANKS)
        .flat_map(|r| {
            [cohort_comm::job_heartbeat_key(r), progress_key(&prefix, r), call_key(&prefix, r), gone_key(&prefix, r)]
        })
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let t = Instant::now();
    for _ in 0..10 {
        for k in &refs {
            store.get(k).unwrap();
        }
    }
    let one_by_one = t.elapsed() / 10;
    let t = Instant::now();
    for _ in 0..10 {
        store.multi_get(&refs).unwrap();
    }
    let at_once = t.elapsed() / 10;
    stop(job, &pid_dir);
    let _ = std::fs::remove_dir_all(&pid_dir);
    println!(
        "cohort status against {RANKS} ranks hung in an all-reduce (rank 5 stopped): median {:.1} ms over 10 runs \
         (min {:.1}, max {:.1}); goal <= 1000 ms: {}",
        median.as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
        if median <= Duration::from_secs(1) { "met" } else { "missed" }
    );
    println!(
        "reading the {} per-rank entries: one get each {:.2} ms, one multi-get {:.2} ms: ratio {:.1}x",
        refs.len(),
        one_by_one.as_secs_f64() * 1e3,
        at_once.as_secs_f64() * 1e3,
        one_by_one.as_secs_f64() / at_once.as_secs_f64()
    );
}
