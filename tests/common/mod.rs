//! The scenarios every backend's DDP tests run, against references built
//! from the same kernels without DistributedDataParallel.

#![allow(dead_code)]

use cohort_comm::{Buffer, Collectives, Error};
use cohort_train::ddp::{compute_clients, DdpOptions, DistributedDataParallel, SplitParameters};
use cohort_train::nn::{Gradients, LocalGradients, Mlp, MlpConfig, Parameter, Sgd, TeacherData};

pub const CONFIG: MlpConfig = MlpConfig { width: 64, depth: 3 };
/// Rows per replica per micro-batch.
pub const ROWS: usize = 8;
pub const BATCHES: usize = 4;
pub const LR: f32 = 0.02;

/// Small caps, so the 3 layers spread over 3 buckets (a weight of 16 KiB
/// and its bias each).
pub fn small_buckets() -> DdpOptions {
    DdpOptions { bucket_cap_bytes: 8 << 10, first_bucket_bytes: 4 << 10, ..DdpOptions::default() }
}

/// A model and its data on `world`'s compute clients.
pub struct Setup {
    pub model: Mlp,
    pub params: Vec<Parameter>,
    pub data: TeacherData,
}

pub fn setup(world: &impl Collectives, seed: u64) -> Result<Setup, Error> {
    setup_with(world, CONFIG, seed)
}

pub fn setup_with(world: &impl Collectives, config: MlpConfig, seed: u64) -> Result<Setup, Error> {
    let clients = compute_clients(world);
    let data = TeacherData::new(
        &clients[0],
        &clients,
        world.first_member(),
        world.members(),
        config,
        99,
        ROWS * world.members(),
        BATCHES,
    )?;
    let mut model = Mlp::new(&clients, config, ROWS, seed)?;
    model.set_loss_slots(64)?;
    let params = model.parameters();
    Ok(Setup { model, params, data })
}

/// Every replica's parameters, as bits, parameter after parameter.
pub fn bits(params: &[Parameter]) -> Vec<Vec<u32>> {
    let replicas = params[0].replicas.len();
    (0..replicas)
        .map(|r| params.iter().flat_map(|p| p.replicas[r].to_vec().unwrap()).map(f32::to_bits).collect())
        .collect()
}

/// `steps` steps of `micro` micro-batches through DDP (no_sync for all but
/// the last); returns the replicas' parameters and every step's loss
/// (replica 0, last micro-batch).
pub fn train_ddp(
    world: &impl Collectives,
    options: DdpOptions,
    steps: usize,
    micro: usize,
) -> (Vec<Vec<u32>>, Vec<f32>) {
    train_ddp_with(world, CONFIG, options, steps, micro)
}

/// [`train_ddp`] of a model of `config`.
pub fn train_ddp_with(
    world: &impl Collectives,
    config: MlpConfig,
    options: DdpOptions,
    steps: usize,
    micro: usize,
) -> (Vec<Vec<u32>>, Vec<f32>) {
    let mut s = setup_with(world, config, 5).unwrap();
    let mut ddp = DistributedDataParallel::new(world, &s.params, options).unwrap();
    let sgd = Sgd::new(&s.params, LR, 0.9).unwrap();
    let mut batch = 0;
    for step in 0..steps {
        for m in 0..micro {
            let b = batch % BATCHES;
            batch += 1;
            s.model.forward(&s.data.inputs[b]).unwrap();
            if m + 1 < micro {
                ddp.no_sync(|ddp| -> Result<(), Error> {
                    s.model.backward(&s.data.targets[b], step, ddp)?;
                    ddp.finish()
                })
                .unwrap();
            } else {
                s.model.backward(&s.data.targets[b], step, &mut ddp).unwrap();
                ddp.finish().unwrap();
            }
        }
        sgd.step(&s.params, &ddp).unwrap();
        ddp.zero_grad().unwrap();
    }
    let losses = s.model.losses(0).to_vec().unwrap()[..steps].to_vec();
    (bits(&s.params), losses)
}

/// The reference: plain per-parameter gradients, one all-reduce per
/// parameter after the whole (accumulated) backward.
pub fn train_reference(world: &impl Collectives, steps: usize, micro: usize) -> Vec<Vec<u32>> {
    train_reference_with(world, CONFIG, steps, micro)
}

/// [`train_reference`] of a model of `config`.
pub fn train_reference_with(world: &impl Collectives, config: MlpConfig, steps: usize, micro: usize) -> Vec<Vec<u32>> {
    let mut s = setup_with(world, config, 5).unwrap();
    // The same start as DDP's broadcast from member 0 (every replica is
    // initialised alike already).
    let mut grads = LocalGradients::new(&s.params).unwrap();
    let sgd = Sgd::new(&s.params, LR, 0.9).unwrap();
    let mut batch = 0;
    for step in 0..steps {
        for _ in 0..micro {
            let b = batch % BATCHES;
            batch += 1;
            s.model.forward(&s.data.inputs[b]).unwrap();
            s.model.backward(&s.data.targets[b], step, &mut grads).unwrap();
        }
        grads.all_reduce(world).unwrap();
        sgd.step(&s.params, &grads).unwrap();
        grads.zero_grad().unwrap();
    }
    bits(&s.params)
}

/// One backward's averaged gradients under `options`, per parameter
/// (replica 0).
pub fn averaged_gradients(world: &impl Collectives, options: DdpOptions) -> Vec<Vec<f32>> {
    averaged_gradients_with(world, CONFIG, options)
}

/// [`averaged_gradients`] of a model of `config`.
pub fn averaged_gradients_with(world: &impl Collectives, config: MlpConfig, options: DdpOptions) -> Vec<Vec<f32>> {
    let mut s = setup_with(world, config, 5).unwrap();
    let mut ddp = DistributedDataParallel::new(world, &s.params, options).unwrap();
    s.model.forward(&s.data.inputs[0]).unwrap();
    s.model.backward(&s.data.targets[0], 0, &mut ddp).unwrap();
    ddp.finish().unwrap();
    (0..s.params.len()).map(|i| ddp.gradient_to_vec(i, 0).unwrap()).collect()
}

/// The largest difference between `got` and `want` of each parameter, over
/// the largest magnitude of `want`'s.
pub fn worst_relative(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let scale = w.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(f32::MIN_POSITIVE);
            g.iter().zip(w).fold(0.0f32, |a, (x, y)| a.max((x - y).abs())) / scale
        })
        .fold(0.0, f32::max)
}

/// Runs every scenario on `world` (two members or more).
pub fn every_scenario(world: &impl Collectives) {
    // Bucketing, overlap and no_sync against an all-reduce after the whole backward.
    let (ddp, losses) = train_ddp(world, small_buckets(), 3, 2);
    let reference = train_reference(world, 3, 2);
    assert_eq!(ddp.len(), world.clients().len());
    assert!(ddp == reference, "DDP (buckets, no_sync) differs from an all-reduce after the whole backward");
    assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
    // Replicas bit-identical after N steps, and the loss falls.
    let (replicas, losses) = train_ddp(world, DdpOptions::default(), 12, 1);
    assert!(replicas.iter().all(|r| r == &replicas[0]), "replicas differ after 12 steps");
    let (first, last) = (losses[..4].iter().sum::<f32>(), losses[8..].iter().sum::<f32>());
    assert!(last < 0.9 * first, "the loss did not fall: {losses:?}");
    // Compression hooks within their stated tolerance of the f32 average.
    let exact = averaged_gradients(world, small_buckets());
    for (hook, tol) in [
        (cohort_train::ddp::CommHook::Bf16Compress, 1.0 / 128.0),
        (cohort_train::ddp::CommHook::Fp16Compress, 1.0 / 512.0),
    ] {
        let got = averaged_gradients(world, DdpOptions { hook, ..small_buckets() });
        let worst = worst_relative(&got, &exact);
        assert!(worst <= tol, "{hook:?}: worst difference {worst:e} of the largest gradient, above {tol:e}");
        assert!(worst > 0.0, "{hook:?} changed nothing: is the hook on?");
    }
}

/// The model of the split scenarios: weights of 256 rows, so a bucket cap
/// of 64 KiB (64 rows) cuts each into 4 pieces.
pub const SPLIT_CONFIG: MlpConfig = MlpConfig { width: 256, depth: 2 };

/// Caps that split every weight of [`SPLIT_CONFIG`] (256 KiB) into pieces.
pub fn split_buckets() -> DdpOptions {
    DdpOptions {
        bucket_cap_bytes: 64 << 10,
        first_bucket_bytes: 16 << 10,
        split_parameters: SplitParameters::All,
        ..DdpOptions::default()
    }
}

/// Whether each backend's products give the same bits split into row
/// pieces as whole, as [`split_scenarios`] checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitBits {
    /// The same bits (CPU: `matrixmultiply` packs the operands alike
    /// whatever the piece; wgpu and the CUDA kernels: one thread per element
    /// summing over k in order).
    Same,
    /// Within 10⁻⁵ of the largest value (cuBLAS may choose other kernels,
    /// with another order of the sum over k, for a product of fewer rows);
    /// the test prints whether the bits matched.
    Close,
}

/// The largest difference between two runs' parameters (as bits), over
/// the largest magnitude.
fn worst_bits(a: &[Vec<u32>], b: &[Vec<u32>]) -> f32 {
    let f = |v: &[Vec<u32>]| -> Vec<Vec<f32>> {
        v.iter().map(|r| r.iter().map(|x| f32::from_bits(*x)).collect()).collect()
    };
    worst_relative(&f(a), &f(b))
}

/// Parameters split across buckets (by whole rows, computed piece by piece
/// by the model's backward) on `world`:
/// * the bucket layout: every weight in several pieces, every bucket within
///   one granule (64 rows) of its cap;
/// * replicas bit-identical; the same parameters as whole-parameter buckets
///   (PyTorch's layout) and as an all-reduce after the whole backward, with
///   no_sync, after several steps (`bits` says how same);
/// * a cap of one element: one granule per bucket, the same again;
/// * the compression hooks within their tolerance of the split f32 average.
pub fn split_scenarios(world: &impl Collectives, bits: SplitBits) {
    let s = setup_with(world, SPLIT_CONFIG, 5).unwrap();
    let ddp = DistributedDataParallel::new(world, &s.params, split_buckets()).unwrap();
    for (i, p) in s.params.iter().enumerate() {
        let pieces = ddp.places(i);
        if p.shape.len() == 2 {
            assert_eq!(pieces.len(), 4, "{}: a 256 KiB weight in 64 KiB buckets: {pieces:?}", p.name);
        }
        assert_eq!(pieces.iter().map(|p| p.len).sum::<usize>(), p.numel());
    }
    let buckets = ddp.buckets();
    for b in &buckets[1..buckets.len() - 1] {
        assert!((16384..16384 + 64 * 256).contains(&b.len), "a bucket of {} floats", b.len);
    }
    drop(ddp);
    let whole = DdpOptions { split_parameters: SplitParameters::Off, ..split_buckets() };
    // Only the first layer (the last gradients backward produces).
    let last = DdpOptions { split_parameters: SplitParameters::Last(2), ..split_buckets() };
    let tail = DistributedDataParallel::new(world, &s.params, last).unwrap();
    assert_eq!((tail.places(0).len(), tail.places(2).len()), (4, 1), "Last(2) cuts layer 0's weight only");
    drop(tail);
    let (last_run, _) = train_ddp_with(world, SPLIT_CONFIG, last, 3, 2);
    let tiny = DdpOptions { bucket_cap_bytes: 4, first_bucket_bytes: 4, ..split_buckets() };
    let (split, losses) = train_ddp_with(world, SPLIT_CONFIG, split_buckets(), 3, 2);
    let (unsplit, _) = train_ddp_with(world, SPLIT_CONFIG, whole, 3, 2);
    let (one_granule, _) = train_ddp_with(world, SPLIT_CONFIG, tiny, 3, 2);
    let reference = train_reference_with(world, SPLIT_CONFIG, 3, 2);
    assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
    assert!(split.iter().all(|r| r == &split[0]), "replicas differ with split parameters");
    assert!(one_granule.iter().all(|r| r == &one_granule[0]), "replicas differ with a cap of one element");
    assert!(unsplit == reference, "whole-parameter buckets differ from an all-reduce after the whole backward");
    let exact = averaged_gradients_with(world, SPLIT_CONFIG, split_buckets());
    let exact_whole = averaged_gradients_with(world, SPLIT_CONFIG, whole);
    let runs = [("split", &split), ("a cap of one element", &one_granule), ("the first layer split", &last_run)];
    match bits {
        SplitBits::Same => {
            for (what, run) in runs {
                assert!(*run == reference, "{what}: other bits than whole-parameter buckets");
            }
            assert!(exact == exact_whole, "split and whole averaged gradients differ");
        }
        SplitBits::Close => {
            let same = runs.iter().all(|(_, run)| **run == reference) && exact == exact_whole;
            println!("split parameters: the same bits as whole ones: {same}");
            for (what, run) in runs {
                let worst = worst_bits(run, &reference);
                assert!(worst <= 1e-5, "{what}: parameters differ by {worst:e} of the largest, above 1e-5");
            }
            let worst = worst_relative(&exact, &exact_whole);
            assert!(worst <= 1e-5, "split averaged gradients differ by {worst:e} of the largest, above 1e-5");
        }
    }
    for (hook, tol) in [
        (cohort_train::ddp::CommHook::Bf16Compress, 1.0 / 128.0),
        (cohort_train::ddp::CommHook::Fp16Compress, 1.0 / 512.0),
    ] {
        let got = averaged_gradients_with(world, SPLIT_CONFIG, DdpOptions { hook, ..split_buckets() });
        let worst = worst_relative(&got, &exact);
        assert!(worst <= tol, "{hook:?} split: worst difference {worst:e} of the largest gradient, above {tol:e}");
        assert!(worst > 0.0, "{hook:?} changed nothing: is the hook on?");
    }
}

/// Buffers of `len` zeros on each client: a parameter of the wrong length.
pub fn wrong_param(world: &impl Collectives, len: usize) -> Parameter {
    Parameter {
        name: "head.weight".into(),
        shape: vec![4, 4],
        replicas: world.clients().iter().map(|c| Buffer::zeros(c, len).unwrap()).collect(),
    }
}

/// The world over `clients` on their own streams, and the same devices over
/// [`cohort_train::ddp::communication_clients`] (a high-priority
/// communication stream per device): every scenario holds there too, and
/// both give the same bits: parameters after several steps (buckets and
/// no_sync), and each hook's averaged gradients.
pub fn high_priority_world_gives_the_same_bits(clients: &[cohort_runtime::Client]) {
    use cohort_comm::ClientGroup;
    use cohort_runtime::StreamPriority;
    use cohort_train::ddp::{communication_clients, CommHook};
    let normal = ClientGroup::new(clients.to_vec()).unwrap();
    let high = ClientGroup::new(communication_clients(clients)).unwrap();
    assert!(high.clients().iter().all(|c| c.stream_id().priority() == StreamPriority::High));
    assert!(compute_clients(&high).iter().all(|c| c.stream_id().priority() == StreamPriority::Normal));
    every_scenario(&high);
    assert!(
        train_ddp(&normal, small_buckets(), 4, 2) == train_ddp(&high, small_buckets(), 4, 2),
        "parameters differ between a normal- and a high-priority communication stream"
    );
    for hook in [CommHook::AllReduce, CommHook::Bf16Compress, CommHook::Fp16Compress] {
        let options = DdpOptions { hook, ..small_buckets() };
        let (a, b) = (averaged_gradients(&normal, options), averaged_gradients(&high, options));
        let same = a.iter().zip(&b).all(|(x, y)| x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())));
        assert!(same, "{hook:?}: averaged gradients differ between the two worlds");
    }
}
