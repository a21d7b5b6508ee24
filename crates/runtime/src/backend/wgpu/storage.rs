//! Pages of device memory: one wgpu buffer each.
//!
//! Every page is usable as a storage binding, a copy source and destination,
//! and an indirect-dispatch argument. Its size is rounded up to the slice
//! alignment, so 4-byte-granular copies and bindings of a slice's last bytes
//! never run past the buffer. A page may be larger than one binding may span
//! (launches bind only their slices); a page larger than the device's
//! `max_buffer_size` is refused.

use std::collections::HashMap;

use crate::backend::Binding;
use crate::error::ServerError;
use crate::memory::{PageId, PageStorage};

use super::adapter::Gpu;

/// The usages every page is created with.
const PAGE_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::INDIRECT);

/// The pages of one device, keyed by page id.
pub(crate) struct WgpuPages {
    device: wgpu::Device,
    id: crate::id::DeviceId,
    max_buffer_size: u64,
    alignment: u64,
    pages: HashMap<PageId, wgpu::Buffer>,
    next: u64,
}

impl WgpuPages {
    pub fn new(gpu: &Gpu) -> Self {
        Self {
            device: gpu.device.clone(),
            id: gpu.id,
            max_buffer_size: gpu.limits.max_buffer_size,
            // Slices must start where a storage binding may start.
            alignment: u64::from(gpu.limits.min_storage_buffer_offset_alignment).max(4),
            pages: HashMap::new(),
            next: 0,
        }
    }

    /// The buffer of a live page.
    pub fn buffer(&self, page: PageId) -> Result<&wgpu::Buffer, ServerError> {
        self.pages.get(&page).ok_or_else(|| ServerError::InvalidState {
            operation: "device memory access",
            reason: format!("page {page:?} was already given back"),
        })
    }

    /// The buffer of a binding, after checking the binding lies inside it
    /// (rounded out to whole 4-byte words).
    pub fn checked(&self, binding: Binding) -> Result<&wgpu::Buffer, ServerError> {
        let buffer = self.buffer(binding.page)?;
        let end = binding.offset.checked_add(binding.size).map(|e| e.next_multiple_of(4));
        if end.is_none_or(|e| e > buffer.size()) {
            return Err(ServerError::InvalidArgument(format!(
                "{} bytes at offset {} run past a page of {} bytes",
                binding.size,
                binding.offset,
                buffer.size()
            )));
        }
        Ok(buffer)
    }
}

impl PageStorage for WgpuPages {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        let rounded = size.max(1).next_multiple_of(self.alignment);
        if rounded > self.max_buffer_size {
            return Err(ServerError::OutOfMemory {
                device: self.id,
                requested: size,
                reason: format!(
                    "one wgpu buffer may hold at most {} bytes on this device (max_buffer_size); split the data into smaller buffers",
                    self.max_buffer_size
                ),
            });
        }
        let memory = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cohort page"),
            size: rounded,
            usage: PAGE_USAGE,
            mapped_at_creation: false,
        });
        let validation = pollster::block_on(validation.pop());
        let memory = pollster::block_on(memory.pop());
        if let Some(error) = memory.or(validation) {
            return Err(ServerError::OutOfMemory {
                device: self.id,
                requested: size,
                reason: format!("wgpu could not create a buffer of {rounded} bytes: {error}"),
            });
        }
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, buffer);
        Ok(id)
    }

    fn free_page(&mut self, page: PageId) {
        // Dropping the handle is enough: wgpu keeps the buffer alive until
        // the submissions that use it have finished.
        self.pages.remove(&page);
    }

    fn alignment(&self) -> u64 {
        self.alignment
    }
}
