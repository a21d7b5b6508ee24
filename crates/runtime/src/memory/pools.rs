//! [`MemoryPools`]: the dynamic pools of a layout, the dedicated pages and the
//! persistent pool of one stream.

use crate::error::{MemoryConfigError, ServerError};

use super::adaptive::AdaptivePool;
use super::exclusive::{ExclusivePool, PagePolicy};
use super::persistent::PersistentPool;
use super::sliced::SlicedPool;
use super::{
    padded_size, AllocationMode, Cleanup, MemoryPoolsConfig, MemoryUsage, PageStorage, PoolConfig, PoolKind,
    PoolReport, SliceHandle,
};

/// A periodic cleanup runs every this many reservations (and whenever a pool
/// is about to allocate a page).
pub(crate) const CLEANUP_INTERVAL: u64 = 256;

/// One pool of the layout.
#[derive(Debug)]
enum DynamicPool {
    Exclusive(ExclusivePool),
    Sliced(SlicedPool),
    Adaptive(AdaptivePool),
}

impl DynamicPool {
    fn new(config: &PoolConfig) -> Self {
        match *config {
            PoolConfig::Exclusive { max_alloc_size } => {
                Self::Exclusive(ExclusivePool::new(PagePolicy::Exclusive, max_alloc_size))
            }
            PoolConfig::Sliced { page_size, max_slice_size } => {
                Self::Sliced(SlicedPool::new(page_size, max_slice_size))
            }
            PoolConfig::Adaptive { page_size, max_page_size } => {
                Self::Adaptive(AdaptivePool::new(page_size, max_page_size))
            }
        }
    }

    fn accepts(&self, size: u64, padded: u64, last: bool) -> bool {
        match self {
            Self::Exclusive(p) => p.accepts(size, last),
            Self::Sliced(p) => p.accepts(size, padded, last),
            Self::Adaptive(p) => p.accepts(padded),
        }
    }

    fn try_reserve(&mut self, padded: u64, size: u64, tick: u64) -> Option<SliceHandle> {
        match self {
            Self::Exclusive(p) => p.try_reserve(size, tick),
            Self::Sliced(p) => p.try_reserve(padded, size, tick),
            Self::Adaptive(p) => p.try_reserve(padded, size, tick),
        }
    }

    /// Frees what nothing holds; returns whether a sweep could have found
    /// anything new (whole-page pools always see frees at once).
    fn sweep(&mut self) -> bool {
        match self {
            Self::Exclusive(_) => false,
            Self::Sliced(p) => {
                p.sweep();
                true
            }
            Self::Adaptive(p) => {
                p.sweep();
                true
            }
        }
    }

    fn grow(
        &mut self,
        storage: &mut dyn PageStorage,
        padded: u64,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        match self {
            Self::Exclusive(p) => p.grow(storage, size, tick),
            Self::Sliced(p) => p.grow(storage, padded, size, tick),
            Self::Adaptive(p) => p.grow(storage, padded, size, tick),
        }
    }

    fn cleanup(&mut self, storage: &mut dyn PageStorage, tick: u64, all: bool) {
        match self {
            Self::Exclusive(p) => p.cleanup(storage, tick, all),
            Self::Sliced(p) => p.cleanup(storage, tick, all),
            Self::Adaptive(p) => p.cleanup(storage, tick, all),
        }
    }

    fn release_all(&mut self, storage: &mut dyn PageStorage) {
        match self {
            Self::Exclusive(p) => p.release_all(storage),
            Self::Sliced(p) => p.release_all(storage),
            Self::Adaptive(p) => p.release_all(storage),
        }
    }

    fn has_live(&self) -> bool {
        match self {
            Self::Exclusive(p) => p.has_live(),
            Self::Sliced(p) => p.has_live(),
            Self::Adaptive(p) => p.has_live(),
        }
    }

    fn usage(&self) -> (u64, u64, u64) {
        match self {
            Self::Exclusive(p) => p.usage(),
            Self::Sliced(p) => p.usage(),
            Self::Adaptive(p) => p.usage(),
        }
    }

    fn report(&self, out: &mut Vec<PoolReport>) {
        match self {
            Self::Exclusive(p) => out.push(p.report(PoolKind::Exclusive { max_alloc_size: p.max_alloc_size })),
            Self::Sliced(p) => out.push(p.report()),
            Self::Adaptive(p) => p.report(out),
        }
    }
}

/// The pools of one stream: the dynamic pools of a [`MemoryPoolsConfig`],
/// the dedicated pages, and the persistent pool.
///
/// Owned by the device's server thread; nothing inside locks. Every method
/// that can give pages back takes the [`PageStorage`] they came from.
#[derive(Debug)]
pub struct MemoryPools {
    config: MemoryPoolsConfig,
    dynamic: Vec<DynamicPool>,
    dedicated: ExclusivePool,
    persistent: PersistentPool,
    /// Reservations made so far; the clock of deallocation periods.
    tick: u64,
    /// Reservations left until the next periodic cleanup.
    until_cleanup: u64,
}

impl MemoryPools {
    /// Builds empty pools for `config` (validated first). Allocates no page.
    pub fn new(config: &MemoryPoolsConfig) -> Result<Self, MemoryConfigError> {
        config.validate()?;
        Ok(Self {
            config: config.clone(),
            dynamic: config.pools.iter().map(DynamicPool::new).collect(),
            dedicated: ExclusivePool::new(PagePolicy::Dedicated, 0),
            persistent: PersistentPool::new(),
            tick: 0,
            until_cleanup: CLEANUP_INTERVAL,
        })
    }

    /// The layout the dynamic pools were built from.
    pub fn config(&self) -> &MemoryPoolsConfig {
        &self.config
    }

    /// Reserves `size` bytes in `mode` and returns the slice.
    ///
    /// A size of 0 is allowed: it takes the smallest slot (one alignment unit,
    /// or a 1-byte page) and counts as an allocation of 0 bytes.
    ///
    /// Cost: when a page already has room (in particular for a reserve/drop
    /// cycle) O(pools + free slots of the pool's pages), with no host
    /// allocation. Otherwise the pool sweeps its slices for dropped handles
    /// (O(used slices)) and, failing that, runs a periodic cleanup and
    /// allocates a page from `storage`. A periodic cleanup also runs every
    /// `CLEANUP_INTERVAL` (256) reservations. If the backend reports out of memory,
    /// an explicit cleanup runs and the allocation is tried once more.
    pub fn reserve(
        &mut self,
        storage: &mut dyn PageStorage,
        size: u64,
        mode: AllocationMode,
    ) -> Result<SliceHandle, ServerError> {
        self.tick += 1;
        let tick = self.tick;
        self.until_cleanup -= 1;
        if self.until_cleanup == 0 {
            self.until_cleanup = CLEANUP_INTERVAL;
            self.cleanup(storage, Cleanup::Periodic);
        }
        match mode {
            AllocationMode::Auto => self.reserve_auto(storage, size, tick),
            AllocationMode::Persistent => {
                self.with_oom_retry(storage, |pools, storage| pools.persistent.reserve(storage, size, tick))
            }
            AllocationMode::Dedicated => self.reserve_dedicated(storage, size, tick),
        }
    }

    fn reserve_auto(
        &mut self,
        storage: &mut dyn PageStorage,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        let align = storage.alignment().max(1);
        let padded = padded_size(size, align).ok_or_else(|| {
            ServerError::InvalidArgument(format!(
                "cannot reserve {size} bytes: the size overflows when aligned to {align}"
            ))
        })?;
        let Some(index) = self.route(size, padded) else {
            return self.reserve_dedicated(storage, size, tick);
        };
        let pool = &mut self.dynamic[index];
        if let Some(handle) = pool.try_reserve(padded, size, tick) {
            return Ok(handle);
        }
        if pool.sweep() {
            if let Some(handle) = pool.try_reserve(padded, size, tick) {
                return Ok(handle);
            }
        }
        // The pool is about to grow: give back what the policies allow first.
        self.cleanup(storage, Cleanup::Periodic);
        self.with_oom_retry(storage, |pools, storage| pools.dynamic[index].grow(storage, padded, size, tick))
    }

    fn reserve_dedicated(
        &mut self,
        storage: &mut dyn PageStorage,
        size: u64,
        tick: u64,
    ) -> Result<SliceHandle, ServerError> {
        self.dedicated.cleanup(storage, tick, false);
        self.with_oom_retry(storage, |pools, storage| pools.dedicated.grow(storage, size, tick))
    }

    /// The first pool whose range holds `size`, else the last pool when it can
    /// hold it at all; `None` sends the request to a dedicated page.
    fn route(&self, size: u64, padded: u64) -> Option<usize> {
        if let Some(index) = self.dynamic.iter().position(|p| p.accepts(size, padded, false)) {
            return Some(index);
        }
        let last = self.dynamic.len().checked_sub(1)?;
        self.dynamic[last].accepts(size, padded, true).then_some(last)
    }

    /// Runs `alloc`; when the backend is out of memory, gives back everything
    /// nothing holds and, if that freed anything, runs `alloc` once more.
    fn with_oom_retry(
        &mut self,
        storage: &mut dyn PageStorage,
        mut alloc: impl FnMut(&mut Self, &mut dyn PageStorage) -> Result<SliceHandle, ServerError>,
    ) -> Result<SliceHandle, ServerError> {
        match alloc(self, storage) {
            Err(err @ ServerError::OutOfMemory { .. }) => {
                let before = self.usage().bytes_reserved;
                self.cleanup(storage, Cleanup::Explicit);
                let after = self.usage().bytes_reserved;
                if after < before {
                    tracing::debug!(freed = before - after, "out of memory: retrying after an explicit cleanup");
                    alloc(self, storage)
                } else {
                    Err(err)
                }
            }
            other => other,
        }
    }

    /// Gives pages back to `storage`: see [`Cleanup`] for how much. Both kinds
    /// first notice dropped handles in the pages they consider.
    /// Cost: periodic O(pages + used slices of idle and outdated pages);
    /// explicit O(pages + used slices).
    pub fn cleanup(&mut self, storage: &mut dyn PageStorage, kind: Cleanup) {
        let all = kind == Cleanup::Explicit;
        let tick = self.tick;
        for pool in &mut self.dynamic {
            pool.cleanup(storage, tick, all);
        }
        self.dedicated.cleanup(storage, tick, all);
        if all {
            self.persistent.cleanup_explicit(storage, tick);
        }
    }

    /// Live slices, their requested bytes, and the bytes of every page held
    /// (all pools, dedicated and persistent included). O(pages + used slices).
    pub fn usage(&self) -> MemoryUsage {
        let parts =
            self.dynamic.iter().map(DynamicPool::usage).chain([self.dedicated.usage(), self.persistent.usage()]);
        parts.fold(MemoryUsage::default(), |acc, (allocations, bytes_in_use, bytes_reserved)| {
            acc.combine(MemoryUsage { allocations, bytes_in_use, bytes_reserved })
        })
    }

    /// One row per dynamic pool in layout order (an adaptive pool's outdated
    /// pages follow it as a `Sliced` row per old page size), then a
    /// `Dedicated` row once a dedicated page was made, then the persistent pool.
    /// O(pages + used slices).
    pub fn report(&self) -> Vec<PoolReport> {
        let mut out = Vec::with_capacity(self.dynamic.len() + 3);
        for pool in &self.dynamic {
            pool.report(&mut out);
        }
        if self.dedicated.ever_used() {
            out.push(self.dedicated.report(PoolKind::Dedicated));
        }
        out.push(self.persistent.report());
        out
    }

    /// Whether no slice of any pool is held by a user. O(pages + used slices).
    pub fn is_quiescent(&self) -> bool {
        !self.dynamic.iter().any(DynamicPool::has_live) && !self.dedicated.has_live() && !self.persistent.has_live()
    }

    /// Rebuilds the dynamic pools with `config`.
    ///
    /// An invalid layout is refused with its error and changes nothing. When a
    /// slice of a dynamic pool is still held, returns `Ok(false)` and keeps the
    /// old layout. Otherwise gives back every page of the old dynamic pools,
    /// builds the new ones (statistics restart) and returns `Ok(true)`.
    /// Dedicated pages and the persistent pool are left as they are.
    /// Cost: O(pages + used slices).
    pub fn reconfigure(
        &mut self,
        storage: &mut dyn PageStorage,
        config: &MemoryPoolsConfig,
    ) -> Result<bool, MemoryConfigError> {
        config.validate()?;
        if self.dynamic.iter().any(DynamicPool::has_live) {
            return Ok(false);
        }
        for pool in &mut self.dynamic {
            pool.release_all(storage);
        }
        self.dynamic = config.pools.iter().map(DynamicPool::new).collect();
        self.config = config.clone();
        Ok(true)
    }

    /// Gives every page back to `storage`, live or not (the device is shutting
    /// down: handles still alive name freed memory afterwards). The pools stay
    /// usable with the same layout. O(pages).
    pub fn release_all(&mut self, storage: &mut dyn PageStorage) {
        for pool in &mut self.dynamic {
            pool.release_all(storage);
        }
        self.dedicated.release_all(storage);
        self.persistent.release_all(storage);
    }

    #[cfg(test)]
    pub(crate) fn test_adaptive(&self, index: usize) -> &AdaptivePool {
        match &self.dynamic[index] {
            DynamicPool::Adaptive(p) => p,
            _ => panic!("pool {index} is not adaptive"),
        }
    }

    #[cfg(test)]
    pub(crate) fn test_sliced(&self, index: usize) -> &SlicedPool {
        match &self.dynamic[index] {
            DynamicPool::Sliced(p) => p,
            _ => panic!("pool {index} is not sliced"),
        }
    }
}
