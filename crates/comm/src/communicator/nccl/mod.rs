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
//! Each collective queues one task per local device (a rank with one
//! device runs it as a `one::OneCall`, whose one task needs no meeting).
//! The last local task to start checks the call's fingerprint with the
//! other ranks over the host links (the check every host-path collective starts with:
//! `World::collective_check`), so a
//! rank that calls something else is named as a mismatch and a rank that
//! never arrives is named by the host timeout, before any NCCL call that
//! would wait for it. Then every local part issues its calls through the
//! runtime's [`DeviceCollectives`](cohort_runtime::backend::DeviceCollectives)
//! hook: its device thread creates its NCCL communicator on first use
//! (`ncclCommInitRank`), queues the calls on the caller's stream and
//! returns (a barrier waits for them). A rank with one device in a job of
//! up to eight ranks (those that compare every rank's fingerprint), once NCCL calls of the call's collective were queued before
//! (the communicator exists and NCCL connected what they need; at once for
//! a call on a peer kernel, which needs neither),
//! queues its part from the caller's thread where the device is idle, and
//! sends the check ahead instead of waiting for it
//! (`World::send_check_ahead`): the part's monitor compares the other
//! ranks' fingerprints on every poll and before the part ends as done,
//! and a mismatch fails the call on every rank and aborts. The
//! device polls them later, looking at the deadline, this rank's other
//! parts and the store's abort flag, and their failure marks the
//! destinations; a waiter on a rank with one device polls it itself. A failed or expired part aborts
//! the NCCL communicator (`ncclCommAbort`) and the communicator for every
//! rank; a timeout names the ranks that never noted their arrival. The
//! call's flight record ends when its last local part ended on the device
//! (or is dropped unfinished, which tells the other ranks, where a part
//! could not be queued, or a one-device rank's task was dropped unrun or
//! panicked).
//!
//! With several devices per rank, `send`/`recv` stay on the host path (the
//! receiving device is not known to the sender). A source that partly
//! overlaps its destination is copied first (on the device), so the path
//! never depends on one rank's buffers.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use cohort_runtime::backend::CommSpec;
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, Handle, ServerError, TaskHandles};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::device::ask;
use crate::device::fusion::{self, Bucket};
use crate::error::CommError;
use crate::meeting::Ticket;
use crate::op::{Collective, Op};
use crate::store::StoreClient;

mod call;
mod one;
mod peer;

use call::{CallCore, NcclCall, PartBuffers, PartOwner};
pub(crate) use call::{PartFusion, PartLayout};

use super::error::ConnectError;
use super::failure::Failure;
use super::fingerprint::Fingerprint;
use super::keys;
use super::label::Label;
use super::observe::Tracker;
use super::world::World;
use super::SlotCall;
use crate::work::Waitable;

/// Set keys of communicators made here carry the top bit, apart from the
/// keys `ClientGroup`s use on the same devices.
const SET_BASE: u64 = 1 << 63;

/// How often a waiting part looks at the store's abort flag.
const ABORT_POLL: Duration = Duration::from_millis(200);

/// The next set key of a communicator made here (with [`SET_BASE`]).
fn next_set() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    SET_BASE | NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A call that could not be queued: its error, and its flight record,
/// unfinished, for the caller to drop once it let go of its locks (the
/// drop tells the other ranks, asking the store).
pub(crate) struct Refused {
    pub error: CommError,
    pub record: Option<Tracker>,
}

impl Refused {
    /// The error, once the record was dropped (which tells the other
    /// ranks): call it after letting go of the locks.
    pub(crate) fn into_error(self) -> CommError {
        drop(self.record);
        self.error
    }
}

/// A communicator's NCCL side.
pub(crate) struct Nccl {
    key: u64,
    rank: usize,
    size: usize,
    local: usize,
    unique_id: Vec<u8>,
    clients: Vec<Client>,
    /// Arrival notes and aborts (its own connection; a group's shares its
    /// communicator's).
    store: Arc<StoreClient>,
    prefix: String,
    /// The peer-memory fast path, where every rank could set it up.
    peer: Option<peer::PeerPath>,
    /// Names ranks by job rank in messages.
    label: Label,
    /// The collectives (a bit each, `kind_bits`) whose NCCL calls were
    /// queued on the device once: its NCCL communicator exists
    /// (`ncclCommInitRank`, which waits for every rank, is behind the first)
    /// and NCCL connected what that collective needs (with
    /// `NCCL_RUNTIME_CONNECT`, on by default, the first call that needs a
    /// connection makes it, waiting for the peer: an all-to-all's first
    /// point-to-point links, say). A one-device rank's later parts of such
    /// a collective wait for no other rank while they are queued.
    warm: AtomicU32,
}

/// One bit per collective of `ops`.
fn kind_bits(ops: &[Op]) -> u32 {
    ops.iter().fold(0, |bits, op| bits | 1 << (op.collective() as u32))
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
    let key = next_set();
    let peer = peer::setup(store, &prefix, rank, size, clients, key, deadline)?;
    tracing::debug!(rank, size, local = clients.len(), peer = peer.is_some(), "the communicator runs on NCCL");
    super::timings::passed(store, &prefix, rank, "nccl", Instant::now());
    Ok(Some(Arc::new(Nccl {
        label: world.label.clone(),
        peer,
        key,
        rank,
        size,
        local: clients.len(),
        unique_id: unique_id.to_vec(),
        clients: clients.to_vec(),
        store: Arc::new(store.duplicate()?),
        prefix,
        warm: AtomicU32::new(0),
    })))
}

impl Nccl {
    /// The path `op` takes on this communicator: a peer kernel where the
    /// fast path is set up and chooses one, else NCCL.
    pub(crate) fn path_of(&self, op: &Op) -> crate::device::peer::Path {
        self.peer.as_ref().map_or(crate::device::peer::Path::Nccl, |p| p.path(op))
    }
}

/// What the leader checks over the host links before the NCCL calls: the
/// collective's fingerprints, or a message's with its other rank.
fn host_check(w: &mut World, fp: &Fingerprint) -> Result<(), Failure> {
    match fp.op.endpoints() {
        Some((from, to)) if from == w.rank => w.send(fp, &[], to),
        Some((from, _)) => w.recv(fp, &mut [], from),
        None => w.collective_check(fp),
    }
}

impl Nccl {
    /// Whether NCCL calls of every collective of `ops` were queued on
    /// this device before (see `warm`).
    fn is_warm(&self, ops: &[Op]) -> bool {
        let bits = kind_bits(ops);
        self.warm.load(Ordering::Relaxed) & bits == bits
    }

    /// Notes that a part's NCCL calls for `ops` were queued on the device
    /// (see `warm`).
    pub(super) fn note_queued<T>(&self, ops: &[Op], queued: &Result<T, ServerError>) {
        if queued.is_ok() {
            self.warm.fetch_or(kind_bits(ops), Ordering::Relaxed);
        }
    }

    /// Whether the calls `ops` (a grouped call's when `grouped`) are
    /// queued from the caller's thread, their fingerprint check sent ahead
    /// (see `launch_calls`): on a rank with one device of a job of up to
    /// eight ranks (`World::sends_checks_ahead` says why not more), for
    /// collectives other than a barrier (which waits for its call) that move
    /// bytes (a part with no NCCL call has nothing to confirm its check
    /// after), once nothing in queueing them waits for another rank: NCCL
    /// calls of each of their collectives were queued before (`warm`: the
    /// communicator exists and NCCL connected what they need), or the
    /// single call runs a peer kernel (which needs neither). The caller then need not hold the
    /// process-wide enqueue order: the part waits for no other device of
    /// this process.
    pub(crate) fn queues_inline(&self, ops: &[Op], grouped: bool) -> bool {
        let collectives = ops
            .iter()
            .all(|op| op.collective() != Collective::Barrier && op.endpoints().is_none() && op.block_bytes() > 0);
        let peer_kernel = match ops {
            [op] if !grouped => self.path_of(op).peer().is_some(),
            _ => false,
        };
        let ahead = World::sends_checks_ahead(self.size) && (self.is_warm(ops) || peer_kernel);
        self.local == 1 && collectives && (self.size == 1 || ahead)
    }

    /// Whether a call takes the NCCL path (see the module docs).
    /// The choice follows from the call alone (not from this rank's
    /// buffers: every rank must take the same path).
    pub(crate) fn takes(&self, op: &Op) -> bool {
        !(op.collective() == Collective::SendRecv && self.local > 1)
    }

    /// Queues one part per local device for `calls` (op, inputs and outputs
    /// by slot) under one fingerprint `fp`: a grouped call's parts issue
    /// every call's NCCL calls inside one `ncclGroupStart/End`. `inline`:
    /// the calls queue inline, as [`Nccl::queues_inline`] said; the caller
    /// holds the process-wide enqueue order otherwise. `tracker`, the call's flight record, ends
    /// when the last local part ended (handed back unfinished when the call
    /// cannot be queued: [`Refused`]); it is told a grouped
    /// call's path here: NCCL, or NCCL with the all-reduces fused (a single
    /// call's, NCCL or a peer kernel, it was given when queued). Returns
    /// what the call's handle waits on: the one part's [`one::OneCall`] on
    /// a rank of one device, else the parts' [`NcclCall`] meeting.
    pub(crate) fn launch_calls(
        self: &Arc<Self>,
        world: &Arc<Mutex<World>>,
        fp: Fingerprint,
        timeout: Duration,
        calls: SmallVec<[SlotCall; 1]>,
        inline: bool,
        tracker: Tracker,
    ) -> Result<Arc<dyn Waitable>, Box<Refused>> {
        let ops: SmallVec<[Op; 1]> = calls.iter().map(|(op, _, _)| *op).collect();
        let name = if fp.group.is_some() { "group" } else { fp.op.name() };
        // Its check is sent ahead where its part queues inline with other
        // ranks (see `queues_inline`).
        let core =
            CallCore { nccl: self.clone(), world: world.clone(), fp, ahead: inline && self.size > 1, name, timeout };
        // The same buckets on every member (they follow from the calls).
        let buckets = fusion::buckets(&ops, fusion::cap());
        let in_bucket = fusion::fused_calls(&buckets, ops.len());
        let fused: Option<Arc<[Bucket]>> = (!buckets.is_empty()).then(|| buckets.into());
        // A single call's path went into its record when it was queued
        // (`Communicator::launch`); a grouped call's is known here.
        if fp.group.is_some() || ops.len() != 1 {
            tracker.set_path(if fused.is_none() { "nccl" } else { "nccl fused" });
        }
        let part = |slot: usize, client: &Client| self.part_buffers(slot, client, &calls, &in_bucket, &fused);
        // A rank with one device: its part meets no other local part, so
        // it is queued from this thread at once where the device is idle,
        // without the hand-over to the device thread (see
        // `Client::submit_buffers_inline`), once nothing in queueing it
        // waits for another rank: its fingerprint check is sent ahead
        // (compared while and after it runs) and its collective ran on NCCL
        // before or it runs a peer kernel (the first NCCL part of each
        // collective, whose `ncclCommInitRank` and connection wait for
        // every rank, goes to the device thread). See `queues_inline`.
        if let [client] = self.clients.as_slice() {
            return Ok(one::launch(core, client, tracker, inline, part(0, client))?);
        }
        let call = NcclCall::new(core, self.clients.iter().map(Client::device_id));
        stages::mark(Stage::MeetingBuilt);
        let mut failed = None;
        for (slot, client) in self.clients.iter().enumerate() {
            let PartBuffers { input, output, layout, fusion } = part(slot, client);
            let ticket = Ticket::new(&call, slot);
            let task = move |access: Result<&mut BufferAccess<'_>, ServerError>| {
                stages::mark(Stage::TaskStarted);
                let result = ticket.run(|call, slot| call.run_part(slot, access, &layout, &fusion));
                stages::mark(Stage::TicketReturned);
                result
            };
            stages::mark(Stage::TasksBuilt);
            let queued = client.submit_buffers_always(name, input, output, task);
            stages::mark(Stage::Submitted);
            if let Err(source) = queued {
                let err = CommError::Enqueue { operation: name, member: slot, device: client.device_id(), source };
                call.fail(ServerError::InvalidState { operation: "collective", reason: err.to_string() });
                failed.get_or_insert(err);
            }
        }
        if let Some(error) = failed {
            return Err(Box::new(Refused { error, record: Some(tracker) }));
        }
        call.on_done(move |outcome| tracker.ended(outcome));
        Ok(call)
    }

    /// Local part `slot`'s buffers for `calls` on `client` (scratch from
    /// its pool), laid out as its task binds them.
    fn part_buffers(
        &self,
        slot: usize,
        client: &Client,
        calls: &[SlotCall],
        in_bucket: &[bool],
        fused: &Option<Arc<[Bucket]>>,
    ) -> PartBuffers {
        let (mut input, mut output) = (TaskHandles::new(), TaskHandles::new());
        let mut layout: SmallVec<[PartLayout; 1]> = SmallVec::with_capacity(calls.len());
        for ((op, ins, outs), &in_bucket) in calls.iter().zip(in_bucket) {
            let src = ins[slot].clone();
            let dst = outs[slot].clone();
            // A copy of the source to read from (an in-place all-to-all, a
            // source partly overlapping its destination), but for a call
            // packed into a fusion bucket, which reads the bucket.
            let scratch = (!in_bucket
                && crate::device::plan::sends_from_copy(op.collective(), src.as_ref(), dst.as_ref()))
            .then(|| src.as_ref().map_or(0, Handle::size));
            let mut part = PartLayout { op: *op, input: None, output: None, scratch: None };
            if let Some(src) = src {
                part.input = Some(input.len());
                input.push(src);
            }
            if let Some(dst) = dst {
                part.output = Some(output.len());
                output.push(dst);
            }
            if let Some(bytes) = scratch {
                part.scratch = Some(output.len());
                output.push(client.empty(bytes as usize));
            }
            layout.push(part);
        }
        // Each bucket's scratch (from the pool), after the outputs.
        let mut scratch: SmallVec<[usize; 4]> = SmallVec::new();
        for bucket in fused.iter().flat_map(|buckets| buckets.iter()) {
            scratch.push(output.len());
            output.push(client.empty(bucket.bytes as usize));
        }
        // Bindings number inputs first, then outputs.
        let inputs_here = input.len();
        for part in &mut layout {
            part.output = part.output.map(|o| o + inputs_here);
            part.scratch = part.scratch.map(|o| o + inputs_here);
        }
        for at in &mut scratch {
            *at += inputs_here;
        }
        PartBuffers { input, output, layout, fusion: PartFusion { buckets: fused.clone(), scratch } }
    }

    /// Tells every rank the communicator failed (first abort wins), and
    /// refuses later calls on this rank.
    fn abort(&self, world: &Mutex<World>, why: &str) {
        if let Some(mut w) = world.try_lock() {
            w.abort(why);
        }
        let me = self.label.global(self.rank);
        let _ = self.store.compare_set(&keys::abort(&self.prefix), None, format!("rank {me}: {why}").as_bytes());
    }

    /// The ranks that never noted their arrival at collective `seq`.
    fn missing(&self, seq: u64) -> String {
        let _ = self.store.set(&keys::arrived(&self.prefix, seq, self.rank), b"");
        let absent: Vec<String> = (0..self.size)
            .filter(|&r| r != self.rank)
            .filter(|&r| !matches!(self.store.get(&keys::arrived(&self.prefix, seq, r)), Ok(Some(_))))
            .map(|r| self.label.global(r).to_string())
            .collect();
        if absent.is_empty() {
            "every rank arrived, but the NCCL calls did not finish (a rank is stuck inside them)".into()
        } else {
            format!("rank(s) {} never arrived", absent.join(", "))
        }
    }
}

impl Nccl {
    /// Splits this communicator on every local device (`ncclCommSplit`,
    /// collective over every member of every rank): slot `s` joins the
    /// group `asks[s]` = `(group, key)` names (`None`: no group), `key`
    /// being its rank there; with `share`, the groups share this
    /// communicator's resources. Returns each group's set key, by group.
    /// Waits for every local device, up to `timeout`.
    pub(crate) fn split(
        &self,
        asks: &[Option<(u32, usize)>],
        share: bool,
        timeout: Duration,
    ) -> Result<Vec<(u32, u64)>, String> {
        let mut sets: Vec<(u32, u64)> = Vec::new();
        for (group, _) in asks.iter().flatten() {
            if !sets.iter().any(|(g, _)| g == group) {
                sets.push((*group, next_set()));
            }
        }
        let (tx, rx) = crossbeam::channel::unbounded();
        let members = self.size * self.local;
        // Every local device's split is queued under the process-wide
        // order, like a collective's parts: each blocks its device thread
        // until the other members call it.
        let order = crate::order::enqueue_lock();
        for (slot, client) in self.clients.iter().enumerate() {
            let ask = asks[slot];
            let set = ask.and_then(|(g, _)| sets.iter().find(|(x, _)| *x == g)).map_or(0, |(_, k)| *k);
            let (parent, member, unique_id, tx) =
                (self.key, self.rank * self.local + slot, self.unique_id.clone(), tx.clone());
            let (store, abort_key) = (self.store.clone(), keys::abort(&self.prefix));
            let queued = client.submit_buffers_always("split", Vec::new(), Vec::new(), move |access| {
                let spec = CommSpec { set: parent, rank: member, ranks: members, unique_id: &unique_id };
                // Another rank's abort ends the wait for the split.
                let stop = || match store.get(&abort_key) {
                    Ok(Some(why)) => Some(String::from_utf8_lossy(&why).into_owned()),
                    _ => None,
                };
                let (color, key) = (ask.map(|(g, _)| g), ask.map_or(0, |(_, k)| k));
                let result = match access.map(|a: &mut BufferAccess<'_>| a.device_collectives()) {
                    Ok(Some(dc)) => dc.split(&spec, set, color, key, share, timeout, &stop),
                    Ok(None) => Err(ServerError::InvalidState {
                        operation: "split",
                        reason: "the device offers no device collectives".into(),
                    }),
                    Err(err) => Err(err),
                };
                let _ = tx.send((slot, result.as_ref().map_err(ToString::to_string).cloned()));
                result
            });
            queued.map_err(|e| format!("could not queue the split on local device {slot}: {e}"))?;
        }
        drop(order);
        let deadline = Instant::now() + timeout;
        for _ in 0..self.clients.len() {
            match rx.recv_deadline(deadline) {
                Ok((_, Ok(()))) => {}
                Ok((slot, Err(why))) => return Err(format!("ncclCommSplit on local device {slot}: {why}")),
                Err(_) => return Err(format!("ncclCommSplit did not return within {:.1} s", timeout.as_secs_f64())),
            }
        }
        Ok(sets)
    }

    /// The NCCL side of a group split from this one: its communicator
    /// `set` exists on every device of `clients` already (made by
    /// [`Nccl::split`]).
    pub(crate) fn child(&self, set: u64, world: &World, clients: &[Client]) -> Result<Arc<Nccl>, ConnectError> {
        Ok(Arc::new(Nccl {
            key: set,
            rank: world.rank,
            size: world.size,
            local: clients.len(),
            unique_id: Vec::new(),
            clients: clients.to_vec(),
            store: world.shared_store(),
            prefix: world.prefix().to_string(),
            label: world.label.clone(),
            // A split group runs on NCCL alone: its members' peer arenas are
            // not exchanged.
            peer: None,
            warm: AtomicU32::new(0),
        }))
    }

    /// Destroys each local device's NCCL communicator, after the work
    /// queued there before, and waits for that (up to 10 s), so that no
    /// device thread is still inside NCCL when the process exits. With the
    /// peer-memory path, each device also closes the other ranks' arenas it
    /// opened; once every rank wrote `nccl/peer/closed/<r>` (waited for up
    /// to 10 s more) each frees its own arena, else it keeps it (a peer may
    /// still read it) until the device closes. Called when the last clone
    /// of the communicator drops.
    pub(crate) fn release(&self) {
        let peer = self.peer.is_some();
        let closed = self.on_every_device("nccl release", move |dc, key| {
            dc.release(key);
            if peer {
                dc.release_peer(key, false);
            }
        });
        if !closed || !peer {
            return;
        }
        let mine = keys::peer_closed(&self.prefix, self.rank);
        let everyone: Vec<String> = (0..self.size).map(|r| keys::peer_closed(&self.prefix, r)).collect();
        let all_closed = self.store.set(&mine, b"").is_ok()
            && self
                .store
                .wait(&everyone.iter().map(String::as_str).collect::<Vec<_>>(), Duration::from_secs(10))
                .is_ok();
        if !all_closed {
            tracing::warn!(
                "not every rank closed its peer-memory arenas within 10 s: this rank's stays until its device closes"
            );
            return;
        }
        self.on_every_device("peer arena release", |dc, key| dc.release_peer(key, true));
    }

    /// Runs `f` with this communicator's set key on every local device's
    /// thread, after the work queued there before; waits up to 10 s for all.
    /// Returns whether every device did.
    fn on_every_device(
        &self,
        name: &'static str,
        f: impl Fn(&mut dyn cohort_runtime::backend::DeviceCollectives, u64) + Clone + Send + 'static,
    ) -> bool {
        let (tx, rx) = crossbeam::channel::unbounded();
        let mut queued = 0;
        for client in &self.clients {
            let (key, tx, f) = (self.key, tx.clone(), f.clone());
            let sent = client.submit_buffers_always(name, Vec::new(), Vec::new(), move |access| {
                if let Some(dc) = access.ok().and_then(|a: &mut BufferAccess<'_>| a.device_collectives()) {
                    f(dc, key);
                }
                let _ = tx.send(());
                Ok(())
            });
            queued += usize::from(sent.is_ok());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for _ in 0..queued {
            if rx.recv_deadline(deadline).is_err() {
                tracing::warn!("{name}: not done within 10 s (a device is still busy)");
                return false;
            }
        }
        queued == self.clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::kind_bits;
    use crate::op::Op;
    use crate::ops::{DType, ReduceOp};

    /// A collective is warm only once its own kind was queued: a first
    /// all-to-all after many all-reduces is not (NCCL may connect for it).
    #[test]
    fn each_collective_kind_warms_on_its_own() {
        let all_reduce = Op::all_reduce(DType::F32, ReduceOp::Sum, 4);
        let all_to_all = Op::all_to_all(DType::F32, 4);
        let warm = kind_bits(&[all_reduce]);
        let wanted = |ops: &[Op]| warm & kind_bits(ops) == kind_bits(ops);
        assert!(wanted(&[all_reduce, all_reduce]));
        assert!(!wanted(&[all_to_all]));
        assert!(!wanted(&[all_reduce, all_to_all]), "a grouped call needs every kind warm");
        assert_ne!(kind_bits(&[all_to_all]), 0);
    }
}
