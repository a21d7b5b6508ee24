//! `cohort run --timings`: the job's start-up phases, from this launcher's
//! start to its first communicator being ready.
//!
//! The launcher marks its own phases (start, store up, ranks started); rank
//! 0 of the first communicator appends its phases to the store (`joined`,
//! `links`, `nccl`, `ready`: see cohort-comm's `published` keys). A thread
//! waits for `ready` and prints them all on stderr, in milliseconds from
//! the launcher's start (Unix clock: comparable across processes).

use std::time::Duration;

use cohort_comm::published::{parse_phases, startup_timings_key};
use cohort_comm::store::{StoreClient, StoreError};
use cohort_comm::trace::now_micros;

/// The launcher's own phases, in Unix microseconds.
#[derive(Debug, Clone)]
pub struct LaunchClock {
    marks: Vec<(&'static str, u64)>,
}

impl LaunchClock {
    /// Marks the launcher's start.
    pub fn start() -> Self {
        LaunchClock { marks: vec![("launcher start", now_micros())] }
    }

    /// Marks that the launcher passed `phase` now.
    pub fn mark(&mut self, phase: &'static str) {
        self.marks.push((phase, now_micros()));
    }
}

/// What a rank's phase is called in the report.
fn shown(phase: &str) -> &str {
    match phase {
        "joined" => "all ranks joined",
        "links" => "links formed",
        "nccl" => "NCCL chosen, id shared",
        "ready" => "communicator ready",
        other => other,
    }
}

/// One line: every phase in ms from the launcher's start.
pub fn render(clock: &LaunchClock, ranks: &[(String, u64)], attempt: u32) -> String {
    let start = clock.marks[0].1;
    let mut parts: Vec<String> = clock
        .marks
        .iter()
        .map(|(p, us)| (p.to_string(), *us))
        .chain(ranks.iter().cloned())
        .map(|(p, us)| format!("{} {:.1} ms", shown(&p), us.saturating_sub(start) as f64 / 1e3))
        .collect();
    if ranks.is_empty() {
        parts.push("(no communicator formed)".into());
    }
    format!("start-up of attempt {attempt}: {}", parts.join(", "))
}

/// Waits (on its own store connection) for the first communicator of the
/// attempt to be ready, then prints the phases on stderr. Gives up quietly
/// when the store goes away (the attempt ended).
pub fn report_when_ready(store: &StoreClient, clock: LaunchClock, attempt: u32) {
    let client = match store.duplicate() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("--timings: cannot reach the store: {e}");
            return;
        }
    };
    let spawned = std::thread::Builder::new().name("cohort-timings".into()).spawn(move || {
        let key = startup_timings_key(1);
        loop {
            match client.wait(&[&key], Duration::from_secs(3600)) {
                Ok(()) => {}
                Err(StoreError::WaitTimeout { .. }) => continue,
                Err(_) => return,
            }
            let phases = match client.get(&key) {
                Ok(Some(v)) => parse_phases(&v),
                Ok(None) => continue,
                Err(_) => return,
            };
            if phases.iter().any(|(p, _)| p == "ready") {
                say!("cohort: {}", render(&clock, &phases, attempt));
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("--timings: cannot start its thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_shown_from_the_launchers_start() {
        let clock = LaunchClock { marks: vec![("launcher start", 1_000_000), ("store up", 1_001_500)] };
        let ranks = vec![("joined".to_string(), 1_040_000), ("ready".to_string(), 1_050_250)];
        assert_eq!(
            render(&clock, &ranks, 0),
            "start-up of attempt 0: launcher start 0.0 ms, store up 1.5 ms, all ranks joined 40.0 ms, \
             communicator ready 50.2 ms"
        );
    }
}
