//! The collectives of a [`Communicator`]: argument checks, then one task per
//! local device, queued in one order under the process-wide lock.
//!
//! In place: pass the same handle as source and destination where the
//! `ClientGroup` allows it (all-reduce, reduce at the root, broadcast at the
//! root, all-to-all); other overlaps are copied first.

use std::sync::Arc;

use cohort_runtime::stages::{self, Stage};
use cohort_runtime::Handle;

use super::fingerprint::Fingerprint;
use super::local::{LocalCall, Part, PerCall, Plan, Views};
use super::{Communicator, SlotCall, Slots};
use crate::check::Members;
use crate::error::CommError;
use crate::grouped::{check_independent, GroupCall};
use crate::meeting::Ticket;
use crate::op::Op;
use crate::ops::{DType, ReduceOp};
use crate::order::enqueue_lock;
use crate::work::Work;

impl Communicator {
    /// This rank's side of every argument check: its local devices among
    /// every rank's members; overlapping sources are copied, not refused.
    fn checks(&self) -> Members<'_> {
        let first = self.rank() * self.local_devices();
        Members { clients: self.clients(), first, count: self.members(), strict_overlap: false }
    }

    /// Queues one task per local device (slot `s` with `inputs[s]` and
    /// `outputs[s]`), the last of which runs `op` between ranks. Returns
    /// its handle. The call's fingerprint (its sequence number
    /// and `op`) is what ranks compare to find mismatched calls.
    fn launch(&self, op: Op, inputs: Slots, outputs: Slots) -> Result<Work, CommError> {
        stages::mark(Stage::Checked);
        let name = op.name();
        for (slot, client) in self.clients().iter().enumerate() {
            if client.is_capturing() {
                return Err(CommError::Capturing { operation: name, member: slot });
            }
        }
        let nccl = self.inner.nccl.as_ref().filter(|n| n.takes(&op));
        // A part queued inline waits for no other device of this process.
        let inline = nccl.is_some_and(|nccl| nccl.queues_inline(&[op], false));
        let order = (!inline).then(enqueue_lock);
        let mut issued = self.inner.issued.lock();
        // A message counts the messages between its two ranks, one way.
        let seq = match op.endpoints() {
            Some((from, to)) if from == self.rank() => self.inner.world.lock().next_p2p(to, true),
            Some((from, _)) => self.inner.world.lock().next_p2p(from, false),
            None => {
                *issued += 1;
                *issued
            }
        };
        let fp = Fingerprint::of(seq, op);
        let peer = op.endpoints().map(|(from, to)| if from == self.rank() { to } else { from });
        let (ranks, rank_call) = self.call(seq, peer);
        stages::mark(Stage::Routed);
        if let Some(nccl) = nccl {
            // Handed back and dropped unfinished (after the locks) when the
            // launch fails: that aborts for the other ranks, as on the host
            // path. Recorded with its path.
            let tracker = self.inner.observer.queued(fp, Some(nccl.path_of(&op).name()));
            stages::mark(Stage::Recorded);
            let calls = smallvec::smallvec![(op, inputs, outputs)];
            let call = nccl.launch_calls(&self.inner.world, fp, self.timeout(), calls, inline, tracker);
            drop((issued, order));
            let call = call.map_err(|refused| (*refused).into_error())?;
            return Ok(Work::new(name, call).within(ranks, rank_call));
        }
        let world = self.inner.world.clone();
        let tracker = self.inner.observer.queued(fp, None);
        let plan: Plan = Box::new(move |mut views: PerCall<Views>| {
            let views = views.pop().expect("one call");
            tracker.run(&mut world.lock(), views).map(|staged| smallvec::smallvec![staged])
        });
        let call = self.queue_local(name, plan, smallvec::smallvec![(inputs, outputs)]);
        drop(issued);
        drop(order);
        Ok(Work::new(name, call?).within(ranks, rank_call))
    }

    /// A grouped call: one sequence number and one fingerprint for all of
    /// `calls` (op, inputs and outputs by slot), one task per local device
    /// holding every call's buffers, one meeting. On NCCL each part issues
    /// every call inside one `ncclGroupStart/End`; on the host path the
    /// all-reduces make one exchange per (element type, operator).
    fn launch_group(&self, calls: Vec<SlotCall>) -> Result<Work, CommError> {
        for (slot, client) in self.clients().iter().enumerate() {
            if client.is_capturing() {
                return Err(CommError::Capturing { operation: "group", member: slot });
            }
        }
        let ops: Vec<Op> = calls.iter().map(|c| c.0).collect();
        let nccl = self.inner.nccl.as_ref().filter(|n| calls.iter().all(|(op, _, _)| n.takes(op)));
        // A part queued inline waits for no other device of this process.
        let inline = nccl.is_some_and(|nccl| nccl.queues_inline(&ops, true));
        let order = (!inline).then(enqueue_lock);
        let mut issued = self.inner.issued.lock();
        *issued += 1;
        let mut fp = Fingerprint::of_group(*issued, &ops);
        let (ranks, rank_call) = self.call(*issued, None);
        if let Some(nccl) = nccl {
            // Every rank must fuse the same all-reduces (`device::fusion`):
            // a rank with another `COHORT_FUSION_MB` is a mismatch.
            if let Some(group) = &mut fp.group {
                group.digest = crate::digest::Fnv1a::default()
                    .write(group.digest.to_le_bytes())
                    .write(crate::device::fusion::cap().to_le_bytes())
                    .finish();
            }
            let tracker = self.inner.observer.queued(fp, None);
            let call = nccl.launch_calls(&self.inner.world, fp, self.timeout(), calls.into(), inline, tracker);
            drop((issued, order));
            // A refused call's record drops here, unfinished, after the locks.
            let call = call.map_err(|refused| (*refused).into_error())?;
            return Ok(Work::new("group", call).within(ranks, rank_call));
        }
        let world = self.inner.world.clone();
        let tracker = self.inner.observer.queued(fp, None);
        let plan: Plan = Box::new(move |views: PerCall<Views>| tracker.run_group(&mut world.lock(), &ops, views));
        let call = self.queue_local("group", plan, calls.into_iter().map(|(_, i, o)| (i, o)).collect());
        drop(issued);
        drop(order);
        Ok(Work::new("group", call?).within(ranks, rank_call))
    }

    /// Queues one task per local device for the calls `calls` (inputs and
    /// outputs by slot) of one meeting, whose leader runs `plan`. A task
    /// that cannot be queued drops its ticket, which fails the call for the
    /// tasks already queued.
    fn queue_local(
        &self,
        name: &'static str,
        plan: Plan,
        calls: PerCall<(Slots, Slots)>,
    ) -> Result<Arc<LocalCall>, CommError> {
        let devices = self.clients().iter().map(|c| c.device_id());
        let call = LocalCall::new(name, calls.len(), devices, self.timeout(), plan);
        let mut failed = None;
        for (slot, client) in self.clients().iter().enumerate() {
            let parts: PerCall<Part> =
                calls.iter().map(|(i, o)| Part { has_in: i[slot].is_some(), has_out: o[slot].is_some() }).collect();
            let ins: cohort_runtime::TaskHandles = calls.iter().filter_map(|(i, _)| i[slot].clone()).collect();
            let outs: cohort_runtime::TaskHandles = calls.iter().filter_map(|(_, o)| o[slot].clone()).collect();
            let ticket = Ticket::new(&call, slot);
            let queued = client.submit_buffers_always(name, ins, outs, move |access| {
                ticket.run(|call, slot| call.run_task(slot, &parts, access))
            });
            if let Err(source) = queued {
                failed.get_or_insert(CommError::Enqueue {
                    operation: name,
                    member: slot,
                    device: client.device_id(),
                    source,
                });
            }
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(call),
        }
    }

    /// The path a collective `op` takes: NCCL or a peer-memory kernel
    /// (`None` off the NCCL path). Every rank follows rank 0's
    /// `COHORT_ALGO` and crossover table.
    pub fn path_of(&self, op: &Op) -> Option<crate::device::peer::Path> {
        self.inner.nccl.as_ref().map(|nccl| nccl.path_of(op))
    }

    /// Reduces every member's `src` (one per local device) element-wise with
    /// `op` and writes the result to every member's `dst`. Returns at once.
    pub fn all_reduce_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let op = self.checks().all_reduce(src, dst, dtype, op)?;
        self.launch(op, some(src), some(dst))
    }

    /// Reduces every member's `src` with `op` into `dst` on member `root`
    /// (`dst` is ignored elsewhere: pass any handle of the device, or the
    /// source). Returns at once.
    pub fn reduce_handles(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, CommError> {
        let op = self.checks().reduce(src, dst, dtype, op, root)?;
        self.launch(op, some(src), self.at_root(root, dst))
    }

    /// Copies `src` of member `root` to every member's `dst` (`src` is
    /// ignored on other ranks). Returns at once.
    pub fn broadcast_handles(
        &self,
        src: &Handle,
        dst: &[Handle],
        dtype: DType,
        root: usize,
    ) -> Result<Work, CommError> {
        let op = self.checks().broadcast(src, dst, dtype, root)?;
        self.launch(op, self.at_root(root, src), some(dst))
    }

    /// Concatenates every member's `src` (member order) into every member's
    /// `dst`, which holds `members()` sources. Returns at once.
    pub fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        let op = self.checks().all_gather(src, dst, dtype)?;
        self.launch(op, some(src), some(dst))
    }

    /// Reduces every member's `src` (`members()` blocks) with `op` and gives
    /// member `m` block `m` of the result in its `dst`. Returns at once.
    pub fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let op = self.checks().reduce_scatter(src, dst, dtype, op)?;
        self.launch(op, some(src), some(dst))
    }

    /// Sends block `k` of member `m`'s `src` to block `m` of member `k`'s
    /// `dst`; every buffer holds `members()` equal blocks. Returns at once.
    pub fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        let op = self.checks().all_to_all(src, dst, dtype)?;
        self.launch(op, some(src), some(dst))
    }

    /// Concatenates every member's `src` into `dst` on member `root`, which
    /// holds `members()` sources (`dst` is ignored elsewhere). Returns at
    /// once.
    pub fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError> {
        let op = self.checks().gather(src, dst, dtype, root)?;
        self.launch(op, some(src), self.at_root(root, dst))
    }

    /// Gives member `m` block `m` of `src`, a buffer of member `root`
    /// holding `members()` destinations (`src` is ignored elsewhere).
    /// Returns at once.
    pub fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        let op = self.checks().scatter(src, dst, dtype, root)?;
        self.launch(op, self.at_root(root, src), some(dst))
    }

    /// Sends `src` (a buffer of one of this rank's devices) to rank `to`,
    /// which must call [`Communicator::recv_handle`] with a buffer of the same size.
    /// Returns at once; the send runs on the device thread and, for messages
    /// larger than the link's buffer (4 MiB over shared memory), waits there
    /// for the receiver, so two ranks that send large messages to each other
    /// first must order them (lower rank sends first) .
    pub fn send_handle(&self, src: &Handle, to: usize, dtype: DType) -> Result<Work, CommError> {
        let (op, slot) = self.checks().message(true, src, self.rank(), to, self.size(), dtype)?;
        let mut inputs = smallvec::smallvec![None; self.local_devices()];
        inputs[slot] = Some(src.clone());
        self.launch(op, inputs, smallvec::smallvec![None; self.local_devices()])
    }

    /// Receives into `dst` (a buffer of one of this rank's devices) what rank
    /// `from` sends with [`Communicator::send_handle`]. Returns at once; reads of
    /// `dst` wait for the message. A message of another size or type is an
    /// error naming both sides.
    pub fn recv_handle(&self, dst: &Handle, from: usize, dtype: DType) -> Result<Work, CommError> {
        let (op, slot) = self.checks().message(false, dst, self.rank(), from, self.size(), dtype)?;
        let mut outputs = smallvec::smallvec![None; self.local_devices()];
        outputs[slot] = Some(dst.clone());
        self.launch(op, smallvec::smallvec![None; self.local_devices()], outputs)
    }

    /// Waits, on the calling thread, until every rank's every local device
    /// reached the barrier (so the work queued before it everywhere has
    /// run). Returns the timeout error naming the ranks that never arrived,
    /// or any other failure.
    pub fn barrier(&self) -> Result<(), CommError> {
        let none = smallvec::smallvec![None; self.local_devices()];
        self.launch(Op::barrier(), none.clone(), none)?.wait()
    }

    /// Runs `calls` as one grouped call: every call is checked (and the
    /// calls checked not to depend on each other) before anything is
    /// queued. On the host path the group is one call between ranks: one
    /// sequence number and one fingerprint check for all of them, one task
    /// per local device and one meeting, its all-reduces packed into one
    /// exchange per element type and operator, its other calls run after
    /// one another in that exchange. On NCCL the same meeting issues every
    /// call in one `ncclGroupStart/End` per device. One handle for all.
    pub fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError> {
        let mut prepared = Vec::with_capacity(calls.len());
        let checks = self.checks();
        for call in &calls {
            prepared.push(match call {
                GroupCall::AllReduce { src, dst, dtype, op } => {
                    (checks.all_reduce(src, dst, *dtype, *op)?, some(src), some(dst))
                }
                GroupCall::Reduce { src, dst, dtype, op, root } => {
                    (checks.reduce(src, dst, *dtype, *op, *root)?, some(src), self.at_root(*root, dst))
                }
                GroupCall::Broadcast { src, dst, dtype, root } => {
                    (checks.broadcast(src, dst, *dtype, *root)?, self.at_root(*root, src), some(dst))
                }
                GroupCall::AllGather { src, dst, dtype } => {
                    (checks.all_gather(src, dst, *dtype)?, some(src), some(dst))
                }
                GroupCall::ReduceScatter { src, dst, dtype, op } => {
                    (checks.reduce_scatter(src, dst, *dtype, *op)?, some(src), some(dst))
                }
                GroupCall::AllToAll { src, dst, dtype } => (checks.all_to_all(src, dst, *dtype)?, some(src), some(dst)),
            });
        }
        check_independent(prepared.iter().enumerate().flat_map(|(k, (_, ins, outs))| {
            ins.iter().flatten().map(move |h| (k, h, false)).chain(outs.iter().flatten().map(move |h| (k, h, true)))
        }))?;
        if prepared.len() > 1 {
            return self.launch_group(prepared);
        }
        let works = prepared.into_iter().map(|(op, ins, outs)| self.launch(op, ins, outs)).collect::<Result<_, _>>()?;
        Ok(Work::all("group", works))
    }

    /// One buffer per local device: `handle` at the root's slot when the
    /// root is local, nothing elsewhere.
    fn at_root(&self, root: usize, handle: &Handle) -> Slots {
        let mut buffers: Slots = smallvec::smallvec![None; self.local_devices()];
        if let Some(slot) = self.checks().local_slot(root) {
            buffers[slot] = Some(handle.clone());
        }
        buffers
    }
}

fn some(handles: &[Handle]) -> Slots {
    handles.iter().cloned().map(Some).collect()
}
