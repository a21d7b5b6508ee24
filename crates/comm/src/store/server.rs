//! [`StoreServer`]: serves the key table over TCP, one thread per connection.
//!
//! Before a client proves the secret it costs the server little and not for
//! long: its frames may hold at most [`protocol::PREAUTH_MAX_FRAME`] bytes,
//! the whole handshake has one deadline (not one per read, which a client
//! sending a byte a second would never hit), and at most
//! [`MAX_UNAUTHENTICATED`] connections may be in the handshake at once.
//! When that many are, the server closes the oldest of them once it has
//! been in the handshake for [`EVICT_AFTER`] (a client that holds the
//! secret answers well within that), and until then leaves the new ones in
//! the kernel's queue: thousands of ranks connecting at once all get
//! through, and a flood of idle connections cannot hold the slots.
//!
//! The listening queue is as deep as the kernel allows (`somaxconn`), so a
//! burst of connections is queued rather than dropped (a dropped SYN costs
//! a client a second before it tries again).
use std::collections::HashMap;
use std::fmt::Display;
use std::io;
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response};
use super::state::State;

/// How long a new connection has to complete the whole handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections allowed in the handshake at once; more are closed at once.
/// Clients that hold the secret finish it in a round trip, so a real job
/// never nears this; a flood of idle or slow connections cannot hold more
/// threads and descriptors than this.
pub const MAX_UNAUTHENTICATED: usize = 256;

/// How long a connection may sit in the handshake before a newer one, with
/// every slot taken, closes it.
pub const EVICT_AFTER: Duration = Duration::from_millis(250);

/// The listening queue asked of the kernel (which caps it at `somaxconn`).
const LISTEN_BACKLOG: i32 = 65535;

/// Stack of a connection's thread: it parses frames and answers requests
/// (buffers live on the heap), so thousands of them stay small.
const CONNECTION_STACK: usize = 256 << 10;

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

struct Connection {
    /// A second handle on the socket, so that shutdown can close it.
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
    /// Still in the handshake (has not proven the secret).
    pending: bool,
    /// When it was accepted.
    since: Instant,
}

struct Inner {
    state: State,
    secret: Vec<u8>,
    stop: AtomicBool,
    connections: Mutex<HashMap<u64, Connection>>,
    next_id: AtomicU64,
    limits: Limits,
    /// Connections in the handshake now.
    unauthenticated: AtomicUsize,
    /// Connections closed because too many were in the handshake.
    turned_away: AtomicU64,
    /// Clients refused or dropped during the handshake (wrong secret,
    /// oversized frame, past the deadline).
    dropped: AtomicU64,
}

/// Counts a connection in the handshake until dropped.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A rendezvous store served on background threads.
///
/// One thread accepts connections and one thread serves each authenticated
/// client. A client must prove it holds the job's secret (see the protocol in
/// the module docs) before any request; a refusal is logged with
/// `tracing::warn!` and the peer's address. Dropping the server shuts it down.
pub struct StoreServer {
    inner: Arc<Inner>,
    local_addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `addr` and starts serving; returns once the socket is bound,
    /// so clients may connect as soon as this returns.
    ///
    /// Port 0 picks a free port: read it back with [`StoreServer::local_addr`].
    /// A port already in use is [`StoreError::Bind`], whose message names the
    /// port and says to pick another or 0.
    pub fn bind(addr: impl ToSocketAddrs + Display, secret: impl AsRef<[u8]>) -> Result<Self> {
        Self::bind_with(addr, secret, Limits::default())
    }

    /// [`StoreServer::bind`] with other limits for unauthenticated clients.
    pub(crate) fn bind_with(
        addr: impl ToSocketAddrs + Display,
        secret: impl AsRef<[u8]>,
        limits: Limits,
    ) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(StoreError::EmptySecret);
        }
        let shown = addr.to_string();
        let listener = TcpListener::bind(&addr).map_err(|source| StoreError::Bind { addr: shown.clone(), source })?;
        let local_addr = listener.local_addr().map_err(|source| StoreError::Bind { addr: shown, source })?;
        deepen_backlog(&listener);
        let inner = Arc::new(Inner {
            state: State::default(),
            secret: secret.to_vec(),
            stop: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            limits,
            unauthenticated: AtomicUsize::new(0),
            turned_away: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let accept_inner = inner.clone();
        let accept = std::thread::Builder::new()
            .name("cohort-store-accept".into())
            .spawn(move || accept_loop(accept_inner, listener))
            .map_err(|source| StoreError::Bind { addr: local_addr.to_string(), source })?;
        tracing::debug!(%local_addr, "rendezvous store listening");
        Ok(StoreServer { inner, local_addr, accept: Some(accept) })
    }

    /// The address the server listens on (with the real port where 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Participants waiting in barrier `name` now.
    #[cfg(test)]
    pub(crate) fn barrier_arrivals(&self, name: &str) -> u32 {
        self.inner.state.barrier_arrivals(name)
    }

    /// Number of keys the store holds now.
    pub fn num_keys(&self) -> usize {
        self.inner.state.len()
    }

    /// Removes every key and barrier whose name does not start with `keep`.
    ///
    /// The launcher calls this between restarts, with no rank alive, so that a
    /// restarted group does not see the keys of the one before. Waiters are
    /// woken and see the change.
    pub fn reset_except(&self, keep: &str) {
        self.inner.state.reset_except(keep);
    }

    /// Stops serving: refuses new requests, answers blocked `wait`s and
    /// barriers with an error, closes every connection and joins the server's
    /// threads. Idempotent; dropping the server does the same.
    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else { return };
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.state.shut_down();
        // Wake the accept loop, which blocks in accept(): connect to it once.
        let wake = wake_addr(self.local_addr);
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
            let _ = accept.join();
        } else {
            // Unreachable from here (odd routing): leave the thread blocked
            // rather than hang; it exits at its next connection or with us.
            tracing::debug!(%wake, "could not wake the store's accept thread");
        }
        let connections: Vec<Connection> = self.inner.connections.lock().drain().map(|(_, c)| c).collect();
        for c in &connections {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        for c in connections {
            if let Some(t) = c.thread {
                let _ = t.join();
            }
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

/// Where to connect to reach a listener bound to `addr` from this host.
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    loop {
        let accepted = listener.accept();
        if inner.stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: say so, back off, go on.
                tracing::warn!(error = %e, "rendezvous store could not accept a connection");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let pending = inner.unauthenticated.fetch_add(1, Ordering::SeqCst);
        if pending >= 2 * inner.limits.unauthenticated {
            // Evicted connections not yet gone: refuse this one.
            inner.unauthenticated.fetch_sub(1, Ordering::SeqCst);
            turn_away(&inner, peer, "refused a new connection");
            drop(stream);
            continue;
        }
        if pending >= inner.limits.unauthenticated && !make_room(&inner) {
            turn_away(&inner, peer, "closed the oldest connection in the handshake");
        }
        let Ok(handle) = stream.try_clone() else {
            inner.unauthenticated.fetch_sub(1, Ordering::SeqCst);
            continue;
        };
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let connection = Connection { stream: handle, thread: None, pending: true, since: Instant::now() };
        inner.connections.lock().insert(id, connection);
        let conn_inner = inner.clone();
        let builder = std::thread::Builder::new().name(format!("cohort-store-conn-{id}")).stack_size(CONNECTION_STACK);
        let spawned = builder.spawn(move || {
            serve_connection(&conn_inner, id, stream, peer);
            conn_inner.connections.lock().remove(&id);
        });
        match spawned {
            Ok(thread) => {
                if let Some(c) = inner.connections.lock().get_mut(&id) {
                    c.thread = Some(thread);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, %peer, "rendezvous store could not start a thread; dropped the client");
                inner.connections.lock().remove(&id);
                inner.unauthenticated.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// Every handshake slot is taken: waits until one frees (returns true) or
/// the oldest connection in the handshake has been there
/// [`Limits::evict_after`], and closes that one (returns false).
fn make_room(inner: &Inner) -> bool {
    loop {
        if inner.unauthenticated.load(Ordering::SeqCst) <= inner.limits.unauthenticated
            || inner.stop.load(Ordering::SeqCst)
        {
            return true;
        }
        let mut connections = inner.connections.lock();
        let Some((_, oldest)) = connections.iter_mut().filter(|(_, c)| c.pending).min_by_key(|(id, _)| **id) else {
            return true;
        };
        let age = oldest.since.elapsed();
        if age >= inner.limits.evict_after {
            let _ = oldest.stream.shutdown(Shutdown::Both);
            // Closed: the next eviction picks the next oldest.
            oldest.pending = false;
            return false;
        }
        drop(connections);
        std::thread::sleep((inner.limits.evict_after - age).min(Duration::from_millis(1)));
    }
}

/// Counts one more event in `n`; true for the first and every 1000th, which
/// are logged at warn (the others at debug), so a flood cannot flood the log.
fn first_or_thousandth(n: &AtomicU64) -> bool {
    let n = n.fetch_add(1, Ordering::Relaxed) + 1;
    n == 1 || n % 1000 == 0
}

/// Logs that the store turned a connection away: at debug every time, at
/// warn the first time and every 1000th, so a flood cannot flood the log.
fn turn_away(inner: &Inner, peer: SocketAddr, what: &str) {
    if first_or_thousandth(&inner.turned_away) {
        tracing::warn!(
            %peer,
            "rendezvous store {what}: {} clients are in the handshake at once (a flood of connections that do \
             not prove the job secret?)",
            inner.limits.unauthenticated
        );
    } else {
        tracing::debug!(%peer, "rendezvous store {what}: too many clients in the handshake");
    }
}

/// Runs the handshake, then answers requests until the client leaves.
fn serve_connection(inner: &Inner, id: u64, mut stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let pending = Pending(&inner.unauthenticated);
    match handshake(inner, &mut stream, peer) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof || inner.stop.load(Ordering::SeqCst) => {
            tracing::debug!(%peer, error = %e, "store client left during the handshake");
            return;
        }
        Err(e) => {
            if first_or_thousandth(&inner.dropped) {
                tracing::warn!(%peer, error = %e, "rendezvous store dropped a client during the handshake");
            } else {
                tracing::debug!(%peer, error = %e, "rendezvous store dropped a client during the handshake");
            }
            return;
        }
    }
    if let Some(c) = inner.connections.lock().get_mut(&id) {
        c.pending = false;
    }
    drop(pending);
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    // A will: set this key (unless present) should the client vanish.
    let mut will: Option<(String, Vec<u8>)> = None;
    loop {
        let body = match protocol::read_frame(&mut stream) {
            Ok(b) => b,
            Err(e) => {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    tracing::debug!(%peer, error = %e, "store connection failed");
                }
                break;
            }
        };
        let response = match Request::decode(&body) {
            Ok(Request::SetWill { key, value }) => {
                will = Some((key, value));
                Response::Ok
            }
            Ok(Request::ClearWill) => {
                will = None;
                Response::Ok
            }
            Ok(req) => inner.state.apply(req, &|| client_connected(&stream)),
            Err(detail) => {
                tracing::warn!(%peer, %detail, "malformed store request; closing the connection");
                let _ = protocol::write_frame(&mut stream, &Response::Refused(detail).encode());
                break;
            }
        };
        if protocol::write_whole_frame(&mut stream, &response.encode_frame()).is_err() {
            break;
        }
    }
    if let Some((key, value)) = will {
        if !inner.state.is_shutting_down() {
            tracing::debug!(%peer, %key, "store client left; setting its will");
            inner.state.set_if_absent(key, value);
        }
    }
}

/// Whether the client of `stream` is still connected: a peek that finds
/// the connection closed (or failed) says no. Never blocks.
fn client_connected(stream: &TcpStream) -> bool {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let mut byte = 0u8;
        // SAFETY: recv writes at most 1 byte into `byte`, which outlives the
        // call; MSG_PEEK leaves the data in the socket and MSG_DONTWAIT
        // keeps it from blocking.
        let n = unsafe {
            libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        if n == 0 {
            return false;
        }
        if n < 0 {
            let err = io::Error::last_os_error();
            return matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted);
        }
        true
    }
    #[cfg(not(unix))]
    {
        let _ = stream;
        true
    }
}

/// Challenges the client; `Ok(false)` when it was refused.
fn handshake(inner: &Inner, stream: &mut TcpStream, peer: SocketAddr) -> io::Result<bool> {
    let deadline = Instant::now() + inner.limits.handshake;
    stream.set_write_timeout(Some(inner.limits.handshake))?;
    let server_nonce = protocol::nonce().map_err(|e| io::Error::other(e.to_string()))?;
    let mut hello = protocol::Encoder::default();
    hello.0.extend_from_slice(protocol::MAGIC);
    hello.u8(protocol::VERSION);
    hello.0.extend_from_slice(&server_nonce);
    protocol::write_frame(stream, &hello.0)?;

    let answer = protocol::read_frame_by(stream, protocol::PREAUTH_MAX_FRAME, deadline)?;
    let ok = answer.len() == protocol::NONCE_LEN + protocol::MAC_LEN && {
        let (client_nonce, tag) = answer.split_at(protocol::NONCE_LEN);
        protocol::verify(&inner.secret, protocol::CLIENT_LABEL, &server_nonce, client_nonce, tag)
    };
    if !ok {
        if first_or_thousandth(&inner.dropped) {
            tracing::warn!(%peer, "rendezvous store refused a client that does not hold the job secret");
        } else {
            tracing::debug!(%peer, "rendezvous store refused a client that does not hold the job secret");
        }
        let _ = protocol::write_frame(stream, &[protocol::AUTH_REFUSED]);
        return Ok(false);
    }
    let client_nonce = &answer[..protocol::NONCE_LEN];
    let tag = protocol::proof(&inner.secret, protocol::SERVER_LABEL, client_nonce, &server_nonce);
    let mut accept = vec![protocol::AUTH_OK];
    accept.extend_from_slice(&tag);
    protocol::write_frame(stream, &accept)?;
    Ok(true)
}
