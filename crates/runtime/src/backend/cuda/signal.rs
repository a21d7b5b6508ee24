//! End signals: words in host memory that the GPU writes behind a stream's
//! collective parts (`cuStreamWriteValue32`), so that a waiter learns the
//! parts ended by reading memory instead of asking the driver.
//!
//! Measured on an H200 (`examples/wait_probe.rs`): a waiter spinning on
//! `cuStreamQuery` pays 0.2–0.9 µs a look and sees a small NCCL call end
//! later than one spinning on a host word (0.3–1.1 µs per waited call),
//! while queueing the write costs the host 1.5 µs. So a word is written only
//! where a waiter asks for one (`DeviceCollectives::end_signal`), while the
//! part still runs; queued calls that nobody waits on pay nothing.
//!
//! Each stream that was asked for a signal owns one 4-byte slot of a page
//! of host memory owned by this process (not by the driver), registered
//! with the context for the GPU to write: its value counts the writes
//! queued on the stream, so "reached" is a comparison. A waiter reads its
//! slot without the device's lock; the page outlives the context (the
//! registration ends with the backend, after its work drained), so a read
//! never touches freed memory.

use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::backend::collectives::count_reached;
use crate::backend::EndSignal;
use crate::id::StreamId;

/// Bytes of the page, and so `SLOTS` streams a backend can signal on.
const PAGE: usize = 4096;
const SLOTS: usize = PAGE / 4;

/// A page of host words, each written by the GPU and read by waiters.
pub(crate) struct HostWords {
    words: *mut AtomicU32,
}

// SAFETY: the page is only read and written through atomics (by threads)
// and by the GPU; the pointer itself never changes.
unsafe impl Send for HostWords {}
// SAFETY: as above.
unsafe impl Sync for HostWords {}

impl HostWords {
    fn layout() -> Layout {
        Layout::from_size_align(PAGE, PAGE).expect("a page is a valid layout")
    }

    fn word(&self, slot: usize) -> &AtomicU32 {
        debug_assert!(slot < SLOTS);
        // SAFETY: `slot` is below `SLOTS`, inside the page, which lives as
        // long as `self`.
        unsafe { &*self.words.add(slot) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        // SAFETY: allocated in `Signals::page` with this layout; its
        // registration ended (`Signals::close` forgets a page it could not
        // unregister) or never began.
        unsafe { std::alloc::dealloc(self.words.cast(), Self::layout()) };
    }
}

/// What a backend keeps for its end signals.
#[derive(Default)]
pub(crate) struct Signals {
    /// The page and its address for the GPU, made on first use.
    page: Option<(Arc<HostWords>, sys::CUdeviceptr)>,
    /// Set when the page could not be made or a write was refused: no
    /// signals then (waiters poll the driver).
    unavailable: bool,
    /// Each signalled stream's slot and the count of writes queued on it.
    slots: HashMap<StreamId, (usize, u32)>,
}

impl Signals {
    /// The page, registered with the current context on first use; `None`
    /// where that failed (waiters then poll the driver).
    fn page(&mut self) -> Option<(Arc<HostWords>, sys::CUdeviceptr)> {
        if self.page.is_none() && !self.unavailable {
            // SAFETY: a non-zero-sized layout.
            let words = unsafe { std::alloc::alloc_zeroed(HostWords::layout()) }.cast::<AtomicU32>();
            if words.is_null() {
                self.unavailable = true;
                return None;
            }
            let words = Arc::new(HostWords { words });
            let mut device = 0;
            let host = words.words.cast();
            let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            // SAFETY: the page is ours, page-aligned, `PAGE` bytes, alive
            // until unregistered (`close`); the context is current on the
            // calling thread (the device's, or a caller's that entered it).
            let registered = unsafe { sys::cuMemHostRegister_v2(host, PAGE, flags) } == sys::CUresult::CUDA_SUCCESS;
            // SAFETY: the page was just registered; writes one address.
            let mapped = registered
                && unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) } == sys::CUresult::CUDA_SUCCESS;
            if mapped {
                self.page = Some((words, device));
            } else {
                tracing::debug!("no host page for end signals: waiters poll the driver");
                self.unavailable = true;
                if registered {
                    self.page = Some((words, device));
                    self.close();
                }
            }
        }
        self.page.clone()
    }

    /// Queues a write of the next count of `stream`'s slot on `raw` (its
    /// driver stream) and returns where and what it writes: once written,
    /// every piece of work queued on the stream before has completed.
    /// `None` where no slot or page can be had, or the write is refused.
    pub(crate) fn arm(&mut self, stream: StreamId, raw: sys::CUstream) -> Option<(usize, u32)> {
        let (words, device) = self.page()?;
        if !self.slots.contains_key(&stream) {
            let slot = self.free_slot(&words)?;
            self.slots.insert(stream, slot);
        }
        let (slot, count) = self.slots.get_mut(&stream).expect("inserted above");
        let target = count.wrapping_add(1);
        let address = device + (*slot * 4) as sys::CUdeviceptr;
        // SAFETY: a live stream of the current context; `address` is the
        // slot's device address inside the registered page. The write is
        // ordered after the stream's earlier work, with a memory barrier.
        let code = unsafe { sys::cuStreamWriteValue32_v2(raw, address, target, 0) };
        if code != sys::CUresult::CUDA_SUCCESS {
            // Refused (stream memory operations off, say): not asked again.
            tracing::debug!(?code, "cuStreamWriteValue32 refused: waiters poll the driver");
            self.unavailable = true;
            return None;
        }
        *count = target;
        Some((*slot, target))
    }

    /// A slot for a stream that has none, with the count its word holds: a
    /// new one while the page has room, else one whose writes all landed
    /// (its stream's signals all reached, so the slot's count goes on from
    /// there and they stay reached). `None` while every slot has a write
    /// in flight.
    fn free_slot(&mut self, words: &HostWords) -> Option<(usize, u32)> {
        if self.slots.len() < SLOTS {
            return Some((self.slots.len(), 0));
        }
        let (&idle, &(slot, count)) =
            self.slots.iter().find(|(_, &(slot, count))| words.word(slot).load(Ordering::Acquire) == count)?;
        self.slots.remove(&idle);
        Some((slot, count))
    }

    /// The waiter's view of `(slot, target)` from [`Signals::arm`].
    pub(crate) fn signal(&self, (slot, target): (usize, u32)) -> Option<EndSignal> {
        let (words, _) = self.page.as_ref()?;
        Some(EndSignal::new(words.clone(), move |words: &HostWords| words.word(slot), target))
    }

    /// Whether `(slot, target)` from [`Signals::arm`] was written.
    pub(crate) fn reached(&self, (slot, target): (usize, u32)) -> bool {
        self.page.as_ref().is_some_and(|(words, _)| count_reached(words.word(slot).load(Ordering::Acquire), target))
    }

    /// Ends the registration (after the context's work drained); waiters
    /// that still hold signals read the page, which they keep alive.
    pub(crate) fn close(&mut self) {
        if let Some((words, _)) = self.page.take() {
            // SAFETY: registered in `page`, unregistered once.
            let code = unsafe { sys::cuMemHostUnregister(words.words.cast()) };
            if code != sys::CUresult::CUDA_SUCCESS {
                // Still registered (a lost context answers so until it is
                // reset): the page is never freed rather than handed back
                // to the allocator pinned.
                std::mem::forget(words);
            }
        }
        self.slots.clear();
    }
}
