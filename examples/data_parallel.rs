//! Data-parallel training: a small MLP learns a synthetic regression task on
//! every device of a backend, each device taking its share of every global
//! batch and the gradients averaged with `all_reduce(avg)`.
//!
//! Run: `cargo run --release --example data_parallel` (CPU, 4 devices), or
//! `-- --devices 8 --epochs 10 --steps 50`.
//!
//! At the end it checks that every replica's parameters are bit-identical
//! and that the loss matches a one-device run over the same global batches
//! within a relative 1e-3 (the two runs sum the batch in a different order,
//! so float rounding differs slightly), prints both, and exits non-zero if a
//! check fails. Kernels are CPU kernels (Rust functions); CUDA and WGSL
//! sources for them are not written yet, so `--backend` accepts `cpu` only.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cohort::comm::{ClientGroup, DType, ReduceOp};
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
    /// Backend: cpu.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Devices to train on (default: every device of the backend; 4 on the CPU).
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

/// Forward and backward over one step's rows: buffers params, x (all
/// steps), y (all steps), grads (PARAMS + 1: the last is the mean loss);
/// scalars step, rows.
fn forward_backward() -> Kernel {
    Kernel::new("mlp_forward_backward").with_cpu(|ctx| {
        let step = ctx.scalar(0).as_u64() as usize;
        let rows = ctx.scalar(1).as_u64() as usize;
        let (params, rest) = ctx.buffers.split_at_mut(1);
        let (xs, rest) = rest.split_at_mut(1);
        let (ys, grads) = rest.split_at_mut(1);
        let p: &[f32] = bytemuck::cast_slice(&params[0][..]);
        let xs: &[f32] = bytemuck::cast_slice(&xs[0][..]);
        let ys: &[f32] = bytemuck::cast_slice(&ys[0][..]);
        let g: &mut [f32] = bytemuck::cast_slice_mut(&mut grads[0][..]);
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
}

/// SGD: buffers params, grads (averaged), loss sum; scalar lr.
fn sgd() -> Kernel {
    Kernel::new("sgd").with_cpu(|ctx| {
        let lr = ctx.scalar(0).as_f64() as f32;
        let (params, rest) = ctx.buffers.split_at_mut(1);
        let (grads, loss) = rest.split_at_mut(1);
        let p: &mut [f32] = bytemuck::cast_slice_mut(&mut params[0][..]);
        let g: &[f32] = bytemuck::cast_slice(&grads[0][..]);
        let loss: &mut [f32] = bytemuck::cast_slice_mut(&mut loss[0][..]);
        p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
        loss[0] += g[PARAMS];
    })
}

struct Run {
    epoch_losses: Vec<f32>,
    replicas: Vec<Vec<u8>>,
    seconds: f64,
}

/// Trains on every client of `group`; `label` prefixes the progress bar.
fn train(group: &ClientGroup, args: &Args, label: &str) -> Result<Run, Box<dyn std::error::Error>> {
    let n = group.len();
    let rows = BATCH / n;
    let init: Vec<f32> = (0..PARAMS).map(|i| 0.3 * noise(1_000_000 + i as u64)).collect();
    let (fb, step_kernel) = (forward_backward(), sgd());
    let mut params = Vec::new();
    let mut grads = Vec::new();
    let mut losses = Vec::new();
    let mut data = Vec::new();
    for (m, client) in group.clients().iter().enumerate() {
        // Device m takes rows [m·rows, (m+1)·rows) of every global batch.
        let mut xs = Vec::with_capacity(args.steps * rows * INPUTS);
        let mut ys = Vec::with_capacity(args.steps * rows);
        for s in 0..args.steps {
            for r in 0..rows {
                let (x, y) = sample(s * BATCH + m * rows + r);
                xs.extend_from_slice(&x);
                ys.push(y);
            }
        }
        params.push(client.create(Bytes::from_elems(&init)));
        grads.push(client.empty((PARAMS + 1) * 4));
        losses.push(client.create(Bytes::from_elems(&[0.0f32])));
        data.push((client.create(Bytes::from_elems(&xs)), client.create(Bytes::from_elems(&ys))));
    }
    let start = Instant::now();
    let mut epoch_losses = Vec::new();
    let total = args.epochs * args.steps;
    for epoch in 0..args.epochs {
        for step in 0..args.steps {
            for (m, client) in group.clients().iter().enumerate() {
                let a = KernelArguments::new()
                    .buffer(&params[m])
                    .buffer(&data[m].0)
                    .buffer(&data[m].1)
                    .buffer(&grads[m])
                    .scalar(Scalar::U32(step as u32))
                    .scalar(Scalar::U32(rows as u32));
                client.launch(&fb, GridCount::Static(1, 1, 1), a)?;
            }
            // Average gradients (and the last slot, the loss) in place.
            group.all_reduce(&grads, &grads, DType::F32, ReduceOp::Avg)?;
            for (m, client) in group.clients().iter().enumerate() {
                let a = KernelArguments::new()
                    .buffer(&params[m])
                    .buffer(&grads[m])
                    .buffer(&losses[m])
                    .scalar(Scalar::F32(args.lr));
                client.launch(&step_kernel, GridCount::Static(1, 1, 1), a)?;
            }
            let done = epoch * args.steps + step + 1;
            if step % 8 == 7 || step + 1 == args.steps {
                // Reading the loss waits for the step: the bar shows work done.
                let sum = group.client(0).read_one(losses[0].clone())?.to_elems::<f32>()[0];
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
        let sum = group.client(0).read_one(losses[0].clone())?.to_elems::<f32>()[0];
        epoch_losses.push(sum / args.steps as f32);
        for (m, client) in group.clients().iter().enumerate() {
            client.write(&losses[m], Bytes::from_elems(&[0.0f32]))?;
        }
    }
    eprintln!();
    let replicas = group
        .clients()
        .iter()
        .zip(&params)
        .map(|(c, p)| c.read_one(p.clone()).map(|b| b.to_vec()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Run { epoch_losses, replicas, seconds: start.elapsed().as_secs_f64() })
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("data_parallel: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    if args.backend != "cpu" {
        return Err(format!(
            "backend {:?}: this example's kernels have only CPU sources so far; use --backend cpu",
            args.backend
        )
        .into());
    }
    if let Some(n) = args.devices {
        if n == 0 || n > 8 {
            return Err("--devices must be 1 to 8 (the global batch of 840 splits evenly over those)".into());
        }
        std::env::set_var("COHORT_CPU_DEVICES", n.max(1).to_string());
    }
    let clients = CpuRuntime::clients()?;
    let n = clients.len();
    if !BATCH.is_multiple_of(n) {
        return Err(format!("{n} devices do not split the global batch of {BATCH} evenly: use 1 to 8").into());
    }
    println!(
        "data_parallel: MLP {INPUTS}-{HIDDEN}-1 ({PARAMS} parameters), global batch {BATCH}, {} epochs × {} steps, lr {}",
        args.epochs, args.steps, args.lr
    );
    let group = ClientGroup::new(clients.clone())?;
    let parallel = train(&group, args, &format!("{n} devices"))?;
    let single = train(&ClientGroup::new(vec![clients[0].clone()])?, args, "1 device ")?;
    println!("{:>6} {:>14} {:>14} {:>10}", "epoch", format!("loss ({n} dev)"), "loss (1 dev)", "rel diff");
    let mut worst = 0.0f32;
    for (e, (a, b)) in parallel.epoch_losses.iter().zip(&single.epoch_losses).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        worst = worst.max(rel);
        println!("{:>6} {:>14.6} {:>14.6} {:>10.2e}", e + 1, a, b, rel);
    }
    println!("time: {:.2} s on {n} devices, {:.2} s on 1 device", parallel.seconds, single.seconds);
    let identical = parallel.replicas.iter().all(|r| r == &parallel.replicas[0]);
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
