//! What each member's part of a collective asks of its device: the
//! [`DeviceCall`]s on the communicator (rank = the part's slot), or the
//! copies of a group of one device.

use cohort_runtime::backend::{Binding, DeviceCall};
use cohort_runtime::Handle;
use smallvec::{smallvec, SmallVec};

use crate::op::{Collective, Op};

/// One part's calls on the communicator: inline (no heap allocation) for
/// the one or two calls of every collective but the rooted and all-to-all
/// ones, which make one or two per rank.
pub(crate) type DeviceCalls = SmallVec<[DeviceCall; 2]>;

/// Which buffers a part's task holds, in the order the task sees them:
/// the input, the output, then the scratch copy of the input (an in-place
/// all-to-all's, or a source that partly overlaps its destination).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub input: bool,
    pub output: bool,
    pub scratch: bool,
}

/// The bindings of one part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buffers {
    pub input: Option<Binding>,
    pub output: Option<Binding>,
    pub scratch: Option<Binding>,
}

impl Shape {
    /// Resolves the shape against the task's bindings.
    pub(crate) fn bind(&self, binding: impl Fn(usize) -> Binding) -> Buffers {
        let mut next = 0;
        let mut take = |present: bool| {
            present.then(|| {
                next += 1;
                binding(next - 1)
            })
        };
        let input = take(self.input);
        let output = take(self.output);
        let scratch = take(self.scratch);
        Buffers { input, output, scratch }
    }
}

impl Shape {
    /// Resolves the shape where its source is binding `0` of `binding` and
    /// its destination and scratch follow from `1` (a grouped call's
    /// buffers: `binding` maps these onto the task's).
    pub(crate) fn bind_at(&self, binding: impl Fn(usize) -> Binding) -> Buffers {
        let input = self.input.then(|| binding(0));
        let output = self.output.then(|| binding(1));
        let scratch = self.scratch.then(|| binding(1 + usize::from(self.output)));
        Buffers { input, output, scratch }
    }
}

/// Block `k` (of `seg` bytes) of a binding.
fn block(b: Binding, k: usize, seg: usize) -> Binding {
    Binding { page: b.page, offset: b.offset + (k * seg) as u64, size: seg as u64 }
}

fn need(b: Option<Binding>, what: &str, op: &Op) -> Binding {
    b.unwrap_or_else(|| panic!("{} part without its {what}: the argument checks let it through", op.name()))
}

/// The calls of part `rank` of `ranks` on the communicator: the one place a
/// description becomes device instructions. `op`'s roots and endpoints are
/// ranks of the communicator. Empty for zero-byte collectives (every member
/// agrees, since they share the count).
pub(crate) fn nccl_calls(op: &Op, rank: usize, ranks: usize, b: &Buffers) -> DeviceCalls {
    let seg = op.block_bytes();
    if seg == 0 && op.collective() != Collective::Barrier {
        return DeviceCalls::new();
    }
    // A source that partly overlaps its destination is read from its copy
    // (made first, below); an all-to-all handles its scratch itself.
    let copied = b.scratch.filter(|_| op.collective() != Collective::AllToAll);
    let input = || copied.unwrap_or_else(|| need(b.input, "source", op));
    let output = || need(b.output, "destination", op);
    if let Some(scratch) = copied {
        let mut calls: DeviceCalls = smallvec![DeviceCall::Copy { src: need(b.input, "source", op), dst: scratch }];
        calls.extend(nccl_calls(op, rank, ranks, &Buffers { input: Some(scratch), scratch: None, ..*b }));
        return calls;
    }
    let (dtype, root) = (op.dtype(), op.root().unwrap_or(0));
    let reduction = || op.reduce_op().expect("a reducing collective has an operator");
    match op.collective() {
        Collective::AllReduce => {
            smallvec![DeviceCall::AllReduce { src: input(), dst: output(), dtype, op: reduction() }]
        }
        Collective::Reduce => {
            smallvec![DeviceCall::Reduce { src: input(), dst: b.output, dtype, op: reduction(), root }]
        }
        Collective::Broadcast => smallvec![DeviceCall::Broadcast { src: b.input, dst: output(), root }],
        Collective::AllGather => smallvec![DeviceCall::AllGather { src: input(), dst: output() }],
        Collective::ReduceScatter => {
            smallvec![DeviceCall::ReduceScatter { src: input(), dst: output(), dtype, op: reduction() }]
        }
        Collective::AllToAll => {
            let dst = output();
            let in_place = b.scratch.is_some() && b.input == b.output;
            let src = b.scratch.unwrap_or_else(input);
            let mut calls = DeviceCalls::with_capacity(2 * ranks);
            if b.scratch.is_some() {
                calls.push(DeviceCall::Copy { src: input(), dst: src });
            }
            for k in 0..ranks {
                if k == rank {
                    // Out of place, its own block moves as a send/recv to
                    // itself inside the group, as NCCL's all-to-all does:
                    // beside the other blocks instead of before them (a
                    // separate copy cost 0.85-0.88x raw NCCL on two H200s).
                    // One rank has no group to overlap with: a copy. In
                    // place, the block is already where it belongs.
                    if !in_place && ranks > 1 {
                        calls.push(DeviceCall::Send { src: block(src, k, seg), peer: k });
                        calls.push(DeviceCall::Recv { dst: block(dst, k, seg), peer: k });
                    } else if !in_place {
                        calls.push(DeviceCall::Copy { src: block(src, k, seg), dst: block(dst, k, seg) });
                    }
                } else {
                    calls.push(DeviceCall::Send { src: block(src, k, seg), peer: k });
                    calls.push(DeviceCall::Recv { dst: block(dst, k, seg), peer: k });
                }
            }
            calls
        }
        Collective::Gather if rank == root => {
            let dst = output();
            (0..ranks)
                .map(|k| match k == rank {
                    true => DeviceCall::Copy { src: input(), dst: block(dst, k, seg) },
                    false => DeviceCall::Recv { dst: block(dst, k, seg), peer: k },
                })
                .collect()
        }
        Collective::Gather => smallvec![DeviceCall::Send { src: input(), peer: root }],
        Collective::Scatter if rank == root => {
            let src = input();
            (0..ranks)
                .map(|k| match k == rank {
                    true => DeviceCall::Copy { src: block(src, k, seg), dst: output() },
                    false => DeviceCall::Send { src: block(src, k, seg), peer: k },
                })
                .collect()
        }
        Collective::Scatter => smallvec![DeviceCall::Recv { dst: output(), peer: root }],
        Collective::SendRecv => match op.endpoints().expect("a send/recv has endpoints") {
            (from, to) if from == to => smallvec![DeviceCall::Copy { src: input(), dst: output() }],
            (from, to) if rank == from => smallvec![DeviceCall::Send { src: input(), peer: to }],
            (from, _) => smallvec![DeviceCall::Recv { dst: output(), peer: from }],
        },
        Collective::Barrier => smallvec![DeviceCall::Barrier],
    }
}

/// Whether a part of `collective` with `input` and `output` sends from a
/// copy of its source: an all-to-all in place (source and destination the
/// same bytes), which NCCL cannot run without one, and any source that
/// partly overlaps its destination (which the argument checks of a
/// `ClientGroup` refuse and a `Communicator` allows).
pub(crate) fn sends_from_copy(collective: Collective, input: Option<&Handle>, output: Option<&Handle>) -> bool {
    input.zip(output).is_some_and(|(i, o)| {
        let same = crate::check::same_bytes(i, o);
        (collective == Collective::AllToAll && same) || (crate::check::overlaps(i, o) && !same)
    })
}

/// The copy a part of a group of one device makes (`None`: nothing to do,
/// in place or no bytes). With one member every collective is the identity
/// on its one block: a reduction of one value is the value (avg divides by
/// one), and every gather, scatter or exchange moves the block onto itself.
pub(crate) fn local_copy(op: &Op, b: &Buffers) -> Option<(Binding, Binding)> {
    match (op.collective(), b.input, b.output) {
        (Collective::Barrier, _, _) => None,
        (_, Some(src), Some(dst)) if src != dst && src.size > 0 => Some((src, dst)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};
    use cohort_runtime::memory::PageId;

    fn b(offset: u64, size: u64) -> Binding {
        Binding { page: PageId(1), offset, size }
    }

    #[test]
    fn all_to_all_pairs_every_block_with_its_peer() {
        let bufs = Buffers { input: Some(b(0, 12)), output: Some(b(64, 12)), scratch: None };
        let calls = nccl_calls(&Op::all_to_all(DType::U8, 4), 1, 3, &bufs);
        assert_eq!(calls.len(), 6);
        assert!(calls.contains(&DeviceCall::Send { src: b(0, 4), peer: 0 }));
        assert!(calls.contains(&DeviceCall::Recv { dst: b(72, 4), peer: 2 }));
        // Its own block goes to itself inside the group.
        assert!(calls.contains(&DeviceCall::Send { src: b(4, 4), peer: 1 }));
        assert!(calls.contains(&DeviceCall::Recv { dst: b(68, 4), peer: 1 }));
    }

    #[test]
    fn in_place_all_to_all_sends_from_the_scratch_copy() {
        let bufs = Buffers { input: Some(b(0, 8)), output: Some(b(0, 8)), scratch: Some(b(256, 8)) };
        let calls = nccl_calls(&Op::all_to_all(DType::U8, 4), 0, 2, &bufs);
        assert_eq!(calls[0], DeviceCall::Copy { src: b(0, 8), dst: b(256, 8) });
        assert!(calls.contains(&DeviceCall::Send { src: b(260, 4), peer: 1 }));
        assert!(calls.contains(&DeviceCall::Recv { dst: b(4, 4), peer: 1 }));
    }

    #[test]
    fn a_source_partly_overlapping_its_destination_is_read_from_its_copy() {
        // An all-reduce whose destination starts 4 bytes into its source.
        let bufs = Buffers { input: Some(b(0, 16)), output: Some(b(4, 16)), scratch: Some(b(256, 16)) };
        let op = Op::all_reduce(DType::F32, ReduceOp::Sum, 4);
        assert_eq!(
            nccl_calls(&op, 0, 2, &bufs)[..],
            [
                DeviceCall::Copy { src: b(0, 16), dst: b(256, 16) },
                DeviceCall::AllReduce { src: b(256, 16), dst: b(4, 16), dtype: DType::F32, op: ReduceOp::Sum },
            ]
        );
        // An all-to-all so: its own block too comes from the copy.
        let bufs = Buffers { input: Some(b(0, 8)), output: Some(b(4, 8)), scratch: Some(b(256, 8)) };
        let calls = nccl_calls(&Op::all_to_all(DType::U8, 4), 0, 2, &bufs);
        assert_eq!(calls[0], DeviceCall::Copy { src: b(0, 8), dst: b(256, 8) });
        assert!(calls.contains(&DeviceCall::Send { src: b(256, 4), peer: 0 }));
        assert!(calls.contains(&DeviceCall::Recv { dst: b(4, 4), peer: 0 }));
        assert!(calls.contains(&DeviceCall::Send { src: b(260, 4), peer: 1 }));
        let one = nccl_calls(&Op::all_to_all(DType::U8, 8), 0, 1, &bufs);
        assert_eq!(
            one[..],
            [DeviceCall::Copy { src: b(0, 8), dst: b(256, 8) }, DeviceCall::Copy { src: b(256, 8), dst: b(4, 8) }]
        );
    }

    #[test]
    fn gather_root_receives_and_others_send() {
        let root = Buffers { input: Some(b(0, 4)), output: Some(b(64, 8)), scratch: None };
        let calls = nccl_calls(&Op::gather(DType::F32, 1, 1), 1, 2, &root);
        assert_eq!(
            calls[..],
            [DeviceCall::Recv { dst: b(64, 4), peer: 0 }, DeviceCall::Copy { src: b(0, 4), dst: b(68, 4) }]
        );
        let other = Buffers { input: Some(b(0, 4)), output: None, scratch: None };
        assert_eq!(
            nccl_calls(&Op::gather(DType::F32, 1, 1), 0, 2, &other)[..],
            [DeviceCall::Send { src: b(0, 4), peer: 1 }]
        );
    }

    #[test]
    fn zero_bytes_make_no_calls_and_one_device_copies_only_out_of_place() {
        let bufs = Buffers { input: Some(b(0, 0)), output: Some(b(0, 0)), scratch: None };
        assert!(nccl_calls(&Op::all_gather(DType::F32, 0), 0, 2, &bufs).is_empty());
        let op = Op::all_reduce(DType::F32, ReduceOp::Sum, 1);
        assert_eq!(local_copy(&op, &bufs), None);
        let apart = Buffers { input: Some(b(0, 4)), output: Some(b(4, 4)), scratch: None };
        assert_eq!(local_copy(&op, &apart), Some((b(0, 4), b(4, 4))));
    }
}
