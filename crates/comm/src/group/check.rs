//! Argument checks every collective runs before it queues anything.

use cohort_runtime::{Client, Handle};

use crate::error::CommError;
use crate::ops::DType;

/// Refuses an empty list, a device listed twice and clients of different
/// runtimes (for a `ClientGroup` and a `Communicator`'s local devices).
pub(crate) fn check_clients(clients: &[Client]) -> Result<(), CommError> {
    let Some(first) = clients.first() else {
        return Err(CommError::EmptyGroup);
    };
    for (member, client) in clients.iter().enumerate() {
        if client.name() != first.name() {
            return Err(CommError::MixedRuntimes { member, first: first.name(), other: client.name() });
        }
        if let Some(earlier) = clients[..member].iter().position(|c| c.device_id() == client.device_id()) {
            return Err(CommError::DuplicateDevice { device: client.device_id(), first: earlier, second: member });
        }
    }
    Ok(())
}

/// The checks of one call: its name, the local clients it queues on, and
/// its element type. Buffers are indexed by local slot; errors name the
/// member, `first_member + slot` (a `Communicator`'s members are numbered
/// across ranks, a `ClientGroup`'s from 0).
pub(crate) struct Check<'a> {
    pub op: &'static str,
    pub clients: &'a [Client],
    pub first_member: usize,
    /// Members of the whole collective (roots and endpoints index these).
    pub members: usize,
    pub dtype: DType,
}

impl Check<'_> {
    /// One buffer per local client, each on its client's device.
    pub fn per_member(&self, what: &'static str, handles: &[Handle]) -> Result<(), CommError> {
        let expected = self.clients.len();
        if handles.len() != expected {
            return Err(CommError::BufferCount { operation: self.op, what, expected, got: handles.len() });
        }
        for (slot, handle) in handles.iter().enumerate() {
            self.owned(what, slot, handle)?;
        }
        Ok(())
    }

    /// `index` is a member (`what` names the role: "root", "sender").
    pub fn member(&self, what: &'static str, index: usize) -> Result<(), CommError> {
        self.member_of(what, index, self.members)
    }

    /// `index` is below `count` (members, or ranks for point-to-point).
    pub fn member_of(&self, what: &'static str, index: usize, count: usize) -> Result<(), CommError> {
        if index >= count {
            return Err(CommError::NotAMember { operation: self.op, what, index, members: count });
        }
        Ok(())
    }

    /// `handle` is on the device of local `slot`.
    pub fn owned(&self, what: &'static str, slot: usize, handle: &Handle) -> Result<(), CommError> {
        let client = &self.clients[slot];
        if handle.service() != client.service_id() {
            return Err(CommError::ForeignHandle {
                operation: self.op,
                what,
                member: self.first_member + slot,
                handle_device: handle.service().device,
                member_device: client.device_id(),
            });
        }
        Ok(())
    }

    /// `handle` holds a whole number of elements; returns its size.
    pub fn whole(&self, what: &'static str, slot: usize, handle: &Handle) -> Result<usize, CommError> {
        let member = self.first_member + slot;
        let bytes = handle.size();
        let elem = self.dtype.size();
        if bytes % elem as u64 != 0 {
            return Err(CommError::PartialElement {
                operation: self.op,
                what,
                member,
                bytes,
                dtype: self.dtype.to_string(),
                elem,
            });
        }
        Ok(bytes as usize)
    }

    /// `handle` holds exactly `expected` bytes.
    pub fn size(
        &self,
        what: &'static str,
        slot: usize,
        handle: &Handle,
        expected: usize,
        why: impl FnOnce() -> String,
    ) -> Result<(), CommError> {
        if handle.size() != expected as u64 {
            return Err(CommError::WrongSize {
                operation: self.op,
                what,
                member: self.first_member + slot,
                expected: expected as u64,
                got: handle.size(),
                why: why(),
            });
        }
        Ok(())
    }

    /// Every handle holds `expected` bytes.
    pub fn sizes(&self, what: &'static str, handles: &[Handle], expected: usize, why: &str) -> Result<(), CommError> {
        for (slot, handle) in handles.iter().enumerate() {
            self.size(what, slot, handle, expected, || why.to_string())?;
        }
        Ok(())
    }

    /// Every handle holds a whole number of elements and `expected` bytes.
    pub fn whole_sizes(
        &self,
        what: &'static str,
        handles: &[Handle],
        expected: usize,
        why: &str,
    ) -> Result<(), CommError> {
        for (slot, handle) in handles.iter().enumerate() {
            self.whole(what, slot, handle)?;
            self.size(what, slot, handle, expected, || why.to_string())?;
        }
        Ok(())
    }

    /// A member's source and destination either do not overlap, or sit
    /// exactly where the collective runs in place: `inner` starts `offset`
    /// bytes into `outer` (same handle when `offset` is 0 and sizes match).
    pub fn overlap(
        &self,
        member: usize,
        outer: &Handle,
        inner: &Handle,
        offset: usize,
        in_place: &str,
    ) -> Result<(), CommError> {
        if !overlaps(outer, inner) || inner.offset() == outer.offset() + offset as u64 {
            return Ok(());
        }
        Err(CommError::Overlap {
            operation: self.op,
            member,
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
