//! The collectives of a [`ClientGroup`].
//!
//! Every call checks its arguments, queues one part per participating member
//! and returns at once; reads of a destination wait for the collective. In
//! place: pass the same handle as source and destination (all-gather: the
//! source is the destination's slice at `member × size`; reduce-scatter: the
//! destination is the source's slice at `member × size`).

use cohort_runtime::{Client, Handle};

use super::{ClientGroup, Part, Parts};
use crate::check::Members;
use crate::error::CommError;
use crate::op::Op;
use crate::ops::{DType, ReduceOp};
use crate::work::Work;

impl ClientGroup {
    /// The group's side of every argument check: all members local, and a
    /// source may meet its destination only in the in-place layout.
    pub(super) fn checks(&self) -> Members<'_> {
        Members { clients: self.clients(), first: 0, count: self.len(), strict_overlap: true }
    }

    pub(super) fn every(&self, src: &[Handle], dst: &[Handle]) -> Parts {
        (0..self.len()).map(|m| Part { member: m, input: src.get(m).cloned(), output: dst.get(m).cloned() }).collect()
    }

    /// Every member's part, the root's with `input` or `output` as well.
    pub(super) fn rooted(
        &self,
        src: &[Handle],
        dst: &[Handle],
        root: usize,
        input: Option<&Handle>,
        output: Option<&Handle>,
    ) -> Parts {
        let mut parts = self.every(src, dst);
        if let Some(input) = input {
            parts[root].input = Some(input.clone());
        }
        if let Some(output) = output {
            parts[root].output = Some(output.clone());
        }
        parts
    }

    /// Reduces every member's `src` element-wise with `op` and writes the
    /// result to every member's `dst`. All buffers hold the same number of
    /// `dtype` elements.
    pub fn all_reduce_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let op = self.checks().all_reduce(src, dst, dtype, op)?;
        self.launch(op, self.every(src, dst))
    }

    /// Reduces every member's `src` with `op` into `dst`, a buffer of member
    /// `root`; nothing is written on the other members.
    pub fn reduce_handles(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, CommError> {
        let op = self.checks().reduce(src, dst, dtype, op, root)?;
        self.launch(op, self.rooted(src, &[], root, None, Some(dst)))
    }

    /// Copies `src`, a buffer of member `root`, to every member's `dst`.
    pub fn broadcast_handles(
        &self,
        src: &Handle,
        dst: &[Handle],
        dtype: DType,
        root: usize,
    ) -> Result<Work, CommError> {
        let op = self.checks().broadcast(src, dst, dtype, root)?;
        self.launch(op, self.rooted(&[], dst, root, Some(src), None))
    }

    /// Concatenates every member's `src` (member order) into every member's
    /// `dst`, which holds `len()` times a source.
    pub fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        let op = self.checks().all_gather(src, dst, dtype)?;
        self.launch(op, self.every(src, dst))
    }

    /// Reduces every member's `src` with `op` and gives member `m` block `m`
    /// of the result in its `dst`; a source holds `len()` destinations.
    pub fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let op = self.checks().reduce_scatter(src, dst, dtype, op)?;
        self.launch(op, self.every(src, dst))
    }

    /// Sends block `k` of member `m`'s `src` to block `m` of member `k`'s
    /// `dst`; every buffer holds `len()` equal blocks. In place when every
    /// member passes the same buffer as source and destination.
    pub fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        let op = self.checks().all_to_all(src, dst, dtype)?;
        self.launch(op, self.every(src, dst))
    }

    /// Concatenates every member's `src` (member order) into `dst`, a buffer
    /// of member `root` holding `len()` sources.
    pub fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError> {
        let op = self.checks().gather(src, dst, dtype, root)?;
        self.launch(op, self.rooted(src, &[], root, None, Some(dst)))
    }

    /// Gives member `m` block `m` of `src`, a buffer of member `root`
    /// holding `len()` destinations.
    pub fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        let op = self.checks().scatter(src, dst, dtype, root)?;
        self.launch(op, self.rooted(&[], dst, root, Some(src), None))
    }

    /// A paired send/recv: copies `src` of member `from` into `dst` of member
    /// `to` (equal sizes). Only those two members take part; each waits for
    /// the other's part on its own device thread.
    pub fn send_recv_handles(
        &self,
        from: usize,
        src: &Handle,
        to: usize,
        dst: &Handle,
        dtype: DType,
    ) -> Result<Work, CommError> {
        let op = self.checks().send_recv(from, src, to, dst, dtype)?;
        let parts = if from == to {
            smallvec::smallvec![Part { member: from, input: Some(src.clone()), output: Some(dst.clone()) }]
        } else {
            smallvec::smallvec![
                Part { member: from, input: Some(src.clone()), output: None },
                Part { member: to, input: None, output: Some(dst.clone()) },
            ]
        };
        self.launch(op, parts)
    }

    /// A new buffer on member `to` holding a copy of `src` (a buffer of
    /// member `from`), moved by a send/recv. Returns at once.
    pub fn to_client(&self, src: &Handle, from: usize, to: usize) -> Result<Handle, CommError> {
        self.checks().within("to_client", "receiver", to, self.len())?;
        let dst = self.client(to).empty(src.size() as usize);
        self.send_recv_handles(from, src, to, &dst, DType::U8)?;
        Ok(dst)
    }

    /// Waits, on the calling thread, until every member's device reached the
    /// barrier (so the work queued before it on every member has run).
    /// Returns the timeout error naming the members that never arrived, or
    /// the failure of a member's device.
    pub fn barrier(&self) -> Result<(), CommError> {
        let parts = (0..self.len()).map(|m| Part { member: m, input: None, output: None }).collect();
        self.launch(Op::barrier(), parts)?.wait()
    }
}

/// Copies `src` (a buffer of `from`) to a new buffer on `to`, device to
/// device where it can, and returns at once then: between devices of one
/// runtime by a peer copy where `from` can reach `to`'s memory (see
/// [`Client::can_access_peer`]), else by an NCCL send/recv, else through
/// the host; on one device by a device copy (CUDA). Between runtimes, and on
/// backends without device collectives, through host memory (waits for the
/// read).
pub fn to_client(src: &Handle, from: &Client, to: &Client) -> Result<Handle, CommError> {
    let (a, b) = (from.device_id(), to.device_id());
    if a.type_id == b.type_id && a != b {
        let pair = ClientGroup::new(vec![from.clone(), to.clone()])?;
        return pair.to_client(src, 0, 1);
    }
    from.check_owned(src).map_err(|source| CommError::Failed { operation: "to_client", source })?;
    if from.service_id() == to.service_id() && from.capabilities().device_collectives {
        let one = ClientGroup::new(vec![from.clone()])?;
        if one.transport() == crate::Transport::LocalCopy {
            return one.to_client(src, 0, 0);
        }
    }
    let (start_us, start) = (crate::trace::now_micros(), std::time::Instant::now());
    let copied = from.to_client(src, to);
    crate::trace::timeline_copy(start_us, start, src.size(), from, to, copied.is_ok());
    copied.map_err(|source| CommError::Failed { operation: "to_client", source })
}
