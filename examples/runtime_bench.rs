//! Runtime micro-benchmarks, each beside a baseline measured in the same run:
//! pool alloc+free against the system allocator, and the round trip of
//! `submit` / `submit_blocking` against a bare channel ping-pong.
//!
//! Run: `cargo run --release --example runtime_bench`

use std::hint::black_box;
use std::time::{Duration, Instant};

use cohort::prelude::*;
use cohort::runtime::memory::{AllocationMode, MemoryPools, MemoryPoolsConfig, PageId, PageStorage};

/// Page storage backed by the system allocator, as the CPU backend's is.
#[derive(Default)]
struct SystemPages {
    pages: std::collections::HashMap<u64, Vec<u8>>,
    next: u64,
}

impl PageStorage for SystemPages {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        self.next += 1;
        self.pages.insert(self.next, vec![0u8; size as usize]);
        Ok(PageId(self.next))
    }
    fn free_page(&mut self, page: PageId) {
        self.pages.remove(&page.0);
    }
    fn alignment(&self) -> u64 {
        256
    }
}

fn per_op(iters: u32, f: impl FnMut()) -> Duration {
    let mut f = f;
    for _ in 0..iters / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed() / iters
}

fn row(what: &str, ours: Duration, baseline_name: &str, baseline: Duration) {
    println!(
        "{what:<38} {:>10.3} µs   {baseline_name:<28} {:>10.3} µs   ratio {:>6.2}x",
        ours.as_secs_f64() * 1e6,
        baseline.as_secs_f64() * 1e6,
        ours.as_secs_f64() / baseline.as_secs_f64()
    );
}

fn main() -> Result<(), ServerError> {
    println!(
        "cohort runtime_bench on the cpu backend ({} host threads)",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("{:<38} {:>13}   {:<28} {:>13}", "measure", "cohort", "baseline", "baseline");
    let mut storage = SystemPages::default();
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).expect("default layout");
    for size in [1024u64, 1 << 20] {
        let warm = pools.reserve(&mut storage, size, AllocationMode::Auto)?;
        drop(warm);
        let iters = 2_000_000;
        let pool = per_op(iters, || {
            let slice = pools.reserve(&mut storage, size, AllocationMode::Auto).expect("reserve");
            drop(black_box(slice));
        });
        let system = per_op(iters, || {
            let buffer: Vec<u8> = Vec::with_capacity(size as usize);
            drop(black_box(buffer));
        });
        row(&format!("pool alloc+free (hit), {size} B"), pool, "system allocator", system);
        let goal = if pool < Duration::from_nanos(200) { "met" } else { "MISSED" };
        println!("  goal: pool hit under 0.2 µs — {goal}");
    }

    let client = CpuRuntime::client(0)?;
    let (ping_tx, ping_rx) = crossbeam::channel::unbounded::<crossbeam::channel::Sender<()>>();
    let echo = std::thread::spawn(move || {
        while let Ok(reply) = ping_rx.recv() {
            let _ = reply.send(());
        }
    });
    let channel_round_trip = per_op(50_000, || {
        let (tx, rx) = crossbeam::channel::bounded(1);
        ping_tx.send(tx).unwrap();
        rx.recv().unwrap();
    });
    let blocking = per_op(50_000, || {
        black_box(client.submit_blocking(|_| 1u32).unwrap());
    });
    row("submit_blocking round trip", blocking, "bare channel ping-pong", channel_round_trip);
    let submit = per_op(200_000, || client.submit(|_| {}).unwrap());
    let channel_send = {
        let (tx, rx) = crossbeam::channel::unbounded::<Box<dyn FnOnce() + Send>>();
        let drain = std::thread::spawn(move || {
            while let Ok(f) = rx.recv() {
                f()
            }
        });
        let d = per_op(200_000, || tx.send(Box::new(|| {})).unwrap());
        drop(tx);
        drain.join().unwrap();
        d
    };
    row("submit (enqueue, no wait)", submit, "bare boxed-closure send", channel_send);
    client.sync()?;
    // Launch throughput: N launches of a no-op kernel, then one sync; the
    // device thread's bookkeeping per launch is what this measures.
    let noop = Kernel::new("noop").with_cpu(|_| {});
    let target = client.empty(256);
    let launches = 100_000u32;
    let start = Instant::now();
    for _ in 0..launches {
        client.launch(&noop, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&target))?;
    }
    client.sync()?;
    let per_launch = start.elapsed() / launches;
    row("launch + run, no-op kernel (per launch)", per_launch, "bare boxed-closure send", channel_send);
    let create = per_op(100_000, || drop(black_box(client.empty(1024))));
    row(
        "client.empty(1 KiB) + drop (enqueue)",
        create,
        "system allocator 1 KiB",
        per_op(100_000, || drop(black_box(Vec::<u8>::with_capacity(1024)))),
    );
    let read = per_op(20_000, || {
        let h = client.empty(4);
        black_box(client.read_one(h).unwrap());
    });
    row("4-byte create+read round trip", read, "bare channel ping-pong", channel_round_trip);
    drop(ping_tx);
    echo.join().unwrap();
    cohort::runtime::shutdown();
    Ok(())
}
