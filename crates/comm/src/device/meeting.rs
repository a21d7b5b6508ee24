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

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::backend::{CollectiveMonitor, CommSpec, Completion, PeerSpec, PeerToken};
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, DeviceId, ServerError};
use smallvec::SmallVec;

use super::fusion::{self, Bucket};
use super::plan::{self, Shape};
use super::{forget, Mode, NcclSet};
use crate::meeting::{Gathering, Meeting, Seat, Seated};
use crate::op::{Collective, Op};
use crate::trace::Watched;

/// What the device path keeps in its meeting.
pub(crate) struct DeviceState {
    /// Parts whose calls completed (or that had nothing to queue).
    finished: SmallVec<[bool; 4]>,
    /// Peer copies: the sender's token, then the receiver's.
    tokens: [Option<PeerToken>; 2],
    /// Peer kernels: every part's arena, as this process addresses it.
    arenas: SmallVec<[u64; 4]>,
}

/// The shared object of one device-path collective.
pub(crate) struct DeviceCollective {
    /// What runs; roots and endpoints are slots. The calls of a grouped
    /// call are several, all on one NCCL communicator (`ops[0]` alone runs
    /// on the other modes).
    ops: SmallVec<[Op; 1]>,
    /// The grouped all-reduces fused on NCCL (see `fusion`).
    buckets: Vec<Bucket>,
    meeting: Meeting<DeviceState>,
    /// The devices a waiter polls itself, for the spin window, before it
    /// waits for their threads to tell it (see [`Seated::helpers`]): each
    /// member's, where the parts leave calls running there (NCCL, peer
    /// kernels), or the one device of a part queued from the caller's
    /// thread.
    helpers: SmallVec<[Client; 2]>,
}

impl Seated for DeviceCollective {
    type State = DeviceState;

    fn meeting(&self) -> &Meeting<DeviceState> {
        &self.meeting
    }

    /// A part is done once its calls completed on its device.
    fn part_done(&self, state: &Gathering<DeviceState>, slot: usize) -> bool {
        state.data.finished[slot]
    }

    fn helpers(&self) -> &[Client] {
        &self.helpers
    }
}

impl DeviceCollective {
    /// The grouped call `ops` (queued on one NCCL communicator, inside one
    /// `ncclGroupStart/End` per part) among `parts`.
    pub(crate) fn grouped(
        ops: SmallVec<[Op; 1]>,
        buckets: Vec<Bucket>,
        name: &'static str,
        parts: impl IntoIterator<Item = (usize, DeviceId)>,
        timeout: Duration,
        helpers: SmallVec<[Client; 2]>,
    ) -> Arc<DeviceCollective> {
        let seats: SmallVec<[Seat; 4]> =
            parts.into_iter().map(|(member, device)| Seat { device, member: Some(member) }).collect();
        let n = seats.len();
        let state = DeviceState {
            finished: smallvec::smallvec![false; n],
            tokens: [None, None],
            arenas: smallvec::smallvec![0; n],
        };
        Arc::new(DeviceCollective { ops, buckets, meeting: Meeting::new(name, seats, timeout, state), helpers })
    }

    fn fail(&self, err: ServerError) -> ServerError {
        self.meeting.fail(err)
    }

    fn arrive(&self, slot: usize, deadline: Instant) -> Result<(), ServerError> {
        let mut state = self.meeting.lock();
        if self.meeting.arrive_locked(&mut state, slot)? {
            return Ok(());
        }
        self.meeting.wait_arrivals(&mut state, slot, deadline)
    }

    /// Runs part `slot` on its device thread: meets the other parts and
    /// queues its calls (waiting for them only for a barrier). `tracked`,
    /// the collective's flight record, is held until the calls end.
    pub(crate) fn run_part(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        mode: &Mode,
        shapes: &[Shape],
        scratch: &[usize],
        tracked: Option<Arc<Watched>>,
    ) -> Result<(), ServerError> {
        let access = access.map_err(|err| self.fail(err))?;
        let deadline = Instant::now() + self.meeting.timeout();
        let op = &self.ops[0];
        let buffers = shapes[0].bind(|i| access.binding(i));
        if let Mode::Local = mode {
            // A copy needs both buffers: the input is buffer 0, the output 1.
            if plan::local_copy(op, &buffers).is_some() {
                access.copy(0, 1).map_err(|err| self.fail(err))?;
            }
            self.meeting.lock().data.finished[slot] = true;
            return Ok(());
        }
        let peer_call = match mode {
            Mode::PeerKernel(set, algo) => {
                let (Some(src), Some(dst)) = (buffers.input, buffers.output) else {
                    return Err(self.fail(ServerError::InvalidArgument(format!(
                        "{} part without its source or destination",
                        op.name()
                    ))));
                };
                let Some(call) = super::peer::peer_call_for(op, *algo, src, dst) else {
                    return Err(
                        self.fail(ServerError::InvalidArgument(format!("{} has no peer-memory kernel", op.name())))
                    );
                };
                // Every part publishes its arena, and has its kernel loaded,
                // before it arrives: each finds all arenas once the meeting
                // is complete, and no part's launch waits for the context
                // while a peer's kernel already spins for it (see
                // `DeviceCollectives::peer_prepare`).
                let arena = match access.device_collectives() {
                    Some(dc) => dc.peer_prepare(&call).and_then(|()| dc.peer_arena(set.key)),
                    None => Err(ServerError::InvalidState {
                        operation: "a peer-memory collective",
                        reason: "the device's backend offers no device collectives".into(),
                    }),
                };
                self.meeting.lock().data.arenas[slot] = arena.map_err(|err| self.fail(err))?;
                Some(call)
            }
            _ => None,
        };
        self.arrive(slot, deadline)?;
        let result = match mode {
            Mode::Local => unreachable!("handled above"),
            Mode::PeerKernel(set, _) => {
                let arenas = self.meeting.lock().data.arenas.clone();
                let call = peer_call.expect("made above for a peer kernel");
                let spec = PeerSpec { set: set.key, rank: slot, arenas: &arenas, sharing: set.sharing };
                let monitor = Arc::new(PartMonitor { collective: self.clone(), slot, set: set.clone(), tracked });
                let result = access.run_peer_collective(&spec, &call, monitor, Completion::Defer);
                if result.is_err() {
                    forget(set);
                }
                return result.map_err(|err| self.fail(err));
            }
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
                // Sources first, then destinations (and scratch), call by call.
                let (calls, fused) = if self.ops.len() == 1 {
                    // One call: its buffers are the task's, as bound above;
                    // nothing to fuse.
                    (plan::nccl_calls(op, slot, self.meeting.len(), &buffers), None)
                } else {
                    let inputs = shapes.iter().filter(|s| s.input).count();
                    let (mut next_in, mut next_out) = (0, inputs);
                    let mut at = Vec::with_capacity(self.ops.len());
                    let mut unfused = Vec::with_capacity(self.ops.len());
                    for (op, shape) in self.ops.iter().zip(shapes) {
                        let (at_in, at_out) = (next_in, next_out);
                        let buffers = shape.bind_at(|i| access.binding(if i == 0 { at_in } else { at_out + i - 1 }));
                        next_in += usize::from(shape.input);
                        next_out += usize::from(shape.output) + usize::from(shape.scratch);
                        at.push((at_in, at_out));
                        unfused.push((op, buffers));
                    }
                    // Fused all-reduces: packed into each bucket's scratch
                    // first, one call per bucket, unpacked after.
                    let fused = fusion::part(&self.buckets, self.ops.len(), scratch, |c| at[c], |i| access.binding(i));
                    let calls =
                        fused.nccl_calls(unfused.iter().map(|(op, buffers)| (*op, buffers)), slot, self.meeting.len());
                    (calls, Some(fused))
                };
                let (pack, unpack) = match &fused {
                    Some(fused) => (&fused.pack[..], &fused.unpack[..]),
                    None => (&[][..], &[][..]),
                };
                if calls.is_empty() {
                    Ok(())
                } else if let Err(err) = access.copy_regions(pack) {
                    forget(set);
                    return Err(self.fail(err));
                } else {
                    let spec =
                        CommSpec { set: set.key, rank: slot, ranks: self.meeting.len(), unique_id: &set.unique_id };
                    // Barriers are waited for (`wait_finished`); the rest
                    // return once queued.
                    let completion =
                        if op.collective() == Collective::Barrier { Completion::Wait } else { Completion::Defer };
                    stages::mark(Stage::PartReady);
                    let monitor = Arc::new(PartMonitor { collective: self.clone(), slot, set: set.clone(), tracked });
                    let result = access
                        .run_collective(&spec, &calls, monitor, completion)
                        .and_then(|()| access.copy_regions(unpack));
                    stages::mark(Stage::PartQueued);
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
        self.meeting.lock().data.finished[slot] = true;
        self.meeting.notify();
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
        let (meeting, other) = (&self.meeting, 1 - slot);
        let mut state = meeting.lock();
        if slot == 0 {
            let src = buffers.input.expect("a send has a source");
            drop(state);
            let token = dc.peer_export(stream, src)?;
            state = meeting.lock();
            state.data.tokens[0] = Some(token);
            meeting.notify();
        }
        let mut waiting = [true; 2];
        waiting[other] = false;
        meeting.wait_for(
            &mut state,
            slot,
            deadline,
            |s| s.data.tokens[other].is_some(),
            |_| format!("{} did not hand over its half of the copy", meeting.names(&waiting)),
        )?;
        let token = state.data.tokens[other].expect("waited for");
        drop(state);
        if slot == 0 {
            return dc.peer_finish(stream, &token);
        }
        let dst = buffers.output.expect("a receive has a destination");
        let done = dc.peer_import(stream, &token, dst)?;
        meeting.lock().data.tokens[1] = Some(done);
        meeting.notify();
        Ok(())
    }
}

/// One part's view of its meeting while its calls run on the device: the
/// backend asks it for other parts' failures and tells it how the part
/// ended. It holds the collective's flight record, which is finished when
/// the last part's monitor and task are gone.
struct PartMonitor {
    collective: Arc<DeviceCollective>,
    slot: usize,
    set: Arc<NcclSet>,
    tracked: Option<Arc<Watched>>,
}

impl CollectiveMonitor for PartMonitor {
    fn operation(&self) -> &str {
        self.collective.meeting.name()
    }

    fn timeout(&self) -> Duration {
        self.collective.meeting.timeout()
    }

    fn failed_elsewhere(&self) -> Option<ServerError> {
        let meeting = &self.collective.meeting;
        if !meeting.failed() {
            return None;
        }
        meeting.failure()
    }

    fn missing(&self) -> String {
        let meeting = &self.collective.meeting;
        let mut done = meeting.lock().data.finished.clone();
        done[self.slot] = false;
        format!("{} did not finish", meeting.names(&done))
    }

    fn finished(&self, outcome: &Result<(), ServerError>) {
        match outcome {
            Ok(()) => self.collective.mark_finished(self.slot),
            Err(err) => {
                forget(&self.set);
                self.collective.fail(err.clone());
                if let Some(tracked) = &self.tracked {
                    tracked.fail(err.to_string());
                }
            }
        }
    }
}
