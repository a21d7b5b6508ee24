//! [`GroupCall`]: one collective of a grouped call, as the typed builder
//! ([`Grouped`](crate::Grouped)) records it; and the check that the calls
//! of one group do not depend on each other.

use cohort_runtime::Handle;

use crate::error::CommError;
use crate::ops::{DType, ReduceOp};

/// One handle per local device, for one side of one call of a group: held
/// inline (no heap allocation) for up to two local devices, so recording a
/// call allocates nothing. A `Vec<Handle>` converts with `.into()`.
pub type CallHandles = smallvec::SmallVec<[Handle; 2]>;

/// One collective of a grouped call, untyped: one handle per local device
/// (in [`clients`](crate::Collectives::clients) order), and the root's
/// single handle for the rooted ones (pass any local handle where this
/// process does not hold the root).
#[derive(Debug, Clone)]
pub enum GroupCall {
    /// See [`Collectives::all_reduce`](crate::Collectives::all_reduce).
    AllReduce { src: CallHandles, dst: CallHandles, dtype: DType, op: ReduceOp },
    /// See [`Collectives::reduce`](crate::Collectives::reduce).
    Reduce { src: CallHandles, dst: Handle, dtype: DType, op: ReduceOp, root: usize },
    /// See [`Collectives::broadcast`](crate::Collectives::broadcast).
    Broadcast { src: Handle, dst: CallHandles, dtype: DType, root: usize },
    /// See [`Collectives::all_gather`](crate::Collectives::all_gather).
    AllGather { src: CallHandles, dst: CallHandles, dtype: DType },
    /// See [`Collectives::reduce_scatter`](crate::Collectives::reduce_scatter).
    ReduceScatter { src: CallHandles, dst: CallHandles, dtype: DType, op: ReduceOp },
    /// See [`Collectives::all_to_all`](crate::Collectives::all_to_all).
    AllToAll { src: CallHandles, dst: CallHandles, dtype: DType },
}

impl GroupCall {
    /// What local slot `slot` sends and receives in this call: its source
    /// and destination, the root's alone for a rooted call (`root_slot`:
    /// the root's local slot, when this process holds it).
    pub(crate) fn part(
        &self,
        slot: usize,
        root_slot: impl Fn(usize) -> Option<usize>,
    ) -> (Option<&Handle>, Option<&Handle>) {
        match self {
            GroupCall::AllReduce { src, dst, .. }
            | GroupCall::AllGather { src, dst, .. }
            | GroupCall::ReduceScatter { src, dst, .. }
            | GroupCall::AllToAll { src, dst, .. } => (src.get(slot), dst.get(slot)),
            GroupCall::Reduce { src, dst, root, .. } => {
                (src.get(slot), (root_slot(*root) == Some(slot)).then_some(dst))
            }
            GroupCall::Broadcast { src, dst, root, .. } => {
                ((root_slot(*root) == Some(slot)).then_some(src), dst.get(slot))
            }
        }
    }
}

/// Refuses a group where a call writes memory another call of the same
/// group reads or writes: the calls of a group run as one, concurrently
/// (on NCCL, and on the host engine), so none may depend on another.
/// `buffers` is every buffer of the group as (call, buffer, whether the
/// call writes it), in any order; the check keeps one vector for the whole
/// group.
pub(crate) fn check_independent<'h>(
    buffers: impl IntoIterator<Item = (usize, &'h Handle, bool)>,
) -> Result<(), CommError> {
    // Every non-empty buffer as (allocation, start, end, call, writes),
    // swept in start order per allocation: only buffers that overlap are
    // ever compared, so a group of many separate buffers costs n log n.
    let buffers = buffers.into_iter();
    let mut spans: Vec<(usize, u64, u64, usize, bool)> = Vec::with_capacity(buffers.size_hint().0);
    for (call, h, writes) in buffers.filter(|b| b.1.size() > 0) {
        let span = (h.allocation_key(), h.offset(), h.offset() + h.size(), call, writes);
        match spans.last_mut() {
            // A call in place gives its buffer twice in a row, as source and
            // as destination: one span that writes stands for both.
            Some(last) if (last.0, last.1, last.2, last.3) == (span.0, span.1, span.2, span.3) => last.4 |= span.4,
            _ => spans.push(span),
        }
    }
    spans.sort_unstable_by_key(|s| (s.0, s.1));
    let mut active: Vec<(usize, u64, u64, usize, bool)> = Vec::new();
    for span in spans {
        active.retain(|a| a.0 == span.0 && a.2 > span.1);
        for a in &active {
            if a.3 != span.3 && (a.4 || span.4) {
                let (earlier, later) = (a.3.min(span.3), a.3.max(span.3));
                return Err(CommError::DependentCalls { earlier, later });
            }
        }
        active.push(span);
    }
    Ok(())
}
