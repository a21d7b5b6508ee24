//! Where backward writes gradients: a [`GradientSink`] gives a buffer per
//! parameter and local replica and is told when a parameter's gradient is
//! complete. [`LocalGradients`] keeps them apart (no communication);
//! [`crate::ddp::DistributedDataParallel`] keeps them in flat buckets and
//! all-reduces a bucket the moment its last gradient is written.

use cohort_comm::{Buffer, Collectives, Error, ReduceOp, Work};
use cohort_runtime::{KernelArguments, Scalar};

use super::kernels::{cover, kernels};
use super::Parameter;

/// Gradients to read, one buffer per parameter and local replica.
pub trait Gradients {
    /// The gradient buffers of parameter `index` (registration order), one
    /// per local replica; each as long as the parameter.
    fn gradient(&self, index: usize) -> &[Buffer<f32>];
}

/// Gradients backward accumulates into (`+=`; each sink's own `zero_grad`
/// clears them).
pub trait GradientSink: Gradients {
    /// Called once the kernels that write parameter `index`'s gradient are
    /// queued on every local replica (backward calls it in the order it
    /// produces gradients: last layer first). Returns at once.
    fn ready(&mut self, index: usize) -> Result<(), Error>;
}

/// One gradient buffer per parameter and replica, with no communication: a
/// one-device run, or the reference that all-reduces after the whole
/// backward ([`LocalGradients::all_reduce`]).
pub struct LocalGradients {
    grads: Vec<Vec<Buffer<f32>>>,
}

impl LocalGradients {
    /// Zeroed gradients for `params`, on the clients (and streams) of their
    /// replicas.
    pub fn new(params: &[Parameter]) -> Result<LocalGradients, Error> {
        let grads = params
            .iter()
            .map(|p| p.replicas.iter().map(|r| Buffer::zeros(r.client(), r.len())).collect::<Result<Vec<_>, _>>())
            .collect::<Result<_, _>>()?;
        Ok(LocalGradients { grads })
    }

    /// Averages every gradient over `world`'s members, one all-reduce per
    /// parameter, all queued now.
    pub fn all_reduce(&self, world: &impl Collectives) -> Result<Vec<Work>, Error> {
        self.grads.iter().map(|g| world.all_reduce(g, g, ReduceOp::Avg)).collect()
    }

    /// Sets every gradient to zero (queued on the replicas' streams).
    pub fn zero_grad(&self) -> Result<(), Error> {
        for g in self.grads.iter().flatten() {
            zero(g)?;
        }
        Ok(())
    }
}

impl Gradients for LocalGradients {
    fn gradient(&self, index: usize) -> &[Buffer<f32>] {
        &self.grads[index]
    }
}

impl GradientSink for LocalGradients {
    fn ready(&mut self, _index: usize) -> Result<(), Error> {
        Ok(())
    }
}

/// Queues `buffer = 0` on its client's stream.
pub(crate) fn zero(buffer: &Buffer<f32>) -> Result<(), Error> {
    let args = KernelArguments::new()
        .buffer(buffer.handle())
        .scalar(Scalar::U32(buffer.len() as u32))
        .scalar(Scalar::F32(0.0));
    buffer.client().launch(&kernels().fill, cover(buffer.len()), args)?;
    Ok(())
}
