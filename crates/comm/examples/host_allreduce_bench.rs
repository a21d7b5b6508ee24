//! Host all-reduce across processes: cohort's `Communicator` (shared memory
//! within a node, and over its MPI transport) against Open MPI's
//! `MPI_Allreduce`, on the same data in the same run. Needs the `mpi`
//! feature and `mpirun`:
//!
//! ```text
//! cargo build --release -p cohort-comm --features mpi --example host_allreduce_bench
//! mpirun --allow-run-as-root --oversubscribe -n 4 \
//!     target/release/examples/host_allreduce_bench [--mib 64] [--iters 10]
//! ```
//!
//! Each rank holds 64 MiB of f32 on one CPU device (host memory). Both
//! sides sum out of place (source to destination); cohort also in place.
//! Every timed iteration starts after an MPI barrier and ends when this
//! rank's result is readable; the time reported is the slowest rank's
//! median. busbw = 2 (n - 1) / n × bytes / time, as nccl-tests reports it.
//! Every cohort result is checked against MPI's. The MPI-transport row runs
//! cohort's ring over MPI point-to-point messages (`Communicator::from_mpi`)
//! instead of shared memory.

use std::time::Instant;

use cohort_comm::{Communicator, DType, ReduceOp};
use cohort_runtime::{CpuRuntime, Runtime};
use mpi::collective::SystemOperation;
use mpi::traits::*;
// The trait of `rank()`/`size()`, whose name cohort's `Communicator` shadows.
use mpi::topology::Communicator as _;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (mib, iters) = (arg("--mib", 64), arg("--iters", 10));
    // The shared-memory communicator comes from `from_env`, which would take
    // MPI under mpirun with the `mpi` feature; set before any thread starts.
    std::env::set_var(cohort_runtime::config::TRANSPORT.name, "host");
    // cohort's MPI transport calls MPI from device threads.
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Multiple).expect("MPI initialises (run under mpirun)");
    let world = universe.world();
    let client = CpuRuntime::client(0).expect("a CPU device");
    let comm = Communicator::from_env(vec![client.clone()]).expect("a communicator");
    let over_mpi = Communicator::from_mpi(vec![client.clone()]).expect("a communicator over MPI");
    assert_eq!(over_mpi.transport_to((comm.rank() + 1) % comm.size()), if comm.size() > 1 { "mpi" } else { "self" });
    let (rank, n) = (comm.rank(), comm.size());
    assert_eq!((rank, n), (world.rank() as usize, world.size() as usize), "MPI and cohort agree on ranks");
    let count = mib << 18;
    let bytes = count * 4;
    let data: Vec<f32> = (0..count).map(|i| ((rank * 7 + i * 3) % 11) as f32).collect();

    // Slowest rank's time of each iteration.
    let slowest = |t: f64| -> f64 {
        let mut max = 0.0f64;
        world.all_reduce_into(&t, &mut max, SystemOperation::max());
        max
    };

    // MPI, out of place.
    let mut mpi_out = vec![0f32; count];
    let mut mpi_times = Vec::new();
    for i in 0..iters + 2 {
        world.barrier();
        let t = Instant::now();
        world.all_reduce_into(&data[..], &mut mpi_out[..], SystemOperation::sum());
        let t = slowest(t.elapsed().as_secs_f64());
        if i >= 2 {
            mpi_times.push(t);
        }
    }

    // cohort, out of place and in place.
    let src = client.create_from_slice(bytemuck::cast_slice(&data));
    let dst = client.empty(bytes);
    let run = |comm: &Communicator, in_place: bool| -> Vec<f64> {
        let mut times = Vec::new();
        for i in 0..iters + 2 {
            let buf = if in_place { client.create_from_slice(bytemuck::cast_slice(&data)) } else { dst.clone() };
            client.sync().expect("uploaded");
            world.barrier();
            let t = Instant::now();
            let s = if in_place { buf.clone() } else { src.clone() };
            comm.all_reduce_handles(&[s], std::slice::from_ref(&buf), DType::F32, ReduceOp::Sum).expect("queued");
            client.sync_buffers([&buf]).expect("all_reduce ran");
            let t = slowest(t.elapsed().as_secs_f64());
            if i >= 2 {
                times.push(t);
            }
        }
        times
    };
    let check = |what: &str| {
        let got = client.read_one(dst.clone()).expect("read");
        let got: &[f32] = bytemuck::cast_slice(&got);
        let wrong = got.iter().zip(&mpi_out).filter(|(a, b)| a != b).count();
        assert_eq!(wrong, 0, "cohort ({what}) and MPI disagree on {wrong} elements");
    };
    let out_of_place = run(&comm, false);
    check("shared memory");
    let in_place = run(&comm, true);
    let mpi_links = run(&over_mpi, false);
    check("MPI transport");

    if rank == 0 {
        let bus = |t: f64| 2.0 * (n - 1) as f64 / n as f64 * bytes as f64 / t / 1e9;
        let (m, c, ci, cm) = (median(mpi_times), median(out_of_place), median(in_place), median(mpi_links));
        println!("host all_reduce, {mib} MiB f32 sum, {n} processes, median of {iters} (slowest rank):");
        println!("  Open MPI MPI_Allreduce        {:8.2} ms  busbw {:6.2} GB/s", m * 1e3, bus(m));
        println!("  cohort (out of place)         {:8.2} ms  busbw {:6.2} GB/s  ratio {:.2}x", c * 1e3, bus(c), m / c);
        println!(
            "  cohort (in place)             {:8.2} ms  busbw {:6.2} GB/s  ratio {:.2}x",
            ci * 1e3,
            bus(ci),
            m / ci
        );
        println!(
            "  cohort over MPI transport     {:8.2} ms  busbw {:6.2} GB/s  ratio {:.2}x",
            cm * 1e3,
            bus(cm),
            m / cm
        );
        println!("  results identical to MPI's: yes");
    }
}
