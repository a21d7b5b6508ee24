//! Fused all-reduces of a grouped call on NCCL (ignored without a CUDA GPU;
//! `two_gpus_*` need two): a group of all-reduces of mixed element types,
//! operators and sizes (0 elements, odd byte sizes, in place, f16 and bf16)
//! with other collectives between them gives, byte for byte, what the same
//! calls give one by one and what the host computes; a group larger than
//! the fusion cap (set to 1 MiB here, with a call larger than the cap) too.
//! On one GPU through a one-rank NCCL communicator (`ClientGroup` with
//! `COHORT_NCCL_SINGLE=1`, and a one-rank `Communicator`), on two through a
//! `ClientGroup` of both and through two `Communicator` ranks (threads).

use std::sync::Once;
use std::thread;

use cohort_comm::store::StoreServer;
use cohort_comm::{ClientGroup, Collectives, Communicator, DType, GroupCall, ReduceOp, Transport};
use cohort_runtime::{Bytes, Client, CudaRuntime, Handle, Runtime};

/// Every CUDA device, with this binary's settings made before first use:
/// one-device groups on NCCL, and a fusion cap of 1 MiB.
fn devices() -> Vec<Client> {
    static SETTINGS: Once = Once::new();
    SETTINGS.call_once(|| {
        std::env::set_var("COHORT_NCCL_SINGLE", "1");
        std::env::set_var("COHORT_FUSION_MB", "1");
    });
    let n = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    (0..n).map(|i| CudaRuntime::client(i).expect("a CUDA client")).collect()
}

/// One call of a test group.
#[derive(Debug, Clone, Copy)]
enum Call {
    AllReduce { dtype: DType, op: ReduceOp, count: usize, in_place: bool },
    AllGather { dtype: DType, count: usize },
}

/// The mixed group: 110 calls cycling through types, operators and sizes,
/// every eleventh an all-gather.
fn mixed() -> Vec<Call> {
    let shapes = [
        (DType::F32, ReduceOp::Sum, 1024, true),
        (DType::F16, ReduceOp::Sum, 3, false),
        (DType::BF16, ReduceOp::Max, 5, true),
        (DType::U8, ReduceOp::Sum, 5, false),
        (DType::I64, ReduceOp::Prod, 7, false),
        (DType::F64, ReduceOp::Min, 9, true),
        (DType::F32, ReduceOp::Avg, 0, false),
        (DType::I32, ReduceOp::Sum, 1, true),
        (DType::F32, ReduceOp::Avg, 33, false),
        (DType::F16, ReduceOp::Sum, 4097, true),
    ];
    (0..110)
        .map(|k| match k % 11 {
            10 => Call::AllGather { dtype: DType::F32, count: 4 + k % 3 },
            i => {
                let (dtype, op, count, in_place) = shapes[i];
                Call::AllReduce { dtype, op, count: count + k / 11 % 2, in_place }
            }
        })
        .collect()
}

/// A group past the 1 MiB cap: 40 f32 sums of 64 KiB (three buckets), one
/// of 1.2 MB (alone), and 20 i32 sums of 12 KiB.
fn large() -> Vec<Call> {
    let mut calls = vec![Call::AllReduce { dtype: DType::F32, op: ReduceOp::Sum, count: 16384, in_place: false }; 40];
    calls.insert(17, Call::AllReduce { dtype: DType::F32, op: ReduceOp::Sum, count: 300_000, in_place: true });
    calls.extend([Call::AllReduce { dtype: DType::I32, op: ReduceOp::Sum, count: 3072, in_place: false }; 20]);
    calls
}

/// Element `j` of member `m`'s source of call `k`: a small whole number
/// (1 to 3 for products), exact in every type and after every reduction.
fn value(op: ReduceOp, m: usize, k: usize, j: usize) -> f64 {
    let x = (m * 7 + k * 3 + j) % 13;
    match op {
        ReduceOp::Prod => (x % 3 + 1) as f64,
        _ => x as f64,
    }
}

fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F64 => v.to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::I32 => (v as i32).to_le_bytes().to_vec(),
            DType::I64 => (v as i64).to_le_bytes().to_vec(),
            DType::U8 => vec![v as u8],
            other => panic!("no test values for {other}"),
        })
        .collect()
}

/// What the host computes for call `k` among `n` members.
fn reference(call: Call, k: usize, n: usize) -> Vec<u8> {
    match call {
        Call::AllReduce { dtype, op, count, .. } => {
            let out: Vec<f64> = (0..count)
                .map(|j| {
                    let each = (0..n).map(|m| value(op, m, k, j));
                    match op {
                        ReduceOp::Sum => each.sum(),
                        ReduceOp::Avg => each.sum::<f64>() / n as f64,
                        ReduceOp::Prod => each.product(),
                        ReduceOp::Max => each.fold(f64::MIN, f64::max),
                        ReduceOp::Min => each.fold(f64::MAX, f64::min),
                    }
                })
                .collect();
            encode(dtype, &out)
        }
        Call::AllGather { dtype, count } => (0..n)
            .flat_map(|m| encode(dtype, &(0..count).map(|j| value(ReduceOp::Sum, m, k, j)).collect::<Vec<_>>()))
            .collect(),
    }
}

/// Every local device's source and destination of call `k` (destinations
/// out of place start as 0xAB bytes, so a missed unpack shows).
fn buffers<C: Collectives>(c: &C, call: Call, k: usize) -> (Vec<Handle>, Vec<Handle>) {
    let n = c.members();
    let mut srcs = Vec::new();
    let mut dsts = Vec::new();
    for (l, client) in c.clients().iter().enumerate() {
        let m = c.first_member() + l;
        let (dtype, op, count, in_place, out_count) = match call {
            Call::AllReduce { dtype, op, count, in_place } => (dtype, op, count, in_place, count),
            Call::AllGather { dtype, count } => (dtype, ReduceOp::Sum, count, false, count * n),
        };
        let src =
            client.create(Bytes::from(encode(dtype, &(0..count).map(|j| value(op, m, k, j)).collect::<Vec<_>>())));
        let dst = if in_place { src.clone() } else { client.create(Bytes::from(vec![0xAB; out_count * dtype.size()])) };
        srcs.push(src);
        dsts.push(dst);
    }
    (srcs, dsts)
}

fn group_call(call: Call, src: Vec<Handle>, dst: Vec<Handle>) -> GroupCall {
    match call {
        Call::AllReduce { dtype, op, .. } => GroupCall::AllReduce { src: src.into(), dst: dst.into(), dtype, op },
        Call::AllGather { dtype, .. } => GroupCall::AllGather { src: src.into(), dst: dst.into(), dtype },
    }
}

fn read(c: &impl Collectives, dsts: &[Handle]) -> Vec<Vec<u8>> {
    c.clients().iter().zip(dsts).map(|(client, d)| client.read_one(d.clone()).unwrap().to_vec()).collect()
}

/// Runs `calls` as one group and one by one on fresh buffers, and checks
/// both against the host, byte for byte, on every local device.
fn fused_matches_separate_and_host<C: Collectives>(c: &C, calls: &[Call]) {
    assert_eq!(c.transport(), Transport::Nccl, "the test is about the NCCL path");
    let grouped: Vec<_> = calls.iter().enumerate().map(|(k, &call)| buffers(c, call, k)).collect();
    let group = grouped.iter().zip(calls).map(|((s, d), &call)| group_call(call, s.clone(), d.clone())).collect();
    c.group_handles(group).unwrap().wait().unwrap();
    let separate: Vec<_> = calls.iter().enumerate().map(|(k, &call)| buffers(c, call, k)).collect();
    for ((s, d), &call) in separate.iter().zip(calls) {
        let work = match call {
            Call::AllReduce { dtype, op, .. } => c.all_reduce_handles(s, d, dtype, op),
            Call::AllGather { dtype, .. } => c.all_gather_handles(s, d, dtype),
        };
        work.unwrap().wait().unwrap();
    }
    for (k, &call) in calls.iter().enumerate() {
        let (got, one_by_one) = (read(c, &grouped[k].1), read(c, &separate[k].1));
        let want = reference(call, k, c.members());
        for (l, (got, one)) in got.iter().zip(&one_by_one).enumerate() {
            assert_eq!(got, one, "call {k} ({call:?}) on local device {l}: grouped differs from separate");
            assert_eq!(got, &want, "call {k} ({call:?}) on local device {l}: differs from the host");
        }
    }
}

/// Runs `body` on `n` communicator ranks (threads), rank r on GPU r.
fn ranks(n: usize, body: fn(Communicator)) {
    let gpus = devices().len();
    assert!(gpus >= n, "this test needs {n} GPUs, found {gpus}");
    let server = StoreServer::bind("127.0.0.1:0", "fusion-secret").unwrap();
    let addr = server.local_addr().to_string();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                let client = CudaRuntime::client(rank).unwrap();
                body(Communicator::connect(rank, n, &addr, "fusion-secret", vec![client]).unwrap())
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_all_reduces_of_mixed_types_equal_separate_calls_on_one_gpu() {
    let group = ClientGroup::new(devices()[..1].to_vec()).unwrap();
    fused_matches_separate_and_host(&group, &mixed());
    fused_matches_separate_and_host(&group, &large());
    // Grouped equals separate whether or not it fused: the flight record
    // says it did.
    let fused = cohort_comm::trace::FlightRecorder::global()
        .snapshot()
        .iter()
        .filter(|r| r.path.as_deref() == Some("nccl fused"))
        .count();
    assert!(fused >= 2, "both groups ran fused, {fused} records say so");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_all_reduces_on_a_one_rank_communicator_equal_separate_calls() {
    ranks(1, |comm| {
        fused_matches_separate_and_host(&comm, &mixed());
        fused_matches_separate_and_host(&comm, &large());
        fused_call_whose_source_partly_overlaps_its_destination(&comm);
    });
}

/// A `Communicator` allows a source that partly overlaps its destination;
/// in a fused group such a call is packed into its bucket from its source
/// (no copy of its own) and unpacked into its destination: on one rank
/// the destination holds the source's values as they were.
fn fused_call_whose_source_partly_overlaps_its_destination(comm: &Communicator) {
    let c = comm.clients()[0].clone();
    let values: Vec<f32> = (1..=12).map(|i| i as f32).collect();
    let buf = c.create_from_slice(bytemuck::cast_slice(&values));
    let (src, dst) = (buf.slice(0, 32).unwrap(), buf.slice(8, 32).unwrap());
    let apart: Vec<(Handle, Handle)> =
        (0..2).map(|k| (c.create_from_slice(bytemuck::cast_slice(&[k as f32 + 0.5; 8])), c.empty(32))).collect();
    let sum = |src: &Handle, dst: &Handle| GroupCall::AllReduce {
        src: vec![src.clone()].into(),
        dst: vec![dst.clone()].into(),
        dtype: DType::F32,
        op: ReduceOp::Sum,
    };
    let group = vec![sum(&apart[0].0, &apart[0].1), sum(&src, &dst), sum(&apart[1].0, &apart[1].1)];
    comm.group_handles(group).unwrap().wait().unwrap();
    let got: Vec<f32> = bytemuck::cast_slice(&c.read_one(dst).unwrap()).to_vec();
    assert_eq!(got, values[..8], "the overlapping call's destination");
    for (k, (_, d)) in apart.iter().enumerate() {
        let got: Vec<f32> = bytemuck::cast_slice(&c.read_one(d.clone()).unwrap()).to_vec();
        assert_eq!(got, [k as f32 + 0.5; 8], "call {k} beside it");
    }
    let last = cohort_comm::trace::FlightRecorder::global().snapshot().pop().expect("a record");
    assert_eq!(last.path.as_deref(), Some("nccl fused"), "{last:?}");
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_fused_all_reduces_equal_separate_calls_and_the_host() {
    let devices = devices();
    assert!(devices.len() >= 2, "this test needs two GPUs, found {}", devices.len());
    let group = ClientGroup::new(devices[..2].to_vec()).unwrap();
    fused_matches_separate_and_host(&group, &mixed());
    fused_matches_separate_and_host(&group, &large());
    ranks(2, |comm| {
        fused_matches_separate_and_host(&comm, &mixed());
        fused_matches_separate_and_host(&comm, &large());
    });
}
