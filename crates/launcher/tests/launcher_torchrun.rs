//! `cohort run` as a drop-in for torchrun, and what a newcomer meets first:
//! the environment torchrun gives, MASTER_PORT free for the program's own
//! store, torchrun's flag spellings, Python programs, exit codes, the hint
//! for a missing `--`, and no stray folders.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn master_port_is_free_for_the_programs_own_store() {
    // Rank 0 listens on MASTER_ADDR:MASTER_PORT as PyTorch's TCPStore does;
    // before, that was cohort's store's port and the bind failed.
    let port = free_port().to_string();
    let out = output_within(cohort_run(&["-n", "3", "--master-port", &port], &["env", "master-store", "store"]), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("master store ok").count(), 3, "{stdout}");
    assert_eq!(stdout.matches("store barrier of 3 passed").count(), 3, "{stdout}");
    for e in env_lines(&stdout) {
        assert_eq!(e["MASTER_PORT"], port);
        assert_ne!(e["COHORT_STORE_ADDR"], format!("127.0.0.1:{port}"), "cohort's store has its own port");
    }
}

#[test]
fn ranks_get_the_rest_of_torchruns_environment() {
    let mut cmd = cohort_run(&["-n", "2", "--master-port", "0", "--max-restarts", "1", "--rdzv-id", "job7"], &["env"]);
    cmd.env_remove("OMP_NUM_THREADS");
    let out = output_within(cmd, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    let envs = env_lines(&stdout);
    assert_eq!(envs.len(), 2, "{stdout}");
    for e in &envs {
        assert_eq!(e["GROUP_RANK"], "0");
        assert_eq!(e["GROUP_WORLD_SIZE"], "1");
        assert_eq!(e["ROLE_RANK"], e["RANK"]);
        assert_eq!(e["ROLE_WORLD_SIZE"], "2");
        assert_eq!(e["ROLE_NAME"], "default");
        assert_eq!(e["TORCHELASTIC_RUN_ID"], "job7");
        assert_eq!(e["TORCHELASTIC_RESTART_COUNT"], "0");
        assert_eq!(e["TORCHELASTIC_MAX_RESTARTS"], "1");
        assert_eq!(e["OMP_NUM_THREADS"], "1");
    }
    assert_eq!(stderr.matches("OMP_NUM_THREADS is unset").count(), 1, "said once: {stderr}");

    // The user's own OMP_NUM_THREADS is kept, and nothing is said.
    let mut cmd = cohort_run(&["-n", "2", "--master-port", "0"], &["env"]);
    cmd.env("OMP_NUM_THREADS", "6");
    let out = output_within(cmd, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert!(env_lines(&stdout).iter().all(|e| e["OMP_NUM_THREADS"] == "6"), "{stdout}");
    assert!(!stderr.contains("OMP_NUM_THREADS"), "{stderr}");
    // One rank alone does not need it.
    let mut cmd = cohort_run(&["-n", "1", "--master-port", "0"], &["env"]);
    cmd.env_remove("OMP_NUM_THREADS");
    let out = output_within(cmd, LIMIT);
    let (stdout, _) = texts(&out);
    assert_eq!(env_lines(&stdout)[0]["OMP_NUM_THREADS"], "<unset>");
}

#[test]
fn torchrun_spellings_are_accepted() {
    let out = output_within(
        cohort_run(&["--nproc_per_node", "2", "--master_port", "0", "--node_rank", "0"], &["env"]),
        LIMIT,
    );
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert_eq!(env_lines(&stdout).len(), 2, "{stdout}");
}

/// A fake `python3` first on PATH that prints how it was called.
fn fake_python(dir: &std::path::Path) -> String {
    let py = dir.join("python3");
    std::fs::write(&py, "#!/bin/sh\necho \"python3 $* RANK=$RANK\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default())
}

#[test]
fn py_programs_and_modules_run_with_python3() {
    let dir = temp_dir("python");
    let path = fake_python(&dir);
    let run = |args: &[&str]| {
        let mut c = Command::new(COHORT);
        c.args(["run", "-n", "2", "--master-port", "0"]).args(args);
        c.env("PATH", &path).env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
        output_within(c, LIMIT)
    };
    let out = run(&["--", "train.py", "--lr", "1"]);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(stdout.contains("[rank 1]: python3 -u train.py --lr 1 RANK=1"), "{stdout}");
    let out = run(&["-m", "pkg.train", "--", "--lr", "1"]);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(stdout.contains("[rank 0]: python3 -u -m pkg.train --lr 1 RANK=0"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_launcher_exits_with_the_failing_ranks_own_code() {
    let out = output_within(
        cohort_run(&["-n", "3", "--master-port", "0"], &["exit-if-rank", "1", "42", "sleep", "30"]),
        LIMIT,
    );
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 42, "{stderr}");
    assert!(stderr.contains("rank 1 failed first: it exited with code 42"), "{stderr}");
    assert!(stderr.contains("the other ranks were stopped"), "{stderr}");
}

#[test]
fn one_rank_summary_does_not_mention_other_ranks() {
    let out =
        output_within(cohort_run(&["-n", "1", "--master-port", "0"], &["say", "bye", "exit-if-rank", "0", "5"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 5, "{stderr}");
    assert!(stderr.contains("rank 0 failed: it exited with code 5"), "{stderr}");
    assert!(!stderr.contains("other ranks"), "{stderr}");
}

#[test]
fn a_program_without_dashes_gets_a_hint() {
    let out = Command::new(COHORT).args(["run", "-n", "2", "./train", "--epochs", "3"]).output().unwrap();
    let (_, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("put `--` between cohort's options and the program"), "{stderr}");
}

#[test]
fn no_empty_trace_folder_is_left_and_its_default_can_be_set() {
    let cwd = temp_dir("cwd");
    let mut c = cohort_run(&["-n", "2", "--master-port", "0"], &["env"]);
    c.current_dir(&cwd).env_remove("COHORT_TRACE_DIR");
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(!cwd.join("cohort-trace").exists(), "a job that wrote no dump leaves no folder");
    let trace = cwd.join("elsewhere");
    let mut c = cohort_run(&["-n", "1", "--master-port", "0"], &["env"]);
    c.current_dir(&cwd).env("COHORT_TRACE_DIR", &trace);
    let out = output_within(c, LIMIT);
    let _ = stdout;
    let (stdout, _) = texts(&out);
    let envs = env_lines(&stdout);
    assert_eq!(envs[0]["COHORT_TRACE_DIR"], trace.display().to_string(), "{stdout}");
    assert!(!trace.exists() && !cwd.join("cohort-trace").exists());
    let _ = std::fs::remove_dir_all(cwd);
}

#[test]
fn nnodes_without_master_addr_is_refused_at_once() {
    let mut c = cohort_run(&["--nnodes", "2", "--node-rank", "0", "-n", "1"], &["env"]);
    c.env("COHORT_JOB_SECRET", "s");
    let out = output_within(c, Duration::from_secs(20));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("--nnodes 2 needs --master-addr"), "{stderr}");
    assert!(stdout.is_empty());
}

#[test]
fn huge_timeouts_are_errors_naming_the_flag() {
    for flag in ["--timeout", "--heartbeat-timeout"] {
        let out = output_within(cohort_run(&[flag, "1e30", "--master-port", "0"], &["env"]), LIMIT);
        let (stdout, stderr) = texts(&out);
        assert_eq!(out.status.code(), Some(2), "an error, not a panic: {stderr}");
        assert!(stderr.contains(flag) && stderr.contains("1e30") && !stderr.contains("panicked"), "{stderr}");
        assert!(stdout.is_empty());
    }
}

#[test]
fn nproc_far_beyond_the_process_limit_is_warned_up_front() {
    // Root is not held to `ulimit -u`, so the ranks may still start; the
    // warning comes first either way.
    let mut c = Command::new("bash");
    c.arg("-c").arg(format!("ulimit -S -u 40 && exec {COHORT} run -n 20 --master-port 0 -- true"));
    c.env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert!(stderr.starts_with("cohort: warning: -n 20 needs about 80 processes"), "{stderr}");
    assert!(stderr.contains("at most 40"), "{stderr}");
}

#[test]
fn a_failing_python_rank_is_named_with_its_last_lines() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3");
        return;
    }
    let dir = temp_dir("pyfail");
    let script = dir.join("train.py");
    std::fs::write(
        &script,
        "import os\nprint('step 1', flush=True)\nif os.environ['RANK'] == '1':\n    raise RuntimeError('rank 1 failing on purpose')\nimport time\ntime.sleep(30)\n",
    )
    .unwrap();
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "3", "--master-port", "0", "--"]).arg(&script);
    c.env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "python's exit code for an uncaught exception: {stderr}");
    assert!(stderr.contains("rank 1 failed first: it exited with code 1"), "{stderr}");
    assert!(stderr.contains("[rank 1]: RuntimeError: rank 1 failing on purpose"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
