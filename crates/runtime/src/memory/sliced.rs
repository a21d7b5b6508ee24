//! The sliced pool: fixed-size pages carved into small slices.

use crate::error::ServerError;

use super::carved::CarvedPages;
use super::{PageStorage, PoolKind, PoolReport, SliceHandle};

/// A page idle (no slot taken from it) for this many reservations may be
/// given back by a periodic cleanup once empty.
pub(crate) const DEALLOC_PERIOD: u64 = 1024;

/// Pages of `page_size` bytes carved into slices of at most `max_slice_size`.
#[derive(Debug)]
pub(crate) struct SlicedPool {
    pub(crate) page_size: u64,
    pub(crate) max_slice_size: u64,
    pages: CarvedPages,
    peak: u64,
    largest: u64,
}

impl SlicedPool {
    pub(crate) fn new(page_size: u64, max_slice_size: u64) -> Self {
        Self { page_size, max_slice_size, pages: CarvedPages::new(), peak: 0, largest: 0 }
    }

    /// Whether the pool takes a request of `size` bytes (`padded` with
    /// alignment); `last` relaxes the range to anything that fits a page.
    pub(crate) fn accepts(&self, size: u64, padded: u64, last: bool) -> bool {
        padded <= self.page_size && (last || size <= self.max_slice_size)
    }

    /// Serves from an existing page without growing. See [`CarvedPages::try_reserve`].
    pub(crate) fn try_reserve(&mut self, padded: u64, size: u64, tick: u64) -> Option<SliceHandle> {
        let handle = self.pages.try_reserve(padded, size, tick)?;
        self.largest = self.largest.max(size);
        Some(handle)
    }

    /// Frees every slot nothing holds. O(used slots).
    pub(crate) fn sweep(&mut self) {
        self.pages.sweep();
    }

    /// Allocates a new page and serves the request from it.
    pub(crate) fn grow(
        &mut self,
        storage: &mut dyn PageStorage,
        padded: u64,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        let id = storage.alloc_page(self.page_size)?;
        let handle = self.pages.add_page_and_take(id, self.page_size, padded, size, tick);
        self.peak = self.peak.max(self.pages.page_count());
        self.largest = self.largest.max(size);
        Ok(handle)
    }

    /// Periodic: gives back empty pages idle for [`DEALLOC_PERIOD`]
    /// reservations. Explicit (`all`): every empty page.
    pub(crate) fn cleanup(&mut self, storage: &mut dyn PageStorage, tick: u64, all: bool) {
        self.pages.free_empty_pages(storage, |page| all || tick.saturating_sub(page.last_used) >= DEALLOC_PERIOD);
    }

    pub(crate) fn release_all(&mut self, storage: &mut dyn PageStorage) {
        self.pages.release_all(storage);
    }

    pub(crate) fn has_live(&self) -> bool {
        self.pages.has_live()
    }

    /// `(live slices, bytes in use, bytes reserved)`. O(used slots).
    pub(crate) fn usage(&self) -> (u64, u64, u64) {
        let (count, bytes) = self.pages.live();
        (count, bytes, self.pages.bytes_reserved())
    }

    pub(crate) fn report(&self) -> PoolReport {
        let (_, in_use) = self.pages.live();
        PoolReport {
            kind: PoolKind::Sliced { page_size: self.page_size, max_slice_size: self.max_slice_size },
            pages: self.pages.page_count(),
            pages_peak: self.peak,
            largest_alloc: self.largest,
            bytes_in_use: in_use,
            bytes_reserved: self.pages.bytes_reserved(),
        }
    }

    #[cfg(test)]
    pub(crate) fn pages(&self) -> &CarvedPages {
        &self.pages
    }
}
