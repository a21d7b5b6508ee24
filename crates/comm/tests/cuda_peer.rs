//! The peer-memory fast path on CUDA: one-shot and two-shot all-reduce and
//! the all-gather kernel give every member the host reference bit for bit,
//! for every element type and operator; the path is chosen and forced as
//! asked and recorded; a member that never arrives makes its peers give up
//! naming it; and arenas exchanged as CUDA IPC handles work across two
//! processes. GPU tests are ignored where there is none.

mod cuda_common;

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::trace::FlightRecorder;
use cohort_comm::{reduce_bytes, Algo, ClientGroup, DType, Path, ReduceOp};
use cohort_runtime::backend::{CollectiveMonitor, Completion, PeerAlgo, PeerCall, PeerSpec, PEER_MAX_BYTES};
use cohort_runtime::{
    BufferAccess, Bytes, Client, CudaRuntime, GridCount, Handle, KernelArguments, Runtime, Scalar, ServerError,
    StreamId,
};

/// Random elements of `dtype` (floats with full significands in ±4,
/// integers over their whole range), different for every seed.
fn random(dtype: DType, count: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let r = next();
        let f = ((r >> 11) as f64 / (1u64 << 53) as f64) * 8.0 - 4.0;
        match dtype {
            DType::F32 => out.extend((f as f32).to_le_bytes()),
            DType::F64 => out.extend(f.to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(f).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(f).to_le_bytes()),
            _ => out.extend(&r.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// One all-reduce through `group`, `offset` bytes into its buffers,
/// checked on every member against the host reference bit for bit.
fn all_reduce_bitwise(group: &ClientGroup, dtype: DType, op: ReduceOp, count: usize, offset: u64, in_place: bool) {
    all_reduce_at(group, dtype, op, count, &vec![offset; group.len()], in_place);
}

/// [`all_reduce_bitwise`] with member `m`'s buffers `offsets[m]` bytes in
/// (members may differ: the kernel's choice must not depend on them).
fn all_reduce_at(group: &ClientGroup, dtype: DType, op: ReduceOp, count: usize, offsets: &[u64], in_place: bool) {
    let n = group.len();
    let offset = offsets[0];
    let bytes = count * dtype.size();
    let inputs: Vec<Vec<u8>> = (0..n).map(|m| random(dtype, count, (m * 1000 + count) as u64 + offset)).collect();
    let mut want = vec![0u8; bytes];
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    reduce_bytes(dtype, op, &refs, &mut want);
    let place = |m: usize, data: Option<&[u8]>| {
        let offset = offsets[m];
        let mut padded = vec![0u8; bytes + offset as usize];
        if let Some(d) = data {
            padded[offset as usize..].copy_from_slice(d);
        }
        group.client(m).create_from_slice(&padded).slice(offset, bytes as u64).unwrap()
    };
    let src: Vec<Handle> = (0..n).map(|m| place(m, Some(&inputs[m]))).collect();
    let dst: Vec<Handle> = if in_place { src.clone() } else { (0..n).map(|m| place(m, None)).collect() };
    let what =
        format!("{:?} all_reduce {dtype} {op} count={count} offsets={offsets:?} in_place={in_place}", group.algo());
    group.all_reduce_handles(&src, &dst, dtype, op).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (m, d) in dst.iter().enumerate() {
        let got = group.client(m).read_one(d.clone()).unwrap_or_else(|e| panic!("{what}: member {m}: {e}"));
        if got[..] != want[..] {
            let at = got[..].iter().zip(&want).position(|(a, b)| a != b).unwrap() / dtype.size();
            panic!("{what}: member {m} differs from the host reference first at element {at}");
        }
    }
}

fn all_gather_bitwise(group: &ClientGroup, count: usize, offset: u64) {
    all_gather_at(group, count, &vec![offset; group.len()], &vec![0; group.len()]);
}

/// An all-gather with member `m`'s source `offsets[m]` bytes into its
/// buffer and its destination `out_offsets[m]` bytes into its own.
fn all_gather_at(group: &ClientGroup, count: usize, offsets: &[u64], out_offsets: &[u64]) {
    let n = group.len();
    let inputs: Vec<Vec<u8>> = (0..n).map(|m| random(DType::U8, count, (77 + m * 31 + count) as u64)).collect();
    let want: Vec<u8> = inputs.concat();
    let src: Vec<Handle> = (0..n)
        .map(|m| {
            let offset = offsets[m];
            let mut padded = vec![0u8; count + offset as usize];
            padded[offset as usize..].copy_from_slice(&inputs[m]);
            group.client(m).create_from_slice(&padded).slice(offset, count as u64).unwrap()
        })
        .collect();
    let dst: Vec<Handle> = (0..n)
        .map(|m| {
            let at = out_offsets[m];
            group.client(m).empty(count * n + at as usize).slice(at, (count * n) as u64).unwrap()
        })
        .collect();
    group.all_gather_handles(&src, &dst, DType::U8).unwrap();
    for (m, d) in dst.iter().enumerate() {
        let got = group.client(m).read_one(d.clone()).unwrap();
        assert!(
            got[..] == want[..],
            "all_gather of {count} bytes (offsets {offsets:?} into {out_offsets:?}): member {m} differs"
        );
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_peer_kernels_give_every_member_the_host_reference_bit_for_bit() {
    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    for n in 2..=devices.len().min(8) {
        for algo in [Algo::OneShot, Algo::TwoShot] {
            let group = ClientGroup::new(devices[..n].to_vec()).unwrap().with_algo(algo);
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let probe = cohort_comm::op::Op::all_reduce(dtype, op, 1);
                    let want = if algo == Algo::OneShot { Path::OneShot } else { Path::TwoShot };
                    assert_eq!(group.path_of(&probe), Some(want), "{n} GPUs reach each other: the kernel runs");
                    for count in [1, 7, 4099, 65536] {
                        all_reduce_bitwise(&group, dtype, op, count, 16, false);
                    }
                    all_reduce_bitwise(&group, dtype, op, 4099, 4 * dtype.size() as u64, false);
                    all_reduce_bitwise(&group, dtype, op, 1000, 16, true);
                }
            }
            // The largest call the arena takes, and the bytes beside it.
            let most = PEER_MAX_BYTES as usize / 4;
            all_reduce_bitwise(&group, DType::F32, ReduceOp::Sum, most, 16, false);
            for count in [1, 13, 4096, 1 << 20] {
                all_gather_bitwise(&group, count, 16);
                all_gather_bitwise(&group, count, 3);
            }
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_members_with_differently_aligned_buffers_agree_bit_for_bit() {
    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    for algo in [Algo::OneShot, Algo::TwoShot] {
        let group = ClientGroup::new(devices[..2].to_vec()).unwrap().with_algo(algo);
        for dtype in [DType::F32, DType::F16, DType::F64, DType::I8] {
            let size = dtype.size() as u64;
            // A size that takes the wide kernels (a multiple of 16 bytes)
            // and one that does not; member 0 aligned, member 1 not (by a
            // whole element, then inside an element).
            for count in [4096, 4099] {
                for offsets in [[16, 16 + size], [16, 2], [3, 16], [5, 7]] {
                    all_reduce_at(&group, dtype, ReduceOp::Sum, count, &offsets, false);
                    all_reduce_at(&group, dtype, ReduceOp::Max, count, &offsets, true);
                }
            }
        }
        // f32 two bytes off element alignment on both members.
        all_reduce_at(&group, DType::F32, ReduceOp::Sum, 1 << 16, &[2, 2], false);
        for count in [4096, 4099] {
            all_gather_at(&group, count, &[16, 4], &[0, 0]);
            all_gather_at(&group, count, &[1, 16], &[3, 16]);
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_the_chosen_path_runs_and_the_flight_recorder_names_it() {
    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    let group = ClientGroup::new(devices[..2].to_vec()).unwrap();
    let small = cohort_comm::op::Op::all_reduce(DType::F32, ReduceOp::Sum, 2);
    let huge = cohort_comm::op::Op::all_reduce(DType::F32, ReduceOp::Sum, 64 << 20);
    let broadcast = cohort_comm::op::Op::broadcast(DType::F32, 0, 2);
    assert_eq!(group.clone().with_algo(Algo::Auto).path_of(&huge), Some(Path::Nccl));
    assert_eq!(group.clone().with_algo(Algo::OneShot).path_of(&huge), Some(Path::Nccl), "past the arena");
    assert_eq!(group.clone().with_algo(Algo::TwoShot).path_of(&broadcast), Some(Path::Nccl), "no kernel");
    assert_eq!(group.clone().with_algo(Algo::Nccl).path_of(&small), Some(Path::Nccl));
    for (algo, path) in [(Algo::Nccl, "nccl"), (Algo::OneShot, "oneshot"), (Algo::TwoShot, "twoshot")] {
        let g = group.clone().with_algo(algo);
        all_reduce_bitwise(&g, DType::F32, ReduceOp::Sum, 2, 16, false);
        g.sync().unwrap();
        let records = FlightRecorder::global().snapshot();
        let ours = group_record_name(&g);
        let last = records
            .iter()
            .rev()
            .find(|r| r.group == ours && r.fingerprint.kind == "all_reduce")
            .unwrap_or_else(|| panic!("{ours} recorded its all_reduce"));
        assert_eq!(last.path.as_deref(), Some(path), "{algo:?}");
    }
}

/// The variables of a child of this test binary that shows `per` devices
/// on its first GPU alone, whose kernels give up after 60 s rather than the
/// default 600.
fn shown_on_one_gpu(per: usize) -> [(&'static str, String); 4] {
    [
        ("CUDA_VISIBLE_DEVICES", "0".into()),
        ("COHORT_CUDA_DEVICES", per.to_string()),
        ("COHORT_TIMEOUT", "60".into()),
        (SHOWN_CHILD, "1".into()),
    ]
}

/// Set in the children of [`shown_on_one_gpu`] (the parent may have
/// `COHORT_CUDA_DEVICES` set itself).
const SHOWN_CHILD: &str = "COHORT_TEST_SHOWN_ON_ONE_GPU";

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn the_peer_tests_of_several_gpus_pass_between_devices_shown_on_one_gpu() {
    // Each test again in a child whose devices share the first GPU: the
    // kernels' flags, arenas and meeting between device threads, on one
    // GPU. With three there the largest calls need the share of resident
    // blocks (`PeerSpec::sharing`): three members' full grids do not fit at
    // once.
    for (name, per) in [
        ("two_gpus_peer_kernels_give_every_member_the_host_reference_bit_for_bit", 3),
        ("two_gpus_members_with_differently_aligned_buffers_agree_bit_for_bit", 2),
    ] {
        let (ok, out) = cuda_common::finish(cuda_common::rerun(name, &shown_on_one_gpu(per)));
        assert!(ok, "{name} with {per} devices on one GPU failed or did not run:\n{out}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_group_of_devices_on_one_gpu_runs_the_peer_kernels_and_every_other_call_through_the_host() {
    let name = "a_group_of_devices_on_one_gpu_runs_the_peer_kernels_and_every_other_call_through_the_host";
    if std::env::var_os(SHOWN_CHILD).is_none() {
        let (ok, out) = cuda_common::finish(cuda_common::rerun(name, &shown_on_one_gpu(2)));
        assert!(ok, "the child with two devices on one GPU failed or did not run:\n{out}");
        return;
    }
    let devices = cuda_common::devices();
    let (a, b) = (devices[0].clone(), devices[1].clone());
    assert_ne!(a.device_id(), b.device_id(), "two devices");
    assert_eq!((a.properties().gpu, b.properties().gpu), (Some(0), Some(0)), "on one GPU");
    assert_eq!((a.properties().devices_on_gpu, b.properties().devices_on_gpu), (2, 2));
    assert_eq!(a.properties().name, b.properties().name);
    assert!(a.can_access_peer(&b) && b.can_access_peer(&a), "one memory");
    let group = ClientGroup::new(vec![a.clone(), b.clone()]).unwrap();
    let count = 1000;
    let x: Vec<Handle> =
        (0..2).map(|m| group.client(m).create(Bytes::from_elems(&vec![m as f32 + 1.0; count]))).collect();
    let fresh = || -> Vec<Handle> {
        (0..2).map(|m| group.client(m).create(Bytes::from_elems(&vec![-1.0f32; count]))).collect()
    };

    // The peer kernels run where the path says so.
    for (algo, path) in [(Algo::OneShot, "oneshot"), (Algo::TwoShot, "twoshot")] {
        let g = group.clone().with_algo(algo);
        let y = fresh();
        g.all_reduce_handles(&x, &y, DType::F32, ReduceOp::Sum).unwrap().wait().unwrap();
        for (m, y) in y.iter().enumerate() {
            assert_eq!(floats(g.client(m), y), vec![3.0; count], "{algo:?}, member {m}");
        }
        let last = FlightRecorder::global().snapshot().into_iter().rev().find(|r| r.group == group_record_name(&g));
        assert_eq!(last.and_then(|r| r.path).as_deref(), Some(path), "{algo:?}");
    }

    // NCCL takes one rank per GPU: whatever would run on it goes through
    // the host, with the right results.
    let y = fresh();
    group.broadcast_handles(&x[1], &y, DType::F32, 1).unwrap().wait().unwrap();
    for (m, y) in y.iter().enumerate() {
        assert_eq!(floats(group.client(m), y), vec![2.0; count], "broadcast, member {m}");
    }
    let y = fresh();
    let forced = group.clone().with_algo(Algo::Nccl);
    forced.all_reduce_handles(&x, &y, DType::F32, ReduceOp::Max).unwrap().wait().unwrap();
    assert_eq!(floats(&b, &y[1]), vec![2.0; count], "an all-reduce forced off the kernels");
    let y = fresh();
    let calls = vec![cohort_comm::GroupCall::AllReduce {
        src: x.iter().cloned().collect(),
        dst: y.iter().cloned().collect(),
        dtype: DType::F32,
        op: ReduceOp::Sum,
    }];
    group.group_handles(calls).unwrap().wait().unwrap();
    assert_eq!(floats(&a, &y[0]), vec![3.0; count], "a grouped call");
    group.barrier().unwrap();

    // A send between the two is a peer copy.
    let y = fresh();
    group.send_recv_handles(0, &x[0], 1, &y[1], DType::F32).unwrap().wait().unwrap();
    assert_eq!(floats(&b, &y[1]), vec![1.0; count], "a peer copy between the two devices");
}

/// The flight recorder's name of `group`'s records: its device set.
fn group_record_name(group: &ClientGroup) -> String {
    let mut devices: Vec<String> = (0..group.len()).map(|m| group.client(m).device_id().to_string()).collect();
    devices.sort();
    format!("group[{}]", devices.join(","))
}

/// Runs `f` on `client`'s device thread with `outputs` bound, and waits.
fn on_device<R: Send + 'static>(
    client: &Client,
    outputs: Vec<Handle>,
    f: impl FnOnce(&mut BufferAccess<'_>) -> Result<R, ServerError> + Send + 'static,
) -> Result<R, ServerError> {
    let (tx, rx) = crossbeam::channel::bounded(1);
    client
        .submit_buffers_always("peer test", Vec::new(), outputs, move |access| {
            let result = access.and_then(f);
            let failed = result.as_ref().err().cloned();
            let _ = tx.send(result);
            failed.map_or(Ok(()), Err)
        })
        .unwrap();
    rx.recv().unwrap()
}

/// A part's monitor with nobody else in the process to ask.
struct Alone(Duration);

impl CollectiveMonitor for Alone {
    fn operation(&self) -> &str {
        "all_reduce (peer test)"
    }
    fn timeout(&self) -> Duration {
        self.0
    }
    fn failed_elsewhere(&self) -> Option<ServerError> {
        None
    }
    fn missing(&self) -> String {
        "the other member".into()
    }
    fn finished(&self, _: &Result<(), ServerError>) {}
}

/// Queues rank `rank`'s part of an f32 sum over `arenas` with `data` as
/// input; returns the output handle (read it to wait).
fn try_peer_sum(
    client: &Client,
    set: u64,
    rank: usize,
    arenas: Vec<u64>,
    data: &[f32],
    timeout: Duration,
) -> Result<Handle, ServerError> {
    try_peer_sum_at(client, set, rank, arenas, data, 0, timeout)
}

/// [`try_peer_sum`] with the buffer `offset` bytes into its allocation.
fn try_peer_sum_at(
    client: &Client,
    set: u64,
    rank: usize,
    arenas: Vec<u64>,
    data: &[f32],
    offset: u64,
    timeout: Duration,
) -> Result<Handle, ServerError> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let mut padded = vec![0u8; offset as usize + bytes.len()];
    padded[offset as usize..].copy_from_slice(bytes);
    let buf = client.create_from_slice(&padded).slice(offset, bytes.len() as u64).unwrap();
    on_device(client, vec![buf.clone()], move |access| {
        let b = access.binding(0);
        let call =
            PeerCall::AllReduce { src: b, dst: b, dtype: DType::F32, op: ReduceOp::Sum, algo: PeerAlgo::OneShot };
        let spec = PeerSpec { set, rank, arenas: &arenas, sharing: 1 };
        access.run_peer_collective(&spec, &call, Arc::new(Alone(timeout)), Completion::Defer)
    })?;
    Ok(buf)
}

fn peer_sum(client: &Client, set: u64, rank: usize, arenas: Vec<u64>, data: &[f32], timeout: Duration) -> Handle {
    try_peer_sum(client, set, rank, arenas, data, timeout).unwrap()
}

fn arena(client: &Client, set: u64) -> u64 {
    on_device(client, Vec::new(), move |a| a.device_collectives().expect("CUDA").peer_arena(set)).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_peer_kernel_whose_peer_never_arrives_gives_up_at_the_timeout_naming_its_rank() {
    let client = CudaRuntime::client(0).unwrap();
    // Two ranks' arenas on one device; only rank 0 ever runs.
    let arenas = vec![arena(&client, 9_000_001), arena(&client, 9_000_002)];
    let started = Instant::now();
    let out = peer_sum(&client, 9_000_001, 0, arenas, &[1.0; 64], Duration::from_millis(500));
    let err = client.read_one(out).expect_err("the other rank never came");
    let waited = started.elapsed();
    let text = err.to_string();
    assert!(text.contains("rank 1 of the peer-memory set never arrived within 0.5 s"), "{text}");
    assert!(waited < Duration::from_secs(10), "it gave up after {waited:?}");
    // The set is refused from then on; the device itself still works.
    let again = try_peer_sum(&client, 9_000_001, 0, vec![0, 0], &[1.0; 4], Duration::from_millis(100));
    let err = again.expect_err("a failed set stays failed").to_string();
    assert!(err.contains("failed earlier"), "{err}");
    let fine = client.create_from_slice(&[7u8; 16]);
    assert_eq!(&client.read_one(fine).unwrap()[..], &[7u8; 16]);
}

/// The child half of the IPC test: opens device `COHORT_TEST_IPC_DEVICE`,
/// prints its arena's handle, reads the parent's, and runs rank 1.
fn ipc_child() {
    let device: usize = std::env::var("COHORT_TEST_IPC_DEVICE").unwrap().parse().unwrap();
    let client = CudaRuntime::client(device).unwrap();
    let set = 4242;
    let handle =
        on_device(&client, Vec::new(), move |a| a.device_collectives().unwrap().peer_arena_handle(set)).unwrap();
    let mine = arena(&client, set);
    println!("HANDLE {}", hex(&handle));
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let theirs = unhex(line.trim().strip_prefix("HANDLE ").expect("the parent's handle"));
    let opened =
        on_device(&client, Vec::new(), move |a| a.device_collectives().unwrap().peer_open(set, &theirs)).unwrap();
    let mut results = Vec::new();
    for (call, &(count, _, offset)) in IPC_CALLS.iter().enumerate() {
        let data = ipc_input(1, count);
        let out = try_peer_sum_at(&client, set, 1, vec![opened, mine], &data, offset, Duration::from_secs(20)).unwrap();
        results.push(format!("RESULT {call} {}", hex(&client.read_one(out).unwrap()[..])));
    }
    // Printed once every call ran: the parent reads them only after its
    // own calls, and a full pipe would stall this process in between.
    for line in results {
        println!("{line}");
    }
    std::io::stdout().flush().unwrap();
}

/// The IPC test's calls: element count, then the parent's and the child's
/// byte offsets. A size the wide kernel takes with the members aligned
/// differently (by whole elements, then inside an element), and a ragged
/// size: both members must run the same kernel over the same packs.
const IPC_CALLS: [(usize, u64, u64); 4] = [(4099, 0, 0), (4096, 0, 4), (4096, 16, 2), (1000, 2, 6)];

/// Rank `rank`'s input to an IPC call of `count` elements.
fn ipc_input(rank: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| if rank == 0 { (i % 5) as f32 * 0.5 } else { (i % 7) as f32 }).collect()
}

/// The sum both halves of an IPC call compute.
fn ipc_reference(count: usize) -> Vec<f32> {
    ipc_input(0, count).iter().zip(ipc_input(1, count)).map(|(a, b)| a + b).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_peer_all_reduce_runs_across_two_processes_through_ipc_handles() {
    if std::env::var_os("COHORT_TEST_IPC_DEVICE").is_some() {
        return ipc_child();
    }
    let count = CudaRuntime::device_count().unwrap();
    // Two GPUs: one each; one GPU: both processes on it.
    let child_device = if count >= 2 { 1 } else { 0 };
    let client = CudaRuntime::client(0).unwrap();
    let set = 4242;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_peer_all_reduce_runs_across_two_processes_through_ipc_handles",
            "--include-ignored",
            "--nocapture",
        ])
        .env("COHORT_TEST_IPC_DEVICE", child_device.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let theirs = loop {
        let line = lines.next().expect("the child's handle").unwrap();
        if let Some(h) = line.strip_prefix("HANDLE ") {
            break unhex(h);
        }
    };
    let handle =
        on_device(&client, Vec::new(), move |a| a.device_collectives().unwrap().peer_arena_handle(set)).unwrap();
    let mine = arena(&client, set);
    writeln!(child.stdin.as_mut().unwrap(), "HANDLE {}", hex(&handle)).unwrap();
    let opened =
        on_device(&client, Vec::new(), move |a| a.device_collectives().unwrap().peer_open(set, &theirs)).unwrap();
    for (call, &(count, offset, _)) in IPC_CALLS.iter().enumerate() {
        let data = ipc_input(0, count);
        let out = try_peer_sum_at(&client, set, 0, vec![mine, opened], &data, offset, Duration::from_secs(20)).unwrap();
        let got = client.read_one(out).unwrap();
        let want = ipc_reference(count);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&got[..]), want.as_slice(), "call {call}: rank 0 differs");
    }
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(child.wait().unwrap().success(), "the child failed: {rest:?}");
    for (call, &(count, _, _)) in IPC_CALLS.iter().enumerate() {
        let prefix = format!("RESULT {call} ");
        let theirs = rest.iter().find_map(|l| l.strip_prefix(prefix.as_str())).expect("the child printed its result");
        let want = ipc_reference(count);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&unhex(theirs)), want.as_slice(), "call {call}: rank 1 differs");
    }
}

#[test]
fn groups_off_the_nccl_route_have_no_path_to_choose() {
    let clients: Vec<Client> = (0..2).map(|i| cohort_runtime::CpuRuntime::client(i).unwrap()).collect();
    let group = ClientGroup::new(clients).unwrap().with_algo(Algo::OneShot);
    let op = cohort_comm::op::Op::all_reduce(DType::F32, ReduceOp::Sum, 4);
    assert_eq!(group.path_of(&op), None);
    // Forcing a peer path on the host route changes nothing: still right.
    let src: Vec<Handle> =
        (0..2).map(|m| group.client(m).create_from_slice(bytemuck::cast_slice(&[m as f32 + 1.0; 4]))).collect();
    group.all_reduce_handles(&src, &src, DType::F32, ReduceOp::Sum).unwrap();
    let got = group.client(1).read_one(src[1].clone()).unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&got[..]), &[3.0; 4]);
}

/// One `scale` launch then an all-reduce of `x` into `y` on every member.
fn scale_then_all_reduce(group: &ClientGroup, x: &[Handle], y: &[Handle], count: usize) {
    let scale = cohort_runtime::conformance::kernels::scale();
    for (m, h) in x.iter().enumerate() {
        let args = KernelArguments::new().buffer(h).scalar(Scalar::F32(2.0));
        group.client(m).launch(&scale, GridCount::cover(count, 256), args).unwrap();
    }
    group.all_reduce_handles(x, y, DType::F32, ReduceOp::Sum).unwrap();
}

fn floats(client: &Client, h: &Handle) -> Vec<f32> {
    client.read_one(h.clone()).unwrap().to_elems::<f32>()
}

/// Captures `scale_then_all_reduce` on every member of `group` (whose
/// clients are pinned to their own streams), then checks that replays run
/// it again, with refreshed inputs too.
fn capture_and_replay(group: &ClientGroup) {
    let (n, count) = (group.len(), 4096);
    let x: Vec<Handle> = (0..n).map(|m| group.client(m).create(Bytes::from_elems(&vec![1.0f32; count]))).collect();
    let y: Vec<Handle> = (0..n).map(|m| group.client(m).empty(count * 4)).collect();
    for m in 0..n {
        group.client(m).graph_prepare().unwrap();
    }
    // Warm-up outside the window: kernels compiled, communicators made.
    scale_then_all_reduce(group, &x, &y, count);
    group.sync().unwrap();
    for m in 0..n {
        group.client(m).start_capture().unwrap();
    }
    scale_then_all_reduce(group, &x, &y, count);
    let graphs: Vec<_> = (0..n).map(|m| group.client(m).stop_capture().unwrap()).collect();
    let what = format!("{n} member(s), {:?}", group.algo());
    assert_eq!(floats(group.client(0), &x[0])[0], 2.0, "{what}: the capture ran nothing");
    for g in &graphs {
        g.replay().unwrap();
    }
    for m in 0..n {
        assert_eq!(floats(group.client(m), &x[m]), vec![4.0; count], "{what}: member {m}'s replay scaled");
        assert_eq!(floats(group.client(m), &y[m]), vec![4.0 * n as f32; count], "{what}: member {m}'s replay reduced");
    }
    for (m, h) in x.iter().enumerate() {
        group.client(m).write(h, Bytes::from_elems(&vec![m as f32 + 1.0; count])).unwrap();
    }
    for _ in 0..3 {
        for g in &graphs {
            g.replay().unwrap();
        }
    }
    // Each replay doubles every input, then sums them.
    let want: f32 = (0..n).map(|m| (m as f32 + 1.0) * 8.0).sum();
    for (m, h) in y.iter().enumerate() {
        assert_eq!(floats(group.client(m), h), vec![want; count], "{what}: member {m} after three replays");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_one_device_group_records_its_collectives_in_a_graph_and_replays_them() {
    let client = CudaRuntime::client(0).unwrap().with_stream(StreamId::fresh());
    capture_and_replay(&ClientGroup::new(vec![client]).unwrap());
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_a_collective_captured_on_only_some_members_is_refused() {
    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    let clients: Vec<Client> = devices[..2].iter().map(|c| c.with_stream(StreamId::fresh())).collect();
    let group = ClientGroup::new(clients).unwrap();
    let count = 256;
    for algo in [Algo::Nccl, Algo::OneShot] {
        let g = group.clone().with_algo(algo);
        let x: Vec<Handle> = (0..2).map(|m| g.client(m).create(Bytes::from_elems(&vec![m as f32; count]))).collect();
        for m in 0..2 {
            g.client(m).graph_prepare().unwrap();
        }
        g.all_reduce_handles(&x, &x, DType::F32, ReduceOp::Sum).unwrap();
        g.sync().unwrap();
        g.client(1).start_capture().unwrap();
        let err = g.all_reduce_handles(&x, &x, DType::F32, ReduceOp::Sum).expect_err("member 0 is not capturing");
        let text = err.to_string();
        assert!(text.contains("member 0's stream is not capturing"), "{algo:?}: {text}");
        g.client(1).stop_capture().unwrap();
        // Nothing was queued: the group still works, with the right sums.
        g.all_reduce_handles(&x, &x, DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(floats(g.client(0), &x[0]), vec![2.0; count], "{algo:?}");
    }
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_nccl_and_peer_kernels_captured_on_every_member_replay_as_graphs() {
    let devices = cuda_common::devices();
    assert!(devices.len() >= 2, "this test needs two GPUs or more, found {}", devices.len());
    let clients: Vec<Client> = devices[..2].iter().map(|c| c.with_stream(StreamId::fresh())).collect();
    let group = ClientGroup::new(clients).unwrap();
    for algo in [Algo::Nccl, Algo::OneShot, Algo::TwoShot] {
        capture_and_replay(&group.clone().with_algo(algo));
    }
}

#[test]
fn capture_on_the_host_path_is_refused_before_anything_is_queued() {
    let client = cohort_runtime::CpuRuntime::client(0).unwrap().with_stream(StreamId::fresh());
    let group = ClientGroup::new(vec![client.clone()]).unwrap();
    let x = client.create(Bytes::from_elems(&[1.0f32; 4]));
    let y = client.create(Bytes::from_elems(&[0.0f32; 4]));
    client.start_capture().unwrap();
    let err = group.all_reduce_handles(std::slice::from_ref(&x), std::slice::from_ref(&y), DType::F32, ReduceOp::Sum);
    let text = err.expect_err("the host path cannot be captured").to_string();
    assert!(text.contains("all_reduce") && text.contains("capturing a graph") && text.contains("member 0"), "{text}");
    let graph = client.stop_capture().unwrap();
    assert!(graph.is_empty(), "nothing was queued");
    assert_eq!(client.read_one(y).unwrap().to_elems::<f32>(), vec![0.0; 4]);
}

/// One rank of the two-process test (`COHORT_TEST_PEER_RANK` set): joins
/// the parent's store with GPU `rank` (GPU 0 for both where there is one),
/// then runs every element type and operator on the peer kernels, checked
/// against the host reference of both ranks' inputs.
fn communicator_rank(rank: usize) {
    let addr = std::env::var("COHORT_TEST_PEER_STORE").unwrap();
    let client = CudaRuntime::client(rank % CudaRuntime::device_count().unwrap()).unwrap();
    let comm = cohort_comm::Communicator::connect(rank, 2, &addr, "peer-test", vec![client.clone()]).unwrap();
    let want_path = if std::env::var("COHORT_ALGO").unwrap() == "oneshot" { Path::OneShot } else { Path::TwoShot };
    let probe = cohort_comm::op::Op::all_reduce(DType::F32, ReduceOp::Sum, 4);
    assert_eq!(comm.path_of(&probe), Some(want_path), "rank {rank}: the fast path is set up across the processes");
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for count in [1, 4099, 65536] {
                let inputs: Vec<Vec<u8>> = (0..2).map(|m| random(dtype, count, (m * 7919 + count) as u64)).collect();
                let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
                let mut want = vec![0u8; count * dtype.size()];
                reduce_bytes(dtype, op, &refs, &mut want);
                let src = client.create_from_slice(&inputs[rank]);
                let dst = client.empty(want.len());
                let what = format!("rank {rank}: all_reduce {dtype} {op} count={count}");
                comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), dtype, op)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let got = client.read_one(dst).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(got[..] == want[..], "{what}: differs from the host reference");
            }
        }
    }
    let block: Vec<Vec<u8>> = (0..2).map(|m| random(DType::U8, 4099, 31 + m as u64)).collect();
    let src = client.create_from_slice(&block[rank]);
    let dst = client.empty(2 * 4099);
    comm.all_gather_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::U8).unwrap();
    assert!(client.read_one(dst).unwrap()[..] == block.concat()[..], "rank {rank}: all_gather differs");
    queued_back_to_back_then_a_mismatch(rank, &comm, &client);
    println!("RANK {rank} OK");
}

/// Calls queued back to back (each from the caller's thread, its check
/// sent ahead) end right; then rank 1 calls a longer all-reduce than rank
/// 0: neither hangs, both name the mismatch, and a later call is refused.
fn queued_back_to_back_then_a_mismatch(rank: usize, comm: &cohort_comm::Communicator, client: &Client) {
    let inline = queued_sums(comm, client, 64, 256);
    assert!(inline > 0, "rank {rank}: none of 64 calls was queued from the caller's thread");
    println!("rank {rank}: {inline} of 64 calls queued from the caller's thread");

    let count = 4 * (rank + 1);
    let src = client.create_from_slice(&vec![0u8; count * 4]);
    let dst = client.empty(count * 4);
    let started = std::time::Instant::now();
    let work =
        comm.all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum);
    // A read of the destination, not waiting for the call first, returns
    // the error too (the mismatch may be found after the kernel ran): from
    // another stream (which waits for the call's end, not only for its
    // kernel), and from the call's own.
    let other = client.with_stream(StreamId::fresh());
    let read = other.read_one(dst.clone()).expect_err("the destination is marked").to_string();
    assert!(read.contains("collective mismatch"), "rank {rank}, another stream: {read}");
    let read = client.read_one(dst.clone()).expect_err("the destination is marked").to_string();
    assert!(read.contains("collective mismatch"), "rank {rank}: {read}");
    let err = work.and_then(|work| work.wait()).expect_err("a mismatched all-reduce fails").to_string();
    assert!(
        err.contains("collective mismatch") && err.contains("f32 × 4") && err.contains("f32 × 8"),
        "rank {rank}: {err}"
    );
    assert!(started.elapsed() < comm.timeout(), "rank {rank}: found only at the timeout: {err}");
    let err = comm
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), DType::F32, ReduceOp::Sum)
        .and_then(|work| work.wait())
        .expect_err("refused after the mismatch")
        .to_string();
    assert!(err.contains("aborted"), "rank {rank}: {err}");
}

/// Queues `calls` f32 all-reduces of `floats` elements back to back on this
/// rank (rank r's call i holds r * 100 + i), then waits for each and checks
/// its sum over every rank; returns how many were queued from the caller's
/// thread.
fn queued_sums(comm: &cohort_comm::Communicator, client: &Client, calls: usize, floats: usize) -> u64 {
    let (rank, ranks) = (comm.rank(), comm.size());
    let value = |i: usize, r: usize| (r * 100 + i) as f32;
    let srcs: Vec<Handle> =
        (0..calls).map(|i| client.create_from_slice(bytemuck::cast_slice(&vec![value(i, rank); floats]))).collect();
    let dsts: Vec<Handle> = (0..calls).map(|_| client.empty(floats * 4)).collect();
    client.sync().unwrap();
    let inline_before = client.stats().unwrap().inline_tasks;
    let works: Vec<_> = srcs
        .iter()
        .zip(&dsts)
        .map(|(s, d)| {
            comm.all_reduce_handles(std::slice::from_ref(s), std::slice::from_ref(d), DType::F32, ReduceOp::Sum)
                .unwrap()
        })
        .collect();
    let inline = client.stats().unwrap().inline_tasks - inline_before;
    for (i, (work, dst)) in works.iter().zip(dsts).enumerate() {
        work.wait().unwrap_or_else(|e| panic!("rank {rank}: queued call {i}: {e}"));
        let got = client.read_one(dst).unwrap();
        let want: f32 = (0..ranks).map(|r| value(i, r)).sum();
        assert!(bytemuck::cast_slice::<u8, f32>(&got).iter().all(|&x| x == want), "rank {rank}: queued call {i}");
    }
    inline
}

/// Runs test `name` as `ranks` child processes (`COHORT_TEST_PEER_RANK`),
/// one `Communicator` rank each over a store served here, on the peer
/// kernels of `algo`; each must print "RANK r OK".
fn peer_ranks(name: &str, ranks: usize, algo: &str) {
    // Checked here, with a clear message, before any child needs a GPU.
    let count = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    assert!(count >= 1, "this test needs a CUDA GPU, found none");
    let server = cohort_comm::store::StoreServer::bind("127.0.0.1:0", "peer-test").unwrap();
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            let envs = [
                ("COHORT_TEST_PEER_RANK", rank.to_string()),
                ("COHORT_TEST_PEER_STORE", server.local_addr().to_string()),
                ("COHORT_ALGO", algo.to_string()),
                ("COHORT_TIMEOUT", "60".to_string()),
            ];
            cuda_common::rerun(name, &envs)
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let (ok, text) = cuda_common::finish(child);
        assert!(ok && text.contains(&format!("RANK {rank} OK")), "{algo}, rank {rank}: {text}");
    }
}

/// Two processes, one `Communicator` rank each, on the peer kernels (each
/// opens the other's arena through its CUDA IPC handle): one GPU each where
/// there are two, both on one GPU otherwise.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn peer_kernels_across_two_processes_give_the_host_reference_bit_for_bit() {
    if let Ok(rank) = std::env::var("COHORT_TEST_PEER_RANK") {
        return communicator_rank(rank.parse().unwrap());
    }
    for algo in ["oneshot", "twoshot"] {
        peer_ranks("peer_kernels_across_two_processes_give_the_host_reference_bit_for_bit", 2, algo);
    }
}

/// Three processes, one `Communicator` rank each, on the peer kernels (all
/// on one GPU where there are fewer than three). Every rank compares every
/// other rank's fingerprint, so calls are queued from the caller's thread,
/// their checks sent ahead: queued back to back they end right, and when
/// rank 1 calls an all-reduce of the same bytes but another type, no rank's
/// call succeeds (rank 0, whose ring predecessor agrees with it, included)
/// and every rank names rank 1's call.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn peer_kernels_across_three_processes_fail_a_mismatch_on_every_rank() {
    const NAME: &str = "peer_kernels_across_three_processes_fail_a_mismatch_on_every_rank";
    if let Ok(rank) = std::env::var("COHORT_TEST_PEER_RANK") {
        return three_ranks(rank.parse().unwrap());
    }
    peer_ranks(NAME, 3, "oneshot");
}

fn three_ranks(rank: usize) {
    let addr = std::env::var("COHORT_TEST_PEER_STORE").unwrap();
    let client = CudaRuntime::client(rank % CudaRuntime::device_count().unwrap()).unwrap();
    let comm = cohort_comm::Communicator::connect(rank, 3, &addr, "peer-test", vec![client.clone()]).unwrap();
    let probe = cohort_comm::op::Op::all_reduce(DType::F32, ReduceOp::Sum, 4);
    assert_eq!(comm.path_of(&probe), Some(Path::OneShot), "rank {rank}: the fast path is set up");
    // Every rank compares every other rank's fingerprint, so a job of
    // three queues its calls from the caller's thread, checks sent ahead.
    let inline = queued_sums(&comm, &client, 16, 64);
    assert!(inline > 0, "rank {rank}: no call of a job of three was queued from the caller's thread");

    // The same 16 bytes, another type on rank 1 only.
    let dtype = if rank == 1 { DType::I32 } else { DType::F32 };
    let src = client.create_from_slice(&[0u8; 16]);
    let dst = client.empty(16);
    let started = Instant::now();
    let outcome = comm
        .all_reduce_handles(std::slice::from_ref(&src), std::slice::from_ref(&dst), dtype, ReduceOp::Sum)
        .and_then(|work| work.wait());
    let err = outcome.expect_err("a mismatched all-reduce fails on every rank").to_string();
    // Each rank compared rank 1's fingerprint itself (or heard of it in
    // an abort, whose message carries the same words).
    assert!(
        err.contains("mismatch") && err.contains("rank 1 called all_reduce") && err.contains("i32"),
        "rank {rank}: {err}"
    );
    assert!(started.elapsed() < comm.timeout(), "rank {rank}: found only at the timeout: {err}");
    let read = client.read_one(dst).expect_err("the destination is marked").to_string();
    assert!(read.contains("mismatch") || read.contains("aborted"), "rank {rank}: {read}");
    println!("RANK {rank} OK");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn bad_peer_arguments_are_refused_with_a_clear_error() {
    let client = CudaRuntime::client(0).unwrap();
    let set = 9_100_001;
    let mine = arena(&client, set);
    let open = |bytes: Vec<u8>| {
        on_device(&client, Vec::new(), move |a| a.device_collectives().unwrap().peer_open(set, &bytes)).unwrap_err()
    };
    let err = open(vec![1; 10]).to_string();
    assert!(err.contains("64 bytes, not 10"), "{err}");
    let err = open(vec![0; 64]).to_string();
    assert!(err.contains("cuIpcOpenMemHandle"), "{err}");
    let sum = |rank, arenas: Vec<u64>| {
        try_peer_sum(&client, set, rank, arenas, &[1.0; 4], Duration::from_secs(1)).unwrap_err().to_string()
    };
    let err = sum(0, vec![mine; 9]);
    assert!(err.contains("1 to 8 members"), "{err}");
    let other = arena(&client, set + 1);
    let err = sum(1, vec![mine, other]);
    assert!(err.contains("not its own"), "{err}");
    // An address that is no arena is refused: safe code cannot aim a
    // kernel at arbitrary device memory.
    let err = sum(0, vec![mine, mine + 4096]);
    assert!(err.contains("rank 1's arena") && err.contains("no arena of this process"), "{err}");
    let err = sum(2, vec![mine, mine]);
    assert!(err.contains("rank 2 of 2"), "{err}");
    // None of it touched the device.
    let fine = client.create_from_slice(&[5u8; 8]);
    assert_eq!(&client.read_one(fine).unwrap()[..], &[5u8; 8]);
}
