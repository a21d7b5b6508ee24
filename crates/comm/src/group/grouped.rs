//! Grouped calls of a [`ClientGroup`]: every call checked, then one task per
//! member and one meeting, on the host engine ([`GroupedHost`]) and on NCCL
//! (one `ncclGroupStart/End` per member); device copies queue each call in
//! turn.

use std::sync::atomic::Ordering;

use cohort_runtime::TaskHandles;
use smallvec::SmallVec;

use super::{ClientGroup, Part, Parts};
use crate::device::{self, Mode, Route};
use crate::error::CommError;
use crate::grouped::{check_independent, GroupCall};
use crate::host::GroupedHost;
use crate::meeting::{Seat, Ticket};
use crate::op::Op;
use crate::order::enqueue_lock;
use crate::work::Work;

impl ClientGroup {
    /// One call's checked description.
    fn check_call(&self, call: &GroupCall) -> Result<Op, CommError> {
        let checks = self.checks();
        match call {
            GroupCall::AllReduce { src, dst, dtype, op } => checks.all_reduce(src, dst, *dtype, *op),
            GroupCall::Reduce { src, dst, dtype, op, root } => checks.reduce(src, dst, *dtype, *op, *root),
            GroupCall::Broadcast { src, dst, dtype, root } => checks.broadcast(src, dst, *dtype, *root),
            GroupCall::AllGather { src, dst, dtype } => checks.all_gather(src, dst, *dtype),
            GroupCall::ReduceScatter { src, dst, dtype, op } => checks.reduce_scatter(src, dst, *dtype, *op),
            GroupCall::AllToAll { src, dst, dtype } => checks.all_to_all(src, dst, *dtype),
        }
    }

    /// A grouped call on the device path: on one NCCL communicator, one
    /// task per member whose calls go inside one `ncclGroupStart/End`;
    /// otherwise (device copies in a group of one) each call in turn.
    fn group_on_device(&self, ops: Vec<Op>, calls: &[GroupCall]) -> Result<Work, CommError> {
        // No call of a group has endpoints: every call takes the route's mode.
        let Route::Nccl(set) = &self.route else {
            let works = ops
                .into_iter()
                .zip(calls)
                .map(|(op, call)| self.launch(op, self.parts_of(call)))
                .collect::<Result<_, _>>()?;
            return Ok(Work::all("group", works));
        };
        let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(sequence, calls = ops.len(), "queue grouped device call");
        let tracked = self.track(sequence, &ops[0], 0, self.len(), None);
        let members: SmallVec<[usize; 4]> = (0..self.len()).collect();
        let part = |call: usize, slot: usize| calls[call].part(slot, Some);
        let grouped = device::launch_grouped(
            &self.clients,
            self.timeout,
            "group",
            ops.into(),
            &members,
            part,
            Mode::Nccl(set.clone()),
            Some(tracked),
        )?;
        Ok(Work::new("group", grouped))
    }

    /// Every member's part of `call`, in member order.
    fn parts_of(&self, call: &GroupCall) -> Parts {
        (0..self.len())
            .map(|member| {
                let (input, output) = call.part(member, Some);
                Part { member, input: input.cloned(), output: output.cloned() }
            })
            .collect()
    }

    /// Runs `calls` as one grouped call: every call is checked (and the
    /// calls checked not to depend on each other) before anything is
    /// queued. On the host engine every member queues one task and the
    /// tasks meet once; on the device path (NCCL, device copies) the calls
    /// go on one NCCL communicator inside one `ncclGroupStart/End` per
    /// member. Returns one handle for all of them.
    ///
    /// The caller's thread keeps no per-call object: the checks give one
    /// vector of descriptions, the independence check one vector of
    /// spans, and each member's one task the handles of every call.
    pub fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError> {
        let ops = calls.iter().map(|call| self.check_call(call)).collect::<Result<Vec<_>, _>>()?;
        let n = self.len();
        check_independent(calls.iter().enumerate().flat_map(|(k, call)| {
            (0..n).flat_map(move |m| {
                let (input, output) = call.part(m, Some);
                input.map(|h| (k, h, false)).into_iter().chain(output.map(|h| (k, h, true)))
            })
        }))?;
        if ops.is_empty() {
            return Ok(Work::nothing("group"));
        }
        for member in 0..n {
            if self.clients[member].is_capturing() {
                return Err(CommError::Capturing { operation: "group", member });
            }
        }
        // Members sharing a GPU cannot run a grouped call on NCCL: the host
        // runs it.
        let shared_gpu = matches!(&self.route, Route::Nccl(set) if set.shared_gpu);
        if !matches!(self.route, Route::Host) && !shared_gpu {
            return self.group_on_device(ops, &calls);
        }
        let seats = (0..n).map(|m| Seat { member: Some(m), device: self.clients[m].device_id() }).collect();
        let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(sequence, calls = ops.len(), members = n, "queue grouped call");
        let tracked = self.track(sequence, &ops[0], 0, n, None);
        let grouped = GroupedHost::new(ops, seats, self.timeout);
        let mut failed = None;
        let order = enqueue_lock();
        for member in 0..n {
            // One task per member: every call's source, then every call's
            // destination, and which calls have each.
            let (mut inputs, mut outputs) = (TaskHandles::new(), TaskHandles::new());
            let mut has: Vec<(bool, bool)> = Vec::with_capacity(calls.len());
            for call in &calls {
                let (input, output) = call.part(member, Some);
                inputs.extend(input.cloned());
                outputs.extend(output.cloned());
                has.push((input.is_some(), output.is_some()));
            }
            let ticket = Ticket::new(&grouped, member);
            let tracked = tracked.clone();
            let client = &self.clients[member];
            let queued = client.submit_buffers_always("group", inputs, outputs, move |access| {
                // The record's hold goes before the ticket returns (see
                // `ClientGroup::launch`).
                ticket.run(move |grouped, slot| {
                    let result = grouped.run_member(slot, &has, access);
                    tracked.note(&result);
                    result
                })
            });
            if let Err(source) = queued {
                failed.get_or_insert(CommError::Enqueue {
                    operation: "group",
                    member,
                    device: client.device_id(),
                    source,
                });
            }
        }
        drop(order);
        match failed {
            Some(err) => Err(err),
            None => Ok(Work::new("group", grouped)),
        }
    }
}
