//! cohort-runtime: per-device runtimes.
//!
//! A [`Client`] reaches one device's server thread. Through it a program
//! creates buffers (from per-stream [`memory`] pools), launches [`Kernel`]s,
//! reads results, captures [`Graph`]s and profiles work. Backends live under
//! [`backend`]; the `cpu` backend is always built and is the default.

mod access;
pub mod backend;
mod bytes;
mod client;
pub mod config;
pub mod copy_regions;
mod device;
pub mod dlpack;
mod dtype;
mod error;
mod foreign;
mod graph;
mod handle;
mod id;
mod kernel;
pub mod memory;
pub mod private_fs;
mod profile;
mod properties;
mod runtime;
pub mod stages;
mod state;

pub use access::{BufferAccess, HostPtr, TaskHandles};
pub use backend::cpu::CpuRuntime;
#[cfg(feature = "cuda")]
pub use backend::cuda::CudaRuntime;
#[cfg(feature = "wgpu")]
pub use backend::wgpu::WgpuRuntime;
pub use bytes::{AlignedBytes, Bytes};
pub use client::{Client, Fence, MemoryReport, MemoryScope, PendingSync, Timestamp};
pub use config::ConfigError;
pub use copy_regions::CopyRegion;
pub use device::{close_device, shutdown, spin_window, BackendFactory};
pub use dtype::{DType, ReduceOp};
pub use error::{MemoryConfigError, ProfileError, ServerError};
#[cfg(feature = "cuda")]
pub use foreign::CudaStreamRef;
pub use foreign::{Access, AdoptError, ExternalStream, ForeignMemory, ForeignOwner};
pub use graph::Graph;
pub use handle::{contiguous_strides, CopyDescriptor, Handle, LayoutPolicy, MemoryLayout, MemoryLayoutDescriptor};
pub use id::{DeviceId, ServiceId, StreamId, StreamPriority};
pub use kernel::{
    CpuKernelContext, CpuKernelFn, GridCount, Kernel, KernelArguments, LaunchBuffers, LaunchScalars, Scalar,
};
pub use profile::{ProfileDuration, ProfileWindow, TimingMethod};
pub use properties::{Capabilities, DeviceProperties};
pub use runtime::{clients_from, clients_of, Runtime};
pub use state::{DeviceStats, StreamMemory};

/// The names most programs need.
pub mod prelude {
    pub use crate::memory::{AllocationMode, MemoryPoolsConfig, MemoryUsage, PoolConfig};
    pub use crate::{
        Bytes, Client, CpuRuntime, DeviceId, GridCount, Handle, Kernel, KernelArguments, MemoryScope, Runtime, Scalar,
        ServerError, StreamId,
    };
}

#[doc(hidden)]
pub mod conformance;
