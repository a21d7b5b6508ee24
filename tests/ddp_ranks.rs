//! DistributedDataParallel across processes, one CPU device each, under the
//! `cohort` launcher: replicas stay bit-identical after several steps, and a
//! rank that registers a parameter of another shape gets an error naming
//! the rank and the parameter on every rank (not a hang), and so does a
//! rank that splits parameters across buckets when the others do not.
//!
//! The launcher runs this test executable again as each rank, with
//! `DDP_RANKS_ROLE` set, running only the ignored `rank_body`.

use std::path::PathBuf;
use std::process::Command;

use cohort::ddp::{compute_clients, DdpOptions, DistributedDataParallel, SplitParameters};
use cohort::nn::{Mlp, MlpConfig, Sgd, TeacherData};
use cohort::prelude::*;

const ROLE: &str = "DDP_RANKS_ROLE";

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps").to_path_buf()
}

/// The launcher, built once per test process (both tests use it).
fn launcher() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_launcher).clone()
}

fn build_launcher() -> PathBuf {
    let release = profile_dir().ends_with("release");
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "cohort-launch", "--bin", "cohort"])
        .args(release.then_some("--release"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo");
    assert!(status.success(), "cargo build of the launcher failed");
    profile_dir().join("cohort")
}

/// Runs `rank_body` as `ranks` ranks with `role`; returns the output.
fn launch(ranks: usize, role: &str) -> (bool, String) {
    let out = Command::new(launcher())
        .args(["run", "-n", &ranks.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["rank_body", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env_remove("COHORT_JOB_SECRET")
        .output()
        .expect("run cohort");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// One rank: `same` trains 6 steps and checks every rank's parameters are
/// bit-identical; `mismatch` makes rank 1's second layer wider, `count`
/// leaves out rank 1's last parameter; both expect the start-up check's
/// error.
#[test]
#[ignore = "one rank of the jobs the other tests launch (run by them with --ignored)"]
fn rank_body() {
    let role = std::env::var(ROLE).expect("rank_body runs as a rank of a job the other tests launch");
    let world = World::join(rank_clients("cpu", Some(1)).unwrap()).unwrap();
    let clients = compute_clients(&world);
    let config = MlpConfig { width: 32, depth: 3 };
    let rows = 4;
    if role == "options" {
        let params = Mlp::new(&clients, config, rows, 1).unwrap().parameters();
        let split = if world.rank() == 1 { SplitParameters::All } else { SplitParameters::Off };
        let options = DdpOptions { split_parameters: split, ..DdpOptions::default() };
        let err = DistributedDataParallel::new(&world, &params, options).err().expect("refused");
        println!("refused: {err}");
        return;
    }
    if role == "mismatch" || role == "count" {
        let mut params = Mlp::new(&clients, config, rows, 1).unwrap().parameters();
        if world.rank() == 1 && role == "mismatch" {
            let wide = Mlp::new(&clients, MlpConfig { width: 48, depth: 3 }, rows, 1).unwrap().parameters();
            params[2] = wide[2].clone();
        }
        if world.rank() == 1 && role == "count" {
            params.pop();
        }
        let err = DistributedDataParallel::new(&world, &params, DdpOptions::default()).err().expect("refused");
        println!("refused: {err}");
        return;
    }
    let n = world.members();
    let data = TeacherData::new(&clients[0], &clients, world.first_member(), n, config, 3, rows * n, 2).unwrap();
    let mut model = Mlp::new(&clients, config, rows, 1).unwrap();
    let params = model.parameters();
    let options = DdpOptions { bucket_cap_bytes: 4096, first_bucket_bytes: 512, ..DdpOptions::default() };
    let mut ddp = DistributedDataParallel::new(&world, &params, options).unwrap();
    let sgd = Sgd::new(&params, 0.01, 0.9).unwrap();
    for step in 0..6 {
        model.forward(&data.inputs[step % 2]).unwrap();
        model.backward(&data.targets[step % 2], step, &mut ddp).unwrap();
        ddp.finish().unwrap();
        sgd.step(&params, &ddp).unwrap();
        ddp.zero_grad().unwrap();
    }
    let mine: Vec<f32> = params.iter().flat_map(|p| p.replicas[0].to_vec().unwrap()).collect();
    let all = world.zeros::<f32>(n * mine.len()).unwrap();
    world.all_gather(&world.replicate(&mine).unwrap(), &all).unwrap();
    let all: Vec<u32> = all[0].to_vec().unwrap().into_iter().map(f32::to_bits).collect();
    let first = &all[..mine.len()];
    assert!(all.chunks(mine.len()).all(|c| c == first), "rank {}: replicas differ across ranks", world.rank());
    assert!(mine.iter().all(|v| v.is_finite()));
    println!("bit-identical across {n} ranks");
}

#[test]
fn replicas_stay_bit_identical_across_three_processes() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (ok, out) = launch(3, "same");
    assert!(ok, "{out}");
    assert_eq!(out.matches("bit-identical across 3 ranks").count(), 3, "{out}");
}

#[test]
fn a_rank_with_another_shape_gets_an_error_naming_it_and_the_parameter() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (ok, out) = launch(2, "mismatch");
    assert!(ok, "{out}");
    let refusals: Vec<&str> = out.lines().filter(|l| l.contains("refused:")).collect();
    assert_eq!(refusals.len(), 2, "every rank is told:\n{out}");
    for line in refusals {
        assert!(line.contains("rank 1") && line.contains("layers.1.weight") && line.contains("[48, 48]"), "{line}");
    }
}

#[test]
fn a_rank_with_fewer_parameters_gets_an_error_naming_it() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (ok, out) = launch(3, "count");
    assert!(ok, "{out}");
    let refusals: Vec<&str> = out.lines().filter(|l| l.contains("refused:")).collect();
    assert_eq!(refusals.len(), 3, "every rank is told:\n{out}");
    for line in refusals {
        assert!(
            line.contains("rank 1") && line.contains("registers 5 parameters") && line.contains("rank 0 registers 6"),
            "{line}"
        );
    }
}

#[test]
fn a_rank_with_other_bucket_options_gets_an_error_naming_it_and_the_option() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (ok, out) = launch(2, "options");
    assert!(ok, "{out}");
    let refusals: Vec<&str> = out.lines().filter(|l| l.contains("refused:")).collect();
    assert_eq!(refusals.len(), 2, "every rank is told:\n{out}");
    for line in refusals {
        assert!(line.contains("rank 1") && line.contains("sets split_parameters to"), "{line}");
    }
}
