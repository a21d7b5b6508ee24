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

use std::ffi::{c_void, CString};
use std::time::Instant;

use cohort::runtime::backend::cuda::cudarc;
use cohort::runtime::conformance::kernels;
use cohort::runtime::{Bytes, CudaRuntime, GridCount, KernelArguments, Runtime, Scalar, StreamId};
use cudarc::driver::sys;

#[path = "support/bench.rs"]
mod bench;
use bench::median;

fn ok(code: sys::CUresult, what: &str) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// The scale kernel loaded from PTX on this thread's primary context, its
/// own stream, and a buffer of 256 floats.
struct Raw {
    stream: sys::CUstream,
    function: sys::CUfunction,
    buffer: sys::CUdeviceptr,
}

impl Raw {
    fn new(source: &str) -> Self {
        // SAFETY (whole block): plain driver calls on the primary context of
        // device 0, made current on this thread; every result is checked.
        unsafe {
            let mut device = 0;
            ok(sys::cuDeviceGet(&mut device, 0), "cuDeviceGet");
            let mut ctx = std::ptr::null_mut();
            ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "retain");
            ok(sys::cuCtxSetCurrent(ctx), "set current");
            let mut stream = std::ptr::null_mut();
            ok(sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "stream");
            let ptx = cudarc::nvrtc::compile_ptx(source).expect("raw NVRTC compile");
            let image = CString::new(ptx.to_src()).unwrap();
            let mut module = std::ptr::null_mut();
            ok(sys::cuModuleLoadData(&mut module, image.as_ptr().cast()), "module");
            let mut function = std::ptr::null_mut();
            let name = CString::new("scale").unwrap();
            ok(sys::cuModuleGetFunction(&mut function, module, name.as_ptr()), "function");
            let mut buffer = 0;
            ok(sys::cuMemAlloc_v2(&mut buffer, 1024), "cuMemAlloc");
            Self { stream, function, buffer }
        }
    }

    /// One launch, its three parameters given as an array of pointers.
    fn launch_pointers(&self) {
        let (mut p, mut l, mut f) = (self.buffer, 1024u64, 1.0f32);
        let mut params =
            [(&mut p as *mut u64).cast::<c_void>(), (&mut l as *mut u64).cast(), (&mut f as *mut f32).cast()];
        // SAFETY: a loaded function and three parameters of its types.
        let code = unsafe {
            sys::cuLaunchKernel(
                self.function,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        ok(code, "cuLaunchKernel (pointers)");
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
                self.function,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                self.stream,
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
        // SAFETY: our live stream.
        ok(unsafe { sys::cuStreamSynchronize(self.stream) }, "sync");
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let launches: usize = args.next().map_or(500, |a| a.parse().expect("LAUNCHES is a number"));
    let rounds: usize = args.next().map_or(21, |a| a.parse().expect("ROUNDS is a number"));
    let client = CudaRuntime::client(0).expect("CUDA device 0").with_stream(StreamId::fresh());
    let scale = kernels::scale();
    let raw = Raw::new(scale.cuda_source().unwrap());
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
