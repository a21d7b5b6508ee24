//! `cohort status` against a job of `cohort-comm-suite` ranks (CPU
//! devices) that hangs because one rank stopped itself (SIGSTOP) between
//! two all-reduces: it names that rank and the collective the others are
//! in, as text and as JSON; bad targets are clear errors.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_comm::published::{abort_key, communicator_prefix, gone_key, newest_communicator_key};
use cohort_comm::store::{StoreClient, StoreServer};
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
    // A runtime folder of its own: no run file of another job is found.
    let runtime = private_dir("status-none");
    let mut c = Command::new(COHORT);
    c.arg("status").env_remove("COHORT_STORE_ADDR").env_remove("COHORT_JOB_SECRET");
    c.env("XDG_RUNTIME_DIR", &runtime);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(30));
    let (_, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no store address") && stderr.contains("COHORT_STORE_ADDR"), "{stderr}");
    assert!(stderr.contains("no `cohort run` of yours runs on this machine"), "{stderr}");

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

/// Run files a reader in this pid namespace must leave alone: another
/// namespace's (a container sharing the folder), whose pid means nothing
/// here, and one named without a namespace (an older cohort's, maybe of
/// another namespace). `cohort status` neither shows nor removes them.
#[test]
fn status_leaves_the_run_files_of_another_pid_namespace() {
    let runtime = private_dir("status-other-ns");
    let cohort_dir = runtime.join("cohort");
    std::fs::create_dir(&cohort_dir).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cohort_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let ours = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/self/ns/pid").unwrap());
    let theirs = ours + 1;
    // Pids above the kernel's largest (2^22): no process here has them.
    let gone = 1u32 << 23;
    for (stem, pidns) in
        [(format!("job-{gone}-{theirs}"), format!("pidns={theirs}\n")), (format!("job-{gone}"), String::new())]
    {
        let run = format!("addr=127.0.0.1:1\npid={gone}\n{pidns}start=5\nsince=1\n");
        write_private(&cohort_dir.join(format!("{stem}.run")), &run);
        write_private(&cohort_dir.join(format!("{stem}.secret")), "s");
    }
    let (code, _, stderr) = status_no_flags(&runtime, &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no `cohort run` of yours runs on this machine"), "{stderr}");
    let left = std::fs::read_dir(&cohort_dir).unwrap().count();
    assert_eq!(left, 4, "the run files of another pid namespace survive `cohort status`");
    let _ = std::fs::remove_dir_all(runtime);
}

/// Writes `text` into a new file at `path`, 0600.
fn write_private(path: &Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).unwrap();
    file.write_all(text.as_bytes()).unwrap();
}

/// A fresh folder of this user's, 0700 (a runtime folder for one test).
fn private_dir(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir(name);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// A store under [`SECRET`] and a client of it.
fn store() -> (StoreServer, StoreClient) {
    let server = StoreServer::bind("127.0.0.1:0", SECRET).unwrap();
    let client = StoreClient::connect(server.local_addr(), SECRET, Duration::from_secs(30)).unwrap();
    (server, client)
}

/// `cohort status <extra>` against `port`, its address space limited to
/// 2 GiB: a status that sized anything by a claimed world would fail here.
fn bounded_status(port: u16, extra: &[&str]) -> (Option<i32>, String, String) {
    let mut c = Command::new(COHORT);
    c.args(["status", "--store-addr", &format!("127.0.0.1:{port}")]).args(extra);
    c.env("COHORT_JOB_SECRET", SECRET).env_remove("COHORT_STORE_ADDR");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        c.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 2 << 30, rlim_max: 2 << 30 };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = output_within(c, Duration::from_secs(60));
    let (stdout, stderr) = texts(&out);
    (out.status.code(), stdout, stderr)
}

/// A `world` entry no launcher writes (more ranks than a job can have,
/// more than a machine word holds, garbage) is a clear error naming it:
/// no panic, no allocation sized by it. A world as large as a job can be,
/// in a store with nothing else, shows one batch of ranks and says the
/// rest wrote nothing.
#[test]
fn status_refuses_a_bogus_world_without_allocating_for_it() {
    let (server, client) = store();
    let port = server.local_addr().port();
    let world = "cohort/launcher/world";
    for (value, why) in [
        ("4000000000 1", "4000000000 ranks, where a job has 1 to 4194304"),
        ("18446744073709551615 1", "18446744073709551615 ranks"),
        ("99999999999999999999999 1", "not whole numbers"),
        ("4 0", "0 nodes for 4 ranks"),
        ("garbage", "not `<ranks> <nodes>`"),
        ("\u{1b}[2J 1", "\\u{1b}[2J"),
    ] {
        client.set(world, value.as_bytes()).unwrap();
        let (code, stdout, stderr) = bounded_status(port, &[]);
        assert_eq!(code, Some(1), "{value}: {stdout}\n{stderr}");
        assert!(stderr.contains(world) && stderr.contains(why), "{value}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains('\u{1b}'), "{value}: {stderr}");
    }
    // Launchers' node entries that add up past any job: the same.
    client.delete(world).unwrap();
    client.set("cohort/launcher/node/0", b"18446744073709551615 on host a").unwrap();
    client.set("cohort/launcher/node/1", b"2 on host b").unwrap();
    let (code, _, stderr) = bounded_status(port, &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("cohort/launcher/node/") && stderr.contains("ranks in all"), "{stderr}");

    client.set(world, b"4194304 1").unwrap();
    let (code, stdout, stderr) = bounded_status(port, &["--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(v["world_size"], 4194304);
    assert_eq!(v["ranks"].as_array().unwrap().len(), 1024, "one batch of ranks");
    assert_eq!(v["not_shown_from"], 1024);
    let (code, text, stderr) = bounded_status(port, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(text.contains("ranks 1024-4194303 not shown"), "{}", &text[text.len().saturating_sub(400)..]);
}

/// A `world` as large as a job can be with one rank's heartbeat in every
/// batch of 1024 (4096 small entries): status reads on only while most of
/// a batch's ranks wrote something, so what it holds follows what the
/// store holds (before, it read all 4194304 ranks: 32 s and 2.9 GB).
#[test]
fn status_of_a_world_with_a_few_ranks_in_every_batch_reads_only_what_is_there() {
    let (server, client) = store();
    let port = server.local_addr().port();
    client.set("cohort/launcher/world", b"4194304 1").unwrap();
    for r in (0..4194304).step_by(1024) {
        client.set(&cohort_comm::job_heartbeat_key(r), format!("{} 0 1", 100 + r).as_bytes()).unwrap();
    }
    let (code, stdout, stderr) = bounded_status(port, &["--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(v["ranks"].as_array().unwrap().len(), 1024, "one batch of ranks");
    assert_eq!(v["not_shown_from"], 1024);
    assert_eq!(v["ranks"][0]["pid"], 100);
    let (code, text, stderr) = bounded_status(port, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(text.contains("ranks 1024-4194303 not shown"), "{}", &text[text.len().saturating_sub(400)..]);
}

/// What a rank left in its `gone` entry and the communicator's abort text
/// reach the terminal with their control characters escaped.
#[test]
fn status_escapes_control_characters_in_gone_and_abort_texts() {
    let (server, client) = store();
    client.set("cohort/launcher/world", b"2 1").unwrap();
    client.set(&newest_communicator_key(0), b"1").unwrap();
    let prefix = communicator_prefix(1);
    client.set(&gone_key(&prefix, 1), b"bye\x1b[31m red\r\x07 forged line").unwrap();
    client.set(&abort_key(&prefix), "\u{1b}]0;title\u{7}boom\u{9b}2J".as_bytes()).unwrap();
    let (code, text, stderr) = bounded_status(server.local_addr().port(), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!text.contains(['\u{1b}', '\r', '\u{7}', '\u{9b}']), "raw control characters: {text:?}");
    assert!(text.contains(r"(left: bye\u{1b}[31m red\r\u{7} forged line)"), "{text}");
    assert!(text.contains(r"aborted: \u{1b}]0;title\u{7}boom\u{9b}2J"), "{text}");
    let (_, json, _) = bounded_status(server.local_addr().port(), &["--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(v["ranks"][1]["gone"], r"bye\u{1b}[31m red\r\u{7} forged line");
    assert!(!json.contains('\u{9b}'), "{json}");
}

/// `cohort status` in `runtime` with no flags and neither address nor
/// secret in its environment.
fn status_no_flags(runtime: &Path, extra: &[&str]) -> (Option<i32>, String, String) {
    let mut c = Command::new(COHORT);
    c.arg("status").args(extra).env("XDG_RUNTIME_DIR", runtime);
    c.env_remove("COHORT_STORE_ADDR").env_remove("COHORT_JOB_SECRET");
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(30));
    let (stdout, stderr) = texts(&out);
    (out.status.code(), stdout, stderr)
}

/// A one-node job whose launcher picked its own secret and port: `cohort
/// status` on the same machine finds it with no flags (the newest of two,
/// naming the other), `--timings` prints the line that shows it, and the
/// run files go when the job ends.
#[test]
fn status_with_no_flags_finds_a_one_node_job() {
    let runtime = private_dir("status-run-file");
    let start = |n: &str| {
        let mut c = cohort_run(&["-n", n, "--master-port", "0", "--timings"], &["sleep", "60"]);
        c.env("XDG_RUNTIME_DIR", &runtime).env_remove("COHORT_STORE_ADDR");
        c.spawn().expect("start cohort run")
    };
    let first = start("1");
    let end_by = Instant::now() + Duration::from_secs(60);
    let (mut code, mut text, mut stderr) = (None, String::new(), String::new());
    while Instant::now() < end_by {
        (code, text, stderr) = status_no_flags(&runtime, &[]);
        if code == Some(0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(code, Some(0), "{stderr}");
    assert!(text.contains("1 ranks on 1 node(s)"), "{text}");
    let cohort_dir = runtime.join("cohort");
    // Named by the launcher's pid and pid namespace (ours: it is our child).
    let pidns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/self/ns/pid").unwrap());
    let secret = cohort_dir.join(format!("job-{}-{pidns}.secret", first.id()));
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&cohort_dir), 0o700);
        assert_eq!(mode(&secret), 0o600);
    }

    let second = start("2");
    let end_by = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end_by {
        (code, text, stderr) = status_no_flags(&runtime, &[]);
        if text.contains("2 ranks") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(code, Some(0), "{stderr}");
    assert!(text.contains("2 ranks on 1 node(s)"), "the newest job is shown: {text}\n{stderr}");
    assert!(stderr.contains(&format!("launcher pid {} (started ", first.id())), "{stderr}");
    assert!(stderr.contains("s ago): cohort status --store-addr 127.0.0.1:"), "{stderr}");

    for job in [second, first] {
        // SAFETY: kill(2) on our own child, a launcher, which stops its ranks.
        unsafe { libc::kill(job.id() as libc::pid_t, libc::SIGTERM) };
        let out = wait_output(job, Duration::from_secs(60));
        let (_, stderr) = texts(&out);
        // The line --timings prints, with the address and the secret's file.
        let line = stderr.lines().find_map(|l| l.split_once("where the ranks are: ")).map(|(_, l)| l.to_string());
        let line = line.unwrap_or_else(|| panic!("no status line: {stderr}"));
        assert!(line.starts_with("cohort status --store-addr 127.0.0.1:"), "{line}");
        assert!(line.contains(&format!("--secret-file {}", cohort_dir.display())), "{line}");
    }
    let left: Vec<_> = std::fs::read_dir(&cohort_dir).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "the run files are removed when the jobs end: {left:?}");
    let (code, _, stderr) = status_no_flags(&runtime, &[]);
    assert_eq!(code, Some(2), "{stderr}");
    let _ = std::fs::remove_dir_all(runtime);
}
