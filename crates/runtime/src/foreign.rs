//! Foreign memory: memory cohort did not allocate (another library's CUDA
//! allocation, a host slice, a `wgpu::Buffer` made on an adopted device),
//! named by an ordinary [`Handle`] so every call and collective takes it
//! unchanged, with no copy.
//!
//! [`Client::adopt`](crate::Client::adopt) registers the memory as a page of
//! the device's storage that the memory pools never see and the backend
//! never frees. The handle keeps an *owner* (any value: the allocation
//! itself, a DLPack deleter, a guard) that cohort drops only after the
//! work queued on the memory has finished. Memory of another device or
//! context, a size or alignment that does not fit, or a wgpu buffer
//! without the usages a collective needs is refused before anything is
//! queued.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::backend::{Backend, FenceWait};
use crate::device::DeviceHandle;
use crate::error::ServerError;
use crate::id::StreamId;
use crate::memory::PageId;

/// Where foreign memory is: what [`Client::adopt`](crate::Client::adopt)
/// registers.
#[derive(Debug)]
pub enum ForeignMemory {
    /// `len` bytes of host memory at `ptr` (the CPU backend).
    Host { ptr: *mut u8, len: usize },
    /// `len` bytes of CUDA device memory at `ptr`, allocated in the
    /// device's primary context (cudarc's default; PyTorch's, CuPy's).
    #[cfg(feature = "cuda")]
    Cuda { ptr: u64, len: usize },
    /// `len` bytes at `offset` into a buffer created on the client's
    /// `wgpu::Device` (one the runtime adopted with `WgpuRuntime::adopt`).
    #[cfg(feature = "wgpu")]
    Wgpu { buffer: wgpu::Buffer, offset: u64, len: u64 },
}

// SAFETY: a `ForeignMemory` is an address (or a reference-counted wgpu
// buffer) and a length; moving it to the device thread accesses nothing.
// Whoever built it promised, through the unsafe `Client::adopt`, that the
// memory stays valid while its owner lives.
unsafe impl Send for ForeignMemory {}

/// What keeps foreign memory alive: dropped by cohort once no queued work
/// needs the memory (never before the last handle naming it is gone).
pub type ForeignOwner = Box<dyn Any + Send>;

/// Why [`Client::adopt`](crate::Client::adopt) refused memory, with what it
/// was given, untouched: the memory and its owner are the caller's again
/// (a `Vec` given as the owner comes back whole, its elements where they
/// were). Displays as the error; converts into it, so `?` works where the
/// owner does not matter (it is dropped then).
pub struct AdoptError {
    /// Boxed: an `Err` as small as a pointer.
    parts: Box<(ServerError, ForeignMemory, ForeignOwner)>,
}

impl AdoptError {
    pub(crate) fn new(error: ServerError, memory: ForeignMemory, owner: ForeignOwner) -> AdoptError {
        AdoptError { parts: Box::new((error, memory, owner)) }
    }

    /// Why: it names the problem.
    pub fn error(&self) -> &ServerError {
        &self.parts.0
    }

    /// The owner, as given: never dropped by the refusal.
    pub fn into_owner(self) -> ForeignOwner {
        self.parts.2
    }

    /// The error, and the memory and owner as given.
    pub fn into_parts(self) -> (ServerError, ForeignMemory, ForeignOwner) {
        *self.parts
    }
}

impl std::fmt::Display for AdoptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self.error(), f)
    }
}

impl std::fmt::Debug for AdoptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (error, memory, _) = &*self.parts;
        f.debug_struct("AdoptError").field("error", error).field("memory", memory).finish_non_exhaustive()
    }
}

impl std::error::Error for AdoptError {}

impl From<AdoptError> for ServerError {
    /// The error alone; the owner is dropped.
    fn from(err: AdoptError) -> ServerError {
        err.parts.0
    }
}

/// Whether collectives and kernels may write foreign memory: a DLPack
/// tensor marked read-only is adopted as [`Access::ReadOnly`], and a call
/// that would write it is refused before anything is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    #[default]
    ReadWrite,
    ReadOnly,
}

/// A stream (or queue) that another library owns and queues its own work
/// on, to order cohort's work with: see
/// [`Client::wait_external`](crate::Client::wait_external) and
/// [`Client::signal_external`](crate::Client::signal_external).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExternalStream {
    /// A `CUstream` of the device's primary context: made by
    /// `ExternalStream::from_cudarc` (which keeps the cudarc stream alive)
    /// or, for a raw handle (torch's
    /// `torch.cuda.current_stream().cuda_stream`), the unsafe
    /// `ExternalStream::cuda_raw`. Null is the legacy default stream.
    #[cfg(feature = "cuda")]
    Cuda(CudaStreamRef),
    /// The queue of an adopted wgpu device: submissions run in order, so
    /// cohort's work only has to be submitted before the caller's next
    /// submission.
    #[cfg(feature = "wgpu")]
    WgpuQueue,
}

/// A `CUstream` handle that the driver may be given: only the unsafe
/// `ExternalStream::cuda_raw` (whose caller promises the handle is live)
/// and `ExternalStream::from_cudarc` (which keeps the stream alive while
/// any clone of this lives) make one. Equal when the handles are.
#[cfg(feature = "cuda")]
#[derive(Clone)]
pub struct CudaStreamRef {
    raw: usize,
    /// What keeps the stream alive, where cohort was given it (a cudarc
    /// stream).
    _keep: Option<std::sync::Arc<dyn Any + Send + Sync>>,
}

#[cfg(feature = "cuda")]
impl CudaStreamRef {
    /// The `CUstream`, as an integer.
    pub fn raw(&self) -> usize {
        self.raw
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for CudaStreamRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUstream {:#x}", self.raw)
    }
}

#[cfg(feature = "cuda")]
impl PartialEq for CudaStreamRef {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

#[cfg(feature = "cuda")]
impl Eq for CudaStreamRef {}

#[cfg(feature = "cuda")]
impl ExternalStream {
    /// The stream of a cudarc `CudaStream` (`cu_stream()`), kept alive
    /// while this value (or a clone) lives.
    pub fn from_cudarc(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Self {
        let keep: std::sync::Arc<dyn Any + Send + Sync> = stream.clone();
        ExternalStream::Cuda(CudaStreamRef { raw: stream.cu_stream() as usize, _keep: Some(keep) })
    }

    /// A raw `CUstream` handle (torch's `cuda_stream`, CuPy's `ptr`): 0 is
    /// the legacy default stream.
    ///
    /// # Safety
    /// `raw` must be 0, or a stream that stays alive while this value (or a
    /// clone) is used: the driver cannot check a handle, and a destroyed
    /// one is undefined behaviour there.
    pub unsafe fn cuda_raw(raw: usize) -> Self {
        ExternalStream::Cuda(CudaStreamRef { raw, _keep: None })
    }
}

impl ForeignMemory {
    /// Bytes the memory spans.
    pub fn len(&self) -> u64 {
        match self {
            ForeignMemory::Host { len, .. } => *len as u64,
            #[cfg(feature = "cuda")]
            ForeignMemory::Cuda { len, .. } => *len as u64,
            #[cfg(feature = "wgpu")]
            ForeignMemory::Wgpu { len, .. } => *len,
        }
    }

    /// Where the handle's slice starts inside the page the storage makes
    /// of it: the offset into a wgpu buffer (the page is the whole
    /// buffer), 0 elsewhere.
    pub(crate) fn page_offset(&self) -> u64 {
        match self {
            #[cfg(feature = "wgpu")]
            ForeignMemory::Wgpu { offset, .. } => *offset,
            _ => 0,
        }
    }

    /// Whether it spans no byte (refused by `adopt`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What kind of memory it is, for errors ("host memory").
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            ForeignMemory::Host { .. } => "host memory",
            #[cfg(feature = "cuda")]
            ForeignMemory::Cuda { .. } => "CUDA device memory",
            #[cfg(feature = "wgpu")]
            ForeignMemory::Wgpu { .. } => "a wgpu buffer",
        }
    }

    /// The refusal of a backend that cannot take this kind of memory.
    pub(crate) fn wrong_backend(&self, backend: &str) -> crate::ServerError {
        crate::ServerError::InvalidArgument(format!(
            "{} cannot be adopted by a {backend} device: adopt it on a client of the backend that owns it \
             (host memory on a CPU client, CUDA memory on the CUDA client of its GPU, a wgpu buffer on the \
             client of the wgpu device it was made on)",
            self.kind()
        ))
    }
}

/// The streams that queued work on adopted memory: the only ones a
/// release or a revoke of it waits for (mostly one).
pub(crate) type Streams = SmallVec<[StreamId; 2]>;

/// Fences after the work queued on some streams, none complete yet.
pub(crate) type Fences = SmallVec<[Box<dyn FenceWait>; 2]>;

/// What an adopted [`Handle`](crate::Handle)'s allocation keeps beside it,
/// in the same allocation: the page the device's storage made of the
/// memory, the access allowed, the owner, the streams that used the
/// memory, and the way back to its device (see [`Adopted::release`]).
pub(crate) struct Adopted {
    pub access: Access,
    /// The storage's page over the memory: outside every pool, never freed
    /// by the backend, forgotten when the memory is given back.
    pub page: PageId,
    /// Where the handle's bytes start in `page`
    /// ([`ForeignMemory::page_offset`]).
    pub offset: u64,
    /// Taken by [`Client::reclaim`](crate::Client::reclaim), else released
    /// when the last clone goes.
    pub owner: Mutex<Option<ForeignOwner>>,
    /// Set once the storage forgot the page
    /// ([`Client::revoke`](crate::Client::revoke), `reclaim`): the handle
    /// no longer binds.
    pub given_back: AtomicBool,
    /// Set by [`Handle::lend_for_scope`](crate::Handle::lend_for_scope):
    /// the memory is only lent for a scope, so nothing that hands its
    /// address out of cohort (DLPack export) may take it.
    pub lent: AtomicBool,
    /// The streams that queued work on the memory: noted by
    /// `DeviceState::order_after_writers`, which every task, launch, write
    /// and read passes with the handles it binds, under the device's state.
    streams: Mutex<Streams>,
    releases: Arc<ReleaseQueue>,
    /// Where the last clone releases the memory (on its own thread, where
    /// the device is idle), else woken to; gone once the device is.
    device: Weak<DeviceHandle>,
}

impl Adopted {
    pub(crate) fn new(
        access: Access,
        page: PageId,
        offset: u64,
        owner: ForeignOwner,
        releases: Arc<ReleaseQueue>,
        device: Weak<DeviceHandle>,
    ) -> Adopted {
        Adopted {
            access,
            page,
            offset,
            owner: Mutex::new(Some(owner)),
            given_back: AtomicBool::new(false),
            lent: AtomicBool::new(false),
            streams: Mutex::new(Streams::new()),
            releases,
            device,
        }
    }

    /// The error a use of memory given back returns.
    pub(crate) fn given_back_error(size: u64) -> ServerError {
        ServerError::InvalidState {
            operation: "device memory access",
            reason: format!(
                "the foreign memory of this handle ({size} bytes) was given back (Client::revoke or reclaim); \
                 adopt it again to use it"
            ),
        }
    }

    /// Whether its device closed, its work all ended.
    pub(crate) fn device_closed(&self) -> bool {
        self.releases.is_closed()
    }

    /// Notes that `stream` queues work on the memory.
    pub(crate) fn used_on(&self, stream: StreamId) {
        let mut streams = self.streams.lock();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    /// The streams noted so far.
    #[cfg(test)]
    pub(crate) fn streams(&self) -> Streams {
        self.streams.lock().clone()
    }

    /// Fences after the work queued so far on the streams that used the
    /// memory (none where it all finished: always on the CPU).
    pub(crate) fn fences(&self, backend: &mut dyn Backend) -> Fences {
        fences_of(backend, &self.streams.lock())
    }

    /// After the memory was given back and the fences of
    /// [`Adopted::fences`] raised then completed: nothing runs on it and
    /// nothing can be queued on it any more, so its release waits for
    /// nothing.
    pub(crate) fn settled(&self) {
        self.streams.lock().clear();
    }

    /// What the last clone of the handle does (from `Allocation`'s drop):
    /// the storage forgets the page (unless already given back) and the
    /// owner (unless reclaimed) is dropped once the work queued on the
    /// memory's streams has finished. Where the device is idle and lets
    /// callers in (CPU, CUDA), on this thread at once (waiting, as every
    /// inline call does, at most 50 µs for the state while nothing is
    /// queued: the device thread letting go after its last task):
    /// the owner is dropped here, after the state is let go, if that work
    /// has finished (on the CPU it always has), else left to the device
    /// thread, woken to poll its fences. Otherwise queued for the device
    /// thread, which is woken. Memory given back with no work left on it
    /// (a revoke waited for it) and memory on a device already closed (its
    /// work drained) drop the owner here at once. Never waits for work
    /// queued on the device, never panics (an owner's panicking `Drop` is
    /// logged).
    pub(crate) fn release(&mut self) {
        let owner = self.owner.get_mut().take();
        let page = (!*self.given_back.get_mut()).then_some(self.page);
        if owner.is_none() && page.is_none() {
            return;
        }
        let streams = std::mem::take(self.streams.get_mut());
        if page.is_none() && streams.is_empty() {
            // Given back, and no work queued on it (or all of it waited
            // for, by a revoke): nothing for the device to do.
            owner.into_iter().for_each(drop_owner);
            return;
        }
        let released = Released { page, owner, streams };
        let device = self.device.upgrade();
        if let Some(mut inline) = device.as_deref().and_then(DeviceHandle::enter_inline) {
            let state = inline.state();
            let ready = state.foreign.retire(state.backend.as_mut(), released);
            // The owner's `Drop` is the caller's code, which may use the
            // device: run once the state is let go.
            drop(inline);
            if let Some(owner) = ready {
                drop_owner(owner);
            }
            return;
        }
        match self.releases.push(released) {
            Ok(()) => {
                if let Some(device) = device {
                    device.wake();
                }
            }
            Err(owner) => {
                if let Some(owner) = owner {
                    drop_owner(owner);
                }
            }
        }
    }
}

/// What the last clone of an adopted handle left to its device.
pub(crate) struct Released {
    page: Option<PageId>,
    owner: Option<ForeignOwner>,
    /// The streams whose work the owner waits for.
    streams: Streams,
}

/// Releases of one device's adopted memory that their handles could not
/// retire on their own thread (the device was busy, or its thread is the
/// one letting go), pushed from any thread and drained by the device (see
/// [`ForeignPages::poll`]).
#[derive(Default)]
pub(crate) struct ReleaseQueue {
    queue: Mutex<QueueState>,
    /// Whether `queue` holds something: read on every message, without
    /// the lock.
    queued: AtomicBool,
}

#[derive(Default)]
struct QueueState {
    released: Vec<Released>,
    /// The device closed: nothing runs on it any more.
    closed: bool,
}

impl ReleaseQueue {
    /// Queues `released`; hands its owner back where the device is closed
    /// (its work all ended, its storage gone: the owner may go at once).
    fn push(&self, released: Released) -> Result<(), Option<ForeignOwner>> {
        let mut queue = self.queue.lock();
        if queue.closed {
            return Err(released.owner);
        }
        queue.released.push(released);
        self.queued.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the device closed, its work all ended.
    pub(crate) fn is_closed(&self) -> bool {
        self.queue.lock().closed
    }

    /// Swaps what was queued into `batch` (empty; its capacity is kept
    /// for the next pushes).
    fn take_into(&self, batch: &mut Vec<Released>) {
        if !self.queued.load(Ordering::Acquire) {
            return;
        }
        let mut queue = self.queue.lock();
        self.queued.store(false, Ordering::Release);
        std::mem::swap(&mut queue.released, batch);
    }
}

/// An owner waiting for the work queued on its memory.
struct Retiring {
    owner: ForeignOwner,
    fences: Fences,
}

/// A device's side of adopted memory: the release queue its handles push
/// to, and the owners waiting for their fences.
pub(crate) struct ForeignPages {
    queue: Arc<ReleaseQueue>,
    retiring: Vec<Retiring>,
    /// The queue's last batch, empty: swapped in at the next poll.
    batch: Vec<Released>,
}

impl Default for ForeignPages {
    fn default() -> Self {
        Self { queue: Arc::new(ReleaseQueue::default()), retiring: Vec::new(), batch: Vec::new() }
    }
}

/// Drops an owner: a panic in its `Drop` (the caller's code) is logged,
/// and never ends the thread dropping it (the device's, or the one that
/// let go of the last handle).
fn drop_owner(owner: ForeignOwner) {
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(owner))) {
        let message = crate::device::panic_message(payload.as_ref());
        tracing::error!("the owner of adopted memory panicked when dropped: {message}");
    }
}

/// Fences after the work queued so far on `streams`, those already
/// complete left out; a stream whose fence cannot be raised (a failed
/// device) has no work that will still run.
pub(crate) fn fences_of(backend: &mut dyn Backend, streams: &[StreamId]) -> Fences {
    let mut fences = Fences::new();
    for &stream in streams {
        match backend.fence(stream) {
            Ok(fence) if !fence.is_complete() => fences.push(fence),
            _ => {}
        }
    }
    fences
}

impl ForeignPages {
    /// The queue adopted handles release into.
    pub fn queue(&self) -> Arc<ReleaseQueue> {
        self.queue.clone()
    }

    /// Whether releases wait to be taken or owners for their fences (the
    /// device thread then polls).
    pub fn pending(&self) -> bool {
        self.queue.queued.load(Ordering::Acquire) || !self.retiring.is_empty()
    }

    /// Retires `released`: the storage forgets its page, and its owner is
    /// returned, to be dropped now, where the work queued on its streams
    /// has finished; else it waits here with fences for a later poll.
    pub(crate) fn retire(&mut self, backend: &mut dyn Backend, released: Released) -> Option<ForeignOwner> {
        if let Some(page) = released.page {
            backend.storage().free_page(page);
        }
        let owner = released.owner?;
        let fences = fences_of(backend, &released.streams);
        if fences.is_empty() {
            return Some(owner);
        }
        self.retiring.push(Retiring { owner, fences });
        None
    }

    /// Retires the queued releases and drops the owners whose fences
    /// completed. Never waits.
    pub fn poll(&mut self, backend: &mut dyn Backend) {
        if !self.pending() {
            return;
        }
        let mut done = Vec::new();
        let mut batch = std::mem::take(&mut self.batch);
        self.queue.take_into(&mut batch);
        for released in batch.drain(..) {
            done.extend(self.retire(backend, released));
        }
        self.batch = batch;
        self.retiring.retain_mut(|retiring| {
            retiring.fences.retain(|fence| !fence.is_complete());
            if !retiring.fences.is_empty() {
                return true;
            }
            done.push(std::mem::replace(&mut retiring.owner, Box::new(())));
            false
        });
        done.into_iter().for_each(drop_owner);
    }

    /// At close: waits for the work queued on `streams` (every stream of
    /// the device: each that queued work on adopted memory is among them)
    /// and on those of the owners waiting, marks the queue closed (a handle
    /// released from then on drops its owner at once: nothing runs on the
    /// device any more), forgets every page released and drops every
    /// owner.
    pub fn close(&mut self, backend: &mut dyn Backend, streams: &[StreamId]) {
        for fence in fences_of(backend, streams) {
            let _ = fence.wait();
        }
        let released = {
            let mut queue = self.queue.queue.lock();
            queue.closed = true;
            std::mem::take(&mut queue.released)
        };
        let mut owners = Vec::new();
        for released in released {
            for fence in fences_of(backend, &released.streams) {
                let _ = fence.wait();
            }
            if let Some(page) = released.page {
                backend.storage().free_page(page);
            }
            owners.extend(released.owner);
        }
        for retiring in self.retiring.drain(..) {
            for fence in retiring.fences {
                let _ = fence.wait();
            }
            owners.push(retiring.owner);
        }
        owners.into_iter().for_each(drop_owner);
    }
}

impl Drop for ForeignPages {
    /// A device state dropped without `close` (its thread panicked): the
    /// queue closes, so owners are never kept forever; those waiting are
    /// dropped (the backend is going away with its work).
    fn drop(&mut self) {
        let released = {
            let mut queue = self.queue.queue.lock();
            queue.closed = true;
            std::mem::take(&mut queue.released)
        };
        drop(released);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::id::DeviceId;

    /// A fence that completes when its flag is set.
    struct Flag(Arc<AtomicBool>);

    impl FenceWait for Flag {
        fn wait(self: Box<Self>) -> Result<(), ServerError> {
            self.0.store(true, Ordering::SeqCst);
            Ok(())
        }

        fn is_complete(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }

    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn retiring(drops: &Arc<AtomicUsize>, fence: &Arc<AtomicBool>) -> Retiring {
        let fences: Fences = smallvec::smallvec![Box::new(Flag(fence.clone())) as Box<dyn FenceWait>];
        Retiring { owner: Box::new(Counted(drops.clone())), fences }
    }

    fn released(drops: &Arc<AtomicUsize>, page: Option<PageId>, streams: &[StreamId]) -> Released {
        Released { page, owner: Some(Box::new(Counted(drops.clone()))), streams: streams.into() }
    }

    #[test]
    fn each_owner_retires_once_its_own_fences_completed() {
        let mut backend = CpuBackend::new(DeviceId::new(DeviceId::CPU, 0));
        let mut pages = ForeignPages::default();
        let (first, second) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (first_drops, second_drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        pages.retiring.push(retiring(&first_drops, &first));
        pages.retiring.push(retiring(&second_drops, &second));
        pages.poll(&mut backend);
        assert_eq!(first_drops.load(Ordering::SeqCst) + second_drops.load(Ordering::SeqCst), 0, "no fence completed");
        second.store(true, Ordering::SeqCst);
        pages.poll(&mut backend);
        assert_eq!(second_drops.load(Ordering::SeqCst), 1, "its work finished: it goes");
        assert_eq!(first_drops.load(Ordering::SeqCst), 0, "its work still runs: it waits");
        assert!(pages.pending());
        first.store(true, Ordering::SeqCst);
        pages.poll(&mut backend);
        assert_eq!((first_drops.load(Ordering::SeqCst), second_drops.load(Ordering::SeqCst)), (1, 1));
        assert!(!pages.pending());
    }

    #[test]
    fn a_release_whose_work_finished_forgets_the_page_and_hands_the_owner_back_at_once() {
        let mut backend = CpuBackend::new(DeviceId::new(DeviceId::CPU, 0));
        let mut pages = ForeignPages::default();
        let mut words = vec![0u128; 4];
        let memory = ForeignMemory::Host { ptr: words.as_mut_ptr().cast(), len: 64 };
        let page = backend.storage().adopt_page(&memory).unwrap();
        let binding = crate::backend::Binding { page, offset: 0, size: 64 };
        assert!(backend.host_bytes(binding).is_some());
        let drops = Arc::new(AtomicUsize::new(0));
        let stream = StreamId::fresh();
        let owner = pages.retire(&mut backend, released(&drops, Some(page), &[stream]));
        assert!(backend.host_bytes(binding).is_none(), "the page is forgotten");
        assert!(owner.is_some(), "the CPU's work ran when queued: the owner may go now");
        assert!(!pages.pending(), "nothing left to poll");
        drop(owner);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        words[0] = 1;
    }

    #[test]
    fn the_streams_that_queue_work_on_adopted_memory_are_noted_once_each() {
        use crate::runtime::Runtime;
        let client = crate::CpuRuntime::client(0).unwrap().with_stream(StreamId::fresh());
        let other = client.with_stream(StreamId::fresh());
        let mut words = vec![0u128; 2];
        let memory = ForeignMemory::Host { ptr: words.as_mut_ptr().cast(), len: 32 };
        // SAFETY: `words` outlives the handle and the work on it (read back).
        let handle = unsafe { client.adopt(memory, Box::new(()), Access::ReadWrite) }.unwrap();
        let adopted = handle.alloc.foreign.as_ref().unwrap();
        assert!(adopted.streams().is_empty(), "nothing queued on it yet");
        client.write(&handle, crate::Bytes::from_slice(&[1u8; 32])).unwrap();
        client.read_one(handle.clone()).unwrap();
        other.read_one(handle.clone()).unwrap();
        assert_eq!(adopted.streams().as_slice(), [client.stream_id(), other.stream_id()]);
        client.revoke(&handle).unwrap();
        assert!(adopted.streams().is_empty(), "revoked after its work: its release waits for nothing");
        drop(handle);
        words[0] = 2;
    }

    #[test]
    fn close_waits_for_every_fence_and_later_releases_drop_at_once() {
        let mut backend = CpuBackend::new(DeviceId::new(DeviceId::CPU, 0));
        let mut pages = ForeignPages::default();
        let (fence, drops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        pages.retiring.push(retiring(&drops, &fence));
        let queue = pages.queue();
        queue.push(released(&drops, None, &[StreamId::fresh()])).ok().unwrap();
        pages.close(&mut backend, &[]);
        assert!(fence.load(Ordering::SeqCst), "waited for");
        assert_eq!(drops.load(Ordering::SeqCst), 2, "the retiring owner and the queued one");
        let late = queue.push(released(&drops, None, &[]));
        let owner = late.expect_err("a closed queue hands the owner back");
        drop(owner);
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }
}
