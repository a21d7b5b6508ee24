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
/// A thread accepts on the rank's listener, reads each connection's hello
/// (10 s at most), drops those without this job's token or from a rank not
/// expected or already filed, and files the others. Dropping the last
/// handle stops the thread (it is woken by a connection to itself).
pub(crate) struct LinkAcceptor {
    filed: Arc<Mutex<HashMap<usize, TcpStream>>>,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl LinkAcceptor {
    /// Starts accepting on `listener` the ranks in `wanted` (each once).
    pub(crate) fn start(listener: TcpListener, token: [u8; TOKEN_LEN], wanted: Vec<usize>) -> io::Result<Arc<Self>> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(false)?;
        let filed: Arc<Mutex<HashMap<usize, TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (f, s) = (filed.clone(), stop.clone());
        std::thread::Builder::new()
            .name("cohort-tcp-accept".into())
            .spawn(move || accept_in_background(listener, token, wanted, f, s))?;
        Ok(Arc::new(LinkAcceptor { filed, stop, addr }))
    }

    /// The connection rank `peer` made, if it came.
    fn take(&self, peer: usize) -> Option<TcpStream> {
        self.filed.lock().remove(&peer)
    }
}

impl Drop for LinkAcceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the thread out of accept(); it sees `stop` and ends.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
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
    while seen.len() < wanted.len() {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (mut stream, from) = match accepted {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "could not accept a data connection; retrying");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut hello = [0u8; TOKEN_LEN + 8];
        let ok = stream.read_exact(&mut hello).is_ok() && hello[..TOKEN_LEN] == token[..];
        let rank = u64::from_le_bytes(hello[TOKEN_LEN..].try_into().expect("8 bytes")) as usize;
        if !ok || !wanted.contains(&rank) || seen.contains(&rank) {
            tracing::warn!(%from, "refused a data connection without this job's link token");
            continue;
        }
        seen.push(rank);
        filed.lock().insert(rank, stream);
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

    /// Drives `send` into `to` and `from` until `want` bytes arrived, or
    /// panics after 10 s.
    fn pass(from: &mut LazyTcpLink, to: &mut LazyTcpLink, data: &[u8]) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(10);
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
}
