//! How a collective's front end tells the flight recorder and the timeline
//! about it, for a `ClientGroup` and a `Communicator` alike: a
//! [`Watched`] collective is recorded when queued and finished when its
//! last holder lets go, with the first failure any of its parts noted. It
//! only observes: nothing here runs or waits for a collective.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::{Client, ServerError};
use parking_lot::Mutex;

use super::recorder::Ranks;
use super::{now_micros, CollectiveFingerprint, FlightRecorder, RecordId, Timeline, TimelineEvent};
use crate::op::Op;

/// One queued collective under watch; each of its parts' tasks (or its one
/// owner) holds a clone and notes how its part ended.
pub(crate) struct Watched {
    record: RecordId,
    /// What the timeline event needs, kept only while `COHORT_TIMELINE` is
    /// set (the flight recorder has its own copy of the call).
    timeline: Option<TimelineStart>,
    /// Where its timeline event goes.
    row: Row,
    parts: usize,
    noted: AtomicUsize,
    failure: Mutex<Option<String>>,
    /// The path that runs it, where there is a choice.
    path: std::sync::OnceLock<&'static str>,
}

/// Where a collective's timeline event goes: its category ("collective",
/// "copy", "p2p") and row (`tid`: the device index, or 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    pub category: &'static str,
    pub tid: u32,
}

/// A watched collective's group, call and start, for its timeline event.
struct TimelineStart {
    group: Arc<str>,
    fingerprint: CollectiveFingerprint,
    start_us: u64,
    start: Instant,
}

impl Watched {
    /// Records that collective number `seq` of `group`, `op`, was queued
    /// with `parts` parts among `ranks`, on `path` where it is chosen
    /// already (one lock of the recorder for both). Its timeline event goes
    /// to `row`.
    pub(crate) fn start(
        group: &Arc<str>,
        seq: u64,
        op: &Op,
        parts: usize,
        ranks: Ranks,
        row: Row,
        path: Option<&'static str>,
    ) -> Arc<Watched> {
        Watched::start_described(group, CollectiveFingerprint::of(seq, op), parts, ranks, row, path)
    }

    /// [`Watched::start`] of a call described by `fingerprint` (a grouped
    /// call's: kind `group`, its number of calls as the count).
    pub(crate) fn start_described(
        group: &Arc<str>,
        fingerprint: CollectiveFingerprint,
        parts: usize,
        ranks: Ranks,
        row: Row,
        path: Option<&'static str>,
    ) -> Arc<Watched> {
        let timeline = Timeline::from_env().map(|_| TimelineStart {
            group: ranks.record_group(group),
            fingerprint: fingerprint.clone(),
            start_us: now_micros(),
            start: Instant::now(),
        });
        let record = FlightRecorder::global().start_entry(group, fingerprint, ranks, path);
        let chosen = std::sync::OnceLock::new();
        if let Some(path) = path {
            let _ = chosen.set(path);
        }
        Arc::new(Watched {
            record,
            timeline,
            row,
            parts,
            noted: AtomicUsize::new(0),
            failure: Mutex::new(None),
            path: chosen,
        })
    }

    /// Notes which path runs it (`nccl`, `oneshot`, `twoshot`), for the
    /// flight recorder and the timeline.
    pub(crate) fn set_path(&self, path: &'static str) {
        if self.path.set(path).is_ok() {
            FlightRecorder::global().set_path(self.record, path);
        }
    }

    /// A part returned with `result`.
    pub(crate) fn note(&self, result: &Result<(), ServerError>) {
        self.ended(result.as_ref().map(|_| ()).map_err(ToString::to_string));
    }

    /// A part ended with `outcome` (its failure in words).
    pub(crate) fn ended(&self, outcome: Result<(), String>) {
        if let Err(why) = outcome {
            self.fail(why);
        }
        self.noted.fetch_add(1, Ordering::Relaxed);
    }

    /// The collective failed: `why` (the first failure is kept).
    pub(crate) fn fail(&self, why: String) {
        self.failure.lock().get_or_insert(why);
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut failure = self.failure.lock().take();
        if failure.is_none() && self.noted.load(Ordering::Relaxed) < self.parts {
            failure = Some("a part was dropped before it ran (its device closed?)".into());
        }
        let ok = failure.is_none();
        FlightRecorder::global().finish_record(self.record, failure.map_or(Ok(()), Err));
        if let (Some(timeline), Some(TimelineStart { group, fingerprint: fp, start_us, start })) =
            (Timeline::from_env(), &self.timeline)
        {
            timeline.record(&TimelineEvent {
                name: fp.kind.to_string(),
                cat: self.row.category.into(),
                ph: "X",
                ts: *start_us,
                dur: start.elapsed().as_micros() as u64,
                pid: FlightRecorder::global().identity().0,
                tid: self.row.tid,
                args: serde_json::json!({
                    "group": &**group, "seq": fp.seq, "dtype": fp.dtype, "count": fp.count,
                    "op": fp.op, "root": fp.root, "ok": ok, "path": self.path.get(),
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
