//! [`DistributedDataParallel`]: data-parallel training as PyTorch DDP does
//! it, over any [`Collectives`] (a `ClientGroup` in one process, a
//! `Communicator` per rank under `cohort run`, `mpirun` or `srun`, or the
//! `World` that is either), with the same training loop.
//!
//! * Parameters are registered in order; their gradients live in flat
//!   bucket buffers, filled from the last parameter back (backward's order)
//!   until they hold at least their cap: the first bucket's is small
//!   ([`DdpOptions::first_bucket_bytes`], 1 MiB), the rest's
//!   [`DdpOptions::bucket_cap_bytes`] (25 MiB), as in PyTorch DDP.
//! * With [`DdpOptions::split_parameters`] ([`SplitParameters`]), a parameter larger than the cap
//!   is cut into a power of two of equal pieces (ranges of whole rows of
//!   its first dimension, multiples of [`SPLIT_ROWS`] rows) of at most the
//!   cap, each a bucket: it spans several buckets, and a model that computes
//!   its gradient piece by piece ([`GradientSink::ready_piece`]; the
//!   [`Mlp`](crate::nn::Mlp) does) has each piece's bucket all-reduced
//!   while it computes the next. The last piece backward produces is then at
//!   most one bucket, not a whole parameter.
//! * The moment backward reports a bucket's last gradient
//!   ([`GradientSink::ready`]), the bucket's all-reduce (average) is queued,
//!   while the rest of backward is still being queued.
//! * Start-up checks that every member registered the same parameters
//!   (names and shapes; an error names the rank and the parameter) with the
//!   same [`DdpOptions`] (an error names the rank and the option), and
//!   broadcasts them from member 0.
//! * [`DistributedDataParallel::no_sync`] accumulates gradients locally;
//!   [`CommHook`] compresses buckets to bf16 or fp16 for the all-reduce
//!   (parameters and the optimizer stay f32).
//! * Every replica applies the same averaged bits: replicas stay
//!   bit-identical.
//!
//! # What overlaps
//!
//! Compute goes to the clients of [`compute_clients`] (a stream of their own
//! per device, at normal priority); the collectives go through `world`, on
//! the streams of the world's clients, and so do a compressing hook's casts
//! to and from 16 bits. Build the world over [`communication_clients`] (each
//! device's client pinned to a high-priority stream of its own) and those
//! are the communication streams. Where a bucket's all-reduce needs a
//! gradient, the runtime orders it after the kernel that wrote it with a
//! fence between the two streams; the optimizer's reads wait for the
//! all-reduce the same way. On CUDA the two are two CUDA streams: NCCL runs
//! on one while the rest of backward runs on the other, and at high
//! priority the block scheduler starts NCCL's blocks before waiting GEMM
//! blocks, so a bucket's all-reduce is not starved by the backward that
//! fills the device. On the CPU and wgpu backends each device has one
//! server thread that runs its tasks in order (priorities have no effect
//! there), so a bucket's all-reduce runs between two of backward's kernels
//! on that device rather than beside them; devices still run their parts
//! concurrently.
//!
//! ```
//! use cohort_comm::{ClientGroup, Collectives};
//! use cohort_runtime::{CpuRuntime, Runtime};
//! use cohort_train::ddp::{communication_clients, compute_clients, DdpOptions, DistributedDataParallel};
//! use cohort_train::nn::{Mlp, MlpConfig, Sgd, TeacherData};
//!
//! # fn main() -> Result<(), cohort_comm::Error> {
//! let world = ClientGroup::new(communication_clients(&CpuRuntime::clients()?))?;
//! let clients = compute_clients(&world);
//! let config = MlpConfig { width: 32, depth: 2 };
//! let rows = 8;
//! let data = TeacherData::new(&clients[0], &clients, 0, world.members(), config, 7, rows * world.members(), 2)?;
//! let mut model = Mlp::new(&clients, config, rows, 1)?;
//! let params = model.parameters();
//! let mut ddp = DistributedDataParallel::new(&world, &params, DdpOptions::default())?;
//! let sgd = Sgd::new(&params, 0.01, 0.9)?;
//! for step in 0..4 {
//!     let b = step % 2;
//!     model.forward(&data.inputs[b])?;
//!     model.backward(&data.targets[b], 0, &mut ddp)?; // buckets all-reduced as they fill
//!     ddp.finish()?;
//!     sgd.step(&params, &ddp)?;
//!     ddp.zero_grad()?;
//! }
//! # Ok(())
//! # }
//! ```

mod buckets;
mod shapes;

use cohort_comm::{Buffer, Collectives, Error, ReduceOp, Work};
use cohort_runtime::{Client, KernelArguments, StreamId, StreamPriority};
use half::{bf16, f16};

use crate::nn::kernels::{cover, kernels, U32s};
use crate::nn::{GradientPiece, GradientSink, Gradients, Parameter};

pub use buckets::{plan, split_granule, BucketPlan, Place, ALIGN_ELEMS, SPLIT_ROWS};
pub use shapes::{check_same_everywhere, check_same_settings, MAX_DIMS};

/// PyTorch DDP's default bucket cap: 25 MiB.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;
/// PyTorch DDP's first bucket: 1 MiB, so the first all-reduce starts early.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// How a bucket is communicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommHook {
    /// All-reduce (average) the f32 gradients.
    #[default]
    AllReduce,
    /// Cast the bucket to bf16, all-reduce (average) that, cast back: half
    /// the bytes; each averaged gradient within 2⁻⁷ of the largest
    /// magnitude in its gradient of the f32 average (PyTorch's
    /// `bf16_compress_hook`).
    Bf16Compress,
    /// The same through IEEE fp16 (within 2⁻⁹ of the largest magnitude;
    /// values under 6·10⁻⁸ flush to zero).
    Fp16Compress,
}

/// Settings of [`DistributedDataParallel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpOptions {
    /// Bytes of f32 gradients at which a bucket is closed (PyTorch's rule:
    /// parameters are added until the bucket holds at least this much, so
    /// its last one may take it past). Default 25 MiB.
    pub bucket_cap_bytes: usize,
    /// The cap of the first bucket (the last parameters). Default 1 MiB.
    pub first_bucket_bytes: usize,
    /// How buckets are communicated.
    pub hook: CommHook,
    /// Split each parameter larger than `bucket_cap_bytes` into a power of
    /// two of equal pieces of whole rows (multiples of [`SPLIT_ROWS`]) of at
    /// most the cap, each piece a bucket of its own, instead of PyTorch's
    /// rule of whole parameters (where such a parameter is one bucket).
    /// A model that reports the pieces as it writes them
    /// ([`GradientSink::ready_piece`]) then has the first pieces'
    /// all-reduces run while it computes the rest. Default off.
    pub split_parameters: SplitParameters,
}

/// Which parameters [`DistributedDataParallel`] may cut into pieces (each
/// only when it is larger than the bucket cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitParameters {
    /// None: PyTorch's layout of whole parameters.
    #[default]
    Off,
    /// Every parameter.
    All,
    /// The first `n` registered: the last `n` backward produces, whose
    /// all-reduces are the ones left after backward ends. Products on
    /// pieces of a layer cost a little more than one product on the whole
    /// (about 4% of the 8 × 4096 MLP's step with every weight cut, on one
    /// H200), so cutting only the tail keeps most of that.
    Last(usize),
}

impl SplitParameters {
    /// Whether parameter `index` (registration order) may be cut.
    pub fn covers(self, index: usize) -> bool {
        match self {
            SplitParameters::Off => false,
            SplitParameters::All => true,
            SplitParameters::Last(n) => index < n,
        }
    }

    /// One number per choice, for the start-up check across ranks.
    fn code(self) -> u64 {
        match self {
            SplitParameters::Off => 0,
            SplitParameters::All => u64::MAX,
            SplitParameters::Last(n) => n as u64 + 1,
        }
    }
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            hook: CommHook::AllReduce,
            split_parameters: SplitParameters::Off,
        }
    }
}

/// The 16-bit copy a compressing hook all-reduces.
enum Packed {
    Bf16(Vec<Buffer<bf16>>),
    F16(Vec<Buffer<f16>>),
}

impl Packed {
    fn handle(&self, replica: usize) -> &cohort_runtime::Handle {
        match self {
            Packed::Bf16(b) => b[replica].handle(),
            Packed::F16(b) => b[replica].handle(),
        }
    }
}

struct Bucket {
    plan: BucketPlan,
    /// The flat f32 gradients, one buffer per local replica.
    flat: Vec<Buffer<f32>>,
    packed: Option<Packed>,
    /// Gradients reported ready in this backward.
    ready: usize,
    /// Its all-reduce is queued for this step.
    queued: bool,
}

/// One clone of each of `world`'s clients pinned to a stream of its own: the
/// clients a model's kernels go to, so the collectives (on the world's
/// clients' streams) can run beside them.
pub fn compute_clients(world: &impl Collectives) -> Vec<Client> {
    world.clients().iter().map(|c| c.with_stream(StreamId::fresh())).collect()
}

/// Each of `clients` pinned to a fresh high-priority stream of its own: the
/// clients to build the world over (`ClientGroup::new`, `World::join`,
/// `Communicator::from_env`), so that the buckets' all-reduces and a hook's
/// casts run on a communication stream per device that the device
/// schedules ahead of compute (CUDA; no effect on the CPU and wgpu
/// backends, see [`StreamPriority`]).
pub fn communication_clients(clients: &[Client]) -> Vec<Client> {
    clients.iter().map(|c| c.with_stream(StreamId::fresh_with_priority(StreamPriority::High))).collect()
}

/// Data-parallel gradients over `world`: see the [module](self) for what it
/// does and what overlaps where.
pub struct DistributedDataParallel<'w, C: Collectives> {
    world: &'w C,
    names: Vec<String>,
    /// Per parameter, its pieces in element order.
    places: Vec<Vec<Place>>,
    buckets: Vec<Bucket>,
    /// Per parameter, per piece: its slice of its bucket on every replica.
    grads: Vec<Vec<GradientPiece>>,
    /// Reported ready in this backward, per parameter and piece.
    seen: Vec<Vec<bool>>,
    sync: bool,
    hook: CommHook,
    works: Vec<Work>,
}

impl<'w, C: Collectives> DistributedDataParallel<'w, C> {
    /// Registers `params` (in order; each with one replica per local device
    /// of `world`, in client order) and lays out their gradient buckets
    /// (zeroed). Waits for the check that every member registered the same
    /// names and shapes (an error names the first rank and parameter that
    /// differ), then queues the broadcast of every parameter from member 0.
    pub fn new(world: &'w C, params: &[Parameter], options: DdpOptions) -> Result<Self, Error> {
        if options.bucket_cap_bytes == 0 || options.first_bucket_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "DdpOptions: bucket caps of {} and {} bytes: both must be at least 1 byte",
                options.first_bucket_bytes, options.bucket_cap_bytes
            )));
        }
        let local = world.clients();
        for p in params {
            if p.shape.len() > MAX_DIMS {
                return Err(Error::InvalidArgument(format!(
                    "parameter `{}` has {} dimensions; DistributedDataParallel takes at most {MAX_DIMS}",
                    p.name,
                    p.shape.len()
                )));
            }
            if p.replicas.len() != local.len() {
                return Err(Error::InvalidArgument(format!(
                    "parameter `{}` has {} replicas, but this process has {} devices: give one per device, in client order",
                    p.name,
                    p.replicas.len(),
                    local.len()
                )));
            }
            for (l, (r, c)) in p.replicas.iter().zip(local).enumerate() {
                if r.len() != p.numel() || r.client().service_id() != c.service_id() {
                    return Err(Error::InvalidArgument(format!(
                        "parameter `{}` (shape {:?}): its replica {l} holds {} elements on {}, but must hold {} on {} (local device {l} of the world)",
                        p.name,
                        p.shape,
                        r.len(),
                        r.client().device_id(),
                        p.numel(),
                        c.device_id()
                    )));
                }
                if p.numel() > u32::MAX as usize / 2 {
                    return Err(Error::InvalidArgument(format!(
                        "parameter `{}` holds {} elements; at most 2^31 per parameter",
                        p.name,
                        p.numel()
                    )));
                }
            }
        }
        check_same_everywhere(world, params)?;
        check_same_settings(
            world,
            &["bucket_cap_bytes", "first_bucket_bytes", "hook", "split_parameters"],
            &[
                options.bucket_cap_bytes as u64,
                options.first_bucket_bytes as u64,
                options.hook as u64,
                options.split_parameters.code(),
            ],
        )?;
        if !params.is_empty() {
            world.group(|g| params.iter().try_for_each(|p| g.broadcast(&p.replicas, &p.replicas, 0)))?;
        }
        let lens: Vec<usize> = params.iter().map(Parameter::numel).collect();
        let granules: Vec<usize> = params
            .iter()
            .enumerate()
            .map(|(i, p)| if options.split_parameters.covers(i) { split_granule(&p.shape) } else { p.numel() })
            .collect();
        let (plans, places) = plan(&lens, &granules, options.first_bucket_bytes, options.bucket_cap_bytes);
        let replica_clients: Vec<Client> = match params.first() {
            Some(p) => p.replicas.iter().map(|r| r.client().clone()).collect(),
            None => Vec::new(),
        };
        let mut buckets = Vec::with_capacity(plans.len());
        for plan in plans {
            let flat = replica_clients.iter().map(|c| Buffer::zeros(c, plan.len)).collect::<Result<Vec<_>, _>>()?;
            let packed = match options.hook {
                CommHook::AllReduce => None,
                CommHook::Bf16Compress => Some(Packed::Bf16(
                    replica_clients.iter().map(|c| Buffer::uninit(c, plan.len)).collect::<Result<_, _>>()?,
                )),
                CommHook::Fp16Compress => Some(Packed::F16(
                    replica_clients.iter().map(|c| Buffer::uninit(c, plan.len)).collect::<Result<_, _>>()?,
                )),
            };
            buckets.push(Bucket { plan, flat, packed, ready: 0, queued: false });
        }
        let grads = places
            .iter()
            .map(|pieces| {
                pieces
                    .iter()
                    .map(|place| {
                        let replicas = buckets[place.bucket]
                            .flat
                            .iter()
                            .map(|f| f.slice(place.offset..place.offset + place.len))
                            .collect::<Result<_, _>>()?;
                        Ok(GradientPiece { range: place.range(), replicas })
                    })
                    .collect::<Result<Vec<_>, Error>>()
            })
            .collect::<Result<_, _>>()?;
        Ok(DistributedDataParallel {
            world,
            names: params.iter().map(|p| p.name.clone()).collect(),
            seen: places.iter().map(|p| vec![false; p.len()]).collect(),
            sync: true,
            places,
            buckets,
            grads,
            hook: options.hook,
            works: Vec::new(),
        })
    }

    /// The buckets' pieces (`(parameter, piece)`, registration indices, in
    /// the order backward fills them) and lengths in elements.
    pub fn buckets(&self) -> Vec<BucketPlan> {
        self.buckets.iter().map(|b| b.plan.clone()).collect()
    }

    /// Where the pieces of parameter `index`'s gradient live (one piece
    /// unless parameters are split).
    pub fn places(&self, index: usize) -> &[Place] {
        &self.places[index]
    }

    /// The flat gradient buffers of bucket `bucket`, one per replica.
    pub fn bucket_gradients(&self, bucket: usize) -> &[Buffer<f32>] {
        &self.buckets[bucket].flat
    }

    /// Runs `body` with gradient synchronisation off, like PyTorch's
    /// `with ddp.no_sync()`: the backward passes in it accumulate
    /// gradients locally; the next backward outside it all-reduces the
    /// sum.
    pub fn no_sync<R>(&mut self, body: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.sync;
        self.sync = false;
        let out = body(self);
        self.sync = before;
        out
    }

    /// The collectives queued since the last [`DistributedDataParallel::zero_grad`],
    /// one per bucket in the order they were queued.
    pub fn works(&self) -> &[Work] {
        &self.works
    }

    /// Waits for every all-reduce queued since the last zero_grad.
    pub fn wait(&self) -> Result<(), Error> {
        for w in &self.works {
            w.wait()?;
        }
        Ok(())
    }

    /// Ends a backward pass: every parameter must have been reported ready
    /// (an error names the first that was not). Every bucket that filled
    /// with synchronisation on has its all-reduce queued by now; a
    /// compressing hook's cast back to f32 of those buckets is queued here,
    /// on the world's (communication) streams (buckets that filled under `no_sync` keep
    /// their local sums, whether `finish` is called inside it or after).
    /// Returns at once; the optimizer's reads of the gradients wait for the
    /// collectives.
    ///
    /// After an error the pass is dropped (its gradients are not usable):
    /// call [`DistributedDataParallel::zero_grad`] and run the backward again.
    pub fn finish(&mut self) -> Result<(), Error> {
        if let Some(missing) = self.seen.iter().position(|s| s.contains(&false)) {
            let piece = self.seen[missing].iter().position(|s| !s).unwrap_or(0);
            let err = Error::InvalidArgument(format!(
                "DistributedDataParallel: parameter {missing} `{}` got no gradient for its elements {:?} in this backward pass: every registered parameter must get one in each backward",
                self.names[missing],
                self.places[missing][piece].range()
            ));
            self.forget_pass();
            return Err(err);
        }
        self.seen.iter_mut().for_each(|s| s.fill(false));
        let decompress = &kernels().decompress;
        for bucket in &mut self.buckets {
            // Only buckets all-reduced in this pass (none under no_sync).
            if !std::mem::replace(&mut bucket.queued, false) {
                continue;
            }
            if let Some(packed) = &bucket.packed {
                for (r, flat) in bucket.flat.iter().enumerate() {
                    let args = KernelArguments::new()
                        .buffer(packed.handle(r))
                        .buffer(flat.handle())
                        .u32s([bucket.plan.len, format_of(self.hook)]);
                    // On the communication stream, behind the all-reduce.
                    self.world.clients()[r].launch(decompress, cover(bucket.plan.len / 2), args)?;
                }
            }
        }
        Ok(())
    }

    /// Sets every gradient to zero (queued on the compute streams), ready
    /// for the next accumulation; a backward pass left unfinished is
    /// forgotten.
    pub fn zero_grad(&mut self) -> Result<(), Error> {
        self.forget_pass();
        for bucket in &self.buckets {
            for flat in &bucket.flat {
                crate::nn::grads_zero(flat)?;
            }
        }
        self.works.clear();
        Ok(())
    }

    /// Forgets which parameters and buckets this backward pass reported, so
    /// that the next pass starts clean.
    fn forget_pass(&mut self) {
        self.seen.iter_mut().for_each(|s| s.fill(false));
        for bucket in &mut self.buckets {
            bucket.ready = 0;
            bucket.queued = false;
        }
    }

    fn queue(&mut self, b: usize) -> Result<(), Error> {
        let bucket = &mut self.buckets[b];
        let work = match &bucket.packed {
            None => self.world.all_reduce(&bucket.flat, &bucket.flat, ReduceOp::Avg)?,
            Some(packed) => {
                let compress = &kernels().compress;
                for (r, flat) in bucket.flat.iter().enumerate() {
                    let args = KernelArguments::new()
                        .buffer(flat.handle())
                        .buffer(packed.handle(r))
                        .u32s([bucket.plan.len, format_of(self.hook)]);
                    // On the communication stream (ordered after the
                    // gradients' writes by a fence), not behind backward.
                    self.world.clients()[r].launch(compress, cover(bucket.plan.len / 2), args)?;
                }
                match packed {
                    Packed::Bf16(p) => self.world.all_reduce(p, p, ReduceOp::Avg)?,
                    Packed::F16(p) => self.world.all_reduce(p, p, ReduceOp::Avg)?,
                }
            }
        };
        bucket.queued = true;
        self.works.push(work);
        Ok(())
    }
}

fn format_of(hook: CommHook) -> usize {
    usize::from(hook == CommHook::Fp16Compress)
}

impl<C: Collectives> Gradients for DistributedDataParallel<'_, C> {
    fn pieces(&self, index: usize) -> &[GradientPiece] {
        &self.grads[index]
    }
}

impl<C: Collectives> DistributedDataParallel<'_, C> {
    /// Marks piece `piece` of parameter `index` ready; when it completes its
    /// bucket (and synchronisation is on), queues the bucket's all-reduce.
    fn mark(&mut self, index: usize, piece: usize) -> Result<(), Error> {
        let Some(seen) = self.seen.get_mut(index) else {
            return Err(Error::InvalidArgument(format!(
                "DistributedDataParallel: parameter {index} reported ready, but {} are registered",
                self.names.len()
            )));
        };
        let pieces = seen.len();
        let Some(seen) = seen.get_mut(piece) else {
            return Err(Error::InvalidArgument(format!(
                "DistributedDataParallel: piece {piece} of parameter {index} `{}` reported ready, but its gradient has {pieces} piece(s)",
                self.names[index]
            )));
        };
        if std::mem::replace(seen, true) {
            return Err(Error::InvalidArgument(format!(
                "DistributedDataParallel: parameter {index} `{}` (elements {:?}) reported ready twice in one backward pass (call finish() after each backward)",
                self.names[index],
                self.places[index][piece].range()
            )));
        }
        let b = self.places[index][piece].bucket;
        let bucket = &mut self.buckets[b];
        bucket.ready += 1;
        if bucket.ready == bucket.plan.pieces.len() {
            bucket.ready = 0;
            if self.sync {
                self.queue(b)?;
            }
        }
        Ok(())
    }
}

impl<C: Collectives> GradientSink for DistributedDataParallel<'_, C> {
    /// Counts every piece of parameter `index` ready; each bucket this
    /// completes (with synchronisation on) has its all-reduce queued at once.
    fn ready(&mut self, index: usize) -> Result<(), Error> {
        let pieces = self.places.get(index).map_or(1, Vec::len);
        for piece in 0..pieces {
            self.mark(index, piece)?;
        }
        Ok(())
    }

    /// Counts piece `piece` of parameter `index` ready; when it completes
    /// its bucket (with synchronisation on), queues the bucket's all-reduce.
    fn ready_piece(&mut self, index: usize, piece: usize) -> Result<(), Error> {
        self.mark(index, piece)
    }
}
