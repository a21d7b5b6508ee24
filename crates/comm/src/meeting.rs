//! Where the parts of one collective meet on their device threads: one
//! primitive for every executor (the host engine, the device path, a
//! communicator's host and NCCL paths), generic over the state each keeps
//! beside it under the same lock.
//!
//! Each part's task arrives (marking itself present) and waits for the
//! others, polling for the runtime's spin window
//! ([`cohort_runtime::spin_window`]) before it sleeps. The first failure
//! any part meets is the meeting's, and every part and waiter returns it.
//! Waits are bounded by the collective's deadline, and the error names the
//! parts that never arrived (or never did what the executor waited for). A
//! [`Ticket`] dropped unrun (its device closed) or in a panicking part
//! fails the meeting, so the other parts return at once instead of at the
//! deadline.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{Client, DeviceId, ServerError};
use parking_lot::{Condvar, Mutex, MutexGuard};
use smallvec::SmallVec;

/// Who takes one slot: its device, and its member number where errors name
/// members (a group's parts) rather than this rank's local devices.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seat {
    pub device: DeviceId,
    pub member: Option<usize>,
}

/// One flag per part, inline for up to eight parts.
type Flags = SmallVec<[bool; 8]>;

/// The state every meeting shares, and the executor's own (`data`).
pub(crate) struct Gathering<S> {
    pub arrived: usize,
    present: Flags,
    /// Tasks that returned, or were dropped unrun: how many, and which.
    returned: usize,
    returned_slots: Flags,
    failure: Option<ServerError>,
    pub data: S,
}

impl<S> Gathering<S> {
    /// The meeting's failure, if any part met one.
    pub(crate) fn failure(&self) -> Option<&ServerError> {
        self.failure.as_ref()
    }

    /// Whether every part arrived.
    pub(crate) fn all_arrived(&self) -> bool {
        self.arrived == self.present.len()
    }

    /// Whether `slot`'s task returned (or was dropped unrun).
    pub(crate) fn task_returned(&self, slot: usize) -> bool {
        self.returned_slots[slot]
    }
}

/// Why a wait for a meeting's parts to finish ended without them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WaitEnd {
    /// The meeting failed.
    Failed(ServerError),
    /// The deadline passed first; the parts not finished, in words.
    Late(String),
}

/// One collective's meeting of parts.
pub(crate) struct Meeting<S> {
    name: &'static str,
    seats: SmallVec<[Seat; 4]>,
    timeout: Duration,
    state: Mutex<Gathering<S>>,
    cv: Condvar,
    /// `Gathering::arrived` and whether a failure is set, readable without
    /// the lock by parts polling for the others.
    arrived: AtomicUsize,
    failed: AtomicBool,
    /// Bumped at every wake-up, so a waiter can poll for a change without
    /// the lock during the runtime's spin window before it sleeps.
    changes: AtomicU64,
}

impl<S> Meeting<S> {
    /// A meeting of `seats` for collective `name`, whose waits end at
    /// `timeout` after they begin. Up to four seats (eight flags) need no
    /// heap allocation beyond the executor's own.
    pub(crate) fn new(
        name: &'static str,
        seats: impl IntoIterator<Item = Seat>,
        timeout: Duration,
        data: S,
    ) -> Meeting<S> {
        let seats: SmallVec<[Seat; 4]> = seats.into_iter().collect();
        let state = Gathering {
            arrived: 0,
            present: smallvec::smallvec![false; seats.len()],
            returned: 0,
            returned_slots: smallvec::smallvec![false; seats.len()],
            failure: None,
            data,
        };
        Meeting {
            name,
            seats,
            timeout,
            state: Mutex::new(state),
            cv: Condvar::new(),
            arrived: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            changes: AtomicU64::new(0),
        }
    }

    /// The collective's name.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Number of parts.
    pub(crate) fn len(&self) -> usize {
        self.seats.len()
    }

    /// Who takes `slot`.
    pub(crate) fn seat(&self, slot: usize) -> Seat {
        self.seats[slot]
    }

    /// How long a wait lasts.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The meeting's state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Gathering<S>> {
        self.state.lock()
    }

    /// Wakes every part waiting on the meeting.
    pub(crate) fn notify(&self) {
        self.wake_all();
    }

    /// Wakes every waiter: those polling (see [`Meeting::spin_for_change`])
    /// and those asleep.
    fn wake_all(&self) {
        self.changes.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }

    /// Polls for a wake-up with the lock released, for up to the runtime's
    /// spin window (`COHORT_SPIN_US`), and returns with the lock held again:
    /// a short wait then costs no sleep and wake-up. The caller looks at the
    /// state again before it sleeps on the condition variable (a wake-up may
    /// have come and gone while the lock was released).
    fn spin_for_change(&self, state: &mut MutexGuard<'_, Gathering<S>>) {
        let window = cohort_runtime::spin_window();
        if window.is_zero() {
            return;
        }
        let seen = self.changes.load(Ordering::Acquire);
        MutexGuard::unlocked(state, || {
            let start = Instant::now();
            let mut polls = 0u32;
            while self.changes.load(Ordering::Acquire) == seen {
                polls = polls.wrapping_add(1);
                // Reading the clock costs more than a poll: look every 64.
                if polls.is_multiple_of(64) && start.elapsed() >= window {
                    return;
                }
                if polls < 256 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        });
    }

    /// Sleeps until woken (no deadline: for waits bounded by someone else's).
    pub(crate) fn sleep(&self, state: &mut MutexGuard<'_, Gathering<S>>) {
        self.cv.wait(state);
    }

    /// Sleeps until woken or `deadline`; whether it timed out.
    pub(crate) fn sleep_until(&self, state: &mut MutexGuard<'_, Gathering<S>>, deadline: Instant) -> bool {
        self.cv.wait_until(state, deadline).timed_out()
    }

    /// Whether the meeting failed (without the lock).
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The meeting's failure, if any.
    pub(crate) fn failure(&self) -> Option<ServerError> {
        self.state.lock().failure.clone()
    }

    /// Records `err` as the meeting's failure (the first one wins), wakes
    /// every waiter, and returns the failure.
    pub(crate) fn fail_locked(&self, state: &mut Gathering<S>, err: ServerError) -> ServerError {
        let failure = state.failure.get_or_insert(err).clone();
        self.failed.store(true, Ordering::Release);
        self.wake_all();
        failure
    }

    /// [`Meeting::fail_locked`], taking the lock.
    pub(crate) fn fail(&self, err: ServerError) -> ServerError {
        self.fail_locked(&mut self.state.lock(), err)
    }

    /// The collective's error on `slot`'s device.
    pub(crate) fn error(&self, slot: usize, reason: String) -> ServerError {
        ServerError::Collective { collective: self.name.to_string(), device: self.seats[slot].device, reason }
    }

    /// The parts whose flag is unset, in words: `member 1 (cpu:1), member
    /// 3 (cpu:3)` for a group's parts, `cuda:0, cuda:1` for a rank's.
    pub(crate) fn names(&self, flags: &[bool]) -> String {
        let names: Vec<String> = self
            .seats
            .iter()
            .zip(flags)
            .filter(|(_, set)| !**set)
            .map(|(seat, _)| match seat.member {
                Some(member) => format!("member {member} ({})", seat.device),
                None => seat.device.to_string(),
            })
            .collect();
        names.join(", ")
    }

    /// The error of a wait that ended at the deadline with `what` still
    /// missing (`what`: "member 1 (cpu:1) did not arrive").
    pub(crate) fn late(&self, slot: usize, what: &str) -> ServerError {
        self.error(
            slot,
            format!(
                "{what} within {:.1} s: their devices are still busy with earlier work or blocked; every member \
                 must call the same collectives in the same order (raise COHORT_TIMEOUT, in seconds, if the work \
                 before it is legitimately that long)",
                self.timeout.as_secs_f64()
            ),
        )
    }

    /// The error naming the parts that never arrived.
    fn absent(&self, slot: usize, state: &Gathering<S>) -> ServerError {
        let names = self.names(&state.present);
        match self.seats[slot].member {
            Some(_) => self.late(slot, &format!("{names} did not arrive")),
            None => self.error(
                slot,
                format!(
                    "local device(s) {names} of this rank never reached it within {:.1} s (still busy with \
                     earlier work?)",
                    self.timeout.as_secs_f64()
                ),
            ),
        }
    }

    /// Marks `slot` present; `Ok(true)` when it was the last to arrive.
    /// Refuses, with the failure, once the meeting failed.
    pub(crate) fn arrive_locked(&self, state: &mut Gathering<S>, slot: usize) -> Result<bool, ServerError> {
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        state.present[slot] = true;
        state.arrived += 1;
        self.arrived.store(state.arrived, Ordering::Release);
        let last = state.all_arrived();
        if last {
            self.wake_all();
        }
        Ok(last)
    }

    /// Waits until every part arrived: polls for the spin window, then
    /// sleeps up to `deadline`, past which it fails the meeting naming the
    /// parts that never arrived. Returns the meeting's failure, if any.
    pub(crate) fn wait_arrivals(
        &self,
        state: &mut MutexGuard<'_, Gathering<S>>,
        slot: usize,
        deadline: Instant,
    ) -> Result<(), ServerError> {
        let n = self.seats.len();
        // No window (fewer than 4 cores): sleep at once. Even 64 polls cost
        // microseconds (a spin-loop hint can take ~100 cycles), which a
        // meeting of a few-µs collective cannot afford.
        let window = cohort_runtime::spin_window();
        if state.arrived < n && state.failure.is_none() && !window.is_zero() {
            MutexGuard::unlocked(state, || {
                let started = Instant::now();
                let mut polls = 0u32;
                while self.arrived.load(Ordering::Acquire) < n && !self.failed() {
                    polls = polls.wrapping_add(1);
                    if polls.is_multiple_of(64) && started.elapsed() >= window {
                        break;
                    }
                    std::hint::spin_loop();
                }
            });
        }
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if state.all_arrived() {
                return Ok(());
            }
            if self.sleep_until(state, deadline) && !state.all_arrived() && state.failure.is_none() {
                let err = self.absent(slot, state);
                return Err(self.fail_locked(state, err));
            }
        }
    }

    /// Waits (up to `deadline`) until `ready` holds or the meeting failed;
    /// past the deadline, fails it with [`Meeting::late`] and `missing`'s
    /// words.
    pub(crate) fn wait_for(
        &self,
        state: &mut MutexGuard<'_, Gathering<S>>,
        slot: usize,
        deadline: Instant,
        ready: impl Fn(&Gathering<S>) -> bool,
        missing: impl Fn(&Gathering<S>) -> String,
    ) -> Result<(), ServerError> {
        loop {
            if let Some(err) = &state.failure {
                return Err(err.clone());
            }
            if ready(state) {
                return Ok(());
            }
            if self.sleep_until(state, deadline) && !ready(state) && state.failure.is_none() {
                let err = self.late(slot, &missing(state));
                return Err(self.fail_locked(state, err));
            }
        }
    }

    /// Blocks the calling thread until `done` holds for every slot, the
    /// meeting failed, or `deadline` (if any) passed. Unlike the parts'
    /// own waits, a deadline passing here fails nothing: the parts go on,
    /// and the error names those not done yet.
    pub(crate) fn wait_done(
        &self,
        deadline: Option<Instant>,
        done: impl Fn(&Gathering<S>, usize) -> bool,
    ) -> Result<(), WaitEnd> {
        let mut state = self.state.lock();
        let mut spun = false;
        loop {
            if let Some(err) = &state.failure {
                return Err(WaitEnd::Failed(err.clone()));
            }
            if (0..self.seats.len()).all(|slot| done(&state, slot)) {
                return Ok(());
            }
            if !spun {
                // Once per wait, then the state is looked at again (above)
                // before any sleep.
                spun = true;
                self.spin_for_change(&mut state);
                continue;
            }
            match deadline {
                None => self.cv.wait(&mut state),
                Some(deadline) => {
                    if self.cv.wait_until(&mut state, deadline).timed_out() {
                        let flags: Vec<bool> = (0..self.seats.len()).map(|slot| done(&state, slot)).collect();
                        if state.failure.is_none() && !flags.iter().all(|f| *f) {
                            return Err(WaitEnd::Late(self.unfinished(&state, &flags)));
                        }
                    }
                }
            }
        }
    }

    /// The parts not finished (`done` false), in words. Every part was
    /// called when the collective was queued (a process queues all its
    /// parts at once), so none is "not arrived": a part is running, or its
    /// task is still queued on its device, not started (its device busy
    /// with earlier work, or not yet at it).
    fn unfinished(&self, state: &Gathering<S>, done: &[bool]) -> String {
        let names = self.names(done);
        let unfinished = done.iter().filter(|d| !**d).count();
        let queued = self.seats.len() - state.arrived;
        let on = if queued == 1 { "its device" } else { "their devices" };
        match queued {
            0 => format!("{names} not finished"),
            1 if unfinished == 1 => format!("{names} not finished (not started yet: still queued on its device)"),
            _ if queued == unfinished => format!("{names} not finished (none started yet: still queued on {on})"),
            _ => format!("{names} not finished ({queued} of them not started yet: still queued on {on})"),
        }
    }

    /// Whether `done` holds for every slot, or the meeting failed (without
    /// waiting).
    pub(crate) fn is_done(&self, done: impl Fn(&Gathering<S>, usize) -> bool) -> bool {
        let state = self.state.lock();
        state.failure.is_some() || (0..self.seats.len()).all(|slot| done(&state, slot))
    }

    /// `slot`'s task returned, or did not: dropped unrun (its device
    /// closed) or unwinding from a panic, which fails the meeting (the
    /// part will do nothing more, so no one may wait for it).
    fn returned(&self, slot: usize, how: Returned) {
        let mut state = self.state.lock();
        let device = self.seats[slot].device;
        let err = match how {
            Returned::Ran => None,
            Returned::Unrun => Some(ServerError::Poisoned {
                operation: self.name.to_string(),
                cause: Arc::new(ServerError::DeviceClosed { device }),
            }),
            Returned::Panicked => {
                Some(ServerError::TaskPanicked { device, message: format!("{}'s part panicked", self.name) })
            }
        };
        if let Some(err) = err {
            self.fail_locked(&mut state, err);
        }
        state.returned += 1;
        state.returned_slots[slot] = true;
        self.wake_all();
    }
}

/// An executor that meets its parts through a [`Meeting`].
pub(crate) trait Seated: Send + Sync + 'static {
    /// The executor's own state, kept in the meeting.
    type State;

    /// Its meeting.
    fn meeting(&self) -> &Meeting<Self::State>;

    /// Part `slot`'s task was dropped unrun (after the meeting failed).
    fn dropped_unrun(&self, _slot: usize) {}

    /// The devices whose running collectives a waiter polls itself, from
    /// its own thread, for the runtime's spin window (`Work::wait`; a
    /// device whose thread holds it for a moment is skipped that round):
    /// by default none, and the devices' threads tell the meeting.
    fn helpers(&self) -> &[Client] {
        &[]
    }

    /// Whether part `slot` finished its work: by default, once its task
    /// returned; executors whose parts leave work running on the device
    /// after their task returned say when that ended.
    fn part_done(&self, state: &Gathering<Self::State>, slot: usize) -> bool {
        state.task_returned(slot)
    }
}

/// A part's right to run. Dropped without running (its device closed, its
/// queue was dropped) or while its part unwinds from a panic, it fails the
/// meeting so the other parts and the waiters return at once instead of
/// waiting for the deadline (or, for a waiter with none, forever).
pub(crate) struct Ticket<E: Seated> {
    executor: Arc<E>,
    slot: usize,
    ran: bool,
}

impl<E: Seated> Ticket<E> {
    /// Part `slot`'s ticket.
    pub(crate) fn new(executor: &Arc<E>, slot: usize) -> Ticket<E> {
        Ticket { executor: executor.clone(), slot, ran: false }
    }

    /// Runs the part: `body` with the executor and the slot.
    pub(crate) fn run<R>(mut self, body: impl FnOnce(&Arc<E>, usize) -> R) -> R {
        self.ran = true;
        body(&self.executor, self.slot)
    }
}

/// How a part's task left its ticket.
enum Returned {
    Ran,
    /// Dropped without running (its device closed).
    Unrun,
    /// Unwinding from a panic in the part.
    Panicked,
}

impl<E: Seated> Drop for Ticket<E> {
    fn drop(&mut self) {
        let how = match (self.ran, std::thread::panicking()) {
            (false, _) => Returned::Unrun,
            (true, true) => Returned::Panicked,
            (true, false) => Returned::Ran,
        };
        self.executor.meeting().returned(self.slot, how);
        if !self.ran {
            self.executor.dropped_unrun(self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Bare(Meeting<()>);

    impl Seated for Bare {
        type State = ();
        fn meeting(&self) -> &Meeting<()> {
            &self.0
        }
    }

    fn bare(parts: usize, timeout: Duration, members: bool) -> Arc<Bare> {
        let seats: Vec<Seat> = (0..parts)
            .map(|i| Seat { device: DeviceId::new(DeviceId::CPU, i as u32), member: members.then_some(i) })
            .collect();
        Arc::new(Bare(Meeting::new("all_reduce", seats, timeout, ())))
    }

    #[test]
    fn every_part_meets_and_the_waiter_sees_them_return() {
        let m = bare(3, Duration::from_secs(5), true);
        let threads: Vec<_> = (0..3)
            .map(|slot| {
                let ticket = Ticket::new(&m, slot);
                std::thread::spawn(move || {
                    ticket.run(|e, slot| {
                        let meeting = e.meeting();
                        let mut state = meeting.lock();
                        meeting.arrive_locked(&mut state, slot)?;
                        meeting.wait_arrivals(&mut state, slot, Instant::now() + meeting.timeout())
                    })
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        m.meeting().wait_done(None, |s, slot| s.task_returned(slot)).unwrap();
    }

    #[test]
    fn the_deadline_names_who_never_arrived() {
        let m = bare(3, Duration::from_millis(50), true);
        let meeting = m.meeting();
        let mut state = meeting.lock();
        meeting.arrive_locked(&mut state, 1).unwrap();
        let err = meeting.wait_arrivals(&mut state, 1, Instant::now() + meeting.timeout()).unwrap_err();
        drop(state);
        let text = err.to_string();
        assert!(text.contains("member 0 (cpu:0), member 2 (cpu:2) did not arrive within 0.1 s"), "{text}");
        assert_eq!(meeting.failure(), Some(err), "the failure is the meeting's");
        let local = bare(2, Duration::from_millis(20), false);
        let meeting = local.meeting();
        let mut state = meeting.lock();
        meeting.arrive_locked(&mut state, 0).unwrap();
        let err = meeting.wait_arrivals(&mut state, 0, Instant::now() + meeting.timeout()).unwrap_err();
        assert!(err.to_string().contains("local device(s) cpu:1 of this rank never reached it"), "{err}");
    }

    #[test]
    fn a_ticket_dropped_unrun_fails_the_meeting() {
        let m = bare(2, Duration::from_secs(60), true);
        drop(Ticket::new(&m, 1));
        let err = match m.meeting().wait_done(None, |s, slot| s.task_returned(slot)) {
            Err(WaitEnd::Failed(err)) => err,
            other => panic!("the meeting should have failed: {other:?}"),
        };
        assert!(matches!(err.root_cause(), ServerError::DeviceClosed { .. }), "{err}");
        let meeting = m.meeting();
        let refused = meeting.arrive_locked(&mut meeting.lock(), 0).unwrap_err();
        assert_eq!(refused, err);
    }

    /// A part whose task panics after its ticket ran fails the meeting
    /// (naming the panic), so a waiter for parts that would end only with
    /// device work the task never queued returns at once, even with no
    /// deadline, instead of waiting forever.
    #[test]
    fn a_part_whose_task_panics_fails_the_meeting_so_no_waiter_hangs() {
        let m = bare(2, Duration::from_secs(60), true);
        let ticket = Ticket::new(&m, 0);
        let unwound = std::thread::spawn(move || ticket.run(|_, _| panic!("the part's task broke"))).join();
        assert!(unwound.is_err(), "the task panicked");
        // Slot 0's device work never ends (the task never queued it): only
        // the failure ends the wait. Bounded, so the test cannot hang.
        let never = |_: &Gathering<()>, _: usize| false;
        let err = match m.meeting().wait_done(Some(Instant::now() + Duration::from_secs(10)), never) {
            Err(WaitEnd::Failed(err)) => err,
            other => panic!("the meeting should have failed: {other:?}"),
        };
        assert!(matches!(err, ServerError::TaskPanicked { .. }), "{err}");
        assert!(err.to_string().contains("all_reduce"), "{err}");
        assert!(m.meeting().is_done(never));
    }
}
