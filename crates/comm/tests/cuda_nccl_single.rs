//! The NCCL path on one device: `COHORT_NCCL_SINGLE=1` sends a group of one
//! device through a one-rank NCCL communicator instead of device copies,
//! which proves every NCCL call of every collective on a one-GPU machine.

mod common;
mod cuda_common;

use std::sync::Once;

use cohort_comm::op::Collective;
use cohort_comm::{ClientGroup, DType, ReduceOp, Transport};
use cohort_runtime::{Bytes, Client, GridCount, Kernel, KernelArguments};

fn one_rank_group() -> ClientGroup {
    static FORCE: Once = Once::new();
    // Set before the first group reads it (every test calls this first).
    FORCE.call_once(|| std::env::set_var("COHORT_NCCL_SINGLE", "1"));
    let device = cuda_common::devices().remove(0);
    if let Err(why) = cohort_runtime::backend::cuda::nccl_version() {
        panic!("this test needs libnccl: {why}");
    }
    let group = ClientGroup::new(vec![device]).unwrap();
    assert_eq!(group.transport(), Transport::Nccl);
    group
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_one_rank_communicator_runs_every_collective_and_type() {
    let group = one_rank_group();
    cuda_common::matrix(&group, &[0, 1, 37, 65_539]);
    cuda_common::check(&group, Collective::AllReduce, DType::BF16, ReduceOp::Avg, 8 << 20, true);
    cuda_common::one_gib(&group);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_poisoned_input_marks_the_destination_without_reaching_nccl() {
    let group = one_rank_group();
    let device = group.client(0).clone();
    let src = device.create(Bytes::from(vec![1u8; 256]));
    let dst = device.create(Bytes::from(vec![0u8; 256]));
    let boom = Kernel::new("boom").with_cpu(|_| {});
    let _ = device.launch(&boom, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src));
    group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    let err = device.read_one(dst).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("boom"), "{err}");
    // The communicator still works.
    let fresh = device.create(Bytes::from(vec![2u8; 256]));
    let out = device.empty(256);
    group
        .all_reduce_handles(std::slice::from_ref(&fresh), std::slice::from_ref(&out), DType::U8, ReduceOp::Sum)
        .unwrap();
    assert!(device.read_one(out).unwrap().iter().all(|&b| b == 2));
    group.barrier().unwrap();
}

/// Queues a one-thread kernel on `device` that spins for the nanoseconds
/// it is given.
fn busy_on(device: &Client) -> impl Fn(u64) + '_ {
    let flag = device.create(Bytes::from(vec![0u8; 4]));
    move |ns| {
        device
            .launch(
                &busy_kernel(),
                GridCount::Static(1, 1, 1),
                KernelArguments::new().buffer(&flag).scalar(cohort_runtime::Scalar::U64(ns)),
            )
            .unwrap()
    }
}

/// A kernel that keeps its stream busy for `ns` nanoseconds (the device's
/// global timer), then writes 1 into its buffer.
fn busy_kernel() -> Kernel {
    Kernel::new("busy").with_cuda(
        r#"extern "C" __global__ void busy(unsigned int* flag, unsigned long long len, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    if (len >= 4) flag[0] = 1;
}"#,
    )
}

/// A collective's task returns once its NCCL call is queued (the device
/// thread does not wait for the kernel before it), the result is right when read, and a collective
/// that stays queued past the group's timeout is aborted by the device's
/// own polling: its destination carries the timeout, and a later group
/// over the device works again.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn collectives_return_once_queued_and_an_expired_one_marks_its_destination() {
    use std::time::{Duration, Instant};

    let group = one_rank_group().with_timeout(Duration::from_millis(400));
    let device = group.client(0).clone();
    let busy = busy_on(&device);
    // Warm up: the kernel compiles and the communicator is created.
    busy(1_000);
    let src = device.create(Bytes::from_elems(&[3.0f32; 1024]));
    let dst = device.empty(4096);
    group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    device.sync().unwrap();

    // Queued behind 3 s of device work, in a group whose timeout is far
    // longer: returns, completes, right. A round trip to the device thread
    // right after is answered before that work could have ended (the
    // device's own 3 s are the measure, not a guess at host speed): had the
    // collective's task waited for its kernel, the answer would come after.
    let patient = ClientGroup::new(vec![device.clone()]).unwrap().with_timeout(Duration::from_secs(60));
    let kernel_time = Duration::from_secs(3);
    let started = Instant::now();
    busy(kernel_time.as_nanos() as u64);
    patient
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    device.stats().unwrap();
    let answered = started.elapsed();
    assert!(answered < kernel_time, "the device thread answered after {answered:?}: it waited for the collective");
    assert_eq!(device.read_one(dst.clone()).unwrap().to_elems::<f32>(), vec![3.0; 1024]);

    // Queued behind 2 s of device work with a 0.4 s timeout: the device
    // aborts it while it waits, and the destination says so.
    busy(2_000_000_000);
    let out = device.empty(4096);
    group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&out), DType::F32, ReduceOp::Sum)
        .unwrap();
    let err = device.read_one(out).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("within 0.4 s"), "{err}");
    device.sync().unwrap();

    // The aborted communicator is forgotten: a new group makes a fresh one.
    let again = ClientGroup::new(vec![device.clone()]).unwrap();
    let fresh = device.empty(4096);
    again
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&fresh), DType::F32, ReduceOp::Sum)
        .unwrap();
    assert_eq!(device.read_one(fresh).unwrap().to_elems::<f32>(), vec![3.0; 1024]);
}

/// Groups on two streams of one device share its communicator; their parts
/// still run in the order they were queued (a part from the other stream
/// first waits for the previous one), and each stream sees its own results.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn parts_from_two_streams_run_in_queue_order() {
    use cohort_runtime::StreamId;

    let first = one_rank_group();
    let device = first.client(0).clone();
    let (a, b) = (device.with_stream(StreamId::fresh()), device.with_stream(StreamId::fresh()));
    let (on_a, on_b) = (ClientGroup::new(vec![a.clone()]).unwrap(), ClientGroup::new(vec![b.clone()]).unwrap());
    let mut expected = Vec::new();
    let mut outputs = Vec::new();
    for round in 0..50u32 {
        let (client, group) = if round % 2 == 0 { (&a, &on_a) } else { (&b, &on_b) };
        let src = client.create(Bytes::from_elems(&vec![round; 4096]));
        let dst = client.empty(4096 * 4);
        group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U32, ReduceOp::Max)
            .unwrap();
        expected.push(round);
        outputs.push((client.clone(), dst));
    }
    for ((client, dst), want) in outputs.into_iter().zip(expected) {
        assert_eq!(client.read_one(dst).unwrap().to_elems::<u32>(), vec![want; 4096]);
    }
}

/// Collectives queued back to back on one stream get no event each: the
/// device records one after the last of them when it runs out of work.
/// Every handle still ends, whichever order they are waited on in, and
/// every result is right.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn back_to_back_collectives_on_one_stream_all_end() {
    let group = one_rank_group();
    let device = group.client(0).clone();
    let (mut works, mut outputs) = (Vec::new(), Vec::new());
    for round in 0..100u32 {
        let src = device.create(Bytes::from_elems(&[round; 64]));
        let dst = device.empty(256);
        let work = group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U32, ReduceOp::Sum)
            .unwrap();
        works.push(work);
        outputs.push((round, dst));
    }
    for work in works.iter().rev() {
        work.wait().unwrap();
    }
    assert!(works.iter().all(|w| w.is_done()));
    for (round, dst) in outputs {
        assert_eq!(device.read_one(dst).unwrap().to_elems::<u32>(), vec![round; 64]);
    }
}

/// `NCCL_COMM_BLOCKING=0` in the environment asks NCCL for non-blocking
/// communicators: the calls work as on a blocking one (a creation that
/// answers "in progress" is waited for, up to the timeout; NCCL 2.28.3
/// answered at once for this one-rank communicator). NCCL reads the
/// variable once per process: a child process runs the calls.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_non_blocking_communicator_asked_for_by_the_environment_works() {
    const NAME: &str = "a_non_blocking_communicator_asked_for_by_the_environment_works";
    if std::env::var_os("COHORT_TEST_NON_BLOCKING_CHILD").is_some() {
        let group = one_rank_group();
        let device = group.client(0).clone();
        for round in 0..20u32 {
            let src = device.create(Bytes::from_elems(&[round; 64]));
            let dst = device.empty(256);
            group
                .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U32, ReduceOp::Max)
                .unwrap_or_else(|e| panic!("round {round}: {e}"))
                .wait()
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(device.read_one(dst).unwrap().to_elems::<u32>(), vec![round; 64], "round {round}");
        }
        println!("CHILD OK");
        return;
    }
    let envs = [("NCCL_COMM_BLOCKING", "0".into()), ("COHORT_TEST_NON_BLOCKING_CHILD", "1".into())];
    let (ok, text) = cuda_common::finish(cuda_common::rerun(NAME, &envs));
    assert!(ok && text.contains("CHILD OK"), "{text}");
}

/// A collective followed on its stream by other work ends when its own
/// calls do: before a kernel that runs longer than the group's timeout (it
/// is not timed out), and before a capture begins there (its end is not
/// recorded into the graph).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_collective_ends_on_its_own_before_the_work_queued_behind_it() {
    use cohort_runtime::StreamId;
    use std::time::Duration;

    let device = one_rank_group().client(0).with_stream(StreamId::fresh());
    let group = ClientGroup::new(vec![device.clone()]).unwrap().with_timeout(Duration::from_millis(400));
    let busy = busy_on(&device);
    busy(1_000);
    let src = device.create(Bytes::from_elems(&[5.0f32; 256]));
    let all_reduce = |dst: &cohort_runtime::Handle| {
        group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(dst), DType::F32, ReduceOp::Sum)
            .unwrap()
    };

    // 2 s of work behind it, five times its timeout.
    let dst = device.empty(1024);
    all_reduce(&dst);
    busy(2_000_000_000);
    assert_eq!(device.read_one(dst).unwrap().to_elems::<f32>(), vec![5.0; 256]);

    // A capture begun on its stream right after it.
    let out = device.empty(1024);
    let work = all_reduce(&out);
    device.start_capture().unwrap();
    busy(1_000);
    let graph = device.stop_capture().unwrap();
    work.wait().unwrap();
    graph.replay().unwrap();
    assert_eq!(device.read_one(out).unwrap().to_elems::<f32>(), vec![5.0; 256]);
}

/// On an idle device, a one-device group's NCCL collective is queued by the
/// caller's thread itself (the device counts it), its handle still ends
/// (the device thread is woken to poll it) and its result is right; behind
/// a task the device thread is still running it is queued there instead,
/// and runs after that task.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_collective_on_an_idle_device_is_queued_by_the_callers_thread() {
    use cohort_runtime::StreamId;

    let device = one_rank_group().client(0).with_stream(StreamId::fresh());
    let group = ClientGroup::new(vec![device.clone()]).unwrap();
    let host: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5 - 7.0).collect();
    let src = device.create(Bytes::from_elems(&host));
    let ran_inline = || device.stats().unwrap().inline_tasks;
    // The device thread lets go of its state a moment after it answered the
    // last round trip: a few tries.
    let inline = (0..50).any(|round| {
        let dst = device.empty(4096);
        device.sync().unwrap();
        let before = ran_inline();
        let work = group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Max)
            .unwrap();
        let counted = ran_inline() > before;
        work.wait().unwrap();
        assert_eq!(device.read_one(dst).unwrap().to_elems::<f32>(), host, "round {round}");
        counted
    });
    assert!(inline, "a one-rank all-reduce on an idle device never ran on the caller's thread");

    // Waited on at once, many times: each handle ends.
    waited_sums(&group, &device, 200);

    // Behind a held task: queued, and run after it.
    let dst = device.empty(4096);
    let before = ran_inline();
    let release = common::hold(&device);
    let work = group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    assert!(!work.is_done(), "the device is held: the collective cannot have run");
    release.send(()).unwrap();
    work.wait().unwrap();
    assert_eq!(ran_inline(), before, "the collective behind the held task ran inline");
    assert_eq!(device.read_one(dst).unwrap().to_elems::<f32>(), host);

    // A barrier waits for the device's work: never on the caller's thread,
    // which would hold the device and the process-wide enqueue order while
    // it waits.
    for _ in 0..20 {
        device.sync().unwrap();
        let before = ran_inline();
        group.barrier().unwrap();
        assert_eq!(ran_inline(), before, "a barrier ran on the caller's thread");
    }
}

/// A waiter can learn that a running collective ended from a host word the
/// device writes behind it: asked for while the collective waits behind
/// 200 ms of device work, the word is written only after that work, the
/// poll that follows ends the collective (its handle is done, without
/// waiting) with the right result; waited calls, which read such words,
/// all end right.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_waiter_learns_a_collective_ended_from_a_host_word_the_device_writes() {
    use std::time::{Duration, Instant};

    let group = one_rank_group();
    let device = group.client(0).clone();
    let busy = busy_on(&device);
    busy(1_000);
    let src = device.create(Bytes::from_elems(&[7.5f32; 256]));
    let all_reduce = |dst: &cohort_runtime::Handle| {
        group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(dst), DType::F32, ReduceOp::Sum)
            .unwrap()
    };
    // Warm: the communicator exists.
    all_reduce(&device.empty(1024)).wait().unwrap();

    let dst = device.empty(1024);
    let queued = Instant::now();
    busy(200_000_000);
    let work = all_reduce(&dst);
    // The device thread may hold the device for a moment (its own poll).
    let asked = Instant::now();
    let signal = loop {
        if let Some(signal) = device.poll_collectives_signal() {
            break signal;
        }
        assert!(asked.elapsed() < Duration::from_secs(5), "no signal while the collective runs");
    };
    assert!(!work.is_done() && !signal.reached(), "the collective ended before the work ahead of it: {signal:?}");
    while !signal.reached() {
        assert!(queued.elapsed() < Duration::from_secs(20), "the word was never written");
        std::hint::spin_loop();
    }
    let written = queued.elapsed();
    assert!(written >= Duration::from_millis(195), "written after {written:?}, before the 200 ms ahead of it ended");
    while !work.is_done() {
        device.poll_collectives();
        assert!(queued.elapsed() < Duration::from_secs(20), "the written word did not end the collective");
    }
    work.wait().unwrap();
    assert_eq!(device.read_one(dst).unwrap().to_elems::<f32>(), vec![7.5; 256]);

    // Many waited calls, each through its word where the waiter got one.
    waited_sums(&group, &device, 200);
}

/// `rounds` all-reduces of `group` on `device`, each waited on at once:
/// each handle ends, with the right sum.
fn waited_sums(group: &ClientGroup, device: &Client, rounds: u32) {
    for round in 0..rounds {
        let src = device.create(Bytes::from_elems(&[round; 8]));
        let dst = device.empty(32);
        group
            .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U32, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(device.read_one(dst).unwrap().to_elems::<u32>(), vec![round; 8], "round {round}");
    }
}

/// A one-device collective held up behind its device's work: a bounded
/// wait ends at its bound naming the member not finished, the collective
/// goes on and a later wait sees it end; its flight record stays open until
/// then and ends completed, on the NCCL path.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_bounded_wait_on_a_held_up_collective_names_its_member_and_a_later_wait_ends_it() {
    use cohort_comm::trace::{FlightRecorder, RecordState};
    use cohort_runtime::StreamId;
    use std::time::{Duration, Instant};

    let device = one_rank_group().client(0).with_stream(StreamId::fresh());
    let group = ClientGroup::new(vec![device.clone()]).unwrap();
    let src = device.create(Bytes::from_elems(&[2.5f32; 64]));
    let dst = device.empty(256);
    let record_of = |seq: u64| {
        let name = format!("group[{}]", device.device_id());
        FlightRecorder::global()
            .snapshot()
            .into_iter()
            .rev()
            .find(|r| r.group == name && r.fingerprint.seq == seq && r.fingerprint.kind == "all_reduce")
            .unwrap_or_else(|| panic!("{name} recorded its all_reduce {seq}"))
    };
    let release = common::hold(&device);
    let work = group
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .unwrap();
    let name = format!("group[{}]", device.device_id());
    let records = FlightRecorder::global().snapshot();
    let seq = records.iter().rev().find(|r| r.group == name).expect("the all_reduce was recorded").fingerprint.seq;
    let started = Instant::now();
    let err = work.wait_timeout(Duration::from_millis(300)).unwrap_err().to_string();
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "waited {waited:?}");
    let member = format!("member 0 ({}) not finished", device.device_id());
    assert!(err.contains("all_reduce has not finished within 300 ms") && err.contains(&member), "{err}");
    assert!(!work.is_done());
    assert_eq!(record_of(seq).state, RecordState::Started, "the record ends with the collective");
    release.send(()).unwrap();
    work.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(work.is_done());
    assert_eq!(device.read_one(dst).unwrap().to_elems::<f32>(), vec![2.5; 64]);
    let record = record_of(seq);
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.path.as_deref(), Some("nccl"));
}

/// Threads calling one-device collectives at once on one device (each on
/// its own stream, so with no order between them; no process-wide lock is
/// taken for a part that waits for no other device): every handle ends and
/// every result is right, whichever thread queued first.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn threads_calling_one_device_collectives_at_once_all_end_right() {
    let device = one_rank_group().client(0).clone();
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let device = device.clone();
            std::thread::spawn(move || {
                let group = ClientGroup::new(vec![device.clone()]).unwrap();
                for round in 0..200u32 {
                    let value = t * 1000 + round;
                    let src = device.create(Bytes::from_elems(&[value; 16]));
                    let dst = device.empty(64);
                    let work = group
                        .all_reduce_handles(
                            std::slice::from_ref(&src),
                            std::slice::from_ref(&dst),
                            DType::U32,
                            ReduceOp::Max,
                        )
                        .unwrap();
                    if round % 2 == 0 {
                        work.wait_timeout(std::time::Duration::from_secs(30)).unwrap();
                    }
                    assert_eq!(device.read_one(dst).unwrap().to_elems::<u32>(), vec![value; 16], "thread {t}");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

/// One thread loops two-device all-reduces over GPUs 0 and 1 (parts that
/// wait for each other, queued under the process-wide order) while another
/// loops one-device collectives on GPU 0 (no order taken): neither waits
/// for the other forever, whatever order GPU 0 sees them in, and every
/// result is right.
#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_one_device_collectives_beside_two_device_ones_never_deadlock() {
    use std::time::Duration;

    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    let _ = one_rank_group();
    let pair = ClientGroup::new(devices[..2].to_vec()).unwrap().with_timeout(Duration::from_secs(60));
    let solo = ClientGroup::new(vec![devices[0].clone()]).unwrap().with_timeout(Duration::from_secs(60));
    let both = std::thread::spawn(move || {
        for round in 0..300u32 {
            let srcs: Vec<_> =
                (0..2).map(|m| pair.client(m).create(Bytes::from_elems(&[round + m as u32; 8]))).collect();
            let dsts: Vec<_> = (0..2).map(|m| pair.client(m).empty(32)).collect();
            pair.all_reduce_handles(&srcs, &dsts, DType::U32, ReduceOp::Sum)
                .unwrap()
                .wait_timeout(Duration::from_secs(30))
                .unwrap();
            for (m, dst) in dsts.into_iter().enumerate() {
                assert_eq!(pair.client(m).read_one(dst).unwrap().to_elems::<u32>(), vec![2 * round + 1; 8]);
            }
        }
    });
    let device = solo.client(0).clone();
    for round in 0..300u32 {
        let src = device.create(Bytes::from_elems(&[round; 8]));
        let dst = device.empty(32);
        solo.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U32, ReduceOp::Max)
            .unwrap()
            .wait_timeout(Duration::from_secs(30))
            .unwrap();
        assert_eq!(device.read_one(dst).unwrap().to_elems::<u32>(), vec![round; 8]);
    }
    both.join().unwrap();
}
