//! Grouped calls of a [`ClientGroup`]: every call checked, then one task per
//! member and one meeting on the host engine ([`GroupedHost`]), or each call
//! queued in turn on the device path.

use std::sync::atomic::Ordering;

use super::{ClientGroup, Part};
use crate::device::{self, DevicePart, Mode, NcclSet, Route};
use crate::error::CommError;
use crate::grouped::{check_independent, GroupCall};
use crate::host::{CallBuffers, GroupedHost};
use crate::meeting::{Seat, Ticket};
use crate::op::Op;
use crate::order::enqueue_lock;
use crate::work::Work;

impl ClientGroup {
    /// One call's checked description and its parts (one per member, in
    /// member order).
    fn prepare(&self, call: &GroupCall) -> Result<(Op, Vec<Part>), CommError> {
        let checks = self.checks();
        Ok(match call {
            GroupCall::AllReduce { src, dst, dtype, op } => {
                (checks.all_reduce(src, dst, *dtype, *op)?, self.every(src, dst))
            }
            GroupCall::Reduce { src, dst, dtype, op, root } => {
                (checks.reduce(src, dst, *dtype, *op, *root)?, self.rooted(src, &[], *root, None, Some(dst)))
            }
            GroupCall::Broadcast { src, dst, dtype, root } => {
                (checks.broadcast(src, dst, *dtype, *root)?, self.rooted(&[], dst, *root, Some(src), None))
            }
            GroupCall::AllGather { src, dst, dtype } => (checks.all_gather(src, dst, *dtype)?, self.every(src, dst)),
            GroupCall::ReduceScatter { src, dst, dtype, op } => {
                (checks.reduce_scatter(src, dst, *dtype, *op)?, self.every(src, dst))
            }
            GroupCall::AllToAll { src, dst, dtype } => (checks.all_to_all(src, dst, *dtype)?, self.every(src, dst)),
        })
    }

    /// A grouped call on the device path: on one NCCL communicator, one
    /// task per member whose calls go inside one `ncclGroupStart/End`;
    /// otherwise (device copies in a group of one) each call in turn.
    fn group_on_device(&self, prepared: Vec<(Op, Vec<Part>)>) -> Result<Work, CommError> {
        let mut set = None;
        for (op, parts) in &prepared {
            match self.device_mode(op, parts)? {
                Some(Mode::Nccl(s)) if set.as_ref().is_none_or(|k: &std::sync::Arc<NcclSet>| k.key == s.key) => {
                    set = Some(s)
                }
                _ => {
                    set = None;
                    break;
                }
            }
        }
        let Some(set) = set else {
            let works = prepared.into_iter().map(|(op, parts)| self.launch(op, parts)).collect::<Result<_, _>>()?;
            return Ok(Work::all("group", works));
        };
        let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(sequence, calls = prepared.len(), "queue grouped device call");
        let tracked = self.track(sequence, &prepared[0].0, &prepared[0].1);
        let calls = prepared
            .into_iter()
            .map(|(op, parts)| {
                let parts = parts
                    .into_iter()
                    .map(|p| DevicePart { member: p.member, input: p.input, output: p.output })
                    .collect();
                (op, parts)
            })
            .collect();
        let grouped =
            device::launch_grouped(&self.clients, self.timeout, "group", calls, Mode::Nccl(set), Some(tracked))?;
        Ok(Work::new("group", grouped))
    }

    /// Runs `calls` as one grouped call: every call is checked (and the
    /// calls checked not to depend on each other) before anything is
    /// queued. On the host engine every member queues one task and the
    /// tasks meet once; on the device path (NCCL, device copies) the calls
    /// go on one NCCL communicator inside one `ncclGroupStart/End` per
    /// member. Returns one handle for all of them.
    pub fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError> {
        let prepared = calls.iter().map(|call| self.prepare(call)).collect::<Result<Vec<_>, _>>()?;
        let buffers: Vec<_> = prepared
            .iter()
            .map(|(_, parts)| {
                (
                    parts.iter().filter_map(|p| p.input.as_ref()).collect(),
                    parts.iter().filter_map(|p| p.output.as_ref()).collect(),
                )
            })
            .collect();
        check_independent(&buffers)?;
        if prepared.is_empty() {
            return Ok(Work::nothing("group"));
        }
        for member in 0..self.len() {
            if self.clients[member].is_capturing() {
                return Err(CommError::Capturing { operation: "group", member });
            }
        }
        if !matches!(self.route, Route::Host) {
            return self.group_on_device(prepared);
        }
        let n = self.len();
        let ops: Vec<Op> = prepared.iter().map(|(op, _)| *op).collect();
        let seats = (0..n).map(|m| Seat { member: Some(m), device: self.clients[m].device_id() }).collect();
        let grouped = GroupedHost::new(ops, seats, self.timeout);
        let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(sequence, calls = prepared.len(), members = n, "queue grouped call");
        let tracked = self.track(sequence, &prepared[0].0, &prepared[0].1);
        let mut failed = None;
        let order = enqueue_lock();
        for member in 0..n {
            // Every prepared call has one part per member, in member order.
            let calls: Vec<CallBuffers> = prepared
                .iter()
                .map(|(_, parts)| CallBuffers {
                    input: parts[member].input.clone(),
                    output: parts[member].output.clone(),
                })
                .collect();
            let has: Vec<(bool, bool)> = calls.iter().map(|c| (c.input.is_some(), c.output.is_some())).collect();
            let (inputs, outputs) = GroupedHost::task_buffers(&calls);
            let ticket = Ticket::new(&grouped, member);
            let tracked = tracked.clone();
            let client = &self.clients[member];
            let queued = client.submit_buffers_always("group", inputs, outputs, move |access| {
                let result = ticket.run(|grouped, slot| grouped.run_member(slot, &has, access));
                tracked.note(&result);
                result
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
