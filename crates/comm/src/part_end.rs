//! [`PartEnd`]: how a collective of one local part ends and is waited for
//! (a one-device group's `device::Solo`, a one-device rank's
//! `communicator::nccl::one::OneCall`). It ends once, done or failed, the
//! first end winning; its waiter looks for the end from its own thread
//! (polling the part's device, or reading its end signal: `EndWatch`) for
//! the runtime's spin window, then sleeps until the end comes. No meeting:
//! one atomic, one lock and one condition variable.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{Client, DeviceId, ServerError};
use parking_lot::{Condvar, Mutex};

use crate::end_watch::EndWatch;
use crate::meeting::WaitEnd;

/// The part is queued, or running on the device.
const RUNNING: u8 = 0;
/// The part's calls completed (or it had none).
const DONE: u8 = 1;
/// The part failed; the failure says why.
const FAILED: u8 = 2;

/// The end of one part: running until [`PartEnd::end`] is called, then done
/// or failed for good. `R` is what its owner hands over to whichever end
/// wins (a flight record to finish), kept under the same lock.
pub(crate) struct PartEnd<R> {
    /// `RUNNING`, `DONE` or `FAILED`; changed under `inner`'s lock.
    state: AtomicU8,
    inner: Mutex<Inner<R>>,
    /// Where a waiter past its spin window sleeps; notified with `inner`'s
    /// lock held after `state` changed, so no end is missed.
    ended: Condvar,
}

struct Inner<R> {
    failure: Option<ServerError>,
    /// Taken by the end that wins.
    kept: Option<R>,
}

impl<R> PartEnd<R> {
    /// A running part, keeping `kept` for the end that wins.
    pub(crate) fn new(kept: R) -> Self {
        Self {
            state: AtomicU8::new(RUNNING),
            inner: Mutex::new(Inner { failure: None, kept: Some(kept) }),
            ended: Condvar::new(),
        }
    }

    /// Ends the part with `outcome` unless it ended already (the first end
    /// wins), running `on_failure` under the lock before any waiter wakes
    /// when this end fails it. Returns the part's outcome (the first end's)
    /// and, to the end that won, what was kept.
    pub(crate) fn end(
        &self,
        outcome: Result<(), ServerError>,
        on_failure: impl FnOnce(),
    ) -> (Result<(), ServerError>, Option<R>) {
        let mut inner = self.inner.lock();
        let mut kept = None;
        if self.state.load(Ordering::Acquire) == RUNNING {
            match outcome {
                Ok(()) => self.state.store(DONE, Ordering::Release),
                Err(err) => {
                    on_failure();
                    inner.failure = Some(err);
                    self.state.store(FAILED, Ordering::Release);
                }
            }
            kept = inner.kept.take();
            self.ended.notify_all();
        }
        (inner.failure.clone().map_or(Ok(()), Err), kept)
    }

    /// Whether the part ended (completed or failed). Never blocks.
    pub(crate) fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) != RUNNING
    }

    /// The part's failure, once it failed.
    pub(crate) fn failure(&self) -> Option<ServerError> {
        match self.state.load(Ordering::Acquire) {
            FAILED => self.inner.lock().failure.clone(),
            _ => None,
        }
    }

    /// The outcome once ended, as `inner` (its lock held) says: `None`
    /// while the part runs.
    fn outcome_in(&self, inner: &Inner<R>) -> Option<Result<(), WaitEnd>> {
        match self.state.load(Ordering::Acquire) {
            RUNNING => None,
            DONE => Some(Ok(())),
            _ => Some(Err(WaitEnd::Failed(inner.failure.clone().expect("set before FAILED")))),
        }
    }

    /// The outcome once ended: `None` while the part runs (no lock then).
    fn outcome(&self) -> Option<Result<(), WaitEnd>> {
        match self.state.load(Ordering::Acquire) {
            RUNNING => None,
            _ => self.outcome_in(&self.inner.lock()),
        }
    }

    /// Waits until the part ended or `deadline` passed: looks for the end
    /// from this thread on `client`, the part's device, for the spin window
    /// (between looks it returns as soon as the part ended, by whichever
    /// thread's hand), then sleeps until the end comes. Past the deadline
    /// the error is `running()`, the part in words.
    pub(crate) fn wait_until(
        &self,
        client: &Client,
        deadline: Option<Instant>,
        running: impl FnOnce() -> String,
    ) -> Result<(), WaitEnd> {
        if let Some(outcome) = self.outcome() {
            return outcome;
        }
        let (start, window) = (Instant::now(), cohort_runtime::spin_window());
        let mut watch = EndWatch::new(std::slice::from_ref(client));
        loop {
            if watch.look() {
                stages::mark(Stage::WaitHelped);
            }
            if let Some(outcome) = self.outcome() {
                stages::mark(Stage::WaitLooked);
                return outcome;
            }
            if start.elapsed() >= window {
                break;
            }
            std::hint::spin_loop();
        }
        let mut inner = self.inner.lock();
        loop {
            if let Some(outcome) = self.outcome_in(&inner) {
                return outcome;
            }
            match deadline {
                None => self.ended.wait(&mut inner),
                Some(deadline) => {
                    let late = self.ended.wait_until(&mut inner, deadline).timed_out();
                    if late && self.state.load(Ordering::Acquire) == RUNNING {
                        return Err(WaitEnd::Late(running()));
                    }
                }
            }
        }
    }
}

/// A one-part call, as the guard its task holds sees it ([`Unfinished`]).
pub(crate) trait Abandoned: Send + Sync {
    /// The call's task was dropped before it returned; `err` says why.
    fn abandoned(&self, err: ServerError);
}

/// Held by a one-part call's task until it returned: dropped before that
/// (unrun, because its device closed or it could not be queued; or
/// unwinding from a panic in it), it tells the call, so that its waiter
/// returns at once.
pub(crate) struct Unfinished<C: Abandoned> {
    call: Option<Arc<C>>,
    operation: &'static str,
    device: DeviceId,
}

impl<C: Abandoned> Unfinished<C> {
    /// The guard of `call`, collective `operation` on `device`.
    pub(crate) fn new(call: Arc<C>, operation: &'static str, device: DeviceId) -> Self {
        Self { call: Some(call), operation, device }
    }

    pub(crate) fn call(&self) -> &Arc<C> {
        self.call.as_ref().expect("held until the task returns")
    }

    /// The task returned (its part ended, or is left running on the
    /// device): dropping the guard no longer fails the call.
    pub(crate) fn returned(mut self) {
        self.call = None;
    }
}

impl<C: Abandoned> Drop for Unfinished<C> {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else { return };
        let (device, operation) = (self.device, self.operation);
        let err = if std::thread::panicking() {
            ServerError::TaskPanicked { device, message: format!("{operation} panicked while it queued its part") }
        } else {
            let cause = Arc::new(ServerError::DeviceClosed { device });
            ServerError::Poisoned { operation: operation.to_string(), cause }
        };
        call.abandoned(err);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use cohort_runtime::{CpuRuntime, DeviceId, Runtime};

    use super::*;

    fn failure(why: &str) -> ServerError {
        ServerError::Collective {
            collective: "all_reduce".into(),
            device: DeviceId::new(DeviceId::CPU, 0),
            reason: why.into(),
        }
    }

    /// The first end wins: its outcome stays, and only it gets what was kept
    /// (and runs `on_failure`).
    #[test]
    fn the_first_end_wins_and_alone_takes_what_was_kept() {
        let end = PartEnd::new("record");
        let mut told = 0;
        let (outcome, kept) = end.end(Err(failure("first")), || told += 1);
        assert_eq!(outcome.unwrap_err().to_string(), failure("first").to_string());
        assert_eq!(kept, Some("record"));
        let (outcome, kept) = end.end(Ok(()), || told += 1);
        assert!(outcome.is_err(), "a later end changes nothing");
        assert_eq!(kept, None);
        let (_, kept) = end.end(Err(failure("second")), || told += 1);
        assert_eq!(kept, None);
        assert_eq!(told, 1);
        assert!(end.is_done());
        assert!(end.failure().unwrap().to_string().contains("first"));
    }

    /// A waiter asleep past its spin window wakes at the end; one with a
    /// deadline that passes first gets the part in words.
    #[test]
    fn a_waiter_wakes_at_the_end_and_a_late_one_names_the_part() {
        let client = CpuRuntime::client(0).unwrap();
        let end = Arc::new(PartEnd::new(()));
        let late = end.wait_until(&client, Some(Instant::now() + Duration::from_millis(20)), || "cpu:0 running".into());
        assert_eq!(late, Err(WaitEnd::Late("cpu:0 running".into())));
        let ender = {
            let end = end.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                end.end(Ok(()), || {})
            })
        };
        assert_eq!(end.wait_until(&client, None, String::new), Ok(()));
        assert!(ender.join().unwrap().0.is_ok());
        assert!(end.failure().is_none());
    }
}
