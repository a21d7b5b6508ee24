//! The device path of a [`crate::ClientGroup`]: collectives that move bytes
//! device to device through the backend's [`DeviceCollectives`] (NCCL on
//! CUDA), a group of one device that needs no library at all, and peer
//! copies between devices that reach each other's memory.
//!
//! A group takes this path when every member's backend offers device
//! collectives; with more than one member it also needs the library
//! (libnccl) to load, and falls back to host staging, saying so once, when
//! it does not. `COHORT_DISABLE_NCCL=1` forces that fallback;
//! `COHORT_NCCL_SINGLE=1` sends groups of one device through NCCL too
//! (a one-rank communicator) instead of a plain device copy. A single
//! collective of one device runs as a [`Solo`] (no meeting).
//!
//! NCCL ranks follow member order (all-gather and reduce-scatter lay blocks
//! out by rank), so a communicator is kept per device set *and* member
//! order: every group over the same devices in the same order shares it.

pub(crate) mod fusion;
mod meeting;
pub mod peer;
pub(crate) mod plan;
pub(crate) mod solo;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use cohort_runtime::backend::DeviceCollectives;
use cohort_runtime::config;
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, Handle, ServerError, ServiceId, TaskHandles};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::error::CommError;
use crate::meeting::Ticket;
use crate::op::{Collective, Op};
use crate::order::enqueue_lock;

pub(crate) use meeting::DeviceCollective;
pub(crate) use solo::Solo;

/// How a group's collectives move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// NCCL (or the backend's device collectives): device to device.
    Nccl,
    /// A group of one device: device copies, or nothing in place.
    LocalCopy,
    /// Host memory, reduced in place through host pointers (CPU devices).
    HostDirect,
    /// Host memory, staged chunk by chunk (devices the host cannot address).
    HostStaged,
}

/// The route a group's collectives take on the device path.
#[derive(Debug, Clone)]
pub(crate) enum Route {
    /// Host staging (or direct host access).
    Host,
    /// One device: copies on its own stream.
    Local,
    /// The backend's communicator of this device set.
    Nccl(Arc<NcclSet>),
}

/// One device set in member order, with the id its communicators are made
/// from.
#[derive(Debug)]
pub(crate) struct NcclSet {
    pub key: u64,
    pub devices: Vec<ServiceId>,
    pub unique_id: Vec<u8>,
    /// Whether two members run on one GPU (`COHORT_CUDA_DEVICES`): NCCL
    /// takes one rank per GPU, so such a set runs only the peer kernels,
    /// and its other calls go through the host.
    pub shared_gpu: bool,
    /// The most devices shown on any member's GPU (1 unless
    /// `COHORT_CUDA_DEVICES` shows several on one): the peer kernels'
    /// share of a GPU's resident blocks (`PeerSpec::sharing`).
    pub sharing: usize,
}

/// What a device's backend offers, asked once per device opening.
#[derive(Debug, Clone)]
struct Offer {
    device: bool,
    library: Result<(), String>,
}

/// Runs `f` on `client`'s device thread with its device collectives, and
/// waits for the answer; `None` where the backend has none or the device
/// failed.
pub(crate) fn ask<R: Send + 'static>(
    client: &Client,
    f: impl FnOnce(&mut dyn DeviceCollectives) -> R + Send + 'static,
) -> Option<R> {
    let (tx, rx) = crossbeam::channel::bounded(1);
    let queued = client.submit_buffers_always("device-path probe", Vec::new(), Vec::new(), move |access| {
        let answer = access.ok().and_then(|a: &mut BufferAccess<'_>| a.device_collectives().map(f));
        let _ = tx.send(answer);
        Ok(())
    });
    queued.ok()?;
    rx.recv().ok().flatten()
}

fn offer(client: &Client) -> Offer {
    static KNOWN: OnceLock<Mutex<HashMap<ServiceId, Offer>>> = OnceLock::new();
    let known = KNOWN.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(found) = known.lock().get(&client.service_id()) {
        return found.clone();
    }
    let none = || Offer { device: false, library: Err("the backend has no device collectives".into()) };
    if !client.capabilities().device_collectives {
        return none();
    }
    let found = match ask(client, |dc| dc.available()) {
        Some(library) => Offer { device: true, library },
        None => none(),
    };
    known.lock().insert(client.service_id(), found.clone());
    found
}

/// Whether groups of one device go through a one-rank NCCL communicator
/// (`COHORT_NCCL_SINGLE`, read once; an unusable value is refused by
/// `ClientGroup::new`, and means the default, off, here).
fn single_through_nccl() -> bool {
    static SINGLE: OnceLock<bool> = OnceLock::new();
    *SINGLE.get_or_init(|| config::NCCL_SINGLE.get().unwrap_or(config::NCCL_SINGLE.fallback))
}

fn warn_fallback(backend: &str, why: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "{backend} collectives fall back to host staging (device to host, reduce on the host, back): {why}"
        )
    });
}

/// The route `clients`' collectives take by default. Waits for one probe
/// task per device the first time a device is seen, and for one more to
/// make a new device set's communicator id.
pub(crate) fn choose(clients: &[Client]) -> Route {
    let offers: Vec<Offer> = clients.iter().map(offer).collect();
    if !offers.iter().all(|o| o.device) {
        return Route::Host;
    }
    if clients.len() == 1 && !single_through_nccl() {
        return Route::Local;
    }
    if let Some(Err(why)) = offers.iter().map(|o| o.library.clone()).find(Result::is_err) {
        warn_fallback(clients[0].name(), &why);
        return Route::Host;
    }
    match nccl_set(clients) {
        Ok(set) => Route::Nccl(set),
        Err(err) => {
            warn_fallback(clients[0].name(), &err.to_string());
            Route::Host
        }
    }
}

fn sets() -> &'static Mutex<HashMap<Vec<ServiceId>, Arc<NcclSet>>> {
    static SETS: OnceLock<Mutex<HashMap<Vec<ServiceId>, Arc<NcclSet>>>> = OnceLock::new();
    SETS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The communicator set of `clients` in member order, made on first use
/// (asks the first member's device for a fresh id).
pub(crate) fn nccl_set(clients: &[Client]) -> Result<Arc<NcclSet>, ServerError> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let devices: Vec<ServiceId> = clients.iter().map(Client::service_id).collect();
    if let Some(found) = sets().lock().get(&devices) {
        return Ok(found.clone());
    }
    let unique_id = ask(&clients[0], |dc| dc.unique_id()).unwrap_or_else(|| {
        Err(ServerError::Unsupported { feature: "device collectives", backend: clients[0].name() })
    })?;
    let gpus: Vec<Option<u32>> = clients.iter().map(|c| c.properties().gpu).collect();
    let shared_gpu = (1..gpus.len()).any(|m| gpus[m].is_some() && gpus[..m].contains(&gpus[m]));
    let sharing = clients.iter().map(|c| c.properties().devices_on_gpu as usize).max().unwrap_or(1).max(1);
    let key = NEXT.fetch_add(1, Ordering::Relaxed);
    let set = Arc::new(NcclSet { key, devices: devices.clone(), unique_id, shared_gpu, sharing });
    Ok(sets().lock().entry(devices).or_insert(set).clone())
}

/// Forgets a set whose communicator failed, so the next group over these
/// devices makes a fresh one (the failed one was aborted).
pub(crate) fn forget(set: &NcclSet) {
    let mut sets = sets().lock();
    if sets.get(&set.devices).is_some_and(|s| s.key == set.key) {
        sets.remove(&set.devices);
    }
}

/// How one collective's parts run.
#[derive(Debug, Clone)]
pub(crate) enum Mode {
    /// Copies on each member's own device (groups of one, sends to self).
    Local,
    /// Calls on the set's communicator; a part's rank is its slot.
    Nccl(Arc<NcclSet>),
    /// A peer copy from slot 0 to slot 1.
    Peer,
    /// A peer-memory kernel (all-reduce or all-gather) among the set's
    /// devices; a part's rank is its slot.
    PeerKernel(Arc<NcclSet>, cohort_runtime::backend::PeerAlgo),
}

/// Queues every part of one collective on the device path under the
/// process-wide order; returns the meeting (to wait on). `members[slot]`
/// takes slot `slot`, whose source and destination are `part(0, slot)`.
/// `op`'s roots and endpoints are slots.
pub(crate) fn launch<'h>(
    clients: &[Client],
    timeout: Duration,
    op: Op,
    mode: Mode,
    members: &[usize],
    part: impl Fn(usize, usize) -> (Option<&'h Handle>, Option<&'h Handle>),
    tracked: Option<Arc<crate::trace::Watched>>,
) -> Result<Arc<DeviceCollective>, CommError> {
    launch_grouped(clients, timeout, op.name(), smallvec::smallvec![op], members, part, mode, tracked)
}

/// Queues a grouped call on the device path: one task per member carrying
/// every call's buffers, whose NCCL calls go inside one
/// `ncclGroupStart/End`. `members[slot]` takes slot `slot` of every call;
/// `part(call, slot)` is that slot's source and destination in call `call`
/// (`mode` must be [`Mode::Nccl`] for more than one call). The caller's
/// thread builds no per-call object: each slot's task gets one list of
/// sources, one of destinations and one of shapes for all the calls.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_grouped<'h>(
    clients: &[Client],
    timeout: Duration,
    operation: &'static str,
    ops: SmallVec<[Op; 1]>,
    members: &[usize],
    part: impl Fn(usize, usize) -> (Option<&'h Handle>, Option<&'h Handle>),
    mode: Mode,
    tracked: Option<Arc<crate::trace::Watched>>,
) -> Result<Arc<DeviceCollective>, CommError> {
    let n = members.len();
    let devices = members.iter().map(|&m| (m, clients[m].device_id()));
    // A grouped call's all-reduces on NCCL fuse (see `fusion`).
    let buckets = match mode {
        Mode::Nccl(_) if ops.len() > 1 => fusion::buckets(&ops, fusion::cap()),
        _ => Vec::new(),
    };
    if let (Mode::Nccl(_), Some(t)) = (&mode, &tracked) {
        // The flight recorder and the timeline say whether it fused (a
        // path noted before stays).
        t.set_path(if buckets.is_empty() { "nccl" } else { "nccl fused" });
    }
    let bucket_bytes: SmallVec<[u64; 4]> = buckets.iter().map(|b| b.bytes).collect();
    let nccl = matches!(mode, Mode::Nccl(_));
    let calls = ops.len();
    let blocks: SmallVec<[(u64, Collective); 1]> =
        ops.iter().map(|op| (op.block_bytes() as u64, op.collective())).collect();
    // A collective of one part meets nobody but itself, and queues its
    // device work without waiting for it (a copy, or calls on a one-rank
    // communicator, whose creation waits for no one either): where its
    // device is idle it is queued from this thread at once, without the
    // hand-over to the device thread (see `Client::submit_buffers_recorded_inline`),
    // and a waiter polls the device for its end itself. Not a barrier: its
    // part waits for the device's work, which this thread must not do while
    // it holds the device and the process-wide enqueue order.
    let barrier = ops.iter().any(|op| op.collective() == Collective::Barrier);
    let inline = n == 1 && !barrier && matches!(mode, Mode::Local | Mode::Nccl(_));
    // A waiter polls the devices whose parts leave calls running there
    // itself before it waits for their threads to say so (a part seen
    // ending on the device thread reaches a waiter through a wake-up).
    let helpers: SmallVec<[Client; 2]> = if inline || (!barrier && matches!(mode, Mode::Nccl(_) | Mode::PeerKernel(..)))
    {
        members.iter().map(|&m| clients[m].clone()).collect()
    } else {
        SmallVec::new()
    };
    let meeting = DeviceCollective::grouped(ops, buckets, operation, devices, timeout, helpers);
    stages::mark(Stage::MeetingBuilt);
    // Per slot: sources, then destinations and scratch, and each call's
    // shape; built and queued slot by slot.
    let mut tasks: SmallVec<[_; 4]> = SmallVec::with_capacity(n);
    for (slot, &member) in members.iter().enumerate() {
        let client = &clients[member];
        let (mut inputs, mut outputs) = (TaskHandles::new(), TaskHandles::new());
        let mut shapes: SmallVec<[plan::Shape; 1]> = SmallVec::with_capacity(calls);
        for (call, &(seg, collective)) in blocks.iter().enumerate() {
            let (input, output) = part(call, slot);
            let scratch = nccl && plan::sends_from_copy(collective, input, output);
            inputs.extend(input.cloned());
            outputs.extend(output.cloned());
            if scratch {
                outputs.push(client.empty(seg as usize * n));
            }
            shapes.push(plan::Shape { input: input.is_some(), output: output.is_some(), scratch });
        }
        // Each bucket's scratch (from the pool), after every other buffer.
        let scratch: SmallVec<[usize; 4]> = bucket_bytes
            .iter()
            .map(|&bytes| {
                outputs.push(client.empty(bytes as usize));
                inputs.len() + outputs.len() - 1
            })
            .collect();
        tasks.push((member, inputs, outputs, Ticket::new(&meeting, slot), (shapes, scratch)));
    }
    // The parts of several devices are queued under the process-wide
    // order; an inline part, which waits for no other device, cannot close
    // a cycle of devices waiting for each other and takes none (it must
    // not hold up other threads' enqueues while it waits for its device).
    let mut failed = None;
    let order = (!inline).then(enqueue_lock);
    for (member, inputs, outputs, ticket, shapes) in tasks {
        let client = &clients[member];
        let mode = mode.clone();
        let tracked = tracked.clone();
        // Recorded when the member's stream is capturing: the group refused
        // every mode that does more than queue device work (see launch).
        let task = move |access: Result<&mut BufferAccess<'_>, ServerError>| {
            let (shapes, scratch) = &shapes;
            stages::mark(Stage::TaskStarted);
            // Noted before the ticket returns; a part left running keeps
            // the record open through its monitor until it ends.
            let result = ticket.run(|c, slot| {
                let result = c.run_part(slot, access, &mode, shapes, scratch, tracked.clone());
                if let Some(t) = &tracked {
                    t.note(&result);
                }
                result
            });
            stages::mark(Stage::TicketReturned);
            result
        };
        stages::mark(Stage::TasksBuilt);
        let queued = match inline {
            true => client.submit_buffers_recorded_inline(operation, inputs, outputs, task),
            false => client.submit_buffers_recorded(operation, inputs, outputs, task),
        };
        stages::mark(Stage::Submitted);
        if let Err(source) = queued {
            failed.get_or_insert(CommError::Enqueue { operation, member, device: client.device_id(), source });
        }
    }
    drop(order);
    match failed {
        Some(err) => Err(err),
        None => Ok(meeting),
    }
}
