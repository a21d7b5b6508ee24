//! The node relay's sockets as a rank's process finds them: the
//! descriptors the launcher lists in `COHORT_STORE_FD`, checked, and
//! claimed by one process of the rank alone (see [`claim_relay_sockets`]),
//! each cleared of the answers an earlier program of the rank left in it
//! (see [`synchronise`]) before this one uses it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixStream};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::{Result, StoreError};
use super::protocol::{self, Request, Response};

/// The relay sockets this process claimed, not taken yet; `None` until
/// `COHORT_STORE_FD` is read.
static RELAY_SOCKETS: Mutex<Option<RelayClaim>> = Mutex::new(None);

/// The next relay socket of `COHORT_STORE_FD` this process claimed and has
/// not taken yet, checked and [synchronised](synchronise) (waiting at most
/// `within` for that); `None` once they are all taken, or when this
/// process claimed none (it connects directly), or when the claim is the
/// parent's of this forked child (the parent's copies of the sockets are
/// the parent's, and answers would cross), or when the socket could not be
/// synchronised (an earlier program of the rank left it unusable: this
/// one connects directly).
pub(crate) fn take_relay_socket(within: Duration) -> Result<Option<UnixStream>> {
    let mut pool = RELAY_SOCKETS.lock();
    if pool.is_none() {
        let fds = cohort_runtime::config::STORE_FD.get().map_err(|e| StoreError::Relay(e.to_string()))?;
        *pool = Some(claim_relay_sockets(fds.unwrap_or_default()));
    }
    let Some(fd) = pool.as_mut().filter(|p| p.owner == std::process::id()).and_then(|p| p.fds.pop_front()) else {
        return Ok(None);
    };
    let mut socket = relay_socket(fd)?;
    match synchronise(&mut socket, within) {
        Ok(stale) => {
            if stale > 0 {
                tracing::debug!(stale, "dropped answers an earlier program of this rank left in its relay socket");
            }
            Ok(Some(socket))
        }
        Err(e) => {
            tracing::info!(
                "this rank's relay socket (COHORT_STORE_FD) is not usable ({e}; an earlier program of the rank \
                 died half-way through a request?): connecting to the store directly"
            );
            Ok(None)
        }
    }
}

/// Answers an earlier program of the rank may have left in one relay
/// socket, at most (the relay passes a rank's requests a few dozen at a
/// time, then waits for their answers to be read).
const STALE_ANSWERS_MAX: usize = 256;

/// Reads and drops every answer left in relay socket `socket` for an
/// earlier program of this rank (one run before this one in the same rank,
/// `prog1; prog2`, killed before its answer came: the socket outlives it,
/// held open by the rank's shell), so that this program never reads one as
/// its own. Sends a request whose answer is this call's alone (an add of
/// a random amount to a fresh random key, and the key's delete) and reads
/// answers until that one; the relay answers a rank's requests in order,
/// so every stale answer comes before it (one still due, to a `wait` the
/// earlier program sent, comes first too: this call waits for it). Returns
/// how many it dropped. Fails when no answer came within `within`, when
/// more than [`STALE_ANSWERS_MAX`] came first, when the relay refused (an
/// earlier program's half-written request swallowed this one's bytes, or
/// the store is lost) or an answer did not decode: the socket is not used.
fn synchronise(socket: &mut UnixStream, within: Duration) -> io::Result<usize> {
    let mut random = [0u8; 24];
    getrandom::fill(&mut random).map_err(|e| io::Error::other(format!("no randomness: {e}")))?;
    let delta = i64::from_le_bytes(random[..8].try_into().expect("8 bytes"));
    let key: String = random[8..].iter().fold("cohort/relay-sync/".into(), |mut k, b| {
        k.push_str(&format!("{b:02x}"));
        k
    });
    let deadline = Instant::now() + within.max(Duration::from_millis(1));
    socket.set_write_timeout(Some(within.max(Duration::from_millis(1))))?;
    let sync = [Request::Add { key: key.clone(), delta }.encode(), Request::Delete { key }.encode()];
    protocol::write_frames(socket, &sync)?;
    let mut next_answer = || -> io::Result<Response> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        socket.set_read_timeout(Some(left))?;
        let body = protocol::read_frame(socket)?;
        Response::decode(&body).map_err(|detail| io::Error::new(io::ErrorKind::InvalidData, detail))
    };
    let unexpected = |what: &str, r: Response| io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {r:?}"));
    for stale in 0..=STALE_ANSWERS_MAX {
        match next_answer()? {
            Response::Int(n) if n == delta => {
                return match next_answer()? {
                    Response::Bool(true) => Ok(stale),
                    r => Err(unexpected("the answer to deleting its key", r)),
                };
            }
            r @ Response::Refused(_) => return Err(unexpected("the relay refused", r)),
            _ => {}
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, format!("more than {STALE_ANSWERS_MAX} answers left in it")))
}

/// The relay sockets one process took, and what holds them for it alone.
pub(crate) struct RelayClaim {
    /// The descriptors, in order, not taken yet (none: the process
    /// connects directly).
    pub(crate) fds: VecDeque<RawFd>,
    /// The socket bound to the claim's name ([`hold_claim`]), held as long
    /// as the process may use the descriptors.
    _held: Option<UnixDatagram>,
    /// The process that claimed them (a child it forks has a copy of this
    /// claim and may not take any).
    owner: u32,
}

impl RelayClaim {
    fn none() -> RelayClaim {
        RelayClaim { fds: VecDeque::new(), _held: None, owner: std::process::id() }
    }
}

/// The descriptors of `COHORT_STORE_FD` this process takes: all of them,
/// each marked close-on-exec at once (programs this rank starts from now on
/// do not hold them: a socket held elsewhere would keep a dead rank's
/// session, and its will, open), when every one is a Unix stream socket
/// whose other end was made by one process that is this one or an ancestor
/// of it (the launcher, also through wrappers such as `timeout` or a shell
/// script that starts the rank), and no other process holds them
/// ([`hold_claim`]: two programs that one rank runs at once both inherit
/// them, and answers read by the wrong one would cross); otherwise none,
/// and the process connects directly: the variable was inherited from a
/// rank by a program it started, where the rank's descriptors are closed
/// or their numbers reused, or another program of the rank holds them.
pub(crate) fn claim_relay_sockets(fds: Vec<RawFd>) -> RelayClaim {
    let makers: Option<Vec<libc::pid_t>> = fds.iter().map(|&fd| unix_stream_peer(fd)).collect();
    let maker = match makers.as_deref() {
        None => {
            tracing::debug!("COHORT_STORE_FD names descriptors that are not relay sockets here (inherited from the rank that started this program?): connecting to the store directly");
            return RelayClaim::none();
        }
        Some([]) => return RelayClaim::none(),
        Some([first, rest @ ..]) if rest.iter().all(|p| p == first) => *first,
        Some(_) => {
            tracing::debug!(
                "COHORT_STORE_FD's sockets were made by different processes: connecting to the store directly"
            );
            return RelayClaim::none();
        }
    };
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    if maker == 0 {
        // Made in another PID namespace (a container between the launcher
        // and this process): nothing here can tell whose they are.
        tracing::warn!(
            "COHORT_STORE_FD's sockets were made outside this PID namespace: connecting to the store directly"
        );
        return RelayClaim::none();
    }
    if maker != me && !is_ancestor(maker) {
        tracing::debug!(
            maker,
            "COHORT_STORE_FD's sockets were made for another process: connecting to the store directly"
        );
        return RelayClaim::none();
    }
    let held = match hold_claim(fds[0]) {
        Ok(Some(held)) => held,
        Ok(None) => {
            tracing::info!(
                "another process of this rank holds its relay sockets (COHORT_STORE_FD; two programs that use the \
                 store run at once in one rank?): this one connects to the store directly"
            );
            return RelayClaim::none();
        }
        Err(e) => {
            tracing::warn!(
                "could not claim this rank's relay sockets (COHORT_STORE_FD) for this process alone ({e}): \
                 connecting to the store directly"
            );
            return RelayClaim::none();
        }
    };
    for &fd in &fds {
        // SAFETY: setting FD_CLOEXEC on a descriptor changes no memory.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
    RelayClaim { fds: fds.into(), _held: Some(held), owner: std::process::id() }
}

/// Claims the relay socket `fd` for this process: binds a Unix socket to
/// an abstract name made of the socket's device and inode numbers, which
/// every process that inherited it sees alike. The kernel gives a name to
/// one socket at a time, so one process holds the claim; it is given up
/// when the returned socket closes (the process exits: it is close-on-exec).
/// `Ok(None)` when another process holds it. A claim is only seen by
/// processes of one network namespace (two programs of one rank share it).
fn hold_claim(fd: RawFd) -> io::Result<Option<UnixDatagram>> {
    // SAFETY: an all-zero `stat` is a valid value of the plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one `stat` into `st`, which outlives the call;
    // any descriptor number is safe to ask about.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let name = format!("cohort-store-relay-claim/{:x}/{:x}", st.st_dev, st.st_ino);
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    match UnixDatagram::bind_addr(&addr) {
        Ok(held) => Ok(Some(held)),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(e),
    }
}

/// The process that made the other end of `fd`, when `fd` is an open Unix
/// stream socket (0 when it was made in another PID namespace).
fn unix_stream_peer(fd: RawFd) -> Option<libc::pid_t> {
    if socket_option(fd, libc::SO_DOMAIN).ok()? != libc::AF_UNIX
        || socket_option(fd, libc::SO_TYPE).ok()? != libc::SOCK_STREAM
    {
        return None;
    }
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which
    // outlives the call; any descriptor number is safe to ask about.
    let rc = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    (rc == 0).then_some(cred.pid)
}

/// The integer socket option `option` (`SOL_SOCKET` level) of `fd`.
fn socket_option(fd: RawFd, option: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `value`, which
    // outlives the call; any descriptor number is safe to ask about.
    let rc =
        unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, option, (&mut value as *mut libc::c_int).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

/// Whether process `pid` is an ancestor of this one (its parent, the
/// parent's parent, ...; read from /proc, at most 64 generations).
fn is_ancestor(pid: libc::pid_t) -> bool {
    // SAFETY: getppid has no preconditions.
    let mut at = unsafe { libc::getppid() };
    for _ in 0..64 {
        if at == pid {
            return true;
        }
        if at <= 1 {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{at}/stat")) else { return false };
        // "pid (command) state ppid ...": the command may hold spaces and
        // parentheses, so the fields after its last ')'.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return false };
        match after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            Some(parent) => at = parent,
            None => return false,
        }
    }
    false
}

/// The descriptor `fd` (from `COHORT_STORE_FD`) as the socket of this
/// rank's end of its node relay, checked to be an open stream socket.
pub(crate) fn relay_socket(fd: RawFd) -> Result<UnixStream> {
    let bad = |why: String| {
        StoreError::Relay(format!(
            "descriptor {fd} of COHORT_STORE_FD is not this process's end of its node relay: {why}; run the \
             program under `cohort run`, or unset COHORT_STORE_FD to connect to the store directly"
        ))
    };
    let kind = socket_option(fd, libc::SO_TYPE).map_err(|e| bad(e.to_string()))?;
    if kind != libc::SOCK_STREAM {
        return Err(bad("it is not a stream socket".into()));
    }
    if socket_option(fd, libc::SO_DOMAIN).ok() != Some(libc::AF_UNIX) {
        return Err(bad("it is not a Unix-domain socket (a relay's end is one of a socket pair)".into()));
    }
    // SAFETY: the descriptor is an open socket (checked above) that the
    // launcher handed to this process for the store alone, and the caller
    // takes it once per process (claimed, so already close-on-exec: see
    // `claim_relay_sockets`); from here the client owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(UnixStream::from(owned))
}
