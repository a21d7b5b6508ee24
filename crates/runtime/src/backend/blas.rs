//! [`DeviceBlas`]: matrix products through a backend's vendor library
//! (cuBLAS on CUDA), for work a kernel source cannot express as fast.

use crate::error::ServerError;
use crate::id::StreamId;

use super::Binding;

/// One single-precision matrix product over row-major matrices:
/// `C = op(A) · op(B)`, or `C += op(A) · op(B)` with `accumulate`. `op(A)` is
/// `m × k` (`A` stored `m × k`, or `k × m` with `trans_a`); `op(B)` is
/// `k × n` (`B` stored `k × n`, or `n × k` with `trans_b`); `C` is `m × n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub accumulate: bool,
}

impl Gemm {
    /// Bytes each operand must hold at least (`A`, `B`, `C`), or `None` when
    /// a size does not fit in 64 bits.
    pub fn byte_sizes(&self) -> Option<[u64; 3]> {
        let bytes = |rows: usize, cols: usize| (rows as u64).checked_mul(cols as u64)?.checked_mul(4);
        Some([bytes(self.m, self.k)?, bytes(self.k, self.n)?, bytes(self.m, self.n)?])
    }
}

/// A backend's BLAS, reached through
/// [`BufferAccess::blas`](crate::BufferAccess::blas) on the device thread.
pub trait DeviceBlas {
    /// Whether the library loads here: `Ok` with its version, or an error
    /// naming the library that is missing. Never panics.
    fn blas_available(&mut self) -> Result<String, String>;

    /// Queues `gemm` on `stream` over the f32 matrices at `a`, `b` and `c`
    /// (sizes checked against the dimensions first). Returns once queued.
    fn sgemm(&mut self, stream: StreamId, gemm: &Gemm, a: Binding, b: Binding, c: Binding) -> Result<(), ServerError>;
}
