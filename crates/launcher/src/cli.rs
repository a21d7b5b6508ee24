//! Command-line interface of `cohort`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, Parser, Subcommand};

use crate::torchrun::{Endpoint, RdzvBackend, RdzvConf, Streams};

/// cohort: collective communication across GPUs.
#[derive(Debug, Parser)]
#[command(name = "cohort", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of `cohort`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Spawn and watch the ranks of a job on this node, like torchrun.
    ///
    /// Example: cohort run -n 4 ./train --epochs 3
    Run(Box<RunArgs>),
    /// List every backend's devices (cpu, cuda, wgpu) with their properties;
    /// a backend with none says why.
    Devices,
    /// Print which devices can address each other's memory, and the copy
    /// bandwidth between every pair.
    ///
    /// Example: cohort peers --backend cuda --mib 256
    Peers(PeersArgs),
    /// Merge the ranks' flight-recorder dumps (rank<N>.json, written on a
    /// timeout, an abort, a mismatch, SIGUSR1 or request) and point at the
    /// first collective that not every rank finished.
    ///
    /// Example: cohort trace ./cohort-trace
    #[command(after_help = TRACE_EXIT_CODES)]
    Trace(TraceArgs),
    /// Serve a rendezvous store (secret from COHORT_JOB_SECRET) for jobs
    /// that `cohort run --store-addr` or other launchers start.
    ///
    /// Example: COHORT_JOB_SECRET=s cohort store --port 29400
    Store(StoreArgs),
    /// Show where every rank of a running (or hung) job is: its state, the
    /// collective it is in and for how long, its last heartbeat, and which
    /// ranks the others wait for. On the machine of a `cohort run` of yours
    /// it needs nothing: it finds the newest such job (its private run
    /// file). Elsewhere it needs the job's store address and secret
    /// (COHORT_STORE_ADDR and COHORT_JOB_SECRET, or the flags).
    ///
    /// Example: cohort status --watch 1
    /// Example: COHORT_JOB_SECRET=s cohort status --store-addr node0:29501
    Status(StatusArgs),
    /// Print every COHORT_* variable: its current value (secrets masked),
    /// its default and what it does. Exits with 1 when a set value cannot
    /// be used.
    ///
    /// Example: COHORT_TIMEOUT=30 cohort config
    Config(ConfigArgs),
    /// Internal: started by `cohort run`; kills the ranks' process groups
    /// (and so what the ranks started) once the launcher is gone, however it
    /// died.
    #[command(name = "__reaper", hide = true)]
    Reaper,
}

/// Options of `cohort config`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Print the variables as the markdown table of docs/configuration.md.
    #[arg(long)]
    pub markdown: bool,
}

/// The end of `cohort trace --help`: its exit codes (see `trace::trace`).
const TRACE_EXIT_CODES: &str = "\
Exit codes:
  0  every recorded collective finished on every rank
  2  a collective did not finish on every rank (a stuck or abandoned one: the report names the first)
  1  the dumps could not be read";

/// Options of `cohort trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Folders of dumps (every *.json in them) or dump files.
    #[arg(required = true, value_name = "DIR|FILE")]
    pub paths: Vec<PathBuf>,
}

/// Options of `cohort status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The job's store, HOST:PORT (default COHORT_STORE_ADDR, else the
    /// newest `cohort run` of yours on this machine).
    #[arg(long, value_name = "HOST:PORT")]
    pub store_addr: Option<String>,
    /// A file holding the job's secret (default COHORT_JOB_SECRET); a file,
    /// not a flag, so that the secret does not show in `ps`.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Print the status as JSON (for scripts).
    #[arg(long)]
    pub json: bool,
    /// Print it again every SECS seconds (default 1) until interrupted.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1", value_parser = watch_period)]
    pub watch: Option<f64>,
    /// Seconds to wait for the store to answer the connection.
    #[arg(long, value_name = "SECS", default_value_t = 5.0, value_parser = seconds)]
    pub connect_timeout: f64,
}

/// Parses `--watch`'s period: at least 0.05 s.
fn watch_period(s: &str) -> Result<f64, String> {
    let t = seconds(s)?;
    if t < 0.05 {
        return Err(format!("{s} is too short a period: at least 0.05 seconds"));
    }
    Ok(t)
}

/// Options of `cohort store`.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (printed on stdout).
    #[arg(long, default_value_t = 29500)]
    pub port: u16,
}

/// Options of `cohort peers`.
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Backend: cpu, cuda or wgpu (default: cuda when it has two devices or
    /// more, else cpu).
    #[arg(long)]
    pub backend: Option<String>,
    /// MiB per copy (more than 0, at most 65536; fractions allowed).
    #[arg(long, default_value_t = 64.0, value_parser = copy_mib, allow_negative_numbers = true)]
    pub mib: f64,
    /// Timed copies per pair (after one warm-up), 1 to 1000.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=MAX_PEER_ITERS),
          allow_negative_numbers = true)]
    pub iters: u64,
}

/// The largest copy `cohort peers --mib` measures: 64 GiB.
pub const MAX_COPY_MIB: f64 = 65536.0;
/// The most timed copies per pair `cohort peers --iters` makes.
pub const MAX_PEER_ITERS: u64 = 1000;

/// Parses `cohort peers --mib`: at least one byte, at most [`MAX_COPY_MIB`].
fn copy_mib(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(mib) if mib.is_finite() && mib * (1 << 20) as f64 >= 1.0 && mib <= MAX_COPY_MIB => Ok(mib),
        Ok(_) => Err(format!("'{s}' MiB is not a copy size: from 1 byte (0.000001 MiB) to {MAX_COPY_MIB} MiB")),
        Err(_) => Err(format!("'{s}' is not a number of MiB")),
    }
}

/// How many ranks to start on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nproc {
    /// Exactly this many.
    Count(usize),
    /// One per CPU device (`COHORT_CPU_DEVICES`, default 4).
    Cpu,
    /// One per CUDA GPU.
    Gpu,
    /// One per CUDA GPU if there is any, else one per CPU device.
    Auto,
}

/// The most ranks `-n` takes: Linux's limit on process ids
/// (`PID_MAX_LIMIT`, 4,194,304), so no count a node could never run is
/// planned for. The same number as the most ranks a job may have
/// ([`cohort_comm::launch_env::MAX_WORLD_SIZE`]), which it is defined as,
/// so the two limits cannot drift apart.
pub const MAX_RANKS_PER_NODE: usize = cohort_comm::launch_env::MAX_WORLD_SIZE;

impl FromStr for Nproc {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Nproc::Cpu),
            "gpu" => Ok(Nproc::Gpu),
            "auto" => Ok(Nproc::Auto),
            "xpu" => Err("cohort has no XPU backend: use gpu (CUDA), cpu, auto or a number".into()),
            _ => match s.parse::<usize>() {
                Ok(0) => Err("needs at least 1 rank per node".into()),
                Ok(n) if n > MAX_RANKS_PER_NODE => {
                    Err(format!("{n} ranks cannot run on one node: Linux runs at most {MAX_RANKS_PER_NODE} processes"))
                }
                Ok(n) => Ok(Nproc::Count(n)),
                Err(_) => Err(format!("'{s}' is not a number, 'cpu', 'gpu' or 'auto'")),
            },
        }
    }
}

/// `--nnodes`: a fixed count `N`, or `MIN:MAX` for an elastic job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    pub min: u32,
    pub max: u32,
}

impl FromStr for NodeRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let count = |v: &str| match v.trim().parse::<u32>() {
            Ok(0) => Err("needs at least 1 node".to_string()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!("'{v}' is not a number of nodes")),
        };
        let range = match s.split_once(':') {
            None => NodeRange { min: count(s)?, max: count(s)? },
            Some((min, max)) => NodeRange { min: count(min)?, max: count(max)? },
        };
        if range.min > range.max {
            return Err(format!("'{s}': MIN ({}) is above MAX ({})", range.min, range.max));
        }
        Ok(range)
    }
}

/// Parses a host name or address (`--master-addr`, `--local-addr`): not
/// empty (an empty one failed later as "cannot serve the rendezvous store
/// on :0").
fn host(s: &str) -> Result<String, String> {
    match s.trim() {
        "" => Err("needs a host name or address, e.g. node0, 10.0.0.1 or [::1]".into()),
        _ => Ok(s.to_string()),
    }
}

/// Longest `--timeout` or `--heartbeat-timeout` accepted: ten years.
pub const MAX_SECONDS: f64 = 10.0 * 365.0 * 86400.0;

/// Parses a number of seconds for `--timeout` and `--heartbeat-timeout`:
/// finite, at least 0, at most [`MAX_SECONDS`] (clap names the flag in the
/// error).
pub(crate) fn seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(t) if t.is_finite() && (0.0..=MAX_SECONDS).contains(&t) => Ok(t),
        Ok(_) => Err(format!("{s} is not between 0 and {MAX_SECONDS:.0} seconds (ten years)")),
        Err(_) => Err(format!("'{s}' is not a number of seconds")),
    }
}

/// Options of `cohort run`: cohort's own, and torchrun's under its own
/// spellings and meanings (`--nproc_per_node` and `--nproc-per-node` alike).
/// The first argument that is not an option is the program: everything
/// after it is the program's (see [`crate::torchrun::split_program`]). An
/// option given twice takes its last value, as under torchrun.
#[derive(Debug, Args)]
#[command(
    args_override_self = true,
    override_usage = "cohort run [OPTIONS] PROGRAM [ARGS]...\n       cohort run [OPTIONS] -m MODULE [ARGS]...",
    after_help = RUN_AFTER_HELP
)]
pub struct RunArgs {
    /// Ranks on this node: a number, `cpu` (one per CPU device:
    /// COHORT_CPU_DEVICES, default 4, where torchrun starts one per core),
    /// `gpu` (one per CUDA GPU) or `auto` (gpu if any, else cpu).
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        alias = "nproc_per_node",
        value_name = "N|cpu|gpu|auto",
        default_value = "1"
    )]
    pub nproc_per_node: Nproc,

    /// Number of nodes (launchers) in the job; more than 1 needs
    /// --master-addr or --rdzv-endpoint. MIN:MAX makes the job elastic: it
    /// starts once MIN nodes joined (and --last-call passed, or MAX joined),
    /// and when a node's launcher dies or a rank fails the others stop their
    /// ranks and restart them (up to --max-restarts) with the nodes still
    /// there, as long as there are MIN; a node that joins later is taken in
    /// at the next restart, up to MAX.
    #[arg(long, value_name = "N|MIN:MAX", default_value = "1")]
    pub nnodes: NodeRange,

    /// Elastic jobs (--nnodes MIN:MAX): how long a restart waits for MIN
    /// nodes before it gives up with an error [default: 600].
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    pub join_timeout: Option<f64>,

    /// Elastic jobs: once MIN nodes joined, how long to wait for more (up
    /// to MAX) before the ranks start [default: 1].
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    pub last_call: Option<f64>,

    /// This node's rank, from 0 to nnodes-1; node 0 serves the rendezvous
    /// store [default: 0; needed with --rdzv-backend c10d and several nodes:
    /// cohort does not number nodes as they arrive].
    #[arg(long, alias = "node_rank")]
    pub node_rank: Option<u32>,

    /// Address of node 0 (MASTER_ADDR): where the program's own store (e.g.
    /// PyTorch's TCPStore) and cohort's rendezvous store listen. Default
    /// the --rdzv-endpoint's host, else 127.0.0.1 with one node; required
    /// with several.
    #[arg(long, alias = "master_addr", value_name = "HOST", value_parser = host)]
    pub master_addr: Option<String>,

    /// MASTER_PORT, the port rank 0 of the program may listen on (PyTorch's
    /// TCPStore does); 0 picks a free one (one node only). Default 29500, as
    /// torchrun's; a free one with --standalone or --rdzv-backend c10d on
    /// one node, as torchrun gives. cohort's own store listens on
    /// --store-port.
    #[arg(long, alias = "master_port")]
    pub master_port: Option<u16>,

    /// Port of cohort's rendezvous store on node 0 (COHORT_STORE_ADDR):
    /// default the --rdzv-endpoint's port, else a free port with one node,
    /// --master-port + 1 with several.
    #[arg(long, value_name = "PORT")]
    pub store_port: Option<u16>,

    /// torchrun's --standalone: a one-node job with its store on a free
    /// port and a fresh run id (TORCHELASTIC_RUN_ID); --rdzv-backend,
    /// --rdzv-endpoint and --rdzv-id are then ignored, as by torchrun.
    #[arg(long)]
    pub standalone: bool,

    /// torchrun's rendezvous backend: `c10d` or `static` (both: cohort's own
    /// store, on node 0). etcd is not available yet.
    #[arg(long, alias = "rdzv_backend", value_name = "c10d|static")]
    pub rdzv_backend: Option<RdzvBackend>,

    /// Where the rendezvous store lives, as torchrun's: node 0's HOST[:PORT]
    /// (port default 29400; an IPv6 address in brackets, [::1]:29400). It is MASTER_ADDR too, and cohort's store
    /// listens on PORT there.
    #[arg(long, alias = "rdzv_endpoint", value_name = "HOST[:PORT]")]
    pub rdzv_endpoint: Option<Endpoint>,

    /// torchrun's rendezvous settings, KEY=VALUE,...: join_timeout is
    /// --join-timeout, last_call_timeout is --last-call; close_timeout,
    /// read_timeout, timeout, keep_alive_interval, keep_alive_max_attempt,
    /// is_host, use_libuv and store_type=tcp are accepted and unused.
    #[arg(long, alias = "rdzv_conf", value_name = "KEY=VALUE,...")]
    pub rdzv_conf: Option<RdzvConf>,

    /// Restart the whole group this many times when a rank fails.
    #[arg(long, alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: u32,

    /// The job's id for the program (TORCHELASTIC_RUN_ID), as torchrun's
    /// --rdzv-id; default `none`, as torchrun's.
    #[arg(long, alias = "rdzv_id", value_name = "ID", default_value = "none")]
    pub rdzv_id: String,

    /// torchrun's --local-addr, this node's address: on a one-node job it is
    /// MASTER_ADDR (unless --master-addr or --rdzv-endpoint says); other
    /// nodes reach node 0 at --master-addr or --rdzv-endpoint, so it is not
    /// needed there.
    #[arg(long, alias = "local_addr", value_name = "HOST", value_parser = host)]
    pub local_addr: Option<String>,

    /// torchrun's worker role, the ranks' ROLE_NAME (default `default`).
    /// Every rank of a job has this one role, so ROLE_RANK is RANK and
    /// ROLE_WORLD_SIZE is WORLD_SIZE, as under torchrun with one role.
    #[arg(long, value_name = "NAME", default_value = "default")]
    pub role: String,

    /// torchrun's period for looking at its workers; accepted and unused:
    /// cohort learns of a rank's end as it happens.
    #[arg(long, alias = "monitor_interval", value_name = "SECONDS", value_parser = seconds)]
    pub monitor_interval: Option<f64>,

    /// torchrun's multiprocessing start method; accepted and unused: every
    /// rank is a process of its own, started afresh.
    #[arg(long, alias = "start_method", value_parser = ["spawn", "fork", "forkserver"])]
    pub start_method: Option<String>,

    /// Run a Python module: `cohort run -n 2 -m pkg.train --lr 1` runs
    /// `python3 -u -m pkg.train --lr 1` as every rank, as torchrun's -m.
    /// What follows MODULE is the module's. As torchrun's flag, `-m` may
    /// come before cohort's other options: `-m -n 2 pkg.train`.
    #[arg(short = 'm', long, value_name = "MODULE")]
    pub module: Option<String>,

    /// Run the program as it is, even when it ends in `.py` (which otherwise
    /// runs with `python3 -u`, as under torchrun).
    #[arg(long, alias = "no_python", conflicts_with = "module")]
    pub no_python: bool,

    /// torchrun's --run-path: run the program as a Python script (`python3
    /// -u PROGRAM`) whatever its name; overrides --no-python.
    #[arg(long, alias = "run_path", conflicts_with = "module")]
    pub run_path: bool,

    /// Write each rank's stdout and stderr to files under this folder
    /// (attempt_<restart>/rank_<rank>/{stdout,stderr}.log) instead of the
    /// console. With --redirects or --tee, as those say (torchrun's
    /// --log-dir alone writes no output files: `-r 0` keeps the console).
    #[arg(long, alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// torchrun's --redirects: the ranks' streams that go to files under
    /// --log-dir instead of the console: 0 none, 1 stdout, 2 stderr, 3 both,
    /// or per local rank (0:3,1:2). cohort keeps a rank's two streams
    /// together: a rank with any stream redirected writes both to files,
    /// and is left off the console only when both are.
    #[arg(short = 'r', long, value_name = "0-3|RANK:N,...")]
    pub redirects: Option<Streams>,

    /// Write ranks' output to the console as well as to the files under
    /// --log-dir. torchrun's values (0-3 or per local rank, as --redirects)
    /// choose the ranks; a bare --tee is --tee 3.
    #[arg(short = 't', long, value_name = "0-3|RANK:N,...", num_args = 0..=1, default_missing_value = "3")]
    pub tee: Option<Streams>,

    /// Show only these local ranks' output on the console (comma list, e.g. 0,3).
    #[arg(long, alias = "local_ranks_filter", value_name = "RANKS", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub local_ranks_filter: Option<Vec<usize>>,

    /// Wall-clock limit for the whole job in seconds (also exported to the
    /// ranks as COHORT_TIMEOUT, the default timeout of their collectives).
    #[arg(long, value_name = "SECONDS", value_parser = seconds, allow_negative_numbers = true)]
    pub timeout: Option<f64>,

    /// Where ranks write their flight recorders (COHORT_TRACE_DIR): default
    /// the launcher's own COHORT_TRACE_DIR when set, else <log-dir>/trace with
    /// --log-dir, else ./cohort-trace. Made only when a rank writes a dump;
    /// cleared of rank<N>.json at each attempt's start; merged into the
    /// failure summary.
    #[arg(long, value_name = "DIR")]
    pub trace_dir: Option<PathBuf>,

    /// Stop the job when a rank's heartbeat (written every second by its
    /// Communicator, even while it waits in a collective) stops for this many
    /// seconds: a stopped or frozen process. 0 turns the watchdog off.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = seconds, allow_negative_numbers = true)]
    pub heartbeat_timeout: f64,

    /// Print the job's start-up phases on stderr once its first communicator
    /// is formed: launcher start, store up, ranks started, all ranks joined,
    /// links formed, NCCL chosen (with its unique id shared), each in ms
    /// from this launcher's start; and the `cohort status` line that shows
    /// where the ranks are.
    #[arg(long)]
    pub timings: bool,

    /// Use the rendezvous store at HOST:PORT (e.g. `cohort store`) instead of
    /// serving one on node 0.
    #[arg(long, value_name = "HOST:PORT")]
    pub store_addr: Option<String>,

    /// The program to run as every rank, and its arguments: the first
    /// argument that is not an option, or what follows `--`. A program
    /// ending in `.py` runs with `python3 -u`.
    #[arg(last = true, required_unless_present = "module", value_name = "PROGRAM [ARGS]")]
    pub program: Vec<OsString>,
}

/// The end of `cohort run --help`.
const RUN_AFTER_HELP: &str = "\
Examples (torchrun's lines work as they are):
  cohort run -n 4 ./train --epochs 3
  cohort run --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10
  cohort run --nnodes=2 --node_rank=0 --rdzv_backend=c10d --rdzv_endpoint=node0:29400 train.py
  cohort run -n 2 -m pkg.train --lr 1e-3

The first argument that is not an option is the program; everything after it is the program's.
torchrun's --logs-specs, --numa-binding, --signals-to-handle and --event-log-handler have no
counterpart: each is an error that says what cohort does instead.";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nproc_parses() {
        assert_eq!("8".parse::<Nproc>(), Ok(Nproc::Count(8)));
        assert_eq!("cpu".parse::<Nproc>(), Ok(Nproc::Cpu));
        assert_eq!("gpu".parse::<Nproc>(), Ok(Nproc::Gpu));
        assert_eq!("auto".parse::<Nproc>(), Ok(Nproc::Auto));
        assert!("0".parse::<Nproc>().is_err());
        assert!("many".parse::<Nproc>().unwrap_err().contains("'many'"));
        assert_eq!("4194304".parse::<Nproc>(), Ok(Nproc::Count(MAX_RANKS_PER_NODE)));
        assert!("4194305".parse::<Nproc>().unwrap_err().contains("4194304"));
        let too_many = "99999999999".parse::<Nproc>().unwrap_err();
        assert!(too_many.contains("99999999999") && too_many.contains("4194304"), "{too_many}");
    }

    #[test]
    fn run_args_parse() {
        let line = "cohort run -n 4 --nnodes 2 --node-rank 1 --local-ranks-filter 0,3 --timeout 2.5 -- prog --flag";
        let cli = Cli::try_parse_from(line.split(' ')).unwrap();
        let Command::Run(a) = cli.command else { panic!("a run command") };
        assert_eq!(a.nproc_per_node, Nproc::Count(4));
        assert_eq!((a.nnodes, a.node_rank), (NodeRange { min: 2, max: 2 }, Some(1)));
        assert_eq!(a.local_ranks_filter, Some(vec![0, 3]));
        assert_eq!(a.timeout, Some(2.5));
        assert_eq!(a.program, vec![OsString::from("prog"), OsString::from("--flag")]);
        // A bare --tee is --tee 3 (whether --log-dir is there is the job
        // configuration's to check).
        let cli = Cli::try_parse_from(["cohort", "run", "--tee", "--", "p"]).unwrap();
        let Command::Run(a) = cli.command else { panic!("a run command") };
        assert_eq!(a.tee, Some(crate::torchrun::Streams::All(3)));
        assert!(Cli::try_parse_from(["cohort", "run", "--nnodes", "0", "--", "p"]).is_err());
        assert_eq!("1:4".parse::<NodeRange>(), Ok(NodeRange { min: 1, max: 4 }));
        assert!("3:2".parse::<NodeRange>().unwrap_err().contains("MIN (3) is above MAX (2)"));
        assert!("0:2".parse::<NodeRange>().is_err());
        assert!("a:2".parse::<NodeRange>().unwrap_err().contains("'a'"));
    }

    #[test]
    fn torchrun_spellings_are_aliases() {
        let line = "cohort run --nproc_per_node 2 --nnodes 2 --node_rank 1 --master_addr h --master_port 7 \
                    --max_restarts 3 --rdzv_id job -- p";
        let cli = Cli::try_parse_from(line.split_whitespace()).unwrap();
        let Command::Run(a) = cli.command else { panic!("a run command") };
        assert_eq!(a.nproc_per_node, Nproc::Count(2));
        assert_eq!((a.nnodes.max, a.node_rank, a.master_port, a.max_restarts), (2, Some(1), Some(7), 3));
        assert_eq!((a.master_addr.as_deref(), a.rdzv_id.as_str()), (Some("h"), "job"));
    }

    #[test]
    fn huge_or_bad_seconds_are_errors_naming_the_flag() {
        for flag in ["--timeout", "--heartbeat-timeout"] {
            for bad in ["1e30", "inf", "NaN", "-1", "soon"] {
                let err = Cli::try_parse_from(["cohort", "run", flag, bad, "--", "p"]).unwrap_err().to_string();
                assert!(err.contains(flag) && err.contains(bad), "{err}");
            }
        }
        let ok = Cli::try_parse_from(["cohort", "run", "--timeout", "1e8", "--", "p"]).unwrap();
        let Command::Run(a) = ok.command else { panic!("a run command") };
        assert_eq!(a.timeout, Some(1e8));
    }

    #[test]
    fn trace_help_says_its_exit_codes() {
        let err = Cli::try_parse_from(["cohort", "trace", "--help"]).unwrap_err();
        let help = err.to_string();
        assert!(
            help.contains("Exit codes:") && help.contains("2  a collective did not finish on every rank"),
            "{help}"
        );
    }

    #[test]
    fn peers_refuses_copy_sizes_and_counts_it_cannot_measure() {
        let parse = |args: &[&str]| {
            let argv = ["cohort", "peers"].iter().chain(args).copied().collect::<Vec<_>>();
            match Cli::try_parse_from(argv) {
                Ok(Cli { command: Command::Peers(p) }) => Ok((p.mib, p.iters)),
                Ok(_) => unreachable!("peers parses as peers"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(parse(&[]), Ok((64.0, 3)));
        assert_eq!(parse(&["--mib", "0.5", "--iters", "1000"]), Ok((0.5, 1000)));
        for bad in ["0", "-5", "nan", "inf", "1e30", "65537", "1e-9", "lots"] {
            let err = parse(&["--mib", bad]).unwrap_err();
            assert!(err.contains(&format!("'{bad}'")) && err.contains("MiB"), "--mib {bad}: {err}");
        }
        for bad in ["0", "-1", "1001", "99999999999999999999"] {
            let err = parse(&["--iters", bad]).unwrap_err();
            assert!(err.contains(&format!("'{bad}'")) && err.contains("--iters"), "--iters {bad}: {err}");
        }
    }
}
