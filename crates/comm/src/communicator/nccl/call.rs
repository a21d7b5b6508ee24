//! One NCCL-path call on a rank of several local devices: its local parts
//! meet (the last runs the host check: the collective's fingerprints with
//! the other ranks, or a message's with its other rank), each queues its
//! NCCL calls ([`part_task`], [`issue_part`]), and a [`PartMonitor`] per part watches them
//! on its device until they end. The call's done hook (its flight record)
//! runs when the last local part ended. A rank of one device runs its calls
//! as a `OneCall` (`one.rs`: no meeting) instead, through the
//! same [`part_task`] and [`PartMonitor`] ([`PartOwner`] is what both ask
//! of the call).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::backend::{CollectiveMonitor, CommSpec, Completion, PeerCall, PeerSpec};
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, CopyRegion, DeviceId, ServerError, TaskHandles};
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::{host_check, Nccl, ABORT_POLL};
use crate::communicator::failure::{Failure, FailureKind};
use crate::communicator::fingerprint::Fingerprint;
use crate::communicator::keys;
use crate::communicator::world::World;
use crate::device::fusion::{self, Bucket};
use crate::device::plan::{self, Buffers};
use crate::meeting::{Gathering, Meeting, Seat, Seated};
use crate::op::Collective;
use crate::op::Op;

/// One call of a part: its description and the binding indices of its
/// buffers in the part's task.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartLayout {
    pub op: Op,
    pub input: Option<usize>,
    pub output: Option<usize>,
    pub scratch: Option<usize>,
}

/// What one local part's task holds: its sources, its destinations (then
/// each call's scratch copy of its source, where it reads one, and each
/// fusion bucket's scratch), and where each call's buffers are among them
/// (bindings number inputs first).
pub(crate) struct PartBuffers {
    pub input: TaskHandles,
    pub output: TaskHandles,
    pub layout: SmallVec<[PartLayout; 1]>,
    pub fusion: PartFusion,
}

/// A part's fused all-reduces: the group's buckets (the same on every
/// member) and, by bucket, the binding of this part's scratch buffer.
#[derive(Debug, Clone)]
pub(crate) struct PartFusion {
    /// `None` where nothing fuses (no allocation for a single call).
    pub buckets: Option<Arc<[Bucket]>>,
    pub scratch: SmallVec<[usize; 4]>,
}

/// What an NCCL-path call keeps in its meeting.
pub(crate) struct NcclState {
    /// The leader's host check, once done.
    checked: Option<Result<(), Failure>>,
    /// Parts that ended: returned without queueing NCCL calls, or whose
    /// queued calls completed or failed on the device (how many, which).
    ended: usize,
    ended_slots: SmallVec<[bool; 8]>,
    /// What kind of failure it was, where one said (a mismatch or timeout
    /// in the host check, an abort seen in the store, the device's
    /// timeout); anything else is [`FailureKind::Other`].
    kind: Option<FailureKind>,
}

/// The call's outcome, for its flight record.
fn outcome(state: &Gathering<NcclState>) -> Result<(), Failure> {
    match state.failure() {
        None => Ok(()),
        Some(err) => Err(Failure::new(state.data.kind.unwrap_or(FailureKind::Other), err.to_string())),
    }
}

/// What a finished NCCL-path call reports to (the flight recorder's tracker).
type DoneHook = Box<dyn FnOnce(Result<(), Failure>) + Send>;

/// What every NCCL-path call of this rank holds, whatever its parts.
pub(crate) struct CallCore {
    pub nccl: Arc<Nccl>,
    pub world: Arc<Mutex<World>>,
    pub fp: Fingerprint,
    /// Its fingerprint check is sent ahead (see `World::send_check_ahead`):
    /// the part is queued without waiting for the other ranks'
    /// fingerprints, and ends as done only once each was compared.
    pub ahead: bool,
    /// The collective's name (`group` for a grouped call).
    pub name: &'static str,
    pub timeout: Duration,
}

impl CallCore {
    /// The call's host check, run once on this rank before its NCCL calls
    /// are queued: sent ahead, or waited for (the collective's fingerprints
    /// with the other ranks, or a message's with its other rank).
    pub(crate) fn check(&self) -> Result<(), Failure> {
        let fp = self.fp;
        match self.ahead {
            true => self.world.lock().send_check_ahead(fp),
            false => self.world.lock().run(fp, |w| host_check(w, &fp)),
        }
    }
}

/// What a part's issuing and its [`PartMonitor`] ask of the call the part
/// belongs to: an [`NcclCall`] of several local parts, or a `OneCall`.
pub(crate) trait PartOwner: Send + Sync + 'static {
    fn core(&self) -> &CallCore;
    /// The call's failure, once any part met one.
    fn failure(&self) -> Option<ServerError>;
    /// The call's error on part `slot`'s device, for `reason`.
    fn error(&self, slot: usize, reason: String) -> ServerError;
    /// Notes what kind of failure the call met (the first said wins).
    fn note_kind(&self, kind: FailureKind);
    /// Fails the call (every part and waiter gets the first failure, which
    /// is returned).
    fn fail(&self, err: ServerError) -> ServerError;
    /// Part `slot` ended: its calls completed or failed on the device, or
    /// it queued none.
    fn end_part(&self, slot: usize);
}

/// The local parts of one NCCL-path call.
pub(crate) struct NcclCall {
    core: CallCore,
    meeting: Meeting<NcclState>,
    /// Called once, with the outcome, when every local part has ended.
    on_done: Mutex<Option<DoneHook>>,
}

impl Seated for NcclCall {
    type State = NcclState;

    fn meeting(&self) -> &Meeting<NcclState> {
        &self.meeting
    }

    /// A part that never ran has ended.
    fn dropped_unrun(&self, slot: usize) {
        self.end_part(slot);
    }

    /// A part is done once it ended (its NCCL calls completed or failed).
    fn part_done(&self, state: &Gathering<NcclState>, slot: usize) -> bool {
        state.data.ended_slots[slot]
    }
}

impl NcclCall {
    /// The parts of `core`'s call on this rank's `devices` (its check
    /// waited for by the last to arrive).
    pub(crate) fn new(core: CallCore, devices: impl ExactSizeIterator<Item = DeviceId>) -> Arc<NcclCall> {
        let n = devices.len();
        let seats = devices.map(|device| Seat { device, member: None });
        let state = NcclState { checked: None, ended: 0, ended_slots: smallvec::smallvec![false; n], kind: None };
        let meeting = Meeting::new(core.name, seats, core.timeout, state);
        Arc::new(NcclCall { core, meeting, on_done: Mutex::new(None) })
    }

    /// Runs `hook` with the call's outcome once every local part ended (its
    /// NCCL calls completed on the device, or failed), at once if they have.
    pub(crate) fn on_done(&self, hook: impl FnOnce(Result<(), Failure>) + Send + 'static) {
        let state = self.meeting.lock();
        if state.data.ended < self.meeting.len() {
            *self.on_done.lock() = Some(Box::new(hook));
            return;
        }
        let outcome = outcome(&state);
        drop(state);
        hook(outcome);
    }

    /// Waits for every local part; the last runs the host check.
    fn meet(&self, slot: usize, deadline: Instant) -> Result<(), ServerError> {
        let meeting = &self.meeting;
        let mut state = meeting.lock();
        if meeting.arrive_locked(&mut state, slot)? {
            drop(state);
            let result = self.core.check();
            meeting.lock().data.checked = Some(result.clone());
            meeting.notify();
            return result.map_err(|failure| {
                self.note_kind(failure.kind);
                meeting.fail(meeting.error(slot, failure.message))
            });
        }
        meeting.wait_arrivals(&mut state, slot, deadline)?;
        // Every part arrived: the leader's check is bounded by the world's
        // own deadline.
        loop {
            if let Some(err) = state.failure() {
                return Err(err.clone());
            }
            if let Some(checked) = &state.data.checked {
                return checked.clone().map_err(|failure| meeting.error(slot, failure.message));
            }
            meeting.sleep(&mut state);
        }
    }

    /// Part `slot`'s task: meets the other local parts and queues its NCCL
    /// calls, returning once they are queued (a barrier waits for them).
    /// The part ends here unless a [`PartMonitor`] took over ending it.
    pub(crate) fn run_part(
        self: &Arc<Self>,
        slot: usize,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        layout: &[PartLayout],
        fusion: &PartFusion,
    ) -> Result<(), ServerError> {
        part_task(self, slot, access, layout, fusion, || self.meet(slot, Instant::now() + self.meeting.timeout()))
    }
}

impl PartOwner for NcclCall {
    fn core(&self) -> &CallCore {
        &self.core
    }

    fn failure(&self) -> Option<ServerError> {
        self.meeting.failure()
    }

    fn error(&self, slot: usize, reason: String) -> ServerError {
        self.meeting.error(slot, reason)
    }

    fn note_kind(&self, kind: FailureKind) {
        self.meeting.lock().data.kind.get_or_insert(kind);
    }

    fn fail(&self, err: ServerError) -> ServerError {
        self.meeting.fail(err)
    }

    /// One local part ended; the last runs the done hook.
    fn end_part(&self, slot: usize) {
        let mut state = self.meeting.lock();
        if std::mem::replace(&mut state.data.ended_slots[slot], true) {
            return;
        }
        state.data.ended += 1;
        self.meeting.notify();
        if state.data.ended == self.meeting.len() {
            let outcome = outcome(&state);
            drop(state);
            if let Some(hook) = self.on_done.lock().take() {
                hook(outcome);
            }
        }
    }
}

/// Part `slot`'s task, for `owner`'s call: once its buffers are bound and
/// `ready` passed (the meeting of the local parts and the check, or a
/// one-device rank's check alone), queues its calls ([`issue_part`]),
/// returning once they are queued. The part ends here unless its
/// [`PartMonitor`] took over ending it; a failure fails the call.
pub(crate) fn part_task<O: PartOwner>(
    owner: &Arc<O>,
    slot: usize,
    access: Result<&mut BufferAccess<'_>, ServerError>,
    layout: &[PartLayout],
    fusion: &PartFusion,
    ready: impl FnOnce() -> Result<(), ServerError>,
) -> Result<(), ServerError> {
    let mut handed = false;
    let result = (|| {
        let access = access.map_err(|err| owner.fail(err))?;
        ready()?;
        issue_part(owner, slot, access, layout, fusion, &mut handed)
    })();
    if !handed {
        owner.end_part(slot);
    }
    result
}

/// Queues part `slot`'s calls once its check passed (sent ahead or
/// waited): a peer kernel where the communicator's fast path chose one,
/// else its NCCL calls (a grouped call's fused all-reduces packed into
/// their buckets first and unpacked after), each watched on the device by
/// a [`PartMonitor`] of `owner` until it ends. Sets `handed` once the
/// monitor took over ending the part. A failure here aborts the
/// communicator: past the check the other ranks queue their parts, so they
/// must not wait for this one.
fn issue_part<O: PartOwner>(
    owner: &Arc<O>,
    slot: usize,
    access: &mut BufferAccess<'_>,
    layout: &[PartLayout],
    fusion: &PartFusion,
    handed: &mut bool,
) -> Result<(), ServerError> {
    let core = owner.core();
    let nccl = &core.nccl;
    let parts: SmallVec<[(Op, Buffers); 1]> = layout
        .iter()
        .map(|p| {
            let bind = |i: Option<usize>| i.map(|i| access.binding(i));
            (p.op, Buffers { input: bind(p.input), output: bind(p.output), scratch: bind(p.scratch) })
        })
        .collect();
    let (member, members) = (nccl.rank * nccl.local + slot, nccl.size * nccl.local);
    // The peer-memory kernels take one call at a time; a grouped call goes
    // to NCCL whole.
    let peer_call = match parts.as_slice() {
        [(op, buffers)] if core.fp.group.is_none() => peer_call(nccl, op, buffers),
        _ => None,
    };
    let fail = |err: ServerError| {
        nccl.abort(&core.world, &err.to_string());
        owner.fail(err)
    };
    if let Some(peer_call) = peer_call {
        // A source partly overlapping its destination: the kernel reads
        // its copy (`peer_call` took the scratch as its source).
        if let (Some(from), Some(to)) = (layout[0].input, layout[0].scratch) {
            let bytes = access.size(from);
            let copy = CopyRegion { src: from, src_offset: 0, dst: to, dst_offset: 0, bytes };
            access.copy_regions(&[copy]).map_err(fail)?;
        }
        // One device per rank: ranks of separate processes on one GPU are
        // separate contexts, which the GPU time-slices, so none waits for
        // residency. (Ranks that are threads of one process on one GPU
        // share a context: tests only, and not sized for it.)
        let arenas = &nccl.peer.as_ref().expect("chosen").arenas;
        let spec = PeerSpec { set: nccl.key, rank: member, arenas, sharing: 1 };
        let monitor = PartMonitor::start(owner, slot);
        let result = access.run_peer_collective(&spec, &peer_call, monitor.clone(), Completion::Defer);
        *handed = result.is_ok() || monitor.ended.load(Ordering::Acquire);
        return result.map_err(fail);
    }
    // Fused all-reduces: their sources packed into each bucket's scratch
    // first, one call per bucket, unpacked after.
    let at = |c: usize| {
        let p = &layout[c];
        (p.input.expect("an all-reduce has a source"), p.output.expect("an all-reduce has a destination"))
    };
    let buckets = fusion.buckets.as_deref().unwrap_or_default();
    let fused = fusion::part(buckets, layout.len(), &fusion.scratch, at, |i| access.binding(i));
    let calls = fused.nccl_calls(parts.iter().map(|(op, buffers)| (op, buffers)), member, members);
    if calls.is_empty() {
        return Ok(());
    }
    access.copy_regions(&fused.pack).map_err(fail)?;
    let spec = CommSpec { set: nccl.key, rank: member, ranks: members, unique_id: &nccl.unique_id };
    let monitor = PartMonitor::start(owner, slot);
    let barrier = core.fp.group.is_none() && core.fp.op.collective() == Collective::Barrier;
    let completion = if barrier { Completion::Wait } else { Completion::Defer };
    stages::mark(Stage::PartReady);
    let result = access.run_collective(&spec, &calls, monitor.clone(), completion);
    stages::mark(Stage::PartQueued);
    // Queued (its monitor ends the part, now or later) unless refused
    // before any call was queued.
    *handed = result.is_ok() || monitor.ended.load(Ordering::Acquire);
    let ops: SmallVec<[Op; 1]> = parts.iter().map(|(op, _)| *op).collect();
    nccl.note_queued(&ops, &result);
    result.map_err(fail)?;
    access.copy_regions(&fused.unpack).map_err(fail)
}

/// The peer kernel a call's part runs, where the communicator has the
/// fast path and its choice for this call is a kernel.
fn peer_call(nccl: &Nccl, op: &Op, buffers: &plan::Buffers) -> Option<PeerCall> {
    let peer = nccl.peer.as_ref()?;
    let algo = peer.path(op).peer()?;
    crate::device::peer::peer_call_for(op, algo, buffers.scratch.or(buffers.input)?, buffers.output?)
}

/// Arrival note and abort polling of one waiting part.
struct Poll {
    last: Instant,
    noted: bool,
}

/// One local part's view while its NCCL calls run (held by its device
/// until they end, when it ends the part): the call's failure met
/// elsewhere (another local part, a check sent ahead), and (once the part
/// is slow) its arrival note and the store's abort flag, looked at every
/// [`ABORT_POLL`].
pub(crate) struct PartMonitor<O: PartOwner> {
    call: Arc<O>,
    slot: usize,
    started: Instant,
    poll: Mutex<Poll>,
    /// Set once the device reported the part's end.
    ended: AtomicBool,
}

impl<O: PartOwner> PartMonitor<O> {
    /// The monitor of local part `slot` of `call`, its clock started now.
    fn start(call: &Arc<O>, slot: usize) -> Arc<PartMonitor<O>> {
        let started = Instant::now();
        Arc::new(PartMonitor {
            call: call.clone(),
            slot,
            started,
            poll: Mutex::new(Poll { last: started, noted: false }),
            ended: AtomicBool::new(false),
        })
    }

    /// The part's error for `failure` of its check sent ahead (the world
    /// aborted already; the rank's other ranks are told through the store).
    fn failed(&self, failure: Failure) -> ServerError {
        let call = &self.call;
        call.note_kind(failure.kind);
        call.core().nccl.abort(&call.core().world, &failure.message);
        call.error(self.slot, failure.message)
    }
}

impl<O: PartOwner> CollectiveMonitor for PartMonitor<O> {
    fn operation(&self) -> &str {
        self.call.core().name
    }

    fn timeout(&self) -> Duration {
        self.call.core().timeout
    }

    fn failed_elsewhere(&self) -> Option<ServerError> {
        let (call, core) = (&self.call, self.call.core());
        if let Some(err) = call.failure() {
            return Some(err);
        }
        // A check sent ahead moves on every poll: a mismatch can leave the
        // kernels waiting for data that never comes. Not waited for: the
        // world may be busy with another call.
        if core.ahead {
            if let Some(Err(failure)) = core.world.try_lock().map(|mut w| w.poll_ahead(core.fp.seq)) {
                return Some(self.failed(failure));
            }
        }
        let slow = (core.timeout / 4).min(Duration::from_secs(1));
        let now = Instant::now();
        let mut p = self.poll.lock();
        if now - self.started < slow || now - p.last < ABORT_POLL {
            return None;
        }
        p.last = now;
        let nccl = &core.nccl;
        if !p.noted {
            p.noted = true;
            let _ = nccl.store.set(&keys::arrived(&nccl.prefix, core.fp.seq, nccl.rank), b"");
        }
        match nccl.store.get(&keys::abort(&nccl.prefix)) {
            Ok(Some(why)) => {
                call.note_kind(FailureKind::Aborted);
                let why = String::from_utf8_lossy(&why);
                Some(call.error(self.slot, format!("{} stopped: the communicator was aborted by {why}", core.fp)))
            }
            _ => None,
        }
    }

    /// Asked by the device only when the part timed out.
    fn missing(&self) -> String {
        let core = self.call.core();
        self.call.note_kind(FailureKind::Timeout);
        // Its calls may have completed while its check was not compared.
        let owed = match core.ahead {
            true => core.world.try_lock().map(|mut w| (w.poll_ahead(core.fp.seq), w.ahead_owed_by(core.fp.seq))),
            false => None,
        };
        let check = match owed {
            Some((Ok(false), ranks)) if !ranks.is_empty() => {
                let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
                format!(" (its check sent ahead still waits for the fingerprint of rank(s) {})", ranks.join(", "))
            }
            _ => String::new(),
        };
        format!("{}: {}{check}", core.fp, core.nccl.missing(core.fp.seq))
    }

    /// A check sent ahead must have been compared with every other rank's
    /// fingerprint (and this rank's have left for them) before the part is
    /// done. Each rank sent its fingerprint before it queued its own part,
    /// so they are usually there already; until they are, the part stays pending
    /// (and times out like a running one, naming the ranks that never
    /// arrived). Not waited for: the world may be busy with another call.
    fn confirm(&self) -> Option<Result<(), ServerError>> {
        let core = self.call.core();
        if !core.ahead {
            return Some(Ok(()));
        }
        match core.world.try_lock()?.ahead_done(core.fp.seq) {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(failure) => Some(Err(self.failed(failure))),
        }
    }

    fn finished(&self, outcome: &Result<(), ServerError>) {
        let call = &self.call;
        if let Err(err) = outcome {
            call.core().nccl.abort(&call.core().world, &err.to_string());
            call.fail(err.clone());
        }
        if !self.ended.swap(true, Ordering::AcqRel) {
            call.end_part(self.slot);
        }
    }
}
