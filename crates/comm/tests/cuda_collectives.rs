//! ClientGroup collectives on CUDA devices: a group of one device (device
//! copies, no NCCL), groups of every size the machine has (NCCL), peers and
//! `to_client`, and failures marking destinations. The GPU tests are
//! ignored where there is no GPU: run them with `--include-ignored`.
//! `cuda_nccl_single.rs` runs the NCCL path on one device, and
//! `cuda_fallback.rs` the fallback without libnccl.

mod cuda_common;

use cohort_comm::op::Collective;
use cohort_comm::{to_client, ClientGroup, DType, ReduceOp, Transport};
use cohort_runtime::{Bytes, CudaRuntime, GridCount, Kernel, KernelArguments, Runtime};

#[test]
fn without_a_driver_or_libnccl_the_cuda_path_reports_errors_not_panics() {
    // Either answer is fine; what matters is that neither panics and that a
    // missing library is named.
    match cohort_runtime::backend::cuda::nccl_version() {
        Ok(version) => assert!(version.starts_with("2."), "NCCL version {version}"),
        Err(why) => assert!(why.contains("libnccl") || why.contains("COHORT_DISABLE_NCCL"), "{why}"),
    }
    match CudaRuntime::client(0) {
        Ok(client) => {
            let group = ClientGroup::new(vec![client]).expect("a one-device group");
            assert_ne!(group.transport(), Transport::HostDirect);
        }
        Err(err) => assert!(err.to_string().contains("CUDA"), "{err}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_one_device_group_copies_on_the_device_for_every_collective_and_type() {
    let device = cuda_common::devices().remove(0);
    let group = ClientGroup::new(vec![device]).unwrap();
    assert_eq!(group.transport(), Transport::LocalCopy, "a group of one needs no NCCL");
    cuda_common::matrix(&group, &[0, 1, 37, 65_539]);
    cuda_common::check(&group, Collective::AllReduce, DType::F32, ReduceOp::Avg, 16 << 20, false);
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_every_group_size_the_machine_has_runs_every_collective_through_nccl() {
    let devices = cuda_common::devices();
    assert!(
        devices.len() >= 2,
        "this test needs two GPUs or more, found {} (see cuda_nccl_single.rs for one)",
        devices.len()
    );
    // The name promises NCCL: without libnccl this would test host staging
    // (cuda_fallback.rs covers that), so it fails and says what is missing.
    if let Err(why) = cohort_runtime::backend::cuda::nccl_version() {
        panic!("this test runs the collectives through NCCL, which is not available: {why}; install libnccl2 (or put libnccl.so.2 on LD_LIBRARY_PATH)");
    }
    for n in 2..=devices.len() {
        let group = ClientGroup::new(devices[..n].to_vec()).unwrap();
        assert_eq!(group.transport(), Transport::Nccl, "a group of {n} GPUs with libnccl loaded");
        cuda_common::matrix(&group, &[0, 1, 37, 4099]);
        // Another member order is another communicator, and still right.
        let reversed: Vec<_> = devices[..n].iter().rev().cloned().collect();
        let group = ClientGroup::new(reversed).unwrap();
        cuda_common::check(&group, Collective::AllGather, DType::BF16, ReduceOp::Sum, 1001, true);
        cuda_common::check(&group, Collective::ReduceScatter, DType::F16, ReduceOp::Avg, 1001, false);
    }
}

/// Every collective at 1 GiB over every GPU of the machine (a device copy
/// on one GPU; see cuda_nccl_single.rs for one-rank NCCL).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn every_collective_at_one_gib_over_every_gpu() {
    let group = ClientGroup::new(cuda_common::devices()).unwrap();
    cuda_common::one_gib(&group);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn peers_and_to_client_stay_on_the_devices() {
    let devices = cuda_common::devices();
    let a = &devices[0];
    assert!(a.can_access_peer(a), "a device reaches its own memory");
    let cpu = cohort_runtime::CpuRuntime::client(0).unwrap();
    assert!(!a.can_access_peer(&cpu), "no peer access across runtimes");
    let data: Vec<u8> = (0..=255u8).cycle().take(3 << 20).collect();
    let src = a.create_from_slice(&data);
    let shared = a.share_with_peers(&src).expect("sharing with peers");
    // On one device: a device copy.
    let copy = to_client(&shared, a, a).unwrap();
    assert_eq!(a.read_one(copy).unwrap().to_vec(), data);
    // Across runtimes: through the host.
    let on_cpu = to_client(&src, a, &cpu).unwrap();
    assert_eq!(cpu.read_one(on_cpu).unwrap().to_vec(), data);
    for b in &devices[1..] {
        let reach = a.can_access_peer(b);
        assert_eq!(reach, a.can_access_peer(b), "the answer is cached and stable");
        let moved = to_client(&src, a, b).unwrap();
        assert_eq!(
            b.read_one(moved).unwrap().to_vec(),
            data,
            "{} -> {} (peer access: {reach})",
            a.device_id(),
            b.device_id()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_poisoned_input_marks_the_destinations_of_a_one_device_group() {
    let device = cuda_common::devices().remove(0);
    let group = ClientGroup::new(vec![device.clone()]).unwrap();
    let src = device.create(Bytes::from(vec![1u8; 256]));
    let dst = device.create(Bytes::from(vec![0u8; 256]));
    // A kernel with no CUDA source fails and marks its output.
    let boom = Kernel::new("boom").with_cpu(|_| {});
    let _ = device.launch(&boom, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src));
    group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    let err = device.read_one(dst).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("boom"), "{err}");
}
