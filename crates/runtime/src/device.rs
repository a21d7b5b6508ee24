//! The server thread of one device, and the registry of open devices.
//!
//! Each device has one thread that owns its backend (it is made, and
//! dropped, there); clients queue tasks to it over a channel. The thread
//! holds the device state under a lock while it runs each message, so that
//! where the backend allows it (CPU and CUDA:
//! [`crate::backend::Backend::runs_on_callers`]) a caller may run a task
//! itself, under the same lock, when the device has nothing queued or
//! running ([`DeviceHandle::run_inline`]): small collectives of one device,
//! reads, and kernel launches where a launch only queues work (CUDA). A panic in a task is
//! caught on the thread and returned to whoever waits for that task (or kept
//! for the stream's next `sync` when nobody waits). Closing a device stops its
//! thread: queued tasks are dropped, so their waiters get
//! [`ServerError::DeviceClosed`] instead of hanging.

use std::any::Any;
use std::cell::Cell;
use std::collections::HashMap;
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::backend::Backend;
use crate::config::{self, ConfigError};
use crate::error::ServerError;
use crate::id::{DeviceId, ServiceId, StreamId};
use crate::properties::DeviceProperties;
use crate::stages::{self, Stage};
use crate::state::{DeviceState, RecordedLaunch};

type Task = Box<dyn FnOnce(&mut DeviceState) + Send>;

// A launch travels by value with its arguments inline: every message is
// then 304 bytes, copied into the channel and out, where boxing launches
// would add an allocation to each one and its free on the device thread.
#[allow(clippy::large_enum_variant)]
enum Message {
    Task(StreamId, Task),
    /// Nothing to run: wakes a sleeping device thread to look at the
    /// collectives a caller's inline task left running (see
    /// [`StateCell::wake_for_collectives`]).
    Wake,
    /// A kernel launch, sent by value: the most frequent message, so it
    /// skips the boxed closure (an allocation freed on another thread).
    Launch(StreamId, RecordedLaunch),
    Shutdown,
}

thread_local! {
    /// The service whose server thread this is, if any.
    static SERVER_OF: Cell<Option<ServiceId>> = const { Cell::new(None) };
    /// The device state while an `exclusive` closure runs on this thread.
    static EXCLUSIVE_STATE: Cell<*mut DeviceState> = const { Cell::new(std::ptr::null_mut()) };
}

/// A device's state, shared by its server thread and callers that run a
/// task inline, always under its lock; and the count of messages sent to
/// the thread and not yet run.
struct StateCell {
    state: Mutex<Option<DeviceState>>,
    in_flight: AtomicUsize,
    /// Set by a caller whose inline task left device collectives running,
    /// for the device thread to poll them (see `wake_for_collectives`).
    poll_wanted: AtomicBool,
    /// Set while the device thread sleeps on its channel with no
    /// collectives to poll (a thread that has some naps at most
    /// [`COLLECTIVE_POLL`] and polls them when it wakes: it is not woken).
    asleep: AtomicBool,
    /// Callers waiting in [`DeviceHandle::enter_inline`] for the state's
    /// lock: the device thread's optional polls (while it spins for work)
    /// step aside for them.
    inline_waiting: AtomicUsize,
}

// SAFETY: the state is only touched under the lock, so one thread at a time
// uses it. Its backend is not `Send` (CUDA keeps raw driver handles), so a
// thread other than the server thread locks it only where
// `DeviceHandle::inline_tasks` holds, which the backend declares
// (`Backend::runs_on_callers`): the CPU backend, whose state is host memory
// and data, and CUDA, whose handles (context, streams, events, modules,
// NCCL communicators, the cuBLAS handle) the driver and the libraries let
// any thread use with the context current, which `Backend::enter_caller`
// makes it before the task runs, one thread at a time. Nothing of either
// lives in thread-local storage of the device thread. The state is created
// on the server thread and taken out and dropped there before it exits, so
// no other thread drops it.
unsafe impl Send for StateCell {}
// SAFETY: as above: shared access goes through the lock.
unsafe impl Sync for StateCell {}

/// Takes the state out of its cell when the server thread ends, even by a
/// panic, so it is released and dropped on that thread (never by the last
/// client to let go of the cell).
struct ReleaseOnExit<'a>(&'a StateCell);

impl Drop for ReleaseOnExit<'_> {
    fn drop(&mut self) {
        // Under the lock: an inline task may still hold it.
        let state = self.0.state.lock().take();
        if let Some(mut state) = state {
            if !std::thread::panicking() {
                state.release_all();
            }
        }
    }
}

impl StateCell {
    /// The state, locked (present while the server thread runs).
    fn lock(&self) -> parking_lot::MappedMutexGuard<'_, DeviceState> {
        parking_lot::MutexGuard::map(self.state.lock(), |s| s.as_mut().expect("the server thread holds the state"))
    }

    /// Asks the device thread to poll the collectives an inline task left
    /// running (it ends them, reports their failures and aborts the ones
    /// that time out): a flag it reads while it spins, and, when it sleeps
    /// on its channel without collectives to poll, a [`Message::Wake`]
    /// (one that naps between polls of its own collectives polls within
    /// [`COLLECTIVE_POLL`]; waking it would cost this caller a system
    /// call and contend for the state with a waiter that polls itself).
    /// The flag is set before `asleep` is read, and the thread sets
    /// `asleep` before it reads the flag a last time (both sequentially
    /// consistent): one of the two sees the other.
    ///
    /// A wake-up carries no work, so it is not counted in flight: a caller
    /// may still run inline (a waiter polling its collective's end on its
    /// own thread) while the device thread wakes, instead of waiting for it.
    fn wake_for_collectives(&self, sender: &Sender<Message>) {
        self.poll_wanted.store(true, Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            let _ = sender.send(Message::Wake);
        }
    }
}

/// The device state lent to a caller's thread by [`DeviceHandle::enter_inline`]:
/// locked, the backend entered on this thread, and the thread-locals set so
/// that client calls nested in the task run inline too. Dropping it undoes
/// all of that, and wakes the device thread if collectives were left
/// running.
pub(crate) struct Inline<'a> {
    handle: &'a DeviceHandle,
    /// Held while the state is lent; the state is reached through `state`.
    _guard: parking_lot::MutexGuard<'a, Option<DeviceState>>,
    /// The state inside the guard, as `EXCLUSIVE_STATE` holds it: the task
    /// and the calls nested in it all reach it through this one pointer.
    state: *mut DeviceState,
    entry: Option<crate::backend::CallerEntry>,
    previous: (Option<ServiceId>, *mut DeviceState),
}

impl Inline<'_> {
    /// The device state, for the task.
    pub(crate) fn state(&mut self) -> &mut DeviceState {
        // SAFETY: `state` points into the locked guard, held as long as
        // `self`; like `EXCLUSIVE_STATE`, from which calls nested in the
        // task reach it on this thread only, strictly nested.
        unsafe { &mut *self.state }
    }
}

impl Drop for Inline<'_> {
    fn drop(&mut self) {
        SERVER_OF.with(|s| s.set(self.previous.0));
        EXCLUSIVE_STATE.with(|s| s.set(self.previous.1));
        let handle = self.handle;
        let entry = self.entry.take();
        let state = self.state();
        if let Some(entry) = entry {
            state.backend.leave_caller(entry);
        }
        if state.has_pending_collectives() {
            handle.cell.wake_for_collectives(&handle.sender);
        }
    }
}

/// The client side of one device's server thread.
pub(crate) struct DeviceHandle {
    pub service: ServiceId,
    pub properties: Arc<DeviceProperties>,
    sender: Sender<Message>,
    cell: Arc<StateCell>,
    /// Whether a caller may run a task on its own thread
    /// ([`crate::backend::Backend::runs_on_callers`]).
    inline_tasks: bool,
    /// Whether a caller may also issue kernel launches itself
    /// ([`crate::backend::Backend::launches_only_queue`]).
    inline_launches: bool,
    closed: AtomicBool,
    /// Streams inside a capture window, so reads and syncs are refused before
    /// anything is queued.
    pub capturing: Mutex<HashSet<StreamId>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Builds a backend on the device thread.
pub type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn Backend>, ServerError> + Send>;

/// The message of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

impl DeviceHandle {
    /// Starts the server thread and builds the backend on it; returns the
    /// backend's error when it cannot be built (no driver, no device).
    fn start(service: ServiceId, factory: BackendFactory) -> Result<Arc<DeviceHandle>, ServerError> {
        let (sender, receiver) = channel::unbounded::<Message>();
        let (ready_tx, ready_rx) = channel::bounded::<Result<(Arc<DeviceProperties>, [bool; 2]), ServerError>>(1);
        let cell = Arc::new(StateCell {
            state: Mutex::new(None),
            in_flight: AtomicUsize::new(0),
            poll_wanted: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            inline_waiting: AtomicUsize::new(0),
        });
        let served = cell.clone();
        let thread = std::thread::Builder::new()
            .name(format!("cohort-{}", service.device))
            .spawn(move || {
                SERVER_OF.with(|s| s.set(Some(service)));
                let backend = match catch_unwind(AssertUnwindSafe(factory)) {
                    Ok(Ok(backend)) => backend,
                    Ok(Err(err)) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                    Err(payload) => {
                        let _ = ready_tx.send(Err(ServerError::TaskPanicked {
                            device: service.device,
                            message: panic_message(payload.as_ref()),
                        }));
                        return;
                    }
                };
                let properties = Arc::new(backend.properties().clone());
                let inline = [backend.runs_on_callers(), backend.launches_only_queue()];
                *served.state.lock() = Some(DeviceState::new(service, backend));
                let _ = ready_tx.send(Ok((properties, inline)));
                let _release = ReleaseOnExit(&served);
                serve(&served, receiver);
            })
            .map_err(|e| ServerError::Backend {
                backend: service.device.backend_name(),
                device: service.device,
                message: format!("could not start the server thread: {e}"),
            })?;
        let (properties, [inline_tasks, launches_only_queue]) =
            ready_rx.recv().map_err(|_| ServerError::DeviceClosed { device: service.device })??;
        Ok(Arc::new(DeviceHandle {
            service,
            properties,
            sender,
            cell,
            inline_tasks,
            inline_launches: inline_tasks && launches_only_queue,
            closed: AtomicBool::new(false),
            capturing: Mutex::new(HashSet::new()),
            thread: Mutex::new(Some(thread)),
        }))
    }

    fn closed_error(&self) -> ServerError {
        ServerError::DeviceClosed { device: self.service.device }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Asks the device thread to poll what waits on the device (running
    /// collectives, released foreign memory), as after an inline task
    /// that left collectives running; never blocks, nothing where closed.
    pub(crate) fn wake(&self) {
        if !self.is_closed() {
            self.cell.wake_for_collectives(&self.sender);
        }
    }

    /// Whether the calling thread is this device's server thread.
    fn on_server_thread(&self) -> bool {
        SERVER_OF.with(|s| s.get()) == Some(self.service)
    }

    /// Sends `message` to the server thread, counted in flight until the
    /// thread has run it.
    fn send(&self, message: Message) -> Result<(), ServerError> {
        self.cell.in_flight.fetch_add(1, Ordering::AcqRel);
        self.sender.send(message).map_err(|_| {
            self.cell.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.closed_error()
        })
    }

    /// The device state, lent to the calling thread to run a task itself
    /// where the server thread would have run it queued: when this device
    /// takes inline tasks (CPU and CUDA), is open, the caller is not its
    /// server thread, nothing is queued or running (waiting up to 50 µs,
    /// while nothing is queued, for whoever holds the state: the device
    /// thread's last task or its poll of its collectives, or another
    /// caller's inline task), and
    /// the backend lets this thread in (on CUDA: no stream capturing; the
    /// context made current). Then every message sent before, by any
    /// thread, has run. Client calls for this device made while it is held
    /// run inline too, as inside [`DeviceHandle::exclusive`]. `None`
    /// otherwise: queue the task.
    pub(crate) fn enter_inline(&self) -> Option<Inline<'_>> {
        self.enter_inline_within(INLINE_WAIT)
    }

    /// [`DeviceHandle::enter_inline`], waiting at most `wait` for the
    /// state's lock (not at all when zero: a poll that is repeated anyway).
    pub(crate) fn enter_inline_within(&self, wait: Duration) -> Option<Inline<'_>> {
        let idle = |cell: &StateCell| cell.in_flight.load(Ordering::Acquire) == 0;
        if !self.inline_tasks || self.is_closed() || self.on_server_thread() || !idle(&self.cell) {
            return None;
        }
        // The server thread counts a message out when it takes the lock to
        // run it, and lets go once it ran: with none in flight and the lock
        // free, every message sent before has run.
        let (mut guard, waited) = match self.cell.state.try_lock() {
            Some(guard) => (guard, false),
            None if wait.is_zero() => return None,
            None => (self.wait_for_state(wait)?, true),
        };
        let state = guard.as_mut().filter(|_| idle(&self.cell))?;
        let entry = state.backend.enter_caller()?;
        state.stats.inline_after_waiting += u64::from(waited);
        let state: *mut DeviceState = state;
        let previous = (SERVER_OF.with(|s| s.replace(Some(self.service))), EXCLUSIVE_STATE.with(|s| s.replace(state)));
        // `EXCLUSIVE_STATE` points at the state only while the guard is
        // held (restored when it drops, on return or unwind), during which
        // nothing else uses the state but the task and the calls nested in
        // it on this thread, as on the server thread inside `exclusive`.
        Some(Inline { handle: self, _guard: guard, state, entry: Some(entry), previous })
    }

    /// The state's lock, for a caller that found it held, waited for while
    /// nothing is queued (the holder is the device thread's last task or
    /// its poll of its collectives, or another caller's inline task: each
    /// short, on the paths that run inline), up to `wait`. A task handed
    /// over instead leaves a message queued, and every later call would
    /// find it and be handed over too, each while the device thread runs
    /// the one before, until it caught up. The device thread starts none
    /// of the polls it makes while it spins for work meanwhile. Spun, not
    /// parked (a timed park can oversleep by tens of µs), yielding the core
    /// after the first 2 µs (the holder may need it).
    fn wait_for_state(&self, wait: Duration) -> Option<parking_lot::MutexGuard<'_, Option<DeviceState>>> {
        let cell = &self.cell;
        cell.inline_waiting.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        let guard = loop {
            if let Some(guard) = cell.state.try_lock() {
                break Some(guard);
            }
            let waited = started.elapsed();
            if cell.in_flight.load(Ordering::Acquire) != 0 || waited >= wait {
                break None;
            }
            if waited < INLINE_SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        };
        cell.inline_waiting.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// Runs `task` on the calling thread, as the server thread would run it
    /// (its panic kept for the stream's next `sync`), where
    /// [`DeviceHandle::enter_inline`] lends the state. Gives the task back
    /// otherwise, to queue.
    ///
    /// For short tasks only (a small collective of one device): it runs on
    /// the caller's thread before this returns, and must not wait for work
    /// queued on this device or for parts not queued yet.
    pub fn run_inline<T: FnOnce(&mut DeviceState) + Send>(&self, stream: StreamId, task: T) -> Result<(), T> {
        let Some(mut inline) = self.enter_inline() else { return Err(task) };
        let state = inline.state();
        state.stats.inline_tasks += 1;
        run_caught(state, stream, task);
        Ok(())
    }

    /// [`DeviceHandle::run`], on the calling thread where
    /// [`DeviceHandle::enter_inline`] lends the state (no hand-over to the
    /// device thread and back, no wake-ups), queued otherwise. For tasks
    /// whose caller waits for them anyway (a read), which wait for nothing
    /// but work already queued on the device.
    pub fn run_inline_or_wait<'a, R: Send + 'a>(
        &self,
        stream: StreamId,
        task: impl FnOnce(&mut DeviceState) -> R + Send + 'a,
    ) -> Result<R, ServerError> {
        if let Some(mut inline) = self.enter_inline() {
            inline.state().stats.inline_tasks += 1;
            // Lent to this thread: `run` takes its nested path.
            return self.run(stream, task);
        }
        self.run(stream, task)
    }

    /// Queues a task and returns at once. A panic or error in it is kept for
    /// the stream's next `sync`.
    pub fn submit(
        &self,
        stream: StreamId,
        task: impl FnOnce(&mut DeviceState) + Send + 'static,
    ) -> Result<(), ServerError> {
        if self.on_server_thread() {
            let state = EXCLUSIVE_STATE.with(|s| s.get());
            if !state.is_null() {
                // SAFETY: the pointer is set only while `exclusive` runs its
                // closure on this thread, or while a task runs inline on it
                // (`enter_inline`), during which the state is reached only
                // through this pointer; calls nest strictly on this thread.
                run_caught(unsafe { &mut *state }, stream, task);
                return Ok(());
            }
        }
        if self.is_closed() {
            return Err(self.closed_error());
        }
        self.send(Message::Task(stream, Box::new(task)))
    }

    /// Queues a kernel launch (see [`DeviceState::launch`]) and returns at
    /// once; failures mark the launch's buffers. Where launches only queue
    /// work (CUDA) and the device is idle ([`DeviceHandle::enter_inline`]),
    /// the calling thread queues it on the device itself, as the device
    /// thread would have. Not the first launch of a kernel (its compile
    /// runs on the device thread, so launches on several devices compile
    /// at once), nor a launch whose grid is read from a buffer: that read
    /// waits for the stream, which the caller's thread must not.
    pub fn submit_launch(&self, stream: StreamId, launch: RecordedLaunch) -> Result<(), ServerError> {
        if self.on_server_thread() && !EXCLUSIVE_STATE.with(|s| s.get()).is_null() {
            return self.submit(stream, move |state| {
                let _ = state.launch(stream, &launch);
            });
        }
        let inline = self.inline_launches && matches!(launch.grid, crate::kernel::GridCount::Static(..));
        if let Some(mut inline) = inline.then(|| self.enter_inline()).flatten() {
            let state = inline.state();
            if state.backend.kernel_ready(&launch.kernel) {
                state.stats.inline_tasks += 1;
                stages::mark(Stage::LaunchEntered);
                run_launch(state, stream, &launch);
                return Ok(());
            }
        }
        if self.is_closed() {
            return Err(self.closed_error());
        }
        self.send(Message::Launch(stream, launch))
    }

    /// Runs a task on the device thread and waits for its result. A panic in
    /// the task comes back as [`ServerError::TaskPanicked`]; a closed device as
    /// [`ServerError::DeviceClosed`].
    pub fn run<'a, R: Send + 'a>(
        &self,
        stream: StreamId,
        task: impl FnOnce(&mut DeviceState) -> R + Send + 'a,
    ) -> Result<R, ServerError> {
        let device = self.service.device;
        if self.on_server_thread() {
            let state = EXCLUSIVE_STATE.with(|s| s.get());
            if state.is_null() {
                return Err(ServerError::InvalidState {
                    operation: "a blocking call",
                    reason: format!(
                        "it was made from a task running on the server thread of {device}, which would wait on itself; use `exclusive` for work that calls the client from the device thread"
                    ),
                });
            }
            // SAFETY: as in `submit`: set only during `exclusive` or an
            // inline task, the state reached only through this pointer,
            // calls nested strictly on this thread.
            let state = unsafe { &mut *state };
            return catch_unwind(AssertUnwindSafe(|| task(state)))
                .map_err(|p| ServerError::TaskPanicked { device, message: panic_message(p.as_ref()) });
        }
        if self.is_closed() {
            return Err(self.closed_error());
        }
        let (boxed, reply) = with_reply(device, task);
        // SAFETY: the task may borrow from the caller's stack ('a). We wait
        // below until the task has run or been dropped: the reply channel
        // disconnects only after `PendingReply` has dropped the task (see its
        // Drop), so nothing the task borrows is used after this returns.
        let boxed: Task = unsafe { std::mem::transmute::<Box<dyn FnOnce(&mut DeviceState) + Send + 'a>, Task>(boxed) };
        self.send(Message::Task(stream, boxed))?;
        Reply { receiver: reply, device }.wait()
    }

    /// Queues a task and returns at once with its [`Reply`], to wait on
    /// later: `run` in two halves, so one thread can have several devices
    /// work at once. A task run from inside [`DeviceHandle::exclusive`] on
    /// this device's thread runs at once, as in `run`.
    pub fn request<R: Send + 'static>(
        &self,
        stream: StreamId,
        task: impl FnOnce(&mut DeviceState) -> R + Send + 'static,
    ) -> Result<Reply<R>, ServerError> {
        let device = self.service.device;
        if self.on_server_thread() {
            let (done, receiver) = oneshot();
            done.send(self.run(stream, task));
            return Ok(Reply { receiver, device });
        }
        if self.is_closed() {
            return Err(self.closed_error());
        }
        let (boxed, receiver) = with_reply(device, task);
        self.send(Message::Task(stream, boxed))?;
        Ok(Reply { receiver, device })
    }

    /// Runs `f` on the device thread with nothing else interleaved; client
    /// calls made inside `f` for this device run inline.
    pub fn exclusive<'a, R: Send + 'a>(
        &self,
        stream: StreamId,
        f: impl FnOnce() -> R + Send + 'a,
    ) -> Result<R, ServerError> {
        self.run(stream, move |state: &mut DeviceState| {
            let previous = EXCLUSIVE_STATE.with(|s| s.replace(state as *mut DeviceState));
            struct Restore(*mut DeviceState);
            impl Drop for Restore {
                fn drop(&mut self) {
                    EXCLUSIVE_STATE.with(|s| s.set(self.0));
                }
            }
            let _restore = Restore(previous);
            f()
        })
    }

    /// Stops the server thread: queued tasks are dropped and every later call
    /// returns [`ServerError::DeviceClosed`]. Waits for the thread to exit
    /// unless called from it.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.send(Message::Shutdown);
        if !self.on_server_thread() {
            if let Some(thread) = self.thread.lock().take() {
                let _ = thread.join();
            }
        }
    }
}

/// A task and the one-shot its caller waits on. Dropping it drops the task
/// before the sender, so a caller that sees the sender gone knows the task
/// (and whatever it borrowed) is gone.
struct PendingReply<F, R> {
    task: Option<F>,
    reply: Option<ReplySender<Result<R, ServerError>>>,
}

impl<F, R> Drop for PendingReply<F, R> {
    fn drop(&mut self) {
        drop(self.task.take());
        drop(self.reply.take());
    }
}

/// Wraps `task` so that its result (or its panic, as
/// [`ServerError::TaskPanicked`]) is sent on the returned one-shot; the
/// receiver sees the sender gone without a result if the task is dropped
/// unrun.
#[allow(clippy::type_complexity)]
fn with_reply<'a, R: Send + 'a>(
    device: DeviceId,
    task: impl FnOnce(&mut DeviceState) -> R + Send + 'a,
) -> (Box<dyn FnOnce(&mut DeviceState) + Send + 'a>, ReplyReceiver<Result<R, ServerError>>) {
    let (reply_tx, reply_rx) = oneshot::<Result<R, ServerError>>();
    let mut pending = PendingReply { task: Some(task), reply: Some(reply_tx) };
    let boxed = Box::new(move |state: &mut DeviceState| {
        let task = pending.task.take().expect("a task runs once");
        let result = catch_unwind(AssertUnwindSafe(|| task(state)))
            .map_err(|p| ServerError::TaskPanicked { device, message: panic_message(p.as_ref()) });
        if let Some(reply) = pending.reply.take() {
            reply.send(result);
        }
    });
    (boxed, reply_rx)
}

/// The result of a task queued with [`DeviceHandle::request`], not yet
/// waited for.
pub struct Reply<R> {
    receiver: ReplyReceiver<Result<R, ServerError>>,
    device: DeviceId,
}

impl<R> Reply<R> {
    /// Waits for the task's result (polling for [`spin_window`] first); a
    /// device closed before the task ran is [`ServerError::DeviceClosed`].
    pub fn wait(self) -> Result<R, ServerError> {
        self.receiver.wait().ok_or(ServerError::DeviceClosed { device: self.device })?
    }
}

/// Where a one-shot reply stands.
const REPLY_EMPTY: u8 = 0;
const REPLY_SENT: u8 = 1;
const REPLY_GONE: u8 = 2;

/// One value handed from the device thread to one waiting caller: a single
/// allocation, a flag the caller polls during its spin window, and a
/// condition variable it sleeps on after.
struct OneShot<T> {
    state: AtomicU8,
    value: Mutex<Option<T>>,
    woken: Condvar,
}

/// The sending half of [`oneshot`]: dropped unsent, the receiver gets `None`.
struct ReplySender<T>(Option<Arc<OneShot<T>>>);

/// The receiving half of [`oneshot`].
struct ReplyReceiver<T>(Arc<OneShot<T>>);

fn oneshot<T>() -> (ReplySender<T>, ReplyReceiver<T>) {
    let shared =
        Arc::new(OneShot { state: AtomicU8::new(REPLY_EMPTY), value: Mutex::new(None), woken: Condvar::new() });
    (ReplySender(Some(shared.clone())), ReplyReceiver(shared))
}

impl<T> OneShot<T> {
    /// Sets the state (and the value) under the lock, so a receiver that
    /// looked and went to sleep is always woken.
    fn settle(&self, state: u8, value: Option<T>) {
        let mut slot = self.value.lock();
        *slot = value;
        self.state.store(state, Ordering::Release);
        drop(slot);
        self.woken.notify_one();
    }
}

impl<T> ReplySender<T> {
    fn send(mut self, value: T) {
        if let Some(shared) = self.0.take() {
            shared.settle(REPLY_SENT, Some(value));
        }
    }
}

impl<T> Drop for ReplySender<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.settle(REPLY_GONE, None);
        }
    }
}

impl<T> ReplyReceiver<T> {
    /// Waits for the value, polling for [`spin_window`] (paced by
    /// [`Spin`]) before sleeping; `None` when the sender was dropped
    /// without sending.
    fn wait(self) -> Option<T> {
        let shared = &self.0;
        let mut spin = Spin::new();
        while shared.state.load(Ordering::Acquire) == REPLY_EMPTY {
            if spin.pause() == Paced::Over {
                break;
            }
        }
        let mut slot = shared.value.lock();
        while shared.state.load(Ordering::Acquire) == REPLY_EMPTY {
            shared.woken.wait(&mut slot);
        }
        slot.take()
    }
}

fn run_caught(state: &mut DeviceState, stream: StreamId, task: impl FnOnce(&mut DeviceState)) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| task(state))) {
        let err = ServerError::TaskPanicked { device: state.service.device, message: panic_message(payload.as_ref()) };
        tracing::error!(device = %state.service.device, "{err}");
        state.pending_errors.entry(stream).or_insert(err);
    }
}

/// How long a waiting thread polls its channel before it sleeps
/// (`COHORT_SPIN_US` microseconds). Work that arrives within it is picked up
/// without a sleep and wake-up, which costs several microseconds each way.
/// The default is 50 µs on machines with at least 4 hardware threads and 0
/// (sleep at once) on smaller ones, where a polling thread takes the core
/// the thread it waits for needs: measured on a loaded 2-core machine, a
/// 4-byte read took 10 µs without polling and 70–160 µs with it.
///
/// Read once. An unusable `COHORT_SPIN_US` is an error from every client's
/// creation (which checks it first); this function then uses the default.
pub fn spin_window() -> Duration {
    checked_spin_window().unwrap_or_else(|_| default_spin_window())
}

/// [`spin_window`], or the error naming `COHORT_SPIN_US` when its value
/// cannot be used (read once).
pub(crate) fn checked_spin_window() -> Result<Duration, ConfigError> {
    static SPIN: OnceLock<Result<Duration, ConfigError>> = OnceLock::new();
    SPIN.get_or_init(|| Ok(config::SPIN_US.get()?.map_or_else(default_spin_window, Duration::from_micros))).clone()
}

fn default_spin_window() -> Duration {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    Duration::from_micros(if cores >= 4 { 50 } else { 0 })
}

/// Receives from `receiver`, polling for up to [`spin_window`] before
/// sleeping, paced by [`Spin`]. With `poll` (the device has
/// collectives running), calls it once before the spin, every 64 polls of
/// the channel during it (a collective that completes meanwhile is ended
/// within microseconds, not at the next nap), and sleeps at most
/// [`COLLECTIVE_POLL`], then reports a timeout. Without it, reports a
/// timeout as soon as `wanted` is set (a caller's inline task left
/// collectives running), taking the flag, and sets `asleep` while it sleeps
/// (see [`StateCell::wake_for_collectives`]).
fn recv_spinning<T>(
    receiver: &Receiver<T>,
    mut poll: Option<&mut dyn FnMut()>,
    wanted: &AtomicBool,
    asleep: &AtomicBool,
) -> Result<T, RecvTimeoutError> {
    let napping = poll.is_some();
    let take_wanted = |wanted: &AtomicBool| !napping && wanted.swap(false, Ordering::SeqCst);
    let sleep = |receiver: &Receiver<T>| {
        if napping {
            return receiver.recv_timeout(COLLECTIVE_POLL);
        }
        asleep.store(true, Ordering::SeqCst);
        let got = if take_wanted(wanted) {
            Err(RecvTimeoutError::Timeout)
        } else {
            receiver.recv().map_err(|_| RecvTimeoutError::Disconnected)
        };
        asleep.store(false, Ordering::SeqCst);
        got
    };
    // Work that is already queued is taken without reading the clock.
    match receiver.try_recv() {
        Ok(message) => return Ok(message),
        Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
        Err(TryRecvError::Empty) => {}
    }
    if let Some(poll) = poll.as_mut() {
        poll();
    }
    let mut spin = Spin::new();
    loop {
        match receiver.try_recv() {
            Ok(message) => return Ok(message),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => {
                if !napping && wanted.load(Ordering::Relaxed) && take_wanted(wanted) {
                    return Err(RecvTimeoutError::Timeout);
                }
                match spin.pause() {
                    Paced::Over => return sleep(receiver),
                    Paced::Looked => {
                        if let Some(poll) = poll.as_mut() {
                            poll();
                        }
                    }
                    Paced::Polled => {}
                }
            }
        }
    }
}

/// What [`Spin::pause`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paced {
    /// Paused before the next poll.
    Polled,
    /// Paused, and read the clock (every 64 polls): a moment for slower
    /// polls of something else.
    Looked,
    /// The spin window is over: sleep instead.
    Over,
}

/// Paces a thread that polls for up to [`spin_window`]: a spin-loop hint
/// between polls for the first half of the window (a value that arrives
/// then is seen within a few dozen nanoseconds), then a yield of the core
/// between polls, so a thread it waits for can run. With no window
/// (fewer than 4 hardware threads) it is over at once.
struct Spin {
    /// `None` without a window: the clock is not read then.
    start: Option<Instant>,
    window: Duration,
    polls: u32,
    yielding: bool,
}

impl Spin {
    fn new() -> Spin {
        let window = spin_window();
        let start = (!window.is_zero()).then(Instant::now);
        Spin { start, window, polls: 0, yielding: false }
    }

    /// Waits a moment before the next poll, or says the window is over.
    fn pause(&mut self) -> Paced {
        let Some(start) = self.start else { return Paced::Over };
        self.polls = self.polls.wrapping_add(1);
        let mut paced = Paced::Polled;
        // Reading the clock costs more than a poll: look every 64.
        if self.polls.is_multiple_of(64) {
            let spun = start.elapsed();
            if spun >= self.window {
                return Paced::Over;
            }
            self.yielding = spun >= self.window / 2;
            paced = Paced::Looked;
        }
        if self.yielding {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        paced
    }
}

fn run_launch(state: &mut DeviceState, stream: StreamId, launch: &RecordedLaunch) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| state.launch(stream, launch))) {
        let err = ServerError::TaskPanicked { device: state.service.device, message: panic_message(payload.as_ref()) };
        tracing::error!(device = %state.service.device, "{err}");
        state.pending_errors.entry(stream).or_insert(err);
    }
}

/// How long [`DeviceHandle::enter_inline`] waits for the device state's
/// lock while nothing is queued, before it queues the task instead: the
/// holder's work is short where it runs inline (an NCCL enqueue of a few
/// µs, a poll that reaps many parts 15–30), and a task that holds the
/// state longer (a barrier, a first NCCL call waiting for every rank)
/// costs one caller this once: the next finds its message queued and
/// queues at once.
const INLINE_WAIT: Duration = Duration::from_micros(50);

/// How long a waiting caller spins before it yields the core between looks.
const INLINE_SPIN: Duration = Duration::from_micros(2);

/// How often a device thread looks at its running device collectives (to
/// end them, and to abort failed or expired ones): idle, and at least as
/// often while a stream of work keeps it busy.
const COLLECTIVE_POLL: Duration = Duration::from_millis(1);

/// Pending device collectives past which the thread polls them after every
/// message, not only when idle.
const POLL_BUSY_AT: usize = 64;

/// How many messages a busy device thread runs between two looks at the
/// clock for an overdue poll of its collectives.
const BUSY_CLOCK_EVERY: usize = 16;

fn serve(cell: &StateCell, receiver: Receiver<Message>) {
    // Whether device collectives are running, as of the last time this
    // thread held the state (after each message): read then, so a message
    // costs one lock. A caller whose inline task leaves collectives running
    // sets `poll_wanted` (and wakes this thread if it sleeps), which the
    // receive below watches while it does not poll.
    let mut collectives_pending = false;
    // When the collectives were last polled, and the messages run since: a
    // thread kept busy by a stream of work polls them at least every
    // `COLLECTIVE_POLL` too (the clock read every `BUSY_CLOCK_EVERY`
    // messages), so a hung collective still times out behind a backlog.
    let mut polled_at = Instant::now();
    let mut since_poll = 0usize;
    loop {
        // With device collectives running, the thread polls them (to end
        // or abort them) when it runs out of work, while it spins, and
        // then every millisecond even when no work comes.
        // A caller running a task inline holds the state: the poll skips
        // a turn rather than wait for it.
        let (wanted, asleep) = (&cell.poll_wanted, &cell.asleep);
        let received = if collectives_pending {
            let mut poll = || {
                // Not while a caller waits to run a task inline: it would
                // hand its task over rather than wait for the poll.
                if cell.inline_waiting.load(Ordering::SeqCst) != 0 {
                    return;
                }
                if let Some(state) = cell.state.try_lock().as_mut().and_then(|s| s.as_mut()) {
                    state.poll_collectives();
                    polled_at = Instant::now();
                }
            };
            recv_spinning(&receiver, Some(&mut poll), wanted, asleep)
        } else {
            recv_spinning(&receiver, None, wanted, asleep)
        };
        let message = match received {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => {
                let mut state = cell.lock();
                state.poll_collectives();
                (polled_at, since_poll) = (Instant::now(), 0);
                collectives_pending = state.has_pending_collectives();
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if let Message::Wake = message {
            // Sent to a thread asleep without collectives: a caller left
            // some. They are polled from the receive above, which takes the
            // state only when it is free (the caller may be polling them
            // itself); a wake-up never waits for the lock.
            collectives_pending = true;
            continue;
        }
        stages::mark(Stage::Received);
        let mut state = cell.lock();
        // Counted out once the lock is held: until this message's task
        // returns and the lock is let go, no caller runs inline (see
        // `enter_inline`); after, every message sent before it has run. A
        // wake-up was never counted (see `wake_for_collectives`).
        cell.in_flight.fetch_sub(1, Ordering::AcqRel);
        match message {
            Message::Task(stream, task) => run_caught(&mut state, stream, task),
            Message::Launch(stream, launch) => run_launch(&mut state, stream, &launch),
            // Taken above, without the lock.
            Message::Wake => {}
            Message::Shutdown => break,
        }
        stages::mark(Stage::Ran);
        since_poll += 1;
        let overdue = || since_poll.is_multiple_of(BUSY_CLOCK_EVERY) && polled_at.elapsed() >= COLLECTIVE_POLL;
        if state.pending_collectives_count() >= POLL_BUSY_AT || (collectives_pending && overdue()) {
            state.poll_collectives();
            (polled_at, since_poll) = (Instant::now(), 0);
        }
        collectives_pending = state.has_pending_collectives();
    }
}

struct Registry {
    open: HashMap<DeviceId, Arc<DeviceHandle>>,
    generations: HashMap<DeviceId, u32>,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(Registry { open: HashMap::new(), generations: HashMap::new() }))
}

/// The open server of `device`, starting one with `factory` if none is.
pub(crate) fn open_device(
    device: DeviceId,
    factory: impl FnOnce() -> BackendFactory,
) -> Result<Arc<DeviceHandle>, ServerError> {
    let mut registry = registry().lock();
    if let Some(handle) = registry.open.get(&device) {
        if !handle.is_closed() {
            return Ok(handle.clone());
        }
    }
    let generation = *registry.generations.entry(device).and_modify(|g| *g += 1).or_insert(0);
    let handle = DeviceHandle::start(ServiceId { device, generation }, factory())?;
    registry.open.insert(device, handle.clone());
    Ok(handle)
}

/// Closes `device`'s server if it is open; clients of it get
/// [`ServerError::DeviceClosed`] from then on. A later `load` starts a new
/// server, to which the old handles are foreign.
pub fn close_device(device: DeviceId) {
    let handle = registry().lock().open.remove(&device);
    if let Some(handle) = handle {
        handle.close();
    }
}

/// Closes every open device (call before the process exits to free device
/// memory and join the server threads).
pub fn shutdown() {
    let handles: Vec<_> = registry().lock().open.drain().map(|(_, h)| h).collect();
    for handle in handles {
        handle.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_sent_later_reaches_a_waiter_that_went_to_sleep() {
        let (sender, receiver) = oneshot::<Vec<u32>>();
        let waiter = std::thread::spawn(move || receiver.wait());
        // Past any spin window: the waiter sleeps on the condition variable.
        std::thread::sleep(Duration::from_millis(100));
        sender.send(vec![1, 2, 3]);
        assert_eq!(waiter.join().unwrap(), Some(vec![1, 2, 3]));
    }

    #[test]
    fn a_reply_sent_before_the_wait_is_there_at_once() {
        let (sender, receiver) = oneshot::<&str>();
        sender.send("ready");
        assert_eq!(receiver.wait(), Some("ready"));
    }

    #[test]
    fn a_sender_dropped_unsent_wakes_the_waiter_with_nothing() {
        let (sender, receiver) = oneshot::<u8>();
        let waiter = std::thread::spawn(move || receiver.wait());
        std::thread::sleep(Duration::from_millis(50));
        drop(sender);
        assert_eq!(waiter.join().unwrap(), None);
    }

    #[test]
    fn an_idle_device_polls_its_collectives_before_it_naps() {
        let (sender, receiver) = channel::unbounded::<u8>();
        let mut polls = 0;
        let (wanted, asleep) = (AtomicBool::new(false), AtomicBool::new(false));
        let got = recv_spinning(&receiver, Some(&mut || polls += 1), &wanted, &asleep);
        assert!(matches!(got, Err(RecvTimeoutError::Timeout)), "{got:?}");
        assert!(polls >= 1, "polled {polls} times");
        // Work already queued is taken at once, without a poll.
        sender.send(7).unwrap();
        let mut polls = 0;
        assert_eq!(recv_spinning(&receiver, Some(&mut || polls += 1), &wanted, &asleep), Ok(7));
        assert_eq!(polls, 0);
    }

    /// What the holder of a device's state does once a caller waits for it.
    #[derive(Clone, Copy)]
    enum Holder {
        /// Lets go this long after.
        LetsGoAfter(Duration),
        /// Queues a message (as another thread would), and lets go once the
        /// caller stopped waiting.
        QueuesAMessage,
        /// Holds on until the caller stopped waiting.
        HoldsOn,
    }

    /// Holds `device`'s state lock on another thread and does `then` once
    /// a caller entering inline waits for it; says whether the caller got
    /// the state. Every spin is bounded (a holder that misses the caller's
    /// wait lets go at the caller's return or after a second): no hang.
    fn entered_while_held(device: &DeviceHandle, then: Holder) -> bool {
        let cell = &device.cell;
        let returned = AtomicBool::new(false);
        let spin_until = |until: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(1);
            while !until() && !returned.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::hint::spin_loop();
            }
        };
        let (held, is_held) = channel::bounded(1);
        std::thread::scope(|s| {
            s.spawn(|| {
                let guard = cell.state.lock();
                held.send(()).unwrap();
                spin_until(&|| cell.inline_waiting.load(Ordering::SeqCst) != 0);
                let waited = Instant::now();
                match then {
                    Holder::LetsGoAfter(more) => spin_until(&|| waited.elapsed() >= more),
                    Holder::QueuesAMessage => {
                        cell.in_flight.fetch_add(1, Ordering::SeqCst);
                        spin_until(&|| cell.inline_waiting.load(Ordering::SeqCst) == 0);
                        cell.in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                    Holder::HoldsOn => spin_until(&|| cell.inline_waiting.load(Ordering::SeqCst) == 0),
                }
                drop(guard);
            });
            is_held.recv().unwrap();
            let entered = device.enter_inline().is_some();
            returned.store(true, Ordering::SeqCst);
            entered
        })
    }

    #[test]
    fn a_caller_waits_for_the_device_while_nothing_is_queued_and_no_longer() {
        use crate::runtime::Runtime;
        let client = crate::CpuRuntime::client(3).unwrap();
        let device = client.device();
        // A holder that lets go 30 µs after the caller began waiting (an
        // NCCL enqueue, a poll) is waited for, and counted. Tries: another
        // test's message queued on this device sends the caller away, and
        // so does a holder descheduled for long.
        let waited = || client.stats().unwrap().inline_after_waiting;
        let before = waited();
        assert!(
            (0..20).any(|_| entered_while_held(device, Holder::LetsGoAfter(Duration::from_micros(30)))),
            "a caller handed its task over rather than wait 30 µs for the device"
        );
        assert!(waited() > before, "counted as a wait");
        // Once a message is queued behind the holder, the caller queues too.
        assert!(!entered_while_held(device, Holder::QueuesAMessage));
        // A holder past the budget (a long task) is not waited for longer.
        let started = Instant::now();
        assert!(!entered_while_held(device, Holder::HoldsOn));
        assert!(started.elapsed() >= INLINE_WAIT, "gave up early: {:?}", started.elapsed());
    }

    /// A spin lasts its window and ends soon after, whatever the
    /// machine's default (0 on fewer than 4 cores: the configured spin is
    /// then over at once, without a poll): it ends only where it reads the
    /// clock, every 64 polls.
    #[test]
    fn a_spin_ends_within_its_window() {
        let started = Instant::now();
        let mut configured = Spin::new();
        while configured.pause() != Paced::Over {}
        assert!(started.elapsed() >= spin_window(), "over before its window: {:?}", started.elapsed());
        if spin_window().is_zero() {
            assert_eq!(configured.polls, 0, "no window: over at once, no poll");
        }
        // A window of its own: the same on every machine.
        let window = Duration::from_millis(20);
        let started = Instant::now();
        let mut spin = Spin { start: Some(started), window, polls: 0, yielding: false };
        while spin.pause() != Paced::Over {}
        let spun = started.elapsed();
        assert!(spun >= window, "over after {spun:?}, before its window of {window:?}");
        // Generous: a loaded 2-core machine may take the core away for long.
        assert!(spun < window + Duration::from_secs(2), "{spun:?}");
        assert!(
            spin.polls >= 64 && spin.polls.is_multiple_of(64),
            "it ends where it reads the clock, not at poll {}",
            spin.polls
        );
    }

    #[test]
    fn a_task_dropped_unrun_is_a_closed_device_not_a_hang() {
        let device = DeviceId { type_id: 0, index: 0 };
        let (task, receiver) = with_reply(device, |_| 7u32);
        drop(task);
        let reply = Reply { receiver, device };
        assert!(matches!(reply.wait(), Err(ServerError::DeviceClosed { .. })));
    }
}
