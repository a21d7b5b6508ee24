//! A [`ClientGroup`](super::ClientGroup) collective in the process's flight
//! recorder and `COHORT_TIMELINE` trace: recorded when queued, finished when
//! the last of its parts ended (returned, or, for device calls still running
//! when their task returned, completed on the device), or failed when a part
//! is dropped unrun.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::{Client, ServerError};
use parking_lot::Mutex;

use crate::op::{Collective, Op};
use crate::trace::{now_micros, CollectiveFingerprint, FlightRecorder, RecordId, Timeline, TimelineEvent};

/// One queued collective of a group; every part's task holds a clone and
/// notes how it ended.
pub(crate) struct Tracked {
    group: String,
    record: RecordId,
    fingerprint: CollectiveFingerprint,
    parts: usize,
    noted: AtomicUsize,
    failure: Mutex<Option<String>>,
    start_us: u64,
    start: Instant,
    copy: bool,
    tid: u32,
}

/// The recorder's name of the group over `clients`: its device set, the
/// same for every group over those devices (they share one sequence).
pub(crate) fn group_name(clients: &[Client]) -> String {
    let mut devices: Vec<String> = clients.iter().map(|c| c.device_id().to_string()).collect();
    devices.sort();
    format!("group[{}]", devices.join(","))
}

impl Tracked {
    /// Records that collective number `seq` of `group`, `op`, was queued
    /// with `parts` parts; `tid` is the timeline row (the first part's
    /// device index).
    pub(crate) fn start(group: String, seq: u64, op: &Op, parts: usize, tid: u32) -> Arc<Tracked> {
        let fingerprint = CollectiveFingerprint::of(seq, op);
        // A process-local group: only this process takes part.
        let (rank, _) = FlightRecorder::global().identity();
        let record = FlightRecorder::global().start_among(&group, fingerprint.clone(), Some(vec![rank]));
        Arc::new(Tracked {
            group,
            record,
            fingerprint,
            parts,
            noted: AtomicUsize::new(0),
            failure: Mutex::new(None),
            start_us: now_micros(),
            start: Instant::now(),
            copy: op.collective() == Collective::SendRecv,
            tid,
        })
    }

    /// A part returned with `result`.
    pub(crate) fn note(&self, result: &Result<(), ServerError>) {
        if let Err(err) = result {
            self.fail(err);
        }
        self.noted.fetch_add(1, Ordering::Relaxed);
    }

    /// A part's device calls failed after its task returned.
    pub(crate) fn fail(&self, err: &ServerError) {
        self.failure.lock().get_or_insert_with(|| err.to_string());
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut failure = self.failure.lock().take();
        if failure.is_none() && self.noted.load(Ordering::Relaxed) < self.parts {
            failure = Some("a part was dropped before it ran (its device closed?)".into());
        }
        let ok = failure.is_none();
        let seq = self.fingerprint.seq;
        FlightRecorder::global().finish_record(self.record, failure.map_or(Ok(()), Err));
        if let Some(timeline) = Timeline::from_env() {
            let fp = &self.fingerprint;
            timeline.record(&TimelineEvent {
                name: fp.kind.clone(),
                cat: if self.copy { "copy".into() } else { "collective".into() },
                ph: "X",
                ts: self.start_us,
                dur: self.start.elapsed().as_micros() as u64,
                pid: FlightRecorder::global().identity().0,
                tid: self.tid,
                args: serde_json::json!({
                    "group": self.group, "seq": seq, "dtype": fp.dtype, "count": fp.count,
                    "op": fp.op, "root": fp.root, "ok": ok,
                }),
            });
        }
    }
}

/// A copy that ran outside any group (between runtimes, through the host)
/// as a timeline event, when `COHORT_TIMELINE` is set.
pub(crate) fn timeline_copy(start_us: u64, start: Instant, bytes: u64, from: &Client, to: &Client, ok: bool) {
    if let Some(timeline) = Timeline::from_env() {
        timeline.record(&TimelineEvent {
            name: "to_client".into(),
            cat: "copy".into(),
            ph: "X",
            ts: start_us,
            dur: start.elapsed().as_micros() as u64,
            pid: FlightRecorder::global().identity().0,
            tid: from.device_id().index,
            args: serde_json::json!({
                "bytes": bytes, "from": from.device_id().to_string(), "to": to.device_id().to_string(), "ok": ok,
            }),
        });
    }
}
