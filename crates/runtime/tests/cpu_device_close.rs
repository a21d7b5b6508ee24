//! Closing a device while threads use it (its own process: it closes a device
//! other tests would share).

use cohort_runtime::{CpuRuntime, Runtime};

#[test]
fn device_closed_mid_use() {
    cohort_runtime::conformance::device_closed_mid_use::<CpuRuntime>(CpuRuntime::client(0).unwrap());
}

#[test]
fn shutdown_closes_every_device() {
    let client = CpuRuntime::client(2).unwrap();
    let h = client.create_from_slice(&[1, 2, 3, 4]);
    cohort_runtime::shutdown();
    assert!(matches!(client.read_one(h), Err(cohort_runtime::ServerError::DeviceClosed { .. })));
}
