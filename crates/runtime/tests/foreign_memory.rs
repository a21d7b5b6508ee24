//! Foreign host memory on CPU devices (`Client::adopt`): used in place,
//! never copied or allocated, and its owner dropped once, only after the
//! work queued on it finished (and, in `cuda`, the same for device memory
//! released while its kernel runs; needs a GPU).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{
    Access, Bytes, Client, CpuRuntime, ForeignMemory, GridCount, Handle, Kernel, KernelArguments, Runtime, ServerError,
    StreamId,
};

/// Four `f32`s, 16-byte aligned (the CPU backend's requirement), so a
/// `Vec<Lane>` is always adoptable.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(16))]
struct Lane([f32; 4]);

fn lanes(values: impl IntoIterator<Item = f32>) -> Vec<Lane> {
    let values: Vec<f32> = values.into_iter().collect();
    values.chunks(4).map(|c| Lane([c[0], c[1], c[2], c[3]])).collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn float_bytes(values: &[f32]) -> Bytes {
    Bytes::from_slice(&values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
}

/// An owner that counts its drops and notes whether `done` was set when
/// it was dropped.
struct Owner {
    _memory: Vec<Lane>,
    drops: Arc<AtomicUsize>,
    done: Arc<AtomicBool>,
    dropped_after_done: Arc<AtomicBool>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.dropped_after_done.store(self.done.load(Ordering::SeqCst), Ordering::SeqCst);
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

struct Watched {
    drops: Arc<AtomicUsize>,
    done: Arc<AtomicBool>,
    dropped_after_done: Arc<AtomicBool>,
}

/// Adopts `memory` read-write (or `access`) with a watched owner; returns
/// the handle, the memory's address, and the watch.
fn adopt_watched(client: &Client, mut memory: Vec<Lane>, access: Access) -> (Handle, *mut u8, Watched) {
    let ptr = memory.as_mut_ptr().cast::<u8>();
    let len = memory.len() * 16;
    let watched = Watched {
        drops: Arc::new(AtomicUsize::new(0)),
        done: Arc::new(AtomicBool::new(false)),
        dropped_after_done: Arc::new(AtomicBool::new(false)),
    };
    let owner = Owner {
        _memory: memory,
        drops: watched.drops.clone(),
        done: watched.done.clone(),
        dropped_after_done: watched.dropped_after_done.clone(),
    };
    // SAFETY: the Vec's heap memory moves with it into the owner, which
    // the handle keeps alive; nothing else touches it.
    let handle = unsafe { client.adopt(ForeignMemory::Host { ptr, len }, Box::new(owner), access) }.unwrap();
    (handle, ptr, watched)
}

/// Doubles every `f32` of buffer 0.
fn double() -> Kernel {
    Kernel::new("double").with_cpu(|ctx| {
        for x in ctx.buffer::<f32>(0) {
            *x *= 2.0;
        }
    })
}

/// Sleeps, then sets `done` (a slow kernel holding its buffer).
fn slow(done: Arc<AtomicBool>, millis: u64) -> Kernel {
    Kernel::new("slow").with_cpu(move |_| {
        std::thread::sleep(Duration::from_millis(millis));
        done.store(true, Ordering::SeqCst);
    })
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn adopted_host_memory_is_used_in_place_without_an_allocation() {
    let client = CpuRuntime::client(0).unwrap();
    let usage = client.memory_usage().unwrap();
    let (handle, ptr, watched) = adopt_watched(&client, lanes((0..8).map(|i| i as f32)), Access::ReadWrite);
    assert!(handle.is_foreign());
    assert_eq!(handle.access(), Access::ReadWrite);
    assert_eq!(handle.size(), 32);
    assert_eq!(client.device_address(&handle).unwrap(), ptr as u64, "the handle names the Vec's own bytes");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), (0..8).map(|i| i as f32).collect::<Vec<_>>());

    client.write(&handle, float_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])).unwrap();
    client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    client.sync().unwrap();
    let expected = [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0];
    // SAFETY: the owner (and so the Vec) lives while `handle` does, and the
    // device's work on it is done (synced).
    let seen = unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), 8) }.to_vec();
    assert_eq!(seen, expected, "the kernel wrote the caller's memory");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), expected);

    // A slice of it, and a device copy from a cohort buffer into it.
    let half = handle.slice(16, 16).unwrap();
    assert_eq!(floats(&client.read_one(half.clone()).unwrap()), &expected[4..]);
    assert_eq!(client.memory_usage().unwrap(), usage, "adopting, writing and launching allocated nothing");
    let source = client.create(float_bytes(&[-1.0, -2.0, -3.0, -4.0]));
    client.submit_buffers("copy", vec![source], vec![half.clone()], |access| access.copy(0, 1)).unwrap();
    client.sync().unwrap();
    // SAFETY: as above.
    let seen = unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), 8) }.to_vec();
    assert_eq!(seen, [2.0, 4.0, 6.0, 8.0, -1.0, -2.0, -3.0, -4.0]);
    assert_eq!(client.device_address(&half).unwrap(), ptr as u64 + 16);

    drop((handle, half));
    client.sync().unwrap();
    assert_eq!(watched.drops.load(Ordering::SeqCst), 1, "the owner goes with the last handle, once");
}

#[test]
fn the_owner_outlives_the_work_queued_on_its_memory() {
    let client = CpuRuntime::client(1).unwrap();
    let (handle, _, watched) = adopt_watched(&client, lanes([1.0; 4]), Access::ReadWrite);
    let kernel = slow(watched.done.clone(), 300);
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    // The last user handle goes while the kernel is queued or running.
    drop(handle);
    // Dropped by the device once idle, without a sync from anyone.
    wait_until("the owner is dropped", || watched.drops.load(Ordering::SeqCst) == 1);
    assert!(watched.dropped_after_done.load(Ordering::SeqCst), "the owner was dropped before the kernel ended");
    client.sync().unwrap();
    assert_eq!(watched.drops.load(Ordering::SeqCst), 1, "dropped exactly once");
}

#[test]
fn an_idle_device_drops_the_owner_of_memory_released_on_another_thread() {
    let client = CpuRuntime::client(1).unwrap();
    let (handle, _, watched) = adopt_watched(&client, lanes([1.0; 4]), Access::ReadWrite);
    client.sync().unwrap();
    // The device has nothing queued; the last handle goes on this thread,
    // and nobody calls the device after.
    std::thread::spawn(move || drop(handle)).join().unwrap();
    wait_until("the idle device drops the owner", || watched.drops.load(Ordering::SeqCst) == 1);
}

#[test]
fn the_last_handle_on_an_idle_device_drops_its_owner_at_once_on_its_own_thread() {
    /// Notes the thread that drops it.
    struct Noted {
        _memory: Vec<Lane>,
        dropped_on: Arc<std::sync::Mutex<Option<std::thread::ThreadId>>>,
    }
    impl Drop for Noted {
        fn drop(&mut self) {
            *self.dropped_on.lock().unwrap() = Some(std::thread::current().id());
        }
    }
    let client = CpuRuntime::client(1).unwrap();
    // Other tests of this file queue work on this device now and then: a
    // release that finds the device busy (or its state held for a moment)
    // is handed to the device thread instead, as it should be. So, tries.
    let at_once = (0..50).any(|_| {
        let mut memory = lanes([1.0; 4]);
        let ptr = memory.as_mut_ptr().cast::<u8>();
        let dropped_on = Arc::new(std::sync::Mutex::new(None));
        let owner = Box::new(Noted { _memory: memory, dropped_on: dropped_on.clone() });
        // SAFETY: the Vec moves into the owner, which the handle keeps alive.
        let handle = unsafe { client.adopt(ForeignMemory::Host { ptr, len: 16 }, owner, Access::ReadWrite) }.unwrap();
        // Work queued on it, and finished.
        client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
        client.sync().unwrap();
        drop(handle);
        let dropped_here = *dropped_on.lock().unwrap() == Some(std::thread::current().id());
        wait_until("the owner is dropped", || dropped_on.lock().unwrap().is_some());
        dropped_here
    });
    assert!(at_once, "the owner was never dropped by the drop of the last handle on an idle device");
}

#[test]
fn a_release_while_the_device_is_busy_never_waits_and_the_device_drops_the_owner() {
    let client = CpuRuntime::client(0).unwrap();
    let (handle, _, watched) = adopt_watched(&client, lanes([1.0; 4]), Access::ReadWrite);
    client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    // The device is busy, with work on another buffer that runs until the
    // gate opens (or 20 s pass), when the last handle of the memory goes.
    let (gate, ended) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let gated = {
        let (gate, ended) = (gate.clone(), ended.clone());
        Kernel::new("gated").with_cpu(move |_| {
            let started = Instant::now();
            while !gate.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(1));
            }
            ended.store(true, Ordering::SeqCst);
        })
    };
    let other = client.create(float_bytes(&[0.0; 4]));
    client.launch(&gated, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&other)).unwrap();
    drop(handle);
    assert!(!ended.load(Ordering::SeqCst), "the drop waited for the busy device");
    gate.store(true, Ordering::SeqCst);
    // Nobody calls the device after: it drops the owner once it is done.
    wait_until("the owner is dropped", || watched.drops.load(Ordering::SeqCst) == 1);
    client.sync().unwrap();
    assert_eq!(watched.drops.load(Ordering::SeqCst), 1, "dropped exactly once");
}

#[test]
fn an_owner_that_panics_when_dropped_does_not_end_the_device() {
    struct Panics {
        _memory: Vec<Lane>,
        dropped: Arc<AtomicBool>,
    }
    impl Drop for Panics {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
            panic!("the owner's own bug");
        }
    }
    let client = CpuRuntime::client(1).unwrap();
    let mut memory = lanes([1.0; 4]);
    let ptr = memory.as_mut_ptr().cast::<u8>();
    let dropped = Arc::new(AtomicBool::new(false));
    let owner = Box::new(Panics { _memory: memory, dropped: dropped.clone() });
    // SAFETY: the Vec moves into the owner, which the handle keeps alive.
    let handle = unsafe { client.adopt(ForeignMemory::Host { ptr, len: 16 }, owner, Access::ReadWrite) }.unwrap();
    let kernel = slow(Arc::new(AtomicBool::new(false)), 50);
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    drop(handle);
    wait_until("the owner is dropped", || dropped.load(Ordering::SeqCst));
    let h = client.create_from_slice(&[1, 2, 3, 4]);
    assert_eq!(&client.read_one(h).unwrap()[..], &[1, 2, 3, 4], "the device still serves");
    client.sync().unwrap();
}

#[test]
fn reclaim_gives_the_same_vec_back() {
    let client = CpuRuntime::client(0).unwrap();
    let mut memory = lanes([0.0; 8]);
    let ptr = memory.as_mut_ptr();
    // SAFETY: the Vec moves into the owner; nothing else touches it.
    let handle =
        unsafe { client.adopt(ForeignMemory::Host { ptr: ptr.cast(), len: 32 }, Box::new(memory), Access::ReadWrite) }
            .unwrap();
    client.write(&handle, float_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])).unwrap();
    client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();

    // Refused while another clone lives, with the handle given back whole.
    let clone = handle.clone();
    let (handle, err) = client.reclaim(handle).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("other clone"), "{err}");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap())[0], 2.0, "the returned handle still works");
    drop(clone);

    // Asked for an owner of another type: refused, the handle given back
    // and still working (the owner was not taken, the memory not forgotten).
    let (handle, err) = client.reclaim_as::<Vec<f32>>(handle).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("not a alloc::vec::Vec<f32>"), "{err}");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap())[0], 2.0, "the returned handle still works");

    let memory: Vec<Lane> = client.reclaim_as(handle).map_err(|(_, e)| e).unwrap();
    assert_eq!(memory.as_ptr(), ptr, "the same allocation: no copy either way");
    assert_eq!(memory, lanes([2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]), "with the device's work in it");

    let own = client.empty(16);
    let (_, err) = client.reclaim(own).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("allocated by cohort"), "{err}");
}

#[test]
fn a_revoked_borrow_errors_on_use_and_its_owner_goes_with_the_last_clone() {
    let client = CpuRuntime::client(2).unwrap();
    let (handle, _, watched) = adopt_watched(&client, lanes([3.0; 4]), Access::ReadWrite);
    let clone = handle.slice(0, 8).unwrap();
    let kernel = slow(watched.done.clone(), 200);
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    client.revoke(&handle).unwrap();
    assert!(watched.done.load(Ordering::SeqCst), "revoke returned before the work queued on the memory ended");
    assert_eq!(watched.drops.load(Ordering::SeqCst), 0, "clones live: the owner stays");

    let err = client.read_one(clone.clone()).unwrap_err();
    assert!(err.to_string().contains("was given back"), "{err}");
    client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&clone)).unwrap();
    let err = client.check([&clone]).unwrap_err();
    assert!(err.to_string().contains("was given back"), "{err}");
    client.revoke(&handle).unwrap();

    drop((handle, clone));
    client.sync().unwrap();
    assert_eq!(watched.drops.load(Ordering::SeqCst), 1);
    assert!(client.revoke(&client.empty(4)).unwrap_err().to_string().contains("allocated by cohort"));
}

#[test]
fn read_only_memory_is_never_written() {
    // A stream of its own: the refusals it keeps for a sync are its own.
    let client = CpuRuntime::client(2).unwrap().with_stream(StreamId::fresh());
    let (handle, ptr, _watched) = adopt_watched(&client, lanes([1.0, 2.0, 3.0, 4.0]), Access::ReadOnly);
    assert_eq!(handle.access(), Access::ReadOnly);
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), [1.0, 2.0, 3.0, 4.0]);

    // Refused by the call itself, before anything is queued.
    let err = client.write(&handle, float_bytes(&[9.0; 4])).unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
    let err = client.launch(&double(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
    let err = client.submit_buffers("a copy into it", vec![], vec![handle.clone()], |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("a copy into it would write a read-only handle"), "{err}");
    client.sync().expect("nothing was queued, so nothing failed");

    // SAFETY: the owner lives while `handle` does; the device's work is done.
    let seen = unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), 4) }.to_vec();
    assert_eq!(seen, [1.0, 2.0, 3.0, 4.0], "nothing wrote it");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), [1.0, 2.0, 3.0, 4.0], "and it reads fine");
    assert!(handle.check_writable("all_reduce").unwrap_err().to_string().contains("all_reduce would write"));
}

#[test]
fn unusable_memory_is_refused_before_anything_runs() {
    let client = CpuRuntime::client(0).unwrap();
    let mut memory = lanes([0.0; 8]);
    let base = memory.as_mut_ptr().cast::<u8>();
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let cases = [
        (std::ptr::null_mut(), 16, "null pointer"),
        (base, 0, "0 bytes"),
        // SAFETY: inside the Vec's allocation; never dereferenced (refused).
        (unsafe { base.add(4) }, 16, "16-byte boundary"),
    ];
    for (i, (ptr, len, says)) in cases.into_iter().enumerate() {
        // SAFETY: refused before the memory is touched.
        let adopted = unsafe {
            client.adopt(ForeignMemory::Host { ptr, len }, Box::new(Counted(dropped.clone())), Access::ReadWrite)
        };
        let err = adopted.unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
        assert!(matches!(err.error(), ServerError::InvalidArgument(_)), "{err}");
        // Nothing lost: the owner and the memory come back as they were given.
        let (_, memory, owner) = err.into_parts();
        assert!(matches!(memory, ForeignMemory::Host { ptr: p, len: l } if p == ptr && l == len), "{memory:?}");
        let owner = owner.downcast::<Counted>().expect("the owner that was given");
        assert_eq!(dropped.load(Ordering::SeqCst), i, "a refused owner is given back, not dropped");
        drop(owner);
        assert_eq!(dropped.load(Ordering::SeqCst), i + 1);
    }
    assert_eq!(memory[0], Lane([0.0; 4]));
    // `?` still works where the owner does not matter.
    let refused = || -> Result<Handle, ServerError> {
        // SAFETY: refused before the memory is touched (0 bytes).
        Ok(unsafe { client.adopt(ForeignMemory::Host { ptr: base, len: 0 }, Box::new(()), Access::ReadWrite)? })
    };
    assert!(refused().unwrap_err().to_string().contains("0 bytes"));
}

/// The client of CPU device `index`, opened again after a close.
fn reopened(index: usize) -> Client {
    CpuRuntime::client(index).unwrap()
}

#[test]
fn a_device_closed_with_adopted_memory_alive_drops_each_owner_once() {
    // A device no other test of this file uses: it is closed here.
    let device = CpuRuntime::device_count().unwrap() - 1;
    assert!(device >= 3, "this test needs 4 CPU devices");
    let client = CpuRuntime::client(device).unwrap();
    let (alive, _, kept) = adopt_watched(&client, lanes([1.0; 4]), Access::ReadWrite);
    let (in_flight, _, released) = adopt_watched(&client, lanes([2.0; 4]), Access::ReadWrite);
    let kernel = slow(released.done.clone(), 200);
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&in_flight)).unwrap();
    drop(in_flight);
    client.close();
    assert_eq!(released.drops.load(Ordering::SeqCst), 1, "released before the close: dropped by it");
    assert!(released.dropped_after_done.load(Ordering::SeqCst), "after the queued kernel");
    assert_eq!(kept.drops.load(Ordering::SeqCst), 0, "its handle lives");
    assert!(matches!(client.read_one(alive.clone()), Err(ServerError::DeviceClosed { .. })));
    drop(alive);
    assert_eq!(kept.drops.load(Ordering::SeqCst), 1, "dropped with the last handle, the device being gone");
    assert_eq!(released.drops.load(Ordering::SeqCst), 1);
    // Adopting on the closed device is refused, the owner given back.
    let mut memory = lanes([4.0; 4]);
    let ptr = memory.as_mut_ptr().cast::<u8>();
    // SAFETY: refused before the memory is touched (the device is closed).
    let err =
        unsafe { client.adopt(ForeignMemory::Host { ptr, len: 16 }, Box::new(memory), Access::ReadWrite) }.unwrap_err();
    assert!(matches!(err.error(), ServerError::DeviceClosed { .. }), "{err}");
    let memory = err.into_owner().downcast::<Vec<Lane>>().expect("the Vec given back");
    assert_eq!((memory.as_ptr().cast::<u8>(), &memory[..]), (ptr.cast_const(), &lanes([4.0; 4])[..]));
    // The last handle of memory on a closed device gives its owner back.
    let client = reopened(device);
    let (reclaimed, _, watched) = adopt_watched(&client, lanes([3.0; 4]), Access::ReadWrite);
    let clone = reclaimed.clone();
    client.close();
    let (reclaimed, err) = client.reclaim(reclaimed).map(|_| ()).unwrap_err();
    assert!(matches!(err, ServerError::DeviceClosed { .. }), "a clone lives: {err}");
    drop(clone);
    let owner = client.reclaim(reclaimed).map_err(|(_, e)| e).expect("the owner back from a closed device");
    assert_eq!(watched.drops.load(Ordering::SeqCst), 0);
    drop(owner);
    assert_eq!(watched.drops.load(Ordering::SeqCst), 1);
}

/// CUDA: the last handle's drop on an idle device retires the memory on
/// the dropping thread, but a kernel still running on it keeps the owner
/// until it ends (its fence is polled by the device thread).
#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cohort_runtime::{Access, CudaRuntime, ForeignMemory, GridCount, Kernel, KernelArguments, Runtime, StreamId};
    use cudarc::driver::{sys, CudaContext, CudaSlice, DevicePtr};

    /// Reads the first float of its slice when dropped.
    struct Owner {
        ctx: Arc<CudaContext>,
        ptr: u64,
        _slice: CudaSlice<f32>,
        seen: Arc<AtomicU32>,
    }

    impl Drop for Owner {
        fn drop(&mut self) {
            let mut first = f32::NAN;
            // SAFETY: reads 4 bytes of the live slice; synchronous on the
            // legacy stream, which does not wait for cohort's non-blocking
            // streams: it sees what the kernel wrote by now (NaN where the
            // read failed, which the test reports).
            unsafe {
                if self.ctx.bind_to_thread().is_ok() {
                    let _ = sys::cuMemcpyDtoH_v2((&mut first as *mut f32).cast(), self.ptr, 4);
                }
            }
            self.seen.store(first.to_bits() | 1 << 31, Ordering::SeqCst);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
    fn the_owner_of_memory_dropped_by_an_idle_devices_caller_waits_for_its_running_kernel() {
        let client = CudaRuntime::client(0).expect("CUDA device 0").with_stream(StreamId::fresh());
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        let slice = stream.alloc_zeros::<f32>(64).unwrap();
        stream.synchronize().unwrap();
        let ptr = {
            let (ptr, _synced) = slice.device_ptr(&stream);
            ptr
        };
        let slow = Kernel::new("slow_flag").with_cuda(
            r#"extern "C" __global__ void slow_flag(float* x, unsigned long long len) {
    long long start = clock64();
    while (clock64() - start < 200000000LL) {}
    x[0] = 42.0f;
}"#,
        );
        // Compiled by a first launch on a cohort buffer: the launch below is
        // then queued by this thread on the idle device, and the handle's
        // last clone is the one this test drops, the kernel still running.
        let warm = client.empty(256);
        client.launch(&slow, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&warm)).unwrap();
        client.sync().unwrap();
        let seen = Arc::new(AtomicU32::new(0));
        let owner = Owner { ctx: ctx.clone(), ptr, _slice: slice, seen: seen.clone() };
        // SAFETY: the slice lives in the owner; nothing else writes it.
        let handle =
            unsafe { client.adopt(ForeignMemory::Cuda { ptr, len: 256 }, Box::new(owner), Access::ReadWrite) }.unwrap();
        client.launch(&slow, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
        drop(handle);
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the owner was never dropped");
            std::thread::sleep(Duration::from_millis(5));
        }
        let bits = seen.load(Ordering::SeqCst) & !(1 << 31);
        assert_eq!(f32::from_bits(bits), 42.0, "the owner was dropped before the kernel wrote its flag");
    }
}
