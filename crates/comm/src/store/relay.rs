//! [`StoreRelay`]: a node's ranks reach the store through one connection.
//!
//! The relay holds one authenticated connection to the store and, for each
//! of the node's ranks, one end of a socket pair whose other end the rank
//! inherits (`COHORT_STORE_FD`). Each rank is a session of that connection
//! (see the `protocol` module): the relay opens the sessions right behind
//! its proof of the secret, passes each rank's request frames upstream
//! tagged with its session, unread, and each answer back to the rank it
//! belongs to. The ranks' ends need no handshake: the descriptor is private
//! to the process that inherits it. A rank's end closing (the rank exited
//! or was killed) closes its session, so the store withdraws it from its
//! barrier and sets its will, as for a rank connected directly. When the
//! store's connection fails, every rank gets a refusal naming the store and
//! its end is closed: its next call fails at once instead of hanging.
//!
//! One thread serves the relay with non-blocking sockets (mio).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use mio::net::{TcpStream, UnixStream as MioUnixStream};
use mio::{Events, Interest, Poll, Token, Waker};

use super::client::{connect_authenticated, Unverified, Verify};
use super::error::{Result, StoreError};
use super::protocol::{self, Response, MAX_FRAME, SESSION_OVERHEAD};

const UPSTREAM: Token = Token(0);
const WAKER: Token = Token(1);
/// The first rank's token (its session is 1).
const FIRST_RANK: usize = 2;

/// Largest request frame a rank may send through the relay: one that still
/// fits a frame once tagged with its session.
pub const MAX_RELAYED_FRAME: usize = MAX_FRAME - SESSION_OVERHEAD;

/// A node relay of the rendezvous store: one thread, one connection to the
/// store, one socket pair per local rank. Dropping it stops the thread and
/// closes the connection (the store then sets the wills of the sessions
/// still open).
pub struct StoreRelay {
    addr: String,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreRelay").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl StoreRelay {
    /// Connects to the store at `addr`, proving `secret` (retrying until
    /// `timeout`, as [`StoreClient::connect`](super::StoreClient::connect)
    /// does), opens one session per rank right behind the proof (one round
    /// trip in all, and the store's verdict is checked before any answer is
    /// passed on) and starts relaying. Returns the relay and the ranks'
    /// ends of their socket pairs, in order: hand each to its rank (which
    /// makes a client of it with
    /// [`StoreClient::over_relay`](super::StoreClient::over_relay)).
    ///
    /// The ends are close-on-exec: the launcher clears that on the one end
    /// each child inherits. Fails when the store cannot be reached within
    /// `timeout`; a store that refuses the secret is reported to every rank
    /// as the answer to its first request.
    pub fn start(
        addr: &str,
        secret: impl AsRef<[u8]>,
        ranks: usize,
        timeout: Duration,
    ) -> Result<(StoreRelay, Vec<UnixStream>)> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let ranks_u32 = u32::try_from(ranks).map_err(|_| StoreError::Relay(format!("{ranks} ranks on one relay")))?;
        let relay_error = |what: &str, e: io::Error| StoreError::Relay(format!("the store relay {what}: {e}"));
        let mut pairs = Vec::with_capacity(ranks);
        let mut ends = Vec::with_capacity(ranks);
        for _ in 0..ranks {
            let (mine, theirs) = UnixStream::pair().map_err(|e| relay_error("could not make a socket pair", e))?;
            mine.set_nonblocking(true).map_err(|e| relay_error("could not set up a socket pair", e))?;
            pairs.push(mine);
            ends.push(theirs);
        }
        let (mut stream, verdict) = connect_authenticated(&addr, addr, secret, timeout, Verify::WithFirstAnswer)?;
        let mut opens = Vec::with_capacity(ranks * (4 + SESSION_OVERHEAD));
        for session in 1..=ranks_u32 {
            opens.extend_from_slice(&protocol::session_head(protocol::OPEN_SESSION, session, 0));
        }
        let lost = |e: io::Error| StoreError::Disconnected { addr: addr.to_string(), source: e };
        stream.write_all(&opens).map_err(lost)?;
        stream.set_nonblocking(true).map_err(lost)?;
        let poll = Poll::new().map_err(|e| relay_error("could not start", e))?;
        let mut upstream = TcpStream::from_std(stream);
        poll.registry()
            .register(&mut upstream, UPSTREAM, Interest::READABLE | Interest::WRITABLE)
            .map_err(|e| relay_error("could not watch its connection", e))?;
        let mut locals = Vec::with_capacity(ranks);
        for (i, mine) in pairs.into_iter().enumerate() {
            let mut stream = MioUnixStream::from_std(mine);
            poll.registry()
                .register(&mut stream, Token(FIRST_RANK + i), Interest::READABLE | Interest::WRITABLE)
                .map_err(|e| relay_error("could not watch a rank's socket", e))?;
            locals.push(Some(Local { stream, input: Vec::new(), output: Vec::new(), written: 0, readable: true }));
        }
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(|e| relay_error("could not start", e))?);
        let stop = Arc::new(AtomicBool::new(false));
        let mut relay = Relay {
            poll,
            addr: addr.to_string(),
            secret: secret.to_vec(),
            upstream: Some(Upstream { stream: upstream, input: Vec::new(), output: Vec::new(), written: 0 }),
            verdict,
            locals,
            stop: stop.clone(),
            scratch: vec![0; 64 << 10],
        };
        let thread = std::thread::Builder::new()
            .name("cohort-store-relay".into())
            .spawn(move || relay.run())
            .map_err(|e| relay_error("could not start its thread", e))?;
        tracing::debug!(addr, ranks, "store relay started");
        Ok((StoreRelay { addr: addr.to_string(), stop, waker, thread: Some(thread) }, ends))
    }

    /// The store's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for StoreRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if self.waker.wake().is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// One rank's end, as the relay serves it.
struct Local {
    stream: MioUnixStream,
    /// Bytes read and not yet passed on as whole frames.
    input: Vec<u8>,
    /// Answers for the rank, the first `written` bytes sent.
    output: Vec<u8>,
    written: usize,
    /// A readable event came since a read found the socket empty.
    readable: bool,
}

/// The relay's connection to the store.
struct Upstream {
    stream: TcpStream,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
}

/// The relay's thread.
struct Relay {
    poll: Poll,
    addr: String,
    secret: Vec<u8>,
    /// `None` once it failed (every rank was told).
    upstream: Option<Upstream>,
    /// The store's verdict on the proof, still to come.
    verdict: Option<Unverified>,
    /// Rank `i`'s end (session `i + 1`), `None` once closed.
    locals: Vec<Option<Local>>,
    stop: Arc<AtomicBool>,
    scratch: Vec<u8>,
}

impl Relay {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut up_readable = true;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            for i in 0..self.locals.len() {
                self.read_rank(i);
            }
            if up_readable {
                up_readable = false;
                if let Err(why) = self.read_upstream() {
                    self.fail(&why);
                }
            }
            if let Some(up) = &mut self.upstream {
                if let Err(e) = flush(&mut up.stream, &mut up.output, &mut up.written) {
                    let why = format!("lost the connection to the rendezvous store at {}: {e}", self.addr);
                    self.fail(&why);
                }
            }
            for i in 0..self.locals.len() {
                if let Some(l) = &mut self.locals[i] {
                    if flush(&mut l.stream, &mut l.output, &mut l.written).is_err() {
                        self.close_rank(i);
                    }
                }
            }
            if self.upstream.is_none() && self.locals.iter().all(Option::is_none) {
                return;
            }
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() != io::ErrorKind::Interrupted {
                    self.fail(&format!("the store relay's event loop failed: {e}"));
                    return;
                }
            }
            for event in events.iter() {
                match event.token() {
                    UPSTREAM => up_readable = true,
                    WAKER => {}
                    Token(t) => {
                        if let Some(Some(l)) = self.locals.get_mut(t - FIRST_RANK) {
                            if event.is_readable() || event.is_read_closed() || event.is_error() {
                                l.readable = true;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Reads what rank `i` sent and passes each whole request upstream in
    /// its session; closes its session at end of stream.
    fn read_rank(&mut self, i: usize) {
        let Some(l) = &mut self.locals[i] else { return };
        if !l.readable {
            return;
        }
        // A failed read is the rank's end gone, as an end of stream is.
        let open = read_all(&mut l.stream, &mut l.input, &mut self.scratch).unwrap_or(false);
        l.readable = false;
        let session = i as u32 + 1;
        let mut at = 0;
        let mut too_large = None;
        while l.input.len() - at >= 4 {
            let len = u32::from_le_bytes(l.input[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len > MAX_RELAYED_FRAME {
                too_large = Some(len);
                break;
            }
            if l.input.len() - at < 4 + len {
                break;
            }
            if let Some(up) = &mut self.upstream {
                up.output.extend_from_slice(&protocol::session_head(protocol::IN_SESSION, session, len));
                up.output.extend_from_slice(&l.input[at + 4..at + 4 + len]);
            }
            at += 4 + len;
        }
        l.input.drain(..at);
        if let Some(len) = too_large {
            let why = format!("a request of {len} bytes exceeds the store relay's limit of {MAX_RELAYED_FRAME}");
            let _ = l.stream.write_all(&frame(&Response::Refused(why).encode()));
            self.close_rank(i);
        } else if !open {
            self.close_rank(i);
        }
    }

    /// Closes rank `i`'s end and its session (the store withdraws it from
    /// its barrier and sets its will).
    fn close_rank(&mut self, i: usize) {
        let Some(mut l) = self.locals[i].take() else { return };
        let _ = self.poll.registry().deregister(&mut l.stream);
        if let Some(up) = &mut self.upstream {
            up.output.extend_from_slice(&protocol::session_head(protocol::CLOSE_SESSION, i as u32 + 1, 0));
        }
        tracing::trace!(session = i + 1, "store relay: a rank's socket closed; closing its session");
    }

    /// Reads what the store sent: the verdict first, then answers, each
    /// passed to its rank. An error says why the connection is lost.
    fn read_upstream(&mut self) -> std::result::Result<(), String> {
        let Some(up) = &mut self.upstream else { return Ok(()) };
        let open = read_all(&mut up.stream, &mut up.input, &mut self.scratch)
            .map_err(|e| format!("lost the connection to the rendezvous store at {}: {e}", self.addr))?;
        let mut at = 0;
        let mut failure = None;
        while up.input.len() - at >= 4 {
            let len = u32::from_le_bytes(up.input[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len > MAX_FRAME + SESSION_OVERHEAD {
                failure = Some(format!("the store at {} sent a frame of {len} bytes", self.addr));
                break;
            }
            if up.input.len() - at < 4 + len {
                break;
            }
            let body = &up.input[at + 4..at + 4 + len];
            at += 4 + len;
            if let Some(hs) = self.verdict.take() {
                let error = match protocol::read_verdict(&self.secret, &hs.client_nonce, &hs.server_nonce, body) {
                    protocol::Verdict::Accepted => continue,
                    protocol::Verdict::Refused => StoreError::AuthRefused { addr: self.addr.clone() },
                    protocol::Verdict::NotAuthentic => StoreError::ServerNotAuthentic { addr: self.addr.clone() },
                    protocol::Verdict::Malformed => StoreError::Protocol {
                        addr: self.addr.clone(),
                        detail: "malformed answer to the handshake".into(),
                    },
                };
                failure = Some(format!("the store relay could not join the store: {error}"));
                break;
            }
            match protocol::session_answer(body) {
                Some((session, answer)) => {
                    let i = (session as usize).wrapping_sub(1);
                    // A rank that left: its answer has no one to go to.
                    if let Some(Some(l)) = self.locals.get_mut(i) {
                        l.output.extend_from_slice(&(answer.len() as u32).to_le_bytes());
                        l.output.extend_from_slice(answer);
                    }
                }
                None => {
                    let detail = match Response::decode(body) {
                        Ok(Response::Refused(message)) => message,
                        _ => "an answer outside any session".into(),
                    };
                    failure = Some(format!("the rendezvous store at {} refused the store relay: {detail}", self.addr));
                    break;
                }
            }
        }
        up.input.drain(..at);
        if let Some(why) = failure {
            return Err(why);
        }
        if !open {
            return Err(format!("the rendezvous store at {} closed the store relay's connection", self.addr));
        }
        Ok(())
    }

    /// The store's connection is lost: tells every rank why (the answer to
    /// its next or current request) and closes its end.
    fn fail(&mut self, why: &str) {
        if self.upstream.take().is_none() {
            return;
        }
        tracing::warn!("{why}; the node's ranks are cut off from the store");
        let refusal = frame(&Response::Refused(why.to_string()).encode());
        for slot in &mut self.locals {
            if let Some(mut l) = slot.take() {
                let _ = flush(&mut l.stream, &mut l.output, &mut l.written);
                let _ = l.stream.write_all(&refusal);
                let _ = self.poll.registry().deregister(&mut l.stream);
            }
        }
    }
}

/// A frame (length prefix and body).
fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Reads what a non-blocking socket holds into `input`; `Ok(false)` at end
/// of stream.
fn read_all(stream: &mut impl Read, input: &mut Vec<u8>, scratch: &mut [u8]) -> io::Result<bool> {
    loop {
        match stream.read(scratch) {
            Ok(0) => return Ok(false),
            Ok(n) => input.extend_from_slice(&scratch[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Writes what a non-blocking socket takes of `output` from `written`;
/// empties the buffer once it is all written.
fn flush(stream: &mut impl Write, output: &mut Vec<u8>, written: &mut usize) -> io::Result<()> {
    while *written < output.len() {
        match stream.write(&output[*written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    output.clear();
    *written = 0;
    Ok(())
}
