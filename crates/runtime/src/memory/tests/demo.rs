//! The reference pool demo: 8 x 1 MiB, drop, again, one 64 MiB, cleanup.

use super::fake::FakeStorage;
use crate::memory::{AllocationMode, Cleanup, MemoryPools, MemoryPoolsConfig, MemoryUsage, PoolKind, PoolReport, MIB};

fn lines(pools: &MemoryPools) -> Vec<String> {
    pools.report().iter().map(|r| format!("  {r}")).collect()
}

fn usage(allocations: u64, bytes_in_use: u64, bytes_reserved: u64) -> MemoryUsage {
    MemoryUsage { allocations, bytes_in_use, bytes_reserved }
}

#[test]
fn reference_demo_sequence() {
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let auto = AllocationMode::Auto;
    assert_eq!(pools.usage(), usage(0, 0, 0));
    assert_eq!(pools.usage().to_string(), "allocs=0   in_use=        0 reserved=        0");

    let handles: Vec<_> = (0..8).map(|_| pools.reserve(&mut storage, MIB, auto).unwrap()).collect();
    assert_eq!(pools.usage(), usage(8, 8 * MIB, 8 * MIB));
    assert_eq!(pools.usage().to_string(), "allocs=8   in_use=  8388608 reserved=  8388608");
    assert_eq!(
        lines(&pools),
        [
            "  dynamic Exclusive { max_alloc_size: 0 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Sliced { page_size: 8388608, max_slice_size: 65536 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Adaptive { page_size: 2097152, outdated_pages: 0 } pages=4 peak=4 largest=1048576 in_use=8388608",
            "  persistent pages=0 in_use=0",
        ]
    );
    let mut pages: Vec<_> = handles.iter().map(|h| h.page()).collect();
    pages.sort_by_key(|p| p.0);
    pages.dedup();
    assert_eq!(pages.len(), 4);

    drop(handles);
    assert_eq!(pools.usage(), usage(0, 0, 8 * MIB));

    let again: Vec<_> = (0..8).map(|_| pools.reserve(&mut storage, MIB, auto).unwrap()).collect();
    assert_eq!(pools.usage(), usage(8, 8 * MIB, 8 * MIB));
    let mut pages_again: Vec<_> = again.iter().map(|h| h.page()).collect();
    pages_again.sort_by_key(|p| p.0);
    pages_again.dedup();
    assert_eq!(pages_again, pages, "the same pages are reused");
    assert_eq!(storage.allocs, 4);
    drop(again);

    let big = pools.reserve(&mut storage, 64 * MIB, auto).unwrap();
    assert_eq!(pools.usage(), usage(1, 67_108_864, 76_546_048));
    assert_eq!(pools.usage().to_string(), "allocs=1   in_use= 67108864 reserved= 76546048");
    assert_eq!(
        lines(&pools),
        [
            "  dynamic Exclusive { max_alloc_size: 0 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Sliced { page_size: 8388608, max_slice_size: 65536 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Adaptive { page_size: 68157440, outdated_pages: 4 } pages=1 peak=1 largest=67108864 in_use=67108864",
            "  dynamic Sliced { page_size: 2097152, max_slice_size: 2097152 } pages=4 peak=4 largest=1048576 in_use=0",
            "  persistent pages=0 in_use=0",
        ]
    );
    drop(big);
    assert_eq!(pools.usage(), usage(0, 0, 76_546_048));

    pools.cleanup(&mut storage, Cleanup::Explicit);
    assert_eq!(pools.usage(), usage(0, 0, 0));
    assert_eq!(
        lines(&pools),
        [
            "  dynamic Exclusive { max_alloc_size: 0 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Sliced { page_size: 8388608, max_slice_size: 65536 } pages=0 peak=0 largest=0 in_use=0",
            "  dynamic Adaptive { page_size: 68157440, outdated_pages: 0 } pages=0 peak=1 largest=67108864 in_use=0",
            "  persistent pages=0 in_use=0",
        ]
    );
    storage.assert_all_freed();
}

#[test]
fn report_rows_add_up_to_usage() {
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let small: Vec<_> = (0..10).map(|i| pools.reserve(&mut storage, 1000 + i, AllocationMode::Auto).unwrap()).collect();
    let big = pools.reserve(&mut storage, 3 * MIB, AllocationMode::Auto).unwrap();
    let weights = pools.reserve(&mut storage, 5000, AllocationMode::Persistent).unwrap();
    let once = pools.reserve(&mut storage, 7000, AllocationMode::Dedicated).unwrap();
    let report = pools.report();
    let in_use: u64 = report.iter().map(|r| r.bytes_in_use).sum();
    let reserved: u64 = report.iter().map(|r| r.bytes_reserved).sum();
    let usage = pools.usage();
    assert_eq!(in_use, usage.bytes_in_use);
    assert_eq!(reserved, usage.bytes_reserved);
    assert_eq!(reserved, storage.live_bytes());
    assert!(report.iter().any(|r| r.kind == PoolKind::Dedicated && r.pages == 1));
    let last: &PoolReport = report.last().unwrap();
    assert_eq!(last.kind, PoolKind::Persistent);
    assert_eq!(last.to_string(), "persistent pages=1 in_use=5000");
    drop((small, big, weights, once));
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn usage_combine_and_display() {
    let a = usage(1, 10, 100);
    let b = usage(2, 20, 200);
    assert_eq!(a.combine(b), usage(3, 30, 300));
    assert_eq!(usage(16, 8_388_992, 8_515_072).to_string(), "allocs=16  in_use=  8388992 reserved=  8515072");
}
