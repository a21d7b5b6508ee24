//! Processes that left their rank's process group (`setsid`, a daemon): the
//! group kill at the end of an attempt misses them, and while one holds the
//! rank's stdout or stderr the launcher's readers never see the end of the
//! pipes. They are found (Linux, this user's processes) by the pipes they
//! hold (the `pipe:[inode]` links under `/proc/<pid>/fd`) or by the
//! environment they inherited from their rank (`/proc/<pid>/environ` holding
//! every one of the attempt's marks: the store's address, the job's secret,
//! the node and the attempt), and killed.
//!
//! A process that left its group, let go of the rank's output *and* was
//! started with another environment (`env -i`) cannot be told apart from
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
/// `inodes` open, or whose environment holds every `NAME=value` of `marks`
/// (none when `marks` is empty), among those whose descriptors and
/// environment this user may read.
pub fn find(inodes: &[u64], marks: &[String]) -> Vec<u32> {
    let me = std::process::id();
    let wanted: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let Ok(procs) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut found = Vec::new();
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let marked = || {
            !marks.is_empty()
                && std::fs::read(entry.path().join("environ"))
                    .is_ok_and(|env| marks.iter().all(|m| env.split(|&b| b == 0).any(|var| var == m.as_bytes())))
        };
        // Another user's process, or one that just ended: not readable.
        let holds = || {
            std::fs::read_dir(entry.path().join("fd")).is_ok_and(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
                })
            })
        };
        if marked() || (!wanted.is_empty() && holds()) {
            found.push(pid);
        }
    }
    found
}

/// Kills (SIGKILL) every process [`find`] finds that is in none of the
/// process groups `spared` (the ranks' own, already being killed), with
/// the process group of each that leads one; returns their pids.
pub fn kill(inodes: &[u64], marks: &[String], spared: &[u32]) -> Vec<u32> {
    let mut killed = Vec::new();
    for pid in find(inodes, marks) {
        let pid = pid as libc::pid_t;
        // SAFETY: getpgid and kill(2) have no memory-safety preconditions.
        // The pid held the job's pipe (or environment) a moment ago; a
        // process that ended since and whose number was reused in that
        // moment is the one risk, as with any signal sent by pid.
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
        assert_eq!(find(&[inode], &[]), [child.id()]);
        assert_eq!(find(&[inode + 1_000_000_007], &[]), Vec::<u32>::new());
        assert_eq!(kill(&[inode], &[], &[]), [child.id()]);
        let status = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    }

    #[test]
    fn a_process_is_found_by_every_mark_of_its_environment() {
        let token = format!("COHORT_ESCAPEE_TEST={}", std::process::id());
        let (name, value) = token.split_once('=').unwrap();
        let mut child = Command::new("sleep").arg("30").env(name, value).env("OTHER", "1").spawn().unwrap();
        let both = [token.clone(), "OTHER=1".to_string()];
        // The parent may resume before exec has set up the new environment.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while find(&[], &both).is_empty() && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(find(&[], &both), [child.id()]);
        assert_eq!(find(&[], &[token.clone(), "OTHER=2".into()]), Vec::<u32>::new(), "every mark must match");
        assert_eq!(find(&[], &[format!("{token}0")]), Vec::<u32>::new(), "whole variables only");
        assert_eq!(kill(&[], &both, &[]), [child.id()]);
        let status = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    }
}
