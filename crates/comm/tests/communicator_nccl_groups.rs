//! Groups and grouped calls of a Communicator on NCCL (ignored without CUDA
//! GPUs; `two_gpus_*` need two): a group split from an NCCL communicator
//! runs on NCCL (`ncclCommSplit`), orders its ranks by key and computes
//! what the host computes; a grouped call of 100 mixed tensors (one
//! `ncclGroupStart/End` per device) equals 100 separate calls. The ranks are
//! threads of this process, one GPU each.

mod cuda_common;

use std::thread;

use cohort_comm::store::StoreServer;
use cohort_comm::{Buffer, Collectives, Communicator, ReduceOp, Transport};
use cohort_runtime::{Client, CudaRuntime, Runtime};

const SECRET: &str = "nccl-groups-secret";

/// Runs `body(comm)` on `n` ranks, rank r on GPU r.
fn ranks<T: Send + 'static>(n: usize, body: fn(Communicator) -> T) -> Vec<T> {
    let gpus = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs CUDA GPUs: {e}"));
    assert!(gpus >= n, "this test needs {n} GPUs, found {gpus}");
    let server = StoreServer::bind("127.0.0.1:0", SECRET).unwrap();
    let addr = server.local_addr().to_string();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                let client: Client = CudaRuntime::client(rank).unwrap();
                body(Communicator::connect(rank, n, &addr, SECRET, vec![client]).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn input(m: usize, k: usize) -> Vec<f32> {
    (0..k).map(|j| (m * 1000 + j) as f32).collect()
}

/// One f32 tensor and one i64 tensor of a test: 100 in all.
type Pair = (Vec<Buffer<f32>>, Vec<Buffer<i64>>);

/// The operators of pair `i`: f32 sum or avg, i64 max or sum.
fn ops(i: usize) -> (ReduceOp, ReduceOp) {
    (
        if i.is_multiple_of(2) { ReduceOp::Sum } else { ReduceOp::Avg },
        if i.is_multiple_of(3) { ReduceOp::Max } else { ReduceOp::Sum },
    )
}

/// Pair `i` of member `m`, of mixed sizes.
fn make(comm: &Communicator, i: usize) -> Pair {
    let (m, len) = (comm.first_member(), 1 + (i * 97) % 1024);
    let f: Vec<f32> = (0..len).map(|j| (m * 5 + i + j % 7) as f32).collect();
    let n: Vec<i64> = (0..len / 3 + 1).map(|j| (m * 11 + i * j) as i64).collect();
    (comm.replicate(&f).unwrap(), comm.replicate(&n).unwrap())
}

/// Every tensor's values (the i64 ones as f32).
fn read(set: &[Pair]) -> Vec<Vec<f32>> {
    set.iter()
        .flat_map(|(f, n)| {
            let ints: Vec<f32> = n[0].to_vec().unwrap().into_iter().map(|v| v as f32).collect();
            [f[0].to_vec().unwrap(), ints]
        })
        .collect()
}

/// 100 all-reduces of mixed sizes and types grouped and separately;
/// returns (grouped, separate) results.
fn grouped_against_separate(comm: &Communicator) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let grouped: Vec<Pair> = (0..50).map(|i| make(comm, i)).collect();
    let work = comm
        .group(|g| {
            for (i, (f, n)) in grouped.iter().enumerate() {
                g.all_reduce(f, f, ops(i).0)?;
                g.all_reduce(n, n, ops(i).1)?;
            }
            Ok(())
        })
        .unwrap();
    work.wait().unwrap();
    let separate: Vec<Pair> = (0..50).map(|i| make(comm, i)).collect();
    for (i, (f, n)) in separate.iter().enumerate() {
        comm.all_reduce(f, f, ops(i).0).unwrap();
        comm.all_reduce(n, n, ops(i).1).unwrap();
    }
    (read(&grouped), read(&separate))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_a_group_split_from_one_rank_runs_on_nccl_and_groups_its_calls() {
    let results = ranks(1, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl, "the name promises NCCL");
        let group = comm.split(Some(4), 0).unwrap().expect("the only rank joins");
        assert_eq!(group.transport(), Transport::Nccl);
        let x = group.replicate(&input(0, 4099)).unwrap();
        group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
        let none = comm.split(None, 0).unwrap();
        (x[0].to_vec().unwrap(), none.is_none(), grouped_against_separate(&group))
    });
    let (sum, none, (grouped, separate)) = results.into_iter().next().unwrap();
    assert_eq!(sum, input(0, 4099));
    assert!(none, "a rank without a color joins no group");
    assert_eq!(grouped.len(), 100);
    assert_eq!(grouped, separate);
    // The flight records say which path ran: the grouped call's all-reduces
    // fused, the separate ones plain NCCL.
    let records = cohort_comm::trace::FlightRecorder::global().snapshot();
    let on = |path: &str| records.iter().filter(|r| r.path.as_deref() == Some(path)).count();
    assert!(on("nccl fused") >= 1, "no record of the fused group: {records:?}");
    assert!(on("nccl") >= 100, "{} separate calls recorded as nccl", on("nccl"));
}

/// With `NCCL_COMM_BLOCKING=0` every communicator is non-blocking, the
/// parent too: `ncclCommSplit` then answers "in progress" and hands the
/// child over only once the parent says the split ended. The group still
/// forms on NCCL, and its calls and a rank without a color work (in a child
/// process: the variable is read once per process).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_a_split_of_a_non_blocking_parent_waits_for_the_child() {
    const NAME: &str = "cuda_a_split_of_a_non_blocking_parent_waits_for_the_child";
    if std::env::var_os("COHORT_TEST_NON_BLOCKING_SPLIT").is_some() {
        let results = ranks(1, |comm| {
            let x = comm.replicate(&input(0, 1000)).unwrap();
            comm.all_reduce(&x, &x, ReduceOp::Max).unwrap();
            let group = comm.split(Some(1), 0).unwrap().expect("the only rank joins");
            assert_eq!(group.transport(), Transport::Nccl);
            let y = group.replicate(&input(0, 4099)).unwrap();
            for _ in 0..10 {
                group.all_reduce(&y, &y, ReduceOp::Max).unwrap();
            }
            (x[0].to_vec().unwrap(), y[0].to_vec().unwrap(), comm.split(None, 0).unwrap().is_none())
        });
        let (x, y, none) = results.into_iter().next().unwrap();
        assert_eq!((x, y, none), (input(0, 1000), input(0, 4099), true));
        println!("CHILD OK");
        return;
    }
    let envs = [("NCCL_COMM_BLOCKING", "0".into()), ("COHORT_TEST_NON_BLOCKING_SPLIT", "1".into())];
    let (ok, text) = cuda_common::finish(cuda_common::rerun(NAME, &envs));
    assert!(ok && text.contains("CHILD OK"), "{text}");
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_split_runs_on_nccl_comm_split_in_key_order() {
    const K: usize = 70_000;
    let results = ranks(2, |comm| {
        let r = comm.rank();
        // One group of both, reversed by key; then each rank alone; then
        // the subgroup of rank 1.
        let both = comm.split(Some(0), -(r as i64)).unwrap().unwrap();
        let alone = comm.split(Some(r as u32), 0).unwrap().unwrap();
        let second = comm.subgroup(&[1]).unwrap();
        let mine = both.replicate(&input(r, K)).unwrap();
        let all = both.zeros::<f32>(2 * K).unwrap();
        both.all_gather(&mine, &all).unwrap();
        let sum = both.zeros::<f32>(K).unwrap();
        both.all_reduce(&mine, &sum, ReduceOp::Sum).unwrap();
        let own = alone.replicate(&input(r, 8)).unwrap();
        alone.all_reduce(&own, &own, ReduceOp::Sum).unwrap();
        // The parent still runs after its splits.
        let parent = comm.replicate(&[1.0f32; 16]).unwrap();
        comm.all_reduce(&parent, &parent, ReduceOp::Sum).unwrap();
        let transports = [both.transport(), alone.transport()];
        (
            (both.rank(), both.job_ranks(), transports, second.map(|g| (g.rank(), g.transport()))),
            all[0].to_vec().unwrap(),
            sum[0].to_vec().unwrap(),
            own[0].to_vec().unwrap(),
            parent[0].to_vec().unwrap(),
        )
    });
    for (r, ((rank, job_ranks, transports, second), all, sum, own, parent)) in results.into_iter().enumerate() {
        assert_eq!(transports, [Transport::Nccl; 2], "rank {r}");
        assert_eq!((rank, job_ranks), (1 - r, vec![1, 0]), "rank {r}: keys order the group");
        let expected: Vec<f32> = [1, 0].iter().flat_map(|&m| input(m, K)).collect();
        assert_eq!(all, expected, "rank {r}");
        let sums: Vec<f32> = (0..K).map(|j| input(0, K)[j] + input(1, K)[j]).collect();
        assert_eq!(sum, sums, "rank {r}");
        assert_eq!(own, input(r, 8), "rank {r} alone");
        assert_eq!(parent, [2.0; 16]);
        assert_eq!(second, (r == 1).then_some((0, Transport::Nccl)), "rank {r}");
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_a_grouped_call_of_a_hundred_mixed_tensors_equals_separate_calls() {
    let results = ranks(2, |comm| (comm.transport(), grouped_against_separate(&comm)));
    for (rank, (transport, (grouped, separate))) in results.into_iter().enumerate() {
        // Without libnccl the host path computes the same sums: the name
        // promises NCCL.
        assert_eq!(transport, Transport::Nccl, "rank {rank}");
        assert_eq!(grouped.len(), 100);
        assert_eq!(grouped, separate, "rank {rank}");
        // Against the host: tensor 0's f32 sum over members 0 and 1.
        let host: Vec<f32> = (0..1).map(|j| (0..2).map(|m| (m * 5 + j % 7) as f32).sum()).collect();
        assert_eq!(grouped[0][..1], host[..], "rank {rank}");
    }
}
