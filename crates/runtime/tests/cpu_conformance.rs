//! The runtime conformance suite on the CPU backend.

cohort_runtime::conformance_tests!(cohort_runtime::CpuRuntime);

/// The CPU has no device clock: `profile` times on the host.
#[test]
fn profile_reports_its_method() {
    cohort_runtime::conformance::profile_reports_its_method::<cohort_runtime::CpuRuntime>(
        cohort_runtime::TimingMethod::Host,
    );
}

/// A buffer task submitted with `submit_buffers_inline` runs on the calling
/// thread, before the call returns, when the device has nothing queued or
/// running; behind queued work it is queued too, and runs after that work
/// on the device thread.
#[test]
fn an_inline_task_runs_at_once_on_an_idle_device_and_in_queue_order_otherwise() {
    use std::sync::{mpsc, Arc, Mutex};
    use std::thread::ThreadId;

    use cohort_runtime::{BufferAccess, CpuRuntime, Runtime, ServerError};

    let client = CpuRuntime::client(3).unwrap();
    let x = client.create_from_slice(&[1, 2, 3, 4]);
    let caller = std::thread::current().id();
    let ran_on: Arc<Mutex<Option<ThreadId>>> = Arc::default();
    let write = |value: u8| {
        let seen = ran_on.clone();
        move |access: Result<&mut BufferAccess<'_>, ServerError>| {
            *seen.lock().unwrap() = Some(std::thread::current().id());
            access?.write(0, &[value; 4])
        }
    };
    // Idle once the sync returned (the device thread lets go of its state a
    // moment after it answered, and a loaded machine may take it off its
    // core in that moment: a few tries).
    let inline = (0..100).any(|_| {
        client.sync().unwrap();
        client.submit_buffers_inline("write", Vec::new(), vec![x.clone()], write(5)).unwrap();
        *ran_on.lock().unwrap() == Some(caller)
    });
    assert!(inline, "never ran on the caller's thread on an idle device");
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<u8>(), [5; 4]);

    // A task holding the device: the write is queued behind it.
    *ran_on.lock().unwrap() = None;
    let (release, held) = mpsc::channel::<()>();
    client
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    client.submit_buffers_inline("write", Vec::new(), vec![x.clone()], write(9)).unwrap();
    assert_eq!(*ran_on.lock().unwrap(), None, "queued behind the held task, not run yet");
    release.send(()).unwrap();
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<u8>(), [9; 4]);
    let ran = ran_on.lock().unwrap().expect("it ran");
    assert_ne!(ran, caller, "it ran on the device thread");
}
