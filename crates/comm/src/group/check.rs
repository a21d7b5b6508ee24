//! Argument checks every collective runs before it queues anything.

use cohort_runtime::Handle;

use super::ClientGroup;
use crate::error::CommError;
use crate::ops::DType;

/// The checks of one call: its name, group and element type.
pub(super) struct Check<'a> {
    pub op: &'static str,
    pub group: &'a ClientGroup,
    pub dtype: DType,
}

impl Check<'_> {
    /// One buffer per member.
    pub fn per_member(&self, what: &'static str, handles: &[Handle]) -> Result<(), CommError> {
        let expected = self.group.len();
        if handles.len() != expected {
            return Err(CommError::BufferCount { operation: self.op, what, expected, got: handles.len() });
        }
        for (member, handle) in handles.iter().enumerate() {
            self.owned(what, member, handle)?;
        }
        Ok(())
    }

    /// `member` is a member (`what` names the role: "root", "sender").
    pub fn member(&self, what: &'static str, index: usize) -> Result<(), CommError> {
        let members = self.group.len();
        if index >= members {
            return Err(CommError::NotAMember { operation: self.op, what, index, members });
        }
        Ok(())
    }

    /// `handle` is on `member`'s device.
    pub fn owned(&self, what: &'static str, member: usize, handle: &Handle) -> Result<(), CommError> {
        let client = self.group.client(member);
        if handle.service() != client.service_id() {
            return Err(CommError::ForeignHandle {
                operation: self.op,
                what,
                member,
                handle_device: handle.service().device,
                member_device: client.device_id(),
            });
        }
        Ok(())
    }

    /// `handle` holds a whole number of elements; returns its size.
    pub fn whole(&self, what: &'static str, member: usize, handle: &Handle) -> Result<usize, CommError> {
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
        member: usize,
        handle: &Handle,
        expected: usize,
        why: impl FnOnce() -> String,
    ) -> Result<(), CommError> {
        if handle.size() != expected as u64 {
            return Err(CommError::WrongSize {
                operation: self.op,
                what,
                member,
                expected: expected as u64,
                got: handle.size(),
                why: why(),
            });
        }
        Ok(())
    }

    /// Every handle holds `expected` bytes.
    pub fn sizes(&self, what: &'static str, handles: &[Handle], expected: usize, why: &str) -> Result<(), CommError> {
        for (member, handle) in handles.iter().enumerate() {
            self.size(what, member, handle, expected, || why.to_string())?;
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
pub(super) fn overlaps(a: &Handle, b: &Handle) -> bool {
    a.same_allocation(b)
        && a.size() > 0
        && b.size() > 0
        && a.offset() < b.offset() + b.size()
        && b.offset() < a.offset() + a.size()
}

/// Whether two handles name exactly the same bytes.
pub(super) fn same_bytes(a: &Handle, b: &Handle) -> bool {
    a.same_allocation(b) && a.offset() == b.offset() && a.size() == b.size()
}
