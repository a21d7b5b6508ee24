//! How many more processes and threads the launcher may start: this user's
//! limit (`ulimit -u`, RLIMIT_NPROC) and its control group's `pids.max`,
//! which counts every thread and process of the group and binds root too
//! (a container's limit). A fork or a thread past either fails with EAGAIN,
//! which says nothing of which limit it was; these name it.

use std::path::{Path, PathBuf};

/// Where the control-group file systems are mounted.
const CGROUP_MOUNT: &str = "/sys/fs/cgroup";

/// The tightest `pids.max` above this process: the group (or an ancestor)
/// that leaves the fewest tasks to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PidsLimit {
    /// The group's folder, e.g. `/sys/fs/cgroup/user.slice/pids.max`'s.
    pub group: PathBuf,
    /// Its `pids.max`.
    pub max: u64,
    /// Its `pids.current`: tasks (threads and processes) in it now.
    pub current: u64,
}

impl PidsLimit {
    /// Tasks that may still start in it.
    pub fn room(&self) -> u64 {
        self.max.saturating_sub(self.current)
    }
}

impl std::fmt::Display for PidsLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the control group {} allows {} more tasks (its pids.max is {}, {} in use; threads count)",
            self.group.display(),
            self.room(),
            self.max,
            self.current
        )
    }
}

/// This process's tightest `pids.max`, or `None` where no group above it
/// sets one (or the files cannot be read).
pub fn pids_limit() -> Option<PidsLimit> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    pids_limit_in(&groups, Path::new(CGROUP_MOUNT))
}

/// The tightest `pids.max` of the groups `groups` (the text of
/// `/proc/self/cgroup`) names, under `mount`: the unified hierarchy's group
/// (`0::/path`, at `mount/path`) and the pids controller's (`N:pids:/path`,
/// at `mount/pids/path`), each with its ancestors up to the mount.
fn pids_limit_in(groups: &str, mount: &Path) -> Option<PidsLimit> {
    let mut folders = Vec::new();
    for line in groups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let root = if id == "0" && controllers.is_empty() {
            mount.to_path_buf()
        } else if controllers.split(',').any(|c| c == "pids") {
            mount.join("pids")
        } else {
            continue;
        };
        // `..` would climb out of the mount: such a path is not followed.
        if path.split('/').any(|part| part == "..") {
            continue;
        }
        let mut folder = root.join(path.trim_start_matches('/'));
        loop {
            folders.push(folder.clone());
            if folder == root || !folder.pop() {
                break;
            }
        }
    }
    folders.into_iter().filter_map(read_limit).min_by_key(PidsLimit::room)
}

/// The limit of the group at `group`, when it sets one.
fn read_limit(group: PathBuf) -> Option<PidsLimit> {
    let read = |name: &str| std::fs::read_to_string(group.join(name)).ok();
    let max = read("pids.max")?.trim().parse::<u64>().ok()?; // "max": none
    let current = read("pids.current")?.trim().parse::<u64>().ok()?;
    Some(PidsLimit { group, max, current })
}

/// This user's limit on processes (`ulimit -u`), or `None` when unlimited.
/// Root is not held to it (only to `pids.max`).
pub fn user_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `lim`, which outlives the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) };
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// What limits this launcher's processes and threads, for a message about
/// a fork or a thread that failed with EAGAIN.
pub fn describe() -> String {
    let user = match user_limit() {
        Some(n) => format!("this user may run {n} processes and threads (`ulimit -u`, RLIMIT_NPROC)"),
        None => "this user's process limit (`ulimit -u`, RLIMIT_NPROC) is unlimited".to_string(),
    };
    match pids_limit() {
        Some(pids) => format!("{user}, and {pids}"),
        None => format!("{user}, and no control group sets a pids.max"),
    }
}

/// Why `nproc` ranks cannot start under the tightest `pids.max`, if they
/// cannot: each rank is a process and the launcher starts three threads to
/// watch it, so fewer than four tasks a rank is sure to fail part way.
pub fn check_room(nproc: usize, limit: Option<&PidsLimit>) -> Result<(), String> {
    let Some(limit) = limit else { return Ok(()) };
    let needed = nproc as u64 * 4;
    if needed <= limit.room() {
        return Ok(());
    }
    Err(format!(
        "-n {nproc} needs at least {needed} new processes and threads on this node (a process per rank, three \
         launcher threads to watch each, more for the ranks' own threads), but {limit}: lower -n, or raise \
         pids.max (the container's or systemd unit's TasksMax / --pids-limit)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(mount: &Path, path: &str, max: &str, current: u64) {
        let dir = mount.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pids.max"), format!("{max}\n")).unwrap();
        std::fs::write(dir.join("pids.current"), format!("{current}\n")).unwrap();
    }

    #[test]
    fn the_tightest_pids_max_of_the_group_and_its_ancestors_counts() {
        let mount = std::env::temp_dir().join(format!("cohort-pids-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&mount);
        // cgroup v2: the group's own limit is loose, its parent's tight.
        group(&mount, "/job.slice", "100", 90);
        group(&mount, "/job.slice/rank.scope", "max", 5);
        let found = pids_limit_in("0::/job.slice/rank.scope\n", &mount).unwrap();
        assert_eq!(found, PidsLimit { group: mount.join("job.slice"), max: 100, current: 90 });
        assert_eq!(found.room(), 10);
        // cgroup v1: the pids controller's hierarchy.
        group(&mount, "/pids/docker/abc", "64", 60);
        let v1 = "12:memory:/docker/abc\n3:pids:/docker/abc\n0::/\n";
        assert_eq!(pids_limit_in(v1, &mount).unwrap().room(), 4);
        // No limit anywhere, a path that climbs out, lines that are not groups.
        assert_eq!(pids_limit_in("0::/elsewhere\n", &mount), None);
        assert_eq!(pids_limit_in("0::/../../job.slice\ngarbage\n", &mount), None);
        let _ = std::fs::remove_dir_all(mount);
    }

    #[test]
    fn too_little_room_for_the_ranks_is_refused_naming_the_group() {
        let limit = PidsLimit { group: "/sys/fs/cgroup/ci".into(), max: 100, current: 70 };
        assert_eq!(check_room(7, Some(&limit)), Ok(()));
        let err = check_room(8, Some(&limit)).unwrap_err();
        assert!(err.starts_with("-n 8 needs at least 32 new processes and threads"), "{err}");
        assert!(err.contains("/sys/fs/cgroup/ci allows 30 more tasks (its pids.max is 100, 70 in use"), "{err}");
        assert_eq!(check_room(1000, None), Ok(()));
    }
}
