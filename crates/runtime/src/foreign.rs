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

/// What an adopted [`Handle`](crate::Handle)'s allocation keeps beside its
/// page: the access allowed, the owner, and the way back to its device's
/// release queue (see [`ReleaseQueue`]).
pub(crate) struct Adopted {
    pub access: Access,
    /// Taken by [`Client::reclaim`](crate::Client::reclaim), else handed to
    /// the release queue when the last clone goes.
    pub owner: Mutex<Option<ForeignOwner>>,
    /// Set once the storage forgot the page
    /// ([`Client::revoke`](crate::Client::revoke), `reclaim`): the handle
    /// no longer binds.
    pub given_back: AtomicBool,
    pub releases: Arc<ReleaseQueue>,
    /// Woken when a release is queued, so an idle device thread retires
    /// the owner at once; gone once the device is.
    pub device: Weak<DeviceHandle>,
}

impl Adopted {
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

    /// Hands the page (unless already forgotten) and the owner (unless
    /// reclaimed) to the device: it forgets the page and drops the owner
    /// once the work queued so far has finished. On a device already
    /// closed (its work drained), the owner is dropped here. Never blocks
    /// on the device, never panics.
    pub(crate) fn release(&self, page: Option<PageId>) {
        let owner = self.owner.lock().take();
        let page = page.filter(|_| !self.given_back.load(Ordering::Acquire));
        if owner.is_none() && page.is_none() {
            return;
        }
        if let Err(owner) = self.releases.push(Released { page, owner }) {
            drop(owner);
            return;
        }
        if let Some(device) = self.device.upgrade() {
            device.wake();
        }
    }
}

/// What the last clone of an adopted handle left to its device.
pub(crate) struct Released {
    page: Option<PageId>,
    owner: Option<ForeignOwner>,
}

/// Releases of one device's adopted memory, pushed from any thread (where
/// the last clone of a handle drops) and drained by the device (see
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
    /// Queues `released`; hands it back where the device is closed (its
    /// work all ended, its storage gone: the owner may go at once).
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

    fn take(&self) -> Vec<Released> {
        if !self.queued.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut queue = self.queue.lock();
        self.queued.store(false, Ordering::Release);
        std::mem::take(&mut queue.released)
    }
}

/// An owner waiting for the work queued before its memory was released.
struct Retiring {
    owner: ForeignOwner,
    fences: Vec<Box<dyn FenceWait>>,
}

/// A device's side of adopted memory: the release queue its handles push
/// to, and the owners waiting for their fences.
pub(crate) struct ForeignPages {
    queue: Arc<ReleaseQueue>,
    retiring: Vec<Retiring>,
}

impl Default for ForeignPages {
    fn default() -> Self {
        Self { queue: Arc::new(ReleaseQueue::default()), retiring: Vec::new() }
    }
}

/// Drops an owner on the device's thread: a panic in its `Drop` (the
/// caller's code) is logged, and never ends the device's thread.
fn drop_owner(owner: ForeignOwner) {
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(owner))) {
        let message = crate::device::panic_message(payload.as_ref());
        tracing::error!("the owner of adopted memory panicked when dropped: {message}");
    }
}

/// Fences after the work queued so far on every stream of the device; a
/// stream whose fence cannot be raised (a failed device) has no work that
/// will still run.
pub(crate) fn fences_of(backend: &mut dyn Backend, streams: &[StreamId]) -> Vec<Box<dyn FenceWait>> {
    streams.iter().filter_map(|&stream| backend.fence(stream).ok()).filter(|f| !f.is_complete()).collect()
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

    /// Takes the queued releases (the storage forgets their pages, a fence
    /// is raised on every stream for their owners) and drops the owners
    /// whose fences completed. Never waits.
    pub fn poll(&mut self, backend: &mut dyn Backend, streams: &[StreamId]) {
        if !self.pending() {
            return;
        }
        let released = self.queue.take();
        if !released.is_empty() {
            for page in released.iter().filter_map(|r| r.page) {
                backend.storage().free_page(page);
            }
            let owners: Vec<ForeignOwner> = released.into_iter().filter_map(|r| r.owner).collect();
            if !owners.is_empty() {
                let fences = fences_of(backend, streams);
                let mut owners = owners.into_iter();
                // One set of fences covers every owner released together.
                let first = owners.next().expect("not empty");
                self.retiring.push(Retiring { owner: first, fences });
                self.retiring.extend(owners.map(|owner| Retiring { owner, fences: Vec::new() }));
            }
        }
        let mut done = Vec::new();
        let mut blocked = false;
        // Owners retire in order: one is dropped only once its fences and
        // those of every owner released before it completed.
        self.retiring.retain_mut(|retiring| {
            retiring.fences.retain(|fence| !fence.is_complete());
            blocked |= !retiring.fences.is_empty();
            if blocked {
                return true;
            }
            done.push(std::mem::replace(&mut retiring.owner, Box::new(())));
            false
        });
        done.into_iter().for_each(drop_owner);
    }

    /// At close: takes what was released, waits for every fence, drops
    /// every owner, and marks the queue closed (a handle released later
    /// drops its owner at once: nothing runs on the device any more).
    pub fn close(&mut self, backend: &mut dyn Backend, streams: &[StreamId]) {
        self.poll(backend, streams);
        let released = {
            let mut queue = self.queue.queue.lock();
            queue.closed = true;
            std::mem::take(&mut queue.released)
        };
        for page in released.iter().filter_map(|r| r.page) {
            backend.storage().free_page(page);
        }
        let fences = fences_of(backend, streams);
        for retiring in self.retiring.drain(..) {
            for fence in retiring.fences {
                let _ = fence.wait();
            }
            drop_owner(retiring.owner);
        }
        for fence in fences {
            let _ = fence.wait();
        }
        released.into_iter().filter_map(|r| r.owner).for_each(drop_owner);
    }
}

impl Drop for ForeignPages {
    /// A device state dropped without `close` (its thread panicked): the
    /// queue closes, so owners are never kept forever; those waiting are
    /// dropped (the backend is going away with its work).
    fn drop(&mut self) {
        self.queue.queue.lock().closed = true;
        let released = self.queue.take();
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
        Retiring { owner: Box::new(Counted(drops.clone())), fences: vec![Box::new(Flag(fence.clone()))] }
    }

    #[test]
    fn owners_retire_after_their_fences_and_those_of_owners_released_before() {
        let mut backend = CpuBackend::new(DeviceId::new(DeviceId::CPU, 0));
        let mut pages = ForeignPages::default();
        let (first, second) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let drops = Arc::new(AtomicUsize::new(0));
        pages.retiring.push(retiring(&drops, &first));
        pages.retiring.push(retiring(&drops, &second));
        pages.poll(&mut backend, &[]);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "no fence completed");
        second.store(true, Ordering::SeqCst);
        pages.poll(&mut backend, &[]);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "the second waits for the first");
        assert!(pages.pending());
        first.store(true, Ordering::SeqCst);
        pages.poll(&mut backend, &[]);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert!(!pages.pending());
    }

    #[test]
    fn close_waits_for_every_fence_and_later_releases_drop_at_once() {
        let mut backend = CpuBackend::new(DeviceId::new(DeviceId::CPU, 0));
        let mut pages = ForeignPages::default();
        let (fence, drops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        pages.retiring.push(retiring(&drops, &fence));
        let queue = pages.queue();
        queue.push(Released { page: None, owner: Some(Box::new(Counted(drops.clone()))) }).ok().unwrap();
        pages.close(&mut backend, &[]);
        assert!(fence.load(Ordering::SeqCst), "waited for");
        assert_eq!(drops.load(Ordering::SeqCst), 2, "the retiring owner and the queued one");
        let late = queue.push(Released { page: None, owner: Some(Box::new(Counted(drops.clone()))) });
        let owner = late.expect_err("a closed queue hands the owner back");
        drop(owner);
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }
}
