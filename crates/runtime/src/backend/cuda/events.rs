//! Pooled CUDA events: cross-stream ordering, host fences and timers.
//!
//! An event is taken from the pool, recorded, and given back as soon as
//! nothing needs its state: right after `cuStreamWaitEvent` (the wait keeps
//! the state it saw), or once a fence has been waited on. The pool is shared
//! with fences, which may be waited on from any thread.

use std::sync::Arc;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{driver_error, set_current, SendPtr};
use crate::backend::FenceWait;
use crate::error::ServerError;
use crate::id::DeviceId;

struct PoolInner {
    free: Vec<SendPtr<sys::CUevent>>,
    /// Set when the backend is gone: events handed back later are dropped
    /// with the context instead of destroyed.
    closed: bool,
}

/// A pool of events of one kind (timing or not).
#[derive(Clone)]
pub(crate) struct EventPool {
    device: DeviceId,
    ctx: SendPtr<sys::CUcontext>,
    timing: bool,
    inner: Arc<Mutex<PoolInner>>,
}

impl EventPool {
    pub fn new(device: DeviceId, ctx: sys::CUcontext, timing: bool) -> Self {
        Self {
            device,
            ctx: SendPtr(ctx),
            timing,
            inner: Arc::new(Mutex::new(PoolInner { free: Vec::new(), closed: false })),
        }
    }

    /// An event from the pool, or a new one.
    pub fn take(&self) -> Result<sys::CUevent, ServerError> {
        if let Some(event) = self.inner.lock().free.pop() {
            return Ok(event.0);
        }
        let flags = if self.timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current on the thread running the device's
        // task (its device thread, or a caller's made ready by
        // `enter_caller`), where events are taken; the call writes one handle.
        let code = unsafe { sys::cuEventCreate(&mut event, flags) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(self.device, "cuEventCreate", code));
        }
        Ok(event)
    }

    /// Hands an event back for reuse.
    pub fn give(&self, event: sys::CUevent) {
        let mut inner = self.inner.lock();
        if !inner.closed {
            inner.free.push(SendPtr(event));
        }
    }

    /// Destroys the pooled events; events handed back later are not reused.
    pub fn close(&self) {
        let mut inner = self.inner.lock();
        inner.closed = true;
        for event in inner.free.drain(..) {
            // SAFETY: each pooled event was created by this pool and is in
            // no one else's hands.
            unsafe {
                let _ = sys::cuEventDestroy_v2(event.0);
            }
        }
    }

    /// Records an event on `stream` and returns a fence for it.
    pub fn fence(&self, stream: sys::CUstream) -> Result<CudaFence, ServerError> {
        let event = self.take()?;
        // SAFETY: event and stream are live handles of the current context.
        let code = unsafe { sys::cuEventRecord(event, stream) };
        if code != sys::CUresult::CUDA_SUCCESS {
            self.give(event);
            return Err(driver_error(self.device, "cuEventRecord", code));
        }
        Ok(CudaFence { event: Some(SendPtr(event)), pool: self.clone() })
    }

    /// Makes `waiter` wait on the device for the work queued so far on
    /// `target`; the host does not block.
    pub fn order(&self, waiter: sys::CUstream, target: sys::CUstream) -> Result<(), ServerError> {
        let event = self.take()?;
        // SAFETY: live handles of the current context; the wait captures the
        // event's current record, so the event may be reused right after.
        let result = unsafe {
            let code = sys::cuEventRecord(event, target);
            if code != sys::CUresult::CUDA_SUCCESS {
                Err(driver_error(self.device, "cuEventRecord", code))
            } else {
                let code = sys::cuStreamWaitEvent(waiter, event, 0);
                if code != sys::CUresult::CUDA_SUCCESS {
                    Err(driver_error(self.device, "cuStreamWaitEvent", code))
                } else {
                    Ok(())
                }
            }
        };
        self.give(event);
        result
    }

    /// Blocks the host until the work queued so far on `target` is done
    /// (used where a device-side wait is not allowed: inside a capture).
    pub fn wait_host(&self, target: sys::CUstream) -> Result<(), ServerError> {
        let fence = self.fence(target)?;
        Box::new(fence).wait()
    }
}

/// A pooled event recorded on a stream; waiting on it blocks until the work
/// queued before it finished, then returns the event to its pool.
pub(crate) struct CudaFence {
    event: Option<SendPtr<sys::CUevent>>,
    pool: EventPool,
}

impl FenceWait for CudaFence {
    fn wait(mut self: Box<Self>) -> Result<(), ServerError> {
        let event = self.event.take().expect("a fence is waited on once");
        if self.pool.inner.lock().closed {
            return Err(ServerError::DeviceClosed { device: self.pool.device });
        }
        set_current(self.pool.device, self.pool.ctx.0)?;
        // SAFETY: the event is live (the pool is not closed) and recorded.
        let code = unsafe { sys::cuEventSynchronize(event.0) };
        self.pool.give(event.0);
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(self.pool.device, "cuEventSynchronize (fence wait)", code));
        }
        Ok(())
    }

    /// `cuEventQuery`: `false` only while the work is still running; a
    /// closed pool or a failed query (a lost context) counts as finished.
    fn is_complete(&self) -> bool {
        let Some(event) = self.event.as_ref() else { return true };
        if self.pool.inner.lock().closed || set_current(self.pool.device, self.pool.ctx.0).is_err() {
            return true;
        }
        // SAFETY: the event is live (the pool is not closed) and recorded.
        let code = unsafe { sys::cuEventQuery(event.0) };
        code != sys::CUresult::CUDA_ERROR_NOT_READY
    }
}

impl Drop for CudaFence {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool.give(event.0);
        }
    }
}
