//! Device timestamps: points on streams of one device, read afterwards on
//! one timebase, to see when work on different streams ran (a collective on
//! one stream beside compute on another, say).
//!
//! [`Client::timestamp`] queues a point on the client's stream after the
//! work queued there so far and returns at once on CUDA (a timing event);
//! [`Client::timestamps_since`] later waits for the points and returns each
//! one's milliseconds after an origin. On the CPU and wgpu backends a
//! timestamp drains its stream and reads the host clock
//! ([`TimingMethod::Host`]): on the CPU backend that is when the work before
//! it ran; on wgpu it includes the wait for the device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Client;
use crate::device::DeviceHandle;
use crate::error::{ProfileError, ServerError};
use crate::id::{ServiceId, StreamId};
use crate::profile::TimingMethod;

/// Tokens of timestamps, unique in the process.
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// A point on one stream of one device, from [`Client::timestamp`]. Read it
/// with [`Client::timestamps_since`] on a client of the same device; the
/// device forgets it when it is dropped.
pub struct Timestamp {
    device: Arc<DeviceHandle>,
    stream: StreamId,
    token: u64,
}

impl Timestamp {
    /// The stream it was taken on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The device (opening) it was taken on.
    pub fn service_id(&self) -> ServiceId {
        self.device.service
    }
}

impl std::fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timestamp")
            .field("service", &self.device.service)
            .field("stream", &self.stream)
            .field("token", &self.token)
            .finish()
    }
}

impl Drop for Timestamp {
    fn drop(&mut self) {
        let token = self.token;
        // A closed device forgot it already.
        let _ = self.device.submit(self.stream, move |state| {
            state.timestamps.remove(&token);
        });
    }
}

impl Client {
    /// Queues a timestamp on this client's stream, after the work queued on
    /// it so far, and returns it. On CUDA this records a timing event and
    /// returns at once (the stream does not wait); on the CPU and wgpu
    /// backends the device thread drains the stream and reads the host
    /// clock. Refused inside a capture window (the capture goes on).
    pub fn timestamp(&self) -> Result<Timestamp, ServerError> {
        self.refuse_if_capturing("timestamp")?;
        let stream = self.stream_id();
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        self.device.submit(stream, move |state| {
            let taken = if state.is_capturing(stream) {
                Err(ServerError::InvalidState {
                    operation: "timestamp",
                    reason: "its stream was inside a capture window".into(),
                })
            } else {
                state.backend.timestamp(stream)
            };
            state.timestamps.insert(token, taken);
        })?;
        Ok(Timestamp { device: self.device.clone(), stream, token })
    }

    /// Milliseconds from `origin` to each of `stamps` (negative for a stamp
    /// reached before the origin), and how they were taken. Every timestamp
    /// must come from this client's device, from any of its streams. Waits
    /// until the device reached each of them (on CUDA, a failed or expired
    /// collective is ended rather than waited for).
    ///
    /// A timestamp from another device, or one that could not be taken (a
    /// lost device), is an error naming it.
    pub fn timestamps_since(
        &self,
        origin: &Timestamp,
        stamps: &[&Timestamp],
    ) -> Result<(Vec<f64>, TimingMethod), ProfileError> {
        let service = self.service_id();
        for (i, stamp) in std::iter::once(origin).chain(stamps.iter().copied()).enumerate() {
            if stamp.device.service != service {
                let which = if i == 0 { "the origin".to_string() } else { format!("timestamp {}", i - 1) };
                return Err(ProfileError::Server(ServerError::InvalidArgument(format!(
                    "timestamps_since on {service}: {which} was taken on {}: read timestamps on the device they were taken on",
                    stamp.device.service
                ))));
            }
        }
        let from = origin.token;
        let tokens: Vec<u64> = stamps.iter().map(|s| s.token).collect();
        let answer = self.device.run(self.stream_id(), move |state| {
            let taken =
                |state: &crate::state::DeviceState, token: u64, which: String| match state.timestamps.get(&token) {
                    Some(Ok(_)) => Ok(()),
                    Some(Err(err)) => Err(ServerError::InvalidState {
                        operation: "timestamps_since",
                        reason: format!("{which} was not taken: {err}"),
                    }),
                    None => Err(ServerError::InvalidState {
                        operation: "timestamps_since",
                        reason: format!("{which} is unknown to this device"),
                    }),
                };
            taken(state, from, "the origin".into())?;
            for (i, &t) in tokens.iter().enumerate() {
                taken(state, t, format!("timestamp {i}"))?;
            }
            let mut method = TimingMethod::Device;
            let mut out = Vec::with_capacity(tokens.len());
            for &t in &tokens {
                let (Some(Ok(a)), Some(Ok(b))) = (state.timestamps.get(&from), state.timestamps.get(&t)) else {
                    unreachable!("checked above");
                };
                let (ms, how) = state.backend.time_between(a, b)?;
                if how == TimingMethod::Host {
                    method = TimingMethod::Host;
                }
                out.push(ms);
            }
            Ok::<_, ServerError>((out, method))
        })??;
        Ok(answer)
    }
}
