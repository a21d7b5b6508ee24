//! Errors of the rendezvous store, each saying what to do about it.

use std::io;
use std::time::Duration;

/// What went wrong talking to (or serving) a rendezvous store.
///
/// Every message names the store's address where it is known and says what
/// the user can do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The job secret was empty.
    #[error(
        "the rendezvous store needs a non-empty job secret: set COHORT_JOB_SECRET \
         (the launcher sets it for its ranks)"
    )]
    EmptySecret,

    /// The server could not listen on the address.
    #[error("{}", bind_message(addr, source))]
    Bind {
        /// The address the server tried to listen on.
        addr: String,
        /// The operating system's reason.
        #[source]
        source: io::Error,
    },

    /// No connection could be made within the timeout.
    #[error(
        "could not reach the rendezvous store at {addr} within {waited:.1?}: {source}; check that \
         the launcher of node 0 is running and that COHORT_STORE_ADDR (`cohort run`'s \
         --master-addr and --store-port; MASTER_ADDR/MASTER_PORT without a launcher) points at it"
    )]
    Connect {
        /// The store's address.
        addr: String,
        /// How long the client kept trying.
        waited: Duration,
        /// The last failure seen.
        #[source]
        source: io::Error,
    },

    /// The store's address does not resolve (by the rule of the client's
    /// `resolve_addrs`): at once when it is not `host:port`, after 60 s of
    /// lookups (at most the timeout) when the resolver does not know the
    /// host's name.
    #[error(
        "the rendezvous store's address {addr} does not resolve to any address: {source}; check the host name \
         in COHORT_STORE_ADDR (`cohort run`'s --master-addr or --store-addr; MASTER_ADDR without a launcher)"
    )]
    Unresolvable {
        /// The store's address.
        addr: String,
        /// The resolver's answer.
        #[source]
        source: io::Error,
    },

    /// The store refused this client's proof of the job secret.
    #[error(
        "the rendezvous store at {addr} refused this client: its job secret is not the job's; \
         export the same COHORT_JOB_SECRET on every node (and check that COHORT_STORE_ADDR, or \
         MASTER_ADDR/MASTER_PORT without a launcher, names this job's store, not another job's)"
    )]
    AuthRefused {
        /// The store's address.
        addr: String,
    },

    /// The store closed the connection, again and again, before it judged
    /// this client's proof (a pipelined connection's first request).
    #[error(
        "the rendezvous store at {addr} closed the connection {tries} times before its verdict on \
         this client's proof of the job secret: it sheds handshakes while more than {} clients are \
         in one (a very large job connecting at once), or it refused the secret and the refusal was \
         lost on the way; check that COHORT_JOB_SECRET is the job's",
        crate::store::MAX_UNAUTHENTICATED
    )]
    HandshakeDropped {
        /// The store's address.
        addr: String,
        /// How many connections it dropped.
        tries: u32,
    },

    /// The server could not prove that it holds the job secret.
    #[error(
        "the server at {addr} does not hold this job's secret, so it is not this job's \
         rendezvous store: check COHORT_STORE_ADDR (MASTER_ADDR/MASTER_PORT without a launcher) and \
         COHORT_JOB_SECRET"
    )]
    ServerNotAuthentic {
        /// The server's address.
        addr: String,
    },

    /// The peer spoke something that is not the store protocol.
    #[error(
        "protocol error talking to the rendezvous store at {addr}: {detail}; is something else \
         listening on that port, or do the two sides run different cohort versions?"
    )]
    Protocol {
        /// The store's address.
        addr: String,
        /// What was wrong.
        detail: String,
    },

    /// The node relay's socket this rank was given cannot be used, or the
    /// relay could not start.
    #[error("{0}")]
    Relay(String),

    /// The connection closed or failed in the middle of a request.
    #[error(
        "lost the connection to the rendezvous store at {addr}: {source}; the process that serves \
         it has probably exited (the launcher of node 0 under `cohort run`, rank 0's process under \
         mpirun or srun: look at its output for why)"
    )]
    Disconnected {
        /// The store's address.
        addr: String,
        /// The operating system's reason.
        #[source]
        source: io::Error,
    },

    /// The store did not answer a request in time.
    #[error(
        "the rendezvous store at {addr} did not answer within {waited:.1?}; its host may be \
         overloaded or unreachable"
    )]
    Unresponsive {
        /// The store's address.
        addr: String,
        /// How long the client waited for the answer.
        waited: Duration,
    },

    /// An earlier failure left this client's connection unusable.
    #[error(
        "this store client's connection to {addr} broke in an earlier call; connect a new \
         StoreClient"
    )]
    Broken {
        /// The store's address.
        addr: String,
    },

    /// A forked child used a client its parent made: the connection is the
    /// parent's, and answers read by one would be the other's.
    #[error(
        "this store client's connection to {addr} belongs to process {owner}, which forked this \
         process ({pid}): a forked child must make its own StoreClient (StoreClient::connect_rank \
         or duplicate), or the two processes would read each other's answers"
    )]
    ForkedChild {
        /// The store's address.
        addr: String,
        /// The process that made the client.
        owner: u32,
        /// This process.
        pid: u32,
    },

    /// `wait` gave up before every key was set.
    #[error(
        "timed out after {waited:.1?} waiting for store keys; still missing: {}; the ranks \
         that should set them have not reached that point (or have failed: look at their output)",
        missing.join(", ")
    )]
    WaitTimeout {
        /// The keys that were still missing when the wait gave up.
        missing: Vec<String>,
        /// How long the wait lasted.
        waited: Duration,
    },

    /// `barrier` gave up before every participant arrived.
    #[error(
        "barrier '{name}' timed out after {waited:.1?}: {arrived} of {world_size} arrived; the \
         others have not reached it (or have failed: look at their output)"
    )]
    BarrierTimeout {
        /// The barrier's name.
        name: String,
        /// How many participants were there when it gave up, this one included.
        arrived: u32,
        /// How many were expected.
        world_size: u32,
        /// How long this participant waited.
        waited: Duration,
    },

    /// Participants of one barrier disagree on its size.
    #[error(
        "barrier '{name}' was entered with world size {this} here but {others} by others; every \
         participant must pass the same world size"
    )]
    BarrierMismatch {
        /// The barrier's name.
        name: String,
        /// The world size this caller passed.
        this: u32,
        /// The world size the participants already waiting passed.
        others: u32,
    },

    /// `add` met a key whose value is not a counter.
    #[error(
        "store key '{key}' holds a value that is not a decimal integer, so `add` cannot count \
         on it; use a key of its own for counters"
    )]
    NotACounter {
        /// The key.
        key: String,
    },

    /// A key, value or request exceeded the protocol's limits.
    #[error("{what} is {len} bytes, more than the store's limit of {max} bytes")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },

    /// The server refused a request for another reason (it said why).
    #[error("the rendezvous store at {addr} refused the request: {message}")]
    Refused {
        /// The store's address.
        addr: String,
        /// The server's reason.
        message: String,
    },

    /// The operating system could not give random bytes for a nonce or secret.
    #[error("could not get random bytes from the operating system: {0}")]
    Random(String),
}

fn bind_message(addr: &str, source: &io::Error) -> String {
    match source.kind() {
        io::ErrorKind::AddrInUse => format!(
            "port {} on {} is already in use (another job's store, or another service): pick \
             another port for the store (`cohort run --store-port`, `cohort store --port`, MASTER_PORT \
             without a launcher), or 0 to let the system choose a free one",
            port_of(addr),
            host_of(addr)
        ),
        io::ErrorKind::AddrNotAvailable => format!(
            "cannot serve the rendezvous store on {addr}: that address is not one of this host's; \
             run node rank 0 on the host that --master-addr names"
        ),
        io::ErrorKind::PermissionDenied => format!(
            "not allowed to listen on {addr}: ports below 1024 need privileges; pick another \
             port for the store (`cohort run --store-port`, `cohort store --port`), or 0 to let the \
             system choose a free one"
        ),
        _ => format!("cannot serve the rendezvous store on {addr}: {source}"),
    }
}

fn port_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(_, p)| p)
}

fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// Result of a store call.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
