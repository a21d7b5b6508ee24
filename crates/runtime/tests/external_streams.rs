//! Ordering cohort's work with a stream cudarc owns, both ways
//! (`Client::wait_external`, `Client::signal_external`), on a client made
//! from the caller's primary context (`CudaRuntime::client_for_context`).
//! Each ordering is checked by a kernel that spins ~50 ms before it writes:
//! without the ordering the reader runs first and sees zeros. Needs a CUDA
//! GPU.

#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{Bytes, Client, CudaRuntime, ExternalStream, GridCount, Kernel, KernelArguments, Scalar};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

const N: usize = 256;
const SPIN_NS: u64 = 50_000_000;

/// The caller's kernels: `spin_then_fill` spins `spin_ns` (the GPU's
/// global timer) and writes `value` into `n` words at `dst`; `copy_words`
/// copies `n` words from `src` to `dst`. Addresses are plain integers, as
/// another library would hold them.
const CALLER_SOURCE: &str = r#"
__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void spin_then_fill(unsigned long long dst, unsigned int n, unsigned int value, unsigned long long spin_ns) {
    if (threadIdx.x == 0) {
        unsigned long long start = now_ns();
        while (now_ns() - start < spin_ns) {}
    }
    __syncthreads();
    unsigned int* out = (unsigned int*)dst;
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}
extern "C" __global__ void copy_words(unsigned long long dst, unsigned long long src, unsigned int n) {
    unsigned int* out = (unsigned int*)dst;
    const unsigned int* in = (const unsigned int*)src;
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i];
}
"#;

/// Cohort's slow writer: spins like the caller's, then fills its buffer.
fn cohort_spin_then_fill() -> Kernel {
    Kernel::new("cohort_spin_then_fill").with_block([256, 1, 1]).with_cuda(
        r#"extern "C" __global__ void cohort_spin_then_fill(unsigned int* x, unsigned long long len_bytes, unsigned int value, unsigned long long spin_ns) {
    if (threadIdx.x == 0) {
        unsigned long long start, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - start < spin_ns);
    }
    __syncthreads();
    for (unsigned long long i = threadIdx.x; i < len_bytes / 4; i += blockDim.x) x[i] = value;
}"#,
    )
}

struct Caller {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    spin_then_fill: CudaFunction,
    copy_words: CudaFunction,
}

fn caller() -> Caller {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    let stream = ctx.new_stream().unwrap();
    let ptx = cudarc::nvrtc::compile_ptx(CALLER_SOURCE).unwrap();
    let module = ctx.load_module(ptx).unwrap();
    Caller {
        spin_then_fill: module.load_function("spin_then_fill").unwrap(),
        copy_words: module.load_function("copy_words").unwrap(),
        ctx,
        stream,
    }
}

fn one_block() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

fn zeros(client: &Client) -> cohort_runtime::Handle {
    let h = client.create(Bytes::from_elems(&[0u32; N]));
    client.sync().unwrap();
    h
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn cohort_waits_for_the_callers_stream() {
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    assert_eq!(client.device_id().index, 0);
    let h = zeros(&client);
    let address = client.device_address(&h).unwrap();
    // The caller's slow kernel writes 7 into cohort's buffer on its stream.
    let (n, value, spin) = (N as u32, 7u32, SPIN_NS);
    let mut launch = caller.stream.launch_builder(&caller.spin_then_fill);
    launch.arg(&address).arg(&n).arg(&value).arg(&spin);
    // SAFETY: the arguments match the kernel's parameters; `address` is
    // N words of cohort's live buffer.
    unsafe { launch.launch(one_block()) }.unwrap();
    let started = Instant::now();
    client.wait_external(&ExternalStream::from_cudarc(&caller.stream)).unwrap();
    assert!(started.elapsed() < Duration::from_millis(40), "wait_external did not wait for the GPU");
    // Cohort's read runs on its own stream, after the caller's kernel.
    assert_eq!(client.read_one(h).unwrap().to_elems::<u32>(), vec![7; N]);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn the_callers_stream_waits_for_cohort() {
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    let h = zeros(&client);
    let src = client.device_address(&h).unwrap();
    let mine = caller.stream.alloc_zeros::<u32>(N).unwrap();
    let dst = {
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&mine, &caller.stream);
        ptr
    };
    // Compiled first (a first launch compiles on the device thread, and
    // signal_external would wait for that task to be handed to the driver).
    let kernel = cohort_spin_then_fill();
    let warm = zeros(&client);
    let no_spin = KernelArguments::new().buffer(&warm).scalar(Scalar::U32(1)).scalar(Scalar::U64(0));
    client.launch(&kernel, GridCount::Static(1, 1, 1), no_spin).unwrap();
    client.sync().unwrap();
    client
        .launch(
            &kernel,
            GridCount::Static(1, 1, 1),
            KernelArguments::new().buffer(&h).scalar(Scalar::U32(9)).scalar(Scalar::U64(SPIN_NS)),
        )
        .unwrap();
    let started = Instant::now();
    client.signal_external(&ExternalStream::from_cudarc(&caller.stream)).unwrap();
    assert!(started.elapsed() < Duration::from_millis(40), "signal_external did not wait for the GPU");
    // The caller's copy on its stream, queued after signal_external, runs
    // after cohort's slow kernel.
    let n = N as u32;
    let mut launch = caller.stream.launch_builder(&caller.copy_words);
    launch.arg(&dst).arg(&src).arg(&n);
    // SAFETY: the arguments match the kernel's parameters; both addresses
    // are N live words.
    unsafe { launch.launch(one_block()) }.unwrap();
    assert_eq!(caller.stream.clone_dtoh(&mine).unwrap(), vec![9; N]);
    client.sync().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn other_contexts_and_their_streams_are_refused() {
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let err = CudaRuntime::client_for_context(&other).unwrap_err().to_string();
    assert!(err.contains("not the primary context") && err.contains("CudaContext::new(0)"), "{err}");

    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    let foreign = other.new_stream().unwrap();
    let err = client.wait_external(&ExternalStream::from_cudarc(&foreign)).unwrap_err().to_string();
    assert!(err.contains("belongs to CUDA context"), "{err}");
    let err = client.signal_external(&ExternalStream::from_cudarc(&foreign)).unwrap_err().to_string();
    assert!(err.contains("belongs to CUDA context"), "{err}");
    let err = client.wait_external(&unsafe { ExternalStream::cuda_raw(2) }).unwrap_err().to_string();
    assert!(err.contains("per-thread default stream"), "{err}");
    // The legacy default stream (null) is the context's own; a wgpu queue
    // is not a CUDA stream.
    client.wait_external(&unsafe { ExternalStream::cuda_raw(0) }).unwrap();
    client.signal_external(&unsafe { ExternalStream::cuda_raw(0) }).unwrap();
    #[cfg(feature = "wgpu")]
    {
        let err = client.wait_external(&ExternalStream::WgpuQueue).unwrap_err().to_string();
        assert!(err.contains("is not a CUDA stream"), "{err}");
    }
    // The refusals left the client working, ordered with the caller's
    // stream again.
    client.wait_external(&ExternalStream::from_cudarc(&caller.stream)).unwrap();
    client.sync().unwrap();
}

/// What a wait and a signal cost the calling thread on an idle device (on
/// its thread, two driver calls each after the first): printed, and
/// bounded generously (CI machines are loaded).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn ordering_with_an_external_stream_is_cheap() {
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    let external = ExternalStream::from_cudarc(&caller.stream);
    client.wait_external(&external).unwrap();
    client.signal_external(&external).unwrap();
    client.sync().unwrap();
    let rounds = 20_000;
    let started = Instant::now();
    for _ in 0..rounds {
        client.wait_external(&external).unwrap();
        client.signal_external(&external).unwrap();
    }
    let per_call = started.elapsed() / (2 * rounds);
    println!("wait_external + signal_external: {per_call:?} per call");
    client.sync().unwrap();
    caller.stream.synchronize().unwrap();
    assert!(per_call < Duration::from_micros(20), "{per_call:?} per call");
}
