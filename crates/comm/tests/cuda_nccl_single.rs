//! The NCCL path on one device: `COHORT_NCCL_SINGLE=1` sends a group of one
//! device through a one-rank NCCL communicator instead of device copies,
//! which proves every NCCL call of every collective on a one-GPU machine.

mod cuda_common;

use std::sync::Once;

use cohort_comm::verify::CollectiveOp;
use cohort_comm::{ClientGroup, DType, ReduceOp, Transport};
use cohort_runtime::{Bytes, GridCount, Kernel, KernelArguments};

fn one_rank_group() -> ClientGroup {
    static FORCE: Once = Once::new();
    // Set before the first group reads it (every test calls this first).
    FORCE.call_once(|| std::env::set_var("COHORT_NCCL_SINGLE", "1"));
    let device = cuda_common::devices().remove(0);
    if let Err(why) = cohort_runtime::backend::cuda::nccl_version() {
        panic!("this test needs libnccl: {why}");
    }
    let group = ClientGroup::new(vec![device]).unwrap();
    assert_eq!(group.transport(), Transport::Nccl);
    group
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_one_rank_communicator_runs_every_collective_and_type() {
    let group = one_rank_group();
    cuda_common::matrix(&group, &[0, 1, 37, 65_539]);
    cuda_common::check(&group, CollectiveOp::AllReduce, DType::BF16, ReduceOp::Avg, 8 << 20, true);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_poisoned_input_marks_the_destination_without_reaching_nccl() {
    let group = one_rank_group();
    let device = group.client(0).clone();
    let src = device.create(Bytes::from(vec![1u8; 256]));
    let dst = device.create(Bytes::from(vec![0u8; 256]));
    let boom = Kernel::new("boom").with_cpu(|_| {});
    let _ = device.launch(&boom, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src));
    group.all_reduce(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum).unwrap();
    let err = device.read_one(dst).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("boom"), "{err}");
    // The communicator still works.
    let fresh = device.create(Bytes::from(vec![2u8; 256]));
    let out = device.empty(256);
    group.all_reduce(std::slice::from_ref(&fresh), std::slice::from_ref(&out), DType::U8, ReduceOp::Sum).unwrap();
    assert!(device.read_one(out).unwrap().iter().all(|&b| b == 2));
    group.barrier().unwrap();
}
