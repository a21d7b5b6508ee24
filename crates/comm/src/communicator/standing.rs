//! Where the other ranks stand in a call of a communicator, from the notes
//! each rank leaves in the store (see [`keys`](super::keys)): an arrival
//! note at a call it waited long in, its progress (the last collective it
//! called and finished), and `gone` once its process left. A collective's
//! timeout names the ranks that never arrived from them
//! (`world::timeout_message`), and so does a handle's bounded wait
//! ([`Work::wait_timeout`](crate::Work::wait_timeout), through
//! [`RankView`]).

use std::sync::Arc;

use crate::store::{StoreClient, StoreError};
use crate::work::{RankCall, Ranks};

use super::keys;
use super::label::Label;

/// Ranks whose notes one store request reads (3 keys each): far below the
/// largest frame, whatever the world size.
const RANKS_PER_READ: usize = 4096;

/// Ranks a handle's wait names of one kind before it only counts the rest.
const NAMED: usize = 16;

/// Where another rank stands in one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Standing {
    /// It noted that it waits in the call (it waited there long).
    Waiting,
    /// Its process went away (its store connection closed, or it closed
    /// its communicator): why.
    Gone(String),
    /// Its progress says it finished the call and went on.
    Finished,
    /// Its progress says it called the call and has not finished it.
    Called,
    /// As far as the store knows, it has not called it: the last call its
    /// progress reported (`None`: none reported, or the call is a message,
    /// whose numbers progress does not count).
    Behind(Option<u64>),
}

/// Where each rank of `ranks` (of the communicator at `prefix`) stands in
/// call `seq`; `message`: the call is a send or recv. One store round trip
/// per [`RANKS_PER_READ`] ranks; does not wait.
pub(super) fn standings(
    store: &StoreClient,
    prefix: &str,
    seq: u64,
    message: bool,
    ranks: &[usize],
) -> Result<Vec<Standing>, StoreError> {
    let mut out = Vec::with_capacity(ranks.len());
    for chunk in ranks.chunks(RANKS_PER_READ) {
        let names: Vec<String> = chunk
            .iter()
            .flat_map(|&r| [keys::arrived(prefix, seq, r), keys::gone(prefix, r), keys::progress(prefix, r)])
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let values = store.multi_get(&names)?;
        out.extend(values.chunks(3).map(|notes| standing(seq, message, notes)));
    }
    Ok(out)
}

/// One rank's standing from its notes: arrival, gone, progress.
fn standing(seq: u64, message: bool, notes: &[Option<Vec<u8>>]) -> Standing {
    if notes[0].is_some() {
        return Standing::Waiting;
    }
    if let Some(why) = &notes[1] {
        return Standing::Gone(String::from_utf8_lossy(why).into_owned());
    }
    let progress = notes[2].as_deref().filter(|_| !message).and_then(keys::parse_progress);
    match progress {
        Some((_, finished)) if finished >= seq => Standing::Finished,
        Some((issued, _)) if issued >= seq => Standing::Called,
        Some((issued, _)) => Standing::Behind(Some(issued)),
        None => Standing::Behind(None),
    }
}

/// A communicator as its handles name it: who this process is, and where
/// the other ranks stand in a call, read from the store.
pub(super) struct RankView {
    /// `rank 1`, or `rank 3 in group comm1.s0c1 (ranks 1, 3)` (job ranks).
    scope: String,
    store: Arc<StoreClient>,
    prefix: String,
    label: Label,
    rank: usize,
    size: usize,
}

impl RankView {
    /// Rank `rank` of the `size` ranks of the communicator at `prefix`,
    /// named by `label`, reading the store through `store`.
    pub(super) fn new(store: Arc<StoreClient>, prefix: &str, label: &Label, rank: usize, size: usize) -> RankView {
        let scope = format!("rank {}{label}", label.global(rank));
        RankView { scope, store, prefix: prefix.to_string(), label: label.clone(), rank, size }
    }

    /// `ranks` (this communicator's) as job ranks, `1, 3`, the first
    /// [`NAMED`] of them and a count of the rest.
    fn list(&self, ranks: &[usize]) -> String {
        let named = self.label.globals(ranks.iter().take(NAMED).copied());
        match ranks.len() > NAMED {
            true => format!("{named} and {} more", ranks.len() - NAMED),
            false => named,
        }
    }
}

impl Ranks for RankView {
    fn scope(&self) -> &str {
        &self.scope
    }

    fn waiting_for(&self, operation: &str, call: RankCall) -> String {
        let others: Vec<usize> = match call.peer {
            Some(peer) => vec![peer],
            None => (0..self.size).filter(|&r| r != self.rank).collect(),
        };
        let found = standings(&self.store, &self.prefix, call.seq, call.peer.is_some(), &others);
        let standings = match found {
            Ok(standings) => standings,
            Err(err) => return format!("where the other ranks stand could not be read from the store ({err})"),
        };
        let call_name = format!("{operation} #{}", call.seq);
        let (mut behind, mut within, mut last, mut clauses) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (&r, standing) in others.iter().zip(standings) {
            let g = self.label.global(r);
            match standing {
                Standing::Behind(reported) => {
                    behind.push(r);
                    match reported {
                        Some(0) => last.push(format!("rank {g} reported no call yet")),
                        Some(issued) => last.push(format!("rank {g} last reported #{issued}")),
                        None => {}
                    }
                }
                Standing::Waiting | Standing::Called => within.push(r),
                Standing::Gone(why) => clauses.push(format!("rank {g} went away ({why})")),
                Standing::Finished => {}
            }
        }
        if let (Some(peer), false) = (call.peer, behind.is_empty()) {
            let g = self.label.global(peer);
            clauses.insert(
                0,
                format!(
                    "it waits for rank {g}, the other end of {call_name} (whether rank {g} arrived is not known: \
                     the progress ranks publish counts collectives, not messages)"
                ),
            );
        } else if !behind.is_empty() {
            let mut words = format!("rank(s) {} not arrived yet at {call_name}", self.list(&behind));
            if !last.is_empty() {
                last.truncate(NAMED);
                words.push_str(&format!(" ({})", last.join(", ")));
            }
            clauses.insert(0, words);
        }
        if !within.is_empty() {
            clauses.push(format!("rank(s) {} arrived at {call_name}, not finished", self.list(&within)));
        }
        match clauses.is_empty() {
            true => format!("every other rank finished {call_name}"),
            false => clauses.join("; "),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_give_each_standing_and_arrival_comes_first() {
        let some = |v: &str| Some(v.as_bytes().to_vec());
        assert_eq!(standing(5, false, &[some(""), some("gone"), some("1 1")]), Standing::Waiting);
        assert_eq!(standing(5, false, &[None, some("its store connection closed"), None]), {
            Standing::Gone("its store connection closed".into())
        });
        assert_eq!(standing(5, false, &[None, None, some("6 5")]), Standing::Finished);
        assert_eq!(standing(5, false, &[None, None, some("5 4")]), Standing::Called);
        assert_eq!(standing(5, false, &[None, None, some("4 4")]), Standing::Behind(Some(4)));
        assert_eq!(standing(5, false, &[None, None, None]), Standing::Behind(None));
        // A message's number is not a collective's: progress says nothing.
        assert_eq!(standing(5, true, &[None, None, some("9 9")]), Standing::Behind(None));
    }
}
