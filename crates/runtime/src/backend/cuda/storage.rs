//! Device pages: the driver allocations the memory pools carve into slices.
//!
//! One `cuMemAlloc` per page, never per buffer. A free asked for while a
//! stream is inside a graph capture, or while a device collective is pending,
//! is deferred until neither is, since `cuMemFree` may synchronise the
//! device.

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
    /// Frees are held here while `hold_frees` is set (during captures and
    /// pending collectives).
    deferred: Vec<sys::CUdeviceptr>,
    pub(crate) hold_frees: bool,
    /// Driver allocations made, for tests and reports.
    pub(crate) allocations: u64,
}

impl DevicePages {
    pub fn new(device: DeviceId) -> Self {
        Self { device, pages: IdMap::default(), next: 0, deferred: Vec::new(), hold_frees: false, allocations: 0 }
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

    /// Frees what was deferred, unless frees are still held.
    pub fn release_deferred(&mut self) {
        if self.hold_frees {
            return;
        }
        for ptr in self.deferred.drain(..) {
            // SAFETY: each pointer came from cuMemAlloc and left the page map
            // when it was deferred, so it is freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(ptr);
            }
        }
    }

    /// Frees every page (the backend is going away).
    pub fn release_all(&mut self) {
        self.hold_frees = false;
        let pages: Vec<PageId> = self.pages.keys().copied().collect();
        for page in pages {
            self.free_page(page);
        }
        self.release_deferred();
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
            self.deferred.push(ptr);
            self.release_deferred();
        }
    }

    fn alignment(&self) -> u64 {
        ALIGNMENT
    }
}
