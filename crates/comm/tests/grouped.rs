//! Grouped calls: 100 collectives of mixed sizes and element types run as
//! one group give the same results as 100 separate calls, on a CPU group,
//! a wgpu group (lavapipe in CI) and communicators of two ranks (threads);
//! a bad call inside a group refuses the whole group before anything is
//! queued, as does a call that reads what an earlier one writes.

mod common;

use std::sync::Once;
use std::thread;

use cohort_comm::store::StoreServer;
use cohort_comm::{Buffer, ClientGroup, Collectives, CommError, Communicator, Error, ReduceOp};
use cohort_runtime::{Client, Runtime, WgpuRuntime};

const CALLS: usize = 100;

/// Every local device's buffers of one kind of call.
enum Set {
    F32(Vec<Buffer<f32>>, Vec<Buffer<f32>>),
    I32(Vec<Buffer<i32>>, Vec<Buffer<i32>>),
    F64(Vec<Buffer<f64>>, Vec<Buffer<f64>>),
}

/// Call `k`'s sources and destinations: an f32 sum all-reduce (in place),
/// an i32 max all-reduce, an f64 all-gather or an f32 broadcast, of sizes
/// 1 to 67 elements.
fn buffers<C: Collectives>(c: &C, k: usize) -> Set {
    let len = 1 + (k * 29) % 67;
    let first = c.first_member();
    let n = c.members();
    let per = |f: &dyn Fn(usize, usize) -> f64| -> Vec<Vec<f64>> {
        (0..c.clients().len()).map(|l| (0..len).map(|j| f(first + l, j)).collect()).collect()
    };
    let data = per(&|m, j| (m * 100 + j + k) as f64);
    match k % 4 {
        0 | 3 => {
            let src: Vec<Buffer<f32>> = c
                .clients()
                .iter()
                .zip(&data)
                .map(|(cl, d)| Buffer::from_slice(cl, &d.iter().map(|v| *v as f32).collect::<Vec<_>>()).unwrap())
                .collect();
            let dst = if k.is_multiple_of(4) { src.clone() } else { c.zeros(len).unwrap() };
            Set::F32(src, dst)
        }
        1 => {
            let src = c
                .clients()
                .iter()
                .zip(&data)
                .map(|(cl, d)| Buffer::from_slice(cl, &d.iter().map(|v| -(*v as i32)).collect::<Vec<_>>()).unwrap())
                .collect();
            Set::I32(src, c.zeros(len).unwrap())
        }
        _ => {
            let src = c.clients().iter().zip(&data).map(|(cl, d)| Buffer::from_slice(cl, d).unwrap()).collect();
            Set::F64(src, c.zeros(len * n).unwrap())
        }
    }
}

/// Queues call `k` on `set`, into a group or alone.
fn call<C: Collectives>(c: &C, g: Option<&mut cohort_comm::Grouped<'_, C>>, k: usize, set: &Set) -> Result<(), Error> {
    let root = k % c.members();
    match (set, g) {
        (Set::F32(s, d), Some(g)) if k.is_multiple_of(4) => g.all_reduce(s, d, ReduceOp::Sum),
        (Set::F32(s, d), None) if k.is_multiple_of(4) => c.all_reduce(s, d, ReduceOp::Sum).map(drop),
        (Set::F32(s, d), Some(g)) => g.broadcast(s, d, root),
        (Set::F32(s, d), None) => c.broadcast(s, d, root).map(drop),
        (Set::I32(s, d), Some(g)) => g.all_reduce(s, d, ReduceOp::Max),
        (Set::I32(s, d), None) => c.all_reduce(s, d, ReduceOp::Max).map(drop),
        (Set::F64(s, d), Some(g)) => g.all_gather(s, d),
        (Set::F64(s, d), None) => c.all_gather(s, d).map(drop),
    }
}

/// Every local destination of `set`, as f64s.
fn read(set: &Set) -> Vec<Vec<f64>> {
    match set {
        Set::F32(_, d) => d.iter().map(|b| b.to_vec().unwrap().into_iter().map(f64::from).collect()).collect(),
        Set::I32(_, d) => d.iter().map(|b| b.to_vec().unwrap().into_iter().map(f64::from).collect()).collect(),
        Set::F64(_, d) => d.iter().map(|b| b.to_vec().unwrap()).collect(),
    }
}

/// Runs the 100 calls grouped and separately and compares every result;
/// spot-checks the grouped results against the host.
fn grouped_matches_separate<C: Collectives>(c: &C) {
    let grouped: Vec<Set> = (0..CALLS).map(|k| buffers(c, k)).collect();
    let separate: Vec<Set> = (0..CALLS).map(|k| buffers(c, k)).collect();
    let work = c
        .group(|g| {
            for (k, set) in grouped.iter().enumerate() {
                call(c, Some(g), k, set)?;
            }
            assert_eq!(g.len(), CALLS);
            Ok(())
        })
        .unwrap();
    work.wait().unwrap();
    assert!(work.is_done());
    for (k, set) in separate.iter().enumerate() {
        call(c, None, k, set).unwrap();
    }
    let n = c.members();
    for k in 0..CALLS {
        let (got, want) = (read(&grouped[k]), read(&separate[k]));
        assert_eq!(got, want, "call {k}: grouped differs from separate");
        if k % 4 == 0 {
            // The in-place f32 sum: element j is Σ_m (m·100 + j + k).
            let sum = (0..n).map(|m| (m * 100 + k) as f64).sum::<f64>();
            assert_eq!(got[0][0], sum, "call {k}");
        }
    }
}

#[test]
fn a_hundred_grouped_calls_on_a_cpu_group_match_separate_calls() {
    grouped_matches_separate(&common::group(4));
}

fn wgpu_clients(n: usize) -> Vec<Client> {
    static DEVICES: Once = Once::new();
    DEVICES.call_once(|| {
        let set = std::env::var("COHORT_WGPU_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok());
        if set.is_none_or(|d| d < 4) {
            std::env::set_var("COHORT_WGPU_DEVICES", "4");
        }
    });
    (0..n).map(|i| WgpuRuntime::client(i).unwrap_or_else(|e| panic!("wgpu device {i}: {e}"))).collect()
}

#[test]
fn a_hundred_grouped_calls_on_a_wgpu_group_match_separate_calls() {
    grouped_matches_separate(&ClientGroup::new(wgpu_clients(3)).unwrap());
}

#[test]
fn a_hundred_grouped_calls_on_communicators_match_separate_calls() {
    common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                let clients = common::clients(8)[4 + 2 * rank..6 + 2 * rank].to_vec();
                let comm = Communicator::connect(rank, 2, &addr, "secret", clients).unwrap();
                grouped_matches_separate(&comm);
            })
        })
        .collect();
    for rank in ranks {
        rank.join().unwrap();
    }
}

#[test]
fn a_bad_call_or_a_dependent_one_refuses_the_whole_group_before_anything_is_queued() {
    let clients = common::clients(4);
    let group = ClientGroup::new(clients[..2].to_vec()).unwrap();
    let a = group.replicate(&[1.0f32; 4]).unwrap();
    let short = group.zeros::<f32>(3).unwrap();
    let err = group
        .group(|g| {
            g.all_reduce(&a, &a, ReduceOp::Sum)?;
            g.all_reduce(&a, &short, ReduceOp::Sum)
        })
        .unwrap_err();
    assert!(err.to_string().contains("all_reduce"), "{err}");
    assert!(matches!(err, Error::Comm(CommError::WrongSize { .. })), "{err}");
    assert_eq!(a[0].to_vec().unwrap(), [1.0; 4], "the good call before the bad one was not queued either");
    let b = group.zeros::<f32>(4).unwrap();
    let err = group
        .group(|g| {
            g.all_reduce(&a, &b, ReduceOp::Sum)?;
            g.all_reduce(&b, &a, ReduceOp::Sum)
        })
        .unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::DependentCalls { earlier: 0, later: 1 })), "{err}");
    assert_eq!((a[1].to_vec().unwrap(), b[1].to_vec().unwrap()), (vec![1.0; 4], vec![0.0; 4]));
    // A call in place writes its buffer: a later call may not read it...
    let err = group
        .group(|g| {
            g.all_reduce(&a, &a, ReduceOp::Sum)?;
            g.all_reduce(&a, &b, ReduceOp::Sum)
        })
        .unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::DependentCalls { earlier: 0, later: 1 })), "{err}");
    // ...while two calls that only read one buffer are independent.
    let c = group.zeros::<f32>(4).unwrap();
    group
        .group(|g| {
            g.all_reduce(&a, &b, ReduceOp::Sum)?;
            g.all_reduce(&a, &c, ReduceOp::Max)
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((b[1].to_vec().unwrap(), c[1].to_vec().unwrap()), (vec![2.0; 4], vec![1.0; 4]));
    // An empty group is done at once.
    assert!(group.group(|_| Ok(())).unwrap().is_done());
}

/// Every CUDA device; panics (with the reason) where there is none, which
/// only the ignored GPU tests reach.
fn cuda_devices() -> Vec<Client> {
    let n = cohort_runtime::CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    (0..n).map(|i| cohort_runtime::CudaRuntime::client(i).expect("a CUDA client")).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_hundred_grouped_calls_on_one_gpu_match_separate_calls() {
    grouped_matches_separate(&ClientGroup::new(cuda_devices()[..1].to_vec()).unwrap());
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_a_hundred_grouped_calls_through_nccl_match_separate_calls() {
    let devices = cuda_devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    let group = ClientGroup::new(devices).unwrap();
    assert_eq!(group.transport(), cohort_comm::Transport::Nccl, "the name promises NCCL");
    grouped_matches_separate(&group);
}
