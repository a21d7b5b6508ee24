//! nccl-tests for a `ClientGroup`: times each collective over a range of
//! sizes, out of place and in place, and prints nccl-tests' table.
//!
//! Run: `cargo run --release --example all_reduce_bench -- -b 1K -e 64M -f 4`
//! (`--collective all` for every collective, `-d all` / `-o all` for every
//! type and reduction, `--devices 8` for more CPU devices, `--backend wgpu`
//! or `--backend cuda` for GPUs; `COHORT_WGPU_DEVICES=4` opens four wgpu
//! devices on one adapter).
//!
//! Columns are nccl-tests': `size` is the largest buffer in bytes, `time` the
//! mean of `-n` iterations, `algbw = size / time`, `busbw = algbw × factor`
//! (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather,
//! scatter (n-1)/n; broadcast, reduce, send_recv 1), `#wrong` the elements
//! that differ from a host reference (`-c 1`).
//!
//! On the CPU backend the devices share the host's memory, so the machine's
//! copy bandwidth bounds every collective. The bench measures it (`B`: bytes
//! copied per second by the faster of one thread and a rayon copy over every
//! core, best of 3 each, at the largest size) interleaved with the timings:
//! before the first size and after each one. Each row's `B` is the larger of
//! the measurements just before and just after it (so a row is not judged by
//! a bound taken while the machine was busier or quieter than during the
//! row), and `%bound` is busbw as a fraction of the busbw of a collective that
//! moved only the bytes it must at that `B`: all-reduce must read n inputs and
//! write n outputs (n copies of `size`, time ≥ n·size / B, so busbw ≤
//! 2(n-1)/n² · B); the bound of each collective is in
//! `Collective::host_copies`.
//!
//! On wgpu and CUDA the memory bound does not apply, so the `%bound` and `B`
//! columns are left out; the header gives device 0's host-to-device and
//! device-to-host copy bandwidth at the largest size instead (what the
//! host-staged path moves through), for reference.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use cohort::comm::op::Collective;
use cohort::comm::verify::Buffers;
use cohort::comm::{ClientGroup, DType, HostPath, ReduceOp};
use cohort::prelude::*;
use rayon::prelude::*;

#[path = "support/bench.rs"]
mod bench;
use bench::parse_size;

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
    /// Backend: cpu, wgpu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Devices in the group: the first N of the backend (default: every
    /// device; on the CPU, N sets COHORT_CPU_DEVICES).
    #[arg(long)]
    devices: Option<usize>,
    /// Force the staged host path (copies through host memory) on the CPU
    /// (wgpu always stages).
    #[arg(long)]
    staged: bool,
}

/// The host's copy bandwidth, measured again and again between timings
/// with the same two buffers (allocated and touched once).
struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
    /// Every measurement of B so far, bytes per second.
    samples: Vec<f64>,
}

impl Memcpy {
    fn new(bytes: usize) -> Memcpy {
        let mut m = Memcpy { src: vec![1u8; bytes], dst: vec![0u8; bytes], samples: Vec::new() };
        // Fault the pages in before the first measurement.
        m.dst.copy_from_slice(&m.src);
        m
    }

    /// Bytes copied per second: the best of 3 copies on one thread and of 3
    /// split over rayon's threads; returns (one thread, every thread) and
    /// records the faster as a sample of B.
    fn measure(&mut self) -> (f64, f64) {
        let bytes = self.src.len();
        let src = &self.src;
        let best = |dst: &mut [u8], f: &dyn Fn(&mut [u8])| {
            let mut best = Duration::MAX;
            for _ in 0..3 {
                let start = Instant::now();
                f(dst);
                best = best.min(start.elapsed());
            }
            bytes as f64 / best.as_secs_f64()
        };
        let single = best(&mut self.dst, &|d| d.copy_from_slice(src));
        let parallel = best(&mut self.dst, &|d| {
            d.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s))
        });
        self.samples.push(single.max(parallel));
        (single, parallel)
    }

    /// The latest sample of B.
    fn last(&self) -> f64 {
        self.samples.last().copied().unwrap_or(0.0)
    }
}

/// Device 0's host-to-device and device-to-host bandwidth for `bytes`
/// (best of 3 writes and of 3 reads, each waited for), bytes per second.
fn transfer_bandwidth(client: &Client, bytes: usize) -> Result<(f64, f64), ServerError> {
    let handle = client.create(Bytes::from(vec![1u8; bytes]));
    client.sync()?;
    let (mut up, mut down) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        let data = Bytes::from(vec![1u8; bytes]);
        let start = Instant::now();
        client.write(&handle, data)?;
        client.sync()?;
        up = up.min(start.elapsed());
        let start = Instant::now();
        client.read_one(handle.clone())?;
        down = down.min(start.elapsed());
    }
    Ok((bytes as f64 / up.as_secs_f64(), bytes as f64 / down.as_secs_f64()))
}

/// The first `devices` clients of `backend` (every device by default).
fn clients(backend: &str, devices: Option<usize>) -> Result<Vec<Client>, Box<dyn std::error::Error>> {
    if let (Some(n), "cpu") = (devices, backend) {
        // Before the first CPU client exists: the runtime reads it then.
        std::env::set_var(cohort::runtime::config::CPU_DEVICES.name, n.to_string());
    }
    Ok(cohort::runtime::clients_of(backend, devices)?)
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
    bench::exit("all_reduce_bench", run(&Args::parse()))
}

fn run(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    let cpu = args.backend == "cpu";
    if args.staged && !cpu {
        return Err("--staged chooses the CPU's host path; other backends stage already".into());
    }
    let group = ClientGroup::new(clients(&args.backend, args.devices)?)?;
    let group = group.with_host_path(if args.staged { HostPath::Staged } else { HostPath::Auto })?;
    let n = group.len();
    let collectives: Vec<Collective> = if args.collective == "all" {
        Collective::ALL.to_vec()
    } else {
        vec![Collective::parse(&args.collective).ok_or_else(|| format!("unknown collective {:?}", args.collective))?]
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
    let path = if args.backend == "cuda" {
        "NCCL (host staging where libnccl is missing)"
    } else if group.is_direct() {
        "direct"
    } else {
        "staged"
    };
    println!(
        "# cohort all_reduce_bench: backend {}, {n} devices ({}), {path} path, {threads} rayon threads",
        args.backend,
        group.client(0).properties().name
    );
    let probe = args.max_bytes.max(1 << 20);
    let mut memcpy = cpu.then(|| Memcpy::new(probe));
    if let Some(memcpy) = memcpy.as_mut() {
        let (single, parallel) = memcpy.measure();
        println!(
            "# memcpy bandwidth at {probe} bytes: {:.2} GB/s on 1 thread, {:.2} GB/s on {threads} threads; measured \
             again after every size, B per row = the larger of the samples before and after it",
            single / 1e9,
            parallel / 1e9,
        );
        println!("# %bound: busbw / the busbw of moving only the bytes the collective must, at B (all_reduce: 2(n-1)/n^2 * B)");
    } else {
        let (up, down) = transfer_bandwidth(group.client(0), probe)?;
        println!(
            "# device 0 copies at {probe} bytes: host to device {:.2} GB/s, device to host {:.2} GB/s (no memcpy bound on {}: %bound left out)",
            up / 1e9,
            down / 1e9,
            args.backend
        );
    }
    println!("#");
    let cols = |a: [&str; 5], b: [&str; 5], c: [&str; 5], extra: &str| {
        let cell = |x: [&str; 5]| {
            let bound = if cpu { format!(" {:>6}", x[4]) } else { String::new() };
            format!("{:>8} {:>7} {:>7} {:>6}{bound}", x[0], x[1], x[2], x[3])
        };
        format!("# {:>10} {:>12} {:>8} {:>6} {:>6}    {}    {}{extra}", a[0], a[1], a[2], a[3], a[4], cell(b), cell(c))
    };
    let blank = ["", "", "", "", ""];
    let b_head = |t: &str| if cpu { format!("    {t:>7}") } else { String::new() };
    println!("{}", cols(blank, ["out-of-place", "", "", "", ""], ["in-place", "", "", "", ""], ""));
    println!(
        "{}",
        cols(
            ["size", "count", "type", "redop", "root"],
            ["time", "algbw", "busbw", "#wrong", "%bound"],
            ["time", "algbw", "busbw", "#wrong", "%bound"],
            &b_head("B")
        )
    );
    println!(
        "{}",
        cols(
            ["(B)", "(elements)", "", "", ""],
            ["(us)", "(GB/s)", "(GB/s)", "", ""],
            ["(us)", "(GB/s)", "(GB/s)", "", ""],
            &b_head("(GB/s)")
        )
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
                    let before = memcpy.as_ref().map_or(0.0, Memcpy::last);
                    let mut timed = Vec::new();
                    let mut shown = (0, 0);
                    for in_place in [false, true] {
                        if in_place && !coll.has_in_place() {
                            timed.push(None);
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
                        timed.push(Some((secs, bufs.size, wrong)));
                    }
                    // B of this row: the larger of the samples around it.
                    let bandwidth = memcpy.as_mut().map_or(0.0, |m| {
                        m.measure();
                        m.last().max(before)
                    });
                    let cells: Vec<String> = timed
                        .into_iter()
                        .map(|t| {
                            let Some((secs, size, wrong)) = t else {
                                let na = if cpu { format!(" {:>6}", "N/A") } else { String::new() };
                                return format!("{:>8} {:>7} {:>7} {:>6}{na}", "N/A", "N/A", "N/A", "N/A");
                            };
                            let algbw = size as f64 / secs;
                            let busbw = algbw * coll.bus_factor(n);
                            bus_sum += busbw / 1e9;
                            bus_count += 1;
                            let bound = if cpu {
                                let floor = coll.host_copies(n) * size as f64 / bandwidth;
                                let bound = size as f64 / floor * coll.bus_factor(n);
                                let fraction = if size == 0 || busbw == 0.0 { 0.0 } else { busbw / bound };
                                format!(" {fraction:>6.2}")
                            } else {
                                String::new()
                            };
                            format!("{:>8.1} {:>7.2} {:>7.2} {:>6}{bound}", secs * 1e6, algbw / 1e9, busbw / 1e9, wrong)
                        })
                        .collect();
                    let redop = if coll.reduces() { op.nccl_name() } else { "none" };
                    let root = if coll.rooted() { args.root.min(n - 1) as i64 } else { -1 };
                    let b = if cpu { format!("    {:>7.2}", bandwidth / 1e9) } else { String::new() };
                    println!(
                        "  {:>10} {:>12} {:>8} {:>6} {:>6}    {}    {}{b}",
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
    if let Some(m) = &memcpy {
        let (lo, hi) = m.samples.iter().fold((f64::MAX, 0.0f64), |(lo, hi), &b| (lo.min(b), hi.max(b)));
        println!("# memcpy B over the run: {} samples, {:.2} to {:.2} GB/s", m.samples.len(), lo / 1e9, hi / 1e9);
    }
    println!("# Out of bounds values : {total_wrong} {}", if total_wrong == 0 { "OK" } else { "FAILED" });
    println!("# Avg bus bandwidth    : {:.3} GB/s", bus_sum / bus_count.max(1) as f64);
    Ok(total_wrong)
}
