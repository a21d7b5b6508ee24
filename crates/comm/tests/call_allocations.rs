//! Heap allocations per small collective, counted by this binary's own
//! allocator: what a call costs beside its bytes. One test only, so no
//! other test's allocations are counted with it. CPU devices: the layers
//! above the backend are the same code on every device kind.

use cohort_comm::trace::{FlightRecorder, RecordState};
use cohort_comm::{Buffer, ClientGroup, Collectives, ReduceOp};
use cohort_runtime::conformance::{kernels, CountingAllocator};
use cohort_runtime::{Bytes, CpuRuntime, GridCount, KernelArguments, Runtime, Scalar};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Allocations per call of `call`, made `calls` times after as many to
/// warm up (the flight recorder's ring fills in the warm-up).
fn per_call(calls: u64, mut call: impl FnMut()) -> f64 {
    for _ in 0..calls {
        call();
    }
    let before = CountingAllocator::count();
    for _ in 0..calls {
        call();
    }
    (CountingAllocator::count() - before) as f64 / calls as f64
}

#[test]
fn small_calls_allocate_a_few_times_and_their_flight_records_nothing() {
    // A small ring, so the warm-up fills it and every counted call pushes
    // the oldest record out.
    std::env::set_var("COHORT_FLIGHT_RECORDER", "64");
    std::env::set_var("COHORT_CPU_DEVICES", "2");
    let clients: Vec<_> = (0..2).map(|i| CpuRuntime::client(i).unwrap()).collect();

    // One device: the call's collective and its watch (two `Arc`s). The
    // flight record used to allocate five times more (its strings, the
    // group's name and the rank list): 7.0 per call.
    let one = ClientGroup::new(clients[..1].to_vec()).unwrap();
    let buf = vec![Buffer::from_slice(&clients[0], &[1.0f32; 8]).unwrap()];
    let allocations = per_call(1000, || one.all_reduce(&buf, &buf, ReduceOp::Max).unwrap().wait().unwrap());
    assert!(allocations <= 2.05, "{allocations} allocations per one-device all-reduce (expected 2)");

    // Two devices: each part's boxed task on top (9.1 per call before).
    let two = ClientGroup::new(clients.clone()).unwrap();
    let bufs: Vec<_> = clients.iter().map(|c| Buffer::from_slice(c, &[1.0f32; 8]).unwrap()).collect();
    let allocations = per_call(500, || two.all_reduce(&bufs, &bufs, ReduceOp::Max).unwrap().wait().unwrap());
    assert!(allocations <= 4.5, "{allocations} allocations per two-device all-reduce (expected about 4)");
    assert_eq!(bufs[1].to_vec().unwrap(), [1.0; 8], "max of ones is one");

    // A kernel launch: its arguments are kept inline (3.0 per launch when
    // they were two vectors).
    let scale = kernels::scale();
    let x = clients[0].create(Bytes::from_elems(&[1.0f32; 8]));
    let mut launched = 0;
    let launch = || {
        let args = KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0));
        clients[0].launch(&scale, GridCount::Static(1, 1, 1), args).unwrap();
        // The device thread's share is counted too: every 100 launches
        // the count waits for them.
        launched += 1;
        if launched % 100 == 0 {
            clients[0].sync().unwrap();
        }
    };
    let allocations = per_call(1000, launch);
    assert!(allocations <= 1.2, "{allocations} allocations per launch (expected 1)");

    // What the ring kept reads back whole.
    let records = FlightRecorder::global().snapshot();
    assert_eq!(records.len(), 64, "the ring keeps COHORT_FLIGHT_RECORDER records");
    let last = records.last().unwrap();
    assert_eq!((&*last.fingerprint.kind, last.fingerprint.op.as_deref()), ("all_reduce", Some("max")));
    assert_eq!((&*last.fingerprint.dtype, last.fingerprint.count), ("f32", 8));
    assert_eq!(last.state, RecordState::Completed);
    assert_eq!(last.ranks, Some(vec![FlightRecorder::global().identity().0]), "a process-local group names this rank");
    assert!(last.group.starts_with("group[cpu"), "{}", last.group);

    // A job's rank (a one-rank Communicator over one device, its store in
    // this process): the meeting, its plan, the watch, the part's boxed
    // task and the device thread's hand-over (22.1 per call before its
    // per-slot and per-call lists were made inline).
    let server = cohort_comm::store::StoreServer::bind("127.0.0.1:0", "allocations").unwrap();
    let addr = server.local_addr().to_string();
    let comm = cohort_comm::Communicator::connect(0, 1, &addr, "allocations", vec![clients[1].clone()]).unwrap();
    let allocations = per_call(500, || comm.all_reduce(&bufs[1..], &bufs[1..], ReduceOp::Max).unwrap().wait().unwrap());
    assert!(allocations <= 5.5, "{allocations} allocations per one-rank Communicator all-reduce (expected about 5)");
    assert_eq!(bufs[1].to_vec().unwrap(), [1.0; 8], "max of ones is one");

    let last = FlightRecorder::global().snapshot().pop().unwrap();
    assert_eq!((last.ranks, &*last.fingerprint.kind), (None, "all_reduce"), "a job's communicator is every rank");
    assert!(last.group.starts_with("comm"), "{}", last.group);
}
