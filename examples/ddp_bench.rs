//! Data-parallel training step time, cohort's `DistributedDataParallel`
//! beside PyTorch DDP (NCCL, one process per GPU under torchrun) in the same
//! run, at one device and at every device count of the machine (1, 2, 4, 8
//! up to the count).
//!
//! ```text
//! cargo run --release --example ddp_bench                      # CPU: 4 devices vs 1, the small model
//! ddp_bench --backend cuda --large [--plot ddp.svg] [--timeline step.json]
//! ```
//!
//! For each count (and each communication-stream priority of
//! `--priorities`, default `high`) it times, per step (mean over `--steps`
//! after `--warmup`, host clock around the drained devices): the full step
//! (forward, backward with each bucket's all-reduce queued as it fills, on
//! the world's streams, SGD); the same step with no_sync (compute alone);
//! and the buckets' all-reduces alone. From these: scaling efficiency
//! (throughput per device against one device, samples per device fixed).
//!
//! The share of all-reduce time hidden behind backward comes from device
//! timestamps (`Client::timestamp`: CUDA events; the host clock on the CPU
//! and wgpu, which say so), over `--probe-steps` more steps: on each device,
//! one at the step's start and one after backward on the compute stream,
//! and per bucket one on the compute stream when its last gradient was
//! queued (`ready`) and one on the communication stream after its
//! all-reduce (`done`). A bucket's all-reduce runs from
//! `max(ready, previous bucket's done)` (its stream waits for both) to
//! `done`; hidden = the part of those intervals inside `[step start, end of
//! backward]` over their sum, averaged over devices and steps; exposed =
//! the last `done` past the end of backward. `--timeline` writes one such
//! step of the largest count as Chrome trace events (open in
//! ui.perfetto.dev): per device, the compute stream's forward+backward and
//! each bucket's all-reduce on the communication stream, device times from
//! the step's start on that device.
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use cohort::ddp::{compute_clients, CommHook, DdpOptions, DistributedDataParallel, SplitParameters};
use cohort::nn::{Mlp, MlpConfig, Sgd, TeacherData};
use cohort::prelude::*;
use cohort::runtime::{StreamPriority, Timestamp, TimingMethod};

#[derive(Parser, Debug)]
#[command(about = "DDP step time: cohort against PyTorch DDP, and scaling over device counts")]
struct Args {
    /// Backend: cpu, wgpu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// The large model: 8 layers of 4096 (134 M parameters).
    #[arg(long)]
    large: bool,
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    depth: Option<usize>,
    /// Samples per device per step (default 512 on GPUs, 64 on the CPU).
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Steps timed with device timestamps for the hidden share.
    #[arg(long, default_value_t = 5)]
    probe_steps: usize,
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// The first bucket's cap (PyTorch DDP's default: 1 MiB).
    #[arg(long, default_value_t = 1.0)]
    first_bucket_mb: f64,
    /// The communication hook: none, bf16 or fp16 (the torch anchor runs
    /// none, so it is skipped with a hook).
    #[arg(long, default_value = "none")]
    hook: String,
    /// Priorities of the communication streams to measure, comma-separated:
    /// high (the default), normal, or both.
    #[arg(long, value_delimiter = ',', default_value = "high")]
    priorities: Vec<String>,
    /// Bucket layouts to measure, comma-separated: last (the first layer's
    /// weight, the last gradient backward produces, cut into row pieces of
    /// at most the cap, each all-reduced as backward writes it; the
    /// default), all (every weight cut so), off (PyTorch's whole
    /// parameters), or every (all three).
    #[arg(long, value_delimiter = ',', default_value = "last")]
    split: Vec<String>,
    /// Device counts, comma-separated (default: 1 and every power of two up
    /// to the machine's count, and the count; 1 and 4 on the CPU).
    #[arg(long, value_delimiter = ',')]
    counts: Vec<usize>,
    /// Run the PyTorch DDP anchor too (`--torch=false` to skip; default on
    /// for cuda).
    #[arg(long)]
    torch: Option<bool>,
    /// The anchor script.
    #[arg(long, default_value = "scripts/anchors/torch_ddp.py")]
    torch_script: PathBuf,
    /// Draw step time and scaling efficiency against device count (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write one step of the largest count as Chrome trace events.
    #[arg(long)]
    timeline: Option<PathBuf>,
}

impl Args {
    fn options(&self) -> Result<DdpOptions, Error> {
        let hook = match self.hook.as_str() {
            "none" => CommHook::AllReduce,
            "bf16" => CommHook::Bf16Compress,
            "fp16" => CommHook::Fp16Compress,
            other => return Err(Error::InvalidArgument(format!("--hook {other}: none, bf16 or fp16"))),
        };
        let bytes = |mb: f64, name: &str| -> Result<usize, Error> {
            if !(mb.is_finite() && mb > 0.0 && mb < 1e6) {
                return Err(Error::InvalidArgument(format!("--{name} {mb}: a size in MiB above 0")));
            }
            Ok(((mb * (1 << 20) as f64) as usize).max(1))
        };
        Ok(DdpOptions {
            bucket_cap_bytes: bytes(self.bucket_cap_mb, "bucket-cap-mb")?,
            first_bucket_bytes: bytes(self.first_bucket_mb, "first-bucket-mb")?,
            hook,
            split_parameters: SplitParameters::Off,
        })
    }

    fn splits(&self) -> Result<Vec<SplitParameters>, Error> {
        let mut out = Vec::new();
        for s in &self.split {
            match s.as_str() {
                "off" => out.push(SplitParameters::Off),
                "last" => out.push(SplitParameters::Last(2)),
                "all" => out.push(SplitParameters::All),
                "every" => out.extend([SplitParameters::Off, SplitParameters::Last(2), SplitParameters::All]),
                other => return Err(Error::InvalidArgument(format!("--split {other}: off, last, all or every"))),
            }
        }
        out.dedup();
        Ok(out)
    }

    fn priorities(&self) -> Result<Vec<StreamPriority>, Error> {
        let mut out = Vec::new();
        for p in &self.priorities {
            match p.as_str() {
                "high" => out.push(StreamPriority::High),
                "normal" => out.push(StreamPriority::Normal),
                "both" => out.extend([StreamPriority::Normal, StreamPriority::High]),
                other => return Err(Error::InvalidArgument(format!("--priorities {other}: high, normal or both"))),
            }
        }
        out.dedup();
        Ok(out)
    }
}

#[derive(Debug, Clone, Default)]
struct Row {
    count: usize,
    priority: StreamPriority,
    split: SplitParameters,
    step_ms: f64,
    compute_ms: f64,
    comm_ms: Option<f64>,
    /// From device timestamps (see the module).
    probe: Option<Probe>,
    torch_step_ms: Option<f64>,
    torch_compute_ms: Option<f64>,
}

/// What the timestamped steps measured, averaged over devices and steps.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// The buckets' all-reduce time inside the step.
    comm_ms: f64,
    /// The part of it past the end of backward.
    exposed_ms: f64,
    /// Share of all-reduce time inside `[step start, end of backward]`.
    hidden: f64,
    backward_end_ms: f64,
    method: TimingMethod,
}

fn config(args: &Args) -> MlpConfig {
    let base = if args.large { MlpConfig::LARGE } else { MlpConfig::SMALL };
    MlpConfig { width: args.width.unwrap_or(base.width), depth: args.depth.unwrap_or(base.depth) }
}

/// Mean milliseconds of `step` over `steps` after `warmup`, ending with
/// `drain` (waits for the devices).
fn timed(
    steps: usize,
    warmup: usize,
    mut step: impl FnMut() -> Result<(), Error>,
    drain: impl Fn() -> Result<(), Error>,
) -> Result<f64, Error> {
    for _ in 0..warmup {
        step()?;
    }
    drain()?;
    let start = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    drain()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

/// Times cohort on the first `count` devices with the communication streams
/// at `priority`; writes a timeline when asked.
fn measure(
    all: &[Client],
    count: usize,
    priority: StreamPriority,
    split: SplitParameters,
    args: &Args,
    timeline: Option<&PathBuf>,
) -> Result<Row, Error> {
    let comm: Vec<Client> =
        all[..count].iter().map(|c| c.with_stream(StreamId::fresh_with_priority(priority))).collect();
    let world = ClientGroup::new(comm)?;
    let cfg = config(args);
    let rows = batch(args);
    let clients = compute_clients(&world);
    let data = TeacherData::new(&clients[0], &clients, 0, count, cfg, 99, rows * count, 2)?;
    let mut model = Mlp::new(&clients, cfg, rows, 7)?;
    let params = model.parameters();
    let options = DdpOptions { split_parameters: split, ..args.options()? };
    let mut ddp = DistributedDataParallel::new(&world, &params, options)?;
    let sgd = Sgd::new(&params, 1e-3, 0.9)?;
    let drain = || -> Result<(), Error> {
        for c in &clients {
            c.sync()?;
        }
        world.sync()?;
        Ok(())
    };
    let mut i = 0usize;
    let step_ms = timed(
        args.steps,
        args.warmup,
        || {
            i += 1;
            model.forward(&data.inputs[i % 2])?;
            model.backward(&data.targets[i % 2], 0, &mut ddp)?;
            ddp.finish()?;
            sgd.step(&params, &ddp)?;
            ddp.zero_grad()
        },
        drain,
    )?;
    let compute_ms = timed(
        args.steps,
        args.warmup,
        || {
            i += 1;
            model.forward(&data.inputs[i % 2])?;
            ddp.no_sync(|ddp| {
                model.backward(&data.targets[i % 2], 0, ddp)?;
                ddp.finish()
            })?;
            sgd.step(&params, &ddp)?;
            ddp.zero_grad()
        },
        drain,
    )?;
    let buckets = ddp.buckets().len();
    // A group of one device on plain copies has nothing to all-reduce.
    let communicates = world.transport() != cohort::comm::Transport::LocalCopy || args.hook != "none";
    let comm_ms = if communicates {
        Some(timed(
            args.steps,
            args.warmup,
            || {
                for b in 0..buckets {
                    let g = ddp.bucket_gradients(b);
                    world.all_reduce(g, g, ReduceOp::Avg)?;
                }
                Ok(())
            },
            drain,
        )?)
    } else {
        None
    };
    let mut probe = None;
    if communicates && args.probe_steps > 0 {
        let mut sum =
            Probe { comm_ms: 0.0, exposed_ms: 0.0, hidden: 0.0, backward_end_ms: 0.0, method: TimingMethod::Device };
        let mut last = None;
        for _ in 0..args.probe_steps {
            i += 1;
            let step = probed_step(&world, &clients, &mut model, &data, i % 2, &mut ddp, &sgd, &params)?;
            let p = step.summary();
            sum.comm_ms += p.comm_ms;
            sum.exposed_ms += p.exposed_ms;
            sum.hidden += p.hidden;
            sum.backward_end_ms += p.backward_end_ms;
            sum.method = p.method;
            last = Some(step);
        }
        let n = args.probe_steps as f64;
        probe = Some(Probe {
            comm_ms: sum.comm_ms / n,
            exposed_ms: sum.exposed_ms / n,
            hidden: sum.hidden / n,
            backward_end_ms: sum.backward_end_ms / n,
            method: sum.method,
        });
        if let (Some(path), Some(step)) = (timeline, last) {
            step.write_timeline(path, &ddp)?;
        }
    }
    Ok(Row { count, priority, split, step_ms, compute_ms, comm_ms, probe, ..Row::default() })
}

/// One step's device times on each device, in ms from the step's start
/// there.
struct ProbedStep {
    /// Per device: end of backward on the compute stream.
    backward_end: Vec<f64>,
    /// Per device, per bucket (in the order queued): `(ready, done)`.
    buckets: Vec<Vec<(f64, f64)>>,
    method: TimingMethod,
}

impl ProbedStep {
    /// Per device, per bucket: the all-reduce's interval on the
    /// communication stream, `(max(ready, previous done), done)`.
    fn intervals(&self, device: usize) -> Vec<(f64, f64)> {
        let mut previous = 0.0f64;
        self.buckets[device]
            .iter()
            .map(|&(ready, done)| {
                let start = ready.max(previous).min(done);
                previous = done;
                (start, done)
            })
            .collect()
    }

    /// All-reduce time, exposed time and hidden share, averaged over devices.
    fn summary(&self) -> Probe {
        let devices = self.backward_end.len() as f64;
        let (mut comm, mut exposed, mut hidden) = (0.0, 0.0, 0.0);
        for (d, &end) in self.backward_end.iter().enumerate() {
            let spans = self.intervals(d);
            let total: f64 = spans.iter().map(|(a, b)| b - a).sum();
            let inside: f64 = spans.iter().map(|&(a, b)| (b.min(end) - a.min(end)).max(0.0)).sum();
            let last = spans.iter().map(|s| s.1).fold(end, f64::max);
            comm += total;
            exposed += last - end;
            hidden += if total > 0.0 { inside / total } else { 1.0 };
        }
        Probe {
            comm_ms: comm / devices,
            exposed_ms: exposed / devices,
            hidden: hidden / devices,
            backward_end_ms: self.backward_end.iter().sum::<f64>() / devices,
            method: self.method,
        }
    }

    /// Chrome trace events: per device, forward+backward on the compute
    /// stream and each bucket's all-reduce on the communication stream.
    fn write_timeline<C: cohort::comm::Collectives>(
        &self,
        path: &PathBuf,
        ddp: &DistributedDataParallel<'_, C>,
    ) -> Result<(), Error> {
        let plans = ddp.buckets();
        let how = match self.method {
            TimingMethod::Device => "device timestamps",
            TimingMethod::Host => "host clock",
        };
        let mut events = Vec::new();
        for (dev, end) in self.backward_end.iter().enumerate() {
            let (compute, comm) = (2 * dev, 2 * dev + 1);
            events.push(format!(
                r#"{{"name":"forward+backward","cat":"compute","ph":"X","pid":0,"tid":{compute},"ts":0,"dur":{:.1}}}"#,
                end * 1e3
            ));
            for (b, ((start, done), (ready, _))) in self.intervals(dev).iter().zip(&self.buckets[dev]).enumerate() {
                events.push(format!(
                    r#"{{"name":"all_reduce bucket {b} ({:.1} MiB)","cat":"collective","ph":"X","pid":0,"tid":{comm},"ts":{:.1},"dur":{:.1},"args":{{"gradients ready at (us)":{:.1}}}}}"#,
                    plans[b].len as f64 * 4.0 / (1 << 20) as f64,
                    start * 1e3,
                    (done - start) * 1e3,
                    ready * 1e3
                ));
            }
            events.push(format!(
                r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{compute},"args":{{"name":"device {dev} compute stream"}}}}"#
            ));
            events.push(format!(
                r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{comm},"args":{{"name":"device {dev} communication stream"}}}}"#
            ));
        }
        events.push(format!(
            r#"{{"name":"process_name","ph":"M","pid":0,"args":{{"name":"one DDP step ({how}; each device from its step start)"}}}}"#
        ));
        std::fs::write(path, format!("[\n{}\n]\n", events.join(",\n")))
            .map_err(|e| Error::InvalidArgument(format!("--timeline {}: {e}", path.display())))?;
        println!(
            "timeline of one step on {} devices ({how}): {} (open in ui.perfetto.dev)",
            self.backward_end.len(),
            path.display()
        );
        Ok(())
    }
}

/// One step with device timestamps: at the start and after backward on each
/// compute stream; per bucket, on the compute streams when its all-reduce
/// was queued (its gradients are the compute stream's work so far) and on
/// the communication streams after it. Drains, then reads them.
#[allow(clippy::too_many_arguments)]
fn probed_step<C: cohort::comm::Collectives>(
    world: &C,
    clients: &[Client],
    model: &mut Mlp,
    data: &TeacherData,
    batch: usize,
    ddp: &mut DistributedDataParallel<'_, C>,
    sgd: &Sgd,
    params: &[cohort::nn::Parameter],
) -> Result<ProbedStep, Error> {
    let drain = || -> Result<(), Error> {
        for c in clients {
            c.sync()?;
        }
        Ok(world.sync()?)
    };
    drain()?;
    let origin: Vec<Timestamp> = clients.iter().map(Client::timestamp).collect::<Result<_, _>>()?;
    model.forward(&data.inputs[batch])?;
    struct Watch<'a, 'w, C: cohort::comm::Collectives> {
        ddp: &'a mut DistributedDataParallel<'w, C>,
        compute: &'a [Client],
        comm: &'a [Client],
        /// Per bucket: per device (ready, done).
        stamps: Vec<Vec<(Timestamp, Timestamp)>>,
    }
    impl<C: cohort::comm::Collectives> Watch<'_, '_, C> {
        /// Stamps both streams when `report` queued a bucket's all-reduce.
        fn stamp_after(
            &mut self,
            report: impl FnOnce(&mut DistributedDataParallel<'_, C>) -> Result<(), Error>,
        ) -> Result<(), Error> {
            let before = self.ddp.works().len();
            report(self.ddp)?;
            // Buckets completed by this report, each stamped after its
            // all-reduce was queued (the last one's stamps cover them all).
            for _ in before..self.ddp.works().len() {
                let pairs = self
                    .compute
                    .iter()
                    .zip(self.comm)
                    .map(|(compute, comm)| Ok((compute.timestamp()?, comm.timestamp()?)))
                    .collect::<Result<Vec<_>, Error>>()?;
                self.stamps.push(pairs);
            }
            Ok(())
        }
    }
    impl<C: cohort::comm::Collectives> cohort::nn::Gradients for Watch<'_, '_, C> {
        fn pieces(&self, index: usize) -> &[cohort::nn::GradientPiece] {
            self.ddp.pieces(index)
        }
    }
    impl<C: cohort::comm::Collectives> cohort::nn::GradientSink for Watch<'_, '_, C> {
        fn ready(&mut self, index: usize) -> Result<(), Error> {
            self.stamp_after(|ddp| ddp.ready(index))
        }
        fn ready_piece(&mut self, index: usize, piece: usize) -> Result<(), Error> {
            self.stamp_after(|ddp| ddp.ready_piece(index, piece))
        }
    }
    let mut watch = Watch { ddp, compute: clients, comm: world.clients(), stamps: Vec::new() };
    model.backward(&data.targets[batch], 0, &mut watch)?;
    let stamps = std::mem::take(&mut watch.stamps);
    let backward_end: Vec<Timestamp> = clients.iter().map(Client::timestamp).collect::<Result<_, _>>()?;
    ddp.finish()?;
    sgd.step(params, ddp)?;
    ddp.zero_grad()?;
    drain()?;
    let mut method = TimingMethod::Device;
    let mut ends = Vec::new();
    let mut buckets = Vec::new();
    for (d, client) in clients.iter().enumerate() {
        let mut points = vec![&backward_end[d]];
        for bucket in &stamps {
            points.push(&bucket[d].0);
            points.push(&bucket[d].1);
        }
        let (ms, how) = client.timestamps_since(&origin[d], &points).map_err(|e| match e {
            cohort::runtime::ProfileError::Server(e) => Error::Device(e),
            other => Error::InvalidArgument(other.to_string()),
        })?;
        if how == TimingMethod::Host {
            method = TimingMethod::Host;
        }
        ends.push(ms[0]);
        buckets.push(ms[1..].chunks(2).map(|p| (p[0], p[1])).collect());
    }
    Ok(ProbedStep { backward_end: ends, buckets, method })
}

fn batch(args: &Args) -> usize {
    args.batch.unwrap_or(if args.backend == "cpu" { 64 } else { 512 })
}

/// Runs the torch anchor on `count` GPUs; `Err` says why it did not run.
fn torch(args: &Args, count: usize) -> Result<(f64, f64), String> {
    let cfg = config(args);
    let out = Command::new("python3")
        .args(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", &count.to_string()])
        .arg(&args.torch_script)
        .args(["--width", &cfg.width.to_string(), "--depth", &cfg.depth.to_string()])
        .args(["--batch", &batch(args).to_string(), "--steps", &args.steps.to_string()])
        .args(["--warmup", &args.warmup.to_string(), "--bucket-cap-mb", &args.bucket_cap_mb.to_string()])
        .output()
        .map_err(|e| format!("python3 did not start: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line =
        stdout.lines().find_map(|l| l.split_once("TORCH_DDP ").map(|(_, j)| j.to_string())).ok_or_else(|| {
            let err = String::from_utf8_lossy(&out.stderr);
            format!("no TORCH_DDP line ({}): {}", out.status, err.lines().rev().take(3).collect::<Vec<_>>().join(" | "))
        })?;
    let field = |name: &str| -> Result<f64, String> {
        let at = line.find(&format!("\"{name}\": ")).ok_or(format!("no {name} in {line}"))?;
        let rest = &line[at + name.len() + 4..];
        rest.split([',', '}']).next().unwrap_or("").trim().parse().map_err(|e| format!("{name}: {e}"))
    };
    Ok((field("step_ms")?, field("compute_ms")?))
}

fn plot(path: &PathBuf, rows: &[Row], device: &str) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(550);
    let max_count = rows.iter().map(|r| r.count).max().unwrap_or(1) as f64;
    let max_ms = rows.iter().flat_map(|r| [Some(r.step_ms), r.torch_step_ms]).flatten().fold(0.0, f64::max) * 1.2;
    let cohort: Vec<(f64, f64)> = rows.iter().map(|r| (r.count as f64, r.step_ms)).collect();
    let torch: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.torch_step_ms.map(|t| (r.count as f64, t))).collect();
    let caption = format!("step time ({device})");
    panel(&left, &caption, "ms per step", max_count, max_ms.max(1e-3), [&cohort, &torch])?;
    let base = rows.iter().find(|r| r.count == 1);
    let eff = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        let Some(b) = base.and_then(f) else { return Vec::new() };
        rows.iter().filter_map(|r| f(r).map(|v| (r.count as f64, b / v))).collect()
    };
    let cohort_eff = eff(&|r: &Row| Some(r.step_ms));
    let torch_eff = eff(&|r: &Row| r.torch_step_ms);
    let caption = "scaling efficiency (throughput per device / 1 device)";
    panel(&right, caption, "efficiency", max_count, 1.2, [&cohort_eff, &torch_eff])?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// One chart of `plot`: cohort's and torch's series (either may be empty)
/// against the device count, `y` from 0 to `max_y`.
fn panel(
    area: &plotters::drawing::DrawingArea<plotters::prelude::SVGBackend, plotters::coord::Shift>,
    caption: &str,
    y_desc: &str,
    max_count: f64,
    max_y: f64,
    [cohort, torch]: [&[(f64, f64)]; 2],
) -> Result<(), String> {
    use plotters::prelude::*;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5..max_count + 0.5, 0.0..max_y)
        .map_err(|e| e.to_string())?;
    chart.configure_mesh().x_desc("devices").y_desc(y_desc).draw().map_err(|e| e.to_string())?;
    for (series, color, name) in [(cohort, BLUE, "cohort"), (torch, RED, "torch DDP")] {
        if series.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(series.iter().copied(), color.stroke_width(2)).point_size(4))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().border_style(BLACK).draw().map_err(|e| e.to_string())?;
    Ok(())
}

fn split_name(split: SplitParameters) -> &'static str {
    match split {
        SplitParameters::Off => "off",
        SplitParameters::All => "all",
        SplitParameters::Last(_) => "last",
    }
}

/// The bucket layout `options` gives the MLP of `cfg`: the count, each
/// bucket's size (runs of equal sizes counted), the parameters cut into
/// pieces, and what the last bucket (the all-reduce left after backward)
/// holds.
fn layout(cfg: MlpConfig, options: DdpOptions) -> String {
    let shapes: Vec<Vec<usize>> = (0..2 * cfg.depth)
        .map(|i| if i.is_multiple_of(2) { vec![cfg.width, cfg.width] } else { vec![cfg.width] })
        .collect();
    let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let granules: Vec<usize> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| if options.split_parameters.covers(i) { cohort::ddp::split_granule(s) } else { lens[i] })
        .collect();
    let (buckets, places) = cohort::ddp::plan(&lens, &granules, options.first_bucket_bytes, options.bucket_cap_bytes);
    let mib = |elems: usize| elems as f64 * 4.0 / (1 << 20) as f64;
    let mut sizes: Vec<(String, usize)> = Vec::new();
    for b in &buckets {
        let size = format!("{:.2}", mib(b.len));
        match sizes.last_mut() {
            Some((last, n)) if *last == size => *n += 1,
            _ => sizes.push((size, 1)),
        }
    }
    let sizes: Vec<String> = sizes.into_iter().map(|(s, n)| if n > 1 { format!("{s} ×{n}") } else { s }).collect();
    let split = places.iter().filter(|p| p.len() > 1).count();
    let pieces: usize = places.iter().filter(|p| p.len() > 1).map(Vec::len).sum();
    let name = |i: usize| format!("layers.{}.{}", i / 2, if i.is_multiple_of(2) { "weight" } else { "bias" });
    let last = buckets.last().map_or(String::new(), |b| {
        let held: Vec<String> = b
            .pieces
            .iter()
            .map(|&(i, k)| {
                let p = places[i][k];
                let row = lens[i] / shapes[i][0];
                if places[i].len() > 1 {
                    format!("{} rows {}..{}", name(i), p.start / row, (p.start + p.len) / row)
                } else {
                    name(i)
                }
            })
            .collect();
        format!("; the last holds {} ({:.2} MiB)", held.join(", "), mib(b.len))
    });
    format!(
        "bucket layout, split {}: {} buckets of {} MiB (in the order backward fills them); {split} parameters cut into {pieces} pieces{last}",
        split_name(options.split_parameters),
        buckets.len(),
        sizes.join(", "),
    )
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    if args.steps == 0 {
        return Err(Error::InvalidArgument("--steps must be at least 1".into()));
    }
    if args.backend == "cpu" && std::env::var(cohort::runtime::config::CPU_DEVICES.name).is_err() {
        // Before the first CPU client exists.
        let most = args.counts.iter().copied().max().unwrap_or(4).max(1);
        std::env::set_var(cohort::runtime::config::CPU_DEVICES.name, most.to_string());
    }
    let all = cohort::runtime::clients_from(&args.backend, 0, None)?;
    let counts: Vec<usize> = if args.counts.is_empty() {
        let mut c: Vec<usize> =
            std::iter::successors(Some(1usize), |c| Some(c * 2)).take_while(|c| *c <= all.len()).collect();
        if c.last() != Some(&all.len()) {
            c.push(all.len());
        }
        c
    } else {
        args.counts.clone()
    };
    if let Some(bad) = counts.iter().find(|c| **c == 0 || **c > all.len()) {
        return Err(Error::InvalidArgument(format!("--counts {bad}: the backend has {} devices", all.len())));
    }
    let cfg = config(&args);
    let options = args.options()?;
    let priorities = args.priorities()?;
    let splits = args.splits()?;
    let device = all[0].properties().name.clone();
    println!(
        "ddp_bench: MLP {} × {} ({:.1} M parameters, {:.0} MiB of f32 gradients), {} samples per device, buckets of {} MiB (first {} MiB), hook {:?}; communication streams at {:?} priority; {} steps after {} warm-up; backend {} ({device} ×{})",
        cfg.depth,
        cfg.width,
        cfg.parameters() as f64 / 1e6,
        cfg.parameters() as f64 * 4.0 / (1 << 20) as f64,
        batch(&args),
        args.bucket_cap_mb,
        args.first_bucket_mb,
        options.hook,
        priorities,
        args.steps,
        args.warmup,
        args.backend,
        all.len()
    );
    for &split in &splits {
        println!("{}", layout(cfg, DdpOptions { split_parameters: split, ..options }));
    }
    let run_torch = args.torch.unwrap_or(args.backend == "cuda");
    if run_torch && options.hook != CommHook::AllReduce {
        println!("torch anchor skipped: it runs no communication hook");
    }
    let run_torch = run_torch && options.hook == CommHook::AllReduce;
    let mut rows = Vec::new();
    let largest = counts.iter().copied().max().unwrap_or(1);
    for &count in &counts {
        let (mut torch_step, mut torch_compute) = (None, None);
        if run_torch {
            match torch(&args, count) {
                Ok((step, compute)) => (torch_step, torch_compute) = (Some(step), Some(compute)),
                Err(why) => println!("torch anchor on {count} devices did not run: {why}"),
            }
        }
        for &split in &splits {
            for &priority in &priorities {
                let last = Some(&priority) == priorities.last() && Some(&split) == splits.last();
                let timeline = args.timeline.as_ref().filter(|_| count == largest && last);
                let mut row = measure(&all, count, priority, split, &args, timeline)?;
                row.torch_step_ms = torch_step;
                row.torch_compute_ms = torch_compute;
                let _ = std::io::stdout().flush();
                rows.push(row);
            }
        }
    }
    let per_sample = |ms: f64| ms / batch(&args) as f64;
    println!(
        "{:>7} {:>8} {:>5} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10}",
        "devices",
        "comm pri",
        "split",
        "cohort ms",
        "torch ms",
        "c/t",
        "cohort eff",
        "torch eff",
        "compute ms",
        "t compute",
        "allred ms",
        "in step ms",
        "exposed ms",
        "hidden",
        "samples/s"
    );
    let mut methods = Vec::new();
    for r in &rows {
        let base = rows.iter().find(|b| b.count == 1 && b.priority == r.priority && b.split == r.split);
        let ratio = r.torch_step_ms.map(|t| r.step_ms / t);
        let eff = base.map(|b| b.step_ms / r.step_ms);
        let torch_eff = base.and_then(|b| Some(b.torch_step_ms? / r.torch_step_ms?));
        let fmt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        if let Some(p) = &r.probe {
            methods.push(p.method);
        }
        println!(
            "{:>7} {:>8} {:>5} {:>10.2} {:>10} {:>7} {:>10} {:>10} {:>10.2} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10.0}",
            r.count,
            format!("{:?}", r.priority).to_lowercase(),
            split_name(r.split),
            r.step_ms,
            fmt(r.torch_step_ms, 2),
            fmt(ratio, 3),
            fmt(eff, 3),
            fmt(torch_eff, 3),
            r.compute_ms,
            fmt(r.torch_compute_ms, 2),
            fmt(r.comm_ms, 2),
            fmt(r.probe.map(|p| p.comm_ms), 2),
            fmt(r.probe.map(|p| p.exposed_ms), 2),
            // On the host clock (CPU, wgpu) a device's one server thread ran
            // the all-reduce between backward's kernels: nothing to hide.
            r.probe
                .filter(|p| p.method == TimingMethod::Device)
                .map_or("-".into(), |p| format!("{:.0}%", p.hidden * 100.0)),
            r.count as f64 * 1e3 / per_sample(r.step_ms),
        );
    }
    let how = if methods.contains(&TimingMethod::Host) {
        "the host clock (this backend has no device timestamps, and its one server thread per device runs an all-reduce between backward's kernels: hidden is not shown)"
    } else {
        "device timestamps (CUDA events)"
    };
    println!(
        "c/t: cohort's step time over torch's (goal ≤ 1.0); eff: throughput per device over 1 device's; allred: the buckets' all-reduces alone; in step, exposed, hidden: from {how} over {} steps, per device: a bucket's all-reduce runs from max(its gradients ready on the compute stream, the previous bucket's done) to done on the communication stream; hidden = its time inside [step start, end of backward] / its time; exposed = last done − end of backward",
        args.probe_steps
    );
    if let Some(path) = &args.plot {
        let high: Vec<Row> = rows
            .iter()
            .filter(|r| Some(&r.priority) == priorities.last() && Some(&r.split) == splits.last())
            .cloned()
            .collect();
        plot(path, &high, &device).map_err(|e| Error::InvalidArgument(format!("--plot {}: {e}", path.display())))?;
        println!("plot: {}", path.display());
    }
    Ok(())
}
