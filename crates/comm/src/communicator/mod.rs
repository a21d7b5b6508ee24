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
//!
//! # Transports
//! - **Host links** (every backend): shared memory between the ranks of one
//!   node, TCP across nodes, under ring and recursive halving-doubling.
//! - **MPI** (the `mpi` feature): when the process was started by `mpirun`
//!   (`OMPI_COMM_WORLD_RANK` is set) or `COHORT_TRANSPORT=mpi`,
//!   [`Communicator::from_env`] forms the ranks from `MPI_COMM_WORLD` and the
//!   host links are MPI point-to-point messages (`MPI_Isend`/`MPI_Irecv` on a
//!   duplicate of `MPI_COMM_WORLD`) under the same ring and halving-doubling
//!   algorithms, not MPI's own collectives. No `MASTER_ADDR`, `MASTER_PORT`
//!   or `COHORT_JOB_SECRET` is needed then: rank 0 serves the store (aborts,
//!   heartbeats, timeouts naming ranks) on a free port under a random secret
//!   and hands both to the others with `MPI_Bcast`. `COHORT_TRANSPORT=host`
//!   keeps shared memory and TCP under `mpirun`.
//! - **NCCL** (CUDA): when every local device of every rank is CUDA and
//!   libnccl loads, the collectives run device to device on one NCCL
//!   communicator over every member, its id shared through the store; see
//!   [`Communicator::transport`]. The host links still carry each call's
//!   fingerprint check (and, with several devices per rank, `send`/`recv`).
//!
//! # Groups
//! [`Communicator::split`], [`Communicator::split_members`] and
//! [`Communicator::subgroup`] make communicators over some of the members,
//! collectively over this one (see the `split` module for what a group
//! shares with its parent). [`Mesh::new`](crate::Mesh::new) over a
//! communicator splits it once per dimension. Grouped calls
//! ([`Collectives::group`](crate::Collectives::group)) are one call between
//! ranks: one fingerprint and one meeting for the whole group.

mod algo;
mod api;
mod env;
mod error;
mod failure;
mod fingerprint;
mod keys;
mod label;
mod local;
mod nccl;
mod observe;
mod plans;
mod setup;
mod split;
mod standing;
mod timings;
mod world;

pub use error::ConnectError;
pub use keys::job_heartbeat_key;
pub use keys::{
    abort_key, arrived_key, call_key, communicator_prefix, directory_key, gone_key, newest_communicator_key,
    parse_progress, progress_key, startup_timings_key, CurrentCall,
};
pub use observe::HEARTBEAT_PERIOD;
pub use timings::parse_phases;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use cohort_runtime::{config, Client};
use parking_lot::Mutex;

use crate::error::CommError;
use crate::host::default_timeout;
use crate::store::{StoreClient, StoreServer};

use world::World;

/// One optional buffer per local device (slot): inline, without a heap
/// allocation, for up to two local devices.
pub(crate) type Slots = smallvec::SmallVec<[Option<cohort_runtime::Handle>; 2]>;

/// One call of a grouped call: its description, inputs and outputs by slot.
pub(crate) type SlotCall = (crate::op::Op, Slots, Slots);

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
/// type, count, root) that the other ranks check (every other rank in a
/// job of up to eight, the ring neighbours in a larger one), so a rank that
/// calls something else gets an error naming both sides instead of a hang.
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
    timeout: Mutex<Duration>,
    world: Arc<Mutex<World>>,
    /// Heartbeat, flight recorder and timeline hooks.
    observer: observe::Observer,
    /// The NCCL side, when every rank's devices can take it.
    nccl: Option<Arc<nccl::Nccl>>,
    /// Sequence number of the last collective issued; held while queueing.
    issued: Mutex<u64>,
    /// Its name and job ranks (the world's label, kept here to read
    /// without the world's lock).
    label: label::Label,
    /// Who this process is ("rank 1"), and where the other ranks stand in
    /// a call, for its handles' errors (shared by every handle, made once).
    ranks: Arc<standing::RankView>,
    /// How many splits this communicator made (names the next one's keys).
    splits: AtomicU64,
    /// The communicator a group was split from (kept alive with it: its
    /// store, and its store server where it serves one).
    _parent: Option<Communicator>,
    /// The store rank 0 serves when no launcher does (kept alive with it).
    _server: Option<StoreServer>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(nccl) = &self.nccl {
            nccl.release();
        }
    }
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
    /// Under `cohort run` with a node relay, the store is reached through
    /// the relay's sockets the launcher passed in `COHORT_STORE_FD` (see
    /// [`StoreClient::connect_rank`]).
    ///
    /// Waits until every rank joined and every link (shared memory within a
    /// node, TCP across) is up, up to the collective timeout (`COHORT_TIMEOUT`
    /// seconds, default 10 minutes). Every rank must pass the same number of
    /// clients. An unusable `COHORT_TIMEOUT`, `COHORT_FLIGHT_RECORDER`,
    /// `COHORT_DESYNC_CHECK` or `COHORT_SHM_RING` is returned as
    /// [`ConnectError::Variable`].
    pub fn connect(
        rank: usize,
        world_size: usize,
        store_addr: &str,
        secret: &str,
        clients: Vec<Client>,
    ) -> Result<Communicator, ConnectError> {
        Self::connect_inner(rank, world_size, store_addr, secret, clients, None, None)
    }

    fn connect_inner(
        rank: usize,
        world_size: usize,
        store_addr: &str,
        secret: &str,
        clients: Vec<Client>,
        server: Option<StoreServer>,
        given: Option<Vec<Option<Box<dyn crate::transport::Link>>>>,
    ) -> Result<Communicator, ConnectError> {
        if world_size > crate::launch_env::MAX_WORLD_SIZE {
            return Err(ConnectError::Config(format!(
                "world size {world_size} is more than a job can have ({} ranks)",
                crate::launch_env::MAX_WORLD_SIZE
            )));
        }
        if rank >= world_size {
            return Err(ConnectError::Config(format!("rank {rank} is not below the world size {world_size}")));
        }
        crate::check::check_clients(&clients)?;
        let timeout = default_timeout()?;
        config::check(&[&config::FLIGHT_RECORDER, &config::DESYNC_CHECK, &config::SHM_RING, &config::FUSION_MB])?;
        // Through the node's relay when the launcher gave this rank one
        // (COHORT_STORE_FD); otherwise the first request (the instance
        // counter) rides on the handshake: a wrong secret fails it with the
        // store's refusal.
        let store = StoreClient::connect_rank(store_addr, secret, timeout)?;
        let world = match given {
            #[cfg(feature = "mpi")]
            Some(links) => setup::form_with_links(store, rank, world_size, clients.len(), timeout, links)?,
            _ => setup::form(store, rank, world_size, clients.len(), timeout)?,
        };
        let observer = observe::Observer::start(&world)?;
        let nccl = nccl::setup(&world, &clients)?;
        timings::passed(world.store(), world.prefix(), rank, "ready", std::time::Instant::now());
        Ok(Communicator::assemble(world, clients, timeout, observer, nccl, None, server))
    }

    /// A communicator over a formed `world` (its rank, size and label are
    /// the world's): the one place its state is put together, for a
    /// connected communicator and for a group split from one (`parent`,
    /// kept alive with it).
    fn assemble(
        world: World,
        clients: Vec<Client>,
        timeout: Duration,
        observer: observe::Observer,
        nccl: Option<Arc<nccl::Nccl>>,
        parent: Option<Communicator>,
        server: Option<StoreServer>,
    ) -> Communicator {
        let ranks = standing::RankView::new(world.shared_store(), world.prefix(), &world.label, world.rank, world.size);
        Communicator {
            inner: Arc::new(Inner {
                ranks: Arc::new(ranks),
                label: world.label.clone(),
                rank: world.rank,
                size: world.size,
                clients,
                timeout: Mutex::new(timeout),
                world: Arc::new(Mutex::new(world)),
                observer,
                nccl,
                issued: Mutex::new(0),
                splits: AtomicU64::new(0),
                _parent: parent,
                _server: server,
            }),
        }
    }

    /// Joins the job the environment describes: `cohort run`'s and
    /// torchrun's variables, Open MPI's, MPICH's or Slurm's (see
    /// [`LaunchEnv`](crate::launch_env::LaunchEnv)), with `clients` as this
    /// process's devices. See the module docs for jobs without `cohort run`.
    /// Waits as [`Communicator::connect`] does.
    ///
    /// Under `mpirun` with the `mpi` feature (or `COHORT_TRANSPORT=mpi`) this
    /// is `Communicator::from_mpi` (built with that feature); see the module
    /// docs' transports.
    pub fn from_env(clients: Vec<Client>) -> Result<Communicator, ConnectError> {
        let mpi = setup::mpi_wanted()?;
        #[cfg(feature = "mpi")]
        if mpi {
            return Self::from_mpi(clients);
        }
        #[cfg(not(feature = "mpi"))]
        let _ = mpi;
        let found = env::resolve()?;
        let (rank, size, addr, secret) = (found.rank, found.world_size, &found.store_addr, &found.secret);
        Self::connect_inner(rank, size, addr, secret, clients, found.server, None)
    }

    /// Joins the `mpirun` job this process belongs to, with MPI as the host
    /// transport: ranks are `MPI_COMM_WORLD`'s, links are MPI messages, and
    /// rank 0's store is found through `MPI_Bcast` (see the module docs).
    /// Initialises MPI (`MPI_THREAD_MULTIPLE`, finalised at exit) unless the
    /// program did, which must then have asked for `MPI_THREAD_SERIALIZED` or
    /// more. Collective: every rank calls it, in the same order as its other
    /// communicators. Waits as [`Communicator::connect`] does.
    #[cfg(feature = "mpi")]
    pub fn from_mpi(clients: Vec<Client>) -> Result<Communicator, ConnectError> {
        use crate::transport::mpi;
        let setup = |e: std::io::Error| ConnectError::Setup(format!("MPI: {e}"));
        let comm = mpi::Comm::world().map_err(setup)?;
        let (rank, size) = comm.rank_size();
        let (addr, secret, server) = mpi::rendezvous(&comm).map_err(setup)?;
        let links = mpi::links(&comm).map_err(setup)?;
        Self::connect_inner(rank, size, &addr, &secret, clients, server, Some(links))
    }

    /// How this communicator's collectives move bytes: [`Transport::Nccl`]
    /// (device to device, CUDA), [`Transport::HostDirect`] (CPU memory) or
    /// [`Transport::HostStaged`] (through host memory); between ranks, host
    /// bytes travel as [`Communicator::transport_to`] says.
    ///
    /// [`Transport::Nccl`]: crate::Transport::Nccl
    /// [`Transport::HostDirect`]: crate::Transport::HostDirect
    /// [`Transport::HostStaged`]: crate::Transport::HostStaged
    pub fn transport(&self) -> crate::Transport {
        if self.inner.nccl.is_some() {
            crate::Transport::Nccl
        } else if self.inner.clients[0].capabilities().host_addressable_memory {
            crate::Transport::HostDirect
        } else {
            crate::Transport::HostStaged
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Call `seq` of this communicator (a message to or from `peer`) as
    /// its handle names it in a timed wait's error: `rank 1`, or `rank 3
    /// in group comm1.s0c1 (ranks 1, 3)` (by job rank), and the other ranks
    /// it waits for.
    fn call(&self, seq: u64, peer: Option<usize>) -> (Arc<dyn crate::work::Ranks>, crate::work::RankCall) {
        (self.inner.ranks.clone(), crate::work::RankCall { seq, peer })
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
        *self.inner.timeout.lock()
    }

    /// Sets how long later collectives wait for the other ranks before they
    /// fail, name the ranks that never arrived and abort the communicator
    /// (every clone shares it). Waits for the collective running now, if
    /// any, to release the links. Every rank should set the same value.
    pub fn set_timeout(&self, timeout: Duration) {
        let timeout = crate::host::bounded_timeout(timeout);
        self.inner.world.lock().timeout = timeout;
        *self.inner.timeout.lock() = timeout;
    }

    /// Writes this process's flight recorder (its last collectives, with
    /// their start, end and state) as JSON to `COHORT_TRACE_DIR` (default
    /// `cohort-trace`) as `rank<R>.json`, and returns the path; merge the
    /// ranks' files with `cohort trace <dir>`. It is also written on a
    /// timeout, an abort, a mismatch and on SIGUSR1.
    pub fn dump_flight_recorder(&self) -> std::io::Result<std::path::PathBuf> {
        crate::trace::FlightRecorder::global().write_to(&crate::trace::trace_dir(), "request")
    }

    /// How host bytes reach `rank`: "shm", "tcp", "mpi", or "self".
    pub fn transport_to(&self, rank: usize) -> &'static str {
        self.inner.world.lock().link_kind(rank)
    }

    /// Waits for everything queued on every local device's stream (all at
    /// once); the first error in device order.
    pub fn sync(&self) -> Result<(), CommError> {
        Client::sync_all(&self.inner.clients).map_err(|source| CommError::Failed { operation: "sync", source })
    }
}
