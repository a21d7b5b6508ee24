//! Device timing with CUDA events: a profile window is two timing events on
//! the stream, and its duration is the time between them on the device.

use std::time::Duration;

use cudarc::driver::sys;

use super::driver::driver_error;
use super::events::EventPool;
use crate::error::ServerError;
use crate::id::DeviceId;
use crate::profile::{ProfileDuration, TimingMethod};

/// The start of a device timer: a recorded timing event, handed back to its
/// pool when the timer ends or is dropped unmeasured.
pub(crate) struct DeviceTimer {
    start: sys::CUevent,
    pool: EventPool,
}

impl Drop for DeviceTimer {
    fn drop(&mut self) {
        self.pool.give(self.start);
    }
}

/// Records the start event of a timer on `stream`.
pub(crate) fn start(pool: &EventPool, device: DeviceId, stream: sys::CUstream) -> Result<DeviceTimer, ServerError> {
    let start = pool.take()?;
    // SAFETY: live event and stream of the current context.
    let code = unsafe { sys::cuEventRecord(start, stream) };
    if code != sys::CUresult::CUDA_SUCCESS {
        pool.give(start);
        return Err(driver_error(device, "cuEventRecord (timer start)", code));
    }
    Ok(DeviceTimer { start, pool: pool.clone() })
}

/// Records the end event, waits for it, and returns the time between the two.
pub(crate) fn end(
    pool: &EventPool,
    device: DeviceId,
    stream: sys::CUstream,
    timer: DeviceTimer,
) -> Result<ProfileDuration, ServerError> {
    let end = pool.take()?;
    let mut millis = 0f32;
    // SAFETY: live events and stream of the current context; both events are
    // recorded before the elapsed time is read.
    let result = unsafe {
        let mut code = sys::cuEventRecord(end, stream);
        if code == sys::CUresult::CUDA_SUCCESS {
            code = sys::cuEventSynchronize(end);
        }
        if code == sys::CUresult::CUDA_SUCCESS {
            code = sys::cuEventElapsedTime_v2(&mut millis, timer.start, end);
        }
        code
    };
    drop(timer);
    pool.give(end);
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "timing the profile window", result));
    }
    let duration = Duration::from_secs_f64((millis.max(0.0) as f64) / 1e3).max(Duration::from_nanos(1));
    Ok(ProfileDuration { duration, method: TimingMethod::Device })
}

/// Milliseconds from `from`'s event to `to`'s (negative where `to` was
/// reached first); waits until both were reached. Both were recorded on
/// this device, on any streams.
pub(crate) fn between(device: DeviceId, from: &DeviceTimer, to: &DeviceTimer) -> Result<f64, ServerError> {
    let mut millis = 0f32;
    // SAFETY: live, recorded events of the current context.
    let code = unsafe {
        let mut code = sys::cuEventSynchronize(from.start);
        if code == sys::CUresult::CUDA_SUCCESS {
            code = sys::cuEventSynchronize(to.start);
        }
        if code == sys::CUresult::CUDA_SUCCESS {
            code = sys::cuEventElapsedTime_v2(&mut millis, from.start, to.start);
        }
        code
    };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "reading timestamps (cuEventElapsedTime)", code));
    }
    Ok(f64::from(millis))
}
