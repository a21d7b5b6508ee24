//! `cohort trace` (merge the ranks' flight recorders), `cohort store`
//! (serve a rendezvous store), and the flight-recorder part of `cohort
//! run`'s failure summary.

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use cohort_comm::store::StoreServer;
use cohort_comm::trace::{merge_files, MergeReport};
use cohort_runtime::config;

use crate::cli::{StoreArgs, TraceArgs};
use crate::summary::Parting;

/// `cohort trace <dir|file>...`: prints the merged report; exits 0 when
/// every recorded collective finished on every rank, 2 when one did not,
/// and 1 when the dumps cannot be read.
pub fn trace(args: TraceArgs) -> ExitCode {
    let paths: Vec<&Path> = args.paths.iter().map(|p| p.as_path()).collect();
    match merge_files(&paths) {
        Ok(report) => {
            print!("{report}");
            ExitCode::from(if report.first_unfinished.is_some() { 2 } else { 0 })
        }
        Err(e) => {
            say!("cohort: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Removes the flight-recorder dumps (`rank<N>.json`) an earlier run left
/// in `dir`. Does not create it: a rank that writes a dump makes it (0700,
/// see `cohort_runtime::private_fs`), so a job that writes none leaves no
/// empty folder behind. A folder that is not this user's own is left alone.
pub fn clear_dumps(dir: &Path) {
    if !dir.exists() {
        return;
    }
    let folder = match cohort_runtime::private_fs::PrivateDir::open(dir) {
        Ok(folder) => folder,
        Err(e) => {
            tracing::warn!("cannot use the trace folder: {e}");
            return;
        }
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dump = name
            .strip_prefix("rank")
            .and_then(|rest| rest.strip_suffix(".json"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if is_dump {
            folder.remove(&name);
        }
    }
}

/// Whether `dir` holds a flight-recorder dump (`*.json`).
fn has_dumps(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|d| d.flatten().any(|e| e.path().extension().is_some_and(|x| x == "json")))
}

/// The merged report of the dumps in `dir`, for the failure summary. When
/// no rank wrote one: why none could be written there (the folder cannot be
/// made or written, its filesystem is full), else `None`.
pub fn report(dir: &Path) -> Option<String> {
    if !has_dumps(dir) {
        return unusable(dir).map(|why| {
            format!(
                "flight recorder: none in {}: {why}, so the ranks could not write theirs there; free space there \
                 or choose another --trace-dir",
                dir.display()
            )
        });
    }
    match merge_files(&[dir]) {
        Ok(report) => {
            // The dumps are the ranks' own writing.
            let body: String =
                report.to_string().lines().map(|l| format!("\n  {}", cohort_comm::trace::printable(l))).collect();
            Some(format!("flight recorder ({}; `cohort trace {}`):{body}", dir.display(), dir.display()))
        }
        // It may name a file a rank put there.
        Err(e) => Some(format!("flight recorder: {}", cohort_comm::trace::printable(&e.to_string()))),
    }
}

/// The first collective that not every rank finished, from the dumps in
/// `dir`, with the ranks stuck inside it and those that never came to it
/// (no call recorded, or no dump); `None` without dumps or such a call.
pub fn parting(dir: &Path) -> Option<Parting> {
    if !has_dumps(dir) {
        return None;
    }
    parting_of(merge_files(&[dir]).ok()?)
}

/// [`parting`] from the merged `report`.
fn parting_of(report: MergeReport) -> Option<Parting> {
    let s = report.first_unfinished?;
    let mut absent: Vec<usize> = s.never_arrived.iter().chain(&report.missing_dumps).copied().collect();
    // A rank outside the collective's group was never awaited there.
    let member = |r: &usize| s.members.as_ref().is_none_or(|m| m.contains(r));
    absent.retain(|r| member(r) && !s.finished.contains(r) && !s.stuck.contains(r));
    absent.sort_unstable();
    absent.dedup();
    let collective = cohort_comm::trace::printable(&format!("{} in group {}", s.fingerprint, s.group)).into_owned();
    Some(Parting { collective, waiting: s.stuck, absent })
}

/// Free space below which a trace folder's filesystem counts as full: a
/// dump of the recorder's default 2,000 records takes about 0.7 MB.
const FULL_BELOW: u64 = 1 << 20;

/// Why no dump can be written into `dir`: the nearest folder that exists
/// on its path (where a rank would make the rest) is not a folder, cannot
/// be written, or its filesystem is full; `None` when none of these holds.
fn unusable(dir: &Path) -> Option<String> {
    let mut at = dir;
    let meta = loop {
        let here = if at.as_os_str().is_empty() { Path::new(".") } else { at };
        match std::fs::metadata(here) {
            Ok(meta) => break (here, meta),
            // Missing (a rank makes it), or under a file (found higher up).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => {
                at = at.parent()?;
            }
            Err(e) => return Some(format!("cannot look at {}: {e}", here.display())),
        }
    };
    let (at, meta) = meta;
    if !meta.is_dir() {
        return Some(format!("{} is not a folder", at.display()));
    }
    let c_path = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `c_path` is NUL-terminated; access(2) reads nothing else.
    if unsafe { libc::access(c_path.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Some(format!("{} cannot be written: {}", at.display(), std::io::Error::last_os_error()));
    }
    // SAFETY: an all-zero `statvfs` is a valid value of this plain C struct.
    let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and `fs` a valid out-pointer.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut fs) } != 0 {
        return None;
    }
    let block = fs.f_frsize as u64;
    full(at, fs.f_blocks as u64 * block, fs.f_bavail as u64 * block, fs.f_files as u64, fs.f_favail as u64)
}

/// Why the filesystem of `at` is full, given its size and free bytes and
/// its total and free inodes (a filesystem without an inode count has 0 in
/// both); one of no size is none for files at all (/proc, /sys).
fn full(at: &Path, bytes: u64, free_bytes: u64, inodes: u64, free_inodes: u64) -> Option<String> {
    if bytes == 0 {
        return Some(format!(
            "{} is a kernel's filesystem (as /proc and /sys are), which holds no files",
            at.display()
        ));
    }
    if free_bytes < FULL_BELOW {
        return Some(format!("the filesystem of {} is full ({free_bytes} bytes free)", at.display()));
    }
    (inodes > 0 && free_inodes == 0).then(|| format!("the filesystem of {} has no free inodes", at.display()))
}

/// `cohort store`: serves a store until killed.
pub fn store(args: StoreArgs) -> ExitCode {
    let secret = match config::JOB_SECRET.get() {
        Ok(Some(secret)) => secret,
        Ok(None) => {
            let name = config::JOB_SECRET.name;
            say!("cohort: error: export {name} (the job's secret; every rank and launcher must use it)");
            return ExitCode::from(1);
        }
        Err(e) => {
            say!("cohort: error: {e}");
            return ExitCode::from(1);
        }
    };
    let host = if args.host.contains(':') { format!("[{}]", args.host) } else { args.host.clone() };
    match StoreServer::bind(format!("{host}:{}", args.port).as_str(), &secret) {
        Ok(server) => {
            // A closed stdout does not stop the store serving.
            let _ = writeln!(std::io::stdout(), "cohort store: listening on {}", server.local_addr());
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            say!("cohort: error: cannot serve the store on {host}:{}: {e}", args.port);
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_comm::trace::{merge, CollectiveFingerprint, CollectiveRecord, RecordState, RecorderDump};

    /// Rank `rank`'s dump (of 4) inside all-reduce #1 of `group`, whose
    /// records name `members` (`None`: every rank).
    fn inside(rank: usize, group: &str, members: Option<Vec<usize>>) -> RecorderDump {
        let fingerprint = CollectiveFingerprint {
            seq: 1,
            kind: "all_reduce".into(),
            op: Some("sum".into()),
            dtype: "f32".into(),
            count: 1024,
            root: None,
        };
        let record = CollectiveRecord {
            group: group.into(),
            fingerprint,
            started_us: 1,
            ended_us: None,
            state: RecordState::Started,
            ranks: members,
            path: None,
            id: 0,
        };
        let (host, reason) = ("h".into(), "signal".into());
        RecorderDump {
            rank,
            world_size: 4,
            host,
            pid: 1,
            reason,
            written_us: 2,
            records: vec![record],
            startup: vec![],
        }
    }

    #[test]
    fn the_ranks_absent_from_the_collective_the_others_waited_in_are_its_members_only() {
        // Ranks 0 and 2 wait in a collective of the whole job: 1 and 3 (no dump) never came.
        let p = parting_of(merge(&[inside(0, "comm1", None), inside(2, "comm1", None)])).unwrap();
        assert_eq!(p.collective, "#1 all_reduce(sum) 1024 × f32 in group comm1");
        assert_eq!((p.waiting, p.absent), (vec![0, 2], vec![1, 3]));
        // In a group of ranks 0-2, rank 3 was never awaited.
        let group = || Some(vec![0, 1, 2]);
        let p = parting_of(merge(&[inside(0, "comm1.g", group()), inside(2, "comm1.g", group())])).unwrap();
        assert_eq!(p.absent, vec![1]);
    }

    #[test]
    fn a_trace_folder_that_cannot_hold_a_dump_says_why() {
        let base = std::env::temp_dir().join(format!("cohort-trace-unusable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        // A folder that can be made there: nothing to say.
        assert_eq!(unusable(&base.join("trace/deeper")), None);
        assert_eq!(report(&base.join("trace")), None);
        // Under a file: it can never be made.
        std::fs::write(base.join("file"), b"").unwrap();
        let why = report(&base.join("file/trace")).unwrap();
        assert!(why.contains(&format!("{} is not a folder", base.join("file").display())), "{why}");
        assert!(why.contains("--trace-dir"), "{why}");
        // A full filesystem, or one out of inodes.
        let at = Path::new("/mnt/trace");
        assert_eq!(full(at, 1 << 40, 4096, 10, 5).unwrap(), "the filesystem of /mnt/trace is full (4096 bytes free)");
        assert_eq!(full(at, 1 << 40, 1 << 30, 10, 0).unwrap(), "the filesystem of /mnt/trace has no free inodes");
        assert_eq!(full(at, 1 << 40, 1 << 30, 0, 0), None, "no inode count (btrfs) is not full");
        // A filesystem of no size is no disk (was "full (0 bytes free)").
        let why = unusable(Path::new("/proc/cohort-trace")).unwrap();
        assert_eq!(why, "/proc is a kernel's filesystem (as /proc and /sys are), which holds no files");
        let _ = std::fs::remove_dir_all(base);
    }
}
