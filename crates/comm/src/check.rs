//! Argument checks every collective runs before it queues anything: one
//! function per collective, called by both front ends, each returning the
//! call's [`Op`] once its buffers fit it.
//!
//! Buffers are indexed by local slot (one per local device); errors name
//! the member, `first + slot` (a `Communicator`'s members are numbered
//! across ranks, a `ClientGroup`'s from 0). A rooted collective's root
//! buffer is checked where the root is local, and ignored elsewhere.

use cohort_runtime::{Access, Client, Handle};

use crate::error::CommError;
use crate::op::Op;
use crate::ops::{DType, ReduceOp};

/// Refuses an empty list, a device listed twice and clients of different
/// runtimes (for a `ClientGroup` and a `Communicator`'s local devices).
pub(crate) fn check_clients(clients: &[Client]) -> Result<(), CommError> {
    let Some(first) = clients.first() else {
        return Err(CommError::EmptyGroup);
    };
    for (member, client) in clients.iter().enumerate() {
        if client.device_id().type_id != first.device_id().type_id {
            return Err(CommError::MixedRuntimes { member, first: first.name(), other: client.name() });
        }
        if let Some(earlier) = clients[..member].iter().position(|c| c.device_id() == client.device_id()) {
            return Err(CommError::DuplicateDevice { device: client.device_id(), first: earlier, second: member });
        }
    }
    Ok(())
}

/// The local side of a collective: the clients whose buffers a call takes
/// (one per local slot), and where they sit among every member.
pub(crate) struct Members<'a> {
    pub clients: &'a [Client],
    /// The member of local slot 0.
    pub first: usize,
    /// Members of the whole collective (roots index these).
    pub count: usize,
    /// Whether a source may share bytes with its destination only in the
    /// collective's in-place layout (a `ClientGroup`, whose host engine
    /// reads and writes there); otherwise the executor copies overlapping
    /// sources first.
    pub strict_overlap: bool,
}

impl Members<'_> {
    /// The local slot of `member`, when it is local.
    pub fn local_slot(&self, member: usize) -> Option<usize> {
        member.checked_sub(self.first).filter(|&slot| slot < self.clients.len())
    }

    fn call(&self, op: &'static str, dtype: DType) -> Check<'_> {
        Check { op, members: self, dtype }
    }

    /// `index` is below `count` (`what` names the role: "root", "receiver").
    pub fn within(&self, op: &'static str, what: &'static str, index: usize, count: usize) -> Result<(), CommError> {
        if index >= count {
            return Err(CommError::NotAMember { operation: op, what, index, members: count });
        }
        Ok(())
    }

    /// [`ClientGroup::all_reduce`](crate::ClientGroup::all_reduce).
    pub fn all_reduce(&self, src: &[Handle], dst: &[Handle], dtype: DType, op: ReduceOp) -> Result<Op, CommError> {
        let c = self.call("all_reduce", dtype);
        c.per_member("source", src)?;
        c.destinations(dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, size, "the destination is the size of the source")?;
        for slot in 0..src.len() {
            c.overlap(slot, &dst[slot], &src[slot], 0, "in place, source and destination are the same buffer")?;
        }
        Ok(Op::all_reduce(dtype, op, size / dtype.size()))
    }

    /// [`ClientGroup::reduce`](crate::ClientGroup::reduce): `dst` counts on
    /// the root only.
    pub fn reduce(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Op, CommError> {
        let c = self.call("reduce", dtype);
        c.member("root", root)?;
        c.per_member("source", src)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        if let Some(slot) = self.local_slot(root) {
            c.destination(slot, dst)?;
            c.size("destination", slot, dst, size, "the destination is the size of the source")?;
            c.overlap(slot, dst, &src[slot], 0, "in place, the root's source and destination are the same buffer")?;
        }
        Ok(Op::reduce(dtype, op, root, size / dtype.size()))
    }

    /// [`ClientGroup::broadcast`](crate::ClientGroup::broadcast): `src`
    /// counts on the root only.
    pub fn broadcast(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Op, CommError> {
        let c = self.call("broadcast", dtype);
        c.member("root", root)?;
        let local_root = self.local_slot(root);
        if let Some(slot) = local_root {
            c.owned("source", slot, src)?;
        }
        c.destinations(dst)?;
        let size = match local_root {
            Some(slot) => {
                let size = c.whole("source", slot, src)?;
                c.sizes("destination", dst, size, "every destination is the size of the root's source")?;
                c.overlap(slot, &dst[slot], src, 0, "in place, the root's source and destination are the same buffer")?;
                size
            }
            None => {
                let size = c.whole("destination", 0, &dst[0])?;
                c.sizes("destination", dst, size, "every destination is the size of member 0's")?;
                size
            }
        };
        Ok(Op::broadcast(dtype, root, size / dtype.size()))
    }

    /// [`ClientGroup::all_gather`](crate::ClientGroup::all_gather).
    pub fn all_gather(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Op, CommError> {
        let (c, n) = (self.call("all_gather", dtype), self.count);
        c.per_member("source", src)?;
        c.destinations(dst)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, n * size, &format!("{n} members × the source size"))?;
        for slot in 0..src.len() {
            let at = (self.first + slot) * size;
            let layout = "in place, the source is the destination's block at member × size";
            c.overlap(slot, &dst[slot], &src[slot], at, layout)?;
        }
        Ok(Op::all_gather(dtype, size / dtype.size()))
    }

    /// [`ClientGroup::reduce_scatter`](crate::ClientGroup::reduce_scatter).
    pub fn reduce_scatter(&self, src: &[Handle], dst: &[Handle], dtype: DType, op: ReduceOp) -> Result<Op, CommError> {
        let (c, n) = (self.call("reduce_scatter", dtype), self.count);
        c.per_member("source", src)?;
        c.destinations(dst)?;
        let size = c.whole("destination", 0, &dst[0])?;
        c.sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        c.sizes("source", src, n * size, &format!("{n} members × the destination size"))?;
        for slot in 0..src.len() {
            let at = (self.first + slot) * size;
            let layout = "in place, the destination is the source's block at member × size";
            c.overlap(slot, &src[slot], &dst[slot], at, layout)?;
        }
        Ok(Op::reduce_scatter(dtype, op, size / dtype.size()))
    }

    /// [`ClientGroup::all_to_all`](crate::ClientGroup::all_to_all). With
    /// strict overlaps, every member or none runs in place.
    pub fn all_to_all(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Op, CommError> {
        let (c, n) = (self.call("all_to_all", dtype), self.count);
        c.per_member("source", src)?;
        c.destinations(dst)?;
        let total = c.whole("source", 0, &src[0])?;
        let block = n * dtype.size();
        if total % block != 0 {
            return Err(CommError::WrongSize {
                operation: "all_to_all",
                what: "source",
                member: self.first,
                dtype,
                expected: (total - total % block) as u64,
                got: total as u64,
                why: format!("a whole number of {n} equal blocks of {dtype} elements, one per member"),
            });
        }
        c.sizes("source", src, total, "every member's source is the size of member 0's")?;
        c.sizes("destination", dst, total, "the destination is the size of the source")?;
        if self.strict_overlap {
            let in_place: Vec<bool> = src.iter().zip(dst).map(|(s, d)| same_bytes(s, d)).collect();
            for slot in 0..src.len() {
                c.overlap(slot, &dst[slot], &src[slot], 0, "in place, source and destination are the same buffer")?;
                if in_place[slot] != in_place[0] {
                    return Err(CommError::Overlap {
                        operation: "all_to_all",
                        member: self.first + slot,
                        detail: "all_to_all runs in place only when every member passes one buffer as both source \
                                 and destination; here some do and some do not"
                            .into(),
                    });
                }
            }
        }
        Ok(Op::all_to_all(dtype, total / n / dtype.size()))
    }

    /// [`ClientGroup::gather`](crate::ClientGroup::gather): `dst` counts on
    /// the root only.
    pub fn gather(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Op, CommError> {
        let (c, n) = (self.call("gather", dtype), self.count);
        c.member("root", root)?;
        c.per_member("source", src)?;
        let size = c.whole("source", 0, &src[0])?;
        c.sizes("source", src, size, "every member's source is the size of member 0's")?;
        if let Some(slot) = self.local_slot(root) {
            c.destination(slot, dst)?;
            c.size("destination", slot, dst, n * size, &format!("{n} members × the source size"))?;
            let layout = "in place, the root's source is its destination's block at root × size";
            c.overlap(slot, dst, &src[slot], root * size, layout)?;
        }
        Ok(Op::gather(dtype, root, size / dtype.size()))
    }

    /// [`ClientGroup::scatter`](crate::ClientGroup::scatter): `src` counts
    /// on the root only.
    pub fn scatter(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Op, CommError> {
        let (c, n) = (self.call("scatter", dtype), self.count);
        c.member("root", root)?;
        let local_root = self.local_slot(root);
        if let Some(slot) = local_root {
            c.owned("source", slot, src)?;
        }
        c.destinations(dst)?;
        let size = c.whole("destination", 0, &dst[0])?;
        c.sizes("destination", dst, size, "every member's destination is the size of member 0's")?;
        if let Some(slot) = local_root {
            c.size("source", slot, src, n * size, &format!("{n} members × the destination size"))?;
            let layout = "in place, the root's destination is its source's block at root × size";
            c.overlap(slot, src, &dst[slot], root * size, layout)?;
        }
        Ok(Op::scatter(dtype, root, size / dtype.size()))
    }

    /// [`ClientGroup::send_recv`](crate::ClientGroup::send_recv): both
    /// members local.
    pub fn send_recv(&self, from: usize, src: &Handle, to: usize, dst: &Handle, dtype: DType) -> Result<Op, CommError> {
        let c = self.call("send_recv", dtype);
        c.member("sender", from)?;
        c.member("receiver", to)?;
        c.owned("source", from, src)?;
        c.destination(to, dst)?;
        let size = c.whole("source", from, src)?;
        c.size("destination", to, dst, size, "the destination is the size of the source")?;
        if from == to {
            c.overlap(from, dst, src, 0, "a send to oneself in place is the same buffer")?;
        }
        Ok(Op::send_recv(dtype, from, to, size / dtype.size()))
    }

    /// A message between ranks of `ranks` (each holding this many local
    /// devices): `me` sends `buffer` (`sending`) to `peer`, or receives it
    /// from `peer` into `buffer`. Returns the description (endpoints are
    /// ranks) and the local slot of `buffer`.
    pub fn message(
        &self,
        sending: bool,
        buffer: &Handle,
        me: usize,
        peer: usize,
        ranks: usize,
        dtype: DType,
    ) -> Result<(Op, usize), CommError> {
        let (name, what, role) =
            if sending { ("send", "source", "receiver rank") } else { ("recv", "destination", "sender rank") };
        let slot =
            self.clients.iter().position(|c| c.service_id() == buffer.service()).ok_or(CommError::ForeignHandle {
                operation: name,
                what,
                member: self.first,
                handle_device: buffer.service().device,
                member_device: self.clients[0].device_id(),
            })?;
        if !sending {
            self.call(name, dtype).writable(slot, buffer)?;
        }
        self.within(name, role, peer, ranks)?;
        if peer == me {
            return Err(CommError::Overlap {
                operation: name,
                member: peer,
                detail: "a rank cannot send to itself; copy the buffer with `to_client` instead".into(),
            });
        }
        let count = buffer.size() as usize / dtype.size();
        let (from, to) = if sending { (me, peer) } else { (peer, me) };
        Ok((Op::send_recv(dtype, from, to, count), slot))
    }
}

/// The checks of one call: its name, its local side, its element type.
struct Check<'a> {
    op: &'static str,
    members: &'a Members<'a>,
    dtype: DType,
}

impl Check<'_> {
    /// One buffer per local client, each on its client's device.
    fn per_member(&self, what: &'static str, handles: &[Handle]) -> Result<(), CommError> {
        let expected = self.members.clients.len();
        if handles.len() != expected {
            return Err(CommError::BufferCount { operation: self.op, what, expected, got: handles.len() });
        }
        for (slot, handle) in handles.iter().enumerate() {
            self.owned(what, slot, handle)?;
        }
        Ok(())
    }

    /// One destination per local client, each on its client's device and
    /// writable.
    fn destinations(&self, handles: &[Handle]) -> Result<(), CommError> {
        self.per_member("destination", handles)?;
        for (slot, handle) in handles.iter().enumerate() {
            self.writable(slot, handle)?;
        }
        Ok(())
    }

    /// The destination of local `slot` is on its device and writable.
    fn destination(&self, slot: usize, handle: &Handle) -> Result<(), CommError> {
        self.owned("destination", slot, handle)?;
        self.writable(slot, handle)
    }

    /// The destination of local `slot` may be written: foreign memory
    /// adopted read-only (a DLPack tensor marked so) may not.
    fn writable(&self, slot: usize, handle: &Handle) -> Result<(), CommError> {
        if handle.access() == Access::ReadOnly {
            return Err(CommError::ReadOnly {
                operation: self.op,
                member: self.members.first + slot,
                bytes: handle.size(),
            });
        }
        Ok(())
    }

    /// `index` is a member (`what` names the role: "root", "sender").
    fn member(&self, what: &'static str, index: usize) -> Result<(), CommError> {
        self.members.within(self.op, what, index, self.members.count)
    }

    /// `handle` is on the device of local `slot`.
    fn owned(&self, what: &'static str, slot: usize, handle: &Handle) -> Result<(), CommError> {
        let client = &self.members.clients[slot];
        if handle.service() != client.service_id() {
            return Err(CommError::ForeignHandle {
                operation: self.op,
                what,
                member: self.members.first + slot,
                handle_device: handle.service().device,
                member_device: client.device_id(),
            });
        }
        Ok(())
    }

    /// `handle` holds a whole number of elements; returns its size.
    fn whole(&self, what: &'static str, slot: usize, handle: &Handle) -> Result<usize, CommError> {
        let bytes = handle.size();
        let elem = self.dtype.size();
        if !bytes.is_multiple_of(elem as u64) {
            return Err(CommError::PartialElement {
                operation: self.op,
                what,
                member: self.members.first + slot,
                bytes,
                dtype: self.dtype.to_string(),
                elem,
            });
        }
        Ok(bytes as usize)
    }

    /// Every handle (by local slot) holds `expected` bytes.
    fn sizes(&self, what: &'static str, handles: &[Handle], expected: usize, why: &str) -> Result<(), CommError> {
        for (slot, handle) in handles.iter().enumerate() {
            self.size(what, slot, handle, expected, why)?;
        }
        Ok(())
    }

    /// The handle of local `slot` holds `expected` bytes.
    fn size(
        &self,
        what: &'static str,
        slot: usize,
        handle: &Handle,
        expected: usize,
        why: &str,
    ) -> Result<(), CommError> {
        if handle.size() != expected as u64 {
            return Err(CommError::WrongSize {
                operation: self.op,
                what,
                member: self.members.first + slot,
                dtype: self.dtype,
                expected: expected as u64,
                got: handle.size(),
                why: why.to_string(),
            });
        }
        Ok(())
    }

    /// With strict overlaps: a member's source and destination either do
    /// not overlap, or sit exactly where the collective runs in place:
    /// `inner` starts `offset` bytes into `outer` (same handle when
    /// `offset` is 0 and sizes match).
    fn overlap(
        &self,
        slot: usize,
        outer: &Handle,
        inner: &Handle,
        offset: usize,
        in_place: &str,
    ) -> Result<(), CommError> {
        if !self.members.strict_overlap || !overlaps(outer, inner) || inner.offset() == outer.offset() + offset as u64 {
            return Ok(());
        }
        Err(CommError::Overlap {
            operation: self.op,
            member: self.members.first + slot,
            detail: format!(
                "they share bytes but are not laid out in place ({in_place}); pass separate buffers or the in-place layout"
            ),
        })
    }
}

/// Whether two handles share at least one byte.
pub(crate) fn overlaps(a: &Handle, b: &Handle) -> bool {
    a.same_allocation(b)
        && a.size() > 0
        && b.size() > 0
        && a.offset() < b.offset() + b.size()
        && b.offset() < a.offset() + a.size()
}

/// Whether two handles name exactly the same bytes.
pub(crate) fn same_bytes(a: &Handle, b: &Handle) -> bool {
    a.same_allocation(b) && a.offset() == b.offset() && a.size() == b.size()
}
