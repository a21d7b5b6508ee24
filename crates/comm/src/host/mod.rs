//! The host-staged engine: one [`HostCollective`] object per call, shared by the
//! tasks every participant runs on its own device thread, which meet through
//! its [`Meeting`].
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
mod grouped;
mod staged;
mod window;

use std::sync::Arc;
use std::time::Duration;

use cohort_runtime::config::{self, ConfigError};
use cohort_runtime::{BufferAccess, Handle, ServerError, TaskHandles};
use smallvec::SmallVec;

pub(crate) use grouped::GroupedHost;

use crate::meeting::{Meeting, Seat, Seated};
use crate::op::Op;

/// Default collective timeout: 10 minutes (`COHORT_TIMEOUT`'s default).
pub const DEFAULT_TIMEOUT: Duration = config::TIMEOUT.fallback;

/// The timeout collectives get unless a group sets one: `COHORT_TIMEOUT`
/// seconds (fractions allowed) when it is set, else [`DEFAULT_TIMEOUT`]; an
/// error naming `COHORT_TIMEOUT` when its value cannot be used.
pub fn default_timeout() -> Result<Duration, ConfigError> {
    config::TIMEOUT.get()
}

/// A timeout a caller gave, kept within what deadlines can hold: from 1 ms
/// to [`config::MAX_SECONDS`] (about 31 years, so `Duration::MAX` means "no
/// timeout" without overflowing `Instant` arithmetic on a device thread).
pub fn bounded_timeout(timeout: Duration) -> Duration {
    timeout.clamp(Duration::from_millis(1), Duration::from_secs_f64(config::MAX_SECONDS))
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

/// What the host engine keeps in its meeting.
#[derive(Default)]
pub(crate) struct HostState {
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
    pub direct: bool,
    /// Staged path: bytes per pipelined chunk of a segment.
    pub stage_chunk: usize,
    meeting: Meeting<HostState>,
}

impl Seated for HostCollective {
    type State = HostState;

    fn meeting(&self) -> &Meeting<HostState> {
        &self.meeting
    }
}

impl HostCollective {
    /// The collective `op` among `seats`, on the direct or the staged path.
    pub(crate) fn new(
        op: Op,
        seats: impl IntoIterator<Item = Seat>,
        timeout: Duration,
        direct: bool,
        stage_chunk: usize,
    ) -> Arc<Self> {
        let seats: SmallVec<[Seat; 4]> = seats.into_iter().collect();
        let (n, seg) = (seats.len(), op.block_bytes());
        let mut state = HostState::default();
        state.direct.init(n);
        if !direct {
            state.staged.init(n, staged::chunk_ranges(seg, stage_chunk).count());
        }
        Arc::new(HostCollective {
            op,
            seg,
            direct,
            stage_chunk,
            meeting: Meeting::new(op.name(), seats, timeout, state),
        })
    }

    fn n(&self) -> usize {
        self.meeting.len()
    }

    /// The handles a participant's task is queued with: whole buffers on the
    /// direct path, one slice per chunk and segment on the staged path.
    pub(crate) fn task_buffers(
        &self,
        slot: usize,
        input: Option<&Handle>,
        output: Option<&Handle>,
    ) -> Result<(TaskHandles, TaskHandles), ServerError> {
        if self.direct {
            return Ok((input.into_iter().cloned().collect(), output.into_iter().cloned().collect()));
        }
        let n = self.n();
        let pieces = |handle: Option<&Handle>, segs: usize| -> Result<TaskHandles, ServerError> {
            let mut out = TaskHandles::new();
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

    /// A participant's task body, on its device thread: waits for the other
    /// participants (up to the timeout) and for the bytes to move.
    pub(crate) fn run_member(
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
}
