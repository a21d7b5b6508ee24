//! One CUDA stream per logical stream, created on first use.
//!
//! Streams are created non-blocking, so no work of ours ever waits on the
//! legacy default stream (which would also break graph captures).

use crate::id::IdMap;

use cudarc::driver::sys;

use super::driver::driver_error;
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};

/// How many kernel names a stream remembers since its last sync, to name
/// suspects when a fault surfaces.
const REMEMBERED_KERNELS: usize = 4;

/// The CUDA side of one logical stream.
pub(crate) struct StreamEntry {
    pub raw: sys::CUstream,
    /// Inside a native graph capture.
    pub capturing: bool,
    /// Kernels launched since the last sync (the last few).
    pub since_sync: Vec<String>,
}

/// The CUDA streams of one device.
pub(crate) struct Streams {
    device: DeviceId,
    map: IdMap<StreamId, StreamEntry>,
}

impl Streams {
    pub fn new(device: DeviceId) -> Self {
        Self { device, map: IdMap::default() }
    }

    /// The stream's entry, creating its CUDA stream on first use.
    pub fn entry(&mut self, stream: StreamId) -> Result<&mut StreamEntry, ServerError> {
        if !self.map.contains_key(&stream) {
            let mut raw: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: the device's context is current on this thread (set when
            // the backend was built); the call writes one handle.
            let code = unsafe { sys::cuStreamCreate(&mut raw, flags) };
            if code != sys::CUresult::CUDA_SUCCESS {
                return Err(driver_error(self.device, "cuStreamCreate", code));
            }
            self.map.insert(stream, StreamEntry { raw, capturing: false, since_sync: Vec::new() });
        }
        Ok(self.map.get_mut(&stream).expect("inserted above"))
    }

    /// The raw CUDA stream of a logical stream.
    pub fn raw(&mut self, stream: StreamId) -> Result<sys::CUstream, ServerError> {
        Ok(self.entry(stream)?.raw)
    }

    /// Whether any stream is inside a capture (frees are deferred then).
    pub fn any_capturing(&self) -> bool {
        self.map.values().any(|s| s.capturing)
    }

    /// Whether this stream is inside a capture.
    pub fn is_capturing(&self, stream: StreamId) -> bool {
        self.map.get(&stream).is_some_and(|s| s.capturing)
    }

    /// Notes a kernel launched on the stream.
    pub fn note_launch(&mut self, stream: StreamId, kernel: &str) {
        if let Some(entry) = self.map.get_mut(&stream) {
            if entry.since_sync.len() == REMEMBERED_KERNELS {
                entry.since_sync.remove(0);
            }
            if entry.since_sync.last().map(String::as_str) != Some(kernel) {
                entry.since_sync.push(kernel.to_string());
            }
        }
    }

    /// The kernels launched since the stream's last sync, and forgets them.
    pub fn take_suspects(&mut self, stream: StreamId) -> Vec<String> {
        self.map.get_mut(&stream).map(|e| std::mem::take(&mut e.since_sync)).unwrap_or_default()
    }

    /// The kernels launched since the last sync on every stream, forgotten.
    pub fn take_all_suspects(&mut self) -> Vec<String> {
        self.map.values_mut().flat_map(|e| std::mem::take(&mut e.since_sync)).collect()
    }

    /// Destroys a stream (work already queued on it still runs).
    pub fn release(&mut self, stream: StreamId) {
        if let Some(entry) = self.map.remove(&stream) {
            // SAFETY: the handle came from cuStreamCreate and is dropped from
            // the map, so it is destroyed once.
            unsafe {
                let _ = sys::cuStreamDestroy_v2(entry.raw);
            }
        }
    }

    /// Destroys every stream.
    pub fn release_all(&mut self) {
        let ids: Vec<StreamId> = self.map.keys().copied().collect();
        for id in ids {
            self.release(id);
        }
    }
}
