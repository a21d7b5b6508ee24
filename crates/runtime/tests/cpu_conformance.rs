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
    use std::sync::{Arc, Mutex};
    use std::thread::ThreadId;

    use cohort_runtime::{CpuRuntime, Runtime};

    let client = CpuRuntime::client(3).unwrap();
    let x = client.create_from_slice(&[1, 2, 3, 4]);
    client.sync().unwrap();
    let caller = std::thread::current().id();
    let ran_on: Arc<Mutex<Option<ThreadId>>> = Arc::default();
    let write = |value: u8| {
        let seen = ran_on.clone();
        move |access: Result<&mut cohort_runtime::BufferAccess<'_>, cohort_runtime::ServerError>| {
            *seen.lock().unwrap() = Some(std::thread::current().id());
            access?.write(0, &[value; 4])
        }
    };
    client.submit_buffers_inline("write", Vec::new(), vec![x.clone()], write(5)).unwrap();
    assert_eq!(*ran_on.lock().unwrap(), Some(caller), "ran on the caller's thread before the call returned");
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<u8>(), [5; 4]);

    // A slow task in flight: the write waits its turn on the device thread.
    *ran_on.lock().unwrap() = None;
    client.submit(|_| std::thread::sleep(std::time::Duration::from_millis(100))).unwrap();
    client.submit_buffers_inline("write", Vec::new(), vec![x.clone()], write(9)).unwrap();
    assert_eq!(*ran_on.lock().unwrap(), None, "queued behind the slow task, not run yet");
    assert_eq!(client.read_one(x.clone()).unwrap().to_elems::<u8>(), [9; 4]);
    assert_ne!(*ran_on.lock().unwrap(), Some(caller), "it ran on the device thread");
}
