//! The runtime conformance suite on the wgpu backend (lavapipe in CI, any
//! Vulkan, Metal, DX12 or GL adapter elsewhere).

cohort_runtime::conformance_tests!(cohort_runtime::WgpuRuntime);
