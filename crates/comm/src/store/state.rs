//! The server's key table and barriers, shared by its connection threads.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::protocol::Response;

/// One named, reusable barrier.
#[derive(Default)]
struct Barrier {
    /// Bumped each time the barrier opens; a waiter leaves when it changes.
    generation: u64,
    /// Participants waiting in the current generation.
    arrived: u32,
    /// The world size the waiting participants passed.
    world_size: u32,
}

#[derive(Default)]
struct Table {
    keys: HashMap<String, Vec<u8>>,
    barriers: HashMap<String, Barrier>,
    shutting_down: bool,
}

/// Keys and barriers behind one lock; one condition variable wakes every
/// waiter on any change (a store serves tens of clients, not thousands).
#[derive(Default)]
pub(crate) struct State {
    table: Mutex<Table>,
    changed: Condvar,
}

/// The instant `timeout_ms` from now, or `None` where it is too far to
/// represent (wait forever).
fn deadline(timeout_ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(timeout_ms))
}

impl State {
    /// Waits on the condition variable until `deadline`; returns whether the
    /// deadline has passed.
    fn wait(&self, table: &mut MutexGuard<'_, Table>, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(d) => self.changed.wait_until(table, d).timed_out(),
            None => {
                self.changed.wait(table);
                false
            }
        }
    }

    /// Runs one request to completion (blocking for `Wait` and `Barrier`).
    /// `SetWill`/`ClearWill` belong to the connection and are answered there.
    pub(crate) fn apply(&self, req: super::protocol::Request) -> Response {
        use super::protocol::Request as R;
        let mut t = self.table.lock();
        if t.shutting_down {
            return Response::Refused("the store is shutting down".into());
        }
        match req {
            R::Set { key, value } => {
                t.keys.insert(key, value);
                self.changed.notify_all();
                Response::Ok
            }
            R::Get { key } => Response::Value(t.keys.get(&key).cloned()),
            R::Wait { keys, timeout_ms } => {
                let deadline = deadline(timeout_ms);
                loop {
                    if t.shutting_down {
                        return Response::Refused("the store is shutting down".into());
                    }
                    let missing: Vec<&String> = keys.iter().filter(|k| !t.keys.contains_key(*k)).collect();
                    if missing.is_empty() {
                        return Response::Ok;
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        let missing = missing.into_iter().cloned().collect();
                        return Response::WaitTimeout { missing };
                    }
                    self.wait(&mut t, deadline);
                }
            }
            R::Add { key, delta } => {
                let current: i64 = match t.keys.get(&key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()) {
                        Some(n) => n,
                        None => return Response::NotACounter,
                    },
                };
                let n = current.wrapping_add(delta);
                t.keys.insert(key, n.to_string().into_bytes());
                self.changed.notify_all();
                Response::Int(n)
            }
            R::CompareSet { key, expected, new } => {
                let current = t.keys.get(&key);
                if current.map(Vec::as_slice) == expected.as_deref() {
                    t.keys.insert(key, new.clone());
                    self.changed.notify_all();
                    Response::Cas { swapped: true, current: Some(new) }
                } else {
                    Response::Cas { swapped: false, current: current.cloned() }
                }
            }
            R::Delete { key } => {
                let existed = t.keys.remove(&key).is_some();
                if existed {
                    self.changed.notify_all();
                }
                Response::Bool(existed)
            }
            R::Barrier { name, world_size, timeout_ms } => self.barrier(t, name, world_size, timeout_ms),
            R::SetWill { .. } | R::ClearWill => Response::Ok,
        }
    }

    fn barrier(&self, mut t: MutexGuard<'_, Table>, name: String, world_size: u32, timeout_ms: u64) -> Response {
        if world_size == 0 {
            return Response::Refused(format!("barrier '{name}' needs a world size of at least 1"));
        }
        let b = t.barriers.entry(name.clone()).or_default();
        if b.arrived > 0 && b.world_size != world_size {
            return Response::BarrierMismatch { others: b.world_size };
        }
        b.world_size = world_size;
        b.arrived += 1;
        let generation = b.generation;
        if b.arrived == world_size {
            b.generation += 1;
            b.arrived = 0;
            self.changed.notify_all();
            return Response::Ok;
        }
        let deadline = deadline(timeout_ms);
        loop {
            let timed_out = self.wait(&mut t, deadline);
            if t.shutting_down {
                return Response::Refused("the store is shutting down".into());
            }
            // The entry can vanish only through `reset_except`, which the
            // launcher calls with no rank alive; treat it as opened.
            let Some(b) = t.barriers.get_mut(&name) else { return Response::Ok };
            if b.generation != generation {
                return Response::Ok;
            }
            if timed_out {
                // Withdraw, so that a retry or a late participant counts right.
                let arrived = b.arrived;
                b.arrived -= 1;
                return Response::BarrierTimeout { arrived, world_size };
            }
        }
    }

    /// Sets `key` to `value` unless it exists (a disconnected client's will).
    pub(crate) fn set_if_absent(&self, key: String, value: Vec<u8>) {
        let mut t = self.table.lock();
        if t.shutting_down || t.keys.contains_key(&key) {
            return;
        }
        t.keys.insert(key, value);
        self.changed.notify_all();
    }

    /// Removes every key and barrier whose name does not start with `keep`.
    pub(crate) fn reset_except(&self, keep: &str) {
        let mut t = self.table.lock();
        t.keys.retain(|k, _| k.starts_with(keep));
        t.barriers.retain(|k, _| k.starts_with(keep));
        self.changed.notify_all();
    }

    /// Participants waiting in barrier `name` now (tests order their
    /// clients by it).
    #[cfg(test)]
    pub(crate) fn barrier_arrivals(&self, name: &str) -> u32 {
        self.table.lock().barriers.get(name).map_or(0, |b| b.arrived)
    }

    /// Number of keys held.
    pub(crate) fn len(&self) -> usize {
        self.table.lock().keys.len()
    }

    /// Refuses every later request and wakes every waiter so it answers.
    pub(crate) fn shut_down(&self) {
        self.table.lock().shutting_down = true;
        self.changed.notify_all();
    }

    /// Whether [`State::shut_down`] has run.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.table.lock().shutting_down
    }
}
