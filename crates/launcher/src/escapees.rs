//! Processes that left their rank's process group (`setsid`, a daemon) but
//! still hold the rank's stdout or stderr: the group kill at the end of an
//! attempt misses them, and while they live the launcher's readers never see
//! the end of the pipes. They are found by the pipes they hold (Linux: the
//! `pipe:[inode]` links under `/proc/<pid>/fd`) and killed.
//!
//! A process that left its group *and* let go of the rank's output (a
//! daemon that points its output at /dev/null) cannot be told apart from
//! any other process of this user, and is left running.

use std::io;
use std::os::fd::AsRawFd;

/// The inode that names the pipe behind `fd` (its two ends share it).
pub fn pipe_inode(fd: &impl AsRawFd) -> io::Result<u64> {
    // SAFETY: an all-zero `stat` is a valid value for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the call (borrowed) and `st` outlives it.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_ino as u64)
}

/// The processes other than this one that hold one of the pipes named by
/// `inodes` open (those whose descriptors this user may read).
pub fn holders(inodes: &[u64]) -> Vec<u32> {
    let me = std::process::id();
    let wanted: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let Ok(procs) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut found = Vec::new();
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        // Another user's process, or one that just ended: not readable.
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
        });
        if holds {
            found.push(pid);
        }
    }
    found
}

/// Kills (SIGKILL) every process that holds one of the pipes `inodes` and
/// is in none of the process groups `spared` (the ranks' own, already being
/// killed), with the process group of each that leads one; returns their
/// pids.
pub fn kill_holders(inodes: &[u64], spared: &[u32]) -> Vec<u32> {
    let mut killed = Vec::new();
    for pid in holders(inodes) {
        let pid = pid as libc::pid_t;
        // SAFETY: getpgid and kill(2) have no memory-safety preconditions.
        // The pid held the job's pipe a moment ago; a process that ended
        // since and whose number was reused in that moment is the one
        // risk, as with any signal sent by pid.
        unsafe {
            let group = libc::getpgid(pid);
            if group < 0 || spared.contains(&(group as u32)) {
                continue;
            }
            if group == pid {
                libc::kill(-pid, libc::SIGKILL);
            }
            libc::kill(pid, libc::SIGKILL);
        }
        killed.push(pid as u32);
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn the_holder_of_a_pipe_is_found_and_killed() {
        let mut child = Command::new("sleep").arg("30").stdout(Stdio::piped()).spawn().unwrap();
        let inode = pipe_inode(child.stdout.as_ref().unwrap()).unwrap();
        assert_eq!(holders(&[inode]), [child.id()]);
        assert_eq!(holders(&[inode + 1_000_000_007]), Vec::<u32>::new());
        assert_eq!(kill_holders(&[inode], &[]), [child.id()]);
        let status = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    }
}
