//! DistributedDataParallel on CPU devices in one process (a ClientGroup):
//! buckets, overlap and no_sync against an all-reduce after the whole
//! backward, bit-identical replicas, the compression hooks' tolerance, and
//! the errors of bad registrations.

mod common;

use cohort_comm::ClientGroup;
use cohort_runtime::{CpuRuntime, Runtime};
use cohort_train::ddp::{DdpOptions, DistributedDataParallel};
use cohort_train::nn::{GradientSink, LocalGradients};

fn group(n: usize) -> ClientGroup {
    ClientGroup::new((0..n).map(|i| CpuRuntime::client(i).unwrap()).collect()).unwrap()
}

#[test]
fn ddp_on_four_cpu_devices_matches_the_reference_and_keeps_replicas_identical() {
    common::every_scenario(&group(4));
}

#[test]
fn ddp_on_one_device_matches_local_training() {
    common::every_scenario(&group(1));
}

#[test]
fn small_caps_make_several_buckets_filled_from_the_last_layer() {
    let world = group(2);
    let s = common::setup(&world, 1).unwrap();
    let ddp = DistributedDataParallel::new(&world, &s.params, common::small_buckets()).unwrap();
    let buckets = ddp.buckets();
    assert_eq!(buckets.len(), 3, "{buckets:?}");
    // The last layer's bias, then its weight, fill the first bucket.
    let n = s.params.len();
    assert_eq!(buckets[0].params, [n - 1, n - 2]);
    assert_eq!(ddp.place(n - 2).offset, 64, "the weight's place is aligned after the bias's 64 floats");
}

#[test]
fn a_replica_of_the_wrong_length_is_refused_naming_the_parameter() {
    let world = group(2);
    let err = DistributedDataParallel::new(&world, &[common::wrong_param(&world, 15)], DdpOptions::default())
        .err()
        .expect("a wrong length is refused");
    let msg = err.to_string();
    assert!(msg.contains("head.weight") && msg.contains("15") && msg.contains("16"), "{msg}");
}

#[test]
fn a_parameter_without_a_gradient_is_an_error_at_finish() {
    let world = group(2);
    let s = common::setup(&world, 1).unwrap();
    let mut ddp = DistributedDataParallel::new(&world, &s.params, DdpOptions::default()).unwrap();
    for i in 1..s.params.len() {
        ddp.ready(i).unwrap();
    }
    let msg = ddp.finish().unwrap_err().to_string();
    assert!(msg.contains("layers.0.weight") && msg.contains("no gradient"), "{msg}");
    // Parameter 3 was reported in this (unfinished) backward already.
    let msg = ddp.ready(3).unwrap_err().to_string();
    assert!(msg.contains("twice") && msg.contains("layers.1.bias"), "{msg}");
    // Bad caps are refused.
    let zero = DdpOptions { bucket_cap_bytes: 0, ..DdpOptions::default() };
    assert!(DistributedDataParallel::new(&world, &s.params, zero).is_err());
    // A reference that is not DDP at all still works with the same model.
    LocalGradients::new(&s.params).unwrap();
    world.sync().unwrap();
}
