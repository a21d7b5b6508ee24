//! What a communicator tells about itself while it runs: every collective
//! into the process's [`FlightRecorder`] (and the `COHORT_TIMELINE` trace),
//! a heartbeat in the store, and an abort for the other ranks when a local
//! part fails before the exchange began.
//!
//! Store keys, under the communicator's prefix (`cohort/comm/<k>/`):
//! - `hb/<r>`: rank r's progress, `<issued> <finished>` (the sequence
//!   numbers of the last collective it called and the last it finished),
//!   rewritten when it changes, at most every 50 ms;
//! - `gone/<r>`: set when rank r's heartbeat connection closes (the store's
//!   will: the process exited, crashed or was killed) or when it drops its
//!   communicator; peers waiting on its bytes stop at once instead of at the
//!   timeout.
//!
//! And, for the launcher's watchdog, `cohort/heartbeat/<RANK>` = `<pid>
//! <beats>`, a counter that moves every period while the process runs, even
//! while its collectives wait.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{RecvTimeoutError, Sender};

use crate::store::StoreClient;
use crate::trace::{now_micros, CollectiveFingerprint, FlightRecorder, RecordId, Timeline, TimelineEvent};

use super::error::ConnectError;
use super::fingerprint::Fingerprint;
use super::local::Views;
use super::plans;
use super::world::World;

/// How often a rank's heartbeat thread bumps its counter in the store.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_secs(1);

/// The shortest time between two writes of the communicator's progress
/// (each call wakes the heartbeat thread): at most 20 store writes a second
/// per rank, however fast collectives go.
const PROGRESS_GAP: Duration = Duration::from_millis(50);

/// The key the launcher's watchdog reads for the job's rank `rank`.
pub fn job_heartbeat_key(rank: usize) -> String {
    format!("cohort/heartbeat/{rank}")
}

pub(super) fn gone_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}gone/{rank}")
}

pub(super) fn progress_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}hb/{rank}")
}

/// Reads a peer's `hb/<r>` entry: (issued, finished).
pub(super) fn parse_progress(value: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let (a, b) = text.split_once(' ')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

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
    /// The recorder's group name, `comm<k>`, the same on every rank.
    group: String,
    rank: usize,
    /// The job rank (timeline rows).
    job_rank: usize,
    /// Last collective called / finished (not counting send/recv).
    issued: AtomicU64,
    finished: AtomicU64,
    /// A connection for aborts raised outside the exchange.
    store: StoreClient,
    prefix: String,
    aborted: AtomicBool,
    /// Wakes the heartbeat thread to report progress (never blocks).
    poke: Sender<()>,
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
        let (job_rank, job_size) = job_identity(rank, size);
        FlightRecorder::global().set_identity(job_rank, job_size);
        crate::trace::install_dump_on_signal();
        let beat = world.store().duplicate()?;
        beat.set_will(&gone_key(&prefix, rank), b"its store connection closed")?;
        let k = prefix.trim_end_matches('/').rsplit('/').next().unwrap_or("0").to_string();
        let (poke, poked) = crossbeam::channel::bounded::<()>(1);
        let shared = Arc::new(Shared {
            poke,
            group: format!("comm{k}"),
            rank,
            job_rank,
            issued: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            store: world.store().duplicate()?,
            prefix,
            aborted: AtomicBool::new(false),
        });
        let (stop, stopped) = crossbeam::channel::bounded::<()>(0);
        let s = shared.clone();
        std::thread::Builder::new()
            .name(format!("cohort-heartbeat-{rank}"))
            .spawn(move || {
                let job_key = job_heartbeat_key(s.job_rank);
                let mine = progress_key(&s.prefix, s.rank);
                let pid = std::process::id();
                let (mut beats, mut last_beat, mut reported) = (0u64, None::<Instant>, String::new());
                loop {
                    let progress =
                        format!("{} {}", s.issued.load(Ordering::Relaxed), s.finished.load(Ordering::Relaxed));
                    let mut sent = Ok(());
                    if last_beat.is_none_or(|t| t.elapsed() >= HEARTBEAT_PERIOD) {
                        beats += 1;
                        last_beat = Some(Instant::now());
                        sent = beat.set(&job_key, format!("{pid} {beats}").as_bytes());
                    }
                    if sent.is_ok() && progress != reported {
                        sent = beat.set(&mine, progress.as_bytes());
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
                let _ = beat.set(&gone_key(&s.prefix, s.rank), b"it closed its communicator");
            })
            .map_err(|e| ConnectError::Setup(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(Observer { shared, _stop: stop })
    }

    /// Records that collective `fp` was queued and returns its tracker, to
    /// run the exchange through.
    pub(crate) fn queued(&self, fp: Fingerprint) -> Tracker {
        let s = &self.shared;
        let (group, ranks) = match fp.op.endpoints() {
            Some((from, to)) => (format!("{}/p2p {from}->{to}", s.group), Some(vec![from, to])),
            None => {
                s.issued.fetch_max(fp.seq, Ordering::Relaxed);
                let _ = s.poke.try_send(());
                (s.group.clone(), None)
            }
        };
        let record = FlightRecorder::global().start_among(&group, CollectiveFingerprint::of(fp.seq, &fp.op), ranks);
        Tracker { shared: s.clone(), group, record, fp, ran: false }
    }
}

/// Why a dump is written, from a failure's message.
fn dump_reason(why: &str) -> &'static str {
    if why.contains("collective mismatch") {
        "mismatch"
    } else if why.contains("timed out") {
        "timeout"
    } else if why.contains("aborted") {
        "abort"
    } else {
        "failure"
    }
}

/// One queued collective: records its end, its timeline event, and on
/// failure writes the flight recorder; dropped without running (a local
/// part failed first), it aborts the communicator for the other ranks.
pub(crate) struct Tracker {
    shared: Arc<Shared>,
    group: String,
    record: RecordId,
    fp: Fingerprint,
    ran: bool,
}

impl Tracker {
    /// Runs the exchange (the leader's plan) and records how it ended.
    pub(crate) fn run(self, world: &mut World, views: Views) -> Result<Vec<Option<Vec<u8>>>, String> {
        let (start_us, start) = (now_micros(), Instant::now());
        let result = plans::run(world, self.fp, views);
        self.ended(result.as_ref().map(|_| ()).map_err(Clone::clone), start_us, start);
        result
    }

    /// Records how a collective that ran elsewhere (the NCCL path) ended:
    /// the recorder, progress for the heartbeat, the timeline, and on
    /// failure the recorder's dump. `start_us`/`start` are when it was
    /// queued.
    pub(crate) fn ended(mut self, outcome: Result<(), String>, start_us: u64, start: Instant) {
        self.ran = true;
        FlightRecorder::global().finish_record(self.record, outcome.clone());
        if !self.fp.is_p2p() && outcome.is_ok() {
            self.shared.finished.fetch_max(self.fp.seq, Ordering::Relaxed);
        }
        if let Some(timeline) = Timeline::from_env() {
            let fp = &self.fp;
            timeline.record(&TimelineEvent {
                name: fp.op.name().to_string(),
                cat: if fp.is_p2p() { "p2p".into() } else { "collective".into() },
                ph: "X",
                ts: start_us,
                dur: start.elapsed().as_micros() as u64,
                pid: self.shared.job_rank,
                tid: 0,
                args: serde_json::json!({
                    "group": self.group, "seq": fp.seq, "dtype": fp.op.dtype().to_string(), "count": fp.op.count(),
                    "op": fp.op.reduce_op().map(|o| o.to_string()),
                    "root": fp.op.root().or(fp.op.endpoints().map(|(from, _)| from)), "ok": outcome.is_ok(),
                }),
            });
        }
        if let Err(why) = &outcome {
            // The first failure writes the recorder; later calls are refused
            // at once (the communicator is aborted) and add nothing to it.
            if !self.shared.aborted.swap(true, Ordering::Relaxed) {
                FlightRecorder::global().write_default(dump_reason(why));
            }
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if self.ran {
            return;
        }
        let why = format!(
            "{} failed on rank {} before the exchange with the other ranks began: a local device task failed (a \
             poisoned input, a failed device, or a local device that never reached it)",
            self.fp, self.shared.rank
        );
        FlightRecorder::global().finish_record(self.record, Err(why.clone()));
        // The first local failure tells the other ranks, so they stop
        // instead of waiting for this rank until their timeout.
        if !self.shared.aborted.swap(true, Ordering::Relaxed) {
            let key = format!("{}abort", self.shared.prefix);
            let _ = self.shared.store.compare_set(&key, None, format!("rank {}: {why}", self.shared.rank).as_bytes());
            FlightRecorder::global().write_default("local-failure");
        }
    }
}
