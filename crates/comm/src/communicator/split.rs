//! Groups of a [`Communicator`] across processes: [`Communicator::split`]
//! (`MPI_Comm_split` semantics), [`Communicator::split_members`] (one color
//! and key per local device) and [`Communicator::subgroup`].
//!
//! Every split is collective over the parent: each member's color, key and
//! (for `subgroup`) a hash of its member list travel in one all-gather on
//! the parent, so every rank computes the same groups from the same table,
//! and ranks that disagree are named in the same error everywhere instead
//! of waiting for each other. Then each group forms under its own store
//! prefix (`split/<n>/<color>/` under the parent's; see `keys`):
//!
//! - **shared with the parent**: its connection to the rendezvous store
//!   (the group forms, notes arrivals and aborts over it; only the group's
//!   heartbeat opens its own, whose closing tells the other ranks this one
//!   is gone), the job's node identity, member numbering by job rank in
//!   every message and flight record, and on NCCL the parent's
//!   communicator, which `ncclCommSplit` splits with `splitShare` (the
//!   parent's buffers and connections shared where NCCL allows);
//! - **its own**: its host links (shared-memory rings within a node, TCP
//!   across), so its collectives never interleave with the parent's or a
//!   sibling's bytes and groups may run in any order with respect to each
//!   other, as MPI and NCCL allow; its heartbeat, progress and abort keys.
//!
//! With `L` devices per rank, a group holds members `rank × L + l`; across
//! processes every rank of a group brings the same number `L'` of its
//! devices, listed next to each other (member `i` of the group is the
//! group's local device `i mod L'` on its rank `i / L'`).

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cohort_runtime::{Client, Handle};

use super::label::Label;
use super::{keys, observe, setup, Communicator};
use crate::digest::Fnv1a;
use crate::error::CommError;
use crate::ops::DType;

/// Whether a group split from an NCCL communicator shares its resources
/// (`splitShare`).
const SHARE: bool = true;

/// What one member brings to a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ask {
    color: Option<u32>,
    key: i64,
    /// A hash of the member list (`subgroup`), 0 otherwise.
    list: i64,
}

const FIELDS: usize = 4;

impl Ask {
    fn encode(&self) -> [i64; FIELDS] {
        [i64::from(self.color.is_some()), i64::from(self.color.unwrap_or(0)), self.key, self.list]
    }

    fn decode(v: &[i64]) -> Ask {
        Ask { color: (v[0] != 0).then_some(v[1] as u32), key: v[2], list: v[3] }
    }
}

/// One group of a split: its color and its members (parent member numbers)
/// in order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Planned {
    color: u32,
    members: Vec<usize>,
    /// The parent ranks of its ranks, in order.
    ranks: Vec<usize>,
}

impl Communicator {
    /// Splits the ranks by `color`, as `MPI_Comm_split` does: ranks that
    /// pass the same color form a group, ordered by `key` and then by rank;
    /// a rank that passes `None` joins no group and gets `None`. Every local
    /// device of this rank joins with the same color and key (see
    /// [`Communicator::split_members`] for one per device).
    ///
    /// Collective over this communicator: every rank calls it, in the same
    /// order as its other collectives; waits until the groups that hold
    /// this rank are formed (their links up), up to the timeout. On NCCL
    /// the groups come from `ncclCommSplit` of this communicator, sharing
    /// its resources; on the host their own links (see the module docs).
    /// Errors name the ranks when the groups cannot be formed.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>, CommError> {
        let l = self.local_devices();
        let groups = self.split_members(&vec![color; l], &vec![key; l])?;
        Ok(groups.into_iter().flatten().next())
    }

    /// Splits the members (every device of every rank) by color: local
    /// device `l` of this rank brings `colors[l]` and `keys[l]`; members of
    /// one color form a group, ordered by key and then by member number.
    /// Returns local device `l`'s group at index `l` (devices of one group
    /// share its clones). Across processes each rank of a group must bring
    /// the same number of its devices, next to each other in the group's
    /// order; otherwise every rank gets an error naming the group and ranks.
    /// Collective and waiting as [`Communicator::split`].
    pub fn split_members(&self, colors: &[Option<u32>], keys: &[i64]) -> Result<Vec<Option<Communicator>>, CommError> {
        let l = self.local_devices();
        for (what, got) in [("colors", colors.len()), ("keys", keys.len())] {
            if got != l {
                return Err(CommError::BufferCount { operation: "split", what, expected: l, got });
            }
        }
        let asks = (0..l).map(|s| Ask { color: colors[s], key: keys[s], list: 0 }).collect();
        self.split_by("split", asks, None)
    }

    /// The group of `members` (member numbers of this communicator), member
    /// `i` of the group being `members[i]`; `None` on a rank that holds none
    /// of them. Collective: every rank calls it with the same list (ranks
    /// that pass another list are named in an error on every rank); a list
    /// that is empty, names a member twice or out of range is refused on
    /// every rank. Waits as [`Communicator::split`].
    pub fn subgroup(&self, members: &[usize]) -> Result<Option<Communicator>, CommError> {
        let problem = list_problem(members, self.members());
        let list = list_hash(members);
        let (l, first) = (self.local_devices(), self.rank() * self.local_devices());
        let asks = (0..l)
            .map(|s| {
                let at = problem.is_none().then(|| members.iter().position(|&m| m == first + s)).flatten();
                Ask { color: at.map(|_| 0), key: at.unwrap_or(0) as i64, list }
            })
            .collect();
        let groups = self.split_by("subgroup", asks, problem)?;
        Ok(groups.into_iter().flatten().next())
    }

    /// This communicator's name in messages, flight records and `cohort
    /// trace`: `comm<k>` for a job's communicator, `<parent>.s<n>c<color>`
    /// for a group (split `n` of its parent, color `color`).
    pub fn group_name(&self) -> String {
        self.inner.label.name.clone()
    }

    /// The job rank of each of this communicator's ranks (the ranks of the
    /// communicator it was split from, first of all): `0..size` for a
    /// job's communicator.
    pub fn job_ranks(&self) -> Vec<usize> {
        self.inner.label.ranks.clone()
    }

    /// How long each phase of this thread's last split took, in order:
    /// `exchange` (the all-gather of every member's color and key),
    /// `device split` (`ncclCommSplit` on every local device, on NCCL only),
    /// `form` (the group's store rendezvous, links and heartbeat). For
    /// benchmarks (`examples/split_bench.rs`); empty before any split.
    pub fn last_split_phases() -> Vec<(&'static str, Duration)> {
        SPLIT_PHASES.with(|p| p.borrow().clone())
    }

    /// The split: the exchange, the checks, then each group with a local
    /// member formed in color order.
    fn split_by(
        &self,
        operation: &'static str,
        asks: Vec<Ask>,
        problem: Option<String>,
    ) -> Result<Vec<Option<Communicator>>, CommError> {
        let mut phases = Phases::start();
        let all = self.exchange_asks(operation, &asks)?;
        phases.passed("exchange");
        let n = self.inner.splits.fetch_add(1, Ordering::Relaxed);
        let (l, size) = (self.local_devices(), self.size());
        let label = self.inner.label.clone();
        if operation == "subgroup" {
            let reference = all[0].list;
            let differ: Vec<usize> = (0..size).filter(|r| all[r * l].list != reference).collect();
            if !differ.is_empty() {
                let detail = format!(
                    "rank(s) {} passed a different member list than rank {}",
                    label.globals(differ),
                    label.global(0)
                );
                return Err(CommError::GroupDisagreement { operation, detail });
            }
        }
        if let Some(detail) = problem {
            return Err(CommError::InvalidGroup { operation, detail });
        }
        let planned = plan(&all, l).map_err(|detail| CommError::InvalidGroup { operation, detail })?;
        // On NCCL every device of every rank splits the parent (also those
        // joining no group), each group's NCCL rank being its member index.
        let sets = match &self.inner.nccl {
            Some(nccl) => {
                let first = self.rank() * l;
                let mine: Vec<Option<(u32, usize)>> = (0..l)
                    .map(|s| {
                        planned
                            .iter()
                            .enumerate()
                            .find_map(|(g, p)| p.members.iter().position(|&m| m == first + s).map(|at| (g as u32, at)))
                    })
                    .collect();
                let sets = nccl
                    .split(&mine, SHARE, self.timeout())
                    .map_err(|detail| CommError::GroupSetup { operation, detail })?;
                phases.passed("device split");
                Some(sets)
            }
            None => None,
        };
        let mut out = vec![None; l];
        for (g, group) in planned.iter().enumerate() {
            if !group.ranks.contains(&self.rank()) {
                continue;
            }
            let set = sets.as_ref().and_then(|s| s.iter().find(|(x, _)| *x == g as u32)).map(|(_, k)| *k);
            let comm = self.form_group(operation, n, group, &label, set)?;
            for &m in group.members.iter().filter(|&&m| m / l == self.rank()) {
                out[m % l] = Some(comm.clone());
            }
        }
        phases.passed("form");
        phases.keep();
        Ok(out)
    }

    /// Every member's ask, through one all-gather on this communicator.
    fn exchange_asks(&self, operation: &'static str, asks: &[Ask]) -> Result<Vec<Ask>, CommError> {
        let clients = self.clients();
        let src: Vec<Handle> =
            asks.iter().zip(clients).map(|(a, c)| c.create_from_slice(bytemuck::cast_slice(&a.encode()))).collect();
        let bytes = FIELDS * 8 * self.members();
        let dst: Vec<Handle> = clients.iter().map(|c| c.empty(bytes)).collect();
        self.all_gather_handles(&src, &dst, DType::I64)?;
        let table = clients[0].read_one(dst[0].clone()).map_err(|source| CommError::Failed { operation, source })?;
        let values: Vec<i64> = bytemuck::pod_collect_to_vec(&table);
        Ok(values.chunks(FIELDS).map(Ask::decode).collect())
    }

    /// Forms group `group` (split `n`) on this rank: its links under its
    /// own prefix, its observer, and its NCCL side (`set`, made by the
    /// split) when the parent runs on NCCL.
    fn form_group(
        &self,
        operation: &'static str,
        n: u64,
        group: &Planned,
        parent: &Label,
        set: Option<u64>,
    ) -> Result<Communicator, CommError> {
        let l = self.local_devices();
        let per = group.members.len() / group.ranks.len();
        let rank = group.ranks.iter().position(|&r| r == self.rank()).expect("a rank of the group");
        let clients: Vec<Client> =
            group.members.iter().filter(|&&m| m / l == self.rank()).map(|&m| self.clients()[m % l].clone()).collect();
        let setup_error = |e: &dyn std::fmt::Display| CommError::GroupSetup { operation, detail: e.to_string() };
        let (store, prefix) = {
            let w = self.inner.world.lock();
            (w.shared_store(), w.prefix().to_string())
        };
        let timeout = self.timeout();
        let prefix = keys::split_prefix(&prefix, n, group.color);
        let mut world =
            setup::form_under(store, prefix, rank, group.ranks.len(), per, timeout).map_err(|e| setup_error(&e))?;
        world.label = parent.child(n, group.color, &group.ranks);
        let observer = observe::Observer::start(&world).map_err(|e| setup_error(&e))?;
        let nccl = match (set, &self.inner.nccl) {
            (Some(set), Some(parent)) => Some(parent.child(set, &world, &clients).map_err(|e| setup_error(&e))?),
            _ => None,
        };
        tracing::debug!(group = %world.label.name, rank, size = group.ranks.len(), "group formed");
        Ok(Communicator::assemble(world, clients, timeout, observer, nccl, Some(self.clone()), None))
    }
}

thread_local! {
    /// This thread's last split's phases ([`Communicator::last_split_phases`]).
    static SPLIT_PHASES: RefCell<Vec<(&'static str, Duration)>> = const { RefCell::new(Vec::new()) };
}

/// The phases of one split as it passes them.
struct Phases {
    last: Instant,
    passed: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn start() -> Phases {
        Phases { last: Instant::now(), passed: Vec::new() }
    }

    fn passed(&mut self, phase: &'static str) {
        let now = Instant::now();
        self.passed.push((phase, now - self.last));
        self.last = now;
    }

    /// Keeps them as this thread's last split's.
    fn keep(self) {
        SPLIT_PHASES.with(|p| *p.borrow_mut() = self.passed);
    }
}

/// Why a subgroup's member list cannot form a group, if it cannot.
fn list_problem(members: &[usize], total: usize) -> Option<String> {
    if members.is_empty() {
        return Some("the member list is empty; a group needs at least one member".into());
    }
    if let Some(&m) = members.iter().find(|&&m| m >= total) {
        return Some(format!("member {m} is not a member: the communicator has members 0..{total}"));
    }
    for (i, m) in members.iter().enumerate() {
        if let Some(j) = members[..i].iter().position(|x| x == m) {
            return Some(format!("member {m} is listed twice (at positions {j} and {i})"));
        }
    }
    None
}

/// FNV-1a of the list, as every rank computes it.
fn list_hash(members: &[usize]) -> i64 {
    let words = std::iter::once(members.len()).chain(members.iter().copied());
    Fnv1a::of(words.flat_map(|m| (m as u64).to_le_bytes())) as i64
}

/// The groups every member's ask forms, in color order: members of one
/// color ordered by key, then member number; `l` devices per rank. Refuses
/// (naming the group and ranks) a group whose members are not one block of
/// the same number of devices per rank.
fn plan(all: &[Ask], l: usize) -> Result<Vec<Planned>, String> {
    let mut colors: Vec<u32> = all.iter().filter_map(|a| a.color).collect();
    colors.sort_unstable();
    colors.dedup();
    let mut planned = Vec::with_capacity(colors.len());
    for color in colors {
        let mut members: Vec<usize> = (0..all.len()).filter(|&m| all[m].color == Some(color)).collect();
        members.sort_by_key(|&m| (all[m].key, m));
        let mut ranks: Vec<usize> = Vec::new();
        let mut counts: Vec<usize> = Vec::new();
        for &m in &members {
            let r = m / l;
            if ranks.last() == Some(&r) {
                *counts.last_mut().expect("a run") += 1;
            } else if ranks.contains(&r) {
                return Err(format!(
                    "the group of color {color} (members {members:?} in key order) lists rank {r}'s devices apart: \
                     across processes a group lists each rank's devices next to each other; give them adjacent keys"
                ));
            } else {
                ranks.push(r);
                counts.push(1);
            }
        }
        if let Some(at) = counts.iter().position(|&c| c != counts[0]) {
            return Err(format!(
                "the group of color {color} (members {members:?}) takes {} device(s) of rank {} but {} of rank {}: \
                 across processes every rank of a group brings the same number of its devices",
                counts[0], ranks[0], counts[at], ranks[at]
            ));
        }
        planned.push(Planned { color, members, ranks });
    }
    Ok(planned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(colors: &[Option<u32>], keys: &[i64]) -> Vec<Ask> {
        colors.iter().zip(keys).map(|(&color, &key)| Ask { color, key, list: 0 }).collect()
    }

    #[test]
    fn plans_follow_keys_then_members() {
        let all = asks(&[Some(1), Some(0), Some(1), None, Some(0), Some(1)], &[5, 0, 2, 0, 0, 2]);
        let planned = plan(&all, 1).unwrap();
        assert_eq!(planned[0], Planned { color: 0, members: vec![1, 4], ranks: vec![1, 4] });
        assert_eq!(planned[1], Planned { color: 1, members: vec![2, 5, 0], ranks: vec![2, 5, 0] });
    }

    #[test]
    fn plans_across_devices_need_blocks_of_one_size() {
        // Two devices per rank: members 0,1 on rank 0, 2,3 on rank 1.
        let ok = plan(&asks(&[Some(0); 4], &[0, 1, 2, 3]), 2).unwrap();
        assert_eq!(ok[0].ranks, vec![0, 1]);
        let apart = plan(&asks(&[Some(0); 4], &[0, 2, 1, 3]), 2).unwrap_err();
        assert!(apart.contains("rank 0's devices apart"), "{apart}");
        let uneven = plan(&asks(&[Some(0), Some(0), Some(0), None], &[0; 4]), 2).unwrap_err();
        assert!(uneven.contains("2 device(s) of rank 0 but 1 of rank 1"), "{uneven}");
    }

    #[test]
    fn lists_are_checked_and_hashed() {
        assert!(list_problem(&[0, 2, 0], 4).unwrap().contains("member 0 is listed twice"));
        assert!(list_problem(&[0, 9], 4).unwrap().contains("member 9 is not a member"));
        assert!(list_problem(&[], 4).is_some());
        assert_eq!(list_problem(&[3, 1], 4), None);
        assert_ne!(list_hash(&[0, 1]), list_hash(&[1, 0]));
        assert_ne!(list_hash(&[0]), list_hash(&[0, 0]));
    }

    #[test]
    fn asks_round_trip() {
        let a = Ask { color: Some(u32::MAX), key: -3, list: 77 };
        assert_eq!(Ask::decode(&a.encode()), a);
        let none = Ask { color: None, key: 0, list: 0 };
        assert_eq!(Ask::decode(&none.encode()), none);
    }
}
