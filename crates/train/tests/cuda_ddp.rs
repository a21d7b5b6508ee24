//! DistributedDataParallel on CUDA devices: on one GPU (a group of one),
//! and over NCCL on every GPU of the machine (`two_gpus_`), the same
//! scenarios as on the CPU: buckets overlapped with backward on two
//! streams and no_sync against an all-reduce after the whole backward,
//! bit-identical replicas, the hooks' tolerance. Ignored without a GPU.

mod common;

use cohort_comm::ClientGroup;
use cohort_runtime::{Client, CudaRuntime, Runtime};

fn devices() -> Vec<Client> {
    let n = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    (0..n).map(|i| CudaRuntime::client(i).expect("a CUDA client")).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ddp_on_one_gpu_matches_the_reference() {
    let one = devices().into_iter().take(1).collect();
    common::every_scenario(&ClientGroup::new(one).unwrap());
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_ddp_over_nccl_matches_the_reference_and_keeps_replicas_identical() {
    let all = devices();
    assert!(all.len() >= 2, "this test needs two GPUs or more, found {}", all.len());
    common::every_scenario(&ClientGroup::new(all).unwrap());
}
