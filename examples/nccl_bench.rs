//! nccl-tests' all-reduce table for a CUDA `ClientGroup`, beside raw NCCL
//! called through cudarc in the same binary on the same devices.
//!
//! Run (on a machine with CUDA GPUs and libnccl):
//! `cargo run --release --example nccl_bench -- --backend cuda -b 8 -e 256M -f 2`
//! (`--devices 1` for one device, `-d half`, `-o avg`, ...). A group of one
//! device takes device copies, not NCCL; `COHORT_NCCL_SINGLE=1` sends it
//! through a one-rank NCCL communicator instead.
//!
//! Columns: `size` in bytes, `call` the host time of one `all_reduce` call
//! (it returns once its parts are queued), `time` the mean of `-n`
//! iterations in µs after `-w` warm-ups (host clock around the iterations,
//! then a sync), `algbw =
//! size / time`, `busbw = algbw × 2(n-1)/n` (nccl-tests' all-reduce factor:
//! 0 for one device), for cohort and for raw NCCL, and `ratio` = cohort's
//! busbw / raw NCCL's (algbw's on one device, where busbw is 0). `#wrong`
//! counts elements of member 0's result that differ from `n × 1` (float
//! sum of ones; `-c 0` skips the check).
//!
//! The raw baseline calls cudarc's NCCL bindings, which load `libnccl.so`:
//! where only `libnccl.so.2` is installed (the pip wheel), put a
//! `libnccl.so` link to it on `LD_LIBRARY_PATH`, or the baseline is skipped.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cohort::comm::{ClientGroup, DType, ReduceOp};
use cohort::prelude::*;
use cohort::runtime::backend::cuda::{cudarc, nccl_version};
use cohort::runtime::CudaRuntime;
use cudarc::driver::sys;
use cudarc::nccl::sys as nccl;

#[derive(Parser, Debug)]
#[command(about = "all-reduce over NCCL: cohort's ClientGroup beside raw NCCL through cudarc")]
struct Args {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    step_factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: u32,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u32,
    /// Backend: cuda.
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Devices to use (default: all).
    #[arg(long)]
    devices: Option<usize>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let (digits, scale) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 1 << 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 1 << 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().map(|v| v * scale).map_err(|e| format!("{text:?} is not a size: {e}"))
}

fn ok(code: sys::CUresult, what: &str) -> Result<(), String> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}"))
    }
}

fn nok(code: nccl::ncclResult_t, what: &str) -> Result<(), String> {
    if code == nccl::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}"))
    }
}

/// Raw NCCL on `n` devices from this thread: one communicator each
/// (`ncclCommInitAll`), a stream and two buffers each in the device's
/// primary context.
struct Raw {
    ctxs: Vec<sys::CUcontext>,
    comms: Vec<nccl::ncclComm_t>,
    streams: Vec<sys::CUstream>,
    bufs: Vec<(sys::CUdeviceptr, sys::CUdeviceptr)>,
}

impl Raw {
    fn new(n: usize, bytes: usize) -> Result<Raw, String> {
        // SAFETY: probing only tries to dlopen cudarc's candidate names.
        if !unsafe { nccl::is_culib_present() } {
            return Err("cudarc finds no libnccl.so (link libnccl.so.2 as libnccl.so on LD_LIBRARY_PATH)".into());
        }
        let mut raw =
            Raw { ctxs: Vec::new(), comms: vec![std::ptr::null_mut(); n], streams: Vec::new(), bufs: Vec::new() };
        // SAFETY (whole block): plain driver and NCCL calls on primary
        // contexts retained here, each made current before its device's
        // calls; every result is checked.
        unsafe {
            for i in 0..n {
                let mut device = 0;
                ok(sys::cuDeviceGet(&mut device, i as i32), "cuDeviceGet")?;
                let mut ctx = std::ptr::null_mut();
                ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "retain")?;
                ok(sys::cuCtxSetCurrent(ctx), "set current")?;
                let mut stream = std::ptr::null_mut();
                ok(sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "stream")?;
                let (mut a, mut b) = (0, 0);
                ok(sys::cuMemAlloc_v2(&mut a, bytes.max(4)), "alloc")?;
                ok(sys::cuMemAlloc_v2(&mut b, bytes.max(4)), "alloc")?;
                ok(sys::cuMemsetD32_v2(a, 1.0f32.to_bits(), bytes.max(4) / 4), "memset")?;
                raw.ctxs.push(ctx);
                raw.streams.push(stream);
                raw.bufs.push((a, b));
            }
            let devs: Vec<i32> = (0..n as i32).collect();
            nok(nccl::ncclCommInitAll(raw.comms.as_mut_ptr(), n as i32, devs.as_ptr()), "ncclCommInitAll")?;
        }
        Ok(raw)
    }

    /// Mean seconds of one all-reduce of `bytes` (f32 sum).
    fn time(&self, bytes: usize, warmup: u32, iters: u32) -> Result<f64, String> {
        let count = bytes / 4;
        let once = || -> Result<(), String> {
            // SAFETY: communicators, streams and buffers made in `new`, of at
            // least `bytes` bytes; one thread issues every device's call
            // inside one NCCL group, as NCCL requires.
            unsafe {
                nok(nccl::ncclGroupStart(), "group start")?;
                for i in 0..self.comms.len() {
                    let (a, b) = self.bufs[i];
                    nok(
                        nccl::ncclAllReduce(
                            a as *const _,
                            b as *mut _,
                            count,
                            nccl::ncclDataType_t::ncclFloat32,
                            nccl::ncclRedOp_t::ncclSum,
                            self.comms[i],
                            self.streams[i] as nccl::cudaStream_t,
                        ),
                        "ncclAllReduce",
                    )?;
                }
                nok(nccl::ncclGroupEnd(), "group end")
            }
        };
        let sync = || -> Result<(), String> {
            for (ctx, stream) in self.ctxs.iter().zip(&self.streams) {
                // SAFETY: our context and stream.
                unsafe {
                    ok(sys::cuCtxSetCurrent(*ctx), "set current")?;
                    ok(sys::cuStreamSynchronize(*stream), "sync")?;
                }
            }
            Ok(())
        };
        for _ in 0..warmup {
            once()?;
        }
        sync()?;
        let start = Instant::now();
        for _ in 0..iters {
            once()?;
        }
        sync()?;
        Ok(start.elapsed().as_secs_f64() / iters.max(1) as f64)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("nccl_bench: {wrong} wrong elements");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("nccl_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    if args.backend != "cuda" {
        return Err(format!("backend {:?}: this bench compares against NCCL, use --backend cuda", args.backend).into());
    }
    let available = CudaRuntime::device_count()?;
    let n = args.devices.unwrap_or(available).clamp(1, available);
    let clients: Vec<Client> = (0..n).map(CudaRuntime::client).collect::<Result<_, _>>()?;
    let group = ClientGroup::new(clients)?;
    let raw = Raw::new(n, args.max_bytes);
    println!(
        "# cohort nccl_bench: all_reduce, float, sum, {n} CUDA device(s) ({}), cohort transport {:?}, NCCL {}",
        group.client(0).properties().name,
        group.transport(),
        nccl_version().unwrap_or_else(|why| format!("unavailable: {why}"))
    );
    if let Err(why) = &raw {
        println!("# raw NCCL baseline skipped: {why}");
    }
    println!("# ratio = cohort busbw / raw NCCL busbw (algbw on one device, whose busbw factor is 0)");
    println!(
        "# {:>10} {:>11} | {:>9} {:>9} {:>8} {:>8} {:>6} | {:>9} {:>8} {:>8} | {:>7}",
        "size", "count", "call(us)", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "ratio"
    );
    println!("# {:>23} | {:^44} | {:^27} |", "", "cohort ClientGroup", "raw NCCL (cudarc)");
    let factor = 2.0 * (n as f64 - 1.0) / n as f64;
    let mut total_wrong = 0;
    let mut bytes = args.min_bytes.max(4) / 4 * 4;
    while bytes <= args.max_bytes {
        let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), bytes / 4).flatten().collect();
        let src: Vec<Handle> = group.clients().iter().map(|c| c.create_from_slice(&ones)).collect();
        let dst: Vec<Handle> = group.clients().iter().map(|c| c.empty(bytes)).collect();
        for _ in 0..args.warmup {
            group.all_reduce(&src, &dst, DType::F32, ReduceOp::Sum)?;
        }
        group.sync()?;
        let start = Instant::now();
        for _ in 0..args.iters {
            group.all_reduce(&src, &dst, DType::F32, ReduceOp::Sum)?;
        }
        let queued = start.elapsed().as_secs_f64() / args.iters.max(1) as f64;
        group.sync()?;
        let time = start.elapsed().as_secs_f64() / args.iters.max(1) as f64;
        let wrong = if args.check == 1 {
            let got = group.client(0).read_one(dst[0].clone())?;
            got.chunks_exact(4).filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != n as f32).count()
        } else {
            0
        };
        total_wrong += wrong;
        let algbw = bytes as f64 / time / 1e9;
        let busbw = algbw * factor;
        let raw_cols = match &raw {
            Ok(raw) => {
                let t = raw.time(bytes, args.warmup, args.iters)?;
                let (a, b) = (bytes as f64 / t / 1e9, bytes as f64 / t / 1e9 * factor);
                let ratio = if n == 1 { algbw / a } else { busbw / b };
                format!("{:>9.2} {:>8.2} {:>8.2} | {:>7.2}", t * 1e6, a, b, ratio)
            }
            Err(_) => format!("{:>9} {:>8} {:>8} | {:>7}", "-", "-", "-", "-"),
        };
        println!(
            "  {:>10} {:>11} | {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>6} | {raw_cols}",
            bytes,
            bytes / 4,
            queued * 1e6,
            time * 1e6,
            algbw,
            busbw,
            wrong
        );
        bytes = bytes.saturating_mul(args.step_factor.max(2));
    }
    Ok(total_wrong)
}
