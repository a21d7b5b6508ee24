//! Files no other local user can steer: the flight recorder and the
//! timeline write only files of their own, 0600, never through a link, and
//! refuse a folder another user owns or may write into ("hostile local
//! user": the folders and links are prepared in a temporary folder; as root
//! the hostile ones are given to user id 65534).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use cohort_comm::trace::{FlightRecorder, Timeline};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cohort-private-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn euid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() }
}

/// Gives `path` (a link itself when `follow` is false) to user 65534 when
/// running as root; returns whether it did.
fn give_away(path: &Path, follow: bool) -> bool {
    if euid() != 0 {
        return false;
    }
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated.
    let rc = unsafe {
        if follow {
            libc::chown(c.as_ptr(), 65534, 65534)
        } else {
            libc::lchown(c.as_ptr(), 65534, 65534)
        }
    };
    assert_eq!(rc, 0, "chown {}", path.display());
    true
}

/// A file of the victim's, 0600, that nothing of cohort's may touch.
fn victim(base: &Path) -> PathBuf {
    let path = base.join("victim");
    std::fs::write(&path, b"the victim's secret").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_recorder_refuses_a_hostile_trace_dir_and_leaves_the_victims_file_alone() {
    let base = temp("hostile-trace");
    let victim = victim(&base);
    // Another user's world-writable folder, with the dump's names linked to
    // the victim's file (the reproduction in issue 20).
    let hostile = base.join("shared");
    std::fs::create_dir(&hostile).unwrap();
    let rank = FlightRecorder::global().identity().0;
    for name in [format!("rank{rank}.json.tmp"), format!("rank{rank}.json")] {
        std::os::unix::fs::symlink(&victim, hostile.join(&name)).unwrap();
        give_away(&hostile.join(&name), false);
    }
    std::fs::set_permissions(&hostile, std::fs::Permissions::from_mode(0o777)).unwrap();
    give_away(&hostile, true);
    let err = FlightRecorder::global().write_to(&hostile, "test").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
    let why = err.to_string();
    assert!(why.contains("belongs to user id 65534") || why.contains("can be written by other users"), "{why}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's secret");
    std::fs::remove_dir_all(base).unwrap();
}

#[test]
fn the_recorder_writes_0600_files_in_a_0700_folder_and_never_through_a_link() {
    let base = temp("own-trace");
    let victim = victim(&base);
    let dir = base.join("trace/deeper");
    let first = FlightRecorder::global().write_to(&dir, "test").unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&first), 0o600);
    assert_eq!(std::fs::metadata(&first).unwrap().uid(), euid());
    // Links left in our own folder (a stale temporary file, the dump itself)
    // are replaced, not followed.
    let name = first.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::remove_file(&first).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join(format!("{name}.tmp"))).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join(&name)).unwrap();
    let again = FlightRecorder::global().write_to(&dir, "test").unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's secret");
    assert!(std::fs::symlink_metadata(&again).unwrap().file_type().is_file());
    assert!(std::fs::read_to_string(&again).unwrap().contains("\"reason\": \"test\""));
    assert!(!dir.join(format!("{name}.tmp")).exists(), "the temporary file was renamed");
    std::fs::remove_dir_all(base).unwrap();
}

#[test]
fn the_timeline_never_writes_through_a_link_nor_into_another_users_file() {
    let base = temp("hostile-timeline");
    let victim = victim(&base);
    // A shared folder (sticky and world-writable, as /tmp) holding a link
    // at the timeline's path.
    let shared = base.join("tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let path = shared.join("timeline.json");
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    // Another user's link, or our own: refused and left alone (our own may
    // be one that matters, such as /dev/stdout to root).
    give_away(&path, false);
    let err = Timeline::create(&path).err().expect("a link at the timeline's path is refused");
    assert!(err.to_string().contains("symbolic link") || err.to_string().contains("belongs to"), "{err}");
    assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's secret");
    // A fresh timeline is 0600.
    let own = base.join("own.json");
    let timeline = Timeline::create(&own).unwrap();
    assert_eq!(mode(&own), 0o600);
    drop(timeline);
    std::fs::remove_dir_all(base).unwrap();
}
