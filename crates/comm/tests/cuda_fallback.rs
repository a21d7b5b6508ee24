//! Without NCCL (`COHORT_DISABLE_NCCL=1` stands in for a missing libnccl)
//! the CUDA path reports why and falls back to host staging; with
//! `COHORT_NCCL_SINGLE=1` a group of one device asks for NCCL, so it takes
//! that fallback too.

mod cuda_common;

use std::sync::Once;

use cohort_comm::{ClientGroup, Transport};

fn setup() {
    static ENV: Once = Once::new();
    // Set before anything reads them (every test calls this first).
    ENV.call_once(|| {
        std::env::set_var("COHORT_DISABLE_NCCL", "1");
        std::env::set_var("COHORT_NCCL_SINGLE", "1");
    });
}

#[test]
fn disabled_nccl_is_an_error_that_says_why() {
    setup();
    let why = cohort_runtime::backend::cuda::nccl_version().unwrap_err();
    assert!(why.contains("COHORT_DISABLE_NCCL"), "{why}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn without_nccl_collectives_fall_back_to_host_staging() {
    setup();
    let device = cuda_common::devices().remove(0);
    let group = ClientGroup::new(vec![device]).unwrap();
    assert_eq!(group.transport(), Transport::HostStaged);
    cuda_common::matrix(&group, &[0, 1, 37, 4099]);
}
