//! Allocation modes, pool routing, cleanup policies, out-of-memory retry,
//! zero sizes and shutdown.

use super::fake::FakeStorage;
use crate::error::ServerError;
use crate::memory::{AllocationMode, Cleanup, MemoryPools, MemoryPoolsConfig, PoolConfig, PoolKind, MIB};

const AUTO: AllocationMode = AllocationMode::Auto;

fn default_pools() -> MemoryPools {
    MemoryPools::new(&MemoryPoolsConfig::default()).unwrap()
}

#[test]
fn persistent_pages_are_exact_reused_and_only_freed_explicitly() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let p = AllocationMode::Persistent;
    let a = pools.reserve(&mut storage, 1000, p).unwrap();
    let page = a.page();
    assert_eq!((storage.page_size(page), a.offset()), (1000, 0));
    drop(a);
    let b = pools.reserve(&mut storage, 950, p).unwrap();
    assert_eq!(b.page(), page, "an equal-or-slightly-smaller request reuses the page");
    let c = pools.reserve(&mut storage, 1000, p).unwrap();
    assert_ne!(c.page(), page, "a used page is not shared");
    drop((b, c));
    let d = pools.reserve(&mut storage, 500, p).unwrap();
    assert_eq!(storage.page_size(d.page()), 500, "too much waste: a new exact page");
    drop(d);
    for _ in 0..2000 {
        pools.reserve(&mut storage, 64, AUTO).unwrap();
    }
    pools.cleanup(&mut storage, Cleanup::Periodic);
    assert_eq!(pools.report().last().unwrap().pages, 3, "periodic cleanup keeps persistent pages");
    pools.cleanup(&mut storage, Cleanup::Explicit);
    assert_eq!(pools.usage().bytes_reserved, 0);
    storage.assert_all_freed();
}

#[test]
fn dedicated_pages_are_fresh_and_freed_by_the_next_cleanup() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let d = AllocationMode::Dedicated;
    let a = pools.reserve(&mut storage, 12345, d).unwrap();
    assert_eq!((storage.page_size(a.page()), a.offset()), (12345, 0));
    let b = pools.reserve(&mut storage, 100, d).unwrap();
    assert_ne!(a.page(), b.page());
    pools.cleanup(&mut storage, Cleanup::Periodic);
    assert_eq!(pools.usage().bytes_reserved, 12445, "live dedicated pages stay");
    drop(a);
    pools.cleanup(&mut storage, Cleanup::Periodic);
    assert_eq!(pools.usage().bytes_reserved, 100);
    let row = pools.report().into_iter().find(|r| r.kind == PoolKind::Dedicated).unwrap();
    assert_eq!(row.to_string(), "dedicated pages=1 peak=2 largest=12345 in_use=100");
    drop(b);
    let c = pools.reserve(&mut storage, 100, d).unwrap();
    assert_eq!(storage.live_pages(), 1, "the dropped page went back before a new one came");
    drop(c);
    pools.cleanup(&mut storage, Cleanup::Periodic);
    storage.assert_all_freed();
}

#[test]
fn exclusive_pool_reuses_pages_within_twice_the_size() {
    let mut storage = FakeStorage::new(256);
    let config = MemoryPoolsConfig {
        pools: vec![
            PoolConfig::Exclusive { max_alloc_size: MIB },
            PoolConfig::Adaptive { page_size: 2 * MIB, max_page_size: 64 * MIB },
        ],
    };
    let mut pools = MemoryPools::new(&config).unwrap();
    let a = pools.reserve(&mut storage, 600 * 1024, AUTO).unwrap();
    let page = a.page();
    assert_eq!(storage.page_size(page), 600 * 1024);
    drop(a);
    let b = pools.reserve(&mut storage, 400 * 1024, AUTO).unwrap();
    assert_eq!((b.page(), b.size()), (page, 400 * 1024));
    drop(b);
    let c = pools.reserve(&mut storage, 200 * 1024, AUTO).unwrap();
    assert_ne!(c.page(), page, "more than 2x waste: a new page");
    let big = pools.reserve(&mut storage, MIB + 1, AUTO).unwrap();
    assert_eq!(storage.page_size(big.page()), 2 * MIB, "past the exclusive range: adaptive");
    drop((c, big));
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn routing_follows_ranges_and_falls_back() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let small = pools.reserve(&mut storage, 64 * 1024, AUTO).unwrap();
    assert_eq!(storage.page_size(small.page()), 8 * MIB, "up to max_slice_size: sliced");
    let medium = pools.reserve(&mut storage, 64 * 1024 + 1, AUTO).unwrap();
    assert_eq!(storage.page_size(medium.page()), 2 * MIB, "larger: adaptive");
    let huge = pools.reserve(&mut storage, 2048 * MIB, AUTO).unwrap();
    assert_eq!(storage.page_size(huge.page()), 2048 * MIB, "past the adaptive cap: dedicated");
    assert!(pools.report().iter().any(|r| r.kind == PoolKind::Dedicated));

    // An exclusive pool of size 0 as the last pool serves what nothing else takes.
    let config = MemoryPoolsConfig {
        pools: vec![
            PoolConfig::Sliced { page_size: MIB, max_slice_size: 1024 },
            PoolConfig::Exclusive { max_alloc_size: 0 },
        ],
    };
    let mut other = MemoryPools::new(&config).unwrap();
    let x = other.reserve(&mut storage, 5 * MIB, AUTO).unwrap();
    assert_eq!(storage.page_size(x.page()), 5 * MIB);
    assert_eq!(other.report()[1].pages, 1);
    // A sliced last pool takes anything up to its page.
    let config = MemoryPoolsConfig { pools: vec![PoolConfig::Sliced { page_size: MIB, max_slice_size: 1024 }] };
    let mut third = MemoryPools::new(&config).unwrap();
    let y = third.reserve(&mut storage, MIB, AUTO).unwrap();
    assert_eq!(third.report()[0].pages, 1);
    let z = third.reserve(&mut storage, MIB + 1, AUTO).unwrap();
    assert_eq!(storage.page_size(z.page()), MIB + 1, "larger than every page: dedicated");

    drop((small, medium, huge, x, y, z));
    for p in [&mut pools, &mut other, &mut third] {
        p.cleanup(&mut storage, Cleanup::Explicit);
    }
    storage.assert_all_freed();
}

#[test]
fn outdated_pages_stay_while_live_and_go_once_empty() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let old: Vec<_> = (0..4).map(|_| pools.reserve(&mut storage, MIB, AUTO).unwrap()).collect();
    let big = pools.reserve(&mut storage, 3 * MIB, AUTO).unwrap();
    assert_eq!(pools.test_adaptive(2).page_size(), 4 * MIB);
    let outdated = |pools: &MemoryPools| match pools.report()[2].kind {
        PoolKind::Adaptive { outdated_pages, .. } => outdated_pages,
        _ => unreachable!(),
    };
    assert_eq!(outdated(&pools), 2);
    // Small requests now land in the grown pages, never in outdated ones.
    let one = pools.reserve(&mut storage, MIB, AUTO).unwrap();
    assert_eq!(storage.page_size(one.page()), 4 * MIB);
    pools.cleanup(&mut storage, Cleanup::Periodic);
    assert_eq!(outdated(&pools), 2, "live outdated pages stay");
    drop(old);
    pools.cleanup(&mut storage, Cleanup::Periodic);
    assert_eq!(outdated(&pools), 0, "emptied outdated pages go back periodically");
    assert_eq!(pools.report().len(), 4, "no outdated row once they are gone");
    assert_eq!(pools.usage().bytes_reserved, 4 * MIB);
    drop((big, one));
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn periodic_cleanup_runs_on_reservation() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let old: Vec<_> = (0..8).map(|_| pools.reserve(&mut storage, MIB, AUTO).unwrap()).collect();
    let big = pools.reserve(&mut storage, 64 * MIB, AUTO).unwrap();
    drop((old, big));
    assert_eq!(pools.usage().bytes_reserved, 76_546_048);
    // Small reservations elsewhere: the periodic cleanup on the way frees the
    // emptied outdated pages, then (past the deallocation period) idle pages.
    for _ in 0..300 {
        pools.reserve(&mut storage, 100, AUTO).unwrap();
    }
    assert_eq!(pools.usage().bytes_reserved, 65 * MIB + 8 * MIB, "outdated pages freed");
    for _ in 0..2000 {
        pools.reserve(&mut storage, 100, AUTO).unwrap();
    }
    assert_eq!(pools.usage().bytes_reserved, 8 * MIB, "the idle adaptive page freed");
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn out_of_memory_retries_after_an_explicit_cleanup() {
    let mut storage = FakeStorage::with_capacity(256, 4 * MIB);
    let mut pools = default_pools();
    let w: Vec<_> = (0..2).map(|_| pools.reserve(&mut storage, MIB, AllocationMode::Persistent).unwrap()).collect();
    drop(w);
    // The grown 4 MiB adaptive page does not fit next to the two free
    // persistent pages: they go back and the allocation is retried.
    let h = pools.reserve(&mut storage, 3 * MIB, AUTO).unwrap();
    assert_eq!(storage.page_size(h.page()), 4 * MIB);
    assert_eq!(pools.report().last().unwrap().pages, 0);
    // Nothing left to free: the error comes back and nothing changed.
    let err = pools.reserve(&mut storage, 5 * MIB, AUTO).unwrap_err();
    assert!(matches!(err, ServerError::OutOfMemory { requested, .. } if requested == 6 * MIB));
    assert_eq!(pools.test_adaptive(2).page_size(), 4 * MIB, "a refused growth changes nothing");
    let err = pools.reserve(&mut storage, 1, AllocationMode::Dedicated).unwrap_err();
    assert!(matches!(err, ServerError::OutOfMemory { .. }));
    assert_eq!(pools.usage().bytes_reserved, storage.live_bytes());
    assert_eq!(pools.usage().allocations, 1);
    drop(h);
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn zero_size_reservations_count_as_empty_allocations() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let hs: Vec<_> = [AUTO, AUTO, AllocationMode::Persistent, AllocationMode::Dedicated]
        .into_iter()
        .map(|mode| pools.reserve(&mut storage, 0, mode).unwrap())
        .collect();
    assert!(hs.iter().all(|h| h.size() == 0));
    assert_ne!((hs[0].page(), hs[0].offset()), (hs[1].page(), hs[1].offset()));
    let usage = pools.usage();
    assert_eq!((usage.allocations, usage.bytes_in_use), (4, 0));
    drop(hs);
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn release_all_frees_every_page_even_live_ones() {
    let mut storage = FakeStorage::new(256);
    let mut pools = default_pools();
    let live: Vec<_> = [(100, AUTO), (MIB, AUTO), (10, AllocationMode::Persistent), (10, AllocationMode::Dedicated)]
        .into_iter()
        .map(|(size, mode)| pools.reserve(&mut storage, size, mode).unwrap())
        .collect();
    assert!(!pools.is_quiescent());
    pools.release_all(&mut storage);
    storage.assert_all_freed();
    assert_eq!(pools.usage().bytes_reserved, 0);
    drop(live);
    assert!(pools.is_quiescent());
    let again = pools.reserve(&mut storage, 100, AUTO).unwrap();
    drop(again);
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}
