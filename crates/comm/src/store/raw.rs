//! The store's protocol without sockets, for a program that drives many
//! connections from one thread with non-blocking sockets of its own:
//! `examples/rendezvous_bench.rs` simulates thousands of ranks this way
//! (each still proves the secret and sends the requests a rank sends).
//! Everything else should use [`StoreClient`](super::StoreClient).
//!
//! Every message is a frame: a little-endian `u32` body length, then the
//! body. A connection starts with the server's greeting frame, answered by
//! [`Handshake::answer`]; the server's verdict is checked by
//! [`Handshake::check`]. Then each request frame (from the functions
//! below) gets one answer frame, read by [`parse_answer`].

use std::time::Duration;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response};

/// The client's side of one connection's handshake.
pub struct Handshake {
    server_nonce: Vec<u8>,
    client_nonce: [u8; protocol::NONCE_LEN],
}

impl Handshake {
    /// Answers the server's greeting (a frame's body) with the proof of
    /// `secret`; returns the handshake and the whole frame to send.
    pub fn answer(secret: &[u8], greeting: &[u8]) -> Result<(Handshake, Vec<u8>)> {
        let magic = protocol::MAGIC.len();
        if greeting.len() != magic + 1 + protocol::NONCE_LEN || &greeting[..magic] != protocol::MAGIC {
            return Err(StoreError::Protocol {
                addr: "(raw)".into(),
                detail: "the server's greeting is not a cohort store's".into(),
            });
        }
        let server_nonce = greeting[magic + 1..].to_vec();
        let client_nonce = protocol::nonce()?;
        let tag = protocol::proof(secret, protocol::CLIENT_LABEL, &server_nonce, &client_nonce);
        let mut body = client_nonce.to_vec();
        body.extend_from_slice(&tag);
        Ok((Handshake { server_nonce, client_nonce }, frame(&body)))
    }

    /// Checks the server's verdict (a frame's body): accepted, and by a
    /// server that holds `secret` too.
    pub fn check(&self, secret: &[u8], verdict: &[u8]) -> Result<()> {
        match verdict.first() {
            Some(&protocol::AUTH_OK)
                if verdict.len() == 1 + protocol::MAC_LEN
                    && protocol::verify(
                        secret,
                        protocol::SERVER_LABEL,
                        &self.client_nonce,
                        &self.server_nonce,
                        &verdict[1..],
                    ) =>
            {
                Ok(())
            }
            Some(&protocol::AUTH_OK) => Err(StoreError::ServerNotAuthentic { addr: "(raw)".into() }),
            _ => Err(StoreError::AuthRefused { addr: "(raw)".into() }),
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
        // A wrong secret is refused.
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        let (hs, answer) = Handshake::answer(b"wrong", &read_frame(&mut s)).unwrap();
        s.write_all(&answer).unwrap();
        assert!(matches!(hs.check(b"wrong", &read_frame(&mut s)), Err(StoreError::AuthRefused { .. })));
        assert!(Handshake::answer(b"x", b"not a greeting").is_err());
    }
}
