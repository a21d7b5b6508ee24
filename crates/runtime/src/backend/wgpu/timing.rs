//! Device-side timing with timestamp queries.
//!
//! Where the device has `TIMESTAMP_QUERY_INSIDE_ENCODERS`, a timestamp is
//! written straight into the command stream; where it has only
//! `TIMESTAMP_QUERY`, an empty compute pass writes it at its beginning (start)
//! or end (stop), which marks the same point between the passes around it.
//! Neither waits for the stream at the start. Without timestamps the backend
//! falls back to the host clock around a drained stream.

use std::time::Duration;

use crate::error::ServerError;
use crate::profile::{ProfileDuration, TimingMethod};

use super::adapter::Gpu;
use super::queue::{wait_for, Submitter};

/// How this device writes timestamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimestampMode {
    /// `CommandEncoder::write_timestamp`.
    Encoder,
    /// The beginning or end of an empty compute pass.
    Pass,
    /// No timestamp queries: host timing.
    None,
}

impl TimestampMode {
    pub fn of(features: wgpu::Features) -> Self {
        if !features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            TimestampMode::None
        } else if features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS) {
            TimestampMode::Encoder
        } else {
            TimestampMode::Pass
        }
    }
}

/// An open device timer: a query set of two timestamps, the first written.
pub(crate) struct DeviceTimer {
    queries: wgpu::QuerySet,
}

/// Writes timestamp `index` (0: start, 1: stop) of `queries` at the current
/// end of the pending encoder.
fn write(gpu: &Gpu, submitter: &mut Submitter, mode: TimestampMode, queries: &wgpu::QuerySet, index: u32) {
    let encoder = submitter.encoder(gpu);
    match mode {
        TimestampMode::Encoder => encoder.write_timestamp(queries, index),
        TimestampMode::Pass | TimestampMode::None => {
            let writes = wgpu::ComputePassTimestampWrites {
                query_set: queries,
                beginning_of_pass_write_index: (index == 0).then_some(0),
                end_of_pass_write_index: (index == 1).then_some(1),
            };
            drop(encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("cohort timestamp"),
                timestamp_writes: Some(writes),
            }));
        }
    }
    submitter.recorded(gpu);
}

/// Starts a device timer after the work queued so far.
pub(crate) fn start(gpu: &Gpu, submitter: &mut Submitter, mode: TimestampMode) -> Result<DeviceTimer, ServerError> {
    let (queries, error) = gpu.scoped(|| {
        let queries = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("cohort profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        write(gpu, submitter, mode, &queries, 0);
        queries
    });
    match error {
        None => Ok(DeviceTimer { queries }),
        Some(error) => Err(gpu.error(format!("could not start a timestamp query: {error}"))),
    }
}

/// Stops a device timer after the work queued so far, waits for it, and
/// returns the time between the two timestamps.
pub(crate) fn end(
    gpu: &Gpu,
    submitter: &mut Submitter,
    mode: TimestampMode,
    timer: DeviceTimer,
) -> Result<ProfileDuration, ServerError> {
    let (staging, error) = gpu.scoped(|| {
        write(gpu, submitter, mode, &timer.queries, 1);
        let resolved = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cohort timestamps"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cohort timestamps staging"),
            size: 16,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let encoder = submitter.encoder(gpu);
        encoder.resolve_query_set(&timer.queries, 0..2, &resolved, 0);
        encoder.copy_buffer_to_buffer(&resolved, 0, &staging, 0, 16);
        staging
    });
    if let Some(error) = error {
        return Err(gpu.error(format!("could not read the timestamp queries: {error}")));
    }
    let index = submitter.submit_checked(gpu)?;
    let (tx, rx) = std::sync::mpsc::channel();
    staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    wait_for(&gpu.device, index).map_err(|m| gpu.error(m))?;
    rx.recv()
        .map_err(|_| gpu.error("the timestamp buffer's map never completed"))?
        .map_err(|e| gpu.error(format!("mapping the timestamp buffer failed: {e}")))?;
    let ticks = {
        let view = staging.slice(..).get_mapped_range().map_err(|e| gpu.error(e.to_string()))?;
        let start = u64::from_le_bytes(view[0..8].try_into().expect("8 bytes"));
        let stop = u64::from_le_bytes(view[8..16].try_into().expect("8 bytes"));
        stop.saturating_sub(start)
    };
    staging.unmap();
    let nanos = ticks as f64 * f64::from(gpu.queue.get_timestamp_period());
    Ok(ProfileDuration { duration: Duration::from_nanos(nanos.round() as u64), method: TimingMethod::Device })
}
