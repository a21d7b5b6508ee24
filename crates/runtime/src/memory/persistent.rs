//! The persistent pool: exact-fit pages for weights and graph captures.
//!
//! Each allocation gets a page of exactly its size. A free page is reused by an
//! equal or slightly smaller request (at most 1/8 of the page wasted), so a
//! model reloaded with the same shapes lands on the same pages. Periodic
//! cleanup never touches it; an explicit cleanup gives back its free pages.
//! Reconfiguring the dynamic pools leaves it as it is.

use crate::error::ServerError;

use super::exclusive::{ExclusivePool, PagePolicy};
use super::{PageStorage, PoolKind, PoolReport, SliceHandle};

/// The persistent pool of one stream.
#[derive(Debug)]
pub(crate) struct PersistentPool {
    pages: ExclusivePool,
}

impl PersistentPool {
    pub(crate) fn new() -> Self {
        Self { pages: ExclusivePool::new(PagePolicy::Persistent, 0) }
    }

    /// Reuses a free page that fits `size` (O(pages)) or allocates one of
    /// exactly `size` bytes.
    pub(crate) fn reserve(
        &mut self,
        storage: &mut dyn PageStorage,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        match self.pages.try_reserve(size, tick) {
            Some(handle) => Ok(handle),
            None => self.pages.grow(storage, size, tick),
        }
    }

    /// Explicit cleanup: gives back every free page. O(pages).
    pub(crate) fn cleanup_explicit(&mut self, storage: &mut dyn PageStorage, tick: u64) {
        self.pages.cleanup(storage, tick, true);
    }

    pub(crate) fn release_all(&mut self, storage: &mut dyn PageStorage) {
        self.pages.release_all(storage);
    }

    pub(crate) fn has_live(&self) -> bool {
        self.pages.has_live()
    }

    /// `(live slices, bytes in use, bytes reserved)`. O(pages).
    pub(crate) fn usage(&self) -> (u64, u64, u64) {
        self.pages.usage()
    }

    pub(crate) fn report(&self) -> PoolReport {
        self.pages.report(PoolKind::Persistent)
    }
}
