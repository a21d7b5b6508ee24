//! Pool layouts and their validation.

use crate::error::MemoryConfigError;

use super::MIB;

/// Most pools one layout may have.
pub const MAX_POOLS: usize = 16;

/// One dynamic pool of a layout. A reservation in [`super::AllocationMode::Auto`]
/// goes to the first pool whose range holds its size; a size no pool takes goes
/// to the last pool when it can hold it, and to a dedicated page otherwise.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolConfig {
    /// One allocation per page; a free page is reused by a later allocation
    /// that fits it with at most 2x waste.
    Exclusive {
        /// Largest size the pool takes; `0` serves nothing unless it is the
        /// last pool (then it serves every size the earlier pools do not take).
        max_alloc_size: u64,
    },
    /// Pages carved into small slices.
    Sliced {
        /// Bytes per page (not 0).
        page_size: u64,
        /// Largest slice the pool takes (at most `page_size`).
        max_slice_size: u64,
    },
    /// Serves every size the earlier pools do not take, up to `max_page_size`.
    /// An allocation larger than the page grows the page size to fit it (to
    /// the next MiB above it, capped at `max_page_size`). Pages of the old size
    /// become *outdated*: they serve nothing more and are given back once empty.
    Adaptive {
        /// The first page size (not 0).
        page_size: u64,
        /// The largest page size (at least `page_size`); larger allocations
        /// get a dedicated page.
        max_page_size: u64,
    },
}

/// The dynamic-pool layout of a stream (the persistent pool is not part of it).
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPoolsConfig {
    /// The pools, tried in order. 1 to [`MAX_POOLS`] of them.
    pub pools: Vec<PoolConfig>,
}

impl MemoryPoolsConfig {
    /// Checks the layout: not empty, at most [`MAX_POOLS`] pools, no zero page
    /// size, no slice larger than its page, no adaptive cap smaller than its
    /// page. Returns the first problem found. O(pools).
    pub fn validate(&self) -> Result<(), MemoryConfigError> {
        if self.pools.is_empty() {
            return Err(MemoryConfigError::Empty);
        }
        if self.pools.len() > MAX_POOLS {
            return Err(MemoryConfigError::TooManyPools { count: self.pools.len(), max: MAX_POOLS });
        }
        for (index, pool) in self.pools.iter().enumerate() {
            match *pool {
                PoolConfig::Exclusive { .. } => {}
                PoolConfig::Sliced { page_size, max_slice_size } => {
                    if page_size == 0 {
                        return Err(MemoryConfigError::ZeroPageSize { index });
                    }
                    if max_slice_size > page_size {
                        return Err(MemoryConfigError::SliceLargerThanPage { index, max_slice_size, page_size });
                    }
                }
                PoolConfig::Adaptive { page_size, max_page_size } => {
                    if page_size == 0 {
                        return Err(MemoryConfigError::ZeroPageSize { index });
                    }
                    if max_page_size < page_size {
                        return Err(MemoryConfigError::CapSmallerThanPage { index, max_page_size, page_size });
                    }
                }
            }
        }
        Ok(())
    }
}

impl Default for MemoryPoolsConfig {
    /// `Exclusive { max_alloc_size: 0 }`, `Sliced { 8 MiB, 64 KiB }`,
    /// `Adaptive { 2 MiB, 1 GiB }`: small buffers share 8 MiB pages, the rest
    /// go to adaptive pages (two 1 MiB buffers per 2 MiB page at first).
    fn default() -> Self {
        Self {
            pools: vec![
                PoolConfig::Exclusive { max_alloc_size: 0 },
                PoolConfig::Sliced { page_size: 8 * MIB, max_slice_size: 64 * 1024 },
                PoolConfig::Adaptive { page_size: 2 * MIB, max_page_size: 1024 * MIB },
            ],
        }
    }
}
