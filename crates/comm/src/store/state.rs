//! The server's key table and barriers, shared by its connection threads.
//!
//! Built for thousands of clients: a `wait` registers itself under each key
//! it still misses and is woken only when the last of them is set (never
//! by unrelated writes), each barrier has its own condition variable, and
//! values are shared (`Arc`), so a read of a large value holds the lock
//! for a reference count, not a copy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::protocol::{Response, Value, MAX_VALUE};

/// How a blocked request was woken (see [`Signal`]).
const PENDING: u8 = 0;
/// Its keys are all set / its barrier opened.
const DONE: u8 = 1;
/// The table changed under it (reset): look again.
const LOOK_AGAIN: u8 = 2;
/// The store is shutting down.
const STOP: u8 = 3;
/// Not a wake-up reason: the waiter's client closed its connection.
const CLIENT_LEFT: u8 = 4;

/// How often a blocked request checks that its client is still connected
/// (a client that dies while it waits must not count in a barrier, and its
/// will must be set).
const CHECK_CLIENT_EVERY: Duration = Duration::from_millis(500);

/// Whether the client of a connection is still there (see
/// [`State::apply`]).
pub(crate) type Alive<'a> = &'a dyn Fn() -> bool;

/// Wakes one blocked connection thread directly (`unpark`), so that waking
/// thousands of them at once needs no lock: each checks its own flag and
/// answers, instead of queueing one after another for the table's lock.
struct Signal {
    state: AtomicU8,
    thread: Thread,
}

impl Signal {
    fn new() -> Arc<Signal> {
        Arc::new(Signal { state: AtomicU8::new(PENDING), thread: std::thread::current() })
    }

    /// Wakes the waiter with `why` (the first reason stays).
    fn fire(&self, why: u8) {
        if self.state.compare_exchange(PENDING, why, Ordering::Release, Ordering::Relaxed).is_ok() {
            self.thread.unpark();
        }
    }

    /// Blocks the calling thread (the one that made the signal) until fired
    /// or `deadline`; returns the reason, `PENDING` on timeout and
    /// `CLIENT_LEFT` when `alive` says the client went away.
    fn wait(&self, deadline: Option<Instant>, alive: Alive<'_>) -> u8 {
        let mut next_check = Instant::now() + CHECK_CLIENT_EVERY;
        loop {
            let state = self.state.load(Ordering::Acquire);
            if state != PENDING {
                return state;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return PENDING;
            }
            if now >= next_check {
                if !alive() {
                    return CLIENT_LEFT;
                }
                next_check = now + CHECK_CLIENT_EVERY;
            }
            let until = deadline.map_or(next_check, |d| d.min(next_check));
            std::thread::park_timeout(until.saturating_duration_since(now));
        }
    }
}

/// One named, reusable barrier.
#[derive(Default)]
struct Barrier {
    /// Bumped each time the barrier opens.
    generation: u64,
    /// The participants waiting in the current generation.
    waiting: Vec<Arc<Signal>>,
    /// The world size the waiting participants passed.
    world_size: u32,
}

/// One blocked `wait`: how many of its keys are still missing.
struct Waiter {
    /// Keys (counted with repeats) not set yet; fired at 0.
    missing: AtomicUsize,
    signal: Arc<Signal>,
}

#[derive(Default)]
struct Table {
    keys: HashMap<String, Value>,
    barriers: HashMap<String, Barrier>,
    /// The waiters registered under each key they miss.
    waiters: HashMap<String, Vec<Arc<Waiter>>>,
    shutting_down: bool,
}

impl Table {
    /// Inserts `key`, waking the waiters for whom it was the last missing key.
    fn insert(&mut self, key: String, value: Value) {
        if let Some(waiters) = self.waiters.remove(&key) {
            for w in waiters {
                if w.missing.fetch_sub(1, Ordering::Relaxed) == 1 {
                    w.signal.fire(DONE);
                }
            }
        }
        self.keys.insert(key, value);
    }

    /// Wakes every blocked waiter and barrier with `why` (shutdown).
    fn wake_everyone(&mut self, why: u8) {
        for w in self.waiters.values().flatten() {
            w.signal.fire(why);
        }
        self.waiters.clear();
        for b in self.barriers.values_mut() {
            for s in b.waiting.drain(..) {
                s.fire(why);
            }
        }
    }
}

/// Keys and barriers behind one lock, held only to read or change them:
/// blocked requests wait off the lock, on their own [`Signal`], so a write
/// wakes only whom it concerns and thousands wake at once without queueing.
#[derive(Default)]
pub(crate) struct State {
    table: Mutex<Table>,
    /// Bumped (under the lock) by every removal of keys: a waiter woken with
    /// no removal since it looked knows its keys are all still there.
    removals: AtomicU64,
}

/// The instant `timeout_ms` from now, or `None` where it is too far to
/// represent (wait forever).
fn deadline(timeout_ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(timeout_ms))
}

fn shutting_down() -> Response {
    Response::Refused("the store is shutting down".into())
}

fn client_left() -> Response {
    Response::Refused("the client closed its connection".into())
}

fn too_large(what: &str, len: usize) -> Response {
    Response::Refused(format!("{what} would hold {len} bytes, over the store's limit of {MAX_VALUE}"))
}

impl State {
    /// Runs one request to completion (blocking for `Wait` and `Barrier`).
    /// `SetWill`/`ClearWill` belong to the connection and are answered there.
    /// `alive` tells a blocked request whether its client is still there.
    pub(crate) fn apply(&self, req: super::protocol::Request, alive: Alive<'_>) -> Response {
        use super::protocol::Request as R;
        let mut t = self.table.lock();
        if t.shutting_down {
            return shutting_down();
        }
        match req {
            R::Set { key, value } => {
                t.insert(key, Arc::new(value));
                Response::Ok
            }
            R::Get { key } => Response::Value(t.keys.get(&key).cloned()),
            R::MultiGet { keys } => {
                let values: Vec<Option<Value>> = keys.iter().map(|k| t.keys.get(k).cloned()).collect();
                drop(t);
                let total: usize = values.iter().flatten().map(|v| v.len() + 8).sum();
                if total > MAX_VALUE {
                    return too_large("the answer", total);
                }
                Response::Values(values)
            }
            R::Append { key, value } => {
                match t.keys.get_mut(&key) {
                    Some(current) => {
                        let len = current.len() + value.len();
                        if len > MAX_VALUE {
                            return too_large(&format!("key '{key}'"), len);
                        }
                        // Copies only while a reader still holds the old value.
                        Arc::make_mut(current).extend_from_slice(&value);
                    }
                    None => t.insert(key, Arc::new(value)),
                }
                Response::Ok
            }
            R::Wait { keys, timeout_ms } => self.wait(t, keys, timeout_ms, alive),
            R::Add { key, delta } => {
                let current: i64 = match t.keys.get(&key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()) {
                        Some(n) => n,
                        None => return Response::NotACounter,
                    },
                };
                let n = current.wrapping_add(delta);
                t.insert(key, Arc::new(n.to_string().into_bytes()));
                Response::Int(n)
            }
            R::CompareSet { key, expected, new } => {
                let current = t.keys.get(&key);
                if current.map(|v| v.as_slice()) == expected.as_deref() {
                    let new = Arc::new(new);
                    t.insert(key, new.clone());
                    Response::Cas { swapped: true, current: Some(new) }
                } else {
                    Response::Cas { swapped: false, current: current.cloned() }
                }
            }
            R::Delete { key } => {
                let existed = t.keys.remove(&key).is_some();
                if existed {
                    self.removals.fetch_add(1, Ordering::Relaxed);
                }
                Response::Bool(existed)
            }
            R::Barrier { name, world_size, timeout_ms } => self.barrier(t, name, world_size, timeout_ms, alive),
            R::SetWill { .. } | R::ClearWill => Response::Ok,
        }
    }

    /// Blocks until every key of `keys` is set at once (registered under the
    /// missing ones, woken when the last arrives), or the deadline passes.
    fn wait<'a>(
        &'a self,
        mut t: MutexGuard<'a, Table>,
        keys: Vec<String>,
        timeout_ms: u64,
        alive: Alive<'_>,
    ) -> Response {
        let deadline = deadline(timeout_ms);
        loop {
            if t.shutting_down {
                return shutting_down();
            }
            let missing: Vec<String> = keys.iter().filter(|k| !t.keys.contains_key(*k)).cloned().collect();
            if missing.is_empty() {
                return Response::Ok;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Response::WaitTimeout { missing };
            }
            let waiter = Arc::new(Waiter { missing: AtomicUsize::new(missing.len()), signal: Signal::new() });
            for k in &missing {
                t.waiters.entry(k.clone()).or_default().push(waiter.clone());
            }
            let removals = self.removals.load(Ordering::Relaxed);
            drop(t);
            let why = waiter.signal.wait(deadline, alive);
            if why == DONE && self.removals.load(Ordering::Relaxed) == removals {
                // Every missing key arrived and none was removed since.
                return Response::Ok;
            }
            if why == STOP {
                return shutting_down();
            }
            t = self.table.lock();
            // Withdraw from the keys still missing, then look again.
            for k in &missing {
                if let Some(list) = t.waiters.get_mut(k) {
                    list.retain(|w| !Arc::ptr_eq(w, &waiter));
                    if list.is_empty() {
                        t.waiters.remove(k);
                    }
                }
            }
            if why == CLIENT_LEFT {
                return client_left();
            }
        }
    }

    fn barrier(
        &self,
        mut t: MutexGuard<'_, Table>,
        name: String,
        world_size: u32,
        timeout_ms: u64,
        alive: Alive<'_>,
    ) -> Response {
        if world_size == 0 {
            return Response::Refused(format!("barrier '{name}' needs a world size of at least 1"));
        }
        let b = t.barriers.entry(name.clone()).or_default();
        if !b.waiting.is_empty() && b.world_size != world_size {
            return Response::BarrierMismatch { others: b.world_size };
        }
        b.world_size = world_size;
        if b.waiting.len() + 1 >= world_size as usize {
            b.generation += 1;
            for s in b.waiting.drain(..) {
                s.fire(DONE);
            }
            return Response::Ok;
        }
        let signal = Signal::new();
        b.waiting.push(signal.clone());
        drop(t);
        let why = signal.wait(deadline(timeout_ms), alive);
        match why {
            DONE | LOOK_AGAIN => return Response::Ok,
            STOP => return shutting_down(),
            _ => {}
        }
        // Timed out or the client left: withdraw, unless it opened
        // meanwhile, so that a retry or a late participant counts right.
        let mut t = self.table.lock();
        match signal.state.load(Ordering::Acquire) {
            PENDING => {}
            STOP => return shutting_down(),
            _ => return Response::Ok,
        }
        let Some(b) = t.barriers.get_mut(&name) else { return Response::Ok };
        let arrived = b.waiting.len() as u32;
        b.waiting.retain(|s| !Arc::ptr_eq(s, &signal));
        if why == CLIENT_LEFT {
            return client_left();
        }
        Response::BarrierTimeout { arrived, world_size }
    }

    /// Sets `key` to `value` unless it exists (a disconnected client's will).
    pub(crate) fn set_if_absent(&self, key: String, value: Vec<u8>) {
        let mut t = self.table.lock();
        if t.shutting_down || t.keys.contains_key(&key) {
            return;
        }
        t.insert(key, Arc::new(value));
    }

    /// Removes every key and barrier whose name does not start with `keep`.
    pub(crate) fn reset_except(&self, keep: &str) {
        let mut t = self.table.lock();
        // Waiters look at the table again; the barriers removed open (the
        // launcher resets with no rank alive), the ones kept stay.
        for w in t.waiters.values().flatten() {
            w.signal.fire(LOOK_AGAIN);
        }
        t.waiters.clear();
        self.removals.fetch_add(1, Ordering::Relaxed);
        t.keys.retain(|k, _| k.starts_with(keep));
        t.barriers.retain(|k, b| {
            let kept = k.starts_with(keep);
            if !kept {
                b.waiting.drain(..).for_each(|s| s.fire(DONE));
            }
            kept
        });
    }

    /// Participants waiting in barrier `name` now (tests order their
    /// clients by it).
    #[cfg(test)]
    pub(crate) fn barrier_arrivals(&self, name: &str) -> u32 {
        self.table.lock().barriers.get(name).map_or(0, |b| b.waiting.len() as u32)
    }

    /// Number of keys held.
    pub(crate) fn len(&self) -> usize {
        self.table.lock().keys.len()
    }

    /// Refuses every later request and wakes every waiter so it answers.
    pub(crate) fn shut_down(&self) {
        let mut t = self.table.lock();
        t.shutting_down = true;
        t.wake_everyone(STOP);
    }

    /// Whether [`State::shut_down`] has run.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.table.lock().shutting_down
    }
}
