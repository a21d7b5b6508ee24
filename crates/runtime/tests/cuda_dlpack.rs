//! DLPack on CUDA: a tensor over another library's allocation (cudarc's)
//! imported with no copy, and cohort's memory exported and read back with
//! cudarc. Needs a CUDA GPU.

#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::backend::cuda::cudarc::driver::{result, CudaContext, CudaSlice};
use cohort_runtime::dlpack::dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensorVersioned};
use cohort_runtime::dlpack::dlpark::metadata::Dynamic;
use cohort_runtime::dlpack::{self, Versioned};
use cohort_runtime::{Bytes, Client, CudaRuntime, DType, GridCount, Kernel, KernelArguments, Runtime, Scalar};

fn client() -> Client {
    CudaRuntime::client(0).expect("CUDA device 0")
}

fn gpu(client: &Client) -> usize {
    client.properties().gpu.expect("a CUDA client names its GPU") as usize
}

/// Counts the deletes of a test tensor's owner.
struct Owner {
    _memory: Arc<CudaSlice<f32>>,
    deletes: Arc<AtomicUsize>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.deletes.fetch_add(1, Ordering::SeqCst);
    }
}

/// A DLPack tensor over `memory` (a cudarc allocation on `device`), as a
/// producer such as candle or CuPy would hand it over.
fn tensor_over(memory: &Arc<CudaSlice<f32>>, ptr: u64, device: DLDevice, deletes: &Arc<AtomicUsize>) -> Versioned {
    let len = memory.len();
    let owner = Box::new(Owner { _memory: memory.clone(), deletes: deletes.clone() });
    let mut tensor = Dynamic::compact([len as i64]).initialize_as::<DLManagedTensorVersioned>(owner).unwrap();
    tensor
        .set_data(std::ptr::with_exposed_provenance_mut(ptr as usize))
        .set_device(device)
        .set_dtype(DLDataType::F32)
        .set_byte_offset(0);
    // SAFETY: the owner keeps the allocation until the deleter runs.
    unsafe { tensor.finish() }
}

fn wait_deletes(deletes: &AtomicUsize, count: usize) {
    let start = Instant::now();
    while deletes.load(Ordering::SeqCst) < count && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(deletes.load(Ordering::SeqCst), count);
}

fn affine_kernel() -> Kernel {
    Kernel::new("dlpack_affine").with_cuda(
        r#"extern "C" __global__ void dlpack_affine(float* x, unsigned int n) {
            unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) x[i] = x[i] * 2.0f + 1.0f;
        }"#,
    )
}

/// A cudarc allocation handed over as a DLPack tensor: cohort names it at
/// its own address, reads it, a cohort kernel writes it in place, cudarc
/// reads the result; the deleter runs once, after the last handle.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_cudarc_allocation_imports_with_no_copy() {
    let client = client();
    let ctx = CudaContext::new(gpu(&client)).unwrap();
    let stream = ctx.default_stream();
    let n = 1000usize;
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let memory = Arc::new(stream.clone_htod(&host).unwrap());
    stream.synchronize().unwrap();
    let ptr = {
        use cohort_runtime::backend::cuda::cudarc::driver::DevicePtr;
        let (ptr, _sync) = memory.device_ptr(&stream);
        ptr
    };
    stream.synchronize().unwrap();
    let deletes = Arc::new(AtomicUsize::new(0));

    let usage = client.memory_usage().unwrap();
    let import = dlpack::import(&client, tensor_over(&memory, ptr, DLDevice::cuda(gpu(&client) as i32), &deletes))
        .expect("a cudarc allocation of this GPU");
    assert_eq!((import.dtype, &import.shape[..]), (DType::F32, &[n][..]));
    assert_eq!(client.device_address(&import.handle).unwrap(), ptr, "the same address");
    assert_eq!(client.memory_usage().unwrap(), usage, "no cohort allocation");
    let read: Vec<f32> = client.read_one(import.handle.clone()).unwrap().to_elems();
    assert_eq!(read, host, "cohort reads the producer's values");

    let args = KernelArguments::new().buffer(&import.handle).scalar(Scalar::U32(n as u32));
    client.launch(&affine_kernel(), GridCount::cover(n, 256), args).unwrap();
    client.sync().unwrap();
    let expected: Vec<f32> = host.iter().map(|x| x * 2.0 + 1.0).collect();
    assert_eq!(stream.clone_dtoh(&*memory).unwrap(), expected, "cudarc reads what cohort wrote in place");

    drop(import);
    client.sync().unwrap();
    wait_deletes(&deletes, 1);
}

/// A CUDA tensor of another GPU, or a CPU tensor, handed to a CUDA client
/// is refused naming both.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn tensors_of_another_device_are_refused_on_cuda() {
    let client = client();
    let ctx = CudaContext::new(gpu(&client)).unwrap();
    let stream = ctx.default_stream();
    let memory = Arc::new(stream.alloc_zeros::<f32>(16).unwrap());
    let ptr = {
        use cohort_runtime::backend::cuda::cudarc::driver::DevicePtr;
        let (ptr, _sync) = memory.device_ptr(&stream);
        ptr
    };
    let other_gpu = gpu(&client) as i32 + 7;
    let deletes = Arc::new(AtomicUsize::new(0));
    for (device, needle) in [
        (DLDevice::cuda(other_gpu), format!("a CUDA tensor on GPU {other_gpu} handed to cuda:0")),
        (DLDevice::CPU, "a CPU tensor handed to cuda:0".to_string()),
        (DLDevice { device_type: DLDeviceType::CUDAHOST, device_id: 0 }, "pinned host".to_string()),
    ] {
        let before = deletes.load(Ordering::SeqCst);
        let err = dlpack::import(&client, tensor_over(&memory, ptr, device, &deletes)).unwrap_err().to_string();
        assert!(err.contains(&needle), "`{err}` names `{needle}`");
        assert_eq!(deletes.load(Ordering::SeqCst), before + 1, "a refused tensor is dropped once");
    }
}

/// A cohort CUDA buffer exported: a `kDLCUDA` tensor of the client's GPU
/// at the buffer's address, which cudarc's copy reads back.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn an_exported_cuda_buffer_reads_back_with_cudarc() {
    let client = client();
    let n = 4096usize;
    let values: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let handle = client.create(Bytes::from_elems(&values));
    client.sync().unwrap();
    let exported = dlpack::export(&client, &handle, DType::F32, &[64, 64]).unwrap();
    let address = client.device_address(&handle).unwrap();
    drop(handle);
    let view = exported.validate().unwrap();
    assert_eq!(view.device(), DLDevice::cuda(gpu(&client) as i32));
    assert!(view.dtype().matches(DLDataType::F32));
    assert_eq!(view.shape(), &[64, 64]);
    assert_eq!(view.strides(), Some(&[64i64, 1][..]));
    assert_eq!(view.data_ptr() as u64, address);

    let ctx = CudaContext::new(gpu(&client)).unwrap();
    ctx.bind_to_thread().unwrap();
    let mut back = vec![0f32; n];
    // SAFETY: the exported tensor (alive) keeps the buffer; cohort's upload
    // was synced; `back` holds exactly the buffer's bytes.
    unsafe { result::memcpy_dtoh_sync(&mut back, view.data_ptr() as u64) }.unwrap();
    assert_eq!(back, values, "the consumer reads cohort's memory without cohort");
    drop(exported);
}
