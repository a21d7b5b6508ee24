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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use cohort_runtime::backend::{CollectiveMonitor, CommSpec, Completion};
use cohort_runtime::{BufferAccess, Client, DeviceId, Handle, ServerError};
use parking_lot::{Condvar, Mutex};

use crate::check::{overlaps, same_bytes};
use crate::device::ask;
use crate::device::plan::{self, Shape};
use crate::error::CommError;
use crate::op::{Collective, Op};
use crate::store::StoreClient;

use super::error::ConnectError;
use super::failure::{Failure, FailureKind};
use super::fingerprint::Fingerprint;
use super::keys;
use super::local;
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
    store.wait(&can.iter().map(String::as_str).collect::<Vec<_>>(), left())?;
    for (r, key) in can.iter().enumerate() {
        let theirs = String::from_utf8_lossy(&store.get(key)?.unwrap_or_default()).into_owned();
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
    ) -> Result<Arc<Meeting>, CommError> {
        // Roots are members, and a message's endpoints (one device per
        // rank) ranks: both are ranks of the NCCL communicator.
        let (op, seg) = (fp.op, fp.op.block_bytes());
        let members = self.size * self.local;
        let devices = self.clients.iter().map(Client::device_id).collect();
        let meeting = Meeting::new(self.clone(), world.clone(), fp, devices, timeout);
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
            let ticket = Ticket { meeting: meeting.clone(), slot, ran: false, handed: false };
            let queued =
                client.submit_buffers_always(op.name(), input, output, move |access| ticket.run(access, shape));
            if let Err(source) = queued {
                let err = CommError::Enqueue { operation: op.name(), member: slot, device: client.device_id(), source };
                meeting.fail(ServerError::InvalidState { operation: "collective", reason: err.to_string() });
                failed.get_or_insert(err);
            }
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(meeting),
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

/// A queued call: waits on the host path's meeting or the NCCL path's.
pub(crate) enum Pending {
    Host(Arc<local::LocalCall>),
    Nccl(Arc<Meeting>),
}

impl Pending {
    /// Blocks the calling thread until the call finished; its failure.
    pub(crate) fn wait(&self) -> Result<(), ServerError> {
        match self {
            Pending::Host(m) => m.wait(),
            Pending::Nccl(m) => m.wait(),
        }
    }
}

#[derive(Default)]
struct State {
    arrived: usize,
    present: Vec<bool>,
    /// The leader's host check, once done.
    checked: Option<Result<(), Failure>>,
    returned: usize,
    /// Parts that ended: returned without queueing NCCL calls, or whose
    /// queued calls completed or failed on the device.
    ended: usize,
    failure: Option<ServerError>,
    /// What kind of failure it was, where one said (a mismatch or timeout
    /// in the host check, an abort seen in the store, the device's
    /// timeout); anything else is [`FailureKind::Other`].
    kind: Option<FailureKind>,
}

impl State {
    /// The call's outcome, for its flight record.
    fn outcome(&self) -> Result<(), Failure> {
        match &self.failure {
            None => Ok(()),
            Some(err) => Err(Failure::new(self.kind.unwrap_or(FailureKind::Other), err.to_string())),
        }
    }
}

/// The local parts of one NCCL-path call.
pub(crate) struct Meeting {
    nccl: Arc<Nccl>,
    world: Arc<Mutex<World>>,
    fp: Fingerprint,
    devices: Vec<DeviceId>,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// Called once, with the outcome, when every local part has ended.
    on_done: Mutex<Option<DoneHook>>,
}

/// What a finished NCCL-path call reports to (the flight recorder's tracker).
type DoneHook = Box<dyn FnOnce(Result<(), Failure>) + Send>;

/// Arrival note and abort polling of one waiting part.
struct Poll {
    last: Instant,
    noted: bool,
}

impl Meeting {
    fn new(
        nccl: Arc<Nccl>,
        world: Arc<Mutex<World>>,
        fp: Fingerprint,
        devices: Vec<DeviceId>,
        timeout: Duration,
    ) -> Arc<Meeting> {
        let state = State { present: vec![false; devices.len()], ..State::default() };
        Arc::new(Meeting {
            nccl,
            world,
            fp,
            devices,
            timeout,
            state: Mutex::new(state),
            cv: Condvar::new(),
            on_done: Mutex::new(None),
        })
    }

    /// Runs `hook` with the call's outcome once every local part ended (its
    /// NCCL calls completed on the device, or failed), at once if they have.
    pub(crate) fn on_done(&self, hook: impl FnOnce(Result<(), Failure>) + Send + 'static) {
        let state = self.state.lock();
        if state.ended < self.devices.len() {
            *self.on_done.lock() = Some(Box::new(hook));
            return;
        }
        let outcome = state.outcome();
        drop(state);
        hook(outcome);
    }

    /// One local part ended; the last runs the done hook.
    fn end_part(&self) {
        let mut state = self.state.lock();
        state.ended += 1;
        if state.ended == self.devices.len() {
            let outcome = state.outcome();
            drop(state);
            if let Some(hook) = self.on_done.lock().take() {
                hook(outcome);
            }
        }
    }

    fn error(&self, slot: usize, reason: String) -> ServerError {
        ServerError::Collective { collective: self.fp.op.name().to_string(), device: self.devices[slot], reason }
    }

    /// Notes what kind of failure the call met (the first said wins).
    fn note_kind(&self, kind: FailureKind) {
        self.state.lock().kind.get_or_insert(kind);
    }

    fn fail(&self, err: ServerError) -> ServerError {
        let mut state = self.state.lock();
        let failure = state.failure.get_or_insert(err).clone();
        self.cv.notify_all();
        failure
    }

    fn wait(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock();
        while state.failure.is_none() && state.returned < self.devices.len() {
            self.cv.wait(&mut state);
        }
        state.failure.clone().map_or(Ok(()), Err)
    }

    /// Waits for every local part; the last runs the host check.
    fn meet(&self, slot: usize, deadline: Instant) -> Result<(), ServerError> {
        let n = self.devices.len();
        let mut state = self.state.lock();
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        state.present[slot] = true;
        state.arrived += 1;
        if state.arrived == n {
            drop(state);
            let fp = self.fp;
            let result = self.world.lock().run(fp, |w| host_check(w, &fp));
            let mut state = self.state.lock();
            state.checked = Some(result.clone());
            self.cv.notify_all();
            drop(state);
            return result.map_err(|failure| {
                self.note_kind(failure.kind);
                self.fail(self.error(slot, failure.message))
            });
        }
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if let Some(checked) = &state.checked {
                return checked.clone().map_err(|failure| self.error(slot, failure.message));
            }
            // Once every part arrived, the leader's check is bounded by the
            // world's own deadline.
            if self.cv.wait_until(&mut state, deadline).timed_out() && state.arrived < n && state.failure.is_none() {
                let missing: Vec<String> =
                    (0..n).filter(|&s| !state.present[s]).map(|s| self.devices[s].to_string()).collect();
                let err = self.error(
                    slot,
                    format!(
                        "local device(s) {} of this rank never reached it within {:.1} s (still busy with earlier \
                         work?)",
                        missing.join(", "),
                        self.timeout.as_secs_f64()
                    ),
                );
                state.failure.get_or_insert(err);
                self.cv.notify_all();
            }
        }
    }

    /// Meets the other local parts and queues this part's NCCL calls,
    /// returning once they are queued (a barrier waits for them). Sets
    /// `handed` when a [`PartMonitor`] took over ending the part.
    fn run_part(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        shape: Shape,
        handed: &mut bool,
    ) -> Result<(), ServerError> {
        let access = access.map_err(|err| self.fail(err))?;
        let buffers = shape.bind(|i| access.binding(i));
        let deadline = Instant::now() + self.timeout;
        self.meet(slot, deadline)?;
        let nccl = &self.nccl;
        let (member, members) = (nccl.rank * nccl.local + slot, nccl.size * nccl.local);
        let calls = plan::nccl_calls(&self.fp.op, member, members, &buffers);
        if calls.is_empty() {
            return Ok(());
        }
        let spec = CommSpec { set: nccl.key, rank: member, ranks: members, unique_id: &nccl.unique_id };
        let started = Instant::now();
        let monitor = Arc::new(PartMonitor {
            meeting: self.clone(),
            slot,
            started,
            poll: Mutex::new(Poll { last: started, noted: false }),
            ended: AtomicBool::new(false),
        });
        let completion =
            if self.fp.op.collective() == Collective::Barrier { Completion::Wait } else { Completion::Defer };
        let result = access.run_collective(&spec, &calls, monitor.clone(), completion);
        // Queued (its monitor ends the part, now or later) unless refused
        // before any call was queued.
        *handed = result.is_ok() || monitor.ended.load(Ordering::Acquire);
        result.map_err(|err| {
            nccl.abort(&self.world, &err.to_string());
            self.fail(err)
        })
    }
}

/// One local part's view while its NCCL calls run (held by its device
/// until they end, when it ends the part): this rank's other parts' failures, and (once the part is slow) its arrival note and the
/// store's abort flag, looked at every [`ABORT_POLL`].
struct PartMonitor {
    meeting: Arc<Meeting>,
    slot: usize,
    started: Instant,
    poll: Mutex<Poll>,
    /// Set once the device reported the part's end.
    ended: AtomicBool,
}

impl CollectiveMonitor for PartMonitor {
    fn operation(&self) -> &str {
        self.meeting.fp.op.name()
    }

    fn timeout(&self) -> Duration {
        self.meeting.timeout
    }

    fn failed_elsewhere(&self) -> Option<ServerError> {
        let m = &self.meeting;
        if let Some(err) = m.state.lock().failure.clone() {
            return Some(err);
        }
        let slow = (m.timeout / 4).min(Duration::from_secs(1));
        let now = Instant::now();
        let mut p = self.poll.lock();
        if now - self.started < slow || now - p.last < ABORT_POLL {
            return None;
        }
        p.last = now;
        if !p.noted {
            p.noted = true;
            let _ = m.nccl.store.set(&keys::arrived(&m.nccl.prefix, m.fp.seq, m.nccl.rank), b"");
        }
        match m.nccl.store.get(&keys::abort(&m.nccl.prefix)) {
            Ok(Some(why)) => {
                m.note_kind(FailureKind::Aborted);
                let why = String::from_utf8_lossy(&why);
                Some(m.error(self.slot, format!("{} stopped: the communicator was aborted by {why}", m.fp)))
            }
            _ => None,
        }
    }

    /// Asked by the device only when the part timed out.
    fn missing(&self) -> String {
        let m = &self.meeting;
        m.note_kind(FailureKind::Timeout);
        format!("{}: {}", m.fp, m.nccl.missing(m.fp.seq))
    }

    fn finished(&self, outcome: &Result<(), ServerError>) {
        let m = &self.meeting;
        if let Err(err) = outcome {
            m.nccl.abort(&m.world, &err.to_string());
            m.fail(err.clone());
        }
        if !self.ended.swap(true, Ordering::AcqRel) {
            m.end_part();
        }
    }
}

/// A part's right to run; dropped unrun (its device closed), it fails the
/// meeting so the other parts and waiters return.
struct Ticket {
    meeting: Arc<Meeting>,
    slot: usize,
    ran: bool,
    /// Its monitor ends the part (its calls were queued on the device).
    handed: bool,
}

impl Ticket {
    fn run(mut self, access: Result<&mut BufferAccess<'_>, ServerError>, shape: Shape) -> Result<(), ServerError> {
        self.ran = true;
        let meeting = self.meeting.clone();
        meeting.run_part(self.slot, access, shape, &mut self.handed)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let m = &self.meeting;
        let mut state = m.state.lock();
        if !self.ran {
            let device = m.devices[self.slot];
            let err = ServerError::Poisoned {
                operation: m.fp.op.name().to_string(),
                cause: Arc::new(ServerError::DeviceClosed { device }),
            };
            state.failure.get_or_insert(err);
        }
        state.returned += 1;
        m.cv.notify_all();
        drop(state);
        if !self.handed {
            m.end_part();
        }
    }
}
