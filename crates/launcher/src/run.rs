//! `cohort run`: the whole life of a job on this node, attempt after attempt.

use std::process::ExitCode;
use std::time::Instant;

use cohort_runtime::private_fs::PrivateDir;
use crossbeam::channel::{Receiver, RecvTimeoutError};

use crate::cli::RunArgs;
use crate::config::{JobConfig, LaunchError};
use crate::rendezvous::{Rendezvous, Round};
use crate::run_file::{self, RunFile};
use crate::signals;
use crate::spawn::RankEnv;
use crate::summary::{signal_name, Verdict};
use crate::supervisor::{self, Event, Outcome};
use crate::{timings, trace, watchdog};

/// Exit code when the job ran past `--timeout` (as timeout(1) uses).
pub const TIMEOUT_EXIT: u8 = 124;

/// Runs `cohort run` and returns the launcher's exit code: 0 when every rank
/// of every node exited with 0; otherwise the first failing rank's own exit
/// code, 128 + N for a rank killed by signal N or a launcher interrupted by it,
/// [`TIMEOUT_EXIT`] past `--timeout`, and 1 for the launcher's own errors.
pub fn run(args: RunArgs) -> ExitCode {
    match run_job(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            say!("cohort: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run_job(args: RunArgs) -> Result<u8, LaunchError> {
    let start = Instant::now();
    let mut clock = timings::LaunchClock::start();
    let cfg = JobConfig::from_args(args)?;
    let deadline = cfg.timeout.map(|t| start + t);
    // Both folders are refused when another user owns them or may write
    // into them (they could read the ranks' output or plant links for cohort
    // to write through). The log folder is made 0700 where missing; the trace
    // folder only when a rank writes a dump, so a job that writes none leaves
    // no empty folder behind.
    if let Some(dir) = &cfg.log_dir {
        crate::output::open_log_dir(dir).map_err(|e| LaunchError::LogDir { path: dir.clone(), source: e.into() })?;
    }
    if std::fs::symlink_metadata(&cfg.trace_dir).is_ok() {
        PrivateDir::open(&cfg.trace_dir)
            .map_err(|e| LaunchError::TraceDir { path: cfg.trace_dir.clone(), source: e.into() })?;
    }
    // Several descriptors per local rank: past the usual soft limit at a
    // few hundred ranks (the ranks get the limit the launcher was given).
    if let Err(e) = crate::fd_limit::raise() {
        tracing::debug!(error = %e, "could not raise the limit on open files");
    }
    let (tx, rx) = crossbeam::channel::unbounded();
    signals::install(tx.clone()).map_err(LaunchError::Signals)?;
    crate::reaper::init();
    // What the ranks of a job whose launcher and reaper were both killed left.
    sweep_shared_memory();
    if let Some(n) = &cfg.omp_threads {
        say!(
            "cohort: OMP_NUM_THREADS is unset: setting it to {n} for the {} ranks of this node so they do not \
             overload its cores (export OMP_NUM_THREADS to choose)",
            cfg.nproc
        );
    }
    let rdzv = Rendezvous::start(&cfg, deadline)?;
    tracing::info!(port = rdzv.port(), nproc = cfg.nproc, "rendezvous store ready");
    clock.mark("store up");
    let _run_file = publish_run_file(&cfg, &cfg.store_addr(rdzv.port()));

    let mut attempt = 0;
    loop {
        // This node's part in the attempt (an elastic job's group changes).
        let cfg = match rdzv.begin(&cfg, attempt, tx.clone())? {
            Round::Member { position, members, attempt: joined } if cfg.elastic => {
                attempt = joined;
                if attempt > 0 || members < cfg.nnodes {
                    say!(
                        "cohort: attempt {attempt} runs on {members} node(s) ({} ranks); this node is node {position}",
                        members as usize * cfg.nproc
                    );
                }
                cfg.for_round(position, members)
            }
            Round::Member { .. } => cfg.clone(),
            Round::JobDone => {
                say!("cohort: the job finished before this node was needed");
                return Ok(0);
            }
        };
        let cfg = &cfg;
        trace::clear_dumps(&cfg.trace_dir);
        let env = RankEnv::new(cfg, rdzv.port(), attempt);
        let ranks = (0..cfg.nproc).map(|l| (RankEnv::global_rank(cfg, l), l)).collect();
        let dog =
            cfg.heartbeat_timeout.and_then(|limit| watchdog::start(rdzv.store(), ranks, attempt, limit, tx.clone()));
        signals::set_supervising(true);
        if cfg.timings {
            let mut clock = clock.clone();
            clock.mark("spawning ranks");
            timings::report_when_ready(rdzv.store(), clock, attempt);
        }
        let outcome = supervisor::run_attempt(cfg, &env, attempt, (&tx, &rx), deadline);
        drop(dog);
        let verdict = settle(&rdzv, cfg, attempt, outcome, &rx, deadline);
        signals::set_supervising(false);
        sweep_shared_memory();
        match verdict {
            Verdict::Ok => {
                tracing::info!(elapsed = ?start.elapsed(), "every rank exited with 0");
                rdzv.finish(attempt);
                return Ok(0);
            }
            Verdict::Failed { restartable, exit_code, summary } => {
                let recorded = trace::report(&cfg.trace_dir);
                if restartable && attempt < cfg.max_restarts {
                    say!("cohort: {summary}");
                    if let Some(r) = &recorded {
                        say!("cohort: {r}");
                    }
                    attempt += 1;
                    say!("cohort: restarting the whole group (restart {attempt} of {})", cfg.max_restarts);
                    continue;
                }
                say!("cohort: job failed: {summary}");
                if let Some(r) = &recorded {
                    say!("cohort: {r}");
                }
                if restartable && cfg.max_restarts > 0 {
                    say!("cohort: all {} restarts used", cfg.max_restarts);
                }
                rdzv.finish(attempt);
                return Ok(exit_code);
            }
        }
    }
}

/// Writes the run files by which `cohort status` with no flags finds this
/// job (see [`crate::run_file`]; removed when the returned value drops) and,
/// with `--timings`, says the `cohort status` line that shows it. A folder
/// that cannot be used is a warning: the job runs.
fn publish_run_file(cfg: &JobConfig, addr: &str) -> Option<RunFile> {
    match RunFile::publish(addr, &cfg.secret) {
        Ok(file) => {
            if cfg.timings {
                say!("cohort: where the ranks are: {}", run_file::status_line(addr, &file.secret_path()));
            }
            Some(file)
        }
        Err(e) => {
            say!("cohort: warning: `cohort status` without flags will not find this job: {e}");
            if cfg.timings {
                say!(
                    "cohort: where the ranks are: {}=<the job's secret> cohort status --store-addr {addr}",
                    cohort_runtime::config::JOB_SECRET.name
                );
            }
            None
        }
    }
}

/// Removes the shared-memory files that ranks killed during set-up left in
/// `/dev/shm`: this node's, once its ranks have ended, and a dead job's.
/// Only files no live process holds are removed (see
/// [`cohort_comm::sweep_shared_memory`]), so another job's live ranks keep
/// theirs. For the launcher (when it starts, after each attempt) and its
/// reaper (once the launcher is gone).
pub fn sweep_shared_memory() {
    match cohort_comm::sweep_shared_memory() {
        Ok(0) => {}
        Ok(n) => tracing::info!("removed {n} shared-memory file(s) that dead ranks left in /dev/shm"),
        Err(e) => tracing::debug!("could not look for shared-memory files that dead ranks left in /dev/shm: {e}"),
    }
}

/// Turns how this node's attempt ended into the job's verdict: reports it to
/// the store, then waits for the verdict every node agrees on (the first
/// failure reported anywhere, or `ok` once every node succeeded).
fn settle(
    rdzv: &Rendezvous,
    cfg: &JobConfig,
    attempt: u32,
    outcome: Outcome,
    events: &Receiver<Event>,
    deadline: Option<Instant>,
) -> Verdict {
    let node = cfg.node_rank;
    let local = match outcome {
        Outcome::Success => {
            if let Err(e) = rdzv.report_success(attempt) {
                return lost_store(e.to_string());
            }
            None
        }
        Outcome::Failed(f) => {
            Some(Verdict::Failed { restartable: true, exit_code: f.ending.launcher_code(), summary: f.summary() })
        }
        Outcome::Unresponsive(f, silent) => {
            Some(Verdict::Failed { restartable: true, exit_code: 1, summary: f.unresponsive_summary(silent) })
        }
        Outcome::Interrupted(sig) => Some(interrupted(sig, node)),
        Outcome::TimedOut(running, stopped) => Some(timed_out(cfg, &running, &stopped)),
        Outcome::SpawnFailed(msg) => Some(Verdict::Failed { restartable: false, exit_code: 1, summary: msg }),
        Outcome::Verdict(Ok(bytes)) => return Verdict::decode(&bytes),
        Outcome::Verdict(Err(e)) => return lost_store(e),
    };
    if let Some(v) = &local {
        // The first failure reported anywhere is the verdict. (Waiting for
        // the watcher to relay it could wait forever: the supervisor may
        // have taken its event while it stopped the ranks.)
        return match rdzv.report_failure(attempt, v) {
            Ok(verdict) => verdict,
            Err(e) => {
                tracing::warn!("could not report the failure to the other nodes: {e}");
                v.clone()
            }
        };
    }
    // This node succeeded: wait for the verdict, which the watcher thread
    // relays. Another node may still be running: signals and the deadline
    // still count (and fail the job).
    loop {
        let event = match deadline {
            Some(d) => events.recv_deadline(d),
            None => events.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let failure = match event {
            Ok(Event::Verdict { attempt: a, result }) if a == attempt => {
                return match result {
                    Ok(bytes) => Verdict::decode(&bytes),
                    Err(e) => lost_store(e),
                };
            }
            Ok(Event::Signal(sig)) => interrupted(sig, node),
            Ok(_) => continue,
            Err(RecvTimeoutError::Timeout) => timed_out(cfg, &[], &[]),
            Err(RecvTimeoutError::Disconnected) => return lost_store("".into()),
        };
        return match rdzv.report_failure(attempt, &failure) {
            Ok(verdict) => verdict,
            Err(e) => lost_store(e.to_string()),
        };
    }
}

fn interrupted(sig: libc::c_int, node: u32) -> Verdict {
    Verdict::Failed {
        restartable: false,
        exit_code: 128u8.saturating_add(sig as u8),
        summary: format!("the launcher of node {node} got {} and stopped its ranks", signal_name(sig)),
    }
}

fn timed_out(cfg: &JobConfig, running: &[usize], stopped: &[usize]) -> Verdict {
    let secs = cfg.timeout.map_or(0.0, |t| t.as_secs_f64());
    let mut who = still_running(running);
    for rank in stopped {
        who.push_str(&format!("; rank {rank} was itself stopped (SIGSTOP, Ctrl-Z or a debugger) when time ran out"));
    }
    Verdict::Failed {
        restartable: false,
        exit_code: TIMEOUT_EXIT,
        summary: format!("the job ran past --timeout {secs} s on node {}: {who}", cfg.node_rank),
    }
}

/// What a timeout found of this node's ranks still `running`, in words.
fn still_running(running: &[usize]) -> String {
    match running {
        [] => "its ranks had finished but other nodes' had not".to_string(),
        [rank] => format!("rank {rank} was still running and was stopped"),
        _ => format!("ranks {} were still running and were stopped", join(running)),
    }
}

fn lost_store(why: String) -> Verdict {
    Verdict::Failed {
        restartable: false,
        exit_code: 1,
        summary: format!(
            "lost the rendezvous store, and with it contact with the other launchers: {why}; the ranks were stopped"
        ),
    }
}

fn join(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_timeout_counts_the_ranks_it_stopped() {
        assert_eq!(super::still_running(&[0]), "rank 0 was still running and was stopped");
        assert_eq!(super::still_running(&[0, 3]), "ranks 0, 3 were still running and were stopped");
        assert!(super::still_running(&[]).contains("other nodes'"));
    }
}
