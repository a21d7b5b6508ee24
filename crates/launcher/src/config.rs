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
    /// Several nodes but no `--master-addr`.
    #[error(
        "--nnodes {0} needs --master-addr: the address of node 0 that every node can reach (its host \
         name or IP); without it each node would wait for itself on 127.0.0.1"
    )]
    MasterAddrMissing(u32),
    /// `--store-port` and `--master-port` are the same port.
    #[error(
        "--store-port {0} is --master-port too: MASTER_PORT is for the program's own store (e.g. \
         PyTorch's TCPStore); give cohort's store another port"
    )]
    StorePortClash(u16),
    /// `--master-port 65535` with several nodes and no `--store-port`.
    #[error("--master-port 65535 leaves no port after it for cohort's store: pass --store-port")]
    NoStorePort,
    /// MASTER_PORT is taken on node 0.
    #[error(
        "port {port} on {addr} is already in use (another job, or another service), so the program's \
         rank 0 could not listen on it as MASTER_PORT: pick another --master-port, or 0 for a free one"
    )]
    MasterPortInUse {
        /// The port.
        port: u16,
        /// The address tried.
        addr: String,
    },
    /// `-m ""`.
    #[error("-m needs a module name, e.g. `cohort run -n 4 -m pkg.train -- --lr 1e-3`")]
    ModuleMissing,
    /// More ranks on this node than this user may run as processes.
    #[error(
        "-n {nproc} asks for more ranks on this node than this user may run as processes ({limit}: `ulimit -u`, \
         /proc/sys/kernel/threads-max); lower -n or raise the limit"
    )]
    TooManyRanks {
        /// Ranks asked for on this node.
        nproc: usize,
        /// Processes this user may run.
        limit: u64,
    },
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
    /// `--timeout` ends past what the clock can hold.
    #[error("--timeout {0} s ends too far in the future for this machine's clock: give a smaller number")]
    TimeoutTooFar(f64),
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
    /// Elastic jobs (`--nnodes MIN:MAX`): the fewest nodes an attempt runs
    /// with (`nnodes` is then MAX, and in an attempt's own copy the nodes
    /// in it: see [`JobConfig::for_round`]).
    pub min_nodes: u32,
    /// Whether the job is elastic (MIN below MAX).
    pub elastic: bool,
    /// How long an elastic attempt waits for `min_nodes`.
    pub join_timeout: Duration,
    /// How long an elastic attempt waits for more nodes once it has MIN.
    pub last_call: Duration,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// Node 0's address.
    pub master_addr: String,
    /// MASTER_PORT, for the program's own store (resolved: never 0).
    pub master_port: u16,
    /// cohort's store's port as asked (0: any).
    pub store_port: u16,
    /// TORCHELASTIC_RUN_ID.
    pub run_id: String,
    /// OMP_NUM_THREADS for the ranks, when the launcher sets it.
    pub omp_threads: Option<String>,
    /// The job's secret.
    pub secret: String,
    /// Group restarts allowed.
    pub max_restarts: u32,
    /// Print the start-up phases (`--timings`).
    pub timings: bool,
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
    pub fn from_args(mut args: RunArgs) -> Result<Self, LaunchError> {
        let range = args.nnodes;
        // Every check below holds for the largest job.
        let nnodes = range.max;
        if args.node_rank >= nnodes {
            return Err(LaunchError::BadNodeRank { node_rank: args.node_rank, nnodes });
        }
        if args.master_port == 0 && nnodes > 1 {
            return Err(LaunchError::PortZeroMultiNode);
        }
        if nnodes > 1 && args.master_addr.is_none() && args.store_addr.is_none() {
            return Err(LaunchError::MasterAddrMissing(nnodes));
        }
        let nproc = resolve_nproc(args.nproc_per_node)?;
        let limit = process_limit();
        if let Some(limit) = limit.filter(|&l| nproc as u64 > l) {
            return Err(LaunchError::TooManyRanks { nproc, limit });
        }
        if let Some(warning) = process_limit_warning(nproc, limit) {
            say!("cohort: warning: {warning}");
        }
        let filter = match args.local_ranks_filter {
            None => None,
            Some(list) => {
                if let Some(&rank) = list.iter().find(|&&r| r >= nproc) {
                    return Err(LaunchError::BadFilter { rank, nproc });
                }
                Some(list.into_iter().collect())
            }
        };
        // The values are checked by the flags' parser; the deadline is
        // checked against the clock where the job starts.
        let timeout = match args.timeout {
            None => None,
            Some(t) if t > 0.0 => match Duration::try_from_secs_f64(t) {
                Ok(d) if std::time::Instant::now().checked_add(d).is_some() => Some(d),
                _ => return Err(LaunchError::TimeoutTooFar(t)),
            },
            Some(t) => return Err(LaunchError::BadTimeout(t)),
        };
        check_inherited(args.timeout.is_some())?;
        let env_secret = config::JOB_SECRET.get()?;
        let mut master_addr = args.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
        let mut store_port = match (args.store_port, nnodes) {
            (Some(p), _) => p,
            (None, 1) => 0,
            (None, _) => args.master_port.checked_add(1).ok_or(LaunchError::NoStorePort)?,
        };
        if let Some(addr) = &args.store_addr {
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
                LaunchError::BadStoreAddr(format!("'{addr}' is not HOST:PORT (e.g. 127.0.0.1:29400)"))
            })?;
            store_port = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                LaunchError::BadStoreAddr(format!("'{addr}': '{port}' is not a port number (1-65535)"))
            })?;
            let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
            if args.master_addr.is_none() {
                master_addr = host.clone();
            }
            if env_secret.is_none() {
                return Err(LaunchError::BadStoreAddr(format!(
                    "{addr} needs the secret that store was started with: export {} before `cohort run`",
                    config::JOB_SECRET.name
                )));
            }
        }
        if store_port != 0 && store_port == args.master_port && args.store_addr.is_none() {
            return Err(LaunchError::StorePortClash(store_port));
        }
        let master_port = program_port(&master_addr, args.master_port, args.node_rank == 0)?;
        let heartbeat_timeout = match args.heartbeat_timeout {
            0.0 => None,
            t if t.is_finite() && t > 0.0 => {
                Some(Duration::try_from_secs_f64(t).map_err(|_| LaunchError::BadHeartbeat(t))?)
            }
            t => return Err(LaunchError::BadHeartbeat(t)),
        };
        let from_env = std::env::var_os("COHORT_TRACE_DIR").filter(|d| !d.is_empty()).map(PathBuf::from);
        let trace_dir = args.trace_dir.or(from_env).unwrap_or_else(|| match &args.log_dir {
            Some(dir) => dir.join("trace"),
            None => PathBuf::from("cohort-trace"),
        });
        let trace_dir = std::env::current_dir().map(|cwd| cwd.join(&trace_dir)).unwrap_or(trace_dir);
        let secret = resolve_secret(env_secret, nnodes)?;
        let program = std::mem::take(&mut args.program);
        let program = python_program(program, args.module, args.no_python)?;
        let omp_threads = (nproc > 1 && std::env::var_os("OMP_NUM_THREADS").is_none()).then(|| "1".to_string());
        Ok(JobConfig {
            nproc,
            nnodes,
            min_nodes: range.min,
            elastic: range.min < range.max,
            join_timeout: Duration::from_secs_f64(args.join_timeout),
            last_call: Duration::from_secs_f64(args.last_call),
            node_rank: args.node_rank,
            master_addr,
            master_port,
            store_port,
            run_id: args.rdzv_id,
            omp_threads,
            trace_dir,
            heartbeat_timeout,
            external_store: args.store_addr.is_some(),
            secret,
            max_restarts: args.max_restarts,
            timings: args.timings,
            log_dir: args.log_dir,
            tee: args.tee,
            filter,
            timeout,
            program,
        })
    }

    /// This node's part in one attempt of an elastic job: node `position`
    /// of `members` (GROUP_RANK and GROUP_WORLD_SIZE; the ranks' global
    /// ranks follow).
    pub fn for_round(&self, position: u32, members: u32) -> JobConfig {
        JobConfig { node_rank: position, nnodes: members, ..self.clone() }
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

/// MASTER_PORT for the program: `asked`, or a port free now where 0 was
/// asked. On node 0 a port something already listens on is an error now,
/// rather than the program's rank 0 failing to listen later (a connection
/// attempt tells, and unlike a test bind it cannot collide with another
/// launcher checking the same port at the same moment).
fn program_port(addr: &str, asked: u16, node0: bool) -> Result<u16, LaunchError> {
    use std::net::{TcpListener, TcpStream, ToSocketAddrs};
    if !node0 {
        return Ok(asked);
    }
    let host = addr.trim_start_matches('[').trim_end_matches(']');
    if asked == 0 {
        // Not an address of this host (an alias, a NAT): any local port.
        let bound = TcpListener::bind((host, 0)).or_else(|_| TcpListener::bind(("0.0.0.0", 0)));
        return Ok(bound.and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500));
    }
    let targets = (host, asked).to_socket_addrs().map(|a| a.collect::<Vec<_>>()).unwrap_or_default();
    if targets.iter().any(|t| TcpStream::connect_timeout(t, Duration::from_millis(500)).is_ok()) {
        return Err(LaunchError::MasterPortInUse { port: asked, addr: host.to_string() });
    }
    Ok(asked)
}

/// The command line that runs `program`: a `.py` file (or, with `module`, a
/// module name) runs with `python3 -u`, as torchrun runs it with its own
/// interpreter; `python3` is the one first on PATH (an active virtual
/// environment's).
fn python_program(
    program: Vec<OsString>,
    module: Option<String>,
    no_python: bool,
) -> Result<Vec<OsString>, LaunchError> {
    let python = || vec![OsString::from("python3"), OsString::from("-u")];
    if let Some(module) = module {
        if module.is_empty() {
            return Err(LaunchError::ModuleMissing);
        }
        let mut cmd = python();
        cmd.extend(["-m".into(), module.into()]);
        cmd.extend(program);
        return Ok(cmd);
    }
    let is_py = program.first().is_some_and(|p| p.to_string_lossy().ends_with(".py"));
    if is_py && !no_python {
        let mut cmd = python();
        cmd.extend(program);
        return Ok(cmd);
    }
    Ok(program)
}

/// How many processes (and threads) this user may run (`ulimit -u`, and the
/// kernel's thread limit), or `None` when unlimited.
fn process_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `lim`, which outlives the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) };
    let user = (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur);
    let kernel =
        std::fs::read_to_string("/proc/sys/kernel/threads-max").ok().and_then(|s| s.trim().parse::<u64>().ok());
    match (user, kernel) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A warning when `nproc` ranks (each a process, plus the launcher's three
/// threads that watch it) cannot fit under `limit`.
fn process_limit_warning(nproc: usize, limit: Option<u64>) -> Option<String> {
    let limit = limit?;
    let needed = nproc as u64 * 4;
    (needed > limit).then(|| {
        format!(
            "-n {nproc} needs about {needed} processes and threads (a process per rank, three launcher threads \
             to watch each), but this user may have at most {limit} (`ulimit -u`, /proc/sys/kernel/threads-max): \
             ranks past the limit will fail to start; lower -n or raise the limit"
        )
    })
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
    fn py_programs_run_with_python() {
        let v = |s: &[&str]| s.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            python_program(v(&["train.py", "--lr", "1"]), None, false).unwrap(),
            v(&["python3", "-u", "train.py", "--lr", "1"])
        );
        assert_eq!(
            python_program(v(&["x"]), Some("pkg.train".into()), false).unwrap(),
            v(&["python3", "-u", "-m", "pkg.train", "x"])
        );
        assert_eq!(python_program(v(&["train.py"]), None, true).unwrap(), v(&["train.py"]));
        assert_eq!(python_program(v(&["./train"]), None, false).unwrap(), v(&["./train"]));
    }

    #[test]
    fn process_limit_warns_only_far_beyond() {
        assert_eq!(process_limit_warning(8, None), None);
        assert_eq!(process_limit_warning(8, Some(4096)), None);
        let w = process_limit_warning(5000, Some(4096)).unwrap();
        assert!(w.contains("-n 5000") && w.contains("4096") && w.contains("ulimit -u"), "{w}");
    }

    #[test]
    fn ipv6_store_addr_is_bracketed() {
        let mut c = JobConfig {
            nproc: 1,
            nnodes: 1,
            min_nodes: 1,
            elastic: false,
            join_timeout: Duration::from_secs(1),
            last_call: Duration::from_secs(1),
            node_rank: 0,
            master_addr: "::1".into(),
            master_port: 1,
            store_port: 2,
            run_id: "none".into(),
            omp_threads: None,
            secret: "s".into(),
            max_restarts: 0,
            timings: false,
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
