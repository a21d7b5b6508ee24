//! Closing a wgpu device while threads use it, then opening it again (its own
//! process: it closes a device other tests would share).

use cohort_runtime::{Runtime, ServerError, WgpuRuntime};

#[test]
fn device_closed_mid_use_then_shutdown() {
    cohort_runtime::conformance::device_closed_mid_use::<WgpuRuntime>(WgpuRuntime::client(0).unwrap());
    let client = WgpuRuntime::client(0).unwrap();
    let h = client.create_from_slice(&[1, 2, 3, 4]);
    assert_eq!(&client.read_one(h.clone()).unwrap()[..], &[1, 2, 3, 4]);
    cohort_runtime::shutdown();
    assert!(matches!(client.read_one(h), Err(ServerError::DeviceClosed { .. })));
}
