//! cuBLAS behind [`DeviceBlas`]: single-precision matrix products on the
//! task's stream, through cudarc's `cublas` bindings loaded at run time. A
//! machine without libcublas gets an error naming it, never a panic: the
//! library is probed (`is_culib_present`) before any call reaches cudarc's
//! loader, which would panic.
//!
//! One cuBLAS handle per device, kept by its backend (whichever thread runs
//! a task of the device, the device thread or a caller's running it inline,
//! has the device's context current and holds the device state's lock),
//! made on first use with the default math mode (full FP32, no TF32, as
//! PyTorch's default) and released before the context is.

use std::sync::OnceLock;

use cudarc::cublas::sys as blas;

use super::CudaBackend;
use crate::backend::{Binding, DeviceBlas, Gemm};
use crate::error::ServerError;
use crate::id::StreamId;

/// Whether libcublas loads in this process: `Ok` with its version (as
/// cuBLAS reports it, `130100` for 13.1), or why not. Probes once; never
/// panics.
pub fn cublas_version() -> Result<String, String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: loading a shared library runs its initialisers; cuBLAS's
            // are safe to run on any thread.
            if unsafe { blas::is_culib_present() } {
                Ok(())
            } else {
                Err(format!(
                    "libcublas could not be loaded (tried {}): install cuBLAS (the CUDA toolkit's libcublas.so.13) or put its folder on LD_LIBRARY_PATH",
                    cudarc::get_lib_name_candidates("cublas").join(", ")
                ))
            }
        })
        .clone()?;
    let mut version = 0;
    // SAFETY: the library is present (checked above); a null handle is allowed
    // by cublasGetVersion_v2, which writes one int.
    let status = unsafe { blas::cublasGetVersion_v2(std::ptr::null_mut(), &mut version) };
    if status == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(version.to_string())
    } else {
        Ok("unknown version".into())
    }
}

/// Destroys the device's handle, if one was made; the device's context must
/// still be current (the backend calls it before releasing the context).
pub(super) fn release(slot: &mut blas::cublasHandle_t) {
    let handle = std::mem::replace(slot, std::ptr::null_mut());
    if !handle.is_null() {
        // SAFETY: the handle was made by cublasCreate_v2 in this device's
        // context, which is still current, and is destroyed once.
        unsafe {
            let _ = blas::cublasDestroy_v2(handle);
        }
    }
}

fn status_error(device: crate::DeviceId, call: &str, status: blas::cublasStatus_t) -> ServerError {
    ServerError::KernelFailed { kernel: "cublas sgemm".into(), device, reason: format!("{call} returned {status:?}") }
}

/// The device's handle in `slot`, made on first use.
fn handle(device: crate::DeviceId, slot: &mut blas::cublasHandle_t) -> Result<blas::cublasHandle_t, ServerError> {
    if !slot.is_null() {
        return Ok(*slot);
    }
    cublas_version().map_err(|message| ServerError::Backend { backend: super::BACKEND, device, message })?;
    let mut made: blas::cublasHandle_t = std::ptr::null_mut();
    // SAFETY: the library is present (checked above) and the device's context
    // is current on this thread; the call writes one handle.
    let status = unsafe { blas::cublasCreate_v2(&mut made) };
    if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(status_error(device, "cublasCreate_v2", status));
    }
    *slot = made;
    Ok(made)
}

fn dim(device: crate::DeviceId, what: &str, value: usize) -> Result<i32, ServerError> {
    i32::try_from(value).map_err(|_| ServerError::KernelFailed {
        kernel: "cublas sgemm".into(),
        device,
        reason: format!("{what} = {value} is larger than cuBLAS's 32-bit dimensions"),
    })
}

impl DeviceBlas for CudaBackend {
    fn blas_available(&mut self) -> Result<String, String> {
        cublas_version()
    }

    fn sgemm(&mut self, stream: StreamId, gemm: &Gemm, a: Binding, b: Binding, c: Binding) -> Result<(), ServerError> {
        self.check_lost()?;
        let device = self.device;
        let shape = format!("sgemm {}×{}×{}", gemm.m, gemm.n, gemm.k);
        let Some(needs) = gemm.byte_sizes() else {
            return Err(ServerError::InvalidArgument(format!("{shape}: the operands' sizes overflow 64 bits")));
        };
        for ((name, binding), need) in [("A", a), ("B", b), ("C", c)].into_iter().zip(needs) {
            if binding.size < need {
                return Err(ServerError::InvalidArgument(format!(
                    "{shape}: {name} holds {} bytes, needs {need}",
                    binding.size
                )));
            }
        }
        if gemm.k == 0 {
            return Err(ServerError::InvalidArgument(format!(
                "{shape}: k = 0 (an empty inner dimension) is not a matrix product"
            )));
        }
        if gemm.m == 0 || gemm.n == 0 {
            return Ok(());
        }
        let (m, n, k) = (dim(device, "m", gemm.m)?, dim(device, "n", gemm.n)?, dim(device, "k", gemm.k)?);
        let (pa, pb, pc) = (self.pages.ptr(a)?, self.pages.ptr(b)?, self.pages.ptr(c)?);
        let raw = self.raw_stream(stream)?;
        let handle = handle(device, &mut self.blas_handle)?;
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B
        // first. A row-major k × n B is a column-major n × k (ld n), used as
        // is; a stored n × k B is transposed (ld k). Likewise A.
        let (op_b, ldb) = if gemm.trans_b {
            (blas::cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (blas::cublasOperation_t::CUBLAS_OP_N, n)
        };
        let (op_a, lda) = if gemm.trans_a {
            (blas::cublasOperation_t::CUBLAS_OP_T, m)
        } else {
            (blas::cublasOperation_t::CUBLAS_OP_N, k)
        };
        let (alpha, beta) = (1.0f32, if gemm.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the handle belongs to this device's context, current on the
        // thread running the task (under the state's lock); `raw` is a
        // live stream of this context; the three pointers address buffers of
        // at least the sizes the dimensions need (checked above), alive
        // until the stream's work on them ends (the runtime's pools hold
        // them); alpha and beta are read before the call returns.
        let status = unsafe {
            let status = blas::cublasSetStream_v2(handle, raw as blas::cudaStream_t);
            if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(status_error(device, "cublasSetStream_v2", status));
            }
            blas::cublasSgemm_v2(
                handle,
                op_b,
                op_a,
                n,
                m,
                k,
                &alpha,
                pb as *const f32,
                ldb,
                pa as *const f32,
                lda,
                &beta,
                pc as *mut f32,
                n,
            )
        };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            let err = status_error(device, "cublasSgemm_v2", status);
            return Err(self.classify(stream, err));
        }
        self.streams.note_launch(stream, "cublas sgemm");
        Ok(())
    }
}
