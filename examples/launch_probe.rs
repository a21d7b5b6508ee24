//! What a kernel launch costs the caller's thread, taken apart with raw
//! cudarc beside cohort's `Client::launch` in one run: the same one-block
//! kernel queued by `cuLaunchKernel` with its parameters as an array of
//! pointers (what cudarc and `cuda_runtime_bench`'s raw rows do), with
//! them packed in one buffer (`CU_LAUNCH_PARAM_BUFFER_POINTER`), with
//! pointers after a `cuCtxGetCurrent` (what a caller entering the device
//! pays), and through cohort (raw ways on GPU 0, cohort's on its device 0:
//! the same GPU unless `COHORT_CUDA_DEVICES` or `CUDA_VISIBLE_DEVICES`
//! says otherwise). Each round queues `LAUNCHES` kernels (the caller's
//! time, timed) and then waits for them (not timed); the ways alternate
//! round by round, and each figure is the median of the rounds.
//!
//! Run (CUDA GPU): `cargo run --release --features cuda --example launch_probe -- [LAUNCHES] [ROUNDS]`

use std::ffi::c_void;
use std::time::Instant;

use cohort::runtime::backend::cuda::cudarc;
use cohort::runtime::conformance::kernels;
use cohort::runtime::{Bytes, CudaRuntime, GridCount, KernelArguments, Runtime, Scalar, StreamId};
use cudarc::driver::sys;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/raw_cuda.rs"]
mod raw_cuda;
use bench::median;
use raw_cuda::{ok, Raw};

/// The raw kernel and stream, and a buffer of 256 floats it scales.
struct Probe {
    raw: Raw,
    buffer: sys::CUdeviceptr,
}

impl Probe {
    fn new(source: &str) -> Self {
        let raw = Raw::new(source);
        let mut buffer = 0;
        // SAFETY: the primary context is current (`Raw::new`); writes one
        // device address.
        ok(unsafe { sys::cuMemAlloc_v2(&mut buffer, 1024) }, "cuMemAlloc");
        Self { raw, buffer }
    }

    /// One launch, its three parameters given as an array of pointers.
    fn launch_pointers(&self) {
        self.raw.launch(self.buffer, 1024, self.raw.stream);
    }

    /// One launch, its parameters packed in one buffer as the kernel lays
    /// them out (8-byte pointer, 8-byte length, 4-byte float).
    fn launch_packed(&self) {
        let mut packed = [0u64; 3];
        packed[0] = self.buffer;
        packed[1] = 1024;
        packed[2] = 1.0f32.to_bits() as u64;
        let mut size = 20usize;
        // The markers are small integers passed as pointers.
        let marker = |m: u32| m as usize as *mut c_void;
        let mut extra = [
            marker(sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT),
            packed.as_mut_ptr().cast::<c_void>(),
            marker(sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT),
            (&mut size as *mut usize).cast::<c_void>(),
            marker(sys::CU_LAUNCH_PARAM_END_AS_INT),
        ];
        // SAFETY: a loaded function; `extra` names a buffer of the
        // parameters' layout and its size, ended by the END marker.
        let code = unsafe {
            sys::cuLaunchKernel(
                self.raw.function,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                self.raw.stream,
                std::ptr::null_mut(),
                extra.as_mut_ptr(),
            )
        };
        ok(code, "cuLaunchKernel (packed)");
    }

    fn current(&self) {
        let mut current = std::ptr::null_mut();
        // SAFETY: writes this thread's current context.
        ok(unsafe { sys::cuCtxGetCurrent(&mut current) }, "cuCtxGetCurrent");
        std::hint::black_box(current);
    }

    fn sync(&self) {
        self.raw.sync();
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let launches: usize = args.next().map_or(500, |a| a.parse().expect("LAUNCHES is a number"));
    let rounds: usize = args.next().map_or(21, |a| a.parse().expect("ROUNDS is a number"));
    let client = CudaRuntime::client(0).expect("CUDA device 0").with_stream(StreamId::fresh());
    let scale = kernels::scale();
    let raw = Probe::new(scale.cuda_source().unwrap());
    let x = client.create(Bytes::from_elems(&[1.0f32; 256]));

    type Way<'a> = (&'a str, Box<dyn Fn() + 'a>, Box<dyn Fn() + 'a>);
    let ways: Vec<Way> = vec![
        ("cuLaunchKernel, parameter pointers (raw)", Box::new(|| raw.launch_pointers()), Box::new(|| raw.sync())),
        ("cuLaunchKernel, one packed buffer", Box::new(|| raw.launch_packed()), Box::new(|| raw.sync())),
        (
            "cuCtxGetCurrent + cuLaunchKernel, pointers",
            Box::new(|| {
                raw.current();
                raw.launch_pointers()
            }),
            Box::new(|| raw.sync()),
        ),
        (
            "cohort Client::launch",
            Box::new(|| {
                client
                    .launch(
                        &scale,
                        GridCount::Static(1, 1, 1),
                        KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0)),
                    )
                    .expect("cohort launch")
            }),
            Box::new(|| client.sync().expect("cohort sync")),
        ),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    for round in 0..=rounds {
        for k in 0..ways.len() {
            // Which way goes first turns with the round.
            let i = (k + round) % ways.len();
            let (_, launch, sync) = &ways[i];
            let start = Instant::now();
            for _ in 0..launches {
                launch();
            }
            let took = start.elapsed().as_secs_f64() * 1e6 / launches as f64;
            sync();
            if round > 0 {
                times[i].push(took);
            }
        }
    }
    println!("launch_probe: {launches} launches a round, median of {rounds} rounds, caller's µs per launch");
    let base = median(&mut times[0].clone());
    for (i, (what, _, _)) in ways.iter().enumerate() {
        let m = median(&mut times[i]);
        println!("{what:<45} {m:>7.3} µs  {:>5.2}× raw", m / base);
    }
}
