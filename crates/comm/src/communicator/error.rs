//! Why a communicator could not be formed.

use cohort_runtime::ConfigError;

use crate::launch_env::LaunchEnvError;
use crate::store::StoreError;
use crate::CommError;

/// Why [`Communicator::connect`](super::Communicator::connect) or
/// [`Communicator::from_env`](super::Communicator::from_env) failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The process environment does not describe a job.
    #[error("cannot tell this process's rank: {0}")]
    Env(#[from] LaunchEnvError),
    /// The rendezvous store failed (unreachable, wrong secret, timeout).
    #[error("rendezvous failed: {0}")]
    Store(#[from] StoreError),
    /// The clients passed are not a valid local group.
    #[error(transparent)]
    Clients(#[from] CommError),
    /// A setting is missing or wrong.
    #[error("{0}")]
    Config(String),
    /// A `COHORT_*` variable has a value that cannot be used.
    #[error(transparent)]
    Variable(#[from] ConfigError),
    /// Links between ranks could not be formed.
    #[error("forming the links between ranks failed: {0}")]
    Setup(String),
}
