//! WGSL kernels compiled once into cached compute pipelines.
//!
//! A pipeline is built for a kernel and a number of bindings, with an explicit
//! layout of that many storage buffers at `@group(0)`: each is read-only where
//! the WGSL declares it `var<storage, read>` and read-write otherwise (wgpu
//! requires the layout to match the declaration), so a kernel may also
//! declare fewer buffers than it is given. The entry point is `main`. The
//! source is parsed once with naga first, which gives the layout and, for
//! source that does not parse, the compiler's full diagnostic.
//!
//! The cache is keyed by kernel id (clones of a kernel share it until one is
//! given another source) and, behind that, by source text, so kernels
//! rebuilt with the same source (as
//! `Kernel::new` does for each call of a kernel constructor) compile once.
//! A compile failure is cached too: the compiler's message comes back for
//! every launch of that kernel without compiling again.

use std::collections::HashMap;
use std::sync::Arc;

use wgpu::naga;

use crate::error::ServerError;
use crate::kernel::Kernel;

use super::adapter::Gpu;

/// Entries kept per map before it is cleared (a program that builds kernels
/// from generated sources should not grow the cache without bound).
const MAX_ENTRIES: usize = 4096;

/// A compiled pipeline with the layout its bind groups use.
pub(crate) struct Compiled {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: Arc<Layout>,
}

/// A compiled pipeline, or the compiler's message.
type Entry = Result<Arc<Compiled>, Arc<str>>;

/// A bind group layout of storage buffers and its pipeline layout.
pub(crate) struct Layout {
    pub bind_group: wgpu::BindGroupLayout,
    pipeline: wgpu::PipelineLayout,
    /// Per binding: whether the shader declares it `var<storage, read>`.
    pub read_only: Vec<bool>,
}

/// Compiled pipelines and layouts of one device.
#[derive(Default)]
pub(crate) struct PipelineCache {
    by_id: HashMap<(u64, usize), Entry>,
    by_source: HashMap<(Arc<str>, usize), Entry>,
    /// Keyed by each binding's read-only flag.
    layouts: HashMap<Vec<bool>, Arc<Layout>>,
}

impl PipelineCache {
    /// The layout of storage buffers, read-only where `read_only` says.
    fn layout(&mut self, gpu: &Gpu, read_only: &[bool]) -> Result<Arc<Layout>, String> {
        if let Some(layout) = self.layouts.get(read_only) {
            return Ok(layout.clone());
        }
        let bindings = read_only.len();
        let max = gpu.limits.max_storage_buffers_per_shader_stage as usize;
        if bindings > max {
            return Err(format!(
                "{bindings} storage bindings (buffers, plus one for scalars) exceed the {max} this device allows per kernel"
            ));
        }
        let entries: Vec<wgpu::BindGroupLayoutEntry> = read_only
            .iter()
            .enumerate()
            .map(|(binding, &read_only)| wgpu::BindGroupLayoutEntry {
                binding: binding as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let (layout, error) = gpu.scoped(|| {
            let bind_group = gpu.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("cohort storage buffers"),
                entries: &entries,
            });
            let pipeline = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("cohort storage buffers"),
                bind_group_layouts: &[Some(&bind_group)],
                immediate_size: 0,
            });
            Layout { bind_group, pipeline, read_only: read_only.to_vec() }
        });
        if let Some(error) = error {
            return Err(format!("could not build a layout of {bindings} storage buffers: {error}"));
        }
        let layout = Arc::new(layout);
        self.layouts.insert(read_only.to_vec(), layout.clone());
        Ok(layout)
    }

    /// The pipeline of `kernel` with `bindings` storage buffers, compiling
    /// it on first use. A kernel without WGSL source, or whose source does
    /// not compile, is an error naming the kernel.
    pub fn pipeline(&mut self, gpu: &Gpu, kernel: &Kernel, bindings: usize) -> Result<Arc<Compiled>, ServerError> {
        let Some(source) = kernel.wgsl_source() else {
            return Err(ServerError::MissingKernelSource { kernel: kernel.name().to_string(), backend: "wgpu" });
        };
        let entry = match self.by_id.get(&(kernel.id(), bindings)) {
            Some(entry) => entry.clone(),
            None => {
                let key: (Arc<str>, usize) = (Arc::from(source), bindings);
                let entry = match self.by_source.get(&key) {
                    Some(entry) => entry.clone(),
                    None => {
                        let entry = self.compile(gpu, kernel.name(), source, bindings).map_err(|message| {
                            tracing::debug!(device = %gpu.id, kernel = kernel.name(), "{message}");
                            Arc::<str>::from(message)
                        });
                        if self.by_source.len() >= MAX_ENTRIES {
                            self.by_source.clear();
                        }
                        self.by_source.insert(key, entry.clone());
                        entry
                    }
                };
                if self.by_id.len() >= MAX_ENTRIES {
                    self.by_id.clear();
                }
                self.by_id.insert((kernel.id(), bindings), entry.clone());
                entry
            }
        };
        entry.map_err(|message| ServerError::KernelFailed {
            kernel: kernel.name().to_string(),
            device: gpu.id,
            reason: message.to_string(),
        })
    }

    /// Parses `source` with naga (for the diagnostic and the bindings'
    /// access), then compiles it (entry point `main`) against the matching
    /// layout, catching wgpu's errors in error scopes.
    fn compile(&mut self, gpu: &Gpu, name: &str, source: &str, bindings: usize) -> Result<Arc<Compiled>, String> {
        let module = naga::front::wgsl::parse_str(source)
            .map_err(|e| format!("the WGSL does not compile:\n{}", e.emit_to_string(source)))?;
        let mut read_only = vec![false; bindings];
        for (_, global) in module.global_variables.iter() {
            let (Some(binding), naga::AddressSpace::Storage { access }) = (&global.binding, global.space) else {
                continue;
            };
            if binding.group == 0 && (binding.binding as usize) < bindings {
                read_only[binding.binding as usize] = !access.contains(naga::StorageAccess::STORE);
            }
        }
        let layout = self.layout(gpu, &read_only)?;
        let (pipeline, error) = gpu.scoped(|| {
            let module = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: Some(&layout.pipeline),
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache: None,
            })
        });
        match error {
            None => Ok(Arc::new(Compiled { pipeline, layout })),
            Some(error) => Err(format!(
                "the WGSL did not compile into a pipeline (entry point `main`, {bindings} storage buffers at @group(0)): {error}"
            )),
        }
    }
}
