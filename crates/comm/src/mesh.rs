//! [`Mesh`]: an N-dimensional layout of a group's members with named
//! dimensions and a group along each, like PyTorch's `DeviceMesh`.

use crate::error::CommError;
use crate::group::ClientGroup;

/// The members of a [`ClientGroup`] laid out row-major over named
/// dimensions (`[("dp", 2), ("tp", 4)]`: member `m` sits at
/// `(m / 4, m % 4)`), with, along each dimension, one group per line of
/// members that differ only in that coordinate.
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
///     assert_eq!(tp.len(), 2);
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
    groups: Vec<ClientGroup>,
    /// Member `m`'s group, and its member number there.
    place: Vec<(usize, usize)>,
}

impl Mesh {
    /// Lays `group`'s members out over `dims` (name, size), row-major.
    /// Refuses sizes whose product is not the number of members, a size of
    /// zero, and a name used twice.
    pub fn new(group: &ClientGroup, dims: &[(&str, usize)]) -> Result<Mesh, CommError> {
        let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let names: Vec<String> = dims.iter().map(|d| d.0.to_string()).collect();
        let total = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if dims.is_empty() || shape.contains(&0) || total != Some(group.len()) {
            return Err(CommError::MeshShape { shape: describe(dims), members: group.len() });
        }
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(CommError::MeshShape { shape: describe(dims), members: group.len() });
            }
        }
        let mut mesh = Mesh { names, shape, along: Vec::new() };
        for dim in 0..dims.len() {
            let mut groups = Vec::new();
            let mut place = vec![(0, 0); group.len()];
            for m in 0..group.len() {
                if mesh.coords(m)[dim] != 0 {
                    continue;
                }
                // The line through `m` along `dim`.
                let stride: usize = mesh.shape[dim + 1..].iter().product();
                let line: Vec<usize> = (0..mesh.shape[dim]).map(|k| m + k * stride).collect();
                for (i, &member) in line.iter().enumerate() {
                    place[member] = (groups.len(), i);
                }
                groups.push(group.subgroup(&line)?);
            }
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

    /// Every group along dimension `name`: one per line of members that
    /// differ only in that coordinate, ordered by the first member of each.
    pub fn groups(&self, name: &str) -> Result<&[ClientGroup], CommError> {
        Ok(&self.along[self.dim(name)?].groups)
    }

    /// The group along `name` that member `member` belongs to (its member
    /// number there is its coordinate along `name`).
    pub fn group_of(&self, name: &str, member: usize) -> Result<&ClientGroup, CommError> {
        let Along { groups, place } = &self.along[self.dim(name)?];
        let members = place.len();
        let (g, _) = place.get(member).ok_or(CommError::NotAMember {
            operation: "mesh",
            what: "member",
            index: member,
            members,
        })?;
        Ok(&groups[*g])
    }
}

fn describe(dims: &[(&str, usize)]) -> String {
    dims.iter().map(|(n, s)| format!("{n}={s}")).collect::<Vec<_>>().join(" × ")
}
