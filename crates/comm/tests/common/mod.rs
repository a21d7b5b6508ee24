//! Shared set-up: eight CPU devices, and groups over the first `n`.

#![allow(dead_code)]

use std::sync::Once;

use cohort_comm::ClientGroup;
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
