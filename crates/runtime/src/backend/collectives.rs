//! The backend-neutral hook for collectives that move bytes device to device
//! (NCCL on CUDA) and for peer access between devices of one runtime.
//!
//! The communication layer drives it from buffer tasks
//! ([`crate::BufferAccess::device_collectives`]): each member's task hands its
//! backend the calls of its part, with its buffers resolved to [`Binding`]s,
//! and the backend queues them on its own communicator. The device's queue
//! then runs on: a part's completion is found later, when the device polls
//! it (when idle, and whenever it waits for a stream), and a failure marks
//! the part's outputs then, as a kernel fault does.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::Binding;
use crate::dtype::{DType, ReduceOp};
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};

/// One primitive of a member's part of a collective. Counts come from the
/// bindings' sizes; roots and peers are ranks of the communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCall {
    /// Element-wise reduction of every rank's `src` into every rank's `dst`.
    AllReduce { src: Binding, dst: Binding, dtype: DType, op: ReduceOp },
    /// ReduceOp of every rank's `src` into `dst` on `root` (`None` elsewhere).
    Reduce { src: Binding, dst: Option<Binding>, dtype: DType, op: ReduceOp, root: usize },
    /// `root`'s `src` (`None` elsewhere) copied into every rank's `dst`.
    Broadcast { src: Option<Binding>, dst: Binding, root: usize },
    /// Every rank's `src` concatenated, in rank order, into every `dst`.
    AllGather { src: Binding, dst: Binding },
    /// The reduction of every rank's `src`, block `rank` of it into `dst`.
    ReduceScatter { src: Binding, dst: Binding, dtype: DType, op: ReduceOp },
    /// `src` sent to rank `peer` (grouped with the other calls of the part).
    Send { src: Binding, peer: usize },
    /// `dst` received from rank `peer`.
    Recv { dst: Binding, peer: usize },
    /// A copy on this device, issued before the part's other calls.
    Copy { src: Binding, dst: Binding },
    /// A barrier: a one-element all-reduce on scratch memory of the backend.
    Barrier,
}

/// Which communicator a part runs on: one per device set and member order,
/// known by `set` (unique in the process), created on its first use from
/// `unique_id` (from [`DeviceCollectives::unique_id`], the same for every
/// member).
#[derive(Debug, Clone, Copy)]
pub struct CommSpec<'a> {
    /// The communicator's key.
    pub set: u64,
    /// This member's rank.
    pub rank: usize,
    /// Number of ranks.
    pub ranks: usize,
    /// The opaque id every member's communicator is created from.
    pub unique_id: &'a [u8],
}

/// What a member's part of a device collective answers while it is queued
/// on the device, and is told when it ends. The backend asks it whenever it
/// polls the part (on the device thread) and keeps it until the part ends.
pub trait CollectiveMonitor: Send + Sync {
    /// The collective's name, for errors.
    fn operation(&self) -> &str;
    /// How long the part may run, counted from when it reaches the front of
    /// the device's queue of collectives; past it the communicator is
    /// aborted and the error names [`CollectiveMonitor::missing`].
    fn timeout(&self) -> Duration;
    /// A failure found outside the part's own calls (another member's, or
    /// a check of the call that runs beside them), if any: the part is
    /// aborted with it rather than waited for. Its message says which.
    fn failed_elsewhere(&self) -> Option<ServerError>;
    /// The members that have not finished, in words; asked only when the
    /// part timed out, to build its error.
    fn missing(&self) -> String;
    /// Asked once the part's calls completed on the device, before it ends
    /// as done, and asked again at every poll until it answers: `None`
    /// while something the part depends on is not known yet (a check of the
    /// call that runs beside its kernels: the part stays at the head of the
    /// device's queue, polled and timed out like a running one), `Some(Ok)`
    /// to end it as done, `Some(Err)` to end it as failed and abort its
    /// communicator. Never waits. By default there is nothing to confirm.
    fn confirm(&self) -> Option<Result<(), ServerError>> {
        Some(Ok(()))
    }
    /// The part ended: `Ok` once its calls completed on the device, or the
    /// error that aborted it (also when the device's context was lost).
    /// Called once, on the device thread, for every part whose calls were
    /// queued, never for a part `run` refused.
    fn finished(&self, outcome: &Result<(), ServerError>);
}

/// Whether [`DeviceCollectives::run`] waits for the part's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Return once the calls are queued; the part is polled later
    /// ([`DeviceCollectives::poll`]) and its outcome reported then.
    Defer,
    /// Wait (polling) until the calls completed or failed.
    Wait,
}

/// A part queued by [`DeviceCollectives::run`] that had not completed when
/// it returned; [`DeviceCollectives::poll`] reports its end by this id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PendingPart(pub u64);

/// A word in host memory that the device writes once the collective parts
/// running when it was asked for have ended
/// ([`DeviceCollectives::end_signal`]): a waiter reads it without entering
/// the device, and polls the device (which reaps the parts) once it is
/// written. It says nothing of failures: a part that fails never writes
/// it, and is found by the device's polls.
pub struct EndSignal {
    /// Keeps the word's memory alive (the backend's page).
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    word: *const AtomicU32,
    target: u32,
}

// SAFETY: `word` points into `_owner`, shared memory read only through an
// atomic, alive as long as the signal.
unsafe impl Send for EndSignal {}
// SAFETY: as above.
unsafe impl Sync for EndSignal {}

impl EndSignal {
    /// The signal that `word`, inside `owner`, reached `target`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new<T: Send + Sync + 'static>(owner: Arc<T>, word: impl Fn(&T) -> &AtomicU32, target: u32) -> Self {
        let word: *const AtomicU32 = word(&owner);
        Self { _owner: owner, word, target }
    }

    /// Whether the device wrote the word: the parts it stands for ended.
    /// A read of host memory; never enters the device.
    pub fn reached(&self) -> bool {
        // SAFETY: `word` lives as long as `_owner`, which `self` holds.
        count_reached(unsafe { &*self.word }.load(Ordering::Acquire), self.target)
    }
}

/// How often a waiter that reads an [`EndSignal`] polls the device anyway:
/// the word stands behind the last part running when it was asked for,
/// which may be another thread's longer one queued after the waiter's.
pub const END_SIGNAL_REPOLL: Duration = Duration::from_micros(10);

/// Whether a count that wraps, now `value`, reached `target`: up to 2^31
/// counts past it still count as reached.
pub(crate) fn count_reached(value: u32, target: u32) -> bool {
    value.wrapping_sub(target) as i32 >= 0
}

impl std::fmt::Debug for EndSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndSignal").field("target", &self.target).field("reached", &self.reached()).finish()
    }
}

/// A device's half of a peer copy: an address in the sender's memory and an
/// event after the work that wrote it (opaque to everyone but the backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerToken {
    /// The device the token comes from.
    pub device: DeviceId,
    /// Device address of the bytes (0 for a completion token).
    pub address: u64,
    /// Bytes at `address`.
    pub size: u64,
    /// The backend's event, as an integer.
    pub event: u64,
}

/// Device-to-device collectives and peer access of one device's backend.
/// Every call runs on the device's server thread.
pub trait DeviceCollectives {
    /// `Ok` when collectives can run here (the collective library loaded and
    /// not disabled); `Err` says why not, in words.
    fn available(&mut self) -> Result<(), String>;

    /// A fresh communicator id for a new device set (waits for the library's
    /// call, which is quick).
    fn unique_id(&mut self) -> Result<Vec<u8>, ServerError>;

    /// Issues `calls` on this member's communicator (created on first use,
    /// which waits for every member to create theirs) on `stream`, after the
    /// work queued there and after the device's earlier parts (from any
    /// stream), so later work on `stream` sees their results. With [`Completion::Defer`] it returns once they
    /// are queued: `Some(part)` while they run, to be reported by
    /// [`DeviceCollectives::poll`]. With [`Completion::Wait`] it polls until
    /// they are done and returns `None`, or their error. `monitor` learns
    /// the outcome of every part whose calls were queued (not of one refused
    /// before, whose error `run` returns). A communicator that fails or
    /// times out is aborted, with the parts still queued on it, and later
    /// parts on it fail at once.
    fn run(
        &mut self,
        stream: StreamId,
        comm: &CommSpec<'_>,
        calls: &[DeviceCall],
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<Option<PendingPart>, ServerError>;

    /// Creates this device's communicator `set` by splitting its
    /// communicator of `parent` (created first from `parent`'s id when this
    /// device has none yet), as `ncclCommSplit` does: collective over every
    /// member of `parent`, each of which calls it with its `color` (`None`:
    /// it joins no group but must still call) and `key` (ranks in the new
    /// communicator follow keys, then parent ranks). With `share`, the new
    /// communicator shares the parent's resources where the library allows.
    /// Waits for every member of `parent`. On NCCL that wait is bounded
    /// (by `timeout`, and by `stop`, asked now and then whether the job gave
    /// up with `Some(why)`; past either the split fails and the parent's
    /// communicator is aborted) only where the parent is non-blocking
    /// (`NCCL_COMM_BLOCKING=0`): a blocking parent splits inside NCCL, which
    /// waits with no bound, so callers make sure every member arrived
    /// first. The new communicator is blocking (see `SplitConfig`). The
    /// default refuses: only a backend with a collective library splits.
    #[allow(clippy::too_many_arguments)]
    fn split(
        &mut self,
        parent: &CommSpec<'_>,
        set: u64,
        color: Option<u32>,
        key: usize,
        share: bool,
        timeout: std::time::Duration,
        stop: &dyn Fn() -> Option<String>,
    ) -> Result<(), ServerError> {
        let _ = (parent, set, color, key, share, timeout, stop);
        Err(ServerError::InvalidState {
            operation: "split",
            reason: "this device's backend cannot split a device communicator".into(),
        })
    }

    /// Whether parts are running, or ended without being reported by
    /// [`DeviceCollectives::poll`] yet.
    fn has_pending(&mut self) -> bool;

    /// A host word the device writes once every part running now has
    /// ended (see [`EndSignal`]); `None` when none runs, or the backend
    /// cannot write one. Queues a write where the last running part has
    /// none yet (on CUDA that costs the host ~1.5 µs, so only a waiter asks).
    fn end_signal(&mut self) -> Option<EndSignal> {
        None
    }

    /// Looks at the parts still running without waiting: each that
    /// completed, failed (an asynchronous error, another member's failure)
    /// or ran past its timeout ends, aborting its communicator if it did not
    /// complete. Returns the parts that ended, with their outcomes.
    fn poll(&mut self) -> Vec<(PendingPart, Result<(), ServerError>)>;

    /// Destroys this device's communicator of `set`, if it has one, once
    /// its parts still running ended (waits for them, polling).
    fn release(&mut self, set: u64);

    /// Whether this device can address `peer`'s memory directly (asks the
    /// driver; quick). `false` for devices of other backends.
    fn can_access_peer(&mut self, peer: DeviceId) -> bool;

    /// Lets every device of this backend that can reach this device's memory
    /// address it; returns those devices. Idempotent.
    fn share_with_peers(&mut self) -> Result<Vec<DeviceId>, ServerError>;

    /// The sending half of a peer copy of `src`: a token after the work
    /// queued so far on `stream` (does not wait).
    fn peer_export(&mut self, stream: StreamId, src: Binding) -> Result<PeerToken, ServerError>;

    /// The receiving half: copies the exported bytes into `dst` on `stream`,
    /// after the sender's work, device to device; returns a token the sender
    /// passes to [`DeviceCollectives::peer_finish`]. Does not wait.
    fn peer_import(&mut self, stream: StreamId, from: &PeerToken, dst: Binding) -> Result<PeerToken, ServerError>;

    /// Orders `stream` after the copy that `done` stands for (so the source
    /// is not overwritten before it is read). Does not wait.
    fn peer_finish(&mut self, stream: StreamId, done: &PeerToken) -> Result<(), ServerError>;

    /// This device's staging arena for the peer-memory collectives of
    /// `set` (allocated on first use, [`PEER_ARENA_BYTES`]): its device
    /// address, which every member of the set passes to
    /// [`DeviceCollectives::run_peer`]. Also lets the devices of this process
    /// that can reach this one address it. Unsupported by default.
    fn peer_arena(&mut self, set: u64) -> Result<u64, ServerError> {
        let _ = set;
        Err(ServerError::Unsupported { feature: "peer-memory collectives", backend: "this backend" })
    }

    /// The arena of `set` as an inter-process handle (64 bytes on CUDA) that
    /// another process on this node opens with
    /// [`DeviceCollectives::peer_open`]. Allocates the arena on first use.
    fn peer_arena_handle(&mut self, set: u64) -> Result<Vec<u8>, ServerError> {
        let _ = set;
        Err(ServerError::Unsupported { feature: "inter-process peer memory", backend: "this backend" })
    }

    /// Opens another process's arena `handle` (from
    /// [`DeviceCollectives::peer_arena_handle`]) for `set`; returns its
    /// address in this process. Closed with the set's other state.
    fn peer_open(&mut self, set: u64, handle: &[u8]) -> Result<u64, ServerError> {
        let _ = (set, handle);
        Err(ServerError::Unsupported { feature: "inter-process peer memory", backend: "this backend" })
    }

    /// Releases `set`'s peer-memory state here, once its parts still
    /// running ended (waits for them, polling). With `own_arena` false, only
    /// the other members' arenas this device opened are closed; with true,
    /// its own arena is freed too: call that only once no member can still
    /// read it (every member closed what it opened and drained its parts).
    /// Nothing happens where the set has no arena.
    fn release_peer(&mut self, set: u64, own_arena: bool) {
        let _ = (set, own_arena);
    }

    /// Compiles and loads the kernel that runs `call` (once per element
    /// type), so that queueing it waits for nothing. Members call it before
    /// they meet: a kernel the driver loads only at its first launch may
    /// wait for the whole context first, and where devices share a GPU
    /// (`COHORT_CUDA_DEVICES`) a peer's kernel already spinning for this one
    /// would never let it. Unsupported by default.
    fn peer_prepare(&mut self, call: &PeerCall) -> Result<(), ServerError> {
        let _ = call;
        Err(ServerError::Unsupported { feature: "peer-memory collectives", backend: "this backend" })
    }

    /// Queues this member's part of a peer-memory collective on `stream`
    /// (after the device's earlier collective parts, as [`DeviceCollectives::run`]):
    /// one kernel that reads and writes the arenas of `spec`'s members
    /// directly, meeting them through flags in those arenas. A member whose
    /// kernel never arrives makes the others give up after the monitor's
    /// timeout, naming its rank. Returns as `run` does.
    fn run_peer(
        &mut self,
        stream: StreamId,
        spec: &PeerSpec<'_>,
        call: &PeerCall,
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<Option<PendingPart>, ServerError> {
        let _ = (stream, spec, call, monitor, completion);
        Err(ServerError::Unsupported { feature: "peer-memory collectives", backend: "this backend" })
    }
}

/// Bytes of one member's input that a peer-memory collective accepts at
/// most (larger calls go to the collective library).
pub const PEER_MAX_BYTES: u64 = 8 << 20;

/// Bytes of device memory each member's arena takes per device set.
pub const PEER_ARENA_BYTES: u64 = 16384 + 4 * PEER_MAX_BYTES;

/// The most members a peer-memory collective takes.
pub const PEER_MAX_RANKS: usize = 8;

/// Which peer-memory all-reduce runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerAlgo {
    /// Every member reads every other member's input and reduces all of
    /// it: one barrier, `ranks - 1` inputs read per member.
    OneShot,
    /// Member `r` reduces chunk `r` (reduce-scatter), then every member
    /// reads the other reduced chunks (all-gather): two barriers, about
    /// twice the input read per member whatever the member count.
    TwoShot,
}

/// One member's part of a peer-memory collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerCall {
    /// Element-wise reduction of every rank's `src` into every rank's `dst`.
    AllReduce { src: Binding, dst: Binding, dtype: DType, op: ReduceOp, algo: PeerAlgo },
    /// Every rank's `src` concatenated, in rank order, into every `dst`.
    AllGather { src: Binding, dst: Binding },
}

/// The device set a peer-memory collective runs on: `arenas[r]` is rank
/// `r`'s arena as this process addresses it.
#[derive(Debug, Clone, Copy)]
pub struct PeerSpec<'a> {
    /// The set's key (unique in the process; its flags live in the arenas).
    pub set: u64,
    /// This member's rank.
    pub rank: usize,
    /// Every rank's arena address.
    pub arenas: &'a [u64],
    /// The most members of the set that run on one GPU: 1, unless
    /// `COHORT_CUDA_DEVICES` shows several devices on one. Their kernels
    /// wait for each other, so all must be resident on the GPU at once:
    /// each then runs at most its share of the blocks the GPU holds.
    pub sharing: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_signal_is_reached_at_its_target_and_after_it_even_across_the_wrap() {
        let page = Arc::new(AtomicU32::new(0));
        let signal = |target| EndSignal::new(page.clone(), |word: &AtomicU32| word, target);
        assert!(!signal(1).reached());
        page.store(1, Ordering::Release);
        assert!(signal(1).reached());
        assert!(!signal(2).reached());
        page.store(u32::MAX, Ordering::Release);
        assert!(!signal(0).reached(), "0 comes after u32::MAX");
        page.store(3, Ordering::Release);
        assert!(signal(u32::MAX).reached(), "3 is 4 counts past u32::MAX");
        assert!(signal(3).reached() && !signal(4).reached());
    }
}
