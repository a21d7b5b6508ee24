//! What only the CUDA backend has: pinned staging, events, graph capture as a
//! CUDA graph, the NVRTC cache, device properties. Needs a CUDA GPU.

#![cfg(feature = "cuda")]

use cohort_runtime::backend::cuda::nvrtc_cache_stats;
use cohort_runtime::conformance::kernels;
use cohort_runtime::{
    Bytes, CudaRuntime, GridCount, Kernel, KernelArguments, Runtime, Scalar, ServerError, StreamId, TimingMethod,
};

const GPU: &str = "needs a CUDA GPU: run with --include-ignored where one is";

/// These tests read device-wide counters (stream syncs, NVRTC compiles)
/// that a test running beside them would move: each holds this lock, so the
/// file runs one test at a time whatever `--test-threads` says.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn client() -> cohort_runtime::Client {
    CudaRuntime::client(0).expect("CUDA device 0")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn properties_name_the_device() {
    let _serial = serial();
    let client = client();
    let p = client.properties();
    assert_eq!(p.backend, "cuda");
    assert!(!p.name.is_empty());
    assert!(p.memory_bytes.unwrap() > 1 << 30);
    assert!(p.compute_units > 0);
    assert!(p.compute_capability.unwrap().0 >= 5);
    assert!(p.device_timing && p.native_graphs);
    println!(
        "{} cc {:?}, {} SMs, {} GiB",
        p.name,
        p.compute_capability,
        p.compute_units,
        p.memory_bytes.unwrap() >> 30
    );
    let _ = GPU;
}

/// Large uploads and reads, from pageable and from staged (pinned) bytes,
/// round trip exactly, at sizes around the chunking thresholds.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn pinned_staging_round_trips() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    for (i, len) in [1usize, (256 << 10) - 1, 256 << 10, (8 << 20) + 3, (40 << 20) + 17].into_iter().enumerate() {
        let data = pattern(len, i as u8);
        let pageable = client.create_from_slice(&data);
        let mut staged = vec![Bytes::from_slice(&data)];
        client.staging(staged.iter_mut());
        assert!(staged[0].is_backend_memory(), "staging moved {len} bytes to pinned memory");
        assert_eq!(&staged[0][..], &data[..]);
        let from_pinned = client.create(staged.pop().unwrap());
        let back = client.read(vec![pageable, from_pinned]).unwrap();
        assert_eq!(&back[0][..], &data[..], "pageable upload of {len} bytes");
        assert_eq!(&back[1][..], &data[..], "pinned upload of {len} bytes");
    }
    // A staged buffer reused for several uploads while earlier ones are in
    // flight: each upload sees the same bytes.
    let data = pattern(16 << 20, 9);
    let mut staged = vec![Bytes::from_slice(&data)];
    client.staging(staged.iter_mut());
    let staged = staged.pop().unwrap();
    let handles: Vec<_> = (0..4).map(|_| client.create_from_slice(&staged)).collect();
    for bytes in client.read(handles).unwrap() {
        assert_eq!(&bytes[..], &data[..]);
    }
    // Reads bigger than the pinned pool's limit go through the chunk ring.
    let big = pattern(96 << 20, 3);
    let handle = client.create_from_slice(&big);
    let reads: Vec<_> = (0..3).map(|_| client.read_one(handle.clone()).unwrap()).collect();
    for read in &reads {
        assert_eq!(&read[..], &big[..]);
    }
}

/// Fences wait from another thread; cross-stream use waits on an event, not
/// a device sync, and sees the writer's work.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn events_order_streams_and_fence_the_host() {
    let _serial = serial();
    let writer = client().with_stream(StreamId::fresh());
    let reader = client().with_stream(StreamId::fresh());
    let n = 1 << 22;
    let h = writer.create(Bytes::from_elems(&vec![1.0f32; n]));
    for _ in 0..20 {
        writer
            .launch(
                &kernels::scale(),
                GridCount::cover(n, 256),
                KernelArguments::new().buffer(&h).scalar(Scalar::F32(1.5)),
            )
            .unwrap();
    }
    let fence = writer.fence().unwrap();
    let waited = std::thread::spawn(move || fence.wait()).join().unwrap();
    waited.unwrap();
    let before = writer.stats().unwrap();
    // The same 20 f32 products as the device (`powi` rounds differently
    // where it is not folded at compile time, as in a debug build).
    let expected = (0..20).fold(1.0f32, |v, _| v * 1.5);
    writer
        .launch(&kernels::scale(), GridCount::cover(n, 256), KernelArguments::new().buffer(&h).scalar(Scalar::F32(2.0)))
        .unwrap();
    let back = reader.read_one(h).unwrap().to_elems::<f32>();
    assert!(back.iter().all(|&v| v == expected * 2.0), "{}", back[0]);
    let after = writer.stats().unwrap();
    assert!(after.stream_fences > before.stream_fences);
    assert_eq!(after.stream_syncs, before.stream_syncs, "no stream was synced for the cross-stream read");
}

/// A captured graph replays as one CUDA graph launch, sees refreshed inputs,
/// and `profile` times on the device.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn graph_capture_replays_and_device_timing() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let n = 1 << 16;
    let x = client.create(Bytes::from_elems(&vec![1.0f32; n]));
    let scale = kernels::scale();
    let run = || {
        for _ in 0..10 {
            client
                .launch(&scale, GridCount::cover(n, 256), KernelArguments::new().buffer(&x).scalar(Scalar::F32(2.0)))
                .unwrap();
        }
    };
    client.graph_prepare().unwrap();
    run();
    client.sync().unwrap();
    client.start_capture().unwrap();
    run();
    let graph = client.stop_capture().unwrap();
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<f32>()[0], 1024.0, "capture ran nothing");
    assert_eq!(graph.len(), 10, "the graph keeps its launches' buffers alive");
    let (_, duration) = client.profile(|| graph.replay().unwrap(), "replay").unwrap();
    assert_eq!(duration.method, TimingMethod::Device);
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<f32>()[0], 1024.0 * 1024.0);
    client.write(&x, Bytes::from_elems(&vec![3.0f32; n])).unwrap();
    graph.replay().unwrap();
    assert_eq!(client.read_one(x).unwrap().to_elems::<f32>(), vec![3072.0; n]);
}

/// A dynamic grid cannot be captured: refused, and the capture fails.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn dynamic_grid_inside_capture_is_refused() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let h = client.create(Bytes::from_elems(&[0.0f32; 4]));
    let grid = client.create(Bytes::from_elems(&[1u32, 1, 1]));
    client.sync().unwrap();
    client.start_capture().unwrap();
    client.launch(&kernels::mark_ran(), GridCount::Dynamic(grid), KernelArguments::new().buffer(&h)).unwrap();
    let _ = client.stop_capture();
    let err = client.read_one(h).unwrap_err();
    assert!(err.to_string().contains("dynamic grid"), "{err}");
    client.sync().unwrap();
}

/// The same source compiles once: a second kernel with it hits the memory
/// cache, and a fresh server of the device (closed and opened again) loads
/// it from the disk cache, unless the entry was changed on disk.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn nvrtc_cache_hits_on_second_compile() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("cohort-nvrtc-test-{}", std::process::id()));
    std::env::set_var("COHORT_CACHE_DIR", &dir);
    let unique = format!("{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    let source = format!(
        "extern \"C\" __global__ void add_const(float* x, unsigned long long len, float c) {{\n    // {unique}\n    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;\n    if (i < len / 4) x[i] += c;\n}}"
    );
    let make = || Kernel::new("add_const").with_cuda(source.clone());
    let client = client().with_stream(StreamId::fresh());
    let h = client.create(Bytes::from_elems(&[0.0f32; 8]));
    let launch = |k: &Kernel| {
        client
            .launch(k, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h).scalar(Scalar::F32(1.0)))
            .unwrap();
        client.sync().unwrap();
    };
    let start = nvrtc_cache_stats();
    launch(&make());
    let first = nvrtc_cache_stats();
    assert_eq!(first.compiles, start.compiles + 1, "first use compiles");
    let t = std::time::Instant::now();
    launch(&make());
    println!("second launch with the same source took {:?}", t.elapsed());
    let second = nvrtc_cache_stats();
    assert_eq!(second.compiles, first.compiles, "no second compile");
    assert!(second.memory_hits > first.memory_hits, "memory cache hit");
    let files: Vec<_> = std::fs::read_dir(dir.join("nvrtc")).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(files.len(), 1, "the cubin was stored on disk: {files:?}");
    assert_eq!(client.read_one(h).unwrap().to_elems::<f32>(), vec![2.0; 8]);

    // A fresh server of the device has no compiled kernels in memory: it
    // loads the entry from disk.
    let fresh = |what: &str| {
        cohort_runtime::close_device(client.device_id());
        let fresh = CudaRuntime::client(0).expect("CUDA device 0, opened again");
        let h = fresh.create(Bytes::from_elems(&[0.0f32; 8]));
        fresh
            .launch(&make(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h).scalar(Scalar::F32(1.0)))
            .unwrap();
        assert_eq!(fresh.read_one(h).unwrap().to_elems::<f32>(), vec![1.0; 8], "{what}");
    };
    let before = nvrtc_cache_stats();
    fresh("from the disk cache");
    let after = nvrtc_cache_stats();
    assert_eq!(after.disk_hits, before.disk_hits + 1, "a disk hit: {before:?} -> {after:?}");
    assert_eq!(after.compiles, before.compiles, "no compile: {before:?} -> {after:?}");

    // An entry changed on disk is refused and compiled again.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    *bytes.last_mut().unwrap() ^= 0x5a;
    std::fs::write(&files[0], &bytes).unwrap();
    let before = nvrtc_cache_stats();
    fresh("compiled again");
    let after = nvrtc_cache_stats();
    assert_eq!(after.disk_hits, before.disk_hits, "the changed entry is not loaded: {before:?} -> {after:?}");
    assert_eq!(after.compiles, before.compiles + 1, "compiled again: {before:?} -> {after:?}");
    std::env::remove_var("COHORT_CACHE_DIR");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A compile error carries NVRTC's log and names the kernel; the client
/// stays usable.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn compile_errors_carry_the_log() {
    let _serial = serial();
    let client = client();
    let h = client.create(Bytes::from_elems(&[1.0f32; 4]));
    let kernel = Kernel::new("broken")
        .with_cuda("extern \"C\" __global__ void broken(float* x, unsigned long long n) { undeclared_name = 1; }");
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h)).unwrap();
    let err = client.read_one(h).unwrap_err();
    let ServerError::KernelFailed { kernel, reason, .. } = &err else { panic!("{err}") };
    assert_eq!(kernel, "broken");
    assert!(reason.contains("undeclared_name"), "{reason}");
    println!("{err}");
}

/// `count` floats of a varied pattern, and what `launches` runs of
/// `scale` by `factor` make of them on the host (the same f32 products).
fn scaled(count: usize, factor: f32, launches: usize) -> (Vec<f32>, Vec<f32>) {
    let start: Vec<f32> = (0..count).map(|i| (i % 1000) as f32 * 0.25 - 100.0).collect();
    let mut end = start.clone();
    for _ in 0..launches {
        end.iter_mut().for_each(|v| *v *= factor);
    }
    (start, end)
}

/// Launches and reads on an idle device run on the caller's thread (the
/// device counts them), in stream order: a read of a buffer right after
/// launches still running on the GPU waits for them and sees every write.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn an_idle_device_runs_launches_and_reads_on_the_callers_thread_in_order() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let scale = kernels::scale();
    let n = 1 << 22;
    let (start, expected) = scaled(n, 1.5, 20);
    // The device thread lets go of its state a moment after it answered
    // the last round trip, and a loaded machine may take it off its core
    // in that moment: a few tries.
    let inline = (0..20).any(|_| {
        let x = client.create(Bytes::from_elems(&start));
        let small = client.create(Bytes::from_elems(&start[..16]));
        client.sync().unwrap();
        let before = client.stats().unwrap().inline_tasks;
        for _ in 0..20 {
            client
                .launch(&scale, GridCount::cover(n, 256), KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.5)))
                .unwrap();
        }
        client
            .launch(&scale, GridCount::cover(16, 256), KernelArguments::new().buffer(&small).scalar(Scalar::F32(2.0)))
            .unwrap();
        // A small read runs on the caller's thread, behind the 20 launches
        // still running; the 16 MiB one goes to the device thread (a large
        // read's host copies may use rayon's pool).
        let got_small = client.read_one(small).unwrap().to_elems::<f32>();
        let counted = client.stats().unwrap().inline_tasks;
        let got = client.read_one(x).unwrap().to_elems::<f32>();
        assert!(got == expected, "a read after 20 launches saw {} (want {})", got[1], expected[1]);
        let want_small: Vec<f32> = start[..16].iter().map(|v| v * 2.0).collect();
        assert_eq!(got_small, want_small);
        assert_eq!(client.stats().unwrap().inline_tasks, counted, "a 16 MiB read ran on the caller's thread");
        counted >= before + 22
    });
    assert!(inline, "21 launches and a small read on an idle CUDA device never all ran on the caller's thread");
}

/// The first launch of a kernel compiles it on the device thread (a caller
/// launching on several devices does not compile them one after another);
/// later launches of it run on the caller's thread.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn the_first_launch_of_a_kernel_compiles_on_the_device_thread() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    // A kernel of its own (a fresh id): nothing compiled it yet.
    let kernel = Kernel::new("add_one").with_cuda(
        r#"extern "C" __global__ void add_one(float* x, unsigned long long len) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < len / 4) x[i] += 1.0f;
}"#,
    );
    let x = client.create(Bytes::from_elems(&[1.0f32; 64]));
    client.sync().unwrap();
    let before = client.stats().unwrap().inline_tasks;
    client.launch(&kernel, GridCount::cover(64, 64), KernelArguments::new().buffer(&x)).unwrap();
    client.sync().unwrap();
    assert_eq!(client.stats().unwrap().inline_tasks, before, "the first launch compiled on the caller's thread");
    let later = (0..20).any(|_| {
        client.sync().unwrap();
        let before = client.stats().unwrap().inline_tasks;
        client.launch(&kernel, GridCount::cover(64, 64), KernelArguments::new().buffer(&x)).unwrap();
        client.stats().unwrap().inline_tasks > before
    });
    assert!(later, "a later launch of a compiled kernel never ran on the caller's thread");
    let got = client.read_one(x).unwrap().to_elems::<f32>();
    assert!(got.iter().all(|&v| v == got[0] && v >= 3.0), "{got:?}");
}

/// Behind a task the device thread is still running, a launch and a read
/// are queued (not run on the caller's thread), and the read sees the
/// launch.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn calls_behind_queued_work_are_queued_and_keep_their_order() {
    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let n = 4096;
    let (start, expected) = scaled(n, -2.0, 1);
    let x = client.create(Bytes::from_elems(&start));
    let before = client.stats().unwrap().inline_tasks;
    let (release, held) = std::sync::mpsc::channel::<()>();
    client
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    client
        .launch(
            &kernels::scale(),
            GridCount::cover(n, 256),
            KernelArguments::new().buffer(&x).scalar(Scalar::F32(-2.0)),
        )
        .unwrap();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        release.send(()).unwrap();
    });
    // Sent while the held task runs: queued behind it and the launch.
    let got = client.read_one(x).unwrap().to_elems::<f32>();
    releaser.join().unwrap();
    assert_eq!(got, expected);
    assert_eq!(client.stats().unwrap().inline_tasks, before, "a call behind a held task ran inline");
}

/// While one stream of the device captures, nothing of the device runs on
/// a caller's thread (the capture sees the device thread's work alone):
/// a launch on another stream is queued, and runs.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn nothing_runs_on_the_callers_thread_while_a_stream_captures() {
    let _serial = serial();
    let capturing = client().with_stream(StreamId::fresh());
    let other = client().with_stream(StreamId::fresh());
    let n = 4096;
    let (start, expected) = scaled(n, 3.0, 1);
    let x = other.create(Bytes::from_elems(&start));
    let y = capturing.create(Bytes::from_elems(&start));
    let scale = |client: &cohort_runtime::Client, h: &cohort_runtime::Handle| {
        client
            .launch(
                &kernels::scale(),
                GridCount::cover(n, 256),
                KernelArguments::new().buffer(h).scalar(Scalar::F32(3.0)),
            )
            .unwrap()
    };
    capturing.graph_prepare().unwrap();
    scale(&capturing, &y);
    capturing.sync().unwrap();
    other.sync().unwrap();
    let before = other.stats().unwrap().inline_tasks;
    capturing.start_capture().unwrap();
    scale(&capturing, &y);
    scale(&other, &x);
    assert_eq!(other.stats().unwrap().inline_tasks, before, "a call ran inline during a capture");
    let graph = capturing.stop_capture().unwrap();
    assert_eq!(other.read_one(x).unwrap().to_elems::<f32>(), expected);
    // The capture recorded its launch (not run): one replay runs it.
    assert_eq!(capturing.read_one(y.clone()).unwrap().to_elems::<f32>(), expected);
    graph.replay().unwrap();
    let (_, twice) = scaled(n, 3.0, 2);
    assert_eq!(capturing.read_one(y).unwrap().to_elems::<f32>(), twice);
}

/// A task that panics or fails on the caller's thread is reported as the
/// same task queued to the device thread is: its error marks its output
/// and a read returns it; a launch that cannot compile names the kernel.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_failing_inline_task_is_reported_like_a_queued_one() {
    use cohort_runtime::BufferAccess;

    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let panicking = |access: Result<&mut BufferAccess<'_>, ServerError>| -> Result<(), ServerError> {
        access?;
        panic!("a task that panics on purpose")
    };
    // Run inline: on an idle device (a few tries), counted.
    let mut inline_error = None;
    for _ in 0..20 {
        let out = client.create(Bytes::from_elems(&[1.0f32; 4]));
        client.sync().unwrap();
        let before = client.stats().unwrap().inline_tasks;
        client.submit_buffers_inline("panicking", Vec::new(), vec![out.clone()], panicking).unwrap();
        let ran_inline = client.stats().unwrap().inline_tasks > before;
        let err = client.read_one(out).unwrap_err();
        if ran_inline {
            inline_error = Some(err);
            break;
        }
    }
    let inline_error = inline_error.expect("the task never ran on the caller's thread on an idle device");
    // Queued behind a held task.
    let out = client.create(Bytes::from_elems(&[1.0f32; 4]));
    let (release, held) = std::sync::mpsc::channel::<()>();
    client
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    client.submit_buffers_inline("panicking", Vec::new(), vec![out.clone()], panicking).unwrap();
    release.send(()).unwrap();
    let queued_error = client.read_one(out).unwrap_err();
    assert_eq!(inline_error.to_string(), queued_error.to_string());
    assert!(inline_error.to_string().contains("a task that panics on purpose"), "{inline_error}");
    client.sync().unwrap();

    // A kernel that cannot compile, launched on an idle device.
    let h = client.create(Bytes::from_elems(&[1.0f32; 4]));
    client.sync().unwrap();
    let kernel = Kernel::new("broken_inline")
        .with_cuda("extern \"C\" __global__ void broken_inline(float* x, unsigned long long n) { nope = 1; }");
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h)).unwrap();
    let err = client.read_one(h).unwrap_err();
    let ServerError::KernelFailed { kernel, reason, .. } = &err else { panic!("{err}") };
    assert_eq!(kernel, "broken_inline");
    assert!(reason.contains("nope"), "{reason}");
}

/// A caller's thread that had its own CUDA context current has it current
/// again after a call ran on it (the device's primary context is current
/// only while the call runs there); a thread that had none keeps the
/// primary context.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_callers_own_context_is_current_again_after_a_call_ran_on_its_thread() {
    use cohort_runtime::backend::cuda::cudarc::driver::sys;

    let _serial = serial();
    let client = client().with_stream(StreamId::fresh());
    let x = client.create(Bytes::from_elems(&[4u32, 5, 6]));
    client.sync().unwrap();
    let current = || {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes this thread's current context (null if none).
        assert_eq!(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, sys::CUresult::CUDA_SUCCESS);
        ctx
    };
    let mut device = 0;
    let mut own: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is initialised (the client opened device 0); the
    // call writes a new context of device 0 and makes it current here.
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut device, 0), sys::CUresult::CUDA_SUCCESS);
        let created = sys::cuCtxCreate_v4(&mut own, std::ptr::null_mut(), 0, device);
        assert_eq!(created, sys::CUresult::CUDA_SUCCESS);
    }
    assert_eq!(current(), own);
    let inline = (0..20).any(|_| {
        client.sync().unwrap();
        let before = client.stats().unwrap().inline_tasks;
        assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<u32>(), [4, 5, 6]);
        assert_eq!(current(), own, "the caller's own context is no longer current");
        client.stats().unwrap().inline_tasks > before
    });
    assert!(inline, "the read never ran on the caller's thread");
    // SAFETY: the context made above, current on this thread, destroyed once.
    unsafe {
        assert_eq!(sys::cuCtxDestroy_v2(own), sys::CUresult::CUDA_SUCCESS);
    }
    // A thread with no context current keeps the device's primary one (so
    // its next call finds it current).
    let reader = client.clone();
    std::thread::spawn(move || {
        assert!(current().is_null());
        let inline = (0..20).any(|_| {
            reader.sync().unwrap();
            let before = reader.stats().unwrap().inline_tasks;
            assert_eq!(reader.read_one(x.clone()).unwrap().to_elems::<u32>(), [4, 5, 6]);
            reader.stats().unwrap().inline_tasks > before
        });
        assert!(inline, "the read never ran on the caller's thread");
        assert!(!current().is_null(), "a thread with no context has the device's primary context after a call");
    })
    .join()
    .unwrap();
}

/// A clone of a kernel given another source is another kernel: the
/// function compiled for the first source (cached by the kernel's id) must
/// not run for the second.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn a_clone_given_another_source_runs_its_own_source() {
    let _serial = serial();
    let client = client();
    let scale = kernels::scale();
    let shift = scale.clone().with_cuda(
        r#"extern "C" __global__ void scale(float* x, unsigned long long len_bytes, float amount) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < len_bytes / 4) x[i] += amount;
}"#,
    );
    let x = client.create(Bytes::from_elems(&[3.0f32; 256]));
    let args = || KernelArguments::new().buffer(&x);
    client.launch(&scale, GridCount::Static(1, 1, 1), args().scalar(Scalar::F32(2.0))).unwrap();
    client.launch(&shift, GridCount::Static(1, 1, 1), args().scalar(Scalar::F32(1.0))).unwrap();
    let values: Vec<f32> = client.read_one(x).unwrap().to_elems();
    assert!(values.iter().all(|&v| v == 7.0), "3 × 2 + 1 = 7, got {:?}", &values[..4]);
}
