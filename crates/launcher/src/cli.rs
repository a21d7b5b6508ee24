//! Command-line interface of `cohort`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, Parser, Subcommand};

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
    /// Example: cohort run -n 4 -- ./train --epochs 3
    Run(RunArgs),
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
    Trace(TraceArgs),
    /// Serve a rendezvous store (secret from COHORT_JOB_SECRET) for jobs
    /// that `cohort run --store-addr` or other launchers start.
    ///
    /// Example: COHORT_JOB_SECRET=s cohort store --port 29400
    Store(StoreArgs),
    /// Print every COHORT_* variable: its current value (secrets masked),
    /// its default and what it does. Exits with 1 when a set value cannot
    /// be used.
    ///
    /// Example: COHORT_TIMEOUT=30 cohort config
    Config(ConfigArgs),
}

/// Options of `cohort config`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Print the variables as the markdown table of docs/configuration.md.
    #[arg(long)]
    pub markdown: bool,
}

/// Options of `cohort trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Folders of dumps (every *.json in them) or dump files.
    #[arg(required = true, value_name = "DIR|FILE")]
    pub paths: Vec<PathBuf>,
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
    /// MiB per copy.
    #[arg(long, default_value_t = 64.0)]
    pub mib: f64,
    /// Timed copies per pair (after one warm-up).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: u64,
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

impl FromStr for Nproc {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Nproc::Cpu),
            "gpu" => Ok(Nproc::Gpu),
            "auto" => Ok(Nproc::Auto),
            _ => match s.parse::<usize>() {
                Ok(0) => Err("needs at least 1 rank per node".into()),
                Ok(n) => Ok(Nproc::Count(n)),
                Err(_) => Err(format!("'{s}' is not a number, 'cpu', 'gpu' or 'auto'")),
            },
        }
    }
}

/// Options of `cohort run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Ranks on this node: a number, `cpu` (COHORT_CPU_DEVICES, default 4),
    /// `gpu` (one per CUDA GPU) or `auto` (gpu if any, else cpu).
    #[arg(short = 'n', long = "nproc-per-node", value_name = "N|cpu|gpu|auto", default_value = "1")]
    pub nproc_per_node: Nproc,

    /// Number of nodes (launchers) in the job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nnodes: u32,

    /// This node's rank, from 0 to nnodes-1; node 0 serves the rendezvous store.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,

    /// Address of node 0, where the rendezvous store listens.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,

    /// Port of the rendezvous store on node 0; 0 picks a free one (one node only).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,

    /// Restart the whole group this many times when a rank fails.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,

    /// Write each rank's stdout and stderr to files under this folder
    /// (attempt_<restart>/rank_<rank>/{stdout,stderr}.log) instead of the console.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// With --log-dir: write ranks' output to the console too.
    #[arg(long, requires = "log_dir")]
    pub tee: bool,

    /// Show only these local ranks' output on the console (comma list, e.g. 0,3).
    #[arg(long, value_name = "RANKS", value_delimiter = ',')]
    pub local_ranks_filter: Option<Vec<usize>>,

    /// Wall-clock limit for the whole job in seconds (also exported to the
    /// ranks as COHORT_TIMEOUT, the default timeout of their collectives).
    #[arg(long, value_name = "SECONDS")]
    pub timeout: Option<f64>,

    /// Where ranks write their flight recorders (COHORT_TRACE_DIR): default
    /// <log-dir>/trace with --log-dir, else ./cohort-trace. Cleared of
    /// rank<N>.json at each attempt's start; merged into the failure summary.
    #[arg(long, value_name = "DIR")]
    pub trace_dir: Option<PathBuf>,

    /// Stop the job when a rank's heartbeat (written every second by its
    /// Communicator, even while it waits in a collective) stops for this many
    /// seconds: a stopped or frozen process. 0 turns the watchdog off.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    pub heartbeat_timeout: f64,

    /// Use the rendezvous store at HOST:PORT (e.g. `cohort store`) instead of
    /// serving one on node 0.
    #[arg(long, value_name = "HOST:PORT")]
    pub store_addr: Option<String>,

    /// The program to run as every rank, and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM [ARGS]")]
    pub program: Vec<OsString>,
}

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
    }

    #[test]
    fn run_args_parse() {
        let line = "cohort run -n 4 --nnodes 2 --node-rank 1 --local-ranks-filter 0,3 --timeout 2.5 -- prog --flag";
        let cli = Cli::try_parse_from(line.split(' ')).unwrap();
        let Command::Run(a) = cli.command else { panic!("a run command") };
        assert_eq!(a.nproc_per_node, Nproc::Count(4));
        assert_eq!((a.nnodes, a.node_rank), (2, 1));
        assert_eq!(a.local_ranks_filter, Some(vec![0, 3]));
        assert_eq!(a.timeout, Some(2.5));
        assert_eq!(a.program, vec![OsString::from("prog"), OsString::from("--flag")]);
        assert!(Cli::try_parse_from(["cohort", "run", "--tee", "--", "p"]).is_err());
        assert!(Cli::try_parse_from(["cohort", "run", "--nnodes", "0", "--", "p"]).is_err());
    }
}
