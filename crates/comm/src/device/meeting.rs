//! Where the parts of one device-path collective meet on the host.
//!
//! Every part's task first arrives here: once all have, each queues its
//! calls on its device (so a communicator's first use, which waits for
//! every member, always meets, and a part whose input failed stops the
//! others before any of them queues device work). A part then returns
//! without waiting for its calls (barriers excepted): its device polls them
//! through a [`PartMonitor`], which watches the meeting for another part's
//! failure and reports this part's. A timeout names the members that never
//! arrived, or never finished.
//!
//! Arriving parts poll for the others for the runtime's spin window
//! ([`cohort_runtime::spin_window`]) before they sleep: device threads that
//! queue collectives back to back meet within microseconds.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::backend::{CollectiveMonitor, CommSpec, Completion, PeerToken};
use cohort_runtime::{BufferAccess, DeviceId, ServerError};
use parking_lot::{Condvar, Mutex, MutexGuard};

use super::plan::{self, Shape};
use super::{forget, Mode, NcclSet};
use crate::op::{Collective, Op};
use crate::trace::Watched;

#[derive(Default)]
struct State {
    arrived: usize,
    present: Vec<bool>,
    finished: Vec<bool>,
    /// Tasks that returned or were dropped.
    returned: usize,
    failure: Option<ServerError>,
    /// Peer copies: the sender's token, then the receiver's.
    tokens: [Option<PeerToken>; 2],
}

/// The shared object of one device-path collective.
pub(crate) struct Meeting {
    /// What runs; roots and endpoints are slots.
    op: Op,
    /// (member, device) of each part, by slot.
    parts: Vec<(usize, DeviceId)>,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// `State::arrived` and whether `State::failure` is set, readable
    /// without the lock by parts polling for the others.
    arrived: AtomicUsize,
    failed: AtomicBool,
}

impl Meeting {
    pub(crate) fn new(op: Op, parts: Vec<(usize, DeviceId)>, timeout: Duration) -> Arc<Meeting> {
        let n = parts.len();
        let state = State { present: vec![false; n], finished: vec![false; n], ..State::default() };
        Arc::new(Meeting {
            op,
            parts,
            timeout,
            state: Mutex::new(state),
            cv: Condvar::new(),
            arrived: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        })
    }

    /// Part `slot`'s right to run; dropped unrun, it fails the meeting.
    pub(crate) fn ticket(self: &Arc<Self>, slot: usize) -> Ticket {
        Ticket { meeting: self.clone(), slot, ran: false }
    }

    fn fail_locked(&self, state: &mut State, err: ServerError) -> ServerError {
        let failure = state.failure.get_or_insert(err).clone();
        self.failed.store(true, Ordering::Release);
        self.cv.notify_all();
        failure
    }

    fn fail(&self, err: ServerError) -> ServerError {
        self.fail_locked(&mut self.state.lock(), err)
    }

    fn failure(&self) -> Option<ServerError> {
        self.state.lock().failure.clone()
    }

    fn names(&self, flags: &[bool]) -> String {
        let missing: Vec<String> = self
            .parts
            .iter()
            .zip(flags)
            .filter(|(_, done)| !**done)
            .map(|((member, device), _)| format!("member {member} ({device})"))
            .collect();
        missing.join(", ")
    }

    fn timeout_error(&self, slot: usize, what: String) -> ServerError {
        ServerError::Collective {
            collective: self.op.name().to_string(),
            device: self.parts[slot].1,
            reason: format!(
                "{what} within {:.1} s: their devices are still busy with earlier work or blocked; every member \
                 must call the same collectives in the same order (raise COHORT_TIMEOUT, in seconds, if the work \
                 before it is legitimately that long)",
                self.timeout.as_secs_f64()
            ),
        }
    }

    /// Waits (up to `deadline`) until `ready` holds, the meeting failed, or
    /// the deadline passed (then fails it with `missing`'s words).
    fn wait_for(
        &self,
        state: &mut MutexGuard<'_, State>,
        slot: usize,
        deadline: Instant,
        ready: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> String,
    ) -> Result<(), ServerError> {
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if ready(state) {
                return Ok(());
            }
            if self.cv.wait_until(state, deadline).timed_out() && !ready(state) && state.failure.is_none() {
                let err = self.timeout_error(slot, missing(state));
                return Err(self.fail_locked(state, err));
            }
        }
    }

    fn arrive(&self, slot: usize, deadline: Instant) -> Result<(), ServerError> {
        let n = self.parts.len();
        let mut state = self.state.lock();
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        state.present[slot] = true;
        state.arrived += 1;
        self.arrived.store(state.arrived, Ordering::Release);
        if state.arrived == n {
            self.cv.notify_all();
            return Ok(());
        }
        drop(state);
        let window = cohort_runtime::spin_window();
        let started = Instant::now();
        let mut polls = 0u32;
        while self.arrived.load(Ordering::Acquire) < n && !self.failed.load(Ordering::Acquire) {
            polls = polls.wrapping_add(1);
            if polls % 64 == 0 && started.elapsed() >= window {
                break;
            }
            std::hint::spin_loop();
        }
        let mut state = self.state.lock();
        self.wait_for(
            &mut state,
            slot,
            deadline,
            |s| s.arrived == n,
            |s| format!("{} did not arrive", self.names(&s.present)),
        )
    }

    /// Blocks the calling thread until every part returned, or the meeting
    /// failed; returns the failure.
    pub(crate) fn wait_finished(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock();
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if state.returned == self.parts.len() {
                return Ok(());
            }
            self.cv.wait(&mut state);
        }
    }

    fn run_part(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        mode: &Mode,
        shape: Shape,
        tracked: Option<Arc<Watched>>,
    ) -> Result<(), ServerError> {
        let access = access.map_err(|err| self.fail(err))?;
        let deadline = Instant::now() + self.timeout;
        let buffers = shape.bind(|i| access.binding(i));
        if let Mode::Local = mode {
            // A copy needs both buffers: the input is buffer 0, the output 1.
            if plan::local_copy(&self.op, &buffers).is_some() {
                access.copy(0, 1).map_err(|err| self.fail(err))?;
            }
            self.state.lock().finished[slot] = true;
            return Ok(());
        }
        self.arrive(slot, deadline)?;
        let result = match mode {
            Mode::Local => unreachable!("handled above"),
            Mode::Peer => {
                let stream = access.stream();
                match access.device_collectives() {
                    Some(dc) => self.peer_part(slot, dc, stream, &buffers, deadline),
                    None => Err(ServerError::InvalidState {
                        operation: "a device-path collective",
                        reason: "the device's backend offers no device collectives".into(),
                    }),
                }
            }
            Mode::Nccl(set) => {
                let calls = plan::nccl_calls(&self.op, slot, self.parts.len(), &buffers);
                if calls.is_empty() {
                    Ok(())
                } else {
                    let spec =
                        CommSpec { set: set.key, rank: slot, ranks: self.parts.len(), unique_id: &set.unique_id };
                    // Barriers are waited for (`wait_finished`); the rest
                    // return once queued.
                    let completion =
                        if self.op.collective() == Collective::Barrier { Completion::Wait } else { Completion::Defer };
                    let monitor = Arc::new(PartMonitor { meeting: self.clone(), slot, set: set.clone(), tracked });
                    let result = access.run_collective(&spec, &calls, monitor, completion);
                    if result.is_err() {
                        forget(set);
                    }
                    return result.map_err(|err| self.fail(err));
                }
            }
        };
        match result {
            Ok(()) => {
                self.mark_finished(slot);
                Ok(())
            }
            Err(err) => Err(self.fail(err)),
        }
    }

    fn mark_finished(&self, slot: usize) {
        let mut state = self.state.lock();
        state.finished[slot] = true;
        self.cv.notify_all();
    }

    /// A peer copy: slot 0 exports its source, slot 1 copies it in and
    /// hands back a completion token that slot 0's stream waits on.
    fn peer_part(
        &self,
        slot: usize,
        dc: &mut dyn cohort_runtime::backend::DeviceCollectives,
        stream: cohort_runtime::StreamId,
        buffers: &plan::Buffers,
        deadline: Instant,
    ) -> Result<(), ServerError> {
        let other = 1 - slot;
        let mut state = self.state.lock();
        if slot == 0 {
            let src = buffers.input.expect("a send has a source");
            drop(state);
            let token = dc.peer_export(stream, src)?;
            state = self.state.lock();
            state.tokens[0] = Some(token);
            self.cv.notify_all();
        }
        let device = self.parts[other].1;
        self.wait_for(
            &mut state,
            slot,
            deadline,
            |s| s.tokens[other].is_some(),
            |_| format!("member {} ({device}) did not hand over its half of the copy", self.parts[other].0),
        )?;
        let token = state.tokens[other].expect("waited for");
        drop(state);
        if slot == 0 {
            return dc.peer_finish(stream, &token);
        }
        let dst = buffers.output.expect("a receive has a destination");
        let done = dc.peer_import(stream, &token, dst)?;
        let mut state = self.state.lock();
        state.tokens[1] = Some(done);
        self.cv.notify_all();
        Ok(())
    }
}

/// A part's right to run. Dropped without running (its device closed), it
/// fails the meeting so the other parts return at once.
pub(crate) struct Ticket {
    meeting: Arc<Meeting>,
    slot: usize,
    ran: bool,
}

impl Ticket {
    /// Runs the part on its device thread: meets the other parts and
    /// queues its calls (waiting for them only for a barrier). `tracked`,
    /// the collective's flight record, is held until the calls end.
    pub(crate) fn run(
        mut self,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        mode: &Mode,
        shape: Shape,
        tracked: Option<Arc<Watched>>,
    ) -> Result<(), ServerError> {
        self.ran = true;
        self.meeting.run_part(self.slot, access, mode, shape, tracked)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.meeting.state.lock();
        if !self.ran {
            let device = self.meeting.parts[self.slot].1;
            let err = ServerError::Poisoned {
                operation: self.meeting.op.name().to_string(),
                cause: Arc::new(ServerError::DeviceClosed { device }),
            };
            self.meeting.fail_locked(&mut state, err);
        }
        state.returned += 1;
        self.meeting.cv.notify_all();
    }
}

/// One part's view of its meeting while its calls run on the device: the
/// backend asks it for other parts' failures and tells it how the part
/// ended. It holds the collective's flight record, which is finished when
/// the last part's monitor and task are gone.
struct PartMonitor {
    meeting: Arc<Meeting>,
    slot: usize,
    set: Arc<NcclSet>,
    tracked: Option<Arc<Watched>>,
}

impl CollectiveMonitor for PartMonitor {
    fn operation(&self) -> &str {
        self.meeting.op.name()
    }

    fn timeout(&self) -> Duration {
        self.meeting.timeout
    }

    fn failed_elsewhere(&self) -> Option<ServerError> {
        if !self.meeting.failed.load(Ordering::Acquire) {
            return None;
        }
        self.meeting.failure()
    }

    fn missing(&self) -> String {
        let state = self.meeting.state.lock();
        let mut done = state.finished.clone();
        done[self.slot] = false;
        format!("{} did not finish", self.meeting.names(&done))
    }

    fn finished(&self, outcome: &Result<(), ServerError>) {
        match outcome {
            Ok(()) => self.meeting.mark_finished(self.slot),
            Err(err) => {
                forget(&self.set);
                self.meeting.fail(err.clone());
                if let Some(tracked) = &self.tracked {
                    tracked.fail(err.to_string());
                }
            }
        }
    }
}
