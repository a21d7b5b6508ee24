//! Room in this process's descriptor table before a burst of connections.
//!
//! Linux keeps a process's open files in one table that it doubles when a
//! new descriptor does not fit, and in a process of more than one thread
//! each doubling waits for an RCU grace period (`expand_fdtable` calls
//! `synchronize_rcu`) while every other descriptor the process asks for
//! past the old size waits too (7–16 ms each on a loaded two-core
//! machine). A store that accepts a thousand connections from a fresh
//! table crosses 64, 128, 256, 512 and 1,024 on the way, so the connections
//! it accepts meanwhile are greeted tens of milliseconds late (on a 16-core
//! host one turn of its accepting thread took 58 ms for 113 accepts).
//! [`reserve_descriptors`] grows the table once, to the size wanted, before
//! the burst: one wait at most, none in a process that has a single thread
//! then, and none later until that many are open. The table never shrinks,
//! and a child process gets a table sized to the descriptors it inherits,
//! not this one.

use std::io;
use std::thread::JoinHandle;

/// Room a store reserves at [`bind`](super::StoreServer::bind) (at most
/// the soft limit on open files): a connection per client, and a second
/// descriptor of each in the handshake. A little under 65,536, so that
/// Linux sizes the table at 65,536 (it rounds up to a power of two) and
/// not twice that.
pub(crate) const STORE_RESERVE: usize = 60_000;

/// Makes this process's descriptor table hold `more` descriptors beyond
/// the lowest free one, capped at the soft limit on open files, in one
/// step (see the module docs), so that opening them later never waits for
/// the table to grow. Waits for the growth (one RCU grace period when the
/// process has more than one thread, none otherwise). Returns the
/// descriptor count the table holds at least now; does nothing (and
/// returns 0) off Linux.
pub fn reserve_descriptors(more: usize) -> io::Result<usize> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into `limit`, which outlives the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // A socket takes the lowest free descriptor: where the room starts.
        let lowest = std::os::unix::net::UnixDatagram::unbound()?;
        let soft = usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX);
        let want = (lowest.as_raw_fd() as usize).saturating_add(more).min(soft).min(i32::MAX as usize);
        if want <= lowest.as_raw_fd() as usize + 1 {
            return Ok(want);
        }
        // The lowest free descriptor at or above want - 1: the table grows
        // to hold it in one step. Closed at once.
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) takes no pointers and returns a new
        // descriptor (owned at once) or -1.
        let top = unsafe { libc::fcntl(lowest.as_raw_fd(), libc::F_DUPFD_CLOEXEC, (want - 1) as libc::c_int) };
        if top < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `top` is a fresh descriptor nothing else owns.
        drop(unsafe { OwnedFd::from_raw_fd(top) });
        Ok(want)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = more;
        Ok(0)
    }
}

/// [`reserve_descriptors`] without waiting where waiting costs: at once
/// when this process has one thread (no grace period to wait for), else
/// on a short-lived thread whose handle is returned. Descriptors opened
/// meanwhile that fit the table as it was do not wait for it; failures are
/// logged at debug (the table then grows as it would have).
pub(crate) fn reserve_descriptors_soon(more: usize) -> Option<JoinHandle<()>> {
    let reserve = move || {
        if let Err(e) = reserve_descriptors(more) {
            tracing::debug!(error = %e, more, "could not grow the descriptor table ahead of need");
        }
    };
    if threads_in_process() == Some(1) {
        reserve();
        return None;
    }
    match std::thread::Builder::new().name("cohort-store-fds".into()).spawn(reserve) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::debug!(error = %e, "could not start the thread that grows the descriptor table");
            None
        }
    }
}

/// Threads of this process (`/proc/self/stat`), where the system says.
fn threads_in_process() -> Option<usize> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Field 20; the fields after the command name (which may hold spaces and
    // parentheses) start at field 3.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(17)?.parse().ok()
}

/// The descriptors this process's table holds now (`FDSize` in
/// `/proc/self/status`), where the system says.
#[cfg(test)]
pub(crate) fn descriptor_table_size() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("FDSize:"))?.trim().parse().ok()
}
