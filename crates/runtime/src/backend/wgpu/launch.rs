//! Recording a kernel launch: bindings, scalars, grid, dispatch.
//!
//! Buffer `i` binds at `@group(0) @binding(i)` as a read-write storage buffer
//! covering exactly its slice (rounded up to whole words, as storage bindings
//! must be). Scalars, when the launch has any, are packed as 32-bit words
//! (64-bit values as two words, low word first) into a storage buffer bound
//! right after the buffers. Scalar buffers are immutable and cached by their
//! bytes, so a replayed graph or a loop launching with the same scalars
//! allocates nothing.
//!
//! A static grid whose x exceeds the device's per-dimension limit (65535
//! workgroups usually) is folded into x' × y' ≥ x workgroups; kernels index
//! with `gid.x + gid.y * num_workgroups.x * workgroup_size.x` and guard the
//! end, as the conformance kernels do. A dynamic grid is copied into a small
//! buffer of its own and dispatched indirectly: the grid's page may also be
//! bound as storage in the same dispatch, which wgpu would refuse.
//!
//! Small buffers are slices of shared pages, and wgpu refuses one buffer
//! bound both read-only and writable in a dispatch. A binding the shader
//! declares `var<storage, read>` whose page another, writable binding of the
//! same launch also uses is therefore copied into a scratch buffer first and
//! bound from there (it is only read, so nothing needs copying back).
//!
//! Everything a dispatch could fail validation on is checked before it is
//! recorded, so one bad launch cannot invalidate the batch it shares an
//! encoder with; what wgpu checks at creation (pipeline, bind group) runs
//! inside error scopes and becomes an error on the launch's outputs.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use wgpu::util::DeviceExt;

use crate::backend::{Binding, ResolvedGrid};
use crate::error::ServerError;
use crate::kernel::{Kernel, Scalar};

use super::adapter::Gpu;
use super::pipeline::PipelineCache;
use super::queue::Submitter;
use super::storage::WgpuPages;

/// Scalar buffers kept before the cache is cleared.
const MAX_SCALAR_BUFFERS: usize = 1024;

/// Immutable scalar buffers, keyed by their bytes.
#[derive(Default)]
pub(crate) struct ScalarCache {
    buffers: HashMap<Vec<u8>, Arc<wgpu::Buffer>>,
}

impl ScalarCache {
    fn buffer(&mut self, gpu: &Gpu, scalars: &[Scalar]) -> Arc<wgpu::Buffer> {
        let bytes: Vec<u8> = scalars.iter().flat_map(|s| s.to_le_bytes()).collect();
        if let Some(buffer) = self.buffers.get(&bytes) {
            return buffer.clone();
        }
        let buffer = Arc::new(gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("cohort scalars"),
            contents: &bytes,
            usage: wgpu::BufferUsages::STORAGE,
        }));
        if self.buffers.len() >= MAX_SCALAR_BUFFERS {
            self.buffers.clear();
        }
        self.buffers.insert(bytes, buffer.clone());
        buffer
    }
}

/// How a launch is dispatched.
enum Dispatch {
    Direct([u32; 3]),
    Indirect(wgpu::Buffer),
}

/// What a launch needs from the backend, borrowed together.
pub(crate) struct Launcher<'a> {
    pub gpu: &'a Gpu,
    pub pages: &'a WgpuPages,
    pub pipelines: &'a mut PipelineCache,
    pub scalars: &'a mut ScalarCache,
    pub submitter: &'a mut Submitter,
}

impl Launcher<'_> {
    /// Records one launch into the pending encoder.
    pub fn launch(
        &mut self,
        kernel: &Kernel,
        grid: ResolvedGrid,
        buffers: &[Binding],
        scalars: &[Scalar],
    ) -> Result<(), ServerError> {
        let failed = |reason: String| ServerError::KernelFailed {
            kernel: kernel.name().to_string(),
            device: self.gpu.id,
            reason,
        };
        let bindings = buffers.len() + usize::from(!scalars.is_empty());
        let compiled = self.pipelines.pipeline(self.gpu, kernel, bindings)?;
        let dispatch = match grid {
            ResolvedGrid::Static(grid) => Dispatch::Direct(self.fold(grid).map_err(failed)?),
            ResolvedGrid::Dynamic(binding) => Dispatch::Indirect(self.indirect(binding).map_err(failed)?),
        };
        let align = u64::from(self.gpu.limits.min_storage_buffer_offset_alignment);
        let read_only = &compiled.layout.read_only;
        let shares_writable_page = |i: usize| {
            read_only.get(i).copied().unwrap_or(false)
                && buffers
                    .iter()
                    .enumerate()
                    .any(|(j, b)| j != i && b.page == buffers[i].page && !read_only.get(j).copied().unwrap_or(false))
        };
        // (binding index, scratch buffer) for read-only bindings to copy apart.
        let mut scratch: Vec<(usize, wgpu::Buffer)> = Vec::new();
        for (i, binding) in buffers.iter().enumerate() {
            if shares_writable_page(i) {
                self.pages.checked(*binding).map_err(|e| failed(format!("buffer {i}: {e}")))?;
                let size = binding.size.next_multiple_of(4).max(4);
                scratch.push((
                    i,
                    self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("cohort read-only copy"),
                        size,
                        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                        mapped_at_creation: false,
                    }),
                ));
            }
        }
        let mut resources: Vec<(&wgpu::Buffer, u64, u64)> = Vec::with_capacity(bindings);
        for (i, binding) in buffers.iter().enumerate() {
            if let Some((_, copy)) = scratch.iter().find(|(j, _)| *j == i) {
                resources.push((copy, 0, copy.size()));
                continue;
            }
            let buffer = self.pages.checked(*binding).map_err(|e| failed(format!("buffer {i}: {e}")))?;
            if !binding.offset.is_multiple_of(align) {
                return Err(failed(format!(
                    "buffer {i} starts at byte {} of its device buffer, which is not a multiple of {align} (min_storage_buffer_offset_alignment): bind whole handles, or slices that start at multiples of {align}",
                    binding.offset
                )));
            }
            // Storage bindings span whole words and at least one.
            resources.push((buffer, binding.offset, binding.size.next_multiple_of(4).max(4)));
        }
        let scalar_buffer = (!scalars.is_empty()).then(|| self.scalars.buffer(self.gpu, scalars));
        if let Some(buffer) = &scalar_buffer {
            resources.push((buffer, 0, buffer.size()));
        }
        let entries: Vec<wgpu::BindGroupEntry> = resources
            .iter()
            .enumerate()
            .map(|(i, (buffer, offset, size))| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: *offset,
                    size: NonZeroU64::new(*size),
                }),
            })
            .collect();
        let (bind_group, error) = self.gpu.scoped(|| {
            self.gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(kernel.name()),
                layout: &compiled.layout.bind_group,
                entries: &entries,
            })
        });
        if let Some(error) = error {
            return Err(failed(format!("its buffers could not be bound: {error}")));
        }
        let encoder = self.submitter.encoder(self.gpu);
        for (i, copy) in &scratch {
            let binding = buffers[*i];
            let page = self.pages.buffer(binding.page)?;
            // Copies move whole words; the page holds at least the rounded
            // size (pages are allocated in words).
            let len = binding.size.next_multiple_of(4).min(page.size().saturating_sub(binding.offset)) & !3;
            if len > 0 {
                encoder.copy_buffer_to_buffer(page, binding.offset, copy, 0, len);
            }
        }
        if let Dispatch::Indirect(indirect) = &dispatch {
            let ResolvedGrid::Dynamic(binding) = grid else { unreachable!("indirect dispatch of a static grid") };
            let page = self.pages.buffer(binding.page)?;
            encoder.copy_buffer_to_buffer(page, binding.offset, indirect, 0, 12);
        }
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(kernel.name()),
                timestamp_writes: None,
            });
            pass.set_pipeline(&compiled.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            match &dispatch {
                Dispatch::Direct([x, y, z]) => pass.dispatch_workgroups(*x, *y, *z),
                Dispatch::Indirect(buffer) => pass.dispatch_workgroups_indirect(buffer, 0),
            }
        }
        self.submitter.recorded(self.gpu);
        Ok(())
    }

    /// The grid within the per-dimension limit, folding a long x into y.
    fn fold(&self, [x, y, z]: [u32; 3]) -> Result<[u32; 3], String> {
        let max = self.gpu.limits.max_compute_workgroups_per_dimension.max(1);
        if x <= max && y <= max && z <= max {
            return Ok([x, y, z]);
        }
        if y == 1 && z == 1 {
            let rows = x.div_ceil(max);
            if rows <= max {
                return Ok([x.div_ceil(rows), rows, 1]);
            }
        }
        Err(format!(
            "a grid of {x} × {y} × {z} workgroups exceeds the {max} per dimension this device allows (only a 1-D grid is folded into 2-D)"
        ))
    }

    /// A fresh indirect-argument buffer for a dynamic grid read from `binding`.
    fn indirect(&self, binding: Binding) -> Result<wgpu::Buffer, String> {
        if !binding.offset.is_multiple_of(4) {
            return Err(format!(
                "the dynamic grid starts at byte {} of its device buffer; it must start at a multiple of 4",
                binding.offset
            ));
        }
        self.pages.checked(Binding { size: 12, ..binding }).map_err(|e| e.to_string())?;
        Ok(self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cohort dynamic grid"),
            size: 12,
            usage: wgpu::BufferUsages::INDIRECT | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }
}
