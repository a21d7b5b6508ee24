//! `split` against a fresh communicator for the same members: the time from
//! the call until a first all-reduce on the result has finished (every rank
//! joins one group, so both communicators hold the same members). On NCCL a
//! split is `ncclCommSplit` of the parent with shared resources, a fresh
//! communicator its own rendezvous, links and `ncclCommInitRank`; on the
//! host a split forms only the group's links over the parent's store
//! connection. Prints the median of each over the iterations and the ratio
//! split / fresh (goal ≤ 0.2× on NCCL), then where each one's time goes;
//! on NCCL also `ncclCommSplit` alone against the NCCL communicator's
//! creation alone (what the library allows).
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

/// Times of one round: the split's call and phases, its group's first
/// collective, the fresh communicator's connect, first and second
/// collectives.
#[derive(Default, Clone)]
struct Round {
    split: Duration,
    phases: Vec<(&'static str, Duration)>,
    split_first: Duration,
    connect: Duration,
    fresh_first: Duration,
    fresh_second: Duration,
}

/// Times `f`.
fn timed<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<(T, Duration), Error> {
    let start = Instant::now();
    let out = f()?;
    Ok((out, start.elapsed()))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The medians of `split` and of `fresh()` over `iters`, each timed to the
/// end of its first collective; prints them on rank 0, with where the time
/// goes: the split's phases (`Communicator::last_split_phases`: on NCCL
/// `device split` is `ncclCommSplit` on every local device) and the fresh
/// communicator's connect and first collective (on NCCL its first
/// collective makes the NCCL communicator, `ncclCommInitRank`; a second
/// collective's time is taken off to leave the creation alone).
fn bench(
    name: &str,
    comm: &Communicator,
    iters: usize,
    fresh: impl Fn() -> Result<Communicator, Error>,
) -> Result<(), Error> {
    first_collective(comm)?;
    let mut rounds = Vec::new();
    for _ in 0..iters + 1 {
        let mut r = Round::default();
        comm.barrier()?;
        let (group, split) = timed(|| Ok(comm.split(Some(0), comm.rank() as i64)?.expect("every rank joins")))?;
        r.phases = Communicator::last_split_phases();
        r.split_first = timed(|| first_collective(&group))?.1;
        r.split = split;
        drop(group);
        comm.barrier()?;
        let (other, connect) = timed(&fresh)?;
        r.connect = connect;
        r.fresh_first = timed(|| first_collective(&other))?.1;
        r.fresh_second = timed(|| first_collective(&other))?.1;
        drop(other);
        rounds.push(r);
    }
    // The first round warms both up.
    rounds.remove(0);
    let med = |f: &dyn Fn(&Round) -> Duration| median(rounds.iter().map(f).collect());
    let s = med(&|r| r.split + r.split_first);
    let f = med(&|r| r.connect + r.fresh_first);
    if comm.rank() == 0 {
        println!(
            "{name:<5} {} ranks x {} devices  {:?}  split {:>8.2} ms  fresh communicator {:>8.2} ms  ratio split/fresh \
             {:.3}x",
            comm.size(),
            comm.local_devices(),
            comm.transport(),
            ms(s),
            ms(f),
            s.as_secs_f64() / f.as_secs_f64()
        );
        let phases: Vec<String> = rounds[0]
            .phases
            .iter()
            .enumerate()
            .map(|(i, (phase, _))| {
                format!("{phase} {:.2}", ms(med(&|r| r.phases.get(i).map_or(Duration::ZERO, |p| p.1))))
            })
            .collect();
        let creation = med(&|r| r.fresh_first.saturating_sub(r.fresh_second));
        println!(
            "      split: {} ms, first collective {:.2} ms | fresh: connect {:.2} ms, first collective {:.2} ms \
             (second {:.2} ms: creation {:.2} ms)",
            phases.join(", "),
            ms(med(&|r| r.split_first)),
            ms(med(&|r| r.connect)),
            ms(med(&|r| r.fresh_first)),
            ms(med(&|r| r.fresh_second)),
            ms(creation),
        );
        if let Some(device) = rounds[0].phases.iter().position(|(p, _)| *p == "device split") {
            let alone = med(&|r| r.phases[device].1);
            println!(
                "      the library alone: device split {:.2} ms against creation {:.2} ms = {:.3}x",
                ms(alone),
                ms(creation),
                alone.as_secs_f64() / creation.as_secs_f64()
            );
        }
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
