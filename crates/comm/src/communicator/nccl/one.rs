//! A call on a rank with one local device (one process per GPU, the usual
//! way to run a job): its one part meets nobody on this rank, so it needs
//! none of a meeting's machinery (no seats to gather, no tickets to count,
//! no done hook to box). One object is the handle's waitable, the owner of
//! the part's [`PartMonitor`](super::call::PartMonitor) and the holder of
//! its flight record.
//!
//! The part's task runs the call's host check (sent ahead, or waited for:
//! [`CallCore::check`]) and queues its calls ([`part_task`]), from the
//! caller's thread where the call queues inline (`Nccl::queues_inline`),
//! otherwise from the device thread. A waiter polls the device for the
//! part's end itself for the spin window, then sleeps ([`PartEnd`]).
//!
//! The call fails for its waiters as soon as a failure is met (the check,
//! the device, another rank's abort); a failure met after the part ended
//! done changes nothing for them (the destinations are still marked). Its
//! flight record ends when the part ended on the device, or never got
//! there. A task dropped unrun once queued (the device closed) or
//! unwinding from a panic drops the record unfinished, which tells the
//! other ranks (see `Tracker`); one that could not be queued hands it back
//! to the caller ([`Refused`]), which drops it once it let go of its locks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, ServerError};
use parking_lot::Mutex;

use super::call::{part_task, CallCore, PartBuffers, PartFusion, PartLayout, PartOwner};
use super::Refused;
use crate::communicator::failure::{Failure, FailureKind};
use crate::communicator::observe::Tracker;
use crate::error::CommError;
use crate::meeting::WaitEnd;
use crate::part_end::{Abandoned, PartEnd, Unfinished};
use crate::work::Waitable;

/// One call's one part on this rank's device.
pub(crate) struct OneCall {
    core: CallCore,
    client: Client,
    end: PartEnd<()>,
    record: Mutex<Record>,
    /// Set once its task was queued (or ran inline): a task dropped before
    /// that was refused, and its record goes back to the caller.
    queued: AtomicBool,
}

/// What a [`OneCall`] tells its flight record when the part ended.
struct Record {
    /// Taken when the part ended (or dropped unfinished).
    tracker: Option<Tracker>,
    /// The kind of failure met, where one said (the first wins).
    kind: Option<FailureKind>,
}

/// Queues `core`'s call on `client`, the rank's one device, with the
/// part's `buffers`: from this thread at once with `inline` where the
/// device is idle, otherwise through the device thread. Returns the call
/// to wait on once the part is queued; `tracker` is its flight record.
pub(crate) fn launch(
    core: CallCore,
    client: &Client,
    tracker: Tracker,
    inline: bool,
    buffers: PartBuffers,
) -> Result<Arc<OneCall>, Box<Refused>> {
    let PartBuffers { input, output, layout, fusion } = buffers;
    let name = core.name;
    let call = Arc::new(OneCall {
        core,
        client: client.clone(),
        end: PartEnd::new(()),
        record: Mutex::new(Record { tracker: Some(tracker), kind: None }),
        queued: AtomicBool::new(false),
    });
    stages::mark(Stage::MeetingBuilt);
    let guard = Unfinished::new(call.clone(), name, client.device_id());
    let task = move |access: Result<&mut BufferAccess<'_>, ServerError>| {
        stages::mark(Stage::TaskStarted);
        let result = guard.call().run(access, &layout, &fusion);
        guard.returned();
        stages::mark(Stage::TicketReturned);
        result
    };
    stages::mark(Stage::TasksBuilt);
    let queued = match inline {
        true => client.submit_buffers_inline(name, input, output, task),
        false => client.submit_buffers_always(name, input, output, task),
    };
    stages::mark(Stage::Submitted);
    match queued {
        Ok(()) => {
            call.queued.store(true, Ordering::Release);
            Ok(call)
        }
        // The task was dropped unqueued (its guard failed the call): the
        // record goes back, unfinished.
        Err(source) => Err(Box::new(Refused {
            error: CommError::Enqueue { operation: name, member: 0, device: client.device_id(), source },
            record: call.record.lock().tracker.take(),
        })),
    }
}

/// A task dropped before it returned (see [`Unfinished`]) fails the call;
/// once it was queued, it also drops the call's record unfinished, which
/// tells the other ranks (a task dropped in the moment between its
/// queueing and `launch` noting it leaves the record to the call's own
/// drop; one that could not be queued goes back to the caller: [`Refused`]).
impl Abandoned for OneCall {
    fn abandoned(&self, err: ServerError) {
        self.fail(err);
        if std::thread::panicking() || self.queued.load(Ordering::Acquire) {
            // Outside the record's lock: its drop asks the store.
            let tracker = self.record.lock().tracker.take();
            drop(tracker);
        }
    }
}

impl OneCall {
    /// The part's task: runs the host check and queues the calls,
    /// returning once they are queued (a barrier waits for them). The part
    /// ends here unless its monitor took over ending it.
    fn run(
        self: &Arc<Self>,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        layout: &[PartLayout],
        fusion: &PartFusion,
    ) -> Result<(), ServerError> {
        let check = || {
            self.core.check().map_err(|failure| {
                self.note_kind(failure.kind);
                self.fail(self.error(0, failure.message))
            })
        };
        part_task(self, 0, access, layout, fusion, check)
    }
}

impl PartOwner for OneCall {
    fn core(&self) -> &CallCore {
        &self.core
    }

    fn failure(&self) -> Option<ServerError> {
        self.end.failure()
    }

    fn error(&self, _slot: usize, reason: String) -> ServerError {
        ServerError::Collective { collective: self.core.name.to_string(), device: self.client.device_id(), reason }
    }

    fn note_kind(&self, kind: FailureKind) {
        self.record.lock().kind.get_or_insert(kind);
    }

    /// The call's first failure; `err` itself where the part had ended
    /// done already (nothing then changes).
    fn fail(&self, err: ServerError) -> ServerError {
        match self.end.end(Err(err.clone()), || {}).0 {
            Err(first) => first,
            Ok(()) => err,
        }
    }

    /// The part ended: done unless the call failed first; its flight
    /// record ends with the call's outcome (once).
    fn end_part(&self, _slot: usize) {
        let (outcome, _) = self.end.end(Ok(()), || {});
        let (tracker, kind) = {
            let mut record = self.record.lock();
            (record.tracker.take(), record.kind)
        };
        if let Some(tracker) = tracker {
            let kind = kind.unwrap_or(FailureKind::Other);
            tracker.ended(outcome.map_err(|err| Failure::new(kind, err.to_string())));
        }
    }
}

impl Waitable for OneCall {
    fn wait_until(&self, deadline: Option<Instant>) -> Result<(), WaitEnd> {
        let ended = self.end.wait_until(&self.client, deadline, || format!("{} not finished", self.client.device_id()));
        stages::mark(Stage::WaitEnded);
        ended
    }

    fn is_done(&self) -> bool {
        self.end.is_done()
    }
}
