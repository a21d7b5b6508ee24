//! [`Mlp`]: a stack of `depth` fully connected layers of `width × width`
//! (ReLU between them, the last linear), one replica per local device, its
//! forward, loss and backward all queued as device kernels.

use cohort_comm::{Buffer, Error};
use cohort_runtime::{Client, KernelArguments, Scalar};

use super::grads::{GradientSink, Gradients};
use cohort_runtime::backend::Gemm;

use super::kernels::{cover, kernels, U32s, LOSS_PARTS};
use super::matmul::{queue, uses_blas, Matmul};
use super::{uniform, Parameter};
use crate::ddp::ALIGN_ELEMS;

/// The shape of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpConfig {
    /// Features of every layer's input and output.
    pub width: usize,
    /// Layers (each a `width × width` weight and a `width` bias).
    pub depth: usize,
}

impl MlpConfig {
    /// The default of the main job: 4 layers of 256 (263 k parameters),
    /// seconds per epoch on CPU devices.
    pub const SMALL: MlpConfig = MlpConfig { width: 256, depth: 4 };
    /// The large setting: 8 layers of 4096 (134 M parameters, 537 MB of
    /// f32), where gradient communication is worth hiding.
    pub const LARGE: MlpConfig = MlpConfig { width: 4096, depth: 8 };

    /// Parameters in all: `depth × (width² + width)`.
    pub fn parameters(&self) -> usize {
        self.depth * (self.width * self.width + self.width)
    }

    /// Floating-point operations of one forward and backward over `rows`
    /// samples (three matrix products of `2·rows·width²` per layer, the
    /// first layer's input gradient skipped).
    pub fn flops(&self, rows: usize) -> f64 {
        let per = 2.0 * rows as f64 * (self.width * self.width) as f64;
        per * (3 * self.depth - 1) as f64
    }

    fn check(&self) -> Result<(), Error> {
        if self.width == 0 || self.depth == 0 {
            return Err(Error::InvalidArgument(format!(
                "an MLP of width {} and depth {}: both must be at least 1",
                self.width, self.depth
            )));
        }
        if self.width.checked_mul(self.width).is_none_or(|w| w > u32::MAX as usize / 2) {
            return Err(Error::InvalidArgument(format!(
                "an MLP of width {}: a layer's weight must hold fewer than 2^31 elements",
                self.width
            )));
        }
        Ok(())
    }
}

/// One replica's device buffers.
struct Replica {
    client: Client,
    /// Products through the backend's BLAS (cuBLAS) rather than kernels.
    blas: bool,
    /// `weight, bias` per layer, in order.
    params: Vec<Buffer<f32>>,
    /// Each layer's output (`rows × width`); the last is the model's output.
    outputs: Vec<Buffer<f32>>,
    /// The gradient flowing back, and the next layer's (swapped per layer).
    delta: [Buffer<f32>; 2],
    /// Column blocks of the current gradient (each `rows × piece` at
    /// `first column × rows`), for gradients the sink splits into row pieces.
    delta_cols: Buffer<f32>,
    /// The input of the last forward.
    input: Option<Buffer<f32>>,
    /// One slot per step of the mean squared error.
    losses: Buffer<f32>,
    /// The loss's first-stage sums.
    partial: Buffer<f32>,
    /// `rows` ones: a bias's gradient is `dzᵀ · ones`, a matrix product.
    ones: Buffer<f32>,
}

/// A multi-layer perceptron, one replica per client, every replica
/// initialised alike from `seed`. Calls queue kernels on every replica and
/// return at once; reads ([`Buffer::to_vec`]) wait for them.
pub struct Mlp {
    config: MlpConfig,
    rows: usize,
    replicas: Vec<Replica>,
}

impl Mlp {
    /// An MLP on each of `clients` (their streams carry its kernels), for
    /// batches of `rows` samples per replica, with `loss_slots` slots of
    /// loss (step `s` writes slot `s % loss_slots`). Weights are uniform in
    /// ±√(6/width) (He), ±√(3/width) for the last layer; biases zero.
    pub fn new(clients: &[Client], config: MlpConfig, rows: usize, seed: u64) -> Result<Mlp, Error> {
        Mlp::with_matmul(clients, config, rows, seed, Matmul::Auto)
    }

    /// [`Mlp::new`] with the matrix products computed as `matmul` says
    /// (waits for one probe per device).
    pub fn with_matmul(
        clients: &[Client],
        config: MlpConfig,
        rows: usize,
        seed: u64,
        matmul: Matmul,
    ) -> Result<Mlp, Error> {
        config.check()?;
        if rows == 0 || rows.checked_mul(config.width).is_none_or(|n| n > u32::MAX as usize / 2) {
            return Err(Error::InvalidArgument(format!(
                "a batch of {rows} rows of width {}: use at least 1 row, and fewer than 2^31 elements",
                config.width
            )));
        }
        let w = config.width;
        let mut host = Vec::new();
        for layer in 0..config.depth {
            let bound = if layer + 1 == config.depth { (3.0 / w as f32).sqrt() } else { (6.0 / w as f32).sqrt() };
            host.push(uniform(seed, layer as u64, w * w, bound));
            host.push(vec![0.0f32; w]);
        }
        let replicas = clients
            .iter()
            .map(|client| {
                Ok(Replica {
                    client: client.clone(),
                    blas: uses_blas(client, matmul)?,
                    params: host.iter().map(|p| Buffer::from_slice(client, p)).collect::<Result<_, Error>>()?,
                    outputs: (0..config.depth).map(|_| Buffer::uninit(client, rows * w)).collect::<Result<_, _>>()?,
                    delta: [Buffer::uninit(client, rows * w)?, Buffer::uninit(client, rows * w)?],
                    delta_cols: Buffer::uninit(client, rows * w)?,
                    input: None,
                    losses: Buffer::zeros(client, 1)?,
                    partial: Buffer::zeros(client, LOSS_PARTS)?,
                    ones: Buffer::from_slice(client, &vec![1.0f32; rows])?,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(Mlp { config, rows, replicas })
    }

    pub fn config(&self) -> MlpConfig {
        self.config
    }

    /// Samples per replica per step.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Local replicas (one per client).
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Every parameter in order (`layers.<l>.weight` `[width, width]`, then
    /// `layers.<l>.bias` `[width]`, per layer), with its buffer on every
    /// replica.
    pub fn parameters(&self) -> Vec<Parameter> {
        let w = self.config.width;
        (0..2 * self.config.depth)
            .map(|i| Parameter {
                name: format!("layers.{}.{}", i / 2, if i % 2 == 0 { "weight" } else { "bias" }),
                shape: if i % 2 == 0 { vec![w, w] } else { vec![w] },
                replicas: self.replicas.iter().map(|r| r.params[i].clone()).collect(),
            })
            .collect()
    }

    /// The output of the last forward on replica `replica` (`rows × width`).
    pub fn output(&self, replica: usize) -> &Buffer<f32> {
        &self.replicas[replica].outputs[self.config.depth - 1]
    }

    /// The loss slots of replica `replica`.
    pub fn losses(&self, replica: usize) -> &Buffer<f32> {
        &self.replicas[replica].losses
    }

    /// Gives every replica `slots` loss slots, zeroed.
    pub fn set_loss_slots(&mut self, slots: usize) -> Result<(), Error> {
        for r in &mut self.replicas {
            r.losses = Buffer::zeros(&r.client, slots.max(1))?;
        }
        Ok(())
    }

    /// Queues the forward pass of `inputs` (one `rows × width` buffer per
    /// replica).
    pub fn forward(&mut self, inputs: &[Buffer<f32>]) -> Result<(), Error> {
        if inputs.len() != self.replicas.len() || inputs.iter().any(|x| x.len() != self.rows * self.config.width) {
            return Err(Error::InvalidArgument(format!(
                "forward takes {} inputs of {} × {} floats (one per replica); got {} of lengths {:?}",
                self.replicas.len(),
                self.rows,
                self.config.width,
                inputs.len(),
                inputs.iter().map(Buffer::len).collect::<Vec<_>>()
            )));
        }
        let (w, rows, depth) = (self.config.width, self.rows, self.config.depth);
        let k = kernels();
        for (r, x) in self.replicas.iter_mut().zip(inputs) {
            r.input = Some(x.clone());
            for layer in 0..depth {
                let input = if layer == 0 { x } else { &r.outputs[layer - 1] };
                let out = &r.outputs[layer];
                let gemm = Gemm { m: rows, n: w, k: w, trans_a: false, trans_b: true, accumulate: false };
                queue(&r.client, r.blas, input, &r.params[2 * layer], out, gemm)?;
                let relu = u32::from(layer + 1 < depth);
                let args = KernelArguments::new()
                    .buffer(out.handle())
                    .buffer(r.params[2 * layer + 1].handle())
                    .u32s([rows * w, w])
                    .scalar(Scalar::U32(relu));
                r.client.launch(&k.bias_act, cover(rows * w), args)?;
            }
        }
        Ok(())
    }

    /// Queues the mean squared error against `targets` (into loss slot
    /// `slot`) and the backward pass, accumulating every parameter's
    /// gradient into `grads` and telling it as each is complete, last layer
    /// first. Call after [`Mlp::forward`].
    pub fn backward(
        &mut self,
        targets: &[Buffer<f32>],
        slot: usize,
        grads: &mut impl GradientSink,
    ) -> Result<(), Error> {
        let (w, rows, depth) = (self.config.width, self.rows, self.config.depth);
        let count = rows * w;
        if targets.len() != self.replicas.len() || targets.iter().any(|t| t.len() != count) {
            return Err(Error::InvalidArgument(format!(
                "backward takes {} targets of {rows} × {w} floats (one per replica)",
                self.replicas.len()
            )));
        }
        let k = kernels();
        for (r, t) in self.replicas.iter().zip(targets) {
            if r.input.is_none() {
                return Err(Error::InvalidArgument("backward before forward: run forward first".into()));
            }
            let slot = slot % r.losses.len();
            let y = &r.outputs[depth - 1];
            let args =
                KernelArguments::new().buffer(y.handle()).buffer(t.handle()).buffer(r.partial.handle()).u32s([count]);
            r.client.launch(&k.mse_partial, cohort_runtime::GridCount::Static(LOSS_PARTS as u32, 1, 1), args)?;
            let args = KernelArguments::new().buffer(r.partial.handle()).buffer(r.losses.handle()).u32s([count, slot]);
            r.client.launch(&k.mse_loss, cohort_runtime::GridCount::Static(1, 1, 1), args)?;
            let args = KernelArguments::new()
                .buffer(y.handle())
                .buffer(t.handle())
                .buffer(r.delta[0].handle())
                .scalar(Scalar::U32(count as u32))
                .scalar(Scalar::F32(2.0 / count as f32));
            r.client.launch(&k.mse_grad, cover(count), args)?;
        }
        let mut current = 0;
        for layer in (0..depth).rev() {
            let (weight, bias) = (2 * layer, 2 * layer + 1);
            for idx in [weight, bias] {
                if grads.pieces(idx).len() > 1 {
                    check_pieces(grads, idx, w, rows)?;
                }
            }
            // The bias first, then the weight: backward reports parameters
            // in reverse registration order (the order of the buckets).
            // db += dzᵀ · ones: [width × rows] · [rows × 1].
            // dW += dzᵀ · input: [width × rows] · [rows × width].
            for (idx, cols) in [(bias, 1), (weight, w)] {
                let pieces = grads.pieces(idx).len();
                for p in 0..pieces {
                    for (i, r) in self.replicas.iter().enumerate() {
                        let other = if idx == bias {
                            &r.ones
                        } else if layer == 0 {
                            r.input.as_ref().expect("checked above")
                        } else {
                            &r.outputs[layer - 1]
                        };
                        let piece = &grads.pieces(idx)[p];
                        let out = &piece.replicas[i];
                        if pieces == 1 {
                            let gemm = Gemm { m: w, n: cols, k: rows, trans_a: true, trans_b: false, accumulate: true };
                            queue(&r.client, r.blas, &r.delta[current], other, out, gemm)?;
                        } else {
                            // Rows r0..r1 of the gradient are dz[:, r0..r1]ᵀ ·
                            // other: the same product on columns r0..r1 of dz
                            // (copied out, contiguous), the same dot products.
                            let (r0, r1) = (piece.range.start / cols, piece.range.end / cols);
                            let block = r.delta_cols.slice(r0 * rows..r1 * rows)?;
                            let args = KernelArguments::new()
                                .buffer(r.delta[current].handle())
                                .buffer(block.handle())
                                .u32s([rows, w, r0, r1 - r0]);
                            r.client.launch(&k.columns, cover(rows * (r1 - r0)), args)?;
                            let gemm =
                                Gemm { m: r1 - r0, n: cols, k: rows, trans_a: true, trans_b: false, accumulate: true };
                            queue(&r.client, r.blas, &block, other, out, gemm)?;
                        }
                    }
                    if pieces == 1 {
                        grads.ready(idx)?;
                    } else {
                        grads.ready_piece(idx, p)?;
                    }
                }
            }
            if layer == 0 {
                break;
            }
            for r in &self.replicas {
                // d(input) = dz · W, masked by the ReLU that made the input.
                let next = &r.delta[1 - current];
                let gemm = Gemm { m: rows, n: w, k: w, trans_a: false, trans_b: false, accumulate: false };
                queue(&r.client, r.blas, &r.delta[current], &r.params[2 * layer], next, gemm)?;
                let args = KernelArguments::new()
                    .buffer(next.handle())
                    .buffer(r.outputs[layer - 1].handle())
                    .scalar(Scalar::U32(count as u32));
                r.client.launch(&k.relu_grad, cover(count), args)?;
            }
            current = 1 - current;
        }
        Ok(())
    }
}

/// Checks that the sink cut parameter `index` (`width` rows) where the
/// model can compute each piece as a row chunk: whole rows, each piece's
/// first row a multiple of [`ALIGN_ELEMS`] columns of the gradient flowing
/// back (its block of those columns, `rows` elements per column, then starts
/// on an aligned element and can be bound on every backend).
fn check_pieces(grads: &impl Gradients, index: usize, width: usize, rows: usize) -> Result<(), Error> {
    let pieces = grads.pieces(index);
    let numel = pieces.last().map_or(0, |p| p.range.end);
    let cols = numel / width;
    for p in pieces {
        let (start, end) = (p.range.start, p.range.end);
        if cols == 0
            || !start.is_multiple_of(cols)
            || !end.is_multiple_of(cols)
            || !(start / cols * rows).is_multiple_of(ALIGN_ELEMS)
        {
            return Err(Error::InvalidArgument(format!(
                "Mlp::backward: the gradient sink splits parameter {index} at elements {start}..{end}: pieces must be whole rows of {cols} elements, starting at a multiple of {} rows",
                ALIGN_ELEMS
            )));
        }
    }
    Ok(())
}
