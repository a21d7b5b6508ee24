//! Ordering cohort's work with a stream another library owns:
//! [`Client::wait_external`] and [`Client::signal_external`].
//!
//! Both run where the device's tasks run, in the order of the client's
//! stream: on the calling thread where the device is idle (nothing queued
//! for its thread: `DeviceHandle::run_inline_or_wait`, CUDA), else as a task
//! the call waits for (the task only queues device work: the call never
//! waits for the GPU itself, only for the tasks queued before it to be
//! handed to the driver, as a read would). Either way the ordering is in
//! place when the call returns, so neither can be overtaken by the caller's
//! next call or by its next work on the external stream.

use super::Client;
use crate::error::ServerError;
use crate::foreign::ExternalStream;

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
    pub fn wait_external(&self, external: &ExternalStream) -> Result<(), ServerError> {
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
    pub fn signal_external(&self, external: &ExternalStream) -> Result<(), ServerError> {
        self.refuse_if_capturing("signal_external")?;
        let stream = self.stream_id();
        self.device().run_inline_or_wait(stream, move |state| state.backend.signal_external(stream, external))?
    }
}
