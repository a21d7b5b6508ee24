//! Turning `cohort run`'s options into a checked job description.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cohort_comm::store::{self, StoreError};
use cohort_runtime::config::{self, ConfigError};

use crate::cli::{Nproc, RunArgs};
use crate::torchrun::{self, Endpoint, RdzvBackend};

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
    /// `--store-port` (or `--rdzv-endpoint`'s port) and `--master-port` are the same port.
    #[error(
        "port {0} is cohort's store's (--store-port or --rdzv-endpoint) and MASTER_PORT (--master-port) too: \
         MASTER_PORT is for the program's own store (e.g. PyTorch's TCPStore); give them different ports"
    )]
    StorePortClash(u16),
    /// `--standalone` with several nodes.
    #[error("--standalone runs a one-node job (torchrun's single-node line): drop --nnodes {0} or --standalone")]
    StandaloneMultiNode(u32),
    /// torchrun's c10d rendezvous with several nodes and no `--node-rank`.
    #[error(
        "--rdzv-backend c10d with --nnodes {0} needs --node-rank on every node: 0 on the node at \
         --rdzv-endpoint, 1 to {last} on the others (torchrun numbers nodes as they arrive; cohort does not yet)",
        last = .0 - 1
    )]
    NodeRankNeeded(u32),
    /// Options that say different things about where the rendezvous is.
    #[error("{0}")]
    RdzvClash(String),
    /// `--redirects` or `--tee` without `--log-dir`.
    #[error(
        "{0} writes the ranks' output to files: add --log-dir DIR to say where (torchrun would make a \
         temporary folder; cohort asks)"
    )]
    LogDirNeeded(&'static str),
    /// `--redirects` or `--tee` names a local rank that does not exist here.
    #[error("{flag} names local rank {rank}, but this node runs {}", local_ranks(*nproc))]
    BadStreamsRank {
        /// `--redirects` or `--tee`.
        flag: &'static str,
        /// The rank named.
        rank: usize,
        /// Ranks on this node.
        nproc: usize,
    },
    /// A setting given both as cohort's flag and in `--rdzv-conf`.
    #[error("{0} and --rdzv-conf {1} say the same thing: give one")]
    GivenTwice(&'static str, &'static str),
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
    #[error("--local-ranks-filter names local rank {rank}, but this node runs {}", local_ranks(*nproc))]
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

/// `1 rank (local rank 0)` or `4 ranks (local ranks 0 to 3)`.
fn local_ranks(nproc: usize) -> String {
    match nproc {
        1 => "1 rank (local rank 0)".to_string(),
        n => format!("{n} ranks (local ranks 0 to {})", n.saturating_sub(1)),
    }
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
    /// torchrun's worker role (`--role`), the ranks' ROLE_NAME.
    pub role: String,
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
        // torchrun's --standalone: one node, a free port, a fresh id; its
        // rendezvous options are ignored, as by torchrun.
        if args.standalone {
            if nnodes > 1 {
                return Err(LaunchError::StandaloneMultiNode(nnodes));
            }
            args.rdzv_backend = Some(RdzvBackend::C10d);
            args.rdzv_endpoint = None;
            args.rdzv_id = random_run_id()?;
        }
        let c10d = args.rdzv_backend == Some(RdzvBackend::C10d);
        let node_rank = match args.node_rank {
            Some(n) => n,
            None if c10d && nnodes > 1 => return Err(LaunchError::NodeRankNeeded(nnodes)),
            None => 0,
        };
        if node_rank >= nnodes {
            return Err(LaunchError::BadNodeRank { node_rank, nnodes });
        }
        // Accepted for torchrun's lines, with no use here (see their help).
        let _ = (args.monitor_interval, args.start_method.take());
        let endpoint = args.rdzv_endpoint.take();
        // MASTER_PORT: torchrun's c10d rendezvous gives the workers a free
        // port; its static one, --master-port.
        let asked_master_port = args.master_port.unwrap_or(if c10d && nnodes == 1 { 0 } else { 29500 });
        if asked_master_port == 0 && nnodes > 1 {
            return Err(LaunchError::PortZeroMultiNode);
        }
        if nnodes > 1 && args.master_addr.is_none() && args.store_addr.is_none() && endpoint.is_none() {
            return Err(LaunchError::MasterAddrMissing(nnodes));
        }
        let (join_timeout, last_call) = rendezvous_waits(&args)?;
        let nproc = resolve_nproc(args.nproc_per_node)?;
        let limit = process_limit();
        if let Some(limit) = limit.filter(|&l| nproc as u64 > l) {
            return Err(LaunchError::TooManyRanks { nproc, limit });
        }
        if let Some(warning) = process_limit_warning(nproc, limit) {
            say!("cohort: warning: {warning}");
        }
        if let Some(&rank) = args.local_ranks_filter.iter().flatten().find(|&&r| r >= nproc) {
            return Err(LaunchError::BadFilter { rank, nproc });
        }
        let user_filter: Option<BTreeSet<usize>> = args.local_ranks_filter.take().map(|l| l.into_iter().collect());
        let sinks = output(&args, nproc, user_filter)?;
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
        let (mut master_addr, mut store_port) = match &endpoint {
            Some(e) => rendezvous_at(e, &args, nnodes)?,
            None => {
                let local = args.local_addr.clone().filter(|_| nnodes == 1);
                let addr = args.master_addr.clone().or(local).unwrap_or_else(|| "127.0.0.1".into());
                let port = match (args.store_port, nnodes) {
                    (Some(p), _) => p,
                    (None, 1) => 0,
                    (None, _) => asked_master_port.checked_add(1).ok_or(LaunchError::NoStorePort)?,
                };
                (addr, port)
            }
        };
        if let Some(addr) = &args.store_addr {
            if endpoint.is_some() {
                return Err(LaunchError::RdzvClash(
                    "--store-addr and --rdzv-endpoint both say where the rendezvous store is: give one".into(),
                ));
            }
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
        if store_port != 0 && store_port == asked_master_port && args.store_addr.is_none() {
            return Err(LaunchError::StorePortClash(store_port));
        }
        let master_port = program_port(&master_addr, asked_master_port, node_rank == 0)?;
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
        // The ranks get it in their environment, which they read as text.
        if trace_dir.to_str().is_none() {
            let source = std::io::Error::other(
                "its name is not UTF-8 text, and the ranks find it in their environment (COHORT_TRACE_DIR), which \
                 they read as text; choose a name of UTF-8 text",
            );
            return Err(LaunchError::TraceDir { path: trace_dir, source });
        }
        let secret = resolve_secret(env_secret, nnodes)?;
        let program = std::mem::take(&mut args.program);
        let with = match (args.run_path, args.no_python) {
            (true, _) => WithPython::Always,
            (false, true) => WithPython::Never,
            (false, false) => WithPython::ByName,
        };
        let program = python_program(program, args.module, with)?;
        let omp_threads = (nproc > 1 && std::env::var_os("OMP_NUM_THREADS").is_none()).then(|| "1".to_string());
        Ok(JobConfig {
            nproc,
            nnodes,
            min_nodes: range.min,
            elastic: range.min < range.max,
            join_timeout,
            last_call,
            node_rank,
            master_addr,
            master_port,
            store_port,
            run_id: args.rdzv_id,
            role: args.role,
            omp_threads,
            trace_dir,
            heartbeat_timeout,
            external_store: args.store_addr.is_some(),
            secret,
            max_restarts: args.max_restarts,
            timings: args.timings,
            log_dir: sinks.log_dir,
            tee: sinks.tee,
            filter: sinks.filter,
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

/// Node 0's address and cohort's store's port from torchrun's
/// `--rdzv-endpoint`, checked against the options that could say otherwise.
fn rendezvous_at(e: &Endpoint, args: &RunArgs, nnodes: u32) -> Result<(String, u16), LaunchError> {
    let clash = |what: String| Err(LaunchError::RdzvClash(what));
    if let Some(addr) = args.master_addr.as_ref().filter(|a| a.trim_start_matches('[').trim_end_matches(']') != e.host)
    {
        return clash(format!(
            "--rdzv-endpoint says node 0 is {} and --master-addr says {addr}: MASTER_ADDR and cohort's store are \
             both on node 0, so give one",
            e.host
        ));
    }
    if let Some(p) = args.store_port.filter(|&p| p != e.port) {
        return clash(format!(
            "--rdzv-endpoint's port {} and --store-port {p} are both cohort's store's: give one",
            e.port
        ));
    }
    if e.port == 0 && nnodes > 1 {
        return clash(format!(
            "--rdzv-endpoint {}:0 (a free port) only works with one node: the other nodes could not know the port",
            e.host
        ));
    }
    Ok((e.host.clone(), e.port))
}

/// `--join-timeout` and `--last-call`, or torchrun's `--rdzv-conf`
/// join_timeout and last_call_timeout (600 s and 1 s when neither says).
fn rendezvous_waits(args: &RunArgs) -> Result<(Duration, Duration), LaunchError> {
    let conf = args.rdzv_conf.clone().unwrap_or_default();
    let pick = |flag: Option<f64>, conf: Option<f64>, names: (&'static str, &'static str), default| match (flag, conf) {
        (Some(_), Some(_)) => Err(LaunchError::GivenTwice(names.0, names.1)),
        (a, b) => Ok(Duration::from_secs_f64(a.or(b).unwrap_or(default))),
    };
    let join = pick(args.join_timeout, conf.join_timeout, ("--join-timeout", "join_timeout"), 600.0)?;
    let last = pick(args.last_call, conf.last_call_timeout, ("--last-call", "last_call_timeout"), 1.0)?;
    Ok((join, last))
}

/// Where a node's ranks' output goes.
struct Sinks {
    /// The folder of their log files, if any.
    log_dir: Option<PathBuf>,
    /// With `log_dir`: whether they are shown on the console too.
    tee: bool,
    /// The local ranks the console shows (`None`: all).
    filter: Option<BTreeSet<usize>>,
}

/// Where the ranks' output goes. `--log-dir` alone writes files only, and a bare `--tee`
/// shows them too, as cohort always had it; torchrun's `--redirects` and
/// `--tee` values decide per rank (see [`torchrun::output_plan`]).
fn output(args: &RunArgs, nproc: usize, user_filter: Option<BTreeSet<usize>>) -> Result<Sinks, LaunchError> {
    for (flag, streams) in [("--redirects", &args.redirects), ("--tee", &args.tee)] {
        if let Some(rank) = streams.as_ref().and_then(|s| s.highest_rank()).filter(|&r| r >= nproc) {
            return Err(LaunchError::BadStreamsRank { flag, rank, nproc });
        }
    }
    let Some(plan) = torchrun::output_plan(nproc, args.redirects.as_ref(), args.tee.as_ref()) else {
        return Ok(Sinks { log_dir: args.log_dir.clone(), tee: false, filter: user_filter });
    };
    if !plan.files {
        return Ok(Sinks { log_dir: None, tee: false, filter: user_filter });
    }
    let Some(dir) = args.log_dir.clone() else {
        let any = |s: &Option<torchrun::Streams>| (0..nproc).any(|r| s.as_ref().is_some_and(|s| s.of(r) != 0));
        return Err(LaunchError::LogDirNeeded(if any(&args.tee) { "--tee" } else { "--redirects" }));
    };
    let shown: BTreeSet<usize> = match &user_filter {
        Some(f) => plan.console.intersection(f).copied().collect(),
        None => plan.console,
    };
    let tee = !shown.is_empty();
    let filter = (user_filter.is_some() || shown.len() < nproc).then_some(shown);
    Ok(Sinks { log_dir: Some(dir), tee, filter })
}

/// A fresh run id in the form of a random UUID (version 4), as torchrun's
/// --standalone makes one.
fn random_run_id() -> Result<String, LaunchError> {
    let hex = store::generate_secret()?;
    let variant = ["8", "9", "a", "b"][usize::from_str_radix(&hex[16..17], 16).unwrap_or(0) & 3];
    Ok(format!("{}-{}-4{}-{variant}{}-{}", &hex[0..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..32]))
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

/// Whether a program runs with `python3 -u`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WithPython {
    /// When its name ends in `.py`.
    ByName,
    /// Never (`--no-python`).
    Never,
    /// Always (torchrun's `--run-path`).
    Always,
}

/// The command line that runs `program`: a `.py` file (or, with `module`, a
/// module name; or, with `--run-path`, any file) runs with `python3 -u`, as torchrun runs it with its own
/// interpreter; `python3` is the one first on PATH (an active virtual
/// environment's).
fn python_program(
    program: Vec<OsString>,
    module: Option<String>,
    with: WithPython,
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
    if with == WithPython::Always || is_py && with == WithPython::ByName {
        let mut cmd = python();
        cmd.extend(program);
        return Ok(cmd);
    }
    Ok(program)
}

/// How many processes (and threads) this user may run (`ulimit -u`, and the
/// kernel's thread limit), or `None` when unlimited.
fn process_limit() -> Option<u64> {
    let user = crate::process_limit::user_limit();
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

    /// The configuration `cohort run <line>` makes (one node, no secret
    /// in the environment needed).
    fn job(line: &str) -> Result<JobConfig, String> {
        use clap::Parser;
        let argv = ["cohort", "run"].into_iter().chain(line.split_whitespace()).map(OsString::from).collect();
        let argv = torchrun::split_program(argv)?;
        match crate::cli::Cli::try_parse_from(argv).map_err(|e| e.to_string())?.command {
            crate::cli::Command::Run(a) => JobConfig::from_args(*a).map_err(|e| e.to_string()),
            _ => unreachable!("a run line parses as run"),
        }
    }

    #[test]
    fn torchruns_rendezvous_options_place_node_0_and_the_store() {
        let c = job("--rdzv-endpoint 127.0.0.1:5 --master-port 0 p").unwrap();
        assert_eq!((c.master_addr.as_str(), c.store_port, c.node_rank), ("127.0.0.1", 5, 0));
        assert_ne!(c.master_port, 0, "a free port, resolved");
        // torchrun's c10d on one node: its port 29400, and a free MASTER_PORT.
        let c = job("--rdzv_backend=c10d --rdzv_endpoint=127.0.0.1 p").unwrap();
        assert_eq!(c.store_port, 29400);
        assert!(c.master_port != 0 && c.master_port != 29400);
        let c = job("--standalone --rdzv_endpoint=10.1.1.1:7 --rdzv_id=mine -n 2 p").unwrap();
        assert_eq!((c.master_addr.as_str(), c.store_port, c.nproc), ("127.0.0.1", 0, 2));
        assert_eq!((c.run_id.len(), c.run_id.as_bytes()[14]), (36, b'4'), "{}", c.run_id);
        let c = job("--local_addr 127.0.0.3 --master-port 0 p").unwrap();
        assert_eq!(c.master_addr, "127.0.0.3");
        let c = job("--rdzv-conf last_call_timeout=3,join_timeout=7 p").unwrap();
        assert_eq!((c.join_timeout, c.last_call), (Duration::from_secs(7), Duration::from_secs(3)));

        let err = |line: &str| job(line).unwrap_err();
        let e = err("--rdzv-endpoint h:5 --master-addr other p");
        assert!(e.contains("--rdzv-endpoint says node 0 is h and --master-addr says other"), "{e}");
        assert!(err("--rdzv-endpoint h:5 --store-port 6 p").contains("port 5 and --store-port 6"));
        let e = err("--nnodes 2 --node_rank 1 --rdzv-endpoint h:0 p");
        assert!(e.contains("h:0 (a free port) only works with one node"), "{e}");
        let e = err("--nnodes 2 --rdzv_backend c10d --rdzv_endpoint h p");
        assert!(e.contains("needs --node-rank on every node: 0 on the node at --rdzv-endpoint, 1 to 1"), "{e}");
        let e = err("--rdzv-endpoint 127.0.0.1:5 --store-addr 127.0.0.1:5 p");
        assert!(e.contains("--store-addr and --rdzv-endpoint both say"), "{e}");
        assert!(err("--standalone --nnodes 1:2 p").contains("--standalone runs a one-node job"));
        assert!(err("--last-call 2 --rdzv-conf last_call_timeout=3 p").contains("--last-call and --rdzv-conf"));
    }

    #[test]
    fn redirects_and_tee_become_files_console_and_filter() {
        let sinks = |line: &str| job(line).map(|c| (c.log_dir.is_some(), c.tee, c.filter));
        let ranks = |r: &[usize]| Some(r.iter().copied().collect::<BTreeSet<_>>());
        // cohort's own meaning: --log-dir alone is files only; a bare --tee shows them too.
        assert_eq!(sinks("-n 2 --master-port 0 --log-dir d p"), Ok((true, false, None)));
        assert_eq!(sinks("-n 2 --master-port 0 --log-dir d --tee p"), Ok((true, true, None)));
        // torchrun's: per rank.
        assert_eq!(sinks("-n 2 --master-port 0 --log-dir d -r 0:3 p"), Ok((true, true, ranks(&[1]))));
        assert_eq!(sinks("-n 2 --master-port 0 --log-dir d -r 3 p"), Ok((true, false, ranks(&[]))));
        assert_eq!(sinks("-n 2 --master-port 0 --log-dir d -r 0 -t 0 p"), Ok((false, false, None)));
        let filtered = "-n 3 --master-port 0 --log-dir d --tee 3 --local-ranks-filter 0,2 -r 2:3 p";
        assert_eq!(sinks(filtered), Ok((true, true, ranks(&[0, 2]))));
        let e = sinks("-n 2 --master-port 0 -t 1:1 p").unwrap_err();
        assert!(e.contains("--tee writes the ranks' output to files: add --log-dir DIR"), "{e}");
        let e = sinks("-n 2 --master-port 0 --log-dir d -r 2:3 p").unwrap_err();
        assert!(e.contains("--redirects names local rank 2, but this node runs 2 ranks (local ranks 0 to 1)"), "{e}");
        let e = sinks("-n 1 --master-port 0 --log-dir d -r 5:3 p").unwrap_err();
        assert!(e.ends_with("--redirects names local rank 5, but this node runs 1 rank (local rank 0)"), "{e}");
        let e = sinks("-n 1 --master-port 0 --local-ranks-filter 1 p").unwrap_err();
        assert!(
            e.ends_with("--local-ranks-filter names local rank 1, but this node runs 1 rank (local rank 0)"),
            "{e}"
        );
    }

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
            python_program(v(&["train.py", "--lr", "1"]), None, WithPython::ByName).unwrap(),
            v(&["python3", "-u", "train.py", "--lr", "1"])
        );
        assert_eq!(
            python_program(v(&["x"]), Some("pkg.train".into()), WithPython::ByName).unwrap(),
            v(&["python3", "-u", "-m", "pkg.train", "x"])
        );
        assert_eq!(python_program(v(&["train.py"]), None, WithPython::Never).unwrap(), v(&["train.py"]));
        assert_eq!(python_program(v(&["./train"]), None, WithPython::ByName).unwrap(), v(&["./train"]));
        assert_eq!(
            python_program(v(&["/abs/train"]), None, WithPython::Always).unwrap(),
            v(&["python3", "-u", "/abs/train"])
        );
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
            role: "default".into(),
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
