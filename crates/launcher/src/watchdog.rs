//! The heartbeat watchdog: every rank's `Communicator` bumps
//! `cohort/heartbeat/<rank>` in the store once a second from a thread of its
//! own, so a rank that waits in a long collective still beats; one whose
//! counter stops moving for `--heartbeat-timeout` is stopped or frozen
//! (SIGSTOP, a debugger, a kernel hang), and the supervisor stops the job.
//!
//! Ranks that never form a communicator never beat and are not watched.
//! Time is the launcher's own clock: ranks' clocks do not matter.

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
        while !stopped.load(Ordering::Relaxed) {
            for (i, &(rank, local_rank)) in ranks.iter().enumerate() {
                let value = match client.get(&job_heartbeat_key(rank)) {
                    Ok(v) => v,
                    // The verdict watcher reports a lost store.
                    Err(_) => return,
                };
                let now = Instant::now();
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
