//! [`Sgd`]: stochastic gradient descent with momentum, on the device.

use cohort_comm::{Buffer, Error};
use cohort_runtime::{KernelArguments, Scalar};

use super::grads::Gradients;
use super::kernels::{cover, kernels, U32s};
use super::Parameter;

/// SGD with momentum as PyTorch computes it (`v = μ·v + g; p -= lr·v`),
/// one kernel per parameter and replica, on the parameter's stream.
pub struct Sgd {
    lr: f32,
    momentum: f32,
    velocity: Vec<Vec<Buffer<f32>>>,
}

impl Sgd {
    /// An optimizer for `params` (velocities start at zero).
    pub fn new(params: &[Parameter], lr: f32, momentum: f32) -> Result<Sgd, Error> {
        if !(lr.is_finite() && lr > 0.0 && (0.0..1.0).contains(&momentum)) {
            return Err(Error::InvalidArgument(format!(
                "SGD with lr {lr} and momentum {momentum}: lr must be a positive number and momentum in [0, 1)"
            )));
        }
        let velocity = params
            .iter()
            .map(|p| p.replicas.iter().map(|r| Buffer::zeros(r.client(), r.len())).collect::<Result<Vec<_>, _>>())
            .collect::<Result<_, _>>()?;
        Ok(Sgd { lr, momentum, velocity })
    }

    /// Queues one step of every parameter against `grads` (read after
    /// whatever writes them: an all-reduce on another stream is waited for
    /// with a fence), one kernel per piece of each gradient and replica: an
    /// element-wise update, so a split gradient gives the same bits as a
    /// whole one. Returns at once.
    pub fn step(&self, params: &[Parameter], grads: &impl Gradients) -> Result<(), Error> {
        let k = kernels();
        for (i, p) in params.iter().enumerate() {
            for piece in grads.pieces(i) {
                let whole = piece.range == (0..p.numel());
                for ((param, grad), v) in p.replicas.iter().zip(&piece.replicas).zip(&self.velocity[i]) {
                    let (param, v) = if whole {
                        (param.clone(), v.clone())
                    } else {
                        (param.slice(piece.range.clone())?, v.slice(piece.range.clone())?)
                    };
                    let args = KernelArguments::new()
                        .buffer(param.handle())
                        .buffer(grad.handle())
                        .buffer(v.handle())
                        .u32s([param.len()])
                        .scalar(Scalar::F32(self.lr))
                        .scalar(Scalar::F32(self.momentum));
                    param.client().launch(&k.sgd_momentum, cover(param.len()), args)?;
                }
            }
        }
        Ok(())
    }
}
