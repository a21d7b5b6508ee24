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
//! or was killed), or the launcher saying its process exited
//! ([`StoreRelay::rank_exited`]), closes its session, so the store
//! withdraws it from its barrier and sets its will, as for a rank connected
//! directly. A rank that only shuts its writing side may still read: its
//! requests keep to the limits below, and its session is closed once they
//! are all answered and the answers written. When the store's connection
//! fails, every rank gets a refusal naming the store (behind the answers
//! it has not read) and its end is closed: its next call fails at once
//! instead of hanging.
//!
//! One thread serves the relay with non-blocking sockets (mio). It holds
//! little for any rank: at most [`MAX_RELAY_HELD`] bytes of answers. The
//! store's connection is shared, so its answers are always read (a rank
//! that does not read must not stall its neighbours' answers behind its
//! own): instead a rank's request is passed to the store only when the
//! largest answer it may bring fits the rank's budget beside the answers
//! it leaves unread and those still coming ([`RANK_BUDGET`]; one request
//! alone always goes). The relay also stops reading a rank that has
//! [`MAX_IN_FLIGHT`] requests unanswered, and every rank while
//! [`UPSTREAM_BACKLOG`] bytes wait for the store, and reads [`READ_TURN`]
//! bytes of one rank per turn; the kernel holds the rest, so a rank that
//! writes without reading blocks while its neighbours are served.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpStream, UnixStream as MioUnixStream};
use mio::{Events, Interest, Poll, Token, Waker};

use parking_lot::Mutex;

use super::client::{connect_authenticated, Verify};
use super::error::{Result, StoreError};
use super::protocol::{self, Response, MAX_FRAME, SESSION_OVERHEAD};

const UPSTREAM: Token = Token(0);
const WAKER: Token = Token(1);
/// The first rank's token (its session is 1).
const FIRST_RANK: usize = 2;

/// Largest request frame a rank may send through the relay: one that still
/// fits a frame once tagged with its session.
pub const MAX_RELAYED_FRAME: usize = MAX_FRAME - SESSION_OVERHEAD;

/// The longest one try at joining the store may take (connecting, the
/// greeting, the verdict) before the relay gives it up and connects again,
/// while its time lasts: a store that stalls (stopped, swapping) is joined
/// once it answers, and a relay dropped while it joins stops within this.
const JOIN_TRY: Duration = Duration::from_secs(10);

/// The longest pause between two tries at joining the store.
const JOIN_BACKOFF_MAX: Duration = Duration::from_millis(100);

/// How long a stopping relay waits to pass on the whole requests of ranks
/// that exited ([`StoreRelay::rank_exited`]) before it closes its
/// connection.
const STOP_FLUSH: Duration = Duration::from_secs(1);

/// Bytes the relay holds for the store, unwritten, before it stops reading
/// the ranks (the kernel holds what they send meanwhile).
const UPSTREAM_BACKLOG: usize = 1 << 20;

/// Bytes of answers the relay may hold for one rank, counting the answers
/// it has not written to the rank yet and, at their largest
/// ([`protocol::answer_bound`]), those still to come from the store. A
/// request whose answer would not fit waits (in the relay, then in the
/// kernel) until the rank reads; one request alone, with nothing held or
/// coming for its rank, always goes, however large its answer may be.
/// Requests whose answers are small (set, add, wait, barrier, append, ...)
/// go many at a time; those that answer values (get, multi-get,
/// compare-set, barrier-get) one at a time.
const RANK_BUDGET: usize = 1 << 20;

/// The most bytes of answers the relay holds for one rank's end at once
/// (plus a refusal of its own of a few hundred bytes): `RANK_BUDGET` (1 MiB), or
/// one answer of the largest frame. A rank that asks for large values on
/// an end and never reads them costs its node's launcher no more than this
/// for that end; the budget is each end's, so a process given several ends
/// (`cohort run` gives each rank three) may make the relay hold this once
/// per end (measured: 180 MiB for three unread gets of a 60 MiB value on
/// three ends).
pub const MAX_RELAY_HELD: usize = if RANK_BUDGET > 4 + MAX_FRAME { RANK_BUDGET } else { 4 + MAX_FRAME };

/// Bytes read from one rank per turn of the relay's loop (more when one
/// frame is larger), so that a rank that writes without pause shares the
/// thread with the others.
const READ_TURN: usize = 64 << 10;
/// The most an exiting rank's end is read before it is closed (a socket's
/// buffer holds less).
const EXIT_READ_MAX: usize = 16 << 20;

/// A node relay of the rendezvous store: one thread, one connection to the
/// store, one socket pair per local rank. Dropping it stops the thread,
/// which first passes on the whole requests of ranks that exited (waiting up
/// to a second for its connection to take them), then closes the
/// connection (the store then sets the wills of the sessions still open)
/// and the ranks' ends. A relay dropped while it still joins the store
/// ([`StoreRelay::spawn`]) returns at once; its thread stops at the end of
/// the try under way (at most 10 s).
pub struct StoreRelay {
    addr: String,
    stop: Arc<AtomicBool>,
    /// Ends whose rank exited, for the thread to close.
    exited: Arc<Mutex<Vec<usize>>>,
    /// The most bytes of answers held for one rank at once so far.
    peak_held: Arc<AtomicUsize>,
    waker: Arc<Waker>,
    /// The thread is past joining the store ([`StoreRelay::spawn`]'s may
    /// still be in its handshake: dropping the relay then does not wait).
    joined: Arc<AtomicBool>,
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
    /// each child inherits. Waits for the store's verdict on the proof (one
    /// round trip); a connection the store drops before its verdict (it
    /// sheds handshakes when too many clients are in one), or that gets no
    /// answer within 10 s, is made again until `timeout` passes.
    /// Fails when the store cannot be reached within `timeout`, keeps
    /// dropping the connection ([`StoreError::HandshakeDropped`]) or does not
    /// answer ([`StoreError::Unresponsive`]), and at once when its host name
    /// does not resolve ([`StoreError::Unresolvable`]); a store that refuses the secret
    /// (or cannot prove it holds it) is reported to every rank as the answer
    /// to its first request. [`StoreRelay::spawn`] returns without waiting.
    pub fn start(
        addr: &str,
        secret: impl AsRef<[u8]>,
        ranks: usize,
        timeout: Duration,
    ) -> Result<(StoreRelay, Vec<UnixStream>)> {
        let secret = secret.as_ref();
        let (mut relay, ends, opens) = Relay::prepare(addr, secret, ranks)?;
        let joined = join_store(addr, secret, timeout, &opens, &AtomicBool::new(false))?;
        relay.attach(joined)?;
        let handle = relay.handle(Arc::new(AtomicBool::new(true)));
        let thread = std::thread::Builder::new()
            .name("cohort-store-relay".into())
            .spawn(move || relay.run())
            .map_err(|e| relay_error("could not start its thread", e))?;
        tracing::debug!(addr, ranks, "store relay started");
        Ok((handle.with_thread(thread), ends))
    }

    /// [`StoreRelay::start`] without waiting for the store: returns the
    /// relay and the ranks' ends at once, and the relay's thread connects
    /// to the store and proves the secret (as `start` does, the same
    /// retries) before it reads the ranks' requests, which wait in their
    /// sockets meanwhile. A launcher hands the ends to its ranks while the
    /// relay's handshake is under way. When the store cannot be joined
    /// within `timeout` (or refuses the secret), every rank gets a refusal
    /// saying why as the answer to its first request, and its end is
    /// closed. Fails (before anything starts) on an empty secret, more ranks
    /// than sessions can number, or when the socket pairs, their poll or the
    /// thread cannot be made.
    pub fn spawn(
        addr: &str,
        secret: impl AsRef<[u8]>,
        ranks: usize,
        timeout: Duration,
    ) -> Result<(StoreRelay, Vec<UnixStream>)> {
        let (unjoined, ends) = StoreRelay::prepare(addr, secret, ranks)?;
        Ok((unjoined.join(timeout)?, ends))
    }

    /// The first half of [`StoreRelay::spawn`]: makes the ranks' socket
    /// pairs and returns their ends, and a relay that has not joined the
    /// store yet ([`UnjoinedRelay::join`] starts it). Requests the ranks
    /// send meanwhile wait in their sockets. Fails when the secret is empty
    /// or the socket pairs cannot be made.
    pub fn prepare(addr: &str, secret: impl AsRef<[u8]>, ranks: usize) -> Result<(UnjoinedRelay, Vec<UnixStream>)> {
        let secret = secret.as_ref().to_vec();
        let (relay, ends, opens) = Relay::prepare(addr, &secret, ranks)?;
        Ok((UnjoinedRelay { relay, secret, opens, ranks }, ends))
    }

    /// The store's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Says that the process given `ends` (indices into the ends
    /// [`StoreRelay::start`] or [`StoreRelay::spawn`] returned) exited: the relay passes on the
    /// whole requests it had sent, then closes those ends and their
    /// sessions (the store withdraws them from their barriers and sets
    /// their wills), without waiting for the ends to close. A process the
    /// rank started (or one it forked) may still hold its socket open, so
    /// the end of stream alone could come late or never. Returns at once;
    /// the relay's thread does the rest. Ends already closed, or out of
    /// range, are ignored.
    pub fn rank_exited(&self, ends: std::ops::Range<usize>) {
        self.exited.lock().extend(ends);
        let _ = self.waker.wake();
    }

    /// The most bytes of answers the relay has held at once for any one
    /// of its ranks since it started (written to no rank yet, or partly):
    /// at most [`MAX_RELAY_HELD`]. Does not wait.
    pub fn peak_held(&self) -> usize {
        self.peak_held.load(Ordering::Relaxed)
    }
}

fn relay_error(what: &str, e: io::Error) -> StoreError {
    StoreError::Relay(format!("the store relay {what}: {e}"))
}

/// Connects to the store, proves `secret`, sends `opens` behind the proof
/// and reads the verdict. Returns the connection and, when the store
/// refused the proof (or could not prove its own), why. A try that the
/// store drops before its verdict (the store ran nothing sent behind the
/// proof: it sheds handshakes when too many clients are in one), or that
/// gets no answer within [`JOIN_TRY`], is made again until `timeout`
/// passes; so is a store not reachable yet. Gives up early when `stop` is
/// set (checked between tries).
fn join_store(
    addr: &str,
    secret: &[u8],
    timeout: Duration,
    opens: &[u8],
    stop: &AtomicBool,
) -> Result<(std::net::TcpStream, Option<String>)> {
    let deadline = Instant::now() + timeout;
    let mut tries = 0u32;
    let mut backoff = Duration::from_millis(1);
    loop {
        if stop.load(Ordering::SeqCst) {
            return Err(StoreError::Relay("the store relay was stopped before it joined the store".into()));
        }
        tries += 1;
        let this_try = deadline.saturating_duration_since(Instant::now()).min(JOIN_TRY);
        let again = match try_join(addr, secret, this_try, opens) {
            Ok(joined) => return Ok(joined),
            Err(JoinAttempt::Fatal(e)) => return Err(e),
            Err(JoinAttempt::Again(e)) => e,
        };
        if Instant::now() >= deadline {
            return Err(match again {
                JoinFailure::Dropped => StoreError::HandshakeDropped { addr: addr.to_string(), tries },
                JoinFailure::Unresponsive => StoreError::Unresponsive { addr: addr.to_string(), waited: timeout },
                JoinFailure::Unreachable(e) => e,
            });
        }
        tracing::debug!(addr, tries, failure = ?again, "the store relay could not join the store yet; trying again");
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(JOIN_BACKOFF_MAX);
    }
}

/// Why one try at joining the store is worth another.
#[derive(Debug)]
enum JoinFailure {
    /// The store closed the connection before its verdict.
    Dropped,
    /// No greeting or verdict within the try's time.
    Unresponsive,
    /// The store could not be reached within the try's time.
    Unreachable(StoreError),
}

enum JoinAttempt {
    Again(JoinFailure),
    Fatal(StoreError),
}

/// One try of [`join_store`], within `within`.
fn try_join(
    addr: &str,
    secret: &[u8],
    within: Duration,
    opens: &[u8],
) -> std::result::Result<(std::net::TcpStream, Option<String>), JoinAttempt> {
    // The opens go in the proof's write.
    let (mut stream, nonces) = match connect_authenticated(&addr, addr, secret, within, Verify::WithFirstAnswer, opens)
    {
        Ok(connected) => connected,
        Err(e @ StoreError::Connect { .. }) => return Err(JoinAttempt::Again(JoinFailure::Unreachable(e))),
        Err(e) => return Err(JoinAttempt::Fatal(e)),
    };
    let hs = nonces.expect("the verdict is left to read");
    // At least a moment for the verdict, however little of the try is left.
    let by = (Instant::now() + within).max(Instant::now() + Duration::from_millis(50));
    let error = match protocol::read_frame_by(&mut stream, protocol::PREAUTH_MAX_FRAME, by) {
        Ok(body) => {
            let verdict = protocol::read_verdict(secret, &hs.client_nonce, &hs.server_nonce, &body);
            match super::client::verdict_result(verdict, addr) {
                Ok(()) => {
                    stream
                        .set_read_timeout(None)
                        .map_err(|e| JoinAttempt::Fatal(StoreError::Disconnected { addr: addr.into(), source: e }))?;
                    return Ok((stream, None));
                }
                Err(refused) => refused,
            }
        }
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            StoreError::Protocol { addr: addr.to_string(), detail: e.to_string() }
        }
        Err(e) if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) => {
            return Err(JoinAttempt::Again(JoinFailure::Unresponsive));
        }
        Err(e) if !super::client::dropped(&e) => {
            return Err(JoinAttempt::Fatal(StoreError::Disconnected { addr: addr.to_string(), source: e }));
        }
        Err(_) => return Err(JoinAttempt::Again(JoinFailure::Dropped)),
    };
    Ok((stream, Some(format!("the store relay could not join the store: {error}"))))
}

/// A node relay whose ranks' ends exist ([`StoreRelay::prepare`]) but
/// that has not joined the store: dropping it closes this side of the
/// ranks' sockets.
pub struct UnjoinedRelay {
    relay: Relay,
    secret: Vec<u8>,
    opens: Vec<u8>,
    ranks: usize,
}

impl std::fmt::Debug for UnjoinedRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnjoinedRelay").field("addr", &self.relay.addr).field("ranks", &self.ranks).finish()
    }
}

impl UnjoinedRelay {
    /// Starts the relay's thread, which joins the store (as
    /// [`StoreRelay::spawn`] says: the same retries until `timeout`, and a
    /// store it cannot join is each rank's first answer) and then relays.
    /// Returns at once; fails only when the thread cannot be made.
    pub fn join(self, timeout: Duration) -> Result<StoreRelay> {
        let UnjoinedRelay { mut relay, secret, opens, ranks } = self;
        let joined = Arc::new(AtomicBool::new(false));
        let handle = relay.handle(joined.clone());
        let at = relay.addr.clone();
        let stop = relay.stop.clone();
        let thread = std::thread::Builder::new()
            .name("cohort-store-relay".into())
            .spawn(move || {
                let attached = join_store(&at, &secret, timeout, &opens, &stop).and_then(|j| relay.attach(j));
                joined.store(true, Ordering::SeqCst);
                if let Err(e) = attached {
                    relay.fail_ranks(&format!("the store relay could not join the store: {e}"));
                }
                relay.run()
            })
            .map_err(|e| relay_error("could not start its thread", e))?;
        tracing::debug!(addr = %handle.addr, ranks, "store relay spawned");
        Ok(handle.with_thread(thread))
    }
}

impl StoreRelay {
    fn with_thread(mut self, thread: JoinHandle<()>) -> StoreRelay {
        self.thread = Some(thread);
        self
    }
}

impl Drop for StoreRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // A thread still joining the store stops once it is done (it checks
        // `stop` first thing in its loop); not waited for.
        if self.joined.load(Ordering::SeqCst) && self.waker.wake().is_ok() {
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
    /// Answers for the rank, the first `written` bytes sent (all of it
    /// held until it is all written).
    output: Vec<u8>,
    written: usize,
    /// A readable event came since a read found the socket empty (or a
    /// read stopped at its turn's limit).
    readable: bool,
    /// The largest answer of each request passed to the store whose answer
    /// has not come back, in order.
    expected: VecDeque<usize>,
    /// Their sum.
    expected_bytes: usize,
    /// Why its last frame is refused (over the relay's limit): written
    /// behind the answers to the requests in flight, once they are all
    /// here; nothing more is read from the rank.
    refusal: Option<String>,
    /// Its session is closed (or the store lost) and its last answer
    /// queued: the end is closed once `output` is written.
    draining: bool,
    /// Its peer is closed (every process that held the rank's socket is
    /// gone) or the socket failed: no one can read its answers, so it is
    /// served as a rank that exited (read to the end, limits or not, and
    /// closed). A peer that only shut its writing side is not gone: it may
    /// still read, so its requests keep to the limits.
    gone: bool,
    /// Its end of stream was read: nothing more comes; the end and its
    /// session are closed once every whole request it sent is answered and
    /// the answers written.
    ended: bool,
}

impl Local {
    fn new(stream: MioUnixStream) -> Local {
        Local {
            stream,
            input: Vec::new(),
            output: Vec::new(),
            written: 0,
            // Registering a socket reports what it already holds; read it anyway.
            readable: true,
            expected: VecDeque::new(),
            expected_bytes: 0,
            refusal: None,
            draining: false,
            gone: false,
            ended: false,
        }
    }

    /// Requests passed to the store whose answers have not come back.
    fn in_flight(&self) -> usize {
        self.expected.len()
    }

    /// Whether a request whose answer takes at most `answer` bytes may go
    /// to the store now: it fits [`RANK_BUDGET`] beside what the relay
    /// holds and expects for the rank, or the relay holds and expects
    /// nothing for it.
    fn admits(&self, answer: usize) -> bool {
        (self.output.is_empty() && self.expected.is_empty())
            || self.output.len() + self.expected_bytes + answer <= RANK_BUDGET
    }

    /// Notes that a request whose answer takes at most `answer` bytes went
    /// to the store.
    fn expect(&mut self, answer: usize) {
        self.expected.push_back(answer);
        self.expected_bytes += answer;
    }

    /// Takes the answer `answer` (its frame's body) to the oldest request
    /// in flight, to be written to the rank.
    fn answered(&mut self, answer: &[u8]) {
        self.output.extend_from_slice(&(answer.len() as u32).to_le_bytes());
        self.output.extend_from_slice(answer);
        if let Some(bound) = self.expected.pop_front() {
            self.expected_bytes -= bound;
        }
    }

    /// Whether the relay takes requests from the rank now: not while the
    /// answer of the whole request it has read would not fit its budget
    /// ([`Local::admits`]), or it has [`MAX_IN_FLIGHT`] requests
    /// unanswered, nor while [`UPSTREAM_BACKLOG`] bytes wait for the store
    /// (`upstream` of them do now). The kernel holds what it sends
    /// meanwhile, and its writes block.
    fn takes_requests(&self, upstream: usize) -> bool {
        self.refusal.is_none()
            && !self.draining
            && self.in_flight() < MAX_IN_FLIGHT
            && upstream <= UPSTREAM_BACKLOG
            && head_frame(&self.input).is_none_or(|body| self.admits(protocol::answer_bound(body)))
    }

    /// Whether its end may close: its end of stream was read, and every
    /// whole request it sent was answered and the answers written (a
    /// partial frame left at the end is no request).
    fn done(&self) -> bool {
        self.ended && !whole_frame(&self.input) && self.expected.is_empty() && self.output.is_empty()
    }

    /// Whether a turn of the loop can do something for it now without an
    /// event: bytes left in its socket, or a whole frame left unpassed.
    fn has_work(&self, upstream: usize) -> bool {
        if self.draining || self.refusal.is_some() {
            return false;
        }
        (self.gone && self.readable) || (self.takes_requests(upstream) && (self.readable || whole_frame(&self.input)))
    }
}

/// Requests a rank may have unanswered through the relay (a `StoreClient`
/// has one; a pipelined batch a few).
const MAX_IN_FLIGHT: usize = 64;

/// The body of the whole frame at the head of `input`, if it is all here
/// (and not over the limit).
fn head_frame(input: &[u8]) -> Option<&[u8]> {
    let end = frame_end(input, MAX_RELAYED_FRAME);
    (end > 0 && input.len() >= end).then(|| &input[4..end])
}

/// Whether `input` starts with a whole frame (or a length over the limit).
fn whole_frame(input: &[u8]) -> bool {
    input.len() >= 4 && {
        let len = u32::from_le_bytes(input[..4].try_into().expect("4 bytes")) as usize;
        len > MAX_RELAYED_FRAME || input.len() >= 4 + len
    }
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
    /// `None` once it failed (every rank was told).
    upstream: Option<Upstream>,
    /// Rank `i`'s end (session `i + 1`), `None` once closed.
    locals: Vec<Option<Local>>,
    stop: Arc<AtomicBool>,
    /// Ends whose process exited (see [`StoreRelay::rank_exited`]).
    exited: Arc<Mutex<Vec<usize>>>,
    /// See [`StoreRelay::peak_held`].
    peak_held: Arc<AtomicUsize>,
    /// Wakes the thread's poll (kept for the handle).
    waker: Arc<Waker>,
    scratch: Vec<u8>,
}

impl Relay {
    /// Everything but the store's connection: the ranks' socket pairs
    /// (their ends returned, in order), the event loop watching this side
    /// of each, and the frames that open one session per rank.
    fn prepare(addr: &str, secret: &[u8], ranks: usize) -> Result<(Relay, Vec<UnixStream>, Vec<u8>)> {
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let ranks_u32 = u32::try_from(ranks).map_err(|_| StoreError::Relay(format!("{ranks} ranks on one relay")))?;
        // The socket pairs, the poll, its waker and the store's connection
        // in a table grown once (a larger node would grow it several times,
        // each a wait in a process of several threads).
        if let Err(e) = super::reserve_descriptors(2 * ranks + 8) {
            tracing::debug!(error = %e, "could not grow the descriptor table for the relay's sockets");
        }
        let mut pairs = Vec::with_capacity(ranks);
        let mut ends = Vec::with_capacity(ranks);
        for _ in 0..ranks {
            let (mine, theirs) = UnixStream::pair().map_err(|e| relay_error("could not make a socket pair", e))?;
            mine.set_nonblocking(true).map_err(|e| relay_error("could not set up a socket pair", e))?;
            pairs.push(mine);
            ends.push(theirs);
        }
        let mut opens = Vec::with_capacity(ranks * (4 + SESSION_OVERHEAD));
        for session in 1..=ranks_u32 {
            opens.extend_from_slice(&protocol::session_head(protocol::OPEN_SESSION, session, 0));
        }
        let poll = Poll::new().map_err(|e| relay_error("could not start", e))?;
        let mut locals = Vec::with_capacity(ranks);
        for (i, mine) in pairs.into_iter().enumerate() {
            let mut stream = MioUnixStream::from_std(mine);
            poll.registry()
                .register(&mut stream, Token(FIRST_RANK + i), Interest::READABLE | Interest::WRITABLE)
                .map_err(|e| relay_error("could not watch a rank's socket", e))?;
            locals.push(Some(Local::new(stream)));
        }
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(|e| relay_error("could not start", e))?);
        let relay = Relay {
            poll,
            addr: addr.to_string(),
            upstream: None,
            locals,
            stop: Arc::new(AtomicBool::new(false)),
            exited: Arc::new(Mutex::new(Vec::new())),
            peak_held: Arc::new(AtomicUsize::new(0)),
            waker,
            scratch: vec![0; READ_TURN],
        };
        Ok((relay, ends, opens))
    }

    /// Takes the store's connection that [`join_store`] made; when the
    /// store refused the proof, every rank's first request is answered with
    /// the refusal.
    fn attach(&mut self, (stream, refused): (std::net::TcpStream, Option<String>)) -> Result<()> {
        let lost = |e: io::Error| StoreError::Disconnected { addr: self.addr.clone(), source: e };
        stream.set_nonblocking(true).map_err(lost)?;
        let mut upstream = TcpStream::from_std(stream);
        self.poll
            .registry()
            .register(&mut upstream, UPSTREAM, Interest::READABLE | Interest::WRITABLE)
            .map_err(|e| relay_error("could not watch its connection", e))?;
        self.upstream = Some(Upstream { stream: upstream, input: Vec::new(), output: Vec::new(), written: 0 });
        if let Some(why) = refused {
            self.fail(&why);
        }
        Ok(())
    }

    /// The handle the launcher keeps; `joined` says whether the thread is
    /// past joining the store (until then dropping the handle does not
    /// wait for it).
    fn handle(&self, joined: Arc<AtomicBool>) -> StoreRelay {
        StoreRelay {
            addr: self.addr.clone(),
            stop: self.stop.clone(),
            exited: self.exited.clone(),
            peak_held: self.peak_held.clone(),
            waker: self.waker.clone(),
            joined,
            thread: None,
        }
    }

    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut up_readable = true;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                // What ranks that exited had sent still reaches the store.
                self.close_exited();
                self.flush_before_stop();
                return;
            }
            self.close_exited();
            for i in 0..self.locals.len() {
                self.pass_requests(i, false);
            }
            if up_readable {
                up_readable = false;
                if let Err(why) = self.read_upstream() {
                    self.fail(&why);
                }
            }
            for i in 0..self.locals.len() {
                self.refuse_when_answered(i);
            }
            if let Some(up) = &mut self.upstream {
                if let Err(e) = flush(&mut up.stream, &mut up.output, &mut up.written) {
                    let why = format!("lost the connection to the rendezvous store at {}: {e}", self.addr);
                    self.fail(&why);
                }
            }
            for i in 0..self.locals.len() {
                if let Some(l) = &mut self.locals[i] {
                    let failed = flush(&mut l.stream, &mut l.output, &mut l.written).is_err();
                    if failed || (l.draining && l.output.is_empty()) || l.done() {
                        self.close_rank(i);
                    }
                }
            }
            if self.upstream.is_none() && self.locals.iter().all(Option::is_none) {
                return;
            }
            // A rank whose turn ended with bytes still to read is served
            // again at once, after the others.
            let backlog = self.upstream_backlog();
            let again = self.locals.iter().flatten().any(|l| l.has_work(backlog));
            if let Err(e) = self.poll.poll(&mut events, again.then_some(Duration::ZERO)) {
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
                            if event.is_write_closed() || event.is_error() {
                                l.gone = true;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Passes on the whole requests of the ranks that exited
    /// ([`StoreRelay::rank_exited`]), then closes their ends and sessions.
    fn close_exited(&mut self) {
        let exited = std::mem::take(&mut *self.exited.lock());
        for i in exited {
            if self.locals.get(i).is_some_and(Option::is_some) {
                self.pass_requests(i, true);
                self.close_rank(i);
            }
        }
    }

    /// Writes what is left for the store before the relay stops, waiting
    /// up to [`STOP_FLUSH`] for the socket to take it.
    fn flush_before_stop(&mut self) {
        let until = Instant::now() + STOP_FLUSH;
        let mut events = Events::with_capacity(8);
        while let Some(up) = &mut self.upstream {
            if flush(&mut up.stream, &mut up.output, &mut up.written).is_err() || up.written >= up.output.len() {
                return;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let _ = self.poll.poll(&mut events, Some(left.min(Duration::from_millis(10))));
        }
    }

    /// Bytes waiting to be written to the store.
    fn upstream_backlog(&self) -> usize {
        self.upstream.as_ref().map_or(0, |up| up.output.len() - up.written)
    }

    /// Reads what rank `i` sent (one turn's worth) and passes its whole
    /// requests upstream in its session, while it [takes
    /// requests](Local::takes_requests), and refuses a frame over
    /// [`MAX_RELAYED_FRAME`]; an end of stream read is noted (the end is
    /// closed once its requests are answered: [`Local::done`]). With
    /// `exiting` (its process exited, or its peer is [gone](Local::gone):
    /// no one can read its answers), reads a turn's worth even without an
    /// event and passes every whole request, whatever the limits, and
    /// closes its session at end of stream. A peer that only shut its
    /// writing side keeps to the limits: it may still read its answers.
    fn pass_requests(&mut self, i: usize, exiting: bool) {
        let backlog = self.upstream_backlog();
        let Some(l) = &mut self.locals[i] else { return };
        if l.draining || l.refusal.is_some() {
            return;
        }
        let mut exiting = exiting || l.gone;
        if !exiting && !l.takes_requests(backlog) {
            return;
        }
        if (l.readable || exiting) && !l.ended {
            // A failed read is the rank's end gone. An exiting rank's end is
            // read to what its socket holds (its whole requests are passed
            // on before it is closed), up to EXIT_READ_MAX.
            loop {
                let limit = match exiting {
                    true => l.input.len() + READ_TURN,
                    false => READ_TURN.max(frame_end(&l.input, MAX_RELAYED_FRAME)),
                };
                match read_some(&mut l.stream, &mut l.input, &mut self.scratch, limit) {
                    Ok(Some(more)) => {
                        l.readable = more;
                        if !(exiting && more && l.input.len() < EXIT_READ_MAX) {
                            break;
                        }
                    }
                    Ok(None) => {
                        l.ended = true;
                        l.readable = false;
                        break;
                    }
                    Err(_) => {
                        (l.ended, l.gone, l.readable, exiting) = (true, true, false, true);
                        break;
                    }
                }
            }
        }
        let session = i as u32 + 1;
        let mut at = 0;
        let mut too_large = None;
        let mut sent = 0;
        while l.input.len() - at >= 4 {
            let len = u32::from_le_bytes(l.input[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len > MAX_RELAYED_FRAME {
                too_large = Some(len);
                break;
            }
            if l.input.len() - at < 4 + len {
                break;
            }
            let Some(up) = &mut self.upstream else { break };
            let body = &l.input[at + 4..at + 4 + len];
            let answer = protocol::answer_bound(body);
            if !exiting
                && (l.in_flight() >= MAX_IN_FLIGHT
                    || up.output.len() - up.written > UPSTREAM_BACKLOG
                    || !l.admits(answer))
            {
                break;
            }
            up.output.extend_from_slice(&protocol::session_head(protocol::IN_SESSION, session, len));
            up.output.extend_from_slice(body);
            l.expect(answer);
            sent += 1;
            at += 4 + len;
        }
        l.input.drain(..at);
        release_if_large(&mut l.input);
        let close = exiting && l.ended;
        if let Some(len) = too_large {
            tracing::debug!(session, len, sent, "store relay: a rank's frame is over the limit; refusing it");
            l.refusal =
                Some(format!("a request of {len} bytes exceeds the store relay's limit of {MAX_RELAYED_FRAME}"));
            l.input = Vec::new();
            l.readable = false;
        } else if close {
            self.close_rank(i);
        }
    }

    /// Once every request rank `i` had in flight is answered, queues its
    /// refusal (if it has one) behind those answers and closes its session;
    /// its end is closed once the refusal is written.
    fn refuse_when_answered(&mut self, i: usize) {
        let Some(l) = &mut self.locals[i] else { return };
        if l.in_flight() > 0 {
            return;
        }
        let Some(why) = l.refusal.take() else { return };
        l.output.extend_from_slice(&frame(&Response::Refused(why).encode()));
        l.draining = true;
        if let Some(up) = &mut self.upstream {
            up.output.extend_from_slice(&protocol::session_head(protocol::CLOSE_SESSION, i as u32 + 1, 0));
        }
    }

    /// Closes rank `i`'s end and its session, unless closed already (the
    /// store withdraws it from its barrier and sets its will).
    fn close_rank(&mut self, i: usize) {
        let Some(mut l) = self.locals[i].take() else { return };
        let _ = self.poll.registry().deregister(&mut l.stream);
        if l.draining {
            return;
        }
        if let Some(up) = &mut self.upstream {
            up.output.extend_from_slice(&protocol::session_head(protocol::CLOSE_SESSION, i as u32 + 1, 0));
        }
        tracing::trace!(
            session = i + 1,
            "store relay: a rank's socket closed or its process exited; closing its session"
        );
    }

    /// Reads what the store sent and passes each answer to its rank, a
    /// turn's worth (or the rest of one frame, when larger) at a time: the
    /// relay holds at most one answer in the making, whatever the store has
    /// sent (the answers of a rank that left, dropped, arrive as fast as
    /// the store writes them). An error says why the connection is lost.
    fn read_upstream(&mut self) -> std::result::Result<(), String> {
        loop {
            let Some(up) = &mut self.upstream else { return Ok(()) };
            let limit = READ_TURN.max(frame_end(&up.input, MAX_FRAME + SESSION_OVERHEAD));
            let more = read_some(&mut up.stream, &mut up.input, &mut self.scratch, limit)
                .map_err(|e| format!("lost the connection to the rendezvous store at {}: {e}", self.addr))?;
            self.pass_answers()?;
            match more {
                Some(true) => {}
                Some(false) => return Ok(()),
                None => {
                    return Err(format!("the rendezvous store at {} closed the store relay's connection", self.addr))
                }
            }
        }
    }

    /// Passes each whole answer the store's connection has read to its
    /// rank. An error says why the connection is lost.
    fn pass_answers(&mut self) -> std::result::Result<(), String> {
        let Some(up) = &mut self.upstream else { return Ok(()) };
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
            match protocol::session_answer(body) {
                Some((session, answer)) => {
                    let i = (session as usize).wrapping_sub(1);
                    // A rank that left: its answer has no one to go to.
                    if let Some(Some(l)) = self.locals.get_mut(i) {
                        if !l.draining {
                            l.answered(answer);
                            self.peak_held.fetch_max(l.output.len(), Ordering::Relaxed);
                        }
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
        release_if_large(&mut up.input);
        failure.map_or(Ok(()), Err)
    }

    /// The store's connection is lost: tells every rank why (the answer to
    /// its next or current request, queued behind the answers it has not
    /// read) and closes its end once that is written.
    fn fail(&mut self, why: &str) {
        if self.upstream.take().is_none() {
            return;
        }
        self.fail_ranks(why);
    }

    /// Tells every rank `why` it is cut off from the store (the answer to
    /// its next or current request, behind the answers it has not read)
    /// and closes its end once that is written.
    fn fail_ranks(&mut self, why: &str) {
        tracing::warn!("{why}; the node's ranks are cut off from the store");
        let refusal = frame(&Response::Refused(why.to_string()).encode());
        for l in self.locals.iter_mut().flatten() {
            if !l.draining {
                l.output.extend_from_slice(&refusal);
                l.draining = true;
                l.refusal = None;
                l.input = Vec::new();
            }
        }
    }
}

/// Where the frame at the head of `input` ends (0 while its length is not
/// all here, or is over `max`).
fn frame_end(input: &[u8], max: usize) -> usize {
    if input.len() < 4 {
        return 0;
    }
    let len = u32::from_le_bytes(input[..4].try_into().expect("4 bytes")) as usize;
    if len > max {
        0
    } else {
        4 + len
    }
}

/// A frame (length prefix and body).
fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Reads what a non-blocking socket holds into `input`, until `input`
/// holds `limit` bytes: `Some(true)` when it stopped at the limit (more may
/// be waiting), `Some(false)` once the socket is empty, `None` at end of
/// stream.
fn read_some(
    stream: &mut impl Read,
    input: &mut Vec<u8>,
    scratch: &mut [u8],
    limit: usize,
) -> io::Result<Option<bool>> {
    loop {
        if input.len() >= limit {
            return Ok(Some(true));
        }
        let n = scratch.len().min(limit - input.len());
        match stream.read(&mut scratch[..n]) {
            Ok(0) => return Ok(None),
            Ok(k) => input.extend_from_slice(&scratch[..k]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Some(false)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Writes what a non-blocking socket takes of `output` from `written`;
/// empties the buffer once it is all written (and gives back its memory
/// when a large answer grew it).
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
    release_if_large(output);
    Ok(())
}

/// Gives back the memory of `buf` when it is empty and a large frame grew
/// it past [`RANK_BUDGET`] (an idle buffer keeps less).
fn release_if_large(buf: &mut Vec<u8>) {
    if buf.is_empty() && buf.capacity() > RANK_BUDGET {
        *buf = Vec::new();
    }
}
