//! Collective communication over cohort runtimes.
//!
//! A [`ClientGroup`] holds one client per device of one runtime and runs
//! every collective across them: [`all_reduce`](ClientGroup::all_reduce),
//! [`reduce`](ClientGroup::reduce), [`broadcast`](ClientGroup::broadcast),
//! [`all_gather`](ClientGroup::all_gather),
//! [`reduce_scatter`](ClientGroup::reduce_scatter),
//! [`all_to_all`](ClientGroup::all_to_all), [`gather`](ClientGroup::gather),
//! [`scatter`](ClientGroup::scatter), [`send_recv`](ClientGroup::send_recv)
//! and [`barrier`](ClientGroup::barrier). On the CPU backend the host engine
//! reduces straight in device memory; elsewhere it stages through host
//! memory, chunk by chunk.
pub mod store;

mod communicator;
mod transport;

mod check;
mod device;
mod error;
mod group;
mod host;
pub mod launch_env;
mod meeting;
pub mod op;
mod ops;
mod order;
pub mod trace;
pub mod verify;

pub use communicator::{job_heartbeat_key, Communicator, ConnectError, HEARTBEAT_PERIOD};
pub use device::Transport;
pub use error::CommError;
pub use group::{to_client, ClientGroup, DEFAULT_STAGE_CHUNK};
pub use host::{default_timeout, HostPath, DEFAULT_TIMEOUT};
pub use ops::{combine, finish, reduce_bytes, DType, Element, ReduceOp};
pub use order::DeviceSetComm;
