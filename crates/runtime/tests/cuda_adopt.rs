//! Device memory another library allocated (cudarc here), adopted by the
//! CUDA client of its GPU (`Client::adopt`): used in place, no cohort
//! allocation, given back whole; and memory of another context, host
//! memory or a range past the allocation refused, naming why. Needs a CUDA
//! GPU.

#![cfg(feature = "cuda")]

use cohort_runtime::{Access, Bytes, CudaRuntime, ForeignMemory, Runtime};
use cudarc::driver::{sys, CudaContext, CudaSlice, DevicePtr};

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn float_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The device address of a cudarc slice (its stream's pending work on it
/// is waited for when the guard drops, at once here).
fn address(slice: &CudaSlice<f32>, stream: &cudarc::driver::CudaStream) -> u64 {
    let (ptr, _synced) = slice.device_ptr(stream);
    ptr
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_cudarc_allocation_is_used_in_place_and_given_back_whole() {
    let client = CudaRuntime::client(0).expect("CUDA device 0");
    // cudarc's default: the primary context of GPU 0, as cohort's.
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let slice = stream.clone_htod(&data).unwrap();
    stream.synchronize().unwrap();
    let ptr = address(&slice, &stream);

    let usage = client.memory_usage().unwrap();
    let memory = ForeignMemory::Cuda { ptr, len: 1024 };
    // SAFETY: the slice moves into the owner, which the handle keeps alive;
    // nothing else uses it until it is reclaimed.
    let handle = unsafe { client.adopt(memory, Box::new(slice), Access::ReadWrite) }.unwrap();
    assert_eq!(client.device_address(&handle).unwrap(), ptr, "the cudarc allocation itself");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), data, "cohort reads what cudarc wrote");

    let doubled: Vec<f32> = data.iter().map(|x| x * 2.0).collect();
    client.write(&handle, Bytes::from_slice(&float_bytes(&doubled))).unwrap();
    client.sync().unwrap();
    assert_eq!(client.memory_usage().unwrap(), usage, "no cohort allocation");

    let owner = client.reclaim(handle).map_err(|(_, e)| e).unwrap();
    let slice = owner.downcast::<CudaSlice<f32>>().expect("the slice that was adopted");
    assert_eq!(address(&slice, &stream), ptr);
    assert_eq!(stream.clone_dtoh(&*slice).unwrap(), doubled, "cudarc reads cohort's write in its own memory");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn memory_the_device_cannot_use_is_refused_naming_why() {
    let client = CudaRuntime::client(0).expect("CUDA device 0");
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let slice = stream.alloc_zeros::<f32>(256).unwrap();
    let ptr = address(&slice, &stream);
    // SAFETY (each adopt below): refused before the memory is touched.
    let adopt = |memory| unsafe { client.adopt(memory, Box::new(()), Access::ReadWrite) };

    let err = adopt(ForeignMemory::Cuda { ptr, len: 1024 + 4 }).unwrap_err().to_string();
    assert!(err.contains("does not hold"), "a range past the allocation: {err}");
    let err = adopt(ForeignMemory::Cuda { ptr: 0, len: 16 }).unwrap_err().to_string();
    assert!(err.contains("null"), "{err}");
    adopt(ForeignMemory::Cuda { ptr: ptr + 512, len: 512 }).expect("the second half of the allocation");

    // Pinned host memory, and pageable host memory the driver does not know.
    ctx.bind_to_thread().unwrap();
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: allocates 1 KiB of pinned host memory in the current context.
    assert_eq!(unsafe { sys::cuMemAllocHost_v2(&mut host, 1024) }, sys::CUresult::CUDA_SUCCESS);
    let err = adopt(ForeignMemory::Cuda { ptr: host as u64, len: 1024 }).unwrap_err().to_string();
    assert!(err.contains("host memory"), "{err}");
    // SAFETY: allocated above, freed once.
    unsafe { sys::cuMemFreeHost(host) };
    let pageable = vec![0u128; 64];
    let err = adopt(ForeignMemory::Cuda { ptr: pageable.as_ptr() as u64, len: 1024 }).unwrap_err().to_string();
    assert!(err.contains("does not know this pointer"), "{err}");

    // Memory of another context of the same GPU.
    let mut gpu: sys::CUdevice = 0;
    let mut other: sys::CUcontext = std::ptr::null_mut();
    let mut foreign: sys::CUdeviceptr = 0;
    // SAFETY: a new context made current, 1 KiB allocated in it, and the
    // context popped; undone below.
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut gpu, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuCtxCreate_v4(&mut other, std::ptr::null_mut(), 0, gpu), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemAlloc_v2(&mut foreign, 1024), sys::CUresult::CUDA_SUCCESS);
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), sys::CUresult::CUDA_SUCCESS);
    }
    let err = adopt(ForeignMemory::Cuda { ptr: foreign, len: 1024 }).unwrap_err().to_string();
    assert!(err.contains("another CUDA context"), "{err}");
    // SAFETY: frees the allocation in its context, then destroys it.
    unsafe {
        sys::cuCtxPushCurrent_v2(other);
        sys::cuMemFree_v2(foreign);
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        sys::cuCtxPopCurrent_v2(&mut popped);
        sys::cuCtxDestroy_v2(other);
    }
    drop(slice);
}

/// The owner of memory whose last handle went while a kernel ran on it
/// (on a stream that never allocated) is dropped only after the kernel:
/// its drop reads the flag the kernel writes last.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn the_owner_is_dropped_after_the_kernel_queued_on_its_memory() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cohort_runtime::{GridCount, Kernel, KernelArguments, StreamId};

    struct Owner {
        ctx: Arc<CudaContext>,
        ptr: u64,
        _slice: CudaSlice<f32>,
        seen: Arc<AtomicU32>,
    }
    impl Drop for Owner {
        fn drop(&mut self) {
            let mut first = f32::NAN;
            // SAFETY: reads 4 bytes of the live slice; synchronous on the
            // legacy stream, which does not wait for cohort's non-blocking
            // streams: it sees what the kernel wrote by now. (A failure
            // leaves NaN, which the test reports.)
            unsafe {
                if self.ctx.bind_to_thread().is_ok() {
                    let _ = sys::cuMemcpyDtoH_v2((&mut first as *mut f32).cast(), self.ptr, 4);
                }
            }
            self.seen.store(first.to_bits() | 1 << 31, Ordering::SeqCst);
        }
    }

    // A stream of its own that never allocates.
    let client = CudaRuntime::client(0).expect("CUDA device 0").with_stream(StreamId::fresh());
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let slice = stream.alloc_zeros::<f32>(64).unwrap();
    stream.synchronize().unwrap();
    let ptr = address(&slice, &stream);
    let seen = Arc::new(AtomicU32::new(0));
    let owner = Owner { ctx: ctx.clone(), ptr, _slice: slice, seen: seen.clone() };
    let memory = ForeignMemory::Cuda { ptr, len: 256 };
    // SAFETY: the slice lives in the owner; nothing else writes it.
    let handle = unsafe { client.adopt(memory, Box::new(owner), Access::ReadWrite) }.unwrap();
    let slow = Kernel::new("slow_flag").with_cuda(
        r#"extern "C" __global__ void slow_flag(float* x, unsigned long long len) {
    long long start = clock64();
    while (clock64() - start < 200000000LL) {}
    x[0] = 42.0f;
}"#,
    );
    client.launch(&slow, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    drop(handle);
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the owner was never dropped");
        std::thread::sleep(Duration::from_millis(5));
    }
    let bits = seen.load(Ordering::SeqCst) & !(1 << 31);
    assert_eq!(f32::from_bits(bits), 42.0, "the owner was dropped before the kernel wrote its flag");
}
