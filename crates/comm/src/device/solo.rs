//! A device-path collective of one part: a group of one device's, or a
//! send to itself in any group, whose part meets nobody but itself (device
//! copies, or calls on a one-rank NCCL communicator). It needs none of a meeting's machinery: no seats to
//! gather, no tickets to count, no other part to watch. One object is the
//! handle's waitable, the part's monitor while its calls run on the device,
//! and the holder of its flight record.
//!
//! The part is queued from the caller's thread where its device is idle
//! (see `Client::submit_buffers_recorded_inline`), otherwise by the device
//! thread; either way it returns once its calls are queued. A waiter then
//! polls the device itself for the runtime's spin window
//! ([`cohort_runtime::spin_window`]), asking it for a host word written once
//! the part ends (`Client::poll_collectives_signal`) and reading that
//! between polls, and sleeps after the window until the device thread,
//! which polls running collectives too, says the part ended.
//!
//! It takes no process-wide enqueue order: a part that waits for no other
//! device cannot close a cycle of devices waiting for each other.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::backend::{CollectiveMonitor, CommSpec, Completion};
use cohort_runtime::stages::{self, Stage};
use cohort_runtime::{BufferAccess, Client, Handle, ServerError, TaskHandles};

use super::plan::{self, Shape};
use super::{forget, Mode, NcclSet};
use crate::error::CommError;
use crate::meeting::WaitEnd;
use crate::op::{Collective, Op};
use crate::part_end::{Abandoned, PartEnd, Unfinished};
use crate::trace::Watched;

/// Whether `op` on `mode` with one part can run as a [`Solo`]: copies on
/// one device, or one call on a one-rank communicator, that waits for no
/// other device. Not a barrier: its part waits for the device's work, which
/// the caller's thread must not do while it holds the device.
pub(crate) fn fits(op: &Op, mode: &Mode, parts: usize) -> bool {
    let one_device = match mode {
        Mode::Local => true,
        Mode::Nccl(set) => set.devices.len() == 1,
        Mode::Peer | Mode::PeerKernel(..) => false,
    };
    parts == 1 && one_device && op.collective() != Collective::Barrier
}

/// One part's collective on one device.
pub(crate) struct Solo {
    operation: &'static str,
    member: usize,
    timeout: Duration,
    /// Its device: named in errors, polled by a waiter for the part's end.
    client: Client,
    /// The communicator's set (forgotten when the part fails, so the next
    /// call makes a fresh communicator).
    set: Option<Arc<NcclSet>>,
    /// Its end, keeping the flight record (if any) for it.
    end: PartEnd<Option<Arc<Watched>>>,
}

/// Queues `op`'s one part on member `member` (`clients[member]`), which
/// [`fits`] a [`Solo`]: from this thread where the device is idle,
/// otherwise through its device thread. Returns the collective to wait on
/// once the part is queued; the part's own failure (a poisoned source, an
/// NCCL error) comes back from the wait and marks the destination.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    client: &Client,
    member: usize,
    timeout: Duration,
    op: Op,
    mode: Mode,
    input: Option<&Handle>,
    output: Option<&Handle>,
    tracked: Option<Arc<Watched>>,
) -> Result<Arc<Solo>, CommError> {
    let operation = op.name();
    let set = match &mode {
        Mode::Nccl(set) => Some(set.clone()),
        _ => None,
    };
    let solo = Arc::new(Solo { operation, member, timeout, client: client.clone(), set, end: PartEnd::new(tracked) });
    let scratch = matches!(mode, Mode::Nccl(_)) && plan::sends_from_copy(op.collective(), input, output);
    let (mut inputs, mut outputs) = (TaskHandles::new(), TaskHandles::new());
    inputs.extend(input.cloned());
    outputs.extend(output.cloned());
    if scratch {
        outputs.push(client.empty(op.block_bytes()));
    }
    let shape = Shape { input: input.is_some(), output: output.is_some(), scratch };
    // Dropped before it returned (its device closed before it ran, or it
    // panicked), the guard fails the collective, so its waiter returns at
    // once.
    let guard = Unfinished::new(solo.clone(), operation, client.device_id());
    let task = move |access: Result<&mut BufferAccess<'_>, ServerError>| {
        stages::mark(Stage::TaskStarted);
        let result = guard.call().run(access, &op, &mode, shape);
        guard.returned();
        stages::mark(Stage::TicketReturned);
        result
    };
    stages::mark(Stage::TasksBuilt);
    let queued = client.submit_buffers_recorded_inline(operation, inputs, outputs, task);
    stages::mark(Stage::Submitted);
    match queued {
        Ok(()) => Ok(solo),
        Err(source) => {
            let _ = solo.end(Err(source.clone()), false);
            Err(CommError::Enqueue { operation, member, device: client.device_id(), source })
        }
    }
}

/// A task dropped before it returned (see [`Unfinished`]) fails the
/// collective, so its waiter returns at once.
impl Abandoned for Solo {
    fn abandoned(&self, err: ServerError) {
        let _ = self.end(Err(err), false);
    }
}

impl Solo {
    /// Runs the part: binds its buffers and queues its copies or calls,
    /// returning once they are queued. A part left running on the device
    /// ends through [`CollectiveMonitor::finished`].
    fn run(
        self: &Arc<Self>,
        access: Result<&mut BufferAccess<'_>, ServerError>,
        op: &Op,
        mode: &Mode,
        shape: Shape,
    ) -> Result<(), ServerError> {
        let access = match access {
            Ok(access) => access,
            Err(err) => return Err(self.end(Err(err), false).unwrap_err()),
        };
        let buffers = shape.bind(|i| access.binding(i));
        let (queued, on_communicator) = match mode {
            Mode::Local => match plan::local_copy(op, &buffers) {
                Some(_) => (access.copy(0, 1), false),
                None => (Ok(()), false),
            },
            Mode::Nccl(set) => {
                let calls = plan::nccl_calls(op, 0, 1, &buffers);
                if calls.is_empty() {
                    (Ok(()), false)
                } else {
                    let spec = CommSpec { set: set.key, rank: 0, ranks: 1, unique_id: &set.unique_id };
                    stages::mark(Stage::PartReady);
                    let queued = access.run_collective(&spec, &calls, self.clone(), Completion::Defer);
                    stages::mark(Stage::PartQueued);
                    // Queued, the part ends when the device says so.
                    if queued.is_ok() {
                        return Ok(());
                    }
                    (queued, true)
                }
            }
            Mode::Peer | Mode::PeerKernel(..) => {
                let reason = "a peer collective has more than one part".into();
                (Err(ServerError::InvalidState { operation: self.operation, reason }), false)
            }
        };
        self.end(queued, on_communicator)
    }

    /// Ends the collective with `outcome` (the first end wins), finishes
    /// its flight record and wakes its sleeping waiters; returns the
    /// collective's outcome. A failure of the communicator itself
    /// (`communicator_failed`: its calls failed, or they were aborted on
    /// the device) forgets its set, so the next group over the device makes
    /// a fresh one; a failed input or a closed device leaves it.
    fn end(&self, outcome: Result<(), ServerError>, communicator_failed: bool) -> Result<(), ServerError> {
        let forget_set = || {
            if let Some(set) = self.set.as_ref().filter(|_| communicator_failed) {
                forget(set);
            }
        };
        let (result, tracked) = self.end.end(outcome, forget_set);
        // Noted and finished outside the lock (the recorder has its own).
        if let Some(tracked) = tracked.flatten() {
            tracked.note(&result);
        }
        result
    }

    /// Waits until the part ended or `deadline` passed: polls the device
    /// from this thread for the spin window, then sleeps until the device
    /// thread ends it.
    pub(crate) fn wait_until(&self, deadline: Option<Instant>) -> Result<(), WaitEnd> {
        let running = || format!("member {} ({}) not finished", self.member, self.client.device_id());
        self.end.wait_until(&self.client, deadline, running)
    }

    /// Whether the part ended (completed or failed). Never blocks.
    pub(crate) fn is_done(&self) -> bool {
        self.end.is_done()
    }
}

impl CollectiveMonitor for Solo {
    fn operation(&self) -> &str {
        self.operation
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn failed_elsewhere(&self) -> Option<ServerError> {
        None
    }

    fn missing(&self) -> String {
        format!("member {} ({}) did not finish", self.member, self.client.device_id())
    }

    fn finished(&self, outcome: &Result<(), ServerError>) {
        let _ = self.end(outcome.clone(), true);
    }
}
