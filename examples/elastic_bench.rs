//! Elastic re-forming: two launchers on loopback (`cohort run --nnodes 1:2
//! --max-restarts 3`), four ranks each, every rank all-reducing 1 MiB in a
//! loop (`cohort-comm-suite loop`). Once every rank of the eight-rank job
//! has finished collectives, node 1's launcher is killed (SIGKILL) while
//! its ranks are inside all-reduces. Measures the time from the kill until
//! the survivor's four new ranks have each finished an all-reduce in the
//! new four-rank world (read with `cohort status --json`); goal ≤ 10 s. Then
//! stops the survivor and checks that no rank of either node is left.
//!
//! Needs the launcher's binaries built with the same profile:
//! `cargo build --release -p cohort-launch --bins && cargo run --release --example elastic_bench`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "elastic-bench-secret";

fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|p| p.parent()).expect("target/<profile>").join(name)
}

fn launcher(node: u32, port: u16, pid_dir: &Path) -> Child {
    Command::new(bin("cohort"))
        .args(["run", "-n", "4", "--nnodes", "1:2", "--node-rank", &node.to_string(), "--max-restarts", "3"])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port.to_string(), "--last-call", "0.5", "--"])
        .arg(bin("cohort-comm-suite"))
        .args(["--pid-dir", pid_dir.to_str().unwrap(), "loop"])
        .env("COHORT_JOB_SECRET", SECRET)
        .env("COHORT_TIMEOUT", "20")
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cohort run")
}

/// `cohort status --json` of the job, parsed.
fn status(addr: &str) -> Option<serde_json::Value> {
    let out = Command::new(bin("cohort"))
        .args(["status", "--json", "--store-addr", addr])
        .env("COHORT_JOB_SECRET", SECRET)
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// Whether the job has `world` ranks in `nodes` nodes, each past its first
/// collective.
fn training(v: &serde_json::Value, world: usize, nodes: usize) -> bool {
    v["world_size"] == world
        && v["nodes"] == nodes
        && v["ranks"]
            .as_array()
            .is_some_and(|r| r.len() == world && r.iter().all(|r| r["finished"].as_u64().is_some_and(|f| f >= 1)))
}

fn pids(dir: &Path) -> Vec<i32> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok()?.trim().parse().ok())
        .collect()
}

fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Kills the launchers it holds when dropped (a failed check must not leave
/// a job running).
struct Launchers(Vec<Child>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                // SAFETY: kill(2) on our own child; the launcher stops its ranks.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
                let _ = c.wait();
            }
        }
    }
}

fn main() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{}", port + 1);
    let dir = std::env::temp_dir().join(format!("elastic-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut job = Launchers(vec![launcher(0, port, &dir), launcher(1, port, &dir)]);
    let end = Instant::now() + Duration::from_secs(60);
    while !status(&addr).is_some_and(|v| training(&v, 8, 2)) {
        assert!(Instant::now() < end, "the 8-rank job never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    let before: Vec<i32> = pids(&dir);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(job.0[1].id() as libc::pid_t, libc::SIGKILL) };
    let killed = Instant::now();
    let _ = job.0[1].wait();
    let end = killed + Duration::from_secs(60);
    while !status(&addr).is_some_and(|v| training(&v, 4, 1)) {
        assert!(Instant::now() < end, "the survivor never trained again");
        std::thread::sleep(Duration::from_millis(20));
    }
    let reformed = killed.elapsed();
    drop(job);
    let mut all = before;
    all.extend(pids(&dir));
    all.sort_unstable();
    all.dedup();
    let stop_by = Instant::now() + Duration::from_secs(5);
    while all.iter().any(|&p| alive(p)) && Instant::now() < stop_by {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<i32> = all.iter().copied().filter(|&p| alive(p)).collect();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "elastic: 2 launchers x 4 ranks, node 1's launcher killed inside all-reduces; the survivor's 4 ranks \
         finished an all-reduce in the new world {:.2} s after the kill (goal <= 10 s: {}); ranks left running: {}",
        reformed.as_secs_f64(),
        if reformed <= Duration::from_secs(10) { "met" } else { "missed" },
        if left.is_empty() { "none".to_string() } else { format!("{left:?}") }
    );
}
