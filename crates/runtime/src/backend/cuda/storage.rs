//! Device pages: the driver allocations the memory pools carve into slices.
//!
//! One `cuMemAlloc` per page, never per buffer. A free asked for while a
//! stream is inside a graph capture, or while a device collective is pending,
//! is deferred until neither is, since `cuMemFree` may synchronise the
//! device. Where several devices are shown on one GPU (`COHORT_CUDA_DEVICES`)
//! they share its context, so a free waits while any of them holds its
//! frees: one member's `cuMemFree` would otherwise wait for another
//! member's peer kernel, which may wait for this member's part.
//!
//! Memory another library allocated (`Client::adopt`) is a page too, after
//! the driver confirmed it is device memory of this device's context; it
//! is only forgotten, never freed.

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
    pages: IdMap<PageId, Page>,
    next: u64,
    /// Whether this device holds its frees (during captures and pending
    /// collectives).
    hold_frees: bool,
    /// The GPU this device shares with other shown devices, if it does:
    /// its frees are then held in the GPU's entry of [`SHARED_FREES`].
    shared_gpu: Option<usize>,
    /// Its held frees where it has its GPU to itself.
    own: HeldFrees,
    /// The device's context and GPU, asked of the driver at the first
    /// adoption (they never change).
    context: Option<OwnContext>,
    /// Driver allocations made, for tests and reports.
    pub(crate) allocations: u64,
}

/// One page: its address and size, and whether it was adopted (never
/// freed here).
#[derive(Clone, Copy)]
struct Page {
    ptr: sys::CUdeviceptr,
    size: u64,
    adopted: bool,
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
            context: None,
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
        let &Page { ptr: base, size, .. } = self.pages.get(&binding.page).ok_or_else(|| ServerError::InvalidState {
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
        self.pages.insert(id, Page { ptr, size, adopted: false });
        Ok(id)
    }

    /// An adopted page is only forgotten.
    fn free_page(&mut self, page: PageId) {
        if let Some(Page { ptr, adopted: false, .. }) = self.pages.remove(&page) {
            self.with_frees(|frees| {
                frees.deferred.push(ptr);
                frees.release_unless_held();
            });
        }
    }

    fn alignment(&self) -> u64 {
        ALIGNMENT
    }

    /// Takes `len` bytes of device memory at `ptr` as a page, after the
    /// driver confirmed it (see [`check_device_range`]).
    fn adopt_page(&mut self, memory: &crate::ForeignMemory) -> Result<PageId, ServerError> {
        #[allow(unreachable_patterns)]
        let (ptr, len) = match *memory {
            crate::ForeignMemory::Cuda { ptr, len } => (ptr, len as u64),
            _ => return Err(memory.wrong_backend("CUDA")),
        };
        let own = match self.context {
            Some(own) => own,
            None => *self.context.insert(current_context(self.device)?),
        };
        check_device_range(self.device, &own, ptr, len)?;
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, Page { ptr, size: len, adopted: true });
        Ok(id)
    }
}

/// What the driver says of a pointer ([`sys::cuPointerGetAttributes`]:
/// zeros for memory it does not know).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PointerFacts {
    pub context: u64,
    pub memory_type: u64,
    pub managed: bool,
    pub ordinal: i64,
    pub range_start: u64,
    pub range_size: u64,
}

/// The device's context and GPU (the context current on this thread: the
/// device thread, or a caller's running a task of the device).
#[derive(Clone, Copy)]
pub(crate) struct OwnContext {
    pub context: u64,
    pub ordinal: i64,
}

/// The context current on this thread (the device's, on the thread
/// running its task) and its GPU.
fn current_context(device: DeviceId) -> Result<OwnContext, ServerError> {
    let failed = |call: &str, code| ServerError::Backend {
        backend: "cuda",
        device,
        message: format!("{call}: {}", describe(code)),
    };
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle; the device's context is current
    // on the thread running the device's task.
    let code = unsafe { sys::cuCtxGetCurrent(&mut context) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(failed("cuCtxGetCurrent", code));
    }
    let mut gpu: sys::CUdevice = 0;
    // SAFETY: writes one device handle of the current context.
    let code = unsafe { sys::cuCtxGetDevice(&mut gpu) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(failed("cuCtxGetDevice", code));
    }
    Ok(OwnContext { context: context as u64, ordinal: i64::from(gpu) })
}

/// Whether `len` bytes at `ptr` are device memory of the device's context
/// `own`: asks the driver, then [`judge_pointer`].
fn check_device_range(device: DeviceId, own: &OwnContext, ptr: sys::CUdeviceptr, len: u64) -> Result<(), ServerError> {
    use sys::CUpointer_attribute as A;
    let mut attributes = [
        A::CU_POINTER_ATTRIBUTE_CONTEXT,
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    // Each slot is 8 bytes, zeroed: the driver writes a pointer, an
    // unsigned int, an int or a size into the low bytes (little-endian).
    let mut slots = [0u64; 6];
    let mut data: [*mut std::ffi::c_void; 6] = slots.each_mut().map(|s| (s as *mut u64).cast());
    // SAFETY: six attributes, six writable 8-byte slots; for memory the
    // driver does not know it writes zeros rather than failing.
    let code = unsafe {
        sys::cuPointerGetAttributes(attributes.len() as u32, attributes.as_mut_ptr(), data.as_mut_ptr(), ptr)
    };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(ServerError::InvalidArgument(format!(
            "the driver cannot describe the pointer {ptr:#x} (cuPointerGetAttributes: {}); pass device memory of {device}",
            describe(code)
        )));
    }
    let facts = PointerFacts {
        context: slots[0],
        memory_type: slots[1] & 0xffff_ffff,
        managed: slots[2] & 0xffff_ffff != 0,
        ordinal: i64::from(slots[3] as u32 as i32),
        range_start: slots[4],
        range_size: slots[5],
    };
    judge_pointer(device, ptr, len, &facts, own)
}

/// Whether memory the driver described as `facts` can be adopted by the
/// device of context `own`: device memory (or managed), of that context
/// (or, for memory of no context, as the driver reports virtual-memory
/// mappings, of its GPU), whose allocation covers `[ptr, ptr + len)`.
pub(crate) fn judge_pointer(
    device: DeviceId,
    ptr: u64,
    len: u64,
    facts: &PointerFacts,
    own: &OwnContext,
) -> Result<(), ServerError> {
    let refuse = |why: String| {
        Err(ServerError::InvalidArgument(format!("cannot adopt {len} bytes at {ptr:#x} on {device}: {why}")))
    };
    if ptr == 0 {
        return refuse("the pointer is null; pass the address of the memory to share".into());
    }
    const HOST: u64 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u64;
    const DEVICE: u64 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64;
    const ARRAY: u64 = sys::CUmemorytype::CU_MEMORYTYPE_ARRAY as u64;
    match facts.memory_type {
        _ if facts.managed => {}
        DEVICE => {}
        HOST => {
            return refuse(
                "it is host memory (pinned); adopt host memory on a CPU client, or copy it to the device first".into(),
            )
        }
        ARRAY => return refuse("it is a CUDA array, not linear device memory".into()),
        0 => {
            return refuse(
                "the CUDA driver does not know this pointer (pageable host memory, freed memory, or another \
                 process's): pass memory allocated on this device (cuMemAlloc, cudaMalloc, cudarc's alloc)"
                    .into(),
            )
        }
        other => return refuse(format!("the driver reports memory type {other}, which is not device memory")),
    }
    if facts.context != 0 && facts.context != own.context {
        return refuse(format!(
            "it belongs to another CUDA context ({:#x}; this device runs on {:#x}, the primary context of GPU {}): \
             allocate it in the device's primary context (cudarc's CudaContext::new, PyTorch's and CuPy's default)",
            facts.context, own.context, own.ordinal
        ));
    }
    if facts.ordinal != own.ordinal {
        return refuse(format!(
            "it is memory of GPU {}, and this device is GPU {}: adopt it on the client of GPU {}",
            facts.ordinal, own.ordinal, facts.ordinal
        ));
    }
    let end = ptr.checked_add(len);
    let range_end = facts.range_start.saturating_add(facts.range_size);
    if ptr < facts.range_start || end.is_none_or(|end| end > range_end) {
        return refuse(format!(
            "its allocation spans {:#x}..{range_end:#x} ({} bytes), which does not hold {len} bytes from {ptr:#x}",
            facts.range_start, facts.range_size
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each fact the driver gives that makes memory unusable is refused
    /// naming it; device memory of the context within its allocation is
    /// taken. (No driver needed: the facts are given.)
    #[test]
    fn pointers_are_judged_by_what_the_driver_says_of_them() {
        let device = DeviceId::new(DeviceId::CUDA, 0);
        let own = OwnContext { context: 0xc0, ordinal: 0 };
        let good = PointerFacts {
            context: 0xc0,
            memory_type: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64,
            managed: false,
            ordinal: 0,
            range_start: 0x1000,
            range_size: 0x1000,
        };
        let judge = |ptr, len, facts: PointerFacts| judge_pointer(device, ptr, len, &facts, &own);
        assert!(judge(0x1000, 0x1000, good).is_ok());
        assert!(judge(0x1800, 0x800, good).is_ok(), "a part of an allocation");
        let managed = PointerFacts { managed: true, memory_type: sys::CUmemorytype::CU_MEMORYTYPE_HOST as u64, ..good };
        assert!(judge(0x1000, 16, managed).is_ok(), "managed memory");
        assert!(judge(0x1000, 16, PointerFacts { context: 0, ..good }).is_ok(), "a mapping of no context, this GPU");
        let cases = [
            (0x1000, 0x1001, good, "does not hold"),
            (0x1ff0, 0x20, good, "does not hold"),
            (0, 16, good, "null"),
            (0x1000, 16, PointerFacts { context: 0xd0, ..good }, "another CUDA context"),
            (0x1000, 16, PointerFacts { context: 0, ordinal: 1, ..good }, "memory of GPU 1"),
            (
                0x1000,
                16,
                PointerFacts { memory_type: sys::CUmemorytype::CU_MEMORYTYPE_HOST as u64, ..good },
                "host memory",
            ),
            (0x1000, 16, PointerFacts::default(), "does not know this pointer"),
        ];
        for (ptr, len, facts, says) in cases {
            let err = judge(ptr, len, facts).unwrap_err().to_string();
            assert!(err.contains(says), "{says}: {err}");
        }
    }

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
