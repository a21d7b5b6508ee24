//! `cohort run` as a drop-in for torchrun, and what a newcomer meets first:
//! the environment torchrun gives, MASTER_PORT free for the program's own
//! store, torchrun's command lines as people type them (no `--` needed),
//! Python programs, exit codes, and no stray folders.

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
    require_python3();
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

/// Fails the test when `python3` cannot run: the tests that use it are
/// meant to run where it is installed (scripts/test.sh installs it), so a
/// missing one is a broken set-up, not a reason to pass.
fn require_python3() {
    match Command::new("python3").arg("--version").stdin(Stdio::null()).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("`python3 --version` failed ({}): install python3 (scripts/test.sh does)", out.status),
        Err(e) => panic!("cannot run python3 ({e}): install python3 (scripts/test.sh does) and put it on PATH"),
    }
}

/// `cohort run <line>`, exactly as typed (no `--` added), with a clean
/// environment as far as the launcher is concerned.
fn run_line(line: &[&str]) -> Command {
    let mut c = Command::new(COHORT);
    c.arg("run").args(line);
    for v in ["COHORT_JOB_SECRET", "COHORT_LOG", "RUST_LOG", "COHORT_TIMEOUT", "COHORT_STORE_ADDR", "COHORT_TRACE_DIR"]
    {
        c.env_remove(v);
    }
    c.env("OMP_NUM_THREADS", "1").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Runs `line` and returns its stdout, failing unless it exits with 0.
fn run_ok(line: &[&str]) -> String {
    let out = output_within(run_line(line), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "cohort run {}:\n{stdout}\n{stderr}", line.join(" "));
    stdout
}

/// Runs `line`, which must fail before any rank starts with `code`; returns
/// its stderr.
fn run_refused(line: &[&str], expected: i32) -> String {
    let out = output_within(run_line(line), LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), expected, "cohort run {}:\n{stdout}\n{stderr}", line.join(" "));
    assert!(!stderr.contains("panicked") && !stderr.contains("tip:"), "{stderr}");
    assert!(!stdout.contains("ARGV="), "no rank ran: {stdout}");
    stderr
}

/// What each rank printed with the test program's `argv` step (or a
/// script's `ARGV=` line), by rank, arguments joined by `|`.
fn argv_lines(stdout: &str) -> Vec<(usize, String)> {
    let mut lines: Vec<(usize, String)> = stdout
        .lines()
        .filter_map(|l| {
            let (prefix, argv) = l.split_once("]: ")?;
            let argv = argv.strip_prefix("ARGV=")?;
            Some((prefix.strip_prefix("[rank ")?.parse().ok()?, argv.to_string()))
        })
        .collect();
    lines.sort();
    lines
}

/// Checks the environment every rank of a one-node job of `n` ranks got,
/// and that each got `argv`; returns the environments by rank.
fn check_ranks(stdout: &str, n: usize, argv: &str) -> Vec<std::collections::HashMap<String, String>> {
    let mut envs = env_lines(stdout);
    envs.sort_by_key(|e| e["RANK"].parse::<usize>().unwrap());
    assert_eq!(envs.len(), n, "{stdout}");
    for (rank, e) in envs.iter().enumerate() {
        assert_eq!((e["RANK"].clone(), e["LOCAL_RANK"].clone()), (rank.to_string(), rank.to_string()), "{stdout}");
        assert_eq!((e["WORLD_SIZE"].as_str(), e["LOCAL_WORLD_SIZE"].as_str()), (&*n.to_string(), &*n.to_string()));
        assert_eq!((e["GROUP_RANK"].as_str(), e["GROUP_WORLD_SIZE"].as_str()), ("0", "1"));
        assert_eq!(e["MASTER_ADDR"], envs[0]["MASTER_ADDR"]);
        assert_eq!(e["MASTER_PORT"], envs[0]["MASTER_PORT"]);
        assert!(e["MASTER_PORT"].parse::<u16>().is_ok_and(|p| p > 0), "{stdout}");
    }
    let expected: Vec<(usize, String)> = (0..n).map(|r| (r, argv.to_string())).collect();
    assert_eq!(argv_lines(stdout), expected, "{stdout}");
    envs
}

#[test]
fn the_ddp_tutorials_standalone_line_runs_as_typed() {
    // PyTorch's DDP tutorial: torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10
    let stdout = run_ok(&["--standalone", "--nproc_per_node=2", RANK, "env", "argv", "50", "10"]);
    let envs = check_ranks(&stdout, 2, "50|10");
    assert_eq!(envs[0]["MASTER_ADDR"], "127.0.0.1");
    // A fresh run id in a UUID's form, as torchrun's --standalone makes.
    let id = &envs[0]["TORCHELASTIC_RUN_ID"];
    let groups: Vec<usize> = id.split('-').map(str::len).collect();
    assert_eq!(groups, [8, 4, 4, 4, 12], "{id}");
    assert!(id.chars().all(|c| c == '-' || c.is_ascii_hexdigit()) && id.as_bytes()[14] == b'4', "{id}");
    assert_eq!(envs[1]["TORCHELASTIC_RUN_ID"], *id);
    // Another run, another id; and its rendezvous options are ignored, as
    // by torchrun.
    let port = free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let stdout =
        run_ok(&["--standalone", "--rdzv_endpoint", &endpoint, "--rdzv-id=mine", "-n", "2", RANK, "env", "argv"]);
    let again = check_ranks(&stdout, 2, "");
    assert_ne!(again[0]["TORCHELASTIC_RUN_ID"], *id);
    assert_ne!(again[0]["TORCHELASTIC_RUN_ID"], "mine");
    assert_ne!(again[0]["COHORT_STORE_ADDR"], endpoint);
}

#[test]
fn the_c10d_rendezvous_line_puts_cohorts_store_at_its_endpoint() {
    let port = free_port();
    let endpoint = format!("127.0.0.1:{port}");
    let line = [
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv_id=123",
        "--rdzv_backend=c10d",
        &format!("--rdzv_endpoint={endpoint}"),
        RANK,
        "env",
        "store",
        "master-store",
        "argv",
        "--lr",
        "1",
        "-n",
        "3",
    ];
    let stdout = run_ok(&line);
    let envs = check_ranks(&stdout, 2, "--lr|1|-n|3");
    for e in &envs {
        assert_eq!(e["COHORT_STORE_ADDR"], endpoint, "cohort's store is where the rendezvous is");
        assert_eq!(e["TORCHELASTIC_RUN_ID"], "123");
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
        assert_ne!(e["MASTER_PORT"], port.to_string(), "the program's own store needs a port of its own");
    }
    assert_eq!(stdout.matches("store barrier of 2 passed").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("master store ok").count(), 2, "{stdout}");
    // An endpoint without a port is torchrun's 29400 (seen where it clashes
    // with another port given for the store: 29400 may be taken here).
    let err = run_refused(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1", "--store-port", "1", "x"], 1);
    assert!(err.contains("--rdzv-endpoint's port 29400 and --store-port 1"), "{err}");
}

#[test]
fn a_program_without_dashes_gets_its_own_arguments() {
    // Before, `cohort run -n 2 train.py 3 1` asked for `--`.
    let stdout = run_ok(&["-n", "2", RANK, "env", "argv", "3", "1"]);
    check_ranks(&stdout, 2, "3|1");
    // The program's own flags, cohort's spellings among them, are its own.
    let stdout = run_ok(&["-n", "2", RANK, "env", "argv", "--lr", "1", "-n", "3", "--", "--standalone"]);
    check_ranks(&stdout, 2, "--lr|1|-n|3|--|--standalone");
    // And `--` still separates.
    let stdout = run_ok(&["-n", "2", "--", RANK, "env", "argv", "x"]);
    check_ranks(&stdout, 2, "x");
}

/// A package `pkg` with a module `pkg.mod` that prints the rank's
/// environment and arguments, in a fresh folder.
fn python_package(name: &str) -> std::path::PathBuf {
    let dir = temp_dir(name);
    std::fs::create_dir(dir.join("pkg")).unwrap();
    std::fs::write(dir.join("pkg/__init__.py"), "").unwrap();
    std::fs::write(
        dir.join("pkg/mod.py"),
        "import os, sys\n\
         names = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE', \
         'MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RUN_ID']\n\
         print(' '.join(f'{n}={os.environ.get(n, \"<unset>\")}' for n in names), flush=True)\n\
         print('ARGV=' + '|'.join(sys.argv[1:]), flush=True)\n",
    )
    .unwrap();
    dir
}

#[test]
fn python_modules_and_scripts_run_as_under_torchrun() {
    require_python3();
    let dir = python_package("pymodule");
    for line in [
        &["--nproc-per-node", "2", "-m", "pkg.mod", "--epochs", "3", "-n", "1"][..],
        &["--nproc_per_node=2", "--module", "pkg.mod", "--", "--epochs", "3", "-n", "1"],
        // torchrun's -m is a flag: the module is the program, after options.
        &["-m", "--nproc_per_node", "2", "--max_restarts", "0", "pkg.mod", "--epochs", "3", "-n", "1"],
    ] {
        let mut c = run_line(line);
        c.current_dir(&dir);
        let out = output_within(c, LIMIT);
        let (stdout, stderr) = texts(&out);
        assert_eq!(code(out.status, &out), 0, "{line:?}: {stderr}");
        let envs = check_ranks(&stdout, 2, "--epochs|3|-n|1");
        assert_eq!(envs[0]["TORCHELASTIC_RUN_ID"], "none");
    }
    // A script, with torchrun's -r/-t spellings in the line.
    std::fs::copy(dir.join("pkg/mod.py"), dir.join("train.py")).unwrap();
    let mut c = run_line(&["--nproc_per_node", "2", "--redirects", "0", "-t", "0", "train.py", "50", "10"]);
    c.current_dir(&dir);
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    check_ranks(&stdout, 2, "50|10");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn no_python_runs_a_py_file_as_it_is_and_run_path_always_with_python() {
    let dir = temp_dir("nopython");
    let script = dir.join("train.py");
    std::fs::write(&script, "#!/bin/sh\necho \"ARGV=sh|$*\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = script.display().to_string();
    for flag in ["--no_python", "--no-python"] {
        let stdout = run_ok(&["-n", "2", flag, &script, "a", "b"]);
        assert_eq!(argv_lines(&stdout), [(0, "sh|a b".to_string()), (1, "sh|a b".to_string())], "{stdout}");
    }
    // --run_path: python3 -u whatever the name (a fake python3 says how it
    // was called), and it overrides --no-python, as under torchrun.
    let path = fake_python(&dir);
    let mut c = run_line(&["-n", "1", "--no-python", "--run_path", "/abs/train", "--lr", "1"]);
    c.env("PATH", &path);
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(stdout.contains("[rank 0]: python3 -u /abs/train --lr 1 RANK=0"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn rdzv_conf_keys_are_cohorts_rendezvous_settings() {
    let stdout = run_ok(&["-n", "2", "--rdzv_conf", "join_timeout=5", RANK, "env", "argv"]);
    check_ranks(&stdout, 2, "");
    run_ok(&["-n", "1", "--rdzv-conf=join_timeout=5,last_call_timeout=1,read_timeout=60,is_host=true", RANK, "argv"]);
    // join_timeout is --join-timeout: an elastic node 0 alone gives up on
    // its second node after it.
    let port = free_port().to_string();
    let mut c = run_line(&[
        "--nnodes=2:3",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        &format!("--master_port={port}"),
        "--rdzv_conf=join_timeout=1",
        RANK,
        "argv",
    ]);
    c.env("COHORT_JOB_SECRET", "s");
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stdout}\n{stderr}");
    assert!(stderr.contains("waited 1.0 s (--join-timeout) for at least 2 nodes"), "{stderr}");
    assert!(!stdout.contains("ARGV"), "{stdout}");
    let err = run_refused(&["--rdzv_conf", "join_timeout=5,retries=3", RANK, "argv"], 2);
    assert!(err.contains("'retries' is not a rendezvous setting cohort knows"), "{err}");
    let err = run_refused(&["--rdzv_conf", "join_timeout=5", "--join-timeout", "5", RANK, "argv"], 1);
    assert!(err.contains("--join-timeout and --rdzv-conf join_timeout say the same thing"), "{err}");
}

#[test]
fn redirects_and_tee_send_output_where_torchrun_would() {
    let dir = temp_dir("tee");
    let log = |name: &str| dir.join(name).display().to_string();
    let logged = |name: &str, rank: usize| {
        std::fs::read_to_string(dir.join(name).join(format!("attempt_0/rank_{rank}/stdout.log"))).unwrap_or_default()
    };
    // torchrun's --tee 3: files and console.
    let stdout = run_ok(&["-n", "2", "--log_dir", &log("tee"), "--tee", "3", RANK, "argv", "x"]);
    assert_eq!(argv_lines(&stdout).len(), 2, "{stdout}");
    assert!(logged("tee", 0).contains("ARGV=x") && logged("tee", 1).contains("ARGV=x"));
    // cohort's bare --tee still means the same.
    let stdout = run_ok(&["-n", "2", "--log-dir", &log("bare"), "--tee", RANK, "argv", "x"]);
    assert_eq!(argv_lines(&stdout).len(), 2, "{stdout}");
    assert!(logged("bare", 1).contains("ARGV=x"));
    // --redirects 3: files only; per rank, 0:3 silences rank 0 alone.
    let stdout = run_ok(&["-n", "2", "--log-dir", &log("redirect"), "-r", "3", RANK, "argv", "x"]);
    assert!(argv_lines(&stdout).is_empty() && logged("redirect", 0).contains("ARGV=x"), "{stdout}");
    let stdout = run_ok(&["-n", "2", "--log-dir", &log("rank0"), "--redirects=0:3", RANK, "argv", "x"]);
    assert_eq!(argv_lines(&stdout), [(1, "x".to_string())], "{stdout}");
    assert!(logged("rank0", 0).contains("ARGV=x"));
    // Nothing redirected: the console, and no files.
    let stdout = run_ok(&["-n", "2", "--log-dir", &log("none"), "-r", "0", RANK, "argv", "x"]);
    assert_eq!(argv_lines(&stdout).len(), 2, "{stdout}");
    assert!(!dir.join("none/attempt_0").exists());
    // Files need a folder; a rank that is not there is named.
    let err = run_refused(&["-n", "2", "--tee", "3", RANK, "argv"], 1);
    assert!(err.contains("--tee writes the ranks' output to files: add --log-dir DIR"), "{err}");
    let err = run_refused(&["-n", "2", "-r", "3", RANK, "argv"], 1);
    assert!(err.contains("--redirects writes the ranks' output to files"), "{err}");
    let err = run_refused(&["-n", "2", "--log-dir", &log("x"), "--tee", "0:3,5:3", RANK, "argv"], 1);
    assert!(err.contains("--tee names local rank 5, but this node runs 2 ranks"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn torchruns_other_options_are_taken_or_refused_saying_why() {
    // Accepted with no use here: cohort watches its ranks without polling
    // and starts each as a process of its own.
    let stdout = run_ok(&[
        "-n",
        "2",
        "--monitor_interval=5",
        "--start-method",
        "fork",
        "--role",
        "default",
        "--max_restarts=0",
        "--local-ranks-filter=1",
        RANK,
        "argv",
        "y",
    ]);
    assert_eq!(argv_lines(&stdout), [(1, "y".to_string())], "{stdout}");
    // --role names every rank's role, as torchrun's one-role jobs do.
    let stdout = run_ok(&["-n", "2", "--role=trainer", RANK, "env", "argv"]);
    for e in check_ranks(&stdout, 2, "") {
        assert_eq!((e["ROLE_NAME"].as_str(), e["ROLE_RANK"].as_str()), ("trainer", e["RANK"].as_str()), "{stdout}");
        assert_eq!(e["ROLE_WORLD_SIZE"], "2", "{stdout}");
    }
    // --local_addr is MASTER_ADDR on one node.
    let stdout = run_ok(&["-n", "2", "--local_addr", "127.0.0.2", RANK, "env", "master-store", "argv"]);
    let envs = check_ranks(&stdout, 2, "");
    assert_eq!(envs[0]["MASTER_ADDR"], "127.0.0.2");
    assert_eq!(stdout.matches("master store ok").count(), 2, "{stdout}");

    let refused = |line: &[&str], expected: i32, says: &str| {
        let err = run_refused(line, expected);
        assert!(err.contains(says), "cohort run {}: {err}", line.join(" "));
    };
    refused(&["--numa_binding=node", RANK], 2, "--numa_binding is torchrun's option that binds each worker");
    refused(&["--bogus", RANK], 2, "unknown option '--bogus'");
    refused(&["--rdzv_backend=etcd", RANK], 2, "torchrun's etcd rendezvous");
    refused(&["--nproc_per_node=xpu", RANK], 2, "no XPU backend");
    refused(&["--standalone", "--nnodes=2", RANK], 1, "--standalone runs a one-node job");
    let mut c = run_line(&["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:29400", RANK, "argv"]);
    c.env("COHORT_JOB_SECRET", "s");
    let out = output_within(c, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("--rdzv-backend c10d with --nnodes 2 needs --node-rank on every node"), "{stderr}");
}

#[test]
fn torchruns_multi_node_c10d_line_runs_with_a_node_rank() {
    // torchrun --nnodes=2 --nproc-per-node=2 --rdzv-id=100 --rdzv-backend=c10d
    //          --rdzv-endpoint=HOST:PORT elastic_ddp.py, plus --node_rank
    // (cohort does not number nodes as they arrive) and a MASTER_PORT free
    // on this busy machine.
    let (endpoint, master_port) = (format!("127.0.0.1:{}", free_port()), free_port().to_string());
    let node = |rank: &str| {
        let endpoint = format!("--rdzv-endpoint={endpoint}");
        let mut c = run_line(&[
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-id=100",
            "--rdzv-backend=c10d",
            &endpoint,
            "--node_rank",
            rank,
            "--master_port",
            &master_port,
            RANK,
            "env",
            "store",
            "argv",
            "--epochs",
            "2",
        ]);
        c.env("COHORT_JOB_SECRET", "shared");
        c.spawn().expect("start cohort")
    };
    // Node 1 first: it waits for node 0's store at the endpoint.
    let n1 = node("1");
    let n0 = node("0");
    let (out0, out1) = (wait_output(n0, LIMIT), wait_output(n1, LIMIT));
    let mut ranks = Vec::new();
    for (node_rank, out) in [(0, &out0), (1, &out1)] {
        let (stdout, stderr) = texts(out);
        assert_eq!(code(out.status, out), 0, "node {node_rank}: {stdout}\n{stderr}");
        assert_eq!(stdout.matches("store barrier of 4 passed").count(), 2, "{stdout}");
        assert_eq!(argv_lines(&stdout).len(), 2, "{stdout}");
        assert!(argv_lines(&stdout).iter().all(|(_, a)| a == "--epochs|2"), "{stdout}");
        for e in env_lines(&stdout) {
            assert_eq!((e["WORLD_SIZE"].as_str(), e["GROUP_RANK"].as_str()), ("4", &*node_rank.to_string()));
            assert_eq!((e["MASTER_ADDR"].as_str(), e["MASTER_PORT"].as_str()), ("127.0.0.1", master_port.as_str()));
            assert_eq!((e["COHORT_STORE_ADDR"].as_str(), e["TORCHELASTIC_RUN_ID"].as_str()), (&*endpoint, "100"));
            ranks.push(e["RANK"].parse::<usize>().unwrap());
        }
    }
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2, 3]);
}
