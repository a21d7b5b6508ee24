//! Catching SIGINT, SIGTERM and SIGHUP so the launcher can forward them to
//! its ranks instead of dying with them orphaned.
//!
//! The handler only writes the signal's number to a pipe (the one thing a
//! handler may safely do); a thread reads the pipe and turns each number into
//! an [`Event::Signal`] on the supervisor's channel while ranks run. When no
//! rank runs (rendezvous, between restarts) there is nothing to forward, and
//! the launcher exits at once with 128 + the signal's number.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use crossbeam::channel::Sender;

use crate::supervisor::Event;

/// The signals the launcher forwards.
pub const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Whether ranks run (or are being started or settled): signals then go to
/// the supervisor instead of ending the launcher.
static SUPERVISING: AtomicBool = AtomicBool::new(false);

/// Says whether ranks run: from just before the first is spawned until the
/// attempt's verdict is known.
///
/// A signal that comes while this is false ends the launcher; a rank being
/// spawned at that very moment dies with it through its parent-death signal.
pub fn set_supervising(on: bool) {
    SUPERVISING.store(on, Ordering::SeqCst);
}

/// Write end of the self-pipe, for the handler; -1 until installed.
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = PIPE_WRITE.load(Ordering::Relaxed);
    if fd >= 0 {
        let byte = sig as u8;
        // SAFETY: write(2) is async-signal-safe; `byte` lives for the call and
        // the fd is the pipe's write end, which is never closed. The pipe is
        // non-blocking: a full pipe drops the signal rather than block.
        unsafe {
            libc::write(fd, (&byte as *const u8).cast(), 1);
        }
    }
}

/// Installs the handlers and starts the thread that sends [`Event::Signal`]
/// to `events`. Call once, before spawning ranks.
pub fn install(events: Sender<Event>) -> io::Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill. O_CLOEXEC
    // keeps the pipe out of the ranks.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let [read_fd, write_fd] = fds;
    // The reading end must block: clear O_NONBLOCK on it.
    // SAFETY: fcntl on a descriptor we just created and own.
    unsafe {
        let flags = libc::fcntl(read_fd, libc::F_GETFL);
        libc::fcntl(read_fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    PIPE_WRITE.store(write_fd, Ordering::Relaxed);
    for sig in FORWARDED {
        // SAFETY: a zeroed sigaction is a valid starting value; we set a
        // handler of the right signature (no SA_SIGINFO), an empty mask, and
        // SA_RESTART so interrupted system calls of other threads resume.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    std::thread::Builder::new().name("cohort-signals".into()).spawn(move || loop {
        let mut byte = 0u8;
        // SAFETY: reads at most one byte into `byte`, which outlives the call;
        // `read_fd` is the pipe's read end, owned by this thread.
        let n = unsafe { libc::read(read_fd, (&mut byte as *mut u8).cast(), 1) };
        match n {
            1 => {
                let sig = byte as libc::c_int;
                if !SUPERVISING.load(Ordering::SeqCst) {
                    say!("cohort: got {} while no rank was running; exiting", crate::summary::signal_name(sig));
                    std::process::exit(128 + sig);
                }
                if events.send(Event::Signal(sig)).is_err() {
                    return;
                }
            }
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => return,
        }
    })?;
    Ok(())
}
