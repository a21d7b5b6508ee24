//! Timing of device work.

use std::fmt;
use std::time::Duration;

use crate::id::StreamId;

/// How a duration was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimingMethod {
    /// On the device (CUDA events, wgpu timestamp queries).
    Device,
    /// With the host clock, around a drained stream: includes launch and
    /// synchronisation overhead.
    Host,
}

/// A measured duration and how it was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProfileDuration {
    pub duration: Duration,
    pub method: TimingMethod,
}

impl fmt::Display for ProfileDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.method {
            TimingMethod::Device => "device",
            TimingMethod::Host => "host",
        };
        write!(f, "{:?} ({how} timing)", self.duration)
    }
}

/// An open profile from `Client::profile_start`; close it with `profile_end`
/// or `profile_abandon` on a client of the same stream.
pub struct ProfileWindow {
    pub(crate) stream: StreamId,
    pub(crate) token: u64,
}

impl fmt::Debug for ProfileWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProfileWindow").field("stream", &self.stream).field("token", &self.token).finish()
    }
}
