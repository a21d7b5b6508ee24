//! What a device is and what it can do.

use crate::id::DeviceId;

/// Name and capabilities of one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProperties {
    pub device: DeviceId,
    /// The backend's name: "cpu", "cuda" or "wgpu".
    pub backend: &'static str,
    /// The device's name as its driver reports it.
    pub name: String,
    /// Total device memory in bytes, where known.
    pub memory_bytes: Option<u64>,
    /// Streaming multiprocessors, compute units or host threads.
    pub compute_units: u32,
    /// CUDA compute capability (major, minor), on CUDA devices.
    pub compute_capability: Option<(u32, u32)>,
    /// Largest buffer a single kernel binding may span.
    pub max_binding_size: u64,
    /// Whether `profile` measures on the device (events, timestamp queries)
    /// rather than on the host.
    pub device_timing: bool,
    /// Whether graphs are captured natively (CUDA graphs) rather than recorded
    /// as launch lists.
    pub native_graphs: bool,
}
