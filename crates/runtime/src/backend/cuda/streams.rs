//! One CUDA stream per logical stream, created on first use.
//!
//! Streams are created non-blocking, so no work of ours ever waits on the
//! legacy default stream (which would also break graph captures). A stream
//! whose id is [`StreamPriority::High`] is created with the device's
//! greatest priority (`cuStreamCreateWithPriority`); every other with the
//! default one.
//!
//! A logical stream may instead be *bound* to a stream another library
//! owns ([`Streams::bind`], for `Client::bind_external`): its work then
//! goes to that `CUstream` itself, which every user of the entry's `raw`
//! handle sees. A bound entry is foreign: it is never destroyed here
//! ([`Streams::release`] and [`Streams::release_all`] destroy only the
//! stream's own `CUstream`, kept aside while bound), and it keeps the
//! [`ExternalStream`] value (a clone, which holds a cudarc stream alive)
//! while bound.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::id::IdMap;

use cudarc::driver::sys;

use super::driver::driver_error;
use super::events::EventPool;
use crate::error::ServerError;
use crate::foreign::ExternalStream;
use crate::id::{DeviceId, StreamId, StreamPriority};

/// How many kernel names a stream remembers since its last sync, to name
/// suspects when a fault surfaces.
const REMEMBERED_KERNELS: usize = 4;

/// The CUDA side of one logical stream.
pub(crate) struct StreamEntry {
    /// The `CUstream` the stream's work goes to: its own, or while bound
    /// the external one.
    pub raw: sys::CUstream,
    /// Inside a native graph capture.
    pub capturing: bool,
    /// Kernels launched since the last sync (the last few): noting a
    /// launch copies no string.
    pub since_sync: SmallVec<[LaunchName; REMEMBERED_KERNELS]>,
    /// Set while the stream is bound to another library's stream.
    bound: Option<Bound>,
}

/// A logical stream's binding to another library's stream.
struct Bound {
    /// Kept so the stream it names stays alive while bound (a cudarc
    /// stream's handle is destroyed with its last clone).
    _external: ExternalStream,
    /// The stream's own `CUstream`, used again once unbound (null where
    /// none was made before the binding).
    own: sys::CUstream,
}

/// The name of a launch a stream remembers (to name the suspects of a
/// fault): a kernel's name, shared with it, or the name of the backend's
/// own work.
#[derive(Debug, Clone)]
pub(crate) enum LaunchName {
    Kernel(Arc<str>),
    Own(&'static str),
}

impl LaunchName {
    fn as_str(&self) -> &str {
        match self {
            LaunchName::Kernel(name) => name,
            LaunchName::Own(name) => name,
        }
    }
}

/// The CUDA streams of one device.
pub(crate) struct Streams {
    device: DeviceId,
    map: IdMap<StreamId, StreamEntry>,
    /// The device's greatest stream priority (numerically the least), asked
    /// once, when the first high-priority stream is made.
    greatest_priority: Option<i32>,
}

impl Streams {
    pub fn new(device: DeviceId) -> Self {
        Self { device, map: IdMap::default(), greatest_priority: None }
    }

    /// The device's greatest stream priority (`cuCtxGetStreamPriorityRange`).
    fn greatest_priority(&mut self) -> Result<i32, ServerError> {
        if let Some(p) = self.greatest_priority {
            return Ok(p);
        }
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: the device's context is current on this thread; the call
        // writes two integers.
        let code = unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(self.device, "cuCtxGetStreamPriorityRange", code));
        }
        tracing::debug!(device = %self.device, least, greatest, "stream priority range");
        self.greatest_priority = Some(greatest);
        Ok(greatest)
    }

    /// Creates a `CUstream` for `stream` (at the priority its id carries).
    fn create(&mut self, stream: StreamId) -> Result<sys::CUstream, ServerError> {
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        let code = match stream.priority() {
            // SAFETY: the device's context is current on this thread (the
            // device thread since the backend was built, or a caller's
            // made ready by `enter_caller`); the call writes one handle.
            StreamPriority::Normal => unsafe { sys::cuStreamCreate(&mut raw, flags) },
            StreamPriority::High => {
                let priority = self.greatest_priority()?;
                tracing::debug!(device = %self.device, stream = stream.value, priority, "high-priority stream");
                // SAFETY: as above; the priority is within the device's
                // range (its greatest).
                unsafe { sys::cuStreamCreateWithPriority(&mut raw, flags, priority) }
            }
        };
        if code != sys::CUresult::CUDA_SUCCESS {
            let call = match stream.priority() {
                StreamPriority::Normal => "cuStreamCreate",
                StreamPriority::High => "cuStreamCreateWithPriority",
            };
            return Err(driver_error(self.device, call, code));
        }
        Ok(raw)
    }

    /// The stream's entry, creating its CUDA stream on first use.
    pub fn entry(&mut self, stream: StreamId) -> Result<&mut StreamEntry, ServerError> {
        if !self.map.contains_key(&stream) {
            let raw = self.create(stream)?;
            self.map.insert(stream, StreamEntry { raw, capturing: false, since_sync: SmallVec::new(), bound: None });
        }
        Ok(self.map.get_mut(&stream).expect("inserted above"))
    }

    /// The external `CUstream` `stream` is bound to, if it is.
    pub fn bound_to(&self, stream: StreamId) -> Option<sys::CUstream> {
        self.map.get(&stream).filter(|e| e.bound.is_some()).map(|e| e.raw)
    }

    /// Binds `stream` to `raw`, the `CUstream` of `external` (checked by
    /// the caller to be a live stream of this context, not capturing):
    /// its later work goes there. First `raw` waits on the device (a
    /// pooled event) for what was queued on the stream's `CUstream` so far
    /// (its own, or the external one it was bound to), so order is kept.
    /// Binding to the stream it is bound to does nothing. `stream` must
    /// not be capturing (checked by the caller).
    pub fn bind(
        &mut self,
        stream: StreamId,
        external: &ExternalStream,
        raw: sys::CUstream,
        events: &EventPool,
    ) -> Result<(), ServerError> {
        let Some(entry) = self.map.get_mut(&stream) else {
            // Nothing queued on the stream yet: nothing to wait for.
            let bound = Some(Bound { _external: external.clone(), own: std::ptr::null_mut() });
            self.map.insert(stream, StreamEntry { raw, capturing: false, since_sync: SmallVec::new(), bound });
            return Ok(());
        };
        if entry.raw == raw && entry.bound.is_some() {
            return Ok(());
        }
        events.order(raw, entry.raw)?;
        let own = match entry.bound.take() {
            Some(previous) => previous.own,
            None => entry.raw,
        };
        entry.bound = Some(Bound { _external: external.clone(), own });
        entry.raw = raw;
        Ok(())
    }

    /// Unbinds `stream`: its later work goes to its own `CUstream` again
    /// (made now where none was), which first waits on the device (a
    /// pooled event) for what was queued on the external stream so far.
    /// Lets go of the [`ExternalStream`]. Nothing to do where unbound.
    pub fn unbind(&mut self, stream: StreamId, events: &EventPool) -> Result<(), ServerError> {
        let Some(own) = self.map.get(&stream).and_then(|e| e.bound.as_ref()).map(|b| b.own) else {
            return Ok(());
        };
        let own = if own.is_null() { self.create(stream)? } else { own };
        let entry = self.map.get_mut(&stream).expect("looked at above");
        // The own stream is kept aside until the order is in place: a
        // failed order leaves the binding as it was.
        if let Some(bound) = entry.bound.as_mut() {
            bound.own = own;
        }
        events.order(own, entry.raw)?;
        entry.raw = own;
        entry.bound = None;
        Ok(())
    }

    /// The raw CUDA stream of a logical stream.
    pub fn raw(&mut self, stream: StreamId) -> Result<sys::CUstream, ServerError> {
        Ok(self.entry(stream)?.raw)
    }

    /// The driver stream of `stream` where it was made already (never
    /// makes one).
    pub fn raw_if_made(&self, stream: StreamId) -> Option<sys::CUstream> {
        self.map.get(&stream).map(|s| s.raw)
    }

    /// Whether any stream is inside a capture (frees are deferred then).
    pub fn any_capturing(&self) -> bool {
        self.map.values().any(|s| s.capturing)
    }

    /// Whether this stream is inside a capture.
    pub fn is_capturing(&self, stream: StreamId) -> bool {
        self.map.get(&stream).is_some_and(|s| s.capturing)
    }

    /// Notes the backend's own work `name` launched on the stream.
    pub fn note_launch(&mut self, stream: StreamId, name: &'static str) {
        self.note(stream, |last| last.as_str() == name, || LaunchName::Own(name));
    }

    /// Notes a kernel launched on the stream: a repeat of the last one costs
    /// a pointer comparison, a new one a reference count.
    pub fn note_kernel(&mut self, stream: StreamId, name: &Arc<str>) {
        let same = |last: &LaunchName| matches!(last, LaunchName::Kernel(k) if Arc::ptr_eq(k, name) || **k == **name);
        self.note(stream, same, || LaunchName::Kernel(Arc::clone(name)));
    }

    /// Remembers a launch unless it repeats the last one (`same`), dropping
    /// the oldest past `REMEMBERED_KERNELS`.
    fn note(&mut self, stream: StreamId, same: impl Fn(&LaunchName) -> bool, name: impl FnOnce() -> LaunchName) {
        if let Some(entry) = self.map.get_mut(&stream) {
            if entry.since_sync.last().is_some_and(same) {
                return;
            }
            if entry.since_sync.len() == REMEMBERED_KERNELS {
                entry.since_sync.remove(0);
            }
            entry.since_sync.push(name());
        }
    }

    /// Forgets the kernels launched since the last sync (the stream
    /// drained without a fault).
    pub fn forget_suspects(&mut self, stream: StreamId) {
        if let Some(entry) = self.map.get_mut(&stream) {
            entry.since_sync.clear();
        }
    }

    /// The kernels launched since the stream's last sync, and forgets them.
    pub fn take_suspects(&mut self, stream: StreamId) -> Vec<String> {
        let names = self.map.get_mut(&stream).map(|e| std::mem::take(&mut e.since_sync)).unwrap_or_default();
        names.iter().map(|name| name.as_str().to_string()).collect()
    }

    /// The kernels launched since the last sync on every stream, forgotten.
    pub fn take_all_suspects(&mut self) -> Vec<String> {
        self.map
            .values_mut()
            .flat_map(|e| std::mem::take(&mut e.since_sync))
            .map(|name| name.as_str().to_string())
            .collect()
    }

    /// Destroys a stream (work already queued on it still runs). A bound
    /// stream's external `CUstream` is not destroyed (its owner does
    /// that): only the stream's own, where one was made, and the
    /// [`ExternalStream`] kept is let go.
    pub fn release(&mut self, stream: StreamId) {
        if let Some(entry) = self.map.remove(&stream) {
            let own = match entry.bound {
                Some(bound) => bound.own,
                None => entry.raw,
            };
            if own.is_null() {
                return;
            }
            // SAFETY: the handle came from cuStreamCreate (never an
            // external stream: those are only ever `raw` of a bound entry)
            // and is dropped from the map, so it is destroyed once.
            unsafe {
                let _ = sys::cuStreamDestroy_v2(own);
            }
        }
    }

    /// Waits for the work queued on every stream (errors are left to the
    /// calls that look at the stream). A bound stream's wait is
    /// `cuStreamSynchronize` of the external stream: it also waits for the
    /// work its owner queued there before. A bound stream's own `CUstream`
    /// needs no wait: the external stream waited for its work (on the
    /// device) when the binding was made.
    ///
    /// # Safety
    /// The device's context is current on this thread.
    pub unsafe fn synchronize_all(&self) {
        for entry in self.map.values() {
            // SAFETY: a live stream of the current context (the caller's
            // promise).
            let _ = unsafe { sys::cuStreamSynchronize(entry.raw) };
        }
    }

    /// Destroys every stream's own `CUstream` (never an external one) and
    /// lets go of the external streams kept by bindings.
    pub fn release_all(&mut self) {
        let ids: Vec<StreamId> = self.map.keys().copied().collect();
        for id in ids {
            self.release(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams with entries but no CUDA stream behind them (nothing here
    /// calls the driver).
    fn streams_with(stream: StreamId) -> Streams {
        let mut streams = Streams::new(DeviceId::new(DeviceId::CUDA, 0));
        let entry =
            StreamEntry { raw: std::ptr::null_mut(), capturing: false, since_sync: SmallVec::new(), bound: None };
        streams.map.insert(stream, entry);
        streams
    }

    #[test]
    fn a_stream_names_its_last_distinct_launches_until_it_drains() {
        let stream = StreamId::fresh();
        let mut streams = streams_with(stream);
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        for name in [&a, &a, &b, &a] {
            streams.note_kernel(stream, name);
        }
        streams.note_launch(stream, "copy_regions");
        streams.note_launch(stream, "copy_regions");
        // A repeat is noted once; past four, the oldest goes.
        streams.note_kernel(stream, &"c".into());
        assert_eq!(streams.take_suspects(stream), ["b", "a", "copy_regions", "c"]);
        assert!(streams.take_suspects(stream).is_empty(), "taken");
        // A kernel of the same name from another `Kernel` is a repeat too.
        streams.note_kernel(stream, &a);
        streams.note_kernel(stream, &"a".into());
        assert_eq!(streams.take_suspects(stream), ["a"]);
        // A stream that drained forgets them; an unknown stream has none.
        streams.note_kernel(stream, &b);
        streams.forget_suspects(stream);
        assert!(streams.take_all_suspects().is_empty());
        streams.note_kernel(StreamId::fresh(), &b);
        assert!(streams.take_all_suspects().is_empty());
    }
}
