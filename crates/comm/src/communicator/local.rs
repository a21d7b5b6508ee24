//! The meeting of one call's local parts: each local device's task brings
//! its buffers (host pointers on the CPU backend, staged copies elsewhere),
//! the last to arrive runs the call between ranks for all of them, and each
//! task then writes its staged outputs back on its own device thread. A
//! grouped call is one meeting too: each task brings the buffers of every
//! call of the group, and the leader gets one [`Views`] per call.
//!
//! Who touches which bytes when: a task publishes the addresses of its
//! buffers and then blocks until the meeting is `done`; once every local
//! task arrived none returns before `done` (no timeout applies then, the
//! world's own deadline bounds the leader), so the memory stays reserved and
//! untouched by its device thread while the leader uses it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{AlignedBytes, BufferAccess, DeviceId, ServerError};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::meeting::{Meeting, Seat, Seated};

/// A task's input as the leader sees it.
pub(crate) enum InView {
    /// Host-addressable device memory: address and length.
    Ptr(usize, usize),
    /// A staged copy.
    Owned(AlignedBytes),
}

/// A task's output as the leader sees it.
pub(crate) enum OutView {
    Ptr(usize, usize),
    /// Staged: the leader fills a host buffer of this length.
    Staged(usize),
}

/// One entry per local slot (device) of a rank: inline for up to four.
pub(crate) type PerSlot<T> = SmallVec<[T; 4]>;

/// One entry per call of a meeting: inline for a single call.
pub(crate) type PerCall<T> = SmallVec<[T; 1]>;

/// A call's staged outputs, by slot (`None` where the slot's output was
/// written in place or it has none).
pub(crate) type Staged = PerSlot<Option<Vec<u8>>>;

/// What the leader gets: each slot's input and output.
pub(crate) struct Views {
    pub ins: PerSlot<Option<InView>>,
    pub outs: PerSlot<Option<OutView>>,
}

/// What one call's meeting keeps: each call's views (by slot) until the
/// leader takes them, then the staged outputs.
pub(crate) struct LocalState {
    views: PerCall<Views>,
    /// Staged outputs, per call and slot, once done.
    results: PerCall<Staged>,
    /// The leader's plan ran (or failed).
    done: bool,
}

/// The leader's work: runs the calls over their views (one [`Views`] per
/// call), returns staged outputs (per call, per slot) or why it failed.
pub(crate) type Plan = Box<dyn FnOnce(PerCall<Views>) -> Result<PerCall<Staged>, String> + Send>;

/// Which buffers a task was queued with for one call of its meeting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    pub has_in: bool,
    pub has_out: bool,
}

/// One call's local tasks and the plan the last of them runs.
pub(crate) struct LocalCall {
    plan: Mutex<Option<Plan>>,
    meeting: Meeting<LocalState>,
}

impl Seated for LocalCall {
    type State = LocalState;

    fn meeting(&self) -> &Meeting<LocalState> {
        &self.meeting
    }
}

impl LocalCall {
    /// The `calls` calls named `name` among this rank's `devices` (one task
    /// each).
    pub(crate) fn new(
        name: &'static str,
        calls: usize,
        devices: impl ExactSizeIterator<Item = DeviceId>,
        timeout: Duration,
        plan: Plan,
    ) -> Arc<LocalCall> {
        let n = devices.len();
        let views = (0..calls)
            .map(|_| Views { ins: (0..n).map(|_| None).collect(), outs: (0..n).map(|_| None).collect() })
            .collect();
        let state = LocalState { views, results: PerCall::new(), done: false };
        let seats = devices.map(|device| Seat { device, member: None });
        Arc::new(LocalCall { plan: Mutex::new(Some(plan)), meeting: Meeting::new(name, seats, timeout, state) })
    }

    /// A local task's body: `parts[k]` says which buffers of call `k` the
    /// task was queued with (every call's input, in call order, then every
    /// call's output).
    pub(crate) fn run_task(
        &self,
        slot: usize,
        parts: &[Part],
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        let meeting = &self.meeting;
        let access = match access {
            Ok(a) => a,
            Err(err) => return Err(meeting.fail(err)),
        };
        let inputs = parts.iter().filter(|p| p.has_in).count();
        let (mut next_in, mut next_out) = (0, inputs);
        let mut mine: PerCall<_> = SmallVec::with_capacity(parts.len());
        let mut out_index: PerCall<_> = SmallVec::with_capacity(parts.len());
        for part in parts {
            let input = if part.has_in {
                let index = next_in;
                next_in += 1;
                Some(match access.host_ptr(index) {
                    Some(p) => InView::Ptr(p.ptr as usize, p.len),
                    None => InView::Owned(access.read(index).map_err(|e| meeting.fail(e))?),
                })
            } else {
                None
            };
            let output = if part.has_out {
                let index = next_out;
                next_out += 1;
                out_index.push(Some(index));
                let size = access.size(index) as usize;
                Some(match access.host_ptr(index) {
                    Some(p) => OutView::Ptr(p.ptr as usize, p.len),
                    None => OutView::Staged(size),
                })
            } else {
                out_index.push(None);
                None
            };
            mine.push((input, output));
        }
        let mut state = meeting.lock();
        if let Some(err) = state.failure() {
            return Err(err.clone());
        }
        for (call, (input, output)) in mine.into_iter().enumerate() {
            state.data.views[call].ins[slot] = input;
            state.data.views[call].outs[slot] = output;
        }
        if meeting.arrive_locked(&mut state, slot)? {
            let views = std::mem::take(&mut state.data.views);
            drop(state);
            let plan = self.plan.lock().take().expect("one leader");
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| plan(views)))
                .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(p.as_ref()))));
            let mut state = meeting.lock();
            match result {
                Ok(results) => state.data.results = results,
                Err(reason) => {
                    meeting.fail_locked(&mut state, meeting.error(slot, reason));
                }
            }
            state.data.done = true;
            meeting.notify();
        } else {
            let deadline = Instant::now() + meeting.timeout();
            meeting.wait_arrivals(&mut state, slot, deadline)?;
            // Every task arrived: the leader uses this task's memory; wait
            // for it without a deadline (the world's own bounds it).
            while !state.data.done && state.failure().is_none() {
                meeting.sleep(&mut state);
            }
            drop(state);
        }
        let mut state = meeting.lock();
        if let Some(err) = state.failure() {
            return Err(err.clone());
        }
        let staged: PerCall<Option<Vec<u8>>> =
            state.data.results.iter_mut().map(|per_slot| per_slot.get_mut(slot).and_then(Option::take)).collect();
        drop(state);
        for (call, bytes) in staged.into_iter().enumerate() {
            if let (Some(bytes), Some(Some(index))) = (bytes, out_index.get(call)) {
                access.write(*index, &bytes).map_err(|e| meeting.fail(e))?;
            }
        }
        Ok(())
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}
