//! Data-parallel training through `cohort::ddp::DistributedDataParallel`:
//! an MLP (`cohort::nn::Mlp`, 4 layers of 256 by default, `--large` for 8 ×
//! 4096, 134 M parameters) learns a teacher network's outputs on every
//! device of a backend, each device taking its share of every global batch,
//! the gradients averaged bucket by bucket while backward runs.
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
//! (across ranks: gathered with `all_gather`) and that each epoch's loss
//! matches a one-device run over the same global batches, on the same
//! backend (on rank 0's first device), within a relative 1e-3 (the two runs
//! sum a batch's gradient in a different order, so float rounding differs
//! slightly; the difference seen is around 1e-6), prints both, and exits
//! non-zero if a check fails.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use cohort::ddp::{communication_clients, compute_clients, CommHook, DdpOptions, DistributedDataParallel};
use cohort::nn::{Mlp, MlpConfig, Sgd, TeacherData};
use cohort::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};

/// The relative difference allowed between the N-device and the 1-device
/// run's loss, per epoch.
const TOLERANCE: f32 = 1e-3;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Hook {
    /// f32 all-reduce.
    None,
    /// bf16 compression.
    Bf16,
    /// fp16 compression.
    Fp16,
}

#[derive(Parser, Debug)]
#[command(about = "Data-parallel MLP training across the devices of a backend, through DistributedDataParallel")]
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
    /// Samples per global batch (split evenly among the devices).
    #[arg(long, default_value_t = 240)]
    batch: usize,
    /// The large model: 8 layers of 4096 (134 M parameters).
    #[arg(long)]
    large: bool,
    /// Layer width (default 256, or 4096 with --large).
    #[arg(long)]
    width: Option<usize>,
    /// Layers (default 4, or 8 with --large).
    #[arg(long)]
    depth: Option<usize>,
    /// Learning rate of SGD (momentum 0.9).
    #[arg(long, default_value_t = 0.01)]
    lr: f32,
    /// Bucket cap in MiB.
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// Communication hook.
    #[arg(long, value_enum, default_value_t = Hook::None)]
    hook: Hook,
    /// Micro-batches per step: all but the last run under no_sync.
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
    /// Cut parameters larger than the bucket cap into row pieces, each a
    /// bucket all-reduced as backward writes it (DdpOptions::split_parameters):
    /// the first layer's (the last gradients backward produces).
    #[arg(long)]
    split_parameters: bool,
}

impl Args {
    fn config(&self) -> MlpConfig {
        let base = if self.large { MlpConfig::LARGE } else { MlpConfig::SMALL };
        MlpConfig { width: self.width.unwrap_or(base.width), depth: self.depth.unwrap_or(base.depth) }
    }

    fn options(&self) -> DdpOptions {
        let hook = match self.hook {
            Hook::None => CommHook::AllReduce,
            Hook::Bf16 => CommHook::Bf16Compress,
            Hook::Fp16 => CommHook::Fp16Compress,
        };
        DdpOptions {
            bucket_cap_bytes: (self.bucket_cap_mb * (1 << 20) as f64) as usize,
            hook,
            split_parameters: if self.split_parameters {
                cohort::ddp::SplitParameters::Last(2)
            } else {
                cohort::ddp::SplitParameters::Off
            },
            ..DdpOptions::default()
        }
    }
}

struct Run {
    /// Mean loss of each epoch, over every replica.
    epoch_losses: Vec<f32>,
    /// Every replica's parameters, as bits.
    replicas: Vec<Vec<u32>>,
    seconds: f64,
    /// Start-up: data, model, DDP's shape check and broadcast.
    setup_seconds: f64,
}

/// The progress of one run: a bar on a terminal, a line per epoch
/// elsewhere (a log, a pipe, CI).
struct Progress {
    bar: Option<ProgressBar>,
    label: String,
}

impl Progress {
    fn new(show: bool, label: &str, total: usize) -> Progress {
        let bar = (show && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] step {pos}/{len} {msg}")
                    .expect("a valid template")
                    .progress_chars("#>."),
            );
            bar.set_prefix(label.to_string());
            bar
        });
        Progress { bar, label: label.to_string() }
    }

    fn step(&self, done: usize, loss: f32, samples_per_s: f64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
            bar.set_message(format!("loss {loss:.5}  {samples_per_s:.0} samples/s"));
        }
    }

    fn epoch(&self, show: bool, epoch: usize, epochs: usize, loss: f32, samples_per_s: f64) {
        if show && self.bar.is_none() {
            eprintln!("{} epoch {epoch}/{epochs}: loss {loss:.5}, {samples_per_s:.0} samples/s", self.label);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// Trains on every replica of `world`; `label` names the run in its progress.
fn train(world: &impl Collectives, args: &Args, label: &str) -> Result<Run, Error> {
    let setup = Instant::now();
    let n = world.members();
    let rows = args.batch / n;
    let config = args.config();
    let clients = compute_clients(world);
    let data = TeacherData::new(&clients[0], &clients, world.first_member(), n, config, 99, args.batch, args.steps)?;
    let mut model = Mlp::new(&clients, config, rows, 7)?;
    model.set_loss_slots(args.steps)?;
    let params = model.parameters();
    let mut ddp = DistributedDataParallel::new(world, &params, args.options())?;
    let sgd = Sgd::new(&params, args.lr, 0.9)?;
    let losses: Vec<Buffer<f32>> = (0..model.replicas()).map(|r| model.losses(r).clone()).collect();
    world.sync()?;
    for c in &clients {
        c.sync()?;
    }
    let setup_seconds = setup.elapsed().as_secs_f64();

    let leads = world.rank() == 0;
    let total = args.epochs * args.steps;
    let progress = Progress::new(leads, label, total);
    let start = Instant::now();
    let mut epoch_losses = Vec::new();
    for epoch in 0..args.epochs {
        for step in 0..args.steps {
            for micro in 0..args.accumulate {
                model.forward(&data.inputs[step])?;
                if micro + 1 < args.accumulate {
                    ddp.no_sync(|ddp| {
                        model.backward(&data.targets[step], step, ddp)?;
                        ddp.finish()
                    })?;
                } else {
                    model.backward(&data.targets[step], step, &mut ddp)?;
                    ddp.finish()?;
                }
            }
            sgd.step(&params, &ddp)?;
            ddp.zero_grad()?;
            let done = epoch * args.steps + step + 1;
            if leads && (step % 8 == 7 || step + 1 == args.steps) {
                // Reading a loss waits for its step: the bar shows work done.
                let loss = losses[0].to_vec()?[step];
                progress.step(done, loss, (done * args.batch) as f64 / start.elapsed().as_secs_f64());
            }
        }
        // The mean over every replica of this epoch's step losses.
        world.all_reduce(&losses, &losses, ReduceOp::Avg)?;
        let all = losses[0].to_vec()?;
        let loss = all.iter().sum::<f32>() / args.steps as f32;
        epoch_losses.push(loss);
        let done = (epoch + 1) * args.steps;
        progress.epoch(leads, epoch + 1, args.epochs, loss, (done * args.batch) as f64 / start.elapsed().as_secs_f64());
    }
    progress.finish();
    for c in &clients {
        c.sync()?;
    }
    let seconds = start.elapsed().as_secs_f64();
    // Every replica's parameters, gathered on every device.
    let total_params = config.parameters();
    let flat = world.zeros::<f32>(total_params)?;
    let gathered = world.zeros::<f32>(n * total_params)?;
    for (l, f) in flat.iter().enumerate() {
        let mut host = Vec::with_capacity(total_params);
        for p in &params {
            host.extend(p.replicas[l].to_vec()?);
        }
        f.write(&host)?;
    }
    world.all_gather(&flat, &gathered)?;
    let replicas =
        gathered[0].to_vec()?.chunks(total_params).map(|c| c.iter().map(|v| v.to_bits()).collect()).collect();
    Ok(Run { epoch_losses, replicas, seconds, setup_seconds })
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
    if args.batch == 0 || args.steps == 0 || args.epochs == 0 || args.accumulate == 0 {
        return Err(Error::InvalidArgument(
            "--batch, --steps, --epochs and --accumulate must each be at least 1".into(),
        ));
    }
    if let Some(n) = args.devices {
        if n == 0 || !args.batch.is_multiple_of(n) {
            return Err(Error::InvalidArgument(format!(
                "--devices {n}: the global batch of {} must split evenly: use a divisor of it",
                args.batch
            )));
        }
        if args.backend == "cpu" {
            // Before the first CPU client exists: the runtime reads it then.
            std::env::set_var(cohort::runtime::config::CPU_DEVICES.name, n.to_string());
        }
    }
    // Alone: every device (or --devices). Under a launcher: --devices per
    // rank (default 1), chosen by LOCAL_RANK.
    // The world's clients are the communication streams (high priority).
    let world = World::join(communication_clients(&rank_clients(&args.backend, args.devices)?))?;
    let n = world.members();
    if !args.batch.is_multiple_of(n) {
        return Err(Error::InvalidArgument(format!(
            "{n} devices do not split the global batch of {} evenly: pick --batch as a multiple of {n}",
            args.batch
        )));
    }
    let leads = world.rank() == 0;
    let place = match world.world_size() {
        1 => "one process".to_string(),
        ranks => format!("{ranks} processes ({} per process, {:?})", world.clients().len(), world.transport()),
    };
    let config = args.config();
    if leads {
        println!("data_parallel: backend {}, {n} devices in {place}: {}", args.backend, describe(world.clients()));
        let options = args.options();
        println!(
            "data_parallel: MLP {} layers × {} ({} parameters), global batch {}, {} epochs × {} steps, SGD lr {} momentum 0.9, buckets of {:.1} MiB (first {:.1} MiB), hook {:?}{}",
            config.depth,
            config.width,
            config.parameters(),
            args.batch,
            args.epochs,
            args.steps,
            args.lr,
            options.bucket_cap_bytes as f64 / (1 << 20) as f64,
            options.first_bucket_bytes as f64 / (1 << 20) as f64,
            options.hook,
            if args.accumulate > 1 { format!(", {} micro-batches per step (no_sync)", args.accumulate) } else { String::new() }
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
    let samples = (args.epochs * args.steps * args.batch * args.accumulate) as f64;
    println!(
        "time: {:.2} s on {n} devices ({:.0} samples/s), {:.2} s on 1 device ({:.0} samples/s); before them, start-up (data, model, shape check, broadcast): {:.2} s and {:.2} s",
        parallel.seconds,
        samples / parallel.seconds,
        single.seconds,
        samples / single.seconds,
        parallel.setup_seconds,
        single.setup_seconds
    );
    let loss_ok = worst <= TOLERANCE;
    let learned = parallel.epoch_losses.last() < parallel.epoch_losses.first();
    println!("check: replicas bit-identical across {n} devices: {}", if identical { "yes" } else { "NO" });
    println!(
        "check: loss matches the 1-device run within {TOLERANCE:e} relative (worst {worst:.2e}): {}",
        if loss_ok { "yes" } else { "NO" }
    );
    println!("check: loss went down: {}", if learned { "yes" } else { "NO" });
    Ok(identical && loss_ok && learned)
}
