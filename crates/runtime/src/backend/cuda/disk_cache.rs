//! The NVRTC disk cache: compiled kernels kept between runs, in a folder of
//! the user's own, each entry checked before the driver loads it.
//!
//! * The folder is `$COHORT_CACHE_DIR/nvrtc`, else
//!   `$XDG_CACHE_HOME/cohort/nvrtc`, else `~/.cache/cohort/nvrtc`; it is
//!   created 0700 and refused (the cache is then off, with one warning) when
//!   it is a link, or another user owns it or may write into it: a cubin
//!   planted there would run as the user's GPU code.
//! * An entry is named by the SHA-256 of what was compiled (the source, the
//!   kernel's name, the options and the NVRTC version) and holds a header,
//!   that same hash and the SHA-256 of the cubin, then the cubin. Loading
//!   checks all three (and that the file is the user's own, 0600, not a
//!   link, a regular file of at most 64 MiB); an entry that fails is
//!   ignored with a warning and compiled again.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::private_fs::{PrivateDir, PrivateFsError};

/// The first bytes of every entry (format version 1).
const MAGIC: &[u8; 16] = b"cohort-nvrtc-v1\n";
/// Bytes before the cubin: magic, key, hash of the cubin.
const HEADER: usize = MAGIC.len() + 32 + 32;
/// The largest entry read (cohort's cubins are well under 1 MiB); a larger
/// file is ignored unread and the kernel compiled again.
const MAX_ENTRY_BYTES: u64 = 64 << 20;

/// Where compiled kernels are kept between runs (the folder is checked only
/// when the cache opens it).
pub fn nvrtc_cache_dir() -> Option<PathBuf> {
    // Any path is a valid COHORT_CACHE_DIR, so reading it cannot fail.
    if let Ok(Some(dir)) = crate::config::CACHE_DIR.get() {
        return Some(dir.join("nvrtc"));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).filter(|d| d.is_absolute()) {
        return Some(dir.join("cohort/nvrtc"));
    }
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|home| PathBuf::from(home).join(".cache/cohort/nvrtc"))
}

/// The key of one compilation: SHA-256 over each part, each preceded by its
/// length (so no two different lists of parts give the same bytes).
pub(crate) fn entry_key(parts: &[&[u8]]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().into()
}

fn hex(key: &[u8; 32]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// An open, checked cache folder.
pub(crate) struct DiskCache {
    dir: PrivateDir,
}

impl DiskCache {
    /// The cache at [`nvrtc_cache_dir`]; `None` when there is no such folder
    /// or it is refused (logged once per process).
    pub fn open_default() -> Option<DiskCache> {
        let path = nvrtc_cache_dir()?;
        match DiskCache::open(&path) {
            Ok(cache) => Some(cache),
            Err(err) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| tracing::warn!("the NVRTC disk cache is off: {err}"));
                None
            }
        }
    }

    /// The cache in `path` (created 0700 where missing; see the module's
    /// documentation for what is refused).
    pub fn open(path: &Path) -> Result<DiskCache, PrivateFsError> {
        Ok(DiskCache { dir: PrivateDir::open_or_create(path)? })
    }

    /// The cubin stored under `key`, when there is one and it passes every
    /// check; an entry that fails one is logged and ignored.
    pub fn load(&self, key: &[u8; 32]) -> Option<Vec<u8>> {
        let name = format!("{}.cubin", hex(key));
        let file = match self.dir.open_file(&name) {
            Ok(Some(file)) => file,
            Ok(None) => return None,
            Err(err) => {
                tracing::warn!("NVRTC cache entry ignored (compiling again): {err}");
                return None;
            }
        };
        let ignored = |why: String| {
            let path = self.dir.path().join(&name);
            tracing::warn!("NVRTC cache entry {} ignored (compiling again): {why}", path.display());
        };
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if size > MAX_ENTRY_BYTES {
            ignored(format!("it is {size} bytes, more than the {} MiB an entry may be", MAX_ENTRY_BYTES >> 20));
            return None;
        }
        let mut bytes = Vec::new();
        if let Err(e) = file.take(MAX_ENTRY_BYTES + 1).read_to_end(&mut bytes) {
            ignored(format!("cannot read it: {e}"));
            return None;
        }
        if bytes.len() as u64 > MAX_ENTRY_BYTES {
            ignored(format!("it grew past the {} MiB an entry may be", MAX_ENTRY_BYTES >> 20));
            return None;
        }
        match check(key, &bytes) {
            Ok(()) => Some(bytes.split_off(HEADER)),
            Err(why) => {
                ignored(why.to_string());
                None
            }
        }
    }

    /// Stores `cubin` under `key` (a 0600 file written aside, then renamed
    /// into place); a failure only costs a compile next time.
    pub fn store(&self, key: &[u8; 32], cubin: &[u8]) {
        let name = format!("{}.cubin", hex(key));
        let tmp = format!("{name}.tmp{}", std::process::id());
        let Ok(mut file) = self.dir.create_file(&tmp) else { return };
        let cubin_hash: [u8; 32] = Sha256::digest(cubin).into();
        let written = file
            .write_all(MAGIC)
            .and_then(|()| file.write_all(key))
            .and_then(|()| file.write_all(&cubin_hash))
            .and_then(|()| file.write_all(cubin));
        if written.is_err() || self.dir.rename(&tmp, &name).is_err() {
            self.dir.remove(&tmp);
        }
    }
}

/// Whether `entry` is a whole entry for `key` whose cubin is intact.
fn check(key: &[u8; 32], entry: &[u8]) -> Result<(), &'static str> {
    if entry.len() < HEADER || &entry[..MAGIC.len()] != MAGIC {
        return Err("not a cohort cache entry (no header)");
    }
    if &entry[MAGIC.len()..MAGIC.len() + 32] != key {
        return Err("it was compiled from another source or with other options");
    }
    let cubin_hash: [u8; 32] = Sha256::digest(&entry[HEADER..]).into();
    if entry[MAGIC.len() + 32..HEADER] != cubin_hash {
        return Err("its cubin does not match its hash (changed or cut short)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cohort-nvrtc-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn an_entry_round_trips_and_is_0600_in_a_0700_folder() {
        let base = temp("round");
        let cache = DiskCache::open(&base.join("nvrtc")).unwrap();
        let key = entry_key(&[b"source", b"name", b"--gpu-architecture=sm_90", b"13.0"]);
        assert!(cache.load(&key).is_none());
        cache.store(&key, b"a cubin");
        assert_eq!(cache.load(&key).as_deref(), Some(&b"a cubin"[..]));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&base.join("nvrtc")), 0o700);
        assert_eq!(mode(&base.join(format!("nvrtc/{}.cubin", hex(&key)))), 0o600);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_tampered_or_foreign_entry_is_not_loaded() {
        let base = temp("tamper");
        let cache = DiskCache::open(&base.join("nvrtc")).unwrap();
        let key = entry_key(&[b"source"]);
        let path = base.join(format!("nvrtc/{}.cubin", hex(&key)));
        // A bare cubin planted under the right name (what the old cache held).
        std::fs::write(&path, b"planted cubin").unwrap();
        assert!(cache.load(&key).is_none());
        // A well-formed entry of another source renamed to this key.
        let other = entry_key(&[b"other source"]);
        cache.store(&other, b"other cubin");
        std::fs::rename(base.join(format!("nvrtc/{}.cubin", hex(&other))), &path).unwrap();
        assert!(cache.load(&key).is_none());
        // Our entry with one byte of its cubin changed.
        cache.store(&key, b"real cubin");
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(cache.load(&key).is_none());
        // A link to an intact entry elsewhere is not followed.
        cache.store(&key, b"real cubin");
        let aside = base.join("aside.cubin");
        std::fs::rename(&path, &aside).unwrap();
        std::os::unix::fs::symlink(&aside, &path).unwrap();
        assert!(cache.load(&key).is_none());
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_cache_folder_others_may_write_is_refused() {
        let base = temp("shared");
        let dir = base.join("nvrtc");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(DiskCache::open(&dir), Err(PrivateFsError::WritableByOthers { .. })));
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn keys_separate_their_parts() {
        assert_ne!(entry_key(&[b"ab", b"c"]), entry_key(&[b"a", b"bc"]));
        assert_eq!(entry_key(&[b"ab", b"c"]), entry_key(&[b"ab", b"c"]));
    }

    #[test]
    fn a_broken_entry_is_compiled_again_never_waited_on_or_read_whole() {
        let base = temp("broken");
        let cache = DiskCache::open(&base.join("nvrtc")).unwrap();
        let key = entry_key(&[b"broken source"]);
        let path = base.join(format!("nvrtc/{}.cubin", hex(&key)));
        let whole = {
            cache.store(&key, b"the cubin");
            std::fs::read(&path).unwrap()
        };
        let fifo = |p: &Path| {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is NUL-terminated.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        };
        type Breaker<'a> = Box<dyn Fn(&Path) + 'a>;
        let breakers: Vec<(&str, Breaker)> = vec![
            ("empty", Box::new(|p: &Path| std::fs::write(p, b"").unwrap())),
            ("cut inside the header", Box::new(|p: &Path| std::fs::write(p, &whole[..HEADER - 1]).unwrap())),
            ("cut inside the cubin", Box::new(|p: &Path| std::fs::write(p, &whole[..whole.len() - 1]).unwrap())),
            ("a FIFO", Box::new(fifo)),
            // 2 GiB, sparse: takes no disk; must not be read into memory.
            ("2 GiB", Box::new(|p: &Path| std::fs::File::create(p).unwrap().set_len(2 << 30).unwrap())),
        ];
        for (what, brk) in &breakers {
            std::fs::remove_file(&path).unwrap();
            brk(&path);
            let dir = base.join("nvrtc");
            let loaded = std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel();
                s.spawn(move || {
                    let cache = DiskCache::open(&dir).unwrap();
                    let _ = tx.send(cache.load(&key));
                });
                let answer = rx.recv_timeout(std::time::Duration::from_secs(10));
                if answer.is_err() {
                    // Let the stuck thread go (a writer for a FIFO) before failing.
                    let _ = std::fs::OpenOptions::new().write(true).open(&path);
                }
                answer
            });
            assert_eq!(loaded, Ok(None), "{what}: loaded, or blocked");
            // Compiled again: the new entry replaces it and loads.
            cache.store(&key, b"the cubin");
            assert_eq!(cache.load(&key).as_deref(), Some(&b"the cubin"[..]), "{what}");
        }
        // A folder under the entry's name: not loaded, not fatal.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(cache.load(&key).is_none());
        cache.store(&key, b"the cubin");
        assert!(cache.load(&key).is_none());
        std::fs::remove_dir_all(base).unwrap();
    }
}
