//! Ordering with a stream another library owns (`Backend::wait_external`
//! and `signal_external`): which `CUstream`s are accepted, and what a
//! failure says.
//!
//! The orderings themselves are one pooled event each
//! (`EventPool::order`): `cuEventRecord` on the stream waited for,
//! `cuStreamWaitEvent` on the other, the event given back at once. With the
//! check below asked once per stream, a call costs those two driver calls
//! (and, on a caller's thread, the `cuCtxGetCurrent` of entering the
//! device).

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
