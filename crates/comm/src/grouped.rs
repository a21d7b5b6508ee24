//! [`GroupCall`]: one collective of a grouped call, as the typed builder
//! ([`Grouped`](crate::Grouped)) records it; and the check that the calls
//! of one group do not depend on each other.

use cohort_runtime::Handle;

use crate::error::CommError;
use crate::ops::{DType, ReduceOp};

/// One collective of a grouped call, untyped: one handle per local device
/// (in [`clients`](crate::Collectives::clients) order), and the root's
/// single handle for the rooted ones (pass any local handle where this
/// process does not hold the root).
#[derive(Debug, Clone)]
pub enum GroupCall {
    /// See [`Collectives::all_reduce`](crate::Collectives::all_reduce).
    AllReduce { src: Vec<Handle>, dst: Vec<Handle>, dtype: DType, op: ReduceOp },
    /// See [`Collectives::reduce`](crate::Collectives::reduce).
    Reduce { src: Vec<Handle>, dst: Handle, dtype: DType, op: ReduceOp, root: usize },
    /// See [`Collectives::broadcast`](crate::Collectives::broadcast).
    Broadcast { src: Handle, dst: Vec<Handle>, dtype: DType, root: usize },
    /// See [`Collectives::all_gather`](crate::Collectives::all_gather).
    AllGather { src: Vec<Handle>, dst: Vec<Handle>, dtype: DType },
    /// See [`Collectives::reduce_scatter`](crate::Collectives::reduce_scatter).
    ReduceScatter { src: Vec<Handle>, dst: Vec<Handle>, dtype: DType, op: ReduceOp },
    /// See [`Collectives::all_to_all`](crate::Collectives::all_to_all).
    AllToAll { src: Vec<Handle>, dst: Vec<Handle>, dtype: DType },
}

/// Refuses a group where a call writes memory another call of the same
/// group reads or writes: the calls of a group run as one, concurrently
/// (on NCCL, and on the host engine), so none may depend on another.
/// `calls[k]` is call `k`'s (sources, destinations).
pub(crate) fn check_independent(calls: &[(Vec<&Handle>, Vec<&Handle>)]) -> Result<(), CommError> {
    // Every non-empty buffer as (allocation, start, end, call, writes),
    // swept in start order per allocation: only buffers that overlap are
    // ever compared, so a group of many separate buffers costs n log n.
    let mut spans: Vec<(usize, u64, u64, usize, bool)> = Vec::new();
    for (call, (ins, outs)) in calls.iter().enumerate() {
        for (handles, writes) in [(ins, false), (outs, true)] {
            for h in handles.iter().filter(|h| h.size() > 0) {
                spans.push((h.allocation_key(), h.offset(), h.offset() + h.size(), call, writes));
            }
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
