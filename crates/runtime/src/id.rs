//! Identifiers for devices, device services and streams.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A device of one backend: its backend's type id and its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// Which backend (and kind of device) this is, e.g. [`DeviceId::CPU`].
    pub type_id: u16,
    /// The device's index among its backend's devices.
    pub index: u32,
}

impl DeviceId {
    pub const CPU: u16 = 0;
    pub const CUDA: u16 = 1;
    pub const WGPU: u16 = 2;

    pub const fn new(type_id: u16, index: u32) -> Self {
        Self { type_id, index }
    }

    /// The backend's name for this type id.
    pub fn backend_name(&self) -> &'static str {
        match self.type_id {
            Self::CPU => "cpu",
            Self::CUDA => "cuda",
            Self::WGPU => "wgpu",
            _ => "unknown",
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.backend_name(), self.index)
    }
}

/// One running server of a device: a device can be closed and opened again,
/// and handles of the old server are foreign to the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceId {
    pub device: DeviceId,
    /// Which opening of the device this is (0 for the first).
    pub generation: u32,
}

impl fmt::Display for ServiceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.generation == 0 {
            write!(f, "{}", self.device)
        } else {
            write!(f, "{} (opening {})", self.device, self.generation)
        }
    }
}

/// A logical stream. Each OS thread gets its own ([`StreamId::current`]) unless a
/// client is pinned to one with `Client::set_stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub value: u64,
}

static NEXT_STREAM: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_STREAM: StreamId = StreamId { value: NEXT_STREAM.fetch_add(1, Ordering::Relaxed) };
}

impl StreamId {
    /// The stream of the calling OS thread: the same for every call on one
    /// thread, different between threads.
    pub fn current() -> StreamId {
        THREAD_STREAM.with(|s| *s)
    }

    /// A fresh stream that no thread uses by default, for pinning a client to a
    /// dedicated stream (graph capture, communication).
    pub fn fresh() -> StreamId {
        StreamId { value: NEXT_STREAM.fetch_add(1, Ordering::Relaxed) }
    }
}
