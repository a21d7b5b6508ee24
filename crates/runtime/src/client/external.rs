//! Ordering cohort's work with a stream another library owns:
//! [`Client::wait_external`] and [`Client::signal_external`] (an event
//! each way per call), or running it on that stream itself:
//! [`Client::bind_external`], [`Client::hand_over`] and
//! [`Client::unbind_external`] (no driver call per call once bound).
//!
//! Both run where the device's tasks run, in the order of the client's
//! stream: on the calling thread where the device is idle (nothing queued
//! for its thread: `DeviceHandle::run_inline_or_wait`, CUDA), else as a task
//! the call waits for (the task only queues device work: the call never
//! waits for the GPU itself, only for the tasks queued before it to be
//! handed to the driver, as a read would). Either way the ordering is in
//! place when the call returns, so neither can be overtaken by the caller's
//! next call or by its next work on the external stream.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Client;
use crate::error::ServerError;
use crate::foreign::ExternalStream;
use crate::id::{ServiceId, StreamId};

/// Counts every change of a binding in the process: a thread's
/// remembered binding holds only while the count it saw is unchanged.
static BINDINGS_CHANGED: AtomicU64 = AtomicU64::new(0);

/// How many bindings a thread remembers (a device each, usually).
const REMEMBERED_BINDINGS: usize = 8;

/// A binding this thread made (or found in place), as of a count of
/// [`BINDINGS_CHANGED`].
#[derive(Clone, Copy, PartialEq, Eq)]
struct Remembered {
    service: ServiceId,
    stream: StreamId,
    external: usize,
    seen: u64,
}

thread_local! {
    /// The bindings this thread made last, newest last: binding again to
    /// one of them, with no binding changed since anywhere, is a compare.
    static BOUND_HERE: RefCell<Vec<Remembered>> = const { RefCell::new(Vec::new()) };
}

/// The identity of an external stream for [`BOUND_HERE`]: a `CUstream`
/// handle (one that is bound is kept alive by its binding, so no other
/// stream can have its handle meanwhile), or one value for a wgpu queue.
fn identity(external: &ExternalStream) -> usize {
    match external {
        #[cfg(feature = "cuda")]
        ExternalStream::Cuda(stream) => stream.raw(),
        #[cfg(feature = "wgpu")]
        ExternalStream::WgpuQueue => usize::MAX,
        #[allow(unreachable_patterns)]
        _ => 0,
    }
}

impl Client {
    /// Makes the work queued on this client's stream after this call start
    /// only after the work the caller queued on `external` before it, on
    /// the device, without a host wait for either: on CUDA an event
    /// recorded on `external` now and waited on by the client's stream
    /// (`cuEventRecord` + `cuStreamWaitEvent`, pooled events); on an
    /// adopted wgpu device's queue ([`ExternalStream::WgpuQueue`]) nothing,
    /// since the queue runs submissions in order.
    ///
    /// Refused with a clear error before anything is queued: a stream of
    /// another CUDA context or device (the caller's must be the device's
    /// primary context, cudarc's default), the per-thread default stream,
    /// a stream of another backend, a backend with no external streams
    /// (the CPU), and a stream inside a capture window.
    ///
    /// Where this client's stream is bound to `external`
    /// ([`Client::bind_external`]) there is nothing to order: a thread
    /// that bound it returns at once, without entering the device.
    pub fn wait_external(&self, external: &ExternalStream) -> Result<(), ServerError> {
        if self.bound_here(external) {
            return Ok(());
        }
        self.refuse_if_capturing("wait_external")?;
        let stream = self.stream_id();
        self.device().run_inline_or_wait(stream, move |state| state.backend.wait_external(stream, external))?
    }

    /// Makes the work the caller queues on `external` after this call
    /// returns start only after the work queued on this client's stream
    /// before the call, including tasks still waiting in the device
    /// thread's queue (they are handed to the driver first), without a
    /// host wait for the device: on CUDA an event recorded on the client's
    /// stream and waited on by `external`; on an adopted wgpu device's
    /// queue, a submission of cohort's pending work, so it precedes the
    /// caller's next submission. Refused as [`Client::wait_external`] is.
    /// Where this client's stream is bound to `external`
    /// ([`Client::bind_external`]) it does what [`Client::hand_over`] does
    /// (no event).
    pub fn signal_external(&self, external: &ExternalStream) -> Result<(), ServerError> {
        self.refuse_if_capturing("signal_external")?;
        let stream = self.stream_id();
        self.device().run_inline_or_wait(stream, move |state| state.backend.signal_external(stream, external))?
    }

    /// Makes this client's stream (the one pinned, else the calling
    /// thread's) queue its work on `external` itself from now on, until
    /// [`Client::unbind_external`] or a binding to another stream: then
    /// cohort's work needs no event per call to follow the caller's work
    /// there, and the caller's work queued later follows cohort's once it
    /// was handed to the driver (see [`Client::hand_over`]).
    ///
    /// Binding first makes `external` wait on the device (an event, no host
    /// wait) for what this stream queued before (on its own stream, or on
    /// the external stream it was bound to), so order is kept. Binding to
    /// the stream it is already bound to, from a thread that bound it (or
    /// found it bound) and with no binding changed since in the process,
    /// is a compare on the calling thread: no driver call, no device
    /// entry.
    ///
    /// While bound, everything of this stream runs on `external`: a
    /// [`Client::sync`] or a read waits for the caller's work queued there
    /// before too (`cuStreamSynchronize` of it), and closing the device
    /// waits for it. The binding keeps `external` (a clone: a cudarc
    /// stream stays alive) and never destroys it: not when the thread
    /// that bound it exits, nor when the device closes. A capture is not
    /// begun on a bound stream ([`Client::start_capture`] refuses it);
    /// do not begin one of your own on `external` while it is bound.
    ///
    /// On an adopted wgpu device's queue ([`ExternalStream::WgpuQueue`])
    /// binding orders as [`Client::wait_external`] does (one queue runs
    /// every submission in order). Refused with a clear error before
    /// anything is queued where [`Client::wait_external`] is (another
    /// context's or device's stream, the per-thread default stream, a
    /// backend with no external streams: the CPU), for a stream inside
    /// cohort's capture window, and on CUDA for an external stream inside
    /// a capture of its owner.
    pub fn bind_external(&self, external: &ExternalStream) -> Result<(), ServerError> {
        if self.bound_here(external) {
            return Ok(());
        }
        let (service, stream) = (self.service_id(), self.stream_id());
        let key = Remembered { service, stream, external: identity(external), seen: 0 };
        self.refuse_if_capturing("bind_external")?;
        // Counted under the device's lock, with the change: a later change
        // anywhere makes the next bind ask the device again.
        let seen = self.device().run_inline_or_wait(stream, move |state| {
            let bound = state.backend.bind_external(stream, external);
            let seen = BINDINGS_CHANGED.fetch_add(1, Ordering::AcqRel) + 1;
            bound.map(|()| seen)
        })??;
        BOUND_HERE.with(|b| {
            let mut bound = b.borrow_mut();
            bound.retain(|r| (r.service, r.stream) != (service, stream));
            if bound.len() == REMEMBERED_BINDINGS {
                bound.remove(0);
            }
            bound.push(Remembered { seen, ..key });
        });
        Ok(())
    }

    /// Ends this client's stream's binding ([`Client::bind_external`]):
    /// its later work goes to cohort's own stream again, which first waits
    /// on the device (an event, no host wait) for what was queued on the
    /// external stream before. Lets go of the external stream. Nothing to
    /// do where the stream is not bound.
    pub fn unbind_external(&self) -> Result<(), ServerError> {
        let stream = self.stream_id();
        self.device().run_inline_or_wait(stream, move |state| {
            let unbound = state.backend.unbind_external(stream);
            BINDINGS_CHANGED.fetch_add(1, Ordering::AcqRel);
            unbound
        })?
    }

    /// Returns once the work queued so far on this client's stream was
    /// handed to the driver, without waiting for the device: on a stream
    /// bound to an external one ([`Client::bind_external`]) the caller's
    /// work queued there after this returns then runs after it. Where the
    /// device is idle it runs on the calling thread (its work was handed
    /// over as it was queued); else it waits until the device thread
    /// reached it (the tasks before it handed over). On CUDA it also
    /// records the end event of a device collective left last on a bound
    /// stream (one `cuEventRecord`), so its end is seen when it ends, not
    /// after the caller's later work there.
    pub fn hand_over(&self) -> Result<(), ServerError> {
        let stream = self.stream_id();
        self.device().run_inline_or_wait(stream, move |state| state.backend.hand_over(stream))?
    }

    /// Whether this thread bound this client's stream to `external` (or
    /// found it bound) and no binding changed since in the process: then
    /// it still is. A compare of what the thread remembers.
    fn bound_here(&self, external: &ExternalStream) -> bool {
        let key = Remembered {
            service: self.service_id(),
            stream: self.stream_id(),
            external: identity(external),
            seen: BINDINGS_CHANGED.load(Ordering::Acquire),
        };
        BOUND_HERE.with(|b| b.borrow().contains(&key))
    }
}
