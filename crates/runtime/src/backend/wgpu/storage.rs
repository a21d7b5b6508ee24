//! Pages of device memory: one wgpu buffer each.
//!
//! Every page is usable as a storage binding, a copy source and destination,
//! and an indirect-dispatch argument. Its size is rounded up to the slice
//! alignment, so 4-byte-granular copies and bindings of a slice's last bytes
//! never run past the buffer. A page may be larger than one binding may span
//! (launches bind only their slices); a page larger than the device's
//! `max_buffer_size` is refused.
//!
//! A buffer the caller made on this device can be adopted as a page
//! (`Client::adopt`): it must have the usages a collective needs
//! ([`ADOPTED_USAGE`]); its handle's slice starts at the caller's offset.

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

/// The usages an adopted buffer must have: bound by kernels and
/// collectives' reductions, read back, and written.
pub(crate) const ADOPTED_USAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

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

    /// Also forgets an adopted buffer: only this clone of its handle goes.
    fn free_page(&mut self, page: PageId) {
        // Dropping the handle is enough: wgpu keeps the buffer alive until
        // the submissions that use it have finished.
        self.pages.remove(&page);
    }

    /// Takes `len` bytes at `offset` into a buffer of this device as a page
    /// (the whole buffer; the handle's slice starts at `offset`). Refused:
    /// another backend's memory, usages short of [`ADOPTED_USAGE`] (named),
    /// an offset that is not a multiple of the device's
    /// `min_storage_buffer_offset_alignment`, a length that is not a
    /// multiple of 4, a range past the buffer, and a buffer of another
    /// device (found by encoding an empty clear of it on this device inside
    /// an error scope; never submitted). A buffer destroyed later fails the
    /// submissions that use it (an error on their outputs).
    fn adopt_page(&mut self, memory: &crate::ForeignMemory) -> Result<PageId, ServerError> {
        #[allow(unreachable_patterns)]
        let (buffer, offset, len) = match memory {
            crate::ForeignMemory::Wgpu { buffer, offset, len } => (buffer, *offset, *len),
            _ => return Err(memory.wrong_backend("wgpu")),
        };
        check_adoptable(buffer, offset, len, self.alignment)?;
        let refused = |why: String| {
            ServerError::InvalidArgument(format!(
                "the wgpu buffer cannot be used on {}: {why}; create it on this client's device \
                 (WgpuRuntime::device_and_queue), or adopt the device it was made on (WgpuRuntime::adopt)",
                self.id
            ))
        };
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        // A buffer of another wgpu::Instance names an id this instance does
        // not have, and wgpu panics looking it up (before any state
        // changes; its locks do not poison): caught, it is a refusal.
        let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let descriptor = wgpu::CommandEncoderDescriptor { label: Some("cohort adopt check") };
            let mut encoder = self.device.create_command_encoder(&descriptor);
            encoder.clear_buffer(buffer, 0, Some(0));
            drop(encoder.finish());
        }));
        let scoped = pollster::block_on(validation.pop());
        if encoded.is_err() {
            return Err(refused("it was made on a device of another wgpu::Instance".into()));
        }
        if let Some(error) = scoped {
            return Err(refused(format!("it was made on another wgpu::Device ({error})")));
        }
        self.next += 1;
        let id = PageId(self.next);
        self.pages.insert(id, buffer.clone());
        Ok(id)
    }

    fn alignment(&self) -> u64 {
        self.alignment
    }
}

/// The checks of [`WgpuPages::adopt_page`] that need no device: usages,
/// alignment of `offset` (to `alignment`) and `len` (to 4), and the range.
fn check_adoptable(buffer: &wgpu::Buffer, offset: u64, len: u64, alignment: u64) -> Result<(), ServerError> {
    let missing = ADOPTED_USAGE.difference(buffer.usage());
    if !missing.is_empty() {
        return Err(ServerError::InvalidArgument(format!(
            "the wgpu buffer lacks the usages {missing:?} (it has {:?}): create it with at least \
             STORAGE | COPY_SRC | COPY_DST, which collectives and kernels need",
            buffer.usage()
        )));
    }
    if !offset.is_multiple_of(alignment) {
        return Err(ServerError::InvalidArgument(format!(
            "offset {offset} into the wgpu buffer is not a multiple of {alignment}, the device's \
             min_storage_buffer_offset_alignment: start the shared range at a multiple of it"
        )));
    }
    if len == 0 || !len.is_multiple_of(4) {
        return Err(ServerError::InvalidArgument(format!(
            "{len} bytes of a wgpu buffer: share a non-zero multiple of 4 bytes (wgpu copies and binds whole words)"
        )));
    }
    if offset.checked_add(len).is_none_or(|end| end > buffer.size()) {
        return Err(ServerError::InvalidArgument(format!(
            "{len} bytes at offset {offset} run past the wgpu buffer of {} bytes",
            buffer.size()
        )));
    }
    Ok(())
}
