//! Where backward writes gradients: a [`GradientSink`] gives each
//! parameter's gradient as pieces (element ranges, one buffer per local
//! replica each) and is told when a piece is complete. [`LocalGradients`]
//! keeps each gradient whole (no communication);
//! [`crate::ddp::DistributedDataParallel`] keeps them in flat buckets, may
//! split a parameter larger than a bucket across buckets, and all-reduces a
//! bucket the moment its last piece is written.

use std::ops::Range;

use cohort_comm::{Buffer, Collectives, Error, ReduceOp, Work};
use cohort_runtime::{KernelArguments, Scalar};

use super::kernels::{cover, kernels};
use super::Parameter;

/// Elements `range` of a parameter's gradient, one buffer per local replica
/// (each `range.len()` long).
#[derive(Debug, Clone)]
pub struct GradientPiece {
    pub range: Range<usize>,
    pub replicas: Vec<Buffer<f32>>,
}

/// Gradients to read, as pieces per parameter and local replica.
pub trait Gradients {
    /// The pieces of parameter `index`'s gradient (registration order), in
    /// element order, covering the parameter: one piece unless the sink
    /// splits it.
    fn pieces(&self, index: usize) -> &[GradientPiece];

    /// Parameter `index`'s gradient on local replica `replica`, read back
    /// to the host (waits for the work that writes it).
    fn gradient_to_vec(&self, index: usize, replica: usize) -> Result<Vec<f32>, Error> {
        let mut out = Vec::new();
        for piece in self.pieces(index) {
            out.extend(piece.replicas[replica].to_vec()?);
        }
        Ok(out)
    }
}

/// Gradients backward accumulates into (`+=`; each sink's own `zero_grad`
/// clears them). Backward reports each parameter's gradient once per pass,
/// either whole ([`GradientSink::ready`]) or piece by piece
/// ([`GradientSink::ready_piece`]), in the order it produces them.
pub trait GradientSink: Gradients {
    /// Called once the kernels that write every piece of parameter
    /// `index`'s gradient are queued on every local replica. Returns at once.
    fn ready(&mut self, index: usize) -> Result<(), Error>;

    /// Called once the kernels that write piece `piece` (of
    /// [`Gradients::pieces`]) of parameter `index`'s gradient are queued on
    /// every local replica. Returns at once.
    fn ready_piece(&mut self, index: usize, piece: usize) -> Result<(), Error>;
}

/// One gradient buffer per parameter and replica, with no communication: a
/// one-device run, or the reference that all-reduces after the whole
/// backward ([`LocalGradients::all_reduce`]).
pub struct LocalGradients {
    grads: Vec<[GradientPiece; 1]>,
}

impl LocalGradients {
    /// Zeroed gradients for `params`, on the clients (and streams) of their
    /// replicas.
    pub fn new(params: &[Parameter]) -> Result<LocalGradients, Error> {
        let grads = params
            .iter()
            .map(|p| {
                let replicas =
                    p.replicas.iter().map(|r| Buffer::zeros(r.client(), r.len())).collect::<Result<Vec<_>, _>>()?;
                Ok([GradientPiece { range: 0..p.numel(), replicas }])
            })
            .collect::<Result<_, Error>>()?;
        Ok(LocalGradients { grads })
    }

    /// Parameter `index`'s gradient buffers, one per replica.
    pub fn gradient(&self, index: usize) -> &[Buffer<f32>] {
        &self.grads[index][0].replicas
    }

    /// Averages every gradient over `world`'s members, one all-reduce per
    /// parameter, all queued now.
    pub fn all_reduce(&self, world: &impl Collectives) -> Result<Vec<Work>, Error> {
        self.grads.iter().map(|[g]| world.all_reduce(&g.replicas, &g.replicas, ReduceOp::Avg)).collect()
    }

    /// Sets every gradient to zero (queued on the replicas' streams).
    pub fn zero_grad(&self) -> Result<(), Error> {
        for [g] in &self.grads {
            for buffer in &g.replicas {
                zero(buffer)?;
            }
        }
        Ok(())
    }
}

impl Gradients for LocalGradients {
    fn pieces(&self, index: usize) -> &[GradientPiece] {
        &self.grads[index]
    }
}

impl GradientSink for LocalGradients {
    fn ready(&mut self, _index: usize) -> Result<(), Error> {
        Ok(())
    }

    fn ready_piece(&mut self, _index: usize, _piece: usize) -> Result<(), Error> {
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
