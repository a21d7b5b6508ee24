//! [`StoreServer`]: serves the key table over TCP from a few event-loop
//! threads, whatever the number of clients.
//!
//! Every socket is non-blocking and watched by a `mio` poll. One thread
//! only accepts connections and hands each to one of a few worker threads
//! (one per two cores, at most [`MAX_WORKERS`]), which runs its handshake
//! (greeting, challenge–response over HMAC) and, once the client proved the
//! secret, serves its requests: thousands of ranks connecting at once have
//! their handshakes spread over the workers. A request that must
//! wait (`wait`, `barrier`) is recorded in the table and costs no thread;
//! its answer is written when the request that completes it arrives (the
//! worker that applied that request passes the answers to the workers of
//! the waiting clients), or when its deadline passes (each worker keeps one
//! timer per blocked request). Answering the same large value to thousands
//! of clients (the directory at a barrier) shares one copy of it, and the
//! workers write it to their sockets in parallel. A client that closes its
//! connection while it waits is seen at once (its socket turns readable at
//! end of stream): it is withdrawn from its barrier and its will is set.
//!
//! Before a client proves the secret it costs the server little and not for
//! long: its frames may hold at most [`protocol::PREAUTH_MAX_FRAME`] bytes,
//! the whole handshake has one deadline (not one per read, which a client
//! sending a byte a second would never hit), and at most
//! [`MAX_UNAUTHENTICATED`] connections may be in the handshake at once,
//! over all workers (the accepting thread keeps their slots). When that
//! many are, the accepting thread closes the oldest of them that has been
//! in the handshake for [`EVICT_AFTER`] without its whole answer waiting in
//! its socket (a client that holds the secret answers well within that;
//! one whose answer waits is about to be served, not evicted), and until
//! then leaves the new ones in the kernel's queue: thousands of ranks
//! connecting at once all get through, and a flood of idle or trickling
//! connections cannot hold the slots.
//!
//! The listening queue is as deep as the kernel allows (`somaxconn`), so a
//! burst of connections is queued rather than dropped (a dropped SYN costs
//! a client a second before it tries again).
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt::Display;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener as MioListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use super::descriptors;
use super::error::{Result, StoreError};
use super::protocol::{self, Chunk, Request, Response};
use super::state::{Blocked, ConnId, Outcome, SessionId, Table, Ticket};

/// How long a new connection has to complete the whole handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections allowed in the handshake at once. Clients that hold the
/// secret finish it in a round trip, so a real job never nears this; a
/// flood of idle or slow connections cannot hold more descriptors than this.
pub const MAX_UNAUTHENTICATED: usize = 256;

/// How long a connection may sit in the handshake before a newer one, with
/// every slot taken, closes it.
pub const EVICT_AFTER: Duration = Duration::from_millis(250);

/// How long a connection is silent before the store probes its peer (TCP
/// keepalive), between probes, and how many unanswered probes close it: a
/// client whose host vanished without a word (powered off, cut off: no FIN,
/// no RST) is seen gone within about 25 s, and its will is set. A peer
/// whose process is stopped still answers (its kernel does).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: libc::c_int = 3;

/// Turns on TCP keepalive for `stream` with [`KEEPALIVE_IDLE`],
/// [`KEEPALIVE_INTERVAL`] and [`KEEPALIVE_PROBES`].
fn probe_when_idle(stream: &TcpStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let options = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE.as_secs() as libc::c_int),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL.as_secs() as libc::c_int),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_PROBES),
    ];
    for (level, name, value) in options {
        // SAFETY: setsockopt reads one c_int from `value`, which outlives
        // the call; the descriptor is the open socket `stream` owns.
        let rc = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Most threads serving authenticated clients.
pub const MAX_WORKERS: usize = 8;

/// The listening queue asked of the kernel (which caps it at `somaxconn`).
const LISTEN_BACKLOG: i32 = 65535;

/// Bytes a connection may have read ahead of the request being answered
/// (a client sends one request at a time; more waits in the kernel).
const READ_AHEAD: usize = 64 << 10;

/// Requests a session may send while it is blocked, waiting their turn;
/// one more closes the session (see [`MAX_QUEUED_BYTES`]).
pub(crate) const MAX_QUEUED: usize = 64;

/// Bytes of requests a connection's sessions may hold queued, over all of
/// them, while they are blocked. A client that waits for each answer
/// before its next request (every `StoreClient`, relayed or not) never
/// queues; only a session that pipelines behind a blocked request does.
///
/// The session whose request would pass this budget (or
/// [`MAX_QUEUED`] requests) is closed, not the connection throttled: a
/// relay's connection carries a whole node's ranks, and reading none of it
/// until one session's wait ends would stall its neighbours, including
/// the one whose request would end that wait. Closing the session answers
/// its blocked request and every request it had queued with a refusal, in
/// order, and sets its will; frames it sends later are refused as "not
/// open". Memory held for queues is then at most this per connection.
pub(crate) const MAX_QUEUED_BYTES: usize = 4 << 20;

/// Sessions one connection may hold open.
pub(crate) const MAX_SESSIONS: usize = 1 << 16;

/// Pieces handed to one vectored write.
const MAX_SLICES: usize = 64;

/// Answers a connection may queue, unwritten, while it serves the next of
/// its requests already read (so that pipelined requests are answered in
/// one write).
const COALESCE: usize = MAX_SLICES / 2;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
/// The first connection's token; ids are never reused.
const FIRST_CONN: usize = 2;

/// What a server allows clients that have not proven the secret.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Deadline of the whole handshake.
    pub handshake: Duration,
    /// Connections in the handshake at once.
    pub unauthenticated: usize,
    /// How long the oldest connection in the handshake is left alone when
    /// every slot is taken.
    pub evict_after: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { handshake: HANDSHAKE_TIMEOUT, unauthenticated: MAX_UNAUTHENTICATED, evict_after: EVICT_AFTER }
    }
}

/// A message to a worker.
enum Message {
    /// Greet this connection, just accepted (at the instant given), and run
    /// its handshake; serve it once it proved the secret.
    Greet(ConnId, Box<(TcpStream, SocketAddr, Instant)>),
    /// Close this connection if it is still in the handshake: the accepting
    /// thread took its slot for a newer one.
    Evict(ConnId),
    /// The answer to a blocked request of one of its connections.
    Answer(Ticket, Response),
}

/// A worker thread's mailbox.
struct Mailbox {
    inbox: Mutex<Vec<Message>>,
    waker: Waker,
}

/// What the threads share with [`StoreServer`]'s own calls.
struct Shared {
    table: Mutex<Table>,
    stop: AtomicBool,
    workers: Vec<Mailbox>,
    acceptor: Waker,
    secret: Vec<u8>,
    limits: Limits,
    /// The connections in the handshake.
    slots: Mutex<Slots>,
    /// Clients refused or dropped during the handshake (every 1000th is
    /// logged at warn).
    dropped: AtomicU64,
}

impl Shared {
    /// The worker that serves connection `id`.
    fn owner(&self, id: ConnId) -> usize {
        id % self.workers.len()
    }

    /// Releases connection `id`'s handshake slot; false when it had none
    /// (the accepting thread evicted it). Wakes the accepting thread when
    /// every slot was taken.
    fn release(&self, id: ConnId) -> bool {
        let mut slots = self.slots.lock();
        let was_full = slots.live.len() >= self.limits.unauthenticated;
        let had = slots.live.remove(&id).is_some();
        drop(slots);
        if had && was_full {
            let _ = self.acceptor.wake();
        }
        had
    }

    /// Counts a client refused or dropped during the handshake: true for
    /// the first and every 1000th (logged at warn, the others at debug).
    fn count_dropped(&self) -> bool {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        n == 1 || n.is_multiple_of(1000)
    }

    /// Sends the table's answers to blocked requests to their connections'
    /// workers (waking each once); returns those of worker `me`.
    fn route(&self, table: &mut Table, me: Option<usize>) -> Vec<(Ticket, Response)> {
        if table.woken.is_empty() {
            return Vec::new();
        }
        let mut mine = Vec::new();
        let mut woke = vec![false; self.workers.len()];
        for (ticket, response) in table.woken.drain(..) {
            let w = self.owner(ticket.conn);
            if Some(w) == me {
                mine.push((ticket, response));
            } else {
                self.workers[w].inbox.lock().push(Message::Answer(ticket, response));
                woke[w] = true;
            }
        }
        for (w, woke) in woke.into_iter().enumerate() {
            if woke {
                let _ = self.workers[w].waker.wake();
            }
        }
        mine
    }
}

/// A rendezvous store served by a few background threads.
///
/// One thread accepts connections; a few worker threads check that each
/// proves the job's secret (see the protocol in the module docs; a refusal
/// is logged with `tracing::warn!` and the peer's address) and serve the
/// authenticated clients with non-blocking sockets; blocked `wait`s and
/// barriers cost them no thread. Dropping the server shuts it down.
pub struct StoreServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
    /// The thread growing the process's descriptor table, if one does.
    reserving: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `addr` and starts serving; returns once the socket is bound,
    /// so clients may connect as soon as this returns.
    ///
    /// Port 0 picks a free port: read it back with [`StoreServer::local_addr`].
    /// A port already in use is [`StoreError::Bind`], whose message names the
    /// port and says to pick another or 0.
    ///
    /// The process's descriptor table is grown once for 60,000 more descriptors
    /// (at most the soft limit on open files), so that accepting a burst of
    /// connections never waits for it to grow
    /// ([`reserve_descriptors`](super::reserve_descriptors)): at once when
    /// the calling process has no other thread, else on a short-lived thread
    /// (connections that fit the table as it was do not wait for it).
    pub fn bind(addr: impl ToSocketAddrs + Display, secret: impl AsRef<[u8]>) -> Result<Self> {
        Self::bind_with(addr, secret, Limits::default())
    }

    /// [`StoreServer::bind`] with `workers` threads serving authenticated
    /// clients instead of one per two cores (at most [`MAX_WORKERS`]); the
    /// rendezvous bench measures whether more threads help.
    pub fn bind_with_workers(
        addr: impl ToSocketAddrs + Display,
        secret: impl AsRef<[u8]>,
        workers: usize,
    ) -> Result<Self> {
        Self::bind_workers(addr, secret, Limits::default(), workers.clamp(1, MAX_WORKERS))
    }

    /// [`StoreServer::bind`] with other limits for unauthenticated clients.
    pub(crate) fn bind_with(
        addr: impl ToSocketAddrs + Display,
        secret: impl AsRef<[u8]>,
        limits: Limits,
    ) -> Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        Self::bind_workers(addr, secret, limits, (cores / 2).clamp(1, MAX_WORKERS))
    }

    /// [`StoreServer::bind_with`] with `threads` workers serving
    /// authenticated clients.
    pub(crate) fn bind_workers(
        addr: impl ToSocketAddrs + Display,
        secret: impl AsRef<[u8]>,
        limits: Limits,
        threads: usize,
    ) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let shown = addr.to_string();
        let bind_error = |source| StoreError::Bind { addr: shown.clone(), source };
        let listener = TcpListener::bind(&addr).map_err(bind_error)?;
        // Room for the connections before they come, before this server's
        // threads start (at once when the caller has no other thread):
        // accepting them never waits for the table to grow.
        let reserving = descriptors::reserve_descriptors_soon(descriptors::STORE_RESERVE);
        let local_addr = listener.local_addr().map_err(bind_error)?;
        deepen_backlog(&listener);
        listener.set_nonblocking(true).map_err(bind_error)?;
        let mut listener = MioListener::from_std(listener);
        let poll = Poll::new().map_err(bind_error)?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE).map_err(bind_error)?;
        let acceptor = Waker::new(poll.registry(), WAKER).map_err(bind_error)?;
        let mut polls = Vec::new();
        let mut workers = Vec::new();
        for _ in 0..threads.max(1) {
            let p = Poll::new().map_err(bind_error)?;
            let waker = Waker::new(p.registry(), WAKER).map_err(bind_error)?;
            workers.push(Mailbox { inbox: Mutex::new(Vec::new()), waker });
            polls.push(p);
        }
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            stop: AtomicBool::new(false),
            workers,
            acceptor,
            secret: secret.to_vec(),
            limits,
            slots: Mutex::new(Slots::default()),
            dropped: AtomicU64::new(0),
        });
        let mut threads = Vec::new();
        let spawn_error = |source| StoreError::Bind { addr: local_addr.to_string(), source };
        for (index, poll) in polls.into_iter().enumerate() {
            let mut worker = Worker {
                index,
                poll,
                shared: shared.clone(),
                conns: HashMap::new(),
                timers: BinaryHeap::new(),
                to_drive: Vec::new(),
                answers: Vec::new(),
                scratch: vec![0; READ_AHEAD],
            };
            let thread = std::thread::Builder::new()
                .name(format!("cohort-store-{index}"))
                .spawn(move || worker.run())
                .map_err(spawn_error)?;
            threads.push(thread);
        }
        let mut acceptor = Acceptor {
            poll,
            listener,
            shared: shared.clone(),
            next_id: FIRST_CONN,
            timers: BinaryHeap::new(),
            may_accept: true,
            parked: None,
            turned_away: 0,
        };
        let thread = std::thread::Builder::new()
            .name("cohort-store-accept".into())
            .spawn(move || acceptor.run())
            .map_err(spawn_error)?;
        threads.push(thread);
        tracing::debug!(%local_addr, workers = shared.workers.len(), "rendezvous store listening");
        Ok(StoreServer { shared, local_addr, threads, reserving })
    }

    /// The address the server listens on (with the real port where 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the process's descriptor table has grown for this
    /// server's connections (see [`StoreServer::bind`]).
    #[cfg(test)]
    pub(crate) fn wait_descriptors_reserved(&mut self) {
        if let Some(t) = self.reserving.take() {
            t.join().expect("the thread growing the descriptor table panicked");
        }
    }

    /// Participants waiting in barrier `name` now.
    #[cfg(test)]
    pub(crate) fn barrier_arrivals(&self, name: &str) -> u32 {
        self.shared.table.lock().barrier_arrivals(name)
    }

    /// Number of keys the store holds now.
    pub fn num_keys(&self) -> usize {
        self.shared.table.lock().len()
    }

    /// Removes every key and barrier whose name does not start with `keep`.
    ///
    /// The launcher calls this between restarts, with no rank alive, so that a
    /// restarted group does not see the keys of the one before. Blocked
    /// waits see the change; barriers removed open.
    pub fn reset_except(&self, keep: &str) {
        let mut table = self.shared.table.lock();
        table.reset_except(keep);
        self.shared.route(&mut table, None);
    }

    /// Stops serving: refuses new requests, answers blocked `wait`s and
    /// barriers with an error, closes every connection and joins the server's
    /// threads. Idempotent; dropping the server does the same.
    pub fn shutdown(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let mut table = self.shared.table.lock();
            table.shut_down();
            self.shared.route(&mut table, None);
        }
        let mut woken = self.shared.acceptor.wake().is_ok();
        for w in &self.shared.workers {
            woken &= w.waker.wake().is_ok();
        }
        if woken {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
        self.threads.clear();
        if let Some(t) = self.reserving.take() {
            let _ = t.join();
        }
        tracing::debug!(local_addr = %self.local_addr, "rendezvous store shut down");
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Asks the kernel for a listening queue of [`LISTEN_BACKLOG`] (std's is
/// 128, too short for a thousand ranks connecting at once). Best effort: on
/// failure the queue stays as it was.
fn deepen_backlog(listener: &TcpListener) {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor belongs to `listener`, which outlives this
        // call; listen() on a listening socket only changes its queue length.
        let rc = unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) };
        if rc != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "could not deepen the store's listening queue");
        }
    }
    #[cfg(not(unix))]
    let _ = listener;
}

/// Where a connection stands.
enum Phase {
    /// Greeted with this nonce, has not proven the secret yet.
    Handshake { nonce: [u8; protocol::NONCE_LEN] },
    /// Proved the secret: its requests are served.
    Ready,
    /// To be closed once its last answer (a refusal) is written.
    Closing,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    phase: Phase,
    /// Bytes read and not yet taken as frames, from `read_at`.
    input: Vec<u8>,
    read_at: usize,
    /// Answers not yet written, the first from `written`.
    output: VecDeque<Chunk>,
    written: usize,
    /// The connection's own session (0): a plain client's requests.
    main: Session,
    /// The sessions opened on it (a relay's ranks), by id.
    sessions: HashMap<SessionId, Session>,
    /// Sessions just answered that have requests waiting their turn.
    resumable: Vec<SessionId>,
    /// Bytes of the requests queued in its sessions (at most
    /// [`MAX_QUEUED_BYTES`]).
    queued_bytes: usize,
    /// Requests taken so far, over all sessions (numbers the blocked ones).
    seq: u64,
    /// The socket may hold bytes not read yet: a readable event came since
    /// a read found it empty. Reads are edge-triggered: bytes (or an end of
    /// stream) arriving later bring another event, so a connection driven
    /// for another reason (an answer to write) reads nothing in vain.
    readable: bool,
    /// The peer's end of stream (or an error) was reported: read until it
    /// shows, even past a short read.
    read_closed: bool,
}

impl Conn {
    fn new(stream: TcpStream, peer: SocketAddr, phase: Phase) -> Conn {
        Conn {
            stream,
            peer,
            phase,
            input: Vec::new(),
            read_at: 0,
            output: VecDeque::new(),
            written: 0,
            main: Session::default(),
            sessions: HashMap::new(),
            resumable: Vec::new(),
            queued_bytes: 0,
            seq: 0,
            // Registering a socket reports what it already holds.
            readable: false,
            read_closed: false,
        }
    }

    /// Session `id` of this connection, if open (0 always is).
    /// The open session other than `except` holding the most queued bytes,
    /// when that is more than `than`.
    fn heaviest_queue_but(&self, except: SessionId, than: usize) -> Option<SessionId> {
        self.sessions
            .iter()
            .filter(|(&id, _)| id != except)
            .map(|(&id, s)| (s.queued.iter().map(Vec::len).sum::<usize>(), id))
            .filter(|&(bytes, _)| bytes > than)
            .max()
            .map(|(_, id)| id)
    }

    fn session(&mut self, id: SessionId) -> Option<&mut Session> {
        if id == 0 {
            Some(&mut self.main)
        } else {
            self.sessions.get_mut(&id)
        }
    }

    /// Queues `response` as session `id`'s answer.
    fn answer(&mut self, id: SessionId, response: &Response) {
        if id == 0 {
            self.output.extend(response.encode_chunks());
        } else {
            self.output.extend(protocol::in_session(id, response.encode_chunks()));
        }
    }

    /// Queues `response` tagged as session `id`'s, even for session 0 (a
    /// refused session frame is answered in the session it named).
    fn answer_tagged(&mut self, id: SessionId, response: &Response) {
        self.output.extend(protocol::in_session(id, response.encode_chunks()));
    }

    /// Delivers the answer to session `ticket.session`'s blocked request
    /// `ticket.seq`; false (nothing queued) when it no longer waits for it.
    fn deliver(&mut self, ticket: Ticket, response: &Response) -> bool {
        let Some(s) = self.session(ticket.session) else { return false };
        if s.blocked.as_ref().is_none_or(|(seq, _)| *seq != ticket.seq) {
            return false;
        }
        s.blocked = None;
        let resume = !s.queued.is_empty();
        if resume {
            self.resumable.push(ticket.session);
        }
        self.answer(ticket.session, response);
        true
    }

    /// Queues `body` in session `id` (open, blocked) to be served after.
    fn queue(&mut self, id: SessionId, body: Vec<u8>) {
        let len = body.len();
        if let Some(s) = self.session(id) {
            s.queued.push_back(body);
            self.queued_bytes += len;
        }
    }

    /// A request of a session that waited its turn and may be served now.
    fn next_queued(&mut self) -> Option<(SessionId, Vec<u8>)> {
        while let Some(&id) = self.resumable.last() {
            match self.session(id) {
                Some(s) if s.blocked.is_none() => {
                    if let Some(body) = s.queued.pop_front() {
                        if s.queued.is_empty() {
                            self.resumable.pop();
                        }
                        self.queued_bytes -= body.len();
                        return Some((id, body));
                    }
                    self.resumable.pop();
                }
                _ => {
                    self.resumable.pop();
                }
            }
        }
        None
    }

    /// Notes what a poll event says about the socket.
    fn saw(&mut self, event: &mio::event::Event) {
        if event.is_readable() || event.is_read_closed() || event.is_error() {
            self.readable = true;
        }
        if event.is_read_closed() || event.is_error() {
            self.read_closed = true;
        }
    }

    fn unread(&self) -> &[u8] {
        &self.input[self.read_at..]
    }

    /// The next whole frame's body, if its bytes are all here; a length over
    /// `max` is an error before anything is read for it.
    fn take_frame(&mut self, max: usize, what: &str) -> io::Result<Option<Vec<u8>>> {
        let unread = self.unread();
        if unread.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(unread[..4].try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes{what} exceeds the limit of {max}"),
            ));
        }
        if unread.len() < 4 + len {
            return Ok(None);
        }
        let body = unread[4..4 + len].to_vec();
        self.read_at += 4 + len;
        if self.read_at == self.input.len() {
            // A large request's buffer goes back at once.
            if self.input.capacity() > READ_AHEAD {
                self.input = Vec::new();
            }
            self.input.clear();
            self.read_at = 0;
        }
        Ok(Some(body))
    }

    /// Reads what the socket holds, through `scratch` (a buffer of the
    /// thread, so an idle connection holds no read buffer): at least the
    /// rest of the frame being read (unless its length is over `max_frame`:
    /// the caller refuses it) and up to `ahead` unread bytes. `Ok(false)` at
    /// end of stream.
    fn fill(&mut self, scratch: &mut [u8], ahead: usize, max_frame: usize) -> io::Result<bool> {
        loop {
            let unread = self.unread();
            let frame_left = if unread.len() < 4 {
                4 - unread.len()
            } else {
                let len = u32::from_le_bytes(unread[..4].try_into().expect("4 bytes")) as usize;
                if len > max_frame {
                    return Ok(true);
                }
                (4 + len).saturating_sub(unread.len())
            };
            let want = frame_left.max(ahead.saturating_sub(unread.len()));
            if want == 0 {
                return Ok(true);
            }
            if !self.readable {
                return Ok(true);
            }
            if self.read_at > 0 && self.read_at >= self.input.len() / 2 {
                self.input.drain(..self.read_at);
                self.read_at = 0;
            }
            let n = want.min(scratch.len());
            match self.stream.read(&mut scratch[..n]) {
                Ok(0) => return Ok(false),
                Ok(k) => {
                    self.input.extend_from_slice(&scratch[..k]);
                    // A short read emptied the socket: what comes next
                    // brings an event (an end of stream already reported
                    // is read now, not waited for). Linux's epoll and the
                    // BSDs' kqueue report every arrival after a read, so
                    // this holds on the Unix systems cohort runs on; mio's
                    // portable promise is only "until WouldBlock".
                    if k < n && !self.read_closed {
                        self.readable = false;
                        return Ok(true);
                    }
                }
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => {
                        self.readable = false;
                        return Ok(true);
                    }
                    io::ErrorKind::Interrupted => {}
                    _ => return Err(e),
                },
            }
        }
    }

    fn send(&mut self, body: &[u8]) {
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(body);
        self.output.push_back(Chunk::Own(frame));
    }

    /// Writes what the socket takes; `Ok(true)` once nothing is left.
    fn flush(&mut self) -> io::Result<bool> {
        loop {
            // Empty pieces (an empty value) take no write.
            while self.output.front().is_some_and(|c| c.bytes().len() == self.written) {
                self.output.pop_front();
                self.written = 0;
            }
            if self.output.is_empty() {
                return Ok(true);
            }
            let mut slices = Vec::with_capacity(self.output.len().min(MAX_SLICES));
            for (i, c) in self.output.iter().take(MAX_SLICES).enumerate() {
                let bytes = c.bytes();
                slices.push(IoSlice::new(if i == 0 { &bytes[self.written..] } else { bytes }));
            }
            match self.stream.write_vectored(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut n) => {
                    while n > 0 {
                        let front = self.output.front().expect("written bytes were queued").bytes().len();
                        let left = front - self.written;
                        if n >= left {
                            n -= left;
                            self.output.pop_front();
                            self.written = 0;
                        } else {
                            self.written += n;
                            n = 0;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// One client's request stream on a connection: the connection's own, or
/// one a relay opened for a rank.
#[derive(Default)]
struct Session {
    /// The request it waits in, if any.
    blocked: Option<(u64, Blocked)>,
    /// A will: set this key (unless present) should the client vanish.
    will: Option<(String, Vec<u8>)>,
    /// Requests that came while it was blocked, served in order after.
    queued: VecDeque<Vec<u8>>,
}

/// A deadline a thread keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// The connection's handshake must be done by now.
    Handshake(ConnId),
    /// Try accepting again (every handshake slot was taken, or accept failed).
    Accept,
    /// The blocked request times out.
    Blocked(Ticket),
    /// A refused connection that has not taken its refusal is closed.
    Linger(ConnId),
}

type Timers = BinaryHeap<Reverse<(Instant, Timer)>>;

/// Why a connection is closed.
enum Close {
    /// The client left (end of stream, reset): nothing to log above debug.
    Left(String),
    /// The server dropped it during the handshake (logged at warn).
    Dropped(String),
    /// It broke the protocol after the handshake (logged at debug).
    Failed(String),
}

/// True for the first and every 1000th event counted in `n`, which are
/// logged at warn (the others at debug), so a flood cannot flood the log.
fn first_or_thousandth(n: &mut u64) -> bool {
    *n += 1;
    *n == 1 || n.is_multiple_of(1000)
}

/// Polls until an event or the first timer.
fn poll_once(poll: &mut Poll, events: &mut Events, timers: &Timers) -> io::Result<()> {
    let timeout = timers.peek().map(|Reverse((at, _))| at.saturating_duration_since(Instant::now()));
    match poll.poll(events, timeout) {
        Err(e) if e.kind() != io::ErrorKind::Interrupted => Err(e),
        _ => Ok(()),
    }
}

/// A connection in the handshake, as the accepting thread tracks it.
struct Pending {
    since: Instant,
    /// A second descriptor of the socket (its worker owns the first), to
    /// look at, without reading it, whether the client has answered.
    probe: Option<std::net::TcpStream>,
}

/// The connections in the handshake, shared by the accepting thread (which
/// adds them and evicts the oldest silent one when all slots are taken) and
/// the workers (which run the handshakes and release the slots). A slot is
/// released exactly once: whoever removes the entry owns the outcome (a
/// worker whose connection was evicted under it closes the connection).
#[derive(Default)]
struct Slots {
    live: HashMap<ConnId, Pending>,
    /// Ids in the order they were accepted (some may have left `live`).
    order: VecDeque<ConnId>,
}

/// The thread that accepts connections and hands them to the workers,
/// which run their handshakes.
struct Acceptor {
    poll: Poll,
    listener: MioListener,
    shared: Arc<Shared>,
    next_id: ConnId,
    timers: Timers,
    /// The listener may hold connections not yet accepted.
    may_accept: bool,
    /// A connection accepted and waiting for a handshake slot.
    parked: Option<(TcpStream, SocketAddr)>,
    /// Connections closed because too many were in the handshake.
    turned_away: u64,
}

impl Acceptor {
    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            if let Err(e) = poll_once(&mut self.poll, &mut events, &self.timers) {
                tracing::error!(error = %e, "rendezvous store's accepting thread failed; it accepts no more clients");
                return;
            }
            if self.shared.stop.load(Ordering::SeqCst) {
                return;
            }
            for event in events.iter() {
                if event.token() == LISTENER {
                    self.may_accept = true;
                }
            }
            // Timers only wake this loop (a slot may be free to evict now).
            let now = Instant::now();
            while self.timers.peek().is_some_and(|Reverse((at, _))| *at <= now) {
                self.timers.pop();
            }
            self.accept();
        }
    }

    /// Accepts connections while the listener has them and a handshake slot
    /// is free (or the oldest silent connection in the handshake may be
    /// evicted), and hands each to its worker.
    fn accept(&mut self) {
        let mut wake = vec![false; self.shared.workers.len()];
        loop {
            // A connection accepted while every slot was taken waits here
            // (not greeted, its handshake's clock not started) for room.
            if self.parked.is_none() {
                if !self.may_accept {
                    break;
                }
                match self.listener.accept() {
                    Ok(s) => self.parked = Some(s),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.may_accept = false;
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // Out of descriptors and the like: say so, back off, go on.
                        tracing::warn!(error = %e, "rendezvous store could not accept a connection");
                        self.timers.push(Reverse((Instant::now() + Duration::from_millis(10), Timer::Accept)));
                        break;
                    }
                }
            }
            if !self.make_room() {
                break;
            }
            let (stream, peer) = self.parked.take().expect("parked above");
            let id = self.next_id;
            self.next_id += 1;
            let since = Instant::now();
            // The second descriptor is made before the lock is taken: the
            // workers take it to finish their handshakes.
            let probe = probe_of(&stream);
            self.shared.slots.lock().live.insert(id, Pending { since, probe });
            self.shared.slots.lock().order.push_back(id);
            let w = self.shared.owner(id);
            self.shared.workers[w].inbox.lock().push(Message::Greet(id, Box::new((stream, peer, since))));
            wake[w] = true;
        }
        for (w, wake) in wake.into_iter().enumerate() {
            if wake {
                let _ = self.shared.workers[w].waker.wake();
            }
        }
    }

    /// Makes room for one more connection in the handshake: true when fewer
    /// than [`Limits::unauthenticated`] are in it, or once the oldest one
    /// that has been there [`Limits::evict_after`] without a whole answer
    /// waiting in its socket is evicted. Otherwise false, with a timer for
    /// when one may be evicted (a worker that releases a slot wakes this
    /// thread sooner).
    fn make_room(&mut self) -> bool {
        let limits = self.shared.limits;
        let mut slots = self.shared.slots.lock();
        let Slots { live, order } = &mut *slots;
        while order.front().is_some_and(|id| !live.contains_key(id)) {
            order.pop_front();
        }
        if live.len() < limits.unauthenticated {
            return true;
        }
        let now = Instant::now();
        let mut victim = None;
        let mut next_try = now + limits.evict_after.max(Duration::from_millis(1));
        for id in order.iter() {
            let Some(p) = live.get(id) else { continue };
            let evictable_at = p.since + limits.evict_after;
            if evictable_at > now {
                next_try = evictable_at;
                break;
            }
            if !answered(p.probe.as_ref()) {
                victim = Some(*id);
                break;
            }
        }
        let Some(victim) = victim else {
            drop(slots);
            self.timers.push(Reverse((next_try, Timer::Accept)));
            return false;
        };
        live.remove(&victim);
        drop(slots);
        let w = self.shared.owner(victim);
        self.shared.workers[w].inbox.lock().push(Message::Evict(victim));
        let _ = self.shared.workers[w].waker.wake();
        if first_or_thousandth(&mut self.turned_away) {
            tracing::warn!(
                "rendezvous store closed the oldest connection in the handshake: {} clients are in the handshake \
                 at once (a flood of connections that do not prove the job secret?)",
                limits.unauthenticated
            );
        } else {
            tracing::debug!("rendezvous store closed the oldest connection in the handshake: too many clients in it");
        }
        true
    }
}

/// A second descriptor of `stream`'s socket, for [`answered`].
fn probe_of(stream: &TcpStream) -> Option<std::net::TcpStream> {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        stream.as_fd().try_clone_to_owned().ok().map(std::net::TcpStream::from)
    }
    #[cfg(not(unix))]
    {
        let _ = stream;
        None
    }
}

/// Whether a connection in the handshake has its whole answer (or its end
/// of stream) waiting in the socket, unread: its worker will finish with it
/// at once, so it is not evicted. Looks without reading (the socket is
/// non-blocking, shared with the worker's descriptor).
fn answered(probe: Option<&std::net::TcpStream>) -> bool {
    let Some(probe) = probe else { return false };
    let mut buf = [0u8; 4 + protocol::PREAUTH_MAX_FRAME];
    match probe.peek(&mut buf) {
        Ok(0) => true,
        Ok(n) if n >= 4 => {
            let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
            n >= 4 + len.min(protocol::PREAUTH_MAX_FRAME)
        }
        _ => false,
    }
}

/// A thread that serves authenticated connections.
struct Worker {
    index: usize,
    poll: Poll,
    shared: Arc<Shared>,
    conns: HashMap<ConnId, Conn>,
    timers: Timers,
    /// Connections with something to do (an answer delivered, bytes read).
    to_drive: Vec<ConnId>,
    /// Answers to blocked requests of this worker's connections.
    answers: Vec<(Ticket, Response)>,
    /// Where sockets are read into.
    scratch: Vec<u8>,
}

impl Worker {
    fn run(&mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            if let Err(e) = poll_once(&mut self.poll, &mut events, &self.timers) {
                tracing::error!(error = %e, "a rendezvous store thread failed; its clients are cut off");
                return;
            }
            let stop = self.shared.stop.load(Ordering::SeqCst);
            for event in events.iter() {
                if event.token() != WAKER {
                    let id = event.token().0;
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.saw(event);
                    }
                    self.to_drive.push(id);
                }
            }
            let messages = std::mem::take(&mut *self.shared.workers[self.index].inbox.lock());
            for m in messages {
                match m {
                    Message::Greet(id, accepted) => {
                        let (stream, peer, since) = *accepted;
                        if stop {
                            let _ = stream.shutdown(std::net::Shutdown::Both);
                            continue;
                        }
                        self.greet(id, stream, peer, since);
                    }
                    Message::Evict(id) => {
                        if self.conns.get(&id).is_some_and(|c| matches!(c.phase, Phase::Handshake { .. })) {
                            self.close(id, Close::Left("evicted".into()));
                        }
                    }
                    Message::Answer(ticket, response) => self.answers.push((ticket, response)),
                }
            }
            if stop {
                // The table answered every blocked request with a refusal:
                // write what the sockets take at once, then close them all.
                self.deliver_answers();
                for (_, mut c) in self.conns.drain() {
                    let _ = c.flush();
                    let _ = c.stream.shutdown(std::net::Shutdown::Both);
                }
                return;
            }
            // Answers first: a request answered in this round is not also
            // timed out.
            self.deliver_answers();
            self.fire_timers();
            self.deliver();
        }
    }

    fn fire_timers(&mut self) {
        // Timers of requests answered long before their deadline: dropped
        // once they outnumber the connections.
        if self.timers.len() > 4 * self.conns.len() + 1024 {
            let conns = &self.conns;
            self.timers.retain(|Reverse((_, t))| match t {
                Timer::Blocked(ticket) => conns.get(&ticket.conn).is_some_and(|c| {
                    let s = if ticket.session == 0 { Some(&c.main) } else { c.sessions.get(&ticket.session) };
                    s.and_then(|s| s.blocked.as_ref()).is_some_and(|(seq, _)| *seq == ticket.seq)
                }),
                _ => true,
            });
        }
        let now = Instant::now();
        while let Some(&Reverse((at, timer))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            match timer {
                Timer::Blocked(ticket) => {
                    let Some(c) = self.conns.get_mut(&ticket.conn) else { continue };
                    let Some(s) = c.session(ticket.session) else { continue };
                    let Some((seq, blocked)) = s.blocked.take_if(|(seq, _)| *seq == ticket.seq) else { continue };
                    match self.shared.table.lock().withdraw(ticket, &blocked) {
                        Some(response) => {
                            s.blocked = Some((seq, blocked));
                            c.deliver(ticket, &response);
                            self.to_drive.push(ticket.conn);
                        }
                        // Answered meanwhile (the barrier opened, the keys
                        // came, on this thread or another): that answer is
                        // on its way through the mailbox; it still blocks.
                        None => s.blocked = Some((seq, blocked)),
                    }
                }
                Timer::Linger(id) => {
                    if self.conns.get(&id).is_some_and(|c| matches!(c.phase, Phase::Closing)) {
                        self.close(id, Close::Left("refused".into()));
                    }
                }
                Timer::Handshake(id) => {
                    if self.conns.get(&id).is_some_and(|c| matches!(c.phase, Phase::Handshake { .. })) {
                        self.close(id, Close::Dropped("the handshake's deadline passed".into()));
                    }
                }
                Timer::Accept => {}
            }
        }
    }

    /// Starts the handshake of a connection just accepted: watches it,
    /// sends the greeting (with a fresh nonce) and sets its deadline.
    fn greet(&mut self, id: ConnId, mut stream: TcpStream, peer: SocketAddr, since: Instant) {
        let nonce = match protocol::nonce() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, %peer, "rendezvous store dropped a client: no nonce");
                self.shared.release(id);
                return;
            }
        };
        if let Err(e) = self.poll.registry().register(&mut stream, Token(id), Interest::READABLE | Interest::WRITABLE) {
            tracing::warn!(error = %e, %peer, "rendezvous store could not watch a connection; dropped it");
            self.shared.release(id);
            return;
        }
        let _ = stream.set_nodelay(true);
        if let Err(e) = probe_when_idle(&stream) {
            tracing::debug!(error = %e, %peer, "rendezvous store could not turn on TCP keepalive for a connection");
        }
        let mut conn = Conn::new(stream, peer, Phase::Handshake { nonce });
        let mut hello = protocol::Encoder::default();
        hello.0.extend_from_slice(protocol::MAGIC);
        hello.u8(protocol::VERSION);
        hello.0.extend_from_slice(&nonce);
        conn.send(&hello.0);
        self.conns.insert(id, conn);
        self.timers.push(Reverse((since + self.shared.limits.handshake, Timer::Handshake(id))));
        self.to_drive.push(id);
    }

    /// Writes the greeting of a connection in the handshake and reads its
    /// answer (pre-auth frames only, [`protocol::PREAUTH_MAX_FRAME`] bytes at
    /// most); checks the proof and answers the verdict. `Ok(true)` once it
    /// proved the secret (its requests are served from now on).
    fn handshake(&mut self, id: ConnId) -> std::result::Result<bool, Close> {
        let Worker { shared, conns, timers, scratch, .. } = self;
        let Some(c) = conns.get_mut(&id) else { return Ok(false) };
        let Phase::Handshake { nonce, .. } = c.phase else { return Ok(true) };
        c.flush().map_err(|e| Close::Left(e.to_string()))?;
        let max = protocol::PREAUTH_MAX_FRAME;
        let open = c.fill(scratch, 4 + max, max).map_err(|e| Close::Left(e.to_string()))?;
        let Some(answer) = c.take_frame(max, " before authentication").map_err(|e| Close::Dropped(e.to_string()))?
        else {
            return if open { Ok(false) } else { Err(Close::Left("left during the handshake".into())) };
        };
        if let Err(why) = check_proof(&shared.secret, c, &nonce, &answer) {
            let peer = c.peer;
            let what = match why {
                Refusal::WrongSecret => "rendezvous store refused a client that does not hold the job secret",
                Refusal::OtherVersion => {
                    "rendezvous store refused a client that speaks another protocol version (an older or newer \
                     cohort?)"
                }
            };
            if shared.count_dropped() {
                tracing::warn!(%peer, "{what}");
            } else {
                tracing::debug!(%peer, "{what}");
            }
            shared.release(id);
            timers.push(Reverse((Instant::now() + shared.limits.handshake, Timer::Linger(id))));
            return Ok(false);
        }
        if !shared.release(id) {
            // Evicted while its answer was read: the slot went to another.
            return Err(Close::Left("evicted".into()));
        }
        Ok(true)
    }

    /// Queues the answers for blocked requests that are still waiting.
    fn deliver_answers(&mut self) {
        for (ticket, response) in std::mem::take(&mut self.answers) {
            let Some(c) = self.conns.get_mut(&ticket.conn) else { continue };
            if c.deliver(ticket, &response) {
                self.to_drive.push(ticket.conn);
            }
        }
    }

    /// Drives every connection with something to do, and the ones their
    /// requests woke, until none is left.
    fn deliver(&mut self) {
        loop {
            self.deliver_answers();
            if self.to_drive.is_empty() {
                return;
            }
            for id in std::mem::take(&mut self.to_drive) {
                if let Err(why) = self.drive(id) {
                    self.close(id, why);
                }
            }
        }
    }

    /// Writes what a connection has to write, reads what it sent and serves
    /// its requests, one at a time, until it blocks or has nothing more.
    fn drive(&mut self, id: ConnId) -> std::result::Result<(), Close> {
        if self.conns.get(&id).is_some_and(|c| matches!(c.phase, Phase::Handshake { .. })) && !self.handshake(id)? {
            let Some(c) = self.conns.get_mut(&id) else { return Ok(()) };
            // Refused: closed once the refusal is written.
            let flushed = c.flush().map_err(|e| Close::Left(e.to_string()))?;
            return if matches!(c.phase, Phase::Closing) && flushed {
                Err(Close::Left("refused".into()))
            } else {
                Ok(())
            };
        }
        let Worker { index, shared, conns, timers, to_drive, answers, scratch, .. } = self;
        let Some(c) = conns.get_mut(&id) else { return Ok(()) };
        let mut ctx = Serve { index: *index, shared, timers, to_drive, answers, id };
        loop {
            if matches!(c.phase, Phase::Closing) {
                let flushed = c.flush().map_err(|e| Close::Left(e.to_string()))?;
                return if flushed { Err(Close::Left("refused".into())) } else { Ok(()) };
            }
            let open = c.fill(scratch, READ_AHEAD, protocol::MAX_FRAME).map_err(|e| Close::Left(e.to_string()))?;
            // Requests of sessions that waited their turn while blocked.
            if let Some((session, body)) = c.next_queued() {
                if ctx.serve(c, session, &body) {
                    return Ok(());
                }
                continue;
            }
            // A request whose bytes are all here is served before anything
            // is written (while few answers wait): the verdict and the
            // answers to the requests a client sent behind its proof, or
            // any requests it pipelined, leave in one write.
            let next = if c.main.blocked.is_none() && c.output.len() < COALESCE {
                c.take_frame(protocol::MAX_FRAME, "").map_err(|e| Close::Failed(e.to_string()))?
            } else {
                None
            };
            let body = match next {
                Some(body) => body,
                None => {
                    let flushed = c.flush().map_err(|e| Close::Left(e.to_string()))?;
                    if c.main.blocked.is_some() || !flushed {
                        // The answer comes first; an end of stream now
                        // means the client left while it waited.
                        return if open { Ok(()) } else { Err(Close::Left("end of stream while blocked".into())) };
                    }
                    let next = c.take_frame(protocol::MAX_FRAME, "").map_err(|e| Close::Failed(e.to_string()))?;
                    let Some(body) = next else {
                        return if open { Ok(()) } else { Err(Close::Left("end of stream".into())) };
                    };
                    body
                }
            };
            let woke_others = match protocol::SessionFrame::parse(&body) {
                Ok(protocol::SessionFrame::Plain(body)) => ctx.serve(c, 0, body),
                Ok(protocol::SessionFrame::Open(session)) => {
                    if let Err(why) = open_session(c, session) {
                        c.answer_tagged(session, &Response::Refused(why));
                    }
                    false
                }
                Ok(protocol::SessionFrame::Close(session)) => {
                    if session == 0 || !c.sessions.contains_key(&session) {
                        c.answer_tagged(session, &Response::Refused(not_open(session)));
                        false
                    } else {
                        ctx.close_session(c, session)
                    }
                }
                Ok(protocol::SessionFrame::In(session, request)) => match c.session(session) {
                    Some(s) if session != 0 && s.blocked.is_some() => {
                        let count = s.queued.len();
                        let mine = s.queued.iter().map(Vec::len).sum::<usize>() + request.len();
                        // Past the connection's budget, the session that
                        // holds the most gives way (one rank's hoard behind
                        // a relay does not close its neighbour's request).
                        let mut woke = false;
                        if count < MAX_QUEUED && c.queued_bytes + request.len() > MAX_QUEUED_BYTES {
                            if let Some(hog) = c.heaviest_queue_but(session, mine) {
                                let why = format!(
                                    "session {hog} held the most of the {MAX_QUEUED_BYTES} bytes its connection may \
                                     queue while blocked, and another session needed room: the session is closed"
                                );
                                tracing::warn!(peer = %c.peer, session = hog, "{why}");
                                woke = ctx.close_overflowing(c, hog, &why, false);
                            }
                        }
                        if count < MAX_QUEUED && c.queued_bytes + request.len() <= MAX_QUEUED_BYTES {
                            c.queue(session, request.to_vec());
                            woke
                        } else {
                            let why = format!(
                                "session {session} sent {} requests ({} bytes queued on its connection) while one \
                                 of its requests was blocked, more than the store holds ({MAX_QUEUED} requests, \
                                 {MAX_QUEUED_BYTES} bytes): the session is closed",
                                count + 1,
                                c.queued_bytes + request.len()
                            );
                            tracing::warn!(peer = %c.peer, session, "{why}");
                            ctx.close_overflowing(c, session, &why, true) | woke
                        }
                    }
                    Some(_) if session != 0 => ctx.serve(c, session, request),
                    _ => {
                        c.answer_tagged(session, &Response::Refused(not_open(session)));
                        false
                    }
                },
                Err(detail) => {
                    tracing::warn!(peer = %c.peer, %detail, "malformed store request; closing the connection");
                    c.send(&Response::Refused(detail).encode());
                    c.phase = Phase::Closing;
                    ctx.timers.push(Reverse((Instant::now() + HANDSHAKE_TIMEOUT, Timer::Linger(id))));
                    false
                }
            };
            if woke_others {
                return Ok(());
            }
        }
    }

    /// Closes connection `id`: withdraws the blocked request and sets the
    /// will of each of its sessions (unless the store is shutting down).
    fn close(&mut self, id: ConnId, why: Close) {
        let Some(mut c) = self.conns.remove(&id) else { return };
        let _ = self.poll.registry().deregister(&mut c.stream);
        let peer = c.peer;
        if matches!(c.phase, Phase::Handshake { .. }) {
            self.shared.release(id);
            if let Close::Dropped(e) = &why {
                if self.shared.count_dropped() {
                    tracing::warn!(%peer, error = %e, "rendezvous store dropped a client during the handshake");
                } else {
                    tracing::debug!(%peer, error = %e, "rendezvous store dropped a client during the handshake");
                }
            }
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        match &why {
            Close::Failed(e) | Close::Dropped(e) => tracing::debug!(%peer, error = %e, "store connection failed"),
            Close::Left(e) => tracing::trace!(%peer, reason = %e, "store connection closed"),
        }
        let mut table = self.shared.table.lock();
        let sessions = std::iter::once((0, std::mem::take(&mut c.main))).chain(c.sessions.drain());
        for (session, s) in sessions {
            end_session(&mut table, id, session, s, &peer);
        }
        let mine = self.shared.route(&mut table, Some(self.index));
        drop(table);
        self.answers.extend(mine);
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// The message refusing a request of a session that is not open.
fn not_open(session: SessionId) -> String {
    if session == 0 {
        "session 0 is the connection's own: it cannot be opened or closed".into()
    } else {
        format!("session {session} is not open on this connection (open it first; a session of another connection cannot be used)")
    }
}

/// Opens session `id` on `c`, or says why not.
fn open_session(c: &mut Conn, id: SessionId) -> std::result::Result<(), String> {
    if id == 0 {
        return Err(not_open(0));
    }
    if c.sessions.contains_key(&id) {
        return Err(format!("session {id} is already open on this connection"));
    }
    if c.sessions.len() >= MAX_SESSIONS {
        return Err(format!("this connection already holds {MAX_SESSIONS} sessions, the most one may"));
    }
    c.sessions.insert(id, Session::default());
    Ok(())
}

/// Ends a session of connection `conn` (it closed, or its connection did):
/// withdraws its blocked request and sets its will.
fn end_session(table: &mut Table, conn: ConnId, session: SessionId, mut s: Session, peer: &SocketAddr) {
    if let Some((seq, blocked)) = s.blocked.take() {
        table.withdraw(Ticket { conn, session, seq }, &blocked);
    }
    if let Some((key, value)) = s.will.take() {
        if !table.is_shutting_down() {
            tracing::debug!(%peer, session, %key, "store client left; setting its will");
            table.set_if_absent(key, value);
        }
    }
}

/// What serving one request of a connection needs of its worker.
struct Serve<'a> {
    index: usize,
    shared: &'a Shared,
    timers: &'a mut Timers,
    to_drive: &'a mut Vec<ConnId>,
    answers: &'a mut Vec<(Ticket, Response)>,
    id: ConnId,
}

impl Serve<'_> {
    /// Serves one plain request `body` of session `session` of `c`
    /// (open): answers it, or records it as blocked. True when it woke
    /// blocked clients of this worker: they are answered first, and the
    /// connection is driven again afterwards.
    fn serve(&mut self, c: &mut Conn, session: SessionId, body: &[u8]) -> bool {
        c.seq += 1;
        let ticket = Ticket { conn: self.id, session, seq: c.seq };
        match Request::decode(body) {
            Ok(Request::SetWill { key, value }) => {
                if let Some(s) = c.session(session) {
                    s.will = Some((key, value));
                }
                c.answer(session, &Response::Ok);
                false
            }
            Ok(Request::ClearWill) => {
                if let Some(s) = c.session(session) {
                    s.will = None;
                }
                c.answer(session, &Response::Ok);
                false
            }
            Ok(req) => {
                let mut table = self.shared.table.lock();
                match table.apply(ticket, req) {
                    Outcome::Answer(r) => c.answer(session, &r),
                    Outcome::Blocked(on, deadline) => {
                        if let Some(s) = c.session(session) {
                            s.blocked = Some((ticket.seq, on));
                        }
                        if let Some(at) = deadline {
                            self.timers.push(Reverse((at, Timer::Blocked(ticket))));
                        }
                    }
                }
                let mine = self.shared.route(&mut table, Some(self.index));
                drop(table);
                self.woke(c, mine)
            }
            Err(detail) if session != 0 => {
                // A relay passes its ranks' bytes on unread: one rank's
                // malformed request ends its session, not the others'.
                tracing::warn!(peer = %c.peer, session, %detail, "malformed store request; closing its session");
                c.answer(session, &Response::Refused(detail));
                // The requests it had queued behind get their answers too,
                // in order: a relayed rank counts one per request.
                let queued = c.sessions.get(&session).map_or(0, |s| s.queued.len());
                let not_run = format!("not run: session {session} was closed (a malformed request before this one)");
                for _ in 0..queued {
                    c.answer(session, &Response::Refused(not_run.clone()));
                }
                self.close_session(c, session)
            }
            Err(detail) => {
                tracing::warn!(peer = %c.peer, %detail, "malformed store request; closing the connection");
                c.send(&Response::Refused(detail).encode());
                c.phase = Phase::Closing;
                self.timers.push(Reverse((Instant::now() + HANDSHAKE_TIMEOUT, Timer::Linger(self.id))));
                false
            }
        }
    }

    /// Closes session `session` of `c` (open, not 0): withdraws its blocked
    /// request, sets its will and drops the requests it had waiting. True
    /// when that woke blocked clients of this worker (see [`Serve::serve`]).
    fn close_session(&mut self, c: &mut Conn, session: SessionId) -> bool {
        let Some(s) = c.sessions.remove(&session) else { return false };
        c.queued_bytes -= s.queued.iter().map(Vec::len).sum::<usize>();
        let mut table = self.shared.table.lock();
        end_session(&mut table, self.id, session, s, &c.peer);
        let mine = self.shared.route(&mut table, Some(self.index));
        drop(table);
        self.woke(c, mine)
    }

    /// Closes session `session` of `c` (open, not 0, blocked), which holds
    /// more than the connection may queue (see [`MAX_QUEUED_BYTES`]): its
    /// blocked request is answered with a refusal saying `why`, and every
    /// request it queued, and with `overflowed` the one it is sending now,
    /// with a refusal that says it was not run, in order (a relayed rank
    /// reads its answers in the order of its requests). True as
    /// [`Serve::close_session`].
    fn close_overflowing(&mut self, c: &mut Conn, session: SessionId, why: &str, overflowed: bool) -> bool {
        let queued = c.sessions.get(&session).map_or(0, |s| s.queued.len()) + usize::from(overflowed);
        c.answer(session, &Response::Refused(why.to_string()));
        let not_run = format!("not run: session {session} was closed (it queued too many requests while blocked)");
        for _ in 0..queued {
            c.answer(session, &Response::Refused(not_run.clone()));
        }
        // Its blocked request is withdrawn: an answer already on its way
        // finds no session and is dropped, so the refusal stays its only one.
        self.close_session(c, session)
    }

    /// Hands this worker's answers that a request produced to the loop:
    /// true (the connection is driven again after them) when there are any.
    fn woke(&mut self, c: &mut Conn, mine: Vec<(Ticket, Response)>) -> bool {
        if mine.is_empty() {
            return false;
        }
        // Deliver to the clients this request woke first; this one goes on
        // afterwards.
        self.answers.extend(mine);
        self.to_drive.push(self.id);
        let _ = c.flush();
        true
    }
}

/// Why a handshake answer was refused.
enum Refusal {
    /// The proof does not hold (another secret).
    WrongSecret,
    /// Not this protocol version's answer (an older client's, say).
    OtherVersion,
}

/// Checks a handshake answer; queues the verdict and moves the connection
/// on (to `Ready`, or to `Closing` after a refusal, with whatever the client
/// sent behind its answer left unread).
fn check_proof(
    secret: &[u8],
    c: &mut Conn,
    nonce: &[u8; protocol::NONCE_LEN],
    answer: &[u8],
) -> std::result::Result<(), Refusal> {
    let verdict = if answer.len() != protocol::PREAUTH_MAX_FRAME || answer[0] != protocol::VERSION {
        Err(Refusal::OtherVersion)
    } else {
        let (client_nonce, tag) = answer[1..].split_at(protocol::NONCE_LEN);
        if protocol::verify(secret, protocol::CLIENT_LABEL, nonce, client_nonce, tag) {
            Ok(client_nonce)
        } else {
            Err(Refusal::WrongSecret)
        }
    };
    let client_nonce = match verdict {
        Ok(n) => n,
        Err(why) => {
            c.send(&[protocol::AUTH_REFUSED]);
            c.phase = Phase::Closing;
            return Err(why);
        }
    };
    let tag = protocol::proof(secret, protocol::SERVER_LABEL, client_nonce, nonce);
    let mut accept = Vec::with_capacity(1 + protocol::MAC_LEN);
    accept.push(protocol::AUTH_OK);
    accept.extend_from_slice(&tag);
    c.send(&accept);
    c.phase = Phase::Ready;
    Ok(())
}
