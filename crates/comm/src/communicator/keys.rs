//! Every key a communicator reads or writes in the rendezvous store.
//!
//! Outside any communicator:
//! - `cohort/comm/instance/<r>`: a counter rank r bumps per communicator it
//!   forms; the count names the communicator, `<k>`;
//! - `cohort/heartbeat/<RANK>` = `<pid> <beats>`, for the launcher's
//!   watchdog: a counter that moves every period while the process runs.
//!
//! Under a communicator's prefix, `cohort/comm/<k>/`:
//! - `job`: rank 0's job id and link token; `peer/<r>`: rank r's node,
//!   address and device count; `shm/<r>`, `mapped/<r>`: the shared-memory
//!   handshake of a node; `ready`: the barrier that ends set-up;
//! - `hb/<r>` = `<issued> <finished>`: rank r's progress (the sequence
//!   numbers of the last collective it called and the last it finished);
//! - `gone/<r>`: set when rank r's heartbeat connection closes (the store's
//!   will) or when it drops its communicator;
//! - `arrived/<seq>/<r>`: rank r waited long at collective `seq`;
//! - `abort`: the first failure, `rank <r>: <why>`;
//! - `nccl/can/<r>` (`yes`, or `no <why>`) and `nccl/id`: the NCCL set-up;
//! - `split/<n>/<color>/`: the prefix of the group of color `color` of this
//!   communicator's split number `n` (every rank splits in the same order),
//!   under which that group's own keys (the ones above) live.

/// The key the launcher's watchdog reads for the job's rank `rank`.
pub fn job_heartbeat_key(rank: usize) -> String {
    format!("cohort/heartbeat/{rank}")
}

/// The counter that numbers rank `rank`'s communicators.
pub(super) fn instance_counter(rank: usize) -> String {
    format!("cohort/comm/instance/{rank}")
}

/// The prefix of communicator number `k`.
pub(super) fn prefix(k: i64) -> String {
    format!("cohort/comm/{k}/")
}

/// The key `name` (`job`, `ready`, `peer/3`, ...) under `prefix`.
pub(super) fn under(prefix: &str, name: &str) -> String {
    format!("{prefix}{name}")
}

pub(super) fn peer(prefix: &str, rank: usize) -> String {
    format!("{prefix}peer/{rank}")
}

pub(super) fn shm(prefix: &str, rank: usize) -> String {
    format!("{prefix}shm/{rank}")
}

pub(super) fn mapped(prefix: &str, rank: usize) -> String {
    format!("{prefix}mapped/{rank}")
}

pub(super) fn gone(prefix: &str, rank: usize) -> String {
    format!("{prefix}gone/{rank}")
}

pub(super) fn progress(prefix: &str, rank: usize) -> String {
    format!("{prefix}hb/{rank}")
}

/// A rank's progress entry: the last collective it called and finished.
pub(super) fn progress_value(issued: u64, finished: u64) -> String {
    format!("{issued} {finished}")
}

/// Reads a peer's progress entry: (issued, finished).
pub(super) fn parse_progress(value: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let (a, b) = text.split_once(' ')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

pub(super) fn arrived(prefix: &str, seq: u64, rank: usize) -> String {
    format!("{prefix}arrived/{seq}/{rank}")
}

pub(super) fn abort(prefix: &str) -> String {
    format!("{prefix}abort")
}

pub(super) fn nccl_can(prefix: &str, rank: usize) -> String {
    format!("{prefix}nccl/can/{rank}")
}

/// The prefix of the group of `color` of split number `n` of the
/// communicator at `prefix`.
pub(super) fn split_prefix(prefix: &str, n: u64, color: u32) -> String {
    format!("{prefix}split/{n}/{color}/")
}

pub(super) fn nccl_id(prefix: &str) -> String {
    format!("{prefix}nccl/id")
}

/// Member `rank`'s peer-memory arena (its process, host, address and CUDA
/// IPC handle), or why it has none.
pub(super) fn peer_arena(prefix: &str, rank: usize) -> String {
    format!("{prefix}nccl/peer/arena/{rank}")
}

/// Rank 0's path choice (`COHORT_ALGO` and crossover sizes), which every
/// rank follows so that all take the same path for every call.
pub(super) fn peer_choice(prefix: &str) -> String {
    format!("{prefix}nccl/peer/choice")
}

/// Member `rank` closed the other members' arenas it opened and drained
/// its parts: once every member wrote it, each frees its own arena.
pub(super) fn peer_closed(prefix: &str, rank: usize) -> String {
    format!("{prefix}nccl/peer/closed/{rank}")
}

/// Whether member `rank` opened every other member's arena.
pub(super) fn peer_ready(prefix: &str, rank: usize) -> String {
    format!("{prefix}nccl/peer/ready/{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips() {
        assert_eq!(parse_progress(progress_value(7, 5).as_bytes()), Some((7, 5)));
        assert_eq!(parse_progress(b"7"), None);
        assert_eq!(arrived(&prefix(3), 9, 1), "cohort/comm/3/arrived/9/1");
        assert_eq!(split_prefix(&prefix(3), 0, 7), "cohort/comm/3/split/0/7/");
    }
}
