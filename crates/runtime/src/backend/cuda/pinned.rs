//! The pinned host pool: page-locked host memory the DMA engines copy from
//! and into at full speed.
//!
//! Blocks are host allocations of ours, page-locked with `cuMemHostRegister`
//! (so they stay valid if the context goes first), and reused: a block handed out
//! (as staging memory, or as the bytes of a large read) comes back to the pool
//! when its [`PinnedBlock`] is dropped, on any thread. A block an upload reads
//! from is marked busy with an event, and is not handed out again before that
//! event completed. The pool holds at most `COHORT_PINNED_LIMIT_MB` MiB
//! (default 2048); past it, callers fall back to pageable memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{driver_error, SendPtr};
use crate::backend::HostMemory;
use crate::error::ServerError;
use crate::id::DeviceId;

/// What the pool knows of each block it allocated.
struct Live {
    size: usize,
    /// Recorded after the last copy that reads or writes the block.
    event: Option<SendPtr<sys::CUevent>>,
    pending: bool,
}

struct Inner {
    /// Idle blocks: (start, size).
    free: Vec<(usize, usize)>,
    /// Every block, by start address.
    live: BTreeMap<usize, Live>,
    total: usize,
    limit: usize,
    closed: bool,
}

struct Shared {
    device: DeviceId,
    inner: Mutex<Inner>,
}

/// The pinned host memory of one device's backend.
#[derive(Clone)]
pub(crate) struct PinnedPool {
    shared: Arc<Shared>,
}

/// One pinned block lent out; dropping it returns it to the pool.
pub(crate) struct PinnedBlock {
    ptr: usize,
    size: usize,
    shared: Arc<Shared>,
}

impl HostMemory for PinnedBlock {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }

    fn capacity(&self) -> usize {
        self.size
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        let mut inner = self.shared.inner.lock();
        if inner.closed {
            // The pool unregistered it when it closed; the memory is ours.
            // SAFETY: allocated by `host_alloc` with this size, freed once.
            unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout(self.size)) };
        } else {
            inner.free.push((self.ptr, self.size));
        }
    }
}

fn layout(size: usize) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(size, 4096).expect("a page-aligned layout")
}

/// Rounds a request up to the pool's size classes (64 KiB below 8 MiB, 2 MiB
/// above), so similar requests reuse blocks.
fn size_class(len: usize) -> usize {
    let step = if len < (8 << 20) { 64 << 10 } else { 2 << 20 };
    len.max(1).div_ceil(step) * step
}

impl PinnedPool {
    /// An empty pool for `device` holding at most `limit_mib` MiB
    /// (`COHORT_PINNED_LIMIT_MB`, checked by the config module to fit).
    pub fn new(device: DeviceId, limit_mib: usize) -> Self {
        let limit = limit_mib.saturating_mul(1 << 20);
        let inner = Inner { free: Vec::new(), live: BTreeMap::new(), total: 0, limit, closed: false };
        Self { shared: Arc::new(Shared { device, inner: Mutex::new(inner) }) }
    }

    /// A block of at least `len` bytes, reusing an idle one when it fits
    /// (waiting for the last copy that used it). `Ok(None)` when the pool's
    /// limit is reached; `may_free` allows idle blocks to be freed for room.
    pub fn take(&self, len: usize, may_free: bool) -> Result<Option<PinnedBlock>, ServerError> {
        let size = size_class(len);
        let mut inner = self.shared.inner.lock();
        let best = inner
            .free
            .iter()
            .enumerate()
            .filter(|(_, &(_, s))| s >= size && s <= size + size / 4 + (64 << 10))
            .min_by_key(|(_, &(_, s))| s)
            .map(|(i, _)| i);
        if let Some(index) = best {
            let (ptr, size) = inner.free.swap_remove(index);
            let live = inner.live.get_mut(&ptr).expect("a free block is live");
            if live.pending {
                live.pending = false;
                let event = live.event.expect("a pending block has an event").0;
                drop(inner);
                // SAFETY: the event belongs to this pool and was recorded; the
                // task's thread (the caller) has the context current.
                let code = unsafe { sys::cuEventSynchronize(event) };
                if code != sys::CUresult::CUDA_SUCCESS {
                    return Err(driver_error(self.shared.device, "cuEventSynchronize (pinned block)", code));
                }
            }
            return Ok(Some(PinnedBlock { ptr, size, shared: self.shared.clone() }));
        }
        if inner.total + size > inner.limit && may_free {
            Self::free_idle(&mut inner);
        }
        if inner.total + size > inner.limit {
            return Ok(None);
        }
        // SAFETY: a non-zero, page-aligned layout.
        let ptr = unsafe { std::alloc::alloc(layout(size)) };
        if ptr.is_null() {
            return Ok(None);
        }
        // SAFETY: `ptr` holds `size` bytes we own; the task's thread (device
        // thread or inline caller) has the context current.
        let code = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), size, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        if code != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated just above with this layout.
            unsafe { std::alloc::dealloc(ptr, layout(size)) };
            return Err(driver_error(self.shared.device, "cuMemHostRegister", code));
        }
        let ptr = ptr as usize;
        inner.total += size;
        inner.live.insert(ptr, Live { size, event: None, pending: false });
        Ok(Some(PinnedBlock { ptr, size, shared: self.shared.clone() }))
    }

    /// Frees idle blocks that no copy uses any more.
    fn free_idle(inner: &mut Inner) {
        let free = std::mem::take(&mut inner.free);
        for (ptr, size) in free {
            let live = inner.live.get(&ptr).expect("a free block is live");
            // SAFETY: querying an event of this pool.
            let done = !live.pending
                || unsafe { sys::cuEventQuery(live.event.expect("pending").0) } == sys::CUresult::CUDA_SUCCESS;
            if !done {
                inner.free.push((ptr, size));
                continue;
            }
            let live = inner.live.remove(&ptr).expect("checked above");
            // SAFETY: the block is idle (in the free list, its copies done),
            // registered and allocated by `take`; it is freed once.
            unsafe {
                if let Some(event) = live.event {
                    let _ = sys::cuEventDestroy_v2(event.0);
                }
                let _ = sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void);
                std::alloc::dealloc(ptr as *mut u8, layout(size));
            }
            inner.total -= size;
        }
    }

    /// Whether `[ptr, ptr + len)` lies inside one pinned block of this pool.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = ptr as usize;
        let inner = self.shared.inner.lock();
        inner.live.range(..=start).next_back().is_some_and(|(&base, live)| start + len <= base + live.size)
    }

    /// Records that a copy queued on `stream` reads the block holding `ptr`:
    /// the block is not handed out again before the copy is done.
    pub fn mark_busy(&self, ptr: *const u8, stream: sys::CUstream) -> Result<(), ServerError> {
        let start = ptr as usize;
        let mut inner = self.shared.inner.lock();
        let Some((_, live)) = inner.live.range_mut(..=start).next_back() else { return Ok(()) };
        let event = match live.event {
            Some(event) => event.0,
            None => {
                let mut event: sys::CUevent = std::ptr::null_mut();
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: the task's thread, context current; writes one handle.
                let code = unsafe { sys::cuEventCreate(&mut event, flags) };
                if code != sys::CUresult::CUDA_SUCCESS {
                    return Err(driver_error(self.shared.device, "cuEventCreate", code));
                }
                live.event = Some(SendPtr(event));
                event
            }
        };
        // SAFETY: live event and stream of the current context.
        let code = unsafe { sys::cuEventRecord(event, stream) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(self.shared.device, "cuEventRecord", code));
        }
        live.pending = true;
        Ok(())
    }

    /// Frees every idle block, unregisters the ones still lent out (their
    /// holders free them on drop) and stops taking blocks back. The device
    /// has drained.
    pub fn close(&self) {
        let mut inner = self.shared.inner.lock();
        for live in inner.live.values_mut() {
            live.pending = false;
        }
        Self::free_idle(&mut inner);
        let lent = std::mem::take(&mut inner.live);
        for (ptr, live) in lent {
            // SAFETY: registered by `take`; the memory stays valid (ours) after
            // it is unregistered, only no longer page-locked.
            unsafe {
                if let Some(event) = live.event {
                    let _ = sys::cuEventDestroy_v2(event.0);
                }
                let _ = sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void);
            }
        }
        inner.closed = true;
    }
}
