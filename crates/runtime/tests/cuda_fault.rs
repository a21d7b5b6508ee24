//! A device fault, in its own process: an illegal address loses the CUDA
//! context of the device for the rest of the process. Needs a CUDA GPU.

#![cfg(feature = "cuda")]

use cohort_runtime::conformance::kernels;
use cohort_runtime::{Bytes, CudaRuntime, GridCount, Kernel, KernelArguments, Runtime, Scalar, ServerError};

fn wild_write() -> Kernel {
    Kernel::new("wild_write").with_block([1, 1, 1]).with_cuda(
        "extern \"C\" __global__ void wild_write(float* x, unsigned long long len) {\n    x[0] = 1.0f;\n    float* wild = (float*)0x10;\n    *wild = 2.0f;\n}",
    )
}

/// Both cases in one test, in this order: a sticky fault loses the device
/// for the rest of the process, so closing and reopening must come first,
/// and nothing may run beside the fault.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn close_mid_use_then_an_illegal_address() {
    device_closed_mid_use();
    illegal_address_is_reported_and_loses_the_device();
}

fn illegal_address_is_reported_and_loses_the_device() {
    let client = CudaRuntime::client(0).unwrap();
    let untouched = client.create(Bytes::from_elems(&[5.0f32; 4]));
    let written = client.create(Bytes::from_elems(&[0.0f32; 4]));
    client.sync().unwrap();
    client.launch(&wild_write(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&written)).unwrap();
    let err = client.sync().unwrap_err();
    println!("sync: {err}");
    assert!(matches!(err, ServerError::KernelFailed { .. }), "{err}");
    assert!(err.to_string().contains("wild_write"), "the fault names the kernel: {err}");
    assert!(err.to_string().contains("ILLEGAL_ADDRESS"), "{err}");
    let marked = client.check([&written]).unwrap_err();
    assert!(marked.to_string().contains("ILLEGAL_ADDRESS"), "the buffer the kernel wrote is marked: {marked}");
    let read = client.read_one(written).unwrap_err();
    assert!(read.to_string().contains("ILLEGAL_ADDRESS"), "{read}");
    client.check([&untouched]).unwrap();
    let lost = client.read_one(untouched).unwrap_err();
    assert!(lost.to_string().contains("context is lost"), "the lost context is explained: {lost}");
    // CUDA cannot recover a sticky fault inside the process: once closed,
    // the device is refused with a message that says so. The CPU runtime
    // still works.
    client.close();
    let reopen = CudaRuntime::client(0).unwrap_err();
    assert!(reopen.to_string().contains("restart the process"), "{reopen}");
    let cpu = cohort_runtime::CpuRuntime::client(0).unwrap();
    let h = cpu.create(Bytes::from_elems(&[1.0f32; 4]));
    cpu.launch(&kernels::scale(), GridCount::cover(4, 256), KernelArguments::new().buffer(&h).scalar(Scalar::F32(3.0)))
        .unwrap();
    assert_eq!(cpu.read_one(h).unwrap().to_elems::<f32>(), vec![3.0; 4]);
}

fn device_closed_mid_use() {
    cohort_runtime::conformance::device_closed_mid_use::<CudaRuntime>(CudaRuntime::client(0).unwrap());
}
