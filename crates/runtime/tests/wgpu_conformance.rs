//! The runtime conformance suite on the wgpu backend (lavapipe in CI, any
//! Vulkan, Metal, DX12 or GL adapter elsewhere).

cohort_runtime::conformance_tests!(cohort_runtime::WgpuRuntime);

/// `profile` measures on the device exactly where device 0's adapter offers
/// timestamp queries, as wgpu itself (not cohort) reports them.
#[test]
fn profile_reports_its_method() {
    use cohort_runtime::{Runtime, TimingMethod, WgpuRuntime};
    let client = WgpuRuntime::client(0).expect("a wgpu adapter (lavapipe in CI)");
    let name = client.properties().name.clone();
    let descriptor = wgpu::InstanceDescriptor {
        backends: wgpu::Backends::all(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    };
    let adapters = pollster::block_on(wgpu::Instance::new(descriptor).enumerate_adapters(wgpu::Backends::all()));
    let ours: Vec<_> = adapters.iter().filter(|a| name.contains(&a.get_info().name)).collect();
    assert!(!ours.is_empty(), "no adapter named in {name:?}");
    let timestamps = ours.iter().any(|a| a.features().contains(wgpu::Features::TIMESTAMP_QUERY));
    let expected = if timestamps { TimingMethod::Device } else { TimingMethod::Host };
    cohort_runtime::conformance::profile_reports_its_method::<WgpuRuntime>(expected);
}
