//! A model worth measuring, on device kernels: [`Mlp`] (configurable width
//! and depth; [`MlpConfig::LARGE`] is 8 × 4096, 134 M parameters), its
//! gradients ([`GradientSink`]), SGD with momentum ([`Sgd`]) and synthetic
//! data from a teacher network ([`TeacherData`]).
//!
//! Every step runs on the devices: matrix products (CPU: `matrixmultiply`;
//! CUDA and wgpu: tiled kernels), bias and ReLU, the loss and its gradient,
//! the optimizer. Each kernel sums in a fixed order, so replicas given the
//! same gradients stay bit-identical.

mod data;
mod grads;
pub mod kernels;
mod matmul;
mod mlp;
mod optim;

use cohort_comm::Buffer;

pub use data::TeacherData;
pub(crate) use grads::zero as grads_zero;
pub use grads::{GradientPiece, GradientSink, Gradients, LocalGradients};
pub use matmul::Matmul;
pub use mlp::{Mlp, MlpConfig};
pub use optim::Sgd;

/// A named parameter with its buffer on every local replica.
#[derive(Debug, Clone)]
pub struct Parameter {
    /// Its name (`layers.0.weight`), used in errors.
    pub name: String,
    /// Its shape; the buffers hold the product of it.
    pub shape: Vec<usize>,
    /// One buffer per local replica (client order).
    pub replicas: Vec<Buffer<f32>>,
}

impl Parameter {
    /// Elements (the product of the shape).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A deterministic pseudo-random number in [-1, 1) from `seed` (splitmix64).
pub fn noise(seed: u64) -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x2545_F491_4F6C_DD1D);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// `len` numbers uniform in ±`bound`, stream `stream` of `seed`.
pub(crate) fn uniform(seed: u64, stream: u64, len: usize, bound: f32) -> Vec<f32> {
    let base = seed.wrapping_mul(0x1000_0000_01B3) ^ stream.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (0..len as u64).map(|i| bound * noise(base.wrapping_add(i))).collect()
}
