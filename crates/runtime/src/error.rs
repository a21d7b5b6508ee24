//! The errors a runtime call can return.

use std::sync::Arc;

use crate::id::{DeviceId, ServiceId, StreamId};

/// Why work on a device failed.
///
/// A `ServerError` is returned by calls that wait (reads, `sync`, `check`) and is
/// attached to every buffer that a failed launch, write or collective should have
/// written, so a later read of such a buffer returns the cause. It is cheap to
/// clone: buffers that share a failure share one error.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ServerError {
    /// The device's server thread has shut down (the process is exiting, or the
    /// device was closed explicitly). Create a new client for a live device.
    #[error("device {device} is closed: its server thread has shut down; no more work can run on it")]
    DeviceClosed { device: DeviceId },
    /// A handle that belongs to another device was passed to this one.
    #[error("handle belongs to {handle_service} but was used on {client_service}: move it with `to_client` first")]
    ForeignHandle { handle_service: ServiceId, client_service: ServiceId },
    /// A task on the device thread panicked; the message is the panic's payload.
    #[error("a task panicked on the server thread of {device}: {message}")]
    TaskPanicked { device: DeviceId, message: String },
    /// The kernel has no source for this backend.
    #[error("kernel `{kernel}` has no source for the {backend} backend: add one with the matching `with_*` builder")]
    MissingKernelSource { kernel: String, backend: &'static str },
    /// A kernel failed (panicked, faulted, or did not compile).
    #[error("kernel `{kernel}` failed on {device}: {reason}")]
    KernelFailed { kernel: String, device: DeviceId, reason: String },
    /// Not enough memory on the device for an allocation.
    #[error("out of memory on {device}: could not reserve {requested} bytes ({reason})")]
    OutOfMemory { device: DeviceId, requested: u64, reason: String },
    /// The call is not allowed in the current state (inside a capture window,
    /// say); the message says what to do instead.
    #[error("{operation} is not allowed now: {reason}")]
    InvalidState { operation: &'static str, reason: String },
    /// An argument is wrong (a size, a layout, an index); the message names it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The backend does not support the requested feature.
    #[error("{feature} is not supported by the {backend} backend")]
    Unsupported { feature: &'static str, backend: &'static str },
    /// The backend's driver returned an error.
    #[error("{backend} driver error on {device}: {message}")]
    Backend { backend: &'static str, device: DeviceId, message: String },
    /// A collective (all-reduce, broadcast, ...) failed: a member did not
    /// arrive in time, the transport broke, or the members disagreed.
    #[error("{collective} failed on {device}: {reason}")]
    Collective { collective: String, device: DeviceId, reason: String },
    /// This buffer was not written because an earlier operation failed; the
    /// cause is that operation's error.
    #[error("buffer was not written because {operation} failed: {cause}")]
    Poisoned { operation: String, cause: Arc<ServerError> },
    /// A `COHORT_*` environment variable has a value that cannot be used;
    /// the message names it and says what is expected. (Boxed: it is rare,
    /// and every other variant stays small.)
    #[error(transparent)]
    Variable(Box<crate::config::ConfigError>),
}

impl From<crate::config::ConfigError> for ServerError {
    fn from(err: crate::config::ConfigError) -> Self {
        ServerError::Variable(Box::new(err))
    }
}

impl ServerError {
    /// The error that started a chain of [`ServerError::Poisoned`] markings.
    pub fn root_cause(&self) -> &ServerError {
        match self {
            ServerError::Poisoned { cause, .. } => cause.root_cause(),
            other => other,
        }
    }
}

/// An invalid memory-pool layout given to `configure_memory_pools`.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum MemoryConfigError {
    #[error("the pool layout is empty: give at least one pool")]
    Empty,
    #[error("the pool layout has {count} pools; at most {max} are allowed")]
    TooManyPools { count: usize, max: usize },
    #[error("pool {index} has a page size of 0 bytes")]
    ZeroPageSize { index: usize },
    #[error("pool {index}: its largest slice ({max_slice_size} bytes) is larger than its page ({page_size} bytes)")]
    SliceLargerThanPage { index: usize, max_slice_size: u64, page_size: u64 },
    #[error("pool {index}: its page cap ({max_page_size} bytes) is smaller than its page ({page_size} bytes)")]
    CapSmallerThanPage { index: usize, max_page_size: u64, page_size: u64 },
}

/// Why a profile could not be taken.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ProfileError {
    #[error("profiled work failed: {0}")]
    Server(#[from] ServerError),
    #[error(
        "this profile window was opened on {opened:?} and closed on {closed:?}: open and close it from the same stream"
    )]
    WrongStream { opened: StreamId, closed: StreamId },
    #[error("the profiled closure panicked: {0}")]
    Panicked(String),
}
