//! Process-wide order: one lock around queueing every member's part of a
//! collective, and the communicators cached by sorted device set.
//!
//! Each member's part blocks its device thread until the other parts
//! arrive. If two groups that share devices queued their parts in different
//! orders on different devices, each device could wait for a part queued
//! behind the other's: a deadlock. Queueing all parts of one collective
//! under one process-wide lock gives every device the same order of
//! collectives, so the first collective queued on any device is the first on
//! all of its members' devices, and it always completes.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use cohort_runtime::{Client, ServiceId};
use parking_lot::{Mutex, MutexGuard};

/// The lock every collective holds while it queues its members' parts, and
/// every communicator holds while it is set up.
pub(crate) fn enqueue_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
}

/// What a group of devices shares, whatever order its members are listed
/// in: how bytes reach the host, and a count of collectives issued.
#[derive(Debug)]
pub struct DeviceSetComm {
    devices: Vec<ServiceId>,
    host_addressable: bool,
    /// Collectives queued through this communicator (for logs).
    pub(crate) issued: AtomicU64,
}

impl DeviceSetComm {
    /// The devices, sorted.
    pub fn devices(&self) -> &[ServiceId] {
        &self.devices
    }

    /// Whether every device's memory is host-addressable, so collectives can
    /// take the direct host path.
    pub fn host_addressable(&self) -> bool {
        self.host_addressable
    }
}

/// The communicator of `clients`' device set, made on first use and cached
/// by the sorted set of devices.
pub(crate) fn communicator(clients: &[Client]) -> Arc<DeviceSetComm> {
    static CACHE: OnceLock<Mutex<HashMap<Vec<ServiceId>, Arc<DeviceSetComm>>>> = OnceLock::new();
    let mut devices: Vec<ServiceId> = clients.iter().map(Client::service_id).collect();
    devices.sort();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(found) = cache.lock().get(&devices) {
        return found.clone();
    }
    let host_addressable = clients.iter().all(|c| c.capabilities().host_addressable_memory);
    let communicator =
        Arc::new(DeviceSetComm { devices: devices.clone(), host_addressable, issued: AtomicU64::new(0) });
    cache.lock().entry(devices).or_insert(communicator).clone()
}
