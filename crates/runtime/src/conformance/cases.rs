//! Conformance cases for buffers, memory, streams, errors and threads.

use std::sync::{Arc, Barrier};

use super::{first_client, kernels};
use crate::memory::{MemoryPoolsConfig, PoolConfig, PoolKind};
use crate::{
    Bytes, Client, CopyDescriptor, CpuRuntime, GridCount, Handle, KernelArguments, LayoutPolicy, MemoryScope, Runtime,
    Scalar, ServerError, TimingMethod,
};

pub(crate) fn upload(client: &Client, values: &[f32]) -> Handle {
    client.create(Bytes::from_elems(values))
}

pub(crate) fn download(client: &Client, handle: &Handle) -> Vec<f32> {
    client.read_one(handle.clone()).unwrap_or_else(|e| panic!("read failed: {e}")).to_elems()
}

pub(crate) fn scale_args(handle: &Handle, factor: f32) -> KernelArguments {
    KernelArguments::new().buffer(handle).scalar(Scalar::F32(factor))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// Bytes written come back unchanged, for sizes 0, 1, odd, and several MiB.
pub fn create_and_read_round_trip<R: Runtime>() {
    let client = first_client::<R>();
    for len in [0usize, 1, 3, 255, 4097, 3 * 1024 * 1024 + 5] {
        let data = pattern(len);
        let handle = client.create_from_slice(&data);
        assert_eq!(handle.size(), len as u64);
        let back = client.read_one(handle).unwrap();
        assert_eq!(&back[..], &data[..], "round trip of {len} bytes");
    }
}

/// `empty` then `write` fills the same memory; `write` refuses a wrong size.
pub fn empty_then_write_in_place<R: Runtime>() {
    let client = first_client::<R>();
    let handle = client.empty(16);
    client.write(&handle, Bytes::from_elems(&[1.0f32, 2.0, 3.0, 4.0])).unwrap();
    assert_eq!(download(&client, &handle), vec![1.0, 2.0, 3.0, 4.0]);
    client.write(&handle, Bytes::from_elems(&[5.0f32, 6.0, 7.0, 8.0])).unwrap();
    assert_eq!(download(&client, &handle), vec![5.0, 6.0, 7.0, 8.0]);
    let err = client.write(&handle, Bytes::from_elems(&[1.0f32])).unwrap_err();
    assert!(matches!(err, ServerError::InvalidArgument(_)), "{err}");
    assert_eq!(download(&client, &handle), vec![5.0, 6.0, 7.0, 8.0], "a refused write changes nothing");
}

/// `read_async` resolves to the same bytes as `read`; `read_one` too.
pub fn read_async_and_read_one<R: Runtime>() {
    let client = first_client::<R>();
    let a = upload(&client, &[1.0, 2.0]);
    let b = upload(&client, &[3.0]);
    let future = client.read_async(vec![a.clone(), b.clone()]);
    let bytes = pollster::block_on(future).unwrap();
    assert_eq!(bytes[0].to_elems::<f32>(), vec![1.0, 2.0]);
    assert_eq!(bytes[1].to_elems::<f32>(), vec![3.0]);
    assert_eq!(client.read_one(a).unwrap().to_elems::<f32>(), vec![1.0, 2.0]);
    let both = client.read(vec![b.clone(), b]).unwrap();
    assert_eq!(both.len(), 2);
}

/// Tensors round trip in contiguous and pitched layouts; several tensors
/// share one reservation.
pub fn tensors_contiguous_and_pitched<R: Runtime>() {
    let client = first_client::<R>();
    let values: Vec<f32> = (0..15).map(|i| i as f32).collect();
    let contiguous = client.create_tensor(Bytes::from_elems(&values), vec![3, 5], 4);
    assert_eq!(contiguous.strides, vec![5, 1]);
    let pitched_client = client.with_layout_policy(LayoutPolicy::Pitched { row_alignment: 64 });
    let pitched = pitched_client.create_tensor(Bytes::from_elems(&values), vec![3, 5], 4);
    assert_eq!(pitched.strides, vec![16, 1], "rows of 20 bytes padded to 64");
    assert!(!pitched.is_contiguous());
    let back = client.read_tensor(vec![contiguous.descriptor(), pitched.descriptor()]).unwrap();
    assert_eq!(back[0].to_elems::<f32>(), values);
    assert_eq!(back[1].to_elems::<f32>(), values);
    let raw = client.read_one(pitched.handle.clone()).unwrap().to_elems::<f32>();
    assert_eq!(raw.len(), 48);
    assert_eq!(&raw[16..21], &values[5..10], "row 1 starts at its pitch");

    let many = client.create_tensors(vec![
        (crate::MemoryLayoutDescriptor::new(vec![2], 4), Bytes::from_elems(&[1.0f32, 2.0])),
        (crate::MemoryLayoutDescriptor::new(vec![3], 4), Bytes::from_elems(&[3.0f32, 4.0, 5.0])),
    ]);
    assert!(many[0].handle.same_allocation(&many[1].handle), "one reservation for both");
    assert_eq!(download(&client, &many[1].handle), vec![3.0, 4.0, 5.0]);
    let empties = client.empty_tensors(vec![crate::MemoryLayoutDescriptor::new(vec![4, 4], 8)]);
    assert_eq!(empties[0].handle.size(), 128);
    let bad = client.create_tensor(Bytes::from_elems(&[1.0f32]), vec![2, 2], 4);
    let err = client.read_one(bad.handle).unwrap_err();
    assert!(err.to_string().contains("needs 16 bytes"), "{err}");
}

/// `read_lazy` copies on first access and sees the device state then.
pub fn read_lazy_defers_the_copy<R: Runtime>() {
    let client = first_client::<R>();
    let handle = upload(&client, &[1.0, 2.0, 3.0]);
    let lazy = client.read_lazy(CopyDescriptor::contiguous(handle.clone(), vec![3], 4));
    assert!(lazy.is_pending());
    client.launch(&kernels::scale(), GridCount::cover(3, 256), scale_args(&handle, 2.0)).unwrap();
    drop(handle);
    assert_eq!(lazy.cast::<f32>(), &[2.0, 4.0, 6.0], "the lazy read sees the launch queued before first access");
    assert!(!lazy.is_pending());
}

/// Bytes in use equal the sum of live handles; dropping them and cleaning up
/// gives every page back.
pub fn memory_accounting_is_exact<R: Runtime>() {
    let client = first_client::<R>();
    let stream = |c: &Client| c.memory_report(MemoryScope::CurrentStream).unwrap().total;
    let sizes = [1usize, 100, 4096, 65_536, 1 << 20, 3 << 20, 17];
    let mut handles = Vec::new();
    let mut expected = 0u64;
    for &size in &sizes {
        handles.push(client.empty(size));
        expected += size as u64;
        let usage = stream(&client);
        assert_eq!(usage.bytes_in_use, expected, "in use after reserving {size} bytes");
        assert_eq!(usage.allocations, handles.len() as u64);
        assert!(usage.bytes_reserved >= usage.bytes_in_use);
    }
    let sub = handles[4].slice(0, 10).unwrap();
    drop(handles.remove(4));
    assert_eq!(stream(&client).bytes_in_use, expected, "a slice keeps its allocation alive");
    drop(sub);
    expected -= 1 << 20;
    assert_eq!(stream(&client).bytes_in_use, expected);
    drop(handles);
    let usage = stream(&client);
    assert_eq!((usage.allocations, usage.bytes_in_use), (0, 0));
    client.memory_cleanup().unwrap();
    assert_eq!(stream(&client).bytes_reserved, 0, "cleanup with nothing alive gives every page back");
}

/// Each thread has its own stream and pools; a report of the current stream
/// shows only its own memory.
pub fn streams_are_isolated_per_thread<R: Runtime>() {
    let client = first_client::<R>();
    let main_stream = client.stream_id();
    let _mine = client.empty(1 << 20);
    let other = std::thread::spawn({
        let client = client.clone();
        move || {
            assert_ne!(client.stream_id(), main_stream, "another thread, another stream");
            let handle = client.empty(1 << 20);
            let report = client.memory_report(MemoryScope::CurrentStream).unwrap();
            assert_eq!(report.streams.len(), 1);
            assert_eq!(report.streams[0].stream, client.stream_id());
            assert_eq!(report.total.bytes_in_use, 1 << 20);
            (handle, client.stream_id())
        }
    })
    .join()
    .unwrap();
    let device = client.memory_report(MemoryScope::Device).unwrap();
    assert!(device.streams.iter().any(|s| s.stream == main_stream && s.usage.bytes_in_use == 1 << 20));
    assert!(device.streams.iter().any(|s| s.stream == other.1 && s.usage.bytes_in_use == 1 << 20));
    let mine = client.memory_report(MemoryScope::CurrentStream).unwrap();
    assert_eq!(mine.streams.len(), 1);
    assert_eq!(mine.streams[0].stream, main_stream);
}

/// A buffer written on one stream and used on another is ordered by a
/// fence, not a device-wide sync.
pub fn cross_stream_use_is_ordered_by_a_fence<R: Runtime>() {
    let client = first_client::<R>();
    let n = 1 << 16;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let handle = upload(&client, &values);
    for _ in 0..4 {
        client.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&handle, 2.0)).unwrap();
    }
    let before = client.stats().unwrap();
    let read = std::thread::spawn({
        let client = client.clone();
        let handle = handle.clone();
        move || download(&client, &handle)
    })
    .join()
    .unwrap();
    assert!(read.iter().enumerate().all(|(i, &v)| v == 16.0 * i as f32), "the other stream saw every launch");
    let after = client.stats().unwrap();
    assert!(after.stream_fences > before.stream_fences, "the read waited on a fence");
    // Pinned clients: the same, with explicit streams.
    let writer = client.with_stream(crate::StreamId::fresh());
    let reader = client.with_stream(crate::StreamId::fresh());
    let h = upload(&writer, &[1.0; 8]);
    writer.launch(&kernels::scale(), GridCount::cover(8, 256), scale_args(&h, 3.0)).unwrap();
    assert_eq!(download(&reader, &h), vec![3.0; 8]);
    let fence = writer.fence().unwrap();
    fence.wait().unwrap();
}

/// A launch that fails marks its buffers: reads return the cause.
pub fn failed_launch_marks_its_outputs<R: Runtime>() {
    let client = first_client::<R>();
    let handle = upload(&client, &[1.0; 4]);
    client.launch(&kernels::failing(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    let err = client.read_one(handle.clone()).unwrap_err();
    assert!(matches!(err, ServerError::KernelFailed { .. }), "{err}");
    assert!(err.to_string().contains("failing"), "the error names the kernel: {err}");
    assert!(err.to_string().contains("deliberate failure"), "the error carries the cause: {err}");
    assert!(client.check([&handle]).is_err());
    assert!(client.sync_buffers([&handle]).is_err());
    // A successful write clears the mark.
    client.write(&handle, Bytes::from_elems(&[2.0f32; 4])).unwrap();
    assert_eq!(download(&client, &handle), vec![2.0; 4]);
    client.check([&handle]).unwrap();
    // The client stays usable.
    let fine = upload(&client, &[1.0; 4]);
    client.launch(&kernels::scale(), GridCount::cover(4, 256), scale_args(&fine, 5.0)).unwrap();
    assert_eq!(download(&client, &fine), vec![5.0; 4]);
    client.sync().unwrap();
}

/// A kernel without a source for this backend marks its outputs.
pub fn missing_source_marks_outputs<R: Runtime>() {
    let client = first_client::<R>();
    let handle = upload(&client, &[1.0; 4]);
    let kernel = kernels::without_source_for(R::NAME);
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    let err = client.read_one(handle).unwrap_err();
    assert!(matches!(err, ServerError::MissingKernelSource { .. }), "{err}");
    assert!(err.to_string().contains(R::NAME), "{err}");
}

/// A launch reading a failed buffer fails too, naming the root cause.
pub fn poison_propagates_to_dependents<R: Runtime>() {
    let client = first_client::<R>();
    let bad = upload(&client, &[1.0; 4]);
    let other = upload(&client, &[1.0; 4]);
    let out = client.empty(16);
    client.launch(&kernels::failing(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&bad)).unwrap();
    client
        .launch(
            &kernels::add(),
            GridCount::cover(4, 256),
            KernelArguments::new().buffer(&bad).buffer(&other).buffer(&out),
        )
        .unwrap();
    let err = client.read_one(out.clone()).unwrap_err();
    assert!(matches!(err, ServerError::Poisoned { .. }), "{err}");
    assert!(matches!(err.root_cause(), ServerError::KernelFailed { .. }), "root cause: {:?}", err.root_cause());
    // A longer chain still names the root failure once.
    let out2 = client.empty(16);
    client
        .launch(
            &kernels::add(),
            GridCount::cover(4, 256),
            KernelArguments::new().buffer(&out).buffer(&other).buffer(&out2),
        )
        .unwrap();
    let err = client.read_one(out2).unwrap_err();
    let ServerError::Poisoned { cause, .. } = &err else { panic!("expected a poisoned buffer: {err}") };
    assert!(matches!(cause.as_ref(), ServerError::KernelFailed { .. }), "the cause is the root failure: {err}");
    assert_eq!(err.to_string().matches("was not written").count(), 1, "{err}");
}

/// A handle of another device (or runtime) is refused before anything is
/// queued.
pub fn foreign_handles_are_refused<R: Runtime>() {
    let client = first_client::<R>();
    let other = if R::NAME == "cpu" { CpuRuntime::client(1).unwrap() } else { CpuRuntime::client(0).unwrap() };
    assert_ne!(other.service_id(), client.service_id());
    let foreign = upload(&other, &[1.0, 2.0]);
    let foreign_err = |e: ServerError| assert!(matches!(e, ServerError::ForeignHandle { .. }), "{e}");
    foreign_err(client.read_one(foreign.clone()).unwrap_err());
    foreign_err(client.write(&foreign, Bytes::from_elems(&[9.0f32, 9.0])).unwrap_err());
    foreign_err(client.launch(&kernels::scale(), GridCount::Static(1, 1, 1), scale_args(&foreign, 3.0)).unwrap_err());
    foreign_err(client.check([&foreign]).unwrap_err());
    assert_eq!(download(&other, &foreign), vec![1.0, 2.0], "nothing was queued on the foreign buffer");
    let moved = other.to_client(&foreign, &client).unwrap();
    assert_eq!(download(&client, &moved), vec![1.0, 2.0]);
}

/// A grid with a zero dimension runs nothing and reports nothing.
pub fn zero_sized_grid_is_a_no_op<R: Runtime>() {
    let client = first_client::<R>();
    let handle = upload(&client, &[0.0; 4]);
    for grid in [GridCount::Static(0, 1, 1), GridCount::Static(4, 0, 1), GridCount::Static(1, 1, 0)] {
        client.launch(&kernels::mark_ran(), grid, KernelArguments::new().buffer(&handle)).unwrap();
        client.launch(&kernels::failing(), GridCount::Static(0, 0, 0), KernelArguments::new().buffer(&handle)).unwrap();
    }
    assert_eq!(download(&client, &handle), vec![0.0; 4]);
    client.check([&handle]).unwrap();
}

/// A dynamic grid reads its size from a buffer when it runs.
pub fn dynamic_grid_reads_its_buffer<R: Runtime>() {
    let client = first_client::<R>();
    let handle = upload(&client, &[0.0; 4]);
    let grid = client.create(Bytes::from_elems(&[0u32, 1, 1]));
    client
        .launch(&kernels::mark_ran(), GridCount::Dynamic(grid.clone()), KernelArguments::new().buffer(&handle))
        .unwrap();
    assert_eq!(download(&client, &handle)[0], 0.0, "a zero dynamic grid ran nothing");
    client.write(&grid, Bytes::from_elems(&[1u32, 1, 1])).unwrap();
    client
        .launch(&kernels::mark_ran(), GridCount::Dynamic(grid.clone()), KernelArguments::new().buffer(&handle))
        .unwrap();
    assert_eq!(download(&client, &handle), vec![1.0, 1.0, 0.0, 0.0]);
    let short = client.create(Bytes::from_elems(&[1u32]));
    client.launch(&kernels::mark_ran(), GridCount::Dynamic(short), KernelArguments::new().buffer(&handle)).unwrap();
    let err = client.read_one(handle).unwrap_err();
    assert!(err.to_string().contains("12 bytes"), "{err}");
}

/// Eight threads create, launch and read on one device at once.
pub fn eight_threads_share_one_device<R: Runtime>() {
    let client = first_client::<R>();
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let client = client.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for round in 0..20 {
                    let n = 1000 + t * 37 + round;
                    let values: Vec<f32> = (0..n).map(|i| (i + t) as f32).collect();
                    let h = upload(&client, &values);
                    client.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, (t + 1) as f32)).unwrap();
                    let back = download(&client, &h);
                    assert!(
                        back.iter().zip(&values).all(|(b, v)| *b == v * (t + 1) as f32),
                        "thread {t} round {round}"
                    );
                }
                client.memory_report(MemoryScope::CurrentStream).unwrap().total.bytes_in_use
            })
        })
        .collect();
    for thread in threads {
        assert_eq!(thread.join().expect("worker thread"), 0, "each thread's handles were dropped");
    }
}

/// An invalid layout is refused; a live stream keeps its pools; a quiescent
/// one is rebuilt.
pub fn pool_layout_configuration<R: Runtime>() {
    let client = first_client::<R>();
    let err = client.configure_memory_pools(&MemoryPoolsConfig { pools: vec![] }).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    let bad = MemoryPoolsConfig { pools: vec![PoolConfig::Sliced { page_size: 1024, max_slice_size: 4096 }] };
    assert!(client.configure_memory_pools(&bad).unwrap_err().to_string().contains("larger than its page"));
    let layout = MemoryPoolsConfig {
        pools: vec![
            PoolConfig::Sliced { page_size: 1 << 20, max_slice_size: 1 << 16 },
            PoolConfig::Adaptive { page_size: 4 << 20, max_page_size: 1 << 30 },
        ],
    };
    let live = client.empty(100);
    assert!(!client.configure_memory_pools(&layout).unwrap(), "something live: the old layout stays");
    drop(live);
    assert!(client.configure_memory_pools(&layout).unwrap(), "quiescent: rebuilt");
    let h = client.empty(1000);
    let report = client.memory_report(MemoryScope::CurrentStream).unwrap();
    let pools = &report.streams[0].pools;
    assert!(
        pools
            .iter()
            .any(|p| matches!(p.kind, PoolKind::Sliced { page_size, .. } if page_size == 1 << 20) && p.pages == 1),
        "{pools:?}"
    );
    drop(h);
    client.configure_memory_pools(&MemoryPoolsConfig::default()).unwrap();
}

/// Persistent and dedicated allocations land where their mode says.
pub fn allocation_modes<R: Runtime>() {
    let client = first_client::<R>();
    let report = |c: &Client| c.memory_report(MemoryScope::CurrentStream).unwrap().streams[0].pools.clone();
    let weights = client.memory_persistent_allocation(3 << 20, |size| client.empty(size)).unwrap();
    let persistent = report(&client).into_iter().find(|p| p.kind == PoolKind::Persistent).expect("a persistent pool");
    assert_eq!(persistent.pages, 1);
    assert_eq!(persistent.bytes_in_use, 3 << 20);
    let after = client.empty(3 << 20);
    let persistent = report(&client).into_iter().find(|p| p.kind == PoolKind::Persistent).unwrap();
    assert_eq!(persistent.pages, 1, "the mode was restored after the closure");
    let dedicated = client.memory_dedicated_allocation(5000, |size| client.empty(size)).unwrap();
    assert_eq!(client.memory_report(MemoryScope::CurrentStream).unwrap().total.bytes_in_use, (6 << 20) + 5000);
    client.write(&dedicated, Bytes::zeroed(5000)).unwrap();
    client.write(&weights, Bytes::zeroed(3 << 20)).unwrap();
    drop((weights, after, dedicated));
    client.memory_cleanup().unwrap();
    assert_eq!(client.memory_report(MemoryScope::CurrentStream).unwrap().total.bytes_reserved, 0);
}

/// `profile` times the closure's work and says how: `expected` is the
/// method the backend must use, which the caller knows independently of
/// the implementation (host timing on the CPU, CUDA events, wgpu timestamp
/// queries where the adapter offers them); not part of
/// [`conformance_tests!`](crate::conformance_tests) for that reason.
pub fn profile_reports_its_method<R: Runtime>(expected: TimingMethod) {
    let client = first_client::<R>();
    let n = 1 << 18;
    let h = upload(&client, &vec![1.0; n]);
    let (value, duration) = client
        .profile(
            || {
                client.launch(&kernels::scale(), GridCount::cover(n, 256), scale_args(&h, 2.0)).unwrap();
                42
            },
            "scale",
        )
        .unwrap();
    assert_eq!(value, 42);
    assert_eq!(duration.method, expected);
    assert_eq!(client.properties().device_timing, expected == TimingMethod::Device, "the properties say the same");
    assert!(duration.duration.as_nanos() > 0);
    let window = client.profile_start().unwrap();
    client.profile_abandon(window);
    let window = client.profile_start().unwrap();
    let other = client.with_stream(crate::StreamId::fresh());
    assert!(other.profile_end(window).is_err(), "closing on another stream is refused");
    assert_eq!(download(&client, &h)[0], 2.0);
}

/// A panic in a task reaches whoever waits on it, or the stream's next sync.
pub fn task_panics_reach_the_caller<R: Runtime>() {
    let client = first_client::<R>();
    let err = client.submit_blocking(|_| -> u32 { panic!("boom in a blocking task") }).unwrap_err();
    assert!(matches!(err, ServerError::TaskPanicked { .. }) && err.to_string().contains("boom"), "{err}");
    assert_eq!(client.submit_blocking(|_| 7).unwrap(), 7, "the device thread survived");
    client.submit(|_| panic!("boom in a queued task")).unwrap();
    let err = client.sync().unwrap_err();
    assert!(err.to_string().contains("boom in a queued task"), "{err}");
    client.sync().unwrap();
    // The same through a sync started now and waited on later.
    client.submit(|_| panic!("boom before a started sync")).unwrap();
    let pending = client.start_sync().unwrap();
    let err = pending.wait().unwrap_err();
    assert!(err.to_string().contains("boom before a started sync"), "{err}");
    client.start_sync().unwrap().wait().unwrap();
    // Several streams synced together: the failed one's error, after both.
    let other = client.with_stream(crate::StreamId::fresh());
    other.submit(|_| panic!("boom on the second stream")).unwrap();
    let err = Client::sync_all(&[client.clone(), other.clone()]).unwrap_err();
    assert!(err.to_string().contains("boom on the second stream"), "{err}");
    Client::sync_all(&[client, other]).unwrap();
}

/// A client's capabilities say what its buffer tasks find: host pointers
/// exactly where memory is host-addressable, device collectives exactly
/// where the backend offers them.
pub fn capabilities_match_the_backend<R: Runtime>() {
    let client = first_client::<R>();
    let (tx, rx) = std::sync::mpsc::channel();
    let buffer = client.empty(16);
    client
        .submit_buffers_always("capabilities", vec![buffer], Vec::new(), move |access| {
            let access = access?;
            let _ = tx.send((access.host_ptr(0).is_some(), access.device_collectives().is_some()));
            Ok(())
        })
        .unwrap();
    let (host_ptr, device_collectives) = rx.recv().expect("the task ran");
    let caps = client.capabilities();
    assert_eq!(caps.host_addressable_memory, host_ptr, "{caps:?}");
    assert_eq!(caps.device_collectives, device_collectives, "{caps:?}");
    assert!(!caps.peer_access || caps.device_collectives, "peer copies go through device collectives: {caps:?}");
}

/// `exclusive` runs a closure on the device thread; client calls inside it
/// run inline, in order.
pub fn exclusive_runs_client_calls_inline<R: Runtime>() {
    let client = first_client::<R>();
    let inner = client.clone();
    let values = client
        .exclusive(move || {
            let h = upload(&inner, &[1.0, 2.0]);
            inner.launch(&kernels::scale(), GridCount::cover(2, 256), scale_args(&h, 10.0)).unwrap();
            download(&inner, &h)
        })
        .unwrap();
    assert_eq!(values, vec![10.0, 20.0]);
    let err = client.submit_blocking({
        let inner = client.clone();
        move |_| inner.sync()
    });
    let nested = err.unwrap().unwrap_err();
    assert!(
        nested.to_string().contains("wait on itself"),
        "a blocking call from a task is refused, not a deadlock: {nested}"
    );
    // A started sync likewise: inline inside `exclusive`, refused in a task.
    let inner = client.clone();
    client.exclusive(move || inner.start_sync().and_then(crate::PendingSync::wait)).unwrap().unwrap();
    let inner = client.clone();
    let nested = client.submit_blocking(move |_| inner.start_sync().and_then(crate::PendingSync::wait)).unwrap();
    assert!(nested.unwrap_err().to_string().contains("wait on itself"), "a started sync from a task is refused too");
}

/// Used by the close test: a device closed while threads use it answers
/// every later call with `DeviceClosed` and nobody hangs.
pub fn device_closed_mid_use<R: Runtime>(client: Client) {
    let h = upload(&client, &[1.0; 1024]);
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let client = client.clone();
            let h = h.clone();
            std::thread::spawn(move || {
                let mut closed = false;
                for _ in 0..10_000 {
                    match client.read_one(h.clone()) {
                        Ok(_) => {}
                        Err(ServerError::DeviceClosed { .. }) => {
                            closed = true;
                            break;
                        }
                        Err(other) => panic!("unexpected error: {other}"),
                    }
                }
                closed
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    client.close();
    for worker in workers {
        assert!(worker.join().unwrap(), "every worker saw the device close");
    }
    let err = client.read_one(h).unwrap_err();
    assert!(matches!(err, ServerError::DeviceClosed { .. }), "{err}");
    assert!(err.to_string().contains("closed"));
    assert!(matches!(client.sync().unwrap_err(), ServerError::DeviceClosed { .. }));
    let _ = client.create_from_slice(&[1, 2, 3]);
    let reopened = R::client(client.device_id().index as usize).unwrap();
    assert_ne!(reopened.service_id(), client.service_id(), "a new opening");
    let fresh = upload(&reopened, &[4.0]);
    assert_eq!(download(&reopened, &fresh), vec![4.0]);
}
