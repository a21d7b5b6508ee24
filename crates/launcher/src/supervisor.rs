//! Running one attempt of this node's ranks: spawn them, watch them, and stop
//! them all as soon as one fails, a signal comes, the job times out or
//! another node says the job failed.

use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use crate::config::JobConfig;
use crate::output::{self, Sinks, Stream, Tail};
use crate::spawn::{self, RankEnv};
use crate::summary::{EarlyExit, Ending, Failure};

/// Time a rank gets between SIGTERM and SIGKILL when the launcher stops it.
pub const STOP_GRACE: Duration = Duration::from_secs(3);
/// Time ranks get to exit after a forwarded SIGINT/SIGTERM/SIGHUP before
/// SIGKILL (a second signal kills at once).
pub const SIGNAL_GRACE: Duration = Duration::from_secs(30);
/// Time ranks that heartbeat get to write their flight recorders (asked
/// with SIGUSR1) before the launcher stops them.
pub const DUMP_GRACE: Duration = Duration::from_millis(500);
/// Once every rank exited: how long the readers may copy nothing (and write
/// nothing) before the launcher stops waiting for them: the pipes are then
/// held open by processes that escaped their group. A reader that is busy
/// writing to a slow console is waited for, however long it takes.
const DRAIN_IDLE: Duration = Duration::from_secs(2);
/// Once every rank exited and its group was killed: how long the readers
/// may take to reach the end of the pipes before the launcher looks for
/// processes that left the ranks' groups holding them (and kills them).
const ESCAPEE_GRACE: Duration = Duration::from_millis(300);

/// Something the supervisor reacts to; every source sends on one channel.
#[derive(Debug)]
pub enum Event {
    /// A rank of `attempt` ended.
    Exited {
        /// The attempt the rank belongs to.
        attempt: u32,
        /// Its local rank.
        local_rank: usize,
        /// How it ended.
        status: ExitStatus,
    },
    /// The launcher received this signal.
    Signal(libc::c_int),
    /// A rank of `attempt` sent its first heartbeat (it runs a
    /// Communicator, which writes its flight recorder on SIGUSR1).
    Beating {
        /// The attempt the rank belongs to.
        attempt: u32,
        /// Its local rank.
        local_rank: usize,
    },
    /// A rank of `attempt` stopped heartbeating for `silent`.
    Silent {
        /// The attempt the rank belongs to.
        attempt: u32,
        /// Its local rank.
        local_rank: usize,
        /// How long it has been silent.
        silent: Duration,
    },
    /// The job's verdict for `attempt` appeared in the store (`Err`: the
    /// store could not be asked, with why).
    Verdict {
        /// The attempt it is about.
        attempt: u32,
        /// The stored verdict's bytes, or why it could not be read.
        result: Result<Vec<u8>, String>,
    },
}

/// How this node's attempt ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every local rank exited with code 0.
    Success,
    /// A local rank failed first; the others were stopped.
    Failed(Failure),
    /// The launcher got this signal and forwarded it.
    Interrupted(libc::c_int),
    /// The job ran past `--timeout`; these global ranks were still running,
    /// and those of the second list were stopped (SIGSTOP, a debugger).
    TimedOut(Vec<usize>, Vec<usize>),
    /// A local rank could not be started.
    SpawnFailed(String),
    /// A local rank stopped heartbeating (stopped, frozen); it was killed
    /// and the others stopped. `ending` says how it ended.
    Unresponsive(Failure, Duration),
    /// The job's verdict arrived from the store before the ranks were done
    /// (another node failed, or the store went away): the ranks were stopped.
    Verdict(Result<Vec<u8>, String>),
}

struct RankProc {
    rank: usize,
    local_rank: usize,
    pid: u32,
    started: Instant,
    ended: Option<(Ending, Instant)>,
    tail: Tail,
    /// The inodes of its stdout and stderr pipes.
    pipes: Vec<u64>,
    /// It heartbeats: it handles SIGUSR1 by writing its flight recorder.
    beating: bool,
}

/// Spawns the node's ranks for `attempt` and returns once every one of them
/// has exited and its output has been copied.
///
/// Must run on the main thread (see [`spawn::spawn_rank`]). Events of other
/// attempts that are still in the channel are skipped.
pub fn run_attempt(
    cfg: &JobConfig,
    env: &RankEnv,
    attempt: u32,
    events: (&Sender<Event>, &Receiver<Event>),
    deadline: Option<Instant>,
) -> Outcome {
    let (tx, rx) = events;
    let (done_tx, done_rx) = crossbeam::channel::bounded::<()>(0);
    let mut ranks: Vec<RankProc> = Vec::with_capacity(cfg.nproc);
    let mut reason: Option<Reason> = None;
    let activity = output::Activity::default();
    // A control group's pids.max binds root too, and changes while the
    // launcher waits: counted here, before any rank starts.
    if let Err(msg) = crate::process_limit::check_room(cfg.nproc, crate::process_limit::pids_limit().as_ref()) {
        return Outcome::SpawnFailed(msg);
    }
    // The node's ranks reach the store through one relay (it joins the
    // store while they start); it lives until they have all exited.
    let (relay, mut ends) = spawn::start_relay(cfg, env);
    crate::reaper::watch_marks(&env.marks());

    // Events that come while ranks are still being started: a signal or a
    // rank that already failed stops the starting (a node of many ranks
    // takes a while to start), and every event is handled below, in order.
    let mut early = std::collections::VecDeque::new();
    for local_rank in 0..cfg.nproc {
        while let Ok(event) = rx.try_recv() {
            early.push_back(event);
        }
        if early.iter().any(|e| stops_starting(e, attempt)) {
            tracing::debug!(started = ranks.len(), "stopped starting ranks: a signal came or a rank failed");
            break;
        }
        let rank = RankEnv::global_rank(cfg, local_rank);
        let mine = ends.get_mut(local_rank).map(std::mem::take).unwrap_or_default();
        match start_rank(cfg, env, attempt, (rank, local_rank, mine), tx, &done_tx, &activity) {
            Ok(p) => ranks.push(p),
            Err(msg) => {
                reason = Some(Reason::SpawnFailed(msg));
                break;
            }
        }
    }
    drop(done_tx);
    let mut kill_at = None;
    let mut term_at = None;
    if reason.is_some() {
        signal_live(&ranks, libc::SIGTERM);
        kill_at = Some(Instant::now() + STOP_GRACE);
    }

    let mut live = ranks.len();
    let mut verdict_seen = None;
    // When the attempt began to stop (for a rank's failure, a timeout, a
    // signal or another node's verdict).
    let mut stopping_at = reason.is_some().then(Instant::now);
    while live > 0 || !early.is_empty() {
        let wake = [kill_at, term_at, reason.is_none().then_some(deadline).flatten()].into_iter().flatten().min();
        let event = match (early.pop_front(), wake) {
            (Some(event), _) => Ok(event),
            (None, Some(t)) => rx.recv_deadline(t),
            (None, None) => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let now = Instant::now();
        match event {
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                if kill_at.is_some_and(|k| now >= k) {
                    signal_live(&ranks, libc::SIGKILL);
                    kill_at = None;
                } else if term_at.is_some_and(|t| now >= t) {
                    signal_live(&ranks, libc::SIGTERM);
                    term_at = None;
                    kill_at = Some(now + STOP_GRACE);
                } else if reason.is_none() && deadline.is_some_and(|d| now >= d) {
                    let running = ranks.iter().filter(|r| r.ended.is_none());
                    let stopped = running.clone().filter(|r| is_stopped(r.pid)).map(|r| r.rank).collect();
                    reason = Some(Reason::TimedOut(running.map(|r| r.rank).collect(), stopped));
                    term_at = Some(ask_dumps(&ranks, now));
                }
            }
            Ok(Event::Exited { attempt: a, local_rank, status }) if a == attempt => {
                // Its store sessions end now: a process it started may hold
                // its relay sockets open, which would keep them open.
                if let Some(relay) = &relay {
                    let per_rank = spawn::RELAY_SOCKETS_PER_RANK;
                    relay.rank_exited(local_rank * per_rank..(local_rank + 1) * per_rank);
                }
                let p = &mut ranks[local_rank];
                let ending = Ending::of(status);
                p.ended = Some((ending, now));
                live -= 1;
                tracing::debug!(rank = p.rank, %ending, "rank ended");
                if !ending.success() && reason.is_none() {
                    reason = Some(Reason::Failed(local_rank));
                    term_at = Some(ask_dumps(&ranks, now));
                }
            }
            Ok(Event::Exited { .. }) => {}
            Ok(Event::Beating { attempt: a, local_rank }) if a == attempt => ranks[local_rank].beating = true,
            Ok(Event::Silent { attempt: a, local_rank, silent }) if a == attempt => {
                let p = &ranks[local_rank];
                if reason.is_none() && p.ended.is_none() {
                    say!(
                        "cohort: rank {} sent no heartbeat for {:.1} s (stopped or frozen?): stopping the job",
                        p.rank,
                        silent.as_secs_f64()
                    );
                    reason = Some(Reason::Unresponsive(local_rank, silent));
                    // It cannot write its recorder nor handle SIGTERM.
                    kill_group(p.pid, libc::SIGKILL);
                    term_at = Some(ask_dumps(&ranks, now));
                }
            }
            Ok(Event::Beating { .. } | Event::Silent { .. }) => {}
            Ok(Event::Signal(sig)) => {
                if matches!(reason, None | Some(Reason::TimedOut(..))) {
                    say!(
                        "cohort: got {}; forwarding it to the ranks (again to kill them)",
                        crate::summary::signal_name(sig)
                    );
                    reason = Some(Reason::Interrupted(sig));
                    signal_live(&ranks, sig);
                    term_at = None;
                    kill_at = Some(now + SIGNAL_GRACE);
                } else {
                    signal_live(&ranks, libc::SIGKILL);
                    kill_at = None;
                }
            }
            Ok(Event::Verdict { attempt: a, result }) if a == attempt => {
                if reason.is_none() {
                    reason = Some(Reason::Verdict);
                    term_at = Some(ask_dumps(&ranks, now));
                }
                verdict_seen = Some(result);
            }
            Ok(Event::Verdict { .. }) => {}
        }
        if reason.is_some() && stopping_at.is_none() {
            stopping_at = Some(now);
        }
    }

    // Whatever the ranks started in their groups goes with them.
    for p in &ranks {
        kill_group(p.pid, libc::SIGKILL);
        crate::reaper::forget(p.pid);
    }
    // Every reader holds a `done` sender: disconnection means all finished.
    let held = done_rx.recv_timeout(ESCAPEE_GRACE) == Err(RecvTimeoutError::Timeout);
    kill_escapees(&ranks, held, &env.marks());
    drain(&done_rx, &activity);
    for p in &ranks {
        crate::reaper::forget_pipes(&p.pipes);
    }
    // Stopped for a cause of no rank of this node: a rank that had left
    // with code 0 while others still ran may be why they did not finish.
    if let (Some(at), Some(Reason::TimedOut(..) | Reason::Interrupted(_) | Reason::Verdict)) = (stopping_at, &reason) {
        let left = exited_ok_by(&ranks, at);
        if !left.is_empty() && ranks.iter().any(|r| r.ended.is_none_or(|(_, t)| t > at)) {
            say!("cohort: {}", crate::summary::left_before_the_stop(&left));
        }
    }

    match reason {
        None => Outcome::Success,
        Some(Reason::Failed(local)) => Outcome::Failed(failure(cfg, &ranks, local)),
        Some(Reason::Unresponsive(local, silent)) => Outcome::Unresponsive(failure(cfg, &ranks, local), silent),
        Some(Reason::Interrupted(sig)) => Outcome::Interrupted(sig),
        Some(Reason::TimedOut(running, stopped)) => Outcome::TimedOut(running, stopped),
        Some(Reason::SpawnFailed(msg)) => Outcome::SpawnFailed(msg),
        Some(Reason::Verdict) => Outcome::Verdict(verdict_seen.expect("the verdict that stopped the ranks")),
    }
}

/// Kills the processes that left the ranks' process groups (setsid, a
/// daemon) and carry the attempt's `marks` in their environment or, when
/// the output pipes are `held` open still, hold them (which would keep the
/// readers, and the launcher, waiting); says which.
fn kill_escapees(ranks: &[RankProc], held: bool, marks: &[String]) {
    let inodes: Vec<u64> = ranks.iter().filter(|_| held).flat_map(|p| p.pipes.iter().copied()).collect();
    let groups: Vec<u32> = ranks.iter().map(|p| p.pid).collect();
    let killed = crate::escapees::kill(&inodes, marks, &groups);
    if !killed.is_empty() {
        say!(
            "cohort: killed process(es) {} after the ranks exited: they had left their rank's process group \
             (setsid, a daemon) and still held its output or carried its environment",
            killed.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
        );
    }
}

/// Waits until every reader has copied its pipe to the end, however slow
/// the console; gives up only when none copied or wrote anything for
/// [`DRAIN_IDLE`] (an escaped process holds a pipe open and is silent).
fn drain(done: &Receiver<()>, activity: &output::Activity) {
    let mut seen = activity.copied();
    loop {
        match done.recv_timeout(DRAIN_IDLE) {
            Err(RecvTimeoutError::Timeout) => {
                let now = activity.copied();
                if now == seen && !activity.writing() {
                    tracing::warn!(
                        "stopped waiting for the ranks' output: a process they started holds their pipes open \
                         and has written nothing for {DRAIN_IDLE:?}"
                    );
                    return;
                }
                seen = now;
            }
            _ => return,
        }
    }
}

/// The failure of local rank `local`, with the ranks that had exited with
/// code 0 before it and, when some had, where the ranks parted (from their
/// flight recorders, which are written by now).
fn failure(cfg: &JobConfig, ranks: &[RankProc], local: usize) -> Failure {
    let p = &ranks[local];
    let (ending, at) = p.ended.expect("a failed rank has ended");
    let left = exited_ok_by(ranks, at);
    let parted_in = if left.is_empty() { None } else { crate::trace::parting(&cfg.trace_dir) };
    Failure {
        rank: p.rank,
        local_rank: p.local_rank,
        node_rank: cfg.node_rank,
        pid: p.pid,
        ending,
        after: at - p.started,
        tail: p.tail.lines(),
        world_size: cfg.world_size(),
        left_early: left,
        parted_in,
    }
}

/// The ranks that had exited with code 0 by `at`, in the order they exited.
fn exited_ok_by(ranks: &[RankProc], at: Instant) -> Vec<EarlyExit> {
    let mut left: Vec<(Instant, EarlyExit)> = ranks
        .iter()
        .filter_map(|r| match r.ended {
            Some((e, t)) if e.success() && t <= at => {
                Some((t, EarlyExit { rank: r.rank, local_rank: r.local_rank, pid: r.pid, after: t - r.started }))
            }
            _ => None,
        })
        .collect();
    left.sort_by_key(|(t, _)| *t);
    left.into_iter().map(|(_, e)| e).collect()
}

/// Asks every live rank that heartbeats to write its flight recorder
/// (SIGUSR1, to the rank's process only) and returns when to stop them; at
/// once where none does.
fn ask_dumps(ranks: &[RankProc], now: Instant) -> Instant {
    let mut asked = false;
    for p in ranks.iter().filter(|p| p.ended.is_none() && p.beating) {
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is a
        // rank we spawned and have not reaped (it has not ended).
        unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGUSR1) };
        asked = true;
    }
    if asked {
        now + DUMP_GRACE
    } else {
        now
    }
}

/// Whether process `pid` is stopped (SIGSTOP, Ctrl-Z) or held by a
/// debugger: state `T` or `t` in `/proc/<pid>/stat`.
fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The name before the state is in parentheses and may hold any byte.
    stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with(['T', 't']))
}

/// Whether `event`, come while the ranks of `attempt` are being started,
/// means no more should start: the launcher got a signal, or a started rank
/// failed (a rank of an earlier attempt does not count).
fn stops_starting(event: &Event, attempt: u32) -> bool {
    match event {
        Event::Signal(_) => true,
        Event::Exited { attempt: a, status, .. } => *a == attempt && !status.success(),
        _ => false,
    }
}

/// Why the attempt is being stopped.
enum Reason {
    Failed(usize),
    Unresponsive(usize, Duration),
    Interrupted(libc::c_int),
    TimedOut(Vec<usize>, Vec<usize>),
    SpawnFailed(String),
    Verdict,
}

fn start_rank(
    cfg: &JobConfig,
    env: &RankEnv,
    attempt: u32,
    (rank, local_rank, store_ends): (usize, usize, Vec<std::os::unix::net::UnixStream>),
    events: &Sender<Event>,
    done: &Sender<()>,
    activity: &output::Activity,
) -> Result<RankProc, String> {
    let sinks = Sinks {
        prefix: Arc::from(format!("[rank {rank}]: ").into_bytes()),
        console: (cfg.log_dir.is_none() || cfg.tee) && cfg.filter.as_ref().is_none_or(|f| f.contains(&local_rank)),
        log_dir: cfg.log_dir.as_ref().map(|d| output::rank_log_dir(d, attempt, rank)),
        tail: Tail::default(),
        activity: activity.clone(),
    };
    let (out_file, err_file) = sinks.open_files().map_err(|e| {
        let folder = sinks.log_dir.as_deref().map_or(String::new(), |d| format!(" in {}", d.display()));
        format!(
            "cannot create the log files of rank {rank}{folder}: {e}; fix that folder (its space, its owner, what \
             is in its way) or choose another --log-dir"
        )
    })?;
    let started = Instant::now();
    // The launcher's copies of the rank's relay sockets are closed once the
    // rank has its own, so the relay sees the rank's exit.
    let spawned = spawn::spawn_rank(&cfg.program, env, rank, local_rank, &store_ends);
    drop(store_ends);
    let mut child = spawned.map_err(|e| spawn_error(&cfg.program[0].to_string_lossy(), rank, &e))?;
    let pid = child.id();
    crate::reaper::watch(pid);
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let pipes = [crate::escapees::pipe_inode(&stdout), crate::escapees::pipe_inode(&stderr)];
    let pipes: Vec<u64> = pipes.into_iter().filter_map(Result::ok).collect();
    crate::reaper::watch_pipes(&pipes);
    let threads = output::spawn_reader(stdout, Stream::Stdout, &sinks, out_file, done.clone())
        .and_then(|_| output::spawn_reader(stderr, Stream::Stderr, &sinks, err_file, done.clone()));
    let tx = events.clone();
    let waiter = threads.and_then(|_| {
        std::thread::Builder::new().name(format!("cohort-wait-{rank}")).spawn(move || {
            let status = child.wait().expect("waiting on our own child cannot fail");
            let _ = tx.send(Event::Exited { attempt, local_rank, status });
        })
    });
    if let Err(e) = waiter {
        // Out of threads: the rank cannot be watched, so it must not run.
        kill_group(pid, libc::SIGKILL);
        crate::reaper::forget(pid);
        return Err(format!("cannot start the threads that watch rank {rank}: {e}{}", what_to_do(&e, "")));
    }
    Ok(RankProc { rank, local_rank, pid, started, ended: None, tail: sinks.tail, pipes, beating: false })
}

/// Why `program` could not start as `rank`, and what to do (its name's
/// control characters escaped).
fn spawn_error(program: &str, rank: usize, e: &std::io::Error) -> String {
    let otherwise = "; check the program's path and permissions";
    let program = cohort_comm::trace::printable(program);
    format!("cannot start `{program}` as rank {rank}: {e}{}", what_to_do(e, otherwise))
}

/// What to do about `e`, an error starting a rank or its threads: for
/// EAGAIN (fork's and a thread's answer at the limit on processes), which
/// limit was reached; else `otherwise`.
fn what_to_do(e: &std::io::Error, otherwise: &str) -> String {
    if e.raw_os_error() != Some(libc::EAGAIN) {
        return otherwise.to_string();
    }
    format!(
        ": this node's limit on processes and threads was reached: {}; lower -n, end other processes, or raise \
         the limit",
        crate::process_limit::describe()
    )
}

/// Sends `sig` to the process group of every rank still running; a
/// SIGTERM is followed by SIGCONT, so a stopped rank (SIGSTOP, Ctrl-Z) acts
/// on it at once instead of at the SIGKILL.
fn signal_live(ranks: &[RankProc], sig: libc::c_int) {
    for p in ranks.iter().filter(|p| p.ended.is_none()) {
        kill_group(p.pid, sig);
        if sig == libc::SIGTERM {
            kill_group(p.pid, libc::SIGCONT);
        }
    }
}

/// Sends `sig` to the process group that `pid` leads.
fn kill_group(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions. The group id is the
    // pid of a rank we spawned as its group's leader; ESRCH (already gone) is
    // fine to ignore.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawn_refused_for_want_of_processes_names_the_limit_not_the_path() {
        let msg = spawn_error("./train", 3, &std::io::Error::from_raw_os_error(libc::EAGAIN));
        assert!(msg.starts_with("cannot start `./train` as rank 3: Resource temporarily unavailable"), "{msg}");
        assert!(msg.contains("limit on processes and threads was reached"), "{msg}");
        assert!(msg.contains("RLIMIT_NPROC") && msg.contains("pids.max"), "{msg}");
        assert!(!msg.contains("path"), "EAGAIN is no fault of the program's path: {msg}");
        let msg = spawn_error("./train", 3, &std::io::Error::from_raw_os_error(libc::ENOENT));
        assert!(msg.ends_with("check the program's path and permissions"), "{msg}");
        // A name with control characters reaches the console escaped.
        let msg = spawn_error("\x1b[2J./x\n", 0, &std::io::Error::from_raw_os_error(libc::ENOENT));
        assert!(msg.starts_with("cannot start `\\u{1b}[2J./x\\n` as rank 0"), "{msg}");
    }
}
