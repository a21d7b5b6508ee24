//! Shared set-up: eight CPU devices, and groups over the first `n`;
//! communicators of ranks as threads.

#![allow(dead_code)]

use std::sync::Once;

use cohort_comm::store::StoreServer;
use cohort_comm::{ClientGroup, Communicator};
use cohort_runtime::{Client, CpuRuntime, Runtime};

/// Clients of CPU devices `0..n` (the process gets eight CPU devices).
pub fn clients(n: usize) -> Vec<Client> {
    static EIGHT: Once = Once::new();
    // Set before the first client exists, and before any other thread reads
    // the environment (every test calls this first).
    EIGHT.call_once(|| std::env::set_var("COHORT_CPU_DEVICES", "8"));
    (0..n).map(|i| CpuRuntime::client(i).expect("a CPU device")).collect()
}

/// A group over CPU devices `0..n`.
pub fn group(n: usize) -> ClientGroup {
    ClientGroup::new(clients(n)).expect("a valid group")
}

/// Runs `body(comm)` on `n` ranks (threads) of `local` CPU devices each
/// over a fresh store, and returns what each rank returned: rank r takes
/// CPU devices `first + r × local` onwards (tests running at once use
/// distinct devices) of the `devices` the process gets.
pub fn communicator_ranks<T: Send + 'static>(
    devices: usize,
    first: usize,
    n: usize,
    local: usize,
    body: fn(Communicator) -> T,
) -> Vec<T> {
    std::env::set_var("COHORT_CPU_DEVICES", devices.to_string());
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let clients = (0..local).map(|l| CpuRuntime::client(first + rank * local + l).unwrap()).collect();
                body(Communicator::connect(rank, n, &addr, "secret", clients).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Blocks `client`'s device thread until the returned sender is used (or
/// dropped): work queued behind it waits, and the device is not idle.
pub fn hold(client: &Client) -> std::sync::mpsc::Sender<()> {
    let (release, held) = std::sync::mpsc::channel::<()>();
    client
        .submit(move |_| {
            let _ = held.recv();
        })
        .unwrap();
    release
}
