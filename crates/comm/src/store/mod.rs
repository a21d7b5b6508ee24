//! The rendezvous store: a small TCP key-value store that the launcher serves
//! and every rank of a job talks to while it forms its communicators.
//!
//! It is the counterpart of torch.distributed's `TCPStore`: `set`, `get`,
//! `multi_get`, `append`, `wait` (with a timeout that names the missing keys), `add` (an atomic
//! counter), `compare_set`, `delete`, a reusable `barrier` and `barrier_get`
//! (a barrier that answers the values of some keys as they were when it
//! opened, to every participant, in one round trip), plus a *will*
//! (a key the server sets when a client vanishes) so that peers learn of a
//! dead process without waiting for a timeout.
//!
//! Every connection proves it holds the job's secret before any of its
//! requests is executed, by an HMAC-SHA256 challenge–response over nonces of
//! both sides: the secret never crosses the wire, a client with the wrong
//! secret is refused (and the server logs the refusal with the peer's
//! address) with nothing it sent executed, and the client checks that the
//! server holds the secret too before it trusts an answer. The first
//! requests may travel right behind the proof
//! ([`StoreClient::connect_pipelined`]): connecting and a first request take
//! one round trip together once the server's greeting is in.
//!
//! ```no_run
//! use std::time::Duration;
//! use cohort_comm::store::{StoreClient, StoreServer};
//!
//! fn main() -> Result<(), cohort_comm::store::StoreError> {
//!     let server = StoreServer::bind("127.0.0.1:0", "job-secret")?;
//!     let client = StoreClient::connect(server.local_addr(), "job-secret", Duration::from_secs(30))?;
//!     client.set("nccl/unique_id", b"...")?;
//!     client.wait(&["nccl/unique_id"], Duration::from_secs(60))?;
//!     client.barrier("init", 1, Duration::from_secs(60))?;
//!     Ok(())
//! }
//! ```
//!
//! One thread accepts connections and a few workers (one per two cores, at
//! most 8) run each connection's handshake and requests as an event loop
//! over non-blocking sockets: a client blocked in `wait` or `barrier` costs
//! the server no thread, so one store serves tens of thousands of ranks.
//!
//! A node's launcher may serve its ranks through a [`StoreRelay`]: one
//! connection to the store carries every local rank's requests, each rank
//! a session of it (its own blocking requests, will and barrier place),
//! and each rank reaches the relay over an inherited socket pair with no
//! handshake ([`StoreClient::connect_rank`] reads `COHORT_STORE_FD`).
//!
//! Wire format and handshake: see the `protocol` module's source; [`raw`]
//! builds and reads frames for programs that drive their own sockets.

mod client;
mod descriptors;
mod error;
mod protocol;
mod rank_sockets;
pub mod raw;
mod relay;
mod server;
mod state;

#[cfg(test)]
mod tests;

pub(crate) use client::dropped as peer_gone;
pub(crate) use client::{await_name, UNKNOWN_NAME_GRACE};
#[cfg(test)]
pub(crate) use client::{resolve_addrs, Unresolved};
pub use client::{CompareSet, StoreClient};
pub use descriptors::reserve_descriptors;
pub use error::{Result, StoreError};
pub use protocol::{MAX_FRAME, MAX_KEY, MAX_VALUE, PREAUTH_MAX_FRAME, SESSION_OVERHEAD};
pub use relay::{StoreRelay, UnjoinedRelay, MAX_RELAYED_FRAME, MAX_RELAY_HELD};
pub use server::{StoreServer, MAX_UNAUTHENTICATED, MAX_WORKERS};

/// Returns a fresh random job secret: 32 bytes from the operating system, as
/// 64 hex digits (printable, so it can travel in `COHORT_JOB_SECRET`).
pub fn generate_secret() -> Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| StoreError::Random(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
