//! nccl-tests' tables for a CUDA `ClientGroup`, beside raw NCCL called
//! through cudarc in the same binary on the same devices: all-reduce,
//! all-gather, reduce-scatter, broadcast and all-to-all.
//!
//! Run (on a machine with CUDA GPUs and libnccl):
//! `cargo run --release --example nccl_bench -- -b 8 -e 256M -f 2`
//! (`--collective all` for the five, `--collective all_gather` for one;
//! `--devices 1` for one device; `-t 5` for five alternating trials per
//! size, `--raw-events` to record an event after each raw call as cohort
//! does). A group of one device takes device
//! copies, not NCCL; `COHORT_NCCL_SINGLE=1` sends it through a one-rank
//! NCCL communicator instead.
//!
//! Columns: `size` in bytes (nccl-tests': the largest buffer, so the
//! gathered output of all-gather and the input of reduce-scatter), `call`
//! the host time of one cohort call (it returns once its parts are
//! queued), `time` the mean of `-n` iterations in µs after `-w` warm-ups
//! (host clock around the iterations, then a sync), `algbw = size / time`,
//! `busbw = algbw × factor` (nccl-tests': all-reduce 2(n-1)/n;
//! all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast 1), for cohort
//! and for raw NCCL, and `ratio` = cohort's busbw / raw NCCL's (algbw's on
//! one device, where most factors are 0). Float, sum, out of place, root 0.
//! `#wrong` counts the elements of the destinations that differ from a host
//! reference (`-c 0` skips the check; sizes above `--check-max` are not
//! checked: the reference of a GiB takes seconds).
//!
//! `--algo auto|nccl|oneshot|twoshot` forces the path of cohort's
//! all-reduces and all-gathers (`all`: one table per path, then auto); the
//! `path` column says which ran for each row. `--write-crossover` (with
//! `--algo all`) stores the sizes where each peer-memory kernel stops
//! beating NCCL as this machine's crossover table, which `auto` reads.
//!
//! `--plot FILE.svg` draws each collective's time and busbw against size,
//! one line per path and one for raw NCCL, on log axes; with `--torch
//! FILE` (the saved output of `scripts/anchors/torch_collectives.py` run
//! under torchrun on the same GPUs) one for torch.distributed too.
//!
//! `--step` times a training-like step instead: ten all-reduces of 4 KiB
//! to 1 MiB with a small kernel before each, queued eagerly against the
//! same step captured once into a CUDA graph per device and replayed, for
//! each path of `--algo` (`ratio` = replay / eager time).
//!
//! The raw baseline calls cudarc's NCCL bindings, which load `libnccl.so`:
//! where only `libnccl.so.2` is installed (the pip wheel), put a
//! `libnccl.so` link to it on `LD_LIBRARY_PATH`, or the baseline is skipped.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cohort::comm::op::Collective;
use cohort::comm::op::Op;
use cohort::comm::verify::Buffers;
use cohort::comm::{Algo, ClientGroup, Crossover, CrossoverRow, DType, ReduceOp, TableKind};
use cohort::prelude::*;
use cohort::runtime::backend::cuda::nccl_version;
use cohort::runtime::CudaRuntime;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/plot.rs"]
mod plot;
use bench::{median, parse_size};
#[path = "support/raw_nccl.rs"]
mod raw_nccl;
use plot::{plot, Point};
use raw_nccl::Raw;

#[derive(Parser, Debug)]
#[command(about = "collectives over NCCL: cohort's ClientGroup beside raw NCCL through cudarc")]
struct Args {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    step_factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: u32,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Trials per size: each times cohort then raw NCCL (`-w` + `-n`
    /// iterations each); the table shows the median trial of each side.
    #[arg(short = 't', long = "trials", default_value_t = 1)]
    trials: u32,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u32,
    /// Largest size whose results are checked.
    #[arg(long = "check-max", default_value = "256M", value_parser = parse_size)]
    check_max: usize,
    /// all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, or
    /// `all` for the five.
    #[arg(long, default_value = "all_reduce")]
    collective: String,
    /// Backend: cuda.
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Devices to use (default: all).
    #[arg(long)]
    devices: Option<usize>,
    /// Record a CUDA event after each raw NCCL call, as cohort does to
    /// learn when a collective ended: shows what that costs the baseline.
    #[arg(long)]
    raw_events: bool,
    /// Path of cohort's all-reduces and all-gathers: auto, nccl, oneshot,
    /// twoshot, or all (one table each, auto last).
    #[arg(long, default_value = "auto")]
    algo: String,
    /// Store the measured crossovers as this machine's table (needs
    /// `--algo all`).
    #[arg(long)]
    write_crossover: bool,
    /// Time a step of ten small all-reduces, eager and replayed as a graph,
    /// instead of the tables.
    #[arg(long)]
    step: bool,
    /// Draw time and busbw against size for each path and raw NCCL into
    /// this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// torch.distributed's timings to draw beside them: the output of
    /// `torchrun --nproc_per_node N scripts/anchors/torch_collectives.py`
    /// saved to a file (needs `--plot`).
    #[arg(long, requires = "plot")]
    torch: Option<std::path::PathBuf>,
}

/// One timed row: collective, path asked for, bytes per member, seconds.
type Timing = (Collective, Algo, usize, f64);

fn parse_algos(text: &str) -> Result<Vec<Algo>, String> {
    if text == "all" {
        return Ok(vec![Algo::Nccl, Algo::OneShot, Algo::TwoShot, Algo::Auto]);
    }
    let raw = std::ffi::OsString::from(text);
    cohort::runtime::config::parse_algo(&raw)
        .map(|a| vec![a])
        .map_err(|e| format!("--algo {text:?}: {e}; use auto, nccl, oneshot, twoshot or all"))
}

/// Raw NCCL's mean seconds of one `coll` of `bytes` (see
/// [`Raw::queue`]): `warmup` calls, a sync, then `iters` calls back to
/// back and a sync.
fn time_raw(raw: &Raw, coll: Collective, bytes: usize, warmup: u32, iters: u32) -> Result<f64, String> {
    for _ in 0..warmup {
        raw.queue(coll, bytes)?;
    }
    raw.sync(false)?;
    let start = Instant::now();
    for _ in 0..iters {
        raw.queue(coll, bytes)?;
    }
    raw.sync(false)?;
    Ok(start.elapsed().as_secs_f64() / iters.max(1) as f64)
}

fn main() -> ExitCode {
    bench::exit("nccl_bench", run(&Args::parse()))
}

fn run(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    if args.backend != "cuda" {
        return Err(format!("backend {:?}: this bench compares against NCCL, use --backend cuda", args.backend).into());
    }
    let collectives: Vec<Collective> = match args.collective.as_str() {
        "all" => FIVE.to_vec(),
        name => match Collective::parse(name).filter(|c| FIVE.contains(c)) {
            Some(c) => vec![c],
            None => {
                return Err(format!(
                    "--collective {name:?}: use all_reduce, all_gather, reduce_scatter, broadcast, all_to_all or all"
                )
                .into())
            }
        },
    };
    let available = CudaRuntime::device_count()?;
    let n = args.devices.unwrap_or(available).clamp(1, available);
    let clients: Vec<Client> = (0..n).map(CudaRuntime::client).collect::<Result<_, _>>()?;
    let group = ClientGroup::new(clients)?;
    let raw = Raw::new(n, args.max_bytes, args.raw_events);
    if let Err(why) = &raw {
        println!("# raw NCCL baseline skipped: {why}");
    }
    let algos = parse_algos(&args.algo)?;
    if args.step {
        drop(raw);
        return step_bench(args, n, &algos).map(|()| 0);
    }
    if args.write_crossover && algos.len() < 4 {
        return Err("--write-crossover measures every path: add --algo all".into());
    }
    // Devices shown on one GPU are not the machine's GPUs: their timings
    // are no crossover table.
    let shared = (1..n).any(|m| (0..m).any(|k| group.client(k).properties().gpu == group.client(m).properties().gpu));
    if args.write_crossover && shared {
        return Err("--write-crossover: some devices share a GPU (COHORT_CUDA_DEVICES); their timings are not this machine's crossover".into());
    }
    let mut total_wrong = 0;
    let mut timings: Vec<Timing> = Vec::new();
    let mut points: Vec<Point> = Vec::new();
    for &coll in &collectives {
        let peer_path = matches!(coll, Collective::AllReduce | Collective::AllGather);
        for &algo in if peer_path { &algos[..] } else { &algos[algos.len() - 1..] } {
            let group = group.clone().with_algo(algo);
            total_wrong += table(args, &group, raw.as_ref().ok(), coll, &mut timings, &mut points)?;
        }
    }
    if let Some(path) = &args.torch {
        let added = plot::add_torch(&mut points, path)?;
        println!("# {added} torch.distributed timings read from {}", path.display());
    }
    if let Some(path) = &args.plot {
        plot(path, &collectives, &points)?;
        println!("# plot written to {}", path.display());
    }
    if args.write_crossover {
        let device = group.client(0).properties().name.clone();
        let mut table = Crossover::for_machine();
        for (coll, kind) in
            [(Collective::AllReduce, TableKind::AllReduce), (Collective::AllGather, TableKind::AllGather)]
        {
            if let Some(row) = crossover(&timings, coll, kind, &device, n) {
                println!("# crossover {}: {row:?}", coll.name());
                table.set(row);
            }
        }
        table.rows.retain(|r| r.device != "*");
        println!("# crossover table written to {}", table.save()?.display());
    }
    Ok(total_wrong)
}

/// The crossover row of `coll` from the timings: the one-shot kernel up to
/// the largest size where it beats NCCL and the two-shot kernel, the
/// two-shot kernel up to the largest where it beats NCCL (all-gathers: one
/// kernel).
fn crossover(
    timings: &[Timing],
    coll: Collective,
    kind: TableKind,
    device: &str,
    ranks: usize,
) -> Option<CrossoverRow> {
    let time =
        |algo: Algo, bytes: usize| timings.iter().find(|t| t.0 == coll && t.1 == algo && t.2 == bytes).map(|t| t.3);
    let mut sizes: Vec<usize> = timings.iter().filter(|t| t.0 == coll).map(|t| t.2).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let (mut one_shot_max, mut two_shot_max) = (0u64, 0u64);
    for &bytes in &sizes {
        let (Some(nccl), Some(one)) = (time(Algo::Nccl, bytes), time(Algo::OneShot, bytes)) else { continue };
        let two = time(Algo::TwoShot, bytes).unwrap_or(f64::INFINITY);
        if one < nccl && (kind == TableKind::AllGather || one <= two) {
            one_shot_max = bytes as u64;
        }
        if kind == TableKind::AllReduce && two < nccl {
            two_shot_max = bytes as u64;
        }
    }
    if sizes.is_empty() {
        return None;
    }
    Some(CrossoverRow {
        device: device.to_string(),
        ranks,
        kind,
        one_shot_max,
        two_shot_max: two_shot_max.max(one_shot_max),
    })
}

/// The collective a row of `size` bytes (nccl-tests' size) runs.
fn op_of(coll: Collective, n: usize, size: usize) -> Op {
    match coll {
        Collective::AllReduce => Op::all_reduce(DType::F32, ReduceOp::Sum, size / 4),
        Collective::AllGather => Op::all_gather(DType::F32, size / 4 / n),
        _ => Op::broadcast(DType::F32, 0, size / 4),
    }
}

/// The five collectives nccl-tests times, in its order.
const FIVE: [Collective; 5] = [
    Collective::AllReduce,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::Broadcast,
    Collective::AllToAll,
];

/// Prints one collective's table; returns the wrong elements found.
fn table(
    args: &Args,
    group: &ClientGroup,
    raw: Option<&Raw>,
    coll: Collective,
    timings: &mut Vec<Timing>,
    points: &mut Vec<Point>,
) -> Result<usize, Box<dyn std::error::Error>> {
    let n = group.len();
    println!(
        "# cohort nccl_bench: {}, float, sum, {n} CUDA device(s) ({}), cohort transport {:?}, --algo {:?}, NCCL {}",
        coll.name(),
        group.client(0).properties().name,
        group.transport(),
        group.algo(),
        nccl_version().unwrap_or_else(|why| format!("unavailable: {why}"))
    );
    println!(
        "# ratio = cohort busbw / raw NCCL busbw (algbw on one device), of the median of {} trial(s); trials = lowest-highest ratio of one trial",
        args.trials.max(1)
    );
    println!(
        "# {:>10} {:>11} {:>7} | {:>9} {:>9} {:>8} {:>8} {:>6} | {:>9} {:>8} {:>8} | {:>7} {:>11}",
        "size",
        "count",
        "path",
        "call(us)",
        "time(us)",
        "algbw",
        "busbw",
        "#wrong",
        "time(us)",
        "algbw",
        "busbw",
        "ratio",
        "trials"
    );
    println!("# {:>31} | {:^44} | {:^27} |", "", "cohort ClientGroup", "raw NCCL (cudarc)");
    let factor = coll.bus_factor(n);
    let mut total_wrong = 0;
    let mut bytes = args.min_bytes.max(4);
    while bytes <= args.max_bytes {
        let bufs = Buffers::new(group, coll, DType::F32, bytes, false, 0);
        let size = bufs.size;
        if size == 0 {
            bytes = bytes.saturating_mul(args.step_factor.max(2));
            continue;
        }
        let trials = args.trials.max(1) as usize;
        let (mut queued, mut times, mut raw_times) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..trials {
            let (q, t) = time_cohort(group, &bufs, args.warmup, args.iters)?;
            queued.push(q);
            times.push(t);
            if let Some(raw) = raw {
                raw_times.push(time_raw(raw, coll, size, args.warmup, args.iters)?);
            }
        }
        let wrong = if args.check == 1 && size <= args.check_max {
            let wrong = bufs.wrong(group, ReduceOp::Sum)?;
            total_wrong += wrong;
            wrong.to_string()
        } else {
            "-".to_string()
        };
        drop(bufs);
        let (queued, time) = (median(&mut queued), median(&mut times));
        let path = group.path_of(&op_of(coll, n, size)).map_or("-", |p| p.name());
        let per_member = if coll == Collective::AllGather { size / n } else { size };
        timings.push((coll, group.algo(), per_member, time));
        let series = format!("cohort {}", format!("{:?}", group.algo()).to_lowercase());
        points.push((coll, series, size as f64, time * 1e6, size as f64 / time / 1e9 * factor));
        let algbw = size as f64 / time / 1e9;
        let busbw = algbw * factor;
        let raw_cols = if raw_times.is_empty() {
            format!("{:>9} {:>8} {:>8} | {:>7} {:>11}", "-", "-", "-", "-", "-")
        } else {
            // Per-trial ratios (busbw ratio = time ratio) show the noise.
            let mut ratios: Vec<f64> = raw_times.iter().zip(&times).map(|(r, c)| r / c).collect();
            ratios.sort_by(f64::total_cmp);
            let t = median(&mut raw_times);
            let (a, b) = (size as f64 / t / 1e9, size as f64 / t / 1e9 * factor);
            // Raw NCCL is timed beside every path's table: plot its first.
            if !points.iter().any(|p| p.0 == coll && p.1 == "raw NCCL" && p.2 == size as f64) {
                points.push((coll, "raw NCCL".into(), size as f64, t * 1e6, b));
            }
            let ratio = if n == 1 { algbw / a } else { busbw / b };
            let spread = format!("{:.2}-{:.2}", ratios[0], ratios[ratios.len() - 1]);
            format!("{:>9.2} {:>8.2} {:>8.2} | {:>7.2} {:>11}", t * 1e6, a, b, ratio, spread)
        };
        println!(
            "  {:>10} {:>11} {:>7} | {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>6} | {raw_cols}",
            size,
            size / 4,
            path,
            queued * 1e6,
            time * 1e6,
            algbw,
            busbw,
            wrong
        );
        bytes = bytes.saturating_mul(args.step_factor.max(2));
    }
    Ok(total_wrong)
}

/// Mean host seconds of one call of `bufs`' collective: `(queued, done)`,
/// the time to queue `iters` calls and the time until they finished (a
/// sync of the group), each divided by `iters`, after `warmup` calls.
fn time_cohort(
    group: &ClientGroup,
    bufs: &Buffers,
    warmup: u32,
    iters: u32,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    for _ in 0..warmup {
        bufs.run(group, ReduceOp::Sum)?;
    }
    group.sync()?;
    let start = Instant::now();
    for _ in 0..iters {
        bufs.run(group, ReduceOp::Sum)?;
    }
    let queued = start.elapsed().as_secs_f64() / iters.max(1) as f64;
    group.sync()?;
    Ok((queued, start.elapsed().as_secs_f64() / iters.max(1) as f64))
}

/// The step's all-reduce sizes in bytes: 4 KiB to 1 MiB.
const STEP_SIZES: [usize; 10] =
    [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 64 << 10];

/// Eager against graph replay of a step of ten all-reduces, each after a
/// small kernel, on `n` devices, for each path.
fn step_bench(args: &Args, n: usize, algos: &[Algo]) -> Result<(), Box<dyn std::error::Error>> {
    use cohort::runtime::{Bytes, GridCount, KernelArguments, Scalar, StreamId};
    let clients: Vec<Client> =
        (0..n).map(|i| CudaRuntime::client(i).map(|c| c.with_stream(StreamId::fresh()))).collect::<Result<_, _>>()?;
    let base = ClientGroup::new(clients)?;
    let scale = cohort::runtime::conformance::kernels::scale();
    let bufs: Vec<(Vec<Handle>, Vec<Handle>)> = STEP_SIZES
        .iter()
        .map(|&bytes| {
            let x = (0..n).map(|m| base.client(m).create(Bytes::from_elems(&vec![1.0f32; bytes / 4]))).collect();
            let y = (0..n).map(|m| base.client(m).empty(bytes)).collect();
            (x, y)
        })
        .collect();
    println!("# cohort nccl_bench --step: 10 all-reduces (4 KiB-1 MiB, f32 sum), a scale kernel before each, {n} device(s) ({})", base.client(0).properties().name);
    println!("# {:>8} | {:>12} {:>12} | {:>7}", "algo", "eager(us)", "replay(us)", "ratio");
    for &algo in algos {
        let group = base.clone().with_algo(algo);
        let step = || -> Result<(), Box<dyn std::error::Error>> {
            for (bytes, (x, y)) in STEP_SIZES.iter().zip(&bufs) {
                for (m, h) in x.iter().enumerate() {
                    let args = KernelArguments::new().buffer(h).scalar(Scalar::F32(1.0));
                    group.client(m).launch(&scale, GridCount::cover(bytes / 4, 256), args)?;
                }
                group.all_reduce_handles(x, y, DType::F32, ReduceOp::Sum)?;
            }
            Ok(())
        };
        for m in 0..n {
            group.client(m).graph_prepare()?;
        }
        for _ in 0..args.warmup.max(1) {
            step()?;
        }
        group.sync()?;
        let start = Instant::now();
        for _ in 0..args.iters {
            step()?;
        }
        group.sync()?;
        let eager = start.elapsed().as_secs_f64() / args.iters.max(1) as f64;
        for m in 0..n {
            group.client(m).start_capture()?;
        }
        step()?;
        let graphs = (0..n).map(|m| group.client(m).stop_capture()).collect::<Result<Vec<_>, _>>()?;
        for _ in 0..args.warmup.max(1) {
            graphs.iter().try_for_each(|g| g.replay())?;
        }
        group.sync()?;
        let start = Instant::now();
        for _ in 0..args.iters {
            graphs.iter().try_for_each(|g| g.replay())?;
        }
        group.sync()?;
        let replay = start.elapsed().as_secs_f64() / args.iters.max(1) as f64;
        println!(
            "  {:>8} | {:>12.2} {:>12.2} | {:>7.2}",
            format!("{algo:?}"),
            eager * 1e6,
            replay * 1e6,
            replay / eager
        );
    }
    Ok(())
}
