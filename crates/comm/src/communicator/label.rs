//! [`Label`]: how a communicator is named in every message, flight record
//! and `cohort trace` report: a name that is the same on every rank and its
//! members' ranks in the job (the root communicator's ranks).
//!
//! The root communicator of a job is `comm<k>` (its k-th communicator);
//! a group split from it is `<parent>.s<n>c<color>` (split number `n` of the
//! parent, color `color`), so nested groups read as a path:
//! `comm1.s0c1.s0c0`.

use std::fmt;

/// A communicator's name and its ranks, by job rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Label {
    /// Stable across ranks: `comm1`, `comm1.s0c3`.
    pub name: String,
    /// Job rank of each of its ranks, in its own rank order.
    pub ranks: Vec<usize>,
    /// Whether it is a group split from another communicator.
    pub split: bool,
}

impl Label {
    /// The root communicator number `k` of `size` ranks.
    pub(crate) fn root(k: &str, size: usize) -> Label {
        Label { name: format!("comm{k}"), ranks: (0..size).collect(), split: false }
    }

    /// The group of color `color` of this communicator's split number `n`,
    /// whose ranks are this communicator's `ranks`.
    pub(crate) fn child(&self, n: u64, color: u32, ranks: &[usize]) -> Label {
        Label {
            name: format!("{}.s{n}c{color}", self.name),
            ranks: ranks.iter().map(|&r| self.global(r)).collect(),
            split: true,
        }
    }

    /// The job rank of this communicator's rank `r`.
    pub(crate) fn global(&self, r: usize) -> usize {
        self.ranks.get(r).copied().unwrap_or(r)
    }

    /// Job ranks of this communicator's ranks `rs`, as `1, 3`.
    pub(crate) fn globals(&self, rs: impl IntoIterator<Item = usize>) -> String {
        rs.into_iter().map(|r| self.global(r).to_string()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for Label {
    /// What follows a collective's name in a message: ` in group
    /// comm1.s0c1 (ranks 0, 2)` for a split group (ranks by job rank),
    /// nothing for a job's own communicator (its ranks are the job's).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.split {
            write!(f, " in group {} (ranks {})", self.name, self.globals(0..self.ranks.len()))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_name_their_parent_and_job_ranks() {
        let root = Label::root("1", 4);
        let child = root.child(0, 7, &[3, 1]);
        assert_eq!(child.to_string(), " in group comm1.s0c7 (ranks 3, 1)");
        let grandchild = child.child(2, 0, &[1]);
        assert_eq!(grandchild.to_string(), " in group comm1.s0c7.s2c0 (ranks 1)");
        assert_eq!(grandchild.global(0), 1);
        assert_eq!(root.to_string(), "");
    }
}
