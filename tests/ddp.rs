//! DistributedDataParallel on CPU devices in one process (a ClientGroup):
//! buckets, overlap and no_sync against an all-reduce after the whole
//! backward, bit-identical replicas, the compression hooks' tolerance, the
//! same bits with the world on high-priority communication streams, and the
//! errors of bad registrations.

mod common;

use cohort_comm::{ClientGroup, Collectives};
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
fn ddp_on_high_priority_communication_streams_gives_the_same_bits() {
    let clients: Vec<_> = (0..2).map(|i| CpuRuntime::client(i).unwrap()).collect();
    common::high_priority_world_gives_the_same_bits(&clients);
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
    assert_eq!(buckets[0].params(), [n - 1, n - 2]);
    assert_eq!(ddp.places(n - 2)[0].offset, 64, "the weight's place is aligned after the bias's 64 floats");
}

#[test]
fn split_parameters_on_four_cpu_devices_give_the_same_bits_as_whole_ones() {
    common::split_scenarios(&group(4), common::SplitBits::Same);
}

#[test]
fn split_parameters_on_one_device_give_the_same_bits_as_whole_ones() {
    common::split_scenarios(&group(1), common::SplitBits::Same);
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
    // Reported twice in one backward pass.
    ddp.ready(3).unwrap();
    let msg = ddp.ready(3).unwrap_err().to_string();
    assert!(msg.contains("twice") && msg.contains("layers.1.bias"), "{msg}");
    // The failed passes are forgotten: a whole backward after zero_grad
    // finishes, every bucket all-reduced once.
    ddp.zero_grad().unwrap();
    for i in 0..s.params.len() {
        ddp.ready(i).unwrap();
    }
    ddp.finish().unwrap();
    assert_eq!(ddp.works().len(), ddp.buckets().len());
    ddp.wait().unwrap();
    // Bad caps are refused.
    let zero = DdpOptions { bucket_cap_bytes: 0, ..DdpOptions::default() };
    assert!(DistributedDataParallel::new(&world, &s.params, zero).is_err());
    // A reference that is not DDP at all still works with the same model.
    LocalGradients::new(&s.params).unwrap();
    world.sync().unwrap();
}

#[test]
fn careless_inputs_get_errors_that_name_the_problem() {
    use cohort_runtime::Client;
    use cohort_train::nn::{Mlp, MlpConfig, Parameter, Sgd, TeacherData};
    let world = group(2);
    let clients: Vec<Client> = world.clients().to_vec();
    let msg = |r: Result<Mlp, cohort_comm::Error>| r.err().expect("refused").to_string();
    assert!(msg(Mlp::new(&clients, MlpConfig { width: 0, depth: 2 }, 4, 1)).contains("width 0"));
    assert!(msg(Mlp::new(&clients, MlpConfig { width: 1 << 20, depth: 2 }, 4, 1)).contains("2^31"));
    assert!(msg(Mlp::new(&clients, MlpConfig { width: 8, depth: 2 }, 0, 1)).contains("0 rows"));
    let mut model = Mlp::new(&clients, MlpConfig { width: 8, depth: 2 }, 4, 1).unwrap();
    let params = model.parameters();
    for (lr, momentum) in [(f32::NAN, 0.9), (-1.0, 0.9), (0.1, 1.0)] {
        let err = Sgd::new(&params, lr, momentum).err().expect("refused").to_string();
        assert!(err.contains("lr") && err.contains("momentum"), "{err}");
    }
    // Backward before forward, then a forward of the wrong size.
    let mut grads = LocalGradients::new(&params).unwrap();
    let targets = world.zeros::<f32>(32).unwrap();
    let err = model.backward(&targets, 0, &mut grads).unwrap_err().to_string();
    assert!(err.contains("backward before forward"), "{err}");
    let err = model.forward(&world.zeros::<f32>(31).unwrap()).unwrap_err().to_string();
    assert!(err.contains("4 × 8") && err.contains("31"), "{err}");
    // A batch the members cannot split.
    let config = MlpConfig { width: 8, depth: 2 };
    let err = TeacherData::new(&clients[0], &clients, 0, 2, config, 1, 5, 1).err().expect("refused").to_string();
    assert!(err.contains("5 rows") && err.contains("2 members"), "{err}");
    // Both replicas of a parameter on device 0 of a two-device world.
    let misplaced = Parameter {
        name: "layers.0.weight".into(),
        shape: vec![2, 2],
        replicas: vec![params[0].replicas[0].slice(0..4).unwrap(), params[0].replicas[0].slice(4..8).unwrap()],
    };
    let err = DistributedDataParallel::new(&world, &[misplaced], DdpOptions::default()).err().expect("refused");
    assert!(err.to_string().contains("layers.0.weight") && err.to_string().contains("replica 1"), "{err}");
}

#[test]
fn finish_after_a_no_sync_backward_keeps_the_local_sums_with_a_hook() {
    use cohort_train::ddp::CommHook;
    use cohort_train::nn::Gradients;
    let world = group(2);
    let mut s = common::setup(&world, 1).unwrap();
    let options = DdpOptions { hook: CommHook::Bf16Compress, ..common::small_buckets() };
    let mut ddp = DistributedDataParallel::new(&world, &s.params, options).unwrap();
    let mut local = LocalGradients::new(&s.params).unwrap();
    s.model.forward(&s.data.inputs[0]).unwrap();
    s.model.backward(&s.data.targets[0], 0, &mut local).unwrap();
    s.model.forward(&s.data.inputs[0]).unwrap();
    ddp.no_sync(|ddp| s.model.backward(&s.data.targets[0], 0, ddp)).unwrap();
    ddp.finish().unwrap();
    for i in 0..s.params.len() {
        for r in 0..2 {
            let (got, want) = (ddp.gradient_to_vec(i, r).unwrap(), local.gradient_to_vec(i, r).unwrap());
            assert!(got == want, "parameter {i}, replica {r}: a no_sync gradient changed at finish");
        }
    }
}

/// A sink that cuts a weight's gradient mid-row: backward refuses it,
/// naming the parameter and the rows it needs, instead of writing the
/// wrong elements.
#[test]
fn a_sink_that_cuts_a_gradient_mid_row_is_refused() {
    use cohort_comm::Buffer;
    use cohort_train::nn::{GradientPiece, Gradients};
    struct MidRow(Vec<Vec<GradientPiece>>);
    impl Gradients for MidRow {
        fn pieces(&self, index: usize) -> &[GradientPiece] {
            &self.0[index]
        }
    }
    impl GradientSink for MidRow {
        fn ready(&mut self, _index: usize) -> Result<(), cohort_comm::Error> {
            Ok(())
        }
        fn ready_piece(&mut self, _index: usize, _piece: usize) -> Result<(), cohort_comm::Error> {
            Ok(())
        }
    }
    let world = group(1);
    let mut s = common::setup(&world, 1).unwrap();
    let zeros = |p: &cohort_train::nn::Parameter, len: usize| -> Vec<Buffer<f32>> {
        p.replicas.iter().map(|r| Buffer::zeros(r.client(), len).unwrap()).collect()
    };
    let mut pieces: Vec<Vec<GradientPiece>> =
        s.params.iter().map(|p| vec![GradientPiece { range: 0..p.numel(), replicas: zeros(p, p.numel()) }]).collect();
    // Layer 0's weight (64 × 64) cut after 100 elements: not a whole row.
    let w = &s.params[0];
    pieces[0] = vec![
        GradientPiece { range: 0..100, replicas: zeros(w, 100) },
        GradientPiece { range: 100..w.numel(), replicas: zeros(w, w.numel() - 100) },
    ];
    let mut sink = MidRow(pieces);
    s.model.forward(&s.data.inputs[0]).unwrap();
    let err = s.model.backward(&s.data.targets[0], 0, &mut sink).unwrap_err().to_string();
    assert!(err.contains("parameter 0") && err.contains("0..100") && err.contains("whole rows of 64"), "{err}");
}
