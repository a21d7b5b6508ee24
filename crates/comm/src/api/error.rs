//! [`Error`]: the one error type of the front door.

use std::fmt;

use cohort_runtime::{ConfigError, ServerError};

use crate::communicator::ConnectError;
use crate::error::CommError;
use crate::launch_env::LaunchEnvError;
use crate::store::StoreError;

/// Anything a program using cohort's front door can be told went wrong:
/// a device's failure, a refused collective, a job that could not form, a
/// launcher environment or `COHORT_*` setting that makes no sense, or a bad
/// argument.
///
/// It converts from every error type of the layers beneath, so `?` works on
/// all of them in one function, and its `Debug` prints the same message as
/// its `Display`: a `main` that returns `Result<(), cohort::Error>` shows
/// the message that says what to do, not a variant name.
#[derive(thiserror::Error)]
pub enum Error {
    /// A device failed, or refused a call (a failed launch, write or
    /// collective marks its buffers; reading one returns why).
    #[error(transparent)]
    Device(#[from] ServerError),
    /// A collective or group was refused before anything was queued.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The job could not form (rendezvous, links, settings).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The launcher's environment does not describe a job.
    #[error(transparent)]
    Env(#[from] LaunchEnvError),
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A `COHORT_*` variable holds a value that cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An argument of a front-door call cannot be used; the message says
    /// which and why.
    #[error("{0}")]
    InvalidArgument(String),
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_same_message_as_display() {
        let err = Error::from(LaunchEnvError::NotFound);
        assert_eq!(format!("{err:?}"), err.to_string());
        assert!(format!("{err:?}").contains("cohort run"), "{err:?}");
        let err = Error::from(CommError::EmptyGroup);
        assert_eq!(format!("{err:?}"), "a group needs at least one client; pass one client per device");
    }
}
