//! What the ranks of a job leave behind and what the launcher tolerates: a
//! rank that is only slow (it still heartbeats) is not stopped, and
//! COHORT_TIMELINE gives each rank a Chrome trace of its collectives.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");

fn suite_run(opts: &[&str], args: &[&str]) -> Command {
    let mut c = Command::new(COHORT);
    c.arg("run").args(["--master-port", "0"]).args(opts).arg("--").arg(SUITE).args(args);
    for v in ["COHORT_JOB_SECRET", "COHORT_LOG", "RUST_LOG", "COHORT_STORE_ADDR", "COHORT_TIMELINE"] {
        c.env_remove(v);
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

#[test]
fn a_slow_rank_that_heartbeats_is_not_stopped() {
    let dir = temp_dir("slow");
    let trace = dir.join("trace");
    let mut c = suite_run(
        &["-n", "2", "--heartbeat-timeout", "1", "--trace-dir", trace.to_str().unwrap()],
        &["slow", "1", "3"],
    );
    c.env("COHORT_TIMEOUT", "20");
    let start = Instant::now();
    let out = output_within(c, Duration::from_secs(60));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(start.elapsed() >= Duration::from_secs(3), "rank 1 slept 3 s: {:?}", start.elapsed());
    assert!(!stderr.contains("no heartbeat"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn cohort_timeline_writes_a_chrome_trace_per_rank() {
    let dir = temp_dir("timeline");
    let mut c = suite_run(&["-n", "2"], &["slow", "0", "0"]);
    c.env("COHORT_TIMELINE", dir.join("timeline.json"));
    let out = output_within(c, Duration::from_secs(60));
    assert_eq!(code(out.status, &out), 0, "{:?}", texts(&out));
    for rank in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("timeline.rank{rank}.json"))).unwrap();
        let strict = format!("{}]", text.trim_end().trim_end_matches(','));
        let events: Vec<serde_json::Value> = serde_json::from_str(&strict).unwrap();
        let names: Vec<&str> = events.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["all_reduce", "barrier"], "rank {rank}: {text}");
        assert!(events.iter().all(|e| e["ph"] == "X" && e["pid"] == rank && e["cat"] == "collective"), "{text}");
        assert_eq!(events[0]["args"]["count"], 1024);
        assert_eq!(events[0]["args"]["ok"], true);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_trace_folder_that_cannot_be_made_is_named_in_the_summary() {
    // The trace folder's path runs through a file: no rank can write its
    // flight recorder. Before: no recorder section and no word about it.
    let dir = temp_dir("trace-unusable");
    std::fs::write(dir.join("file"), b"").unwrap();
    let trace = dir.join("file/trace");
    let mut c = suite_run(&["-n", "2", "--trace-dir", trace.to_str().unwrap()], &["kill9", "1"]);
    c.env("COHORT_TIMEOUT", "3");
    let out = output_within(c, Duration::from_secs(60));
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 128 + 9, "{stderr}");
    let said = format!("flight recorder: none in {}: {} is not a folder", trace.display(), dir.join("file").display());
    assert!(stderr.contains(&said) && stderr.contains("choose another --trace-dir"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_trace_folder_whose_name_is_not_utf8_is_refused_before_any_rank_starts() {
    // Before: the ranks were given the name with U+FFFD in place of the
    // byte, wrote their recorders there, and the launcher, looking in the
    // folder it was given, found none: no recorder section, no blame.
    use std::os::unix::ffi::OsStrExt;
    let dir = temp_dir("trace-not-utf8");
    let trace = dir.join(std::ffi::OsStr::from_bytes(b"trace\xff"));
    // suite_run's line, with the name (not UTF-8) for --trace-dir.
    let line = suite_run(&["-n", "2", "--trace-dir", "PLACEHOLDER"], &["leave", "1"]);
    let mut c = Command::new(COHORT);
    for arg in line.get_args() {
        c.arg(if arg == "PLACEHOLDER" { trace.as_os_str() } else { arg });
    }
    for (k, v) in line.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c.env("COHORT_TIMEOUT", "5").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(60));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("cannot use the trace folder (--trace-dir)"), "{stderr}");
    assert!(stderr.contains("its name is not UTF-8 text"), "{stderr}");
    assert!(!stdout.contains("[rank") && !stderr.contains("[rank"), "no rank started: {stdout}{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
