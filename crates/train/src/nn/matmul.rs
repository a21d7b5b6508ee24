//! Where an [`super::Mlp`]'s matrix products run: the backend's vendor BLAS
//! (cuBLAS on CUDA) where it has one, the `matmul` kernel elsewhere (CPU:
//! `matrixmultiply`; wgpu: the tiled WGSL source).

use cohort_comm::{Buffer, Error};
use cohort_runtime::backend::Gemm;
use cohort_runtime::{Client, KernelArguments, ServerError};

use super::kernels::{kernels, matmul_grid, U32s};

/// How matrix products are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Matmul {
    /// The backend's BLAS where it has one (CUDA: cuBLAS; a missing
    /// libcublas is an error naming it), the `matmul` kernel elsewhere.
    #[default]
    Auto,
    /// Always the `matmul` kernel (on CUDA: the tiled CUDA C source).
    Kernels,
}

/// Whether `client`'s products go through its backend's BLAS under `choice`:
/// asks the device thread once (waits for it). An error names the library
/// that the backend has but could not load.
pub(crate) fn uses_blas(client: &Client, choice: Matmul) -> Result<bool, Error> {
    if choice == Matmul::Kernels {
        return Ok(false);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    client.submit_buffers_always("blas probe", Vec::new(), Vec::new(), move |access| {
        let answer = access.ok().and_then(|a| a.blas().map(|b| b.blas_available()));
        let _ = tx.send(answer);
        Ok(())
    })?;
    match rx.recv().ok().flatten() {
        None => Ok(false),
        Some(Ok(_)) => Ok(true),
        Some(Err(why)) => Err(Error::Device(ServerError::Backend {
            backend: client.name(),
            device: client.device_id(),
            message: format!("{why} (or build the model with Matmul::Kernels to use the slower tiled kernel)"),
        })),
    }
}

/// Queues `c (+)= op(a) · op(b)` on `client` (see [`Gemm`]).
pub(crate) fn queue(
    client: &Client,
    blas: bool,
    a: &Buffer<f32>,
    b: &Buffer<f32>,
    c: &Buffer<f32>,
    gemm: Gemm,
) -> Result<(), Error> {
    if blas {
        client.submit_buffers(
            "cublas sgemm",
            vec![a.handle().clone(), b.handle().clone()],
            vec![c.handle().clone()],
            move |access| {
                let (ba, bb, bc, stream) = (access.binding(0), access.binding(1), access.binding(2), access.stream());
                match access.blas() {
                    Some(blas) => blas.sgemm(stream, &gemm, ba, bb, bc),
                    None => {
                        Err(ServerError::InvalidState { operation: "sgemm", reason: "the backend has no BLAS".into() })
                    }
                }
            },
        )?;
        return Ok(());
    }
    let args = KernelArguments::new().buffer(a.handle()).buffer(b.handle()).buffer(c.handle()).u32s([
        gemm.m,
        gemm.n,
        gemm.k,
        usize::from(gemm.trans_a),
        usize::from(gemm.trans_b),
        usize::from(gemm.accumulate),
    ]);
    client.launch(&kernels().matmul, matmul_grid(gemm.m, gemm.n), args)?;
    Ok(())
}
