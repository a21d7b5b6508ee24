//! The collectives of a [`ClientGroup`].
//!
//! Every call checks its arguments, queues one part per participating member
//! and returns at once; reads of a destination wait for the collective. In
//! place: pass the same handle as source and destination (all-gather: the
//! source is the destination's slice at `member × size`; reduce-scatter: the
//! destination is the source's slice at `member × size`).

use cohort_runtime::{Client, Handle};

use super::check::{same_bytes, Check};
use super::{ClientGroup, Part};
use crate::collective::Kind;
use crate::error::CommError;
use crate::ops::{DType, ReduceOp};

impl ClientGroup {
    fn check(&self, op: &'static str, dtype: DType) -> Check<'_> {
        Check { op, clients: self.clients(), first_member: 0, members: self.len(), dtype }
    }

    fn every(&self, src: &[Handle], dst: &[Handle]) -> Vec<Part> {
        (0..self.len()).map(|m| Part { member: m, input: src.get(m).cloned(), output: dst.get(m).cloned() }).collect()
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
    ) -> Result<(), CommError> {
        let c = self.check("all_reduce", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, size, "the destination is the size of the source")?;
        for m in 0..self.len() {
            c.overlap(m, &dst[m], &src[m], 0, "in place, source and destination are the same buffer")?;
        }
        self.launch(Kind::AllReduce { dtype, op }, size, self.every(src, dst))?;
        Ok(())
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
    ) -> Result<(), CommError> {
        let c = self.check("reduce", dtype);
        c.member("root", root)?;
        c.per_member("source", src)?;
        c.owned("destination", root, dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.size("destination", root, dst, size, || "the destination is the size of the source".into())?;
        c.overlap(root, dst, &src[root], 0, "in place, the root's source and destination are the same buffer")?;
        let mut parts = self.every(src, &[]);
        parts[root].output = Some(dst.clone());
        self.launch(Kind::Reduce { dtype, op, root }, size, parts)?;
        Ok(())
    }

    /// Copies `src`, a buffer of member `root`, to every member's `dst`.
    pub fn broadcast_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<(), CommError> {
        let c = self.check("broadcast", dtype);
        c.member("root", root)?;
        c.owned("source", root, src)?;
        c.per_member("destination", dst)?;
        let size = c.whole("source", root, src)?;
        c.sizes("destination", dst, size, "every destination is the size of the root's source")?;
        c.overlap(root, &dst[root], src, 0, "in place, the root's source and destination are the same buffer")?;
        let mut parts = self.every(&[], dst);
        parts[root].input = Some(src.clone());
        self.launch(Kind::Broadcast { root }, size, parts)?;
        Ok(())
    }

    /// Concatenates every member's `src` (member order) into every member's
    /// `dst`, which holds `len()` times a source.
    pub fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<(), CommError> {
        let n = self.len();
        let c = self.check("all_gather", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, n * size, &format!("{n} members × the source size"))?;
        for m in 0..n {
            c.overlap(
                m,
                &dst[m],
                &src[m],
                m * size,
                "in place, the source is the destination's block at member × size",
            )?;
        }
        self.launch(Kind::AllGather, size, self.every(src, dst))?;
        Ok(())
    }

    /// Reduces every member's `src` with `op` and gives member `m` block `m`
    /// of the result in its `dst`; a source holds `len()` destinations.
    pub fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = self.len();
        let c = self.check("reduce_scatter", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let size = c.whole("destination", 0, &dst[0])?;
        c.sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        c.sizes("source", src, n * size, &format!("{n} members × the destination size"))?;
        for m in 0..n {
            c.overlap(
                m,
                &src[m],
                &dst[m],
                m * size,
                "in place, the destination is the source's block at member × size",
            )?;
        }
        self.launch(Kind::ReduceScatter { dtype, op }, size, self.every(src, dst))?;
        Ok(())
    }

    /// Sends block `k` of member `m`'s `src` to block `m` of member `k`'s
    /// `dst`; every buffer holds `len()` equal blocks. In place when every
    /// member passes the same buffer as source and destination.
    pub fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<(), CommError> {
        let n = self.len();
        let c = self.check("all_to_all", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let total = c.whole("source", 0, &src[0])?;
        let block = n * dtype.size();
        if total % block != 0 {
            return Err(CommError::WrongSize {
                operation: "all_to_all",
                what: "source",
                member: 0,
                expected: (total - total % block) as u64,
                got: total as u64,
                why: format!("a whole number of {n} equal blocks of {dtype} elements, one per member"),
            });
        }
        c.sizes("source", src, total, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, total, "the destination is the size of the source")?;
        let in_place: Vec<bool> = src.iter().zip(dst).map(|(s, d)| same_bytes(s, d)).collect();
        for m in 0..n {
            c.overlap(m, &dst[m], &src[m], 0, "in place, source and destination are the same buffer")?;
            if in_place[m] != in_place[0] {
                return Err(CommError::Overlap {
                    operation: "all_to_all",
                    member: m,
                    detail: "all_to_all runs in place only when every member passes one buffer as both source and \
                             destination; here some do and some do not"
                        .into(),
                });
            }
        }
        self.launch(Kind::AllToAll, total / n, self.every(src, dst))?;
        Ok(())
    }

    /// Concatenates every member's `src` (member order) into `dst`, a buffer
    /// of member `root` holding `len()` sources.
    pub fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<(), CommError> {
        let n = self.len();
        let c = self.check("gather", dtype);
        c.member("root", root)?;
        c.per_member("source", src)?;
        c.owned("destination", root, dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.size("destination", root, dst, n * size, || format!("{n} members × the source size"))?;
        c.overlap(
            root,
            dst,
            &src[root],
            root * size,
            "in place, the root's source is its destination's block at root × size",
        )?;
        let mut parts = self.every(src, &[]);
        parts[root].output = Some(dst.clone());
        self.launch(Kind::Gather { root }, size, parts)?;
        Ok(())
    }

    /// Gives member `m` block `m` of `src`, a buffer of member `root`
    /// holding `len()` destinations.
    pub fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<(), CommError> {
        let n = self.len();
        let c = self.check("scatter", dtype);
        c.member("root", root)?;
        c.owned("source", root, src)?;
        c.per_member("destination", dst)?;
        let size = c.whole("destination", 0, &dst[0])?;
        c.sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        c.size("source", root, src, n * size, || format!("{n} members × the destination size"))?;
        c.overlap(
            root,
            src,
            &dst[root],
            root * size,
            "in place, the root's destination is its source's block at root × size",
        )?;
        let mut parts = self.every(&[], dst);
        parts[root].input = Some(src.clone());
        self.launch(Kind::Scatter { root }, size, parts)?;
        Ok(())
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
    ) -> Result<(), CommError> {
        let c = self.check("send_recv", dtype);
        c.member("sender", from)?;
        c.member("receiver", to)?;
        c.owned("source", from, src)?;
        c.owned("destination", to, dst)?;
        let size = c.whole("source", from, src)?;
        c.size("destination", to, dst, size, || "the destination is the size of the source".into())?;
        if from == to {
            c.overlap(from, dst, src, 0, "a send to oneself in place is the same buffer")?;
            let part = Part { member: from, input: Some(src.clone()), output: Some(dst.clone()) };
            self.launch(Kind::Copy { from: 0, to: 0 }, size, vec![part])?;
        } else {
            let parts = vec![
                Part { member: from, input: Some(src.clone()), output: None },
                Part { member: to, input: None, output: Some(dst.clone()) },
            ];
            self.launch(Kind::Copy { from: 0, to: 1 }, size, parts)?;
        }
        Ok(())
    }

    /// A new buffer on member `to` holding a copy of `src` (a buffer of
    /// member `from`), moved by a send/recv. Returns at once.
    pub fn to_client(&self, src: &Handle, from: usize, to: usize) -> Result<Handle, CommError> {
        self.check("to_client", DType::U8).member("receiver", to)?;
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
        let collective = self.launch(Kind::Barrier, 0, parts)?;
        collective.wait_finished().map_err(|source| CommError::Failed { operation: "barrier", source })
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
    if from.name() == to.name() && from.device_id() != to.device_id() {
        let pair = ClientGroup::new(vec![from.clone(), to.clone()])?;
        return pair.to_client(src, 0, 1);
    }
    from.check_owned(src).map_err(|source| CommError::Failed { operation: "to_client", source })?;
    if from.service_id() == to.service_id() && from.name() != "cpu" {
        let one = ClientGroup::new(vec![from.clone()])?;
        if one.transport() == crate::Transport::LocalCopy {
            return one.to_client(src, 0, 0);
        }
    }
    let (start_us, start) = (crate::trace::now_micros(), std::time::Instant::now());
    let copied = from.to_client(src, to);
    super::record::timeline_copy(start_us, start, src.size(), from, to, copied.is_ok());
    copied.map_err(|source| CommError::Failed { operation: "to_client", source })
}
