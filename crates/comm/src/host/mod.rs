//! The host-staged engine: one [`HostCollective`] object per call, shared by the
//! tasks every participant runs on its own device thread.
//!
//! Each participant's task arrives at the collective's rendezvous, and the
//! bytes move on the host:
//!
//! * **direct** (devices whose memory the host can address: the CPU backend):
//!   each task publishes the addresses of its buffers and the last to arrive
//!   reduces and copies straight between device memories, in parallel chunks
//!   on rayon, while the others wait; no extra copy.
//! * **staged** (every other backend): each task reads its input chunk by
//!   chunk into host memory; as soon as every participant has published chunk
//!   `c`, a rayon task computes chunk `c`'s outputs, which each participant
//!   writes back. Reads, host reductions and writes of different chunks
//!   overlap.
//!
//! A failure in any participant (a poisoned input, a failed read, a panic, a
//! timeout) is recorded once and returned by every participant's task, so it
//! marks every destination; no participant waits past the timeout for one
//! that never arrives.

mod direct;
mod staged;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{BufferAccess, DeviceId, Handle, ServerError};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::op::Op;

/// Default collective timeout: 10 minutes.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The timeout collectives get unless a group sets one: `COHORT_TIMEOUT`
/// (seconds, fractions allowed) when it is set to a positive number, else
/// [`DEFAULT_TIMEOUT`].
pub fn default_timeout() -> Duration {
    std::env::var("COHORT_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(DEFAULT_TIMEOUT)
}

/// How a collective moves bytes through the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostPath {
    /// Direct where every member's memory is host-addressable, staged
    /// elsewhere.
    #[default]
    Auto,
    /// Reduce and copy in device memory through host pointers (CPU backend).
    Direct,
    /// Read to host memory, reduce there, write back, chunk by chunk.
    Staged,
}

/// One participant of a collective.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Participant {
    /// Its index in the group.
    pub member: usize,
    pub device: DeviceId,
}

/// Mutable rendezvous state.
#[derive(Default)]
struct State {
    arrived: usize,
    present: Vec<bool>,
    /// Tasks that returned (or were dropped without running).
    finished: usize,
    /// The first failure; every participant returns it.
    failure: Option<ServerError>,
    /// Direct path: the collective ran (or failed after everyone arrived).
    done: bool,
    direct: direct::Addresses,
    staged: staged::Chunks,
}

/// The shared object of one collective call.
pub(crate) struct HostCollective {
    /// What runs; roots and endpoints are slots.
    pub op: Op,
    /// Segment (one member's block) size in bytes.
    pub seg: usize,
    pub parts: Vec<Participant>,
    pub timeout: Duration,
    pub direct: bool,
    /// Staged path: bytes per pipelined chunk of a segment.
    pub stage_chunk: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl HostCollective {
    pub(crate) fn new(
        op: Op,
        parts: Vec<Participant>,
        timeout: Duration,
        direct: bool,
        stage_chunk: usize,
    ) -> Arc<Self> {
        let (n, seg) = (parts.len(), op.block_bytes());
        let mut state = State { present: vec![false; n], ..State::default() };
        state.direct.init(n);
        if !direct {
            state.staged.init(n, staged::chunk_ranges(seg, stage_chunk).count());
        }
        Arc::new(HostCollective {
            op,
            seg,
            parts,
            timeout,
            direct,
            stage_chunk,
            state: Mutex::new(state),
            cv: Condvar::new(),
        })
    }

    fn n(&self) -> usize {
        self.parts.len()
    }

    /// The handles a participant's task is queued with: whole buffers on the
    /// direct path, one slice per chunk and segment on the staged path.
    pub(crate) fn task_buffers(
        &self,
        slot: usize,
        input: Option<&Handle>,
        output: Option<&Handle>,
    ) -> Result<(Vec<Handle>, Vec<Handle>), ServerError> {
        if self.direct {
            return Ok((input.into_iter().cloned().collect(), output.into_iter().cloned().collect()));
        }
        let n = self.n();
        let pieces = |handle: Option<&Handle>, segs: usize| -> Result<Vec<Handle>, ServerError> {
            let mut out = Vec::new();
            if let Some(handle) = handle {
                for (start, len) in staged::chunk_ranges(self.seg, self.stage_chunk) {
                    for j in 0..segs {
                        out.push(handle.slice((j * self.seg + start) as u64, len as u64)?);
                    }
                }
            }
            Ok(out)
        };
        Ok((pieces(input, self.op.in_blocks(slot, n))?, pieces(output, self.op.out_blocks(slot, n))?))
    }

    /// A participant's task body.
    fn run_member(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        if self.direct {
            self.direct_member(slot, access)
        } else {
            self.staged_member(slot, access)
        }
    }

    /// Records `err` as the collective's failure (the first one wins) and
    /// wakes every waiter.
    fn fail_locked(&self, state: &mut State, err: ServerError) -> ServerError {
        let failure = state.failure.get_or_insert(err).clone();
        self.cv.notify_all();
        failure
    }

    fn fail(&self, err: ServerError) -> ServerError {
        let mut state = self.state.lock();
        self.fail_locked(&mut state, err)
    }

    /// Marks `slot` as arrived; refuses when the collective already failed.
    fn arrive(&self, state: &mut State, slot: usize) -> Result<(), ServerError> {
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        state.present[slot] = true;
        state.arrived += 1;
        if state.arrived == self.n() {
            self.cv.notify_all();
        }
        Ok(())
    }

    /// Waits (holding `state` between checks) until every participant
    /// arrived; past the deadline, fails the collective naming those that
    /// did not.
    fn wait_arrivals(
        &self,
        state: &mut MutexGuard<'_, State>,
        slot: usize,
        deadline: Instant,
    ) -> Result<(), ServerError> {
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if state.arrived == self.n() {
                return Ok(());
            }
            if self.cv.wait_until(state, deadline).timed_out() && state.arrived < self.n() && state.failure.is_none() {
                let err = self.timeout_error(state, slot);
                return Err(self.fail_locked(state, err));
            }
        }
    }

    fn timeout_error(&self, state: &State, slot: usize) -> ServerError {
        let missing: Vec<String> = self
            .parts
            .iter()
            .zip(&state.present)
            .filter(|(_, present)| !**present)
            .map(|(p, _)| format!("member {} ({})", p.member, p.device))
            .collect();
        ServerError::Collective {
            collective: self.op.name().to_string(),
            device: self.parts[slot].device,
            reason: format!(
                "{} did not arrive within {:.1} s: their devices are still busy with earlier work or blocked; \
                     every member must call the same collectives in the same order (raise COHORT_TIMEOUT, in \
                     seconds, if the work before it is legitimately that long)",
                missing.join(", "),
                self.timeout.as_secs_f64()
            ),
        }
    }

    fn member_finished(&self) {
        let mut state = self.state.lock();
        state.finished += 1;
        self.cv.notify_all();
    }

    /// Blocks the calling (host) thread until every participant's task
    /// finished, or until the collective failed; returns the failure.
    pub(crate) fn wait_finished(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock();
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if state.finished == self.n() {
                return Ok(());
            }
            self.cv.wait(&mut state);
        }
    }
}

/// A participant's right to run its part. Dropped without running (its
/// device closed, its queue was dropped), it fails the collective so the
/// other participants return at once instead of waiting for the timeout.
pub(crate) struct Ticket {
    collective: Arc<HostCollective>,
    slot: usize,
    ran: bool,
}

impl Ticket {
    pub(crate) fn new(collective: &Arc<HostCollective>, slot: usize) -> Self {
        Ticket { collective: collective.clone(), slot, ran: false }
    }

    /// Runs the participant's part on its device thread: waits for the
    /// other participants (up to the timeout) and for the bytes to move.
    pub(crate) fn run(mut self, access: Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> {
        self.ran = true;
        self.collective.run_member(self.slot, access)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.ran {
            let p = self.collective.parts[self.slot];
            self.collective.fail(ServerError::Poisoned {
                operation: self.collective.op.name().to_string(),
                cause: Arc::new(ServerError::DeviceClosed { device: p.device }),
            });
        }
        self.collective.member_finished();
    }
}
