//! NCCL collectives of one device: communicators per device set, parts
//! queued on the caller's stream in one device-wide order, and the polling
//! that turns NCCL's asynchronous errors and timeouts into errors on the
//! collective's destinations.
//!
//! A communicator is created the first time a part of its device set runs
//! here (`ncclCommInitRank` with the set's shared id; it returns once every
//! member called it), on the thread running the part: the device thread,
//! or for a one-rank set the caller's, which may run a part of an idle
//! device itself (see `Backend::enter_caller`; a one-rank creation waits
//! for no one). The communication layer queues
//! every member's part under one process-wide order and meets its members on
//! the host before the first call, so those calls always meet.
//!
//! A part's calls are queued on the caller's own stream (inside one NCCL
//! group when there are several), so later work there sees the results
//! with no extra event, as with a kernel. Parts of one device run in the
//! order they were queued, whatever stream they came from: a part from
//! another stream than the device's previous pending part first waits (on
//! the device) for an event recorded after that part. NCCL needs that
//! order: every member's communicators must see their operations in the
//! same order, or two communicators can wait on each other across devices.
//! It also means parts end in that order, so one event stands for every
//! part before it: a part gets an event only when something needs one (a
//! part from another stream, a caller that waits for the part, or any other
//! work about to be queued on its stream, a capture included), and parts
//! queued back to back on one stream share the event recorded after the
//! last of them. So a part's end is seen when its own calls end, never
//! after work queued behind it. A poll that finds no event recorded asks
//! whether the last part's stream drained (`cuStreamQuery`): only parts
//! were queued there since, so that says they all ended.
//!
//! The pending parts are polled (`poll`) when the device is idle, while it
//! waits for any stream, and when a caller asks to wait: parts up to an
//! event that fired have completed (completed parts are reaped at every
//! poll); one
//! whose communicator reports an asynchronous error
//! (`ncclCommGetAsyncError`), whose monitor reports another member's
//! failure, or that stays at the front longer than its timeout fails (those
//! are looked for at most every millisecond), and its communicator is
//! aborted (`ncclCommAbort`, which also ends its kernels, so the streams
//! behind it drain) and refused from then on.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::driver::{driver_error, BACKEND};
use super::nccl_lib::{self, Nccl, RawComm, RawStream, UniqueId};
use super::CudaBackend;
use crate::backend::{
    Binding, CollectiveMonitor, CommSpec, Completion, DeviceCall, DeviceCollectives, EndSignal, PeerCall, PeerSpec,
    PeerToken, PendingPart,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};
use crate::stages::{self, Stage};

/// The NCCL state of one device.
#[derive(Default)]
pub(crate) struct NcclState {
    comms: HashMap<u64, RawComm>,
    /// Sets whose communicator was aborted, with why.
    aborted: HashMap<u64, String>,
    /// 256 bytes of device memory for barriers.
    scratch: Option<sys::CUdeviceptr>,
    /// Devices already given access to this device's memory.
    pub(crate) shared: Option<Vec<DeviceId>>,
    /// Parts queued and not yet seen to end, oldest first.
    pending: VecDeque<Pending>,
    /// Parts that ended, not yet reported by `poll`.
    ended: Vec<(PendingPart, Result<(), ServerError>)>,
    next_part: u64,
    /// When the pending parts were last looked at for failures.
    checked: Option<Instant>,
    /// Peer-memory arenas and kernels.
    pub(crate) peer: super::peer_kernels::PeerSets,
    /// Host words written behind parts that waiters wait on.
    pub(crate) signals: super::signal::Signals,
}

/// A part whose calls are queued on the device.
struct Pending {
    part: PendingPart,
    /// The caller's stream the calls were queued on.
    stream: StreamId,
    set: u64,
    /// Null for a peer-memory part.
    comm: RawComm,
    /// A peer-memory part's error word (host-mapped), read once it completed.
    peer_error: Option<*mut u32>,
    /// Recorded after the part's calls, or `None` while a later record
    /// stands for it: parts end in the order they were queued (see
    /// [`CudaBackend::queue_part`]), so an event recorded after a part on
    /// its stream fires only once it and every part before it completed.
    done: Option<sys::CUevent>,
    monitor: Arc<dyn CollectiveMonitor>,
    /// When the part reached the front of the queue; its timeout counts
    /// from then (the parts before it run first).
    front_since: Option<Instant>,
    /// The host word written behind the part where a waiter asked for one
    /// ([`DeviceCollectives::end_signal`]): once written, the part and every
    /// part before it completed, which a poll then sees without asking the
    /// driver.
    signal: Option<(usize, u32)>,
}

/// What one part queues on its stream.
enum PartWork<'a> {
    /// Calls on this device's communicator of the set.
    Nccl { comm: RawComm, ranks: usize, calls: &'a [DeviceCall] },
    /// A peer-memory kernel.
    Peer { spec: &'a PeerSpec<'a>, call: &'a PeerCall },
}

/// How often pending parts are looked at for failures (asynchronous
/// errors, other members' failures, timeouts); completed parts are reaped
/// at every poll.
const FAILURE_CHECK: Duration = Duration::from_millis(1);

/// Past this many pending parts, queueing another first reaps the ones that
/// completed (their events go back to the pool).
const REAP_AT: usize = 32;

/// How a thread that waits on the device paces its polls: yielding (a
/// poll every few microseconds, as CUDA's default synchronization spins)
/// for the first [`Backoff::SPIN`], then sleeping between polls for a
/// fraction of the time already waited, so a long wait ends at most about
/// 0.4 % (plus the timer's slack, ~50 µs) after the device finished, and a
/// wait that hangs costs one wake-up per millisecond.
struct Backoff {
    started: Instant,
}

impl Backoff {
    /// How long a wait polls without sleeping.
    const SPIN: Duration = Duration::from_millis(20);
    /// The longest sleep between polls.
    const LONGEST_NAP: Duration = Duration::from_millis(1);

    fn new() -> Self {
        Backoff { started: Instant::now() }
    }

    /// The sleep before the next poll after `waited`; `None`: yield only.
    fn nap_after(waited: Duration) -> Option<Duration> {
        (waited >= Self::SPIN).then(|| (waited / 256).min(Self::LONGEST_NAP))
    }

    fn pause(&mut self) {
        match Self::nap_after(self.started.elapsed()) {
            None => std::thread::yield_now(),
            Some(nap) => std::thread::sleep(nap),
        }
    }
}

impl NcclState {
    /// Whether collectives are queued and not yet seen to end.
    pub(crate) fn has_pending_parts(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Destroys the communicators and the scratch memory (the device
    /// drained first; its context is current).
    pub(crate) fn close(&mut self) {
        if let Ok(lib) = nccl_lib::load() {
            for (_, comm) in self.comms.drain() {
                // SAFETY: a communicator this state created and still owns.
                unsafe { (lib.comm_destroy)(comm) };
            }
        }
        self.peer.close();
        if let Some(ptr) = self.scratch.take() {
            // SAFETY: memory this state allocated; released once.
            unsafe {
                let _ = sys::cuMemFree_v2(ptr);
            }
        }
    }
}

fn nccl_type(dtype: DType) -> c_int {
    match dtype {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// The operator of a reduction over `ranks` ranks. The mean of one value
/// is the value, so a one-rank `Avg` runs as `Sum` (a copy inside NCCL):
/// NCCL 2.28.3's one-rank averaging kernel left the last 3 of 65,539 `f64`
/// elements unwritten on an H200.
fn one_rank_op(op: ReduceOp, ranks: usize) -> c_int {
    if ranks == 1 && op == ReduceOp::Avg {
        nccl_op(ReduceOp::Sum)
    } else {
        nccl_op(op)
    }
}

/// Waits until a non-blocking communicator that answered "in progress"
/// is ready (`ncclCommGetAsyncError` no longer says so), up to `timeout`
/// (then the error says `late`, "after N s"), asking `stop` every 200 ms
/// whether the job gave up (`Some(why)`).
fn wait_ready(
    lib: &Nccl,
    comm: RawComm,
    timeout: Duration,
    late: &str,
    stop: &dyn Fn() -> Option<String>,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    let mut asked_stop = Instant::now();
    loop {
        let mut state: c_int = nccl_lib::IN_PROGRESS;
        // SAFETY: a live communicator of this device; writes one status.
        let polled = unsafe { (lib.comm_get_async_error)(comm, &mut state) };
        if polled != nccl_lib::SUCCESS {
            return Err(format!("ncclCommGetAsyncError failed: {}", lib.describe(polled, comm)));
        }
        match state {
            nccl_lib::SUCCESS => return Ok(()),
            nccl_lib::IN_PROGRESS if Instant::now() < deadline => {}
            nccl_lib::IN_PROGRESS => return Err(format!("{late} after {:.1} s", timeout.as_secs_f64())),
            other => return Err(format!("NCCL reported an asynchronous error: {}", lib.describe(other, comm))),
        }
        if asked_stop.elapsed() >= Duration::from_millis(200) {
            asked_stop = Instant::now();
            if let Some(why) = stop() {
                return Err(format!("abandoned: the job aborted ({why})"));
            }
        }
        backoff.pause();
    }
}

/// What a communicator still being created is doing at the timeout.
const CONNECTING: &str = "the NCCL communicator was still connecting";

impl CudaBackend {
    fn nccl_error(&self, operation: &str, reason: String) -> ServerError {
        ServerError::Collective { collective: operation.to_string(), device: self.device, reason }
    }

    fn scratch(&mut self) -> Result<sys::CUdeviceptr, ServerError> {
        if let Some(ptr) = self.nccl.scratch {
            return Ok(ptr);
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: context current; writes one address.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, 256) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(self.device, "cuMemAlloc (barrier scratch)", code));
        }
        self.nccl.scratch = Some(ptr);
        Ok(ptr)
    }

    /// This device's communicator of `spec.set`, created on first use (waits
    /// for every member's creation; up to `timeout` where NCCL makes it
    /// non-blocking, as `NCCL_COMM_BLOCKING=0` asks).
    fn comm(
        &mut self,
        lib: &Nccl,
        spec: &CommSpec<'_>,
        operation: &str,
        timeout: Duration,
    ) -> Result<RawComm, ServerError> {
        if let Some(why) = self.nccl.aborted.get(&spec.set) {
            return Err(self.nccl_error(
                operation,
                format!("its NCCL communicator was aborted after an earlier failure ({why}); make a new ClientGroup for these devices"),
            ));
        }
        if let Some(&comm) = self.nccl.comms.get(&spec.set) {
            return Ok(comm);
        }
        let mut id = UniqueId { internal: [0; 128] };
        if spec.unique_id.len() != 128 {
            return Err(ServerError::InvalidArgument(format!(
                "an NCCL unique id has 128 bytes, not {}",
                spec.unique_id.len()
            )));
        }
        for (to, from) in id.internal.iter_mut().zip(spec.unique_id) {
            *to = *from as _;
        }
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: the device's context is current (NCCL takes the device from
        // it); `comm` receives the new communicator.
        let code = unsafe { (lib.comm_init_rank)(&mut comm, spec.ranks as c_int, id, spec.rank as c_int) };
        if code == nccl_lib::IN_PROGRESS {
            // A non-blocking communicator (`NCCL_COMM_BLOCKING=0`): ready
            // once NCCL says so, or given up at the timeout.
            if let Err(why) = wait_ready(lib, comm, timeout, CONNECTING, &|| None) {
                // SAFETY: the communicator just made; abort frees it.
                unsafe { (lib.comm_abort)(comm) };
                let (rank, ranks) = (spec.rank, spec.ranks);
                return Err(self.nccl_error(operation, format!("ncclCommInitRank (rank {rank} of {ranks}): {why}")));
            }
        } else if code != nccl_lib::SUCCESS {
            return Err(self.nccl_error(
                operation,
                format!(
                    "ncclCommInitRank (rank {} of {}) failed: {}",
                    spec.rank,
                    spec.ranks,
                    lib.describe(code, std::ptr::null_mut())
                ),
            ));
        }
        tracing::debug!(device = %self.device, set = spec.set, rank = spec.rank, ranks = spec.ranks, "NCCL communicator created");
        self.nccl.comms.insert(spec.set, comm);
        Ok(comm)
    }

    fn abort(&mut self, lib: &Nccl, set: u64, why: &str) {
        if let Some(comm) = self.nccl.comms.remove(&set) {
            // SAFETY: our communicator; abort stops its kernels and frees it.
            unsafe { (lib.comm_abort)(comm) };
        }
        self.nccl.aborted.insert(set, why.to_string());
    }

    /// Queues the calls on `stream` (the caller's).
    fn issue(
        &mut self,
        lib: &Nccl,
        comm: RawComm,
        ranks: usize,
        stream: sys::CUstream,
        calls: &[DeviceCall],
        timeout: Duration,
    ) -> Result<(), String> {
        let s = stream as RawStream;
        let ptr = |b: Binding| -> Result<*mut c_void, String> {
            self.pages.ptr(b).map(|p| p as *mut c_void).map_err(|e| e.to_string())
        };
        // A non-blocking communicator (`NCCL_COMM_BLOCKING=0`) answers "in
        // progress" while NCCL launches the calls on a thread of its own:
        // it is waited for below, since NCCL takes no further call on it
        // until it is ready.
        let in_progress = std::cell::Cell::new(false);
        let check = |call: &str, code: c_int| {
            if code == nccl_lib::SUCCESS {
                Ok(())
            } else if code == nccl_lib::IN_PROGRESS {
                in_progress.set(true);
                Ok(())
            } else {
                Err(format!("{call} failed: {}", lib.describe(code, comm)))
            }
        };
        for call in calls {
            if let DeviceCall::Copy { src, dst } = *call {
                if src.size != dst.size {
                    return Err(format!("a copy of {} bytes into {} bytes", src.size, dst.size));
                }
                let (from, to) = (ptr(src)?, ptr(dst)?);
                if src.size > 0 && from != to {
                    // SAFETY: both ranges lie in live pages (checked by `ptr`).
                    let code = unsafe { sys::cuMemcpyDtoDAsync_v2(to as u64, from as u64, src.size as usize, stream) };
                    if code != sys::CUresult::CUDA_SUCCESS {
                        return Err(format!("cuMemcpyDtoDAsync: {}", super::driver::describe(code)));
                    }
                }
            }
        }
        let nccl_calls = calls.iter().filter(|c| !matches!(c, DeviceCall::Copy { .. })).count();
        let grouped = nccl_calls > 1;
        if grouped {
            // SAFETY: opens an NCCL group on this thread; closed below.
            check("ncclGroupStart", unsafe { (lib.group_start)() })?;
        }
        let mut result = Ok(());
        for call in calls {
            // SAFETY (every arm): pointers come from live pages of this
            // device and sizes from their bindings; NCCL reads and writes
            // them on `stream` only.
            let step = unsafe {
                match *call {
                    DeviceCall::Copy { .. } => Ok(()),
                    DeviceCall::AllReduce { src, dst, dtype, op } => check(
                        "ncclAllReduce",
                        (lib.all_reduce)(
                            ptr(src)?,
                            ptr(dst)?,
                            src.size as usize / dtype.size(),
                            nccl_type(dtype),
                            one_rank_op(op, ranks),
                            comm,
                            s,
                        ),
                    ),
                    DeviceCall::Reduce { src, dst, dtype, op, root } => {
                        let to = match dst {
                            Some(d) => ptr(d)?,
                            None => ptr(src)?,
                        };
                        let count = src.size as usize / dtype.size();
                        let (t, o) = (nccl_type(dtype), one_rank_op(op, ranks));
                        check("ncclReduce", (lib.reduce)(ptr(src)?, to, count, t, o, root as c_int, comm, s))
                    }
                    DeviceCall::Broadcast { src, dst, root } => {
                        let from = match src {
                            Some(b) => ptr(b)?,
                            None => ptr(dst)?,
                        };
                        let n = dst.size as usize;
                        check(
                            "ncclBroadcast",
                            (lib.broadcast)(from, ptr(dst)?, n, nccl_lib::UINT8, root as c_int, comm, s),
                        )
                    }
                    DeviceCall::AllGather { src, dst } => check(
                        "ncclAllGather",
                        (lib.all_gather)(ptr(src)?, ptr(dst)?, src.size as usize, nccl_lib::UINT8, comm, s),
                    ),
                    DeviceCall::ReduceScatter { src, dst, dtype, op } => check(
                        "ncclReduceScatter",
                        (lib.reduce_scatter)(
                            ptr(src)?,
                            ptr(dst)?,
                            dst.size as usize / dtype.size(),
                            nccl_type(dtype),
                            one_rank_op(op, ranks),
                            comm,
                            s,
                        ),
                    ),
                    DeviceCall::Send { src, peer } => check(
                        "ncclSend",
                        (lib.send)(ptr(src)?, src.size as usize, nccl_lib::UINT8, peer as c_int, comm, s),
                    ),
                    DeviceCall::Recv { dst, peer } => check(
                        "ncclRecv",
                        (lib.recv)(ptr(dst)?, dst.size as usize, nccl_lib::UINT8, peer as c_int, comm, s),
                    ),
                    DeviceCall::Barrier => {
                        let scratch = self.nccl.scratch.expect("allocated before issue") as *mut c_void;
                        check(
                            "ncclAllReduce (barrier)",
                            (lib.all_reduce)(scratch, scratch, 1, nccl_lib::FLOAT32, nccl_lib::SUM, comm, s),
                        )
                    }
                }
            };
            if let Err(err) = step {
                result = Err(err);
                break;
            }
        }
        if grouped {
            // SAFETY: closes the group opened above (also after a failed call,
            // so the thread's group state stays balanced).
            let code = unsafe { (lib.group_end)() };
            if result.is_ok() {
                result = check("ncclGroupEnd", code);
            }
        }
        if result.is_ok() && in_progress.get() {
            let late = "NCCL was still launching the calls of a non-blocking communicator";
            result = wait_ready(lib, comm, timeout, late, &|| None);
        }
        result
    }

    /// Moves the parts that ended to `ended`: completed ones from the front
    /// of the queue, then every part of a communicator that reports an
    /// asynchronous error, of a part whose monitor reports another member's
    /// failure, or of the front part past its timeout (those communicators
    /// are aborted). Does not wait.
    fn poll_pending(&mut self, lib: &Nccl) {
        while !self.nccl.pending.is_empty() {
            // Parts end in queue order: the first event says for its part
            // and every part before it. With none recorded, nothing but
            // parts was queued on the last part's stream since it
            // (`close_run_on` records one before anything else goes
            // there): that stream drained says every part ended. Asked so,
            // a waiter that polls a small collective records no event.
            // A written end signal says so for its part and every part
            // before it, without a driver call.
            let signalled =
                self.nccl.pending.iter().rposition(|p| p.signal.is_some_and(|s| self.nccl.signals.reached(s)));
            let (at, code, query) = match (signalled, self.nccl.pending.iter().position(|p| p.done.is_some())) {
                (Some(at), _) => (at, sys::CUresult::CUDA_SUCCESS, "the end signal"),
                (None, Some(at)) => {
                    let done = self.nccl.pending[at].done.expect("found above");
                    stages::mark(Stage::PollAsking);
                    // SAFETY: a live event of this context, recorded after part `at`.
                    (at, unsafe { sys::cuEventQuery(done) }, "cuEventQuery")
                }
                (None, None) => {
                    let at = self.nccl.pending.len() - 1;
                    match self.streams.raw(self.nccl.pending[at].stream) {
                        Ok(raw) => {
                            stages::mark(Stage::PollAsking);
                            // SAFETY: a live stream of this context, not capturing
                            // (`close_run_on` ran before any capture began on it,
                            // giving its last part an event); only reads its state.
                            (at, unsafe { sys::cuStreamQuery(raw) }, "cuStreamQuery")
                        }
                        Err(err) => {
                            self.fail_all(lib, &err.to_string());
                            break;
                        }
                    }
                }
            };
            stages::mark(Stage::PollAsked);
            if code == sys::CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            if code != sys::CUresult::CUDA_SUCCESS {
                let (set, reason) = (self.nccl.pending[at].set, format!("{query}: {}", super::driver::describe(code)));
                self.fail_set(lib, set, &reason);
                continue;
            }
            let mut undecided = false;
            for _ in 0..=at {
                let front = self.nccl.pending.front().expect("at most `at + 1` parts taken");
                if let Some(word) = front.peer_error {
                    // SAFETY: the set's host-mapped word, alive while the set is;
                    // the kernel that could write it has completed.
                    let value = unsafe { word.read_volatile() };
                    if value != 0 {
                        // Only now: naming the missing members asks the store.
                        let (timeout, missing) = (front.monitor.timeout(), front.monitor.missing());
                        let reason = super::peer_kernels::gave_up(value, &missing, timeout).unwrap_or_default();
                        let set = front.set;
                        // Ends this part and its set's later ones; the parts
                        // after it are looked at again by the loop.
                        self.fail_set(lib, set, &reason);
                        break;
                    }
                }
                // Completed: ends once its monitor confirms it (it stays at
                // the head, polled and timed out, until then).
                let Some(confirmed) = front.monitor.confirm() else {
                    undecided = true;
                    break;
                };
                let pending = self.nccl.pending.pop_front().expect("looked at");
                if let Some(event) = pending.done {
                    self.events.give(event);
                }
                if let Err(err) = confirmed {
                    // Its set's later parts end with it, the communicator aborted.
                    let (set, reason) = (pending.set, format!("aborted because an earlier call failed: {err}"));
                    self.end_part(pending, Err(err));
                    self.fail_set(lib, set, &reason);
                    break;
                }
                self.end_part(pending, Ok(()));
            }
            stages::mark(Stage::PollReaped);
            if undecided {
                break;
            }
        }
        // Failures are looked for at most every FAILURE_CHECK: asking NCCL
        // costs microseconds, and a device thread queueing collectives back
        // to back reaps completed parts between them.
        let now = Instant::now();
        if self.nccl.pending.is_empty() || self.nccl.checked.is_some_and(|at| now - at < FAILURE_CHECK) {
            if let Some(front) = self.nccl.pending.front_mut() {
                front.front_since.get_or_insert(now);
            }
            self.update_held_frees();
            return;
        }
        self.nccl.checked = Some(now);
        let mut failed: Vec<(u64, String)> = Vec::new();
        let mut asked: Vec<RawComm> = Vec::new();
        for (index, pending) in self.nccl.pending.iter_mut().enumerate() {
            if failed.iter().any(|(set, _)| *set == pending.set) {
                continue;
            }
            if !pending.comm.is_null() && !asked.contains(&pending.comm) {
                asked.push(pending.comm);
                let mut state: c_int = nccl_lib::SUCCESS;
                // SAFETY: a live communicator of this device; writes one status.
                let polled = unsafe { (lib.comm_get_async_error)(pending.comm, &mut state) };
                let reason = if polled != nccl_lib::SUCCESS {
                    Some(format!("ncclCommGetAsyncError failed: {}", lib.describe(polled, pending.comm)))
                } else if state != nccl_lib::SUCCESS && state != nccl_lib::IN_PROGRESS {
                    Some(format!("NCCL reported an asynchronous error: {}", lib.describe(state, pending.comm)))
                } else {
                    None
                };
                if let Some(reason) = reason {
                    failed.push((pending.set, reason));
                    continue;
                }
            }
            if let Some(err) = pending.monitor.failed_elsewhere() {
                if let Some(word) = pending.peer_error {
                    // SAFETY: the set's host-mapped word: the kernel polls it
                    // and stops.
                    unsafe { word.write_volatile(super::peer_kernels::STOP) };
                }
                failed.push((pending.set, format!("aborted: {err}")));
                continue;
            }
            if index == 0 {
                let since = *pending.front_since.get_or_insert(now);
                // A peer kernel gives up by itself at the timeout and names
                // the rank it waited for; the host waits longer.
                let timeout = match pending.peer_error {
                    Some(_) => pending.monitor.timeout() * 2 + Duration::from_secs(1),
                    None => pending.monitor.timeout(),
                };
                if now - since >= timeout {
                    failed.push((
                        pending.set,
                        format!(
                            "{} within {:.1} s; the communicator was aborted (raise COHORT_TIMEOUT, in seconds, if the work before it is legitimately that long)",
                            pending.monitor.missing(),
                            timeout.as_secs_f64()
                        ),
                    ));
                }
            }
        }
        for (set, reason) in failed {
            self.fail_set(lib, set, &reason);
        }
        self.update_held_frees();
    }

    /// Aborts `set`'s communicator and ends every pending part on it with
    /// `reason`.
    fn fail_set(&mut self, lib: &Nccl, set: u64, reason: &str) {
        if let Some(word) = self.nccl.peer.error_word(set) {
            // SAFETY: the set's host-mapped word, alive while the set is: a
            // peer kernel of the set that still runs (or runs later, after
            // its part was given up) sees STOP at its next barrier and
            // writes nothing more into the caller's buffers.
            unsafe { word.write_volatile(super::peer_kernels::STOP) };
        }
        self.abort(lib, set, reason);
        let mut kept: VecDeque<Pending> = VecDeque::with_capacity(self.nccl.pending.len());
        let mut gone = Vec::new();
        for mut pending in std::mem::take(&mut self.nccl.pending) {
            if pending.set != set {
                kept.push_back(pending);
                continue;
            }
            // A kept part before it with no event of its own ended when
            // this event fires (the aborted calls end, the stream goes on):
            // it takes the event over.
            if let Some(event) = pending.done.take() {
                match kept.back_mut() {
                    Some(before) if before.done.is_none() => before.done = Some(event),
                    _ => self.events.give(event),
                }
            }
            gone.push(pending);
        }
        self.nccl.pending = kept;
        for pending in gone {
            let err = self.nccl_error(pending.monitor.operation(), reason.to_string());
            self.end_part(pending, Err(err));
        }
        self.update_held_frees();
    }

    /// Ends every pending part with `reason`, aborting their sets: when an
    /// event cannot be recorded after them, nothing would say they ended.
    fn fail_all(&mut self, lib: &Nccl, reason: &str) {
        while let Some(set) = self.nccl.pending.front().map(|p| p.set) {
            self.fail_set(lib, set, reason);
        }
    }

    /// Records the event after the last pending part when it ran on
    /// `stream` and has none yet: before other work is queued there (see
    /// [`CudaBackend::raw_stream`]), or before the stream begins a capture,
    /// where a record would be captured rather than run. A record that
    /// fails ends every pending part with its error.
    pub(crate) fn close_run_on(&mut self, stream: StreamId) {
        if !self.nccl.pending.back().is_some_and(|p| p.stream == stream && p.done.is_none()) {
            return;
        }
        if let Err(reason) = self.close_run() {
            if let Ok(lib) = nccl_lib::load() {
                self.fail_all(lib, &reason);
            }
        }
    }

    /// The event recorded after the last pending part, recording one on its
    /// stream now when it has none. Nothing but parts was queued on that
    /// stream since ([`CudaBackend::close_run_on`] runs first otherwise), so
    /// the record fires when the last part ends.
    fn close_run(&mut self) -> Result<sys::CUevent, String> {
        let back = self.nccl.pending.back().expect("called with a pending part");
        if let Some(event) = back.done {
            return Ok(event);
        }
        let stream = back.stream;
        let raw = self.streams.raw(stream).map_err(|err| err.to_string())?;
        let event = self.events.take().map_err(|err| err.to_string())?;
        // SAFETY: a live event and stream of this context.
        let code = unsafe { sys::cuEventRecord(event, raw) };
        if code != sys::CUresult::CUDA_SUCCESS {
            self.events.give(event);
            return Err(format!("cuEventRecord after the collectives: {}", super::driver::describe(code)));
        }
        self.nccl.pending.back_mut().expect("looked at").done = Some(event);
        Ok(event)
    }

    /// Queues a part's calls (or kernel) on the caller's `stream` after the
    /// device's previous part, and tracks it until it ends: the one path of
    /// [`DeviceCollectives::run`] and [`DeviceCollectives::run_peer`].
    ///
    /// Parts run one after the other in the order they were queued: a part
    /// on the previous part's stream follows it there; one on another stream
    /// first waits (on the device) for an event recorded after it. So parts
    /// also end in that order, and a part that nothing waits for yet gets no
    /// event of its own: the device thread records one after the last part
    /// when it polls them with none recorded (as it does when idle), or when
    /// a part from another stream comes. A part waited for here
    /// ([`Completion::Wait`]) is recorded at once.
    fn queue_part(
        &mut self,
        lib: &Nccl,
        stream: StreamId,
        set: u64,
        work: PartWork<'_>,
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<Option<PendingPart>, ServerError> {
        let raw = self.streams.raw(stream)?;
        if self.streams.is_capturing(stream) {
            // Recorded into the stream's graph: nothing runs now, so there
            // is nothing to poll; a replay runs the calls in the graph's
            // order (the communicator was made before the window; a peer
            // kernel keeps its own counters, so every replay meets the
            // peers' replays afresh).
            let queued = self.queue_work(lib, raw, &work, monitor.timeout());
            let queued = queued.map_err(|reason| self.nccl_error(monitor.operation(), reason));
            if queued.is_ok() {
                monitor.finished(&Ok(()));
            }
            return queued.map(|()| None);
        }
        if self.nccl.pending.back().is_some_and(|p| p.stream != stream) {
            let previous = match self.close_run() {
                Ok(event) => event,
                Err(reason) => {
                    self.fail_all(lib, &reason);
                    return Err(self.nccl_error(monitor.operation(), reason));
                }
            };
            // SAFETY: live stream and event of this context; the wait is on
            // the device (it captures the event's current record).
            let code = unsafe { sys::cuStreamWaitEvent(raw, previous, 0) };
            if code != sys::CUresult::CUDA_SUCCESS {
                return Err(
                    self.classify(stream, driver_error(self.device, "cuStreamWaitEvent (collective order)", code))
                );
            }
        }
        // Taken before the calls are queued: once they are, the part must be
        // tracked (or its set failed).
        let done = match completion {
            Completion::Wait => Some(self.events.take()?),
            Completion::Defer => None,
        };
        // Frees held before anything is queued: where devices share the GPU,
        // another's free must not slip in behind this part's kernel.
        self.pages.hold_frees(true);
        stages::mark(Stage::Issuing);
        let queued = self.queue_work(lib, raw, &work, monitor.timeout()).and_then(|()| {
            let Some(event) = done else { return Ok(()) };
            // SAFETY: a live event and stream of this context.
            let code = unsafe { sys::cuEventRecord(event, raw) };
            if code == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("cuEventRecord after the part: {}", super::driver::describe(code)))
            }
        });
        stages::mark(Stage::Issued);
        if let Err(reason) = queued {
            if let Some(event) = done {
                self.events.give(event);
            }
            // Earlier parts of this set end with it; the hold is updated.
            self.fail_set(lib, set, &reason);
            return Err(self.nccl_error(monitor.operation(), reason));
        }
        let part = PendingPart(self.nccl.next_part);
        self.nccl.next_part += 1;
        let front_since = self.nccl.pending.is_empty().then(Instant::now);
        let (comm, peer_error) = match work {
            PartWork::Nccl { comm, .. } => (comm, None),
            PartWork::Peer { .. } => (std::ptr::null_mut(), self.nccl.peer.error_word(set)),
        };
        let pending = Pending { part, stream, set, comm, peer_error, done, monitor, front_since, signal: None };
        self.nccl.pending.push_back(pending);
        self.update_held_frees();
        if completion == Completion::Defer {
            return Ok(Some(part));
        }
        let mut backoff = Backoff::new();
        loop {
            self.poll_pending(lib);
            if let Some(at) = self.nccl.ended.iter().position(|(p, _)| *p == part) {
                return self.nccl.ended.swap_remove(at).1.map(|()| None);
            }
            backoff.pause();
        }
    }

    /// Queues `work` on `raw` (no event, no tracking).
    fn queue_work(
        &mut self,
        lib: &Nccl,
        raw: sys::CUstream,
        work: &PartWork<'_>,
        timeout: Duration,
    ) -> Result<(), String> {
        match *work {
            PartWork::Nccl { comm, ranks, calls } => self.issue(lib, comm, ranks, raw, calls, timeout),
            PartWork::Peer { spec, call } => self.launch_peer(raw, spec, call, timeout),
        }
    }

    /// Waits until `stream` drained, polling the pending parts meanwhile so a
    /// failed or expired collective the stream waits on is aborted rather
    /// than waited for forever, and until its own parts ended: one whose
    /// calls completed but whose monitor has not confirmed it yet (a check
    /// sent ahead) may still fail, which marks its destinations, so what
    /// reads them waits for that. Returns at once when no part is pending.
    pub(crate) fn settle_collectives(&mut self, stream: sys::CUstream) {
        self.poll_pending_until(|this| {
            // SAFETY: a live stream of the current context; only reads state.
            let drained = unsafe { sys::cuStreamQuery(stream) } != sys::CUresult::CUDA_ERROR_NOT_READY;
            drained && !this.has_part_on(stream)
        });
    }

    /// Waits until no pending part was queued on `stream` (each ends, or
    /// is aborted at its timeout), whatever else the stream still runs.
    pub(crate) fn settle_parts_on(&mut self, stream: StreamId) {
        if let Some(raw) = self.streams.raw_if_made(stream) {
            self.poll_pending_until(|this| !this.has_part_on(raw));
        }
    }

    /// Polls the pending parts, backing off between polls, until none is
    /// left or `settled` says so. Bounded: each part ends, or is aborted at
    /// its timeout.
    fn poll_pending_until(&mut self, settled: impl Fn(&mut Self) -> bool) {
        if self.nccl.pending.is_empty() || settled(self) {
            return;
        }
        let Ok(lib) = nccl_lib::load() else { return };
        let mut backoff = Backoff::new();
        loop {
            self.poll_pending(lib);
            if self.nccl.pending.is_empty() || settled(self) {
                return;
            }
            backoff.pause();
        }
    }

    /// Whether a pending part was queued on `stream`.
    fn has_part_on(&self, stream: sys::CUstream) -> bool {
        self.nccl.pending.iter().any(|p| self.streams.raw_if_made(p.stream) == Some(stream))
    }

    /// Ends every pending part with `err` without touching the device
    /// (its context was lost: nothing there can be asked).
    pub(crate) fn end_collectives_lost(&mut self, err: &ServerError) {
        for pending in std::mem::take(&mut self.nccl.pending) {
            self.end_part(pending, Err(err.clone()));
        }
    }

    /// Tells a part's monitor how it ended and keeps the outcome for the
    /// next [`DeviceCollectives::poll`]; every queued part ends here once.
    fn end_part(&mut self, pending: Pending, outcome: Result<(), ServerError>) {
        pending.monitor.finished(&outcome);
        self.nccl.ended.push((pending.part, outcome));
    }

    /// Waits (polling) until no part is pending: before the device's
    /// resources are freed, and before a wait that polls nothing (so a
    /// collective that never completes is aborted at its timeout rather
    /// than waited for forever). On a lost context the parts end with its
    /// fault at once.
    pub(crate) fn settle_all_collectives(&mut self) {
        if self.nccl.pending.is_empty() {
            return;
        }
        if let Some(lost) = self.lost.clone() {
            self.end_collectives_lost(&lost);
            return;
        }
        self.poll_pending_until(|_| false);
    }
}

impl DeviceCollectives for CudaBackend {
    fn available(&mut self) -> Result<(), String> {
        nccl_lib::load().map(|_| ())
    }

    fn unique_id(&mut self) -> Result<Vec<u8>, ServerError> {
        let lib = nccl_lib::load().map_err(|message| ServerError::Backend {
            backend: BACKEND,
            device: self.device,
            message,
        })?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        let code = unsafe { (lib.get_unique_id)(&mut id) };
        if code != nccl_lib::SUCCESS {
            return Err(ServerError::Backend {
                backend: BACKEND,
                device: self.device,
                message: format!("ncclGetUniqueId failed: {}", lib.describe(code, std::ptr::null_mut())),
            });
        }
        tracing::debug!(library = %lib.path, version = %lib.version_text(), "NCCL unique id made");
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    fn run(
        &mut self,
        stream: StreamId,
        spec: &CommSpec<'_>,
        calls: &[DeviceCall],
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<Option<PendingPart>, ServerError> {
        self.check_lost()?;
        let lib = nccl_lib::load().map_err(|reason| self.nccl_error(monitor.operation(), reason))?;
        if self.nccl.pending.len() >= REAP_AT {
            // Before this part's communicator is looked up: the poll may
            // abort it.
            self.poll_pending(lib);
        }
        if calls.contains(&DeviceCall::Barrier) {
            self.scratch()?;
        }
        let comm = self.comm(lib, spec, monitor.operation(), monitor.timeout())?;
        let work = PartWork::Nccl { comm, ranks: spec.ranks, calls };
        self.queue_part(lib, stream, spec.set, work, monitor, completion)
    }

    fn peer_arena(&mut self, set: u64) -> Result<u64, ServerError> {
        CudaBackend::peer_arena(self, set)
    }

    fn peer_prepare(&mut self, call: &PeerCall) -> Result<(), ServerError> {
        self.check_lost()?;
        CudaBackend::peer_prepare(self, call).map_err(|reason| self.nccl_error("peer kernel set-up", reason))
    }

    fn peer_arena_handle(&mut self, set: u64) -> Result<Vec<u8>, ServerError> {
        CudaBackend::peer_arena_handle(self, set)
    }

    fn peer_open(&mut self, set: u64, handle: &[u8]) -> Result<u64, ServerError> {
        CudaBackend::peer_open(self, set, handle)
    }

    fn run_peer(
        &mut self,
        stream: StreamId,
        spec: &PeerSpec<'_>,
        call: &PeerCall,
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<Option<PendingPart>, ServerError> {
        self.check_lost()?;
        let lib = nccl_lib::load().map_err(|reason| self.nccl_error(monitor.operation(), reason))?;
        if self.nccl.pending.len() >= REAP_AT {
            self.poll_pending(lib);
        }
        if let Some(why) = self.nccl.aborted.get(&spec.set) {
            return Err(self.nccl_error(
                monitor.operation(),
                format!("its device set failed earlier ({why}); make a new ClientGroup for these devices"),
            ));
        }
        if let Err(reason) = self.check_peer(spec, call) {
            return Err(ServerError::InvalidArgument(format!("{}: {reason}", monitor.operation())));
        }
        if let Some(word) = self.nccl.peer.error_word(spec.set) {
            // SAFETY: the set's host-mapped word, alive while the set is.
            let value = unsafe { word.read_volatile() };
            if value != 0 {
                // Eager parts read the word when they end (a failure there
                // aborts the set), so a value here was left by a kernel
                // replayed from a CUDA graph: the set is no longer in step.
                let reason =
                    super::peer_kernels::gave_up(value, &monitor.missing(), monitor.timeout()).unwrap_or_default();
                let reason = format!("a replayed CUDA graph's peer kernel of this set failed: {reason}");
                self.fail_set(lib, spec.set, &reason);
                return Err(self.nccl_error(monitor.operation(), reason));
            }
        }
        self.queue_part(lib, stream, spec.set, PartWork::Peer { spec, call }, monitor, completion)
    }

    fn split(
        &mut self,
        parent: &CommSpec<'_>,
        set: u64,
        color: Option<u32>,
        key: usize,
        share: bool,
        timeout: Duration,
        stop: &dyn Fn() -> Option<String>,
    ) -> Result<(), ServerError> {
        self.check_lost()?;
        let lib = nccl_lib::load().map_err(|reason| self.nccl_error("split", reason))?;
        let Some(split) = lib.comm_split else {
            let why =
                format!("{} (NCCL {}) has no ncclCommSplit: NCCL 2.18 or newer splits", lib.path, lib.version_text());
            return Err(self.nccl_error("split", why));
        };
        let comm = self.comm(lib, parent, "split", timeout)?;
        let color = match color {
            None => nccl_lib::SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c)
                .map_err(|_| self.nccl_error("split", format!("color {c} is above {}", c_int::MAX)))?,
        };
        let key =
            c_int::try_from(key).map_err(|_| self.nccl_error("split", format!("key {key} is above {}", c_int::MAX)))?;
        let mut config = nccl_lib::SplitConfig::new(share);
        let mut child: RawComm = std::ptr::null_mut();
        let what = format!("ncclCommSplit (color {color}, key {key})");
        // SAFETY: `comm` is this device's live communicator of the parent
        // (its context is current); `child` and `config` outlive the call
        // and the wait for the parent below (where the split runs on after
        // the call returned, NCCL writes `child` before the parent is ready).
        let code = unsafe { split(comm, color, key, &mut child, &mut config) };
        if code != nccl_lib::SUCCESS && code != nccl_lib::IN_PROGRESS {
            let reason = format!("{what} failed: {}", lib.describe(code, comm));
            return Err(self.nccl_error("split", reason));
        }
        // A non-blocking parent (`NCCL_COMM_BLOCKING=0`) splits on a thread
        // NCCL starts for it, answering "success" or "in progress" at once
        // (2.28.3 answers "success"), and hands the child over only when the
        // parent says every member joined; a blocking parent is ready now.
        // Given up, the parent stays inside the split: aborted.
        let late = "a member never called it (raise COHORT_TIMEOUT if it is legitimately that late): still waiting";
        if let Err(why) = wait_ready(lib, comm, timeout, late, stop) {
            let reason = format!("{what}: {why}");
            // Ends the parent's parts still pending with it (its
            // communicator goes), and joins NCCL's split thread.
            self.fail_set(lib, parent.set, &reason);
            if !child.is_null() {
                // SAFETY: a child the split finished after the last look;
                // nothing else holds it.
                unsafe { (lib.comm_abort)(child) };
            }
            return Err(self.nccl_error("split", reason));
        }
        if child.is_null() {
            // No color: this member joins no group.
            return Ok(());
        }
        // The child is blocking (`SplitConfig`) unless NCCL_COMM_BLOCKING=0
        // makes every communicator non-blocking: then it is ready once NCCL
        // says so.
        if let Err(why) = wait_ready(lib, child, timeout, CONNECTING, stop) {
            // SAFETY: our child communicator; abort ends its set-up and frees it.
            unsafe { (lib.comm_abort)(child) };
            return Err(self.nccl_error("split", format!("{what}: {why}")));
        }
        tracing::debug!(device = %self.device, parent = parent.set, set, color, key, share, "NCCL communicator split");
        self.nccl.comms.insert(set, child);
        Ok(())
    }

    fn has_pending(&mut self) -> bool {
        !self.nccl.pending.is_empty() || !self.nccl.ended.is_empty()
    }

    fn end_signal(&mut self) -> Option<EndSignal> {
        let back = self.nccl.pending.back()?;
        if let Some(armed) = back.signal {
            return self.nccl.signals.signal(armed);
        }
        if back.done.is_some() {
            // Other work may follow it on its stream (its event was
            // recorded because something came next): a word written
            // behind that would say nothing of the part for too long.
            return None;
        }
        let stream = back.stream;
        if self.streams.is_capturing(stream) {
            return None;
        }
        let raw = self.streams.raw_if_made(stream)?;
        let armed = self.nccl.signals.arm(stream, raw)?;
        self.nccl.pending.back_mut().expect("looked at above").signal = Some(armed);
        self.nccl.signals.signal(armed)
    }

    fn poll(&mut self) -> Vec<(PendingPart, Result<(), ServerError>)> {
        if !self.nccl.pending.is_empty() {
            if let Ok(lib) = nccl_lib::load() {
                self.poll_pending(lib);
            }
        }
        std::mem::take(&mut self.nccl.ended)
    }

    fn release(&mut self, set: u64) {
        // Its parts still queued end first: polling reads the communicator.
        if let Ok(lib) = nccl_lib::load() {
            let mut backoff = Backoff::new();
            while self.nccl.pending.iter().any(|p| p.set == set) {
                self.poll_pending(lib);
                backoff.pause();
            }
        }
        if let (Some(comm), Ok(lib)) = (self.nccl.comms.remove(&set), nccl_lib::load()) {
            // SAFETY: our communicator, no longer in the map.
            unsafe { (lib.comm_destroy)(comm) };
        }
    }

    fn release_peer(&mut self, set: u64, own_arena: bool) {
        if let Ok(lib) = nccl_lib::load() {
            let mut backoff = Backoff::new();
            while self.nccl.pending.iter().any(|p| p.set == set) {
                self.poll_pending(lib);
                backoff.pause();
            }
        }
        self.nccl.peer.release(set, own_arena);
    }

    fn can_access_peer(&mut self, peer: DeviceId) -> bool {
        super::peer::can_access(self, peer)
    }

    fn share_with_peers(&mut self) -> Result<Vec<DeviceId>, ServerError> {
        super::peer::share(self)
    }

    fn peer_export(&mut self, stream: StreamId, src: Binding) -> Result<PeerToken, ServerError> {
        super::peer::export(self, stream, src)
    }

    fn peer_import(&mut self, stream: StreamId, from: &PeerToken, dst: Binding) -> Result<PeerToken, ServerError> {
        super::peer::import(self, stream, from, dst)
    }

    fn peer_finish(&mut self, stream: StreamId, done: &PeerToken) -> Result<(), ServerError> {
        super::peer::finish(self, stream, done)
    }
}

#[cfg(test)]
mod tests {
    use super::Backoff;
    use std::time::Duration;

    #[test]
    fn a_wait_spins_first_then_sleeps_a_small_fraction_of_its_length() {
        let ms = Duration::from_millis;
        assert_eq!(Backoff::nap_after(Duration::ZERO), None);
        assert_eq!(Backoff::nap_after(ms(19)), None);
        // A 100 ms wait overshoots the device by at most ~0.4 ms.
        let nap = Backoff::nap_after(ms(100)).expect("sleeps after the spin");
        assert!(nap > Duration::ZERO && nap <= ms(100) / 250, "{nap:?}");
        // A wait that hangs still wakes every millisecond to look for failures.
        assert_eq!(Backoff::nap_after(Duration::from_secs(60)), Some(ms(1)));
    }
}
