//! [`Mesh`]: an N-dimensional layout of a job's members with named
//! dimensions and a group along each, like PyTorch's `DeviceMesh`.

use crate::api::World;
use crate::communicator::Communicator;
use crate::error::CommError;
use crate::group::ClientGroup;

/// The members of a [`ClientGroup`], a [`Communicator`] or a [`World`]
/// (every device of every rank of the job) laid out row-major over named
/// dimensions (`[("dp", 2), ("tp", 4)]`: member `m` sits at
/// `(m / 4, m % 4)`), with, along each dimension, one group per line of
/// members that differ only in that coordinate. Each group is a [`World`]:
/// a [`ClientGroup`] in one process, a [`Communicator`] split from the
/// job's across processes (see [`Communicator::split_members`]); a process
/// holds the groups that hold its devices.
///
/// ```
/// use cohort_comm::{ClientGroup, Collectives, Error, Mesh, ReduceOp};
/// use cohort_runtime::{CpuRuntime, Runtime};
///
/// fn main() -> Result<(), Error> {
///     std::env::set_var("COHORT_CPU_DEVICES", "4");
///     let mesh = Mesh::new(&ClientGroup::new(CpuRuntime::clients()?)?, &[("dp", 2), ("tp", 2)])?;
///     // Member 3 sits at (1, 1); along "tp" it meets member 2.
///     assert_eq!(mesh.coords(3), vec![1, 1]);
///     let tp = mesh.group_of("tp", 3)?;
///     assert_eq!(tp.members(), 2);
///     let x = tp.replicate(&[1.0f32; 4])?;
///     tp.all_reduce(&x, &x, ReduceOp::Sum)?;
///     assert_eq!(x[1].to_vec()?, [2.0; 4]);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Mesh {
    names: Vec<String>,
    shape: Vec<usize>,
    /// Per dimension: its groups.
    along: Vec<Along>,
}

/// The groups along one dimension.
#[derive(Debug, Clone)]
struct Along {
    /// One per line; `None` where this process holds no member of it.
    groups: Vec<Option<World>>,
    /// Member `m`'s group, and its member number there.
    place: Vec<(usize, usize)>,
}

impl Mesh {
    /// Lays `parent`'s members out over `dims` (name, size), row-major,
    /// and forms the groups along each dimension. Refuses sizes whose
    /// product is not the number of members, a size of zero, and a name
    /// used twice. Over a [`Communicator`] (or a [`World`] of several
    /// ranks) it is collective: every rank calls it with the same `dims`,
    /// and it waits for one split per dimension.
    pub fn new(parent: &impl MeshOver, dims: &[(&str, usize)]) -> Result<Mesh, CommError> {
        let members = parent.mesh_members();
        let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let names: Vec<String> = dims.iter().map(|d| d.0.to_string()).collect();
        let total = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if dims.is_empty() || shape.contains(&0) || total != Some(members) {
            return Err(CommError::MeshShape { shape: describe(dims), members });
        }
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(CommError::MeshShape { shape: describe(dims), members });
            }
        }
        let mut mesh = Mesh { names, shape, along: Vec::new() };
        for dim in 0..dims.len() {
            let mut lines: Vec<Vec<usize>> = Vec::new();
            let mut place = vec![(0, 0); members];
            for m in 0..members {
                if mesh.coords(m)[dim] != 0 {
                    continue;
                }
                // The line through `m` along `dim`.
                let stride: usize = mesh.shape[dim + 1..].iter().product();
                let line: Vec<usize> = (0..mesh.shape[dim]).map(|k| m + k * stride).collect();
                for (i, &member) in line.iter().enumerate() {
                    place[member] = (lines.len(), i);
                }
                lines.push(line);
            }
            let groups = parent.line_groups(&lines)?;
            mesh.along.push(Along { groups, place });
        }
        Ok(mesh)
    }

    /// The dimensions' names, in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The dimensions' sizes, in order.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Member `member`'s coordinates (row-major).
    pub fn coords(&self, member: usize) -> Vec<usize> {
        let mut rest = member;
        let mut coords = vec![0; self.shape.len()];
        for (d, size) in self.shape.iter().enumerate().rev() {
            coords[d] = rest % size;
            rest /= size;
        }
        coords
    }

    fn dim(&self, name: &str) -> Result<usize, CommError> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| CommError::NoSuchDimension { name: name.to_string(), names: self.names.join(", ") })
    }

    /// The groups along dimension `name` that this process holds (every
    /// group in one process): one per line of members that differ only in
    /// that coordinate, ordered by the first member of each.
    pub fn groups(&self, name: &str) -> Result<Vec<&World>, CommError> {
        Ok(self.along[self.dim(name)?].groups.iter().flatten().collect())
    }

    /// The group along `name` that member `member` belongs to (its member
    /// number there is its coordinate along `name`). Across processes,
    /// only a group that holds a device of this process is here.
    pub fn group_of(&self, name: &str, member: usize) -> Result<&World, CommError> {
        let Along { groups, place } = &self.along[self.dim(name)?];
        let members = place.len();
        let (g, _) = place.get(member).ok_or(CommError::NotAMember {
            operation: "mesh",
            what: "member",
            index: member,
            members,
        })?;
        groups[*g].as_ref().ok_or_else(|| CommError::InvalidGroup {
            operation: "mesh",
            detail: format!(
                "member {member}'s group along {name:?} holds no device of this process; ask the process that \
                 holds member {member}"
            ),
        })
    }
}

/// What a [`Mesh`] lays out: a [`ClientGroup`] (one process), a
/// [`Communicator`] (every member of every rank) or a [`World`].
pub trait MeshOver {
    /// Members to lay out.
    fn mesh_members(&self) -> usize;

    /// One group per line (`lines[i]` lists its members in order): the
    /// group where this process holds one of its members, `None`
    /// elsewhere. Collective across processes.
    fn line_groups(&self, lines: &[Vec<usize>]) -> Result<Vec<Option<World>>, CommError>;
}

impl MeshOver for ClientGroup {
    fn mesh_members(&self) -> usize {
        self.len()
    }

    fn line_groups(&self, lines: &[Vec<usize>]) -> Result<Vec<Option<World>>, CommError> {
        lines.iter().map(|line| Ok(Some(World::Local(self.subgroup(line)?)))).collect()
    }
}

impl MeshOver for Communicator {
    fn mesh_members(&self) -> usize {
        self.members()
    }

    /// One split of this communicator: each local device's color is its
    /// line, its key its place on the line.
    fn line_groups(&self, lines: &[Vec<usize>]) -> Result<Vec<Option<World>>, CommError> {
        let first = self.rank() * self.local_devices();
        let (mut colors, mut keys, mut line_of) = (Vec::new(), Vec::new(), Vec::new());
        for slot in 0..self.local_devices() {
            let (line, at) = lines
                .iter()
                .enumerate()
                .find_map(|(i, l)| l.iter().position(|&m| m == first + slot).map(|at| (i, at)))
                .expect("every member lies on one line of each dimension");
            colors.push(Some(line as u32));
            keys.push(at as i64);
            line_of.push(line);
        }
        let mut groups = vec![None; lines.len()];
        for (slot, comm) in self.split_members(&colors, &keys)?.into_iter().enumerate() {
            if let Some(comm) = comm {
                groups[line_of[slot]] = Some(World::Ranks(comm));
            }
        }
        Ok(groups)
    }
}

impl MeshOver for World {
    fn mesh_members(&self) -> usize {
        match self {
            World::Local(g) => g.mesh_members(),
            World::Ranks(c) => c.mesh_members(),
        }
    }

    fn line_groups(&self, lines: &[Vec<usize>]) -> Result<Vec<Option<World>>, CommError> {
        match self {
            World::Local(g) => g.line_groups(lines),
            World::Ranks(c) => c.line_groups(lines),
        }
    }
}

fn describe(dims: &[(&str, usize)]) -> String {
    dims.iter().map(|(n, s)| format!("{n}={s}")).collect::<Vec<_>>().join(" × ")
}
