//! Memory accounting, cleanup, pool layouts and allocation modes.

use std::fmt;

use super::Client;
use crate::error::ServerError;
use crate::memory::{AllocationMode, Cleanup, MemoryPoolsConfig, MemoryUsage};
use crate::state::StreamMemory;

/// Which streams a [`MemoryReport`] covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryScope {
    /// The client's stream alone.
    CurrentStream,
    /// Every stream of the device.
    Device,
}

/// Memory of a device or stream: totals, then each stream's pools.
#[derive(Debug, Clone)]
pub struct MemoryReport {
    pub scope: MemoryScope,
    pub total: MemoryUsage,
    pub streams: Vec<StreamMemory>,
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:?}: {}", self.scope, self.total)?;
        for stream in &self.streams {
            writeln!(f, "{:?}: {}", stream.stream, stream.usage)?;
            for pool in &stream.pools {
                writeln!(f, "  {pool}")?;
            }
        }
        Ok(())
    }
}

/// Resets a stream's allocation mode when dropped, even after a panic.
struct RestoreMode<'a> {
    client: &'a Client,
    previous: AllocationMode,
}

impl Drop for RestoreMode<'_> {
    fn drop(&mut self) {
        let _ = self.client.set_allocation_mode(self.previous);
    }
}

impl Client {
    /// Memory of every stream of the device, after what was queued before
    /// this call.
    pub fn memory_usage(&self) -> Result<MemoryUsage, ServerError> {
        self.device().run(self.stream_id(), |state| state.memory_usage(None))
    }

    /// Memory per stream and per pool, for this client's stream or the whole
    /// device.
    pub fn memory_report(&self, scope: MemoryScope) -> Result<MemoryReport, ServerError> {
        let stream = self.stream_id();
        self.device().run(stream, move |state| {
            let filter = match scope {
                MemoryScope::CurrentStream => Some(stream),
                MemoryScope::Device => None,
            };
            MemoryReport { scope, total: state.memory_usage(filter), streams: state.memory_streams(filter) }
        })
    }

    /// Gives back to the driver every page nothing holds, on every stream.
    /// Waits for the work queued before it.
    pub fn memory_cleanup(&self) -> Result<(), ServerError> {
        self.device().run(self.stream_id(), |state| state.cleanup(Cleanup::Explicit))
    }

    /// Installs a new pool layout. This stream's pools are rebuilt now when
    /// nothing in them is live (returns `true`); otherwise they keep the old
    /// layout (returns `false`, retry once the work drains). Streams created
    /// later use the new layout either way. An invalid layout is refused with
    /// an error and changes nothing.
    pub fn configure_memory_pools(&self, config: &MemoryPoolsConfig) -> Result<bool, ServerError> {
        config.validate().map_err(|e| ServerError::InvalidArgument(format!("memory pool layout: {e}")))?;
        let config = config.clone();
        let stream = self.stream_id();
        self.device().run(stream, move |state| {
            state.pool_config = config.clone();
            state.stream(stream);
            let stream_state = state.streams.get_mut(&stream).expect("stream exists");
            stream_state
                .pools
                .reconfigure(state.backend.storage(), &config)
                .map_err(|e| ServerError::InvalidArgument(format!("memory pool layout: {e}")))
        })?
    }

    /// Sets how this stream allocates from now on: `Auto` (dynamic pools),
    /// `Persistent` (the persistent pool, for weights and graph captures) or
    /// `Dedicated` (a page of its own per allocation).
    pub fn set_allocation_mode(&self, mode: AllocationMode) -> Result<(), ServerError> {
        let stream = self.stream_id();
        self.device().submit(stream, move |state| state.stream(stream).mode = mode)
    }

    fn allocation_mode_of_stream(&self) -> Result<AllocationMode, ServerError> {
        let stream = self.stream_id();
        self.device().run(stream, move |state| state.stream(stream).mode)
    }

    /// Runs `task(input)` with this stream's allocations going to the
    /// persistent pool, then restores the previous mode.
    pub fn memory_persistent_allocation<I: Send, R: Send>(
        &self,
        input: I,
        task: impl FnOnce(I) -> R + Send,
    ) -> Result<R, ServerError> {
        self.with_allocation_mode(AllocationMode::Persistent, input, task)
    }

    /// Runs `task(input)` with each of this stream's allocations getting a
    /// page of its own, then restores the previous mode.
    pub fn memory_dedicated_allocation<I: Send, R: Send>(
        &self,
        input: I,
        task: impl FnOnce(I) -> R + Send,
    ) -> Result<R, ServerError> {
        self.with_allocation_mode(AllocationMode::Dedicated, input, task)
    }

    fn with_allocation_mode<I, R>(
        &self,
        mode: AllocationMode,
        input: I,
        task: impl FnOnce(I) -> R,
    ) -> Result<R, ServerError> {
        let previous = self.allocation_mode_of_stream()?;
        self.set_allocation_mode(mode)?;
        let _restore = RestoreMode { client: self, previous };
        Ok(task(input))
    }
}
