//! Device pages: the driver allocations the memory pools carve into slices.
//!
//! One `cuMemAlloc` per page, never per buffer. A free asked for while a
//! stream is inside a graph capture, or while a device collective is pending,
//! is deferred until neither is, since `cuMemFree` may synchronise the
//! device. Where several devices are shown on one GPU (`COHORT_CUDA_DEVICES`)
//! they share its context, so a free waits while any of them holds its
//! frees: one member's `cuMemFree` would otherwise wait for another
//! member's peer kernel, which may wait for this member's part.

use crate::id::IdMap;

use cudarc::driver::sys;

use super::driver::describe;
use crate::backend::Binding;
use crate::error::ServerError;
use crate::id::DeviceId;
use crate::memory::{PageId, PageStorage};

/// Alignment of slices inside a page (cuMemAlloc aligns pages to 256 bytes or
/// more).
pub(crate) const ALIGNMENT: u64 = 256;

/// The device memory of one device, page by page.
pub(crate) struct DevicePages {
    device: DeviceId,
    pages: IdMap<PageId, (sys::CUdeviceptr, u64)>,
    next: u64,
    /// Whether this device holds its frees (during captures and pending
    /// collectives).
    hold_frees: bool,
    /// The GPU this device shares with other shown devices, if it does:
    /// its frees are then held in the GPU's entry of [`SHARED_FREES`].
    shared_gpu: Option<usize>,
    /// Its held frees where it has its GPU to itself.
    own: HeldFrees,
    /// Driver allocations made, for tests and reports.
    pub(crate) allocations: u64,
}

/// Frees held while a holder is running: one device's own, or those of
/// the devices shown on one GPU, which share its context.
#[derive(Default)]
struct HeldFrees {
    /// How many devices hold their frees now.
    holders: usize,
    /// Pages freed while one held, freed by whichever lets go last (where
    /// devices share a GPU, the context is the same on every member's
    /// thread).
    deferred: Vec<sys::CUdeviceptr>,
}

impl HeldFrees {
    /// Frees what was deferred unless a holder remains.
    fn release_unless_held(&mut self) {
        if self.holders > 0 {
            return;
        }
        for ptr in self.deferred.drain(..) {
            // SAFETY: each pointer came from cuMemAlloc in the context
            // current on this thread (the device's, or its GPU's shared
            // one) and left its page map when it was deferred: freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(ptr);
            }
        }
    }
}

/// Per GPU ordinal, for GPUs that show several devices. Its lock is held
/// across the `cuMemFree`s of the deferred pages, so no device starts
/// holding (and queues a kernel a free could wait for) midway; no holder
/// is running then, so the frees wait for no device spinning on another.
static SHARED_FREES: parking_lot::Mutex<Vec<HeldFrees>> = parking_lot::Mutex::new(Vec::new());

impl DevicePages {
    /// The pages of `device`; `shared_gpu` is its GPU where other devices
    /// are shown on it too.
    pub fn new(device: DeviceId, shared_gpu: Option<usize>) -> Self {
        Self {
            device,
            pages: IdMap::default(),
            next: 0,
            hold_frees: false,
            shared_gpu,
            own: HeldFrees::default(),
            allocations: 0,
        }
    }

    /// Runs `f` on the frees this device's are held with: its own, or its
    /// GPU's (locked) where it shares one.
    fn with_frees<R>(&mut self, f: impl FnOnce(&mut HeldFrees) -> R) -> R {
        let Some(gpu) = self.shared_gpu else { return f(&mut self.own) };
        let mut shared = SHARED_FREES.lock();
        if shared.len() <= gpu {
            shared.resize_with(gpu + 1, HeldFrees::default);
        }
        f(&mut shared[gpu])
    }

    /// Holds this device's frees (`hold`: a capture open or a device
    /// collective pending, set before the capture begins or the part is
    /// queued) or lets them go, counting the device among its GPU's holders
    /// where it shares one; then frees what was deferred unless a holder
    /// remains.
    pub fn hold_frees(&mut self, hold: bool) {
        let change = hold != self.hold_frees;
        self.hold_frees = hold;
        self.with_frees(|frees| {
            match (change, hold) {
                (true, true) => frees.holders += 1,
                (true, false) => frees.holders -= 1,
                (false, _) => {}
            }
            frees.release_unless_held();
        });
    }

    /// Whether frees wait now: this device holds them, or (sharing its
    /// GPU) another device of the GPU does.
    #[cfg(test)]
    fn frees_held(&mut self) -> bool {
        self.with_frees(|frees| frees.holders > 0)
    }

    /// Device address of a binding, checked against its page.
    #[inline]
    pub fn ptr(&self, binding: Binding) -> Result<sys::CUdeviceptr, ServerError> {
        let &(base, size) = self.pages.get(&binding.page).ok_or_else(|| ServerError::InvalidState {
            operation: "device memory access",
            reason: format!("page {:?} was already given back", binding.page),
        })?;
        if binding.offset.checked_add(binding.size).is_none_or(|end| end > size) {
            return Err(ServerError::InvalidArgument(format!(
                "{} bytes at offset {} run past a page of {size} bytes",
                binding.size, binding.offset
            )));
        }
        Ok(base + binding.offset)
    }

    /// Frees every page (the backend is going away, its work drained);
    /// where other devices of its GPU hold their frees, its pages join the
    /// GPU's deferred list, freed when the last of them lets go.
    pub fn release_all(&mut self) {
        let pages: Vec<PageId> = self.pages.keys().copied().collect();
        for page in pages {
            self.free_page(page);
        }
        self.hold_frees(false);
    }
}

impl Drop for DevicePages {
    /// A device dropped while it still holds (a panic before
    /// `release_all`) stops counting among its GPU's holders, so the other
    /// devices' frees do not wait for it forever; nothing is freed here.
    fn drop(&mut self) {
        if self.hold_frees {
            self.with_frees(|frees| frees.holders -= 1);
        }
    }
}

impl PageStorage for DevicePages {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the device's context is current on this (the device)
        // thread; the call writes one device address.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, size.max(1) as usize) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(ServerError::OutOfMemory {
                device: self.device,
                requested: size,
                reason: format!("cuMemAlloc: {}", describe(code)),
            });
        }
        self.allocations += 1;
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, (ptr, size));
        Ok(id)
    }

    fn free_page(&mut self, page: PageId) {
        if let Some((ptr, _)) = self.pages.remove(&page) {
            self.with_frees(|frees| {
                frees.deferred.push(ptr);
                frees.release_unless_held();
            });
        }
    }

    fn alignment(&self) -> u64 {
        ALIGNMENT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frees of devices shown on one GPU wait while any of them holds its
    /// own; a device with the GPU to itself minds only its own. (Nothing is
    /// deferred here, so no driver call is made.)
    #[test]
    fn devices_sharing_a_gpu_hold_frees_while_any_of_them_does() {
        // A GPU ordinal no other test uses.
        let gpu = 4_000;
        let id = |i| DeviceId::new(DeviceId::CUDA, i);
        let (mut a, mut b) = (DevicePages::new(id(0), Some(gpu)), DevicePages::new(id(1), Some(gpu)));
        let mut alone = DevicePages::new(id(2), None);
        assert!(!a.frees_held() && !b.frees_held());
        a.hold_frees(true);
        assert!(a.frees_held() && b.frees_held(), "b shares a's context");
        assert!(!alone.frees_held(), "a device alone on its GPU");
        b.hold_frees(true);
        a.hold_frees(false);
        assert!(a.frees_held(), "b still holds");
        a.hold_frees(false);
        b.hold_frees(false);
        b.hold_frees(false);
        assert!(!a.frees_held() && !b.frees_held(), "a repeated let-go counts once");
        b.hold_frees(true);
        b.release_all();
        assert!(!a.frees_held(), "a closed device holds nothing");
        let mut dropped = DevicePages::new(id(3), Some(gpu));
        dropped.hold_frees(true);
        assert!(a.frees_held());
        drop(dropped);
        assert!(!a.frees_held(), "a device dropped while holding (a panic) stops holding the others' frees");
    }
}
