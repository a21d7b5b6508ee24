//! The CPU backend: N host "devices" in one process, each with its own server
//! thread and memory pools, so every multi-device path runs without a GPU.
//!
//! Device memory is host memory; kernels are Rust functions run on the
//! device's thread; work runs when its task runs, so streams are ordered by
//! construction and fences are complete when raised.

mod storage;

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::backend::{Backend, Binding, CompletedFence, FenceWait, ResolvedGrid};
use crate::bytes::AlignedBytes;
use crate::client::Client;
use crate::device::{panic_message, BackendFactory};
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};
use crate::kernel::{CpuKernelContext, Kernel, Scalar};
use crate::memory::PageStorage;
use crate::properties::{Capabilities, DeviceProperties};
use crate::runtime::Runtime;

use storage::HostPages;

/// Default number of CPU devices when `COHORT_CPU_DEVICES` is unset
/// (declared in [`crate::config::CPU_DEVICES`]).
pub const DEFAULT_CPU_DEVICES: usize = crate::config::CPU_DEVICES.fallback;

/// The CPU runtime: `COHORT_CPU_DEVICES` host devices (default 4).
#[derive(Debug, Clone, Copy)]
pub struct CpuRuntime;

impl Runtime for CpuRuntime {
    const NAME: &'static str = "cpu";

    fn device_count() -> Result<usize, ServerError> {
        Ok(crate::config::CPU_DEVICES.get()?)
    }

    fn client(index: usize) -> Result<Client, ServerError> {
        let count = Self::device_count()?;
        if index >= count {
            return Err(ServerError::InvalidArgument(format!(
                "CPU device {index} does not exist: there are {count} (set COHORT_CPU_DEVICES for more)"
            )));
        }
        let device = DeviceId::new(DeviceId::CPU, index as u32);
        Client::load(device, || -> BackendFactory {
            Box::new(move || Ok(Box::new(CpuBackend::new(device)) as Box<dyn Backend>))
        })
    }
}

/// One host device's state.
pub struct CpuBackend {
    properties: DeviceProperties,
    pages: HostPages,
}

impl CpuBackend {
    pub fn new(device: DeviceId) -> Self {
        let threads = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        Self {
            properties: DeviceProperties {
                device,
                backend: "cpu",
                name: format!("host CPU device {}", device.index),
                memory_bytes: None,
                compute_units: threads,
                compute_capability: None,
                gpu: None,
                devices_on_gpu: 1,
                max_binding_size: 1 << 40,
                device_timing: false,
                native_graphs: false,
                capabilities: Capabilities {
                    host_addressable_memory: true,
                    device_collectives: false,
                    peer_access: false,
                },
            },
            pages: HostPages::default(),
        }
    }
}

impl Backend for CpuBackend {
    fn properties(&self) -> &DeviceProperties {
        &self.properties
    }

    /// Its memory is the host's and its kernels plain functions: any
    /// thread may run its tasks.
    fn runs_on_callers(&self) -> bool {
        true
    }

    fn storage(&mut self) -> &mut dyn PageStorage {
        &mut self.pages
    }

    fn write(&mut self, _stream: StreamId, dst: Binding, data: &[u8]) -> Result<(), ServerError> {
        self.pages.bytes_mut(dst)?.copy_from_slice(data);
        Ok(())
    }

    fn read(&mut self, _stream: StreamId, sources: &[Binding]) -> Result<Vec<AlignedBytes>, ServerError> {
        sources.iter().map(|b| Ok(AlignedBytes::from_slice(self.pages.bytes_mut(*b)?))).collect()
    }

    fn copy(&mut self, _stream: StreamId, src: Binding, dst: Binding) -> Result<(), ServerError> {
        if src.size != dst.size {
            return Err(ServerError::InvalidArgument(format!("copy of {} bytes into {} bytes", src.size, dst.size)));
        }
        let [s, d] = self.pages.disjoint_mut([src, dst])?;
        d.copy_from_slice(s);
        Ok(())
    }

    fn launch(
        &mut self,
        _stream: StreamId,
        kernel: &Kernel,
        grid: ResolvedGrid,
        buffers: &[Binding],
        scalars: &[Scalar],
    ) -> Result<(), ServerError> {
        let Some(function) = kernel.cpu_source().cloned() else {
            return Err(ServerError::MissingKernelSource { kernel: kernel.name().to_string(), backend: "cpu" });
        };
        let grid = match grid {
            ResolvedGrid::Static(g) => g,
            ResolvedGrid::Dynamic(binding) => {
                let bytes = self.pages.bytes_mut(Binding { size: 12, ..binding })?;
                let words: Vec<u32> =
                    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                [words[0], words[1], words[2]]
            }
        };
        if grid.contains(&0) {
            return Ok(());
        }
        let device = self.properties.device;
        let failed = |reason: String| ServerError::KernelFailed { kernel: kernel.name().to_string(), device, reason };
        let slices = self.pages.disjoint_many_mut(buffers).map_err(|e| failed(e.to_string()))?;
        let mut context = CpuKernelContext { grid, block: kernel.block(), buffers: slices, scalars };
        catch_unwind(AssertUnwindSafe(|| function(&mut context)))
            .map_err(|payload| failed(format!("panicked: {}", panic_message(payload.as_ref()))))
    }

    fn flush(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn sync(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn order_streams(&mut self, _waiter: StreamId, _target: StreamId) -> Result<(), ServerError> {
        // Work runs when its task runs, in queue order: the target's queued
        // work is already done.
        Ok(())
    }

    fn fence(&mut self, _stream: StreamId) -> Result<Box<dyn FenceWait>, ServerError> {
        Ok(Box::new(CompletedFence))
    }

    fn host_bytes(&mut self, binding: Binding) -> Option<&mut [u8]> {
        self.pages.bytes_mut(binding).ok()
    }

    fn address(&mut self, binding: Binding) -> Option<u64> {
        self.pages.bytes_mut(binding).ok().map(|b| b.as_mut_ptr() as u64)
    }
}
