//! The launcher and its store under attack and under faults: hostile
//! clients (memory and threads measured), every output line delivered to a
//! slow console, a launcher paused with SIGSTOP, ranks' children after a
//! SIGKILLed launcher, and under srun the death of the rank that serves the
//! store. Network: loopback only; every loop is bounded.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(90);
const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");

/// (resident KiB, threads) of process `pid`, from /proc.
fn rss_and_threads(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Forwards `child`'s stdout lines to a channel.
fn lines_of(stdout: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn hostile_clients_cannot_exhaust_the_launcher() {
    let dir = temp_dir("hostile");
    let go = dir.join("go");
    let mut child =
        cohort_run(&["-n", "2", "--master-port", "0"], &["env", "wait-file", go.to_str().unwrap(), "store"])
            .spawn()
            .unwrap();
    let pid = child.id();
    let lines = lines_of(child.stdout.take().unwrap());
    let line = lines.recv_timeout(Duration::from_secs(30)).expect("a rank's environment");
    let addr = line.split("COHORT_STORE_ADDR=").nth(1).unwrap().split(' ').next().unwrap().to_string();
    let before = rss_and_threads(pid);

    // 16 clients announce a 64 MiB frame before authenticating and send 8
    // MiB of it (before: read into a 64 MiB buffer each); 300 connect and say nothing (before: a thread
    // each); 4 trickle a byte every 200 ms (before: never cut off).
    let mut hostile: Vec<TcpStream> = Vec::new();
    let body = vec![1u8; 8 << 20];
    for _ in 0..16 {
        let mut t = TcpStream::connect(&addr).unwrap();
        t.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        // Then 8 MiB of it (before: 8 MiB resident each); the server closes
        // at the length, so the writes fail: fine.
        let _ = t.write_all(&(64u32 << 20).to_le_bytes());
        let _ = t.write_all(&body);
        hostile.push(t);
    }
    for _ in 0..300 {
        hostile.push(TcpStream::connect(&addr).unwrap());
    }
    let trickle_addr = addr.clone();
    let trickler = std::thread::spawn(move || {
        let mut ts: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&trickle_addr).unwrap()).collect();
        let mut cut = 0;
        for _ in 0..100 {
            cut = 0;
            for t in &mut ts {
                if t.write_all(&[0]).is_err() {
                    cut += 1;
                }
            }
            if cut == ts.len() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        cut
    });
    // Sample while the flood holds its connections.
    let mut worst = before;
    for _ in 0..10 {
        let now = rss_and_threads(pid);
        worst = (worst.0.max(now.0), worst.1.max(now.1));
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "launcher before the flood: {} KiB, {} threads; worst during it: {} KiB, {} threads",
        before.0, before.1, worst.0, worst.1
    );
    assert!(worst.0 < before.0 + 64 * 1024, "RSS grew from {} to {} KiB", before.0, worst.0);
    let bound = before.1 + 2 * cohort_comm::store::MAX_UNAUTHENTICATED as u64 + 8;
    assert!(worst.1 <= bound, "threads grew from {} to {} (bound {bound})", before.1, worst.1);

    // Ranks holding the secret still get through, while the flood holds on.
    std::fs::write(&go, b"").unwrap();
    let out = wait_output(child, LIMIT);
    let (_, stderr) = texts(&out);
    let mut rest: Vec<String> = lines.try_iter().collect();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(1)) {
        rest.push(l);
    }
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert_eq!(rest.iter().filter(|l| l.contains("store barrier of 2 passed")).count(), 2, "{rest:?}");
    assert_eq!(
        trickler.join().unwrap(),
        4,
        "every trickling client was cut off (at the handshake deadline, or by the bound)"
    );
    assert!(
        stderr.contains("rendezvous store closed the oldest connection in the handshake")
            || stderr.contains("rendezvous store dropped a client"),
        "drops are logged: {stderr}"
    );
    drop(hostile);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_output_line_reaches_a_slow_console() {
    // The console is a pipe nobody reads for 3 s (`| (sleep 4; cat)`): the
    // launcher used to give its readers 2 s and drop the rest.
    let mut c = Command::new(COHORT);
    c.args([
        "run",
        "-n",
        "1",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        "seq 1 20000; echo LAST; echo FINAL-ERROR >&2; exit 3",
    ]);
    c.env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let mut text = String::new();
    stdout.read_to_string(&mut text).unwrap();
    let out = wait_output(child, LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(text.lines().count(), 20001, "every line arrives");
    assert!(text.ends_with("[rank 0]: 20000\n[rank 0]: LAST\n"), "{}", &text[text.len() - 60..]);
    assert_eq!(code(out.status, &out), 3, "{stderr}");
    assert!(stderr.contains("[rank 0]: FINAL-ERROR"), "the summary has the last line: {stderr}");
}

#[test]
fn an_enormous_line_is_split_and_the_launcher_stays_small() {
    // 256 MiB without a newline: the launcher copies it in 64 KiB pieces.
    let mut c = Command::new(COHORT);
    c.args([
        "run",
        "-n",
        "1",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        "head -c 268435456 /dev/zero | tr '\\0' x; echo; echo END",
    ]);
    c.env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let pid = child.id();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let (mut lines, mut longest, mut worst_rss) = (0usize, 0usize, 0u64);
    let mut line = Vec::new();
    loop {
        line.clear();
        if stdout.read_until(b'\n', &mut line).unwrap() == 0 {
            break;
        }
        lines += 1;
        longest = longest.max(line.len());
        if lines % 512 == 0 {
            if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                let rss = s
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok());
                worst_rss = worst_rss.max(rss.unwrap_or(0));
            }
        }
    }
    let out = wait_output(child, LIMIT);
    eprintln!("{lines} console lines, longest {longest} bytes, launcher RSS at most {worst_rss} KiB");
    assert_eq!(code(out.status, &out), 0);
    assert!(longest <= 64 * 1024 + "[rank 0]: \n".len(), "{longest}");
    assert!(lines >= 4096, "{lines}");
    assert!(worst_rss < 64 * 1024, "the launcher held {worst_rss} KiB");
}

#[test]
fn a_paused_launcher_does_not_blame_a_healthy_rank() {
    // Ctrl-Z then fg: the launcher (and the store it serves) stands still
    // for 4 s, twice its heartbeat limit; the ranks keep running.
    let dir = temp_dir("paused");
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "2", "--master-port", "0", "--heartbeat-timeout", "2", "--trace-dir"])
        .arg(dir.join("trace"))
        .args(["--", SUITE, "--pid-dir", dir.to_str().unwrap(), "slow", "1", "8"]);
    c.env_remove("COHORT_JOB_SECRET").env("COHORT_TIMEOUT", "60").stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    wait_pid_files(&dir, 2, Duration::from_secs(20));
    // Let the ranks form their communicator and beat.
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_secs(4));
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) };
    let out = wait_output(child, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(!stderr.contains("no heartbeat"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ranks_children_die_with_a_sigkilled_launcher() {
    let dir = temp_dir("children");
    let script = format!("sleep 300 & echo $! > {}/child$RANK.pid; wait", dir.display());
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "2", "--master-port", "0", "--", "sh", "-c", &script]);
    c.env_remove("COHORT_JOB_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let pids = wait_pid_files(&dir, 2, Duration::from_secs(20));
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    let _ = wait_output(child, LIMIT);
    let left = wait_all_gone(&pids, Duration::from_secs(10));
    for &p in &left {
        // SAFETY: kill(2); clean up what the failed check left.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(left.is_empty(), "the ranks' children outlived the launcher: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn escapees_holding_a_ranks_output_die_with_a_sigkilled_launcher() {
    // Processes that left their rank's group (setsid) and never write,
    // rank 0's with the rank's output, rank 1's with its output on
    // /dev/null: before, the reaper (which kills groups) missed both.
    let dir = temp_dir("escapee-reaped");
    let script = format!(
        "if [ $RANK = 0 ]; then out=; else out=/dev/null; fi; \
         setsid sh -c \"echo \\$\\$ > {}/escapee$RANK.pid; exec sleep 300 ${{out:+>$out 2>&1}}\" & wait",
        dir.display()
    );
    let child = cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", &script]).spawn().unwrap();
    let pids = wait_pid_files(&dir, 2, Duration::from_secs(20));
    let _guard = KillOnDrop(pids.clone());
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    let _ = wait_output(child, LIMIT);
    assert_eq!(wait_all_gone(&pids, Duration::from_secs(10)), Vec::<i32>::new(), "escapees outlived the launcher");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn processes_that_left_the_ranks_groups_holding_their_output_are_killed() {
    // Each rank starts a process that leaves its group (setsid), then exits
    // 0: rank 0's keeps the rank's output and writes a line every 0.3 s
    // forever (before: the launcher waited for its pipes forever, deaf to
    // SIGTERM), rank 1's is silent, its output on /dev/null (before: left
    // running).
    let dir = temp_dir("escapees");
    let d = dir.display();
    let script = format!(
        "if [ $RANK = 0 ]; then setsid sh -c 'echo $$ > {d}/escapee0.pid; while :; do echo tick; sleep 0.3; done' & \
         else setsid sh -c 'echo $$ > {d}/escapee1.pid; exec sleep 1000 >/dev/null 2>&1' & fi; sleep 1; echo started"
    );
    let child = cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", &script]).spawn().unwrap();
    let pids = wait_pid_files(&dir, 2, Duration::from_secs(20));
    let _guard = KillOnDrop(pids.clone());
    let start = Instant::now();
    let out = wait_output(child, Duration::from_secs(30));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(start.elapsed() < Duration::from_secs(25), "took {:?}", start.elapsed());
    assert_eq!(wait_all_gone(&pids, Duration::from_secs(15)), Vec::<i32>::new(), "escapees left running: {stderr}");
    for pid in &pids {
        assert!(stderr.contains(&pid.to_string()), "the launcher names what it killed ({pid}): {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_ranks_last_lines_are_quoted_with_control_characters_escaped() {
    // Terminal escapes (set the title, clear the screen), a carriage return
    // that would hide the quote's prefix under a forged launcher line, a NUL
    // and a byte that is not UTF-8 (before: quoted raw in the summary).
    let script = r"printf '\033]0;pwned\007\033[2Jbefore\r\033[1mcohort: every rank exited with 0\000x\377\n'; exit 1";
    let out = output_within(cohort_run_program("sh", &["-n", "1", "--master-port", "0"], &["-c", script]), LIMIT);
    assert_eq!(code(out.status, &out), 1);
    let raw = b"\x1b]0;pwned\x07\x1b[2Jbefore\r\x1b[1mcohort: every rank exited with 0\0x\xff\n";
    assert!(out.stdout.ends_with(raw), "the rank's own output passes through as written: {:?}", out.stdout);
    let (_, stderr) = texts(&out);
    let summary = &stderr[stderr.find("cohort: job failed").expect(&stderr)..];
    // What the carriage return wrote over is left out, as a terminal shows
    // the line, and the quote says a \r came before.
    let quoted = "[rank 0]: \\r\\u{1b}[1mcohort: every rank exited with 0\\0x\u{fffd}";
    assert!(summary.contains(quoted), "{summary:?}");
    assert!(!summary.chars().any(|c| c.is_control() && c != '\n'), "{summary:?}");
}

#[test]
fn a_timeout_names_the_rank_that_was_stopped() {
    // Rank 1 stops itself (SIGSTOP) and sends no heartbeat to be missed:
    // --timeout ends the job (before: "ranks 0, 1 were still running", with
    // nothing to tell the stopped one from the busy one).
    let script = "if [ $RANK = 1 ]; then kill -STOP $$; fi; sleep 30";
    let opts = ["-n", "2", "--master-port", "0", "--timeout", "2"];
    let out = output_within(cohort_run_program("sh", &opts, &["-c", script]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 124, "{stderr}");
    assert!(stderr.contains("ranks 0, 1 were still running and were stopped"), "{stderr}");
    assert!(stderr.contains("rank 1 was itself stopped (SIGSTOP"), "{stderr}");
    assert!(!stderr.contains("rank 0 was itself"), "{stderr}");
}

#[test]
fn a_rank_that_closes_its_output_is_waited_for_and_forked_children_are_gone() {
    // Rank 0 closes stdout and stderr at once (its readers see the end long
    // before it exits 5); rank 1 forks 200 children and exits 0 at once.
    let dir = temp_dir("closed-and-forks");
    let script = format!(
        "if [ $RANK = 0 ]; then exec >&- 2>&-; sleep 1; exit 5; fi; \
         for i in $(seq 200); do sleep 1000 & echo $! >> {}/children; done; exit 0",
        dir.display()
    );
    let out = output_within(cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", &script]), LIMIT);
    let (_, stderr) = texts(&out);
    let children: Vec<i32> =
        std::fs::read_to_string(dir.join("children")).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    let _guard = KillOnDrop(children.clone());
    assert_eq!(code(out.status, &out), 5, "{stderr}");
    assert!(stderr.contains("rank 0 failed first: it exited with code 5 after 1."), "{stderr}");
    assert_eq!(children.len(), 200);
    assert_eq!(wait_all_gone(&children, Duration::from_secs(15)), Vec::<i32>::new(), "children left running");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_escapee_that_keeps_starting_escapees_leaves_none() {
    // It leaves the group with its output on /dev/null and starts a new
    // session every 10 ms (before: those started between the launcher's
    // look and its kill were left running).
    let dir = temp_dir("escapee-spawner");
    let list = dir.join("started");
    let script = format!(
        "setsid sh -c 'echo $$ >> {l}; while :; do setsid sh -c \"echo \\$\\$ >> {l}; exec sleep 1000\" & sleep 0.01; \
         done' >/dev/null 2>&1 & sleep 1; exit 0",
        l = list.display()
    );
    let out = output_within(cohort_run_program("sh", &["-n", "1", "--master-port", "0"], &["-c", &script]), LIMIT);
    let read = || -> Vec<i32> {
        std::fs::read_to_string(&list).unwrap_or_default().lines().filter_map(|l| l.parse().ok()).collect()
    };
    let started = read();
    let _guard = KillOnDrop(started.clone());
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert!(started.len() > 10, "{started:?}");
    std::thread::sleep(Duration::from_millis(300));
    let after = read();
    let _guard2 = KillOnDrop(after.clone());
    assert_eq!(after.len(), started.len(), "the escapee still starts processes: {stderr}");
    assert_eq!(wait_all_gone(&after, Duration::from_secs(15)), Vec::<i32>::new(), "left running: {stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Sends SIGKILL to its processes when dropped (a failed check included).
struct KillOnDrop(Vec<libc::pid_t>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: kill(2) on processes this test started (ESRCH or a
            // zombie when they already ended: harmless).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// `cohort-comm-suite` as rank `rank` of `n` started by "srun" (Slurm's
/// variables, no launcher, no COHORT_JOB_SECRET).
fn srun_rank(rank: usize, n: usize, job: &str, port: u16, dir: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(SUITE);
    c.args(["--pid-dir", dir.to_str().unwrap()]).args(args);
    for v in ["COHORT_JOB_SECRET", "COHORT_STORE_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "COHORT_LOG"]
    {
        c.env_remove(v);
    }
    c.env("SLURM_PROCID", rank.to_string())
        .env("SLURM_NTASKS", n.to_string())
        .env("SLURM_LOCALID", rank.to_string())
        .env("SLURM_TASKS_PER_NODE", n.to_string())
        .env("SLURM_JOB_ID", job)
        .env("SLURM_STEP_ID", "0")
        .env("MASTER_PORT", port.to_string())
        .env("COHORT_TIMEOUT", "600")
        .env("COHORT_TRACE_DIR", dir.join("trace"));
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Whether something listens on `port` at an address other than loopback
/// (from /proc/net/tcp and tcp6).
fn listens_beyond_loopback(port: u16) -> Option<bool> {
    let mut found = None;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state)) = (cols.get(1), cols.get(3)) else { continue };
            let Some((ip, p)) = local.rsplit_once(':') else { continue };
            if *state == "0A" && u16::from_str_radix(p, 16).ok() == Some(port) {
                let loopback = ip == "0100007F" || ip == "00000000000000000000000001000000";
                found = Some(found.unwrap_or(false) || !loopback);
            }
        }
    }
    found
}

#[test]
fn under_srun_without_a_secret_nothing_guessable_and_the_store_hosts_death_is_noticed() {
    let dir = temp_dir("srun");
    let job = format!("{}", 900_000 + std::process::id());
    let port = free_port();
    let ranks: Vec<_> = (0..3).map(|r| srun_rank(r, 3, &job, port, &dir, &["loop"]).spawn().unwrap()).collect();
    // Whatever happens below, no rank outlives the test.
    let mut guard = KillOnDrop(ranks.iter().map(|c| c.id() as libc::pid_t).collect());
    let pids = wait_pid_files(&dir, 3, Duration::from_secs(30));
    // The store listens on loopback only, and the secret an outsider could
    // derive from the job id (as it used to be) is refused.
    let end = Instant::now() + Duration::from_secs(20);
    while listens_beyond_loopback(port).is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(listens_beyond_loopback(port), Some(false), "the store listens on loopback only");
    let outsider = cohort_comm::store::StoreClient::connect(
        format!("127.0.0.1:{port}").as_str(),
        format!("cohort-derived-{job}.0"),
        Duration::from_secs(5),
    );
    assert!(
        matches!(outsider, Err(cohort_comm::store::StoreError::AuthRefused { .. })),
        "a secret derived from the job id must be refused: {:?}",
        outsider.map(|_| ())
    );
    // The secret went through a file only this user can read, removed once
    // every rank joined.
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let secret_dir = match std::env::var_os("XDG_RUNTIME_DIR").map(std::path::PathBuf::from).filter(|d| d.is_dir()) {
        Some(d) => d.join("cohort"),
        None => std::env::temp_dir().join(format!("cohort-{uid}")),
    };
    let secret_file = secret_dir.join(format!("job-{job}.0.secret"));
    let end = Instant::now() + Duration::from_secs(20);
    while secret_file.exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!secret_file.exists(), "{} is removed once every rank joined", secret_file.display());
    // Let the ranks run their all-reduces, then kill rank 0, which serves
    // the store; before, the others waited for the 600 s timeout.
    std::thread::sleep(Duration::from_millis(1000));
    let rank0 = pids.iter().copied().find(|&p| p as u32 == ranks[0].id()).expect("rank 0's pid");
    // SAFETY: kill(2) on a process this test started.
    unsafe { libc::kill(rank0, libc::SIGKILL) };
    let mut outs = Vec::new();
    for (r, child) in ranks.into_iter().enumerate().skip(1) {
        let out = wait_output(child, Duration::from_secs(60));
        let (_, stderr) = texts(&out);
        eprintln!("rank {r}: {stderr}");
        outs.push((out.status.code(), stderr));
    }
    // Ranks 1 and 2 are reaped: their pids may be reused, so never signal
    // them again (rank 0's Child was dropped unwaited: a zombie keeps its pid).
    guard.0.truncate(1);
    for (code, stderr) in &outs {
        assert_eq!(*code, Some(1), "{stderr}");
        assert!(
            stderr.contains("lost the connection to the rendezvous store") || stderr.contains("rank 0"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Makes `c`'s process start with the soft limit `resource` lowered to
/// `soft` (`ulimit -u 64`, `ulimit -n 256`, …).
fn lower_soft_limit(c: &mut Command, resource: libc::__rlimit_resource_t, soft: libc::rlim_t) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and makes
    // two system calls (getrlimit, setrlimit) on a local value; it only
    // lowers the child's own soft limit.
    unsafe {
        c.pre_exec(move || {
            let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(resource, &mut limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            limit.rlim_cur = soft.min(limit.rlim_max);
            if libc::setrlimit(resource, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Lines in `path` (0 when it does not exist).
fn lines_in(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map(|s| s.lines().count()).unwrap_or(0)
}

/// `cohort run -n ranks -- sh -c "echo $RANK >> <dir>/started; then"`,
/// output to stderr only, no relay: each rank notes in a file that it
/// started. Returns the command, the file and the folder.
fn ranks_noting_their_start(name: &str, ranks: usize, then: &str) -> (Command, PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let log = dir.join("started");
    let script = format!("echo $RANK >> {}; {then}", log.display());
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", &ranks.to_string(), "--master-port", "0", "--", "sh", "-c", &script]);
    c.env_remove("COHORT_JOB_SECRET").env("COHORT_STORE_RELAY", "0").stdout(Stdio::null()).stderr(Stdio::piped());
    (c, log, dir)
}

#[test]
fn a_signal_while_ranks_start_stops_the_starting() {
    // A node of many ranks takes a while to start; Ctrl-C (here SIGTERM)
    // in that time must stop the starting, not be left until every rank
    // has started. Each rank notes itself in a file, then sleeps.
    const RANKS: usize = 400;
    let (mut c, log, dir) = ranks_noting_their_start("stop-starting", RANKS, "exec sleep 60");
    let child = c.spawn().unwrap();
    let began = Instant::now();
    while lines_in(&log) == 0 && began.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = wait_output(child, LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    let started = lines_in(&log);
    assert!(started > 0 && started < RANKS, "{started} of {RANKS} ranks started after the signal\n{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_rank_that_fails_while_others_start_stops_the_starting() {
    // Every rank fails at once: the launcher stops starting more after the
    // first failure it sees, and names it.
    const RANKS: usize = 400;
    let (mut c, log, dir) = ranks_noting_their_start("fail-starting", RANKS, "exit 3");
    let out = wait_output(c.spawn().unwrap(), LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("failed first: it exited with code 3"), "{stderr}");
    let started = lines_in(&log);
    assert!(started < RANKS, "all {RANKS} ranks were started after one had failed\n{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn more_ranks_than_processes_allowed_is_refused_before_any_starts() {
    // A process limit of 64 for the launcher (`ulimit -u 64`): -n 100 could
    // never run; -n 99999999999 is refused by the parser (no node runs that
    // many processes).
    let mut c = Command::new(COHORT);
    c.args(["run", "-n", "100", "--", "true"]).env_remove("COHORT_JOB_SECRET");
    lower_soft_limit(&mut c, libc::RLIMIT_NPROC, 64);
    let out = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("-n 100 asks for more ranks") && stderr.contains("(64: `ulimit -u`"), "{stderr}");
    let out = Command::new(COHORT).args(["run", "-n", "99999999999", "--", "true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("99999999999") && stderr.contains("4194304"), "{stderr}");
}

#[test]
fn a_node_of_many_ranks_keeps_its_relay_under_a_low_file_limit_and_ranks_get_that_limit() {
    // A soft limit of 256 open files: 60 ranks need about 360 descriptors in
    // the launcher (pipes and relay sockets). It raises its own soft limit
    // to the hard one; each rank still sees 256.
    let script = "echo limit $(ulimit -n) fd ${COHORT_STORE_FD:-none}";
    let mut c = cohort_run_program("sh", &["-n", "60", "--master-port", "0"], &["-c", script]);
    c.env_remove("COHORT_STORE_RELAY");
    lower_soft_limit(&mut c, libc::RLIMIT_NOFILE, 256);
    let out = output_within(c, LIMIT);
    let (stdout, stderr) = texts(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(!stderr.contains("could not start the node's store relay"), "{stderr}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("limit ")).collect();
    assert_eq!(lines.len(), 60, "{stdout}");
    for line in lines {
        assert!(line.contains("limit 256 fd "), "a rank saw another limit: {line}");
        assert!(!line.ends_with("fd none"), "a rank had no relay sockets: {line}");
    }
}

/// The write end of a pipe whose read end is already closed: every write to
/// it fails with EPIPE (a console that went away: `cohort ... | head -c0`).
fn closed_pipe() -> Stdio {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just made and are owned by nothing else.
    unsafe {
        libc::close(fds[0]);
        Stdio::from(std::os::fd::OwnedFd::from_raw_fd(fds[1]))
    }
}

#[test]
fn a_console_that_went_away_does_not_change_the_exit_code() {
    for (script, expect) in [("sleep 0.3; echo out; echo err >&2; exit 3", 3), ("sleep 0.3; echo out; echo err >&2", 0)]
    {
        for (close_stdout, close_stderr) in [(true, true), (false, true), (true, false)] {
            let mut c = cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", script]);
            // Unset: the launcher says at once that it sets it.
            c.env_remove("OMP_NUM_THREADS");
            if close_stdout {
                c.stdout(closed_pipe());
            }
            if close_stderr {
                c.stderr(closed_pipe());
            }
            let out = output_within(c, LIMIT);
            let what = format!("{script} (stdout closed: {close_stdout}, stderr closed: {close_stderr})");
            assert_eq!(out.status.code(), Some(expect), "{what}: {:?}", texts(&out));
            assert!(!texts(&out).1.contains("panicked"), "{what}: {:?}", texts(&out));
        }
    }
}

#[test]
fn printing_commands_end_quietly_when_their_reader_goes_away() {
    use std::os::unix::process::ExitStatusExt;
    let dir = temp_dir("closed-reader");
    let dump = r#"{"rank":0,"world_size":1,"host":"h","pid":1,"reason":"test","written_us":0,"records":[]}"#;
    std::fs::write(dir.join("rank0.json"), dump).unwrap();
    for args in [vec!["config"], vec!["config", "--markdown"], vec!["trace", dir.to_str().unwrap()]] {
        let mut c = Command::new(COHORT);
        c.args(&args).stdin(Stdio::null()).stdout(closed_pipe()).stderr(Stdio::piped());
        let out = output_within(c, LIMIT);
        let (_, stderr) = texts(&out);
        // Ended by SIGPIPE, as `cat` or `grep` would be, or a plain exit: never a panic.
        let quiet = out.status.signal() == Some(libc::SIGPIPE) || out.status.code() == Some(0);
        assert!(quiet && !stderr.contains("panicked"), "cohort {args:?}: {:?}: {stderr}", out.status);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_console_that_stops_reading_holds_back_output_not_supervision() {
    // Rank 0 floods stdout into a pipe nobody reads; rank 1 fails after
    // 0.5 s. The failure is noticed and rank 0 stopped while the console is
    // stuck; once the console goes away the launcher exits with rank 1's code.
    let dir = temp_dir("stuck-console");
    let script =
        format!("echo $$ > {}/$RANK.pid; if [ $RANK = 0 ]; then yes; else sleep 0.5; exit 3; fi", dir.display());
    let c = cohort_run_program("sh", &["-n", "2", "--master-port", "0"], &["-c", &script]);
    let mut child = { c }.spawn().unwrap();
    let console = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let pids = wait_pid_files(&dir, 2, LIMIT);
    assert_eq!(wait_all_gone(&pids, Duration::from_secs(30)), Vec::<i32>::new(), "every rank was stopped");
    drop(console);
    let out = wait_output(child, LIMIT);
    let stderr = stderr.join().unwrap();
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("rank 1 failed first") && !stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_link_in_the_middle_of_the_log_path_is_followed_only_when_no_other_user_could_place_it() {
    use std::os::unix::fs::PermissionsExt;
    // --log-dir <dir>/link/logs with `link` pointing elsewhere. A link of
    // another user, or one in a folder others may write to, could send the
    // logs wherever they choose: refused, and nothing is made through it.
    // A link of root or this user in a folder of theirs (`/home ->
    // var/home`) is followed.
    let run = |dir: &std::path::Path| {
        let logs = dir.join("link/logs");
        let opts = ["-n", "1", "--master-port", "0", "--log-dir", logs.to_str().unwrap()];
        output_within(cohort_run_program("sh", &opts, &["-c", "echo private"]), LIMIT)
    };
    let refused = |dir: &std::path::Path, real: &std::path::Path, why: &str| {
        let out = run(dir);
        let (_, stderr) = texts(&out);
        assert_eq!(code(out.status, &out), 1, "{why}: {stderr}");
        assert!(stderr.contains(&format!("{} is a symbolic link", dir.join("link").display())), "{why}: {stderr}");
        assert!(!real.join("logs").exists(), "{why}: the log folder was made through the link");
    };
    let dir = temp_dir("log-link-middle");
    let real = dir.join("real");
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, dir.join("link")).unwrap();

    // Another user's link (the tests run as root, who may give it away).
    std::os::unix::fs::lchown(dir.join("link"), Some(65534), Some(65534))
        .expect("giving the link to another user needs root (CI runs the tests as root)");
    refused(&dir, &real, "another user's link");

    // This user's link in a folder anyone may write to, not sticky.
    std::os::unix::fs::lchown(dir.join("link"), Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(&dir, &real, "a link in a folder open to others");

    // This user's link in this user's folder: followed, as a system link is.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = run(&dir);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    let log = std::fs::read_to_string(real.join("logs/attempt_0/rank_0/stdout.log")).unwrap();
    assert!(log.contains("private"), "{log}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_log_folder_that_cannot_be_made_is_named_without_debug_text() {
    // A file where the attempt's folder goes. Before: `under Some("…")`.
    let dir = temp_dir("log-blocked");
    std::fs::write(dir.join("attempt_0"), b"").unwrap();
    let opts = ["-n", "1", "--master-port", "0", "--log-dir", dir.to_str().unwrap()];
    let out = output_within(cohort_run_program("sh", &opts, &["-c", "echo hi"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    let folder = dir.join("attempt_0/rank_0");
    let said = format!("cannot create the log files of rank 0 in {}: ", folder.display());
    assert!(stderr.contains(&said) && stderr.contains("choose another --log-dir"), "{stderr}");
    assert!(!stderr.contains("Some(") && !stderr.contains("\\\""), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}
