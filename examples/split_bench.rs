//! `split` against a fresh communicator for the same members: the time from
//! the call until a first all-reduce on the result has finished (every rank
//! joins one group, so both communicators hold the same members). On NCCL a
//! split is `ncclCommSplit` of the parent with shared resources, a fresh
//! communicator its own rendezvous, links and `ncclCommInitRank`; on the
//! host a split forms only the group's links over the parent's store
//! connection. Prints the median of each over the iterations and the ratio
//! split / fresh (goal ≤ 0.2× on NCCL).
//!
//! Across processes (rank 0 prints):
//! `cohort run -n 2 -- target/release/examples/split_bench [iterations] [cpu|cuda]`
//!
//! Without a launcher, ranks are threads of this process on CPU devices:
//! `cargo run --release --example split_bench -- [iterations] [ranks]`
//! (default 10 iterations, 4 ranks).

use std::time::{Duration, Instant};

use cohort::comm::store::StoreServer;
use cohort::prelude::*;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Waits for a first all-reduce of one element on `comm` (on NCCL this
/// makes a fresh communicator's NCCL communicator).
fn first_collective(comm: &Communicator) -> Result<(), Error> {
    let x = comm.replicate(&[1.0f32])?;
    comm.all_reduce(&x, &x, ReduceOp::Sum)?.wait()?;
    let want = comm.members() as f32;
    match x[0].to_vec()?[0] {
        got if got == want => Ok(()),
        got => Err(Error::InvalidArgument(format!("wrong sum {got}, want {want}"))),
    }
}

/// The medians of `split` and of `fresh()` over `iters`, each timed to the
/// end of its first collective; prints them on rank 0.
fn bench(
    name: &str,
    comm: &Communicator,
    iters: usize,
    fresh: impl Fn() -> Result<Communicator, Error>,
) -> Result<(), Error> {
    first_collective(comm)?;
    let (mut split, mut new) = (Vec::new(), Vec::new());
    for _ in 0..iters + 1 {
        comm.barrier()?;
        let start = Instant::now();
        let group = comm.split(Some(0), comm.rank() as i64)?.expect("every rank joins");
        first_collective(&group)?;
        split.push(start.elapsed());
        drop(group);
        comm.barrier()?;
        let start = Instant::now();
        let other = fresh()?;
        first_collective(&other)?;
        new.push(start.elapsed());
        drop(other);
    }
    // The first round warms both up.
    let (s, f) = (median(split.split_off(1)), median(new.split_off(1)));
    if comm.rank() == 0 {
        println!(
            "{name:<5} {} ranks x {} devices  {:?}  split {:>8.2} ms  fresh communicator {:>8.2} ms  ratio split/fresh \
             {:.3}x",
            comm.size(),
            comm.local_devices(),
            comm.transport(),
            s.as_secs_f64() * 1e3,
            f.as_secs_f64() * 1e3,
            s.as_secs_f64() / f.as_secs_f64()
        );
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters = args.first().and_then(|a| a.parse().ok()).unwrap_or(10usize).max(1);
    if cohort::comm::launch_env::LaunchEnv::from_process().is_ok() {
        let backend = args.get(1).map_or("cpu", String::as_str).to_string();
        let comm = Communicator::from_env(rank_clients(&backend, None)?)?;
        return bench(&backend, &comm, iters, || Ok(Communicator::from_env(rank_clients(&backend, None)?)?));
    }
    let ranks = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4usize).max(1);
    if std::env::var_os("COHORT_CPU_DEVICES").is_none() {
        std::env::set_var("COHORT_CPU_DEVICES", ranks.to_string());
    }
    let server = StoreServer::bind("127.0.0.1:0", "split-bench")
        .map_err(|e| Error::InvalidArgument(format!("cannot serve a store: {e}")))?;
    let addr = server.local_addr().to_string();
    let threads: Vec<_> = (0..ranks)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || -> Result<(), Error> {
                let join = || -> Result<Communicator, Error> {
                    Ok(Communicator::connect(rank, ranks, &addr, "split-bench", vec![CpuRuntime::client(rank)?])?)
                };
                bench("cpu", &join()?, iters, join)
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| Error::InvalidArgument("a rank panicked".into()))??;
    }
    Ok(())
}
