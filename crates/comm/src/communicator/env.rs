//! Where [`Communicator::from_env`](super::Communicator::from_env) finds the
//! store and the secret.

use cohort_runtime::config;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::launch_env::{LaunchEnv, LaunchSource};
use crate::store::{await_name, StoreServer, UNKNOWN_NAME_GRACE};

use super::error::ConnectError;

/// The rendezvous a process joins.
pub(crate) struct Found {
    pub rank: usize,
    pub world_size: usize,
    pub store_addr: String,
    pub secret: String,
    /// Rank 0's own store, when no launcher serves one.
    pub server: Option<StoreServer>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// The job id the MPI or Slurm launcher gave, if any.
fn job_id() -> Option<String> {
    var("OMPI_MCA_ess_base_jobid")
        .or_else(|| var("SLURM_JOB_ID").map(|j| format!("{j}.{}", var("SLURM_STEP_ID").unwrap_or_default())))
        .or_else(|| var("PMI_ID").and(var("PMIX_NAMESPACE")))
        .or_else(|| var("PMIX_NAMESPACE"))
}

/// A port in 20000..40000 derived from the job id (FNV-1a), so that
/// concurrent jobs on one node rarely collide; 29500 without one.
fn derived_port(job: Option<&str>) -> u16 {
    match job {
        None => 29500,
        Some(job) => {
            let hash = crate::digest::Fnv1a::of(job.bytes());
            20000 + (hash % 20000) as u16
        }
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Rank 0's secret file, until every rank has joined (then it is removed).
static SECRET_FILE: parking_lot::Mutex<Option<PathBuf>> = parking_lot::Mutex::new(None);

/// Removes rank 0's secret file, if this process wrote one: called once
/// every rank has joined the store (each read the file before it could).
pub(crate) fn remove_secret_file() {
    if let Some(path) = SECRET_FILE.lock().take() {
        let _ = std::fs::remove_file(path);
    }
}

/// How long ranks other than 0 wait for rank 0's secret file.
const SECRET_FILE_WAIT: Duration = Duration::from_secs(120);

/// This user's private folder for job secrets: `$XDG_RUNTIME_DIR/cohort`
/// when that is set, else `/tmp/cohort-<uid>`; made with mode 0700, and
/// refused unless it is a real folder of this user that no one else may
/// enter (so no one can plant or read a secret there).
fn secret_dir() -> Result<PathBuf, ConnectError> {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = match var("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_dir()) {
        Some(d) => d.join("cohort"),
        None => std::env::temp_dir().join(format!("cohort-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(ConnectError::Config(format!("cannot create {} for the job secret: {e}", dir.display()))),
    }
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| ConnectError::Config(format!("cannot inspect {}: {e}", dir.display())))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(ConnectError::Config(format!(
            "{} is not a private folder of this user (a link, another owner, or open to others), so the job \
             secret cannot be shared through it: remove it, or export COHORT_JOB_SECRET=$(openssl rand -hex 32) \
             before the launcher",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The secret file of job `job` in `dir`.
fn secret_path(dir: &Path, job: &str) -> PathBuf {
    let name: String =
        job.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).collect();
    dir.join(format!("job-{name}.secret"))
}

/// The job's secret, shared on one node without COHORT_JOB_SECRET: rank 0
/// draws 32 random bytes and writes them (mode 0600, never following a
/// link, renamed into place whole) to the job's file in [`secret_dir`];
/// the other ranks wait up to `wait` for the file and read it.
fn shared_secret(rank: usize, job: &str, wait: Duration) -> Result<String, ConnectError> {
    let dir = secret_dir()?;
    let path = secret_path(&dir, job);
    let failed = |what: &str, e: std::io::Error| {
        ConnectError::Config(format!(
            "cannot {what} the job secret file {}: {e}; or export COHORT_JOB_SECRET=$(openssl rand -hex 32) before \
             the launcher",
            path.display()
        ))
    };
    if rank == 0 {
        let secret = crate::store::generate_secret().map_err(|e| ConnectError::Config(e.to_string()))?;
        let tmp =
            dir.join(format!(".{}.{}", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| failed("write", e))?;
        f.write_all(secret.as_bytes()).map_err(|e| failed("write", e))?;
        std::fs::rename(&tmp, &path).map_err(|e| failed("write", e))?;
        *SECRET_FILE.lock() = Some(path);
        return Ok(secret);
    }
    let end = Instant::now() + wait;
    loop {
        let read = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path);
        match read.and_then(|f| {
            let meta = f.metadata()?;
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            if meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
                return Err(std::io::Error::other("it is not this user's private file"));
            }
            std::io::read_to_string(f)
        }) {
            Ok(s) if s.len() == 64 => return Ok(s),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed("read", e)),
        }
        if Instant::now() >= end {
            return Err(ConnectError::Config(format!(
                "rank 0 wrote no job secret to {} within {wait:?}: it has not started, or runs on another node (then \
                 export COHORT_JOB_SECRET=$(openssl rand -hex 32) before the launcher)",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An error naming the variable that gave `host` (MASTER_ADDR, or Slurm's
/// node list) when `host` does not resolve, by the store client's rule
/// (`store::resolve_addrs`): at once when the address is malformed, after
/// the store client's grace for a name the resolver does not know (a host
/// whose name appears only when it starts; at most `COHORT_TIMEOUT`), so
/// no rank waits its whole timeout for a misspelt name and the error says
/// which variable to fix.
/// A lookup that failed only for the moment passes here: the client
/// retries it until its timeout.
fn check_resolves(host: &str, port: u16) -> Result<(), ConnectError> {
    let timeout = crate::host::default_timeout()?;
    check_resolves_within(host, port, UNKNOWN_NAME_GRACE.min(timeout))
}

/// [`check_resolves`] with `grace` for a name the resolver does not know.
fn check_resolves_within(host: &str, port: u16, grace: Duration) -> Result<(), ConnectError> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let shown = format!("{host}:{port}");
    let Err(unresolved) = await_name(&(bare, port), &shown, grace) else { return Ok(()) };
    let why = unresolved.into_error().to_string();
    let named = match var("MASTER_ADDR") {
        Some(_) => "MASTER_ADDR".to_string(),
        None => "the first host of SLURM_STEP_NODELIST".to_string(),
    };
    Err(ConnectError::Config(format!(
        "{named}={host:?} names no host this machine can resolve ({why}): set MASTER_ADDR to rank 0's host name or IP \
         address on every rank"
    )))
}

pub(crate) fn resolve() -> Result<Found, ConnectError> {
    let env = LaunchEnv::from_process()?;
    let (rank, world_size) = (env.rank, env.world_size);
    if let Some(store_addr) = config::STORE_ADDR.get()? {
        let secret = config::JOB_SECRET.get()?.ok_or_else(|| {
            ConnectError::Config("COHORT_STORE_ADDR is set but COHORT_JOB_SECRET is not: set both".into())
        })?;
        return Ok(Found { rank, world_size, store_addr, secret, server: None });
    }
    if env.source == LaunchSource::Torchrun && env.master_addr.is_none() {
        return Err(ConnectError::Config(
            "MASTER_ADDR is missing: RANK and WORLD_SIZE are set (torchrun-style) but nothing names the host of \
             the rendezvous store; set MASTER_ADDR (and MASTER_PORT) to rank 0's host on every rank, or start the \
             job with `cohort run`"
                .into(),
        ));
    }
    let job = job_id();
    let host = env.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
    let port = env.master_port.unwrap_or_else(|| derived_port(job.as_deref()));
    let single_node = env.local_world_size == world_size;
    let exported = config::JOB_SECRET.get()?;
    let secret = match (exported.clone(), &job) {
        (Some(s), _) => s,
        // Nothing derived from the job id (anyone who sees it could derive
        // it too): rank 0 draws a random secret and hands it to the ranks of
        // its node through a file only this user can read. The store then
        // listens on loopback only.
        (None, Some(job)) if single_node => shared_secret(rank, job, SECRET_FILE_WAIT)?,
        (None, _) => {
            let why =
                if single_node { "no job id to name its secret file after" } else { "the job spans several nodes" };
            return Err(ConnectError::Config(format!(
                "COHORT_JOB_SECRET is unset and {why}: run `export COHORT_JOB_SECRET=$(openssl rand -hex 32)` \
                 before the launcher ({:?}) so every rank gets it",
                env.source
            )));
        }
    };
    // Without an exported secret, nothing listens beyond this host.
    let host = if exported.is_none() { "127.0.0.1".to_string() } else { host };
    let store_addr = format!("{}:{port}", bracket(&host));
    if exported.is_some() {
        check_resolves(&host, port)?;
    }
    let server = if rank == 0 {
        let bind = if env.source == LaunchSource::Torchrun { store_addr.clone() } else { format!("0.0.0.0:{port}") };
        let bind = if host == "127.0.0.1" || host == "localhost" { store_addr.clone() } else { bind };
        Some(StoreServer::bind(bind.as_str(), &secret).map_err(|e| {
            ConnectError::Config(format!(
                "rank 0 could not serve the rendezvous store on {bind}: {e}; set MASTER_PORT to a free port \
                 (the same for every rank)"
            ))
        })?)
    } else {
        None
    };
    Ok(Found { rank, world_size, store_addr, secret, server })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_are_private_and_random() {
        let job = format!("test-{}", std::process::id());
        let reader = {
            let job = job.clone();
            std::thread::spawn(move || shared_secret(1, &job, Duration::from_secs(20)))
        };
        let written = shared_secret(0, &job, Duration::from_secs(1)).unwrap();
        let read = reader.join().unwrap().unwrap();
        assert_eq!(written, read);
        assert_eq!(written.len(), 64);
        assert_ne!(written, format!("cohort-derived-{job}"), "nothing derived from the job id");
        let path = secret_path(&secret_dir().unwrap(), &job);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "only this user may read it");
        let dir_mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        // A second job's secret differs.
        assert_ne!(shared_secret(0, &format!("{job}-b"), Duration::from_secs(1)).unwrap(), written);
        let _ = std::fs::remove_file(path);
        remove_secret_file();
    }

    #[test]
    fn store_hosts_must_resolve() {
        let grace = Duration::from_millis(200);
        for host in ["127.0.0.1", "localhost", "::1", "[::1]"] {
            assert!(check_resolves_within(host, 29500, grace).is_ok(), "{host}");
        }
        for host in ["not a host!", "host:1234", "[::1", "999.1.1.1"] {
            // Where no name server answers, the resolver's failure is only
            // for the moment, which the store client retries: nothing to
            // check here then.
            let shown = format!("{host}:29500");
            if let Err(crate::store::Unresolved::Transient(e)) = crate::store::resolve_addrs(&(host, 29500), &shown) {
                eprintln!("{host}: the resolver failed for the moment ({e}); not checked");
                continue;
            }
            let start = Instant::now();
            let err = check_resolves_within(host, 29500, grace).unwrap_err().to_string();
            assert!(err.contains(&format!("={host:?} names no host")), "{host}: {err}");
            assert!(start.elapsed() < Duration::from_secs(30), "{host}: looked up for {:?}", start.elapsed());
        }
    }

    #[test]
    fn ports_come_from_the_job() {
        assert_eq!(derived_port(None), 29500);
        let p = derived_port(Some("3529703425"));
        assert!((20000..40000).contains(&p));
        assert_eq!(p, derived_port(Some("3529703425")));
    }
}
