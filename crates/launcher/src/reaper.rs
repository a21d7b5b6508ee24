//! The reaper: a small process that outlives the launcher just long enough
//! to kill what the ranks started.
//!
//! A rank dies with its launcher through its parent-death signal, but that
//! signal is not inherited: a process the rank started (`sleep 300 &`, a
//! data loader, a compiler server) would be left under init when the
//! launcher is SIGKILLed, which no handler can catch. So `cohort run` starts
//! `cohort __reaper` first, in a process group of its own, and tells it over
//! a pipe which process groups hold ranks (`+<pgid>` when one starts, `-<pgid>`
//! once it is gone). When the pipe closes (the launcher exited, however it
//! ended), the reaper sends SIGKILL to every group still listed, and exits.
//!
//! A process that leaves its rank's group (setsid, a daemon) is found, as
//! the launcher finds it at the end of an attempt, by the rank's output pipes
//! it holds (`p<inode>` lines name them, `q<inode>` forgets them) or by the
//! attempt's marks in its environment (`m<NAME=value>` lines, `M` forgets
//! them); see [`crate::escapees`].
//!
//! Once what it killed has ended, it removes the shared-memory files that
//! ranks killed during set-up left (see [`crate::run::sweep_shared_memory`]).

use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();

/// Starts this launcher's reaper, once; a launcher without one (it could not
/// start) says so and goes on: its ranks still die with it.
pub fn init() {
    REAPER.get_or_init(|| match Reaper::start() {
        Ok(r) => Some(r),
        Err(e) => {
            say!(
                "cohort: warning: cannot start the reaper ({e}): processes the ranks start may outlive a \
                 launcher that is killed with SIGKILL"
            );
            None
        }
    });
}

/// Lists a rank's process group with the reaper, if there is one.
pub fn watch(pgid: u32) {
    if let Some(Some(r)) = REAPER.get() {
        r.watch(pgid);
    }
}

/// Takes a finished rank's process group off the reaper's list.
pub fn forget(pgid: u32) {
    if let Some(Some(r)) = REAPER.get() {
        r.forget(pgid);
    }
}

/// Lists a rank's output pipes (their inodes) with the reaper, which kills
/// the processes still holding them when the launcher is gone.
pub fn watch_pipes(inodes: &[u64]) {
    if let Some(Some(r)) = REAPER.get() {
        for i in inodes {
            r.send(&format!("p{i}\n"));
        }
    }
}

/// Gives the reaper the marks of the attempt that starts (see
/// [`crate::spawn::RankEnv::marks`]), in place of the last attempt's; none
/// when one holds a newline (a partial set would match too much).
pub fn watch_marks(marks: &[String]) {
    if let Some(Some(r)) = REAPER.get() {
        r.send("M\n");
        if marks.iter().all(|m| !m.contains('\n')) {
            for m in marks {
                r.send(&format!("m{m}\n"));
            }
        }
    }
}

/// Takes a finished rank's output pipes off the reaper's list.
pub fn forget_pipes(inodes: &[u64]) {
    if let Some(Some(r)) = REAPER.get() {
        for i in inodes {
            r.send(&format!("q{i}\n"));
        }
    }
}

/// The launcher's end of the pipe to its reaper.
pub struct Reaper {
    pipe: Mutex<File>,
}

impl Reaper {
    /// Starts `cohort __reaper` (this same executable), in its own process
    /// group so that a terminal's Ctrl-C reaches only the launcher.
    pub fn start() -> io::Result<Reaper> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        // O_CLOEXEC keeps both ends out of the ranks (a rank's child holding
        // the write end would keep the reaper from ever seeing the launcher
        // go).
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 just returned these two descriptors; each is owned
        // once, here.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let exe = std::env::current_exe()?;
        Command::new(exe)
            .arg("__reaper")
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()?;
        Ok(Reaper { pipe: Mutex::new(File::from(write)) })
    }

    /// Lists the process group `pgid` (a rank's) for the reaper.
    pub fn watch(&self, pgid: u32) {
        self.send(&format!("+{pgid}\n"));
    }

    /// Takes `pgid` off the list: every process in it is gone.
    pub fn forget(&self, pgid: u32) {
        self.send(&format!("-{pgid}\n"));
    }

    fn send(&self, line: &str) {
        // A reaper that died is not worth failing the job for: the ranks
        // still die with the launcher through their parent-death signal.
        if let Err(e) = self.pipe.lock().write_all(line.as_bytes()) {
            tracing::debug!("the reaper is gone: {e}");
        }
    }
}

/// `cohort __reaper`: reads `+pgid`/`-pgid` lines from stdin until it closes,
/// then kills every group still listed, waits (up to [`RANKS_END_LIMIT`])
/// for them to end and sweeps the shared memory dead ranks left.
pub fn serve() -> ExitCode {
    for sig in [libc::SIGINT, libc::SIGHUP, libc::SIGTERM] {
        // SAFETY: setting a signal to SIG_IGN has no memory-safety
        // preconditions. The reaper must outlive the launcher's own end,
        // whatever signal ended it.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    let mut groups: Vec<libc::pid_t> = Vec::new();
    let mut pipes: Vec<u64> = Vec::new();
    let mut marks: Vec<String> = Vec::new();
    for line in BufReader::new(io::stdin().lock()).lines() {
        let Ok(line) = line else { break };
        let (op, number) = line.split_at(line.len().min(1));
        match (op, number.parse::<libc::pid_t>(), number.parse::<u64>()) {
            ("+", Ok(pgid), _) if pgid > 1 => groups.push(pgid),
            ("-", Ok(pgid), _) => groups.retain(|&g| g != pgid),
            ("p", _, Ok(inode)) => pipes.push(inode),
            ("q", _, Ok(inode)) => pipes.retain(|&i| i != inode),
            ("m", _, _) => marks.push(number.to_string()),
            ("M", _, _) => marks.clear(),
            _ => {}
        }
    }
    for &pgid in &groups {
        // SAFETY: kill(2) has no memory-safety preconditions; the group is a
        // rank's, which the launcher listed and never took off (it did not
        // see it end). ESRCH (already gone) is fine.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let escaped = crate::escapees::kill(&pipes, &marks, &[]);
    // A rank killed while it set up its communicator leaves its shared-memory
    // file: once the ranks are gone (their files' locks with them), sweep.
    let killed: Vec<libc::pid_t> = groups.into_iter().chain(escaped.into_iter().map(|p| p as libc::pid_t)).collect();
    let end = Instant::now() + RANKS_END_LIMIT;
    while !killed.iter().all(|&p| ended(p)) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    crate::run::sweep_shared_memory();
    ExitCode::SUCCESS
}

/// Longest the reaper waits for the processes it killed to end before it
/// sweeps their shared memory (a process in the kernel may take a moment to
/// die; whatever is still held then is left for the next launcher's sweep).
const RANKS_END_LIMIT: Duration = Duration::from_secs(10);

/// Whether process `pid` has ended: gone, or a zombie (whose descriptors,
/// and the locks they held, are already released).
fn ended(pid: libc::pid_t) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}
