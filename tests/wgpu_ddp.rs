//! DistributedDataParallel on wgpu devices (lavapipe in CI:
//! `COHORT_WGPU_DEVICES` opens several on one adapter): the tiled WGSL
//! matmul and the staged all-reduce give the same parameters as an
//! all-reduce after the whole backward, replicas stay bit-identical, and
//! the compression hooks stay within their tolerance.

mod common;

use std::sync::Once;

use cohort_comm::ClientGroup;
use cohort_runtime::{Client, Runtime, WgpuRuntime};

/// The most devices any test here opens. The wgpu runtime reads
/// `COHORT_WGPU_DEVICES` once, when the first test opens a device, so it is
/// set for the largest test whichever test runs first.
const MOST_DEVICES: usize = 3;

fn clients(n: usize) -> Vec<Client> {
    assert!(n <= MOST_DEVICES, "raise MOST_DEVICES to {n}");
    static DEVICES: Once = Once::new();
    DEVICES.call_once(|| {
        let set = std::env::var("COHORT_WGPU_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok());
        if set.is_none_or(|d| d < MOST_DEVICES) {
            std::env::set_var("COHORT_WGPU_DEVICES", MOST_DEVICES.to_string());
        }
    });
    (0..n).map(|i| WgpuRuntime::client(i).unwrap_or_else(|e| panic!("wgpu device {i}: {e}"))).collect()
}

#[test]
fn wgpu_ddp_on_three_devices_matches_the_reference_and_keeps_replicas_identical() {
    common::every_scenario(&ClientGroup::new(clients(3)).unwrap());
}

#[test]
fn wgpu_split_parameters_give_the_same_bits_as_whole_ones() {
    common::split_scenarios(&ClientGroup::new(clients(2)).unwrap(), common::SplitBits::Same);
}
