//! Ordering with a stream another library owns (`Backend::wait_external`
//! and `signal_external`), and running on it (`Backend::bind_external`):
//! which `CUstream`s are accepted, and what a failure says.
//!
//! The orderings themselves are one pooled event each
//! (`EventPool::order`): `cuEventRecord` on the stream waited for,
//! `cuStreamWaitEvent` on the other, the event given back at once. With the
//! check below asked once per stream, a call costs those two driver calls
//! (and, on a caller's thread, the `cuCtxGetCurrent` of entering the
//! device).
//!
//! A bound stream (`Streams::bind`) queues cohort's work on the caller's
//! `CUstream` itself: no event per call. Every user of the stream's raw
//! handle then works on the caller's stream, which is safe as follows:
//! launches, copies, cuBLAS, peer copies, NCCL calls, fences, timers and
//! cross-stream orders only queue work or record events there (the caller's
//! own work on it stays in its order); a sync or a read waits with
//! `cuStreamSynchronize` of the caller's stream, so it also waits for the
//! work the caller queued there before (said by `Client::bind_external`);
//! a capture is never begun on a bound stream (`begin_native_capture`
//! refuses it) and a stream inside cohort's capture or the caller's is
//! never bound, so cohort ends only captures it began; the stream is never
//! destroyed by cohort (`Streams::release`). A device collective part
//! queued there is tracked by the stream's raw handle while it is pending:
//! since the caller's work may follow the part on that stream, the part's
//! end event is recorded as the call hands over (`hand_over_bound`, before
//! the caller can queue more), and before the stream is rebound or
//! unbound, so a part's end is never seen only after the caller's later
//! work (nor its timeout counted over it).

use cudarc::driver::sys;

use super::driver::describe;
use super::CudaBackend;
use crate::error::ServerError;
use crate::id::StreamId;

/// `CU_STREAM_PER_THREAD` of `cuda.h` (cudarc's bindings leave the
/// macro out): the calling thread's default stream.
const CU_STREAM_PER_THREAD: usize = 0x2;

impl CudaBackend {
    /// A capture may neither wait on an event recorded outside it nor
    /// hand one out: its work runs only at replay.
    pub(super) fn refuse_external_in_capture(&self, stream: StreamId) -> Result<(), ServerError> {
        if self.streams.is_capturing(stream) {
            return Err(ServerError::InvalidState {
                operation: "ordering with an external stream",
                reason: "this stream is inside a capture window; call stop_capture first".into(),
            });
        }
        Ok(())
    }

    /// The `CUstream` of `external`, checked to be a stream of this
    /// device's context (`cuStreamGetCtx`, asked once for a stream seen
    /// last time too). Null (the legacy default stream) is the context's
    /// own; the per-thread default stream is refused, since a task may run
    /// on the device thread, whose per-thread stream it would name.
    pub(super) fn external_stream(&mut self, external: &crate::ExternalStream) -> Result<sys::CUstream, ServerError> {
        let raw = match external {
            crate::ExternalStream::Cuda(stream) => stream.raw(),
            #[allow(unreachable_patterns)]
            other => {
                return Err(ServerError::InvalidArgument(format!(
                    "{other:?} is not a CUDA stream: CUDA device {} orders only with CUDA streams (ExternalStream::Cuda, ExternalStream::from_cudarc)",
                    self.device
                )))
            }
        };
        if raw == CU_STREAM_PER_THREAD {
            return Err(ServerError::InvalidArgument(
                "the per-thread default stream (CU_STREAM_PER_THREAD) names whichever thread uses it, and cohort may order from its device thread: pass a stream you created (cudarc's CudaContext::new_stream) or the legacy default stream (0)".into(),
            ));
        }
        let stream = raw as sys::CUstream;
        if self.checked_external == Some(raw) {
            return Ok(stream);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle. `ExternalStream::Cuda` names
        // a live stream (of any context) or a special handle (null,
        // legacy), as its maker promised: the driver cannot check a
        // handle, and an invalid one is undefined behaviour there. A
        // special handle names the context current here, which is this
        // device's (its thread, or a caller's made ready by `enter_caller`).
        let code = unsafe { sys::cuStreamGetCtx(stream, &mut ctx) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(ServerError::InvalidArgument(format!(
                "external stream {raw:#x} is not a live CUDA stream (cuStreamGetCtx: {})",
                describe(code)
            )));
        }
        if ctx != self.ctx {
            return Err(ServerError::InvalidArgument(format!(
                "external stream {raw:#x} belongs to CUDA context {ctx:?}, not to the primary context {:?} of GPU {} that CUDA device {} runs on: cohort orders only with streams of that context (cudarc's CudaContext::new({}) gives it; a context from cuCtxCreate or another GPU's cannot be used)",
                self.ctx, self.gpu, self.device, self.gpu
            )));
        }
        self.checked_external = Some(raw);
        Ok(stream)
    }

    /// Binds `stream` to `external` (see `Streams::bind`): refused where
    /// `stream` is inside cohort's capture or the external stream inside a
    /// capture of its owner (`cuStreamIsCapturing`, asked only when the
    /// binding changes). Binding to the stream it is bound to calls no
    /// driver function.
    pub(super) fn bind_external_stream(
        &mut self,
        stream: StreamId,
        external: &crate::ExternalStream,
    ) -> Result<(), ServerError> {
        self.check_lost()?;
        self.refuse_external_in_capture(stream)?;
        let raw = self.external_stream(external)?;
        if self.streams.bound_to(stream) == Some(raw) {
            return Ok(());
        }
        // A live stream of this context (checked by `external_stream`).
        let status = match super::graphs::capture_status(self.device, raw) {
            Ok(status) => status,
            Err(err) => return Err(self.external_error(stream, err)),
        };
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(ServerError::InvalidState {
                operation: "binding an external stream",
                reason: format!(
                    "external stream {raw:?} is inside a capture ({status:?}): cohort tracks its work by events and queries that a capture cannot hold; bind before the capture begins or after it ends"
                ),
            });
        }
        // The last collective part on the stream's current CUstream gets
        // its end event there before the stream moves.
        self.close_run_on(stream);
        let result = self.streams.bind(stream, external, raw, &self.events);
        result.map_err(|err| self.external_error(stream, err))
    }

    /// Unbinds `stream` (see `Streams::unbind`); nothing where unbound.
    pub(super) fn unbind_external_stream(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.check_lost()?;
        if self.streams.bound_to(stream).is_none() {
            return Ok(());
        }
        self.close_run_on(stream);
        let result = self.streams.unbind(stream, &self.events);
        result.map_err(|err| self.external_error(stream, err))
    }

    /// On a bound stream: records the end event of the last collective
    /// part when it was queued there and has none (one `cuEventRecord`),
    /// before the caller queues more work behind it. Nothing otherwise.
    pub(super) fn hand_over_bound(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.check_lost()?;
        if self.streams.bound_to(stream).is_some() {
            self.close_run_on(stream);
        }
        Ok(())
    }

    /// A capture begun by cohort on a bound stream would capture the
    /// caller's work too, and its end is not cohort's to make: refused.
    pub(super) fn refuse_capture_of_bound(&self, stream: StreamId) -> Result<(), ServerError> {
        if let Some(raw) = self.streams.bound_to(stream) {
            return Err(ServerError::InvalidState {
                operation: "begin_capture",
                reason: format!(
                    "this stream is bound to external stream {raw:?} (Client::bind_external, OnStream): call Client::unbind_external first"
                ),
            });
        }
        Ok(())
    }

    /// An error of ordering with an external stream: the lost context when
    /// there is one, else `err` with a hint at the usual cause.
    pub(super) fn external_error(&mut self, stream: StreamId, err: ServerError) -> ServerError {
        self.checked_external = None;
        match self.classify(stream, err) {
            ServerError::Backend { backend, device, message } => ServerError::Backend {
                backend,
                device,
                message: format!(
                    "{message} (ordering with an external stream: was it destroyed, or made in another context?)"
                ),
            },
            other => other,
        }
    }
}
