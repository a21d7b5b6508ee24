//! [`Collectives`]: the calls every communicator offers, typed; and
//! [`Grouped`], the builder of a grouped call.

use cohort_runtime::{Client, Handle};

use super::buffer::{handles, Buffer};
use super::Error;
use crate::communicator::Communicator;
use crate::device::Transport;
use crate::error::CommError;
use crate::group::ClientGroup;
use crate::grouped::GroupCall;
use crate::ops::{DType, Element, ReduceOp};
use crate::work::Work;

/// The collectives of a set of devices, written once for every way a job
/// runs: [`ClientGroup`] (one process over several devices), and
/// [`Communicator`] (one rank of a job of several processes, each with one
/// or more devices), and [`World`](super::World), which is whichever of the
/// two the process was started as.
///
/// **Members.** Every device of the job is a member, numbered across ranks:
/// with `L` devices per process, member `rank × L + l` is local device `l`
/// of `rank`. Roots, senders and receivers are members.
///
/// **Buffers.** Every collective takes one [`Buffer`] per local device (in
/// [`clients`](Collectives::clients) order) for its sources and one for its
/// destinations, and infers the element type and count from them. Where only
/// one member's buffer is used (the root's source of a broadcast, the root's
/// destination of a reduce or gather), every process still passes one per
/// local device and the others are not touched. In place: pass the same
/// buffers as source and destination (all-gather: the source is the
/// destination's block at `member × len`; reduce-scatter: the destination is
/// the source's block at `member × len`).
///
/// **When it runs.** Each call checks its arguments (a wrong length or a
/// foreign buffer is an error before anything is queued), queues one part
/// on every local device and returns at once. A later read of a destination
/// (or any work on it on its device) runs after the collective. A collective
/// that fails marks its destinations; reading one returns why.
///
/// **Handles.** Every collective returns a [`Work`]: `wait()`,
/// `wait_timeout(d)` (an expiry names the members not finished yet) and
/// `is_done()`. Dropping it cancels nothing, so `?;` alone is fine where
/// reads of the destinations are the only wait needed.
///
/// ```
/// use cohort_comm::{Buffer, ClientGroup, Collectives, Error, ReduceOp};
/// use cohort_runtime::{CpuRuntime, Runtime};
///
/// fn main() -> Result<(), Error> {
///     let group = ClientGroup::new(CpuRuntime::clients()?)?;
///     // Member m holds [m, m, m]; after the all-reduce every member holds the sum.
///     let grads: Vec<Buffer<f32>> = group
///         .clients()
///         .iter()
///         .enumerate()
///         .map(|(m, c)| Buffer::from_slice(c, &[m as f32; 3]))
///         .collect::<Result<_, _>>()?;
///     group.all_reduce(&grads, &grads, ReduceOp::Sum)?;
///     let n = group.members() as f32;
///     assert_eq!(grads[0].to_vec()?, [n * (n - 1.0) / 2.0; 3]);
///     Ok(())
/// }
/// ```
///
/// Buffers of different element types cannot be mixed in one call:
///
/// ```compile_fail
/// use cohort_comm::{Buffer, ClientGroup, Collectives, ReduceOp};
///
/// fn mixed(group: &ClientGroup, a: &[Buffer<f32>], b: &[Buffer<i32>]) {
///     let _ = group.all_reduce(a, b, ReduceOp::Sum); // expected `Buffer<f32>`, found `Buffer<i32>`
/// }
/// fn main() {}
/// ```
///
/// while the same call over one element type compiles:
///
/// ```
/// use cohort_comm::{Buffer, ClientGroup, Collectives, ReduceOp};
///
/// fn same(group: &ClientGroup, a: &[Buffer<f32>], b: &[Buffer<f32>]) {
///     let _ = group.all_reduce(a, b, ReduceOp::Sum);
/// }
/// fn main() {}
/// ```
pub trait Collectives {
    /// This process's devices, in local order (one buffer each per call).
    fn clients(&self) -> &[Client];

    /// Members in the whole job: every device of every rank.
    fn members(&self) -> usize;

    /// The member number of this process's first device.
    fn first_member(&self) -> usize;

    /// This process's rank (0 for a [`ClientGroup`]).
    fn rank(&self) -> usize;

    /// Processes in the job (1 for a [`ClientGroup`]).
    fn world_size(&self) -> usize;

    /// How the collectives move bytes.
    fn transport(&self) -> Transport;

    /// Waits for everything queued on every local device's stream.
    fn sync(&self) -> Result<(), CommError>;

    /// Waits until every member's device reached the barrier; a timeout
    /// names the members (or ranks) that never arrived.
    fn barrier(&self) -> Result<(), CommError>;

    /// The untyped layer beneath [`Collectives::all_reduce`]: handles and an
    /// explicit element type (for code that handles many types at once).
    fn all_reduce_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType, op: ReduceOp)
        -> Result<Work, CommError>;
    /// Untyped [`Collectives::reduce`]; `dst` is the root's destination
    /// where this process holds the root.
    fn reduce_handles(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, CommError>;
    /// Untyped [`Collectives::broadcast`]; `src` is the root's source where
    /// this process holds the root.
    fn broadcast_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError>;
    /// Untyped [`Collectives::all_gather`].
    fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError>;
    /// Untyped [`Collectives::reduce_scatter`].
    fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError>;
    /// Untyped [`Collectives::all_to_all`].
    fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError>;
    /// Untyped [`Collectives::gather`].
    fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError>;
    /// Untyped [`Collectives::scatter`].
    fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError>;
    /// Untyped [`Collectives::send_recv`].
    fn send_recv_members(
        &self,
        from: usize,
        src: Option<&Handle>,
        to: usize,
        dst: Option<&Handle>,
        dtype: DType,
    ) -> Result<Work, CommError>;

    /// Untyped [`Collectives::group`]: runs `calls` as one grouped call
    /// (every call checked first; nothing is queued if one is refused).
    fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError>;

    /// Runs the collectives `body` records as one grouped call, like
    /// `ncclGroupStart/End` or PyTorch's coalescing: on the host engine one
    /// task per device and one meeting for all of them, on NCCL queued back
    /// to back. Different sizes and element types may be mixed. Every call
    /// is checked before anything is queued (one bad call refuses the
    /// group); a call may not read what an earlier call of the group
    /// writes. Returns one [`Work`] for all of them, at once.
    ///
    /// ```
    /// use cohort_comm::{ClientGroup, Collectives, Error, ReduceOp};
    /// use cohort_runtime::{CpuRuntime, Runtime};
    ///
    /// fn main() -> Result<(), Error> {
    ///     let group = ClientGroup::new(CpuRuntime::clients()?)?;
    ///     let a = group.replicate(&[1.0f32; 8])?;
    ///     let b = group.replicate(&[2i64; 3])?;
    ///     let work = group.group(|g| {
    ///         g.all_reduce(&a, &a, ReduceOp::Sum)?;
    ///         g.all_reduce(&b, &b, ReduceOp::Max)
    ///     })?;
    ///     work.wait()?;
    ///     assert_eq!(a[0].to_vec()?, [group.members() as f32; 8]);
    ///     assert_eq!(b[0].to_vec()?, [2; 3]);
    ///     Ok(())
    /// }
    /// ```
    fn group<F>(&self, body: F) -> Result<Work, Error>
    where
        F: FnOnce(&mut Grouped<'_, Self>) -> Result<(), Error>,
    {
        let mut grouped = Grouped { comm: self, calls: Vec::new() };
        body(&mut grouped)?;
        Ok(self.group_handles(grouped.calls)?)
    }

    /// The local slot (index into [`clients`](Collectives::clients)) of
    /// `member`, when this process holds it.
    fn local_slot(&self, member: usize) -> Option<usize> {
        member.checked_sub(self.first_member()).filter(|slot| *slot < self.clients().len())
    }

    /// One buffer of `len` zeros on every local device.
    fn zeros<T: Element>(&self, len: usize) -> Result<Vec<Buffer<T>>, Error> {
        self.clients().iter().map(|c| Buffer::zeros(c, len)).collect()
    }

    /// One copy of `data` on every local device.
    fn replicate<T: Element>(&self, data: &[T]) -> Result<Vec<Buffer<T>>, Error> {
        self.clients().iter().map(|c| Buffer::from_slice(c, data)).collect()
    }

    /// Reduces every member's `src` element-wise with `op` and writes the
    /// result to every member's `dst` (same lengths). Returns its [`Work`] handle at
    /// once.
    fn all_reduce<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>], op: ReduceOp) -> Result<Work, Error> {
        Ok(self.all_reduce_handles(&handles(src), &handles(dst), T::DTYPE, op)?)
    }

    /// Reduces every member's `src` with `op` into member `root`'s `dst`;
    /// no other destination is written. Returns its [`Work`] handle at
    /// once.
    fn reduce<T: Element>(
        &self,
        src: &[Buffer<T>],
        dst: &[Buffer<T>],
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, Error> {
        let dst = pick(self, "reduce", "destination", dst, root)?;
        Ok(self.reduce_handles(&handles(src), dst, T::DTYPE, op, root)?)
    }

    /// Copies member `root`'s `src` into every member's `dst`; no other
    /// source is read. Returns its [`Work`] handle at
    /// once.
    fn broadcast<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>], root: usize) -> Result<Work, Error> {
        let src = pick(self, "broadcast", "source", src, root)?;
        Ok(self.broadcast_handles(src, &handles(dst), T::DTYPE, root)?)
    }

    /// Concatenates every member's `src` (member order) into every member's
    /// `dst`, which holds `members()` times a source. Returns its [`Work`] handle at
    /// once.
    fn all_gather<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>]) -> Result<Work, Error> {
        Ok(self.all_gather_handles(&handles(src), &handles(dst), T::DTYPE)?)
    }

    /// Reduces every member's `src` (`members()` blocks) with `op` and gives
    /// member `m` block `m` of the result in its `dst`. Returns its [`Work`] handle at
    /// once.
    fn reduce_scatter<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>], op: ReduceOp) -> Result<Work, Error> {
        Ok(self.reduce_scatter_handles(&handles(src), &handles(dst), T::DTYPE, op)?)
    }

    /// Sends block `k` of member `m`'s `src` to block `m` of member `k`'s
    /// `dst`; every buffer holds `members()` equal blocks. Returns its [`Work`] handle at
    /// once.
    fn all_to_all<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>]) -> Result<Work, Error> {
        Ok(self.all_to_all_handles(&handles(src), &handles(dst), T::DTYPE)?)
    }

    /// Concatenates every member's `src` (member order) into member
    /// `root`'s `dst`, which holds `members()` sources. Returns its [`Work`] handle at
    /// once.
    fn gather<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>], root: usize) -> Result<Work, Error> {
        let dst = pick(self, "gather", "destination", dst, root)?;
        Ok(self.gather_handles(&handles(src), dst, T::DTYPE, root)?)
    }

    /// Gives member `m` block `m` of member `root`'s `src` (which holds
    /// `members()` destinations). Returns its [`Work`] handle at
    /// once.
    fn scatter<T: Element>(&self, src: &[Buffer<T>], dst: &[Buffer<T>], root: usize) -> Result<Work, Error> {
        let src = pick(self, "scatter", "source", src, root)?;
        Ok(self.scatter_handles(src, &handles(dst), T::DTYPE, root)?)
    }

    /// Copies member `from`'s `src` into member `to`'s `dst` (equal
    /// lengths). Each process passes the buffers of the members it holds
    /// and `None` for the others; a process holding neither does nothing.
    /// Across processes the receiver's reads of `dst` wait for the message.
    fn send_recv<T: Element>(
        &self,
        from: usize,
        src: Option<&Buffer<T>>,
        to: usize,
        dst: Option<&Buffer<T>>,
    ) -> Result<Work, Error> {
        Ok(self.send_recv_members(from, src.map(Buffer::handle), to, dst.map(Buffer::handle), T::DTYPE)?)
    }
}

/// The handle of `member`'s buffer among `buffers` (one per local device),
/// or the first when this process does not hold `member` (the call then
/// does not use it).
fn pick<'a, C: Collectives + ?Sized, T: Element>(
    comm: &C,
    operation: &'static str,
    what: &'static str,
    buffers: &'a [Buffer<T>],
    member: usize,
) -> Result<&'a Handle, CommError> {
    let slot = comm.local_slot(member).unwrap_or(0);
    buffers.get(slot).map(Buffer::handle).ok_or(CommError::BufferCount {
        operation,
        what,
        expected: comm.clients().len(),
        got: buffers.len(),
    })
}

/// The collectives of one grouped call, recorded in order by the closure
/// given to [`Collectives::group`] and run as one when it returns: on the
/// host engine one task per device and one meeting for all of them; on
/// NCCL the calls are queued back to back. Sizes and element types may
/// differ between calls; a call may not read what an earlier call of the
/// same group writes (that is refused). Nothing is queued until every call
/// passed its argument check: one bad call refuses the whole group.
pub struct Grouped<'a, C: Collectives + ?Sized> {
    comm: &'a C,
    calls: Vec<GroupCall>,
}

impl<C: Collectives + ?Sized> Grouped<'_, C> {
    /// Calls recorded so far.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Records [`Collectives::all_reduce`].
    pub fn all_reduce<T: Element>(&mut self, src: &[Buffer<T>], dst: &[Buffer<T>], op: ReduceOp) -> Result<(), Error> {
        self.calls.push(GroupCall::AllReduce { src: handles(src), dst: handles(dst), dtype: T::DTYPE, op });
        Ok(())
    }

    /// Records [`Collectives::reduce`].
    pub fn reduce<T: Element>(
        &mut self,
        src: &[Buffer<T>],
        dst: &[Buffer<T>],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        let dst = pick(self.comm, "reduce", "destination", dst, root)?.clone();
        self.calls.push(GroupCall::Reduce { src: handles(src), dst, dtype: T::DTYPE, op, root });
        Ok(())
    }

    /// Records [`Collectives::broadcast`].
    pub fn broadcast<T: Element>(&mut self, src: &[Buffer<T>], dst: &[Buffer<T>], root: usize) -> Result<(), Error> {
        let src = pick(self.comm, "broadcast", "source", src, root)?.clone();
        self.calls.push(GroupCall::Broadcast { src, dst: handles(dst), dtype: T::DTYPE, root });
        Ok(())
    }

    /// Records [`Collectives::all_gather`].
    pub fn all_gather<T: Element>(&mut self, src: &[Buffer<T>], dst: &[Buffer<T>]) -> Result<(), Error> {
        self.calls.push(GroupCall::AllGather { src: handles(src), dst: handles(dst), dtype: T::DTYPE });
        Ok(())
    }

    /// Records [`Collectives::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(
        &mut self,
        src: &[Buffer<T>],
        dst: &[Buffer<T>],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.calls.push(GroupCall::ReduceScatter { src: handles(src), dst: handles(dst), dtype: T::DTYPE, op });
        Ok(())
    }

    /// Records [`Collectives::all_to_all`].
    pub fn all_to_all<T: Element>(&mut self, src: &[Buffer<T>], dst: &[Buffer<T>]) -> Result<(), Error> {
        self.calls.push(GroupCall::AllToAll { src: handles(src), dst: handles(dst), dtype: T::DTYPE });
        Ok(())
    }
}

/// The untyped collectives of `$ty`, from its inherent methods of the same
/// names.
macro_rules! untyped_from_inherent {
    ($ty:ty) => {
        fn all_reduce_handles(
            &self,
            src: &[Handle],
            dst: &[Handle],
            dtype: DType,
            op: ReduceOp,
        ) -> Result<Work, CommError> {
            <$ty>::all_reduce_handles(self, src, dst, dtype, op)
        }
        fn reduce_handles(
            &self,
            src: &[Handle],
            dst: &Handle,
            dtype: DType,
            op: ReduceOp,
            root: usize,
        ) -> Result<Work, CommError> {
            <$ty>::reduce_handles(self, src, dst, dtype, op, root)
        }
        fn broadcast_handles(
            &self,
            src: &Handle,
            dst: &[Handle],
            dtype: DType,
            root: usize,
        ) -> Result<Work, CommError> {
            <$ty>::broadcast_handles(self, src, dst, dtype, root)
        }
        fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
            <$ty>::all_gather_handles(self, src, dst, dtype)
        }
        fn reduce_scatter_handles(
            &self,
            src: &[Handle],
            dst: &[Handle],
            dtype: DType,
            op: ReduceOp,
        ) -> Result<Work, CommError> {
            <$ty>::reduce_scatter_handles(self, src, dst, dtype, op)
        }
        fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
            <$ty>::all_to_all_handles(self, src, dst, dtype)
        }
        fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError> {
            <$ty>::gather_handles(self, src, dst, dtype, root)
        }
        fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
            <$ty>::scatter_handles(self, src, dst, dtype, root)
        }
        fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError> {
            <$ty>::group_handles(self, calls)
        }
        fn sync(&self) -> Result<(), CommError> {
            <$ty>::sync(self)
        }
        fn barrier(&self) -> Result<(), CommError> {
            <$ty>::barrier(self)
        }
        fn transport(&self) -> Transport {
            <$ty>::transport(self)
        }
        fn clients(&self) -> &[Client] {
            <$ty>::clients(self)
        }
    };
}

impl Collectives for ClientGroup {
    untyped_from_inherent!(ClientGroup);

    fn members(&self) -> usize {
        self.len()
    }

    fn first_member(&self) -> usize {
        0
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn send_recv_members(
        &self,
        from: usize,
        src: Option<&Handle>,
        to: usize,
        dst: Option<&Handle>,
        dtype: DType,
    ) -> Result<Work, CommError> {
        // One process holds every member: both ends are its own.
        let src = src.ok_or(CommError::MissingBuffer { operation: "send_recv", what: "source", member: from })?;
        let dst = dst.ok_or(CommError::MissingBuffer { operation: "send_recv", what: "destination", member: to })?;
        self.send_recv_handles(from, src, to, dst, dtype)
    }
}

impl Collectives for Communicator {
    untyped_from_inherent!(Communicator);

    fn members(&self) -> usize {
        Communicator::members(self)
    }

    fn first_member(&self) -> usize {
        Communicator::rank(self) * self.local_devices()
    }

    fn rank(&self) -> usize {
        Communicator::rank(self)
    }

    fn world_size(&self) -> usize {
        self.size()
    }

    fn send_recv_members(
        &self,
        from: usize,
        src: Option<&Handle>,
        to: usize,
        dst: Option<&Handle>,
        dtype: DType,
    ) -> Result<Work, CommError> {
        let members = Communicator::members(self);
        for (what, index) in [("sender", from), ("receiver", to)] {
            if index >= members {
                return Err(CommError::NotAMember { operation: "send_recv", what, index, members });
            }
        }
        let local = self.local_devices();
        let (from_rank, to_rank, me) = (from / local, to / local, Communicator::rank(self));
        let missing = |what, member| CommError::MissingBuffer { operation: "send_recv", what, member };
        // The buffer must be on the device of the member it is passed for.
        let owned = |what, member: usize, handle: &Handle| {
            let client = &self.clients()[member % local];
            match handle.service() == client.service_id() {
                true => Ok(()),
                false => Err(CommError::ForeignHandle {
                    operation: "send_recv",
                    what,
                    member,
                    handle_device: handle.service().device,
                    member_device: client.device_id(),
                }),
            }
        };
        match (from_rank == me, to_rank == me) {
            (true, true) => Err(CommError::Overlap {
                operation: "send_recv",
                member: from,
                detail: format!(
                    "members {from} and {to} are both devices of rank {me}; a rank does not send to itself: copy \
                     between its devices with `to_client`"
                ),
            }),
            (true, false) => {
                let src = src.ok_or(missing("source", from))?;
                owned("source", from, src)?;
                self.send_handle(src, to_rank, dtype)
            }
            (false, true) => {
                let dst = dst.ok_or(missing("destination", to))?;
                owned("destination", to, dst)?;
                self.recv_handle(dst, from_rank, dtype)
            }
            (false, false) => Ok(Work::nothing("send_recv")),
        }
    }
}
