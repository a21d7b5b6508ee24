//! The collectives of a [`Communicator`]: argument checks, then one task per
//! local device, queued in one order under the process-wide lock.
//!
//! In place: pass the same handle as source and destination where the
//! `ClientGroup` allows it (all-reduce, reduce at the root, broadcast at the
//! root, all-to-all); other overlaps are copied first.

use cohort_runtime::Handle;

use super::fingerprint::Fingerprint;
use super::local::Meeting;
use super::nccl::Pending;
use super::plans::Job;
use super::Communicator;
use crate::error::CommError;
use crate::group::check::Check;
use crate::ops::{DType, ReduceOp};
use crate::order::enqueue_lock;

impl Communicator {
    fn check(&self, op: &'static str, dtype: DType) -> Check<'_> {
        let first_member = self.rank() * self.local_devices();
        Check { op, clients: self.clients(), first_member, members: self.members(), dtype }
    }

    /// Queues one task per local device (slot `s` with `inputs[s]` and
    /// `outputs[s]`), the last of which runs `job` between ranks. Returns
    /// the meeting (to wait on). The job's fingerprint (its call, operator
    /// and root, `dtype`, `count` elements per member) is what ranks compare
    /// to find mismatched calls.
    fn launch(
        &self,
        job: Job,
        dtype: DType,
        count: usize,
        inputs: Vec<Option<Handle>>,
        outputs: Vec<Option<Handle>>,
    ) -> Result<Pending, CommError> {
        let call = job.call();
        let name = call.name();
        for (slot, client) in self.clients().iter().enumerate() {
            if client.is_capturing() {
                return Err(CommError::Capturing { operation: name, member: slot });
            }
        }
        let order = enqueue_lock();
        let mut issued = self.inner.issued.lock();
        let seq = match job {
            Job::Send { peer } => self.inner.world.lock().next_p2p(peer, true),
            Job::Recv { peer } => self.inner.world.lock().next_p2p(peer, false),
            _ => {
                *issued += 1;
                *issued
            }
        };
        // A message's fingerprint names its sender where a collective's
        // names its root.
        let root = match job {
            Job::Send { .. } => Some(self.rank()),
            Job::Recv { peer } => Some(peer),
            _ => job.root(),
        };
        let fp = Fingerprint { seq, call, op: job.op(), dtype, count: count as u64, root: root.map(|r| r as u32) };
        if let Some(nccl) = self.inner.nccl.as_ref().filter(|n| n.takes(&job, &inputs, &outputs)) {
            let (start_us, start) = (crate::trace::now_micros(), std::time::Instant::now());
            // Dropped unrun when the launch fails: that aborts for the
            // other ranks, as on the host path.
            let tracker = self.inner.observer.queued(fp, job);
            let meeting = nccl.launch(&self.inner.world, fp, job, self.timeout(), inputs, outputs);
            drop((issued, order));
            let meeting = meeting?;
            meeting.on_done(move |outcome| tracker.ended(outcome, start_us, start));
            return Ok(Pending::Nccl(meeting));
        }
        let world = self.inner.world.clone();
        let tracker = self.inner.observer.queued(fp, job);
        let plan = Box::new(move |views| tracker.run(&mut world.lock(), views));
        let devices = self.clients().iter().map(|c| c.device_id()).collect();
        let meeting = Meeting::new(name, devices, self.timeout(), plan);
        let mut failed = None;
        for (slot, client) in self.clients().iter().enumerate() {
            let (has_in, has_out) = (inputs[slot].is_some(), outputs[slot].is_some());
            let m = meeting.clone();
            let ins = inputs[slot].iter().cloned().collect();
            let outs = outputs[slot].iter().cloned().collect();
            let queued =
                client.submit_buffers_always(name, ins, outs, move |access| m.run_task(slot, has_in, has_out, access));
            if let Err(source) = queued {
                let err = CommError::Enqueue { operation: name, member: slot, device: client.device_id(), source };
                meeting.fail(cohort_runtime::ServerError::InvalidState {
                    operation: "collective",
                    reason: err.to_string(),
                });
                failed.get_or_insert(err);
            }
        }
        drop(issued);
        drop(order);
        match failed {
            Some(err) => Err(err),
            None => Ok(Pending::Host(meeting)),
        }
    }

    /// Reduces every member's `src` (one per local device) element-wise with
    /// `op` and writes the result to every member's `dst`. Returns at once.
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
        let size = src[0].size() as usize;
        c.whole_sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.whole_sizes("destination", dst, size, "the destination is the size of the source")?;
        let job = Job::AllReduce { dtype, op };
        self.launch(job, dtype, size / dtype.size(), some(src), some(dst))?;
        Ok(())
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
    ) -> Result<(), CommError> {
        let c = self.check("reduce", dtype);
        c.member_of("root", root, self.members())?;
        c.per_member("source", src)?;
        let size = src[0].size() as usize;
        c.whole_sizes("source", src, size, "every member's source is the size of member 0's")?;
        let mut outputs = vec![None; self.local_devices()];
        if let Some(slot) = self.local_slot(root) {
            c.owned("destination", slot, dst)?;
            c.whole_sizes("destination", std::slice::from_ref(dst), size, "the destination is the size of the source")?;
            outputs[slot] = Some(dst.clone());
        }
        let job = Job::Reduce { dtype, op, root };
        self.launch(job, dtype, size / dtype.size(), some(src), outputs)?;
        Ok(())
    }

    /// Copies `src` of member `root` to every member's `dst` (`src` is
    /// ignored on other ranks). Returns at once.
    pub fn broadcast_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<(), CommError> {
        let c = self.check("broadcast", dtype);
        c.member_of("root", root, self.members())?;
        c.per_member("destination", dst)?;
        let size = dst[0].size() as usize;
        c.whole_sizes("destination", dst, size, "every destination is the size of member 0's")?;
        let mut inputs = vec![None; self.local_devices()];
        if let Some(slot) = self.local_slot(root) {
            c.owned("source", slot, src)?;
            c.whole_sizes("source", std::slice::from_ref(src), size, "the source is the size of the destination")?;
            inputs[slot] = Some(src.clone());
        }
        let job = Job::Broadcast { root };
        self.launch(job, dtype, size / dtype.size(), inputs, some(dst))?;
        Ok(())
    }

    /// Concatenates every member's `src` (member order) into every member's
    /// `dst`, which holds `members()` sources. Returns at once.
    pub fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<(), CommError> {
        let c = self.check("all_gather", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let size = src[0].size() as usize;
        c.whole_sizes("source", src, size, "every member's source is the size of member 0's")?;
        let m = self.members();
        c.whole_sizes("destination", dst, m * size, &format!("{m} members × the source size"))?;
        self.launch(Job::AllGather, dtype, size / dtype.size(), some(src), some(dst))?;
        Ok(())
    }

    /// Reduces every member's `src` (`members()` blocks) with `op` and gives
    /// member `m` block `m` of the result in its `dst`. Returns at once.
    pub fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let c = self.check("reduce_scatter", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let size = dst[0].size() as usize;
        let m = self.members();
        c.whole_sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        c.whole_sizes("source", src, m * size, &format!("{m} members × the destination size"))?;
        let job = Job::ReduceScatter { dtype, op };
        self.launch(job, dtype, size / dtype.size(), some(src), some(dst))?;
        Ok(())
    }

    /// Sends block `k` of member `m`'s `src` to block `m` of member `k`'s
    /// `dst`; every buffer holds `members()` equal blocks. Returns at once.
    pub fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<(), CommError> {
        let c = self.check("all_to_all", dtype);
        c.per_member("source", src)?;
        c.per_member("destination", dst)?;
        let total = src[0].size() as usize;
        let m = self.members();
        let block = m * dtype.size();
        if total % block != 0 {
            return Err(CommError::WrongSize {
                operation: "all_to_all",
                what: "source",
                member: self.rank() * self.local_devices(),
                expected: (total - total % block) as u64,
                got: total as u64,
                why: format!("a whole number of {m} equal blocks of {dtype} elements, one per member"),
            });
        }
        c.whole_sizes("source", src, total, "every member's source is the size of member 0's")?;
        c.whole_sizes("destination", dst, total, "the destination is the size of the source")?;
        let count = total / m / dtype.size();
        self.launch(Job::AllToAll, dtype, count, some(src), some(dst))?;
        Ok(())
    }

    /// Concatenates every member's `src` into `dst` on member `root`, which
    /// holds `members()` sources (`dst` is ignored elsewhere). Returns at
    /// once.
    pub fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<(), CommError> {
        let c = self.check("gather", dtype);
        c.member_of("root", root, self.members())?;
        c.per_member("source", src)?;
        let size = src[0].size() as usize;
        c.whole_sizes("source", src, size, "every member's source is the size of member 0's")?;
        let mut outputs = vec![None; self.local_devices()];
        if let Some(slot) = self.local_slot(root) {
            let m = self.members();
            c.owned("destination", slot, dst)?;
            c.whole_sizes(
                "destination",
                std::slice::from_ref(dst),
                m * size,
                &format!("{m} members × the source size"),
            )?;
            outputs[slot] = Some(dst.clone());
        }
        let job = Job::Gather { root };
        self.launch(job, dtype, size / dtype.size(), some(src), outputs)?;
        Ok(())
    }

    /// Gives member `m` block `m` of `src`, a buffer of member `root`
    /// holding `members()` destinations (`src` is ignored elsewhere).
    /// Returns at once.
    pub fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<(), CommError> {
        let c = self.check("scatter", dtype);
        c.member_of("root", root, self.members())?;
        c.per_member("destination", dst)?;
        let size = dst[0].size() as usize;
        c.whole_sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        let mut inputs = vec![None; self.local_devices()];
        if let Some(slot) = self.local_slot(root) {
            let m = self.members();
            c.owned("source", slot, src)?;
            c.whole_sizes(
                "source",
                std::slice::from_ref(src),
                m * size,
                &format!("{m} members × the destination size"),
            )?;
            inputs[slot] = Some(src.clone());
        }
        let job = Job::Scatter { root };
        self.launch(job, dtype, size / dtype.size(), inputs, some(dst))?;
        Ok(())
    }

    /// Sends `src` (a buffer of one of this rank's devices) to rank `to`,
    /// which must call [`Communicator::recv_handle`] with a buffer of the same size.
    /// Returns at once; the send runs on the device thread and, for messages
    /// larger than the link's buffer (4 MiB over shared memory), waits there
    /// for the receiver, so two ranks that send large messages to each other
    /// first must order them (lower rank sends first) .
    pub fn send_handle(&self, src: &Handle, to: usize, dtype: DType) -> Result<(), CommError> {
        let slot = self.slot_of("send", "source", src)?;
        self.check("send", dtype).member_of("receiver rank", to, self.size())?;
        self.check_not_self("send", to)?;
        let count = src.size() as usize / dtype.size();
        let mut inputs = vec![None; self.local_devices()];
        inputs[slot] = Some(src.clone());
        let none = vec![None; self.local_devices()];
        self.launch(Job::Send { peer: to }, dtype, count, inputs, none)?;
        Ok(())
    }

    /// Receives into `dst` (a buffer of one of this rank's devices) what rank
    /// `from` sends with [`Communicator::send_handle`]. Returns at once; reads of
    /// `dst` wait for the message. A message of another size or type is an
    /// error naming both sides.
    pub fn recv_handle(&self, dst: &Handle, from: usize, dtype: DType) -> Result<(), CommError> {
        let slot = self.slot_of("recv", "destination", dst)?;
        self.check("recv", dtype).member_of("sender rank", from, self.size())?;
        self.check_not_self("recv", from)?;
        let count = dst.size() as usize / dtype.size();
        let mut outputs = vec![None; self.local_devices()];
        outputs[slot] = Some(dst.clone());
        let none = vec![None; self.local_devices()];
        self.launch(Job::Recv { peer: from }, dtype, count, none, outputs)?;
        Ok(())
    }

    /// Waits, on the calling thread, until every rank's every local device
    /// reached the barrier (so the work queued before it everywhere has
    /// run). Returns the timeout error naming the ranks that never arrived,
    /// or any other failure.
    pub fn barrier(&self) -> Result<(), CommError> {
        let none = vec![None; self.local_devices()];
        let meeting = self.launch(Job::Barrier, DType::U8, 0, none.clone(), none)?;
        meeting.wait().map_err(|source| CommError::Failed { operation: "barrier", source })
    }

    /// The local slot of member `member`, if it is on this rank.
    fn local_slot(&self, member: usize) -> Option<usize> {
        let l = self.local_devices();
        (member / l == self.rank()).then_some(member % l)
    }

    fn slot_of(&self, op: &'static str, what: &'static str, handle: &Handle) -> Result<usize, CommError> {
        self.clients().iter().position(|c| c.service_id() == handle.service()).ok_or(CommError::ForeignHandle {
            operation: op,
            what,
            member: self.rank() * self.local_devices(),
            handle_device: handle.service().device,
            member_device: self.clients()[0].device_id(),
        })
    }

    fn check_not_self(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        if peer == self.rank() {
            return Err(CommError::Overlap {
                operation: op,
                member: peer,
                detail: "a rank cannot send to itself; copy the buffer with `to_client` instead".into(),
            });
        }
        Ok(())
    }
}

fn some(handles: &[Handle]) -> Vec<Option<Handle>> {
    handles.iter().cloned().map(Some).collect()
}
