//! Memory pools of one stream: how device memory is carved into slices.
//!
//! A backend hands out raw *pages* of device memory through [`PageStorage`];
//! [`MemoryPools`] carves them into [`SliceHandle`]s according to a
//! [`MemoryPoolsConfig`] layout:
//!
//! - **exclusive** pools give one allocation per page ([`PoolConfig::Exclusive`]),
//! - **sliced** pools carve fixed-size pages into small slices ([`PoolConfig::Sliced`]),
//! - **adaptive** pools carve pages whose size grows with the largest
//!   allocation seen ([`PoolConfig::Adaptive`]),
//! - a **persistent** pool gives exact-fit pages for weights and graph captures
//!   ([`AllocationMode::Persistent`]), and *dedicated* allocations get a page of
//!   their own outside every pool ([`AllocationMode::Dedicated`]).
//!
//! A slice is in use while any clone of its handle other than the pool's own
//! bookkeeping copy is alive. Dropping the last user clone frees it; the pools
//! notice lazily (through `Arc::strong_count`) at the next reservation, cleanup
//! or usage query, so freeing costs nothing and needs no message.
//!
//! Nothing here is thread-safe by itself: one [`MemoryPools`] belongs to one
//! stream and is used from the device's server thread. Handles are `Send + Sync`
//! and may be dropped anywhere.

mod adaptive;
mod carved;
mod config;
mod exclusive;
mod persistent;
mod pools;
mod sliced;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;

use crate::error::ServerError;

pub use config::{MemoryPoolsConfig, PoolConfig, MAX_POOLS};
pub use pools::MemoryPools;

/// One mebibyte, the unit adaptive page sizes are rounded to.
pub const MIB: u64 = 1024 * 1024;

/// Opaque id of one backend allocation (a "page").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageId(pub u64);

/// What a backend gives the pools: raw pages of device memory.
///
/// The pools call [`PageStorage::alloc_page`] only when no existing page can
/// serve a reservation, and [`PageStorage::free_page`] exactly once for each
/// page they allocated (on cleanup, reconfiguration or [`MemoryPools::release_all`]).
pub trait PageStorage {
    /// Allocates a page of `size` bytes (`size >= 1`). Errors (out of memory,
    /// driver failure) are passed to the caller of [`MemoryPools::reserve`].
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError>;
    /// Gives a page back to the backend. Called once per allocated page.
    fn free_page(&mut self, page: PageId);
    /// Required alignment of slice offsets inside a page (e.g. 256). Values
    /// below 1 are treated as 1.
    fn alignment(&self) -> u64;

    /// Registers foreign memory (see [`crate::ForeignMemory`]) as a page of
    /// its own, after checking it belongs to this device; the pools never
    /// see it, and [`PageStorage::free_page`] of it only forgets it (the
    /// memory is not freed). Refused by default.
    fn adopt_page(&mut self, memory: &crate::ForeignMemory) -> Result<PageId, ServerError> {
        let _ = memory;
        Err(ServerError::InvalidArgument("this backend cannot take memory it did not allocate".into()))
    }
}

/// The shared part of a [`SliceHandle`]. The pool keeps one `Arc` of it per
/// reserved slice; user clones raise the strong count above 1.
#[derive(Debug)]
pub(crate) struct SliceInner {
    pub(crate) page: PageId,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

/// A reserved slice of a page.
///
/// Cheap to clone (one `Arc` inside). The slice is in use while any clone
/// other than the pool's own bookkeeping copy is alive; dropping every user
/// clone frees it, which the pool detects lazily at its next reservation,
/// cleanup or usage query. Dropping costs one atomic decrement.
#[derive(Clone, Debug)]
pub struct SliceHandle {
    inner: Arc<SliceInner>,
}

impl SliceHandle {
    /// Wraps a pool's bookkeeping `Arc` into a user handle (a clone of it).
    pub(crate) fn from_arc(inner: &Arc<SliceInner>) -> Self {
        Self { inner: Arc::clone(inner) }
    }

    /// The page that holds the slice. O(1).
    pub fn page(&self) -> PageId {
        self.inner.page
    }

    /// Byte offset of the slice inside its page; a multiple of the storage's
    /// alignment. O(1).
    pub fn offset(&self) -> u64 {
        self.inner.offset
    }

    /// The requested size in bytes (without alignment padding). O(1).
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// Whether `self` and `other` are clones of the same reservation. O(1).
    pub fn same_slice(&self, other: &SliceHandle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Takes an `Arc` whose only holder is the caller (from a spare list or a
/// freed slot), or makes a new one, and points it at `page`/`offset`/`size`.
/// Allocation-free when `spare` is given.
pub(crate) fn fill_arc(spare: Option<Arc<SliceInner>>, page: PageId, offset: u64, size: u64) -> Arc<SliceInner> {
    if let Some(mut arc) = spare {
        if let Some(inner) = Arc::get_mut(&mut arc) {
            inner.page = page;
            inner.offset = offset;
            inner.size = size;
            return arc;
        }
    }
    Arc::new(SliceInner { page, offset, size })
}

/// `Some(size)` when a user holds the slice (strong count above the pool's
/// own copy), `None` when it is free. O(1).
#[inline]
pub(crate) fn live_size(arc: &Arc<SliceInner>) -> Option<u64> {
    (Arc::strong_count(arc) > 1).then_some(arc.size)
}

/// Where a reservation is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocationMode {
    /// The dynamic pools of the layout, chosen by size.
    #[default]
    Auto,
    /// The persistent pool: a page per allocation sized exactly, reused for an
    /// equal or slightly smaller request once free, never released by
    /// [`Cleanup::Periodic`], released by [`Cleanup::Explicit`] when free.
    Persistent,
    /// A fresh page of exactly the requested size outside every pool, given
    /// back by the first cleanup (periodic or explicit) after it is dropped.
    Dedicated,
}

/// How much a [`MemoryPools::cleanup`] gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cleanup {
    /// On the way to a reservation: each pool gives back what its own policy
    /// says is unused, such as a page past its deallocation period or an
    /// outdated page that emptied. Persistent pages stay.
    Periodic,
    /// Asked for: everything nothing holds goes back, persistent pages included.
    Explicit,
}

/// Totals of one stream's pools (or, combined, of several streams).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Live slices.
    pub allocations: u64,
    /// Sum of the requested sizes of the live slices.
    pub bytes_in_use: u64,
    /// Sum of the sizes of all pages held from the backend.
    pub bytes_reserved: u64,
}

impl MemoryUsage {
    /// Field-wise sum, for folding the usage of several streams. O(1).
    pub fn combine(self, other: MemoryUsage) -> MemoryUsage {
        MemoryUsage {
            allocations: self.allocations + other.allocations,
            bytes_in_use: self.bytes_in_use + other.bytes_in_use,
            bytes_reserved: self.bytes_reserved + other.bytes_reserved,
        }
    }
}

impl fmt::Display for MemoryUsage {
    /// `allocs=8   in_use=  8388608 reserved=  8388608`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "allocs={:<3} in_use={:>9} reserved={:>9}", self.allocations, self.bytes_in_use, self.bytes_reserved)
    }
}

/// Which pool a [`PoolReport`] describes.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolKind {
    /// One allocation per page.
    Exclusive {
        /// Largest size the pool takes (0: only what no other pool takes, as
        /// the last pool).
        max_alloc_size: u64,
    },
    /// Fixed pages carved into slices; also used for the outdated pages of an
    /// adaptive pool (then `max_slice_size == page_size`).
    Sliced {
        /// Bytes per page.
        page_size: u64,
        /// Largest slice the pool takes.
        max_slice_size: u64,
    },
    /// Growing pages.
    Adaptive {
        /// The current page size.
        page_size: u64,
        /// Pages of earlier (smaller) sizes still held; each size also gets
        /// a `Sliced` row of its own.
        outdated_pages: u64,
    },
    /// Pages of [`AllocationMode::Dedicated`] allocations (reported only once
    /// one was made).
    Dedicated,
    /// The persistent pool.
    Persistent,
}

/// Statistics of one pool, from [`MemoryPools::report`].
#[derive(Debug, Clone, PartialEq)]
pub struct PoolReport {
    /// Which pool this is.
    pub kind: PoolKind,
    /// Pages held now.
    pub pages: u64,
    /// Most pages held at once (since the pool was built, or since an adaptive
    /// pool last grew its page size).
    pub pages_peak: u64,
    /// Largest requested size served (same period as `pages_peak`).
    pub largest_alloc: u64,
    /// Sum of the requested sizes of live slices.
    pub bytes_in_use: u64,
    /// Sum of the sizes of the pages held.
    pub bytes_reserved: u64,
}

impl fmt::Display for PoolReport {
    /// `dynamic Adaptive { page_size: 2097152, outdated_pages: 0 } pages=4 peak=4
    /// largest=1048576 in_use=8388608`, `persistent pages=0 in_use=0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            PoolKind::Persistent => {
                write!(f, "persistent pages={} in_use={}", self.pages, self.bytes_in_use)
            }
            PoolKind::Dedicated => write!(
                f,
                "dedicated pages={} peak={} largest={} in_use={}",
                self.pages, self.pages_peak, self.largest_alloc, self.bytes_in_use
            ),
            kind => write!(
                f,
                "dynamic {kind:?} pages={} peak={} largest={} in_use={}",
                self.pages, self.pages_peak, self.largest_alloc, self.bytes_in_use
            ),
        }
    }
}

/// `size` rounded up to a multiple of `align` (at least `align`, so a
/// zero-size request still gets the smallest slot), or `None` on overflow.
#[inline]
pub(crate) fn padded_size(size: u64, align: u64) -> Option<u64> {
    let size = size.max(1);
    let rem = size % align;
    if rem == 0 {
        Some(size)
    } else {
        size.checked_add(align - rem)
    }
}
