//! [`Work`]: the handle every collective returns, to wait on or poll.
//!
//! A collective is queued on its members' device threads when the call
//! returns; the handle watches its meeting (the one primitive every
//! executor of several parts meets on), or the end of its one part (a
//! one-device group's `Solo`, a one-device rank's `OneCall`: `PartEnd`),
//! and says when every local part finished: the host
//! engine's and a communicator's host path once their tasks returned, the
//! device path and NCCL once the calls they queued completed on the device.
//! Dropping the handle cancels nothing: stream order still holds, and reads
//! of the destinations still wait for the collective.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::stages::{self, Stage};

use crate::end_watch::EndWatch;
use crate::error::CommError;
use crate::meeting::{Seated, WaitEnd};

/// Where a handle's call runs beyond this process: the rank this process
/// is, and what the other ranks published about the call (a
/// [`Communicator`](crate::Communicator)'s handles). A bounded wait that
/// expires names them.
pub(crate) trait Ranks: Send + Sync {
    /// Who this process is: `rank 1`, `rank 3 in group comm1.s0c1 (ranks
    /// 1, 3)`.
    fn scope(&self) -> &str;

    /// The other ranks call `call` (named `operation`) still waits for, in
    /// words: those that have not arrived at it yet, those that arrived and
    /// have not finished it, those that went away. Reads what they
    /// published (one store round trip).
    fn waiting_for(&self, operation: &str, call: RankCall) -> String;
}

/// A communicator's call, as the other ranks know it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankCall {
    /// Its sequence number: the communicator's collectives (a grouped call
    /// is one), or for a message the messages between its two ranks.
    pub seq: u64,
    /// The other rank of a message (send or recv); `None` for a collective
    /// of every rank.
    pub peer: Option<usize>,
}

/// What a [`Work`] waits on: one executor's meeting, or a collective of
/// one part (`device::Solo`, `communicator::nccl::one::OneCall`).
pub(crate) trait Waitable: Send + Sync {
    fn wait_until(&self, deadline: Option<Instant>) -> Result<(), WaitEnd>;
    fn is_done(&self) -> bool;
}

impl<E: Seated> Waitable for E {
    fn wait_until(&self, deadline: Option<Instant>) -> Result<(), WaitEnd> {
        // Where the executor can look for its own end on this thread (its
        // parts' calls run on devices this thread polls when they are
        // idle), it does so for the spin window before it
        // waits for the device thread to tell it: no wake-up on either
        // side. When it cannot look for a moment (the device thread holds
        // the device, polling the same collectives), it goes on watching:
        // the end is seen as soon as either thread finds it. It reads the
        // devices' end signals between polls (`EndWatch`).
        //
        let helpers = self.helpers();
        if !helpers.is_empty() && !self.is_done() {
            let (start, window) = (Instant::now(), cohort_runtime::spin_window());
            let mut watch = EndWatch::new(helpers);
            loop {
                if watch.look() {
                    stages::mark(Stage::WaitHelped);
                    let done = self.is_done();
                    stages::mark(Stage::WaitLooked);
                    if done {
                        break;
                    }
                }
                if start.elapsed() >= window {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let ended = self.meeting().wait_done(deadline, |state, slot| self.part_done(state, slot));
        stages::mark(Stage::WaitEnded);
        ended
    }

    fn is_done(&self) -> bool {
        self.meeting().is_done(|state, slot| self.part_done(state, slot))
    }
}

impl Waitable for crate::device::Solo {
    fn wait_until(&self, deadline: Option<Instant>) -> Result<(), WaitEnd> {
        crate::device::Solo::wait_until(self, deadline)
    }

    fn is_done(&self) -> bool {
        crate::device::Solo::is_done(self)
    }
}

/// A queued collective (or grouped call), like PyTorch's `Work`: wait for
/// it, with or without a bound, or ask whether it is done.
///
/// It covers this process's parts only: on a [`Communicator`](crate::Communicator)
/// the other ranks' parts are theirs to wait on. Dropping it does not
/// cancel the collective; later work on its buffers still runs after it.
pub struct Work {
    operation: &'static str,
    /// On a communicator: who this process is and which call of its ranks
    /// this is, for errors ("rank 1", and the ranks it waits for).
    ranks: Option<(Arc<dyn Ranks>, RankCall)>,
    /// What it waits on: none when nothing was queued on this process
    /// (it takes no part); `first` alone for one collective (no heap
    /// allocation beyond the executor's own); `first` and `rest` for a
    /// grouped call that ran as several.
    first: Option<Arc<dyn Waitable>>,
    rest: Vec<Arc<dyn Waitable>>,
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Work").field("operation", &self.operation).field("done", &self.is_done()).finish()
    }
}

impl Work {
    /// The handle of the collective `operation` that `executor` says the
    /// end of (an executor's meeting, or a call of one part).
    pub(crate) fn new(operation: &'static str, executor: Arc<dyn Waitable>) -> Work {
        Work { operation, ranks: None, first: Some(executor), rest: Vec::new() }
    }

    /// A handle that is done already: this process queued nothing.
    pub(crate) fn nothing(operation: &'static str) -> Work {
        Work { operation, ranks: None, first: None, rest: Vec::new() }
    }

    /// One handle over every handle of `works` (a grouped call queued as
    /// several collectives).
    pub(crate) fn all(operation: &'static str, works: Vec<Work>) -> Work {
        let ranks = works.iter().find_map(|w| w.ranks.clone());
        let mut inner = works.into_iter().flat_map(|w| w.first.into_iter().chain(w.rest));
        let first = inner.next();
        Work { operation, ranks, first, rest: inner.collect() }
    }

    /// This handle of call `call` of `ranks`: its errors name the process
    /// (`"rank 1"`) and the other ranks the call waits for.
    pub(crate) fn within(mut self, ranks: Arc<dyn Ranks>, call: RankCall) -> Work {
        self.ranks = Some((ranks, call));
        self
    }

    /// The collective's name (`"all_reduce"`; `"group"` for a grouped call).
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// Blocks the calling thread until every local part finished; returns
    /// the collective's failure, if it failed. The parts' own waits are
    /// bounded by the collective's timeout, so this returns by then.
    pub fn wait(&self) -> Result<(), CommError> {
        self.wait_until(None)
    }

    /// [`Work::wait`] for at most `timeout`. When it passes first, the
    /// error ([`CommError::Unfinished`]) names the members that have not
    /// finished yet (and how many have not started: still queued on their
    /// device); on a communicator, it names the other ranks the call waits
    /// for (those not arrived at it yet, with the last call each reported,
    /// those arrived and not finished, those gone), read from what they
    /// published in the store (their progress, at most 50 ms old), then
    /// this rank's devices not finished. The collective is not cancelled,
    /// and a later wait may still succeed. A timeout too long for a
    /// deadline (`Duration::MAX`) waits like [`Work::wait`].
    pub fn wait_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        self.wait_until(Instant::now().checked_add(timeout)).map_err(|err| match err {
            CommError::Unfinished { operation, scope, missing, .. } => {
                CommError::Unfinished { operation, scope, missing, waited_ms: timeout.as_millis() as u64 }
            }
            other => other,
        })
    }

    /// Whether every local part finished (or the collective failed:
    /// [`Work::wait`] then returns why). Never blocks.
    pub fn is_done(&self) -> bool {
        self.parts().all(|inner| inner.is_done())
    }

    /// Every executor this handle waits on.
    fn parts(&self) -> impl Iterator<Item = &Arc<dyn Waitable>> {
        self.first.iter().chain(&self.rest)
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Result<(), CommError> {
        for inner in self.parts() {
            self.end(inner.wait_until(deadline))?;
        }
        Ok(())
    }

    fn end(&self, waited: Result<(), WaitEnd>) -> Result<(), CommError> {
        waited.map_err(|end| match end {
            WaitEnd::Failed(source) => CommError::Failed { operation: self.operation, source },
            WaitEnd::Late(local) => {
                let (scope, missing) = match &self.ranks {
                    Some((ranks, call)) => (
                        format!(" on {}", ranks.scope()),
                        format!("{}; this rank's {local}", ranks.waiting_for(self.operation, *call)),
                    ),
                    None => (String::new(), local),
                };
                CommError::Unfinished { operation: self.operation, scope, missing, waited_ms: 0 }
            }
        })
    }
}
