//! TCP links between ranks of different nodes.
//!
//! Rank `r` connects to every other-node rank below it and accepts from
//! every one above it. A connecting rank opens with a hello: the job's
//! link token (16 random bytes that rank 0 published through the
//! authenticated store) and its rank; the accepting rank drops any
//! connection whose token is wrong, so only ranks of this job can join.
//! Sockets are then non-blocking, with Nagle's algorithm off.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

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

/// Connects to `addr` (rank `peer`) before `deadline`, retrying refused
/// attempts, and says hello as rank `me`.
pub(crate) fn connect(addr: &str, me: usize, token: &[u8; TOKEN_LEN], deadline: Instant) -> io::Result<TcpLink> {
    let mut backoff = Duration::from_millis(1);
    let mut stream = loop {
        let addrs: Vec<_> = std::net::ToSocketAddrs::to_socket_addrs(addr)?.collect();
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
        match addrs.first().map(|a| TcpStream::connect_timeout(a, left.min(Duration::from_secs(5)))) {
            Some(Ok(s)) => break s,
            Some(Err(e)) if Instant::now() >= deadline => return Err(e),
            None => return Err(io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to nothing"))),
            Some(Err(_)) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
        }
    };
    let mut hello = token.to_vec();
    hello.extend_from_slice(&(me as u64).to_le_bytes());
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(&hello)?;
    TcpLink::new(stream)
}

/// Accepts connections on `listener` until `expect(rank)` accepted one link
/// from every rank it wants, or `deadline` passes; drops connections with a
/// wrong token. Returns `(rank, link)` pairs.
pub(crate) fn accept(
    listener: &TcpListener,
    token: &[u8; TOKEN_LEN],
    wanted: &[usize],
    deadline: Instant,
) -> io::Result<Vec<(usize, TcpLink)>> {
    listener.set_nonblocking(true)?;
    let mut links: Vec<(usize, TcpLink)> = Vec::new();
    while links.len() < wanted.len() {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut hello = [0u8; TOKEN_LEN + 8];
                let ok = stream.read_exact(&mut hello).is_ok() && hello[..TOKEN_LEN] == token[..];
                let rank = u64::from_le_bytes(hello[TOKEN_LEN..].try_into().expect("8 bytes")) as usize;
                if !ok || !wanted.contains(&rank) || links.iter().any(|(r, _)| *r == rank) {
                    tracing::warn!(%from, "refused a data connection without this job's link token");
                    continue;
                }
                links.push((rank, TcpLink::new(stream)?));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> =
                        wanted.iter().filter(|w| !links.iter().any(|(r, _)| r == *w)).map(|r| r.to_string()).collect();
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("ranks {} never connected", missing.join(", ")),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(links)
}
