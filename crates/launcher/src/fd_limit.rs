//! The launcher's limit on open files.
//!
//! The launcher holds several descriptors per local rank (its output pipes,
//! the node relay's socket pairs), so a node of a few hundred ranks passes
//! the usual soft limit of 1,024 and loses its relay. It raises its own soft
//! limit to the hard one, as far as it may without privileges, and its ranks
//! start with the limit the launcher was given (a program that uses
//! `select` needs descriptors below 1,024).

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::OnceLock;

/// The soft and hard limits the launcher was started with.
static GIVEN: OnceLock<libc::rlimit> = OnceLock::new();

/// Raises this process's soft limit on open files to its hard limit (at
/// most 1,048,576), remembering the limit it was given for its ranks.
/// Returns the soft limit now in force.
pub fn raise() -> io::Result<u64> {
    let mut given = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `given`, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut given) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let given = *GIVEN.get_or_init(|| given);
    let wanted = given.rlim_max.min(1 << 20);
    if wanted <= given.rlim_cur {
        return Ok(given.rlim_cur);
    }
    let raised = libc::rlimit { rlim_cur: wanted, rlim_max: given.rlim_max };
    // SAFETY: setrlimit reads one rlimit from `raised`, which outlives the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(wanted)
}

/// Makes `cmd`'s process start with the limit the launcher was given,
/// where [`raise`] changed it.
pub fn give_back_in(cmd: &mut Command) {
    let Some(&given) = GIVEN.get() else { return };
    // SAFETY: the closure runs in the forked child before exec and makes one
    // system call (setrlimit, a plain system call in glibc: no lock, no
    // allocation) with a value copied before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &given) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
