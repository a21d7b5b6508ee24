//! Collective communication over cohort runtimes.
//!
//! The front door is the [`Collectives`] trait over typed [`Buffer`]s: the
//! same calls run in one process over several devices ([`ClientGroup`]),
//! as one rank of a job of several processes ([`Communicator`]), or as
//! whichever of the two the process was started as ([`World`]). Every error
//! converts into [`Error`].
//!
//! Beneath it, each collective also takes untyped runtime handles with an
//! explicit [`DType`] (`all_reduce_handles` and the rest), for code that
//! handles many element types at once. On the CPU backend the host engine
//! reduces straight in device memory; on CUDA collectives go through NCCL;
//! elsewhere they stage through host memory, chunk by chunk.
mod api;
pub mod store;

mod communicator;
mod transport;

mod check;
mod device;
pub mod digest;
mod end_watch;
mod error;
mod group;
mod grouped;
mod host;
pub mod launch_env;
mod meeting;
mod mesh;
pub mod op;
mod ops;
mod order;
mod part_end;
pub mod trace;
pub mod verify;
mod work;

pub use api::{rank_clients, Buffer, Collectives, Error, Grouped, IntoOwnerError, OnStream, Refused, World};
pub use communicator::{job_heartbeat_key, Communicator, ConnectError, HEARTBEAT_PERIOD};
pub use device::peer::{Algo, Crossover, CrossoverRow, Path, TableKind};

/// What a running communicator publishes about itself in the rendezvous
/// store, for tools outside its ranks: `cohort status` (progress, current
/// call, who left) and `cohort run --timings` (start-up phases).
pub mod published {
    pub use crate::communicator::{
        abort_key, arrived_key, call_key, communicator_prefix, directory_key, gone_key, newest_communicator_key,
        parse_phases, parse_progress, progress_key, startup_timings_key, CurrentCall,
    };
}
pub use device::Transport;
pub use error::CommError;
pub use group::{to_client, ClientGroup, DEFAULT_STAGE_CHUNK};
pub use grouped::{CallHandles, GroupCall};
pub use host::{default_timeout, HostPath, DEFAULT_TIMEOUT};
pub use mesh::{Mesh, MeshOver};
pub use ops::{combine, finish, reduce_bytes, DType, Element, ReduceOp};
pub use order::DeviceSetComm;
pub use transport::shm::sweep_shared_memory;
pub use work::Work;
