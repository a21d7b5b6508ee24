//! CUDA graphs by stream capture.
//!
//! `start_capture` begins a relaxed-mode capture on the stream, so the device
//! thread may still allocate, compile and serve other streams meanwhile; the
//! launches of the window go into the capture; `stop_capture` ends it and
//! instantiates the graph, and a replay is one `cuGraphLaunch`.
//!
//! The warm-up rule: run the work once (after `graph_prepare`) before
//! `start_capture`, so its memory comes from the persistent pool and its
//! kernels are compiled. A kernel first met inside the window is still
//! compiled and loaded there; a new page inside it is refused by the runtime.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::driver_error;
use crate::error::ServerError;
use crate::id::DeviceId;

/// An instantiated graph, destroyed with its last owner while the context
/// that made it is alive.
pub(crate) struct GraphExec {
    pub exec: sys::CUgraphExec,
    /// Cleared when the backend (and its context) goes away first.
    alive: Arc<AtomicBool>,
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        if self.alive.load(Ordering::Acquire) {
            // SAFETY: the exec came from cuGraphInstantiateWithFlags, its
            // context is alive, and it is destroyed once.
            unsafe {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
        }
    }
}

/// Begins a relaxed-mode capture on `stream`.
pub(crate) fn begin(device: DeviceId, stream: sys::CUstream) -> Result<(), ServerError> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a live stream of the current context, not capturing yet (the
    // runtime refuses a second start_capture).
    let code = unsafe { sys::cuStreamBeginCapture_v2(stream, mode) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuStreamBeginCapture", code));
    }
    Ok(())
}

/// Whether `stream` is inside a capture, cohort's or its owner's
/// (`cuStreamIsCapturing`: the one question a capturing stream may be
/// asked; an invalidated capture counts, it is still open).
pub(crate) fn capture_status(
    device: DeviceId,
    stream: sys::CUstream,
) -> Result<sys::CUstreamCaptureStatus, ServerError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream of the current context; writes one status.
    let code = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuStreamIsCapturing", code));
    }
    Ok(status)
}

/// Ends the capture on `stream` and instantiates its graph.
pub(crate) fn end(device: DeviceId, stream: sys::CUstream, alive: &Arc<AtomicBool>) -> Result<GraphExec, ServerError> {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing (begun by `begin`); the call writes the
    // captured graph, which we destroy after instantiating it.
    let code = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuStreamEndCapture (the capture was invalidated)", code));
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the graph just captured; it may be destroyed once
    // instantiated (the exec does not refer to it).
    let code = unsafe {
        let code = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
        let _ = sys::cuGraphDestroy(graph);
        code
    };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuGraphInstantiateWithFlags", code));
    }
    Ok(GraphExec { exec, alive: alive.clone() })
}

/// Launches an instantiated graph on `stream`.
pub(crate) fn replay(device: DeviceId, exec: &GraphExec, stream: sys::CUstream) -> Result<(), ServerError> {
    // SAFETY: a live exec of the current context and a live stream.
    let code = unsafe { sys::cuGraphLaunch(exec.exec, stream) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuGraphLaunch", code));
    }
    Ok(())
}
