//! The collective suite under `mpirun` with the Communicator's MPI host
//! transport (ranks from `MPI_COMM_WORLD`, bytes over MPI messages, no
//! `MASTER_PORT` or secret). Built with the launcher's `mpi` feature:
//!
//! ```text
//! cargo test -p cohort-launch --features mpi --test communicator_mpi
//! ```

#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
const LIMIT: Duration = Duration::from_secs(120);

/// `mpirun -n <n> cohort-comm-suite <args>` forcing the MPI transport, with
/// no launcher or store settings inherited. Fails the test without `mpirun`.
fn mpirun(n: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    require_mpirun();
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-n", &n.to_string(), SUITE]).args(args);
    for v in ["COHORT_JOB_SECRET", "COHORT_STORE_ADDR", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c.env("COHORT_TRANSPORT", "mpi");
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    output_within(c, LIMIT)
}

#[test]
fn four_ranks_pass_the_suite_over_mpi() {
    let out = mpirun(4, &[], &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("suite passed") && stdout.contains("4 ranks × 1 devices"), "{stdout}");
    assert!(stdout.contains("links from rank 0: self,mpi,mpi,mpi"), "bytes travel over MPI: {stdout}");
}

#[test]
fn two_ranks_of_two_devices_pass_the_suite_over_mpi() {
    let out = mpirun(2, &["--devices", "2"], &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("2 ranks × 2 devices") && stdout.contains("self,mpi"), "{stdout}");
}

#[test]
fn a_rank_that_never_arrives_is_named_over_mpi_too() {
    let out = mpirun(3, &["skip", "2"], &[("COHORT_TIMEOUT", "2")]);
    let (_, stderr) = texts(&out);
    assert!(!out.status.success(), "{stderr}");
    // Ended by the 2 s collective timeout (not the harness's limit), naming rank 2.
    assert!(stderr.contains("timed out after 2.0 s") && stderr.contains("2 never arrived"), "{stderr}");
}
