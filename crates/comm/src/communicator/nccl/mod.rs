//! The NCCL path of a [`Communicator`](super::Communicator): when every
//! rank's every local device is CUDA and libnccl loads there, collectives
//! run device to device on one NCCL communicator spanning every member of
//! every rank (NCCL rank = member index, `rank × L + l`).
//!
//! Set-up (at connect time, through the rendezvous store, under the
//! communicator's prefix): every rank writes `nccl/can/<r>` (`yes`, or `no`
//! and why); when all say yes, rank 0 asks its first device for an
//! `ncclUniqueId` and writes it to `nccl/id`, which every rank reads. When
//! any rank cannot, every rank keeps the host path (and a capable one says
//! why once). Nothing is probed on a rank whose devices offer no device
//! collectives.
//!
//! Each collective queues one task per local device. The last local task
//! to start checks the call's fingerprint with its ring neighbours over the
//! host links (the check every host-path collective starts with), so a
//! rank that calls something else is named as a mismatch and a rank that
//! never arrives is named by the host timeout, before any NCCL call that
//! would wait for it. Then every local part issues its calls through the
//! runtime's [`DeviceCollectives`](cohort_runtime::backend::DeviceCollectives)
//! hook: its device thread creates its NCCL communicator on first use
//! (`ncclCommInitRank`), queues the calls on the caller's stream and
//! returns (a barrier waits for them); the device polls them later, looking
//! at the deadline, this rank's other parts and the store's abort flag, and
//! their failure marks the destinations. A failed or expired part aborts
//! the NCCL communicator (`ncclCommAbort`) and the communicator for every
//! rank; a timeout names the ranks that never noted their arrival. The
//! call's flight record ends when its last local part ended on the device.
//!
//! With several devices per rank, `send`/`recv` stay on the host path (the
//! receiving device is not known to the sender), as do calls whose source
//! overlaps their destination other than exactly (in place).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use cohort_runtime::{BufferAccess, Client, Handle, ServerError};
use parking_lot::Mutex;

use crate::check::{overlaps, same_bytes};
use crate::device::ask;
use crate::device::plan::Shape;
use crate::error::CommError;
use crate::meeting::Ticket;
use crate::op::{Collective, Op};
use crate::store::StoreClient;

mod call;

pub(crate) use call::NcclCall;

use super::error::ConnectError;
use super::failure::Failure;
use super::fingerprint::Fingerprint;
use super::keys;
use super::world::World;

/// Set keys of communicators made here carry the top bit, apart from the
/// keys `ClientGroup`s use on the same devices.
const SET_BASE: u64 = 1 << 63;

/// How often a waiting part looks at the store's abort flag.
const ABORT_POLL: Duration = Duration::from_millis(200);

/// A communicator's NCCL side.
pub(crate) struct Nccl {
    key: u64,
    rank: usize,
    size: usize,
    local: usize,
    unique_id: Vec<u8>,
    clients: Vec<Client>,
    /// Arrival notes and aborts (its own connection).
    store: StoreClient,
    prefix: String,
}

/// Why this rank's devices cannot take the NCCL path (`None`: they can).
/// Asks each device's backend once, and only when every device offers
/// device collectives.
fn refusal(clients: &[Client]) -> Option<String> {
    if let Some(c) = clients.iter().find(|c| !c.capabilities().device_collectives) {
        return Some(format!("its devices run on {}, which offers no device collectives", c.name()));
    }
    for client in clients {
        match ask(client, |dc| dc.available()) {
            Some(Ok(())) => {}
            Some(Err(why)) => return Some(why),
            None => return Some(format!("device {} offers no device collectives", client.device_id())),
        }
    }
    None
}

fn warn_host(why: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| tracing::warn!("the Communicator's collectives take the host path instead of NCCL: {why}"));
}

/// Decides, with every rank, whether the communicator runs on NCCL, and
/// shares the NCCL id; waits for every rank up to the world's timeout.
pub(crate) fn setup(world: &World, clients: &[Client]) -> Result<Option<Arc<Nccl>>, ConnectError> {
    let (rank, size, prefix, store) = (world.rank, world.size, world.prefix().to_string(), world.store());
    let deadline = Instant::now() + world.timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let mine = refusal(clients);
    let answer = match &mine {
        None => "yes".to_string(),
        Some(why) => format!("no {why}"),
    };
    store.set(&keys::nccl_can(&prefix, rank), answer.as_bytes())?;
    let can: Vec<String> = (0..size).map(|r| keys::nccl_can(&prefix, r)).collect();
    let can: Vec<&str> = can.iter().map(String::as_str).collect();
    store.wait(&can, left())?;
    // One round trip for every rank's answer (not one per rank).
    for (r, value) in store.multi_get(&can)?.into_iter().enumerate() {
        let theirs = String::from_utf8_lossy(&value.unwrap_or_default()).into_owned();
        if theirs != "yes" {
            if mine.is_none() {
                warn_host(&format!("rank {r} cannot: {}", theirs.trim_start_matches("no ")));
            }
            return Ok(None);
        }
    }
    let id_key = keys::nccl_id(&prefix);
    if rank == 0 {
        let value = match ask(&clients[0], |dc| dc.unique_id()) {
            Some(Ok(id)) => [b"ok ".as_slice(), &id].concat(),
            Some(Err(err)) => format!("no {err}").into_bytes(),
            None => b"no rank 0's device failed while making the NCCL id".to_vec(),
        };
        store.set(&id_key, &value)?;
    }
    store.wait(&[&id_key], left())?;
    let value = store.get(&id_key)?.unwrap_or_default();
    let Some(unique_id) = value.strip_prefix(b"ok ") else {
        warn_host(&String::from_utf8_lossy(&value[value.len().min(3)..]));
        return Ok(None);
    };
    static NEXT: AtomicU64 = AtomicU64::new(0);
    tracing::debug!(rank, size, local = clients.len(), "the communicator runs on NCCL");
    super::timings::passed(store, &prefix, rank, "nccl", Instant::now());
    Ok(Some(Arc::new(Nccl {
        key: SET_BASE | NEXT.fetch_add(1, Ordering::Relaxed),
        rank,
        size,
        local: clients.len(),
        unique_id: unique_id.to_vec(),
        clients: clients.to_vec(),
        store: store.duplicate()?,
        prefix,
    })))
}

/// Whether two handles share bytes without being the same bytes.
fn partly_overlap(a: &Handle, b: &Handle) -> bool {
    overlaps(a, b) && !same_bytes(a, b)
}

/// What the leader checks over the host links before the NCCL calls: the
/// ring's fingerprints, or a message's with its other rank.
fn host_check(w: &mut World, fp: &Fingerprint) -> Result<(), Failure> {
    match fp.op.endpoints() {
        Some((from, to)) if from == w.rank => w.send(fp, &[], to),
        Some((from, _)) => w.recv(fp, &mut [], from),
        None => w.ring_check(fp),
    }
}

impl Nccl {
    /// Whether a call takes the NCCL path (see the module docs).
    pub(crate) fn takes(&self, op: &Op, inputs: &[Option<Handle>], outputs: &[Option<Handle>]) -> bool {
        if op.collective() == Collective::SendRecv && self.local > 1 {
            return false;
        }
        !inputs.iter().flatten().any(|i| outputs.iter().flatten().any(|o| partly_overlap(i, o)))
    }

    /// Queues one part per local device (slot `s` with `inputs[s]` and
    /// `outputs[s]`); the caller holds the process-wide enqueue order.
    pub(crate) fn launch(
        self: &Arc<Self>,
        world: &Arc<Mutex<World>>,
        fp: Fingerprint,
        timeout: Duration,
        inputs: Vec<Option<Handle>>,
        outputs: Vec<Option<Handle>>,
    ) -> Result<Arc<NcclCall>, CommError> {
        // Roots are members, and a message's endpoints (one device per
        // rank) ranks: both are ranks of the NCCL communicator.
        let (op, seg) = (fp.op, fp.op.block_bytes());
        let members = self.size * self.local;
        let devices = self.clients.iter().map(Client::device_id).collect();
        let call = NcclCall::new(self.clone(), world.clone(), fp, devices, timeout);
        let mut failed = None;
        for (slot, client) in self.clients.iter().enumerate() {
            let input: Vec<Handle> = inputs[slot].iter().cloned().collect();
            let mut output: Vec<Handle> = outputs[slot].iter().cloned().collect();
            // An in-place all-to-all sends from a copy of the source.
            let scratch = op.collective() == Collective::AllToAll
                && input.first().zip(output.first()).is_some_and(|(i, o)| same_bytes(i, o));
            if scratch {
                output.push(client.empty(seg * members));
            }
            let shape = Shape { input: !input.is_empty(), output: !output.is_empty(), scratch };
            let ticket = Ticket::new(&call, slot);
            let queued = client.submit_buffers_always(op.name(), input, output, move |access| {
                ticket.run(|call, slot| call.run_part(slot, access, shape))
            });
            if let Err(source) = queued {
                let err = CommError::Enqueue { operation: op.name(), member: slot, device: client.device_id(), source };
                call.fail(ServerError::InvalidState { operation: "collective", reason: err.to_string() });
                failed.get_or_insert(err);
            }
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(call),
        }
    }

    /// Tells every rank the communicator failed (first abort wins), and
    /// refuses later calls on this rank.
    fn abort(&self, world: &Mutex<World>, why: &str) {
        if let Some(mut w) = world.try_lock() {
            w.abort(why);
        }
        let _ =
            self.store.compare_set(&keys::abort(&self.prefix), None, format!("rank {}: {why}", self.rank).as_bytes());
    }

    /// The ranks that never noted their arrival at collective `seq`.
    fn missing(&self, seq: u64) -> String {
        let _ = self.store.set(&keys::arrived(&self.prefix, seq, self.rank), b"");
        let absent: Vec<String> = (0..self.size)
            .filter(|&r| r != self.rank)
            .filter(|&r| !matches!(self.store.get(&keys::arrived(&self.prefix, seq, r)), Ok(Some(_))))
            .map(|r| r.to_string())
            .collect();
        if absent.is_empty() {
            "every rank arrived, but the NCCL calls did not finish (a rank is stuck inside them)".into()
        } else {
            format!("rank(s) {} never arrived", absent.join(", "))
        }
    }
}

impl Nccl {
    /// Destroys each local device's NCCL communicator, after the work
    /// queued there before, and waits for that (up to 10 s), so that no
    /// device thread is still inside NCCL when the process exits. Called
    /// when the last clone of the communicator drops.
    pub(crate) fn release(&self) {
        let (tx, rx) = crossbeam::channel::unbounded();
        let mut queued = 0;
        for client in &self.clients {
            let (key, tx) = (self.key, tx.clone());
            let sent = client.submit_buffers_always("nccl release", Vec::new(), Vec::new(), move |access| {
                if let Some(dc) = access.ok().and_then(|a: &mut BufferAccess<'_>| a.device_collectives()) {
                    dc.release(key);
                }
                let _ = tx.send(());
                Ok(())
            });
            queued += usize::from(sent.is_ok());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for _ in 0..queued {
            if rx.recv_deadline(deadline).is_err() {
                tracing::warn!("the NCCL communicator was not released within 10 s (a device is still busy)");
                return;
            }
        }
    }
}
