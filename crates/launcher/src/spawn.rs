//! Starting one rank: its environment, its own process group, and a
//! parent-death signal so that it never outlives the launcher.

use std::ffi::OsString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cohort_comm::store::StoreRelay;

use cohort_runtime::config;

use crate::config::JobConfig;

/// The environment every rank of this node gets, less RANK and LOCAL_RANK.
#[derive(Debug, Clone)]
pub struct RankEnv {
    vars: Vec<(&'static str, String)>,
    /// The store's address the ranks are given.
    store_addr: String,
}

impl RankEnv {
    /// The variables torchrun sets, plus cohort's own, for attempt `restart`
    /// of the job whose (cohort) store listens on `store_port`.
    ///
    /// MASTER_ADDR:MASTER_PORT is left to the program (PyTorch's rank 0
    /// listens there with its TCPStore), as under torchrun; cohort's store is
    /// in COHORT_STORE_ADDR.
    pub fn new(cfg: &JobConfig, store_port: u16, restart: u32) -> RankEnv {
        let mut vars = vec![
            ("WORLD_SIZE", cfg.world_size().to_string()),
            ("LOCAL_WORLD_SIZE", cfg.nproc.to_string()),
            ("GROUP_RANK", cfg.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", cfg.nnodes.to_string()),
            ("ROLE_NAME", cfg.role.clone()),
            ("ROLE_WORLD_SIZE", cfg.world_size().to_string()),
            ("MASTER_ADDR", cfg.master_addr.clone()),
            ("MASTER_PORT", cfg.master_port.to_string()),
            ("TORCHELASTIC_RUN_ID", cfg.run_id.clone()),
            ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string()),
            // PyTorch's rank 0 then serves its own store on MASTER_PORT.
            ("TORCHELASTIC_USE_AGENT_STORE", "False".to_string()),
            (config::JOB_SECRET.name, cfg.secret.clone()),
            (config::STORE_ADDR.name, cfg.store_addr(store_port)),
            (config::RESTART_COUNT.name, restart.to_string()),
            (config::NNODES.name, cfg.nnodes.to_string()),
            (config::TRACE_DIR.name, cfg.trace_dir.to_string_lossy().into_owned()),
        ];
        if let Some(t) = cfg.timeout {
            vars.push((config::TIMEOUT.name, t.as_secs_f64().to_string()));
        }
        if let Some(n) = &cfg.omp_threads {
            vars.push(("OMP_NUM_THREADS", n.clone()));
        }
        RankEnv { vars, store_addr: cfg.store_addr(store_port) }
    }

    /// The `NAME=value` entries that every process a rank of this node and
    /// attempt starts inherits unless it changes its environment, and no
    /// other process has: the store's address, the job's secret, the node
    /// and the attempt (see [`crate::escapees`]).
    pub fn marks(&self) -> Vec<String> {
        let names = [config::STORE_ADDR.name, config::JOB_SECRET.name, "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"];
        self.vars.iter().filter(|(k, _)| names.contains(k)).map(|(k, v)| format!("{k}={v}")).collect()
    }

    /// The global rank of `local_rank` on `node_rank`.
    pub fn global_rank(cfg: &JobConfig, local_rank: usize) -> usize {
        cfg.node_rank as usize * cfg.nproc + local_rank
    }
}

/// How long a node relay may take to join the store: as long as its ranks
/// would wait to connect to it themselves (`--timeout`, else
/// `COHORT_TIMEOUT`, else its default), so a store that stalls a while
/// (stopped, swapping) is joined once it answers.
fn relay_join_limit(cfg: &JobConfig) -> Duration {
    // The launcher checked every COHORT_* variable before it started.
    cfg.timeout.unwrap_or_else(|| config::TIMEOUT.get().unwrap_or(config::TIMEOUT.fallback))
}

/// Relay sockets each rank gets: its communicator's store connection, the
/// heartbeat's second connection and NCCL's (a rank that needs more
/// connects directly).
pub const RELAY_SOCKETS_PER_RANK: usize = 3;

/// Starts the node relay of an attempt when this node runs 2 or more ranks
/// and `COHORT_STORE_RELAY` is not 0: the relay and each local rank's ends
/// of its socket pairs ([`RELAY_SOCKETS_PER_RANK`] each), by local rank.
/// The relay joins the store on its own thread while the ranks start
/// ([`StoreRelay::spawn`], retrying for as long as the ranks would wait
/// themselves); a store it cannot join is each rank's first answer, naming
/// the store. Without a relay (or when its socket pairs or thread cannot be
/// made, which is logged) the ranks connect to the store themselves.
pub fn start_relay(cfg: &JobConfig, env: &RankEnv) -> (Option<StoreRelay>, Vec<Vec<UnixStream>>) {
    // The launcher checked every COHORT_* variable before it started.
    if cfg.nproc < 2 || !config::STORE_RELAY.get().unwrap_or(true) {
        return (None, Vec::new());
    }
    let per_rank = RELAY_SOCKETS_PER_RANK;
    match StoreRelay::spawn(&env.store_addr, &cfg.secret, cfg.nproc * per_rank, relay_join_limit(cfg)) {
        Ok((relay, ends)) => {
            let mut ends = ends.into_iter();
            let by_rank = (0..cfg.nproc).map(|_| ends.by_ref().take(per_rank).collect()).collect();
            (Some(relay), by_rank)
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not start the node's store relay; the ranks connect to the store themselves");
            (None, Vec::new())
        }
    }
}

/// Starts `program` as one rank, with piped stdout and stderr and no stdin.
///
/// The rank leads its own process group (so a signal to the group reaches
/// whatever it spawns, and a terminal's Ctrl-C reaches only the launcher,
/// which forwards it), and on Linux gets SIGKILL should the launcher die.
///
/// Must be called from the thread that lives as long as the launcher (the
/// main thread): Linux sends the parent-death signal when the *thread* that
/// forked the child exits.
///
/// The rank inherits the sockets of `store_ends` (its ends of the node
/// relay's pairs) and finds their numbers in `COHORT_STORE_FD`; with none,
/// the variable is removed from its environment.
pub fn spawn_rank(
    program: &[OsString],
    env: &RankEnv,
    rank: usize,
    local_rank: usize,
    store_ends: &[UnixStream],
) -> io::Result<Child> {
    let (exe, args) = program.split_first().ok_or(io::ErrorKind::InvalidInput)?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .envs(env.vars.iter().map(|(k, v)| (k, v)))
        .env("RANK", rank.to_string())
        .env("ROLE_RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if store_ends.is_empty() {
        cmd.env_remove(config::STORE_FD.name);
    } else {
        inherit(&mut cmd, store_ends.iter().map(AsRawFd::as_raw_fd).collect());
    }
    die_with_parent(&mut cmd);
    crate::fd_limit::give_back_in(&mut cmd);
    cmd.spawn()
}

/// Lets the child inherit descriptors `fds` (every descriptor the launcher
/// opens is close-on-exec) and names them in `COHORT_STORE_FD`.
fn inherit(cmd: &mut Command, fds: Vec<std::os::fd::RawFd>) {
    let list: Vec<String> = fds.iter().map(|fd| fd.to_string()).collect();
    cmd.env(config::STORE_FD.name, list.join(","));
    // SAFETY: the closure runs in the forked child before exec and calls
    // only fcntl, which is async-signal-safe; it allocates nothing (the
    // list was built before the fork). The descriptors are open in the
    // child (a copy of the parent's table, which holds them until the spawn
    // returns).
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, raise); it allocates
    // nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl, in which case
            // no signal will ever come: we have been re-parented. Die now.
            if libc::getppid() != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {
    // No parent-death signal outside Linux: ranks are still stopped through
    // their process groups whenever the launcher exits normally.
}
