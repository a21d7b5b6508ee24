//! Raw CUDA beside cohort, for the benches' baselines: a kernel loaded
//! from PTX on the primary context of GPU 0, with a stream of its own,
//! launched one block at a time by plain `cuLaunchKernel`. Included by the
//! examples (`#[path]`), not an example itself.

#![allow(dead_code)]

use std::ffi::{c_void, CString};

use cohort::runtime::backend::cuda::cudarc;
use cudarc::driver::sys;

/// Panics naming `what` unless `code` is success.
pub fn ok(code: sys::CUresult, what: &str) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// Raw CUDA state on the bench's thread: the primary context, a stream and
/// the scale kernel loaded from PTX.
pub struct Raw {
    pub stream: sys::CUstream,
    pub function: sys::CUfunction,
}

impl Raw {
    pub fn new(source: &str) -> Self {
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
            Self { stream, function }
        }
    }

    pub fn launch(&self, ptr: sys::CUdeviceptr, len: u64, stream: sys::CUstream) {
        let (mut p, mut l, mut f) = (ptr, len, 1.0f32);
        let mut params =
            [(&mut p as *mut u64).cast::<c_void>(), (&mut l as *mut u64).cast(), (&mut f as *mut f32).cast()];
        // SAFETY: a loaded function and three parameters of its types.
        ok(
            unsafe {
                sys::cuLaunchKernel(
                    self.function,
                    1,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "launch",
        );
    }

    pub fn sync(&self) {
        // SAFETY: our live stream.
        ok(unsafe { sys::cuStreamSynchronize(self.stream) }, "sync");
    }
}
