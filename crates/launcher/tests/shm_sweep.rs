//! Shared memory that ranks killed during set-up leave in `/dev/shm`: a
//! launcher SIGKILLed while its ranks' files exist leaves none behind (its
//! reaper sweeps them), and a live job's files survive another launcher's
//! sweeps.
//!
//! To catch the moment (a few milliseconds) when the files exist, the test
//! watches `/dev/shm` (inotify) and stops the launcher (SIGSTOP) as soon as
//! one of the job's files appears: the launcher serves the store, so every
//! rank then waits in its next store call, before the barrier after which
//! it would unlink its file.

mod common;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use cohort_comm::store::StoreClient;
use common::*;

const SUITE: &str = env!("CARGO_BIN_EXE_cohort-comm-suite");
const SECRET: &str = "shm-sweep-test-secret";
/// Jobs tried before the test gives up catching their files (it fails then:
/// the machine was too slow or too fast to show anything).
const TRIES: usize = 6;

/// `cohort run -n 4` of ranks that write their pids into `pids`, form a
/// communicator and pass a barrier, its store on `port` under [`SECRET`].
fn job(port: u16, pids: &Path) -> Child {
    let mut c = cohort_run_program(
        SUITE,
        &["-n", "4", "--master-port", "0", "--store-port", &port.to_string(), "--heartbeat-timeout", "0"],
        &["--pid-dir", pids.to_str().unwrap(), "barrier"],
    );
    c.env("COHORT_JOB_SECRET", SECRET).env("OMP_NUM_THREADS", "1");
    c.spawn().expect("start cohort run")
}

/// An inotify watch of `/dev/shm`'s new files.
struct ShmWatch(libc::c_int);

impl ShmWatch {
    fn new() -> ShmWatch {
        // SAFETY: inotify_init1 has no preconditions.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        assert!(fd >= 0, "inotify: {}", std::io::Error::last_os_error());
        let dir = CString::new("/dev/shm").unwrap();
        // SAFETY: fd is an inotify descriptor; dir is NUL-terminated.
        let wd = unsafe { libc::inotify_add_watch(fd, dir.as_ptr(), libc::IN_CREATE) };
        assert!(wd >= 0, "watch /dev/shm: {}", std::io::Error::last_os_error());
        ShmWatch(fd)
    }

    /// Waits (up to `limit`) for a new file whose name starts with `prefix`.
    fn wait_for(&self, prefix: &str, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        let mut buf = vec![0u8; 64 * 1024];
        while Instant::now() < end {
            let mut fds = libc::pollfd { fd: self.0, events: libc::POLLIN, revents: 0 };
            // SAFETY: `fds` is one valid pollfd.
            unsafe { libc::poll(&mut fds, 1, 50) };
            // SAFETY: buf is writable for its length.
            let n = unsafe { libc::read(self.0, buf.as_mut_ptr().cast(), buf.len()) };
            let mut at = 0;
            while n > 0 && at + 16 <= n as usize {
                // struct inotify_event: wd, mask, cookie, len, then `len` bytes of name.
                let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                let name = &buf[at + 16..at + 16 + len];
                let name = String::from_utf8_lossy(name.split(|&b| b == 0).next().unwrap_or_default());
                if name.starts_with(prefix) {
                    return true;
                }
                at += 16 + len;
            }
        }
        false
    }
}

impl Drop for ShmWatch {
    fn drop(&mut self) {
        // SAFETY: the descriptor is ours.
        unsafe { libc::close(self.0) };
    }
}

/// The files of job `id` in `/dev/shm`.
fn files_of(id: &str) -> Vec<String> {
    let prefix = format!("cohort-{id}-");
    let mut found: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect();
    found.sort();
    found
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child, the launcher.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

/// A job stopped in its ranks' set-up.
struct Stopped {
    launcher: Child,
    /// Its ranks' pids (stopped too).
    ranks: Vec<i32>,
    /// Its communicator's job id, which names the ranks' files.
    id: String,
    /// Its files that exist and that their ranks hold (a rank stopped
    /// between creating its file and locking it does not hold it yet: a
    /// sweep may take it, and the rank makes it again when it goes on).
    files: Vec<String>,
    /// The folder of the ranks' pid files.
    pid_dir: PathBuf,
}

impl Stopped {
    /// Lets the job go on.
    fn resume(&self) {
        for &p in &self.ranks {
            // SAFETY: kill(2) on the pids our job's ranks wrote.
            unsafe { libc::kill(p, libc::SIGCONT) };
        }
        signal(&self.launcher, libc::SIGCONT);
    }
}

/// Starts jobs until one is stopped (its launcher, then its ranks,
/// SIGSTOPped) while some of its ranks' files exist.
fn job_stopped_with_files() -> Stopped {
    for _ in 0..TRIES {
        let watch = ShmWatch::new();
        let port = free_port();
        let pids = temp_dir(&format!("shm-sweep-{port}"));
        let child = job(port, &pids);
        let store = StoreClient::connect(format!("127.0.0.1:{port}"), SECRET, Duration::from_secs(60))
            .expect("reach the job's store");
        // Rank 0's random id, which names the communicator's files.
        let key = "cohort/comm/1/job";
        store.wait(&[key], Duration::from_secs(60)).expect("the communicator's job entry");
        let entry = store.get(key).unwrap().expect("the job entry");
        let id = String::from_utf8_lossy(&entry).split(' ').next().unwrap().to_string();
        let seen = watch.wait_for(&format!("cohort-{id}-"), Duration::from_secs(60));
        // The store stops, so no rank passes the barrier after which it
        // unlinks its file; then the ranks stop, so none that passed it
        // already unlinks its file now: what exists stays.
        signal(&child, libc::SIGSTOP);
        let ranks = wait_pid_files(&pids, 4, Duration::from_secs(60));
        for &p in &ranks {
            // SAFETY: kill(2) on the pids our job's ranks wrote.
            unsafe { libc::kill(p, libc::SIGSTOP) };
        }
        // A signal is delivered after kill(2) returns: a rank on another
        // core may still unlink its file until it has stopped.
        for &p in &ranks {
            wait_stopped(p, Duration::from_secs(60));
        }
        let files: Vec<String> = files_of(&id).into_iter().filter(|f| held(f)).collect();
        if seen && !files.is_empty() {
            return Stopped { launcher: child, ranks, id, files, pid_dir: pids };
        }
        // Too late: every rank had unlinked its file. Again.
        signal(&child, libc::SIGKILL);
        let _ = wait_output(child, Duration::from_secs(60));
        let _ = std::fs::remove_dir_all(pids);
    }
    panic!("in {TRIES} jobs, the launcher never stopped while its ranks' shared-memory files existed");
}

/// Whether a process holds the lock of `/dev/shm/<name>` (as its rank
/// does from just after creating it until it unlinks it).
fn held(name: &str) -> bool {
    let Ok(file) = std::fs::File::open(Path::new("/dev/shm").join(name)) else { return false };
    use std::os::fd::AsRawFd;
    // SAFETY: flock(2) on a file we opened; a free lock taken here is let
    // go when `file` closes, at the end of this function.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0 }
}

/// Waits up to `limit` for process `pid` to be stopped (or gone).
fn wait_stopped(pid: i32, limit: Duration) {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return };
        // "pid (command) state ...": the state follows the last ')'.
        if stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next()) == Some("T") {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("process {pid} did not stop within {limit:?}");
}

/// Waits up to `limit` for the files of job `id` to be gone; those left.
fn wait_files_gone(id: &str, limit: Duration) -> Vec<String> {
    let end = Instant::now() + limit;
    loop {
        let left = files_of(id);
        if left.is_empty() || Instant::now() >= end {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_launcher_killed_during_set_up_leaves_no_shared_memory() {
    let job = job_stopped_with_files();
    // The launcher dies; its ranks die with it (parent-death signal, reaper).
    signal(&job.launcher, libc::SIGKILL);
    let out = wait_output(job.launcher, Duration::from_secs(60));
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&out.status), Some(libc::SIGKILL));
    let left = wait_all_gone(&job.ranks, Duration::from_secs(30));
    assert!(left.is_empty(), "ranks left alive: {left:?}");
    let left = wait_files_gone(&job.id, Duration::from_secs(30));
    assert!(left.is_empty(), "the killed job's files {left:?} are left in /dev/shm (it had {:?})", job.files);
    let _ = std::fs::remove_dir_all(job.pid_dir);
}

#[test]
fn a_live_job_s_shared_memory_survives_another_launcher_s_sweeps() {
    let job = job_stopped_with_files();
    // Its ranks live and hold their files. Another launcher sweeps when it
    // starts and after its attempt, its reaper when it ends: the same sweep
    // this test runs then.
    let other = cohort_run(&["-n", "1", "--master-port", "0"], &["say", "other job"]);
    let out = output_within(other, Duration::from_secs(60));
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success() && stdout.contains("other job"), "{stdout}\n{stderr}");
    let swept = cohort_comm::sweep_shared_memory().expect("sweep /dev/shm");
    let left = files_of(&job.id);
    job.resume();
    // The job goes on as if nothing happened, and leaves nothing.
    let out = wait_output(job.launcher, Duration::from_secs(120));
    let (stdout, stderr) = texts(&out);
    let removed: Vec<&String> = job.files.iter().filter(|f| !left.contains(f)).collect();
    assert!(
        removed.is_empty(),
        "a live job's files {removed:?} were removed (this sweep removed {swept}):\n{stdout}\n{stderr}"
    );
    assert!(out.status.success(), "the job failed after the sweeps:\n{stdout}\n{stderr}");
    assert!(wait_files_gone(&job.id, Duration::from_secs(30)).is_empty());
    let _ = std::fs::remove_dir_all(job.pid_dir);
}
