//! The store's protocol without sockets, for a program that drives many
//! connections from one thread with non-blocking sockets of its own:
//! `examples/rendezvous_bench.rs` simulates thousands of ranks this way
//! (each still proves the secret and sends the requests a rank sends).
//! Everything else should use [`StoreClient`](super::StoreClient).
//!
//! Every message is a frame: a little-endian `u32` body length, then the
//! body. A connection starts with the server's greeting frame, answered by
//! [`Handshake::answer`]; the first requests may follow the answer at once
//! ([`Handshake::pipelines`]): the server's verdict, checked by
//! [`Handshake::check`], comes before their answers. Then each request frame
//! (from the functions below) gets one answer frame, read by
//! [`parse_answer`].

use std::time::Duration;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response};

/// The protocol version before requests could follow the proof: a raw
/// client answers its greeting too (waiting for the verdict before its
/// first request), so a benchmark can compare this store with an older
/// build's.
const PREVIOUS_VERSION: u8 = 1;

/// The protocol version before sessions: its handshake and requests are
/// this one's, so a raw client speaks it to an older build's store too.
const PIPELINED_VERSION: u8 = 2;

/// The client's side of one connection's handshake.
pub struct Handshake {
    server_nonce: [u8; protocol::NONCE_LEN],
    client_nonce: [u8; protocol::NONCE_LEN],
    version: u8,
}

impl Handshake {
    /// Answers the server's greeting (a frame's body) with the proof of
    /// `secret`; returns the handshake and the whole frame to send. A
    /// greeting of this protocol's version, or of the two before it, is
    /// answered in its own version; any other is an error naming it.
    pub fn answer(secret: &[u8], greeting: &[u8]) -> Result<(Handshake, Vec<u8>)> {
        let magic = protocol::MAGIC.len();
        let error = |detail: String| StoreError::Protocol { addr: "(raw)".into(), detail };
        let version = match greeting.get(magic) {
            Some(&v @ (PREVIOUS_VERSION | PIPELINED_VERSION)) if greeting[..magic] == protocol::MAGIC[..] => v,
            _ => {
                protocol::parse_greeting(greeting).map_err(error)?;
                protocol::VERSION
            }
        };
        let server_nonce: [u8; protocol::NONCE_LEN] = greeting[magic + 1..]
            .try_into()
            .map_err(|_| error("the server's greeting is not a cohort store's".into()))?;
        let (client_nonce, mut body) = protocol::client_answer(secret, &server_nonce)?;
        if version == PREVIOUS_VERSION {
            // Its answer had no version byte.
            body.remove(0);
        } else {
            body[0] = version;
        }
        Ok((Handshake { server_nonce, client_nonce, version }, frame(&body)))
    }

    /// Whether requests may follow the answer at once (the server's
    /// version reads them after the proof); otherwise wait for the verdict.
    pub fn pipelines(&self) -> bool {
        self.version != PREVIOUS_VERSION
    }

    /// Checks the server's verdict (a frame's body): accepted, and by a
    /// server that holds `secret` too.
    pub fn check(&self, secret: &[u8], verdict: &[u8]) -> Result<()> {
        let addr = "(raw)".to_string();
        match protocol::read_verdict(secret, &self.client_nonce, &self.server_nonce, verdict) {
            protocol::Verdict::Accepted => Ok(()),
            protocol::Verdict::NotAuthentic => Err(StoreError::ServerNotAuthentic { addr }),
            protocol::Verdict::Refused | protocol::Verdict::Malformed => Err(StoreError::AuthRefused { addr }),
        }
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The frame of [`StoreClient::set`](super::StoreClient::set).
pub fn set(key: &str, value: &[u8]) -> Vec<u8> {
    frame(&Request::Set { key: key.into(), value: value.to_vec() }.encode())
}

/// The frame of [`StoreClient::append`](super::StoreClient::append).
pub fn append(key: &str, value: &[u8]) -> Vec<u8> {
    frame(&Request::Append { key: key.into(), value: value.to_vec() }.encode())
}

/// The frame of [`StoreClient::multi_get`](super::StoreClient::multi_get).
pub fn multi_get(keys: &[&str]) -> Vec<u8> {
    frame(&Request::MultiGet { keys: keys.iter().map(|k| k.to_string()).collect() }.encode())
}

/// The frame of [`StoreClient::barrier`](super::StoreClient::barrier).
pub fn barrier(name: &str, world_size: u32, timeout: Duration) -> Vec<u8> {
    frame(&Request::Barrier { name: name.into(), world_size, timeout_ms: millis(timeout) }.encode())
}

/// The frame of [`StoreClient::barrier_get`](super::StoreClient::barrier_get).
pub fn barrier_get(name: &str, world_size: u32, timeout: Duration, keys: &[&str]) -> Vec<u8> {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    frame(&Request::BarrierGet { name: name.into(), world_size, timeout_ms: millis(timeout), keys }.encode())
}

/// A request's answer, as far as a raw client needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Done (set, append, barrier).
    Ok,
    /// The values asked (multi-get, barrier_get), `None` where not set.
    Values(Vec<Option<Vec<u8>>>),
    /// Anything else: what the server said.
    Other(String),
}

/// Reads an answer frame's body.
pub fn parse_answer(body: &[u8]) -> Answer {
    match Response::decode(body) {
        Ok(Response::Ok) => Answer::Ok,
        Ok(Response::Values(values)) => Answer::Values(
            values
                .into_iter()
                .map(|v| v.map(|v| std::sync::Arc::try_unwrap(v).unwrap_or_else(|v| v.to_vec())))
                .collect(),
        ),
        Ok(other) => Answer::Other(format!("{other:?}")),
        Err(detail) => Answer::Other(format!("malformed answer: {detail}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;
    use std::io::{Read, Write};

    fn read_frame(s: &mut std::net::TcpStream) -> Vec<u8> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        body
    }

    #[test]
    fn store_raw_frames_drive_a_real_server() {
        let server = StoreServer::bind("127.0.0.1:0", "raw-secret").unwrap();
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        let (hs, answer) = Handshake::answer(b"raw-secret", &read_frame(&mut s)).unwrap();
        s.write_all(&answer).unwrap();
        hs.check(b"raw-secret", &read_frame(&mut s)).unwrap();
        // A verdict for another secret is not authentic.
        assert!(hs.check(b"other", &[protocol::AUTH_OK; 33]).is_err());
        s.write_all(&append("dir", b"0 a\n")).unwrap();
        assert_eq!(parse_answer(&read_frame(&mut s)), Answer::Ok);
        s.write_all(&set("job", b"j")).unwrap();
        assert_eq!(parse_answer(&read_frame(&mut s)), Answer::Ok);
        s.write_all(&barrier_get("b", 1, Duration::from_secs(5), &["job", "dir", "none"])).unwrap();
        assert_eq!(
            parse_answer(&read_frame(&mut s)),
            Answer::Values(vec![Some(b"j".to_vec()), Some(b"0 a\n".to_vec()), None])
        );
        s.write_all(&barrier("b", 1, Duration::from_secs(5))).unwrap();
        assert_eq!(parse_answer(&read_frame(&mut s)), Answer::Ok);
        s.write_all(&multi_get(&["job"])).unwrap();
        assert_eq!(parse_answer(&read_frame(&mut s)), Answer::Values(vec![Some(b"j".to_vec())]));
        // Pipelined: the proof and a request in one write; the verdict
        // comes first, then the answer.
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        let (hs, mut out) = Handshake::answer(b"raw-secret", &read_frame(&mut s)).unwrap();
        assert!(hs.pipelines());
        out.extend(multi_get(&["job"]));
        s.write_all(&out).unwrap();
        hs.check(b"raw-secret", &read_frame(&mut s)).unwrap();
        assert_eq!(parse_answer(&read_frame(&mut s)), Answer::Values(vec![Some(b"j".to_vec())]));
        // A greeting of the previous version is answered in its shape (no
        // version byte), one of an unknown version is an error naming it.
        let mut old = protocol::MAGIC.to_vec();
        old.push(PREVIOUS_VERSION);
        old.extend_from_slice(&[1u8; protocol::NONCE_LEN]);
        let (hs, answer) = Handshake::answer(b"x", &old).unwrap();
        assert!(!hs.pipelines());
        assert_eq!(answer.len(), 4 + protocol::NONCE_LEN + protocol::MAC_LEN);
        old[protocol::MAGIC.len()] = 9;
        let err = Handshake::answer(b"x", &old).err().expect("version 9 is refused").to_string();
        assert!(err.contains("protocol version 9"), "{err}");
        // A wrong secret is refused.
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        let (hs, answer) = Handshake::answer(b"wrong", &read_frame(&mut s)).unwrap();
        s.write_all(&answer).unwrap();
        assert!(matches!(hs.check(b"wrong", &read_frame(&mut s)), Err(StoreError::AuthRefused { .. })));
        assert!(Handshake::answer(b"x", b"not a greeting").is_err());
    }
}
