//! Host pages standing in for device memory: the backend's own, and host
//! memory adopted from the caller (`Client::adopt`), which is viewed in
//! place and never freed.

use crate::id::IdMap;

use crate::backend::Binding;
use crate::error::ServerError;
use crate::memory::{PageId, PageStorage};

/// Alignment of every page, own or adopted: kernels
/// ([`crate::CpuKernelContext::buffer`]) and host-staged collectives
/// ([`crate::BufferAccess::host_ptr`]) view pages as elements of any type
/// in place, which needs the alignment of the widest (16 bytes).
pub(crate) const PAGE_ALIGN: usize = 16;

/// One page: memory the backend allocated, or host memory it adopted.
enum Page {
    Own(Box<[u128]>),
    /// `len` bytes at `ptr`, owned by the caller (kept alive by the owner
    /// of the adopting handle) and never freed here.
    Adopted {
        ptr: *mut u8,
        len: usize,
    },
}

/// Pages of host memory, 16-byte aligned (any element type can be viewed in
/// place), keyed by page id.
#[derive(Default)]
pub(crate) struct HostPages {
    pages: IdMap<PageId, Page>,
    next: u64,
}

impl HostPages {
    fn page_range(&mut self, binding: Binding) -> Result<(*mut u8, usize), ServerError> {
        let page = self.pages.get_mut(&binding.page).ok_or_else(|| ServerError::InvalidState {
            operation: "device memory access",
            reason: format!("page {:?} was already given back", binding.page),
        })?;
        let (base, page_len) = match page {
            Page::Own(words) => (words.as_mut_ptr().cast::<u8>(), words.len() * 16),
            Page::Adopted { ptr, len } => (*ptr, *len),
        };
        binding.offset.checked_add(binding.size).filter(|&e| e <= page_len as u64).ok_or_else(|| {
            ServerError::InvalidArgument(format!(
                "{} bytes at offset {} run past a page of {page_len} bytes",
                binding.size, binding.offset
            ))
        })?;
        // SAFETY: offset + size <= page length was checked above, so the
        // pointer stays inside the page's memory (own, or adopted: valid for
        // `len` bytes while its handle lives, as `Client::adopt`'s caller
        // promised).
        let start = unsafe { base.add(binding.offset as usize) };
        Ok((start, binding.size as usize))
    }

    /// The bytes of one binding.
    pub fn bytes_mut(&mut self, binding: Binding) -> Result<&mut [u8], ServerError> {
        let (ptr, len) = self.page_range(binding)?;
        // SAFETY: `page_range` checked the range lies inside a live page that
        // `self` owns; the returned borrow of `self` keeps it alive and unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    /// Mutable bytes of several bindings at once; refuses bindings that
    /// overlap.
    pub fn disjoint_many_mut(&mut self, bindings: &[Binding]) -> Result<Vec<&mut [u8]>, ServerError> {
        for (i, a) in bindings.iter().enumerate() {
            for (j, b) in bindings.iter().enumerate().skip(i + 1) {
                let overlap = a.page == b.page && a.offset < b.offset + b.size && b.offset < a.offset + a.size;
                if overlap && a.size > 0 && b.size > 0 {
                    return Err(ServerError::InvalidArgument(format!(
                        "bindings {i} and {j} overlap in device memory; the CPU backend hands kernels separate slices"
                    )));
                }
            }
        }
        let mut out = Vec::with_capacity(bindings.len());
        for binding in bindings {
            let (ptr, len) = self.page_range(*binding)?;
            // SAFETY: each range lies inside a live page owned by `self` (checked
            // by `page_range`) and no two ranges overlap (checked above), so the
            // slices never alias; they borrow `self` mutably for their lifetime.
            out.push(unsafe { std::slice::from_raw_parts_mut(ptr, len) });
        }
        Ok(out)
    }

    /// Two non-overlapping bindings at once.
    pub fn disjoint_mut(&mut self, bindings: [Binding; 2]) -> Result<[&mut [u8]; 2], ServerError> {
        let mut slices = self.disjoint_many_mut(&bindings)?;
        let second = slices.pop().expect("two slices");
        let first = slices.pop().expect("two slices");
        Ok([first, second])
    }
}

impl PageStorage for HostPages {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        let words = (size as usize).div_ceil(16);
        let mut page = Vec::new();
        page.try_reserve_exact(words).map_err(|e| ServerError::OutOfMemory {
            device: crate::id::DeviceId::new(crate::id::DeviceId::CPU, 0),
            requested: size,
            reason: e.to_string(),
        })?;
        page.resize(words, 0u128);
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, Page::Own(page.into_boxed_slice()));
        Ok(id)
    }

    /// An adopted page is only forgotten: its memory is the caller's.
    fn free_page(&mut self, page: PageId) {
        self.pages.remove(&page);
    }

    /// Takes `len` bytes of host memory at `ptr` as a page, viewed in place.
    /// Refused: another backend's memory, a null pointer, zero bytes, a
    /// range that wraps the address space, and a pointer not aligned to
    /// [`PAGE_ALIGN`] (16) bytes.
    fn adopt_page(&mut self, memory: &crate::ForeignMemory) -> Result<PageId, ServerError> {
        #[allow(unreachable_patterns)]
        let (ptr, len) = match *memory {
            crate::ForeignMemory::Host { ptr, len } => (ptr, len),
            _ => return Err(memory.wrong_backend("CPU")),
        };
        check_host_range(ptr, len)?;
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, Page::Adopted { ptr, len });
        Ok(id)
    }

    fn alignment(&self) -> u64 {
        256
    }
}

/// Whether `len` bytes at `ptr` can be adopted as a page (see
/// [`HostPages::adopt_page`]).
fn check_host_range(ptr: *mut u8, len: usize) -> Result<(), ServerError> {
    if ptr.is_null() {
        return Err(ServerError::InvalidArgument(
            "foreign host memory at a null pointer: pass the address of the memory to share".into(),
        ));
    }
    if len == 0 {
        return Err(ServerError::InvalidArgument(
            "foreign host memory of 0 bytes: there is nothing to share; make an empty cohort buffer instead".into(),
        ));
    }
    if (ptr as usize).checked_add(len).is_none() {
        return Err(ServerError::InvalidArgument(format!(
            "foreign host memory of {len} bytes at {ptr:p} runs past the end of the address space"
        )));
    }
    let misaligned = ptr as usize % PAGE_ALIGN;
    if misaligned != 0 {
        return Err(ServerError::InvalidArgument(format!(
            "foreign host memory at {ptr:p} is {misaligned} bytes past a {PAGE_ALIGN}-byte boundary: the CPU backend \
             views memory as elements of any type in place (kernels, host-staged collectives), so it must be \
             {PAGE_ALIGN}-byte aligned; allocate it aligned (std::alloc with Layout::from_size_align(len, 16), or \
             a Vec of a 16-byte type), or share from an aligned start"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adopted_pages_are_viewed_in_place_and_only_forgotten() {
        let mut words = vec![0u128; 4];
        let ptr = words.as_mut_ptr().cast::<u8>();
        let mut pages = HostPages::default();
        let page = pages.adopt_page(&crate::ForeignMemory::Host { ptr, len: 64 }).unwrap();
        let binding = Binding { page, offset: 16, size: 16 };
        pages.bytes_mut(binding).unwrap().fill(7);
        assert_eq!(words[1], u128::from_ne_bytes([7; 16]));
        let past = pages.bytes_mut(Binding { page, offset: 16, size: 49 }).unwrap_err();
        assert!(past.to_string().contains("run past a page of 64 bytes"), "{past}");
        pages.free_page(page);
        assert!(pages.bytes_mut(binding).is_err(), "forgotten");
        // The memory is still the Vec's (freed once, by the Vec).
        words[0] = 1;
        assert_eq!(words[0], 1);
    }

    #[test]
    fn unusable_host_memory_is_refused_naming_why() {
        let mut pages = HostPages::default();
        let mut words = vec![0u128; 2];
        let base = words.as_mut_ptr().cast::<u8>();
        let cases: [(*mut u8, usize, &str); 4] = [
            (std::ptr::null_mut(), 16, "null pointer"),
            (base, 0, "0 bytes"),
            // SAFETY: one byte into the Vec's allocation, never read.
            (unsafe { base.add(4) }, 16, "4 bytes past a 16-byte boundary"),
            (usize::MAX as *mut u8, 16, "past the end of the address space"),
        ];
        for (ptr, len, says) in cases {
            let err = pages.adopt_page(&crate::ForeignMemory::Host { ptr, len }).unwrap_err();
            assert!(err.to_string().contains(says), "{err}");
        }
    }
}
