//! The Communicator's NCCL path. Everywhere: a CPU communicator never
//! probes NCCL (its ranks say why in the store) and a CUDA client without a
//! driver is an error, never a panic. On CUDA GPUs (ignored elsewhere):
//! one rank per GPU or every GPU in one rank, every collective checked
//! against the host reference, and a rank that never arrives named by the
//! timeout. The ranks are threads of this process, each with its own
//! devices (NCCL refuses two ranks on one GPU). Tests named `two_gpus_*` /
//! `four_gpus_*` need that many and fail with that message on fewer;
//! `scripts/gpu-bundle.sh`'s runner skips them there.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use cohort_comm::op::Collective;
use cohort_comm::store::{StoreClient, StoreServer};
use cohort_comm::verify::{count_wrong, expected, pattern};
use cohort_comm::{Communicator, DType, ReduceOp, Transport};
use cohort_runtime::{Client, CpuRuntime, CudaRuntime, Handle, Runtime};

const SECRET: &str = "nccl-test-secret";

/// Runs `body(comm)` on one thread per entry of `devices` (rank r brings
/// `devices[r]`, opened on its thread) over a fresh store; returns the
/// results and the store's address.
fn ranks<T: Send + 'static>(
    devices: Vec<Vec<usize>>,
    open: fn(usize) -> Client,
    body: fn(Communicator) -> T,
) -> (Vec<T>, StoreServer) {
    let server = StoreServer::bind("127.0.0.1:0", SECRET).unwrap();
    let addr = server.local_addr().to_string();
    let n = devices.len();
    let handles: Vec<_> = devices
        .into_iter()
        .enumerate()
        .map(|(rank, mine)| {
            let addr = addr.clone();
            thread::spawn(move || {
                let clients = mine.into_iter().map(open).collect();
                body(Communicator::connect(rank, n, &addr, SECRET, clients).unwrap())
            })
        })
        .collect();
    (handles.into_iter().map(|h| h.join().unwrap()).collect(), server)
}

fn cpu(index: usize) -> Client {
    CpuRuntime::client(index).unwrap()
}

fn cuda(index: usize) -> Client {
    CudaRuntime::client(index).unwrap_or_else(|e| panic!("this test needs CUDA GPUs: {e}"))
}

fn gpus() -> usize {
    CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs CUDA GPUs: {e}"))
}

#[test]
fn a_cpu_communicator_never_takes_nccl() {
    std::env::set_var("COHORT_CPU_DEVICES", "8");
    let (results, server) = ranks(vec![vec![6], vec![7]], cpu, |comm| {
        let c = &comm.clients()[0];
        let buf = c.create_from_slice(bytemuck::cast_slice(&[1.0f32; 64]));
        let one = std::slice::from_ref(&buf);
        comm.all_reduce_handles(one, one, DType::F32, ReduceOp::Sum).unwrap();
        let sum: Vec<f32> = bytemuck::cast_slice(&c.read_one(buf).unwrap()).to_vec();
        (comm.transport(), sum.iter().all(|&v| v == 2.0))
    });
    for (transport, ok) in results {
        assert_eq!(transport, Transport::HostDirect);
        assert!(ok);
    }
    // Each rank refused by the devices' capabilities, before probing any
    // library.
    let store = StoreClient::connect(server.local_addr(), SECRET, Duration::from_secs(5)).unwrap();
    for rank in 0..2 {
        let said = store.get(&format!("cohort/comm/1/nccl/can/{rank}")).unwrap().unwrap_or_default();
        assert_eq!(String::from_utf8_lossy(&said), "no its devices run on cpu, which offers no device collectives");
    }
}

#[test]
fn a_cuda_communicator_without_a_driver_is_an_error_not_a_panic() {
    match CudaRuntime::client(0) {
        Err(err) => {
            let text = err.to_string();
            assert!(text.to_lowercase().contains("cuda"), "the error names CUDA: {text}");
        }
        // A GPU host: a one-rank communicator forms and says how it runs.
        Ok(client) => {
            let server = StoreServer::bind("127.0.0.1:0", SECRET).unwrap();
            let addr = server.local_addr().to_string();
            let comm = Communicator::connect(0, 1, &addr, SECRET, vec![client]).unwrap();
            assert!(matches!(comm.transport(), Transport::Nccl | Transport::HostStaged));
        }
    }
}

/// One collective over every member, checked against the host reference.
fn check(comm: &Communicator, op: Collective, dtype: DType, rop: ReduceOp, elems: usize, root: usize) {
    let (l, m, rank) = (comm.local_devices(), comm.members(), comm.rank());
    let block = elems * dtype.size();
    let blocked = |o: Collective| matches!(o, Collective::ReduceScatter | Collective::AllToAll);
    let in_len = if blocked(op) || op == Collective::Scatter { m * block } else { block };
    let out_len = match op {
        Collective::AllGather | Collective::AllToAll | Collective::Gather => m * block,
        _ => block,
    };
    let inputs: Vec<Vec<u8>> = (0..m).map(|member| pattern(dtype, member, in_len)).collect();
    let me = |slot: usize| rank * l + slot;
    let clients = comm.clients();
    let src: Vec<Handle> = (0..l).map(|s| clients[s].create_from_slice(&inputs[me(s)])).collect();
    let dst: Vec<Handle> = (0..l).map(|s| clients[s].empty(out_len)).collect();
    let root_slot = if root / l == rank { root % l } else { 0 };
    let what = format!("{op:?} {dtype} {rop} root {root} × {elems}");
    let queued = match op {
        Collective::AllReduce => comm.all_reduce_handles(&src, &dst, dtype, rop).map(drop),
        Collective::Reduce => comm.reduce_handles(&src, &dst[root_slot], dtype, rop, root).map(drop),
        Collective::Broadcast => comm.broadcast_handles(&src[root_slot], &dst, dtype, root).map(drop),
        Collective::AllGather => comm.all_gather_handles(&src, &dst, dtype).map(drop),
        Collective::ReduceScatter => comm.reduce_scatter_handles(&src, &dst, dtype, rop).map(drop),
        Collective::AllToAll => comm.all_to_all_handles(&src, &dst, dtype).map(drop),
        Collective::Gather => comm.gather_handles(&src, &dst[root_slot], dtype, root).map(drop),
        Collective::Scatter => comm.scatter_handles(&src[root_slot], &dst, dtype, root).map(drop),
        Collective::SendRecv => unreachable!("checked by `ring_of_messages`"),
        Collective::Barrier => comm.barrier(),
    };
    queued.unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = expected(op, dtype, rop, root, block, &inputs);
    for (slot, out) in dst.iter().enumerate() {
        let rooted = matches!(op, Collective::Reduce | Collective::Gather);
        if rooted && (slot != root_slot || root / l != rank) {
            continue;
        }
        let Some(w) = &want[me(slot)] else { continue };
        let got = clients[slot].read_one(out.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
        let wrong = count_wrong(dtype, op.reduces().then_some(rop), &got, w, m);
        assert_eq!(wrong, 0, "{what}: member {} got {wrong} wrong elements", me(slot));
    }
}

/// Every collective, a few types, operators, roots and sizes.
fn every_collective(comm: &Communicator) {
    let last = comm.members() - 1;
    for elems in [1, 37, 65_539] {
        for dtype in [DType::F32, DType::BF16, DType::I32] {
            for rop in ReduceOp::ALL {
                check(comm, Collective::AllReduce, dtype, rop, elems, 0);
            }
        }
        for root in [0, last] {
            for op in [Collective::Reduce, Collective::Broadcast, Collective::Gather, Collective::Scatter] {
                check(comm, op, DType::F32, ReduceOp::Sum, elems, root);
            }
        }
        for op in [Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
            check(comm, op, DType::F64, ReduceOp::Avg, elems, 0);
        }
    }
    // In place: all-reduce and all-to-all on one buffer per device.
    let bufs: Vec<Handle> =
        comm.clients().iter().map(|c| c.create_from_slice(&vec![1u8; 4 * comm.members()])).collect();
    comm.all_reduce_handles(&bufs, &bufs, DType::U8, ReduceOp::Sum).unwrap();
    comm.all_to_all_handles(&bufs, &bufs, DType::U8).unwrap();
    let got = comm.clients()[0].read_one(bufs[0].clone()).unwrap();
    assert!(got.iter().all(|&b| b as usize == comm.members()), "in place: {got:?}");
    comm.barrier().unwrap();
}

/// Rank r sends to rank r + 1 (even ranks first), one device per rank.
fn ring_of_messages(comm: &Communicator) {
    let (n, r, c) = (comm.size(), comm.rank(), &comm.clients()[0]);
    if n < 2 {
        return;
    }
    let out = c.create_from_slice(bytemuck::cast_slice(&[r as u32; 1000]));
    let into = c.empty(4000);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    if r % 2 == 0 {
        comm.send_handle(&out, next, DType::U32).unwrap();
        comm.recv_handle(&into, prev, DType::U32).unwrap();
    } else {
        comm.recv_handle(&into, prev, DType::U32).unwrap();
        comm.send_handle(&out, next, DType::U32).unwrap();
    }
    let got: Vec<u32> = bytemuck::cast_slice(&c.read_one(into).unwrap()).to_vec();
    assert!(got.iter().all(|&v| v as usize == prev));
}

#[test]
#[ignore = "needs CUDA GPUs: run with --include-ignored where one is"]
fn one_rank_on_one_gpu_runs_every_collective_through_nccl() {
    let (results, _server) = ranks(vec![vec![0]], cuda, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl, "libnccl is needed too");
        every_collective(&comm);
    });
    assert_eq!(results.len(), 1);
}

/// A one-rank job's collective on an idle GPU is queued by the caller's
/// thread itself (the device counts it) and its handle ends, waited on at
/// once round after round; one left unwaited still ends (the device thread
/// polls it: a read waits for it); behind a task the device thread is
/// still running it is queued there instead, and runs after that task.
#[test]
#[ignore = "needs CUDA GPUs: run with --include-ignored where one is"]
fn one_rank_on_one_gpu_queues_its_collectives_from_the_callers_thread() {
    let (results, _server) = ranks(vec![vec![0]], cuda, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl, "libnccl is needed too");
        let device = comm.clients()[0].clone();
        let ran_inline = || device.stats().unwrap().inline_tasks;
        let host: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5 - 7.0).collect();
        let src = device.create_from_slice(bytemuck::cast_slice(&host));
        let all_reduce = |dst: &Handle, op| {
            comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(dst), DType::F32, op)
        };
        let read = |dst: Handle| -> Vec<f32> { bytemuck::cast_slice(&device.read_one(dst).unwrap()).to_vec() };
        // The device thread lets go of its state a moment after it answered
        // the last round trip: a few tries.
        let inline = (0..50).any(|round| {
            let dst = device.empty(4096);
            device.sync().unwrap();
            let before = ran_inline();
            let work = all_reduce(&dst, ReduceOp::Max).unwrap();
            let counted = ran_inline() > before;
            work.wait().unwrap();
            assert_eq!(read(dst), host, "round {round}");
            counted
        });
        assert!(inline, "a one-rank all-reduce on an idle GPU never ran on the caller's thread");

        for round in 0..200 {
            let dst = device.empty(4096);
            all_reduce(&dst, ReduceOp::Sum).unwrap().wait().unwrap();
            assert_eq!(read(dst), host, "waited round {round}");
        }
        let dst = device.empty(4096);
        drop(all_reduce(&dst, ReduceOp::Min).unwrap());
        assert_eq!(read(dst), host, "unwaited");

        let dst = device.empty(4096);
        let before = ran_inline();
        let release = common::hold(&device);
        let work = all_reduce(&dst, ReduceOp::Sum).unwrap();
        assert!(!work.is_done(), "the device is held: the collective cannot have run");
        release.send(()).unwrap();
        work.wait().unwrap();
        assert_eq!(ran_inline(), before, "the collective behind the held task ran inline");
        assert_eq!(read(dst), host);
    });
    assert_eq!(results.len(), 1);
}

/// A one-rank job's collective whose source a failed kernel poisoned (run
/// on the caller's thread where the GPU is idle) fails, naming the
/// collective and the kernel, without reaching NCCL or hanging; the next
/// collective works.
#[test]
#[ignore = "needs CUDA GPUs: run with --include-ignored where one is"]
fn one_rank_on_one_gpu_a_poisoned_input_fails_its_collective_and_the_next_one_works() {
    use cohort_runtime::{GridCount, Kernel, KernelArguments};

    let (results, _server) = ranks(vec![vec![0]], cuda, |comm| {
        let device = comm.clients()[0].clone();
        let src = device.create_from_slice(&[1u8; 256]);
        let dst = device.create_from_slice(&[0u8; 256]);
        // A kernel with no CUDA source: its launch fails and poisons `src`.
        let boom = Kernel::new("boom").with_cpu(|_| {});
        let _ = device.launch(&boom, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src));
        let queued =
            comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum);
        let waited = queued.and_then(|work| work.wait_timeout(Duration::from_secs(60)));
        let err = match waited {
            Err(err) => err.to_string(),
            Ok(()) => device.read_one(dst).unwrap_err().to_string(),
        };
        assert!(err.contains("all_reduce") && err.contains("boom"), "{err}");
        let fresh = device.create_from_slice(&[2u8; 256]);
        let out = device.empty(256);
        comm.all_reduce_handles(std::slice::from_ref(&fresh), std::slice::from_ref(&out), DType::U8, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert!(device.read_one(out).unwrap().iter().all(|&b| b == 2));
    });
    assert_eq!(results.len(), 1);
}

/// A one-rank job's call on a device closed under it is refused at once,
/// naming the call and the device, and its flight record, dropped
/// unfinished after the call returned, publishes the abort for the other
/// ranks (naming this rank) in the store; nothing hangs or panics.
#[test]
#[ignore = "needs CUDA GPUs: run with --include-ignored where one is"]
fn one_rank_on_one_gpu_a_call_on_a_closed_device_is_refused_and_the_abort_published() {
    use cohort_comm::published::{abort_key, communicator_prefix, newest_communicator_key};

    let (results, server) = ranks(vec![vec![0]], cuda, |comm| {
        let device = comm.clients()[0].clone();
        let src = device.create_from_slice(&[1u8; 256]);
        let dst = device.empty(256);
        let all_reduce = || {
            comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U8, ReduceOp::Sum)
        };
        // Warm: the next call queues from this thread.
        all_reduce().unwrap().wait().unwrap();
        device.close();
        all_reduce().map(|_| ()).unwrap_err().to_string()
    });
    let err = &results[0];
    assert!(err.contains("all_reduce") && err.contains("could not queue") && err.contains("cuda:0"), "{err}");
    let store = StoreClient::connect(server.local_addr().to_string(), SECRET, Duration::from_secs(10)).unwrap();
    let newest = store.get(&newest_communicator_key(0)).unwrap().expect("rank 0's communicator is published");
    let instance: u64 = String::from_utf8_lossy(&newest).trim().parse().unwrap();
    let abort = store.get(&abort_key(&communicator_prefix(instance))).unwrap().expect("the abort is published");
    let abort = String::from_utf8_lossy(&abort);
    assert!(abort.contains("rank 0") && abort.contains("all_reduce"), "{abort}");
}

#[test]
#[ignore = "needs CUDA GPUs: two or more, one per rank"]
fn two_gpus_one_rank_per_gpu_runs_every_collective_through_nccl() {
    let n = gpus();
    assert!(n >= 2, "this test needs two GPUs or more, found {n}");
    ranks((0..n).map(|g| vec![g]).collect(), cuda, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl);
        every_collective(&comm);
        ring_of_messages(&comm);
    });
}

#[test]
#[ignore = "needs CUDA GPUs: four or more, two per rank"]
fn four_gpus_two_ranks_of_two_gpus_run_every_collective_through_nccl() {
    let n = gpus();
    assert!(n >= 4, "this test needs four GPUs or more, found {n}");
    ranks(vec![vec![0, 1], vec![2, 3]], cuda, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl);
        assert_eq!(comm.members(), 4);
        every_collective(&comm);
    });
}

/// A source that partly overlaps its destination (a `Communicator`
/// allows it) runs on NCCL from a device copy of the source, so its path
/// never depends on one rank's buffers: every collective of one rank gives
/// the source's values, read before anything was written.
#[test]
#[ignore = "needs CUDA GPUs: run with --include-ignored where one is"]
fn one_rank_on_one_gpu_a_source_partly_overlapping_its_destination_is_copied_first() {
    let (results, _server) = ranks(vec![vec![0]], cuda, |comm| {
        assert_eq!(comm.transport(), Transport::Nccl);
        let c = comm.clients()[0].clone();
        let values: Vec<f32> = (1..=12).map(|i| i as f32).collect();
        for (name, shift) in
            [("all_reduce", 1u64), ("all_gather", 3), ("reduce_scatter", 2), ("broadcast", 1), ("all_to_all", 4)]
        {
            let buf = c.create_from_slice(bytemuck::cast_slice(&values));
            let src = buf.slice(0, 32).unwrap();
            let dst = buf.slice(4 * shift, 32).unwrap();
            let (s, d) = (std::slice::from_ref(&src), std::slice::from_ref(&dst));
            let work = match name {
                "all_reduce" => comm.all_reduce_handles(s, d, DType::F32, ReduceOp::Sum),
                "all_gather" => comm.all_gather_handles(s, d, DType::F32),
                "reduce_scatter" => comm.reduce_scatter_handles(s, d, DType::F32, ReduceOp::Sum),
                "broadcast" => comm.broadcast_handles(&src, d, DType::F32, 0),
                _ => comm.all_to_all_handles(s, d, DType::F32),
            };
            work.unwrap_or_else(|e| panic!("{name}: {e}")).wait().unwrap_or_else(|e| panic!("{name}: {e}"));
            let got: Vec<f32> = bytemuck::cast_slice(&c.read_one(dst).unwrap()).to_vec();
            assert_eq!(got, values[..8], "{name}, destination {shift} elements into the source");
        }
    });
    assert_eq!(results.len(), 1);
}

/// Rank 0's source partly overlaps its destination, rank 1's does not:
/// both take the NCCL path (the choice follows from the call alone), and
/// the sum is right on both.
#[test]
#[ignore = "needs CUDA GPUs: two or more, one per rank"]
fn two_gpus_ranks_with_and_without_overlapping_buffers_take_one_path() {
    assert!(gpus() >= 2, "this test needs two GPUs or more");
    let (results, _server) = ranks(vec![vec![0], vec![1]], cuda, |comm| {
        let (c, rank) = (comm.clients()[0].clone(), comm.rank());
        let values = |r: usize| -> Vec<f32> { (0..12).map(|i| (r * 100 + i) as f32).collect() };
        let buf = c.create_from_slice(bytemuck::cast_slice(&values(rank)));
        let src = buf.slice(0, 32).unwrap();
        let dst = if rank == 0 { buf.slice(4, 32).unwrap() } else { c.empty(32) };
        comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let got: Vec<f32> = bytemuck::cast_slice(&c.read_one(dst).unwrap()).to_vec();
        let want: Vec<f32> = (0..8).map(|i| values(0)[i] + values(1)[i]).collect();
        assert_eq!(got, want, "rank {rank}");
    });
    assert_eq!(results.len(), 2);
}

/// One rank per GPU, on every GPU there is: after the first call (which
/// creates the NCCL communicators on the device threads) each call is
/// queued from the caller's thread with its check sent ahead (up to eight
/// ranks compare every other rank's fingerprint). Calls queued back to back
/// end right; then rank 1 calls a longer all-reduce than the others: every
/// rank names the mismatch well before the timeout (NCCL's kernels, which
/// may wait for bytes that never come, are aborted), and the next call is
/// refused.
#[test]
#[ignore = "needs CUDA GPUs: two or more, one per rank"]
fn two_gpus_a_mismatch_after_calls_queued_from_the_callers_thread_is_named_on_every_rank() {
    let n = gpus();
    assert!(n >= 2, "this test needs two GPUs or more");
    let (results, _server) = ranks((0..n).map(|g| vec![g]).collect(), cuda, |comm| {
        comm.set_timeout(Duration::from_secs(30));
        let (c, rank, n) = (&comm.clients()[0], comm.rank(), comm.size());
        let all_reduce = |src: &Handle, dst: &Handle| {
            comm.all_reduce_handles(std::slice::from_ref(src), std::slice::from_ref(dst), DType::F32, ReduceOp::Sum)
        };
        let srcs: Vec<Handle> =
            (0..100).map(|i| c.create_from_slice(bytemuck::cast_slice(&[(rank * 1000 + i) as f32; 1024]))).collect();
        let dsts: Vec<Handle> = (0..100).map(|_| c.empty(4096)).collect();
        let works: Vec<_> = srcs.iter().zip(&dsts).map(|(s, d)| all_reduce(s, d).unwrap()).collect();
        let inline = c.stats().unwrap().inline_tasks;
        for (i, (work, dst)) in works.iter().zip(dsts).enumerate() {
            work.wait().unwrap_or_else(|e| panic!("rank {rank}, call {i}: {e}"));
            let want = (1000 * n * (n - 1) / 2 + n * i) as f32;
            let got: Vec<f32> = bytemuck::cast_slice(&c.read_one(dst).unwrap()).to_vec();
            assert!(got.iter().all(|&x| x == want), "rank {rank}, call {i}: {:?}", &got[..4]);
        }
        assert!(inline > 0, "rank {rank}: no call was queued from the caller's thread");
        let bytes = if rank == 1 { 8192 } else { 4096 };
        let src = c.create_from_slice(&vec![0u8; bytes]);
        let dst = c.empty(bytes);
        let started = Instant::now();
        let work = all_reduce(&src, &dst);
        // Read before the call is waited for: the error, not the bytes.
        let read = c.read_one(dst.clone()).expect_err("the destination is marked").to_string();
        assert!(read.contains("collective mismatch"), "rank {rank}: {read}");
        let mismatch = work.and_then(|w| w.wait()).expect_err("a mismatch").to_string();
        let took = started.elapsed();
        let refused = all_reduce(&src, &dst).and_then(|w| w.wait()).expect_err("refused").to_string();
        (mismatch, took, refused)
    });
    for (rank, (mismatch, took, refused)) in results.iter().enumerate() {
        assert!(
            mismatch.contains("collective mismatch")
                && mismatch.contains("f32 × 1024")
                && mismatch.contains("f32 × 2048"),
            "rank {rank}: {mismatch}"
        );
        assert!(*took < Duration::from_secs(15), "rank {rank}: found after {took:?}: {mismatch}");
        assert!(refused.contains("aborted"), "rank {rank}: {refused}");
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more, one per rank"]
fn two_gpus_a_rank_that_never_arrives_is_named_and_the_nccl_communicator_aborted() {
    static GAVE_UP: AtomicBool = AtomicBool::new(false);
    assert!(gpus() >= 2, "this test needs two GPUs or more");
    let (results, _server) = ranks(vec![vec![0], vec![1]], cuda, |comm| {
        comm.set_timeout(Duration::from_secs(3));
        let c = &comm.clients()[0];
        let buf = c.create_from_slice(&[0u8; 4096]);
        let one = std::slice::from_ref(&buf);
        // A first collective creates the NCCL communicators.
        comm.all_reduce_handles(one, one, DType::F32, ReduceOp::Sum).unwrap();
        c.read_one(buf.clone()).unwrap();
        if comm.rank() == 1 {
            // Never calls; stays until rank 0 gave up (a bound only against
            // a hang).
            let deadline = Instant::now() + Duration::from_secs(120);
            while !GAVE_UP.load(Ordering::SeqCst) && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(10));
            }
            return None;
        }
        comm.all_reduce_handles(one, one, DType::F32, ReduceOp::Sum).unwrap();
        let err = c.read_one(buf).unwrap_err().to_string();
        GAVE_UP.store(true, Ordering::SeqCst);
        Some(err)
    });
    // Ended by rank 0's timeout while rank 1 was still there (not "went away").
    let err = results[0].clone().expect("rank 0 waited");
    assert!(err.contains("timed out") && err.contains("1 never arrived"), "{err}");
}
