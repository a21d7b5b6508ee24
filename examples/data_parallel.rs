//! Data-parallel training: a small MLP learns a synthetic regression task on
//! every device of a backend, each device taking its share of every global
//! batch and the gradients averaged with `all_reduce(avg)`.
//!
//! Run: `cargo run --release --example data_parallel` (CPU, 4 devices), or
//! `-- --devices 8 --epochs 10 --steps 50`; `--backend wgpu` trains on every
//! wgpu device (`COHORT_WGPU_DEVICES=4` opens four on one adapter, e.g.
//! lavapipe), `--backend cuda` on every CUDA device. That is one process
//! for all devices (a `ClientGroup`).
//!
//! One process per device: start it with a launcher, e.g.
//! `cohort run -n gpu -- target/release/examples/data_parallel --backend cuda`
//! (or torchrun, mpirun, srun). The same training loop, written once against
//! the `Collectives` trait, then runs over a `Communicator`: `World::join`
//! picks, and `rank_clients` gives each rank `--devices` devices (default 1)
//! from device `LOCAL_RANK × --devices`; the replicas are the devices of
//! every rank.
//!
//! At the end it checks that every replica's parameters are bit-identical
//! (across ranks: gathered with `all_gather`) and that the loss matches a
//! one-device run over the same global batches, on the same backend (on
//! rank 0's first device), within a relative 1e-3 per epoch (the two runs
//! sum the batch in a different order, so float rounding differs slightly;
//! the observed difference is around 1e-6), prints both, and exits non-zero
//! if a check fails. The kernels carry a CPU (Rust), a CUDA C and a WGSL
//! source.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cohort::prelude::*;

const INPUTS: usize = 16;
const HIDDEN: usize = 32;
/// Parameters: W1 (HIDDEN × INPUTS), b1 (HIDDEN), W2 (HIDDEN), b2 (1).
const PARAMS: usize = HIDDEN * INPUTS + HIDDEN + HIDDEN + 1;
/// Samples per global batch: divisible by every device count 1..=8.
const BATCH: usize = 840;

#[derive(Parser, Debug)]
#[command(about = "Data-parallel MLP training across the devices of a backend")]
struct Args {
    /// Backend: cpu, wgpu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Devices to train on, the first N of the backend (default: every
    /// device; 4 on the CPU, where N sets COHORT_CPU_DEVICES). Under a
    /// launcher: devices per rank (default 1).
    #[arg(long)]
    devices: Option<usize>,
    #[arg(long, default_value_t = 6)]
    epochs: usize,
    /// Steps (global batches) per epoch.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
}

/// A deterministic pseudo-random number in [-1, 1).
fn noise(seed: u64) -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x2545_F491_4F6C_DD1D);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Sample `i`: its inputs and target.
fn sample(i: usize) -> ([f32; INPUTS], f32) {
    let x: [f32; INPUTS] = std::array::from_fn(|k| noise((i * INPUTS + k) as u64));
    let y = (x[0] * 1.5 - x[3]).sin() + 0.5 * x[7] * x[9] - 0.25 * x[12];
    (x, y)
}

/// Floats per row in the scratch buffer of the GPU kernels: h (HIDDEN),
/// dh (HIDDEN), dout, squared error.
const STRIDE: usize = 2 * HIDDEN + 2;
/// Threads of the one block (workgroup) the GPU forward/backward runs on.
const THREADS: usize = 256;

/// Forward and backward over one step's rows: buffers params, x (all
/// steps), y (all steps), grads (PARAMS + 1: the last is the mean loss),
/// scratch (rows × STRIDE floats, used by the GPU sources); scalars step,
/// rows.
///
/// The CPU source runs the rows in order on one thread. The GPU sources run
/// on one block of THREADS threads in two phases: one thread per row
/// computes activations and per-row gradients into scratch; after a block
/// barrier, one thread per gradient slot sums them over the rows in order.
/// Every sum has a fixed order, so a run is deterministic on its backend.
///
/// The WGSL binds every buffer `read_write`: small buffers are slices of one
/// pooled wgpu buffer, and wgpu refuses one buffer bound both read-only and
/// read-write in a dispatch.
fn forward_backward() -> Kernel {
    let cuda = format!(
        r#"#define INPUTS {INPUTS}
#define HIDDEN {HIDDEN}
#define PARAMS {PARAMS}
#define STRIDE {STRIDE}
extern "C" __global__ void mlp_forward_backward(
    const float* p, const float* xs, const float* ys, float* grads, float* scratch,
    unsigned long long p_bytes, unsigned long long xs_bytes, unsigned long long ys_bytes,
    unsigned long long grads_bytes, unsigned long long scratch_bytes,
    unsigned int step, unsigned int rows) {{
    const float* w1 = p;
    const float* b1 = p + HIDDEN * INPUTS;
    const float* w2 = b1 + HIDDEN;
    float b2 = w2[HIDDEN];
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) {{
        const float* x = xs + (unsigned long long)(step * rows + r) * INPUTS;
        float* s = scratch + (unsigned long long)r * STRIDE;
        float out = b2;
        for (int j = 0; j < HIDDEN; j++) {{
            float z = b1[j];
            for (int k = 0; k < INPUTS; k++) z += w1[j * INPUTS + k] * x[k];
            float h = tanhf(fminf(fmaxf(z, -15.0f), 15.0f));
            s[j] = h;
            out += w2[j] * h;
        }}
        float err = out - ys[step * rows + r];
        float dout = 2.0f * err / (float)rows;
        for (int j = 0; j < HIDDEN; j++) s[HIDDEN + j] = dout * w2[j] * (1.0f - s[j] * s[j]);
        s[2 * HIDDEN] = dout;
        s[2 * HIDDEN + 1] = err * err;
    }}
    __syncthreads();
    for (unsigned int q = threadIdx.x; q <= PARAMS; q += blockDim.x) {{
        float acc = 0.0f;
        for (unsigned int r = 0; r < rows; r++) {{
            const float* s = scratch + (unsigned long long)r * STRIDE;
            if (q < HIDDEN * INPUTS) acc += s[HIDDEN + q / INPUTS] * xs[(unsigned long long)(step * rows + r) * INPUTS + q % INPUTS];
            else if (q < HIDDEN * INPUTS + HIDDEN) acc += s[HIDDEN + (q - HIDDEN * INPUTS)];
            else if (q < HIDDEN * INPUTS + 2 * HIDDEN) acc += s[2 * HIDDEN] * s[q - HIDDEN * INPUTS - HIDDEN];
            else if (q == PARAMS - 1) acc += s[2 * HIDDEN];
            else acc += s[2 * HIDDEN + 1];
        }}
        grads[q] = q == PARAMS ? acc / (float)rows : acc;
    }}
}}"#
    );
    let wgsl = format!(
        r#"const INPUTS: u32 = {INPUTS}u;
const HIDDEN: u32 = {HIDDEN}u;
const PARAMS: u32 = {PARAMS}u;
const STRIDE: u32 = {STRIDE}u;
const THREADS: u32 = {THREADS}u;
@group(0) @binding(0) var<storage, read_write> p: array<f32>;
@group(0) @binding(1) var<storage, read_write> xs: array<f32>;
@group(0) @binding(2) var<storage, read_write> ys: array<f32>;
@group(0) @binding(3) var<storage, read_write> grads: array<f32>;
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(5) var<storage, read> scalars: array<u32>;
@compute @workgroup_size({THREADS})
fn main(@builtin(local_invocation_index) t: u32) {{
    let step = scalars[0];
    let rows = scalars[1];
    let b1 = HIDDEN * INPUTS;
    let w2 = b1 + HIDDEN;
    for (var r = t; r < rows; r += THREADS) {{
        let x = (step * rows + r) * INPUTS;
        let s = r * STRIDE;
        var out = p[PARAMS - 1u];
        for (var j = 0u; j < HIDDEN; j++) {{
            var z = p[b1 + j];
            for (var k = 0u; k < INPUTS; k++) {{ z += p[j * INPUTS + k] * xs[x + k]; }}
            let h = tanh(clamp(z, -15.0, 15.0));
            scratch[s + j] = h;
            out += p[w2 + j] * h;
        }}
        let err = out - ys[step * rows + r];
        let dout = 2.0 * err / f32(rows);
        for (var j = 0u; j < HIDDEN; j++) {{
            let h = scratch[s + j];
            scratch[s + HIDDEN + j] = dout * p[w2 + j] * (1.0 - h * h);
        }}
        scratch[s + 2u * HIDDEN] = dout;
        scratch[s + 2u * HIDDEN + 1u] = err * err;
    }}
    storageBarrier();
    workgroupBarrier();
    for (var q = t; q <= PARAMS; q += THREADS) {{
        var acc = 0.0;
        for (var r = 0u; r < rows; r++) {{
            let s = r * STRIDE;
            if (q < b1) {{
                acc += scratch[s + HIDDEN + q / INPUTS] * xs[(step * rows + r) * INPUTS + q % INPUTS];
            }} else if (q < w2) {{
                acc += scratch[s + HIDDEN + (q - b1)];
            }} else if (q < w2 + HIDDEN) {{
                acc += scratch[s + 2u * HIDDEN] * scratch[s + (q - w2)];
            }} else if (q == PARAMS - 1u) {{
                acc += scratch[s + 2u * HIDDEN];
            }} else {{
                acc += scratch[s + 2u * HIDDEN + 1u];
            }}
        }}
        if (q == PARAMS) {{ acc = acc / f32(rows); }}
        grads[q] = acc;
    }}
}}"#
    );
    Kernel::new("mlp_forward_backward")
        .with_block([THREADS as u32, 1, 1])
        .with_cpu(|ctx| {
            let step = ctx.scalar(0).as_u64() as usize;
            let rows = ctx.scalar(1).as_u64() as usize;
            let [params, xs, ys, grads, _scratch] = &mut ctx.buffers[..] else {
                panic!("mlp_forward_backward takes 5 buffers");
            };
            let p: &[f32] = bytemuck::cast_slice(&params[..]);
            let xs: &[f32] = bytemuck::cast_slice(&xs[..]);
            let ys: &[f32] = bytemuck::cast_slice(&ys[..]);
            let g: &mut [f32] = bytemuck::cast_slice_mut(&mut grads[..]);
            g.fill(0.0);
            let (w1, rest) = p.split_at(HIDDEN * INPUTS);
            let (b1, rest) = rest.split_at(HIDDEN);
            let (w2, b2) = rest.split_at(HIDDEN);
            let mut loss = 0.0f32;
            let mut h = [0.0f32; HIDDEN];
            for r in 0..rows {
                let row = step * rows + r;
                let x = &xs[row * INPUTS..(row + 1) * INPUTS];
                for j in 0..HIDDEN {
                    let z: f32 = b1[j] + (0..INPUTS).map(|k| w1[j * INPUTS + k] * x[k]).sum::<f32>();
                    h[j] = z.tanh();
                }
                let out = b2[0] + (0..HIDDEN).map(|j| w2[j] * h[j]).sum::<f32>();
                let err = out - ys[row];
                loss += err * err;
                let dout = 2.0 * err / rows as f32;
                let (gw1, grest) = g.split_at_mut(HIDDEN * INPUTS);
                let (gb1, grest) = grest.split_at_mut(HIDDEN);
                let (gw2, grest) = grest.split_at_mut(HIDDEN);
                grest[0] += dout;
                for j in 0..HIDDEN {
                    gw2[j] += dout * h[j];
                    let dh = dout * w2[j] * (1.0 - h[j] * h[j]);
                    gb1[j] += dh;
                    for k in 0..INPUTS {
                        gw1[j * INPUTS + k] += dh * x[k];
                    }
                }
            }
            g[PARAMS] = loss / rows as f32;
        })
        .with_cuda(cuda)
        .with_wgsl(wgsl)
}

/// SGD: buffers params, grads (averaged), loss sum; scalar lr. One thread
/// per parameter on the GPU.
fn sgd() -> Kernel {
    let cuda = format!(
        r#"extern "C" __global__ void sgd(float* p, const float* g, float* loss,
    unsigned long long p_bytes, unsigned long long g_bytes, unsigned long long loss_bytes, float lr) {{
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < {PARAMS}) p[i] -= lr * g[i];
    if (i == 0) loss[0] += g[{PARAMS}];
}}"#
    );
    let wgsl = format!(
        r#"@group(0) @binding(0) var<storage, read_write> p: array<f32>;
@group(0) @binding(1) var<storage, read_write> g: array<f32>;
@group(0) @binding(2) var<storage, read_write> loss: array<f32>;
@group(0) @binding(3) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let lr = bitcast<f32>(scalars[0]);
    let i = gid.x;
    if (i < {PARAMS}u) {{ p[i] = p[i] - lr * g[i]; }}
    if (i == 0u) {{ loss[0] = loss[0] + g[{PARAMS}u]; }}
}}"#
    );
    Kernel::new("sgd")
        .with_cpu(|ctx| {
            let lr = ctx.scalar(0).as_f64() as f32;
            let [params, grads, loss] = &mut ctx.buffers[..] else {
                panic!("sgd takes 3 buffers");
            };
            let p: &mut [f32] = bytemuck::cast_slice_mut(&mut params[..]);
            let g: &[f32] = bytemuck::cast_slice(&grads[..]);
            let loss: &mut [f32] = bytemuck::cast_slice_mut(&mut loss[..]);
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
            loss[0] += g[PARAMS];
        })
        .with_cuda(cuda)
        .with_wgsl(wgsl)
}

struct Run {
    epoch_losses: Vec<f32>,
    /// Every replica's parameters, as bits.
    replicas: Vec<Vec<u32>>,
    /// The training loop.
    seconds: f64,
    /// The warm-up collective before it (creates NCCL communicators).
    setup_seconds: f64,
}

/// Averages one float per device and waits for it, so communicators exist
/// before the clock starts (NCCL takes up to a second to make them; the host
/// path next to nothing); returns the seconds it took.
fn warm_up(world: &impl Collectives) -> Result<f64, Error> {
    let start = Instant::now();
    let probes = world.replicate(&[1.0f32])?;
    world.all_reduce(&probes, &probes, ReduceOp::Avg)?;
    world.sync()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Trains on every replica; `label` prefixes the progress bar.
fn train(world: &impl Collectives, args: &Args, label: &str) -> Result<Run, Error> {
    let n = world.members();
    let rows = BATCH / n;
    let init: Vec<f32> = (0..PARAMS).map(|i| 0.3 * noise(1_000_000 + i as u64)).collect();
    let (fb, step_kernel) = (forward_backward(), sgd());
    let mut params = Vec::new();
    let mut grads = Vec::new();
    let mut losses = Vec::new();
    let mut data = Vec::new();
    let mut scratch = Vec::new();
    for (l, client) in world.clients().iter().enumerate() {
        // Replica m takes rows [m·rows, (m+1)·rows) of every global batch.
        let m = world.first_member() + l;
        let mut xs = Vec::with_capacity(args.steps * rows * INPUTS);
        let mut ys = Vec::with_capacity(args.steps * rows);
        for s in 0..args.steps {
            for r in 0..rows {
                let (x, y) = sample(s * BATCH + m * rows + r);
                xs.extend_from_slice(&x);
                ys.push(y);
            }
        }
        params.push(Buffer::from_slice(client, &init)?);
        grads.push(Buffer::<f32>::uninit(client, PARAMS + 1)?);
        scratch.push(Buffer::<f32>::uninit(client, rows * STRIDE)?);
        losses.push(Buffer::from_slice(client, &[0.0f32])?);
        data.push((Buffer::from_slice(client, &xs)?, Buffer::from_slice(client, &ys)?));
    }
    let setup_seconds = warm_up(world)?;
    let start = Instant::now();
    let mut epoch_losses = Vec::new();
    let total = args.epochs * args.steps;
    for epoch in 0..args.epochs {
        for step in 0..args.steps {
            for (m, client) in world.clients().iter().enumerate() {
                let a = KernelArguments::new()
                    .buffer(params[m].handle())
                    .buffer(data[m].0.handle())
                    .buffer(data[m].1.handle())
                    .buffer(grads[m].handle())
                    .buffer(scratch[m].handle())
                    .scalar(Scalar::U32(step as u32))
                    .scalar(Scalar::U32(rows as u32));
                // One block: the GPU sources sync their two phases inside it.
                client.launch(&fb, GridCount::Static(1, 1, 1), a)?;
            }
            // Average gradients (and the last slot, the loss) in place.
            world.all_reduce(&grads, &grads, ReduceOp::Avg)?;
            for (m, client) in world.clients().iter().enumerate() {
                let a = KernelArguments::new()
                    .buffer(params[m].handle())
                    .buffer(grads[m].handle())
                    .buffer(losses[m].handle())
                    .scalar(Scalar::F32(args.lr));
                client.launch(&step_kernel, GridCount::cover(PARAMS, 256), a)?;
            }
            let done = epoch * args.steps + step + 1;
            if world.rank() == 0 && (step % 8 == 7 || step + 1 == args.steps) {
                // Reading the loss waits for the step: the bar shows work done.
                let sum = losses[0].to_vec()?[0];
                let width = 30 * done / total;
                eprint!(
                    "\r{label} epoch {}/{} [{}{}] step {:>4}/{total} loss {:.5}",
                    epoch + 1,
                    args.epochs,
                    "#".repeat(width),
                    ".".repeat(30 - width),
                    done,
                    sum / (step + 1) as f32
                );
                let _ = std::io::stderr().flush();
            }
        }
        let sum = losses[0].to_vec()?[0];
        epoch_losses.push(sum / args.steps as f32);
        for loss in &losses {
            loss.write(&[0.0f32])?;
        }
    }
    if world.rank() == 0 {
        eprintln!();
    }
    let seconds = start.elapsed().as_secs_f64();
    // Every replica's parameters, gathered on every device.
    let gathered = world.zeros::<f32>(n * PARAMS)?;
    world.all_gather(&params, &gathered)?;
    let copies = gathered[0].to_vec()?.chunks(PARAMS).map(|c| c.iter().map(|v| v.to_bits()).collect()).collect();
    Ok(Run { epoch_losses, replicas: copies, seconds, setup_seconds })
}

/// The devices' names, repeated ones counted once (`name ×4`).
fn describe(clients: &[Client]) -> String {
    let mut names: Vec<(String, usize)> = Vec::new();
    for c in clients {
        let name = c.properties().name.clone();
        match names.iter_mut().find(|(n, _)| *n == name) {
            Some((_, count)) => *count += 1,
            None => names.push((name, 1)),
        }
    }
    names.iter().map(|(n, c)| if *c > 1 { format!("{n} ×{c}") } else { n.clone() }).collect::<Vec<_>>().join(", ")
}

fn main() -> Result<ExitCode, Error> {
    Ok(match run(&Args::parse())? {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    })
}

fn run(args: &Args) -> Result<bool, Error> {
    if let Some(n) = args.devices {
        if n == 0 || !BATCH.is_multiple_of(n) {
            return Err(Error::InvalidArgument(format!(
                "--devices {n}: the global batch of {BATCH} must split evenly: use a divisor of it, e.g. 1 to 8"
            )));
        }
        if args.backend == "cpu" {
            // Before the first CPU client exists: the runtime reads it then.
            std::env::set_var(cohort::runtime::config::CPU_DEVICES.name, n.to_string());
        }
    }
    // Alone: every device (or --devices). Under a launcher: --devices per
    // rank (default 1), chosen by LOCAL_RANK.
    let world = World::join(rank_clients(&args.backend, args.devices)?)?;
    let n = world.members();
    if !BATCH.is_multiple_of(n) {
        return Err(Error::InvalidArgument(format!(
            "{n} devices do not split the global batch of {BATCH} evenly: use 1 to 8 devices in all"
        )));
    }
    let leads = world.rank() == 0;
    let place = match world.world_size() {
        1 => "one process".to_string(),
        ranks => format!("{ranks} processes ({} per process, {:?})", world.clients().len(), world.transport()),
    };
    if leads {
        println!("data_parallel: backend {}, {n} devices in {place}: {}", args.backend, describe(world.clients()));
        println!(
            "data_parallel: MLP {INPUTS}-{HIDDEN}-1 ({PARAMS} parameters), global batch {BATCH}, {} epochs × {} steps, lr {}",
            args.epochs, args.steps, args.lr
        );
    }
    let parallel = train(&world, args, &format!("{n} devices"))?;
    let identical = parallel.replicas.iter().all(|r| r == &parallel.replicas[0]);
    if !leads {
        // Rank 0 alone runs the one-device reference; the others wait for
        // it so no rank leaves the job early.
        world.barrier()?;
        return Ok(identical);
    }
    let single = train(&ClientGroup::new(vec![world.clients()[0].clone()])?, args, "1 device ")?;
    world.barrier()?;
    println!("{:>6} {:>14} {:>14} {:>10}", "epoch", format!("loss ({n} dev)"), "loss (1 dev)", "rel diff");
    let mut worst = 0.0f32;
    for (e, (a, b)) in parallel.epoch_losses.iter().zip(&single.epoch_losses).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        worst = worst.max(rel);
        println!("{:>6} {:>14.6} {:>14.6} {:>10.2e}", e + 1, a, b, rel);
    }
    println!(
        "time: {:.2} s on {n} devices, {:.2} s on 1 device; before them, a first collective (communicator set-up): {:.2} s and {:.2} s",
        parallel.seconds, single.seconds, parallel.setup_seconds, single.setup_seconds
    );
    let loss_ok = worst <= 1e-3;
    let learned = parallel.epoch_losses.last() < parallel.epoch_losses.first();
    println!("check: replicas bit-identical across {n} devices: {}", if identical { "yes" } else { "NO" });
    println!(
        "check: loss matches the 1-device run within 1e-3 relative (worst {worst:.2e}): {}",
        if loss_ok { "yes" } else { "NO" }
    );
    println!("check: loss went down: {}", if learned { "yes" } else { "NO" });
    Ok(identical && loss_ok && learned)
}
