//! Shared-memory links between ranks of one node.
//!
//! Each rank creates one file, `/dev/shm/cohort-<job>-<rank>`, holding one
//! single-producer single-consumer ring per same-node sender (slot `s` is
//! written by the rank of local index `s`, read by the owner). Every rank
//! maps its own file and its peers'; once every rank has mapped every file
//! (a store barrier), the owner unlinks its file, so nothing is left in
//! `/dev/shm` after set-up, whatever happens later. A [`Segment`] unlinks its
//! file when dropped before that point (a failed set-up, a panic).
//!
//! A rank killed during set-up (its launcher SIGKILLed, the OOM killer)
//! cannot unlink its file, so its owner holds an exclusive `flock` on the
//! file for as long as the name is its own: a file no process holds is
//! provably a dead rank's, and [`sweep_shared_memory`] removes those. The
//! launcher sweeps when it starts and after each attempt, and its reaper
//! once the launcher is gone, however it died. The lock names no job and no
//! process, so nothing is trusted from the file or the store, and a live
//! job's files (held) are never removed.
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

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
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
    owned: Option<Owned>,
}

/// The name of a segment this process created, and the descriptor that
/// holds the file's lock while the name is its own (see the module docs).
struct Owned {
    path: CString,
    _lock: OwnedFd,
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

/// What `posix_fallocate`'s result for a new segment means.
#[derive(Debug, PartialEq, Eq)]
enum Allocation {
    /// Every page is there.
    Done,
    /// The folder's filesystem cannot allocate ahead (`EOPNOTSUPP`,
    /// `EINVAL`: a `/dev/shm` that is not tmpfs, as under gVisor and some
    /// sandboxes): the file stays sparse, its pages come at the first write.
    Sparse,
    /// Too little room in the folder (`ENOSPC`): an error naming the bytes.
    NoRoom,
    /// Any other error, the set-up's error.
    Failed,
}

/// What `posix_fallocate` returning `rc` means (see [`Allocation`]).
fn allocation(rc: i32) -> Allocation {
    match rc {
        0 => Allocation::Done,
        libc::EOPNOTSUPP | libc::EINVAL => Allocation::Sparse,
        libc::ENOSPC => Allocation::NoRoom,
        _ => Allocation::Failed,
    }
}

impl Segment {
    /// Creates (exclusively) and maps the file at `path` with `slots` rings
    /// of `capacity` bytes each, zeroed and allocated (an error naming the
    /// room it needs when its folder has less; sparse where the folder's
    /// filesystem cannot allocate ahead), and holds its lock until
    /// [`Segment::unlink`] (or drop).
    pub(crate) fn create(path: &str, slots: usize, capacity: usize) -> io::Result<Segment> {
        let c_path = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let len = slots * (HEADER + capacity);
        let fd = create_locked(&c_path)?;
        let unlink = |err: io::Error| {
            // SAFETY: c_path is a valid path string; the file is ours (we
            // still hold its lock, so no sweep removed it).
            unsafe { libc::unlink(c_path.as_ptr()) };
            err
        };
        // SAFETY: fd is an open, writable file descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(unlink(io::Error::last_os_error()));
        }
        let ptr = map(fd.as_raw_fd(), len).map_err(unlink)?;
        let unmap = |err: io::Error| {
            // SAFETY: ptr/len are the mapping just made, which nothing uses yet.
            unsafe { libc::munmap(ptr.cast(), len) };
            err
        };
        // Every page now (after the mapping, which may fail without them),
        // not at the first write: a sparse file larger than the folder's
        // room (a container's /dev/shm) maps, and a write past the room
        // then kills the rank with SIGBUS. A folder whose filesystem cannot
        // allocate ahead (not tmpfs) keeps the sparse file, as before.
        // posix_fallocate may fail with EINTR when a signal is caught: again.
        let allocated = loop {
            // SAFETY: fd is an open, writable file descriptor we own.
            match unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) } {
                libc::EINTR => continue,
                rc => break rc,
            }
        };
        match allocation(allocated) {
            Allocation::Done => {}
            Allocation::Sparse => tracing::debug!(
                path,
                error = %io::Error::from_raw_os_error(allocated),
                "this folder's filesystem cannot allocate ahead (not tmpfs?): the file stays sparse"
            ),
            Allocation::NoRoom => {
                return Err(unmap(unlink(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "{path} needs {len} bytes ({slots} rings of {capacity} bytes and their headers), more than \
                         its folder has free: give the node a larger /dev/shm (`docker run --shm-size`, a tmpfs \
                         of its own) or smaller rings (COHORT_SHM_RING, bytes per ring)"
                    ),
                ))))
            }
            Allocation::Failed => return Err(unmap(unlink(io::Error::from_raw_os_error(allocated)))),
        }
        Ok(Segment { ptr, len, capacity, owned: Some(Owned { path: c_path, _lock: fd }) })
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
        Ok(Segment { ptr: mapped?, len, capacity, owned: None })
    }

    /// Removes the file's name (the mappings stay valid), then lets go of
    /// its lock. Idempotent.
    pub(crate) fn unlink(&mut self) {
        if let Some(owned) = self.owned.take() {
            // SAFETY: path is a valid NUL-terminated string.
            unsafe { libc::unlink(owned.path.as_ptr()) };
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

/// The folder of every rank's file.
const SHM_DIR: &str = "/dev/shm";

/// How many times [`create_locked`] makes its file again when a sweep took
/// it in the moment before it was locked (once is all a sweep can take).
const CREATE_TRIES: usize = 4;

/// Creates the file at `path` (`O_EXCL`, 0600, never through a link) and
/// takes its exclusive lock. A sweep may take the lock first, in the moment
/// between the two, and remove the file: the lock then comes once the sweep
/// is done (it holds it for a few system calls), the file is found unlinked
/// and made again under the same name.
fn create_locked(path: &CStr) -> io::Result<OwnedFd> {
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    for _ in 0..CREATE_TRIES {
        // SAFETY: path is a valid NUL-terminated string; open has no other
        // preconditions.
        let fd = unsafe { libc::open(path.as_ptr(), flags, 0o600 as libc::c_uint) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: open just returned this descriptor; it is owned once, here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if lock_while_linked(&fd)? {
            return Ok(fd);
        }
    }
    Err(io::Error::other(format!(
        "{} was removed {CREATE_TRIES} times between its creation and its lock: another process keeps sweeping it",
        path.to_string_lossy()
    )))
}

/// Takes `fd`'s exclusive lock, waiting while someone else (a sweep) holds
/// it; whether the file still has a name once the lock is ours.
fn lock_while_linked(fd: &OwnedFd) -> io::Result<bool> {
    loop {
        // SAFETY: fd is open; flock has no other preconditions.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX) } == 0 {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(fstat(fd)?.st_nlink > 0)
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open and `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Whether `name` (in [`SHM_DIR`]) is a rank's file: `cohort-<job>-<rank>`
/// ([`path`]) or a fresh name beside it (`...-<16 hex digits>`), with a
/// job id of hex digits (rank 0's random id).
fn is_segment_name(name: &str) -> bool {
    let Some((job, rest)) = name.strip_prefix("cohort-").and_then(|n| n.split_once('-')) else { return false };
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    hex(job)
        && match rest.split_once('-') {
            None => digits(rest),
            Some((rank, fresh)) => digits(rank) && fresh.len() == 16 && hex(fresh),
        }
}

/// Removes every rank's file in `/dev/shm` that is this user's and that no
/// live process holds: a rank that died between creating its file and
/// unlinking it (see the module docs), of any job. Returns how many it
/// removed. A live rank's file is held and left alone; so is anything not
/// named as a rank's file, another user's, or not a regular file. Costs one
/// read of the folder and a few system calls per rank's file there; waits
/// for nothing.
pub fn sweep_shared_memory() -> io::Result<usize> {
    sweep_in(Path::new(SHM_DIR))
}

/// [`sweep_shared_memory`] in the folder `dir`.
fn sweep_in(dir: &Path) -> io::Result<usize> {
    let c_dir =
        CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c_dir is NUL-terminated; open has no other preconditions.
    let fd = unsafe { libc::open(c_dir.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open just returned this descriptor; it is owned once, here.
    let dir_fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| is_segment_name(n)) else { continue };
        let Ok(c_name) = CString::new(name) else { continue };
        if remove_if_orphaned(&dir_fd, &c_name) {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Unlinks the file `name` of the open folder `dir` when it is a regular
/// file of this user's whose lock nobody holds; whether it did. The lock is
/// held from the check to the unlink, and the name must still be the file
/// that was locked, so a rank that creates its file meanwhile waits for the
/// lock and then sees that its file went ([`create_locked`]).
fn remove_if_orphaned(dir: &OwnedFd, name: &CStr) -> bool {
    // O_NONBLOCK: a FIFO does not wait for a writer (refused below).
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: dir is an open folder; name is NUL-terminated.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) };
    if fd < 0 {
        return false;
    }
    // SAFETY: openat just returned this descriptor; it is owned once, here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: geteuid(2) has no preconditions.
    let me = unsafe { libc::geteuid() };
    match fstat(&fd) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == me => {}
        _ => return false,
    }
    // SAFETY: fd is open; a lock that is held fails at once (LOCK_NB).
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return false;
    }
    let Ok(locked) = fstat(&fd) else { return false };
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut named: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: dir is open, name NUL-terminated, `named` a valid out-pointer;
    // AT_SYMLINK_NOFOLLOW describes a link itself.
    let same = unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut named, libc::AT_SYMLINK_NOFOLLOW) } == 0
        && locked.st_nlink > 0
        && (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino);
    // SAFETY: dir is open and name NUL-terminated; unlinkat removes the
    // name, never a link's target. The lock is released when fd drops.
    same && unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } == 0
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

    /// A folder of its own for a sweep test (another process's sweep of
    /// `/dev/shm` could take this test's orphans first).
    fn sweep_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("cohort-shm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    /// The sweep removes the files of ranks that are gone (no one holds
    /// them: a usual name and a fresh one), and leaves a live rank's file
    /// (its owner holds it, as every rank does until it unlinks), names
    /// that are not a rank's, and what is not a regular file.
    #[test]
    fn the_sweep_removes_only_files_no_live_rank_holds() {
        let dir = sweep_dir("sweep");
        let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
        let job = "0123456789abcdef";
        let live = Segment::create(&at(&format!("cohort-{job}-0")), 2, 4096).unwrap();
        let dead = [format!("cohort-{job}-1"), format!("cohort-{job}-2-0123456789abcdef")];
        for name in &dead {
            write_file(&at(name), 10, 0o600);
        }
        let others = ["cohort-test-1", "cohort-0123-x", "cohort-0123-1-abc", "other-0123-1", "cohort-0123"];
        for name in others {
            write_file(&at(name), 10, 0o600);
        }
        std::fs::create_dir(at(&format!("cohort-{job}-3"))).unwrap();
        std::os::unix::fs::symlink("/dev/null", at(&format!("cohort-{job}-4"))).unwrap();

        assert_eq!(sweep_in(&dir).unwrap(), dead.len());
        for name in &dead {
            assert!(std::fs::symlink_metadata(at(name)).is_err(), "{name} swept");
        }
        assert!(std::path::Path::new(&at(&format!("cohort-{job}-0"))).exists(), "a held file is left");
        for name in others.iter().map(|n| n.to_string()).chain([3, 4].map(|r| format!("cohort-{job}-{r}"))) {
            assert!(std::fs::symlink_metadata(at(&name)).is_ok(), "{name} left");
        }
        // Once its owner unlinks it (or dies), nothing of it is left.
        drop(live);
        assert_eq!(sweep_in(&dir).unwrap(), 0);
        assert!(!std::path::Path::new(&at(&format!("cohort-{job}-0"))).exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A `/dev/shm` with less room than a rank's rings (a container's is
    /// 64 MiB unless `--shm-size` says more; 8 ranks take 256 MiB): the
    /// segment is refused when it is made, naming the room it needs and
    /// what to change, and nothing is left; before, the file was made
    /// sparse and the first write past the room killed the rank (SIGBUS).
    #[test]
    fn a_segment_larger_than_its_folder_s_room_is_refused_when_made() {
        let dir = sweep_dir("small");
        let at = dir.join("cohort-ab-0");
        // SAFETY: fork(2); the child only mounts, makes the segment and
        // leaves with _exit, never returning into the test harness.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", io::Error::last_os_error());
        if child == 0 {
            let code = make_in_a_small_tmpfs(&dir, at.to_str().unwrap());
            // SAFETY: _exit(2) ends the forked child at once.
            unsafe { libc::_exit(code) };
        }
        let start = std::time::Instant::now();
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child, writing one int.
        while unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == 0 {
            if start.elapsed() > std::time::Duration::from_secs(60) {
                // SAFETY: kill(2) of our own child.
                unsafe { libc::kill(child, libc::SIGKILL) };
                panic!("the child did not finish within 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let what = match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
            (true, 0) => return,
            (true, 2) => "no mount namespace with a tmpfs of 64 KiB could be made",
            (true, 3) => "the segment was made, larger than its tmpfs",
            (true, 4) => "the refusal does not say what to change",
            (true, 5) => "the refused segment's file was left",
            _ => "the child died",
        };
        panic!("{what} (child status {status:#x})");
    }

    /// In a forked child: mounts a 64 KiB tmpfs on `dir` in a mount
    /// namespace of its own (and a user namespace when not root), and makes
    /// a segment of 2 MiB at `at` in it. The exit code for
    /// [`a_segment_larger_than_its_folder_s_room_is_refused_when_made`].
    fn make_in_a_small_tmpfs(dir: &Path, at: &str) -> i32 {
        // SAFETY: these calls change only this (forked, single-threaded)
        // process's namespaces and mounts; every pointer is a NUL-terminated
        // string or null.
        unsafe {
            let (uid, gid) = (libc::geteuid(), libc::getegid());
            if uid == 0 {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return 2;
                }
            } else {
                if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                    return 2;
                }
                let maps = [
                    ("/proc/self/setgroups", "deny".to_string()),
                    ("/proc/self/uid_map", format!("{uid} {uid} 1")),
                    ("/proc/self/gid_map", format!("{gid} {gid} 1")),
                ];
                for (file, text) in maps {
                    if std::fs::write(file, text).is_err() {
                        return 2;
                    }
                }
            }
            let c_dir = CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
            let private = libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            );
            let tmpfs =
                libc::mount(c"tmpfs".as_ptr(), c_dir.as_ptr(), c"tmpfs".as_ptr(), 0, c"size=64k".as_ptr().cast());
            if private != 0 || tmpfs != 0 {
                return 2;
            }
        }
        match Segment::create(at, 2, 1 << 20) {
            Ok(_) => 3,
            Err(e) if !e.to_string().contains("COHORT_SHM_RING") => 4,
            Err(_) if std::fs::symlink_metadata(at).is_ok() => 5,
            Err(_) => 0,
        }
    }

    /// `posix_fallocate`'s answer: a folder that cannot allocate ahead
    /// keeps the sparse file (as before allocating); only a full one is the
    /// clear error.
    #[test]
    fn a_folder_that_cannot_allocate_ahead_keeps_a_sparse_file_and_only_a_full_one_is_refused() {
        assert_eq!(allocation(0), Allocation::Done);
        // A /dev/shm that is not tmpfs (gVisor, some sandboxes).
        assert_eq!(allocation(libc::EOPNOTSUPP), Allocation::Sparse);
        assert_eq!(allocation(libc::EINVAL), Allocation::Sparse);
        assert_eq!(allocation(libc::ENOSPC), Allocation::NoRoom);
        assert_eq!(allocation(libc::EIO), Allocation::Failed);
        assert_eq!(allocation(libc::EFBIG), Allocation::Failed);
    }

    /// A rank that creates its file while a sweep holds it (the moment
    /// between creation and lock): its lock waits for the sweep, then it
    /// sees its file was removed (and makes it again).
    #[test]
    fn a_file_swept_before_its_lock_is_seen_as_gone() {
        let dir = sweep_dir("race");
        let at = dir.join("cohort-ab-0");
        write_file(at.to_str().unwrap(), 10, 0o600);
        let mine = OwnedFd::from(std::fs::File::open(&at).unwrap());
        let sweeper = OwnedFd::from(std::fs::File::open(&at).unwrap());
        // SAFETY: sweeper is open.
        assert_eq!(unsafe { libc::flock(sweeper.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(lock_while_linked(&mine).unwrap()).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(rx.try_recv().is_err(), "the lock waits while the sweep holds it");
        std::fs::remove_file(&at).unwrap();
        drop(sweeper);
        assert!(!rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap(), "the file is gone");
        // Not swept: it is its own still.
        let mine = OwnedFd::from(std::fs::File::create(&at).unwrap());
        assert!(lock_while_linked(&mine).unwrap());
        assert_eq!(sweep_in(&dir).unwrap(), 0, "a held file is not swept");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
