//! [`Communicator`]: the collectives of a [`ClientGroup`](crate::ClientGroup)
//! across processes, one rank per process with one or several local devices.
//!
//! A communicator is formed through the rendezvous store: from the
//! launcher's environment ([`Communicator::from_env`]) or an explicit address
//! ([`Communicator::connect`]). Its ranks talk through shared memory on one
//! node and TCP across nodes (see the `transport` module); bytes go from
//! device to host memory (directly on the CPU backend, staged elsewhere),
//! between ranks, and back.
//!
//! Members: with `L` local devices per rank, member `rank × L + l` is local
//! device `l` of `rank` (with one device per process, the member is the
//! rank). Roots are members; every rank must bring the same `L`.
//!
//! # Without `cohort run`
//! Under `mpirun` or `srun` (no `COHORT_STORE_ADDR`), rank 0 serves the store
//! itself on `MASTER_ADDR:MASTER_PORT` (defaults: `127.0.0.1` and a port
//! derived from the job id, `OMPI_MCA_ess_base_jobid` or `SLURM_JOB_ID`, else
//! 29500). The secret is `COHORT_JOB_SECRET`; when it is unset and every rank
//! runs on one node, one is derived from the job id and a warning says it is
//! weak (anyone on the node who can read the job id can join); across nodes
//! `COHORT_JOB_SECRET` is required.

mod algo;
mod api;
mod env;
mod error;
mod fingerprint;
mod local;
mod plans;
mod setup;
mod world;

pub use error::ConnectError;

use std::sync::Arc;
use std::time::Duration;

use cohort_runtime::Client;
use parking_lot::Mutex;

use crate::error::CommError;
use crate::host::default_timeout;
use crate::store::{StoreClient, StoreServer};

use world::World;

/// One rank of a job: collectives with the other processes' ranks.
///
/// Every collective takes one buffer per local device, checks its arguments
/// before anything is queued, queues one task per local device and returns
/// at once; a later read of a destination waits for it. The last local task
/// to start runs the exchange with the other ranks on its device thread.
/// A collective that fails (a timeout, a mismatch between ranks, a lost
/// peer) marks every local destination with the cause and aborts the
/// communicator: later collectives fail at once with the same cause.
///
/// Every rank must call the same collectives in the same order; each call
/// carries a sequence number and a fingerprint (kind, operator, element
/// type, count, root) that its ring neighbour checks, so a rank that calls
/// something else gets an error naming both sides instead of a hang.
///
/// Cloning is cheap; clones share the links.
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    size: usize,
    clients: Vec<Client>,
    timeout: Duration,
    world: Arc<Mutex<World>>,
    /// Sequence number of the last collective issued; held while queueing.
    issued: Mutex<u64>,
    /// The store rank 0 serves when no launcher does (kept alive with it).
    _server: Option<StoreServer>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator").field("rank", &self.rank()).field("size", &self.size()).finish_non_exhaustive()
    }
}

impl Communicator {
    /// Joins the job as `rank` of `world_size` ranks through the store at
    /// `store_addr` (`host:port`), proving `secret`, with `clients` as this
    /// rank's local devices.
    ///
    /// Waits until every rank joined and every link (shared memory within a
    /// node, TCP across) is up, up to the collective timeout (`COHORT_TIMEOUT`
    /// seconds, default 10 minutes). Every rank must pass the same number of
    /// clients.
    pub fn connect(
        rank: usize,
        world_size: usize,
        store_addr: &str,
        secret: &str,
        clients: Vec<Client>,
    ) -> Result<Communicator, ConnectError> {
        Self::connect_inner(rank, world_size, store_addr, secret, clients, None)
    }

    fn connect_inner(
        rank: usize,
        world_size: usize,
        store_addr: &str,
        secret: &str,
        clients: Vec<Client>,
        server: Option<StoreServer>,
    ) -> Result<Communicator, ConnectError> {
        if rank >= world_size {
            return Err(ConnectError::Config(format!("rank {rank} is not below the world size {world_size}")));
        }
        api::check_clients(&clients)?;
        let timeout = default_timeout();
        let store = StoreClient::connect(store_addr, secret, timeout)?;
        let world = setup::form(store, rank, world_size, clients.len(), timeout)?;
        Ok(Communicator {
            inner: Arc::new(Inner {
                rank,
                size: world_size,
                clients,
                timeout,
                world: Arc::new(Mutex::new(world)),
                issued: Mutex::new(0),
                _server: server,
            }),
        })
    }

    /// Joins the job the environment describes: `cohort run`'s and
    /// torchrun's variables, Open MPI's, MPICH's or Slurm's (see
    /// [`LaunchEnv`](crate::launch_env::LaunchEnv)), with `clients` as this
    /// process's devices. See the module docs for jobs without `cohort run`.
    /// Waits as [`Communicator::connect`] does.
    pub fn from_env(clients: Vec<Client>) -> Result<Communicator, ConnectError> {
        let found = env::resolve()?;
        Self::connect_inner(found.rank, found.world_size, &found.store_addr, &found.secret, clients, found.server)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Local devices (buffers per call).
    pub fn local_devices(&self) -> usize {
        self.inner.clients.len()
    }

    /// Members across all ranks: `size() × local_devices()`.
    pub fn members(&self) -> usize {
        self.inner.size * self.inner.clients.len()
    }

    /// This rank's clients, in local order.
    pub fn clients(&self) -> &[Client] {
        &self.inner.clients
    }

    /// How long a collective waits for the other ranks before it fails
    /// (default 10 minutes, or `COHORT_TIMEOUT` seconds).
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// How bytes reach `rank`: "shm", "tcp", or "self".
    pub fn transport_to(&self, rank: usize) -> &'static str {
        self.inner.world.lock().link_kind(rank)
    }

    /// Waits for everything queued on every local device's stream; the
    /// first error found.
    pub fn sync(&self) -> Result<(), CommError> {
        for client in &self.inner.clients {
            client.sync().map_err(|source| CommError::Failed { operation: "sync", source })?;
        }
        Ok(())
    }
}
