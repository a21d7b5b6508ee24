//! The direct path: participants publish the host addresses of their device
//! buffers and the last to arrive runs the collective over them in parallel
//! chunks, while the others wait on their device threads.
//!
//! Who touches which bytes when: a participant's task publishes its
//! addresses and then blocks on the rendezvous until the collective is
//! `done`; it never touches its buffers in between, and once every
//! participant arrived none of them returns before `done` (no timeout
//! applies then), so the memory stays reserved and untouched by its device
//! thread. The last arriver splits the segment into disjoint byte windows;
//! each rayon task owns one window `[a, a + len)` of every segment of every
//! buffer, so no two threads read or write the same byte, except reads of
//! one input by several windows' tasks, which never overlap a write (the
//! argument checks only let a destination alias its own source in the
//! layouts `run_window` handles).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::{BufferAccess, ServerError};
use rayon::prelude::*;
use smallvec::SmallVec;

use super::window::{run_window, Starts, Window};
use super::HostCollective;
use crate::op::Op;

/// Bytes of one window on the direct path: the accumulator stays in the
/// core's L2 cache while it is reduced and copied out.
const DIRECT_CHUNK: usize = 128 * 1024;

/// Segments from this size on are written with non-temporal stores.
const STREAM_FROM: usize = 1 << 20;

/// Segment start addresses each participant published (`usize` so the state
/// stays `Send`; they are turned back into pointers only inside the windows).
#[derive(Default)]
pub(super) struct Addresses {
    ins: SmallVec<[Segments; 4]>,
    outs: SmallVec<[Segments; 4]>,
}

/// The segment starts of one buffer (inline for one segment).
pub(super) type Segments = SmallVec<[usize; 1]>;

impl Addresses {
    pub(super) fn init(&mut self, n: usize) {
        self.ins = smallvec::smallvec![Segments::new(); n];
        self.outs = smallvec::smallvec![Segments::new(); n];
    }
}

impl HostCollective {
    /// The addresses of every segment of `slot`'s buffers.
    fn addresses(&self, slot: usize, access: &mut BufferAccess<'_>) -> Result<(Segments, Segments), ServerError> {
        let n = self.n();
        let (in_segs, out_segs) = (self.op.in_blocks(slot, n), self.op.out_blocks(slot, n));
        let backend = self.meeting.seat(slot).device.backend_name();
        let mut index = 0;
        let mut segments = |segs: usize| -> Result<Segments, ServerError> {
            if segs == 0 {
                return Ok(Segments::new());
            }
            let ptr = access.host_ptr(index).ok_or(ServerError::Unsupported {
                feature: "host-addressable device memory (the direct host path)",
                backend,
            })?;
            index += 1;
            Ok(segments(ptr.ptr as usize, segs, self.seg))
        };
        let ins = segments(in_segs)?;
        let outs = segments(out_segs)?;
        Ok((ins, outs))
    }

    pub(super) fn direct_member(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        let addresses = access.and_then(|access| self.addresses(slot, access));
        let meeting = &self.meeting;
        let mut state = meeting.lock();
        let (ins, outs) = match addresses {
            Ok(found) => found,
            Err(err) => {
                meeting.fail_locked(&mut state, err.clone());
                return Err(err);
            }
        };
        state.data.direct.ins[slot] = ins;
        state.data.direct.outs[slot] = outs;
        if meeting.arrive_locked(&mut state, slot)? {
            // Nobody reads the addresses after the last arrival but the
            // leader: taken, not copied.
            let (ins, outs) = (std::mem::take(&mut state.data.direct.ins), std::mem::take(&mut state.data.direct.outs));
            drop(state);
            let result = catch_unwind(AssertUnwindSafe(|| self.compute(&ins, &outs))).map_err(|payload| {
                ServerError::TaskPanicked {
                    device: meeting.seat(slot).device,
                    message: payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_default(),
                }
            });
            let mut state = meeting.lock();
            state.data.done = true;
            if let Err(err) = result {
                return Err(meeting.fail_locked(&mut state, err));
            }
            meeting.notify();
            return Ok(());
        }
        let deadline = Instant::now() + meeting.timeout();
        meeting.wait_arrivals(&mut state, slot, deadline)?;
        // Everyone arrived: the last arriver is using our memory; wait for it
        // without a deadline (the work is bounded and must not race a return).
        while !state.data.done {
            meeting.sleep(&mut state);
        }
        match state.failure() {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// Runs the collective over the published addresses, window by window
    /// in parallel.
    fn compute(&self, ins: &[Segments], outs: &[Segments]) {
        compute(self.op, self.seg, ins, outs)
    }
}

/// The segment start addresses of a buffer at `base` holding `segs`
/// segments of `seg` bytes.
pub(super) fn segments(base: usize, segs: usize, seg: usize) -> Segments {
    (0..segs).map(|j| base + j * seg).collect()
}

/// Runs `op` (segments of `seg` bytes) over the addresses every slot
/// published, window by window in parallel. Every address must be a
/// segment start inside memory that stays alive and untouched until it
/// returns (see the module docs).
pub(super) fn compute(op: Op, seg: usize, ins: &[Segments], outs: &[Segments]) {
    let in_place = op.collective() == crate::op::Collective::AllToAll && ins.iter().zip(outs).all(|(i, o)| i == o);
    let chunk = DIRECT_CHUNK;
    // Out of place only: in place, the destination lines were just read
    // and are in cache, so plain stores are cheaper.
    let aliased = ins.iter().zip(outs).any(|(i, o)| i.iter().any(|a| o.contains(a)));
    let stream = seg >= STREAM_FROM && !aliased;
    let chunks = seg.div_ceil(chunk);
    let window = |c: usize| {
        let start = c * chunk;
        let len = chunk.min(seg - start);
        let win_ins: SmallVec<[Starts<*const u8>; 4]> =
            ins.iter().map(|segs| segs.iter().map(|&a| (a + start) as *const u8).collect()).collect();
        let win_outs: SmallVec<[Starts<*mut u8>; 4]> =
            outs.iter().map(|segs| segs.iter().map(|&a| (a + start) as *mut u8).collect()).collect();
        let window = Window { ins: &win_ins, outs: &win_outs, len, in_place, stream };
        // SAFETY: every address is a segment start inside a buffer whose
        // task is blocked on this collective (see the module docs), so
        // the memory is alive and untouched by its device thread; this
        // task owns window [start, start + len) of every segment, which no
        // other window overlaps; sources alias destinations only in place
        // (checked before queueing).
        unsafe { run_window(&op, &window) };
    };
    // One window (a small collective) runs here, without a rayon job.
    if chunks == 1 {
        return window(0);
    }
    (0..chunks).into_par_iter().for_each(window);
}
