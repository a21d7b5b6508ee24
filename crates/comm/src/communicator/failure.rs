//! How a collective between ranks failed: a kind the flight recorder files
//! its dump under, and the message that says what happened and what to do.

/// What went wrong, as a variant (never read back from a message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// Ranks called different collectives (their fingerprints differ).
    Mismatch,
    /// A rank never arrived, or the bytes never moved, within the timeout.
    Timeout,
    /// Another rank aborted the communicator, or an earlier failure did.
    Aborted,
    /// Anything else: a link broke, a peer went away, a local error.
    Other,
}

impl FailureKind {
    /// Why the flight recorder is written for it.
    pub(crate) fn dump_reason(self) -> &'static str {
        match self {
            FailureKind::Mismatch => "mismatch",
            FailureKind::Timeout => "timeout",
            FailureKind::Aborted => "abort",
            FailureKind::Other => "failure",
        }
    }
}

/// A failed collective: its kind and its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub(crate) struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

impl Failure {
    pub(crate) fn new(kind: FailureKind, message: impl Into<String>) -> Failure {
        Failure { kind, message: message.into() }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::new(FailureKind::Other, message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        Failure::new(FailureKind::Other, message)
    }
}
