//! Every key a communicator reads or writes in the rendezvous store.
//!
//! Outside any communicator:
//! - `cohort/comm/instance/<r>`: a counter rank r bumps per communicator it
//!   forms; the count names the communicator, `<k>`;
//! - `cohort/heartbeat/<RANK>` = `<pid> <beats> <unix ms>`, for the
//!   launcher's watchdog and `cohort status`: a counter that moves every
//!   period while the process runs, and when it last did.
//!
//! Under a communicator's prefix, `cohort/comm/<k>/`:
//! - `job`: rank 0's job id and link token; `peer/<r>`: rank r's node,
//!   address and device count; `shm/<r>` (rank r's file path), `created/<r>`, `mapped/<r>`: the shared-memory
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
//!
//! Start-up and status (see `timings` and `observe`):
//! - `peers`: the directory of a communicator (one line per rank), and
//!   `node/<node id>/peers`: the lines of one node's ranks; `joined`: the
//!   barrier after every rank appended to both, whose answer
//!   (`barrier_get`) is `job` and the rank's node directory (for rank 0,
//!   the whole directory too); `verdict`: rank 0's check of the whole
//!   directory (empty, or what is wrong), answered by barrier `checked`;
//! - `addr/<r>`: rank r's TCP listening address, when the communicator
//!   spans nodes (a rank of another node reads it on first use of its link);
//! - `timings`: rank 0's start-up phases, lines `<phase> <unix µs>`;
//! - `call/<r>` = `<seq> <kind> <bytes> <since unix ms>`: the collective
//!   rank r is in now (or last was), written with its progress.

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

/// Rank r's entry (the MPI path's set-up; the host path uses the directory).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(super) fn peer(prefix: &str, rank: usize) -> String {
    format!("{prefix}peer/{rank}")
}

pub(super) fn shm(prefix: &str, rank: usize) -> String {
    format!("{prefix}shm/{rank}")
}

/// The barrier of a node's ranks (named by its lowest) that opens once
/// each created its shared-memory file, answering their paths.
pub(super) fn created(prefix: &str, rank: usize) -> String {
    format!("{prefix}created/{rank}")
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
pub fn parse_progress(value: &[u8]) -> Option<(u64, u64)> {
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

/// The directory of a communicator: one line per rank, appended by it.
pub(super) fn directory(prefix: &str) -> String {
    format!("{prefix}peers")
}

/// The directory of the ranks of one node (node id `node`): one line per
/// rank, appended by it, in the format of [`directory`].
pub(super) fn node_directory(prefix: &str, node: &str) -> String {
    format!("{prefix}node/{node}/peers")
}

/// Rank `rank`'s TCP listening address, set when the communicator spans
/// nodes and read by a rank of another node when it first links to it.
pub(super) fn link_addr(prefix: &str, rank: usize) -> String {
    format!("{prefix}addr/{rank}")
}

/// Rank 0's verdict on a communicator's directory: empty when every rank
/// joined once with the same device count, else what is wrong.
pub(super) fn verdict(prefix: &str) -> String {
    format!("{prefix}verdict")
}

/// Rank 0's start-up phases of communicator `prefix`.
pub(super) fn setup_timings(prefix: &str) -> String {
    format!("{prefix}timings")
}

/// The start-up phases of communicator number `instance` (the first a job
/// forms is 1), for the launcher's `--timings`.
pub fn startup_timings_key(instance: u64) -> String {
    setup_timings(&prefix(instance as i64))
}

/// The counter that numbers rank `rank`'s communicators: its value is the
/// number of the newest one the rank began to form.
pub fn newest_communicator_key(rank: usize) -> String {
    instance_counter(rank)
}

/// A communicator's directory (one line per rank that joined:
/// `<rank>\t<node>\t<address>\t<devices>`), for readers outside it.
pub fn directory_key(prefix: &str) -> String {
    directory(prefix)
}

/// The prefix of communicator number `instance`, for readers outside it
/// (`cohort status`).
pub fn communicator_prefix(instance: u64) -> String {
    prefix(instance as i64)
}

/// Rank `rank`'s progress entry under `prefix` (see [`parse_progress`]).
pub fn progress_key(prefix: &str, rank: usize) -> String {
    progress(prefix, rank)
}

/// Rank `rank`'s current-call entry under `prefix`.
pub fn call_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}call/{rank}")
}

/// Whether rank `rank` left communicator `prefix` (its `gone` key).
pub fn gone_key(prefix: &str, rank: usize) -> String {
    gone(prefix, rank)
}

/// Whether rank `rank` reported waiting long at collective `seq`.
pub fn arrived_key(prefix: &str, seq: u64, rank: usize) -> String {
    arrived(prefix, seq, rank)
}

/// The communicator's abort key (the first failure).
pub fn abort_key(prefix: &str) -> String {
    abort(prefix)
}

/// The collective a rank is in: sequence number, kind, bytes per rank and
/// since when (Unix milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentCall {
    pub seq: u64,
    /// "all_reduce", ... (borrowed where this process made it).
    pub kind: std::borrow::Cow<'static, str>,
    pub bytes: u64,
    pub since_ms: u64,
}

impl CurrentCall {
    /// The value written at [`call_key`].
    pub fn encode(&self) -> String {
        format!("{} {} {} {}", self.seq, self.kind, self.bytes, self.since_ms)
    }

    /// Reads a value written by [`CurrentCall::encode`].
    pub fn parse(value: &[u8]) -> Option<CurrentCall> {
        let text = std::str::from_utf8(value).ok()?;
        let mut f = text.split(' ');
        let call = CurrentCall {
            seq: f.next()?.parse().ok()?,
            kind: f.next()?.to_string().into(),
            bytes: f.next()?.parse().ok()?,
            since_ms: f.next()?.parse().ok()?,
        };
        f.next().is_none().then_some(call)
    }
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

    #[test]
    fn current_call_round_trips() {
        let c = CurrentCall { seq: 12, kind: "all_reduce".into(), bytes: 4096, since_ms: 1_700_000_000_000 };
        assert_eq!(CurrentCall::parse(c.encode().as_bytes()), Some(c));
        assert_eq!(CurrentCall::parse(b"12 all_reduce 4096"), None);
        assert_eq!(CurrentCall::parse(b"12 all_reduce x 5"), None);
        assert_eq!(startup_timings_key(1), "cohort/comm/1/timings");
    }
}
