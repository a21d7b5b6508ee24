//! What a communicator tells about itself while it runs: every collective
//! into the process's [`FlightRecorder`] (and the `COHORT_TIMELINE` trace),
//! a heartbeat in the store, and an abort for the other ranks when a local
//! part fails before the exchange began.
//!
//! The heartbeat thread writes the launcher's `cohort/heartbeat/<RANK>`
//! every period, even while collectives wait, and this rank's progress
//! (`hb/<r>`) and current call (`call/<r>`: sequence number, kind, bytes,
//! since when; read by `cohort status`) when they change, at most every
//! 50 ms; its store connection's
//! will sets `gone/<r>`, so peers waiting on this rank's bytes stop at once
//! when its process dies (see [`keys`](super::keys)).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{RecvTimeoutError, Sender};

use crate::op::Op;
use crate::store::StoreClient;
use crate::trace::{CollectiveFingerprint, FlightRecorder, Ranks, Row, Watched};

use super::error::ConnectError;
use super::failure::Failure;
use super::fingerprint::Fingerprint;
use super::keys::{self, job_heartbeat_key, CurrentCall};
use super::local::{PerCall, Staged, Views};
use super::plans;
use super::world::World;

/// How often a rank's heartbeat thread bumps its counter in the store.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_secs(1);

/// The shortest time between two writes of the communicator's progress
/// (each call wakes the heartbeat thread): at most 20 store writes a second
/// per rank, however fast collectives go.
const PROGRESS_GAP: Duration = Duration::from_millis(50);

/// The rank and world size of the job (`RANK`, `WORLD_SIZE`), falling back to
/// the communicator's when the process has none.
fn job_identity(rank: usize, size: usize) -> (usize, usize) {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<usize>().ok());
    match (var("RANK"), var("WORLD_SIZE")) {
        (Some(r), Some(w)) if r < w => (r, w),
        _ => (rank, size),
    }
}

/// What every tracked call shares.
struct Shared {
    /// The recorder's group name (`comm<k>`, `comm<k>.s<n>c<color>`), the
    /// same on every rank.
    group: Arc<str>,
    /// Its ranks' job ranks: the ranks of its records.
    label: super::label::Label,
    /// The ranks its collectives' records name: a split group's, or every
    /// rank of the job's communicator.
    record_ranks: Ranks,
    rank: usize,
    /// The job rank (timeline rows).
    job_rank: usize,
    /// Last collective called / finished (not counting send/recv).
    issued: AtomicU64,
    finished: AtomicU64,
    /// The communicator's store connection, for aborts raised outside the
    /// exchange.
    store: Arc<StoreClient>,
    prefix: String,
    aborted: AtomicBool,
    /// Wakes the heartbeat thread to report progress (never blocks).
    poke: Sender<()>,
    /// The last collective called, for `cohort status` (written beside the
    /// progress when it changes).
    current: parking_lot::Mutex<Option<CurrentCall>>,
}

/// A communicator's observer: the heartbeat and the recorder's group.
pub(crate) struct Observer {
    shared: Arc<Shared>,
    /// Dropping it stops the heartbeat thread.
    _stop: Sender<()>,
}

impl Observer {
    /// Starts the heartbeat of `rank` of communicator `prefix` (on its own
    /// store connection, whose will sets `gone/<rank>`), installs the
    /// SIGUSR1 dump and names the recorder's dumps after the job's rank.
    pub(crate) fn start(world: &World) -> Result<Observer, ConnectError> {
        let (rank, size, prefix) = (world.rank, world.size, world.prefix().to_string());
        let job_rank = if world.label.split {
            world.label.global(rank)
        } else {
            let (job_rank, job_size) = job_identity(rank, size);
            FlightRecorder::global().set_identity(job_rank, job_size);
            job_rank
        };
        crate::trace::install_dump_on_signal();
        let beat = world.store().duplicate()?;
        beat.set_will(&keys::gone(&prefix, rank), b"its store connection closed")?;
        let (poke, poked) = crossbeam::channel::bounded::<()>(1);
        let shared = Arc::new(Shared {
            poke,
            group: Arc::from(world.label.name.as_str()),
            // A group's records name its ranks, so the merge expects only
            // them; a job's communicator is every rank.
            record_ranks: match world.label.split {
                true => Ranks::Listed(world.label.ranks.as_slice().into()),
                false => Ranks::Every,
            },
            label: world.label.clone(),
            rank,
            job_rank,
            issued: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            store: world.shared_store(),
            prefix,
            aborted: AtomicBool::new(false),
            current: parking_lot::Mutex::new(None),
        });
        let (stop, stopped) = crossbeam::channel::bounded::<()>(0);
        let s = shared.clone();
        std::thread::Builder::new()
            .name(format!("cohort-heartbeat-{rank}"))
            .spawn(move || {
                let job_key = job_heartbeat_key(s.job_rank);
                let mine = keys::progress(&s.prefix, s.rank);
                let call_key = keys::call_key(&s.prefix, s.rank);
                let mut call_reported = 0u64;
                let pid = std::process::id();
                let (mut beats, mut last_beat, mut reported) = (0u64, None::<Instant>, String::new());
                loop {
                    let progress =
                        keys::progress_value(s.issued.load(Ordering::Relaxed), s.finished.load(Ordering::Relaxed));
                    let mut sent = Ok(());
                    if last_beat.is_none_or(|t| t.elapsed() >= HEARTBEAT_PERIOD) {
                        beats += 1;
                        last_beat = Some(Instant::now());
                        let now_ms = crate::trace::now_micros() / 1000;
                        sent = beat.set(&job_key, format!("{pid} {beats} {now_ms}").as_bytes());
                    }
                    if sent.is_ok() && progress != reported {
                        // The call first: a reader that sees the progress
                        // move finds the call it moved to.
                        let call = s.current.lock().clone();
                        if let Some(call) = call.filter(|c| c.seq != call_reported) {
                            call_reported = call.seq;
                            sent = beat.set(&call_key, call.encode().as_bytes());
                        }
                        if sent.is_ok() {
                            sent = beat.set(&mine, progress.as_bytes());
                        }
                        reported = progress;
                    }
                    if let Err(err) = sent {
                        tracing::error!(rank = s.rank, "heartbeat: lost the rendezvous store: {err}");
                        return;
                    }
                    if !matches!(stopped.recv_timeout(PROGRESS_GAP), Err(RecvTimeoutError::Timeout)) {
                        break;
                    }
                    let next_beat =
                        HEARTBEAT_PERIOD.saturating_sub(last_beat.map_or(HEARTBEAT_PERIOD, |t| t.elapsed()));
                    crossbeam::channel::select! {
                        recv(stopped) -> _ => break,
                        recv(poked) -> _ => {}
                        default(next_beat) => {}
                    }
                }
                let _ = beat.set(&keys::gone(&s.prefix, s.rank), b"it closed its communicator");
            })
            .map_err(|e| ConnectError::Setup(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(Observer { shared, _stop: stop })
    }

    /// Records that collective `fp` was queued (on `path`, where it is
    /// known already) and returns its tracker, to run the exchange through.
    pub(crate) fn queued(&self, fp: Fingerprint, path: Option<&'static str>) -> Tracker {
        let s = &self.shared;
        let (group, ranks) = match fp.op.endpoints() {
            Some((from, to)) => {
                let (from, to) = (s.label.global(from), s.label.global(to));
                (s.group.clone(), Ranks::Message(from, to))
            }
            None => {
                let call = CurrentCall {
                    seq: fp.seq,
                    kind: fp.op.name().into(),
                    bytes: fp.op.block_bytes() as u64,
                    since_ms: crate::trace::now_micros() / 1000,
                };
                *s.current.lock() = Some(call);
                s.issued.fetch_max(fp.seq, Ordering::Relaxed);
                let _ = s.poke.try_send(());
                (s.group.clone(), s.record_ranks.clone())
            }
        };
        let category = if fp.is_p2p() { "p2p" } else { "collective" };
        let watched = match fp.group {
            None => Watched::start(&group, fp.seq, &fp.op, 1, ranks, Row { category, tid: 0 }, path),
            Some(g) => {
                let described = CollectiveFingerprint {
                    seq: fp.seq,
                    kind: "group".into(),
                    op: None,
                    dtype: "calls".into(),
                    count: u64::from(g.calls),
                    root: None,
                };
                Watched::start_described(&group, described, 1, ranks, Row { category, tid: 0 }, path)
            }
        };
        Tracker { shared: s.clone(), watched: Some(watched), fp }
    }
}

/// One queued collective: its flight record and timeline event (through
/// [`Watched`]), this rank's progress, and on failure the recorder's dump;
/// dropped without running (a local part failed first), it aborts the
/// communicator for the other ranks.
pub(crate) struct Tracker {
    shared: Arc<Shared>,
    /// Taken when it ended.
    watched: Option<Arc<Watched>>,
    fp: Fingerprint,
}

impl Tracker {
    /// Runs the exchange (the leader's plan) and records how it ended.
    pub(crate) fn run(self, world: &mut World, views: Views) -> Result<Staged, String> {
        let result = plans::run(world, self.fp, views);
        self.ended(result.as_ref().map(|_| ()).map_err(Clone::clone));
        result.map_err(|failure| failure.message)
    }

    /// Runs a grouped call's exchange (its calls `ops`, one [`Views`] each)
    /// and records how it ended.
    pub(crate) fn run_group(
        self,
        world: &mut World,
        ops: &[Op],
        views: PerCall<Views>,
    ) -> Result<PerCall<Staged>, String> {
        let result = plans::run_group(world, self.fp, ops, views);
        self.ended(result.as_ref().map(|_| ()).map_err(Clone::clone));
        result.map_err(|failure| failure.message)
    }

    /// Notes which path runs the call (`nccl`, `nccl fused`, `oneshot`,
    /// `twoshot`), for the flight recorder and the timeline.
    pub(crate) fn set_path(&self, path: &'static str) {
        if let Some(watched) = &self.watched {
            watched.set_path(path);
        }
    }

    /// Records how the collective ended (the NCCL path calls it when its
    /// last local part ended on the device): the recorder and timeline,
    /// progress for the heartbeat, and on failure the recorder's dump.
    pub(crate) fn ended(mut self, outcome: Result<(), Failure>) {
        if let Some(watched) = self.watched.take() {
            watched.ended(outcome.clone().map_err(|failure| failure.message));
        }
        if !self.fp.is_p2p() && outcome.is_ok() {
            self.shared.finished.fetch_max(self.fp.seq, Ordering::Relaxed);
        }
        if let Err(failure) = &outcome {
            // The first failure writes the recorder; later calls are refused
            // at once (the communicator is aborted) and add nothing to it.
            if !self.shared.aborted.swap(true, Ordering::Relaxed) {
                FlightRecorder::global().write_default(failure.kind.dump_reason());
            }
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let Some(watched) = self.watched.take() else {
            return;
        };
        let me = self.shared.label.global(self.shared.rank);
        let why = format!(
            "{}{} failed on rank {me} before the exchange with the other ranks began: a local device task failed (a \
             poisoned input, a failed device, or a local device that never reached it)",
            self.fp, self.shared.label
        );
        watched.ended(Err(why.clone()));
        // The first local failure tells the other ranks, so they stop
        // instead of waiting for this rank until their timeout.
        if !self.shared.aborted.swap(true, Ordering::Relaxed) {
            let key = keys::abort(&self.shared.prefix);
            let _ = self.shared.store.compare_set(&key, None, format!("rank {me}: {why}").as_bytes());
            FlightRecorder::global().write_default("local-failure");
        }
    }
}
