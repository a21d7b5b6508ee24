//! [`World`]: the job this process belongs to, however it was started, and
//! [`rank_clients`]: the devices a rank should bring to it.

use cohort_runtime::{Client, Handle};

use super::{Collectives, Error};
use crate::communicator::Communicator;
use crate::device::Transport;
use crate::error::CommError;
use crate::group::ClientGroup;
use crate::launch_env::{LaunchEnv, LaunchEnvError};
use crate::ops::{DType, ReduceOp};
use crate::work::Work;

/// Every device of the job, as this process sees it: a [`ClientGroup`] when
/// the process runs alone (no launcher), a [`Communicator`] when `cohort
/// run`, torchrun, `mpirun` or `srun` started it as one rank of several.
///
/// A training loop written against [`Collectives`] runs unchanged either
/// way:
///
/// ```no_run
/// use cohort_comm::{rank_clients, Collectives, Error, ReduceOp, World};
///
/// fn main() -> Result<(), Error> {
///     // One device per rank under a launcher, every CPU device otherwise.
///     let world = World::join(rank_clients("cpu", None)?)?;
///     let grads = world.replicate(&[1.0f32; 1024])?;
///     world.all_reduce(&grads, &grads, ReduceOp::Avg)?;
///     println!("member {} of {}: {:?}", world.first_member(), world.members(), &grads[0].to_vec()?[..4]);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub enum World {
    /// This process alone, over its devices.
    Local(ClientGroup),
    /// One rank of a job of several processes.
    Ranks(Communicator),
}

impl World {
    /// Joins the job the environment describes with `clients` as this
    /// process's devices: a [`Communicator`] (waits for every rank, as
    /// [`Communicator::from_env`] does) when a launcher's variables are set,
    /// else a [`ClientGroup`] over `clients`. Launcher variables that make
    /// no sense are an error, never a silent one-process run.
    pub fn join(clients: Vec<Client>) -> Result<World, Error> {
        match LaunchEnv::from_process() {
            Ok(_) => Ok(World::Ranks(Communicator::from_env(clients)?)),
            Err(LaunchEnvError::NotFound) => Ok(World::Local(ClientGroup::new(clients)?)),
            Err(err) => Err(err.into()),
        }
    }

    /// Whether this process is rank 0 (the one that should print).
    pub fn leads(&self) -> bool {
        self.rank() == 0
    }

    /// Splits the job's processes by `color`, as `MPI_Comm_split` does:
    /// processes that pass the same color form a group, ordered by `key`
    /// and then by rank; one that passes `None` joins no group and gets
    /// `None`. Every local device of this process joins with the same color
    /// and key (see [`World::split_members`] for one per device).
    ///
    /// As one rank of a job it is [`Communicator::split`]: collective over
    /// the job (every rank calls it, in the same order as its collectives)
    /// and it waits until the group that holds this rank is formed, up to
    /// the timeout. Alone, this process is the job's only rank: a color
    /// gives the group of all its devices, in the same order (a new
    /// [`ClientGroup`] over them with this one's timeout and host path),
    /// `None` gives `None`; nothing waits.
    ///
    /// ```
    /// use cohort_comm::{Collectives, Error, World};
    /// use cohort_runtime::{CpuRuntime, Runtime};
    ///
    /// fn main() -> Result<(), Error> {
    ///     let world = World::Local(cohort_comm::ClientGroup::new(CpuRuntime::clients()?)?);
    ///     // Even ranks in one group, odd ranks in another (alone: rank 0).
    ///     let half = world.split(Some((world.rank() % 2) as u32), 0)?.expect("a color joins a group");
    ///     assert_eq!(half.members(), world.members());
    ///     assert!(world.split(None, 0)?.is_none());
    ///     Ok(())
    /// }
    /// ```
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<World>, CommError> {
        Ok(match self {
            World::Local(g) => {
                let n = g.len();
                g.split(&vec![color; n], &vec![key; n])?.into_iter().flatten().next().map(World::Local)
            }
            World::Ranks(c) => c.split(color, key)?.map(World::Ranks),
        })
    }

    /// Splits the job's members by color, as `MPI_Comm_split` does, with
    /// one color and key per local device (`colors[l]`, `keys[l]`): members
    /// of one color form a group ordered by key, then member number; `None`
    /// joins no group. Returns local device `l`'s group at index `l`. Alone,
    /// every member is local ([`ClientGroup::split`]); as one rank of a job
    /// it is collective over the job ([`Communicator::split_members`]).
    pub fn split_members(&self, colors: &[Option<u32>], keys: &[i64]) -> Result<Vec<Option<World>>, CommError> {
        Ok(match self {
            World::Local(g) => g.split(colors, keys)?.into_iter().map(|g| g.map(World::Local)).collect(),
            World::Ranks(c) => c.split_members(colors, keys)?.into_iter().map(|c| c.map(World::Ranks)).collect(),
        })
    }

    /// The group of `members` (member `i` of it being `members[i]`), or
    /// `None` where this process holds none of them. As one rank of a job
    /// it is collective: every rank passes the same list
    /// ([`Communicator::subgroup`]).
    pub fn subgroup(&self, members: &[usize]) -> Result<Option<World>, CommError> {
        Ok(match self {
            World::Local(g) => Some(World::Local(g.subgroup(members)?)),
            World::Ranks(c) => c.subgroup(members)?.map(World::Ranks),
        })
    }
}

/// `$body` with `$c` bound to the world's group or communicator.
macro_rules! each {
    ($world:expr, $c:ident => $body:expr) => {
        match $world {
            World::Local($c) => $body,
            World::Ranks($c) => $body,
        }
    };
}

impl Collectives for World {
    fn clients(&self) -> &[Client] {
        each!(self, c => Collectives::clients(c))
    }
    fn members(&self) -> usize {
        each!(self, c => Collectives::members(c))
    }
    fn first_member(&self) -> usize {
        each!(self, c => Collectives::first_member(c))
    }
    fn rank(&self) -> usize {
        each!(self, c => Collectives::rank(c))
    }
    fn world_size(&self) -> usize {
        each!(self, c => Collectives::world_size(c))
    }
    fn transport(&self) -> Transport {
        each!(self, c => Collectives::transport(c))
    }
    fn sync(&self) -> Result<(), CommError> {
        each!(self, c => Collectives::sync(c))
    }
    fn barrier(&self) -> Result<(), CommError> {
        each!(self, c => Collectives::barrier(c))
    }
    fn all_reduce_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        each!(self, c => c.all_reduce_handles(src, dst, dtype, op))
    }
    fn reduce_handles(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, CommError> {
        each!(self, c => c.reduce_handles(src, dst, dtype, op, root))
    }
    fn broadcast_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        each!(self, c => c.broadcast_handles(src, dst, dtype, root))
    }
    fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        each!(self, c => c.all_gather_handles(src, dst, dtype))
    }
    fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        each!(self, c => c.reduce_scatter_handles(src, dst, dtype, op))
    }
    fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        each!(self, c => c.all_to_all_handles(src, dst, dtype))
    }
    fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError> {
        each!(self, c => c.gather_handles(src, dst, dtype, root))
    }
    fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        each!(self, c => c.scatter_handles(src, dst, dtype, root))
    }
    fn group_handles(&self, calls: Vec<crate::GroupCall>) -> Result<Work, CommError> {
        each!(self, c => c.group_handles(calls))
    }
    fn send_recv_members(
        &self,
        from: usize,
        src: Option<&Handle>,
        to: usize,
        dst: Option<&Handle>,
        dtype: DType,
    ) -> Result<Work, CommError> {
        each!(self, c => c.send_recv_members(from, src, to, dst, dtype))
    }
}

/// The devices of `backend` ("cpu", "cuda", "wgpu") this process should
/// bring to its job, as torchrun users expect:
///
/// - started by a launcher (`LOCAL_RANK` and the rest are set): `per_rank`
///   devices (default 1) from device `LOCAL_RANK × per_rank`, so the ranks
///   of a node share its GPUs out instead of each taking all of them. On
///   the CPU backend, whose devices belong to the process, devices
///   `0..per_rank`.
/// - alone: the first `per_rank` devices, or every device when `None`.
///
/// Errors name the backend and how many devices it has when there are too
/// few, and say which launcher variable is wrong when one is.
pub fn rank_clients(backend: &str, per_rank: Option<usize>) -> Result<Vec<Client>, Error> {
    if per_rank == Some(0) {
        return Err(Error::InvalidArgument("0 devices per rank asked for: each rank needs at least one".into()));
    }
    let launched = match LaunchEnv::from_process() {
        Ok(env) => Some(env),
        Err(LaunchEnvError::NotFound) => None,
        Err(err) => return Err(err.into()),
    };
    let clients = match launched {
        Some(env) => {
            let n = per_rank.unwrap_or(1);
            let first = if backend == "cpu" { 0 } else { env.local_rank.saturating_mul(n) };
            cohort_runtime::clients_from(backend, first, Some(n))?
        }
        None => cohort_runtime::clients_from(backend, 0, per_rank)?,
    };
    Ok(clients)
}
