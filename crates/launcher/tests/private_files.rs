//! The launcher's files on a shared node: log folders 0700 and log files
//! 0600, and a trace or log folder that another user owns or may write into
//! refused before any rank starts ("hostile local user": the folders and
//! links are prepared in a temporary folder; as root the hostile folder is
//! given to user id 65534).

mod common;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

/// A world-writable folder (given to user 65534 when running as root) whose
/// `names` are links to `victim`.
fn hostile_dir(base: &Path, victim: &Path, names: &[&str]) -> std::path::PathBuf {
    let dir = base.join("shared");
    std::fs::create_dir(&dir).unwrap();
    for name in names {
        let link = dir.join(name);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(victim, link).unwrap();
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let c = CString::new(dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
    }
    dir
}

fn victim(base: &Path) -> std::path::PathBuf {
    let victim = base.join("victim");
    std::fs::write(&victim, b"the victim's secret").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    victim
}

#[test]
fn a_hostile_trace_dir_is_refused_before_any_rank_starts() {
    let base = temp_dir("hostile-trace");
    let victim = victim(&base);
    let dir = hostile_dir(&base, &victim, &["rank0.json.tmp", "rank0.json", "rank1.json.tmp"]);
    let pids = base.join("pids");
    std::fs::create_dir(&pids).unwrap();
    let opts = ["-n", "2", "--master-port", "0", "--trace-dir", dir.to_str().unwrap()];
    let out = output_within(cohort_run(&opts, &["pid", pids.to_str().unwrap()]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("cannot use the trace folder"), "{stderr}");
    assert!(read_pids(&pids).is_empty(), "no rank started");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's secret");
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn a_hostile_log_dir_is_refused_and_nothing_is_written_through_its_links() {
    let base = temp_dir("hostile-logs");
    let victim = victim(&base);
    let dir = hostile_dir(&base, &victim, &["attempt_0/rank_0/stdout.log", "attempt_0/rank_0/stderr.log"]);
    let opts = ["-n", "1", "--master-port", "0", "--log-dir", dir.to_str().unwrap()];
    let out = output_within(cohort_run(&opts, &["say", "rank output"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stderr}");
    assert!(stderr.contains("cannot use the log folder"), "{stderr}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's secret");
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn rank_logs_are_0600_in_0700_folders() {
    let base = temp_dir("log-modes");
    let logs = base.join("logs");
    let trace = base.join("trace");
    let opts =
        ["-n", "2", "--master-port", "0", "--log-dir", logs.to_str().unwrap(), "--trace-dir", trace.to_str().unwrap()];
    let out = output_within(cohort_run(&opts, &["say", "rank output"]), LIMIT);
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stderr}");
    assert_eq!(mode(&logs), 0o700);
    // No rank wrote a flight-recorder dump, so no trace folder was made (a
    // rank that writes one makes it 0700: comm's private_files tests).
    assert!(!trace.exists(), "{}", trace.display());
    for r in 0..2 {
        let rank_dir = logs.join("attempt_0").join(format!("rank_{r}"));
        assert_eq!(mode(&rank_dir), 0o700, "{}", rank_dir.display());
        for f in ["stdout.log", "stderr.log"] {
            assert_eq!(mode(&rank_dir.join(f)), 0o600, "{f} of rank {r}");
        }
        assert_eq!(std::fs::read_to_string(rank_dir.join("stdout.log")).unwrap(), "rank output\n");
    }
    let _ = std::fs::remove_dir_all(base);
}

/// The folder of the run files that `cohort status` reads (under
/// XDG_RUNTIME_DIR) is a link to a folder of the victim's, or another
/// user's folder: the launcher writes nothing there and says why, the job
/// still runs, and `cohort status` refuses the folder.
#[test]
fn a_hostile_run_file_folder_is_refused_and_nothing_is_written_there() {
    let base = temp_dir("hostile-run-files");
    let runtime = base.join("runtime");
    let elsewhere = base.join("elsewhere");
    for dir in [&runtime, &elsewhere] {
        std::fs::create_dir(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    std::os::unix::fs::symlink(&elsewhere, runtime.join("cohort")).unwrap();
    let check = |why: &str| {
        let mut run = cohort_run(&["-n", "1", "--master-port", "0"], &["say", "rank output"]);
        run.env("XDG_RUNTIME_DIR", &runtime);
        let out = output_within(run, LIMIT);
        let (stdout, stderr) = texts(&out);
        assert_eq!(code(out.status, &out), 0, "{stderr}");
        assert!(stdout.contains("rank output"), "{stdout}");
        assert!(
            stderr.contains("`cohort status` without flags will not find this job") && stderr.contains(why),
            "{stderr}"
        );
        let mut status = std::process::Command::new(COHORT);
        status.arg("status").env("XDG_RUNTIME_DIR", &runtime);
        status.env_remove("COHORT_STORE_ADDR").env_remove("COHORT_JOB_SECRET");
        status
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let out = output_within(status, LIMIT);
        let (_, stderr) = texts(&out);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("cannot look for jobs of yours") && stderr.contains(why), "{stderr}");
    };
    check("symbolic link");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing written through the link");
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::remove_file(runtime.join("cohort")).unwrap();
        let theirs = runtime.join("cohort");
        std::fs::create_dir(&theirs).unwrap();
        let c = CString::new(theirs.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        check("belongs to user id 65534");
        assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), 0, "nothing written into another user's folder");
    }
    let _ = std::fs::remove_dir_all(base);
}
