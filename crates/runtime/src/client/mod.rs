//! The client: the handle through which a thread uses one device.
//!
//! A [`Client`] is cheap to clone and `Send + Sync`. Its calls queue tasks on
//! the device's server thread; those that return data or errors wait for
//! their task. Work goes to the client's stream: the calling thread's own
//! ([`StreamId::current`]) unless the client was pinned with
//! [`Client::set_stream`].

mod external;
mod foreign;
mod io;
mod launch;
mod memory;
mod peer;
mod timestamps;

use std::any::Any;
use std::sync::Arc;

use crate::backend::{EndSignal, FenceWait};
use crate::device::{self, BackendFactory, DeviceHandle, Reply};
use crate::error::ServerError;
use crate::handle::{Handle, LayoutPolicy};
use crate::id::{DeviceId, ServiceId, StreamId};
use crate::properties::{Capabilities, DeviceProperties};
use crate::state::{DeviceState, DeviceStats};

pub use memory::{MemoryReport, MemoryScope};
pub use timestamps::Timestamp;

/// One device, seen from any thread.
#[derive(Clone)]
pub struct Client {
    device: Arc<DeviceHandle>,
    stream: Option<StreamId>,
    layout: LayoutPolicy,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("service", &self.device.service).field("stream", &self.stream).finish()
    }
}

/// A fence raised on a stream: wait on it from the host with
/// [`Fence::wait`].
pub struct Fence {
    inner: Box<dyn FenceWait>,
}

impl Fence {
    /// Blocks until the work queued on the stream before the fence finished.
    pub fn wait(self) -> Result<(), ServerError> {
        self.inner.wait()
    }
}

/// A [`Client::sync`] asked for and not yet waited on
/// ([`Client::start_sync`]).
pub struct PendingSync {
    reply: Reply<Result<(), ServerError>>,
}

impl PendingSync {
    /// Waits until the device drained the stream; returns what
    /// [`Client::sync`] would.
    pub fn wait(self) -> Result<(), ServerError> {
        self.reply.wait()?
    }
}

impl Client {
    /// The client of `device`, starting its server thread with the backend
    /// `factory` builds (on that thread) if it is not running. Backends call
    /// this; users call their runtime's `client`.
    ///
    /// An unusable `COHORT_SPIN_US` (read by every client's waits) is
    /// returned here as [`ServerError::Variable`].
    pub fn load(device: DeviceId, factory: impl FnOnce() -> BackendFactory) -> Result<Client, ServerError> {
        device::checked_spin_window()?;
        let handle = device::open_device(device, factory)?;
        Ok(Client { device: handle, stream: None, layout: LayoutPolicy::Contiguous })
    }

    /// The backend's name ("cpu", "cuda", "wgpu").
    pub fn name(&self) -> &'static str {
        self.device.properties.backend
    }

    pub fn device_id(&self) -> DeviceId {
        self.device.service.device
    }

    /// The running server this client talks to.
    pub fn service_id(&self) -> ServiceId {
        self.device.service
    }

    /// The device's name and capabilities.
    pub fn properties(&self) -> &DeviceProperties {
        &self.device.properties
    }

    /// What the device offers collectives: host-addressable memory, device
    /// collectives, peer access. Costs nothing (decided when it opened).
    pub fn capabilities(&self) -> Capabilities {
        self.device.properties.capabilities
    }

    /// The stream this client's work goes to now.
    pub fn stream_id(&self) -> StreamId {
        self.stream.unwrap_or_else(StreamId::current)
    }

    /// Pins this client (not its clones made before) to `stream`, whatever
    /// thread uses it. Buffers shared with other streams stay ordered by
    /// fences.
    pub fn set_stream(&mut self, stream: StreamId) {
        self.stream = Some(stream);
    }

    /// A clone pinned to `stream`.
    pub fn with_stream(&self, stream: StreamId) -> Client {
        let mut client = self.clone();
        client.set_stream(stream);
        client
    }

    /// A clone that lays out tensors it creates with `policy`.
    pub fn with_layout_policy(&self, policy: LayoutPolicy) -> Client {
        Client { layout: policy, ..self.clone() }
    }

    pub fn layout_policy(&self) -> LayoutPolicy {
        self.layout
    }

    /// Closes the device for every client: queued work is dropped and later
    /// calls return [`ServerError::DeviceClosed`].
    pub fn close(&self) {
        device::close_device(self.device_id());
        self.device.close();
    }

    pub(crate) fn device(&self) -> &DeviceHandle {
        &self.device
    }

    /// Refuses a handle of another device (or an earlier opening of this one)
    /// before anything is queued.
    pub fn check_owned(&self, handle: &Handle) -> Result<(), ServerError> {
        if handle.service() != self.service_id() {
            return Err(ServerError::ForeignHandle {
                handle_service: handle.service(),
                client_service: self.service_id(),
            });
        }
        Ok(())
    }

    /// Queues `task` on the device thread with the backend's state and
    /// returns at once. A panic in it is returned by the stream's next `sync`.
    pub fn submit(&self, task: impl FnOnce(&mut dyn Any) + Send + 'static) -> Result<(), ServerError> {
        self.device.submit(self.stream_id(), move |state| {
            let backend: &mut dyn Any = &mut state.backend;
            task(backend)
        })
    }

    /// Runs `task` on the device thread and waits for its result; a panic in
    /// it comes back as [`ServerError::TaskPanicked`]. The task gets the
    /// backend as `&mut dyn Any` (a `Box<dyn Backend>`).
    pub fn submit_blocking<'a, R: Send + 'a>(
        &self,
        task: impl FnOnce(&mut dyn Any) -> R + Send + 'a,
    ) -> Result<R, ServerError> {
        self.device.run(self.stream_id(), move |state| {
            let backend: &mut dyn Any = &mut state.backend;
            task(backend)
        })
    }

    /// Runs `task` on the device thread with nothing else interleaved. Calls
    /// of this client inside `task` run inline, in order.
    pub fn exclusive<'a, R: Send + 'a>(&self, task: impl FnOnce() -> R + Send + 'a) -> Result<R, ServerError> {
        self.device.exclusive(self.stream_id(), task)
    }

    /// Hands the stream's queued work to the device without waiting for it;
    /// returns an error a fire-and-forget task left on the stream.
    pub fn flush(&self) -> Result<(), ServerError> {
        let stream = self.stream_id();
        self.device.run(stream, move |state| {
            state.backend.flush(stream)?;
            state.take_pending(stream)
        })?
    }

    /// Waits for everything queued on this client's stream; returns the first
    /// error a fire-and-forget task left on it.
    pub fn sync(&self) -> Result<(), ServerError> {
        self.start_sync()?.wait()
    }

    /// [`Client::sync`] on every client at once: each device drains its
    /// stream in parallel; returns the first error in `clients`' order
    /// after every device finished.
    pub fn sync_all(clients: &[Client]) -> Result<(), ServerError> {
        let pending: Vec<_> = clients.iter().map(Client::start_sync).collect();
        let mut first_error = None;
        for result in pending {
            if let Err(err) = result.and_then(PendingSync::wait) {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Asks the device for a [`Client::sync`] and returns without waiting:
    /// wait on the [`PendingSync`] later. Syncing several devices this way
    /// waits for the slowest, not for the sum of them.
    pub fn start_sync(&self) -> Result<PendingSync, ServerError> {
        let stream = self.stream_id();
        self.refuse_if_capturing("sync")?;
        Ok(PendingSync { reply: self.device.request(stream, move |state| state.sync(stream))? })
    }

    /// Waits for the work that writes `handles` (on whatever stream queued it)
    /// and returns the error marked on any of them.
    pub fn sync_buffers<'a>(&self, handles: impl IntoIterator<Item = &'a Handle>) -> Result<(), ServerError> {
        let handles: Vec<Handle> = handles.into_iter().cloned().collect();
        for handle in &handles {
            self.check_owned(handle)?;
        }
        let stream = self.stream_id();
        self.refuse_if_capturing("sync_buffers")?;
        self.device.run(stream, move |state| {
            let refs: Vec<&Handle> = handles.iter().collect();
            state.order_after_writers(stream, refs.iter().copied())?;
            state.backend_sync(stream)?;
            match refs.iter().find_map(|h| h.error()) {
                Some(err) => Err(err),
                None => Ok(()),
            }
        })?
    }

    /// Returns the error marked on any of `handles` by the work queued so far,
    /// without waiting for the device to finish it.
    pub fn check<'a>(&self, handles: impl IntoIterator<Item = &'a Handle>) -> Result<(), ServerError> {
        let handles: Vec<Handle> = handles.into_iter().cloned().collect();
        for handle in &handles {
            self.check_owned(handle)?;
        }
        self.device.run(self.stream_id(), move |_| match handles.iter().find_map(|h| h.error()) {
            Some(err) => Err(err),
            None => Ok(()),
        })?
    }

    /// A fence after the work queued so far on this client's stream.
    pub fn fence(&self) -> Result<Fence, ServerError> {
        let stream = self.stream_id();
        let inner = self.device.run(stream, move |state| state.backend.fence(stream))??;
        Ok(Fence { inner })
    }

    /// Looks on the calling thread whether the device collectives queued on
    /// this device ended, and ends those that did (their monitors hear it,
    /// as when the device thread polls them), where the device is idle
    /// (nothing queued or running on its thread, see
    /// [`Client::submit_buffers_inline`]). Returns whether it could look;
    /// where it could not, the device thread polls them. Never waits for
    /// the device.
    pub fn poll_collectives(&self) -> bool {
        self.polled(|_| ()).is_some()
    }

    /// [`Client::poll_collectives`], and where collectives still run after
    /// it, a host word that the device writes once they have all ended
    /// ([`EndSignal`]), asked for from the backend (on CUDA a stream write
    /// behind the last of them, ~1.5 µs of this thread's time, made once
    /// per part). A waiter reads it without entering the device, then polls
    /// again to reap them. `None` where the device could not be entered
    /// now, nothing runs, or the backend writes no such word. Never waits
    /// for the device.
    pub fn poll_collectives_signal(&self) -> Option<EndSignal> {
        self.polled(DeviceState::collectives_end_signal).flatten()
    }

    /// Polls the device's collectives from this thread, then runs `then`
    /// on its state; `None` where the device could not be entered now.
    fn polled<R>(&self, then: impl FnOnce(&mut DeviceState) -> R) -> Option<R> {
        // Not waiting for the lock: a device thread that holds it is
        // polling them itself, and the caller polls again.
        let mut inline = self.device.enter_inline_within(std::time::Duration::ZERO)?;
        crate::stages::mark(crate::stages::Stage::PollEntered);
        let state = inline.state();
        state.poll_collectives();
        crate::stages::mark(crate::stages::Stage::Polled);
        Some(then(state))
    }

    /// Counters of the device: cross-stream fences, stream syncs, launches.
    pub fn stats(&self) -> Result<DeviceStats, ServerError> {
        self.device.run(self.stream_id(), |state| state.stats)
    }

    pub(crate) fn refuse_if_capturing(&self, operation: &'static str) -> Result<(), ServerError> {
        if self.device.capturing.lock().contains(&self.stream_id()) {
            return Err(ServerError::InvalidState {
                operation,
                reason: "this stream is inside a capture window; call stop_capture first".into(),
            });
        }
        Ok(())
    }
}
