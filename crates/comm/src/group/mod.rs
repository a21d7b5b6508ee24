//! [`ClientGroup`]: one client per device of one runtime, in one process,
//! and the collectives across them.

mod collectives;
mod grouped;
mod split;

pub use collectives::to_client;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cohort_runtime::config;
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, Handle, ServerError};
use smallvec::SmallVec;

use crate::device::peer::{self, Algo, Path};
use crate::device::{self, Mode, Route, Transport};
use crate::error::CommError;
use crate::host::{default_timeout, HostCollective, HostPath};
use crate::meeting::{Seat, Ticket};
use crate::op::{Collective, Op};
use crate::order::{communicator, enqueue_lock, DeviceSetComm};
use crate::trace::{FlightRecorder, Ranks, Row, Watched};
use crate::work::Work;

/// Default bytes per pipelined chunk on the staged host path.
pub const DEFAULT_STAGE_CHUNK: usize = 4 << 20;

/// The largest block of a one-part host collective that runs on the
/// caller's thread when its device is idle: a copy this size takes about
/// what the hand-over to the device thread does.
const INLINE_MAX_BYTES: usize = 64 << 10;

/// One client per device of one runtime, in one process.
///
/// Its collectives take one buffer per member (index `i` belongs to member
/// `i`'s device), check their arguments before anything is queued, then
/// queue each member's part on that member's device thread, in one
/// process-wide order, and return at once. A later read (or any work) of a
/// destination on its device runs after the collective, so there is no
/// separate sync to call. A collective that fails marks every destination
/// it should have written, on every member, with the cause.
///
/// Cloning is cheap; clones share the cached communicator.
#[derive(Debug, Clone)]
pub struct ClientGroup {
    clients: Vec<Client>,
    communicator: Arc<DeviceSetComm>,
    /// How collectives move bytes now, and by default.
    route: Route,
    auto_route: Route,
    direct: bool,
    timeout: Duration,
    stage_chunk: usize,
    /// The flight recorder's name of this device set.
    record_name: Arc<str>,
    /// Which path all-reduces and all-gathers take on NCCL routes.
    algo: Algo,
    /// Whether every member reaches every other's memory (peer kernels can
    /// run): decided once, for NCCL routes of 2 to 8 members.
    peers_reach: bool,
}

/// One buffer's worth of a collective for one member: what it sends and
/// what it receives.
pub(crate) struct Part {
    member: usize,
    input: Option<Handle>,
    output: Option<Handle>,
}

/// One collective's parts, inline (no heap allocation) for up to four.
pub(crate) type Parts = SmallVec<[Part; 4]>;

impl ClientGroup {
    /// A group over `clients`, member `i` being `clients[i]`.
    ///
    /// Refuses an empty list, a device listed twice and clients of different
    /// runtimes. The first group over a device that offers device
    /// collectives waits for one small task there (does the library load?);
    /// later groups do not wait.
    ///
    /// Where every member's backend offers device collectives (CUDA), the
    /// group's collectives go device to device through NCCL (a group of one
    /// device: plain device copies, no NCCL); without libnccl they fall back
    /// to host staging, and the first such group logs why (see
    /// [`ClientGroup::transport`]). The NCCL communicators themselves are
    /// made on the first collective, on every member's device at once.
    ///
    /// An unusable `COHORT_TIMEOUT`, `COHORT_NCCL_SINGLE` or
    /// `COHORT_FLIGHT_RECORDER` is returned as [`CommError::Variable`].
    pub fn new(clients: Vec<Client>) -> Result<ClientGroup, CommError> {
        crate::check::check_clients(&clients)?;
        let timeout = default_timeout()?;
        config::check(&[&config::NCCL_SINGLE, &config::FLIGHT_RECORDER, &config::ALGO, &config::FUSION_MB])?;
        let communicator = communicator(&clients);
        let direct = communicator.host_addressable();
        let route = device::choose(&clients);
        let record_name = Arc::from(record_name(&clients));
        let peers_reach = matches!(route, Route::Nccl(_))
            && (2..=cohort_runtime::backend::PEER_MAX_RANKS).contains(&clients.len())
            && clients.iter().all(|a| clients.iter().all(|b| a.can_access_peer(b)));
        Ok(ClientGroup {
            algo: peer::algo_from_env(),
            peers_reach,
            record_name,
            clients,
            communicator,
            auto_route: route.clone(),
            route,
            direct,
            timeout,
            stage_chunk: DEFAULT_STAGE_CHUNK,
        })
    }

    /// How this group's collectives move bytes: NCCL, device copies (one
    /// device), or the host (direct or staged).
    pub fn transport(&self) -> Transport {
        match self.route {
            Route::Nccl(_) => Transport::Nccl,
            Route::Local => Transport::LocalCopy,
            Route::Host if self.direct => Transport::HostDirect,
            Route::Host => Transport::HostStaged,
        }
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// Always `false`: a group has at least one member.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The members' clients, in member order.
    pub fn clients(&self) -> &[Client] {
        &self.clients
    }

    /// Member `member`'s client. Panics when `member >= len()`.
    pub fn client(&self, member: usize) -> &Client {
        &self.clients[member]
    }

    /// The communicator this group's collectives go through (shared by every
    /// group over the same set of devices).
    pub fn communicator(&self) -> &DeviceSetComm {
        &self.communicator
    }

    /// How long a member waits for the others in each collective before the
    /// collective fails and marks its destinations (default: 10 minutes, or
    /// `COHORT_TIMEOUT` seconds).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// This group with another collective timeout (kept from 1 ms to about
    /// 31 years: `Duration::MAX` means no practical limit).
    pub fn with_timeout(mut self, timeout: Duration) -> ClientGroup {
        self.timeout = crate::host::bounded_timeout(timeout);
        self
    }

    /// Whether collectives take the direct host path (`true`: reduce in
    /// device memory through host pointers) or the staged one.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// This group with a forced path for its CUDA all-reduces and
    /// all-gathers (default: `COHORT_ALGO`, else [`Algo::Auto`]): `Nccl`,
    /// or a peer-memory kernel (`OneShot`, `TwoShot`) wherever one can run
    /// (2 to 8 devices that reach each other's memory, at most
    /// [`cohort_runtime::backend::PEER_MAX_BYTES`] per member); the rest
    /// goes to NCCL. Cheap: clone the group to force a path for one call.
    pub fn with_algo(mut self, algo: Algo) -> ClientGroup {
        self.algo = algo;
        self
    }

    /// The path `with_algo` (or `COHORT_ALGO`) set.
    pub fn algo(&self) -> Algo {
        self.algo
    }

    /// The path a collective `op` of this group takes now: NCCL or a
    /// peer-memory kernel (`None` off the NCCL route).
    pub fn path_of(&self, op: &Op) -> Option<Path> {
        let Route::Nccl(_) = self.route else { return None };
        if !self.peers_reach {
            return Some(Path::Nccl);
        }
        Some(peer::choose(self.algo, op, self.len(), &self.clients[0].properties().name))
    }

    /// This group with a chosen host path. `Direct` is refused where a
    /// member's memory is not host-addressable. `Direct` and `Staged` also
    /// turn the device path (NCCL, device copies) off; `Auto` restores the
    /// default.
    pub fn with_host_path(mut self, path: HostPath) -> Result<ClientGroup, CommError> {
        let addressable = self.communicator.host_addressable();
        self.route = match path {
            HostPath::Auto => self.auto_route.clone(),
            _ => Route::Host,
        };
        self.direct = match path {
            HostPath::Auto => addressable,
            HostPath::Staged => false,
            HostPath::Direct if addressable => true,
            HostPath::Direct => return Err(CommError::DirectUnsupported { backend: self.clients[0].name() }),
        };
        Ok(self)
    }

    /// This group with `bytes` per pipelined chunk on the staged path
    /// (rounded down to a multiple of 16, at least 16; default 4 MiB).
    pub fn with_stage_chunk(mut self, bytes: usize) -> ClientGroup {
        self.stage_chunk = (bytes / 16 * 16).max(16);
        self
    }

    /// Waits for everything queued on every member's stream (this thread's
    /// stream, or the pinned one); every device drains at once, and the
    /// first error in member order is returned once all finished.
    pub fn sync(&self) -> Result<(), CommError> {
        Client::sync_all(&self.clients).map_err(|source| CommError::Failed { operation: "sync", source })
    }

    /// How one collective's parts run on the device path, or `None` for the
    /// host path. `op`'s endpoints are slots of `parts`.
    fn device_mode(&self, op: &Op, parts: &[Part]) -> Result<Option<Mode>, CommError> {
        if let Some((from, to)) = op.endpoints() {
            if from == to && !matches!(self.route, Route::Host) {
                return Ok(Some(Mode::Local));
            }
            if from != to {
                let (a, b) = (&self.clients[parts[from].member], &self.clients[parts[to].member]);
                let peers = !matches!(self.route, Route::Host) || self.peer_copies_on_host_path();
                if peers && a.can_access_peer(b) {
                    return Ok(Some(Mode::Peer));
                }
                if let Route::Nccl(_) = self.route {
                    let pair = device::nccl_set(&[a.clone(), b.clone()])
                        .map_err(|source| CommError::Failed { operation: op.name(), source })?;
                    return Ok(Some(Mode::Nccl(pair)));
                }
            }
        }
        Ok(match &self.route {
            Route::Host => None,
            Route::Local => Some(Mode::Local),
            // Members sharing a GPU run the peer kernels; NCCL takes one
            // rank per GPU, so their other calls go through the host.
            Route::Nccl(set) if set.shared_gpu && !self.takes_peer_kernel(op, parts.len()) => None,
            Route::Nccl(set) => Some(Mode::Nccl(set.clone())),
        })
    }

    /// Whether `op` with `parts` parts runs on a peer-memory kernel.
    fn takes_peer_kernel(&self, op: &Op, parts: usize) -> bool {
        parts == self.len() && self.path_of(op).is_some_and(|path| path.peer().is_some())
    }

    /// Whether the staged host path was chosen on devices that offer peer
    /// access (their sends may still go device to device).
    fn peer_copies_on_host_path(&self) -> bool {
        !self.direct && self.clients[0].capabilities().peer_access
    }

    /// Records collective `sequence` in the flight recorder (and timeline):
    /// `parts` parts, the first on member `first`, on `path` where chosen.
    fn track(&self, sequence: u64, op: &Op, first: usize, parts: usize, path: Option<Path>) -> Arc<Watched> {
        let tid = self.clients.get(first).map_or(0, |c| c.device_id().index);
        let category = if op.collective() == Collective::SendRecv { "copy" } else { "collective" };
        // A process-local group: only this process takes part.
        let ranks = Ranks::One(FlightRecorder::global().identity().0);
        Watched::start(&self.record_name, sequence, op, parts, ranks, Row { category, tid }, path.map(Path::name))
    }

    /// Queues every part of one collective, under the process-wide order.
    /// Returns its handle once all parts are
    /// queued; a part that could not be queued fails the whole collective.
    fn launch(&self, op: Op, parts: Parts) -> Result<Work, CommError> {
        stages::mark(Stage::Checked);
        let operation = op.name();
        // The executors see roots and endpoints as slots of `parts`.
        let members: SmallVec<[usize; 4]> = parts.iter().map(|p| p.member).collect();
        let on_slots = op.on_slots(&members);
        let bytes = op.block_bytes();
        let mode = self.device_mode(&on_slots, &parts)?;
        // Inside a capture window only work queued on the device's own
        // stream can be recorded: NCCL calls, peer kernels and device
        // copies. Host staging and peer copies (events across devices)
        // cannot, and are refused before anything is queued. A part
        // recorded into a graph runs only at replay, one queued now at
        // once: captured on some members only, the two would wait for each
        // other forever.
        let recordable = matches!(mode, Some(Mode::Nccl(_) | Mode::PeerKernel(..) | Mode::Local));
        let mut first_captured = None;
        for part in &parts {
            let captured = self.clients[part.member].is_capturing();
            if !recordable && captured {
                return Err(CommError::Capturing { operation, member: part.member });
            }
            match first_captured {
                None => first_captured = Some(captured),
                Some(first) if first != captured => {
                    let member = if captured { parts[0].member } else { part.member };
                    return Err(CommError::CapturingPartly { operation, member });
                }
                Some(_) => {}
            }
        }
        let first = members.first().copied().unwrap_or(0);
        if let Some(mut mode) = mode {
            let mut path = None;
            if let Mode::Nccl(set) = &mode {
                if parts.len() == self.len() {
                    let chosen = self.path_of(&on_slots).unwrap_or(Path::Nccl);
                    if let Some(algo) = chosen.peer() {
                        mode = Mode::PeerKernel(set.clone(), algo);
                    }
                    path = Some(chosen);
                }
            }
            stages::mark(Stage::Routed);
            let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(operation, sequence, bytes, members = parts.len(), ?mode, "queue device collective");
            let tracked = self.track(sequence, &op, first, parts.len(), path);
            stages::mark(Stage::Recorded);
            if device::solo::fits(&on_slots, &mode, parts.len()) {
                let (input, output) = (parts[0].input.as_ref(), parts[0].output.as_ref());
                let client = &self.clients[first];
                return device::solo::launch(client, first, self.timeout, on_slots, mode, input, output, Some(tracked))
                    .map(|solo| Work::new(operation, solo));
            }
            let part = |_call: usize, slot: usize| (parts[slot].input.as_ref(), parts[slot].output.as_ref());
            return device::launch(&self.clients, self.timeout, on_slots, mode, &members, part, Some(tracked))
                .map(|collective| Work::new(operation, collective));
        }
        let seats = parts.iter().map(|p| Seat { member: Some(p.member), device: self.clients[p.member].device_id() });
        let collective = HostCollective::new(on_slots, seats, self.timeout, self.direct, self.stage_chunk);
        let mut tasks: SmallVec<[_; 4]> = SmallVec::with_capacity(parts.len());
        for (slot, part) in parts.iter().enumerate() {
            let (inputs, outputs) =
                collective.task_buffers(slot, part.input.as_ref(), part.output.as_ref()).map_err(|source| {
                    CommError::Enqueue {
                        operation,
                        member: part.member,
                        device: self.clients[part.member].device_id(),
                        source,
                    }
                })?;
            tasks.push((part.member, inputs, outputs, Ticket::new(&collective, slot)));
        }
        let sequence = self.communicator.issued.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(operation, sequence, bytes, members = tasks.len(), direct = self.direct, "queue collective");
        let tracked = self.track(sequence, &op, first, parts.len(), None);
        // A small collective of one part meets nobody but itself: where its
        // device is idle (CPU backend), it runs on this thread at once,
        // without the hand-over to the device thread and its wake-up. Only
        // on the direct path: a staged part waits for chunk jobs on rayon's
        // pool, which the caller's thread may be part of. A part of one
        // device keeps no order across devices, so it takes no enqueue lock
        // (a reduction running inline must not hold up other threads'
        // enqueues).
        let inline = tasks.len() == 1 && bytes <= INLINE_MAX_BYTES && self.direct;
        let mut failed = None;
        let order = (!inline).then(enqueue_lock);
        for (member, inputs, outputs, ticket) in tasks {
            let client = &self.clients[member];
            // A part that cannot be queued drops its ticket, which fails the
            // collective for the parts already queued.
            let tracked = tracked.clone();
            // The part's hold on the record goes before its ticket returns
            // (the body owns it): the record of a collective whose last part
            // ended is finished before the waiter is released.
            let task = move |access: Result<&mut BufferAccess<'_>, ServerError>| {
                ticket.run(move |collective, slot| {
                    let result = collective.run_member(slot, access);
                    tracked.note(&result);
                    result
                })
            };
            let queued = match inline {
                true => client.submit_buffers_inline(operation, inputs, outputs, task),
                false => client.submit_buffers_always(operation, inputs, outputs, task),
            };
            if let Err(source) = queued {
                failed.get_or_insert(CommError::Enqueue { operation, member, device: client.device_id(), source });
            }
        }
        drop(order);
        match failed {
            Some(err) => Err(err),
            None => Ok(Work::new(operation, collective)),
        }
    }
}

/// The recorder's name of the group over `clients`: its device set, the
/// same for every group over those devices (they share one sequence).
fn record_name(clients: &[Client]) -> String {
    let mut devices: Vec<String> = clients.iter().map(|c| c.device_id().to_string()).collect();
    devices.sort();
    format!("group[{}]", devices.join(","))
}
