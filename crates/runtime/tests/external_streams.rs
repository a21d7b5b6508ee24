//! Ordering cohort's work with a stream cudarc owns, both ways: by events
//! (`Client::wait_external`, `Client::signal_external`) and by running on
//! it (`Client::bind_external`, `hand_over`, `unbind_external`), on a
//! client made from the caller's primary context
//! (`CudaRuntime::client_for_context`). Each ordering is checked by a
//! kernel that spins ~50 ms before it writes: without the ordering the
//! reader runs first and sees zeros. Needs a CUDA GPU (but the CPU's
//! refusal, which runs everywhere). The tests take turns
//! (`serial`): one closes the device.

#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_runtime::{
    Bytes, Client, CpuRuntime, CudaRuntime, ExternalStream, GridCount, Kernel, KernelArguments, Runtime, Scalar,
    ServerError, StreamId,
};
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

/// Cohort's copy: `n` words from `src` to `dst` (one block).
fn cohort_copy_words() -> Kernel {
    Kernel::new("cohort_copy_words").with_block([256, 1, 1]).with_cuda(
        r#"extern "C" __global__ void cohort_copy_words(unsigned int* dst, const unsigned int* src, unsigned long long dst_bytes, unsigned long long src_bytes) {
    for (unsigned long long i = threadIdx.x; i < dst_bytes / 4 && i < src_bytes / 4; i += blockDim.x) dst[i] = src[i];
}"#,
    )
}

/// One test at a time: one closes device 0, which every test uses.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
    let _serial = serial();
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
    let _serial = serial();
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
    let _serial = serial();
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
    let _serial = serial();
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

/// Launches the caller's `spin_then_fill` on `stream`: after `spin_ns`,
/// `value` into the `N` words at `address`.
fn caller_fill(caller: &Caller, stream: &Arc<CudaStream>, address: u64, value: u32, spin_ns: u64) {
    let n = N as u32;
    let mut launch = stream.launch_builder(&caller.spin_then_fill);
    launch.arg(&address).arg(&n).arg(&value).arg(&spin_ns);
    // SAFETY: the arguments match the kernel's parameters; `address` is N
    // live words.
    unsafe { launch.launch(one_block()) }.unwrap();
}

/// Launches the caller's `copy_words` on `stream`: `N` words from `src`
/// into the caller's `mine`.
fn caller_copy(caller: &Caller, stream: &Arc<CudaStream>, mine: &mut cudarc::driver::CudaSlice<u32>, src: u64) {
    let n = N as u32;
    let mut launch = stream.launch_builder(&caller.copy_words);
    launch.arg(mine).arg(&src).arg(&n);
    // SAFETY: (dst, src, n) as the kernel takes them; both hold N words.
    unsafe { launch.launch(one_block()) }.unwrap();
}

/// Cohort's kernels compiled (a first launch compiles on the device
/// thread) and the device drained, so the launches below run on this
/// thread, handed to the driver before they return.
fn warm_kernels(client: &Client) {
    let (a, b) = (zeros(client), zeros(client));
    let args = KernelArguments::new().buffer(&a).scalar(Scalar::U32(1)).scalar(Scalar::U64(0));
    client.launch(&cohort_spin_then_fill(), GridCount::Static(1, 1, 1), args).unwrap();
    client
        .launch(&cohort_copy_words(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&b).buffer(&a))
        .unwrap();
    client.sync().unwrap();
}

fn cohort_fill(client: &Client, h: &cohort_runtime::Handle, value: u32, spin_ns: u64) {
    let args = KernelArguments::new().buffer(h).scalar(Scalar::U32(value)).scalar(Scalar::U64(spin_ns));
    client.launch(&cohort_spin_then_fill(), GridCount::Static(1, 1, 1), args).unwrap();
}

fn cohort_copy(client: &Client, dst: &cohort_runtime::Handle, src: &cohort_runtime::Handle) {
    let args = KernelArguments::new().buffer(dst).buffer(src);
    client.launch(&cohort_copy_words(), GridCount::Static(1, 1, 1), args).unwrap();
}

/// A stream bound to the caller's orders both ways with no event: cohort's
/// copy queued after the caller's slow kernel copies what it wrote, and
/// the caller's copy queued after cohort's slow kernel (no
/// `signal_external`: `hand_over` only makes sure the launch reached the
/// driver) copies what cohort wrote.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_bound_stream_orders_both_ways_without_events() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap().with_stream(StreamId::fresh());
    warm_kernels(&client);
    let (h, copied) = (zeros(&client), zeros(&client));
    let external = ExternalStream::from_cudarc(&caller.stream);
    let started = Instant::now();
    client.bind_external(&external).unwrap();
    assert!(started.elapsed() < Duration::from_millis(40), "bind_external did not wait for the GPU");

    // The caller's slow write, then cohort's copy on the same stream.
    caller_fill(&caller, &caller.stream, client.device_address(&h).unwrap(), 7, SPIN_NS);
    cohort_copy(&client, &copied, &h);
    assert_eq!(client.read_one(copied).unwrap().to_elems::<u32>(), vec![7; N], "cohort's copy ran first");

    // Cohort's slow write, then the caller's copy: no signal_external.
    cohort_fill(&client, &h, 9, SPIN_NS);
    client.hand_over().unwrap();
    let mut mine = caller.stream.alloc_zeros::<u32>(N).unwrap();
    caller_copy(&caller, &caller.stream, &mut mine, client.device_address(&h).unwrap());
    assert_eq!(caller.stream.clone_dtoh(&mine).unwrap(), vec![9; N], "the caller's copy ran first");
    // Binding again, waiting on and signalling the bound stream need no
    // event (and still work).
    client.bind_external(&external).unwrap();
    client.wait_external(&external).unwrap();
    client.signal_external(&external).unwrap();
    client.unbind_external().unwrap();
    client.sync().unwrap();
}

/// Rebinding to another stream first makes it wait for what cohort queued
/// on the one it was bound to: the caller's copy on the second stream sees
/// cohort's slow write queued on the first.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn rebinding_to_another_stream_keeps_order() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap().with_stream(StreamId::fresh());
    warm_kernels(&client);
    let h = zeros(&client);
    let second = caller.ctx.new_stream().unwrap();
    client.bind_external(&ExternalStream::from_cudarc(&caller.stream)).unwrap();
    cohort_fill(&client, &h, 11, SPIN_NS);
    let started = Instant::now();
    client.bind_external(&ExternalStream::from_cudarc(&second)).unwrap();
    assert!(started.elapsed() < Duration::from_millis(40), "rebinding did not wait for the GPU");
    let mut mine = second.alloc_zeros::<u32>(N).unwrap();
    caller_copy(&caller, &second, &mut mine, client.device_address(&h).unwrap());
    assert_eq!(second.clone_dtoh(&mine).unwrap(), vec![11; N], "the second stream did not wait for the first");
    client.unbind_external().unwrap();
    client.sync().unwrap();
}

/// Unbinding first makes cohort's own stream wait for the external one:
/// cohort's copy after the unbind sees the caller's slow write queued on
/// the external stream while bound.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn unbinding_keeps_order() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap().with_stream(StreamId::fresh());
    warm_kernels(&client);
    let (h, copied) = (zeros(&client), zeros(&client));
    client.bind_external(&ExternalStream::from_cudarc(&caller.stream)).unwrap();
    caller_fill(&caller, &caller.stream, client.device_address(&h).unwrap(), 13, SPIN_NS);
    let started = Instant::now();
    client.unbind_external().unwrap();
    assert!(started.elapsed() < Duration::from_millis(40), "unbind_external did not wait for the GPU");
    cohort_copy(&client, &copied, &h);
    assert_eq!(client.read_one(copied).unwrap().to_elems::<u32>(), vec![13; N], "cohort's copy ran first");
    // Unbinding an unbound stream does nothing.
    client.unbind_external().unwrap();
    client.sync().unwrap();
}

/// A binding keeps the caller's stream alive (its clone of the cudarc
/// stream) and never destroys it: not when the thread that bound its own
/// stream exits, nor when the device closes; the caller's stream works
/// after both.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_bound_stream_outlives_its_thread_and_the_device() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    warm_kernels(&client);
    let h = zeros(&client);
    let stream = caller.ctx.new_stream().unwrap();
    let mut mine = stream.alloc_zeros::<u32>(N).unwrap();
    stream.synchronize().unwrap();
    // This test's clone, and any the allocation holds.
    let unbound = Arc::strong_count(&stream);
    // A thread binds its own stream, writes slowly on it and exits.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            client.bind_external(&ExternalStream::from_cudarc(&stream)).unwrap();
            cohort_fill(&client, &h, 17, SPIN_NS);
            client.hand_over().unwrap();
        });
    });
    assert_eq!(Arc::strong_count(&stream), unbound + 1, "the binding holds the cudarc stream");
    caller_copy(&caller, &stream, &mut mine, client.device_address(&h).unwrap());
    assert_eq!(stream.clone_dtoh(&mine).unwrap(), vec![17; N], "cohort's write was not on the caller's stream");
    client.close();
    assert!(matches!(client.sync(), Err(ServerError::DeviceClosed { .. })), "the device is closed");
    // The device thread lets go of its clone as the device closes.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Arc::strong_count(&stream) > unbound && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(Arc::strong_count(&stream), unbound, "the closed device let go of the stream");
    // The caller's stream still works.
    let (address, _sync) = cudarc::driver::DevicePtr::device_ptr(&mine, &stream);
    caller_fill(&caller, &stream, address, 19, 0);
    assert_eq!(stream.clone_dtoh(&mine).unwrap(), vec![19; N]);
    stream.synchronize().unwrap();
}

/// Binding inside a capture is refused: a stream inside cohort's capture
/// window, and a caller's stream inside the caller's capture; and a bound
/// stream cannot begin a capture of cohort's.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn binding_inside_a_capture_is_refused() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap();
    let external = ExternalStream::from_cudarc(&caller.stream);

    let capturing = client.with_stream(StreamId::fresh());
    capturing.start_capture().unwrap();
    let err = capturing.bind_external(&external).unwrap_err();
    assert!(matches!(err, ServerError::InvalidState { .. }) && err.to_string().contains("capture"), "{err}");
    let _ = capturing.stop_capture();

    let theirs = caller.ctx.new_stream().unwrap();
    theirs.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
    let pinned = client.with_stream(StreamId::fresh());
    let err = pinned.bind_external(&ExternalStream::from_cudarc(&theirs)).unwrap_err();
    assert!(err.to_string().contains("inside a capture"), "{err}");
    let _ = theirs
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);

    let bound = client.with_stream(StreamId::fresh());
    bound.bind_external(&external).unwrap();
    let err = bound.start_capture().unwrap_err();
    assert!(err.to_string().contains("bound to external stream"), "{err}");
    assert!(!bound.is_capturing());
    // The refusals left the streams working.
    bound.unbind_external().unwrap();
    pinned.bind_external(&external).unwrap();
    pinned.unbind_external().unwrap();
    client.sync().unwrap();
}

/// What binding again to the bound stream costs (a compare on this
/// thread), and a hand-over on an idle device: printed, and bounded
/// generously (CI machines are loaded).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn binding_again_is_cheap() {
    let _serial = serial();
    let caller = caller();
    let client = CudaRuntime::client_for_context(&caller.ctx).unwrap().with_stream(StreamId::fresh());
    let external = ExternalStream::from_cudarc(&caller.stream);
    client.bind_external(&external).unwrap();
    let rounds = 100_000;
    let started = Instant::now();
    for _ in 0..rounds {
        client.bind_external(&external).unwrap();
    }
    let bind = started.elapsed() / rounds;
    let started = Instant::now();
    for _ in 0..rounds {
        client.hand_over().unwrap();
    }
    let hand_over = started.elapsed() / rounds;
    println!("bind_external again: {bind:?}, hand_over: {hand_over:?} per call");
    client.unbind_external().unwrap();
    client.sync().unwrap();
    assert!(bind < Duration::from_micros(5), "{bind:?} per bind");
    assert!(hand_over < Duration::from_micros(20), "{hand_over:?} per hand_over");
}

/// The CPU has no external streams: binding is refused, saying so;
/// nothing is bound, so unbinding and handing over do nothing.
#[test]
fn binding_on_the_cpu_is_refused() {
    let cpu = CpuRuntime::client(0).unwrap();
    // SAFETY: the legacy default stream's handle; the CPU never uses it.
    let external = unsafe { ExternalStream::cuda_raw(0) };
    let err = cpu.bind_external(&external).unwrap_err();
    assert!(matches!(err, ServerError::Unsupported { backend: "cpu", .. }), "{err}");
    assert!(err.to_string().contains("external stream"), "{err}");
    // Refused again (nothing was remembered as bound).
    assert!(cpu.bind_external(&external).is_err());
    cpu.unbind_external().unwrap();
    cpu.hand_over().unwrap();
}

/// On a wgpu device one queue runs every submission in order: binding to
/// it orders as `wait_external` does (nothing to queue), binding again is
/// a compare, handing over and unbinding work; a CUDA stream is refused,
/// and the refusal is not remembered as a binding.
#[cfg(feature = "wgpu")]
#[test]
fn binding_a_wgpu_queue_is_its_order_and_a_cuda_stream_is_refused() {
    let client = cohort_runtime::WgpuRuntime::client(0).unwrap_or_else(|e| panic!("no wgpu device 0: {e}"));
    let h = client.create(Bytes::from_elems(&[5u32; 4]));
    client.bind_external(&ExternalStream::WgpuQueue).unwrap();
    client.bind_external(&ExternalStream::WgpuQueue).unwrap();
    client.wait_external(&ExternalStream::WgpuQueue).unwrap();
    client.hand_over().unwrap();
    assert_eq!(client.read_one(h).unwrap().to_elems::<u32>(), vec![5; 4]);
    // SAFETY: the legacy default stream's handle; wgpu never uses it.
    let cuda = unsafe { ExternalStream::cuda_raw(0) };
    for _ in 0..2 {
        let err = client.bind_external(&cuda).unwrap_err().to_string();
        assert!(err.contains("is not a stream of wgpu device"), "{err}");
    }
    client.unbind_external().unwrap();
    client.sync().unwrap();
}
