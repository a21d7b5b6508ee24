//! `cohort status` against a job of `cohort-comm-suite` ranks (CPU
//! devices) that hangs because one rank stopped itself (SIGSTOP) between
//! two all-reduces: it names that rank and the collective the others are
//! in, as text and as JSON; bad targets are clear errors.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
const SECRET: &str = "status-test-secret";

/// `cohort run -n 4` of ranks whose rank 2 stops itself after 20
/// all-reduces, its store on `port` under [`SECRET`].
fn hung_job(dir: &Path, port: u16) -> Child {
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "4", "--master-port", "0", "--store-port", &port.to_string()]);
    c.args(["--heartbeat-timeout", "0", "--timeout", "60"]);
    c.arg("--").arg(SUITE).args(["--pid-dir", dir.to_str().unwrap(), "stop", "2"]);
    for v in ["COHORT_LOG", "RUST_LOG", "COHORT_STORE_ADDR", "COHORT_TIMELINE"] {
        c.env_remove(v);
    }
    c.env("COHORT_JOB_SECRET", SECRET).env("COHORT_TIMEOUT", "60").env("OMP_NUM_THREADS", "1");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c.spawn().expect("start cohort run")
}

fn status(port: u16, extra: &[&str]) -> (bool, String, String) {
    let mut c = Command::new(COHORT);
    c.args(["status", "--store-addr", &format!("127.0.0.1:{port}")]).args(extra);
    c.env("COHORT_JOB_SECRET", SECRET).env_remove("COHORT_STORE_ADDR");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(30));
    let (stdout, stderr) = texts(&out);
    (out.status.success(), stdout, stderr)
}

/// Stops the job and its ranks (the stopped one included).
fn end(job: Child, dir: &Path) {
    let pids = read_pids(dir);
    for &p in &pids {
        // SAFETY: kill(2) on pids our job's ranks wrote; SIGCONT then SIGKILL.
        unsafe {
            libc::kill(p, libc::SIGCONT);
        }
    }
    // SAFETY: kill(2) on our own child, the launcher, which stops its ranks.
    unsafe { libc::kill(job.id() as libc::pid_t, libc::SIGTERM) };
    let _ = wait_output(job, Duration::from_secs(30));
    let left = wait_all_gone(&pids, Duration::from_secs(5));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
}

#[test]
fn status_names_the_stopped_rank_and_the_collective_the_others_wait_in() {
    let dir = temp_dir("status-stop");
    let port = free_port();
    let job = hung_job(&dir, port);
    // Wait until the others have been stuck for more than three heartbeats
    // (the stopped rank's heartbeat is then stale): poll the JSON.
    let end_by = Instant::now() + Duration::from_secs(40);
    let mut last = String::new();
    let found = loop {
        if Instant::now() > end_by {
            break None;
        }
        std::thread::sleep(Duration::from_millis(300));
        let (ok, stdout, stderr) = status(port, &["--json"]);
        if !ok {
            last = stderr;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&stdout).expect("--json prints JSON");
        last = stdout;
        if v["stuck_on"] == serde_json::json!([2]) && v["ranks"][2]["state"] == "silent" {
            break Some(v);
        }
    };
    let Some(v) = found else {
        end(job, &dir);
        panic!("status never named rank 2; last answer:\n{last}");
    };
    assert_eq!(v["world_size"], 4);
    assert_eq!(v["communicator"], "comm1");
    let seq = v["ranks"][0]["call"]["seq"].as_u64().expect("rank 0 is in a call");
    for r in [0, 1, 3] {
        let rank = &v["ranks"][r];
        assert_eq!(rank["state"], "in-collective", "rank {r}: {rank}");
        assert_eq!(rank["call"]["kind"], "all_reduce", "rank {r}: {rank}");
        assert_eq!(rank["call"]["bytes"], 1 << 20, "rank {r}: {rank}");
        assert_eq!(rank["call"]["seq"].as_u64(), Some(seq), "rank {r}: {rank}");
        assert_eq!(rank["waiting_for"], serde_json::json!([2]), "rank {r}: {rank}");
        assert!(rank["heartbeat_age_s"].as_f64().unwrap() < 3.0, "rank {r} still beats: {rank}");
    }
    assert!(v["ranks"][2]["issued"].as_u64().unwrap() < seq, "rank 2 is behind: {}", v["ranks"][2]);
    // The text says the same.
    let (ok, text, stderr) = status(port, &[]);
    assert!(ok, "{stderr}");
    assert!(text.contains(&format!("3 rank(s) wait in #{seq} for 2: rank 2 (silent")), "{text}");
    assert!(text.contains(&format!("#{seq} all_reduce 1048576 B in comm1")), "{text}");
    end(job, &dir);
}

#[test]
fn status_without_a_store_or_with_a_wrong_secret_is_a_clear_error() {
    let mut c = Command::new(COHORT);
    c.arg("status").env_remove("COHORT_STORE_ADDR").env_remove("COHORT_JOB_SECRET");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(30));
    let (_, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no store address") && stderr.contains("COHORT_STORE_ADDR"), "{stderr}");

    // A store that holds another secret refuses.
    let server = cohort_comm::store::StoreServer::bind("127.0.0.1:0", "the-real-secret").unwrap();
    let (ok, _, stderr) = status(server.local_addr().port(), &[]);
    assert!(!ok);
    assert!(stderr.contains("cannot reach the job's store") && stderr.contains("secret"), "{stderr}");

    // An empty store: no job there yet, said plainly.
    let empty = cohort_comm::store::StoreServer::bind("127.0.0.1:0", SECRET).unwrap();
    let (ok, text, stderr) = status(empty.local_addr().port(), &[]);
    assert!(ok, "{stderr}");
    assert!(text.contains("0 ranks") && text.contains("not formed yet"), "{text}");
}
