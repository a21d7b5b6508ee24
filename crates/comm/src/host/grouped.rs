//! Grouped calls on the host engine: several collectives (any sizes and
//! element types) as one [`GroupedHost`], with one task per member and one
//! meeting.
//!
//! Each member's task publishes the host addresses of every call's
//! buffers: the device memory itself where the host can address it (the
//! CPU backend), else host copies (its sources read in, its destinations
//! staged). The last to arrive runs the calls one after another in the
//! order given, over those addresses, while the others wait; then each
//! member writes its staged destinations back. The calls run in parallel
//! on rayon: no call writes memory another call touches (checked before
//! anything is queued). Memory safety follows the
//! direct path's argument (see `direct.rs`): no task returns, or touches
//! its buffers, before the last arriver is done.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{BufferAccess, ServerError};
use rayon::prelude::*;
use smallvec::SmallVec;

use super::direct::{compute, segments, Segments};
use crate::meeting::{Meeting, Seat, Seated};
use crate::op::Op;

/// Every member's addresses, per call: `ins[slot][call]` segment starts.
pub(crate) struct GroupState {
    ins: Vec<Vec<Segments>>,
    outs: Vec<Vec<Segments>>,
    done: bool,
}

/// One grouped call's shared object: the calls (roots are slots) and the
/// meeting of every member's one task.
pub(crate) struct GroupedHost {
    ops: Vec<Op>,
    meeting: Meeting<GroupState>,
}

impl Seated for GroupedHost {
    type State = GroupState;

    fn meeting(&self) -> &Meeting<GroupState> {
        &self.meeting
    }
}

/// Where a member's destination lives while the leader computes.
enum Out {
    /// In device memory, written in place.
    Device,
    /// In a host copy, written back after (buffer index, copy).
    Staged(usize, Vec<u64>),
}

impl GroupedHost {
    /// The calls `ops` among `seats`, waits bounded by `timeout`.
    pub(crate) fn new(ops: Vec<Op>, seats: Vec<Seat>, timeout: Duration) -> Arc<GroupedHost> {
        let n = seats.len();
        let state = GroupState { ins: vec![Vec::new(); n], outs: vec![Vec::new(); n], done: false };
        Arc::new(GroupedHost { ops, meeting: Meeting::new("group", seats, timeout, state) })
    }

    /// Member `slot`'s task; `has` says which calls gave it a source and a
    /// destination (its task holds every call's source, then every call's destination, in call order).
    pub(crate) fn run_member(
        &self,
        slot: usize,
        has: &[(bool, bool)],
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        let meeting = &self.meeting;
        let access = match access {
            Ok(access) => access,
            Err(err) => return Err(meeting.fail(err)),
        };
        let n = meeting.len();
        let inputs = has.iter().filter(|h| h.0).count();
        // Host copies stay alive in these until the task returns.
        let mut copies: Vec<cohort_runtime::AlignedBytes> = Vec::new();
        let mut staged: Vec<Out> = Vec::new();
        let (mut ins, mut outs) = (Vec::with_capacity(has.len()), Vec::with_capacity(has.len()));
        let (mut next_in, mut next_out) = (0, inputs);
        for (op, (has_in, has_out)) in self.ops.iter().zip(has) {
            let seg = op.block_bytes();
            let mut found = Segments::new();
            if *has_in {
                let base = match access.host_ptr(next_in) {
                    Some(p) => p.ptr as usize,
                    None => {
                        let bytes = access.read(next_in).map_err(|e| meeting.fail(e))?;
                        copies.push(bytes);
                        copies.last().expect("just pushed").as_slice().as_ptr() as usize
                    }
                };
                found = segments(base, op.in_blocks(slot, n), seg);
                next_in += 1;
            }
            ins.push(found);
            let mut found = Segments::new();
            if *has_out {
                let base = match access.host_ptr(next_out) {
                    Some(p) => {
                        staged.push(Out::Device);
                        p.ptr as usize
                    }
                    None => {
                        let size = access.size(next_out) as usize;
                        let mut copy = vec![0u64; size.div_ceil(8)];
                        let base = copy.as_mut_ptr() as usize;
                        staged.push(Out::Staged(next_out, copy));
                        base
                    }
                };
                found = segments(base, op.out_blocks(slot, n), seg);
                next_out += 1;
            }
            outs.push(found);
        }
        let mut state = meeting.lock();
        if let Some(err) = state.failure() {
            return Err(err.clone());
        }
        state.data.ins[slot] = ins;
        state.data.outs[slot] = outs;
        if meeting.arrive_locked(&mut state, slot)? {
            let (ins, outs) = (std::mem::take(&mut state.data.ins), std::mem::take(&mut state.data.outs));
            drop(state);
            // The calls touch disjoint memory where one writes (checked
            // before queueing), so they run in parallel.
            let result = catch_unwind(AssertUnwindSafe(|| {
                self.ops.par_iter().enumerate().for_each(|(k, op)| {
                    let call_ins: SmallVec<[Segments; 4]> = ins.iter().map(|m| m[k].clone()).collect();
                    let call_outs: SmallVec<[Segments; 4]> = outs.iter().map(|m| m[k].clone()).collect();
                    compute(*op, op.block_bytes(), &call_ins, &call_outs);
                })
            }));
            let mut state = meeting.lock();
            state.data.done = true;
            if result.is_err() {
                let err = meeting.error(slot, "a grouped call panicked while reducing on the host".into());
                return Err(meeting.fail_locked(&mut state, err));
            }
            meeting.notify();
        } else {
            let deadline = Instant::now() + meeting.timeout();
            meeting.wait_arrivals(&mut state, slot, deadline)?;
            // Everyone arrived: the leader is using our memory; wait for it
            // without a deadline (bounded work that must not race a return).
            while !state.data.done {
                meeting.sleep(&mut state);
            }
            if let Some(err) = state.failure() {
                return Err(err.clone());
            }
        }
        for out in staged {
            if let Out::Staged(index, copy) = out {
                let size = access.size(index) as usize;
                // SAFETY: `copy` holds `size.div_ceil(8)` u64s, so its first
                // `size` bytes are initialised and in bounds.
                let bytes = unsafe { std::slice::from_raw_parts(copy.as_ptr() as *const u8, size) };
                access.write(index, bytes).map_err(|e| meeting.fail(e))?;
            }
        }
        Ok(())
    }
}
