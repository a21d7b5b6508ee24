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
///
/// A stream's scheduling [`StreamPriority`] is part of its id (its top bit):
/// [`StreamId::fresh_with_priority`] makes a high-priority one, and every
/// client pinned to it (`client.with_stream(id)`) queues work there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub value: u64,
}

/// How the device schedules a stream's work against other streams' work.
///
/// * CUDA: the stream is created with `cuStreamCreateWithPriority`; `High`
///   is the greatest priority of the device's range
///   (`cuCtxGetStreamPriorityRange`), `Normal` the default. When both have
///   kernels waiting, the block scheduler starts the high-priority stream's
///   blocks first (running blocks are not preempted), e.g. a collective's
///   kernels beside compute that fills the device.
/// * CPU and wgpu: accepted and without effect: each device has one server
///   thread that runs every stream's tasks in the order they were queued.
///
/// Ordering, fences, events, errors and memory pools are the same at every
/// priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StreamPriority {
    /// The device's default priority (every stream from
    /// [`StreamId::current`] and [`StreamId::fresh`]).
    #[default]
    Normal,
    /// The device's greatest priority.
    High,
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

    /// A fresh stream (as [`StreamId::fresh`]) scheduled at `priority`, for
    /// pinning a client to it: `client.with_stream(StreamId::fresh_with_priority(StreamPriority::High))`.
    pub fn fresh_with_priority(priority: StreamPriority) -> StreamId {
        let fresh = Self::fresh();
        match priority {
            StreamPriority::Normal => fresh,
            StreamPriority::High => StreamId { value: fresh.value | HIGH_PRIORITY_BIT },
        }
    }

    /// The priority this stream is scheduled at.
    pub fn priority(&self) -> StreamPriority {
        if self.value & HIGH_PRIORITY_BIT != 0 {
            StreamPriority::High
        } else {
            StreamPriority::Normal
        }
    }
}

/// The bit of [`StreamId::value`] that marks a high-priority stream (ids are
/// counted up from 0 and never reach it).
const HIGH_PRIORITY_BIT: u64 = 1 << 63;

/// A hasher for maps keyed by small integer ids (streams, pages, kernels):
/// one multiply instead of SipHash, on the device thread's hot path. Ids are
/// made by this process, not by an adversary, so hash flooding is no concern.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_u16(&mut self, value: u16) {
        self.write_u64(u64::from(value));
    }
}

/// A `HashMap` keyed by an id, hashed with [`IdHasher`].
pub type IdMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_maps_keep_distinct_ids_apart() {
        let mut map: IdMap<StreamId, u64> = IdMap::default();
        for value in 0..10_000u64 {
            map.insert(StreamId { value }, value * 2);
        }
        assert_eq!(map.len(), 10_000);
        assert!((0..10_000u64).all(|v| map[&StreamId { value: v }] == v * 2));
    }

    #[test]
    fn priority_is_carried_by_the_id() {
        let normal = StreamId::fresh_with_priority(StreamPriority::Normal);
        let high = StreamId::fresh_with_priority(StreamPriority::High);
        assert_eq!(normal.priority(), StreamPriority::Normal);
        assert_eq!(high.priority(), StreamPriority::High);
        assert_eq!(StreamId::fresh().priority(), StreamPriority::Normal);
        assert_eq!(StreamId::current().priority(), StreamPriority::Normal);
        assert_ne!(high, StreamId::fresh_with_priority(StreamPriority::High), "each call is a new stream");
        // Kept through the u64 a handle stores as its last writer.
        assert_eq!(StreamId { value: high.value }.priority(), StreamPriority::High);
    }
}
