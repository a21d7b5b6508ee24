//! [`StoreClient`]: one authenticated connection to a rendezvous store.

use std::fmt::Display;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response, MAX_FRAME, MAX_KEY};
use super::rank_sockets::take_relay_socket;

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

/// The socket of a client: a TCP connection to the store, or a rank's end
/// of its node relay's socket pair.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
        }
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_write_timeout(t),
            Socket::Unix(s) => s.set_write_timeout(t),
        }
    }
}

impl io::Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl io::Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Conn {
    stream: Socket,
    /// Set when a request failed half-way: the stream's framing is lost.
    broken: bool,
    /// The handshake whose verdict has not been read yet (a client from
    /// [`StoreClient::connect_pipelined`] before its first request).
    verdict: Option<Unverified>,
}

/// The nonces of a handshake whose verdict is still on its way.
pub(crate) struct Unverified {
    pub(crate) client_nonce: [u8; protocol::NONCE_LEN],
    pub(crate) server_nonce: [u8; protocol::NONCE_LEN],
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
    /// The store's address as errors show it.
    shown: String,
    /// The address a direct connection goes to.
    direct: String,
    secret: Vec<u8>,
    timeout: Duration,
    /// Over a node relay's socket (no handshake; frames a little smaller).
    relayed: bool,
    /// The process that made the client: its connection is that process's
    /// alone (a child it forks gets [`StoreError::ForkedChild`]).
    owner: u32,
    conn: Mutex<Conn>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("StoreClient").field("addr", &self.shown).finish_non_exhaustive()
    }
}

impl StoreClient {
    /// Connects to the store at `addr` and proves the job secret.
    ///
    /// Retries refused connections until `timeout` has passed (ranks may
    /// start before the store is up), backing off from 1 ms to 100 ms between
    /// attempts; a lookup of the host name that fails only for the moment is
    /// retried the same way. The same `timeout` bounds every later plain
    /// request's answer. A wrong secret fails at once with
    /// [`StoreError::AuthRefused`]. An address that is not `host:port` fails
    /// at once with [`StoreError::Unresolvable`], and so does one whose host
    /// name the resolver has not known for 60 s (at most `timeout`; see
    /// `resolve_addrs`).
    pub fn connect(addr: impl ToSocketAddrs + Display, secret: impl AsRef<[u8]>, timeout: Duration) -> Result<Self> {
        Self::over_tcp(addr, secret.as_ref(), timeout, Verify::Now)
    }

    /// A client of its own TCP connection to `addr`, its handshake up to
    /// `verify`.
    fn over_tcp(addr: impl ToSocketAddrs + Display, secret: &[u8], timeout: Duration, verify: Verify) -> Result<Self> {
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let shown = addr.to_string();
        let (stream, verdict) = connect_authenticated(&addr, &shown, secret, timeout, verify, &[])?;
        Ok(StoreClient {
            direct: shown.clone(),
            shown,
            secret: secret.to_vec(),
            timeout,
            relayed: false,
            owner: std::process::id(),
            conn: Mutex::new(Conn { stream: Socket::Tcp(stream), broken: false, verdict }),
        })
    }

    /// A client over `socket`, a rank's end of its node relay's socket
    /// pair ([`StoreRelay`](super::StoreRelay)): already trusted, so there
    /// is no handshake; every request goes through the relay's connection
    /// to the store at `addr` (which errors name, and which
    /// [`StoreClient::duplicate`] connects to directly, proving `secret`).
    pub fn over_relay(
        socket: UnixStream,
        addr: impl Display,
        secret: impl AsRef<[u8]>,
        timeout: Duration,
    ) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        Ok(StoreClient {
            shown: format!("{addr} (through this node's relay)"),
            direct: addr.to_string(),
            secret: secret.to_vec(),
            timeout,
            relayed: true,
            owner: std::process::id(),
            conn: Mutex::new(Conn { stream: Socket::Unix(socket), broken: false, verdict: None }),
        })
    }

    /// The client a rank uses to reach the store at `addr`: over its node
    /// relay's socket when the launcher passed it some in `COHORT_STORE_FD`
    /// (each is taken once per process, in order, and first cleared of the
    /// answers an earlier program of the rank left in it, one round trip
    /// that waits at most `timeout`: a socket that cannot be cleared is
    /// left and this call connects directly; once they are all taken,
    /// calls connect directly), otherwise
    /// [`StoreClient::connect_pipelined`]. A descriptor that is not an open
    /// socket, or a value that is not a list of descriptors, is an error
    /// naming the variable.
    pub fn connect_rank(addr: &str, secret: impl AsRef<[u8]>, timeout: Duration) -> Result<Self> {
        match take_relay_socket(timeout)? {
            Some(socket) => Self::over_relay(socket, addr, secret, timeout),
            None => Self::connect_pipelined(addr, secret, timeout),
        }
    }

    /// [`StoreClient::connect`] without waiting for the store's verdict on
    /// the proof: the first request leaves right behind the proof, and its
    /// answer comes after the verdict, so connecting and the first request
    /// take one round trip together instead of two.
    ///
    /// The client checks the verdict (and the server's proof of the secret)
    /// before it reads that first answer: a wrong secret fails the first
    /// request with [`StoreError::AuthRefused`] (the store executes none of
    /// it), a server without the secret with
    /// [`StoreError::ServerNotAuthentic`]. The first request's bytes do go
    /// to the server before it has proved itself: use
    /// [`StoreClient::connect`] where they must not.
    pub fn connect_pipelined(
        addr: impl ToSocketAddrs + Display,
        secret: impl AsRef<[u8]>,
        timeout: Duration,
    ) -> Result<Self> {
        Self::over_tcp(addr, secret.as_ref(), timeout, Verify::WithFirstAnswer)
    }

    /// Opens a second, independent connection to the same store with the
    /// same secret and timeout. Like [`StoreClient::connect_pipelined`], it
    /// does not wait for the verdict: its first request travels with the
    /// proof (the secret is the one this connection uses), and the server's
    /// proof is checked before that request's answer is read.
    ///
    /// A client over a node relay takes the next relay socket the launcher
    /// gave this process (`COHORT_STORE_FD`), while there is one: another
    /// session of the relay's connection, with its own will, no handshake.
    pub fn duplicate(&self) -> Result<StoreClient> {
        if self.relayed {
            if let Some(socket) = take_relay_socket(self.timeout)? {
                return StoreClient::over_relay(socket, self.direct.as_str(), &self.secret, self.timeout);
            }
        }
        StoreClient::connect_pipelined(self.direct.as_str(), &self.secret, self.timeout)
    }

    /// A second handle on the connection's socket (tests cut it).
    #[cfg(test)]
    pub(crate) fn socket(&self) -> TcpStream {
        match &self.conn.lock().stream {
            Socket::Tcp(s) => s.try_clone().expect("clone the socket"),
            Socket::Unix(_) => panic!("a relay's client has no TCP socket"),
        }
    }

    /// The store's address as given to [`StoreClient::connect`] (a client
    /// over a node relay: the address the relay forwards to), `host:port`.
    pub fn addr(&self) -> &str {
        &self.direct
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

    /// [`StoreClient::append`] for each `(key, value)`, in order, with every
    /// request in one write: one round trip for all (a rank publishes its
    /// entry to two directories this way). The store applies or refuses
    /// each append on its own (one refused does not stop those after it);
    /// the first refusal is the error.
    pub fn append_each(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        let mut reqs = Vec::with_capacity(entries.len());
        for (key, value) in entries {
            check_key(key)?;
            check_value(value)?;
            reqs.push(Request::Append { key: key.to_string(), value: value.to_vec() });
        }
        for r in self.requests(&reqs, self.timeout)? {
            if r != Response::Ok {
                return Err(self.unexpected(r));
            }
        }
        Ok(())
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
        let mut answers = self.requests(std::slice::from_ref(req), answer_within)?;
        Ok(answers.pop().expect("one answer per request"))
    }

    /// Sends `reqs` in one write and reads their answers, in order, waiting
    /// at most `answer_within` for each; the first refusal is the error.
    fn requests(&self, reqs: &[Request], answer_within: Duration) -> Result<Vec<Response>> {
        let mut bodies = Vec::with_capacity(reqs.len());
        // A relay adds a session's tag to every frame it forwards.
        let max = if self.relayed { super::MAX_RELAYED_FRAME } else { MAX_FRAME };
        for req in reqs {
            let body = req.encode();
            if body.len() > max {
                return Err(StoreError::TooLarge { what: "the request", len: body.len(), max });
            }
            bodies.push(body);
        }
        let pid = std::process::id();
        if pid != self.owner {
            return Err(StoreError::ForkedChild { addr: self.shown.clone(), owner: self.owner, pid });
        }
        let mut conn = self.conn.lock();
        if conn.broken {
            return Err(StoreError::Broken { addr: self.shown.clone() });
        }
        let mut dropped_before_verdict = 0;
        let answers = loop {
            match exchange(&mut conn, &self.secret, &bodies, answer_within) {
                Ok(answers) => break Ok(answers),
                Err(Failed::BeforeVerdict(e)) => {
                    // Connect again and send it all again, a few times:
                    // the store ran none of it.
                    dropped_before_verdict += 1;
                    if dropped_before_verdict > HANDSHAKE_RETRIES {
                        conn.broken = true;
                        return Err(StoreError::HandshakeDropped {
                            addr: self.shown.clone(),
                            tries: dropped_before_verdict,
                        });
                    }
                    tracing::debug!(addr = %self.shown, error = %e, "the store dropped the connection before its verdict; connecting again");
                    std::thread::sleep(Duration::from_millis(1 << dropped_before_verdict));
                    match connect_authenticated(
                        self.direct.as_str(),
                        &self.direct,
                        &self.secret,
                        self.timeout,
                        Verify::WithFirstAnswer,
                        &[],
                    ) {
                        Ok((stream, verdict)) => {
                            conn.stream = Socket::Tcp(stream);
                            conn.verdict = verdict;
                        }
                        Err(e) => {
                            conn.broken = true;
                            return Err(e);
                        }
                    }
                }
                Err(other) => break Err(other),
            }
        };
        let answers = match answers {
            Ok(answers) => answers,
            Err(Failed::Verdict(e)) => {
                conn.broken = true;
                return Err(self.verdict_error(e));
            }
            Err(Failed::Io(e) | Failed::BeforeVerdict(e)) => {
                conn.broken = true;
                return Err(match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        StoreError::Unresponsive { addr: self.shown.clone(), waited: answer_within }
                    }
                    io::ErrorKind::InvalidData => {
                        StoreError::Protocol { addr: self.shown.clone(), detail: e.to_string() }
                    }
                    _ => StoreError::Disconnected { addr: self.shown.clone(), source: e },
                });
            }
        };
        let mut decoded = Vec::with_capacity(answers.len());
        for body in answers {
            match Response::decode(&body) {
                Ok(Response::Refused(message)) => {
                    return Err(StoreError::Refused { addr: self.shown.clone(), message });
                }
                Ok(r) => decoded.push(r),
                Err(detail) => {
                    conn.broken = true;
                    return Err(StoreError::Protocol { addr: self.shown.clone(), detail });
                }
            }
        }
        Ok(decoded)
    }

    /// The error of a verdict other than "accepted".
    fn verdict_error(&self, v: protocol::Verdict) -> StoreError {
        match verdict_result(v, &self.shown) {
            Err(e) => e,
            Ok(()) => StoreError::AuthRefused { addr: self.shown.clone() },
        }
    }

    fn unexpected(&self, r: Response) -> StoreError {
        StoreError::Protocol { addr: self.shown.clone(), detail: format!("unexpected answer {r:?}") }
    }
}

/// Connections a pipelined client makes again when the store drops one
/// before its verdict on the proof.
const HANDSHAKE_RETRIES: u32 = 5;

/// Whether `e` says the peer closed the connection (or went away): also
/// the transports' check (`transport::peer_gone`), which build on the
/// store.
pub(crate) fn dropped(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::BrokenPipe
    )
}

/// Why an exchange failed.
enum Failed {
    /// The socket failed, timed out or carried a malformed frame.
    Io(io::Error),
    /// The store closed the connection before its verdict on the proof:
    /// nothing sent behind the proof ran, so it may be sent again.
    BeforeVerdict(io::Error),
    /// The verdict read before the first answer was not "accepted by a
    /// server that holds the secret".
    Verdict(protocol::Verdict),
}

/// Writes the request frames `bodies` in one write and reads their
/// answers; on a connection whose verdict is still due, reads and checks
/// that first (nothing of an answer is read unless the server proved the
/// secret).
fn exchange(
    conn: &mut Conn,
    secret: &[u8],
    bodies: &[Vec<u8>],
    answer_within: Duration,
) -> Result<Vec<Vec<u8>>, Failed> {
    let stream = &mut conn.stream;
    // A zero timeout means "none" to the socket API; never ask for that.
    let within = answer_within.max(Duration::from_millis(1));
    stream.set_read_timeout(Some(within)).map_err(Failed::Io)?;
    stream.set_write_timeout(Some(within)).map_err(Failed::Io)?;
    let sent = protocol::write_frames(stream, bodies);
    if let (Some(hs), Socket::Tcp(stream)) = (conn.verdict.take(), &mut *stream) {
        // Read the verdict even if the write failed: a store that refused
        // the proof may have closed before the request went out.
        let deadline = Instant::now() + within;
        let verdict = match protocol::read_frame_by(stream, protocol::PREAUTH_MAX_FRAME, deadline) {
            Ok(v) => v,
            // Closed with no verdict: the store let go of the connection
            // before it judged the proof (it sheds handshakes past its
            // limit), so nothing sent behind the proof ran.
            Err(e) if dropped(&e) => return Err(Failed::BeforeVerdict(e)),
            Err(e) => return Err(Failed::Io(e)),
        };
        match protocol::read_verdict(secret, &hs.client_nonce, &hs.server_nonce, &verdict) {
            protocol::Verdict::Accepted => {}
            other => return Err(Failed::Verdict(other)),
        }
        // read_frame_by changed the read timeout: each answer's is the whole.
        stream.set_read_timeout(Some(within)).map_err(Failed::Io)?;
    }
    if let (Err(e), Socket::Unix(_)) = (&sent, &*stream) {
        // A relay that lost the store closes this rank's end right after
        // leaving it a refusal that says why: read that rather than the
        // broken pipe.
        if let Ok(refusal) = protocol::read_frame(stream) {
            tracing::debug!(error = %e, "the store relay closed this rank's socket");
            // Closed: nothing more goes over it.
            conn.broken = true;
            return Ok(vec![refusal]);
        }
    }
    sent.map_err(Failed::Io)?;
    let relayed = matches!(&*stream, Socket::Unix(_));
    let mut answers = Vec::with_capacity(bodies.len());
    for _ in bodies {
        match protocol::read_frame(stream) {
            Ok(answer) => answers.push(answer),
            // A relay that lost the store answers the first request it could
            // not pass on with a refusal saying why, then closes this rank's
            // end: that refusal is the answer, not the end of stream.
            Err(e) if relayed && answers.iter().any(|a| matches!(Response::decode(a), Ok(Response::Refused(_)))) => {
                tracing::debug!(error = %e, "the store relay closed this rank's socket");
                conn.broken = true;
                return Ok(answers);
            }
            Err(e) => return Err(Failed::Io(e)),
        }
    }
    Ok(answers)
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
    /// Worth another try (refused, reset, a lookup that failed for the
    /// moment).
    Retry(io::Error),
    /// Final (an address that is not `host:port`, wrong secret, not a
    /// store).
    Fatal(StoreError),
}

/// Why [`resolve_addrs`] gave no address to connect to.
#[derive(Debug)]
pub(crate) enum Unresolved {
    /// The lookup failed in a way that may pass (a timeout, an interrupted
    /// call, the resolver's "temporary failure"): retried until the
    /// caller's timeout.
    Transient(io::Error),
    /// The resolver does not know the name, or it gives no address: retried
    /// for [`UNKNOWN_NAME_GRACE`] (a host whose name is published only once
    /// it runs, as a Kubernetes service's), then an error.
    Unknown(io::Error),
    /// Not `host:port` at all: no retry helps.
    Malformed(io::Error),
}

impl Unresolved {
    /// The resolver's answer.
    pub(crate) fn into_error(self) -> io::Error {
        match self {
            Unresolved::Transient(e) | Unresolved::Unknown(e) | Unresolved::Malformed(e) => e,
        }
    }
}

/// How long a store address whose name the resolver does not know is
/// looked up again before that is an error (never longer than the
/// caller's timeout): long enough for a host whose name appears when it
/// starts, short of the whole rendezvous timeout for a misspelt one.
pub(crate) const UNKNOWN_NAME_GRACE: Duration = Duration::from_secs(60);

/// The socket addresses `addr` resolves to. This is the one place that
/// decides whether a store's address resolves: every connection of a
/// [`StoreClient`] (and of a node relay) goes through it, and so does the
/// early check of MASTER_ADDR when a rank finds its store from the
/// environment ([`await_name`]).
///
/// The rule: an address that is not `host:port` is
/// [`Unresolved::Malformed`]; a lookup that times out, is interrupted or
/// would block, or that the resolver answers with its temporary failure
/// (`EAI_AGAIN`, what glibc answers when no name server replied; the
/// standard library reports it with an uncategorized kind, so it is told
/// apart by `gai_strerror`'s text) is [`Unresolved::Transient`]; any other
/// failure (the resolver does not know the name, `EAI_NONAME`, or fails
/// for good) and a lookup that gives no address are
/// [`Unresolved::Unknown`].
///
/// A name the resolver does not know whose host part (in `shown`, the
/// address as text) cannot be a host name at all (empty, or with
/// characters no host name has, or an unclosed `[`) is
/// [`Unresolved::Malformed`] too: no later lookup can find it.
pub(crate) fn resolve_addrs(addr: &(impl ToSocketAddrs + ?Sized), shown: &str) -> Result<Vec<SocketAddr>, Unresolved> {
    let unknown = |e: io::Error| match could_be_host(shown) {
        true => Unresolved::Unknown(e),
        false => Unresolved::Malformed(e),
    };
    match addr.to_socket_addrs() {
        Ok(found) => {
            let found: Vec<SocketAddr> = found.collect();
            if found.is_empty() {
                return Err(unknown(io::Error::new(io::ErrorKind::NotFound, "it resolves to no address")));
            }
            Ok(found)
        }
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => Err(Unresolved::Malformed(e)),
        Err(e) if lookup_may_pass(&e) => Err(Unresolved::Transient(e)),
        Err(e) => Err(unknown(e)),
    }
}

/// Whether the host part of `shown` (`host:port`, `[v6]:port`) could be a
/// host name or address: not empty, at most 253 characters of letters,
/// digits, `-`, `.` and `_`, or a bracketed IPv6 address.
fn could_be_host(shown: &str) -> bool {
    let host = shown.rsplit_once(':').map_or(shown, |(host, _)| host);
    if let Some(inner) = host.strip_prefix('[') {
        return inner.strip_suffix(']').is_some_and(|v6| v6.parse::<std::net::Ipv6Addr>().is_ok());
    }
    !host.is_empty() && host.len() <= 253 && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
}

/// Looks `addr` up until it resolves, or the lookup fails only for the
/// moment (the connection retries those), or the resolver has not known
/// the name for `grace`: then, and at once for a malformed address, the
/// last answer. Logs a warning once when the name is not known at first.
pub(crate) fn await_name(addr: &(impl ToSocketAddrs + ?Sized), shown: &str, grace: Duration) -> Result<(), Unresolved> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        match resolve_addrs(addr, shown) {
            Ok(_) | Err(Unresolved::Transient(_)) => return Ok(()),
            Err(Unresolved::Unknown(e)) if start.elapsed() < grace => {
                if pause == Duration::from_millis(50) {
                    warn_unknown(shown, &e, grace);
                }
                std::thread::sleep(pause.min(grace.saturating_sub(start.elapsed())));
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(other) => return Err(other),
        }
    }
}

/// The warning when a store's host name is not known (yet).
fn warn_unknown(shown: &str, e: &io::Error, grace: Duration) {
    tracing::warn!(
        "the rendezvous store's address {shown} does not resolve ({e}); looking it up again for up to {} s \
         (a host whose name appears when it starts), then giving up",
        grace.as_secs()
    );
}

/// Whether the failed lookup `e` may succeed if tried again: a timeout, an
/// interrupted or would-block call, or the resolver's temporary failure
/// (`EAI_AGAIN`).
fn lookup_may_pass(e: &io::Error) -> bool {
    if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
        return true;
    }
    // The standard library reports getaddrinfo's own failures (all but
    // EAI_SYSTEM, which carries an OS error) with no OS error code, as
    // "failed to lookup address information: " and gai_strerror's text.
    e.raw_os_error().is_none() && gai_text(libc::EAI_AGAIN).is_some_and(|text| e.to_string().contains(&text))
}

/// What `gai_strerror` says for the getaddrinfo error `code` (in this
/// process's locale, as the standard library reads it), if anything.
fn gai_text(code: libc::c_int) -> Option<String> {
    // SAFETY: gai_strerror takes any code and returns null or a pointer to
    // a NUL-terminated string that is never freed.
    let text = unsafe { libc::gai_strerror(code) };
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null, so a NUL-terminated string that outlives this call.
    let text = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned();
    (!text.is_empty()).then_some(text)
}

/// When the client reads the store's verdict on its proof.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Before connecting returns.
    Now,
    /// Before the first request's answer.
    WithFirstAnswer,
}

/// Connects to the store and proves `secret`, retrying until `timeout`;
/// `behind` (requests, with [`Verify::WithFirstAnswer`]) goes in the same
/// write as the proof.
pub(crate) fn connect_authenticated(
    addr: &(impl ToSocketAddrs + ?Sized),
    shown: &str,
    secret: &[u8],
    timeout: Duration,
    verify: Verify,
    behind: &[u8],
) -> Result<(TcpStream, Option<Unverified>)> {
    let start = Instant::now();
    let deadline = start + timeout;
    // A name not known yet is waited for here, at most for the grace;
    // a malformed address fails at once.
    await_name(addr, shown, UNKNOWN_NAME_GRACE.min(timeout))
        .map_err(|unresolved| StoreError::Unresolvable { addr: shown.to_string(), source: unresolved.into_error() })?;
    let mut backoff = Duration::from_millis(1);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last = match try_connect(addr, shown, secret, remaining.max(Duration::from_millis(50)), verify, behind) {
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
    verify: Verify,
    behind: &[u8],
) -> Result<(TcpStream, Option<Unverified>), Attempt> {
    // Known by `await_name` before the first attempt: a lookup that fails
    // now (the name went away, the resolver is slow) is retried.
    let addrs = resolve_addrs(addr, shown).map_err(|unresolved| Attempt::Retry(unresolved.into_error()))?;
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing");
    for a in addrs {
        let per_try = within.min(Duration::from_secs(5));
        match TcpStream::connect_timeout(&a, per_try) {
            Ok(mut stream) => {
                let _ = stream.set_nodelay(true);
                let unverified = client_handshake(&mut stream, shown, secret, within, verify, behind)?;
                return Ok((stream, unverified));
            }
            Err(e) => last = e,
        }
    }
    Err(Attempt::Retry(last))
}

/// Reads the greeting and sends the proof; with [`Verify::Now`], reads and
/// checks the verdict too, otherwise returns the nonces to check it with.
fn client_handshake(
    stream: &mut TcpStream,
    shown: &str,
    secret: &[u8],
    within: Duration,
    verify: Verify,
    behind: &[u8],
) -> Result<Option<Unverified>, Attempt> {
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
    let server_nonce = protocol::parse_greeting(&hello).map_err(protocol_error)?;
    let (client_nonce, answer) = protocol::client_answer(secret, &server_nonce).map_err(Attempt::Fatal)?;
    if verify == Verify::WithFirstAnswer && !behind.is_empty() {
        // One write (one segment) for the proof and what follows it.
        let mut out = Vec::with_capacity(4 + answer.len() + behind.len());
        out.extend_from_slice(&(answer.len() as u32).to_le_bytes());
        out.extend_from_slice(&answer);
        out.extend_from_slice(behind);
        io::Write::write_all(stream, &out).map_err(Attempt::Retry)?;
    } else {
        protocol::write_frame(stream, &answer).map_err(Attempt::Retry)?;
    }
    if verify == Verify::WithFirstAnswer {
        return Ok(Some(Unverified { client_nonce, server_nonce }));
    }
    let verdict = match protocol::read_frame_by(stream, protocol::PREAUTH_MAX_FRAME, deadline) {
        Ok(v) => v,
        // The server closes right after refusing; a reset can lose the verdict.
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => vec![protocol::AUTH_REFUSED],
        Err(e) => return Err(Attempt::Retry(e)),
    };
    let verdict = protocol::read_verdict(secret, &client_nonce, &server_nonce, &verdict);
    verdict_result(verdict, shown).map(|()| None).map_err(Attempt::Fatal)
}

/// What the store's verdict on this client's proof means: `Ok` when it
/// accepted the proof and proved it holds the secret too; otherwise the
/// error naming the store at `addr`.
pub(crate) fn verdict_result(verdict: protocol::Verdict, addr: &str) -> Result<()> {
    let addr = addr.to_string();
    match verdict {
        protocol::Verdict::Accepted => Ok(()),
        protocol::Verdict::Refused => Err(StoreError::AuthRefused { addr }),
        protocol::Verdict::NotAuthentic => Err(StoreError::ServerNotAuthentic { addr }),
        protocol::Verdict::Malformed => {
            Err(StoreError::Protocol { addr, detail: "malformed answer to the handshake".into() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the standard library's error says when getaddrinfo fails with
    /// `code` (its text for every code but EAI_SYSTEM).
    fn lookup_failed(code: libc::c_int) -> io::Error {
        let text = gai_text(code).expect("gai_strerror has a text for the code");
        io::Error::other(format!("failed to lookup address information: {text}"))
    }

    #[test]
    fn store_lookups_that_may_pass_are_retried_and_the_rest_are_fatal() {
        assert!(lookup_may_pass(&lookup_failed(libc::EAI_AGAIN)), "a temporary failure of the resolver");
        for code in [libc::EAI_NONAME, libc::EAI_FAIL, libc::EAI_SERVICE] {
            assert!(!lookup_may_pass(&lookup_failed(code)), "{}", lookup_failed(code));
        }
        for kind in [io::ErrorKind::TimedOut, io::ErrorKind::Interrupted, io::ErrorKind::WouldBlock] {
            assert!(lookup_may_pass(&io::Error::from(kind)), "{kind:?}");
        }
        assert!(!lookup_may_pass(&io::Error::from(io::ErrorKind::InvalidInput)));
        // An OS error is judged by its kind, whatever its text.
        assert!(!lookup_may_pass(&io::Error::from_raw_os_error(libc::ENOENT)));
        assert!(lookup_may_pass(&io::Error::from_raw_os_error(libc::EINTR)));
    }

    #[test]
    fn store_addresses_resolve_by_one_rule() {
        let local: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        assert_eq!(resolve_addrs("127.0.0.1:29500", "127.0.0.1:29500").unwrap(), vec![local]);
        let loopback = resolve_addrs(&("localhost", 29500), "localhost:29500").unwrap();
        assert!(loopback.iter().all(|a| a.ip().is_loopback()));
        // Not host:port, a port out of range, or a host part no host name
        // has (where the resolver does not know it): no retry helps.
        for bad in ["127.0.0.1", "127.0.0.1:70000", "", ":29500", "host:", "a b:1", "[::1:29500", "bad!:1", "[zz]:1"] {
            assert!(matches!(resolve_addrs(bad, bad), Err(Unresolved::Malformed(_))), "{bad}");
            let start = Instant::now();
            assert!(matches!(await_name(bad, bad, Duration::from_secs(30)), Err(Unresolved::Malformed(_))), "{bad}");
            // Well short of the 30 s grace a name not known yet gets.
            assert!(start.elapsed() < Duration::from_secs(10), "{bad}: looked up again");
        }
        // A lookup that gives no address at all: looked up again for the
        // grace, then given up.
        let none: &[SocketAddr] = &[];
        match resolve_addrs(&none, "none:1") {
            Err(Unresolved::Unknown(e)) => assert_eq!(e.to_string(), "it resolves to no address"),
            other => panic!("{other:?}"),
        }
        let start = Instant::now();
        assert!(matches!(await_name(&none, "none:1", Duration::from_millis(300)), Err(Unresolved::Unknown(_))));
        for host in ["node-1.cluster.local:29500", "[::1]:1", "10.0.0.1:2", "under_score:3"] {
            assert!(could_be_host(host), "{host}");
        }
        let waited = start.elapsed();
        // The grace, then no longer (a loaded machine may add seconds).
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(20), "{waited:?}");
        assert!(await_name("127.0.0.1:29500", "local", Duration::from_secs(30)).is_ok());
    }
}
