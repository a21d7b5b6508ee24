//! What the leader of a call does with its rank's local buffers: combine
//! them into the rank's part, run the exchange between ranks, and spread
//! the result back over the local outputs.
//!
//! Buffers arrive as [`Views`]: host pointers into device memory (CPU
//! backend) or staged copies. With one local device and host pointers, the
//! exchange runs straight in the destination (no extra copy); otherwise it
//! runs in host scratch memory. An input that overlaps an output (in place)
//! is read before any output is written.

use crate::op::{Collective, Op};
use crate::ops::{finish, DType, ReduceOp};
use crate::transport::reduce_into;
use crate::with_dtype;

use super::failure::Failure;
use super::fingerprint::Fingerprint;
use super::local::{InView, OutView, PerCall, PerSlot, Staged, Views};
use super::world::World;

/// Host scratch memory, 16-byte aligned so any element type can be viewed.
struct Scratch(Vec<u128>, usize);

impl Scratch {
    fn new(len: usize) -> Scratch {
        Scratch(vec![0; len.div_ceil(16)], len)
    }
    fn bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.0)[..self.1]
    }
}

/// Resolved buffers of the local slots.
struct Bufs<'a> {
    ins: PerSlot<Option<&'a [u8]>>,
    outs: PerSlot<Option<&'a mut [u8]>>,
    /// Staged outputs, by slot (returned to their tasks).
    staged: Staged,
    /// Copies of inputs that overlapped an output.
    _copies: Vec<Vec<u8>>,
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Turns the views into slices. Inputs that overlap an output are copied
/// first, unless `same_ok` and the input is exactly its slot's output (then
/// the input is `None` and lives in the output).
///
/// # Safety
/// Every pointer view must be valid for its length, and reserved for this
/// call until the returned slices are dropped (see `local`'s module docs).
unsafe fn resolve(views: &mut Views, same_ok: bool) -> (Bufs<'_>, PerSlot<bool>) {
    let n = views.ins.len();
    let out_ranges: PerSlot<Option<(usize, usize)>> = views
        .outs
        .iter()
        .map(|o| match o {
            Some(OutView::Ptr(p, l)) => Some((*p, *l)),
            _ => None,
        })
        .collect();
    let mut copies = Vec::new();
    let mut in_place: PerSlot<bool> = smallvec::smallvec![false; n];
    let mut ins: PerSlot<Option<&[u8]>> = PerSlot::with_capacity(n);
    // Inputs first: copies of overlapping ones are taken before any output
    // slice exists.
    let mut pending: PerSlot<Option<(usize, usize, bool)>> = PerSlot::with_capacity(n);
    for (slot, view) in views.ins.iter().enumerate() {
        pending.push(match view {
            Some(InView::Ptr(p, l)) => {
                let r = (*p, *l);
                if same_ok && out_ranges[slot] == Some(r) {
                    in_place[slot] = true;
                    None
                } else if out_ranges.iter().flatten().any(|o| overlaps(*o, r)) {
                    // SAFETY: caller's contract; no slice of these bytes exists yet.
                    copies.push(std::slice::from_raw_parts(*p as *const u8, *l).to_vec());
                    Some((copies.len() - 1, 0, true))
                } else {
                    Some((*p, *l, false))
                }
            }
            _ => None,
        });
    }
    for (slot, view) in views.ins.iter().enumerate() {
        ins.push(match (view, pending[slot]) {
            (Some(InView::Owned(b)), _) => Some(std::slice::from_raw_parts(b.as_slice().as_ptr(), b.len())),
            (_, Some((i, _, true))) => Some(std::slice::from_raw_parts(copies[i].as_ptr(), copies[i].len())),
            // SAFETY: caller's contract; this input overlaps no output.
            (_, Some((p, l, false))) => Some(std::slice::from_raw_parts(p as *const u8, l)),
            _ => None,
        });
    }
    let mut staged: Staged = views
        .outs
        .iter()
        .map(|o| match o {
            Some(OutView::Staged(len)) => Some(vec![0u8; *len]),
            _ => None,
        })
        .collect();
    let outs = views
        .outs
        .iter()
        .zip(staged.iter_mut())
        .map(|(o, s)| match o {
            // SAFETY: caller's contract; outputs of distinct slots are
            // distinct buffers, and no input slice aliases them.
            Some(OutView::Ptr(p, l)) => Some(std::slice::from_raw_parts_mut(*p as *mut u8, *l)),
            Some(OutView::Staged(_)) => s.as_mut().map(|v| std::slice::from_raw_parts_mut(v.as_mut_ptr(), v.len())),
            None => None,
        })
        .collect();
    (Bufs { ins, outs, staged, _copies: copies }, in_place)
}

/// `Avg` travels as `Sum`; the division comes at the end.
fn wire_op(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

fn divide(buf: &mut [u8], dtype: DType, members: usize) {
    with_dtype!(dtype, T => finish(bytemuck::cast_slice_mut::<u8, T>(buf), ReduceOp::Avg, members))
}

/// Runs the call `fp` describes (roots are members, endpoints ranks) for
/// this rank's local slots; returns the staged outputs.
pub(crate) fn run(world: &mut World, fp: Fingerprint, mut views: Views) -> Result<Staged, Failure> {
    let same_ok = matches!(fp.op.collective(), Collective::AllReduce | Collective::Reduce | Collective::Broadcast);
    // SAFETY: the views come from the tasks of this call, which stay blocked
    // (their buffers reserved) until this returns.
    let (mut b, in_place) = unsafe { resolve(&mut views, same_ok) };
    let l = b.outs.len().max(b.ins.len());
    let (rank, size) = (world.rank, world.size);
    let members = size * l;
    world.run(fp, |w| execute(w, &fp, &mut b, &in_place, l, rank, members))?;
    Ok(std::mem::take(&mut b.staged))
}

/// Runs grouped call `fp`, whose calls are `ops` (one [`Views`] each), for
/// this rank's local slots: one check of the group's fingerprint, then the
/// all-reduces packed per (element type, operator) into one exchange each,
/// then every other call in order, none checking a fingerprint of its own.
/// Returns the staged outputs, per call and slot.
pub(crate) fn run_group(
    world: &mut World,
    fp: Fingerprint,
    ops: &[Op],
    mut views: PerCall<Views>,
) -> Result<PerCall<Staged>, Failure> {
    let mut resolved: PerCall<(Bufs<'_>, PerSlot<bool>)> = views
        .iter_mut()
        .zip(ops)
        .map(|(v, op)| {
            let same_ok = matches!(op.collective(), Collective::AllReduce | Collective::Reduce | Collective::Broadcast);
            // SAFETY: as in `run`: every call's views come from this group's
            // tasks, which stay blocked until this returns.
            unsafe { resolve(v, same_ok) }
        })
        .collect();
    let l = resolved.first().map_or(1, |(b, _)| b.outs.len().max(b.ins.len()));
    let (rank, size) = (world.rank, world.size);
    let members = size * l;
    world.run(fp, |w| {
        w.collective_check(&fp)?;
        w.in_group = true;
        let result = execute_group(w, &fp, ops, &mut resolved, l, rank, members);
        w.in_group = false;
        result
    })?;
    Ok(resolved.into_iter().map(|(mut b, _)| std::mem::take(&mut b.staged)).collect())
}

/// Slot `slot`'s input of a call (its output where it runs in place).
fn input_of<'b>(b: &'b Bufs<'_>, in_place: &[bool], slot: usize) -> &'b [u8] {
    if in_place[slot] {
        b.outs[slot].as_deref().expect("in place has an output")
    } else {
        b.ins[slot].expect("an input")
    }
}

fn execute_group(
    w: &mut World,
    fp: &Fingerprint,
    ops: &[Op],
    resolved: &mut [(Bufs<'_>, PerSlot<bool>)],
    l: usize,
    rank: usize,
    members: usize,
) -> Result<(), Failure> {
    // All-reduces by (element type, operator on the wire), in the order
    // each pair first appears (the same on every rank: the group's
    // fingerprint covers every call's description).
    let mut buckets: Vec<((DType, ReduceOp), Vec<usize>)> = Vec::new();
    for (k, op) in ops.iter().enumerate() {
        if op.collective() != Collective::AllReduce {
            continue;
        }
        let key = (op.dtype(), wire_op(op.reduce_op().unwrap_or(ReduceOp::Sum)));
        match buckets.iter_mut().find(|(b, _)| *b == key) {
            Some((_, calls)) => calls.push(k),
            None => buckets.push((key, vec![k])),
        }
    }
    for ((dtype, op), calls) in &buckets {
        let lens: Vec<usize> = calls.iter().map(|&k| input_of(&resolved[k].0, &resolved[k].1, 0).len()).collect();
        let mut packed = Scratch::new(lens.iter().sum());
        let mut at = 0;
        for (&k, &len) in calls.iter().zip(&lens) {
            let (b, in_place) = &resolved[k];
            let part = &mut packed.bytes()[at..at + len];
            part.copy_from_slice(input_of(b, in_place, 0));
            local_reduce(part, b, in_place, *dtype, *op);
            at += len;
        }
        w.all_reduce(fp, packed.bytes(), None, *dtype, *op)?;
        at = 0;
        for (&k, &len) in calls.iter().zip(&lens) {
            let part = &mut packed.bytes()[at..at + len];
            if ops[k].reduce_op() == Some(ReduceOp::Avg) {
                divide(part, *dtype, members);
            }
            for out in resolved[k].0.outs.iter_mut().flatten() {
                out.copy_from_slice(part);
            }
            at += len;
        }
    }
    for (k, op) in ops.iter().enumerate() {
        if op.collective() != Collective::AllReduce {
            let (b, in_place) = &mut resolved[k];
            execute(w, &Fingerprint::of(fp.seq, *op), b, in_place, l, rank, members)?;
        }
    }
    Ok(())
}

/// Combines every local input into `acc` (`acc` already holds slot 0's).
fn local_reduce(acc: &mut [u8], b: &Bufs<'_>, in_place: &[bool], dtype: DType, op: ReduceOp) {
    for (slot, input) in b.ins.iter().enumerate().skip(1) {
        let src = if in_place[slot] { b.outs[slot].as_deref() } else { *input };
        if let Some(src) = src {
            reduce_into(acc, src, dtype, op, false);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn execute(
    w: &mut World,
    fp: &Fingerprint,
    b: &mut Bufs<'_>,
    in_place: &[bool],
    l: usize,
    rank: usize,
    members: usize,
) -> Result<(), Failure> {
    let input = |b: &Bufs<'_>, slot: usize| -> Vec<u8> {
        if in_place[slot] {
            b.outs[slot].as_deref().expect("in place has an output").to_vec()
        } else {
            b.ins[slot].expect("an input").to_vec()
        }
    };
    let (dtype, root) = (fp.op.dtype(), fp.op.root().unwrap_or(0));
    let op = fp.op.reduce_op().unwrap_or(ReduceOp::Sum);
    match fp.op.collective() {
        Collective::AllReduce | Collective::Reduce => {
            let root = fp.op.root();
            // One device with its output here: reduce straight in it.
            if l == 1 && b.outs[0].is_some() {
                let out = b.outs[0].as_deref_mut().expect("checked");
                let src = if in_place[0] { None } else { b.ins[0] };
                w.all_reduce(fp, out, src, dtype, wire_op(op))?;
                if op == ReduceOp::Avg {
                    divide(out, dtype, members);
                }
                return Ok(());
            }
            let first = input(b, 0);
            let mut acc = Scratch::new(first.len());
            acc.bytes().copy_from_slice(&first);
            local_reduce(acc.bytes(), b, in_place, dtype, wire_op(op));
            w.all_reduce(fp, acc.bytes(), None, dtype, wire_op(op))?;
            if op == ReduceOp::Avg {
                divide(acc.bytes(), dtype, members);
            }
            for (slot, out) in b.outs.iter_mut().enumerate() {
                if root.is_none_or(|r| r == rank * l + slot) {
                    if let Some(out) = out {
                        out.copy_from_slice(acc.bytes());
                    }
                }
            }
        }
        Collective::Broadcast => {
            let (root_rank, root_slot) = (root / l, root % l);
            let len = b.outs.iter().flatten().map(|o| o.len()).next().unwrap_or(0);
            let mut work = Scratch::new(len);
            if rank == root_rank {
                work.bytes().copy_from_slice(&input(b, root_slot));
            }
            w.broadcast(fp, work.bytes(), root_rank)?;
            for out in b.outs.iter_mut().flatten() {
                out.copy_from_slice(work.bytes());
            }
        }
        Collective::AllGather => {
            let seg = b.ins[0].map_or(0, <[u8]>::len);
            let part = l * seg;
            let mut work = Scratch::new(members * seg);
            for slot in 0..l {
                work.bytes()[rank * part + slot * seg..][..seg].copy_from_slice(b.ins[slot].expect("an input"));
            }
            w.all_gather(fp, work.bytes(), part)?;
            for out in b.outs.iter_mut().flatten() {
                out.copy_from_slice(work.bytes());
            }
        }
        Collective::ReduceScatter => {
            let mut work = Scratch::new(b.ins[0].map_or(0, <[u8]>::len));
            work.bytes().copy_from_slice(b.ins[0].expect("an input"));
            local_reduce(work.bytes(), b, in_place, dtype, wire_op(op));
            let seg = b.outs[0].as_deref().map_or(0, <[u8]>::len);
            let mut mine = Scratch::new(l * seg);
            w.reduce_scatter(fp, work.bytes(), mine.bytes(), dtype, wire_op(op))?;
            if op == ReduceOp::Avg {
                divide(mine.bytes(), dtype, members);
            }
            for (slot, out) in b.outs.iter_mut().enumerate() {
                if let Some(out) = out {
                    out.copy_from_slice(&mine.bytes()[slot * seg..(slot + 1) * seg]);
                }
            }
        }
        Collective::AllToAll => {
            let total = b.ins[0].map_or(0, <[u8]>::len);
            let seg = total / members;
            let size = members / l;
            // send[q][s][t] = block (q·L + t) of local s; recv[p][s][t] goes
            // to block (p·L + s) of local t.
            let mut send = Scratch::new(l * total);
            for q in 0..size {
                for s in 0..l {
                    let src = b.ins[s].expect("an input");
                    for t in 0..l {
                        let at = ((q * l + s) * l + t) * seg;
                        send.bytes()[at..at + seg].copy_from_slice(&src[(q * l + t) * seg..][..seg]);
                    }
                }
            }
            let mut recv = Scratch::new(l * total);
            w.all_to_all(fp, send.bytes(), recv.bytes())?;
            for p in 0..size {
                for s in 0..l {
                    for t in 0..l {
                        let at = ((p * l + s) * l + t) * seg;
                        if let Some(out) = b.outs[t].as_deref_mut() {
                            out[(p * l + s) * seg..][..seg].copy_from_slice(&recv.bytes()[at..at + seg]);
                        }
                    }
                }
            }
        }
        Collective::Gather => {
            let seg = b.ins[0].map_or(0, <[u8]>::len);
            let mut part = Scratch::new(l * seg);
            for slot in 0..l {
                part.bytes()[slot * seg..][..seg].copy_from_slice(b.ins[slot].expect("an input"));
            }
            let (root_rank, root_slot) = (root / l, root % l);
            if rank == root_rank {
                let out = b.outs[root_slot].as_deref_mut().expect("the root's destination");
                w.gather(fp, part.bytes(), Some(out), root_rank)?;
            } else {
                w.gather(fp, part.bytes(), None, root_rank)?;
            }
        }
        Collective::Scatter => {
            let seg = b.outs[0].as_deref().map_or(0, <[u8]>::len);
            let (root_rank, root_slot) = (root / l, root % l);
            let mut mine = Scratch::new(l * seg);
            if rank == root_rank {
                let src = b.ins[root_slot].expect("the root's source");
                w.scatter(fp, Some(src), mine.bytes(), root_rank)?;
            } else {
                w.scatter(fp, None, mine.bytes(), root_rank)?;
            }
            for (slot, out) in b.outs.iter_mut().enumerate() {
                if let Some(out) = out {
                    out.copy_from_slice(&mine.bytes()[slot * seg..(slot + 1) * seg]);
                }
            }
        }
        Collective::Barrier => w.barrier(fp)?,
        Collective::SendRecv => {
            let (from, to) = fp.op.endpoints().ok_or("a send/recv without endpoints")?;
            if from == rank {
                let src = b.ins.iter().flatten().next().copied().unwrap_or(&[]);
                w.send(fp, src, to)?;
            } else {
                let dst = b.outs.iter_mut().flatten().next().ok_or("a destination")?;
                w.recv(fp, dst, from)?;
            }
        }
    }
    Ok(())
}
