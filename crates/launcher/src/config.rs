//! Turning `cohort run`'s options into a checked job description.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cohort_comm::store::{self, StoreError};
use cohort_runtime::config::{self, ConfigError};

use crate::cli::{Nproc, RunArgs};

/// Why `cohort run` could not start or finish a job (a rank's failure is not
/// one of these: it is reported by the supervisor's summary).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `-n gpu` found none.
    #[error("no GPUs found ({0}); use -n cpu for CPU devices, -n auto for GPUs when present, or a number")]
    NoGpus(String),
    /// A `COHORT_*` variable the launcher or its ranks read has a value that
    /// cannot be used.
    #[error(transparent)]
    Variable(#[from] ConfigError),
    /// A multi-node job without a shared secret.
    #[error(
        "a job with --nnodes {nnodes} needs the same secret on every node: run \
         `export {}=$(openssl rand -hex 32)` (or any hard-to-guess string) and pass \
         it to the launcher of every node",
        config::JOB_SECRET.name
    )]
    SecretMissing {
        /// The number of nodes asked for.
        nnodes: u32,
    },
    /// `--node-rank` out of range.
    #[error("--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0 to {}", nnodes - 1)]
    BadNodeRank {
        /// The node rank given.
        node_rank: u32,
        /// The number of nodes.
        nnodes: u32,
    },
    /// `--master-port 0` with several nodes.
    #[error(
        "--master-port 0 only works with --nnodes 1: other nodes could not know the port; pick a \
         fixed port"
    )]
    PortZeroMultiNode,
    /// `--local-ranks-filter` names a rank that does not exist here.
    #[error("--local-ranks-filter names local rank {rank}, but this node runs {nproc} ranks (0 to {})", nproc - 1)]
    BadFilter {
        /// The rank named.
        rank: usize,
        /// Ranks on this node.
        nproc: usize,
    },
    /// `--heartbeat-timeout` is not a number of seconds.
    #[error("--heartbeat-timeout {0} is not a number of seconds (0 turns the watchdog off)")]
    BadHeartbeat(f64),
    /// `--store-addr` is not `host:port`, or has no secret to prove.
    #[error("--store-addr {0}")]
    BadStoreAddr(String),
    /// `--timeout` is not a positive number of seconds.
    #[error("--timeout {0} is not a positive number of seconds")]
    BadTimeout(f64),
    /// The log folder could not be made, or is not this user's own.
    #[error("cannot use the log folder {path}: {source}")]
    LogDir {
        /// The folder.
        path: PathBuf,
        /// The reason.
        source: std::io::Error,
    },
    /// The trace folder could not be made, or is not this user's own.
    #[error("cannot use the trace folder (--trace-dir) {path}: {source}")]
    TraceDir {
        /// The folder.
        path: PathBuf,
        /// The reason.
        source: std::io::Error,
    },
    /// The rendezvous store failed (bind, connect, barrier...).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Launchers of the job disagree.
    #[error("{0}")]
    Rendezvous(String),
    /// A signal could not be set up.
    #[error("cannot set up signal forwarding: {0}")]
    Signals(std::io::Error),
}

/// Everything a launcher needs to run its node's part of the job.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// Ranks on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// Node 0's address.
    pub master_addr: String,
    /// The store's port as asked (0: any).
    pub master_port: u16,
    /// The job's secret.
    pub secret: String,
    /// Group restarts allowed.
    pub max_restarts: u32,
    /// Per-rank log files' folder.
    pub log_dir: Option<PathBuf>,
    /// Console output too when logging to files.
    pub tee: bool,
    /// Local ranks whose output the console shows (`None`: all).
    pub filter: Option<BTreeSet<usize>>,
    /// The job's wall-clock limit.
    pub timeout: Option<Duration>,
    /// The program and its arguments.
    pub program: Vec<OsString>,
    /// Where ranks write their flight recorders (COHORT_TRACE_DIR).
    pub trace_dir: PathBuf,
    /// A rank silent this long is stopped (`None`: no watchdog).
    pub heartbeat_timeout: Option<Duration>,
    /// A store served elsewhere (`--store-addr`): node 0 serves none.
    pub external_store: bool,
}

impl JobConfig {
    /// Checks `args` and resolves what they leave open (device counts,
    /// secret).
    pub fn from_args(args: RunArgs) -> Result<Self, LaunchError> {
        if args.node_rank >= args.nnodes {
            return Err(LaunchError::BadNodeRank { node_rank: args.node_rank, nnodes: args.nnodes });
        }
        if args.master_port == 0 && args.nnodes > 1 {
            return Err(LaunchError::PortZeroMultiNode);
        }
        let nproc = resolve_nproc(args.nproc_per_node)?;
        let filter = match args.local_ranks_filter {
            None => None,
            Some(list) => {
                if let Some(&rank) = list.iter().find(|&&r| r >= nproc) {
                    return Err(LaunchError::BadFilter { rank, nproc });
                }
                Some(list.into_iter().collect())
            }
        };
        let timeout = match args.timeout {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => return Err(LaunchError::BadTimeout(t)),
        };
        check_inherited(args.timeout.is_some())?;
        let env_secret = config::JOB_SECRET.get()?;
        let (mut master_addr, mut master_port) = (args.master_addr, args.master_port);
        if let Some(addr) = &args.store_addr {
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
                LaunchError::BadStoreAddr(format!("'{addr}' is not HOST:PORT (e.g. 127.0.0.1:29400)"))
            })?;
            master_port = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                LaunchError::BadStoreAddr(format!("'{addr}': '{port}' is not a port number (1-65535)"))
            })?;
            master_addr = host.trim_start_matches('[').trim_end_matches(']').to_string();
            if env_secret.is_none() {
                return Err(LaunchError::BadStoreAddr(format!(
                    "{addr} needs the secret that store was started with: export {} before `cohort run`",
                    config::JOB_SECRET.name
                )));
            }
        }
        let heartbeat_timeout = match args.heartbeat_timeout {
            0.0 => None,
            t if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            t => return Err(LaunchError::BadHeartbeat(t)),
        };
        let trace_dir = args.trace_dir.unwrap_or_else(|| match &args.log_dir {
            Some(dir) => dir.join("trace"),
            None => PathBuf::from("cohort-trace"),
        });
        let trace_dir = std::env::current_dir().map(|cwd| cwd.join(&trace_dir)).unwrap_or(trace_dir);
        let secret = resolve_secret(env_secret, args.nnodes)?;
        Ok(JobConfig {
            nproc,
            nnodes: args.nnodes,
            node_rank: args.node_rank,
            master_addr,
            master_port,
            trace_dir,
            heartbeat_timeout,
            external_store: args.store_addr.is_some(),
            secret,
            max_restarts: args.max_restarts,
            log_dir: args.log_dir,
            tee: args.tee,
            filter,
            timeout,
            program: args.program,
        })
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc * self.nnodes as usize
    }

    /// `host:port` of the store, with IPv6 literals bracketed.
    pub fn store_addr(&self, port: u16) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{port}", self.master_addr)
        } else {
            format!("{}:{port}", self.master_addr)
        }
    }
}

/// The secret from the environment, or a fresh one for a one-node job.
fn resolve_secret(from_env: Option<String>, nnodes: u32) -> Result<String, LaunchError> {
    match from_env {
        Some(s) => Ok(s),
        None if nnodes == 1 => Ok(store::generate_secret()?),
        None => Err(LaunchError::SecretMissing { nnodes }),
    }
}

fn resolve_nproc(n: Nproc) -> Result<usize, LaunchError> {
    match n {
        Nproc::Count(n) => Ok(n),
        Nproc::Cpu => cpu_devices(),
        Nproc::Gpu => match count_gpus() {
            Ok(0) => Err(LaunchError::NoGpus("CUDA_VISIBLE_DEVICES or nvidia-smi -L lists none".into())),
            Ok(n) => Ok(n),
            Err(why) => Err(LaunchError::NoGpus(why)),
        },
        Nproc::Auto => match count_gpus() {
            Ok(n) if n > 0 => Ok(n),
            _ => cpu_devices(),
        },
    }
}

/// `COHORT_CPU_DEVICES`, default 4.
fn cpu_devices() -> Result<usize, LaunchError> {
    Ok(config::CPU_DEVICES.get()?)
}

/// Checks the `COHORT_*` variables the ranks inherit, so that an unusable
/// value stops the job before any rank starts (and not once per rank). The
/// ones `cohort run` sets for its ranks are skipped (`COHORT_TIMEOUT` too when
/// `--timeout` replaces it).
fn check_inherited(timeout_flag: bool) -> Result<(), ConfigError> {
    let replaced = |name: &str| timeout_flag && name == config::TIMEOUT.name;
    config::ALL
        .iter()
        .filter(|s| !s.decl().set_by_launcher && !replaced(s.decl().name))
        .try_for_each(|s| s.check().map(drop))
}

/// CUDA GPUs visible to this job: the entries of `CUDA_VISIBLE_DEVICES` when
/// set, else the GPUs `nvidia-smi -L` lists.
// TODO(issue 7): ask the runtime's CUDA backend once device enumeration lands.
fn count_gpus() -> Result<usize, String> {
    if let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return Ok(visible.split(',').filter(|s| !s.trim().is_empty() && s.trim() != "-1").count());
    }
    let out = Command::new("nvidia-smi").arg("-L").output().map_err(|e| format!("cannot run nvidia-smi: {e}"))?;
    if !out.status.success() {
        return Err(format!("nvidia-smi -L failed with {}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("GPU ")).count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_rules() {
        assert_eq!(resolve_secret(Some("s".into()), 2).unwrap(), "s");
        assert_eq!(resolve_secret(None, 1).unwrap().len(), 64);
        let err = resolve_secret(None, 2).unwrap_err().to_string();
        assert!(err.contains("export COHORT_JOB_SECRET"), "{err}");
    }

    #[test]
    fn ipv6_store_addr_is_bracketed() {
        let mut c = JobConfig {
            nproc: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "::1".into(),
            master_port: 1,
            secret: "s".into(),
            max_restarts: 0,
            log_dir: None,
            tee: false,
            filter: None,
            timeout: None,
            program: vec![],
            trace_dir: PathBuf::from("t"),
            heartbeat_timeout: None,
            external_store: false,
        };
        assert_eq!(c.store_addr(5), "[::1]:5");
        c.master_addr = "node0".into();
        assert_eq!(c.store_addr(5), "node0:5");
    }
}
