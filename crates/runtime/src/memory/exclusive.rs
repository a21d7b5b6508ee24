//! Pools of one allocation per page: the exclusive pool, and the page-per-
//! allocation paths of dedicated and persistent reservations.

use std::sync::Arc;

use crate::error::ServerError;

use super::sliced::DEALLOC_PERIOD;
use super::{fill_arc, live_size, PageStorage, PoolKind, PoolReport, SliceHandle, SliceInner};

/// When a free page is reused and when it is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PagePolicy {
    /// Reused by a request that fits with at most 2x waste; given back by a
    /// periodic cleanup once free and idle for [`DEALLOC_PERIOD`] reservations.
    Exclusive,
    /// Never reused; given back by any cleanup once free.
    Dedicated,
    /// Reused by an equal or slightly smaller request (at most 1/8 of the page
    /// wasted); given back only by an explicit cleanup.
    Persistent,
}

#[derive(Debug)]
struct WholePage {
    size: u64,
    /// The pool's bookkeeping copy; the page is free when it is the only one.
    arc: Arc<SliceInner>,
    last_used: u64,
}

impl WholePage {
    fn is_free(&self) -> bool {
        Arc::strong_count(&self.arc) == 1
    }
}

/// Pages that each hold one allocation at offset 0, sized exactly to the
/// request that made them.
#[derive(Debug)]
pub(crate) struct ExclusivePool {
    policy: PagePolicy,
    /// Largest size taken in `Auto` mode (for [`PagePolicy::Exclusive`]).
    pub(crate) max_alloc_size: u64,
    pages: Vec<WholePage>,
    peak: u64,
    largest: u64,
}

impl ExclusivePool {
    pub(crate) fn new(policy: PagePolicy, max_alloc_size: u64) -> Self {
        Self { policy, max_alloc_size, pages: Vec::new(), peak: 0, largest: 0 }
    }

    /// Whether an exclusive pool of the layout takes `size`: up to
    /// `max_alloc_size` (0 takes nothing), or anything when it is the last pool.
    pub(crate) fn accepts(&self, size: u64, last: bool) -> bool {
        last || (self.max_alloc_size > 0 && size <= self.max_alloc_size)
    }

    fn fits(&self, page_size: u64, need: u64) -> bool {
        page_size >= need
            && match self.policy {
                PagePolicy::Exclusive => page_size <= need.saturating_mul(2),
                PagePolicy::Persistent => page_size - need <= page_size / 8,
                PagePolicy::Dedicated => false,
            }
    }

    /// Reuses the smallest free page that fits `size` under the policy.
    /// O(pages); allocation-free.
    pub(crate) fn try_reserve(&mut self, size: u64, tick: u64) -> Option<SliceHandle> {
        if self.policy == PagePolicy::Dedicated {
            return None;
        }
        let need = size.max(1);
        let mut best: Option<usize> = None;
        for (i, page) in self.pages.iter().enumerate() {
            if page.is_free() && self.fits(page.size, need) && best.is_none_or(|b| page.size < self.pages[b].size) {
                best = Some(i);
            }
        }
        let page = &mut self.pages[best?];
        let inner = Arc::get_mut(&mut page.arc).expect("a free page's Arc has no other holder");
        inner.size = size;
        page.last_used = tick;
        self.largest = self.largest.max(size);
        Some(SliceHandle::from_arc(&page.arc))
    }

    /// Allocates a page of exactly `size` bytes (1 for a zero-size request)
    /// and serves the request from it.
    pub(crate) fn grow(
        &mut self,
        storage: &mut dyn PageStorage,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        let need = size.max(1);
        let id = storage.alloc_page(need)?;
        let arc = fill_arc(None, id, 0, size);
        let handle = SliceHandle::from_arc(&arc);
        self.pages.push(WholePage { size: need, arc, last_used: tick });
        self.peak = self.peak.max(self.pages.len() as u64);
        self.largest = self.largest.max(size);
        Ok(handle)
    }

    /// Gives back free pages: every one when `all`, else those the policy
    /// releases periodically. O(pages).
    pub(crate) fn cleanup(&mut self, storage: &mut dyn PageStorage, tick: u64, all: bool) {
        let policy = self.policy;
        self.pages.retain(|page| {
            let due = all
                || match policy {
                    PagePolicy::Exclusive => tick.saturating_sub(page.last_used) >= DEALLOC_PERIOD,
                    PagePolicy::Dedicated => true,
                    PagePolicy::Persistent => false,
                };
            if due && page.is_free() {
                storage.free_page(page.arc.page);
                false
            } else {
                true
            }
        });
    }

    /// Gives back every page, live or not. O(pages).
    pub(crate) fn release_all(&mut self, storage: &mut dyn PageStorage) {
        for page in self.pages.drain(..) {
            storage.free_page(page.arc.page);
        }
    }

    pub(crate) fn has_live(&self) -> bool {
        self.pages.iter().any(|p| !p.is_free())
    }

    /// Whether a page was ever allocated (for reporting dedicated pages).
    pub(crate) fn ever_used(&self) -> bool {
        self.peak > 0
    }

    /// `(live slices, bytes in use, bytes reserved)`. O(pages).
    pub(crate) fn usage(&self) -> (u64, u64, u64) {
        let mut total = (0, 0, 0);
        for page in &self.pages {
            if let Some(size) = live_size(&page.arc) {
                total.0 += 1;
                total.1 += size;
            }
            total.2 += page.size;
        }
        total
    }

    /// The pool's row, reported as `kind`.
    pub(crate) fn report(&self, kind: PoolKind) -> PoolReport {
        let (_, in_use, reserved) = self.usage();
        PoolReport {
            kind,
            pages: self.pages.len() as u64,
            pages_peak: self.peak,
            largest_alloc: self.largest,
            bytes_in_use: in_use,
            bytes_reserved: reserved,
        }
    }
}
