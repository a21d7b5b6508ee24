//! The runtime conformance suite on the CUDA backend (needs a CUDA GPU), and
//! the no-driver check that runs everywhere.

#![cfg(feature = "cuda")]

cohort_runtime::conformance_tests!(
    cohort_runtime::CudaRuntime,
    #[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
);

/// CUDA devices time with events: `profile` measures on the device.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn profile_reports_its_method() {
    cohort_runtime::conformance::profile_reports_its_method::<cohort_runtime::CudaRuntime>(
        cohort_runtime::TimingMethod::Device,
    );
}

/// Where no driver (or no device) is, counting devices is an error naming
/// what was looked for, never a panic; where one is, it counts at least one.
#[test]
fn device_count_is_an_error_not_a_panic() {
    use cohort_runtime::{CudaRuntime, Runtime};
    match CudaRuntime::device_count() {
        Ok(n) => assert!(n > 0),
        Err(err) => {
            let message = err.to_string();
            assert!(message.contains("libcuda.so") || message.contains("no CUDA device"), "{message}");
            let client = CudaRuntime::client(0).unwrap_err();
            assert_eq!(client.to_string(), message);
        }
    }
}
