//! nccl-tests for a `ClientGroup`: times each collective over a range of
//! sizes, out of place and in place, and prints nccl-tests' table.
//!
//! Run: `cargo run --release --example all_reduce_bench -- -b 1K -e 64M -f 4`
//! (`--op all` for every collective, `-d all` / `-o all` for every type and
//! reduction, `--devices 8` for more CPU devices).
//!
//! Columns are nccl-tests': `size` is the largest buffer in bytes, `time` the
//! mean of `-n` iterations, `algbw = size / time`, `busbw = algbw × factor`
//! (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather,
//! scatter (n-1)/n; broadcast, reduce, send_recv 1), `#wrong` the elements
//! that differ from a host reference (`-c 1`).
//!
//! On the CPU backend the devices share the host's memory, so the machine's
//! copy bandwidth bounds every collective. The bench measures it in the same
//! run (`B`: bytes copied per second by the faster of one thread and a rayon
//! copy over every core, at the largest size) and prints `%bound`, busbw as
//! a fraction of the busbw of a collective that moved only the bytes it must
//! at that bandwidth: all-reduce must read n inputs and write n outputs (n
//! copies of `size`, time ≥ n·size / B, so busbw ≤ 2(n-1)/n² · B); the
//! bound of each collective is in `CollectiveOp::host_copies`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use cohort::comm::verify::{Buffers, CollectiveOp};
use cohort::comm::{ClientGroup, DType, HostPath, ReduceOp};
use cohort::prelude::*;
use rayon::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "nccl-tests' performance table for cohort collectives")]
struct Args {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "1K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    step_factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: u32,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Check results against the host (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u32,
    /// Reduction: sum, prod, min, max, avg or all.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: String,
    /// Element type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64 or all.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: String,
    /// Root of rooted collectives.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Collective: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, gather, scatter, send_recv or all.
    #[arg(long = "collective", visible_alias = "coll", default_value = "all_reduce")]
    collective: String,
    /// Backend: cpu.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Devices in the group (default: every device of the backend).
    #[arg(long)]
    devices: Option<usize>,
    /// Force the staged host path (copies through host memory) on the CPU.
    #[arg(long)]
    staged: bool,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, scale) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 1 << 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().map(|v| v * scale).map_err(|e| format!("{text:?} is not a size: {e}"))
}

/// Bytes copied per second: the best of 5 copies of `bytes`, on one thread
/// and split over rayon's threads, whichever is faster.
fn memcpy_bandwidth(bytes: usize) -> (f64, f64) {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = |f: &mut dyn FnMut(&mut [u8])| {
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let start = Instant::now();
            f(&mut dst);
            best = best.min(start.elapsed());
        }
        bytes as f64 / best.as_secs_f64()
    };
    let single = best(&mut |d: &mut [u8]| d.copy_from_slice(&src));
    let parallel = best(&mut |d: &mut [u8]| {
        d.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s))
    });
    (single, parallel)
}

fn time_one(group: &ClientGroup, bufs: &Buffers, op: ReduceOp, args: &Args) -> Result<f64, Box<dyn std::error::Error>> {
    for _ in 0..args.warmup {
        bufs.run(group, op)?;
    }
    group.sync()?;
    let start = Instant::now();
    for _ in 0..args.iters {
        bufs.run(group, op)?;
    }
    group.sync()?;
    Ok(start.elapsed().as_secs_f64() / args.iters.max(1) as f64)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("all_reduce_bench: {wrong} wrong elements");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("all_reduce_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    if args.backend != "cpu" {
        return Err(format!("backend {:?} is not available in this bench yet: use --backend cpu", args.backend).into());
    }
    if let Some(n) = args.devices {
        // Before the first client exists: the CPU runtime reads it once per call.
        std::env::set_var("COHORT_CPU_DEVICES", n.to_string());
    }
    let clients = CpuRuntime::clients()?;
    let group = ClientGroup::new(clients)?;
    let group = group.with_host_path(if args.staged { HostPath::Staged } else { HostPath::Auto })?;
    let n = group.len();
    let collectives: Vec<CollectiveOp> = if args.collective == "all" {
        CollectiveOp::ALL.to_vec()
    } else {
        vec![CollectiveOp::parse(&args.collective).ok_or_else(|| format!("unknown collective {:?}", args.collective))?]
    };
    let dtypes: Vec<DType> = if args.dtype == "all" {
        DType::ALL.to_vec()
    } else {
        vec![DType::parse(&args.dtype).ok_or_else(|| format!("unknown datatype {:?}", args.dtype))?]
    };
    let redops: Vec<ReduceOp> = if args.redop == "all" {
        ReduceOp::ALL.to_vec()
    } else {
        vec![ReduceOp::parse(&args.redop).ok_or_else(|| format!("unknown op {:?}", args.redop))?]
    };
    let threads = rayon::current_num_threads();
    let (single, parallel) = memcpy_bandwidth(args.max_bytes.max(1 << 20));
    let bandwidth = single.max(parallel);
    println!(
        "# cohort all_reduce_bench: backend {}, {n} devices, {} host path, {threads} rayon threads",
        args.backend,
        if group.is_direct() { "direct" } else { "staged" }
    );
    println!(
        "# memcpy bandwidth at {} bytes: {:.2} GB/s on 1 thread, {:.2} GB/s on {threads} threads; B = {:.2} GB/s",
        args.max_bytes.max(1 << 20),
        single / 1e9,
        parallel / 1e9,
        bandwidth / 1e9
    );
    println!("# %bound: busbw / the busbw of moving only the bytes the collective must, at B (all_reduce: 2(n-1)/n^2 * B = {:.2} GB/s)", 2.0 * (n as f64 - 1.0) / (n * n) as f64 * bandwidth / 1e9);
    println!("#");
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}",
        "", "", "", "", "", "out-of-place", "", "", "", "", "in-place", "", "", "", ""
    );
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "%bound",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "%bound"
    );
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}    {:>8} {:>7} {:>7} {:>6} {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "", "(us)", "(GB/s)", "(GB/s)", "", ""
    );
    let mut total_wrong = 0;
    let mut bus_sum = 0.0;
    let mut bus_count = 0;
    for &coll in &collectives {
        println!("# collective: {} (busbw factor {:.3})", coll.name(), coll.bus_factor(n));
        for &dtype in &dtypes {
            let ops: &[ReduceOp] = if coll.reduces() { &redops } else { &[ReduceOp::Sum] };
            for &op in ops {
                let mut size = args.min_bytes.max(1);
                loop {
                    let mut cells = Vec::new();
                    let mut shown = (0, 0);
                    for in_place in [false, true] {
                        if in_place && !coll.has_in_place() {
                            cells.push(format!("{:>8} {:>7} {:>7} {:>6} {:>6}", "N/A", "N/A", "N/A", "N/A", "N/A"));
                            continue;
                        }
                        let bufs = Buffers::new(&group, coll, dtype, size, in_place, args.root.min(n - 1));
                        shown = (bufs.size, bufs.size / dtype.size());
                        let wrong = if args.check != 0 {
                            bufs.run(&group, op)?;
                            let wrong = bufs.wrong(&group, op)?;
                            bufs.refill(&group)?;
                            total_wrong += wrong;
                            wrong.to_string()
                        } else {
                            "N/A".to_string()
                        };
                        let secs = time_one(&group, &bufs, op, args)?;
                        let algbw = bufs.size as f64 / secs;
                        let busbw = algbw * coll.bus_factor(n);
                        let floor = coll.host_copies(n) * bufs.size as f64 / bandwidth;
                        let bound = bufs.size as f64 / floor * coll.bus_factor(n);
                        let fraction = if bufs.size == 0 || busbw == 0.0 { 0.0 } else { busbw / bound };
                        bus_sum += busbw / 1e9;
                        bus_count += 1;
                        cells.push(format!(
                            "{:>8.1} {:>7.2} {:>7.2} {:>6} {:>6.2}",
                            secs * 1e6,
                            algbw / 1e9,
                            busbw / 1e9,
                            wrong,
                            fraction
                        ));
                    }
                    let redop = if coll.reduces() { op.nccl_name() } else { "none" };
                    let root = if coll.rooted() { args.root.min(n - 1) as i64 } else { -1 };
                    println!(
                        "  {:>10} {:>12} {:>8} {:>6} {:>6}    {}    {}",
                        shown.0,
                        shown.1,
                        dtype.nccl_name(),
                        redop,
                        root,
                        cells[0],
                        cells[1]
                    );
                    if size >= args.max_bytes || args.step_factor <= 1 {
                        break;
                    }
                    size = (size * args.step_factor).min(args.max_bytes);
                }
            }
        }
    }
    println!("# Out of bounds values : {total_wrong} {}", if total_wrong == 0 { "OK" } else { "FAILED" });
    println!("# Avg bus bandwidth    : {:.3} GB/s", bus_sum / bus_count.max(1) as f64);
    Ok(total_wrong)
}
