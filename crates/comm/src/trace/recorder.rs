//! The flight recorder: the last collectives of this process, in memory.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::now_micros;
use crate::op::Op;

/// What identifies a collective across ranks: every rank must call the same
/// sequence of these. Two ranks whose fingerprints differ at one sequence
/// number have desynchronised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveFingerprint {
    /// Position in this communicator's sequence of collectives (from 0).
    pub seq: u64,
    /// "all_reduce", "broadcast", ... (the names are borrowed, not copied,
    /// where the library records a call: `"all_reduce".into()`).
    pub kind: Cow<'static, str>,
    /// The reduction, for reducing collectives.
    pub op: Option<Cow<'static, str>>,
    /// Element type, e.g. "f32".
    pub dtype: Cow<'static, str>,
    /// Elements per rank's source.
    pub count: u64,
    /// Root rank, for rooted collectives.
    pub root: Option<usize>,
}

impl CollectiveFingerprint {
    /// Collective number `seq`, described by `op` (a send/recv's root is
    /// its sender). Allocates nothing: the names are static.
    pub fn of(seq: u64, op: &Op) -> CollectiveFingerprint {
        CollectiveFingerprint {
            seq,
            kind: Cow::Borrowed(op.name()),
            op: op.reduce_op().map(|o| Cow::Borrowed(o.nccl_name())),
            dtype: Cow::Borrowed(op.dtype().name()),
            count: op.count() as u64,
            root: op.root().or(op.endpoints().map(|(from, _)| from)),
        }
    }
}

impl fmt::Display for CollectiveFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}", self.seq, self.kind)?;
        if let Some(op) = &self.op {
            write!(f, "({op})")?;
        }
        write!(f, " {} × {}", self.count, self.dtype)?;
        if let Some(root) = self.root {
            write!(f, " root {root}")?;
        }
        Ok(())
    }
}

/// Where a recorded collective got to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordState {
    /// Queued; not every local device has started it.
    Started,
    Completed,
    Failed(String),
}

/// One collective as this process saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveRecord {
    /// Which communicator or group (a name stable across ranks).
    pub group: String,
    pub fingerprint: CollectiveFingerprint,
    /// Microseconds since the Unix epoch.
    pub started_us: u64,
    pub ended_us: Option<u64>,
    pub state: RecordState,
    /// The ranks that take part (`None`: every rank of the job). A
    /// point-to-point message names its two ranks, a process-local group
    /// its own rank, so the merge does not expect the others to see it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<usize>>,
    /// The path that ran it where there is a choice (`nccl`, `oneshot`,
    /// `twoshot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// This process's id of the record ([`FlightRecorder::start_among`]
    /// returns it), so two communicators whose group names collide in one
    /// process (ranks as threads in a test) finish their own records.
    #[serde(skip)]
    pub id: u64,
}

/// The id of one record in this process's recorder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordId(pub u64);

/// A rank's recorder written to disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecorderDump {
    pub rank: usize,
    pub world_size: usize,
    pub host: String,
    pub pid: u32,
    /// Why it was written: "timeout", "signal", "request", ...
    pub reason: String,
    pub written_us: u64,
    /// Oldest first.
    pub records: Vec<CollectiveRecord>,
    /// When this process passed each start-up phase of its communicators
    /// (`joined`, `links`, ...: see `cohort run --timings`), in Unix
    /// microseconds, in the order passed.
    #[serde(default)]
    pub startup: Vec<(String, u64)>,
}

/// Who takes part in a recorded collective, as the ring keeps it: the
/// common cases without a heap list, a communicator's list shared with it.
#[derive(Debug, Clone)]
pub(crate) enum Ranks {
    /// Every rank of the job.
    Every,
    /// One rank (a process-local group: this process).
    One(usize),
    /// A point-to-point message from one rank to another: its record's
    /// group is `<group>/p2p <from>-><to>` (made when read).
    Message(usize, usize),
    /// A communicator's ranks (a split group's job ranks).
    Listed(Arc<[usize]>),
}

impl Ranks {
    /// The list a [`CollectiveRecord`] names (`None`: every rank).
    fn to_list(&self) -> Option<Vec<usize>> {
        match self {
            Ranks::Every => None,
            Ranks::One(rank) => Some(vec![*rank]),
            Ranks::Message(from, to) => Some(vec![*from, *to]),
            Ranks::Listed(list) => Some(list.to_vec()),
        }
    }

    /// The name a record of `group` among these ranks carries: the
    /// group's own, shared, but for a message (`<group>/p2p <from>-><to>`).
    pub(crate) fn record_group(&self, group: &Arc<str>) -> Arc<str> {
        match self {
            Ranks::Message(from, to) => format!("{group}/p2p {from}->{to}").into(),
            _ => Arc::clone(group),
        }
    }

    /// Whether a record of `group` among these ranks carries `name`.
    fn names_group(&self, group: &str, name: &str) -> bool {
        match self {
            Ranks::Message(from, to) => name
                .strip_prefix(group)
                .and_then(|rest| rest.strip_prefix("/p2p "))
                .and_then(|ends| ends.split_once("->"))
                .is_some_and(|(f, t)| f.parse() == Ok(*from) && t.parse() == Ok(*to)),
            _ => group == name,
        }
    }
}

/// One collective in the ring: a [`CollectiveRecord`] in the form that is
/// cheap to write on every call (the group's name shared, static names
/// borrowed, no rank list for one rank or a message's two). Dropping one that falls off
/// the ring frees nothing on the common path.
struct Entry {
    id: u64,
    group: Arc<str>,
    fingerprint: CollectiveFingerprint,
    started_us: u64,
    ended_us: Option<u64>,
    state: RecordState,
    ranks: Ranks,
    path: Option<&'static str>,
}

impl Entry {
    /// Ends the entry with `outcome`, unless it already failed (the first
    /// reason is kept).
    fn end(&mut self, outcome: Result<(), String>) {
        if matches!(self.state, RecordState::Failed(_)) {
            return;
        }
        self.ended_us = Some(now_micros());
        self.state = match outcome {
            Ok(()) => RecordState::Completed,
            Err(reason) => RecordState::Failed(reason),
        };
    }

    fn to_record(&self) -> CollectiveRecord {
        CollectiveRecord {
            group: self.ranks.record_group(&self.group).to_string(),
            fingerprint: self.fingerprint.clone(),
            started_us: self.started_us,
            ended_us: self.ended_us,
            state: self.state.clone(),
            ranks: self.ranks.to_list(),
            path: self.path.map(str::to_string),
            id: self.id,
        }
    }
}

/// Where record `id` is in `records` (sorted by id), if still there: found
/// at once where the ring's ids are consecutive (the process-wide recorder,
/// the only one that records while others do), by binary search otherwise.
fn position(records: &VecDeque<Entry>, id: RecordId) -> Option<usize> {
    let front = records.front()?.id;
    let guess = usize::try_from(id.0.checked_sub(front)?).ok()?;
    if records.get(guess).is_some_and(|r| r.id == id.0) {
        return Some(guess);
    }
    records.binary_search_by_key(&id.0, |r| r.id).ok()
}

/// The last collectives of this process (a ring buffer; old ones fall off).
///
/// Recording a call of the library costs one lock and no heap allocation:
/// the ring keeps the group's shared name and the call's static names, and
/// builds the public [`CollectiveRecord`]s only when read.
pub struct FlightRecorder {
    capacity: usize,
    /// The rank (high 32 bits) and world size (low 32) written in dumps.
    identity: AtomicU64,
    records: Mutex<VecDeque<Entry>>,
    startup: Mutex<Vec<(String, u64)>>,
}

/// A rank and world size as one word, so a reader never sees half of an
/// update.
fn pack_identity(rank: usize, world_size: usize) -> u64 {
    // Both stay far below 2^32 (the launcher refuses more than 4,194,304
    // ranks); saturate rather than wrap past that.
    let narrow = |n: usize| u64::from(u32::try_from(n).unwrap_or(u32::MAX));
    narrow(rank) << 32 | narrow(world_size)
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` collectives (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            identity: AtomicU64::new(pack_identity(0, 1)),
            records: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
            startup: Mutex::new(Vec::new()),
        }
    }

    /// The process-wide recorder; its size is `COHORT_FLIGHT_RECORDER`
    /// (default 2000 collectives), read once. An unusable value is refused
    /// by `ClientGroup::new` and `Communicator::connect`, and means the
    /// default here.
    pub fn global() -> &'static FlightRecorder {
        static GLOBAL: OnceLock<FlightRecorder> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let setting = &cohort_runtime::config::FLIGHT_RECORDER;
            FlightRecorder::new(setting.get().unwrap_or(setting.fallback))
        })
    }

    /// Sets the rank and world size written in dumps.
    pub fn set_identity(&self, rank: usize, world_size: usize) {
        self.identity.store(pack_identity(rank, world_size), Ordering::Relaxed);
    }

    /// Keeps that this process passed start-up phase `name` at `at_us`
    /// (Unix microseconds); dumps carry every phase kept.
    pub fn record_startup(&self, name: &str, at_us: u64) {
        self.startup.lock().push((name.to_string(), at_us));
    }

    /// The start-up phases kept, in the order passed.
    pub fn startup(&self) -> Vec<(String, u64)> {
        self.startup.lock().clone()
    }

    /// The rank and world size written in dumps (one atomic load).
    pub fn identity(&self) -> (usize, usize) {
        let packed = self.identity.load(Ordering::Relaxed);
        ((packed >> 32) as usize, (packed & u64::from(u32::MAX)) as usize)
    }

    /// Records the start of a collective. Costs a lock and a push.
    pub fn start(&self, group: &str, fingerprint: CollectiveFingerprint) {
        self.start_among(group, fingerprint, None);
    }

    /// Records the start of a collective that only `ranks` take part in
    /// (`None`: every rank). Costs a lock, a push and a copy of `group`.
    pub fn start_among(&self, group: &str, fingerprint: CollectiveFingerprint, ranks: Option<Vec<usize>>) -> RecordId {
        let ranks = ranks.map_or(Ranks::Every, |list| Ranks::Listed(list.into()));
        self.start_entry(&Arc::from(group), fingerprint, ranks, None)
    }

    /// Records the start of a collective of `group` among `ranks`, on `path`
    /// where it is known already: one lock and a push; nothing is allocated
    /// once the ring has grown to its size.
    pub(crate) fn start_entry(
        &self,
        group: &Arc<str>,
        fingerprint: CollectiveFingerprint,
        ranks: Ranks,
        path: Option<&'static str>,
    ) -> RecordId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        if self.capacity == 0 {
            return RecordId(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        let mut records = self.records.lock();
        // Taken under the lock: the ring stays sorted by id (and by start
        // time), so a record is found by binary search however far behind
        // its finish comes.
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let started_us = now_micros();
        if records.len() == self.capacity {
            records.pop_front();
        }
        records.push_back(Entry {
            id,
            group: Arc::clone(group),
            fingerprint,
            started_us,
            ended_us: None,
            state: RecordState::Started,
            ranks,
            path,
        });
        RecordId(id)
    }

    /// Notes which path ran record `id` (ignored once it fell off the ring).
    pub fn set_path(&self, id: RecordId, path: &'static str) {
        let mut records = self.records.lock();
        if let Some(at) = position(&records, id) {
            records[at].path = Some(path);
        }
    }

    /// Records the end of the record `id` returned by
    /// [`FlightRecorder::start_among`]; a record that already failed keeps
    /// its first reason, and one that fell off the ring is ignored.
    pub fn finish_record(&self, id: RecordId, outcome: Result<(), String>) {
        let mut records = self.records.lock();
        if let Some(at) = position(&records, id) {
            records[at].end(outcome);
        }
    }

    /// Records the end of collective `seq` of `group` (the newest record
    /// with that sequence number), completed or failed. A collective that
    /// already failed stays failed (its first reason is kept).
    pub fn finish(&self, group: &str, seq: u64, outcome: Result<(), String>) {
        let mut records = self.records.lock();
        if let Some(record) =
            records.iter_mut().rev().find(|r| r.fingerprint.seq == seq && r.ranks.names_group(&r.group, group))
        {
            record.end(outcome);
        }
    }

    /// A copy of what is recorded, oldest first.
    pub fn snapshot(&self) -> Vec<CollectiveRecord> {
        self.records.lock().iter().map(Entry::to_record).collect()
    }

    /// The recorder as a dump, with why it is taken.
    pub fn dump(&self, reason: &str) -> RecorderDump {
        let (rank, world_size) = self.identity();
        RecorderDump {
            rank,
            world_size,
            host: hostname(),
            pid: std::process::id(),
            reason: reason.to_string(),
            written_us: now_micros(),
            records: self.snapshot(),
            startup: self.startup(),
        }
    }

    /// Writes the dump as JSON to `dir/rank<N>.json` (creating `dir` with
    /// mode 0700) and returns the path. The folder must be this user's and
    /// not writable by others, and the file is created 0600 without
    /// following links (see `cohort_runtime::private_fs`): another local
    /// user can neither read the dump nor aim it at a file of their choice.
    pub fn write_to(&self, dir: &Path, reason: &str) -> std::io::Result<PathBuf> {
        use std::io::Write;
        let dump = self.dump(reason);
        let folder = cohort_runtime::private_fs::PrivateDir::open_or_create(dir)?;
        let name = format!("rank{}.json", dump.rank);
        let tmp = format!("{name}.tmp");
        let json = serde_json::to_vec_pretty(&dump).map_err(std::io::Error::other)?;
        let mut file = folder.create_file(&tmp)?;
        if let Err(e) = file.write_all(&json).and_then(|()| file.sync_data()) {
            folder.remove(&tmp);
            return Err(e);
        }
        folder.rename(&tmp, &name)?;
        Ok(dir.join(name))
    }

    /// Writes the dump to [`trace_dir`] (`COHORT_TRACE_DIR`, default
    /// `cohort-trace`); logs where, or why it could not.
    pub fn write_default(&self, reason: &str) -> Option<PathBuf> {
        let dir = trace_dir();
        match self.write_to(&dir, reason) {
            Ok(path) => {
                tracing::warn!(path = %path.display(), "flight recorder written ({reason}); merge ranks with `cohort trace {}`", dir.display());
                Some(path)
            }
            Err(err) => {
                tracing::error!("could not write the flight recorder to {}: {err}", dir.display());
                None
            }
        }
    }
}

/// Where dumps go: `COHORT_TRACE_DIR`, default `cohort-trace` (relative to
/// the working directory). `cohort run` sets it for its ranks.
pub fn trace_dir() -> PathBuf {
    // Any path is a valid COHORT_TRACE_DIR, so this cannot fail.
    match cohort_runtime::config::TRACE_DIR.get() {
        Ok(Some(dir)) => dir,
        _ => "cohort-trace".into(),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

static SIGNAL_SEEN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_dump_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe. The watcher thread writes.
    SIGNAL_SEEN.store(true, Ordering::SeqCst);
}

/// Writes the global recorder whenever the process gets SIGUSR1 (like
/// `py-spy dump` for collectives): `kill -USR1 <pid>`. Idempotent.
pub fn install_dump_on_signal() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        // SAFETY: the handler only stores to an atomic (async-signal-safe);
        // `sigaction` is given a zeroed, then filled, struct that outlives
        // the call.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_dump_signal as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut());
        }
        let _ = std::thread::Builder::new().name("cohort-recorder-signal".into()).spawn(|| loop {
            std::thread::sleep(std::time::Duration::from_millis(50));
            if SIGNAL_SEEN.swap(false, Ordering::SeqCst) {
                FlightRecorder::global().write_default("signal");
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(seq: u64) -> CollectiveFingerprint {
        CollectiveFingerprint {
            seq,
            kind: "all_reduce".into(),
            op: Some("sum".into()),
            dtype: "f32".into(),
            count: 8,
            root: None,
        }
    }

    #[test]
    fn keeps_the_last_n_and_records_outcomes() {
        let recorder = FlightRecorder::new(3);
        for seq in 0..5 {
            recorder.start("g", fp(seq));
            recorder.finish("g", seq, if seq == 4 { Err("boom".into()) } else { Ok(()) });
        }
        recorder.start("g", fp(5));
        let records = recorder.snapshot();
        assert_eq!(records.iter().map(|r| r.fingerprint.seq).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(records[0].state, RecordState::Completed);
        assert_eq!(records[1].state, RecordState::Failed("boom".into()));
        assert_eq!(records[2].state, RecordState::Started);
        assert!(records[2].ended_us.is_none());
        assert_eq!(fp(2).to_string(), "#2 all_reduce(sum) 8 × f32");
    }

    #[test]
    fn the_identity_reads_back_whole_and_saturates_past_32_bits() {
        let recorder = FlightRecorder::new(1);
        assert_eq!(recorder.identity(), (0, 1));
        recorder.set_identity(4_194_303, 4_194_304);
        assert_eq!(recorder.identity(), (4_194_303, 4_194_304));
        recorder.set_identity(usize::MAX, 7);
        assert_eq!(recorder.identity(), (u32::MAX as usize, 7));
    }

    #[test]
    fn records_read_back_as_they_were_written() {
        let recorder = FlightRecorder::new(4);
        let id = recorder.start_among("g", fp(0), Some(vec![2, 5]));
        recorder.set_path(id, "oneshot");
        recorder.start_entry(&"h".into(), fp(1), Ranks::Message(3, 1), None);
        recorder.start_entry(&"h".into(), fp(2), Ranks::One(4), Some("nccl"));
        recorder.finish_record(id, Err("first".into()));
        recorder.finish_record(id, Ok(()));
        let records = recorder.snapshot();
        assert_eq!(records[0].group, "g");
        assert_eq!(records[0].ranks, Some(vec![2, 5]));
        assert_eq!(records[0].path.as_deref(), Some("oneshot"));
        assert_eq!(records[0].state, RecordState::Failed("first".into()), "the first reason stays");
        assert_eq!((records[1].ranks.clone(), records[2].ranks.clone()), (Some(vec![3, 1]), Some(vec![4])));
        assert_eq!((records[1].group.as_str(), records[2].group.as_str()), ("h/p2p 3->1", "h"));
        // A message's record is found by its whole name: its group's alone
        // does not end it.
        recorder.finish("h", 1, Err("wrong".into()));
        recorder.finish("h/p2p 3->1", 1, Err("lost".into()));
        let records = recorder.snapshot();
        assert_eq!(records[1].state, RecordState::Failed("lost".into()));
        assert_eq!(records[1].fingerprint, fp(1));
        assert_eq!((records[1].path.as_deref(), records[2].path.as_deref()), (None, Some("nccl")));
    }

    /// A record is ended by its id whether the ring's ids run on (found at
    /// once) or have gaps (another recorder took the ids between: found by
    /// search); one that fell off the ring is ignored, and no other record
    /// is touched.
    #[test]
    fn records_are_ended_by_id_with_or_without_gaps_in_the_ids() {
        let (ours, other) = (FlightRecorder::new(3), FlightRecorder::new(3));
        let group: Arc<str> = "g".into();
        let start = |recorder: &FlightRecorder, seq| recorder.start_entry(&group, fp(seq), Ranks::One(0), None);
        let gone = start(&ours, 0);
        let run: Vec<RecordId> = (1..4).map(|seq| start(&ours, seq)).collect();
        ours.finish_record(run[1], Err("second".into()));
        ours.finish_record(gone, Err("fell off".into()));
        let gapped: Vec<RecordId> = (4..7)
            .map(|seq| {
                start(&other, seq);
                start(&ours, seq)
            })
            .collect();
        ours.finish_record(gapped[2], Ok(()));
        ours.set_path(gapped[0], "oneshot");
        ours.finish_record(gapped[0], Err("first".into()));
        let states: Vec<(u64, RecordState, Option<String>)> =
            ours.snapshot().into_iter().map(|r| (r.fingerprint.seq, r.state, r.path)).collect();
        assert_eq!(
            states,
            vec![
                (4, RecordState::Failed("first".into()), Some("oneshot".into())),
                (5, RecordState::Started, None),
                (6, RecordState::Completed, None),
            ]
        );
        let ours_then = FlightRecorder::new(4);
        let ids: Vec<RecordId> = (0..4).map(|seq| start(&ours_then, seq)).collect();
        ours_then.finish_record(ids[1], Err("second".into()));
        let states: Vec<RecordState> = ours_then.snapshot().into_iter().map(|r| r.state).collect();
        assert_eq!(states[1], RecordState::Failed("second".into()));
        assert!(states.iter().enumerate().all(|(i, s)| i == 1 || *s == RecordState::Started), "{states:?}");
    }

    #[test]
    fn dumps_round_trip_through_json() {
        let dir = std::env::temp_dir().join(format!("cohort-recorder-{}", std::process::id()));
        let recorder = FlightRecorder::new(10);
        recorder.set_identity(3, 4);
        recorder.start("g", fp(0));
        let path = recorder.write_to(&dir, "request").unwrap();
        assert!(path.ends_with("rank3.json"));
        let dump: RecorderDump = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!((dump.rank, dump.world_size, dump.reason.as_str()), (3, 4, "request"));
        assert_eq!(dump.records.len(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
