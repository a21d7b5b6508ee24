//! The runtime conformance suite on the CPU backend.

cohort_runtime::conformance_tests!(cohort_runtime::CpuRuntime);
