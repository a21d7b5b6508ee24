//! A [`PageStorage`] that records allocations and frees, panics on a double
//! free or an unknown page, and can run out of memory.

use std::collections::HashMap;

use crate::error::ServerError;
use crate::id::DeviceId;
use crate::memory::{PageId, PageStorage};

pub(super) struct FakeStorage {
    pub(super) align: u64,
    /// Bytes the "device" has; `None` for unlimited.
    pub(super) capacity: Option<u64>,
    next: u64,
    live: HashMap<u64, u64>,
    pub(super) allocs: u64,
    pub(super) frees: u64,
}

impl FakeStorage {
    pub(super) fn new(align: u64) -> Self {
        Self { align, capacity: None, next: 1, live: HashMap::new(), allocs: 0, frees: 0 }
    }

    pub(super) fn with_capacity(align: u64, capacity: u64) -> Self {
        Self { capacity: Some(capacity), ..Self::new(align) }
    }

    /// Bytes of the pages allocated and not yet freed.
    pub(super) fn live_bytes(&self) -> u64 {
        self.live.values().sum()
    }

    pub(super) fn live_pages(&self) -> usize {
        self.live.len()
    }

    /// Size of a live page; panics for a freed or unknown one.
    pub(super) fn page_size(&self, page: PageId) -> u64 {
        *self.live.get(&page.0).unwrap_or_else(|| panic!("{page:?} is not a live page"))
    }

    /// Every page allocated was freed exactly once.
    pub(super) fn assert_all_freed(&self) {
        assert!(self.live.is_empty(), "leaked pages: {:?}", self.live);
        assert_eq!(self.allocs, self.frees, "allocations and frees differ");
    }
}

impl PageStorage for FakeStorage {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        assert!(size >= 1, "zero-size page requested");
        if let Some(cap) = self.capacity {
            if self.live_bytes() + size > cap {
                return Err(ServerError::OutOfMemory {
                    device: DeviceId::new(DeviceId::CPU, 0),
                    requested: size,
                    reason: "fake device is full".into(),
                });
            }
        }
        let id = self.next;
        self.next += 1;
        self.live.insert(id, size);
        self.allocs += 1;
        Ok(PageId(id))
    }

    fn free_page(&mut self, page: PageId) {
        assert!(self.live.remove(&page.0).is_some(), "double free or unknown page {page:?}");
        self.frees += 1;
    }

    fn alignment(&self) -> u64 {
        self.align
    }
}
