//! Tensor fusion of a grouped call on NCCL: the group's all-reduces of one
//! element type and operator are packed into one scratch buffer per device,
//! reduced by one NCCL all-reduce, and unpacked into their destinations, as
//! Horovod's tensor fusion and PyTorch's coalesced buckets do. 256
//! all-reduces of 4 KiB then cost NCCL one call instead of 256.
//!
//! The plan ([`buckets`]) depends only on the calls' descriptions, which
//! every member shares (the fingerprint check compares them), so every
//! member packs the same buckets in the same order. A bucket holds at most
//! `COHORT_FUSION_MB` MiB (64 by default; 0 turns fusion off): larger groups
//! split into several buckets, and a call larger than the cap runs alone, as
//! does a call with no partner of its type and operator. Zero-byte calls
//! make no NCCL call at all and are left out. Other collectives of the
//! group stay as they were, inside the same `ncclGroupStart/End`.
//!
//! A part's task runs, on its stream: one batched copy packing every
//! bucket's sources ([`BufferAccess::copy_regions`], one kernel on CUDA),
//! the NCCL calls (one per bucket, beside the group's unfused calls), and one
//! batched copy unpacking the buckets into the destinations. In place calls
//! (source = destination) work as any other: the source is read before the
//! reduction and the destination written after it. The scratch buffers come
//! from the device's memory pool ([`cohort_runtime::Client::empty`]), so
//! calls of the same sizes reuse the same pages.
//!
//! The part's end (its [`Work`](crate::Work)) is the NCCL calls' end; the
//! unpack follows on the same stream, so every later task and read of the
//! destinations runs after it.
//!
//! Results: NCCL reduces one element from the same element of every rank,
//! so integer types and min / max give the same bits as separate calls for
//! any number of ranks. A floating-point sum, product or average of one or
//! two ranks does too (one value, or `a + b` = `b + a`); with three or more
//! ranks NCCL's order of the additions for one element depends on the
//! algorithm and on where the element falls in the ring's chunks, which the
//! fused buffer's size and the element's offset change, so the last bits
//! can differ from separate calls (as they differ between separate calls of
//! different sizes).

use cohort_runtime::backend::{Binding, DeviceCall};
use cohort_runtime::{config, CopyRegion};
use smallvec::SmallVec;

use super::plan::DeviceCalls;

use crate::op::{Collective, Op};
use crate::ops::{DType, ReduceOp};

/// Each fused call's block starts at a multiple of this many bytes in the
/// scratch buffer (the element size of every type divides it, and the
/// batched copy moves 16 bytes at a time where both ends allow).
pub(crate) const ALIGN: u64 = 16;

/// One scratch buffer's worth of all-reduces of one element type and
/// operator, each at its offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    pub dtype: DType,
    pub op: ReduceOp,
    /// (the call's index in the group, its offset in the scratch, bytes).
    pub members: Vec<(usize, u64, u64)>,
    /// The scratch buffer's size.
    pub bytes: u64,
}

/// The cap on one bucket in bytes from `COHORT_FUSION_MB` (read once; an
/// unusable value is refused by `ClientGroup::new` and
/// `Communicator::connect`, and means the default here); 0 turns fusion
/// off.
pub(crate) fn cap() -> u64 {
    static CAP: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        let mib = config::FUSION_MB.get().unwrap_or_else(|err| {
            tracing::warn!("{err}; grouped all-reduces fuse up to the default {} MiB", config::FUSION_MB.fallback);
            config::FUSION_MB.fallback
        });
        (mib as u64).saturating_mul(1 << 20)
    })
}

/// The buckets of a group of `ops` under `cap` bytes each, in the order
/// their first calls appear; only buckets of two or more calls (the others
/// run as they are). Deterministic in `ops` alone.
pub(crate) fn buckets(ops: &[Op], cap: u64) -> Vec<Bucket> {
    if cap == 0 || ops.len() < 2 {
        return Vec::new();
    }
    // Open buckets by (type, operator); a full one is closed and replaced.
    let mut open: Vec<Bucket> = Vec::new();
    let mut closed: Vec<(usize, Bucket)> = Vec::new();
    let mut first_call: Vec<usize> = Vec::new();
    for (call, op) in ops.iter().enumerate() {
        let bytes = op.block_bytes() as u64;
        let Some(reduce) = op.reduce_op().filter(|_| op.collective() == Collective::AllReduce && bytes > 0) else {
            continue;
        };
        if bytes > cap {
            continue;
        }
        let at = match open.iter().position(|b| b.dtype == op.dtype() && b.op == reduce) {
            Some(at) if open[at].bytes.next_multiple_of(ALIGN) + bytes <= cap => at,
            found => {
                if let Some(at) = found {
                    let full = std::mem::replace(
                        &mut open[at],
                        Bucket { dtype: op.dtype(), op: reduce, members: Vec::new(), bytes: 0 },
                    );
                    closed.push((first_call[at], full));
                    first_call[at] = call;
                    at
                } else {
                    open.push(Bucket { dtype: op.dtype(), op: reduce, members: Vec::new(), bytes: 0 });
                    first_call.push(call);
                    open.len() - 1
                }
            }
        };
        let bucket = &mut open[at];
        let offset = bucket.bytes.next_multiple_of(ALIGN);
        bucket.members.push((call, offset, bytes));
        bucket.bytes = offset + bytes;
    }
    closed.extend(first_call.into_iter().zip(open));
    closed.sort_by_key(|(first, _)| *first);
    closed.into_iter().map(|(_, b)| b).filter(|b| b.members.len() >= 2).collect()
}

/// One part's fused work: what to pack before the NCCL calls, the calls
/// that reduce the buckets, and what to unpack after them.
#[derive(Debug, Default)]
pub(crate) struct FusedPart {
    /// Per call of the group, whether a bucket carries it (its own NCCL
    /// call is left out).
    pub fused: SmallVec<[bool; 8]>,
    pub pack: Vec<CopyRegion>,
    pub calls: Vec<DeviceCall>,
    pub unpack: Vec<CopyRegion>,
}

impl FusedPart {
    /// The NCCL calls of part `rank` of `ranks`: every call of `parts` (the
    /// group's calls, in order, with their bound buffers) that no bucket
    /// carries, then one all-reduce per bucket.
    pub(crate) fn nccl_calls<'a>(
        &self,
        parts: impl IntoIterator<Item = (&'a Op, &'a super::plan::Buffers)>,
        rank: usize,
        ranks: usize,
    ) -> DeviceCalls {
        let mut calls: DeviceCalls = parts
            .into_iter()
            .zip(&self.fused)
            .filter(|(_, fused)| !**fused)
            .flat_map(|((op, buffers), _)| super::plan::nccl_calls(op, rank, ranks, buffers))
            .collect();
        calls.extend(self.calls.iter().copied());
        calls
    }
}

/// Whether each of a group's `calls` calls is fused into one of `buckets`:
/// its bucket is packed from its source before the bucket's call, so it
/// needs no copy of its own (a source partly overlapping its destination).
pub(crate) fn fused_calls(buckets: &[Bucket], calls: usize) -> SmallVec<[bool; 8]> {
    let mut fused = smallvec::smallvec![false; calls];
    for &(call, _, _) in buckets.iter().flat_map(|bucket| &bucket.members) {
        fused[call] = true;
    }
    fused
}

/// The fused work of one part of a group of `calls` calls: `buckets`, bucket
/// `k`'s scratch being the task's buffer `scratch[k]`, call `c`'s source
/// and destination its buffers `at(c)`, and `binding` the task's bindings.
pub(crate) fn part(
    buckets: &[Bucket],
    calls: usize,
    scratch: &[usize],
    at: impl Fn(usize) -> (usize, usize),
    binding: impl Fn(usize) -> Binding,
) -> FusedPart {
    let mut part = FusedPart { fused: fused_calls(buckets, calls), ..FusedPart::default() };
    for (bucket, &scratch) in buckets.iter().zip(scratch) {
        for &(call, offset, bytes) in &bucket.members {
            let (src, dst) = at(call);
            part.pack.push(CopyRegion { src, src_offset: 0, dst: scratch, dst_offset: offset, bytes });
            part.unpack.push(CopyRegion { src: scratch, src_offset: offset, dst, dst_offset: 0, bytes });
        }
        let whole = Binding { size: bucket.bytes, ..binding(scratch) };
        part.calls.push(DeviceCall::AllReduce { src: whole, dst: whole, dtype: bucket.dtype, op: bucket.op });
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(dtype: DType, count: usize) -> Op {
        Op::all_reduce(dtype, ReduceOp::Sum, count)
    }

    #[test]
    fn same_type_and_operator_share_a_bucket_at_aligned_offsets() {
        let ops = [
            sum(DType::F32, 3),
            Op::all_reduce(DType::F32, ReduceOp::Max, 4),
            sum(DType::F32, 5),
            sum(DType::F16, 7),
            Op::all_gather(DType::F32, 4),
            sum(DType::F16, 1),
            sum(DType::F32, 0),
            Op::all_reduce(DType::F32, ReduceOp::Max, 2),
        ];
        let got = buckets(&ops, 1 << 20);
        assert_eq!(
            got,
            vec![
                Bucket { dtype: DType::F32, op: ReduceOp::Sum, members: vec![(0, 0, 12), (2, 16, 20)], bytes: 36 },
                Bucket { dtype: DType::F32, op: ReduceOp::Max, members: vec![(1, 0, 16), (7, 16, 8)], bytes: 24 },
                Bucket { dtype: DType::F16, op: ReduceOp::Sum, members: vec![(3, 0, 14), (5, 16, 2)], bytes: 18 },
            ]
        );
    }

    #[test]
    fn the_cap_splits_buckets_and_leaves_large_or_lone_calls_alone() {
        // Four 4 KiB calls under an 8 KiB cap: two buckets of two.
        let ops = vec![sum(DType::F32, 1024); 4];
        let got = buckets(&ops, 8192);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].members, vec![(0, 0, 4096), (1, 4096, 4096)]);
        assert_eq!(got[1].members, vec![(2, 0, 4096), (3, 4096, 4096)]);
        // Under a 6 KiB cap every call is alone: nothing is fused.
        assert!(buckets(&ops, 6144).is_empty());
        // A call over the cap runs alone; the others still fuse.
        let ops = [sum(DType::F32, 4096), sum(DType::F32, 1), sum(DType::F32, 1)];
        assert_eq!(buckets(&ops, 8192)[0].members, vec![(1, 0, 4), (2, 16, 4)]);
        // Alignment counts against the cap: 4 + pad to 16 + 4 = 20 bytes.
        assert!(buckets(&[sum(DType::F32, 1), sum(DType::F32, 1)], 19).is_empty());
        assert_eq!(buckets(&[sum(DType::F32, 1), sum(DType::F32, 1)], 20).len(), 1);
        // Cap 0 turns fusion off; one call has nothing to fuse with.
        assert!(buckets(&[sum(DType::F32, 1), sum(DType::F32, 1)], 0).is_empty());
        assert!(buckets(&[sum(DType::F32, 1)], 1 << 20).is_empty());
    }

    #[test]
    fn a_part_packs_unpacks_and_reduces_each_bucket_once() {
        use cohort_runtime::memory::PageId;
        let ops = [sum(DType::F32, 3), Op::all_gather(DType::F32, 4), sum(DType::F32, 5)];
        let plan = buckets(&ops, 1 << 20);
        // Buffers: sources 0..3, destinations 3..6, the scratch 6.
        let binding = |i: usize| Binding { page: PageId(i as u64), offset: 0, size: 64 };
        let part = part(&plan, 3, &[6], |c| (c, 3 + c), binding);
        assert_eq!(part.fused[..], [true, false, true]);
        let region = |src, src_offset, dst, dst_offset, bytes| CopyRegion { src, src_offset, dst, dst_offset, bytes };
        assert_eq!(part.pack, vec![region(0, 0, 6, 0, 12), region(2, 0, 6, 16, 20)]);
        assert_eq!(part.unpack, vec![region(6, 0, 3, 0, 12), region(6, 16, 5, 0, 20)]);
        let whole = Binding { page: PageId(6), offset: 0, size: 36 };
        assert_eq!(
            part.calls,
            vec![DeviceCall::AllReduce { src: whole, dst: whole, dtype: DType::F32, op: ReduceOp::Sum }]
        );
    }
}
