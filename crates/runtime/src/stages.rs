//! Where a small call's time goes on its caller's thread, stage by stage:
//! the layers a collective crosses (argument checks, the flight record, the
//! meeting, the hand-over or the inline entry, the backend's call, the
//! waiter's polls) each [`mark`] the end of their stage, and the time
//! since the thread's previous mark is added to that stage.
//!
//! Compiled in with the `stage-clock` feature only; without it [`mark`] is
//! an empty inline function and [`ENABLED`] is false. `call_cost` prints
//! the table for the NCCL rows when it is on:
//!
//! ```text
//! cargo run --release --features stage-clock --example call_cost -- 20000 nccl
//! ```
//!
//! Only threads between [`start`] and [`stop`] are timed: a caller's, or a
//! device thread's (started from a task it runs, `Client::exclusive`).
//! A mark costs two clock reads (~50 ns), which the stage it ends absorbs.

/// Whether the stage clock is compiled in (the `stage-clock` feature).
pub const ENABLED: bool = cfg!(feature = "stage-clock");

/// A stage, named by where it ends. A mark's time is the time since the
/// previous mark on the same thread. Declared in the order a waited call
/// meets them ([`Stage::ALL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Typed buffers to handles, argument checks (`ClientGroup::launch` entered).
    Checked,
    /// The path chosen; the capture checks.
    Routed,
    /// The flight record started.
    Recorded,
    /// The collective's meeting built.
    MeetingBuilt,
    /// Every part's task built; the process-wide enqueue lock taken.
    TasksBuilt,
    /// A device thread took a message (its wait for it included).
    Received,
    /// The part's task began (inline entry or the device thread, buffers bound).
    TaskStarted,
    /// The part met the others; its calls and monitor built.
    PartReady,
    /// The backend about to queue the calls (communicator and stream found).
    Issuing,
    /// The backend's calls queued (`ncclAllReduce` returned).
    Issued,
    /// The part's calls pending on the device.
    PartQueued,
    /// The part's task returned its ticket (its record noted, the meeting
    /// told).
    TicketReturned,
    /// The task's outputs marked with its outcome.
    OutputsMarked,
    /// A device thread ran its message (the task and what it held dropped).
    Ran,
    /// The task handed over or run inline, the device let go.
    Submitted,
    /// The collective's call returned its handle.
    Returned,
    /// A waiter looked whether its collective is done.
    WaitLooked,
    /// A waiter polled the device itself.
    WaitHelped,
    /// A poll entered the device on the caller's thread.
    PollEntered,
    /// A poll found what to ask the device (an event, or the last stream).
    PollAsking,
    /// The device was asked (`cuEventQuery` or `cuStreamQuery`).
    PollAsked,
    /// The ended parts reaped, their monitors told.
    PollReaped,
    /// The device's poll returned.
    Polled,
    /// A waiter's last, blocking look returned.
    WaitEnded,
    /// The waiter's wait returned.
    Waited,
    /// A launch's arguments built and checked (sizes, overlap, owner).
    LaunchChecked,
    /// A launch entered the device on the caller's thread (lock, context)
    /// and found its kernel loaded.
    LaunchEntered,
    /// A launch's buffers checked for errors, bound, ordered after other
    /// streams' writers.
    LaunchBound,
    /// The backend found the launch's function, pointers and stream.
    LaunchFound,
    /// The backend's launch queued (`cuLaunchKernel` returned).
    LaunchQueued,
    /// The launch noted on its stream and its outputs marked.
    LaunchNoted,
    /// The launch's call returned (the device let go, the launch dropped).
    LaunchReturned,
}

impl Stage {
    /// Every stage, in declaration order (a stage's index is `stage as usize`).
    pub const ALL: [Stage; 32] = [
        Stage::Checked,
        Stage::Routed,
        Stage::Recorded,
        Stage::MeetingBuilt,
        Stage::TasksBuilt,
        Stage::Received,
        Stage::TaskStarted,
        Stage::PartReady,
        Stage::Issuing,
        Stage::Issued,
        Stage::PartQueued,
        Stage::TicketReturned,
        Stage::OutputsMarked,
        Stage::Ran,
        Stage::Submitted,
        Stage::Returned,
        Stage::WaitLooked,
        Stage::WaitHelped,
        Stage::PollEntered,
        Stage::PollAsking,
        Stage::PollAsked,
        Stage::PollReaped,
        Stage::Polled,
        Stage::WaitEnded,
        Stage::Waited,
        Stage::LaunchChecked,
        Stage::LaunchEntered,
        Stage::LaunchBound,
        Stage::LaunchFound,
        Stage::LaunchQueued,
        Stage::LaunchNoted,
        Stage::LaunchReturned,
    ];

    /// What the stage's time covers, for the table.
    pub fn describe(self) -> &'static str {
        match self {
            Stage::Checked => "typed call, argument checks",
            Stage::Routed => "path chosen, capture checks",
            Stage::Recorded => "flight record started",
            Stage::MeetingBuilt => "meeting built",
            Stage::TasksBuilt => "tasks built, enqueue lock",
            Stage::Received => "device thread: message taken (its wait too)",
            Stage::TaskStarted => "task started (inline entry, bindings)",
            Stage::PartReady => "part met, calls and monitor built",
            Stage::Issuing => "backend: communicator and stream found",
            Stage::Issued => "backend call (ncclAllReduce)",
            Stage::PartQueued => "part pending",
            Stage::TicketReturned => "ticket returned (record noted, meeting told)",
            Stage::OutputsMarked => "outputs marked",
            Stage::Ran => "device thread: message ran (the task dropped)",
            Stage::Submitted => "task returned, device let go",
            Stage::Returned => "handle returned",
            Stage::WaitLooked => "wait: is it done?",
            Stage::WaitHelped => "wait: device let go after a poll",
            Stage::PollEntered => "poll: device entered",
            Stage::PollAsking => "poll: what to ask found",
            Stage::PollAsked => "poll: device asked",
            Stage::PollReaped => "poll: ended parts reaped",
            Stage::Polled => "poll: done",
            Stage::WaitEnded => "wait: last look",
            Stage::Waited => "wait returned",
            Stage::LaunchChecked => "launch: arguments built and checked",
            Stage::LaunchEntered => "launch: device entered, kernel ready",
            Stage::LaunchBound => "launch: buffers checked, bound, ordered",
            Stage::LaunchFound => "launch: function, pointers, stream found",
            Stage::LaunchQueued => "launch: parameters packed, cuLaunchKernel",
            Stage::LaunchNoted => "launch: noted on the stream, outputs marked",
            Stage::LaunchReturned => "launch: device let go, returned",
        }
    }
}

/// Starts timing this thread: the next mark counts from now.
#[inline(always)]
pub fn start() {
    #[cfg(feature = "stage-clock")]
    clock::start();
}

/// Stops timing this thread.
#[inline(always)]
pub fn stop() {
    #[cfg(feature = "stage-clock")]
    clock::stop();
}

/// Ends `stage` on this thread (when it is being timed): the time since
/// the thread's previous mark is added to it.
#[inline(always)]
pub fn mark(stage: Stage) {
    #[cfg(feature = "stage-clock")]
    clock::mark(stage);
    #[cfg(not(feature = "stage-clock"))]
    let _ = stage;
}

/// Forgets every stage's time.
pub fn reset() {
    #[cfg(feature = "stage-clock")]
    clock::reset();
}

/// Each stage's total time and count since the last [`reset`], in
/// [`Stage::ALL`]'s order (all zero without the feature).
pub fn totals() -> Vec<(Stage, std::time::Duration, u64)> {
    #[cfg(feature = "stage-clock")]
    return clock::totals();
    #[cfg(not(feature = "stage-clock"))]
    Stage::ALL.iter().map(|&s| (s, std::time::Duration::ZERO, 0)).collect()
}

/// The table of [`totals`] per call of `calls`: µs per call, times per
/// call, µs each; stages never met are left out.
pub fn table(calls: u64) -> String {
    let calls = calls.max(1) as f64;
    let mut out = String::new();
    let mut total = 0.0;
    for (stage, time, count) in totals().into_iter().filter(|(_, _, count)| *count > 0) {
        let micros = time.as_secs_f64() * 1e6;
        total += micros / calls;
        out.push_str(&format!(
            "  {:<42} {:>7.3} µs/call {:>6.2} times/call {:>7.3} µs each\n",
            stage.describe(),
            micros / calls,
            count as f64 / calls,
            micros / count as f64
        ));
    }
    out.push_str(&format!("  {:<42} {total:>7.3} µs/call\n", "all stages"));
    out
}

#[cfg(feature = "stage-clock")]
mod clock {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::Stage;

    const STAGES: usize = Stage::ALL.len();
    static NANOS: [AtomicU64; STAGES] = [const { AtomicU64::new(0) }; STAGES];
    static COUNTS: [AtomicU64; STAGES] = [const { AtomicU64::new(0) }; STAGES];

    thread_local! {
        /// When this thread's last mark was, while it is timed.
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }

    pub(super) fn start() {
        LAST.with(|last| last.set(Some(Instant::now())));
    }

    pub(super) fn stop() {
        LAST.with(|last| last.set(None));
    }

    pub(super) fn mark(stage: Stage) {
        LAST.with(|last| {
            let Some(then) = last.get() else { return };
            let i = stage as usize;
            NANOS[i].fetch_add(then.elapsed().as_nanos() as u64, Ordering::Relaxed);
            COUNTS[i].fetch_add(1, Ordering::Relaxed);
            last.set(Some(Instant::now()));
        });
    }

    pub(super) fn reset() {
        for i in 0..STAGES {
            NANOS[i].store(0, Ordering::Relaxed);
            COUNTS[i].store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn totals() -> Vec<(Stage, Duration, u64)> {
        Stage::ALL
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                (s, Duration::from_nanos(NANOS[i].load(Ordering::Relaxed)), COUNTS[i].load(Ordering::Relaxed))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_is_listed_at_its_index_and_described() {
        for (i, stage) in Stage::ALL.iter().enumerate() {
            assert_eq!(*stage as usize, i, "{stage:?} listed out of declaration order");
            assert!(!stage.describe().is_empty());
        }
    }

    #[test]
    fn a_timed_thread_adds_to_the_stages_it_marks_and_an_untimed_one_does_not() {
        // One test touches the process-wide totals, so nothing races it.
        reset();
        mark(Stage::Checked);
        assert!(totals().iter().all(|(_, _, count)| *count == 0), "an untimed thread was counted");
        start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        mark(Stage::Checked);
        mark(Stage::Routed);
        stop();
        mark(Stage::Routed);
        let totals = totals();
        let (_, checked, count) = totals[0];
        if ENABLED {
            assert_eq!(count, 1);
            assert!(checked >= std::time::Duration::from_millis(2), "{checked:?}");
            assert_eq!(totals[1].2, 1, "the mark after stop was counted");
            assert!(table(1).contains("typed call, argument checks"));
        } else {
            assert!(totals.iter().all(|(_, time, count)| *count == 0 && time.is_zero()));
        }
    }
}
