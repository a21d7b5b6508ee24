//! The server's key table and barriers, driven by its event loop.
//!
//! A request that must wait (`wait`, `barrier`) costs no thread: it is
//! recorded here under its connection and a sequence number (a
//! [`Ticket`]), and answered later, when the write that completes it
//! comes, by pushing the answer to [`Table::woken`], which the event loop
//! delivers. A `wait` is registered only under the keys it still misses
//! and is counted down as they arrive (never woken by unrelated writes);
//! a barrier answers all its participants when the last arrives, with one
//! shared copy of the values a `barrier_get` reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::protocol::{Request, Response, Value, MAX_VALUE};

/// A connection of the server (its event-loop token).
pub(crate) type ConnId = usize;

/// A session of a connection: 0 is the connection's own (a plain client's
/// only one); a relay opens others, one per rank it serves.
pub(crate) type SessionId = u32;

/// Whoever a blocked request belongs to: a session of a connection (one
/// blocked request at a time each).
pub(crate) type Waiter = (ConnId, SessionId);

/// One blocked request: its connection, its session and the connection's
/// request number (a later request is another ticket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Ticket {
    pub conn: ConnId,
    pub session: SessionId,
    pub seq: u64,
}

impl Ticket {
    fn waiter(&self) -> Waiter {
        (self.conn, self.session)
    }

    fn of((conn, session): Waiter, seq: u64) -> Ticket {
        Ticket { conn, session, seq }
    }
}

/// What a blocked request waits on (so it can withdraw).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Blocked {
    Keys,
    Barrier(String),
}

/// What [`Table::apply`] made of a request.
pub(crate) enum Outcome {
    /// Answered now.
    Answer(Response),
    /// Waits (until its deadline, if any); answered through [`Table::woken`].
    Blocked(Blocked, Option<Instant>),
}

/// One blocked `wait`.
struct Wait {
    seq: u64,
    keys: Vec<String>,
    /// Distinct keys of `keys` not set now; answered at 0.
    missing: usize,
}

/// One participant of a barrier.
struct Arrival {
    ticket: Ticket,
    /// The keys it reads when the barrier opens (`barrier_get`), if any.
    reads: Option<Vec<String>>,
}

/// One named, reusable barrier: the participants of its current round.
#[derive(Default)]
struct Barrier {
    waiting: Vec<Arrival>,
    /// The world size the waiting participants passed.
    world_size: u32,
}

/// Keys, barriers and blocked requests. The event loop holds it under a
/// lock that other threads take only for [`StoreServer`](super::StoreServer)'s
/// own calls (reset, counts, shutdown).
#[derive(Default)]
pub(crate) struct Table {
    keys: HashMap<String, Value>,
    barriers: HashMap<String, Barrier>,
    /// Blocked waits, by session (one request at a time each).
    waits: HashMap<Waiter, Wait>,
    /// The sessions whose blocked wait misses each key.
    waiting_on: HashMap<String, Vec<Waiter>>,
    /// Answers to blocked requests, for the event loop to deliver.
    pub(crate) woken: Vec<(Ticket, Response)>,
    shutting_down: bool,
}

/// The instant `timeout_ms` from now, or `None` where it is too far to
/// represent (wait forever).
fn deadline(timeout_ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(timeout_ms))
}

pub(crate) fn shutting_down() -> Response {
    Response::Refused("the store is shutting down".into())
}

fn too_large(what: &str, len: usize) -> Response {
    Response::Refused(format!("{what} would hold {len} bytes, over the store's limit of {MAX_VALUE}"))
}

impl Table {
    /// Inserts `key`, counting down the waits that missed it.
    fn insert(&mut self, key: String, value: Value) {
        if let Some(conns) = self.waiting_on.remove(&key) {
            for conn in conns {
                let Some(w) = self.waits.get_mut(&conn) else { continue };
                w.missing -= 1;
                if w.missing == 0 {
                    let seq = w.seq;
                    self.waits.remove(&conn);
                    self.woken.push((Ticket::of(conn, seq), Response::Ok));
                }
            }
        }
        self.keys.insert(key, value);
    }

    /// The values of `keys` now, or a refusal when they exceed a frame.
    fn read(&self, keys: &[String]) -> Response {
        let values: Vec<Option<Value>> = keys.iter().map(|k| self.keys.get(k).cloned()).collect();
        let total: usize = values.iter().flatten().map(|v| v.len() + 8).sum();
        if total > MAX_VALUE {
            return too_large("the answer", total);
        }
        Response::Values(values)
    }

    /// Runs one request for `ticket`: answers it, or records it as blocked.
    /// `SetWill`/`ClearWill` belong to the connection and are answered there.
    pub(crate) fn apply(&mut self, ticket: Ticket, req: Request) -> Outcome {
        if self.shutting_down {
            return Outcome::Answer(shutting_down());
        }
        let answer = match req {
            Request::Set { key, value } => {
                self.insert(key, Arc::new(value));
                Response::Ok
            }
            Request::Get { key } => Response::Value(self.keys.get(&key).cloned()),
            Request::MultiGet { keys } => self.read(&keys),
            Request::Append { key, value } => {
                match self.keys.get_mut(&key) {
                    Some(current) => {
                        let len = current.len() + value.len();
                        if len > MAX_VALUE {
                            return Outcome::Answer(too_large(&format!("key '{key}'"), len));
                        }
                        // Copies only while an answer still holds the old value.
                        Arc::make_mut(current).extend_from_slice(&value);
                    }
                    None => self.insert(key, Arc::new(value)),
                }
                Response::Ok
            }
            Request::Wait { keys, timeout_ms } => return self.wait(ticket, keys, timeout_ms),
            Request::Add { key, delta } => {
                let current: i64 = match self.keys.get(&key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()) {
                        Some(n) => n,
                        None => return Outcome::Answer(Response::NotACounter),
                    },
                };
                let n = current.wrapping_add(delta);
                self.insert(key, Arc::new(n.to_string().into_bytes()));
                Response::Int(n)
            }
            Request::CompareSet { key, expected, new } => {
                let current = self.keys.get(&key);
                if current.map(|v| v.as_slice()) == expected.as_deref() {
                    let new = Arc::new(new);
                    self.insert(key, new.clone());
                    Response::Cas { swapped: true, current: Some(new) }
                } else {
                    Response::Cas { swapped: false, current: current.cloned() }
                }
            }
            Request::Delete { key } => {
                let existed = self.keys.remove(&key).is_some();
                if existed {
                    self.missing_again(&key);
                }
                Response::Bool(existed)
            }
            Request::Barrier { name, world_size, timeout_ms } => {
                return self.barrier(ticket, name, world_size, timeout_ms, None)
            }
            Request::BarrierGet { name, world_size, timeout_ms, keys } => {
                return self.barrier(ticket, name, world_size, timeout_ms, Some(keys))
            }
            Request::SetWill { .. } | Request::ClearWill => Response::Ok,
        };
        Outcome::Answer(answer)
    }

    /// `key` was removed: the blocked waits that counted it as set miss it again.
    fn missing_again(&mut self, key: &str) {
        for (&conn, w) in self.waits.iter_mut() {
            if w.keys.iter().any(|k| k == key) {
                w.missing += 1;
                self.waiting_on.entry(key.to_string()).or_default().push(conn);
            }
        }
    }

    /// Answers at once when every key of `keys` is set; otherwise registers
    /// the wait under the distinct keys it misses.
    fn wait(&mut self, ticket: Ticket, keys: Vec<String>, timeout_ms: u64) -> Outcome {
        let mut missing: Vec<&String> = keys.iter().filter(|k| !self.keys.contains_key(*k)).collect();
        if missing.is_empty() {
            return Outcome::Answer(Response::Ok);
        }
        let deadline = deadline(timeout_ms);
        if timeout_ms == 0 {
            return Outcome::Answer(Response::WaitTimeout { missing: missing.into_iter().cloned().collect() });
        }
        missing.sort();
        missing.dedup();
        for k in &missing {
            self.waiting_on.entry((*k).clone()).or_default().push(ticket.waiter());
        }
        let count = missing.len();
        self.waits.insert(ticket.waiter(), Wait { seq: ticket.seq, keys, missing: count });
        Outcome::Blocked(Blocked::Keys, deadline)
    }

    fn barrier(
        &mut self,
        ticket: Ticket,
        name: String,
        world_size: u32,
        timeout_ms: u64,
        reads: Option<Vec<String>>,
    ) -> Outcome {
        if world_size == 0 {
            return Outcome::Answer(Response::Refused(format!("barrier '{name}' needs a world size of at least 1")));
        }
        let b = self.barriers.entry(name.clone()).or_default();
        if !b.waiting.is_empty() && b.world_size != world_size {
            return Outcome::Answer(Response::BarrierMismatch { others: b.world_size });
        }
        b.world_size = world_size;
        if b.waiting.len() + 1 < world_size as usize {
            b.waiting.push(Arrival { ticket, reads });
            return Outcome::Blocked(Blocked::Barrier(name), deadline(timeout_ms));
        }
        // The last participant: open the barrier for everyone.
        let waiting = std::mem::take(&mut b.waiting);
        // One answer per distinct list of keys (one per node when each rank
        // reads its node's directory), its values shared.
        let mut answers: HashMap<Vec<String>, Response> = HashMap::new();
        let mut answer_for = |table: &Table, reads: Option<Vec<String>>| match reads {
            None => Response::Ok,
            Some(keys) => {
                if let Some(r) = answers.get(&keys) {
                    return r.clone();
                }
                let r = table.read(&keys);
                answers.insert(keys, r.clone());
                r
            }
        };
        for a in waiting {
            let r = answer_for(self, a.reads);
            self.woken.push((a.ticket, r));
        }
        Outcome::Answer(answer_for(self, reads))
    }

    /// Withdraws a blocked request (its deadline passed, or its client left)
    /// and returns the answer a timeout gets; `None` when it is no longer
    /// blocked here (its barrier opened or its keys came, and that answer
    /// is already on its way).
    pub(crate) fn withdraw(&mut self, ticket: Ticket, blocked: &Blocked) -> Option<Response> {
        match blocked {
            Blocked::Keys => {
                let w = self.waits.remove(&ticket.waiter())?;
                let missing: Vec<String> = w.keys.iter().filter(|k| !self.keys.contains_key(*k)).cloned().collect();
                for k in &missing {
                    if let Some(list) = self.waiting_on.get_mut(k) {
                        list.retain(|&c| c != ticket.waiter());
                        if list.is_empty() {
                            self.waiting_on.remove(k);
                        }
                    }
                }
                Some(Response::WaitTimeout { missing })
            }
            Blocked::Barrier(name) => {
                let b = self.barriers.get_mut(name)?;
                let at = b.waiting.iter().position(|a| a.ticket == ticket)?;
                let arrived = b.waiting.len() as u32;
                b.waiting.remove(at);
                Some(Response::BarrierTimeout { arrived, world_size: b.world_size })
            }
        }
    }

    /// Sets `key` to `value` unless it exists (a disconnected client's will).
    pub(crate) fn set_if_absent(&mut self, key: String, value: Vec<u8>) {
        if self.shutting_down || self.keys.contains_key(&key) {
            return;
        }
        self.insert(key, Arc::new(value));
    }

    /// Removes every key and barrier whose name does not start with `keep`.
    /// The barriers removed open (the launcher resets with no rank alive);
    /// blocked waits count their keys again.
    pub(crate) fn reset_except(&mut self, keep: &str) {
        self.keys.retain(|k, _| k.starts_with(keep));
        let removed: Vec<String> = self.barriers.keys().filter(|k| !k.starts_with(keep)).cloned().collect();
        for name in removed {
            if let Some(b) = self.barriers.remove(&name) {
                for a in b.waiting {
                    let r = a.reads.map_or(Response::Ok, |keys| self.read(&keys));
                    self.woken.push((a.ticket, r));
                }
            }
        }
        self.waiting_on.clear();
        for (&conn, w) in self.waits.iter_mut() {
            let mut missing: Vec<&String> = w.keys.iter().filter(|k| !self.keys.contains_key(*k)).collect();
            missing.sort();
            missing.dedup();
            w.missing = missing.len();
            for k in missing {
                self.waiting_on.entry(k.clone()).or_default().push(conn);
            }
        }
    }

    /// Participants waiting in barrier `name` now (tests order their
    /// clients by it).
    #[cfg(test)]
    pub(crate) fn barrier_arrivals(&self, name: &str) -> u32 {
        self.barriers.get(name).map_or(0, |b| b.waiting.len() as u32)
    }

    /// Number of keys held.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Refuses every later request; answers every blocked one with a refusal.
    pub(crate) fn shut_down(&mut self) {
        self.shutting_down = true;
        let waits: Vec<(Waiter, u64)> = self.waits.drain().map(|(c, w)| (c, w.seq)).collect();
        for (waiter, seq) in waits {
            self.woken.push((Ticket::of(waiter, seq), shutting_down()));
        }
        self.waiting_on.clear();
        for b in self.barriers.values_mut() {
            for a in b.waiting.drain(..) {
                self.woken.push((a.ticket, shutting_down()));
            }
        }
    }

    /// Whether [`Table::shut_down`] has run.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }
}
