//! The adaptive pool: carved pages whose size grows with the largest
//! allocation seen.

use crate::error::ServerError;

use super::carved::CarvedPages;
use super::sliced::DEALLOC_PERIOD;
use super::{PageStorage, PoolKind, PoolReport, SliceHandle, MIB};

/// Pages of an earlier page size, kept until they empty.
#[derive(Debug)]
struct Outdated {
    page_size: u64,
    pages: CarvedPages,
    peak: u64,
    largest: u64,
}

/// Serves every size up to `max_page_size` from pages of the current
/// `page_size`, growing it when a larger request comes.
#[derive(Debug)]
pub(crate) struct AdaptivePool {
    page_size: u64,
    max_page_size: u64,
    pages: CarvedPages,
    peak: u64,
    largest: u64,
    /// Oldest generation first.
    outdated: Vec<Outdated>,
}

impl AdaptivePool {
    pub(crate) fn new(page_size: u64, max_page_size: u64) -> Self {
        Self { page_size, max_page_size, pages: CarvedPages::new(), peak: 0, largest: 0, outdated: Vec::new() }
    }

    /// The current page size.
    #[cfg(test)]
    pub(crate) fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Whether the pool takes a request of `padded` bytes: anything a page of
    /// the largest allowed size holds.
    pub(crate) fn accepts(&self, padded: u64) -> bool {
        padded <= self.max_page_size
    }

    /// Serves from an existing current page without growing. Outdated pages
    /// serve nothing.
    pub(crate) fn try_reserve(&mut self, padded: u64, size: u64, tick: u64) -> Option<SliceHandle> {
        if padded > self.page_size {
            return None;
        }
        let handle = self.pages.try_reserve(padded, size, tick)?;
        self.largest = self.largest.max(size);
        Some(handle)
    }

    /// Frees every slot nothing holds, current and outdated. O(used slots).
    pub(crate) fn sweep(&mut self) {
        self.pages.sweep();
        for old in &mut self.outdated {
            old.pages.sweep();
        }
    }

    /// The page size for a request of `size` (`padded`) bytes larger than the
    /// current page: the next MiB above `size`, capped at `max_page_size`.
    fn grown_size(&self, size: u64, padded: u64) -> u64 {
        let next_mib = (size / MIB).saturating_add(1).saturating_mul(MIB);
        next_mib.min(self.max_page_size).max(padded)
    }

    /// Allocates a new page (growing the page size first when the request is
    /// larger than it) and serves the request from it. On a growth the current
    /// pages become outdated and the peak and largest statistics restart. When
    /// the backend refuses the page nothing changes.
    pub(crate) fn grow(
        &mut self,
        storage: &mut dyn PageStorage,
        padded: u64,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        let page_size = if padded > self.page_size { self.grown_size(size, padded) } else { self.page_size };
        let id = storage.alloc_page(page_size)?;
        if page_size != self.page_size {
            tracing::debug!(old = self.page_size, new = page_size, "adaptive pool grows its page size");
            let pages = std::mem::replace(&mut self.pages, CarvedPages::new());
            if pages.page_count() > 0 {
                self.outdated.push(Outdated {
                    page_size: self.page_size,
                    pages,
                    peak: self.peak,
                    largest: self.largest,
                });
            }
            self.page_size = page_size;
            self.peak = 0;
            self.largest = 0;
        }
        let handle = self.pages.add_page_and_take(id, page_size, padded, size, tick);
        self.peak = self.peak.max(self.pages.page_count());
        self.largest = self.largest.max(size);
        Ok(handle)
    }

    /// Periodic: gives back current pages idle for [`DEALLOC_PERIOD`]
    /// reservations once empty, and every emptied outdated page. Explicit
    /// (`all`): every empty page.
    pub(crate) fn cleanup(&mut self, storage: &mut dyn PageStorage, tick: u64, all: bool) {
        self.pages.free_empty_pages(storage, |page| all || tick.saturating_sub(page.last_used) >= DEALLOC_PERIOD);
        for old in &mut self.outdated {
            old.pages.free_empty_pages(storage, |_| true);
        }
        self.outdated.retain(|old| old.pages.page_count() > 0);
    }

    pub(crate) fn release_all(&mut self, storage: &mut dyn PageStorage) {
        self.pages.release_all(storage);
        for mut old in self.outdated.drain(..) {
            old.pages.release_all(storage);
        }
    }

    pub(crate) fn has_live(&self) -> bool {
        self.pages.has_live() || self.outdated.iter().any(|old| old.pages.has_live())
    }

    /// `(live slices, bytes in use, bytes reserved)`. O(used slots).
    pub(crate) fn usage(&self) -> (u64, u64, u64) {
        let mut total = (0, 0, 0);
        for pages in std::iter::once(&self.pages).chain(self.outdated.iter().map(|old| &old.pages)) {
            let (count, bytes) = pages.live();
            total = (total.0 + count, total.1 + bytes, total.2 + pages.bytes_reserved());
        }
        total
    }

    /// The pool's row, then one `Sliced` row per outdated page size.
    pub(crate) fn report(&self, out: &mut Vec<PoolReport>) {
        let outdated_pages = self.outdated.iter().map(|old| old.pages.page_count()).sum();
        out.push(PoolReport {
            kind: PoolKind::Adaptive { page_size: self.page_size, outdated_pages },
            pages: self.pages.page_count(),
            pages_peak: self.peak,
            largest_alloc: self.largest,
            bytes_in_use: self.pages.live().1,
            bytes_reserved: self.pages.bytes_reserved(),
        });
        for old in &self.outdated {
            out.push(PoolReport {
                kind: PoolKind::Sliced { page_size: old.page_size, max_slice_size: old.page_size },
                pages: old.pages.page_count(),
                pages_peak: old.peak,
                largest_alloc: old.largest,
                bytes_in_use: old.pages.live().1,
                bytes_reserved: old.pages.bytes_reserved(),
            });
        }
    }

    #[cfg(test)]
    pub(crate) fn pages(&self) -> impl Iterator<Item = &CarvedPages> {
        std::iter::once(&self.pages).chain(self.outdated.iter().map(|old| &old.pages))
    }
}
