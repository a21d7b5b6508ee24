//! The runtime conformance suite on the CPU backend.

cohort_runtime::conformance_tests!(cohort_runtime::CpuRuntime);

/// The CPU has no device clock: `profile` times on the host.
#[test]
fn profile_reports_its_method() {
    cohort_runtime::conformance::profile_reports_its_method::<cohort_runtime::CpuRuntime>(
        cohort_runtime::TimingMethod::Host,
    );
}
