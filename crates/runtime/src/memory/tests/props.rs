//! Properties that must hold at every step: exact accounting, no overlap,
//! alignment, pages freed exactly once; layout validation; reconfiguration;
//! the page reuse of a reserve/drop cycle.

use std::collections::HashMap;

use super::fake::FakeStorage;
use crate::error::MemoryConfigError;
use crate::memory::{AllocationMode, Cleanup, MemoryPools, MemoryPoolsConfig, PoolConfig, SliceHandle, MAX_POOLS, MIB};

/// xorshift64*, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Accounting matches the live handles, reserved bytes match the storage, and
/// live slices are aligned, inside their page and disjoint.
fn check(pools: &MemoryPools, storage: &FakeStorage, live: &[SliceHandle]) {
    let usage = pools.usage();
    assert_eq!(usage.allocations, live.len() as u64);
    assert_eq!(usage.bytes_in_use, live.iter().map(SliceHandle::size).sum::<u64>());
    assert_eq!(usage.bytes_reserved, storage.live_bytes());
    let mut by_page: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    for h in live {
        assert_eq!(h.offset() % storage.align, 0, "misaligned slice {h:?}");
        assert!(h.offset() + h.size() <= storage.page_size(h.page()), "slice past its page {h:?}");
        by_page.entry(h.page().0).or_default().push((h.offset(), h.size().max(1)));
    }
    for slices in by_page.values_mut() {
        slices.sort_unstable();
        for w in slices.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlapping slices {w:?}");
        }
    }
}

fn random_size(rng: &mut Rng) -> u64 {
    match rng.below(20) {
        0 => 0,
        1..=11 => 1 + rng.below(64 * 1024),
        12..=17 => 1 + rng.below(3 * MIB),
        18 => 1 + rng.below(40 * MIB),
        _ => rng.below(2) * 64 * 1024 + 1, // just past / at the sliced limit
    }
}

fn random_run(config: &MemoryPoolsConfig, align: u64, seed: u64, steps: usize) {
    let mut rng = Rng(seed);
    let mut storage = FakeStorage::new(align);
    let mut pools = MemoryPools::new(config).unwrap();
    let mut live: Vec<SliceHandle> = Vec::new();
    for step in 0..steps {
        match rng.below(100) {
            0..=54 => {
                let mode = match rng.below(20) {
                    0 => AllocationMode::Persistent,
                    1 => AllocationMode::Dedicated,
                    _ => AllocationMode::Auto,
                };
                let size = random_size(&mut rng);
                let h = pools.reserve(&mut storage, size, mode).unwrap();
                assert_eq!(h.size(), size);
                // A clone keeps the slice live; the pool sees one user.
                if rng.below(4) == 0 {
                    live.push(h.clone());
                }
                live.push(h);
            }
            55..=95 => {
                if !live.is_empty() {
                    let i = rng.below(live.len() as u64) as usize;
                    let h = live.swap_remove(i);
                    // Drop every clone of this slice.
                    live.retain(|o| !o.same_slice(&h));
                }
            }
            96..=97 => pools.cleanup(&mut storage, Cleanup::Periodic),
            _ => pools.cleanup(&mut storage, Cleanup::Explicit),
        }
        let mut unique: Vec<SliceHandle> = Vec::new();
        for h in &live {
            if !unique.iter().any(|u| u.same_slice(h)) {
                unique.push(h.clone());
            }
        }
        check(&pools, &storage, &unique);
        assert_eq!(pools.is_quiescent(), live.is_empty(), "step {step}");
    }
    live.clear();
    assert!(pools.is_quiescent());
    pools.cleanup(&mut storage, Cleanup::Explicit);
    assert_eq!(pools.usage().bytes_reserved, 0);
    assert!(pools.report().iter().all(|r| r.pages == 0 && r.bytes_reserved == 0));
    storage.assert_all_freed();
}

#[test]
fn accounting_overlap_and_frees_default_layout() {
    for seed in 1..=4 {
        random_run(&MemoryPoolsConfig::default(), 256, seed * 7919, 3000);
    }
}

#[test]
fn accounting_overlap_and_frees_custom_layouts() {
    let layouts = [
        vec![
            PoolConfig::Sliced { page_size: MIB, max_slice_size: 4096 },
            PoolConfig::Exclusive { max_alloc_size: MIB },
            PoolConfig::Adaptive { page_size: MIB, max_page_size: 16 * MIB },
        ],
        vec![
            PoolConfig::Sliced { page_size: 1_000_003, max_slice_size: 1_000_003 },
            PoolConfig::Exclusive { max_alloc_size: 0 },
        ],
        vec![PoolConfig::Adaptive { page_size: 1, max_page_size: 8 * MIB }],
    ];
    for (i, pools) in layouts.into_iter().enumerate() {
        let config = MemoryPoolsConfig { pools };
        random_run(&config, 256, 17 + i as u64, 2000);
        random_run(&config, 4, 91 + i as u64, 2000);
    }
}

#[test]
fn carved_pages_cover_without_gaps_and_merge_free_neighbours() {
    let mut rng = Rng(42);
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let mut live = Vec::new();
    for _ in 0..5000 {
        if rng.below(3) < 2 || live.is_empty() {
            let size = if rng.below(2) == 0 { 1 + rng.below(64 * 1024) } else { 64 * 1024 + rng.below(MIB) };
            live.push(pools.reserve(&mut storage, size, AllocationMode::Auto).unwrap());
        } else {
            let i = rng.below(live.len() as u64) as usize;
            live.swap_remove(i);
        }
    }
    pools.cleanup(&mut storage, Cleanup::Periodic);
    let sliced = pools.test_sliced(1).pages();
    assert!(sliced.page_count() > 0);
    let adaptive: Vec<_> = pools.test_adaptive(2).pages().collect();
    assert!(adaptive[0].page_count() > 0);
    for page in adaptive.into_iter().chain([sliced]).flat_map(|set| &set.pages) {
        let layout = page.layout();
        let mut end = 0;
        for (k, &(offset, len, used)) in layout.iter().enumerate() {
            assert_eq!(offset, end, "gap or overlap in {layout:?}");
            assert!(len > 0);
            end = offset + len;
            if k > 0 && !used {
                assert!(layout[k - 1].2, "two adjacent free slots");
            }
        }
        assert_eq!(end, page.size);
    }
    drop(live);
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn pools_and_handles_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<MemoryPools>();
    send_sync::<SliceHandle>();
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let h = pools.reserve(&mut storage, 1000, AllocationMode::Auto).unwrap();
    std::thread::spawn(move || drop(h)).join().unwrap();
    assert!(pools.is_quiescent());
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

#[test]
fn validate_reports_each_problem() {
    let v = |pools: Vec<PoolConfig>| MemoryPoolsConfig { pools }.validate();
    assert_eq!(MemoryPoolsConfig::default().validate(), Ok(()));
    assert_eq!(v(vec![]), Err(MemoryConfigError::Empty));
    let many = vec![PoolConfig::Exclusive { max_alloc_size: 1 }; MAX_POOLS + 1];
    assert_eq!(v(many), Err(MemoryConfigError::TooManyPools { count: MAX_POOLS + 1, max: MAX_POOLS }));
    assert_eq!(
        v(vec![PoolConfig::Exclusive { max_alloc_size: 0 }, PoolConfig::Sliced { page_size: 0, max_slice_size: 0 }]),
        Err(MemoryConfigError::ZeroPageSize { index: 1 })
    );
    assert_eq!(
        v(vec![PoolConfig::Adaptive { page_size: 0, max_page_size: 10 }]),
        Err(MemoryConfigError::ZeroPageSize { index: 0 })
    );
    assert_eq!(
        v(vec![PoolConfig::Sliced { page_size: 100, max_slice_size: 101 }]),
        Err(MemoryConfigError::SliceLargerThanPage { index: 0, max_slice_size: 101, page_size: 100 })
    );
    assert_eq!(
        v(vec![PoolConfig::Adaptive { page_size: 100, max_page_size: 99 }]),
        Err(MemoryConfigError::CapSmallerThanPage { index: 0, max_page_size: 99, page_size: 100 })
    );
    assert!(MemoryPools::new(&MemoryPoolsConfig { pools: vec![] }).is_err());
}

#[test]
fn reconfigure_only_when_quiescent() {
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let new = MemoryPoolsConfig { pools: vec![PoolConfig::Sliced { page_size: 4 * MIB, max_slice_size: 4 * MIB }] };
    let h = pools.reserve(&mut storage, 1000, AllocationMode::Auto).unwrap();
    let weights = pools.reserve(&mut storage, 5000, AllocationMode::Persistent).unwrap();

    assert_eq!(pools.reconfigure(&mut storage, &new), Ok(false));
    assert_eq!(pools.config(), &MemoryPoolsConfig::default());
    assert_eq!(storage.frees, 0);

    let bad = MemoryPoolsConfig { pools: vec![] };
    assert_eq!(pools.reconfigure(&mut storage, &bad), Err(MemoryConfigError::Empty));

    drop(h);
    // A live persistent slice does not block: the persistent pool is kept.
    assert_eq!(pools.reconfigure(&mut storage, &new), Ok(true));
    assert_eq!(pools.config(), &new);
    assert_eq!(storage.frees, 1, "the old sliced page was given back");
    assert_eq!(pools.usage().bytes_reserved, 5000);
    assert_eq!(pools.report().len(), 2);

    let h = pools.reserve(&mut storage, 3 * MIB, AllocationMode::Auto).unwrap();
    assert_eq!(storage.page_size(h.page()), 4 * MIB);
    drop((h, weights));
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}

/// `n` reserve/drop cycles of `size` bytes; the pages they landed on.
fn cycle(pools: &mut MemoryPools, storage: &mut FakeStorage, size: u64, n: u32) -> std::collections::BTreeSet<u64> {
    let mut pages = std::collections::BTreeSet::new();
    for _ in 0..n {
        let h = pools.reserve(storage, size, AllocationMode::Auto).unwrap();
        pages.insert(h.page().0);
    }
    pages
}

/// A reserve/drop cycle on a page that already has room reuses it: no page
/// is allocated, however many cycles run, and each size keeps landing on
/// the same page. (How fast a cycle is, is the benchmarks' business.)
#[test]
fn reserve_drop_cycle_on_an_existing_page_allocates_nothing() {
    let mut storage = FakeStorage::new(256);
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    // Long-lived neighbours: a full sliced page of 4 KiB slices but one, and
    // some adaptive slices.
    let mut keep: Vec<_> =
        (0..2048).map(|_| pools.reserve(&mut storage, 4096, AllocationMode::Auto).unwrap()).collect();
    keep.swap_remove(1000);
    keep.extend((0..3).map(|_| pools.reserve(&mut storage, 300 * 1024, AllocationMode::Auto).unwrap()));
    let pages = storage.allocs;
    for (size, what) in [(4096, "sliced 4 KiB"), (100, "sliced 100 B"), (256 * 1024, "adaptive 256 KiB")] {
        let first = cycle(&mut pools, &mut storage, size, 1);
        let landed = cycle(&mut pools, &mut storage, size, 20_000);
        assert_eq!(landed, first, "every reserve+drop of {what} lands on the page of the first");
    }
    assert_eq!(storage.allocs, pages, "the cycles allocated no page");
    drop(keep);
    pools.cleanup(&mut storage, Cleanup::Explicit);
    storage.assert_all_freed();
}
