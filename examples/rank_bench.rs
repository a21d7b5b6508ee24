//! nccl-tests' tables for a `Communicator`, one process per device: each
//! rank of a job (started by `cohort run`, torchrun, `mpirun` or `srun`)
//! takes one device, and rank 0 prints, per size, the time of one
//! collective queued back to back, its algbw and busbw, and beside it
//! raw NCCL's over the same devices (`ncclCommInitRank` in each process,
//! its id handed from rank 0 through the communicator), timed in
//! alternating trials in the same processes.
//!
//! Run: `cohort run -n gpu -- target/release/examples/rank_bench -b 8 -e
//! 256M -f 4` (every GPU of the node), `--collective all` for the five,
//! `--algo oneshot|twoshot` to force the peer-memory kernels (rank 0's
//! choice, which every rank follows), `--plot FILE.svg` to draw time and
//! busbw against size (with `--torch FILE`, torch.distributed's timings
//! saved from `scripts/anchors/torch_collectives.py`, beside), `--split` to time a group split from the world
//! (its NCCL communicator made by `ncclCommSplit`) rather than the world,
//! `--backend cpu` on CPU devices (no raw baseline): `cohort run -n 4 --
//! target/release/examples/rank_bench --backend cpu -e 1M`.
//!
//! Columns: `size` in bytes (nccl-tests': the largest buffer), `path` the
//! path cohort took (`Communicator::path_of`), `time` µs per call (rank
//! 0's clock around `-n` calls queued back to back and a sync, after a
//! barrier), `algbw = size / time`, `busbw = algbw × factor` (all-reduce
//! 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast 1),
//! `ratio` = cohort's busbw / raw NCCL's, `#wrong` the elements of rank 0's
//! destination that differ from the expected values after one checked call
//! (every rank checks its own and the job fails if any differs). Float,
//! sum, out of place, root 0.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cohort::comm::op::Collective;
use cohort::prelude::*;
use cohort::runtime::Handle;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/plot.rs"]
mod plot;
use bench::{median, parse_size};
#[cfg(feature = "cuda")]
#[path = "support/raw_nccl.rs"]
mod raw_nccl;

#[derive(Parser, Debug)]
#[command(about = "collectives of a Communicator, one process per device, beside raw NCCL")]
struct Args {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4, value_parser = clap::value_parser!(u64).range(2..))]
    step_factor: u64,
    /// Timed calls per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Warm-up calls per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Trials per size (cohort, then raw NCCL, alternating); the median is shown.
    #[arg(short = 't', long = "trials", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    trials: u32,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u32,
    /// all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, or `all`.
    #[arg(long, default_value = "all_reduce")]
    collective: String,
    /// Backend of each rank's device: cuda or cpu.
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// The path of cohort's all-reduces and all-gathers (rank 0's, which
    /// every rank follows): auto, nccl, oneshot or twoshot.
    #[arg(long, default_value = "auto")]
    algo: String,
    /// Draw time and busbw against size, cohort's and raw NCCL's, into
    /// this SVG file (rank 0).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// torch.distributed's timings to draw beside them: the output of
    /// `torchrun --nproc_per_node N scripts/anchors/torch_collectives.py`
    /// saved to a file (needs `--plot`).
    #[arg(long, requires = "plot")]
    torch: Option<std::path::PathBuf>,
    /// Time a group of every rank split from the world
    /// (`Communicator::split`; on NCCL its communicator comes from
    /// `ncclCommSplit`) instead of the world itself.
    #[arg(long)]
    split: bool,
}

fn collectives(name: &str) -> Result<Vec<Collective>, String> {
    use Collective::*;
    let all = [AllReduce, AllGather, ReduceScatter, Broadcast, AllToAll];
    match name {
        "all" => Ok(all.to_vec()),
        _ => all.iter().copied().find(|c| c.name() == name).map(|c| vec![c]).ok_or_else(|| {
            format!("--collective {name:?}: use all_reduce, all_gather, reduce_scatter, broadcast, all_to_all or all")
        }),
    }
}

/// One rank's buffers for `coll` at nccl-tests' `size` (the largest buffer)
/// over `n` ranks: its source and destination, each of whole f32 blocks.
struct Case {
    coll: Collective,
    /// Elements of one block (a rank's share in gathered and scattered layouts).
    block: usize,
    src: Handle,
    dst: Handle,
}

impl Case {
    fn new(comm: &Communicator, coll: Collective, size: usize) -> Result<Case, Error> {
        let n = comm.size();
        let elems = (size / 4).max(n);
        let block = elems / n;
        let (src_elems, dst_elems) = match coll {
            Collective::AllGather => (block, block * n),
            Collective::ReduceScatter => (block * n, block),
            Collective::AllToAll => (block * n, block * n),
            _ => (elems, elems),
        };
        let client = &comm.clients()[0];
        let src = client.create_from_slice(bytemuck::cast_slice(&input(coll, comm.rank(), n, src_elems, block)));
        let dst = client.empty(dst_elems * 4);
        Ok(Case { coll, block, src, dst })
    }

    /// Elements of the sizes table's row: what nccl-tests calls size.
    fn bytes(&self, n: usize) -> usize {
        match self.coll {
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => self.block * n * 4,
            _ => self.src.size() as usize,
        }
    }

    fn queue(&self, comm: &Communicator) -> Result<Work, Error> {
        let (src, dst) = (std::slice::from_ref(&self.src), std::slice::from_ref(&self.dst));
        Ok(match self.coll {
            Collective::AllReduce => comm.all_reduce_handles(src, dst, DType::F32, ReduceOp::Sum)?,
            Collective::AllGather => comm.all_gather_handles(src, dst, DType::F32)?,
            Collective::ReduceScatter => comm.reduce_scatter_handles(src, dst, DType::F32, ReduceOp::Sum)?,
            Collective::Broadcast => comm.broadcast_handles(&self.src, dst, DType::F32, 0)?,
            Collective::AllToAll => comm.all_to_all_handles(src, dst, DType::F32)?,
            other => return Err(Error::InvalidArgument(format!("{} is not benchmarked", other.name()))),
        })
    }

    /// How many elements of this rank's destination differ from what
    /// `coll` must leave there.
    fn wrong(&self, comm: &Communicator) -> Result<usize, Error> {
        let (rank, n) = (comm.rank(), comm.size());
        let got: Vec<f32> = comm.clients()[0].read_one(self.dst.clone())?.to_elems();
        let want = expected(self.coll, rank, n, got.len(), self.block);
        Ok(got.iter().zip(&want).filter(|(g, w)| g != w).count())
    }
}

/// Rank `rank`'s source: small whole numbers (sums stay exact in f32).
fn input(coll: Collective, rank: usize, n: usize, len: usize, block: usize) -> Vec<f32> {
    match coll {
        // Block j goes to rank j: it says who sent it and where to.
        Collective::AllToAll => (0..len).map(|i| ((rank * n + i / block.max(1)) % 1024) as f32).collect(),
        Collective::Broadcast if rank != 0 => vec![-1.0; len],
        _ => (0..len).map(|i| ((rank + 1) + i % 7) as f32).collect(),
    }
}

/// What rank `rank`'s destination of `len` elements holds after `coll`.
fn expected(coll: Collective, rank: usize, n: usize, len: usize, block: usize) -> Vec<f32> {
    let summed = |i: usize| (0..n).map(|r| ((r + 1) + i % 7) as f32).sum::<f32>();
    match coll {
        Collective::AllReduce => (0..len).map(summed).collect(),
        Collective::ReduceScatter => (0..len).map(|i| summed(rank * block + i)).collect(),
        Collective::AllGather => (0..len).map(|i| ((i / block + 1) + (i % block) % 7) as f32).collect(),
        Collective::Broadcast => (0..len).map(|i| (1 + i % 7) as f32).collect(),
        Collective::AllToAll => (0..len).map(|i| (((i / block) * n + rank) % 1024) as f32).collect(),
        _ => Vec::new(),
    }
}

/// Seconds per call of `coll` at `size` through raw NCCL, every rank
/// starting together.
#[cfg(feature = "cuda")]
fn time_raw(
    comm: &Communicator,
    raw: &raw_nccl::Raw,
    coll: Collective,
    bytes: usize,
    args: &Args,
) -> Result<f64, Box<dyn std::error::Error>> {
    for _ in 0..args.warmup {
        raw.queue(coll, bytes)?;
    }
    raw.sync(false)?;
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..args.iters {
        raw.queue(coll, bytes)?;
    }
    raw.sync(false)?;
    Ok(start.elapsed().as_secs_f64() / f64::from(args.iters))
}

/// Seconds per call of `case` through cohort, every rank starting together.
fn time_cohort(comm: &Communicator, case: &Case, args: &Args) -> Result<f64, Error> {
    for _ in 0..args.warmup {
        case.queue(comm)?;
    }
    comm.sync()?;
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..args.iters {
        case.queue(comm)?;
    }
    comm.sync()?;
    Ok(start.elapsed().as_secs_f64() / f64::from(args.iters))
}

/// The path `case` takes: a peer-memory kernel or NCCL for all-reduces
/// and all-gathers (`Communicator::path_of`), NCCL or the host for the rest.
fn path_name(comm: &Communicator, case: &Case) -> String {
    use cohort::comm::op::Op;
    let op = match case.coll {
        Collective::AllReduce => Some(Op::all_reduce(DType::F32, ReduceOp::Sum, case.src.size() as usize / 4)),
        Collective::AllGather => Some(Op::all_gather(DType::F32, case.block)),
        _ => None,
    };
    match (op.and_then(|op| comm.path_of(&op)), comm.transport()) {
        (Some(path), _) => path.name().to_string(),
        (None, Transport::Nccl) => "nccl".to_string(),
        (None, _) => "host".to_string(),
    }
}

/// Raw NCCL for this rank, where the backend is CUDA and libnccl loads: rank
/// 0's unique id goes to every rank through a broadcast on the
/// communicator. Every rank takes part in the broadcast, so every rank
/// learns whether rank 0 could make an id (an empty id: no baseline).
#[cfg(feature = "cuda")]
fn raw_for(
    comm: &Communicator,
    args: &Args,
    bytes: usize,
) -> Result<Option<raw_nccl::Raw>, Box<dyn std::error::Error>> {
    if args.backend != "cuda" {
        return Ok(None);
    }
    let made = if comm.rank() == 0 { raw_nccl::unique_id() } else { Ok([0; 128]) };
    let mut id = [0u8; 129];
    if let Ok(made) = &made {
        id[..128].copy_from_slice(made);
        id[128] = 1;
    }
    let client = &comm.clients()[0];
    let buf = client.create_from_slice(&id);
    comm.broadcast_handles(&buf, std::slice::from_ref(&buf), DType::U8, 0)?.wait()?;
    let shared = client.read_one(buf)?;
    if shared[128] != 1 {
        if let Err(why) = made {
            println!("# raw NCCL skipped: {why}");
        }
        return Ok(None);
    }
    let id: [u8; 128] = shared[..128].try_into().expect("128 bytes");
    // The driver's ordinal (COHORT_CUDA_DEVICES may show several devices
    // on one GPU).
    let device = client.properties().gpu.unwrap_or(client.device_id().index) as usize;
    Ok(Some(raw_nccl::Raw::rank(&id, comm.rank(), comm.size(), device, bytes)?))
}

fn run(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    if args.min_bytes > args.max_bytes {
        return Err(format!("-b {} is larger than -e {}", args.min_bytes, args.max_bytes).into());
    }
    let colls = collectives(&args.collective)?;
    if !["auto", "nccl", "oneshot", "twoshot"].contains(&args.algo.as_str()) {
        return Err(format!("--algo {:?}: use auto, nccl, oneshot or twoshot", args.algo).into());
    }
    // Read by rank 0 when it connects; every rank follows its choice.
    std::env::set_var("COHORT_ALGO", &args.algo);
    let world = Communicator::from_env(rank_clients(&args.backend, Some(1))?)?;
    // The world stays alive beside a group split from it.
    let split = match args.split {
        true => Some(world.split(Some(0), world.rank() as i64)?.ok_or("every rank joins the split group")?),
        false => None,
    };
    let comm = split.as_ref().unwrap_or(&world);
    let (rank, n) = (comm.rank(), comm.size());
    #[cfg(feature = "cuda")]
    let raw = raw_for(comm, args, args.max_bytes)?;
    #[cfg(not(feature = "cuda"))]
    let raw: Option<()> = None;
    if rank == 0 {
        println!(
            "# rank_bench: {n} ranks{}, one {} device each ({}), {:?} transport, algo {}; raw NCCL: {}",
            if args.split { " (a group split from the world)" } else { "" },
            args.backend,
            comm.clients()[0].properties().name,
            comm.transport(),
            args.algo,
            if raw.is_some() { "yes" } else { "no" }
        );
        println!(
            "{:>12} {:>14} {:>8} {:>10} {:>8} {:>8} {:>10} {:>8} {:>6} {:>7}",
            "size", "collective", "path", "time(us)", "algbw", "busbw", "raw(us)", "busbw", "ratio", "#wrong"
        );
    }
    let mut wrong_total = 0;
    let mut points: Vec<plot::Point> = Vec::new();
    for &coll in &colls {
        let mut size = args.min_bytes.max(4);
        loop {
            let case = Case::new(comm, coll, size)?;
            let bytes = case.bytes(n);
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..args.trials {
                ours.push(time_cohort(comm, &case, args)?);
                #[cfg(feature = "cuda")]
                if let Some(raw) = &raw {
                    theirs.push(time_raw(comm, raw, coll, bytes, args)?);
                }
            }
            let wrong = if args.check == 1 {
                case.queue(comm)?.wait()?;
                case.wrong(comm)?
            } else {
                0
            };
            // Every rank's count, so one wrong rank fails the run.
            let counts = comm.clients()[0].create_from_slice(bytemuck::bytes_of(&(wrong as f32)));
            comm.all_reduce_handles(
                std::slice::from_ref(&counts),
                std::slice::from_ref(&counts),
                DType::F32,
                ReduceOp::Sum,
            )?
            .wait()?;
            let all_wrong = comm.clients()[0].read_one(counts)?.to_elems::<f32>()[0] as usize;
            wrong_total += all_wrong;
            if rank == 0 {
                let path = path_name(comm, &case);
                let t = median(&mut ours);
                let algbw = bytes as f64 / t / 1e9;
                let busbw = algbw * coll.bus_factor(n);
                points.push((coll, format!("cohort {path}"), bytes as f64, t * 1e6, busbw));
                let (raw_us, raw_bus, ratio) = if theirs.is_empty() {
                    ("-".to_string(), "-".to_string(), "-".to_string())
                } else {
                    let r = median(&mut theirs);
                    let rb = bytes as f64 / r / 1e9 * coll.bus_factor(n);
                    points.push((coll, "raw NCCL".to_string(), bytes as f64, r * 1e6, rb));
                    (format!("{:.2}", r * 1e6), format!("{rb:.2}"), format!("{:.2}", t.recip() / r.recip()))
                };
                println!(
                    "{bytes:>12} {:>14} {path:>8} {:>10.2} {algbw:>8.2} {busbw:>8.2} {raw_us:>10} {raw_bus:>8} {ratio:>6} {all_wrong:>7}",
                    coll.name(),
                    t * 1e6
                );
            }
            if size >= args.max_bytes {
                break;
            }
            size = size.saturating_mul(args.step_factor as usize).min(args.max_bytes);
        }
    }
    comm.barrier()?;
    if let (Some(path), 0) = (&args.plot, rank) {
        if let Some(torch) = &args.torch {
            let added = plot::add_torch(&mut points, torch)?;
            println!("# {added} torch.distributed timings read from {}", torch.display());
        }
        plot::plot(path, &colls, &points)?;
        println!("# plot written to {}", path.display());
    }
    Ok(wrong_total)
}

fn main() -> ExitCode {
    bench::exit("rank_bench", run(&Args::parse()))
}
