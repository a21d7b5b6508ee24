//! TCP links between ranks of different nodes.
//!
//! Rank `r` connects to other-node ranks below it and accepts from those
//! above it, when a collective first uses the link ([`LazyTcpLink`]), so
//! forming a communicator opens no socket to another node and a rank holds
//! sockets only to the peers its collectives talk to. A connecting rank opens with a hello: the job's
//! link token (16 random bytes that rank 0 published through the
//! authenticated store) and its rank; the accepting rank drops any
//! connection whose token is wrong, so only ranks of this job can join.
//! Sockets are then non-blocking, with Nagle's algorithm off.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Link;

/// Bytes of the link token.
pub(crate) const TOKEN_LEN: usize = 16;

/// Bytes of the receive buffer of one link.
const RECV_BUFFER: usize = 256 * 1024;

/// A TCP link to one peer.
pub(crate) struct TcpLink {
    stream: TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl TcpLink {
    fn new(stream: TcpStream) -> io::Result<TcpLink> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(TcpLink { stream, buf: vec![0; RECV_BUFFER].into_boxed_slice(), start: 0, end: 0 })
    }
}

impl Link for TcpLink {
    fn try_send(&mut self, data: &[u8]) -> io::Result<usize> {
        match self.stream.write(data) {
            Ok(0) if !data.is_empty() => Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            match self.stream.read(&mut self.buf) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection")),
                Ok(n) => self.end = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                    return Ok(0)
                }
                Err(e) => return Err(e),
            }
        }
        let used = take(&self.buf[self.start..self.end]);
        self.start += used;
        Ok(used)
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }
}

/// Connections from higher ranks of other nodes, accepted in the background
/// and filed by rank until their links take them (links formed on first use).
///
/// A thread accepts on the rank's listener and reads every connection's
/// hello side by side (each gets [`HELLO_WAIT`]; at most [`MAX_PENDING`]
/// wait at once, the oldest dropped for a newer one), so connections that
/// send nothing or trickle bytes cannot hold up a real rank's. It drops
/// those without this job's token or from a rank not expected or already
/// filed, files the others, and closes the listener once every expected
/// rank is filed. Dropping the last handle stops the thread (it looks every
/// [`ACCEPT_POLL`]).
pub(crate) struct LinkAcceptor {
    filed: Arc<Mutex<HashMap<usize, TcpStream>>>,
    stop: Arc<AtomicBool>,
}

/// How long a connection may take to send its hello.
const HELLO_WAIT: Duration = Duration::from_secs(10);

/// Connections whose hello the acceptor waits for at once.
const MAX_PENDING: usize = 64;

/// How often the acceptor looks at its stop flag and the hellos' deadlines.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

/// Bytes of a hello: the token, then the rank (u64, little-endian).
const HELLO_LEN: usize = TOKEN_LEN + 8;

impl LinkAcceptor {
    /// Starts accepting on `listener` the ranks in `wanted` (each once).
    pub(crate) fn start(listener: TcpListener, token: [u8; TOKEN_LEN], wanted: Vec<usize>) -> io::Result<Arc<Self>> {
        listener.set_nonblocking(true)?;
        let filed: Arc<Mutex<HashMap<usize, TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (f, s) = (filed.clone(), stop.clone());
        std::thread::Builder::new()
            .name("cohort-tcp-accept".into())
            .spawn(move || accept_in_background(listener, token, wanted, f, s))?;
        Ok(Arc::new(LinkAcceptor { filed, stop }))
    }

    /// The connection rank `peer` made, if it came.
    fn take(&self, peer: usize) -> Option<TcpStream> {
        self.filed.lock().remove(&peer)
    }
}

impl Drop for LinkAcceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A connection whose hello has not all arrived.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    hello: [u8; HELLO_LEN],
    got: usize,
    since: Instant,
}

/// Waits up to `wait` until `listener` or one of `pending` has something to
/// read (or was closed); `[listener ready, pending ready...]`.
fn poll_readable(listener: &TcpListener, pending: &[Pending], wait: Duration) -> Vec<bool> {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
        .chain(pending.iter().map(|p| p.stream.as_raw_fd()))
        .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
        .collect();
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs that
    // outlives the call; every descriptor in it is open (owned by
    // `listener` and `pending`, borrowed for the call).
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait.as_millis() as libc::c_int) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    fds.iter().map(|f| f.revents != 0).collect()
}

impl Pending {
    /// Reads what has arrived of the hello (never blocks); false once the
    /// connection closed or failed.
    fn read_more(&mut self) -> bool {
        match self.stream.read(&mut self.hello[self.got..]) {
            Ok(0) => false,
            Ok(n) => {
                self.got += n;
                true
            }
            Err(e) => matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted),
        }
    }
}

fn accept_in_background(
    listener: TcpListener,
    token: [u8; TOKEN_LEN],
    wanted: Vec<usize>,
    filed: Arc<Mutex<HashMap<usize, TcpStream>>>,
    stop: Arc<AtomicBool>,
) {
    let mut seen: Vec<usize> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    // Connections dropped so far; warned of at 1, 2, 4, 8, ... so that a
    // stream of strangers cannot flood the log.
    let mut dropped = 0u64;
    let mut drop_one = |from: SocketAddr, why: &str| {
        dropped += 1;
        if dropped.is_power_of_two() {
            tracing::warn!(%from, dropped, "dropped a data connection: {why}");
        }
    };
    // Files a connection whose hello is complete, drops one that cannot
    // become a link; returns those still waiting for their hello.
    let settle = |p: Pending, seen: &mut Vec<usize>, drop_one: &mut dyn FnMut(SocketAddr, &str)| {
        if p.got < HELLO_LEN {
            if p.since.elapsed() < HELLO_WAIT {
                return Some(p);
            }
            drop_one(p.from, "it sent no hello in time");
            return None;
        }
        let rank = u64::from_le_bytes(p.hello[TOKEN_LEN..].try_into().expect("8 bytes"));
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        if p.hello[..TOKEN_LEN] != token[..] || !wanted.contains(&rank) || seen.contains(&rank) {
            drop_one(p.from, "its hello has not this job's link token, or names a rank not expected");
            return None;
        }
        seen.push(rank);
        filed.lock().insert(rank, p.stream);
        None
    };
    while seen.len() < wanted.len() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let ready = poll_readable(&listener, &pending, ACCEPT_POLL);
        // Read what arrived of each hello; keep those still incomplete.
        let mut still = Vec::with_capacity(pending.len());
        for (mut p, ready) in pending.drain(..).zip(ready[1..].iter()) {
            if *ready && !p.read_more() {
                continue;
            }
            still.extend(settle(p, &mut seen, &mut drop_one));
        }
        pending = still;
        if !ready[0] {
            continue;
        }
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    // A rank sends its hello with the connection: read it
                    // now, so a crowd of strangers arriving behind it cannot
                    // push it out of the waiting list first.
                    let mut p = Pending { stream, from, hello: [0; HELLO_LEN], got: 0, since: Instant::now() };
                    if !p.read_more() {
                        continue;
                    }
                    let Some(p) = settle(p, &mut seen, &mut drop_one) else { continue };
                    if pending.len() == MAX_PENDING {
                        let oldest = pending.remove(0);
                        drop_one(oldest.from, "it had no hello yet and too many connections wait");
                    }
                    pending.push(p);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not accept a data connection; retrying");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }
}

/// Where a link formed on first use stands.
enum Lazy {
    /// This rank connects (the peer is lower): it reads the peer's address
    /// from the store, then connects, retrying from `next_try`.
    Dial {
        address: Box<dyn FnMut() -> io::Result<Option<String>> + Send>,
        next_try: Instant,
        backoff: Duration,
    },
    /// The peer connects (it is higher): its connection is filed here.
    Await(Arc<LinkAcceptor>),
    Up(TcpLink),
}

/// A TCP link to a rank of another node, connected when a collective first
/// uses it: until then `try_send` and `try_recv` move nothing (the
/// collective waits with its deadline and the job's abort, as for a slow
/// peer), while the higher rank of the two connects and the lower one's
/// [`LinkAcceptor`] files the connection.
pub(crate) struct LazyTcpLink {
    me: usize,
    peer: usize,
    token: [u8; TOKEN_LEN],
    state: Lazy,
}

impl LazyTcpLink {
    /// A link that connects to a lower rank once its address (read by
    /// `address`: `None` while the peer has not published it) is known.
    pub(crate) fn dial(
        me: usize,
        peer: usize,
        token: [u8; TOKEN_LEN],
        address: impl FnMut() -> io::Result<Option<String>> + Send + 'static,
    ) -> LazyTcpLink {
        let state =
            Lazy::Dial { address: Box::new(address), next_try: Instant::now(), backoff: Duration::from_millis(1) };
        LazyTcpLink { me, peer, token, state }
    }

    /// A link that a higher rank `peer` connects, filed by `acceptor`.
    pub(crate) fn accept(me: usize, peer: usize, acceptor: Arc<LinkAcceptor>) -> LazyTcpLink {
        LazyTcpLink { me, peer, token: [0; TOKEN_LEN], state: Lazy::Await(acceptor) }
    }

    /// Moves towards a connection; the link once up.
    fn up(&mut self) -> io::Result<Option<&mut TcpLink>> {
        match &mut self.state {
            Lazy::Up(_) => {}
            Lazy::Await(acceptor) => {
                let Some(stream) = acceptor.take(self.peer) else { return Ok(None) };
                self.state = Lazy::Up(TcpLink::new(stream)?);
            }
            Lazy::Dial { address, next_try, backoff } => {
                if Instant::now() < *next_try {
                    return Ok(None);
                }
                let connected = match address()? {
                    Some(addr) => try_dial(&addr, self.me, &self.token),
                    None => Ok(None),
                };
                match connected? {
                    Some(link) => self.state = Lazy::Up(link),
                    None => {
                        *next_try = Instant::now() + *backoff;
                        *backoff = (*backoff * 2).min(Duration::from_millis(100));
                        return Ok(None);
                    }
                }
            }
        }
        match &mut self.state {
            Lazy::Up(link) => Ok(Some(link)),
            _ => Ok(None),
        }
    }
}

/// One attempt to connect to `addr` and say hello as rank `me`: `Ok(None)`
/// when nobody listens there yet (refused, timed out).
fn try_dial(addr: &str, me: usize, token: &[u8; TOKEN_LEN]) -> io::Result<Option<TcpLink>> {
    let Some(a) = std::net::ToSocketAddrs::to_socket_addrs(addr)?.next() else {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to nothing")));
    };
    let mut stream = match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut hello = token.to_vec();
    hello.extend_from_slice(&(me as u64).to_le_bytes());
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(&hello)?;
    TcpLink::new(stream).map(Some)
}

impl Link for LazyTcpLink {
    fn try_send(&mut self, data: &[u8]) -> io::Result<usize> {
        match self.up()? {
            Some(link) => link.try_send(data),
            None => Ok(0),
        }
    }

    fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        match self.up()? {
            Some(link) => link.try_recv(take),
            None => Ok(0),
        }
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `data` from `from` to `to` until all of it arrived, or panics
    /// after 60 s (a guard against a hang, not a speed check: a test that
    /// cares how soon bounds it itself).
    fn pass(from: &mut LazyTcpLink, to: &mut LazyTcpLink, data: &[u8]) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut sent, mut got) = (0, Vec::new());
        while got.len() < data.len() {
            assert!(Instant::now() < deadline, "sent {sent}, got {} of {} bytes", got.len(), data.len());
            sent += from.try_send(&data[sent..]).unwrap();
            to.try_recv(&mut |b| {
                got.extend_from_slice(b);
                b.len()
            })
            .unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        got
    }

    #[test]
    fn links_connect_on_first_use_and_refuse_a_wrong_token() {
        let token = [7u8; TOKEN_LEN];
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let acceptor = LinkAcceptor::start(listener, token, vec![3]).unwrap();
        let mut lower = LazyTcpLink::accept(0, 3, acceptor.clone());
        // Nothing moves before the higher rank connects.
        assert_eq!(lower.try_recv(&mut |b| b.len()).unwrap(), 0);
        assert_eq!(lower.try_send(b"x").unwrap(), 0);
        // A stranger claiming rank 3 without the token is not filed.
        let mut stranger = TcpStream::connect(&addr).unwrap();
        let mut hello = vec![0u8; TOKEN_LEN];
        hello.extend_from_slice(&3u64.to_le_bytes());
        stranger.write_all(&hello).unwrap();
        // The address is not published for the first few looks.
        let mut looks = 0;
        let published = addr.clone();
        let mut higher = LazyTcpLink::dial(3, 0, token, move || {
            looks += 1;
            Ok((looks > 3).then(|| published.clone()))
        });
        assert_eq!(pass(&mut higher, &mut lower, b"from rank 3"), b"from rank 3");
        assert_eq!(pass(&mut lower, &mut higher, b"from rank 0"), b"from rank 0");
        // The stranger's connection was closed, not answered.
        stranger.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 8];
        assert!(matches!(stranger.read(&mut buf), Ok(0) | Err(_)));
    }

    /// A hostile or careless neighbour on a rank's link port: connections
    /// that send nothing, the right length of garbage, a wrong token
    /// claiming an expected rank, one claiming a rank out of range, a flood
    /// of bytes, and a thousand connections at once. The real higher rank's
    /// link comes up before a single stranger's hello wait (`HELLO_WAIT`,
    /// 10 s) could have run out, so no stranger held it up, and once every
    /// expected rank is filed the port is closed. The order is what is
    /// checked, not the speed: it takes milliseconds, but a connection
    /// attempt the kernel drops while the crowd fills the listen queue is
    /// sent again only after a second, and a loaded machine adds more.
    #[test]
    fn strangers_on_the_link_port_do_not_hold_up_the_real_ranks() {
        let token = [9u8; TOKEN_LEN];
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = LinkAcceptor::start(listener, token, vec![3]).unwrap();
        let mut lower = LazyTcpLink::accept(0, 3, acceptor.clone());
        let mut strangers: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let hello = |token: &[u8], rank: u64| {
            let mut h = token.to_vec();
            h.extend_from_slice(&rank.to_le_bytes());
            h
        };
        let mut say = |bytes: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(bytes);
            strangers.push(s);
        };
        say(&[0xa5; TOKEN_LEN + 8]);
        say(&hello(&[0; TOKEN_LEN], 3));
        say(&hello(&token[..TOKEN_LEN - 1], 3));
        say(&hello(&[1; TOKEN_LEN], u64::MAX));
        say(&vec![0xff; 1 << 20]);
        // And a crowd that keeps arriving while the real rank connects.
        let crowd_stop = Arc::new(AtomicBool::new(false));
        let crowd = {
            let stop = crowd_stop.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                while !stop.load(Ordering::SeqCst) && held.len() < 2000 {
                    held.extend(TcpStream::connect_timeout(&addr, Duration::from_millis(100)).ok());
                }
                held.len()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        let mut higher = LazyTcpLink::dial(3, 0, token, move || Ok(Some(addr.to_string())));
        assert_eq!(pass(&mut higher, &mut lower, b"from rank 3"), b"from rank 3");
        assert!(started.elapsed() < HELLO_WAIT, "the link took {:?}: it waited for a stranger", started.elapsed());
        crowd_stop.store(true, Ordering::SeqCst);
        assert!(crowd.join().unwrap() > 0);
        assert_eq!(pass(&mut lower, &mut higher, b"from rank 0"), b"from rank 0");
        // Every expected rank is in: the port closes.
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(addr).is_ok() {
            assert!(Instant::now() < deadline, "the link port still accepts after every rank linked");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(strangers);
    }
}
