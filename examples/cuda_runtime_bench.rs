//! The CUDA backend against raw cudarc doing the same work, in one run:
//! launch enqueue per kernel, a 4-byte read round trip, pool alloc+free
//! against the driver's allocation, 256 MiB upload and read bandwidth against
//! raw pinned copies, and graph replay per kernel. Each figure is the median
//! of several timed rounds after a warm-up; for launches and reads, cohort's
//! rounds and raw's alternate.
//!
//! Run (on a machine with a CUDA GPU):
//! `cargo run --release --example cuda_runtime_bench`

use std::time::{Duration, Instant};

use cohort::runtime::backend::cuda::cudarc;
use cohort::runtime::conformance::kernels;
use cohort::runtime::memory::{AllocationMode, MemoryPools, MemoryPoolsConfig, PageId, PageStorage};
use cohort::runtime::stages;
use cohort::runtime::{Bytes, CudaRuntime, GridCount, KernelArguments, Runtime, Scalar, ServerError, StreamId};
use cudarc::driver::sys;

#[path = "support/raw_cuda.rs"]
mod raw_cuda;
use raw_cuda::{ok, Raw};

const ROUNDS: usize = 7;
const MIB: usize = 1 << 20;

/// Median over `ROUNDS` rounds of `f`, which returns the time of one round.
fn median(mut f: impl FnMut() -> Duration) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..ROUNDS).map(|_| f()).collect();
    times.sort();
    times[ROUNDS / 2]
}

/// The medians over `ROUNDS` rounds of `cohort` and `raw`, run alternately
/// round by round (which goes first alternating too), so that a drift of
/// the machine reaches both alike.
fn paired(mut cohort: impl FnMut() -> Duration, mut raw: impl FnMut() -> Duration) -> (Duration, Duration) {
    cohort();
    raw();
    let (mut c, mut r) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            c.push(cohort());
            r.push(raw());
        } else {
            r.push(raw());
            c.push(cohort());
        }
    }
    c.sort();
    r.sort();
    (c[ROUNDS / 2], r[ROUNDS / 2])
}

struct Row {
    what: &'static str,
    unit: &'static str,
    cohort: f64,
    raw: f64,
    goal: &'static str,
    met: bool,
}

fn micros(d: Duration, per: usize) -> f64 {
    d.as_secs_f64() * 1e6 / per as f64
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn alloc(bytes: usize) -> sys::CUdeviceptr {
    let mut ptr = 0;
    // SAFETY: context current on this thread.
    ok(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc");
    ptr
}

fn pinned(bytes: usize) -> *mut u8 {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: context current on this thread.
    ok(unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 0) }, "cuMemHostAlloc");
    ptr.cast()
}

/// Device pages straight from the driver, for the in-thread pool figure.
#[derive(Default)]
struct DriverPages(std::collections::HashMap<u64, sys::CUdeviceptr>, u64);

impl PageStorage for DriverPages {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        self.1 += 1;
        self.0.insert(self.1, alloc(size as usize));
        Ok(PageId(self.1))
    }
    fn free_page(&mut self, page: PageId) {
        if let Some(ptr) = self.0.remove(&page.0) {
            // SAFETY: allocated by alloc_page, freed once.
            unsafe { sys::cuMemFree_v2(ptr) };
        }
    }
    fn alignment(&self) -> u64 {
        256
    }
}

fn main() -> Result<(), ServerError> {
    let client = CudaRuntime::client(0)?.with_stream(StreamId::fresh());
    let p = client.properties().clone();
    println!(
        "cohort cuda_runtime_bench on {} (cc {:?}, {} SMs)",
        p.name,
        p.compute_capability.unwrap_or_default(),
        p.compute_units
    );
    let scale = kernels::scale();
    let raw = Raw::new(scale.cuda_source().unwrap());
    let mut rows = Vec::new();

    // Launch enqueue per kernel: N tiny launches, then one sync (so the
    // GPU's pace counts too); and the caller's time alone for a batch
    // short enough that the driver's queue never fills.
    let n = 20_000;
    let x = client.create(Bytes::from_elems(&[1.0f32; 256]));
    let rx = alloc(1024);
    let cohort_launches = |count: usize| {
        let t = Instant::now();
        for _ in 0..count {
            client
                .launch(&scale, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0)))
                .unwrap();
        }
        t.elapsed()
    };
    let raw_launches = |count: usize| {
        let t = Instant::now();
        for _ in 0..count {
            raw.launch(rx, 1024, raw.stream);
        }
        t.elapsed()
    };
    let (cohort_launch, raw_launch) = paired(
        || {
            let t = Instant::now();
            cohort_launches(n);
            client.sync().unwrap();
            t.elapsed()
        },
        || {
            let t = Instant::now();
            raw_launches(n);
            raw.sync();
            t.elapsed()
        },
    );
    let (c, r) = (micros(cohort_launch, n), micros(raw_launch, n));
    rows.push(Row {
        what: "launch enqueue per kernel",
        unit: "µs",
        cohort: c,
        raw: r,
        goal: "≤ 1.1× raw",
        met: c <= 1.1 * r,
    });
    let short = 500;
    let (cohort_host, raw_host) = paired(
        || {
            let t = cohort_launches(short);
            client.sync().unwrap();
            t
        },
        || {
            let t = raw_launches(short);
            raw.sync();
            t
        },
    );
    let (c, r) = (micros(cohort_host, short), micros(raw_host, short));
    rows.push(Row {
        what: "launch, caller's time (500, unwaited)",
        unit: "µs",
        cohort: c,
        raw: r,
        goal: "",
        met: true,
    });
    if stages::ENABLED {
        // Where a launch's time goes on the caller's thread
        // (`--features stage-clock`; each mark adds ~50 ns to its stage).
        stages::reset();
        for _ in 0..20 {
            for _ in 0..short {
                stages::start();
                client
                    .launch(
                        &scale,
                        GridCount::Static(1, 1, 1),
                        KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0)),
                    )
                    .unwrap();
                stages::stop();
            }
            client.sync().unwrap();
        }
        println!("stages of a launch (20 × {short}, each batch waited, untimed):");
        print!("{}", stages::table(20 * short as u64));
    }

    // 4-byte read round trip.
    let n = 2_000;
    let four = client.create(Bytes::from_elems(&[7u32]));
    let host = pinned(4);
    let (cohort_read, raw_read) = paired(
        || {
            let t = Instant::now();
            for _ in 0..n {
                std::hint::black_box(client.read_one(four.clone()).unwrap());
            }
            t.elapsed()
        },
        || {
            let t = Instant::now();
            for _ in 0..n {
                // SAFETY: 4 pinned bytes, a live device buffer and stream.
                ok(unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), rx, 4, raw.stream) }, "dtoh");
                raw.sync();
            }
            t.elapsed()
        },
    );
    let (c, r) = (micros(cohort_read, n), micros(raw_read, n));
    rows.push(Row {
        what: "4-byte read round trip",
        unit: "µs",
        cohort: c,
        raw: r,
        goal: "≤ 1.25× raw",
        met: c <= 1.25 * r,
    });

    // Pool alloc+free against the driver's allocation (1 MiB).
    let n = 20_000;
    let cohort_alloc = median(|| {
        let t = Instant::now();
        for _ in 0..n {
            drop(std::hint::black_box(client.empty(MIB)));
        }
        client.sync().unwrap();
        t.elapsed()
    });
    let mut pages = DriverPages::default();
    let mut pools = MemoryPools::new(&MemoryPoolsConfig::default()).unwrap();
    let pool_hit = median(|| {
        let t = Instant::now();
        for _ in 0..n {
            drop(std::hint::black_box(pools.reserve(&mut pages, MIB as u64, AllocationMode::Auto).unwrap()));
        }
        t.elapsed()
    });
    let driver_alloc = median(|| {
        let t = Instant::now();
        for _ in 0..n / 10 {
            // SAFETY: freeing what was just allocated.
            unsafe { sys::cuMemFree_v2(alloc(MIB)) };
        }
        t.elapsed()
    });
    let (c, h, r) = (micros(cohort_alloc, n), micros(pool_hit, n), micros(driver_alloc, n / 10));
    rows.push(Row { what: "alloc+free 1 MiB, client (queued)", unit: "µs", cohort: c, raw: r, goal: "", met: c < r });
    rows.push(Row {
        what: "alloc+free 1 MiB, pool hit",
        unit: "µs",
        cohort: h,
        raw: r,
        goal: "≤ 0.5 µs",
        met: h <= 0.5,
    });

    // 256 MiB upload and read.
    let size = 256 * MIB;
    let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    let big = client.empty(size);
    let upload = median(|| {
        let mut staged = vec![Bytes::from_slice(&data)];
        client.staging(staged.iter_mut());
        let staged = staged.pop().unwrap();
        assert!(staged.is_backend_memory());
        client.sync().unwrap();
        let t = Instant::now();
        client.write(&big, staged).unwrap();
        client.sync().unwrap();
        t.elapsed()
    });
    let pageable_upload = median(|| {
        let bytes = Bytes::from_slice(&data);
        client.sync().unwrap();
        let t = Instant::now();
        client.write(&big, bytes).unwrap();
        client.sync().unwrap();
        t.elapsed()
    });
    let read = median(|| {
        let t = Instant::now();
        let bytes = client.read_one(big.clone()).unwrap();
        let elapsed = t.elapsed();
        assert_eq!(bytes[size - 1], data[size - 1]);
        elapsed
    });
    let dbig = alloc(size);
    let hbig = pinned(size);
    let raw_up = median(|| {
        let t = Instant::now();
        // SAFETY: pinned and device buffers of `size` bytes.
        ok(unsafe { sys::cuMemcpyHtoDAsync_v2(dbig, hbig.cast(), size, raw.stream) }, "htod");
        raw.sync();
        t.elapsed()
    });
    // The driver's own staging of pageable memory, from the same bytes.
    let raw_pageable_up = median(|| {
        let t = Instant::now();
        // SAFETY: `data` holds `size` bytes; from pageable memory the copy is
        // staged by the driver before the call returns.
        ok(unsafe { sys::cuMemcpyHtoDAsync_v2(dbig, data.as_ptr().cast(), size, raw.stream) }, "htod pageable");
        raw.sync();
        t.elapsed()
    });
    let raw_down = median(|| {
        let t = Instant::now();
        // SAFETY: as above.
        ok(unsafe { sys::cuMemcpyDtoHAsync_v2(hbig.cast(), dbig, size, raw.stream) }, "dtoh");
        raw.sync();
        t.elapsed()
    });
    let (c, r) = (gbps(size, upload), gbps(size, raw_up));
    rows.push(Row {
        what: "256 MiB upload (staged)",
        unit: "GB/s",
        cohort: c,
        raw: r,
        goal: "≥ 0.9× raw",
        met: c >= 0.9 * r,
    });
    let c = gbps(size, pageable_upload);
    let rp = gbps(size, raw_pageable_up);
    rows.push(Row {
        what: "256 MiB upload (pageable)",
        unit: "GB/s",
        cohort: c,
        raw: rp,
        goal: "≥ 0.9× raw pageable",
        met: c >= 0.9 * rp,
    });
    let (c, r) = (gbps(size, read), gbps(size, raw_down));
    rows.push(Row { what: "256 MiB read", unit: "GB/s", cohort: c, raw: r, goal: "≥ 0.9× raw", met: c >= 0.9 * r });

    // Graph replay per kernel: 100 launches captured, replayed 200 times.
    let (k, n) = (100, 200);
    let gclient = client.with_stream(StreamId::fresh());
    let gx = gclient.create(Bytes::from_elems(&[1.0f32; 256]));
    let capture = || {
        for _ in 0..k {
            gclient
                .launch(&scale, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&gx).scalar(Scalar::F32(1.0)))
                .unwrap();
        }
    };
    gclient.graph_prepare().unwrap();
    capture();
    gclient.sync().unwrap();
    gclient.start_capture().unwrap();
    capture();
    let graph = gclient.stop_capture().unwrap();
    let cohort_graph = median(|| {
        let t = Instant::now();
        for _ in 0..n {
            graph.replay().unwrap();
        }
        gclient.sync().unwrap();
        t.elapsed()
    });
    // SAFETY (whole block): capture of launches on our own stream, then an
    // instantiated graph launched on it; results checked.
    let raw_graph = unsafe {
        ok(sys::cuStreamBeginCapture_v2(raw.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED), "begin");
        for _ in 0..k {
            raw.launch(rx, 1024, raw.stream);
        }
        let mut g = std::ptr::null_mut();
        ok(sys::cuStreamEndCapture(raw.stream, &mut g), "end");
        let mut exec = std::ptr::null_mut();
        ok(sys::cuGraphInstantiateWithFlags(&mut exec, g, 0), "instantiate");
        median(|| {
            let t = Instant::now();
            for _ in 0..n {
                ok(sys::cuGraphLaunch(exec, raw.stream), "graph launch");
            }
            raw.sync();
            t.elapsed()
        })
    };
    let (c, r) = (micros(cohort_graph, n * k), micros(raw_graph, n * k));
    rows.push(Row {
        what: "graph replay per kernel",
        unit: "µs",
        cohort: c,
        raw: r,
        goal: "≤ 1.2× raw",
        met: c <= 1.2 * r,
    });

    println!("{:<36} {:>12} {:>12} {:>8}   goal", "measure", "cohort", "raw cudarc", "ratio");
    for row in &rows {
        println!(
            "{:<36} {:>7.3} {:<4} {:>7.3} {:<4} {:>7.2}x   {} {}",
            row.what,
            row.cohort,
            row.unit,
            row.raw,
            row.unit,
            row.cohort / row.raw,
            row.goal,
            if row.goal.is_empty() {
                ""
            } else if row.met {
                "met"
            } else {
                "MISSED"
            }
        );
    }
    Ok(())
}
