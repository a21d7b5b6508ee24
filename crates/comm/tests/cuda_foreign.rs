//! Collectives on memory another CUDA library owns (cudarc allocations on a
//! cudarc stream, a DLPack tensor over one), on one GPU through a one-rank
//! NCCL communicator (`COHORT_NCCL_SINGLE=1`): ordered on the caller's
//! stream both ways (a cudarc kernel that writes before, one that reads
//! after, each checked by values), with no copy (same address, no cohort
//! allocation), the owner kept until the work ends, the refusals.
//!
//! Ignored: they need a GPU (`cargo test -p cohort-comm --features cuda
//! --test cuda_foreign -- --include-ignored`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use cohort_comm::{Buffer, ClientGroup, Collectives, OnStream, ReduceOp, Transport};
use cohort_runtime::backend::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cohort_runtime::backend::cuda::cudarc::nvrtc::compile_ptx;
use cohort_runtime::dlpack::dlpark::ffi::{DLDataType, DLDevice, DLManagedTensorVersioned};
use cohort_runtime::dlpack::dlpark::metadata::Dynamic;
use cohort_runtime::{Bytes, Client, CpuRuntime, CudaRuntime, ExternalStream, GridCount, Kernel, KernelArguments};
use cohort_runtime::{Runtime, Scalar};

/// Elements of the test tensors (16 MiB of f32: NCCL's copy takes a
/// while).
const N: usize = 4 << 20;

/// The caller's side: cudarc's primary context of GPU 0, a stream of its
/// own, its kernels; cohort's client on the same context and a one-device
/// group that runs through NCCL.
struct Caller {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    spin_fill: CudaFunction,
    copy: CudaFunction,
    client: Client,
    group: ClientGroup,
}

/// The caller's kernels: `spin_fill` spins `ns` nanoseconds (the global
/// timer) in every thread, then writes `value`; `copy` copies `n` floats.
const KERNELS: &str = r#"
extern "C" __global__ void spin_fill(float* x, unsigned n, float value, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}
extern "C" __global__ void copy(float* out, const float* in, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i];
}"#;

fn caller() -> Caller {
    static FORCE: Once = Once::new();
    // Set before the first group reads it.
    FORCE.call_once(|| std::env::set_var("COHORT_NCCL_SINGLE", "1"));
    CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    if let Err(why) = cohort_runtime::backend::cuda::nccl_version() {
        panic!("this test needs libnccl: {why}");
    }
    let ctx = CudaContext::new(0).expect("cudarc's primary context");
    let client = CudaRuntime::client_for_context(&ctx).expect("cohort's client on that context");
    let group = ClientGroup::new(vec![client.clone()]).unwrap();
    assert_eq!(group.transport(), Transport::Nccl);
    let stream = ctx.new_stream().expect("a stream of the caller's");
    let module = ctx.load_module(compile_ptx(KERNELS).expect("NVRTC")).expect("module");
    let (spin_fill, copy) = (module.load_function("spin_fill").unwrap(), module.load_function("copy").unwrap());
    Caller { _ctx: ctx, stream, spin_fill, copy, client, group }
}

impl Caller {
    /// A cudarc allocation of the caller's holding `value` everywhere,
    /// written and synchronized.
    fn filled(&self, value: f32) -> CudaSlice<f32> {
        let slice = self.stream.clone_htod(&vec![value; N]).unwrap();
        self.stream.synchronize().unwrap();
        slice
    }

    /// Queues `spin_fill` on the caller's stream.
    fn spin_fill(&self, x: &mut CudaSlice<f32>, value: f32, spin: Duration) {
        let (n, ns) = (N as u32, spin.as_nanos() as u64);
        let mut launch = self.stream.launch_builder(&self.spin_fill);
        launch.arg(x).arg(&n).arg(&value).arg(&ns);
        // SAFETY: (float*, unsigned, float, unsigned long long); writes
        // below `n`, which `x` holds.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    }

    /// Queues `copy` (out ← input) on the caller's stream.
    fn copy(&self, out: &mut CudaSlice<f32>, input: &CudaSlice<f32>) {
        let n = N as u32;
        let mut launch = self.stream.launch_builder(&self.copy);
        launch.arg(out).arg(input).arg(&n);
        // SAFETY: (float*, const float*, unsigned); both hold `n`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    }

    /// The device address of a cudarc allocation.
    fn address(&self, slice: &CudaSlice<f32>) -> u64 {
        let (ptr, _read) = slice.device_ptr(&self.stream);
        ptr
    }

    /// A buffer over `slice`'s memory, the slice kept by the test.
    ///
    /// # Safety
    /// `slice` must outlive the work cohort queues on the buffer.
    unsafe fn raw(&self, slice: &CudaSlice<f32>) -> Buffer<f32> {
        // SAFETY: the caller's promise.
        unsafe { Buffer::from_device_ptr(&self.client, self.address(slice), N, ()) }.unwrap()
    }

    /// Keeps cohort's stream busy for `spin` (a one-thread kernel of
    /// cohort's on this thread's stream).
    fn busy_cohort(&self, spin: Duration) {
        let kernel = Kernel::new("busy").with_cuda(
            r#"extern "C" __global__ void busy(unsigned int* flag, unsigned long long len, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    if (len >= 4) flag[0] = 1;
}"#,
        );
        let flag = self.client.create(Bytes::from(vec![0u8; 4]));
        let args = KernelArguments::new().buffer(&flag).scalar(Scalar::U64(spin.as_nanos() as u64));
        self.client.launch(&kernel, GridCount::Static(1, 1, 1), args).unwrap();
    }

    fn on_stream(&self) -> OnStream<'_, ClientGroup> {
        OnStream::new(&self.group, &[ExternalStream::from_cudarc(&self.stream)]).unwrap()
    }
}

/// The issue's stream ordering, both ways, on cudarc allocations:
/// - before: the caller's kernel writes `src` after spinning 50 ms; the
///   all-reduce ordered on the caller's stream reads what it wrote (not
///   the zeros it held when the call was made);
/// - after: with cohort's stream for this thread kept busy 50 ms first
///   (after the first call, the caller's stream itself, which `OnStream`
///   bound it to: were the all-reduce queued on a stream of cohort's own,
///   the kernel would wait there and the caller's copy run first), the
///   caller's kernel queued right after the call copies the all-reduce's
///   result (not the sentinel the destination held).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_cudarc_kernel_before_and_one_after_are_ordered_with_the_all_reduce_on_their_stream() {
    let c = caller();
    // Warm up: kernels compiled, the NCCL communicator made.
    let (warm_src, warm_dst) = (c.filled(1.0), c.filled(0.0));
    // SAFETY: the slices outlive the call: it is waited for below.
    let warm = unsafe { [c.raw(&warm_src), c.raw(&warm_dst)] };
    c.group.all_reduce(&warm[..1], &warm[1..], ReduceOp::Sum).unwrap().wait().unwrap();
    c.busy_cohort(Duration::from_micros(1));
    c.client.sync().unwrap();

    // Before.
    let (mut src, dst) = (c.filled(0.0), c.filled(-1.0));
    // SAFETY: the slices outlive the work: synchronized below.
    let (s, d) = unsafe { ([c.raw(&src)], [c.raw(&dst)]) };
    c.spin_fill(&mut src, 7.0, Duration::from_millis(50));
    c.on_stream().all_reduce(&s, &d, ReduceOp::Sum).unwrap();
    let got = d[0].to_vec().unwrap();
    assert!(got.iter().all(|&x| x == 7.0), "the all-reduce ran before the caller's write: {:?}", &got[..4]);

    // After.
    let (src, dst, mut out) = (c.filled(5.0), c.filled(-1.0), c.filled(-2.0));
    // SAFETY: as above.
    let (s, d) = unsafe { ([c.raw(&src)], [c.raw(&dst)]) };
    c.busy_cohort(Duration::from_millis(50));
    c.on_stream().all_reduce(&s, &d, ReduceOp::Sum).unwrap();
    c.copy(&mut out, &dst);
    let copied = c.stream.clone_dtoh(&out).unwrap();
    assert!(copied.iter().all(|&x| x == 5.0), "the caller's kernel ran before the all-reduce: {:?}", &copied[..4]);
    c.client.sync().unwrap();
    c.stream.synchronize().unwrap();
}

/// The "after" order where the part goes through the device thread (kept
/// busy 50 ms by a task, so the call is queued there rather than run on
/// this thread): `OnStream` returns only once the part was handed to the
/// driver (`Client::hand_over`), so the caller's kernel queued right after
/// the call still copies the result. Without that wait the copy would be
/// queued on the caller's stream before the part, and copy the sentinel.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn the_callers_kernel_after_a_call_queued_on_a_busy_device_sees_its_result() {
    let c = caller();
    // Warm up: the communicator made, the kernels compiled, this thread's
    // stream bound to the caller's.
    let (warm_src, warm_dst) = (c.filled(1.0), c.filled(0.0));
    // SAFETY: the slices outlive the call: it is waited for below.
    let warm = unsafe { [c.raw(&warm_src), c.raw(&warm_dst)] };
    c.on_stream().all_reduce(&warm[..1], &warm[1..], ReduceOp::Sum).unwrap().wait().unwrap();

    let (src, dst, mut out) = (c.filled(6.0), c.filled(-1.0), c.filled(-2.0));
    // SAFETY: the slices outlive the work: synchronized below.
    let (s, d) = unsafe { ([c.raw(&src)], [c.raw(&dst)]) };
    c.client.submit(|_| std::thread::sleep(Duration::from_millis(50))).unwrap();
    let started = Instant::now();
    c.on_stream().all_reduce(&s, &d, ReduceOp::Sum).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(20), "the call did not go through the busy device thread");
    c.copy(&mut out, &dst);
    let copied = c.stream.clone_dtoh(&out).unwrap();
    assert!(copied.iter().all(|&x| x == 6.0), "the caller's kernel ran before the all-reduce: {:?}", &copied[..4]);
    c.client.sync().unwrap();
    c.stream.synchronize().unwrap();
}

/// The issue's zero-copy proof on CUDA: an in-place all-reduce (one-rank
/// NCCL) on a cudarc allocation keeps its address and makes no allocation
/// of cohort's; `into_owner` gives the same `CudaSlice` back.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn an_in_place_all_reduce_on_a_cudarc_allocation_copies_nothing() {
    let c = caller();
    let slice = c.filled(3.0);
    let address = c.address(&slice);
    c.client.memory_cleanup().unwrap();
    let before = c.client.memory_usage().unwrap();
    let buf = [Buffer::from_cuda_slice(&c.client, slice).unwrap()];
    assert_eq!(c.client.device_address(buf[0].handle()).unwrap(), address, "the buffer is the allocation");
    c.group.all_reduce(&buf, &buf, ReduceOp::Sum).unwrap().wait().unwrap();
    c.group.all_reduce(&buf, &buf, ReduceOp::Max).unwrap().wait().unwrap();
    assert_eq!(c.client.memory_usage().unwrap(), before, "no allocation of cohort's");
    let [buf] = buf;
    let back: CudaSlice<f32> = buf.into_owner().unwrap();
    assert_eq!(c.address(&back), address, "the same allocation back");
    assert!(c.stream.clone_dtoh(&back).unwrap().iter().all(|&x| x == 3.0));
}

/// `with_cuda_slice`: the caller's writes before the call are seen, the
/// results are in the slice after, a clone kept past the scope fails
/// cleanly, and a DLPack export inside the scope is refused (the tensor
/// would name the slice after the borrow ended).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn with_cuda_slice_lends_the_slice_for_the_scope_only() {
    let c = caller();
    let mut slice = c.filled(0.0);
    c.spin_fill(&mut slice, 4.0, Duration::from_millis(20));
    let mut kept = None;
    Buffer::with_cuda_slice(&c.client, &mut slice, |b| {
        let err = b.to_dlpack().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("only lent") && err.contains("from_cuda_slice"), "{err}");
        let b = [b.clone()];
        c.group.all_reduce(&b, &b, ReduceOp::Sum).unwrap();
        kept = Some(b);
    })
    .unwrap();
    assert!(c.stream.clone_dtoh(&slice).unwrap().iter().all(|&x| x == 4.0));
    let kept = kept.unwrap();
    assert!(kept[0].to_vec().is_err(), "a clone kept past the scope fails");
    assert!(c.group.all_reduce(&kept, &kept, ReduceOp::Sum).and_then(|w| Ok(w.wait()?)).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn memory_of_another_backend_is_refused_both_ways() {
    let c = caller();
    let err = Buffer::from_vec(&c.client, vec![1.0f32; 8]).unwrap_err().to_string();
    assert!(err.contains("host memory"), "{err}");
    let cpu = CpuRuntime::client(0).unwrap();
    let err = Buffer::from_cuda_slice(&cpu, c.filled(1.0)).unwrap_err().to_string();
    assert!(err.contains("CUDA"), "{err}");
    // An address inside no allocation of this context.
    // SAFETY: refused before anything uses it.
    let bogus = unsafe { Buffer::<f32>::from_device_ptr(&c.client, 0x1000, 4, ()) };
    assert!(bogus.is_err());
}

/// What another library's tensor left when its deleter ran.
#[derive(Default)]
struct Deleted {
    count: AtomicUsize,
}

/// Another library's device tensor: its allocation, shared with the test.
struct Allocation {
    _slice: Arc<CudaSlice<f32>>,
    deleted: Arc<Deleted>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.deleted.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// A DLPack tensor (kDLCUDA, as PyTorch or CuPy hand one over) over another
/// library's cudarc allocation, the destination of an all-reduce: the deleter runs
/// once, after the work, and the allocation holds the result.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_dlpack_tensor_over_another_librarys_allocation_takes_an_all_reduce_result() {
    let c = caller();
    let slice = Arc::new(c.filled(2.0));
    let address = c.address(&slice);
    let deleted = Arc::new(Deleted::default());
    let owner = Box::new(Allocation { _slice: slice.clone(), deleted: deleted.clone() });
    let mut tensor =
        Dynamic::new(vec![N as i64 / 4, 4], vec![4, 1]).initialize_as::<DLManagedTensorVersioned>(owner).unwrap();
    tensor.set_data(address as *mut std::ffi::c_void).set_device(DLDevice::cuda(0)).set_dtype(DLDataType::F32);
    // SAFETY: data, shape and strides stay valid until the deleter drops
    // the owner, which holds the allocation.
    let tensor = unsafe { tensor.finish() };
    let buf = [Buffer::<f32>::from_dlpack(&c.client, tensor).unwrap()];
    assert_eq!(c.client.device_address(buf[0].handle()).unwrap(), address);
    // Cohort's own buffer into the tensor, queued behind 200 ms of cohort's
    // work, and the tensor's buffer dropped at once.
    let nines = [Buffer::from_slice(&c.client, &vec![9.0f32; N]).unwrap()];
    c.busy_cohort(Duration::from_millis(200));
    c.group.all_reduce(&nines, &buf, ReduceOp::Sum).unwrap();
    drop(buf);
    assert_eq!(deleted.count.load(Ordering::SeqCst), 0, "kept while the all-reduce is queued");
    let deadline = Instant::now() + Duration::from_secs(10);
    while deleted.count.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(deleted.count.load(Ordering::SeqCst), 1, "the deleter ran once");
    c.client.sync().unwrap();
    assert_eq!(deleted.count.load(Ordering::SeqCst), 1);
    assert!(c.stream.clone_dtoh(slice.as_ref()).unwrap().iter().all(|&x| x == 9.0), "the tensor holds the result");
}
