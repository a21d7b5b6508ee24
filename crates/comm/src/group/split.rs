//! Groups within a [`ClientGroup`]: [`ClientGroup::subgroup`] and
//! [`ClientGroup::split`] (`MPI_Comm_split` / `ncclCommSplit` semantics,
//! with every member's color and key given at once, since one process holds
//! every member). A subgroup is a `ClientGroup` over those members' clients,
//! with the parent's timeout, host path and stage chunk; its collectives
//! number members within the subgroup.

use super::ClientGroup;
use crate::device::Route;
use crate::error::CommError;

impl ClientGroup {
    /// The group of `members` (member numbers of this group), member `i`
    /// of the result being `members[i]`. Refuses an empty list, a member
    /// out of range and a member listed twice. Its NCCL communicator (on
    /// CUDA) is made on its first collective, cached by device set.
    pub fn subgroup(&self, members: &[usize]) -> Result<ClientGroup, CommError> {
        if members.is_empty() {
            return Err(CommError::EmptyGroup);
        }
        for &m in members {
            self.checks().within("subgroup", "member", m, self.len())?;
        }
        let clients = members.iter().map(|&m| self.clients[m].clone()).collect();
        let mut group = ClientGroup::new(clients)?.with_timeout(self.timeout).with_stage_chunk(self.stage_chunk);
        // A host path the parent chose carries over.
        if matches!(self.route, Route::Host) {
            group.route = Route::Host;
            group.direct = self.direct;
        }
        Ok(group)
    }

    /// Splits the members by color, as `MPI_Comm_split` does: member `m`
    /// brings `colors[m]` and `keys[m]`; members with the same color form a
    /// group, ordered by key and then by member number; a member whose
    /// color is `None` joins no group. Returns member `m`'s group (or
    /// `None`) at index `m`; members of one group share its clones.
    pub fn split(&self, colors: &[Option<u32>], keys: &[i64]) -> Result<Vec<Option<ClientGroup>>, CommError> {
        for (what, got) in [("colors", colors.len()), ("keys", keys.len())] {
            if got != self.len() {
                return Err(CommError::BufferCount { operation: "split", what, expected: self.len(), got });
            }
        }
        let mut by_color: Vec<(u32, Vec<usize>)> = Vec::new();
        for (m, color) in colors.iter().enumerate() {
            let Some(color) = *color else { continue };
            match by_color.iter_mut().find(|(c, _)| *c == color) {
                Some((_, members)) => members.push(m),
                None => by_color.push((color, vec![m])),
            }
        }
        let mut out = vec![None; self.len()];
        for (_, mut members) in by_color {
            members.sort_by_key(|&m| (keys[m], m));
            let group = self.subgroup(&members)?;
            for &m in &members {
                out[m] = Some(group.clone());
            }
        }
        Ok(out)
    }
}
