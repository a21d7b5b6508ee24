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
//! For each count it times, per step (mean over `--steps` after
//! `--warmup`): the full step (forward, backward with each bucket's
//! all-reduce queued as it fills, SGD); the same step with no_sync
//! (compute alone); and the buckets' all-reduces alone. From these:
//! scaling efficiency (throughput per device against one device, samples
//! per device fixed) and the share of all-reduce time hidden behind
//! compute, `(compute + all-reduce − step) / all-reduce`. `--timeline` writes
//! one step of the largest count as Chrome trace events (open in
//! ui.perfetto.dev): the compute stream's span on each device and each
//! bucket's all-reduce, from when it was queued to when its `Work` was done,
//! both observed from the host.
//!
//! With `--torch` (default on CUDA) it runs `scripts/anchors/torch_ddp.py`
//! under `python3 -m torch.distributed.run` for each count with the same
//! sizes and prints its step times beside cohort's.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use cohort::ddp::{compute_clients, DdpOptions, DistributedDataParallel};
use cohort::nn::{Mlp, MlpConfig, Sgd, TeacherData};
use cohort::prelude::*;

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
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
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

#[derive(Debug, Clone, Default)]
struct Row {
    count: usize,
    step_ms: f64,
    compute_ms: f64,
    comm_ms: f64,
    torch_step_ms: Option<f64>,
    torch_compute_ms: Option<f64>,
}

impl Row {
    /// Share of all-reduce time hidden behind compute, in [0, 1].
    fn hidden(&self) -> Option<f64> {
        (self.count > 1 && self.comm_ms > 0.0)
            .then(|| ((self.compute_ms + self.comm_ms - self.step_ms) / self.comm_ms).clamp(0.0, 1.0))
    }
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

/// Times cohort on the first `count` devices; writes a timeline when asked.
fn measure(all: &[Client], count: usize, args: &Args, timeline: Option<&PathBuf>) -> Result<Row, Error> {
    let world = ClientGroup::new(all[..count].to_vec())?;
    let cfg = config(args);
    let rows = batch(args);
    let clients = compute_clients(&world);
    let data = TeacherData::new(&clients[0], &clients, 0, count, cfg, 99, rows * count, 2)?;
    let mut model = Mlp::new(&clients, cfg, rows, 7)?;
    let params = model.parameters();
    let options =
        DdpOptions { bucket_cap_bytes: (args.bucket_cap_mb * (1 << 20) as f64) as usize, ..DdpOptions::default() };
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
    let comm_ms = if count > 1 {
        timed(
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
        )?
    } else {
        0.0
    };
    if let Some(path) = timeline {
        write_timeline(path, &world, &clients, &mut model, &data, &mut ddp, &sgd, &params)?;
    }
    Ok(Row { count, step_ms, compute_ms, comm_ms, ..Row::default() })
}

/// One step, observed from the host: each device's compute stream from the
/// step's start to its fence after backward, and each bucket's all-reduce
/// from when it was queued to when its `Work` said done.
#[allow(clippy::too_many_arguments)]
fn write_timeline(
    path: &PathBuf,
    world: &ClientGroup,
    clients: &[Client],
    model: &mut Mlp,
    data: &TeacherData,
    ddp: &mut DistributedDataParallel<'_, ClientGroup>,
    sgd: &Sgd,
    params: &[cohort::nn::Parameter],
) -> Result<(), Error> {
    for c in clients {
        c.sync()?;
    }
    world.sync()?;
    let t0 = Instant::now();
    model.forward(&data.inputs[0])?;
    // Each bucket's queue time: backward queues them in order.
    let mut queued = Vec::new();
    {
        struct Watch<'a, 'w> {
            ddp: &'a mut DistributedDataParallel<'w, ClientGroup>,
            queued: &'a mut Vec<Duration>,
            t0: Instant,
        }
        impl cohort::nn::Gradients for Watch<'_, '_> {
            fn gradient(&self, index: usize) -> &[Buffer<f32>] {
                self.ddp.gradient(index)
            }
        }
        impl cohort::nn::GradientSink for Watch<'_, '_> {
            fn ready(&mut self, index: usize) -> Result<(), Error> {
                let before = self.ddp.works().len();
                self.ddp.ready(index)?;
                if self.ddp.works().len() > before {
                    self.queued.push(self.t0.elapsed());
                }
                Ok(())
            }
        }
        let mut watch = Watch { ddp, queued: &mut queued, t0 };
        model.backward(&data.targets[0], 0, &mut watch)?;
    }
    let fences: Vec<_> = clients.iter().map(Client::fence).collect::<Result<_, _>>()?;
    let waiter = std::thread::spawn(move || {
        fences.into_iter().map(|f| f.wait().map(|()| t0.elapsed())).collect::<Result<Vec<_>, _>>()
    });
    let mut done = vec![None; ddp.works().len()];
    while done.iter().any(Option::is_none) {
        for (d, w) in done.iter_mut().zip(ddp.works()) {
            if d.is_none() && w.is_done() {
                *d = Some(t0.elapsed());
            }
        }
        std::hint::spin_loop();
    }
    ddp.wait()?;
    let compute_end = waiter.join().expect("the fence thread")?;
    ddp.finish()?;
    sgd.step(params, ddp)?;
    ddp.zero_grad()?;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut events = Vec::new();
    for (dev, end) in compute_end.iter().enumerate() {
        events.push(format!(
            r#"{{"name":"forward+backward","cat":"compute","ph":"X","pid":0,"tid":{dev},"ts":0,"dur":{:.1}}}"#,
            us(*end)
        ));
    }
    let plans = ddp.buckets();
    for (b, (q, d)) in queued.iter().zip(&done).enumerate() {
        let d = d.expect("every work done");
        events.push(format!(
            r#"{{"name":"all_reduce bucket {b} ({:.1} MiB)","cat":"collective","ph":"X","pid":0,"tid":100,"ts":{:.1},"dur":{:.1}}}"#,
            plans[b].len as f64 * 4.0 / (1 << 20) as f64,
            us(*q),
            us(d.saturating_sub(*q))
        ));
    }
    events.push(
        r#"{"name":"thread_name","ph":"M","pid":0,"tid":100,"args":{"name":"all-reduces (queued → done)"}}"#.into(),
    );
    for dev in 0..compute_end.len() {
        events.push(format!(
            r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{dev},"args":{{"name":"device {dev} compute"}}}}"#
        ));
    }
    std::fs::write(path, format!("[\n{}\n]\n", events.join(",\n")))
        .map_err(|e| Error::InvalidArgument(format!("--timeline {}: {e}", path.display())))?;
    println!("timeline of one step on {} devices: {} (open in ui.perfetto.dev)", clients.len(), path.display());
    Ok(())
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
    let mut chart = ChartBuilder::on(&left)
        .caption(format!("step time ({device})"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5..max_count + 0.5, 0.0..max_ms.max(1e-3))
        .map_err(|e| e.to_string())?;
    chart.configure_mesh().x_desc("devices").y_desc("ms per step").draw().map_err(|e| e.to_string())?;
    let cohort: Vec<(f64, f64)> = rows.iter().map(|r| (r.count as f64, r.step_ms)).collect();
    let torch: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.torch_step_ms.map(|t| (r.count as f64, t))).collect();
    for (series, color, name) in [(&cohort, BLUE, "cohort"), (&torch, RED, "torch DDP")] {
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
    let mut chart = ChartBuilder::on(&right)
        .caption("scaling efficiency (throughput per device / 1 device)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5..max_count + 0.5, 0.0..1.2)
        .map_err(|e| e.to_string())?;
    chart.configure_mesh().x_desc("devices").y_desc("efficiency").draw().map_err(|e| e.to_string())?;
    let base = rows.iter().find(|r| r.count == 1);
    let eff = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        let Some(b) = base.and_then(f) else { return Vec::new() };
        rows.iter().filter_map(|r| f(r).map(|v| (r.count as f64, b / v))).collect()
    };
    let cohort_eff = eff(&|r: &Row| Some(r.step_ms));
    let torch_eff = eff(&|r: &Row| r.torch_step_ms);
    for (series, color, name) in [(&cohort_eff, BLUE, "cohort"), (&torch_eff, RED, "torch DDP")] {
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
    root.present().map_err(|e| e.to_string())?;
    Ok(())
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
    let options =
        DdpOptions { bucket_cap_bytes: (args.bucket_cap_mb * (1 << 20) as f64) as usize, ..DdpOptions::default() };
    let lens: Vec<usize> =
        (0..2 * cfg.depth).map(|i| if i % 2 == 0 { cfg.width * cfg.width } else { cfg.width }).collect();
    let buckets = cohort::ddp::plan(&lens, options.first_bucket_bytes, options.bucket_cap_bytes).0.len();
    let device = all[0].properties().name.clone();
    println!(
        "ddp_bench: MLP {} × {} ({:.1} M parameters, {:.0} MiB of f32 gradients), {} samples per device, buckets of {} MiB (first {} MiB): {buckets} buckets; {} steps after {} warm-up; backend {} ({device} ×{})",
        cfg.depth,
        cfg.width,
        cfg.parameters() as f64 / 1e6,
        cfg.parameters() as f64 * 4.0 / (1 << 20) as f64,
        batch(&args),
        args.bucket_cap_mb,
        options.first_bucket_bytes >> 20,
        args.steps,
        args.warmup,
        args.backend,
        all.len()
    );
    let run_torch = args.torch.unwrap_or(args.backend == "cuda");
    let mut rows = Vec::new();
    let largest = counts.iter().copied().max().unwrap_or(1);
    for &count in &counts {
        let timeline = args.timeline.as_ref().filter(|_| count == largest);
        let mut row = measure(&all, count, &args, timeline)?;
        if run_torch {
            match torch(&args, count) {
                Ok((step, compute)) => {
                    row.torch_step_ms = Some(step);
                    row.torch_compute_ms = Some(compute);
                }
                Err(why) => println!("torch anchor on {count} devices did not run: {why}"),
            }
        }
        let _ = std::io::stdout().flush();
        rows.push(row);
    }
    let base = rows.iter().find(|r| r.count == 1).cloned();
    let per_sample = |ms: f64| ms / batch(&args) as f64;
    println!(
        "{:>7} {:>12} {:>12} {:>9} {:>12} {:>12} {:>11} {:>11} {:>11} {:>8} {:>12}",
        "devices",
        "cohort ms",
        "torch ms",
        "c/t",
        "cohort eff",
        "torch eff",
        "compute ms",
        "t compute",
        "allred ms",
        "hidden",
        "samples/s"
    );
    for r in &rows {
        let ratio = r.torch_step_ms.map(|t| r.step_ms / t);
        let eff = base.as_ref().map(|b| b.step_ms / r.step_ms);
        let torch_eff = base.as_ref().and_then(|b| Some(b.torch_step_ms? / r.torch_step_ms?));
        let fmt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        println!(
            "{:>7} {:>12.2} {:>12} {:>9} {:>12} {:>12} {:>11.2} {:>11} {:>11} {:>8} {:>12.0}",
            r.count,
            r.step_ms,
            fmt(r.torch_step_ms, 2),
            fmt(ratio, 3),
            fmt(eff, 3),
            fmt(torch_eff, 3),
            r.compute_ms,
            fmt(r.torch_compute_ms, 2),
            if r.count > 1 { format!("{:.2}", r.comm_ms) } else { "-".into() },
            r.hidden().map_or("-".into(), |h| format!("{:.0}%", h * 100.0)),
            r.count as f64 * 1e3 / per_sample(r.step_ms),
        );
    }
    println!(
        "c/t: cohort's step time over torch's (goal ≤ 1.0); eff: throughput per device over 1 device's; hidden: (compute + all-reduce − step) / all-reduce"
    );
    if let Some(path) = &args.plot {
        plot(path, &rows, &device).map_err(|e| Error::InvalidArgument(format!("--plot {}: {e}", path.display())))?;
        println!("plot: {}", path.display());
    }
    Ok(())
}
