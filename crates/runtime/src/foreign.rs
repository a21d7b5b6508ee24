//! Foreign memory: memory cohort did not allocate (another library's CUDA
//! allocation, a host slice, a `wgpu::Buffer` made on an adopted device),
//! named by an ordinary [`Handle`] so every call and collective takes it
//! unchanged, with no copy.
//!
//! [`Client::adopt`](crate::Client::adopt) registers the memory as a page of
//! the device's storage that the memory pools never see and the backend
//! never frees. The handle keeps an *owner* (any value: the allocation
//! itself, a DLPack deleter, a guard) that cohort drops only after the
//! work queued on the memory has finished. Memory of another device or
//! context, a size or alignment that does not fit, or a wgpu buffer
//! without the usages a collective needs is refused before anything is
//! queued.

use std::any::Any;

/// Where foreign memory is: what [`Client::adopt`](crate::Client::adopt)
/// registers.
#[derive(Debug)]
pub enum ForeignMemory {
    /// `len` bytes of host memory at `ptr` (the CPU backend).
    Host { ptr: *mut u8, len: usize },
    /// `len` bytes of CUDA device memory at `ptr`, allocated in the
    /// device's primary context (cudarc's default; PyTorch's, CuPy's).
    #[cfg(feature = "cuda")]
    Cuda { ptr: u64, len: usize },
    /// `len` bytes at `offset` into a buffer created on the client's
    /// `wgpu::Device` (one the runtime adopted with `WgpuRuntime::adopt`).
    #[cfg(feature = "wgpu")]
    Wgpu { buffer: wgpu::Buffer, offset: u64, len: u64 },
}

// SAFETY: a `ForeignMemory` is an address (or a reference-counted wgpu
// buffer) and a length; moving it to the device thread accesses nothing.
// Whoever built it promised, through the unsafe `Client::adopt`, that the
// memory stays valid while its owner lives.
unsafe impl Send for ForeignMemory {}

/// What keeps foreign memory alive: dropped by cohort once no queued work
/// needs the memory (never before the last handle naming it is gone).
pub type ForeignOwner = Box<dyn Any + Send>;

/// Whether collectives and kernels may write foreign memory: a DLPack
/// tensor marked read-only is adopted as [`Access::ReadOnly`], and a call
/// that would write it is refused before anything is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    #[default]
    ReadWrite,
    ReadOnly,
}

/// A stream (or queue) that another library owns and queues its own work
/// on, to order cohort's work with: see
/// [`Client::wait_external`](crate::Client::wait_external) and
/// [`Client::signal_external`](crate::Client::signal_external).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalStream {
    /// A `CUstream` of the device's primary context (cudarc's
    /// `CudaStream::cu_stream()`, torch's `torch.cuda.current_stream().cuda_stream`).
    /// Null is the legacy default stream.
    #[cfg(feature = "cuda")]
    Cuda(usize),
    /// The queue of an adopted wgpu device: submissions run in order, so
    /// cohort's work only has to be submitted before the caller's next
    /// submission.
    #[cfg(feature = "wgpu")]
    WgpuQueue,
}
