//! Run files: how `cohort status` with no flags finds this user's jobs on
//! this machine.
//!
//! Every `cohort run` writes two files into a folder of this user's
//! ([`folder`]: `$XDG_RUNTIME_DIR/cohort`, else `/tmp/cohort-<uid>`; 0700,
//! refused when it is a link, another user's or writable by others):
//! `job-<pid>.secret`, the job's secret alone (what `cohort status
//! --secret-file` reads), and `job-<pid>.run`, written last and whole
//! (renamed into place), with the store's address and the launcher's pid
//! and start time. Both are 0600, never written through a link, and
//! removed when the launcher ends. A launcher that was killed leaves them:
//! its pid no longer runs with that start time, so readers pass them over
//! and the next launcher or `cohort status` removes them.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use cohort_runtime::private_fs::{effective_uid, PrivateDir, PrivateFsError};

/// The folder of this user's run files: `$XDG_RUNTIME_DIR/cohort` where
/// `XDG_RUNTIME_DIR` names a folder of this user's that no one else may
/// write, else `/tmp/cohort-<uid>`.
pub fn folder() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() && PrivateDir::open(&dir).is_ok() => dir.join("cohort"),
        _ => PathBuf::from(format!("/tmp/cohort-{}", effective_uid())),
    }
}

/// A launcher's run files, removed when dropped.
pub struct RunFile {
    dir: PrivateDir,
    pid: u32,
}

impl RunFile {
    /// Writes this launcher's run files for the job whose store is at
    /// `addr` with `secret` (see the module docs), after removing those of
    /// launchers that are gone. Fails when the folder is refused or cannot
    /// be written.
    pub fn publish(addr: &str, secret: &str) -> Result<RunFile, PrivateFsError> {
        let dir = PrivateDir::open_or_create(&folder())?;
        live_in(&dir);
        let pid = std::process::id();
        let me = RunFile { dir, pid };
        let write = |name: &str, text: &str| {
            let mut file = me.dir.create_file(name)?;
            file.write_all(text.as_bytes())
                .map_err(|source| PrivateFsError::Io { path: me.dir.path().join(name), source })
        };
        write(&format!("job-{pid}.secret"), secret)?;
        let started = start_time(pid).unwrap_or(0);
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let tmp = format!("job-{pid}.run.tmp");
        write(&tmp, &format!("addr={addr}\npid={pid}\nstart={started}\nsince={since}\n"))?;
        me.dir.rename(&tmp, &format!("job-{pid}.run"))?;
        Ok(me)
    }

    /// The file that holds the job's secret (for `--secret-file`).
    pub fn secret_path(&self) -> PathBuf {
        self.dir.path().join(format!("job-{}.secret", self.pid))
    }
}

impl Drop for RunFile {
    fn drop(&mut self) {
        remove(&self.dir, self.pid);
    }
}

fn remove(dir: &PrivateDir, pid: u32) {
    for name in [format!("job-{pid}.run"), format!("job-{pid}.run.tmp"), format!("job-{pid}.secret")] {
        dir.remove(&name);
    }
}

/// A running job of this user's on this machine, from its run files.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Its launcher's pid.
    pub pid: u32,
    /// Its store, `HOST:PORT`.
    pub addr: String,
    /// The file holding its secret.
    pub secret_file: PathBuf,
    /// The secret.
    pub secret: String,
    /// When its launcher started (seconds since 1970).
    pub since: u64,
    /// Its launcher's start time (clock ticks since boot: orders jobs).
    start: u64,
}

/// The jobs whose launchers run now, newest first; the run files of
/// launchers that are gone are removed. An error names the folder when it
/// cannot be used (another user's, a link, writable by others).
pub fn live() -> Result<Vec<Job>, PrivateFsError> {
    let path = folder();
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(Vec::new());
    }
    Ok(live_in(&PrivateDir::open(&path)?))
}

/// [`live`] in the open folder `dir`.
fn live_in(dir: &PrivateDir) -> Vec<Job> {
    let Ok(entries) = std::fs::read_dir(dir.path()) else { return Vec::new() };
    let mut jobs = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("job-")?.strip_suffix(".run")?.parse().ok()) else {
            continue;
        };
        match read_job(dir, pid) {
            Some(job) if start_time(pid) == Some(job.start) => jobs.push(job),
            // Its launcher is gone (or the file is not one a launcher wrote).
            _ => remove(dir, pid),
        }
    }
    jobs.sort_by_key(|j| std::cmp::Reverse(j.start));
    jobs
}

/// Reads launcher `pid`'s run files (refusing links and files that are not
/// this user's alone).
fn read_job(dir: &PrivateDir, pid: u32) -> Option<Job> {
    let read = |name: &str| -> Option<String> {
        let mut text = String::new();
        dir.open_file(name).ok()??.take(64 * 1024).read_to_string(&mut text).ok()?;
        Some(text)
    };
    let run = read(&format!("job-{pid}.run"))?;
    let field = |key: &str| run.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='));
    if field("pid")?.parse::<u32>().ok()? != pid {
        return None;
    }
    let secret_name = format!("job-{pid}.secret");
    let secret = read(&secret_name)?;
    Some(Job {
        pid,
        addr: field("addr")?.to_string(),
        secret_file: dir.path().join(secret_name),
        secret: secret.trim().to_string(),
        since: field("since")?.parse().ok()?,
        start: field("start")?.parse().ok()?,
    })
}

/// Process `pid`'s start time (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`): with the pid, it names one process for good. None
/// when there is no such process.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces and
    // parentheses) start at field 3.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// The `cohort status` line that shows the job of `addr` whose secret is in
/// `secret_file`, quoted for a POSIX shell.
pub fn status_line(addr: &str, secret_file: &Path) -> String {
    format!("cohort status --store-addr {} --secret-file {}", quoted(addr), quoted(&secret_file.to_string_lossy()))
}

fn quoted(word: &str) -> String {
    if !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._-:@+,=".contains(&b)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_start_time_is_read_and_a_gone_one_has_none() {
        assert!(start_time(std::process::id()).is_some());
        // Above the kernel's largest pid (2^22).
        assert_eq!(start_time(1 << 23), None);
    }

    #[test]
    fn a_status_line_quotes_what_a_shell_would_split() {
        assert_eq!(
            status_line("127.0.0.1:29500", Path::new("/run/user/1000/cohort/job-7.secret")),
            "cohort status --store-addr 127.0.0.1:29500 --secret-file /run/user/1000/cohort/job-7.secret"
        );
        assert_eq!(
            status_line("[::1]:5", Path::new("/tmp/a b/it's")),
            r"cohort status --store-addr '[::1]:5' --secret-file '/tmp/a b/it'\''s'"
        );
    }
}
