//! The pool demo: how a device's memory pools grow, get reused and are given
//! back, step by step, with a second thread showing its own stream.
//!
//! Run: `cargo run --release --example memory_pools`

use cohort::prelude::*;
use cohort::runtime::{Client, MemoryScope};

const MIB: usize = 1024 * 1024;

fn usage(client: &Client, label: &str) {
    let u = client.memory_report(MemoryScope::CurrentStream).expect("memory report").total;
    println!("{label:<34} allocs={:<3} in_use={:>9} reserved={:>9}", u.allocations, u.bytes_in_use, u.bytes_reserved);
}

fn pools(client: &Client) {
    let report = client.memory_report(MemoryScope::CurrentStream).expect("memory report");
    for stream in &report.streams {
        for pool in &stream.pools {
            println!("  {pool}");
        }
    }
}

fn main() -> Result<(), ServerError> {
    let client = CpuRuntime::client(0)?;
    println!("device: {} ({})", client.properties().name, client.device_id());
    usage(&client, "start");
    let data = vec![1u8; MIB];
    let handles: Vec<_> = (0..8).map(|_| client.create_from_slice(&data)).collect();
    usage(&client, "8 x 1 MiB created");
    pools(&client);
    drop(handles);
    usage(&client, "dropped");
    let again: Vec<_> = (0..8).map(|_| client.create_from_slice(&data)).collect();
    usage(&client, "8 x 1 MiB created again");
    drop(again);
    let big = client.create_from_slice(&vec![0u8; 64 * MIB]);
    usage(&client, "one 64 MiB created");
    pools(&client);
    drop(big);
    usage(&client, "64 MiB dropped");
    client.memory_cleanup()?;
    usage(&client, "memory_cleanup");
    pools(&client);

    println!();
    let _main = client.create_from_slice(&data);
    let worker = std::thread::spawn({
        let client = client.clone();
        let data = data.clone();
        move || {
            let handle = client.create_from_slice(&data);
            let mine = client.memory_report(MemoryScope::CurrentStream).expect("memory report");
            println!("worker thread CurrentStream: {} stream(s)", mine.streams.len());
            handle
        }
    });
    let _worker_handle = worker.join().expect("worker thread");
    let device = client.memory_report(MemoryScope::Device)?;
    for stream in device.streams.iter().filter(|s| s.usage.allocations > 0) {
        println!("{:?}: {}", stream.stream, stream.usage);
    }
    cohort::runtime::shutdown();
    Ok(())
}
