//! Grouped against separate: 256 all-reduces of 4 KiB each (f32 sum, in
//! place), queued as one grouped call (`Collectives::group`) and as 256
//! separate calls. Prints the median time of each over the iterations and
//! the ratio separate / grouped (goal ≥ 5×), and beside them one all-reduce
//! of the same 1 MiB in one buffer: the floor a grouped call can reach
//! (on NCCL the group's all-reduces fuse into one such call, plus a pack
//! and an unpack; `COHORT_FUSION_MB=0` turns fusion off to compare).
//!
//! In one process: on CPU devices and (where a CUDA driver and two or more
//! GPUs are present) on CUDA, as one `ClientGroup` each:
//! `cargo run --release --example grouped_bench -- [iterations] [cpu devices]`
//! (default 20 iterations, 4 CPU devices).
//!
//! Across processes, one `Communicator` rank per process (host links on
//! CPU devices, NCCL on CUDA); rank 0 prints:
//! `cohort run -n 4 -- target/release/examples/grouped_bench [iterations] [cpu|cuda]`

use std::time::{Duration, Instant};

use cohort::prelude::*;

const CALLS: usize = 256;
const ELEMS: usize = 1024; // 4 KiB of f32

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Median seconds of the grouped run, the separate run and one all-reduce
/// of all the bytes in one buffer over `iters`, after one warm-up of each;
/// checks the sums once.
fn bench(group: &impl Collectives, iters: usize) -> Result<(Duration, Duration, Duration), Error> {
    let bufs: Vec<Vec<Buffer<f32>>> =
        (0..CALLS).map(|_| group.replicate(&[1.0f32; ELEMS])).collect::<Result<_, _>>()?;
    let whole = group.replicate(&vec![1.0f32; CALLS * ELEMS])?;
    // The floor a grouped call can reach: the same bytes as one collective.
    let one = || -> Result<Duration, Error> {
        let start = Instant::now();
        group.all_reduce(&whole, &whole, ReduceOp::Sum)?.wait()?;
        Ok(start.elapsed())
    };
    let grouped = || -> Result<Duration, Error> {
        let start = Instant::now();
        let work = group.group(|g| bufs.iter().try_for_each(|b| g.all_reduce(b, b, ReduceOp::Sum)))?;
        if std::env::var_os("GROUPED_BENCH_QUEUE").is_some() {
            eprintln!("queued in {:?}", start.elapsed());
        }
        work.wait()?;
        Ok(start.elapsed())
    };
    let separate = || -> Result<Duration, Error> {
        let start = Instant::now();
        let mut last = None;
        for b in &bufs {
            last = Some(group.all_reduce(b, b, ReduceOp::Sum)?);
        }
        // Every device runs its parts in order: the last call done is all done.
        if let Some(work) = last {
            work.wait()?;
        }
        group.sync()?;
        Ok(start.elapsed())
    };
    grouped()?;
    separate()?;
    one()?;
    let n = group.members() as f32;
    let want = n * n; // two all-reduces of all-ones, in place
    let got = bufs[CALLS - 1][0].to_vec()?;
    if got[0] != want || got[ELEMS - 1] != want {
        return Err(Error::InvalidArgument(format!("wrong sum: got {} want {want}", got[0])));
    }
    let (mut g, mut s, mut o) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iters {
        g.push(grouped()?);
        s.push(separate()?);
        o.push(one()?);
    }
    Ok((median(g), median(s), median(o)))
}

fn report(name: &str, group: &impl Collectives, iters: usize) -> Result<(), Error> {
    let (g, s, o) = bench(group, iters)?;
    if group.rank() != 0 {
        return Ok(());
    }
    println!(
        "{name:<6} {} ranks x {} devices  {:?}  {CALLS} x 4 KiB all_reduce: grouped {:>9.1} us  separate {:>9.1} us  \
         ratio {:.1}x  (one 1 MiB all_reduce {:>7.1} us: grouped / one {:.2}x)",
        group.world_size(),
        group.clients().len(),
        group.transport(),
        g.as_secs_f64() * 1e6,
        s.as_secs_f64() * 1e6,
        s.as_secs_f64() / g.as_secs_f64(),
        o.as_secs_f64() * 1e6,
        g.as_secs_f64() / o.as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters = args.first().and_then(|a| a.parse().ok()).unwrap_or(20usize).max(1);
    if cohort::comm::launch_env::LaunchEnv::from_process().is_ok() {
        // One rank of a job: its device(s) of the backend asked for.
        let backend = args.get(1).map_or("cpu", String::as_str);
        let world = World::join(rank_clients(backend, None)?)?;
        return report(backend, &world, iters);
    }
    let devices = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4usize);
    if std::env::var_os("COHORT_CPU_DEVICES").is_none() {
        std::env::set_var("COHORT_CPU_DEVICES", devices.to_string());
    }
    let cpu: Vec<Client> = (0..devices).map(CpuRuntime::client).collect::<Result<_, _>>()?;
    report("cpu", &ClientGroup::new(cpu)?, iters)?;
    match cohort::runtime::clients_from("cuda", 0, None) {
        Ok(cuda) if cuda.len() >= 2 => report("cuda", &ClientGroup::new(cuda)?, iters)?,
        Ok(cuda) => println!("cuda   skipped: {} device(s), the bench needs two", cuda.len()),
        Err(err) => println!("cuda   skipped: {err}"),
    }
    Ok(())
}
