//! [`StoreClient`]: one authenticated connection to a rendezvous store.

use std::fmt::Display;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response, MAX_FRAME, MAX_KEY};

/// Extra time a client gives the server to answer a `wait` or `barrier`
/// beyond the timeout the server applies itself.
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// The outcome of [`StoreClient::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareSet {
    /// The key held the expected value (or was absent, as expected) and now
    /// holds the new one.
    Swapped,
    /// The key held something else, left unchanged: this (`None` = absent).
    Mismatch(Option<Vec<u8>>),
}

impl CompareSet {
    /// Whether the new value was stored.
    pub fn swapped(&self) -> bool {
        matches!(self, CompareSet::Swapped)
    }
}

struct Conn {
    stream: TcpStream,
    /// Set when a request failed half-way: the stream's framing is lost.
    broken: bool,
}

/// A connection to a rendezvous store, authenticated with the job secret.
///
/// Calls take `&self` and the client is `Send + Sync`, but one connection
/// carries one request at a time: a thread blocked in [`StoreClient::wait`]
/// or [`StoreClient::barrier`] holds it until that call returns. Use
/// [`StoreClient::duplicate`] for a second connection.
///
/// Plain requests (set, get, add, ...) are one round trip; each fails with
/// [`StoreError::Unresponsive`] if no answer comes within the timeout given
/// to [`StoreClient::connect`], and with [`StoreError::Disconnected`] at once
/// when the server goes away, never hanging.
pub struct StoreClient {
    addr: String,
    secret: Vec<u8>,
    timeout: Duration,
    conn: Mutex<Conn>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("StoreClient").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl StoreClient {
    /// Connects to the store at `addr` and proves the job secret.
    ///
    /// Retries refused connections until `timeout` has passed (ranks may
    /// start before the store is up), backing off from 1 ms to 100 ms between
    /// attempts. The same `timeout` bounds every later plain request's answer.
    /// A wrong secret fails at once with [`StoreError::AuthRefused`].
    pub fn connect(addr: impl ToSocketAddrs + Display, secret: impl AsRef<[u8]>, timeout: Duration) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let shown = addr.to_string();
        let stream = connect_authenticated(&addr, &shown, secret, timeout)?;
        Ok(StoreClient {
            addr: shown,
            secret: secret.to_vec(),
            timeout,
            conn: Mutex::new(Conn { stream, broken: false }),
        })
    }

    /// Opens a second, independent connection to the same store with the
    /// same secret and timeout.
    pub fn duplicate(&self) -> Result<StoreClient> {
        StoreClient::connect(self.addr.as_str(), &self.secret, self.timeout)
    }

    /// A second handle on the connection's socket (tests cut it).
    #[cfg(test)]
    pub(crate) fn socket(&self) -> TcpStream {
        self.conn.lock().stream.try_clone().expect("clone the socket")
    }

    /// The store's address as given to [`StoreClient::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets `key` to `value`, replacing any value, and wakes its waiters.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let req = Request::Set { key: key.into(), value: value.to_vec() };
        match self.request(&req, self.timeout)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// The value of `key`, or `None` if it is not set. Does not wait.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        match self.request(&Request::Get { key: key.into() }, self.timeout)? {
            Response::Value(v) => Ok(v.map(owned)),
            r => Err(self.unexpected(r)),
        }
    }

    /// The values of `keys` (each `None` where not set), in one round trip.
    /// Does not wait.
    ///
    /// This is how a rank reads many peers' entries at once: one request
    /// instead of one per key. The answer must fit one frame: more than
    /// [`MAX_VALUE`](super::MAX_VALUE) bytes in all is refused.
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>> {
        for k in keys {
            check_key(k)?;
        }
        let req = Request::MultiGet { keys: keys.iter().map(|k| k.to_string()).collect() };
        match self.request(&req, self.timeout)? {
            Response::Values(values) if values.len() == keys.len() => {
                Ok(values.into_iter().map(|v| v.map(owned)).collect())
            }
            r => Err(self.unexpected(r)),
        }
    }

    /// Appends `value` to `key`'s value (an absent key starts empty) and
    /// wakes the key's waiters if it was absent, atomically.
    ///
    /// Many ranks appending one line each build a directory that one
    /// [`StoreClient::get`] reads whole. A value may not grow past
    /// [`MAX_VALUE`](super::MAX_VALUE) bytes: the store refuses
    /// the append that would.
    pub fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let req = Request::Append { key: key.into(), value: value.to_vec() };
        match self.request(&req, self.timeout)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Blocks until every key in `keys` is set, or `timeout` passes.
    ///
    /// The server does the waiting: this is one round trip however long it
    /// lasts. On timeout the error ([`StoreError::WaitTimeout`]) names the
    /// keys still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        for k in keys {
            check_key(k)?;
        }
        let req = Request::Wait { keys: keys.iter().map(|k| k.to_string()).collect(), timeout_ms: millis(timeout) };
        match self.request(&req, timeout.saturating_add(ANSWER_GRACE))? {
            Response::Ok => Ok(()),
            Response::WaitTimeout { missing } => Err(StoreError::WaitTimeout { missing, waited: timeout }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Adds `delta` to the counter at `key` (absent counts as 0) and returns
    /// the new value, atomically. Counters are stored as decimal text.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        match self.request(&Request::Add { key: key.into(), delta }, self.timeout)? {
            Response::Int(n) => Ok(n),
            Response::NotACounter => Err(StoreError::NotACounter { key: key.into() }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Stores `new` at `key` if the key now holds `expected` (`None`: if it is
    /// absent), atomically; otherwise leaves it and returns what it holds.
    pub fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CompareSet> {
        check_key(key)?;
        check_value(new)?;
        if let Some(e) = expected {
            check_value(e)?;
        }
        let req = Request::CompareSet { key: key.into(), expected: expected.map(<[u8]>::to_vec), new: new.to_vec() };
        match self.request(&req, self.timeout)? {
            Response::Cas { swapped: true, .. } => Ok(CompareSet::Swapped),
            Response::Cas { swapped: false, current } => Ok(CompareSet::Mismatch(current.map(owned))),
            r => Err(self.unexpected(r)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        match self.request(&Request::Delete { key: key.into() }, self.timeout)? {
            Response::Bool(b) => Ok(b),
            r => Err(self.unexpected(r)),
        }
    }

    /// Blocks until `world_size` participants have entered the barrier
    /// `name`, or `timeout` passes.
    ///
    /// Barriers are reusable: once it opens, the next `world_size` callers of
    /// the same name form the next round. On timeout this caller withdraws and
    /// the error ([`StoreError::BarrierTimeout`]) says how many of how many
    /// had arrived. Participants must agree on `world_size`.
    pub fn barrier(&self, name: &str, world_size: u32, timeout: Duration) -> Result<()> {
        check_key(name)?;
        let req = Request::Barrier { name: name.into(), world_size, timeout_ms: millis(timeout) };
        match self.request(&req, timeout.saturating_add(ANSWER_GRACE))? {
            Response::Ok => Ok(()),
            Response::BarrierTimeout { arrived, world_size } => {
                Err(StoreError::BarrierTimeout { name: name.into(), arrived, world_size, waited: timeout })
            }
            Response::BarrierMismatch { others } => {
                Err(StoreError::BarrierMismatch { name: name.into(), this: world_size, others })
            }
            r => Err(self.unexpected(r)),
        }
    }

    /// [`StoreClient::barrier`] that also reads `keys` when the barrier
    /// opens: the answer holds their values (each `None` where not set) as
    /// they were when the last participant arrived, in the order asked.
    ///
    /// This is how every rank reads a directory all ranks wrote before the
    /// barrier, in the barrier's own round trip: the store sends every
    /// participant one shared copy of the values, not one per request. The
    /// values must fit one frame ([`MAX_VALUE`](super::MAX_VALUE) bytes in all).
    pub fn barrier_get(
        &self,
        name: &str,
        world_size: u32,
        timeout: Duration,
        keys: &[&str],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        check_key(name)?;
        for k in keys {
            check_key(k)?;
        }
        let req = Request::BarrierGet {
            name: name.into(),
            world_size,
            timeout_ms: millis(timeout),
            keys: keys.iter().map(|k| k.to_string()).collect(),
        };
        match self.request(&req, timeout.saturating_add(ANSWER_GRACE))? {
            Response::Values(values) if values.len() == keys.len() => {
                Ok(values.into_iter().map(|v| v.map(owned)).collect())
            }
            Response::BarrierTimeout { arrived, world_size } => {
                Err(StoreError::BarrierTimeout { name: name.into(), arrived, world_size, waited: timeout })
            }
            Response::BarrierMismatch { others } => {
                Err(StoreError::BarrierMismatch { name: name.into(), this: world_size, others })
            }
            r => Err(self.unexpected(r)),
        }
    }

    /// Leaves a will: should this connection close before
    /// [`StoreClient::clear_will`], the server sets `key` to `value` unless
    /// the key exists. Replaces any earlier will of this connection.
    ///
    /// This is how peers learn that a process died without a word: they wait
    /// on `key`.
    pub fn set_will(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let req = Request::SetWill { key: key.into(), value: value.to_vec() };
        match self.request(&req, self.timeout)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Withdraws this connection's will, if any.
    pub fn clear_will(&self) -> Result<()> {
        match self.request(&Request::ClearWill, self.timeout)? {
            Response::Ok => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Sends one request and reads its answer, waiting at most `answer_within`.
    fn request(&self, req: &Request, answer_within: Duration) -> Result<Response> {
        let body = req.encode();
        if body.len() > MAX_FRAME {
            return Err(StoreError::TooLarge { what: "the request", len: body.len(), max: MAX_FRAME });
        }
        let mut conn = self.conn.lock();
        if conn.broken {
            return Err(StoreError::Broken { addr: self.addr.clone() });
        }
        let result = exchange(&mut conn.stream, &body, answer_within);
        let body = match result {
            Ok(b) => b,
            Err(e) => {
                conn.broken = true;
                return Err(match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        StoreError::Unresponsive { addr: self.addr.clone(), waited: answer_within }
                    }
                    io::ErrorKind::InvalidData => {
                        StoreError::Protocol { addr: self.addr.clone(), detail: e.to_string() }
                    }
                    _ => StoreError::Disconnected { addr: self.addr.clone(), source: e },
                });
            }
        };
        match Response::decode(&body) {
            Ok(Response::Refused(message)) => Err(StoreError::Refused { addr: self.addr.clone(), message }),
            Ok(r) => Ok(r),
            Err(detail) => {
                conn.broken = true;
                Err(StoreError::Protocol { addr: self.addr.clone(), detail })
            }
        }
    }

    fn unexpected(&self, r: Response) -> StoreError {
        StoreError::Protocol { addr: self.addr.clone(), detail: format!("unexpected answer {r:?}") }
    }
}

fn exchange(stream: &mut TcpStream, body: &[u8], answer_within: Duration) -> io::Result<Vec<u8>> {
    // A zero timeout means "none" to the socket API; never ask for that.
    stream.set_read_timeout(Some(answer_within.max(Duration::from_millis(1))))?;
    stream.set_write_timeout(Some(answer_within.max(Duration::from_millis(1))))?;
    protocol::write_frame(stream, body)?;
    protocol::read_frame(stream)
}

/// The bytes of a value answered by the server (shared only on its side).
fn owned(v: super::protocol::Value) -> Vec<u8> {
    std::sync::Arc::try_unwrap(v).unwrap_or_else(|shared| shared.as_ref().clone())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY {
        return Err(StoreError::TooLarge { what: "the key", len: key.len(), max: MAX_KEY });
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<()> {
    // Leave room for the request's own fields.
    let max = super::protocol::MAX_VALUE;
    if value.len() > max {
        return Err(StoreError::TooLarge { what: "the value", len: value.len(), max });
    }
    Ok(())
}

/// Why one connection attempt failed.
enum Attempt {
    /// Worth another try (refused, reset, not resolvable yet).
    Retry(io::Error),
    /// Final (wrong secret, not a store).
    Fatal(StoreError),
}

fn connect_authenticated(
    addr: &(impl ToSocketAddrs + ?Sized),
    shown: &str,
    secret: &[u8],
    timeout: Duration,
) -> Result<TcpStream> {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut backoff = Duration::from_millis(1);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last = match try_connect(addr, shown, secret, remaining.max(Duration::from_millis(50))) {
            Ok(s) => return Ok(s),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(e)) => e,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(StoreError::Connect { addr: shown.to_string(), waited: now - start, source: last });
        }
        tracing::trace!(addr = shown, error = %last, "store not reachable yet; retrying");
        std::thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

fn try_connect(
    addr: &(impl ToSocketAddrs + ?Sized),
    shown: &str,
    secret: &[u8],
    within: Duration,
) -> Result<TcpStream, Attempt> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(Attempt::Retry)?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing");
    for a in addrs {
        let per_try = within.min(Duration::from_secs(5));
        match TcpStream::connect_timeout(&a, per_try) {
            Ok(mut stream) => {
                let _ = stream.set_nodelay(true);
                return match client_handshake(&mut stream, shown, secret, within) {
                    Ok(()) => Ok(stream),
                    Err(e) => Err(e),
                };
            }
            Err(e) => last = e,
        }
    }
    Err(Attempt::Retry(last))
}

fn client_handshake(stream: &mut TcpStream, shown: &str, secret: &[u8], within: Duration) -> Result<(), Attempt> {
    let protocol_error = |detail: String| Attempt::Fatal(StoreError::Protocol { addr: shown.to_string(), detail });
    let within = within.clamp(Duration::from_millis(50), Duration::from_secs(10));
    stream.set_read_timeout(Some(within)).map_err(Attempt::Retry)?;
    stream.set_write_timeout(Some(within)).map_err(Attempt::Retry)?;
    // A store that is shutting down or still starting may close on us: retry.
    let deadline = Instant::now() + within;
    let hello = protocol::read_frame_by(stream, protocol::PREAUTH_MAX_FRAME, deadline).map_err(|e| match e.kind() {
        io::ErrorKind::InvalidData => protocol_error(e.to_string()),
        _ => Attempt::Retry(e),
    })?;
    let magic = protocol::MAGIC.len();
    if hello.len() != magic + 1 + protocol::NONCE_LEN || &hello[..magic] != protocol::MAGIC {
        return Err(protocol_error("the server's greeting is not a cohort store's".into()));
    }
    if hello[magic] != protocol::VERSION {
        return Err(protocol_error(format!(
            "the store speaks protocol version {}, this client {}",
            hello[magic],
            protocol::VERSION
        )));
    }
    let server_nonce = &hello[magic + 1..];
    let client_nonce = protocol::nonce().map_err(Attempt::Fatal)?;
    let tag = protocol::proof(secret, protocol::CLIENT_LABEL, server_nonce, &client_nonce);
    let mut answer = client_nonce.to_vec();
    answer.extend_from_slice(&tag);
    protocol::write_frame(stream, &answer).map_err(Attempt::Retry)?;
    let verdict = match protocol::read_frame_by(stream, protocol::PREAUTH_MAX_FRAME, deadline) {
        Ok(v) => v,
        // The server closes right after refusing; a reset can lose the verdict.
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => vec![protocol::AUTH_REFUSED],
        Err(e) => return Err(Attempt::Retry(e)),
    };
    match verdict.first() {
        Some(&protocol::AUTH_OK) if verdict.len() == 1 + protocol::MAC_LEN => {
            let ok = protocol::verify(secret, protocol::SERVER_LABEL, &client_nonce, server_nonce, &verdict[1..]);
            if ok {
                Ok(())
            } else {
                Err(Attempt::Fatal(StoreError::ServerNotAuthentic { addr: shown.to_string() }))
            }
        }
        Some(&protocol::AUTH_REFUSED) => Err(Attempt::Fatal(StoreError::AuthRefused { addr: shown.to_string() })),
        _ => Err(protocol_error("malformed answer to the handshake".into())),
    }
}
