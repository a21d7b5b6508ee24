//! Shared-memory links between ranks of one node.
//!
//! Each rank creates one file, `/dev/shm/cohort-<job>-<rank>`, holding one
//! single-producer single-consumer ring per same-node sender (slot `s` is
//! written by the rank of local index `s`, read by the owner). Every rank
//! maps its own file and its peers'; once every rank has mapped every file
//! (a store barrier), the owner unlinks its file, so nothing is left in
//! `/dev/shm` after set-up, whatever happens later. A [`Segment`] unlinks its
//! file when dropped before that point (a failed set-up, a panic); a rank
//! killed during set-up cannot, so `cohort run` removes its job's files when
//! the ranks have ended ([`sweep_shared_memory`]).
//!
//! Files are created 0600 (`O_EXCL`, never through a link) and a peer's
//! file is opened only when it is a regular file of this user's that no one
//! else may read or write, so another local user can neither read a job's
//! bytes nor hand a rank a file of their own to map.
//!
//! A ring is a header (producer's `head` and consumer's `tail`, byte counts
//! that only grow, on separate cache lines) and `capacity` data bytes. The
//! producer copies bytes in, then publishes `head` with release ordering; the
//! consumer reads `head` with acquire ordering, copies bytes out, then
//! publishes `tail` with release ordering; so no byte is read before it is
//! written, nor overwritten before it is read.

use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Link;

/// Bytes of one ring's header: two cache lines.
const HEADER: usize = 128;

/// The data bytes of one ring: `COHORT_SHM_RING` (rounded up to a power of
/// two, at least 4 KiB; default 4 MiB); an error naming it when its value
/// cannot be used.
pub(crate) fn ring_capacity() -> Result<usize, cohort_runtime::ConfigError> {
    Ok(cohort_runtime::config::SHM_RING.get()?.max(4096).next_power_of_two())
}

/// One mapped file of rings.
pub(crate) struct Segment {
    ptr: *mut u8,
    len: usize,
    capacity: usize,
    /// Set while this process owns the file's name and must unlink it.
    owned_path: Option<CString>,
}

// SAFETY: the mapping is process-wide memory; every access to it goes through
// rings whose producer/consumer protocol (atomics with acquire/release) keeps
// threads and processes from racing on the same bytes.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only hands out ring views, never `&mut`.
unsafe impl Sync for Segment {}

/// The path of rank `rank`'s file in job `job`.
pub(crate) fn path(job: &str, rank: usize) -> String {
    format!("/dev/shm/cohort-{job}-{rank}")
}

/// Whether `at` names rank `rank`'s file of job `job`: its [`path`], or a
/// fresh name [`create_for`] took beside it (`<path>-<16 hex digits>`).
pub(crate) fn is_own_path(job: &str, rank: usize, at: &str) -> bool {
    let usual = path(job, rank);
    at == usual
        || at
            .strip_prefix(&usual)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|n| n.len() == 16 && n.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Creates rank `rank`'s file of job `job` with `slots` rings of
/// `capacity` bytes: at [`path`], or, when something already holds that
/// name (another user's or process's file, a leftover: never opened), under
/// a fresh random name next to it. Returns the segment and the path it got,
/// which the rank publishes for its peers.
pub(crate) fn create_for(job: &str, rank: usize, slots: usize, capacity: usize) -> io::Result<(Segment, String)> {
    let first = path(job, rank);
    match Segment::create(&first, slots, capacity) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        created => return created.map(|seg| (seg, first)),
    }
    tracing::warn!(path = first, "something else already holds this rank's shared-memory name: taking a fresh one");
    for _ in 0..4 {
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| io::Error::other(format!("no randomness for a fresh name: {e}")))?;
        let fresh = format!("{first}-{}", nonce.iter().map(|b| format!("{b:02x}")).collect::<String>());
        match Segment::create(&fresh, slots, capacity) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            created => return created.map(|seg| (seg, fresh)),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{first} and four fresh random names next to it already exist: someone is squatting this job's names"),
    ))
}

impl Segment {
    /// Creates (exclusively) and maps the file at `path` with `slots` rings
    /// of `capacity` bytes each, zeroed.
    pub(crate) fn create(path: &str, slots: usize, capacity: usize) -> io::Result<Segment> {
        let c_path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let len = slots * (HEADER + capacity);
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: c_path is a valid NUL-terminated string; open has no other
        // preconditions.
        let fd = unsafe { libc::open(c_path.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let unlink = |err: io::Error| {
            // SAFETY: c_path is a valid path string; fd is ours.
            unsafe {
                libc::close(fd);
                libc::unlink(c_path.as_ptr());
            }
            err
        };
        // SAFETY: fd is an open, writable file descriptor we own.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(unlink(io::Error::last_os_error()));
        }
        let ptr = map(fd, len).map_err(unlink)?;
        // SAFETY: fd is ours; the mapping keeps the file's memory alive.
        unsafe { libc::close(fd) };
        Ok(Segment { ptr, len, capacity, owned_path: Some(c_path) })
    }

    /// Maps the existing file at `path` (a peer's), expecting `slots` rings
    /// of `capacity` bytes. Refused when `path` is a link, not a regular
    /// file, not this user's, or readable or writable by anyone else.
    pub(crate) fn open(path: &str, slots: usize, capacity: usize) -> io::Result<Segment> {
        let c_path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let len = slots * (HEADER + capacity);
        // SAFETY: c_path is a valid NUL-terminated string.
        let fd = unsafe { libc::open(c_path.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ELOOP) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{path} is a symbolic link, not a rank's shared memory: refused (remove it)"),
                ));
            }
            return Err(err);
        }
        let refuse = |kind: io::ErrorKind, why: String| {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            Err(io::Error::new(kind, why))
        };
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open and `stat` is a valid out-pointer.
        if unsafe { libc::fstat(fd, &mut stat) } != 0 {
            return refuse(io::ErrorKind::Other, format!("cannot stat {path}: {}", io::Error::last_os_error()));
        }
        // SAFETY: geteuid(2) has no preconditions.
        let me = unsafe { libc::geteuid() };
        let mode = stat.st_mode & 0o7777;
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
            return refuse(io::ErrorKind::PermissionDenied, format!("{path} is not a regular file: refused"));
        }
        if stat.st_uid != me {
            return refuse(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{path} belongs to user id {}, not to this job's user ({me}): refused (another user's file \
                     in the job's place; remove it)",
                    stat.st_uid
                ),
            );
        }
        if mode & 0o077 != 0 {
            return refuse(
                io::ErrorKind::PermissionDenied,
                format!("{path} has mode {mode:04o}; a rank's shared memory is 0600: refused (remove it)"),
            );
        }
        if stat.st_size as usize != len {
            return refuse(
                io::ErrorKind::InvalidData,
                format!(
                    "{path} holds {} bytes, expected {len} ({slots} rings of {capacity} bytes): its rank was given \
                     another COHORT_SHM_RING (every rank of a node must agree), or it is another job's file",
                    stat.st_size
                ),
            );
        }
        let mapped = map(fd, len);
        // SAFETY: fd is ours; a successful mapping outlives it.
        unsafe { libc::close(fd) };
        Ok(Segment { ptr: mapped?, len, capacity, owned_path: None })
    }

    /// Removes the file's name (the mappings stay valid). Idempotent.
    pub(crate) fn unlink(&mut self) {
        if let Some(path) = self.owned_path.take() {
            // SAFETY: path is a valid NUL-terminated string.
            unsafe { libc::unlink(path.as_ptr()) };
        }
    }

    /// The ring in slot `slot`.
    fn ring(self: &Arc<Self>, slot: usize) -> Ring {
        let offset = slot * (HEADER + self.capacity);
        assert!(offset + HEADER + self.capacity <= self.len, "ring slot {slot} outside the segment");
        // SAFETY: the offset is inside the mapping (asserted); the mapping is
        // page-aligned and HEADER + capacity is a multiple of 64, so both
        // counters are 8-byte aligned.
        let base = unsafe { self.ptr.add(offset) };
        Ring { _segment: self.clone(), base, capacity: self.capacity }
    }
}

fn map(fd: libc::c_int, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of `len` bytes of an open file; the
    // kernel picks the address, so it overlaps nothing of ours.
    let ptr =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

/// Removes the shared-memory files the ranks `ranks` of the job served by
/// `store` may have left (a rank killed between creating its file and the
/// barrier after which it unlinks it): every communicator those ranks
/// registered in the store is looked up, and each of their files that is
/// still there and this user's is unlinked. Returns how many were. For the
/// launcher, once its ranks have ended (before the store is reset).
///
/// Asks the store two round trips per rank: its count of communicators,
/// then the entries of all of them in one
/// [`multi_get`](crate::store::StoreClient::multi_get) (a few, each for a
/// batch of hundreds of communicators, for a rank that made more).
pub fn sweep_shared_memory(
    store: &crate::store::StoreClient,
    ranks: &[usize],
) -> Result<usize, crate::store::StoreError> {
    // The keys `communicator::setup::form` writes: the count of
    // communicators each rank made, each one's job entry ("<id> <token>"),
    // and each rank's file path when it is not the usual one.
    let mut removed = 0;
    for &rank in ranks {
        let made = store.add(&format!("cohort/comm/instance/{rank}"), 0)?;
        let mut first = 1;
        while first <= made {
            let last = made.min(first.saturating_add(SWEEP_BATCH - 1));
            let keys: Vec<String> = (first..=last)
                .flat_map(|k| [format!("cohort/comm/{k}/job"), format!("cohort/comm/{k}/shm/{rank}")])
                .collect();
            let values = entries(store, &keys)?;
            for pair in values.chunks(2) {
                let [Some(entry), taken] = pair else { continue };
                let entry = String::from_utf8_lossy(entry);
                let Some(job) = entry.split(' ').next().filter(|j| j.bytes().all(|b| b.is_ascii_hexdigit())) else {
                    continue;
                };
                if remove_own(&path(job, rank)) {
                    removed += 1;
                }
                // A fresh name the rank took (`create_for`), published as its
                // `shm/<rank>` entry.
                if let Some(taken) = taken {
                    let taken = String::from_utf8_lossy(taken);
                    if taken != path(job, rank) && is_own_path(job, rank, &taken) && remove_own(&taken) {
                        removed += 1;
                    }
                }
            }
            if last == i64::MAX {
                break;
            }
            first = last + 1;
        }
    }
    Ok(removed)
}

/// How many communicators' entries [`sweep_shared_memory`] reads in one
/// request (two keys each).
const SWEEP_BATCH: i64 = 512;

/// The values of `keys` (`None` where not set), in order: one
/// [`multi_get`](crate::store::StoreClient::multi_get), or one get per key
/// when the store refuses that (the values together too large for one
/// answer, where each alone fits).
fn entries(
    store: &crate::store::StoreClient,
    keys: &[String],
) -> Result<Vec<Option<Vec<u8>>>, crate::store::StoreError> {
    let asked: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.multi_get(&asked) {
        Err(crate::store::StoreError::Refused { .. }) => asked.iter().map(|k| store.get(k)).collect(),
        answered => answered,
    }
}

/// Unlinks `path` when it is a file (or link) of this user's; whether it did.
fn remove_own(path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else { return false };
    // SAFETY: geteuid(2) has no preconditions.
    if meta.uid() != unsafe { libc::geteuid() } || meta.is_dir() {
        return false;
    }
    std::fs::remove_file(path).is_ok()
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: ptr/len are exactly the mapping made in create/open, and no
        // ring outlives the segment (rings hold an Arc to it).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One end of one ring.
struct Ring {
    /// Keeps the mapping alive while the ring is in use.
    _segment: Arc<Segment>,
    base: *mut u8,
    capacity: usize,
}

// SAFETY: a Ring is used by one thread at a time (it lives in a link, which
// the communicator's world lock guards); the memory is the segment's.
unsafe impl Send for Ring {}

impl Ring {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: base is 8-byte aligned and inside the live mapping (held by
        // `segment`); the counter is only accessed atomically by any process.
        unsafe { &*self.base.cast::<AtomicU64>() }
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as for `head`, one cache line further.
        unsafe { &*self.base.add(64).cast::<AtomicU64>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.base.add(HEADER) }
    }

    /// The bytes between `tail` and `head`, read from shared memory: an
    /// error unless they are counts the ring's two ends could have written
    /// (tail not past head, at most `capacity` apart, head able to grow by
    /// a ring's worth), so no foreign value ever sizes or places a copy.
    fn used(&self, head: u64, tail: u64) -> io::Result<usize> {
        let room = u64::MAX - self.capacity as u64;
        match head.checked_sub(tail) {
            Some(used) if used <= self.capacity as u64 && head <= room => Ok(used as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the shared-memory ring's header holds head {head}, tail {tail}, which its ranks never write \
                     (a ring holds {} bytes): corrupt, or written by another process",
                    self.capacity
                ),
            )),
        }
    }

    /// Producer side: copies what fits.
    fn push(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        let free = self.capacity - self.used(head, tail)?;
        let n = free.min(bytes.len());
        if n == 0 {
            return Ok(0);
        }
        let at = head as usize & (self.capacity - 1);
        let first = n.min(self.capacity - at);
        // SAFETY: [at, at + first) and [0, n - first) lie in the data area
        // and are free (the consumer's tail says it has read them), so no one
        // reads them until head is published below; `bytes` is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().add(at), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.data(), n - first);
        }
        self.head().store(head + n as u64, Ordering::Release);
        Ok(n)
    }

    /// Consumer side: offers the contiguous arrived bytes (up to the wrap)
    /// to `take`, twice if they wrap.
    fn pop(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        let mut total = 0;
        for _ in 0..2 {
            let tail = self.tail().load(Ordering::Relaxed);
            let head = self.head().load(Ordering::Acquire);
            let avail = self.used(head, tail)?;
            if avail == 0 {
                break;
            }
            let at = tail as usize & (self.capacity - 1);
            let len = avail.min(self.capacity - at);
            // SAFETY: [at, at + len) was written and published (acquire load
            // of head) and the producer does not touch it until tail moves.
            let bytes = unsafe { std::slice::from_raw_parts(self.data().add(at), len) };
            let used = take(bytes);
            if used == 0 {
                break;
            }
            self.tail().store(tail + used as u64, Ordering::Release);
            total += used;
            if used < len {
                break;
            }
        }
        Ok(total)
    }
}

/// A shared-memory link: our ring in the peer's segment (we produce) and
/// the peer's ring in ours (we consume).
pub(crate) struct ShmLink {
    tx: Ring,
    rx: Ring,
}

impl ShmLink {
    /// The link between us (local index `me`, owning `mine`) and the peer of
    /// local index `peer`, owning `theirs`.
    pub(crate) fn new(mine: &Arc<Segment>, theirs: &Arc<Segment>, me: usize, peer: usize) -> ShmLink {
        ShmLink { tx: theirs.ring(me), rx: mine.ring(peer) }
    }
}

impl Link for ShmLink {
    fn try_send(&mut self, data: &[u8]) -> io::Result<usize> {
        self.tx.push(data)
    }

    fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        self.rx.pop(take)
    }

    fn kind(&self) -> &'static str {
        "shm"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_moves_bytes_across_the_wrap() {
        let name = format!("test-{}", std::process::id());
        let a = Arc::new(Segment::create(&path(&name, 0), 2, 4096).unwrap());
        let b = Arc::new(Segment::open(&path(&name, 0), 2, 4096).unwrap());
        let mut tx = ShmLink::new(&a, &b, 1, 0);
        let mut rx = ShmLink::new(&a, &b, 0, 1);
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let (mut sent, mut got) = (0, Vec::new());
        while got.len() < data.len() {
            sent += tx.try_send(&data[sent..]).unwrap();
            rx.try_recv(&mut |bytes| {
                got.extend_from_slice(bytes);
                bytes.len()
            })
            .unwrap();
        }
        assert_eq!(got, data);
        drop((tx, rx, a, b));
        assert!(!std::path::Path::new(&path(&name, 0)).exists());
    }

    fn write_file(path: &str, len: usize, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, vec![0u8; len]).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A hostile local user's plants at a peer's path: a link to a file of
    /// the right size, a file others may read, another user's file. Each is
    /// refused, and the link's target is left as it was.
    #[test]
    fn open_refuses_links_open_modes_and_other_users_files() {
        let (slots, capacity) = (2, 4096);
        let len = slots * (HEADER + capacity);
        let name = format!("test-hostile-{}", std::process::id());
        let at = path(&name, 1);
        let target = std::env::temp_dir().join(format!("cohort-shm-target-{}", std::process::id()));
        write_file(target.to_str().unwrap(), len, 0o600);
        std::os::unix::fs::symlink(&target, &at).unwrap();
        let err = Segment::open(&at, slots, capacity).err().expect("a link is refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        std::fs::remove_file(&at).unwrap();

        write_file(&at, len, 0o644);
        let err = Segment::open(&at, slots, capacity).err().expect("a file others may read is refused");
        assert!(err.to_string().contains("mode 0644"), "{err}");
        std::fs::remove_file(&at).unwrap();

        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            write_file(&at, len, 0o600);
            let c = CString::new(at.as_str()).unwrap();
            // SAFETY: `c` is NUL-terminated.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
            let err = Segment::open(&at, slots, capacity).err().expect("another user's file is refused");
            assert!(err.to_string().contains("belongs to user id 65534"), "{err}");
            std::fs::remove_file(&at).unwrap();
        }
        // A peer whose COHORT_SHM_RING differs: its file's size says so.
        write_file(&at, 2 * len, 0o600);
        let err = Segment::open(&at, slots, capacity).err().expect("a file of another size is refused");
        assert!(err.to_string().contains("another COHORT_SHM_RING"), "{err}");
        std::fs::remove_file(&at).unwrap();
        // A file of ours, 0600, of the right size, opens.
        write_file(&at, len, 0o600);
        assert!(Segment::open(&at, slots, capacity).is_ok());
        std::fs::remove_file(&at).unwrap();
        // `create` does not write through a link either.
        std::os::unix::fs::symlink(&target, &at).unwrap();
        assert!(Segment::create(&at, slots, capacity).is_err());
        std::fs::remove_file(&at).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), vec![0u8; len]);
        std::fs::remove_file(&target).unwrap();
    }

    #[test]
    fn a_created_segment_is_0600() {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("test-mode-{}", std::process::id());
        let seg = Segment::create(&path(&name, 0), 1, 4096).unwrap();
        let mode = std::fs::metadata(path(&name, 0)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        drop(seg);
        assert!(!std::path::Path::new(&path(&name, 0)).exists(), "unlinked when dropped");
    }

    /// Counters in a ring's header that no producer and consumer could
    /// have written (a stranger's or a corrupted process's bytes): the
    /// consumer's count ahead of the producer's, or the two further apart
    /// than the ring holds. Both ends refuse the ring with an error naming
    /// the counters, and write nothing outside it.
    #[test]
    fn garbage_ring_counters_are_refused_not_trusted() {
        let name = format!("test-garbage-{}", std::process::id());
        let capacity = 4096;
        let a = Arc::new(Segment::create(&path(&name, 0), 2, capacity).unwrap());
        let b = Arc::new(Segment::open(&path(&name, 0), 2, capacity).unwrap());
        // Both ends of slot 1's ring (the segment's last).
        let mut tx = ShmLink::new(&a, &b, 1, 0);
        let mut rx = ShmLink::new(&a, &b, 0, 1);
        let slot = HEADER + capacity;
        // SAFETY: slot 1's header lies in the mapping; the counters are
        // 8-byte aligned and only accessed atomically.
        let (head, tail) =
            unsafe { (&*a.ptr.add(slot).cast::<AtomicU64>(), &*a.ptr.add(slot + 64).cast::<AtomicU64>()) };
        // SAFETY: slot 0's data lies in the mapping.
        let neighbour = || unsafe { std::slice::from_raw_parts(a.ptr.add(HEADER), capacity).to_vec() };
        let before = neighbour();
        for (h, t) in [(5, 6), (0, u64::MAX), (capacity as u64 + 1, 0), (u64::MAX, 0), (u64::MAX - 9, u64::MAX - 9)] {
            head.store(h, Ordering::SeqCst);
            tail.store(t, Ordering::SeqCst);
            let err = tx.try_send(&vec![0xee; 3 * capacity]).expect_err("a corrupt ring is refused");
            assert!(err.to_string().contains(&format!("head {h}, tail {t}")), "{err}");
            let err = rx.try_recv(&mut |b| b.len()).expect_err("a corrupt ring is refused");
            assert!(err.to_string().contains("corrupt"), "{err}");
            assert_eq!((head.load(Ordering::SeqCst), tail.load(Ordering::SeqCst)), (h, t), "counters untouched");
        }
        assert_eq!(neighbour(), before, "nothing written outside the ring");
    }

    /// A published path is a rank's own only as its usual name or a fresh
    /// name beside it: nothing else is mapped or swept.
    #[test]
    fn a_rank_s_own_paths_are_its_usual_one_and_fresh_names_beside_it() {
        let usual = path("ab12", 3);
        assert!(is_own_path("ab12", 3, &usual));
        assert!(is_own_path("ab12", 3, &format!("{usual}-0123456789abcdef")));
        for other in [
            format!("{usual}-/../../etc/passwd"),
            format!("{usual}-anything"),
            format!("{usual}-0123456789abcde"),
            format!("{usual}0123456789abcdef"),
            path("ab12", 4),
            path("ab13", 3),
            "/tmp/x".to_string(),
        ] {
            assert!(!is_own_path("ab12", 3, &other), "{other}");
        }
    }

    /// Someone (another user, a leftover) already holds a rank's name in
    /// `/dev/shm`, as a file or a link: the rank creates its file under a
    /// fresh name next to it (what it publishes for its peers), and leaves
    /// the squatter's file, and a link's target, as they were.
    #[test]
    fn a_squatted_name_gets_a_fresh_one() {
        let name = format!("test-squat-{}", std::process::id());
        let at = path(&name, 1);
        write_file(&at, 100, 0o644);
        let (seg, got) = create_for(&name, 1, 2, 4096).expect("a fresh name");
        assert!(got.starts_with(&format!("{at}-")) && got.len() > at.len() + 8, "{got}");
        assert_eq!(std::fs::read(&at).unwrap(), vec![0u8; 100], "the squatter's file is untouched");
        assert!(Segment::open(&got, 2, 4096).is_ok(), "a peer maps it by the published name");
        drop(seg);
        assert!(!std::path::Path::new(&got).exists(), "unlinked when dropped");
        std::fs::remove_file(&at).unwrap();
        // A link planted at the name: a fresh name too, and nothing written
        // through the link into its target.
        let target = std::env::temp_dir().join(format!("cohort-squat-target-{}", std::process::id()));
        write_file(target.to_str().unwrap(), 100, 0o600);
        std::os::unix::fs::symlink(&target, &at).unwrap();
        let (seg, got) = create_for(&name, 1, 2, 4096).expect("a fresh name");
        assert!(got.starts_with(&format!("{at}-")), "{got}");
        assert_eq!(std::fs::read(&target).unwrap(), vec![0u8; 100], "the link's target is untouched");
        drop(seg);
        std::fs::remove_file(&at).unwrap();
        std::fs::remove_file(&target).unwrap();
        // Unsquatted, the rank's own name.
        let (_seg, got) = create_for(&name, 2, 2, 4096).unwrap();
        assert_eq!(got, path(&name, 2));
    }

    /// The launcher's sweep removes a fresh name a rank took (read from its
    /// `shm/<rank>` entry) as well as the usual one, and nothing else an
    /// entry names.
    #[test]
    fn the_sweep_removes_fresh_names_and_nothing_else() {
        let server = crate::store::StoreServer::bind("127.0.0.1:0", "secret").unwrap();
        let store =
            crate::store::StoreClient::connect(server.local_addr(), "secret", std::time::Duration::from_secs(10))
                .unwrap();
        let job = format!("{:08x}", std::process::id());
        assert_eq!(store.add("cohort/comm/instance/1", 2).unwrap(), 2);
        store.set("cohort/comm/1/job", format!("{job} 00").as_bytes()).unwrap();
        store.set("cohort/comm/2/job", format!("{job}ff 00").as_bytes()).unwrap();
        let fresh = format!("{}-0123456789abcdef", path(&job, 1));
        write_file(&fresh, 10, 0o600);
        store.set("cohort/comm/1/shm/1", fresh.as_bytes()).unwrap();
        // An entry naming some other file of this user's is not followed.
        let other = std::env::temp_dir().join(format!("cohort-sweep-other-{}", std::process::id()));
        write_file(other.to_str().unwrap(), 10, 0o600);
        store.set("cohort/comm/2/shm/1", other.to_str().unwrap().as_bytes()).unwrap();
        assert_eq!(sweep_shared_memory(&store, &[1]).unwrap(), 1);
        assert!(!std::path::Path::new(&fresh).exists());
        assert!(other.exists(), "only the job's own names are removed");
        std::fs::remove_file(other).unwrap();
    }

    /// A rank that made more communicators than one request reads has each
    /// of them swept (the first, the last of a batch, one in the next
    /// batch), communicators with no job entry are passed over as before,
    /// and entries too large together for one answer are read one by one.
    #[test]
    fn the_sweep_reads_every_communicator_in_batches() {
        let server = crate::store::StoreServer::bind("127.0.0.1:0", "secret").unwrap();
        let store =
            crate::store::StoreClient::connect(server.local_addr(), "secret", std::time::Duration::from_secs(30))
                .unwrap();
        let rank = 3;
        let made = SWEEP_BATCH + 2;
        assert_eq!(store.add(&format!("cohort/comm/instance/{rank}"), made).unwrap(), made);
        let swept = [1, SWEEP_BATCH, SWEEP_BATCH + 2];
        let mut files = Vec::new();
        for k in swept {
            let job = format!("{:08x}{k:04x}", std::process::id());
            store.set(&format!("cohort/comm/{k}/job"), format!("{job} 00").as_bytes()).unwrap();
            files.push(path(&job, rank));
            write_file(files.last().unwrap(), 10, 0o600);
        }
        // A communicator with a fresh name published but no job entry: its
        // file is left (nothing says whose job it is).
        let orphan_job = format!("{:08x}ffff", std::process::id());
        let orphan = format!("{}-0123456789abcdef", path(&orphan_job, rank));
        write_file(&orphan, 10, 0o600);
        store.set(&format!("cohort/comm/2/shm/{rank}"), orphan.as_bytes()).unwrap();
        assert_eq!(sweep_shared_memory(&store, &[rank]).unwrap(), swept.len());
        for f in &files {
            assert!(!std::path::Path::new(f).exists(), "{f} swept");
        }
        assert!(std::path::Path::new(&orphan).exists(), "no job entry, not swept");
        std::fs::remove_file(&orphan).unwrap();

        // Two `shm` entries of the first batch, each under the store's
        // limit but over it together: the multi-get is refused, and the
        // sweep reads the entries one by one and still removes every file.
        let half = crate::store::MAX_VALUE / 2 + 1;
        for k in [1, 3] {
            store.set(&format!("cohort/comm/{k}/shm/{rank}"), &vec![b'x'; half]).unwrap();
        }
        let keys = [format!("cohort/comm/1/shm/{rank}"), format!("cohort/comm/3/shm/{rank}")];
        assert!(
            matches!(
                store.multi_get(&[keys[0].as_str(), keys[1].as_str()]),
                Err(crate::store::StoreError::Refused { .. })
            ),
            "the store refuses the values in one answer"
        );
        for f in &files {
            write_file(f, 10, 0o600);
        }
        assert_eq!(sweep_shared_memory(&store, &[rank]).unwrap(), swept.len());
        for f in &files {
            assert!(!std::path::Path::new(f).exists(), "{f} swept");
        }
    }
}
