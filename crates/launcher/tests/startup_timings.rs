//! `cohort run --timings` prints the start-up phases of the job, from the
//! launcher's start to its first communicator being ready, in order.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");

#[test]
fn timings_print_every_phase_in_order() {
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "3", "--master-port", "0", "--timings", "--"]).arg(SUITE).arg("suite");
    for v in ["COHORT_JOB_SECRET", "COHORT_LOG", "RUST_LOG", "COHORT_STORE_ADDR", "COHORT_TIMELINE"] {
        c.env_remove(v);
    }
    c.env("OMP_NUM_THREADS", "1");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(120));
    let (_, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    let line = stderr.lines().find(|l| l.contains("start-up of attempt 0:")).expect("a timings line");
    let phases: Vec<(String, f64)> = line
        .split_once("attempt 0: ")
        .unwrap()
        .1
        .split(", ")
        .map(|p| {
            let (name, ms) = p.trim_end_matches(" ms").rsplit_once(' ').unwrap();
            (name.to_string(), ms.parse().unwrap())
        })
        .collect();
    let names: Vec<&str> = phases.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["launcher start", "store up", "spawning ranks", "all ranks joined", "links formed", "communicator ready"],
        "{line}"
    );
    assert_eq!(phases[0].1, 0.0);
    assert!(phases.windows(2).all(|w| w[0].1 <= w[1].1), "phases in order: {line}");
}
