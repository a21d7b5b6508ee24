//! How a host thread best learns that a small NCCL call ended, measured
//! with raw cudarc only (no cohort in the timed loops): a one-rank
//! all-reduce of 32 B waited on by `cuStreamSynchronize`, by spinning on
//! `cuStreamQuery`, on `cuEventQuery` after an event recorded behind the
//! call, and on a host-mapped word the GPU writes behind the call
//! (`cuStreamWriteValue32`); and what each of those driver calls costs on
//! its own. The ways alternate round by round; medians of the rounds.
//!
//! Run (CUDA GPU, libnccl): `cargo run --release --features cuda --example wait_probe -- [CALLS]`

use std::time::Instant;

use cohort::comm::op::Collective::AllReduce;
use cohort::runtime::backend::cuda::cudarc;
use cudarc::driver::sys;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/raw_nccl.rs"]
mod raw_nccl;
use bench::median;
use raw_nccl::ok;

const ROUNDS: usize = 9;

/// A 4-byte word in pinned host memory that the GPU can write.
struct HostWord {
    host: *mut u32,
    device: sys::CUdeviceptr,
}

impl HostWord {
    fn new() -> Result<Self, String> {
        let mut host = std::ptr::null_mut();
        // SAFETY: a fresh pinned, device-mapped allocation of 4 bytes in
        // the current context; its device address asked for next.
        unsafe {
            ok(sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")?;
            host.cast::<u32>().write_volatile(0);
            let mut device = 0;
            ok(sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0), "cuMemHostGetDevicePointer")?;
            Ok(Self { host: host.cast(), device })
        }
    }

    fn read(&self) -> u32 {
        // SAFETY: our live pinned word; the GPU writes it whole.
        unsafe { self.host.read_volatile() }
    }
}

fn main() -> Result<(), String> {
    let calls: usize = std::env::args().nth(1).map_or(5000, |a| a.parse().expect("CALLS is a number"));
    // SAFETY: initializes the driver API; no other effect.
    ok(unsafe { sys::cuInit(0) }, "cuInit")?;
    let raw = raw_nccl::Raw::new(1, 32, false)?;
    let stream = raw.streams[0];
    let mut event = std::ptr::null_mut();
    // SAFETY: a fresh event in the current context (made so by `Raw::new`).
    ok(unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "event")?;
    let word = HostWord::new()?;
    let mut seq = 0u32;

    let per_call = |start: Instant, n: usize| start.elapsed().as_secs_f64() * 1e6 / n as f64;
    let spin_stream = || loop {
        // SAFETY: our live stream.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => break,
            sys::CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            other => panic!("cuStreamQuery: {other:?}"),
        }
    };
    let all_reduce = || raw.queue(AllReduce, 32).expect("all-reduce");

    let mut ways: Vec<(&str, Vec<f64>)> = [
        "cuStreamSynchronize",
        "cuStreamQuery spin",
        "cuEventRecord + cuEventQuery spin",
        "cuStreamWriteValue32 + host word spin",
    ]
    .into_iter()
    .map(|w| (w, Vec::new()))
    .collect();
    for round in 0..=ROUNDS {
        let mut times = [0.0; 4];
        let start = Instant::now();
        for _ in 0..calls {
            all_reduce();
            // SAFETY: our live stream.
            ok(unsafe { sys::cuStreamSynchronize(stream) }, "sync")?;
        }
        times[0] = per_call(start, calls);
        let start = Instant::now();
        for _ in 0..calls {
            all_reduce();
            spin_stream();
        }
        times[1] = per_call(start, calls);
        let start = Instant::now();
        for _ in 0..calls {
            all_reduce();
            // SAFETY: our event and stream.
            ok(unsafe { sys::cuEventRecord(event, stream) }, "record")?;
            loop {
                // SAFETY: our event, recorded just above.
                match unsafe { sys::cuEventQuery(event) } {
                    sys::CUresult::CUDA_SUCCESS => break,
                    sys::CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
                    other => panic!("cuEventQuery: {other:?}"),
                }
            }
        }
        times[2] = per_call(start, calls);
        let start = Instant::now();
        for _ in 0..calls {
            all_reduce();
            seq = seq.wrapping_add(1);
            // SAFETY: our live stream and the word's device address.
            ok(unsafe { sys::cuStreamWriteValue32_v2(stream, word.device, seq, 0) }, "write value")?;
            while word.read() != seq {
                std::hint::spin_loop();
            }
        }
        times[3] = per_call(start, calls);
        if round > 0 {
            for (way, t) in ways.iter_mut().zip(times) {
                way.1.push(t);
            }
        }
    }
    println!("one-rank NCCL all-reduce of 32 B, waited, µs per call (median of {ROUNDS} rounds, {calls} calls each):");
    for (way, times) in ways.iter_mut() {
        let m = median(times);
        println!("  {way:<42} {m:>7.2}   (rounds {:.2}–{:.2})", times[0], times[times.len() - 1]);
    }

    // Each driver call on its own, on an idle stream.
    let alone = |what: &str, f: &mut dyn FnMut()| {
        let mut rounds: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..calls {
                    f();
                }
                let t = per_call(start, calls);
                spin_stream();
                t
            })
            .collect();
        println!("  {what:<42} {:>7.3}", median(&mut rounds));
    };
    println!("each call alone, µs:");
    // SAFETY (each closure): our live stream, event and word.
    alone("cuStreamQuery, idle stream", &mut || unsafe {
        sys::cuStreamQuery(stream);
    });
    alone("cuEventQuery, completed event", &mut || unsafe {
        sys::cuEventQuery(event);
    });
    alone("cuEventRecord", &mut || unsafe {
        sys::cuEventRecord(event, stream);
    });
    alone("cuStreamWriteValue32", &mut || unsafe {
        seq = seq.wrapping_add(1);
        sys::cuStreamWriteValue32_v2(stream, word.device, seq, 0);
    });
    alone("host word read", &mut || {
        std::hint::black_box(word.read());
    });
    Ok(())
}
