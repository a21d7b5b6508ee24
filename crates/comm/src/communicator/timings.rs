//! A communicator's start-up phases, for `cohort run --timings` and the
//! flight recorder.
//!
//! Rank 0 appends one line per phase, `<phase> <unix µs>`, to its
//! communicator's `timings` key once it passed it (every rank passes
//! `joined` and `links` within one barrier of the others):
//! - `joined`: every rank appended its entry to the directory (the
//!   `joined` barrier opened);
//! - `links`: every rank formed its links (the `ready` barrier opened);
//! - `nccl`: every rank agreed on NCCL and holds its unique id (the NCCL
//!   communicator itself is created on each device at its first call);
//! - `ready`: rank 0's `Communicator::connect` returns (the last phase).
//!
//! Each rank also keeps the phases it passed in its flight recorder.

use std::time::Instant;

use crate::store::StoreClient;
use crate::trace::{now_micros, FlightRecorder};

use super::keys;

/// The Unix microseconds of `at` (an instant in the past).
fn unix_micros(at: Instant) -> u64 {
    now_micros().saturating_sub(at.elapsed().as_micros() as u64)
}

/// Keeps that this rank passed `phase` at `at` (in its flight recorder) and,
/// on rank 0, tells the launcher (in the store). Best effort: a store error
/// here is logged, not fatal (the communicator is formed).
pub(super) fn passed(store: &StoreClient, prefix: &str, rank: usize, phase: &str, at: Instant) {
    let us = unix_micros(at);
    FlightRecorder::global().record_startup(phase, us);
    if rank == 0 {
        if let Err(err) = store.append(&keys::setup_timings(prefix), format!("{phase} {us}\n").as_bytes()) {
            tracing::debug!(phase, "could not publish a start-up phase: {err}");
        }
    }
}

/// Reads a `timings` value: `(phase, unix µs)` in the order written;
/// malformed lines are skipped.
pub fn parse_phases(value: &[u8]) -> Vec<(String, u64)> {
    String::from_utf8_lossy(value)
        .lines()
        .filter_map(|line| {
            let (name, us) = line.split_once(' ')?;
            Some((name.to_string(), us.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_parse_in_order_and_skip_garbage() {
        let v = b"joined 100\nlinks 250\nbroken\nnccl x\nnccl 300\n";
        assert_eq!(
            parse_phases(v),
            vec![("joined".to_string(), 100), ("links".to_string(), 250), ("nccl".to_string(), 300)]
        );
    }
}
