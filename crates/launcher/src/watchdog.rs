//! The heartbeat watchdog: every rank's `Communicator` bumps
//! `cohort/heartbeat/<rank>` in the store once a second from a thread of its
//! own, so a rank that waits in a long collective still beats; one whose
//! counter stops moving for `--heartbeat-timeout` is stopped or frozen
//! (SIGSTOP, a debugger, a kernel hang), and the supervisor stops the job.
//!
//! Ranks that never form a communicator never beat and are not watched.
//! Time is the launcher's own clock: ranks' clocks do not matter. When that
//! clock jumps between two rounds (the launcher was stopped with Ctrl-Z and
//! resumed, or the machine slept), the silence is the launcher's own, not
//! the ranks': every rank gets a fresh window. While the launcher is stopped
//! so is the store it serves, so the ranks' beats queue up unanswered and
//! the first reads after the pause would still show the old values.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::job_heartbeat_key;
use cohort_comm::store::StoreClient;
use crossbeam::channel::Sender;

use crate::supervisor::Event;

/// Stops the watchdog thread when dropped.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Watches the heartbeats of `ranks` (global rank, local rank) of `attempt`
/// on its own store connection; sends [`Event::Beating`] when a rank's
/// first beat arrives and [`Event::Silent`] once when one stops for
/// `limit`. Returns `None` (and logs why) if the store cannot be reached.
pub fn start(
    store: &StoreClient,
    ranks: Vec<(usize, usize)>,
    attempt: u32,
    limit: Duration,
    events: Sender<Event>,
) -> Option<Watchdog> {
    let client = match store.duplicate() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("heartbeat watchdog off: cannot reach the store: {e}");
            return None;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    // Fast enough to see a short job's first beats (so its ranks are asked
    // for their flight recorders when it fails): a few store reads per
    // rank and second.
    let period = (limit / 4).clamp(Duration::from_millis(20), Duration::from_millis(100));
    let spawned = std::thread::Builder::new().name("cohort-watchdog".into()).spawn(move || {
        // Per rank: last value seen, when it last changed, reported.
        let mut seen: Vec<(Option<Vec<u8>>, Instant, bool)> = vec![(None, Instant::now(), false); ranks.len()];
        // When the previous read (or sleep) ended; a read or sleep that took
        // far longer than it should means the launcher stood still.
        let mut last_tick = Instant::now();
        while !stopped.load(Ordering::Relaxed) {
            for (i, &(rank, local_rank)) in ranks.iter().enumerate() {
                let value = match client.get(&job_heartbeat_key(rank)) {
                    Ok(v) => v,
                    // The verdict watcher reports a lost store; this says
                    // why the heartbeats stopped being watched (the first
                    // read is also where a second connection proves the
                    // secret).
                    Err(e) => {
                        if !stopped.load(Ordering::Relaxed) {
                            tracing::warn!("heartbeat watchdog off: {e}");
                        }
                        return;
                    }
                };
                let now = Instant::now();
                let gap = now - last_tick;
                last_tick = now;
                if paused(gap, period, limit) {
                    tracing::info!(?gap, "the launcher itself was paused; restarting every rank's heartbeat window");
                    for entry in &mut seen {
                        entry.1 = now;
                    }
                }
                let entry = &mut seen[i];
                if value.is_some() && value != entry.0 {
                    if entry.0.is_none() {
                        let _ = events.send(Event::Beating { attempt, local_rank });
                    }
                    *entry = (value, now, false);
                } else if entry.0.is_some() && !entry.2 && now - entry.1 >= limit {
                    entry.2 = true;
                    let _ = events.send(Event::Silent { attempt, local_rank, silent: now - entry.1 });
                }
            }
            std::thread::sleep(period);
        }
    });
    match spawned {
        Ok(_) => Some(Watchdog { stop }),
        Err(e) => {
            tracing::warn!("heartbeat watchdog off: cannot start its thread: {e}");
            None
        }
    }
}

/// Whether a gap of `gap` between two rounds that should be `period` apart
/// means the launcher itself stood still (stopped, the machine asleep): more
/// than a quarter of the limit and more than a second beyond the period.
fn paused(gap: Duration, period: Duration, limit: Duration) -> bool {
    gap > period + (limit / 4).max(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_gap_between_rounds_is_a_pause_of_the_launcher() {
        let (period, limit) = (Duration::from_millis(100), Duration::from_secs(30));
        assert!(!paused(Duration::from_millis(150), period, limit));
        assert!(!paused(Duration::from_secs(5), period, limit), "a loaded machine's hiccup");
        assert!(paused(Duration::from_secs(40), period, limit), "Ctrl-Z, then fg");
        assert!(paused(Duration::from_secs(3), period, Duration::from_secs(2)));
    }
}
