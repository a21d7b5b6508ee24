//! The staged path, for devices whose memory the host cannot address: each
//! participant copies its input to host memory chunk by chunk, a rayon task
//! computes a chunk's outputs as soon as every participant published it, and
//! each participant writes its outputs back, so the copies of one chunk
//! overlap the host work of another.
//!
//! Only host memory the collective owns is shared between threads here
//! (staging bytes moved into and out of the rendezvous state under its lock),
//! so a timeout may end a wait at any point without leaving a thread behind
//! that touches device memory.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::{AlignedBytes, BufferAccess, ServerError};

use super::window::{run_window, Starts, Window};
use super::HostCollective;

/// Per-chunk staging of one collective.
#[derive(Default)]
pub(super) struct Chunks {
    /// `[chunk][slot]`: a participant's input pieces (one per segment) until
    /// the chunk is computed.
    inputs: Vec<Vec<Option<Vec<AlignedBytes>>>>,
    /// `[chunk]`: how many participants published the chunk.
    arrivals: Vec<usize>,
    /// `[chunk][slot][segment]`: computed outputs, taken by their writer.
    outputs: Vec<Option<Vec<Vec<Vec<u8>>>>>,
}

impl Chunks {
    pub(super) fn init(&mut self, participants: usize, chunks: usize) {
        self.inputs = vec![vec![None; participants]; chunks];
        self.arrivals = vec![0; chunks];
        self.outputs = vec![None; chunks];
    }
}

/// `(start, len)` of each chunk of a segment of `seg` bytes.
pub(crate) fn chunk_ranges(seg: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..seg.div_ceil(chunk)).map(move |c| (c * chunk, chunk.min(seg - c * chunk)))
}

impl HostCollective {
    pub(super) fn staged_member(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        let meeting = &self.meeting;
        let access = match access {
            Ok(access) => access,
            Err(err) => {
                meeting.fail(err.clone());
                return Err(err);
            }
        };
        let deadline = Instant::now() + meeting.timeout();
        {
            let mut state = meeting.lock();
            meeting.arrive_locked(&mut state, slot)?;
            meeting.wait_arrivals(&mut state, slot, deadline)?;
        }
        let n = self.n();
        let (in_segs, out_segs) = (self.op.in_blocks(slot, n), self.op.out_blocks(slot, n));
        let ranges: Vec<(usize, usize)> = chunk_ranges(self.seg, self.stage_chunk).collect();
        for (c, &(_, len)) in ranges.iter().enumerate() {
            let mut pieces = Vec::with_capacity(in_segs);
            for j in 0..in_segs {
                pieces.push(access.read(c * in_segs + j).map_err(|err| meeting.fail(err))?);
            }
            let mut state = meeting.lock();
            if let Some(err) = state.failure() {
                return Err(err.clone());
            }
            let staged = &mut state.data.staged;
            staged.inputs[c][slot] = Some(pieces);
            staged.arrivals[c] += 1;
            if staged.arrivals[c] == n {
                let inputs = std::mem::take(&mut staged.inputs[c]);
                let me = self.clone();
                rayon::spawn(move || me.compute_chunk(c, len, inputs));
            }
        }
        let first_output = ranges.len() * in_segs;
        for c in 0..ranges.len() {
            let pieces = {
                let mut state = meeting.lock();
                loop {
                    if let Some(err) = state.failure() {
                        return Err(err.clone());
                    }
                    if let Some(outputs) = &mut state.data.staged.outputs[c] {
                        break std::mem::take(&mut outputs[slot]);
                    }
                    if meeting.sleep_until(&mut state, deadline) && state.data.staged.outputs[c].is_none() {
                        let err = self.stalled_error(slot, c);
                        return Err(meeting.fail_locked(&mut state, err));
                    }
                }
            };
            for (j, bytes) in pieces.iter().enumerate() {
                access.write(first_output + c * out_segs + j, bytes).map_err(|err| meeting.fail(err))?;
            }
        }
        Ok(())
    }

    fn stalled_error(&self, slot: usize, chunk: usize) -> ServerError {
        self.meeting.error(
            slot,
            format!(
                "chunk {chunk} was not ready within {:.1} s although every member arrived: a member's copies to \
                 the host stalled (raise COHORT_TIMEOUT, in seconds, for very slow devices)",
                self.meeting.timeout().as_secs_f64()
            ),
        )
    }

    /// Computes chunk `c`'s outputs from every participant's staged input
    /// (on a rayon thread) and publishes them.
    fn compute_chunk(&self, c: usize, len: usize, inputs: Vec<Option<Vec<AlignedBytes>>>) {
        let n = self.n();
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut outs: Vec<Vec<Vec<u8>>> =
                (0..n).map(|s| (0..self.op.out_blocks(s, n)).map(|_| vec![0u8; len]).collect()).collect();
            let win_ins: Vec<Starts<*const u8>> =
                inputs.iter().map(|p| p.iter().flatten().map(|b| b.as_slice().as_ptr()).collect()).collect();
            let win_outs: Vec<Starts<*mut u8>> =
                outs.iter_mut().map(|segs| segs.iter_mut().map(|v| v.as_mut_ptr()).collect()).collect();
            let window = Window { ins: &win_ins, outs: &win_outs, len, in_place: false, stream: false };
            // SAFETY: every input piece is `len` bytes this function owns
            // (moved out of the shared state), every output is a fresh `len`
            // byte vector it owns; inputs and outputs are distinct
            // allocations, and nothing else touches them until it returns.
            unsafe { run_window(&self.op, &window) };
            outs
        }));
        let meeting = &self.meeting;
        let mut state = meeting.lock();
        match result {
            Ok(outs) => state.data.staged.outputs[c] = Some(outs),
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let device = meeting.seat(0).device;
                meeting.fail_locked(&mut state, ServerError::TaskPanicked { device, message });
            }
        }
        meeting.notify();
    }
}
