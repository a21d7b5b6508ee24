//! MPI links (the `mpi` feature, rsmpi over Open MPI or MPICH): byte
//! streams between the ranks of an `mpirun` job made of MPI point-to-point
//! messages, under the same ring and halving-doubling algorithms as the
//! shared-memory and TCP links.
//!
//! Each communicator duplicates `MPI_COMM_WORLD` (its traffic never meets
//! the program's own) and sets `MPI_ERRORS_RETURN` on the duplicate, so an
//! MPI failure becomes an error on the collective rather than an abort.
//! A link copies what it sends into up to [`WINDOW`] chunk buffers of
//! [`CHUNK`] bytes in flight (`MPI_Isend`), and keeps [`WINDOW`] receives
//! posted (`MPI_Irecv`) whose chunks it hands over in order; MPI keeps
//! messages between two ranks of one communicator in order, so the chunks
//! form one byte stream. `MPI_Test` on the pending requests drives MPI's
//! progress from the exchange loop.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` the first time a
//! communicator needs it (collectives run on device threads); a program
//! that initialised MPI itself must have asked for at least
//! `MPI_THREAD_SERIALIZED`. Every MPI call made here holds one process-wide
//! lock, so `MPI_THREAD_SERIALIZED` suffices.
//!
//! When cohort initialised MPI, it finalises it as the process exits, but
//! only after a clean run: every communicator over MPI was dropped and none
//! failed. `MPI_Finalize` waits for every rank to call it, so a rank that
//! exits while its communicator is alive (an early `exit`) or after a
//! failed collective skips it instead of hanging; `mpirun` then sees a rank
//! that ended without finalising and stops the whole job, as it should.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use mpi::ffi;
use parking_lot::Mutex;

use super::Link;
use crate::store::StoreServer;

/// Bytes of one message (the unit of a link's sends and receives).
pub(crate) const CHUNK: usize = 1 << 20;

/// Messages in flight per direction and link.
pub(crate) const WINDOW: usize = 4;

/// The tag of every data message.
const TAG: c_int = 7;

/// Held around every MPI call made here (see the module docs).
static MPI_LOCK: Mutex<()> = parking_lot::const_mutex(());

/// An MPI error code in words.
fn describe(code: c_int) -> String {
    let mut text = vec![0 as c_char; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in Open MPI and
    // MPICH) characters; MPI writes at most that many and their count.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) } == 0;
    if !ok {
        return format!("MPI error {code}");
    }
    let bytes: Vec<u8> = text[..len.clamp(0, 512) as usize].iter().map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn check(call: &str, code: c_int) -> io::Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(io::Error::other(format!("{call} failed: {}", describe(code))))
    }
}

fn finalized() -> bool {
    let mut done: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time; writes one flag.
    unsafe { ffi::MPI_Finalized(&mut done) };
    done != 0
}

/// Communicators over MPI alive now.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Set once a communicator failed in this process (see the module docs).
static FAILED: AtomicBool = AtomicBool::new(false);

/// Notes that a communicator failed: the process will not finalise MPI.
pub(crate) fn note_failure() {
    FAILED.store(true, Ordering::Relaxed);
}

extern "C" fn finalize_at_exit() {
    let _guard = MPI_LOCK.lock();
    let live = LIVE.load(Ordering::Relaxed);
    if live > 0 || FAILED.load(Ordering::Relaxed) {
        let why = if live > 0 { "a communicator over MPI is still alive" } else { "a collective failed" };
        eprintln!("cohort: not finalising MPI at exit ({why}); mpirun stops the other ranks");
        return;
    }
    if !finalized() {
        // SAFETY: MPI was initialised by `init` and is not finalised yet.
        unsafe { ffi::MPI_Finalize() };
    }
}

/// Initialises MPI for the process (once), or checks the thread level of
/// the program's own initialisation. Errors say what to change.
pub(crate) fn init() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        if finalized() {
            return Err("MPI was already finalised in this process".into());
        }
        if let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Multiple) {
            // Finalised at exit, after the program's last collective, rather
            // than when this value drops.
            std::mem::forget(universe);
            // SAFETY: registers a plain `extern "C" fn()` with the C runtime.
            if unsafe { libc::atexit(finalize_at_exit) } != 0 {
                tracing::warn!("could not register MPI_Finalize at exit");
            }
        }
        let mut level: c_int = 0;
        // SAFETY: MPI is initialised; writes one level.
        unsafe { ffi::MPI_Query_thread(&mut level) };
        // SAFETY: reads a constant of the MPI library.
        let serialized = unsafe { ffi::RSMPI_THREAD_SERIALIZED };
        if level < serialized {
            return Err(format!(
                "MPI was initialised with thread level {level}, below MPI_THREAD_SERIALIZED ({serialized}): cohort \
                 runs collectives on device threads; initialise MPI with \
                 mpi::initialize_with_threading(Threading::Multiple) (or create the Communicator first)"
            ));
        }
        Ok(())
    })
    .clone()
}

/// A duplicate of `MPI_COMM_WORLD`, freed when the last link drops.
pub(crate) struct Comm(ffi::MPI_Comm);

// SAFETY: an MPI communicator handle may be used from any thread once MPI
// runs at MPI_THREAD_SERIALIZED or above (checked by `init`); every call
// made with it here holds `MPI_LOCK`.
unsafe impl Send for Comm {}
// SAFETY: as above; the handle itself is never mutated after creation.
unsafe impl Sync for Comm {}

impl Comm {
    /// Duplicates `MPI_COMM_WORLD` (collective: every rank calls it, in the
    /// same order) with errors returned rather than fatal.
    pub(crate) fn world() -> io::Result<Arc<Comm>> {
        init().map_err(io::Error::other)?;
        let _guard = MPI_LOCK.lock();
        // SAFETY: an MPI handle is plain data; MPI overwrites it below.
        let mut comm: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        // SAFETY: MPI is initialised; the constants come from the library.
        unsafe {
            check("MPI_Comm_dup", ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm))?;
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN))?;
        }
        LIVE.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Comm(comm)))
    }

    /// This process's rank and the number of ranks.
    pub(crate) fn rank_size(&self) -> (usize, usize) {
        let _guard = MPI_LOCK.lock();
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: a live communicator; each call writes one integer.
        unsafe {
            ffi::MPI_Comm_rank(self.0, &mut rank);
            ffi::MPI_Comm_size(self.0, &mut size);
        }
        (rank as usize, size as usize)
    }

    /// Whether every rank runs on this node (`MPI_Comm_split_type` with
    /// `MPI_COMM_TYPE_SHARED`; collective).
    pub(crate) fn one_node(&self) -> io::Result<bool> {
        let _guard = MPI_LOCK.lock();
        // SAFETY: handle initialised by MPI below.
        let mut node: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        let (mut local, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: a live communicator; the split's result is freed here.
        unsafe {
            check(
                "MPI_Comm_split_type",
                ffi::MPI_Comm_split_type(self.0, ffi::RSMPI_COMM_TYPE_SHARED, 0, ffi::RSMPI_INFO_NULL, &mut node),
            )?;
            ffi::MPI_Comm_size(node, &mut local);
            ffi::MPI_Comm_size(self.0, &mut size);
            ffi::MPI_Comm_free(&mut node);
        }
        Ok(local == size)
    }

    /// Copies `buf` of rank `root` to every rank (`MPI_Bcast`; collective).
    pub(crate) fn broadcast(&self, buf: &mut [u8], root: usize) -> io::Result<()> {
        let _guard = MPI_LOCK.lock();
        // SAFETY: `buf` is valid for its length; MPI writes at most that many
        // bytes and returns before the call ends.
        let code = unsafe {
            ffi::MPI_Bcast(
                buf.as_mut_ptr() as *mut c_void,
                buf.len() as c_int,
                ffi::RSMPI_UINT8_T,
                root as c_int,
                self.0,
            )
        };
        check("MPI_Bcast", code)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
        let _guard = MPI_LOCK.lock();
        if !finalized() {
            // SAFETY: our duplicate, freed once; no link uses it any more.
            unsafe { ffi::MPI_Comm_free(&mut self.0) };
        }
    }
}

/// A chunk buffer and the request that uses it.
struct Pending {
    buf: Box<[u8]>,
    req: ffi::MPI_Request,
}

// SAFETY: see `Comm`: requests are used under `MPI_LOCK` by one thread at a
// time (the link is owned by one world, behind its mutex).
unsafe impl Send for Pending {}

/// An MPI link to one peer.
pub(crate) struct MpiLink {
    comm: Arc<Comm>,
    peer: c_int,
    /// Sends in flight, oldest first.
    sends: VecDeque<Pending>,
    /// Receives posted, in the order MPI matches them.
    recvs: VecDeque<Pending>,
    /// The oldest receive's arrived length and how much of it was taken.
    head: Option<(usize, usize)>,
    /// Chunk buffers of finished sends, for reuse.
    spare: Vec<Box<[u8]>>,
}

impl MpiLink {
    /// A link to `peer` over `comm`, with its receives posted.
    pub(crate) fn new(comm: Arc<Comm>, peer: usize) -> io::Result<MpiLink> {
        let mut link = MpiLink {
            comm,
            peer: peer as c_int,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            head: None,
            spare: Vec::new(),
        };
        let _guard = MPI_LOCK.lock();
        while link.recvs.len() < WINDOW {
            link.post_recv(vec![0u8; CHUNK].into_boxed_slice())?;
        }
        Ok(link)
    }

    /// Posts a receive into `buf` (caller holds `MPI_LOCK`).
    fn post_recv(&mut self, mut buf: Box<[u8]>) -> io::Result<()> {
        // SAFETY: plain handle data, written by MPI_Irecv.
        let mut req: ffi::MPI_Request = unsafe { std::mem::zeroed() };
        // SAFETY: `buf` lives on the heap in `self.recvs` until the request
        // completes or is cancelled and waited for (see `Drop`).
        let code = unsafe {
            ffi::MPI_Irecv(
                buf.as_mut_ptr() as *mut c_void,
                buf.len() as c_int,
                ffi::RSMPI_UINT8_T,
                self.peer,
                TAG,
                self.comm.0,
                &mut req,
            )
        };
        check("MPI_Irecv", code)?;
        self.recvs.push_back(Pending { buf, req });
        Ok(())
    }

    /// Whether `req` finished; its received length (caller holds the lock).
    fn test(req: &mut ffi::MPI_Request) -> io::Result<Option<usize>> {
        let mut flag: c_int = 0;
        // SAFETY: plain C struct, written by MPI_Test.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: a request this link posted and has not completed yet.
        check("MPI_Test", unsafe { ffi::MPI_Test(req, &mut flag, &mut status) })?;
        if flag == 0 {
            return Ok(None);
        }
        let mut count: c_int = 0;
        // SAFETY: the status MPI_Test filled; writes one count (0 for sends).
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        Ok(Some(count.max(0) as usize))
    }
}

impl Link for MpiLink {
    fn try_send(&mut self, data: &[u8]) -> io::Result<usize> {
        let _guard = MPI_LOCK.lock();
        while let Some(front) = self.sends.front_mut() {
            if Self::test(&mut front.req)?.is_none() {
                break;
            }
            let done = self.sends.pop_front().expect("a front");
            self.spare.push(done.buf);
        }
        let mut taken = 0;
        while self.sends.len() < WINDOW && taken < data.len() {
            let n = (data.len() - taken).min(CHUNK);
            let mut buf = self.spare.pop().unwrap_or_else(|| vec![0u8; CHUNK].into_boxed_slice());
            buf[..n].copy_from_slice(&data[taken..taken + n]);
            // SAFETY: plain handle data, written by MPI_Isend.
            let mut req: ffi::MPI_Request = unsafe { std::mem::zeroed() };
            // SAFETY: `buf` stays on the heap in `self.sends` until the
            // request completes (or is leaked with it, see `Drop`).
            let code = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr() as *const c_void,
                    n as c_int,
                    ffi::RSMPI_UINT8_T,
                    self.peer,
                    TAG,
                    self.comm.0,
                    &mut req,
                )
            };
            check("MPI_Isend", code)?;
            self.sends.push_back(Pending { buf, req });
            taken += n;
        }
        Ok(taken)
    }

    fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        let _guard = MPI_LOCK.lock();
        let (len, at) = match self.head {
            Some(h) => h,
            None => {
                let front = self.recvs.front_mut().expect("receives stay posted");
                match Self::test(&mut front.req)? {
                    None => return Ok(0),
                    Some(len) => (len, 0),
                }
            }
        };
        let front = self.recvs.front().expect("receives stay posted");
        let used = take(&front.buf[at..len]);
        if at + used == len {
            self.head = None;
            let done = self.recvs.pop_front().expect("a front");
            self.post_recv(done.buf)?;
        } else {
            self.head = Some((len, at + used));
        }
        Ok(used)
    }

    fn kind(&self) -> &'static str {
        "mpi"
    }
}

impl Drop for MpiLink {
    fn drop(&mut self) {
        let _guard = MPI_LOCK.lock();
        if finalized() {
            // MPI may still own the buffers; leak them with the requests.
            self.sends.drain(..).chain(self.recvs.drain(..)).for_each(std::mem::forget);
            return;
        }
        let head_done = self.head.take().is_some();
        for (i, mut r) in self.recvs.drain(..).enumerate() {
            if i == 0 && head_done {
                continue; // The completed head needs no cancel.
            }
            // SAFETY: a posted receive; cancelled, then waited for, so MPI no
            // longer touches its buffer when it drops.
            unsafe {
                ffi::MPI_Cancel(&mut r.req);
                ffi::MPI_Wait(&mut r.req, ffi::RSMPI_STATUS_IGNORE);
            }
        }
        for mut s in self.sends.drain(..) {
            if matches!(Self::test(&mut s.req), Ok(Some(_))) {
                continue;
            }
            // A send the peer never received: MPI keeps the request, so the
            // buffer is leaked rather than freed under it.
            // SAFETY: frees our handle of an active request (MPI completes it
            // on its own); the buffer is never freed.
            unsafe { ffi::MPI_Request_free(&mut s.req) };
            std::mem::forget(s.buf);
        }
    }
}

/// An `mpirun` job's links: one per other rank over a fresh duplicate of
/// `MPI_COMM_WORLD`. Collective: every rank calls it, in the same order.
pub(crate) fn links(comm: &Arc<Comm>) -> io::Result<Vec<Option<Box<dyn Link>>>> {
    let (rank, size) = comm.rank_size();
    (0..size)
        .map(|peer| match peer == rank {
            true => Ok(None),
            false => MpiLink::new(comm.clone(), peer).map(|l| Some(Box::new(l) as Box<dyn Link>)),
        })
        .collect()
}

/// Where the ranks of an `mpirun` job find rank 0's store: rank 0 serves
/// one on a free port (loopback when every rank runs on its node, every
/// interface otherwise) under a fresh random secret, and `MPI_Bcast` hands
/// the address and the secret to the others. Returns `(address, secret,
/// rank 0's server)`. Collective.
pub(crate) fn rendezvous(comm: &Comm) -> io::Result<(String, String, Option<StoreServer>)> {
    let (rank, _) = comm.rank_size();
    let one_node = comm.one_node()?;
    let mut msg = [0u8; 512];
    let mut server = None;
    if rank == 0 {
        let text = match serve(one_node) {
            Ok((s, addr, secret)) => {
                server = Some(s);
                format!("ok {addr} {secret}")
            }
            Err(e) => format!("error rank 0 could not serve the store: {e}"),
        };
        let n = text.len().min(msg.len());
        msg[..n].copy_from_slice(&text.as_bytes()[..n]);
    }
    comm.broadcast(&mut msg, 0)?;
    let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
    let text = String::from_utf8_lossy(&msg[..end]).into_owned();
    let mut words = text.splitn(3, ' ');
    match (words.next(), words.next(), words.next()) {
        (Some("ok"), Some(addr), Some(secret)) => Ok((addr.to_string(), secret.to_string(), server)),
        _ => Err(io::Error::other(text.trim_start_matches("error ").to_string())),
    }
}

/// Rank 0's store: (server, address for the others, secret).
fn serve(one_node: bool) -> io::Result<(StoreServer, String, String)> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| io::Error::other(format!("no randomness for the secret: {e}")))?;
    let secret: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let host = if one_node {
        "127.0.0.1".to_string()
    } else {
        std::env::var("MASTER_ADDR").ok().filter(|h| !h.trim().is_empty()).unwrap_or_else(outward_ip)
    };
    let bind = if one_node { "127.0.0.1:0" } else { "0.0.0.0:0" };
    let server = StoreServer::bind(bind, &secret).map_err(|e| io::Error::other(e.to_string()))?;
    let addr = format!("{host}:{}", server.local_addr().port());
    Ok((server, addr, secret))
}

/// The address other nodes reach this one at (the interface of the default
/// route; a UDP "connect" sends nothing); loopback when there is none.
fn outward_ip() -> String {
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect("192.0.2.1:9").map(|_| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}
