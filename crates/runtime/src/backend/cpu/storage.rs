//! Host pages standing in for device memory.

use crate::id::IdMap;

use crate::backend::Binding;
use crate::error::ServerError;
use crate::memory::{PageId, PageStorage};

/// Pages of host memory, 16-byte aligned (any element type can be viewed in
/// place), keyed by page id.
#[derive(Default)]
pub(crate) struct HostPages {
    pages: IdMap<PageId, Box<[u128]>>,
    next: u64,
}

impl HostPages {
    fn page_range(&mut self, binding: Binding) -> Result<(*mut u8, usize), ServerError> {
        let page = self.pages.get_mut(&binding.page).ok_or_else(|| ServerError::InvalidState {
            operation: "device memory access",
            reason: format!("page {:?} was already given back", binding.page),
        })?;
        let page_len = page.len() * 16;
        binding.offset.checked_add(binding.size).filter(|&e| e <= page_len as u64).ok_or_else(|| {
            ServerError::InvalidArgument(format!(
                "{} bytes at offset {} run past a page of {page_len} bytes",
                binding.size, binding.offset
            ))
        })?;
        // SAFETY: offset + size <= page length was checked above, so the
        // pointer stays inside the page's allocation.
        let start = unsafe { page.as_mut_ptr().cast::<u8>().add(binding.offset as usize) };
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
        self.pages.insert(id, page.into_boxed_slice());
        Ok(id)
    }

    fn free_page(&mut self, page: PageId) {
        self.pages.remove(&page);
    }

    fn alignment(&self) -> u64 {
        256
    }
}
