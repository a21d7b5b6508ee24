//! Run files: how `cohort status` with no flags finds this user's jobs on
//! this machine.
//!
//! Every `cohort run` writes two files into a folder of this user's
//! ([`folder`]: `$XDG_RUNTIME_DIR/cohort`, else `/tmp/cohort-<uid>`; 0700,
//! refused when it is a link, another user's or writable by others):
//! `job-<pid>-<ns>.secret`, the job's secret alone (what `cohort status
//! --secret-file` reads), and `job-<pid>-<ns>.run`, written last and whole
//! (renamed into place), with the store's address, the launcher's pid and
//! start time and its pid namespace `<ns>` (the inode of
//! `/proc/self/ns/pid`, as `lsns` names it). Both are 0600, never written
//! through a link, and removed when the launcher ends. A launcher that
//! cannot read its own start time writes none (a warning: its files would
//! look like a dead launcher's).
//!
//! A pid names a process only in its pid namespace, and launchers of
//! several namespaces may share the folder (containers that share `/tmp`
//! or the runtime folder): the namespace in the names keeps their files
//! apart, and a reader judges only its own namespace's. A launcher that was
//! killed leaves its files: its pid no longer runs with that start time, so
//! readers of its namespace pass them over and the next launcher or `cohort
//! status` there removes them. Files of another namespace are neither shown
//! nor removed. Files named without a namespace (`job-<pid>.run`: an older
//! cohort's, or a launcher's that cannot read `/proc/self/ns/pid`) may be
//! any namespace's: they are shown when their pid runs here with their
//! start time (the two together name one process) and never removed (remove
//! them by hand once their job is gone).

use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
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

/// Why a launcher wrote no run files.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The folder is refused or cannot be written.
    #[error(transparent)]
    Folder(#[from] PrivateFsError),
    /// The launcher's start time cannot be read.
    #[error(
        "cannot read this launcher's start time from /proc/{pid}/stat ({source}): without it every reader would \
         take its run files for a dead launcher's and remove them"
    )]
    NoStartTime {
        /// The launcher's pid.
        pid: u32,
        /// The reason.
        source: io::Error,
    },
}

/// Whose run files: a launcher's pid and its pid namespace (None: unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    pid: u32,
    ns: Option<u64>,
}

impl Key {
    /// The files' name without its ending: `job-<pid>-<ns>`, `job-<pid>`
    /// when the namespace is unknown.
    fn stem(self) -> String {
        match self.ns {
            Some(ns) => format!("job-{}-{ns}", self.pid),
            None => format!("job-{}", self.pid),
        }
    }

    /// The key of the run file named `name`; None for any other name.
    fn of_run_file(name: &str) -> Option<Key> {
        let stem = name.strip_prefix("job-")?.strip_suffix(".run")?;
        let (pid, ns) = match stem.split_once('-') {
            Some((pid, ns)) => (pid, Some(ns.parse().ok()?)),
            None => (stem, None),
        };
        Some(Key { pid: pid.parse().ok()?, ns })
    }
}

/// A launcher's run files, removed when dropped.
pub struct RunFile {
    dir: PrivateDir,
    key: Key,
}

impl RunFile {
    /// Writes this launcher's run files for the job whose store is at
    /// `addr` with `secret` (see the module docs), after removing those of
    /// this pid namespace's launchers that are gone. Fails when the folder
    /// is refused or cannot be written, or this launcher's start time
    /// cannot be read.
    pub fn publish(addr: &str, secret: &str) -> Result<RunFile, PublishError> {
        let pid = std::process::id();
        let dir = PrivateDir::open_or_create(&folder())?;
        RunFile::publish_in(dir, addr, secret, Key { pid, ns: pid_namespace() }, start_time(pid))
    }

    /// [`RunFile::publish`] into `dir` for the launcher `key` that started
    /// at `started`.
    fn publish_in(
        dir: PrivateDir,
        addr: &str,
        secret: &str,
        key: Key,
        started: io::Result<u64>,
    ) -> Result<RunFile, PublishError> {
        let started = started.map_err(|source| PublishError::NoStartTime { pid: key.pid, source })?;
        live_in(&dir, key.ns);
        let stem = key.stem();
        write_file(&dir, &format!("{stem}.secret"), secret)?;
        // From here on, what is there is this launcher's: removed on failure.
        let me = RunFile { dir, key };
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let pidns = key.ns.map_or(String::new(), |ns| format!("pidns={ns}\n"));
        let tmp = format!("{stem}.run.tmp");
        write_file(&me.dir, &tmp, &format!("addr={addr}\npid={}\n{pidns}start={started}\nsince={since}\n", key.pid))?;
        me.dir.rename(&tmp, &format!("{stem}.run"))?;
        Ok(me)
    }

    /// The file that holds the job's secret (for `--secret-file`).
    pub fn secret_path(&self) -> PathBuf {
        self.dir.path().join(format!("{}.secret", self.key.stem()))
    }
}

/// Writes `text` into the new file `name` of `dir`.
fn write_file(dir: &PrivateDir, name: &str, text: &str) -> Result<(), PrivateFsError> {
    let mut file = dir.create_file(name)?;
    file.write_all(text.as_bytes()).map_err(|source| PrivateFsError::Io { path: dir.path().join(name), source })
}

impl Drop for RunFile {
    fn drop(&mut self) {
        remove(&self.dir, self.key);
    }
}

fn remove(dir: &PrivateDir, key: Key) {
    let stem = key.stem();
    for name in [format!("{stem}.run"), format!("{stem}.run.tmp"), format!("{stem}.secret")] {
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

/// The jobs whose launchers run now in this pid namespace (and those named
/// without one whose pid and start time run here), newest first; the run
/// files of this namespace's launchers that are gone are removed (see the
/// module docs). An error names the folder when it cannot be used (another
/// user's, a link, writable by others).
pub fn live() -> Result<Vec<Job>, PrivateFsError> {
    let path = folder();
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(Vec::new());
    }
    Ok(live_in(&PrivateDir::open(&path)?, pid_namespace()))
}

/// [`live`] in the open folder `dir`, for a process of pid namespace `ours`.
fn live_in(dir: &PrivateDir, ours: Option<u64>) -> Vec<Job> {
    let Ok(entries) = std::fs::read_dir(dir.path()) else { return Vec::new() };
    let mut jobs = Vec::new();
    for entry in entries.flatten() {
        let Some(key) = entry.file_name().to_str().and_then(Key::of_run_file) else { continue };
        let running = |job: &Job| start_time(key.pid).ok() == Some(job.start);
        match key.ns {
            // Another namespace's launcher: its pid means nothing here.
            Some(_) if key.ns != ours => {}
            Some(_) => match read_job(dir, key) {
                Some(job) if running(&job) => jobs.push(job),
                // Its launcher is gone (or the file is not one a launcher wrote).
                _ => remove(dir, key),
            },
            // Any namespace's: shown when it runs here, never removed.
            None => jobs.extend(read_job(dir, key).filter(running)),
        }
    }
    jobs.sort_by_key(|j| std::cmp::Reverse(j.start));
    jobs
}

/// Reads launcher `key`'s run files (refusing links and files that are not
/// this user's alone, and a file whose pid or namespace is not its name's).
fn read_job(dir: &PrivateDir, key: Key) -> Option<Job> {
    let read = |name: &str| -> Option<String> {
        let mut text = String::new();
        dir.open_file(name).ok()??.take(64 * 1024).read_to_string(&mut text).ok()?;
        Some(text)
    };
    let stem = key.stem();
    let run = read(&format!("{stem}.run"))?;
    let field = |key: &str| run.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='));
    if field("pid")?.parse::<u32>().ok()? != key.pid || field("pidns").map(str::parse).transpose().ok()? != key.ns {
        return None;
    }
    let secret_name = format!("{stem}.secret");
    let secret = read(&secret_name)?;
    Some(Job {
        pid: key.pid,
        addr: field("addr")?.to_string(),
        secret_file: dir.path().join(secret_name),
        secret: secret.trim().to_string(),
        since: field("since")?.parse().ok()?,
        start: field("start")?.parse().ok()?,
    })
}

/// Process `pid`'s start time (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`): with the pid, it names one process for good. An
/// error when there is no such process or its stat cannot be read.
fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name (which may hold spaces and
    // parentheses) start at field 3.
    let start = stat.rfind(')').and_then(|at| stat[at + 1..].split_whitespace().nth(19)?.parse().ok());
    start.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no start time in it"))
}

/// This process's pid namespace: the inode of `/proc/self/ns/pid` (what
/// the link's `pid:[<inode>]` and `lsns` name it by; a kernel's namespaces
/// all live on its one nsfs, so the inode tells them apart). None where it
/// cannot be read (no such file in this `/proc`).
fn pid_namespace() -> Option<u64> {
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
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

    /// Above the kernel's largest pid (2^22): no process has it.
    const GONE: u32 = 1 << 23;

    #[test]
    fn this_process_start_time_is_read_and_a_gone_one_has_none() {
        assert!(start_time(std::process::id()).is_ok());
        assert_eq!(start_time(GONE).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    /// A fresh private folder for one test.
    fn test_dir(name: &str) -> PrivateDir {
        let path = std::env::temp_dir().join(format!("cohort-run-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        PrivateDir::open_or_create(&path).unwrap()
    }

    /// Writes the run files of launcher `pid` named `stem`, its run file
    /// saying `pidns` (none when None) and start time `start`.
    fn write_job(dir: &PrivateDir, stem: &str, pid: u32, pidns: Option<u64>, start: u64) {
        let pidns = pidns.map_or(String::new(), |ns| format!("pidns={ns}\n"));
        let run = format!("addr=127.0.0.1:1\npid={pid}\n{pidns}start={start}\nsince=1\n");
        write_file(dir, &format!("{stem}.run"), &run).unwrap();
        write_file(dir, &format!("{stem}.secret"), "s").unwrap();
    }

    fn names(dir: &PrivateDir) -> Vec<String> {
        let mut names: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }

    fn pids(jobs: &[Job]) -> Vec<u32> {
        jobs.iter().map(|j| j.pid).collect()
    }

    #[test]
    fn run_files_of_another_pid_namespace_are_left_alone_and_not_shown() {
        let dir = test_dir("other-ns");
        let (ours, theirs, me) = (Some(7), 8, std::process::id());
        // Their launchers: a pid that runs nowhere here, and one that is
        // ours here (with our start time): neither means anything here.
        write_job(&dir, &format!("job-{GONE}-{theirs}"), GONE, Some(theirs), 5);
        write_job(&dir, &format!("job-{me}-{theirs}"), me, Some(theirs), start_time(me).unwrap());
        // A file named without a namespace (an older cohort's, of any
        // namespace) whose pid runs nowhere here: left too.
        write_job(&dir, &format!("job-{}", GONE - 1), GONE - 1, Some(theirs), 5);
        let before = names(&dir);
        assert_eq!(before.len(), 6, "{before:?}");
        assert_eq!(pids(&live_in(&dir, ours)), Vec::<u32>::new());
        assert_eq!(names(&dir), before, "another namespace's files survive a read");
        std::fs::remove_dir_all(dir.path()).unwrap();
    }

    #[test]
    fn a_dead_launcher_of_this_pid_namespace_loses_its_files_and_a_live_one_is_shown() {
        let dir = test_dir("our-ns");
        let (ours, me) = (Some(7), std::process::id());
        let started = start_time(me).unwrap();
        write_job(&dir, &format!("job-{GONE}-7"), GONE, ours, 5);
        // Our pid, another start time: a dead launcher whose pid was reused.
        write_job(&dir, &format!("job-{me}-7"), me, ours, started + 1);
        assert_eq!(pids(&live_in(&dir, ours)), Vec::<u32>::new());
        assert_eq!(names(&dir), Vec::<String>::new(), "a dead launcher's files are removed");

        // A live one, and one named without a namespace (an older cohort's)
        // that runs here: both shown, nothing removed.
        write_job(&dir, &format!("job-{me}-7"), me, ours, started);
        write_job(&dir, &format!("job-{me}"), me, None, started);
        assert_eq!(pids(&live_in(&dir, ours)), vec![me, me]);
        assert_eq!(names(&dir).len(), 4);
        std::fs::remove_dir_all(dir.path()).unwrap();
    }

    #[test]
    fn a_launcher_without_its_start_time_publishes_nothing() {
        let dir = test_dir("no-start");
        let path = dir.path().to_path_buf();
        let key = Key { pid: std::process::id(), ns: Some(7) };
        let gone = Err(io::Error::from(io::ErrorKind::NotFound));
        let err = RunFile::publish_in(dir, "127.0.0.1:1", "s", key, gone).err().expect("refused");
        assert!(err.to_string().contains(&format!("start time from /proc/{}/stat", key.pid)), "{err}");
        assert_eq!(std::fs::read_dir(&path).unwrap().count(), 0, "no run file is written");

        // With it: its files, named and marked with its namespace, shown to
        // a reader of that namespace and removed when it drops.
        let dir = PrivateDir::open(&path).unwrap();
        let file = RunFile::publish_in(dir, "127.0.0.1:1", "s", key, start_time(key.pid)).unwrap();
        assert_eq!(file.secret_path(), path.join(format!("job-{}-7.secret", key.pid)));
        let dir = PrivateDir::open(&path).unwrap();
        let run = std::fs::read_to_string(path.join(format!("job-{}-7.run", key.pid))).unwrap();
        assert!(run.contains("pidns=7\n"), "{run}");
        assert_eq!(pids(&live_in(&dir, Some(7))), vec![key.pid]);
        assert_eq!(pids(&live_in(&dir, Some(8))), Vec::<u32>::new());
        drop(file);
        assert_eq!(names(&dir), Vec::<String>::new());
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn this_process_has_a_pid_namespace() {
        // Linux 3.8 and later: /proc/self/ns/pid.
        assert!(pid_namespace().is_some_and(|ns| ns > 0));
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
