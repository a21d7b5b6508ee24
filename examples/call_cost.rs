//! What one small call costs cohort itself, on CPU devices (no GPU needed):
//! heap allocations per call (every thread's, counted by this binary's
//! allocator) and wall time per call, for a one-device and a two-device
//! `ClientGroup` all-reduce of 8 floats (waited on, and queued back to
//! back: then the time is the caller's thread's alone), a kernel launch
//! enqueue, and a 4-byte read round trip. Where a CUDA device and NCCL
//! are found, the same for a one-device `ClientGroup` all-reduce through a
//! one-rank NCCL communicator (`COHORT_NCCL_SINGLE=1`), waited on and
//! queued back to back (then one sync per 100 calls), and the round trip
//! of an empty task to the CUDA device thread and back (the hand-over
//! alone, which a small call on an idle device skips); beside them, raw
//! NCCL's all-reduce of the same size through cudarc, waited on (with
//! `cuStreamSynchronize`, and spinning on `cuStreamQuery` as cohort's
//! waiters do) and queued back to back, and what cohort adds to each:
//! raw and cohort alternate over seven rounds, and the medians of the
//! rounds are compared; and a one-rank `Communicator` over that device.
//! Built with `--features stage-clock`, it also prints where a NCCL call's
//! time goes on the caller's thread, stage by stage (`cohort::runtime::stages`).
//! Foreign memory (section `foreign`): the same small all-reduce on a
//! cohort buffer and on memory the caller owns, wrapped per call, rounds
//! alternating, medians compared (the goal: wrapping plus ordering
//! adds at most 0.5 µs a call): on one CPU device a `Vec` wrapped per call
//! (`Buffer::from_host_ptr` + call + drop, and `Buffer::with_borrowed`);
//! where a CUDA device and NCCL are found, a one-rank NCCL all-reduce on
//! cudarc allocations ordered on a cudarc stream (`OnStream`: cohort's
//! part runs on that stream itself, bound once), wrapped per call
//! (`Buffer::from_device_ptr`) and wrapped once (the ordering alone), and
//! the bandwidth of a 256 MiB all-reduce on cudarc memory, wrapped per
//! call and once, against a cohort buffer's (goal: at least 0.99×).
//! Run it under `perf stat -e task-clock,context-switches` for context
//! switches per call and under `perf record -e cpu-clock` for where the
//! time goes, where perf is allowed.
//!
//! Run: `cargo run --release --example call_cost -- [CALLS] [SECTION] [BYTES]`,
//! SECTION being one of `group`, `communicator`, `launch`, `read`, `nccl`,
//! `foreign` and `peer` (a two-member one-shot all-reduce over two CUDA devices, or
//! two shown on one GPU with `COHORT_CUDA_DEVICES=2`) to run only those rows (under `valgrind --tool=callgrind`, the
//! instructions of one kind of call); BYTES the size of the NCCL rows'
//! all-reduce (32 by default).

use std::time::Instant;

use cohort::comm::{Buffer, ClientGroup, Collectives, ReduceOp, Work};
use cohort::runtime::conformance::{kernels, CountingAllocator};
use cohort::runtime::stages::{self, Stage};
use cohort::runtime::{Bytes, Client, GridCount, KernelArguments, Scalar};

#[path = "support/bench.rs"]
mod bench;
#[cfg(feature = "cuda")]
#[path = "support/raw_nccl.rs"]
mod raw_nccl;
use bench::median;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Runs `call` `calls` times after a warm-up; prints and returns µs per
/// call (and prints allocations per call).
fn measure(what: &str, calls: usize, call: impl FnMut()) -> f64 {
    measure_batches(what, calls, 1, call)
}

/// Runs `batch`, which makes `per` calls, `batches` times after a warm-up;
/// prints and returns µs per call (and prints allocations per call).
fn measure_batches(what: &str, batches: usize, per: usize, mut batch: impl FnMut()) -> f64 {
    measure_queued(what, batches, per, || {
        let start = Instant::now();
        batch();
        start.elapsed()
    })
}

/// Runs `batch` (which queues `per` calls and returns the time it took
/// to queue them, its wait not counted) `batches` times after a warm-up;
/// prints and returns the caller's µs per call (and prints the
/// allocations per call: every thread's, the waits' included).
fn measure_queued(what: &str, batches: usize, per: usize, mut batch: impl FnMut() -> std::time::Duration) -> f64 {
    for _ in 0..batches / 10 + 1 {
        batch();
    }
    let before = CountingAllocator::count();
    let queued: std::time::Duration = (0..batches).map(|_| batch()).sum();
    let allocations = CountingAllocator::count() - before;
    let calls = (batches * per) as f64;
    let micros = queued.as_secs_f64() * 1e6 / calls;
    println!("{what:<44} {micros:>8.2} µs/call {:>7.1} allocations/call", allocations as f64 / calls);
    micros
}

/// Rounds of the NCCL rows: raw NCCL and cohort alternate, round after
/// round, so a drift of the machine (clocks, other load) reaches both; the
/// medians of the rounds are compared.
const NCCL_ROUNDS: usize = 7;

/// A one-device all-reduce through a one-rank NCCL communicator, waited on
/// and queued back to back, where a CUDA device and NCCL are found; raw
/// NCCL's beside it, alternating round by round.
fn nccl_all_reduce(calls: usize, bytes: usize) {
    let clients = match cohort::runtime::clients_of("cuda", Some(1)) {
        Ok(clients) => clients,
        Err(why) => return println!("# no CUDA device, NCCL rows skipped: {why}"),
    };
    let group = ClientGroup::new(clients.clone()).expect("group");
    if group.transport() != cohort::comm::Transport::Nccl {
        return println!("# NCCL rows skipped: the group's transport is {:?}", group.transport());
    }
    // The hand-over alone: an empty task sent to the device thread and its
    // answer sent back (`exclusive` always runs there), with the wake-up
    // of each side that sleeps.
    measure("empty task round trip, CUDA device thread", calls.min(2000), || {
        clients[0].exclusive(|| ()).expect("exclusive")
    });
    #[cfg(feature = "cuda")]
    let raw = raw_nccl::Raw::new(1, bytes, false).map_err(|why| println!("# raw NCCL rows skipped: {why}")).ok();
    // Out of place, as raw NCCL's calls: a one-rank NCCL all-reduce in
    // place moves no bytes at all, one out of place copies them.
    let floats = (bytes / 4).max(1);
    let src: Vec<Buffer<f32>> =
        clients.iter().map(|c| Buffer::from_slice(c, &vec![1.0; floats]).expect("buffer")).collect();
    let dst: Vec<Buffer<f32>> =
        clients.iter().map(|c| Buffer::from_slice(c, &vec![0.0; floats]).expect("buffer")).collect();
    let call = || group.all_reduce(&src, &dst, ReduceOp::Sum).expect("all_reduce");
    // A one-rank Communicator over the same device (a job's rank with one
    // GPU; a store served in this process).
    let server = cohort::comm::store::StoreServer::bind("127.0.0.1:0", "call_cost").expect("store");
    let addr = server.local_addr().to_string();
    let comm =
        cohort::comm::Communicator::connect(0, 1, &addr, "call_cost", vec![clients[0].clone()]).expect("connect");
    let rank_call = || comm.all_reduce(&src[..1], &dst[..1], ReduceOp::Sum).expect("all_reduce");
    // A waited call may cost a millisecond: at most 2,000 per round.
    let per_round = (calls / NCCL_ROUNDS).clamp(100, 2000);
    let (mut waited, mut queued) = (Vec::new(), Vec::new());
    let (mut rank_waited, mut rank_queued) = (Vec::new(), Vec::new());
    #[cfg(feature = "cuda")]
    let (mut raw_waited, mut raw_queued) = (Vec::new(), Vec::new());
    for round in 1..=NCCL_ROUNDS {
        println!("# round {round} of {NCCL_ROUNDS}");
        #[cfg(feature = "cuda")]
        if let Some(raw) = raw.as_ref() {
            let (w, q) = raw_nccl_rows(raw, per_round, bytes);
            raw_waited.push(w);
            raw_queued.push(q);
        }
        let what = &format!("all_reduce {bytes} B, 1 CUDA device (NCCL)");
        let (w, q) = waited_and_queued(what, per_round, call, || group.sync().expect("sync"));
        waited.push(w);
        queued.push(q);
        let what = &format!("all_reduce {bytes} B, 1-rank Communicator (NCCL)");
        let (w, q) = waited_and_queued(what, per_round, rank_call, || comm.sync().expect("sync"));
        rank_waited.push(w);
        rank_queued.push(q);
    }
    if cohort::runtime::stages::ENABLED {
        stage_tables("1 CUDA device (NCCL), ", per_round as u64, call, || group.sync().expect("sync"));
        // The device thread's side of the queued calls: its clock started
        // and stopped by tasks it runs itself; the caller's is off.
        stages::reset();
        clients[0].exclusive(stages::start).expect("exclusive");
        for _ in 0..(per_round / 100).max(1) {
            hundred_then(call, || group.sync().expect("sync"));
        }
        clients[0].exclusive(stages::stop).expect("exclusive");
        println!("stages on the device thread, the same queued calls:");
        print!("{}", stages::table(((per_round / 100).max(1) * 100) as u64));
        // The same two tables for the one-rank Communicator's calls.
        let what = "1 CUDA device (NCCL), 1-rank Communicator, ";
        stage_tables(what, per_round as u64, rank_call, || comm.sync().expect("sync"));
    }
    assert_eq!(dst[0].to_vec().expect("read"), vec![1.0; floats], "one rank's sum is its source");
    let (waited, queued) = (median(&mut waited), median(&mut queued));
    println!("cohort, median of {NCCL_ROUNDS} rounds: waited {waited:.2} µs, queued {queued:.2} µs");
    let (rank_waited, rank_queued) = (median(&mut rank_waited), median(&mut rank_queued));
    let what = "1-rank Communicator, median of";
    println!("{what} {NCCL_ROUNDS} rounds: waited {rank_waited:.2} µs, queued {rank_queued:.2} µs");
    #[cfg(feature = "cuda")]
    if !raw_waited.is_empty() {
        let (best, raw_queued) = (median(&mut raw_waited), median(&mut raw_queued));
        println!("raw NCCL, median of {NCCL_ROUNDS} rounds: waited {best:.2} µs, queued {raw_queued:.2} µs");
        println!("cohort adds, waited: {:.2} µs ({:.2}× raw)", waited - best, waited / best);
        println!("cohort adds, queued: {:.2} µs ({:.2}× raw)", queued - raw_queued, queued / raw_queued);
        let (w, q) = (rank_waited - best, rank_queued - raw_queued);
        println!("a 1-rank Communicator adds: waited {w:.2} µs, queued {q:.2} µs");
    }
}

/// A two-member all-reduce on the one-shot peer kernel over the first two
/// CUDA devices (two GPUs, or two devices shown on one GPU with
/// `COHORT_CUDA_DEVICES=2`), waited on and queued back to back over
/// seven rounds; with the stage clock, where its time goes on the caller's
/// thread and on the members' device threads. No raw baseline: the kernels
/// are cohort's own (and NCCL refuses two ranks on one GPU).
fn peer_all_reduce(calls: usize, bytes: usize) {
    use cohort::comm::{op::Op, Algo, DType, Path};
    let clients = match cohort::runtime::clients_of("cuda", Some(2)) {
        Ok(clients) => clients,
        Err(why) => return println!("# fewer than two CUDA devices, peer rows skipped: {why}"),
    };
    let group = ClientGroup::new(clients.clone()).expect("group").with_algo(Algo::OneShot);
    let floats = (bytes / 4).max(1);
    let path = group.path_of(&Op::all_reduce(DType::F32, ReduceOp::Sum, floats));
    if path != Some(Path::OneShot) {
        return println!("# peer rows skipped: a {bytes} B all-reduce takes the path {path:?}");
    }
    let src: Vec<Buffer<f32>> =
        clients.iter().map(|c| Buffer::from_slice(c, &vec![1.0; floats]).expect("buffer")).collect();
    let dst: Vec<Buffer<f32>> =
        clients.iter().map(|c| Buffer::from_slice(c, &vec![0.0; floats]).expect("buffer")).collect();
    let call = || group.all_reduce(&src, &dst, ReduceOp::Sum).expect("all_reduce");
    let sync = || group.sync().expect("sync");
    let per_round = (calls / NCCL_ROUNDS).clamp(100, 2000);
    let (mut waited, mut queued) = (Vec::new(), Vec::new());
    let gpus: Vec<String> = clients.iter().map(|c| format!("{:?}", c.properties().gpu)).collect();
    let what = format!("all_reduce {bytes} B, 2 CUDA devices (GPUs {}), one-shot", gpus.join(", "));
    for round in 1..=NCCL_ROUNDS {
        println!("# round {round} of {NCCL_ROUNDS}");
        let (w, q) = waited_and_queued(&what, per_round, call, sync);
        waited.push(w);
        queued.push(q);
    }
    let (waited, queued) = (median(&mut waited), median(&mut queued));
    println!("2 members one-shot, median of {NCCL_ROUNDS} rounds: waited {waited:.2} µs, queued {queued:.2} µs");
    if stages::ENABLED {
        stage_tables("2 CUDA devices, one-shot, ", per_round as u64, call, sync);
        // Both device threads' side of the queued calls, summed: per call,
        // each stage's time on the two threads together.
        stages::reset();
        for client in &clients {
            client.exclusive(stages::start).expect("exclusive");
        }
        for _ in 0..(per_round / 100).max(1) {
            hundred_then(call, sync);
        }
        for client in &clients {
            client.exclusive(stages::stop).expect("exclusive");
        }
        println!("stages on the two device threads together, the same queued calls:");
        print!("{}", stages::table(((per_round / 100).max(1) * 100) as u64));
    }
    for d in &dst {
        assert_eq!(d.to_vec().expect("read"), vec![2.0; floats], "two members' sum");
    }
}

/// `call` waited on `calls` times, then queued back to back 100 at a time
/// with `sync` after each hundred (timed too); prints both rows (`what`,
/// wait / queued) and returns their µs per call.
fn waited_and_queued(what: &str, calls: usize, call: impl Fn() -> Work, sync: impl Fn()) -> (f64, f64) {
    let waited = measure(&format!("{what}, wait"), calls, || call().wait().expect("wait"));
    let what = format!("{what}, queued (sync per 100)");
    let queued = measure_batches(&what, (calls / 100).max(1), 100, || hundred_then(&call, &sync));
    (waited, queued)
}

/// Queues `call` 100 times back to back, then runs `sync`.
fn hundred_then<R>(call: impl Fn() -> R, sync: impl Fn()) {
    for _ in 0..100 {
        call();
    }
    sync();
}

/// Runs `call` `calls` times with this thread's stage clock on (see
/// `cohort::runtime::stages`; the `stage-clock` feature) and prints where
/// each call's time went, stage by stage.
/// `between(i)` runs after call `i`, untimed.
fn stage_table(what: &str, calls: u64, mut call: impl FnMut(), mut between: impl FnMut(u64)) {
    stages::reset();
    for i in 0..calls {
        stages::start();
        call();
        stages::stop();
        between(i);
    }
    println!("stages of the all-reduce, {what}:");
    print!("{}", stages::table(calls));
}

/// The stage tables of `call` waited on, and queued back to back with
/// `sync` (untimed) after every hundred and at the end; `what` begins each
/// table's title.
fn stage_tables(what: &str, calls: u64, call: impl Fn() -> Work, sync: impl Fn()) {
    let waited = || {
        let work = call();
        stages::mark(Stage::Returned);
        work.wait().expect("wait");
        stages::mark(Stage::Waited);
    };
    stage_table(&format!("{what}waited"), calls, waited, |_| {});
    let queued = || {
        call();
        stages::mark(Stage::Returned);
    };
    let every_hundred = |i| {
        if i % 100 == 99 {
            sync();
        }
    };
    stage_table(&format!("{what}queued (a sync per 100 calls, untimed)"), calls, queued, every_hundred);
    sync();
}

/// Raw NCCL's one-rank all-reduce of 32 B (sum, out of place, as cohort's
/// calls), waited on both ways and queued back to back;
/// returns the better wait and the queued time, µs per call.
#[cfg(feature = "cuda")]
fn raw_nccl_rows(raw: &raw_nccl::Raw, calls: usize, bytes: usize) -> (f64, f64) {
    use cohort::comm::op::Collective::AllReduce;
    let once = |spin: bool| {
        raw.queue(AllReduce, bytes).expect("raw all-reduce");
        raw.sync(spin).expect("raw sync");
    };
    let synced = measure(&format!("raw NCCL all_reduce {bytes} B, wait (synchronize)"), calls, || once(false));
    let spun = measure(&format!("raw NCCL all_reduce {bytes} B, wait (query spin)"), calls, || once(true));
    let what = &format!("raw NCCL all_reduce {bytes} B, queued (sync per 100)");
    let queued = measure_batches(what, (calls / 100).max(1), 100, || {
        for _ in 0..100 {
            raw.queue(AllReduce, bytes).expect("raw all-reduce");
        }
        raw.sync(false).expect("raw sync");
    });
    (synced.min(spun), queued)
}

fn all_reduce(clients: &[Client], calls: usize) {
    let group = ClientGroup::new(clients.to_vec()).expect("group");
    let bufs: Vec<Buffer<f32>> = clients.iter().map(|c| Buffer::from_slice(c, &[1.0; 8]).expect("buffer")).collect();
    let what = format!("all_reduce 32 B, {} CPU device(s), wait", clients.len());
    measure(&what, calls, || group.all_reduce(&bufs, &bufs, ReduceOp::Max).expect("all_reduce").wait().expect("wait"));
    // The caller's thread alone: 100 calls queued back to back, timed
    // without the sync that follows them.
    let what = format!("all_reduce 32 B, {} CPU device(s), queued", clients.len());
    measure_queued(&what, (calls / 100).max(1), 100, || {
        let start = Instant::now();
        for _ in 0..100 {
            group.all_reduce(&bufs, &bufs, ReduceOp::Max).expect("all_reduce");
        }
        let queued = start.elapsed();
        group.sync().expect("sync");
        queued
    });
    for b in &bufs {
        assert_eq!(b.to_vec().expect("read"), [1.0; 8], "max of ones is one");
    }
}

/// The same all-reduce through a one-rank `Communicator` over one CPU
/// device (the path of a job's rank; a store served in this process).
fn communicator_all_reduce(client: &Client, calls: usize) {
    let server = cohort::comm::store::StoreServer::bind("127.0.0.1:0", "call_cost").expect("store");
    let addr = server.local_addr().to_string();
    let comm = cohort::comm::Communicator::connect(0, 1, &addr, "call_cost", vec![client.clone()]).expect("connect");
    let bufs = vec![Buffer::from_slice(client, &[1.0f32; 8]).expect("buffer")];
    let call = || comm.all_reduce(&bufs, &bufs, ReduceOp::Max).expect("all_reduce");
    measure("all_reduce 32 B, 1-rank Communicator, wait", calls, || call().wait().expect("wait"));
    measure_queued("all_reduce 32 B, 1-rank Communicator, queued", (calls / 100).max(1), 100, || {
        let start = Instant::now();
        for _ in 0..100 {
            call();
        }
        let queued = start.elapsed();
        comm.sync().expect("sync");
        queued
    });
    assert_eq!(bufs[0].to_vec().expect("read"), [1.0; 8], "max of ones is one");
}

/// What wrapping memory the caller owns adds to a call: `ours` (a cohort
/// buffer) and `theirs` (each variant of foreign memory, by name) measured
/// in alternating rounds by `round`, which returns one µs value each;
/// prints the medians, the µs added and the ratio.
fn foreign_medians(what: &str, names: &[&str], mut round: impl FnMut() -> Vec<f64>) {
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for r in 1..=NCCL_ROUNDS {
        println!("# round {r} of {NCCL_ROUNDS}");
        for (values, us) in rounds.iter_mut().zip(round()) {
            values.push(us);
        }
    }
    let medians: Vec<f64> = rounds.iter_mut().map(|v| median(v)).collect();
    println!("{what}, median of {NCCL_ROUNDS} rounds: {} {:.2} µs", names[0], medians[0]);
    for (name, m) in names.iter().zip(&medians).skip(1) {
        println!("  {name}: {m:.2} µs, adds {:.2} µs ({:.3}× cohort's buffer)", m - medians[0], m / medians[0]);
    }
}

/// A one-device all-reduce of 8 floats on a cohort buffer, and on a `Vec`
/// of the caller's wrapped per call: by `Buffer::from_host_ptr` (adopt,
/// call, wait, drop the wrapper) and by `Buffer::with_borrowed` (the same,
/// and the borrow's end: a revoke).
fn foreign_host(client: &Client, calls: usize) {
    let group = ClientGroup::new(vec![client.clone()]).expect("group");
    let ours = [Buffer::from_slice(client, &[1.0f32; 8]).expect("buffer")];
    let (mut raw, mut lent) = (vec![1.0f32; 8], vec![1.0f32; 8]);
    let raw_ptr = raw.as_mut_ptr();
    let per_round = (calls / NCCL_ROUNDS).max(100);
    let what = "all_reduce 32 B, 1 CPU device, wait";
    let names = ["cohort's buffer", "a Vec wrapped per call (from_host_ptr)", "a Vec lent per call (with_borrowed)"];
    foreign_medians(what, &names, || {
        let own = measure(&format!("{what}, {}", names[0]), per_round, || {
            group.all_reduce(&ours, &ours, ReduceOp::Max).expect("all_reduce").wait().expect("wait")
        });
        let wrapped = measure(&format!("{what}, {}", names[1]), per_round, || {
            // SAFETY: `raw` outlives every call (each is waited for) and
            // nothing else touches it meanwhile.
            let b = [unsafe { Buffer::from_host_ptr(client, raw_ptr, 8, ()) }.expect("wrap")];
            group.all_reduce(&b, &b, ReduceOp::Max).expect("all_reduce").wait().expect("wait");
        });
        let borrowed = measure(&format!("{what}, {}", names[2]), per_round, || {
            Buffer::with_borrowed(client, &mut lent, |b| {
                let b = std::slice::from_ref(b);
                group.all_reduce(b, b, ReduceOp::Max).expect("all_reduce").wait().expect("wait")
            })
            .expect("lend")
        });
        vec![own, wrapped, borrowed]
    });
    group.sync().expect("sync");
    assert_eq!((raw.clone(), lent), (vec![1.0; 8], vec![1.0; 8]), "max of ones is one");
    drop(raw);
}

/// One GPU, a one-rank NCCL all-reduce (out of place, as the `nccl` rows)
/// of `bytes`: on cohort buffers (this thread's stream, cohort's own), and
/// on cudarc allocations ordered on a cudarc stream (`OnStream`, through
/// a client pinned to a stream of its own, which the first call binds to
/// the cudarc stream), wrapped per call (`Buffer::from_device_ptr`) and
/// wrapped once, waited on and queued back to back; then the bandwidth of
/// a 256 MiB all-reduce on each, 20 calls a round.
#[cfg(feature = "cuda")]
fn foreign_nccl(calls: usize, bytes: usize) {
    use cohort::comm::OnStream;
    use cohort::runtime::backend::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
    use cohort::runtime::{CudaRuntime, ExternalStream, Runtime, StreamId};

    if let Err(why) = CudaRuntime::device_count() {
        return println!("# no CUDA device, foreign NCCL rows skipped: {why}");
    }
    let ctx = CudaContext::new(0).expect("cudarc's primary context");
    let client = CudaRuntime::client_for_context(&ctx).expect("cohort's client on it");
    let group = ClientGroup::new(vec![client.clone()]).expect("group");
    if group.transport() != cohort::comm::Transport::Nccl {
        return println!("# foreign NCCL rows skipped: the group's transport is {:?}", group.transport());
    }
    // The foreign rows' stream is bound to the caller's by `OnStream`; the
    // baseline's stays cohort's own.
    let theirs_client = client.with_stream(StreamId::fresh());
    let theirs_group = ClientGroup::new(vec![theirs_client.clone()]).expect("group");
    let stream = ctx.new_stream().expect("a cudarc stream");
    let on_stream = OnStream::new(&theirs_group, &[ExternalStream::from_cudarc(&stream)]).expect("on stream");
    let address = |s: &CudaSlice<f32>, stream: &CudaStream| s.device_ptr(stream).0;
    // Cohort's buffers and the caller's allocations of `floats` each.
    let setup = |floats: usize| {
        let ours =
            [vec![1.0f32; floats], vec![0.0f32; floats]].map(|v| [Buffer::from_slice(&client, &v).expect("buffer")]);
        let theirs =
            [stream.clone_htod(&vec![1.0f32; floats]).expect("alloc"), stream.alloc_zeros(floats).expect("alloc")];
        stream.synchronize().expect("sync");
        (ours, theirs)
    };
    // SAFETY (both): the allocations outlive every call: they are dropped
    // after the final syncs below.
    let wrap = |ptrs: [u64; 2], floats: usize| {
        ptrs.map(|p| [unsafe { Buffer::<f32>::from_device_ptr(&theirs_client, p, floats, ()) }.expect("wrap")])
    };
    let wrapped = |ptrs: [u64; 2], floats: usize| {
        let [s, d] = wrap(ptrs, floats);
        on_stream.all_reduce(&s, &d, ReduceOp::Sum).expect("all_reduce")
    };
    let sync_all = || {
        group.sync().expect("sync");
        theirs_group.sync().expect("sync");
        stream.synchronize().expect("stream sync");
    };

    let floats = (bytes / 4).max(1);
    let (ours, theirs) = setup(floats);
    let ptrs = [address(&theirs[0], &stream), address(&theirs[1], &stream)];
    let once = wrap(ptrs, floats);
    let own_call = || group.all_reduce(&ours[0], &ours[1], ReduceOp::Sum).expect("all_reduce");
    let per_call = || wrapped(ptrs, floats);
    let once_call = || on_stream.all_reduce(&once[0], &once[1], ReduceOp::Sum).expect("all_reduce");
    let per_round = (calls / NCCL_ROUNDS).clamp(100, 2000);
    let what = format!("all_reduce {bytes} B, 1 CUDA device (NCCL)");
    let names = [
        "cohort's buffer",
        "cudarc memory wrapped per call, on its stream (OnStream)",
        "cudarc memory wrapped once, on its stream (OnStream)",
    ];
    let calls: [&dyn Fn() -> Work; 3] = [&own_call, &per_call, &once_call];
    let mut queued = Vec::new();
    foreign_medians(&format!("{what}, wait"), &names, || {
        let rows: Vec<(f64, f64)> = names
            .iter()
            .zip(calls)
            .map(|(name, call)| waited_and_queued(&format!("{what}, {name}"), per_round, call, sync_all))
            .collect();
        queued.push(rows.iter().map(|r| r.1).collect::<Vec<f64>>());
        rows.iter().map(|r| r.0).collect()
    });
    let mut q: Vec<Vec<f64>> = (0..names.len()).map(|i| queued.iter().map(|r| r[i]).collect()).collect();
    let q: Vec<f64> = q.iter_mut().map(|v| median(v)).collect();
    println!("{what}, queued, median of {NCCL_ROUNDS} rounds: cohort's buffer {:.2} µs", q[0]);
    for (name, fq) in names.iter().zip(&q).skip(1) {
        println!("  {name}: {fq:.2} µs, adds {:.2} µs ({:.3}× cohort's buffer)", fq - q[0], fq / q[0]);
    }
    sync_all();
    assert_eq!(stream.clone_dtoh(&theirs[1]).expect("read"), vec![1.0; floats], "one rank's sum is its source");
    drop(once);
    drop((ours, theirs));

    // Bandwidth: 256 MiB, 20 calls queued back to back, then the syncs.
    let big = 256 << 20;
    let floats = big / 4;
    let (ours, theirs) = setup(floats);
    let ptrs = [address(&theirs[0], &stream), address(&theirs[1], &stream)];
    let once = wrap(ptrs, floats);
    let gbps = |call: &dyn Fn() -> Work| {
        let start = Instant::now();
        for _ in 0..20 {
            call();
        }
        sync_all();
        (20 * big) as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let own_call = || group.all_reduce(&ours[0], &ours[1], ReduceOp::Sum).expect("all_reduce");
    let per_call = || wrapped(ptrs, floats);
    let once_call = || on_stream.all_reduce(&once[0], &once[1], ReduceOp::Sum).expect("all_reduce");
    let calls: [&dyn Fn() -> Work; 3] = [&own_call, &per_call, &once_call];
    let mut bw: [Vec<f64>; 3] = Default::default();
    for call in calls {
        gbps(call);
    }
    for round in 1..=NCCL_ROUNDS {
        for (values, call) in bw.iter_mut().zip(calls) {
            values.push(gbps(call));
        }
        let [a, b, c] = [0, 1, 2].map(|i| bw[i][round - 1]);
        println!(
            "# round {round}: all_reduce 256 MiB, cohort's buffer {a:.1} GB/s, cudarc memory wrapped per call {b:.1} \
             GB/s, wrapped once {c:.1} GB/s"
        );
    }
    let [own, per, once_bw] = bw.map(|mut v| median(&mut v));
    println!("all_reduce 256 MiB, 1 CUDA device (NCCL), median of {NCCL_ROUNDS} rounds: cohort's buffer {own:.1} GB/s");
    for (name, value) in names.iter().skip(1).zip([per, once_bw]) {
        println!("  {name}: {value:.1} GB/s ({:.3}× cohort's buffer)", value / own);
    }
    drop(once);
    drop((ours, theirs));
}

fn main() {
    let calls: usize = std::env::args().nth(1).map_or(20_000, |n| n.parse().expect("CALLS is a count"));
    let only = std::env::args().nth(2);
    let sections = ["group", "communicator", "launch", "read", "nccl", "foreign", "peer"];
    if let Some(only) = only.as_deref().filter(|o| !sections.contains(o)) {
        eprintln!("call_cost: no section {only:?}; the sections are {}", sections.join(", "));
        std::process::exit(2);
    }
    let wanted = |section: &str| only.as_deref().is_none_or(|o| o == section);
    std::env::set_var(cohort::runtime::config::CPU_DEVICES.name, "2");
    std::env::set_var(cohort::runtime::config::NCCL_SINGLE.name, "1");
    let clients = cohort::runtime::clients_of("cpu", Some(2)).expect("two CPU devices");
    println!("# cohort call_cost: {calls} calls each, CPU backend");
    if wanted("group") {
        all_reduce(&clients[..1], calls);
        all_reduce(&clients, calls);
    }
    if wanted("communicator") {
        communicator_all_reduce(&clients[0], calls);
    }
    let client = &clients[0];
    if wanted("launch") {
        let scale = kernels::scale();
        let x = client.create(Bytes::from_elems(&[1.0f32; 8]));
        measure("launch enqueue (scale, 8 floats)", calls, || {
            let args = KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0));
            client.launch(&scale, GridCount::Static(1, 1, 1), args).expect("launch")
        });
        client.sync().expect("sync");
    }
    if wanted("read") {
        let four = client.create(Bytes::from_elems(&[7u32]));
        measure("read_one 4 B", calls, || {
            let bytes = client.read_one(four.clone()).expect("read");
            assert_eq!(bytes.len(), 4);
        });
    }
    if wanted("nccl") {
        // The NCCL rows' size: 32 B unless a third argument says.
        let bytes = std::env::args().nth(3).map_or(32, |b| b.parse().expect("BYTES is a count"));
        nccl_all_reduce(calls, bytes);
    }
    if wanted("foreign") {
        foreign_host(&clients[0], calls);
        #[cfg(feature = "cuda")]
        {
            let bytes = std::env::args().nth(3).map_or(32, |b| b.parse().expect("BYTES is a count"));
            foreign_nccl(calls, bytes);
        }
    }
    if wanted("peer") {
        let bytes = std::env::args().nth(3).map_or(32, |b| b.parse().expect("BYTES is a count"));
        peer_all_reduce(calls, bytes);
    }
}
