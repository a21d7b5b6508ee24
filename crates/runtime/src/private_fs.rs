//! Files no other local user can steer: the folders cohort writes into
//! (flight-recorder dumps, rank logs, the NVRTC cache) and the files it
//! creates there.
//!
//! * A [`PrivateDir`] is a folder of this user's, held open: it is created
//!   with mode 0700 where missing, opened without following a symbolic link,
//!   and refused when another user owns it or others may write into it
//!   (where they could swap a file for a link to one of the victim's). Files
//!   inside are reached through the open folder (`openat`), so renaming or
//!   replacing the path afterwards changes nothing.
//! * Files are created with `O_CREAT | O_EXCL | O_NOFOLLOW` and mode 0600:
//!   never through a link, never into a file someone else made. A stale
//!   file or link of this user's own under the same name is removed first
//!   (for a path the user names, [`create_private_file`], only a file: a
//!   link is refused); one of another user's is refused.
//!
//! Reading the same files back ([`PrivateDir::open_file`]) refuses links and
//! files that are not this user's or that others may write.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Why a private folder or file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PrivateFsError {
    /// The operating system refused (missing parent, no permission, ...).
    #[error("cannot use {path}: {source}")]
    Io {
        /// The folder or file.
        path: PathBuf,
        /// The reason.
        source: io::Error,
    },
    /// The path's last component is a symbolic link.
    #[error(
        "{path} is a symbolic link: cohort does not write or read through links there (another user could aim \
         one at your files); give the real path, or remove the link"
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// The path is not a folder (or not a regular file, for files).
    #[error("{path} is not a {expected}; remove it or choose another path")]
    WrongKind {
        /// The path.
        path: PathBuf,
        /// "folder" or "regular file".
        expected: &'static str,
    },
    /// Another user owns it.
    #[error(
        "{path} belongs to user id {owner}, not to you (user id {me}): its owner could read or replace what \
         cohort keeps there; choose a folder of your own"
    )]
    NotOwned {
        /// The folder or file.
        path: PathBuf,
        /// Its owner's user id.
        owner: u32,
        /// This process's effective user id.
        me: u32,
    },
    /// Other users may write into it.
    #[error(
        "{path} can be written by other users (mode {mode:04o}): they could plant files or links there; run \
         `chmod go-w {path}` or choose a folder of your own"
    )]
    WritableByOthers {
        /// The folder or file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

impl From<PrivateFsError> for io::Error {
    fn from(err: PrivateFsError) -> io::Error {
        let kind = match &err {
            PrivateFsError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::PermissionDenied,
        };
        io::Error::new(kind, err)
    }
}

/// This process's effective user id.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn c_name(path: &Path) -> Result<CString, PrivateFsError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| PrivateFsError::Io {
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "the path contains a NUL byte"),
    })
}

fn fstat(fd: &OwnedFd, path: &Path) -> Result<libc::stat, PrivateFsError> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(PrivateFsError::Io { path: path.to_path_buf(), source: io::Error::last_os_error() });
    }
    Ok(st)
}

/// Refuses what another user owns or what others may write.
fn check_owner_and_mode(st: &libc::stat, path: &Path) -> Result<(), PrivateFsError> {
    let me = effective_uid();
    if st.st_uid != me {
        return Err(PrivateFsError::NotOwned { path: path.to_path_buf(), owner: st.st_uid, me });
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(PrivateFsError::WritableByOthers { path: path.to_path_buf(), mode });
    }
    Ok(())
}

/// A folder of this user's, held open (see the module's documentation).
#[derive(Debug)]
pub struct PrivateDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl PrivateDir {
    /// Creates `path` (and missing parents) with mode 0700 where missing,
    /// then opens it as a folder of this user's: refused when it is a link,
    /// not a folder, owned by another user, or writable by group or others.
    pub fn open_or_create(path: &Path) -> Result<PrivateDir, PrivateFsError> {
        if let Err(source) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path) {
            // A link or file in the way: reported precisely by `open` below.
            if source.kind() != io::ErrorKind::AlreadyExists {
                return Err(PrivateFsError::Io { path: path.to_path_buf(), source });
            }
        }
        PrivateDir::open(path)
    }

    /// Opens the existing folder `path` with the checks of
    /// [`PrivateDir::open_or_create`].
    pub fn open(path: &Path) -> Result<PrivateDir, PrivateFsError> {
        let c_path = c_name(path)?;
        // SAFETY: `c_path` is NUL-terminated; open(2) has no other preconditions.
        let fd = unsafe {
            libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        };
        if fd < 0 {
            let source = io::Error::last_os_error();
            return Err(match source.raw_os_error() {
                Some(libc::ELOOP) => PrivateFsError::Symlink { path: path.to_path_buf() },
                Some(libc::ENOTDIR) if is_symlink(path) => PrivateFsError::Symlink { path: path.to_path_buf() },
                Some(libc::ENOTDIR) => PrivateFsError::WrongKind { path: path.to_path_buf(), expected: "folder" },
                _ => PrivateFsError::Io { path: path.to_path_buf(), source },
            });
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = fstat(&fd, path)?;
        check_owner_and_mode(&st, path)?;
        Ok(PrivateDir { fd, path: path.to_path_buf() })
    }

    /// The folder's path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the file `name` in this folder for writing: new, 0600, never
    /// through a link, refused when something of another user is there.
    pub fn create_file(&self, name: &str) -> Result<File, PrivateFsError> {
        create_in(self.fd.as_raw_fd(), &self.path, name, Stale::FileOrLink)
    }

    /// Opens the file `name` of this folder for reading: `Ok(None)` when
    /// there is none; refused when it is a link, not a regular file (a FIFO
    /// is refused at once, never waited on), not this user's or writable by
    /// others.
    pub fn open_file(&self, name: &str) -> Result<Option<File>, PrivateFsError> {
        let path = self.path.join(name);
        let c = c_name(Path::new(name))?;
        // O_NONBLOCK: opening a FIFO does not wait for a writer (it is then
        // refused as not a regular file); it is cleared again below.
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: the folder's fd is open; `c` is NUL-terminated.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            let source = io::Error::last_os_error();
            return match source.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                Some(libc::ELOOP) => Err(PrivateFsError::Symlink { path }),
                _ => Err(PrivateFsError::Io { path, source }),
            };
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = fstat(&fd, &path)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(PrivateFsError::WrongKind { path, expected: "regular file" });
        }
        check_owner_and_mode(&st, &path)?;
        // SAFETY: `fd` is open; F_SETFL with plain O_RDONLY flags only clears
        // O_NONBLOCK (the access mode is not changed by F_SETFL).
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_RDONLY) };
        Ok(Some(File::from(fd)))
    }

    /// Renames `from` to `to` inside this folder (replacing `to`, never
    /// following a link there).
    pub fn rename(&self, from: &str, to: &str) -> Result<(), PrivateFsError> {
        let (f, t) = (c_name(Path::new(from))?, c_name(Path::new(to))?);
        let dir = self.fd.as_raw_fd();
        // SAFETY: the folder's fd is open; both names are NUL-terminated.
        if unsafe { libc::renameat(dir, f.as_ptr(), dir, t.as_ptr()) } != 0 {
            return Err(PrivateFsError::Io { path: self.path.join(to), source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Removes the file (or link) `name` of this folder, if there is one.
    pub fn remove(&self, name: &str) {
        if let Ok(c) = c_name(Path::new(name)) {
            // SAFETY: the folder's fd is open; `c` is NUL-terminated. unlinkat
            // removes a link itself, never its target.
            unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) };
        }
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Creates the file at `path` for writing, with mode 0600, through its
/// parent folder but without checking who owns that folder (for a path the
/// user names, such as `COHORT_TIMELINE` in the working directory): the
/// file is new and this user's, never a link's target nor another user's
/// file. A file of this user's there is replaced; a link is refused and
/// left alone, even this user's own (it may be one that matters, such as
/// `/dev/stdout` to root).
pub fn create_private_file(path: &Path) -> Result<File, PrivateFsError> {
    let (parent, name) = match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) => (if p.as_os_str().is_empty() { Path::new(".") } else { p }, n),
        _ => {
            return Err(PrivateFsError::WrongKind { path: path.to_path_buf(), expected: "regular file" });
        }
    };
    let c_parent = c_name(parent)?;
    // SAFETY: `c_parent` is NUL-terminated.
    let fd = unsafe { libc::open(c_parent.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(PrivateFsError::Io { path: parent.to_path_buf(), source: io::Error::last_os_error() });
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let dir = unsafe { OwnedFd::from_raw_fd(fd) };
    create_in(dir.as_raw_fd(), parent, &name.to_string_lossy(), Stale::File)
}

/// What of this user's [`create_in`] may remove to make its file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stale {
    /// A regular file.
    File,
    /// A regular file or a link (a private folder's stale entry).
    FileOrLink,
}

/// Creates `name` in the open folder `dir` (at `dir_path`, for messages):
/// `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600. A file of this user's
/// already there, or with [`Stale::FileOrLink`] a link of this user's, is
/// removed first (a link itself, never its target); one of another user's,
/// or anything else, is refused.
fn create_in(dir: libc::c_int, dir_path: &Path, name: &str, stale: Stale) -> Result<File, PrivateFsError> {
    let path = dir_path.join(name);
    let c = c_name(Path::new(name))?;
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    for attempt in 0..2 {
        // SAFETY: `dir` is an open folder; `c` is NUL-terminated.
        let fd = unsafe { libc::openat(dir, c.as_ptr(), flags, 0o600 as libc::c_uint) };
        if fd >= 0 {
            // SAFETY: `fd` was just opened and is owned by nothing else.
            return Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        let source = io::Error::last_os_error();
        if source.raw_os_error() != Some(libc::EEXIST) || attempt == 1 {
            return Err(PrivateFsError::Io { path, source });
        }
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `dir` is open, `c` NUL-terminated, `st` a valid out-pointer;
        // AT_SYMLINK_NOFOLLOW describes a link itself.
        if unsafe { libc::fstatat(dir, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
            continue; // gone meanwhile: try again
        }
        let kind = st.st_mode & libc::S_IFMT;
        if kind != libc::S_IFREG && kind != libc::S_IFLNK {
            return Err(PrivateFsError::WrongKind { path, expected: "regular file" });
        }
        let me = effective_uid();
        if st.st_uid != me {
            return Err(PrivateFsError::NotOwned { path, owner: st.st_uid, me });
        }
        if kind == libc::S_IFLNK && stale == Stale::File {
            return Err(PrivateFsError::Symlink { path });
        }
        // SAFETY: as above; unlinkat removes the entry (a link itself).
        unsafe { libc::unlinkat(dir, c.as_ptr(), 0) };
    }
    unreachable!("the loop returns on its second attempt")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cohort-private-fs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Another user's id, when this process may give files away (root).
    fn other_user() -> Option<u32> {
        (effective_uid() == 0).then_some(65534)
    }

    fn chown(path: &Path, uid: u32, follow: bool) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated; (l)chown has no other preconditions.
        let rc = unsafe {
            if follow {
                libc::chown(c.as_ptr(), uid, uid)
            } else {
                libc::lchown(c.as_ptr(), uid, uid)
            }
        };
        assert_eq!(rc, 0, "chown {}: {}", path.display(), io::Error::last_os_error());
    }

    #[test]
    fn a_new_folder_is_0700_and_files_0600() {
        let base = temp("modes");
        let dir = PrivateDir::open_or_create(&base.join("a/b")).unwrap();
        let mode = std::fs::metadata(base.join("a/b")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        dir.create_file("x").unwrap().write_all(b"hello").unwrap();
        let meta = std::fs::metadata(base.join("a/b/x")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.uid(), effective_uid());
        // A second create replaces our own file.
        dir.create_file("x").unwrap().write_all(b"again").unwrap();
        assert_eq!(std::fs::read(base.join("a/b/x")).unwrap(), b"again");
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_folder_others_may_write_or_own_is_refused() {
        let base = temp("refused");
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = PrivateDir::open_or_create(&open).unwrap_err();
        assert!(matches!(err, PrivateFsError::WritableByOthers { mode: 0o777, .. }), "{err}");
        assert!(err.to_string().contains("chmod go-w"), "{err}");
        if let Some(uid) = other_user() {
            let theirs = base.join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            chown(&theirs, uid, true);
            let err = PrivateDir::open_or_create(&theirs).unwrap_err();
            assert!(matches!(err, PrivateFsError::NotOwned { owner, .. } if owner == uid), "{err}");
        }
        // A link to a folder of ours is refused too (its target is not the path given).
        let real = base.join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, base.join("link")).unwrap();
        let err = PrivateDir::open_or_create(&base.join("link")).unwrap_err();
        assert!(matches!(err, PrivateFsError::Symlink { .. }), "{err}");
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_planted_link_is_replaced_never_followed() {
        let base = temp("link");
        let victim = base.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let dir = PrivateDir::open_or_create(&base.join("d")).unwrap();
        std::os::unix::fs::symlink(&victim, base.join("d/out")).unwrap();
        dir.create_file("out").unwrap().write_all(b"mine").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(!std::fs::symlink_metadata(base.join("d/out")).unwrap().file_type().is_symlink());
        // Reading refuses a link.
        std::fs::remove_file(base.join("d/out")).unwrap();
        std::os::unix::fs::symlink(&victim, base.join("d/out")).unwrap();
        assert!(matches!(dir.open_file("out"), Err(PrivateFsError::Symlink { .. })));
        assert!(dir.open_file("missing").unwrap().is_none());
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn another_users_file_or_link_in_a_shared_folder_is_refused() {
        let Some(uid) = other_user() else { return };
        let base = temp("shared");
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let victim = base.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = base.join("timeline.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        chown(&link, uid, false);
        let err = create_private_file(&link).unwrap_err();
        assert!(matches!(err, PrivateFsError::NotOwned { .. }), "{err}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let base = temp("fifo");
        let dir = PrivateDir::open_or_create(&base.join("d")).unwrap();
        let c = CString::new(base.join("d/entry").as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(dir.open_file("entry").map(|f| f.is_some()));
        });
        let answer = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("open_file waited on a FIFO");
        assert!(matches!(answer, Err(PrivateFsError::WrongKind { expected: "regular file", .. })), "{answer:?}");
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_link_at_a_path_the_user_names_is_refused_and_left_alone() {
        // `COHORT_TIMELINE=/dev/stdout` as root: the link is root's own, and
        // replacing it would take /dev/stdout away from every program.
        let base = temp("named-link");
        let target = base.join("target");
        std::fs::write(&target, b"kept").unwrap();
        let link = base.join("stdout");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = create_private_file(&link).unwrap_err();
        assert!(matches!(err, PrivateFsError::Symlink { .. }), "{err}");
        assert!(err.to_string().contains(&link.display().to_string()), "{err}");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link is still there");
        assert_eq!(std::fs::read(&target).unwrap(), b"kept");
        // A stale file of ours is still replaced.
        std::fs::write(base.join("old.json"), b"old").unwrap();
        create_private_file(&base.join("old.json")).unwrap().write_all(b"new").unwrap();
        assert_eq!(std::fs::read(base.join("old.json")).unwrap(), b"new");
        std::fs::remove_dir_all(base).unwrap();
    }
}
