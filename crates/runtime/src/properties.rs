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
    /// On CUDA, the GPU (the driver's ordinal) the device runs on: its own
    /// index, unless `COHORT_CUDA_DEVICES` shows several devices per GPU.
    pub gpu: Option<u32>,
    /// How many devices of this backend run on that GPU, this one among
    /// them: 1, unless `COHORT_CUDA_DEVICES` shows several on it (1 off CUDA).
    pub devices_on_gpu: u32,
    /// Largest buffer a single kernel binding may span.
    pub max_binding_size: u64,
    /// Whether `profile` measures on the device (events, timestamp queries)
    /// rather than on the host.
    pub device_timing: bool,
    /// Whether graphs are captured natively (CUDA graphs) rather than recorded
    /// as launch lists.
    pub native_graphs: bool,
    /// What the device offers collectives.
    pub capabilities: Capabilities,
}

/// What a device offers the communication layer, decided by its backend:
/// the layer picks its paths from these, never from the backend's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Its buffers can be read and written through host pointers (a buffer
    /// task's `host_ptr` answers), so collectives can reduce in place.
    pub host_addressable_memory: bool,
    /// Its backend runs collectives device to device
    /// ([`DeviceCollectives`](crate::backend::DeviceCollectives)), given
    /// the collective library; without it, collectives stage through host
    /// memory.
    pub device_collectives: bool,
    /// Its backend can copy straight between two of its devices where the
    /// pair allows it ([`Client::can_access_peer`](crate::Client::can_access_peer)
    /// says for one pair).
    pub peer_access: bool,
}
