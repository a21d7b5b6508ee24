//! torchrun's command line under `cohort run`: where the program starts (at
//! the first argument that is not an option, as torchrun reads it), the
//! values of torchrun's own options (`--redirects`/`--tee`,
//! `--rdzv-backend`, `--rdzv-endpoint`, `--rdzv-conf`), and what torchrun's
//! options that cohort lacks do there.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::str::FromStr;

use clap::CommandFactory;

use crate::cli::{seconds, Cli};

/// The port of torchrun's rendezvous endpoint when `--rdzv-endpoint` names
/// none (torchrun's default).
pub const DEFAULT_RDZV_PORT: u16 = 29400;

/// torchrun's options that `cohort run` does not have: their spellings,
/// what they do under torchrun, and what cohort offers instead.
const TORCHRUN_ONLY: &[(&[&str], &str)] = &[
    (
        &["--logs-specs", "--logs_specs"],
        "names a Python entry point (torchrun.logs_specs) that lays out the workers' log files; cohort lays \
         them out itself: --log-dir DIR with --redirects or --tee",
    ),
    (
        &["--numa-binding", "--numa_binding"],
        "binds each worker to the CPUs of its GPU's NUMA node; cohort does not bind ranks: start the program \
         through a script that runs `numactl` by LOCAL_RANK",
    ),
    (
        &["--signals-to-handle", "--signals_to_handle"],
        "chooses the signals torchrun forwards to its workers; cohort always forwards SIGINT, SIGTERM and \
         SIGHUP to every rank (and what it started)",
    ),
    (
        &["--event-log-handler", "--event_log_handler"],
        "names a Python handler for torchelastic's events; cohort says what happens on stderr (more with \
         --timings or COHORT_LOG=info)",
    ),
];

/// torchrun's options whose default is "": given an empty value, they are
/// unset there (a script's `--rdzv_endpoint=$EP` with `EP` unset).
const EMPTY_IS_UNSET: [&str; 3] = ["rdzv_endpoint", "rdzv_conf", "local_ranks_filter"];

/// `argv` (all of `cohort`'s arguments) with `--` put where the program of
/// a `cohort run` starts, as torchrun reads its line: the first argument
/// that is not an option or an option's value is the program, and
/// everything after it is the program's (its own flags included); after
/// `-m MODULE` everything is the module's, and `-m` followed by options is
/// torchrun's flag: the program is the module. A `--` already there is
/// kept. Other subcommands' lines are returned as they are.
///
/// A long option may be shortened to any start that is no other's (as
/// torchrun's argparse allows: `--nnode=1`); it is written in full for
/// clap. An option `cohort run` does not know is an error naming it (and,
/// for torchrun's options cohort lacks, what it does under torchrun). Which
/// options take a value comes from the parser's own definition; `--tee`
/// takes one only when the next argument is a `--tee` value (`0`-`3` or
/// `RANK:N,...`): a bare `--tee` is cohort's older spelling of `--tee 3`.
/// A value that starts with '-' is read as torchrun's argparse reads it: a
/// negative number is a value, anything else an option (the value is
/// missing); an empty value of an option in [`EMPTY_IS_UNSET`] drops it.
pub fn split_program(argv: Vec<OsString>) -> Result<Vec<OsString>, String> {
    if argv.get(1).is_none_or(|a| a != "run") {
        return Ok(argv);
    }
    let mut cli = Cli::command();
    cli.build();
    let run = cli.find_subcommand("run").expect("`cohort run` is a subcommand");
    let mut out: Vec<OsString> = argv[..2].to_vec();
    let mut rest = argv.into_iter().skip(2).peekable();
    // torchrun's `-m` is a flag: the program it names is the module. The
    // `-m` seen with options after it, waiting for the program.
    let mut module_flag: Option<String> = None;
    while let Some(arg) = rest.next() {
        let text = arg.to_string_lossy().into_owned();
        if text == "--" || !text.starts_with('-') || text == "-" {
            let program = (text != "--").then_some(arg);
            match module_flag.take() {
                Some(flag) => {
                    let module = program.or_else(|| rest.next()).ok_or_else(|| needs_module(&flag, None))?;
                    let mut opt = OsString::from("--module=");
                    opt.push(module);
                    out.extend([opt, "--".into()]);
                }
                None => out.extend(std::iter::once("--".into()).chain(program)),
            }
            break;
        }
        let (name, inline) = match text.strip_prefix("--") {
            Some(long) => match long.split_once('=') {
                Some((n, _)) => (format!("--{n}"), true),
                None => (text.clone(), false),
            },
            None => (text[..text.char_indices().nth(2).map_or(text.len(), |(i, _)| i)].to_string(), text.len() > 2),
        };
        let (opt, arg, name) = match find_option(run, &name) {
            Some(opt) => (opt, arg, name),
            None => match abbreviated(run, &name) {
                // Written in full for clap, with its `=value` if any.
                Ok(opt) => {
                    let full = format!("--{}", opt.get_long().unwrap_or_default());
                    let mut whole = OsString::from(&full);
                    let bytes = arg.as_encoded_bytes();
                    if let Some(eq) = bytes.iter().position(|&b| b == b'=') {
                        whole.push(std::ffi::OsStr::from_bytes(&bytes[eq..]));
                    }
                    (opt, whole, full)
                }
                Err(e) => {
                    return Err(match &module_flag {
                        Some(flag) if e.starts_with("unknown option") => needs_module(flag, Some(&name)),
                        _ => e,
                    })
                }
            },
        };
        if opt.get_id() == "module" {
            // `-m MODULE` (or `--module=MODULE`, `-mMODULE`): what follows
            // is the module's, and a `--` right after it (cohort's older
            // spelling) only separates. `-m` followed by an option:
            // torchrun's flag, the module comes as the program.
            let module = match inline {
                true => None,
                false => match rest.next_if(|next| !next.to_string_lossy().starts_with('-')) {
                    Some(module) => Some(module),
                    None => {
                        module_flag = Some(name);
                        continue;
                    }
                },
            };
            out.push(arg);
            out.extend(module);
            out.push("--".into());
            rest.next_if(|a| a == "--");
            break;
        }
        out.push(arg);
        let takes = opt.get_num_args().unwrap_or_default();
        let value = if inline || !opt.get_action().takes_values() {
            None
        } else if takes.min_values() == 0 {
            rest.next_if(|next| next.to_str().is_some_and(|v| v.parse::<Streams>().is_ok()))
        } else {
            rest.next()
        };
        // argparse's reading of a value that starts with '-': a negative
        // number is the value (written `--opt=-1`, so that clap hands it to
        // the option's parser), anything else is an option, so the value
        // is missing.
        let value = match value {
            Some(v) if v.to_str().is_some_and(|v| v.len() > 1 && v.starts_with('-')) => {
                let v = v.to_string_lossy();
                if v.parse::<f64>().is_err() {
                    return Err(format!(
                        "{name} needs a value, but '{v}' follows it (an option): give the value after {name} (one \
                         that starts with '-' is written {name}=VALUE)"
                    ));
                }
                out.pop();
                out.push(format!("{name}={v}").into());
                None
            }
            v => v,
        };
        let empty = match inline {
            true => text.split_once('=').is_some_and(|(_, v)| v.is_empty()),
            false => value.as_ref().is_some_and(|v| v.is_empty()),
        };
        if empty && EMPTY_IS_UNSET.contains(&opt.get_id().as_str()) {
            out.pop();
            continue;
        }
        out.extend(value);
    }
    if let Some(flag) = module_flag {
        return Err(needs_module(&flag, None));
    }
    out.extend(rest);
    Ok(out)
}

/// The error for `-m` that no module's name follows (`option`: the option
/// of no use to `cohort run` met instead).
fn needs_module(flag: &str, option: Option<&str>) -> String {
    let met = option.map_or(String::new(), |o| format!(", and '{o}' is not an option of `cohort run`"));
    format!(
        "{flag} needs the module's name: the first argument after cohort's options, e.g. `cohort run -n 2 -m \
         pkg.train --lr 1` (what follows the module is its own){met}"
    )
}

/// The option of `run` spelled `name` (`--long`, an alias, or `-s`).
fn find_option<'a>(run: &'a clap::Command, name: &str) -> Option<&'a clap::Arg> {
    run.get_arguments().find(|a| match name.strip_prefix("--") {
        Some(long) => a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|v| v.contains(&long)),
        None => name.chars().nth(1).is_some_and(|short| {
            a.get_short() == Some(short) || a.get_all_short_aliases().is_some_and(|v| v.contains(&short))
        }),
    })
}

/// The option of `run` whose long name (or alias) starts with `name`, as
/// argparse takes an unambiguous start of a long option for it; the error
/// for an option `cohort run` does not have, or for a start of several.
fn abbreviated<'a>(run: &'a clap::Command, name: &str) -> Result<&'a clap::Arg, String> {
    let Some(start) = name.strip_prefix("--").filter(|s| !s.is_empty()) else { return Err(unknown_option(name)) };
    let ours: Vec<&clap::Arg> = run
        .get_arguments()
        .filter(|a| {
            a.get_long().into_iter().chain(a.get_all_aliases().into_iter().flatten()).any(|l| l.starts_with(start))
        })
        .collect();
    let theirs: Vec<&(&[&str], &str)> =
        TORCHRUN_ONLY.iter().filter(|(names, _)| names.iter().any(|n| n[2..].starts_with(start))).collect();
    match (ours.as_slice(), theirs.as_slice()) {
        ([], []) => Err(unknown_option(name)),
        ([one], []) => Ok(one),
        ([], [(_, meaning)]) => Err(format!("{name} is torchrun's option that {meaning}")),
        _ => {
            let all: Vec<String> = ours
                .iter()
                .map(|a| format!("--{}", a.get_long().unwrap_or_default()))
                .chain(theirs.iter().map(|(names, _)| names[0].to_string()))
                .collect();
            Err(format!("'{name}' is the start of several options: {}; write the one you mean", all.join(", ")))
        }
    }
}

/// The error for an option `cohort run` does not have.
fn unknown_option(name: &str) -> String {
    match TORCHRUN_ONLY.iter().find(|(names, _)| names.contains(&name)) {
        Some((_, meaning)) => format!("{name} is torchrun's option that {meaning}"),
        None => format!(
            "unknown option '{name}' for `cohort run` (every argument before the program that starts with '-' \
             is cohort's: put the program's own options after it; see `cohort run --help`)"
        ),
    }
}

/// torchrun's `--redirects`/`--tee` value: which streams of each local
/// rank: 0 none, 1 stdout, 2 stderr, 3 both; one number for every rank, or
/// `LOCAL_RANK:N,...` (ranks not named: 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Streams {
    /// The same for every local rank.
    All(u8),
    /// Per local rank.
    PerRank(BTreeMap<usize, u8>),
}

impl Streams {
    /// The streams of local rank `rank` (1 stdout, 2 stderr, 3 both).
    pub fn of(&self, rank: usize) -> u8 {
        match self {
            Streams::All(s) => *s,
            Streams::PerRank(map) => map.get(&rank).copied().unwrap_or(0),
        }
    }

    /// The highest local rank named in a per-rank value.
    pub fn highest_rank(&self) -> Option<usize> {
        match self {
            Streams::All(_) => None,
            Streams::PerRank(map) => map.keys().next_back().copied(),
        }
    }
}

impl FromStr for Streams {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let streams = |v: &str| match v.parse::<u8>() {
            Ok(n) if n <= 3 => Ok(n),
            _ => Err(format!("'{v}' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")),
        };
        if !s.contains(':') {
            return streams(s).map(Streams::All);
        }
        let mut map = BTreeMap::new();
        for item in s.split(',') {
            let (rank, v) = item.split_once(':').ok_or(format!("'{item}' is not LOCAL_RANK:STREAMS, e.g. 0:3"))?;
            let rank = rank.parse::<usize>().map_err(|_| format!("'{rank}' in '{item}' is not a local rank"))?;
            if map.insert(rank, streams(v)?).is_some() {
                return Err(format!("local rank {rank} is named twice"));
            }
        }
        Ok(Streams::PerRank(map))
    }
}

/// Where a node's ranks' output goes, per local rank, from torchrun's
/// `--redirects` and `--tee`. cohort keeps a rank's stdout and stderr
/// together: a rank any of whose streams torchrun would write to a file
/// gets both files (and then so does every rank of the node); a rank any
/// of whose streams torchrun would show on the console is shown, both
/// streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputPlan {
    /// Whether the ranks' output goes to files under `--log-dir`.
    pub files: bool,
    /// Local ranks shown on the console (with `files`).
    pub console: BTreeSet<usize>,
}

/// The plan for `nproc` local ranks, or `None` when neither `--redirects`
/// nor `--tee` was given (cohort's own meaning of `--log-dir` then holds).
pub fn output_plan(nproc: usize, redirects: Option<&Streams>, tee: Option<&Streams>) -> Option<OutputPlan> {
    if redirects.is_none() && tee.is_none() {
        return None;
    }
    let of = |s: Option<&Streams>, r| s.map_or(0, |s| s.of(r));
    let files = (0..nproc).any(|r| of(redirects, r) | of(tee, r) != 0);
    // A stream is on torchrun's console unless redirected without tee.
    let console = (0..nproc).filter(|&r| [1, 2].iter().any(|s| of(redirects, r) & s == 0 || of(tee, r) & s != 0));
    Some(OutputPlan { files, console: console.collect() })
}

/// `--rdzv-backend`: where the nodes meet. torchrun's `c10d` and `static`
/// both mean cohort's own store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdzvBackend {
    /// Fixed nodes numbered by `--node-rank`; the store on node 0.
    Static,
    /// torchrun's TCP-store rendezvous: cohort's store at `--rdzv-endpoint`.
    C10d,
}

impl FromStr for RdzvBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "static" => Ok(RdzvBackend::Static),
            "c10d" => Ok(RdzvBackend::C10d),
            "etcd" | "etcd-v2" => Err(format!(
                "torchrun's {s} rendezvous (nodes meeting in an etcd server) is not available in cohort yet; use \
                 c10d (or static): cohort's own store, served by node 0 at --rdzv-endpoint HOST:PORT, or \
                 --store-addr for one that `cohort store` serves"
            )),
            _ => Err(format!("'{s}' is not a rendezvous backend cohort has: c10d or static (cohort's own store)")),
        }
    }
}

/// `--rdzv-endpoint HOST[:PORT]`: where the rendezvous store lives (node
/// 0); the port defaults to [`DEFAULT_RDZV_PORT`], as under torchrun.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Node 0's address, without brackets.
    pub host: String,
    /// The store's port (0: a free one).
    pub port: u16,
}

impl FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or(format!("'{s}' has no closing ']'"))?;
            match after {
                "" => (host, None),
                _ => (host, Some(after.strip_prefix(':').ok_or(format!("'{s}' is not [HOST]:PORT"))?)),
            }
        } else if s.matches(':').count() > 1 {
            // `::1:8080` is an IPv6 address, and so is `::1` with port
            // 8080: refused rather than guessed.
            return Err(format!(
                "'{s}' looks like an IPv6 address: write it in brackets, [HOST] or [HOST]:PORT (e.g. [::1]:29400)"
            ));
        } else {
            match s.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (s, None),
            }
        };
        if host.trim().is_empty() {
            return Err(format!("'{s}' names no host: give HOST[:PORT], e.g. node0:29400"));
        }
        let port = match port {
            None => DEFAULT_RDZV_PORT,
            Some(p) => p.parse().map_err(|_| format!("'{p}' in '{s}' is not a port number (0-65535)"))?,
        };
        Ok(Endpoint { host: host.to_string(), port })
    }
}

/// torchrun's `--rdzv-conf KEY=VALUE,...`: the keys cohort has a meaning
/// for. Keys of torchrun's c10d and static rendezvous that tune waits
/// cohort does not have are accepted once checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RdzvConf {
    /// `join_timeout`: cohort's `--join-timeout`.
    pub join_timeout: Option<f64>,
    /// `last_call_timeout`: cohort's `--last-call`.
    pub last_call_timeout: Option<f64>,
}

/// The `--rdzv-conf` keys of torchrun's c10d and static rendezvous that
/// cohort accepts without a use: they tune waits and transports cohort
/// does not have (its store is TCP, served by node 0, with no keep-alive).
const RDZV_KEYS_ACCEPTED: [&str; 8] = [
    "close_timeout",
    "read_timeout",
    "timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "is_host",
    "use_libuv",
    "store_type",
];

impl FromStr for RdzvConf {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut conf = RdzvConf::default();
        if s.trim().is_empty() {
            return Ok(conf);
        }
        for item in s.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(format!("'{s}' has an empty item: write KEY=VALUE,KEY=VALUE"));
            }
            let (key, value) = item.split_once('=').ok_or(format!("'{item}' is not KEY=VALUE"))?;
            let (key, value) = (key.trim(), value.trim());
            let secs = || seconds(value).map_err(|e| format!("{key}: {e}"));
            match key {
                "join_timeout" => conf.join_timeout = Some(secs()?),
                "last_call_timeout" => conf.last_call_timeout = Some(secs()?),
                "close_timeout" | "read_timeout" | "timeout" | "keep_alive_interval" => {
                    secs()?;
                }
                "keep_alive_max_attempt" => {
                    value.parse::<u32>().map_err(|_| format!("{key}: '{value}' is not a count"))?;
                }
                "is_host" | "use_libuv" => {
                    if !["true", "false", "1", "0", "yes", "no"].contains(&value.to_ascii_lowercase().as_str()) {
                        return Err(format!("{key}: '{value}' is not true or false"));
                    }
                }
                "store_type" if value.eq_ignore_ascii_case("tcp") => {}
                "store_type" => return Err(format!("store_type: '{value}': cohort's store is TCP only")),
                _ => {
                    return Err(format!(
                        "'{key}' is not a rendezvous setting cohort knows: join_timeout (--join-timeout), \
                         last_call_timeout (--last-call), or torchrun's {} (accepted, with no use: cohort's store is TCP, \
                         served by node 0)",
                        RDZV_KEYS_ACCEPTED.join(", ")
                    ))
                }
            }
        }
        Ok(conf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Command, Nproc, RunArgs};
    use clap::Parser;

    /// `line` read as `cohort` reads it: split at the program, then parsed.
    fn parse(line: &str) -> Result<RunArgs, String> {
        let argv = split_program(line.split_whitespace().map(OsString::from).collect())?;
        match Cli::try_parse_from(argv).map_err(|e| e.to_string())?.command {
            Command::Run(a) => Ok(*a),
            _ => unreachable!("a run line parses as run"),
        }
    }

    fn program(a: &RunArgs) -> String {
        a.program.iter().map(|p| p.to_string_lossy()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn the_program_starts_at_the_first_argument_that_is_not_an_option() {
        let a = parse("cohort run --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10").unwrap();
        assert!(a.standalone);
        assert_eq!(a.nproc_per_node, Nproc::Gpu);
        assert_eq!(program(&a), "multigpu_torchrun.py 50 10");
        // The program's own flags are its own, even cohort's spellings.
        let a = parse("cohort run -n 2 train.py --lr 1 -n 3 --standalone").unwrap();
        assert_eq!((a.nproc_per_node, a.standalone), (Nproc::Count(2), false));
        assert_eq!(program(&a), "train.py --lr 1 -n 3 --standalone");
        // `--` still separates, and is the program's after the program.
        let a = parse("cohort run -n 4 -- ./train --epochs 3 -- x").unwrap();
        assert_eq!(program(&a), "./train --epochs 3 -- x");
        // Both `--opt=value` and `--opt value`, either spelling.
        for line in [
            "cohort run --nnodes=1 --nproc-per-node=2 --rdzv_id=123 --rdzv_backend=c10d --rdzv_endpoint=h:1 p a",
            "cohort run --nnodes 1 --nproc_per_node 2 --rdzv-id 123 --rdzv-backend c10d --rdzv-endpoint h:1 p a",
        ] {
            let a = parse(line).unwrap();
            assert_eq!((a.nproc_per_node, a.rdzv_id.as_str()), (Nproc::Count(2), "123"), "{line}");
            assert_eq!(a.rdzv_backend, Some(RdzvBackend::C10d), "{line}");
            assert_eq!(a.rdzv_endpoint, Some(Endpoint { host: "h".into(), port: 1 }), "{line}");
            assert_eq!(program(&a), "p a", "{line}");
        }
        // A value that looks like an option is still the option's value.
        let a = parse("cohort run --heartbeat-timeout 0 --timeout 2 p").unwrap();
        assert_eq!((a.heartbeat_timeout, a.timeout, program(&a).as_str()), (0.0, Some(2.0), "p"));
        let err = parse("cohort run --timeout -1 p").unwrap_err();
        assert!(err.contains("invalid value '-1' for '--timeout"), "{err}");
    }

    /// An option's value that starts with '-' is read as argparse reads
    /// it: a negative number is the value (and its parser judges it), any
    /// other is an option, so the value is missing. clap's own answer was a
    /// tip to write `-- -1`, which would have made `-1` the program.
    #[test]
    fn a_value_that_starts_with_a_dash_is_judged_or_named_as_missing() {
        let err = parse("cohort run --nproc_per_node -1 p").unwrap_err();
        assert!(err.contains("invalid value '-1' for '--nproc-per-node"), "{err}");
        assert!(!err.contains("tip"), "{err}");
        let err = parse("cohort run -n -2 p").unwrap_err();
        assert!(err.contains("invalid value '-2' for '--nproc-per-node"), "{err}");
        for (line, name, next) in [
            ("cohort run --rdzv_id --bogus p", "--rdzv_id", "--bogus"),
            ("cohort run --rdzv_id --standalone p", "--rdzv_id", "--standalone"),
            ("cohort run -r -n 2 p", "-r", "-n"),
            ("cohort run --log-dir -x p", "--log-dir", "-x"),
        ] {
            let err = parse(line).unwrap_err();
            assert!(
                err.contains(&format!("{name} needs a value, but '{next}' follows it"))
                    && err.contains(&format!("{name}=VALUE")),
                "{line}: {err}"
            );
        }
        // Written with '=', a value may start with '-'.
        assert_eq!(parse("cohort run --rdzv_id=-x p").unwrap().rdzv_id, "-x");
    }

    #[test]
    fn what_follows_a_module_is_the_modules() {
        for line in ["cohort run -n 2 -m pkg.train --lr 1 -n 3", "cohort run -n 2 -m pkg.train -- --lr 1 -n 3"] {
            let a = parse(line).unwrap();
            assert_eq!((a.module.as_deref(), program(&a).as_str()), (Some("pkg.train"), "--lr 1 -n 3"), "{line}");
        }
        for line in ["cohort run --module=pkg.train x", "cohort run -mpkg.train x", "cohort run --module pkg.train x"] {
            let a = parse(line).unwrap();
            assert_eq!((a.module.as_deref(), program(&a).as_str()), (Some("pkg.train"), "x"), "{line}");
        }
        let a = parse("cohort run -m pkg.train").unwrap();
        assert!(a.program.is_empty());
        // torchrun's -m is a flag: the program it names is the module, and
        // options may come between.
        for line in [
            "cohort run -m --nproc_per_node 2 pkg.train --lr 1 -n 3",
            "cohort run --module -n 2 pkg.train --lr 1 -n 3",
            "cohort run -m -n 2 -- pkg.train --lr 1 -n 3",
        ] {
            let a = parse(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(a.nproc_per_node, Nproc::Count(2), "{line}");
            assert_eq!((a.module.as_deref(), program(&a).as_str()), (Some("pkg.train"), "--lr 1 -n 3"), "{line}");
        }
        for line in ["cohort run -m", "cohort run -m --", "cohort run -m -n 2", "cohort run -m --lr 1"] {
            let err = parse(line).unwrap_err();
            assert!(
                err.contains("-m needs the module's name: the first argument after cohort's options"),
                "{line}: {err}"
            );
        }
        assert!(parse("cohort run -m --lr 1").unwrap_err().contains("'--lr' is not an option of `cohort run`"));
    }

    #[test]
    fn tee_takes_torchruns_values_and_stays_a_flag_before_the_program() {
        let tee = |line: &str| parse(line).map(|a| (a.tee.clone(), a.redirects.clone(), program(&a)));
        let all = |n| Some(Streams::All(n));
        assert_eq!(tee("cohort run --log-dir d --tee prog 3"), Ok((all(3), None, "prog 3".into())));
        assert_eq!(tee("cohort run --log-dir d --tee -- prog"), Ok((all(3), None, "prog".into())));
        assert_eq!(tee("cohort run --tee --log-dir d prog"), Ok((all(3), None, "prog".into())));
        assert_eq!(tee("cohort run --tee 1 prog"), Ok((all(1), None, "prog".into())));
        assert_eq!(tee("cohort run -t 2 -r 3 prog"), Ok((all(2), all(3), "prog".into())));
        assert_eq!(tee("cohort run -t3 --redirects=0 prog"), Ok((all(3), all(0), "prog".into())));
        let map = Streams::PerRank([(0, 1), (1, 2)].into());
        assert_eq!(tee("cohort run --tee=0:1,1:2 prog"), Ok((Some(map.clone()), None, "prog".into())));
        assert_eq!(tee("cohort run --tee 0:1,1:2 prog"), Ok((Some(map), None, "prog".into())));
        let err = tee("cohort run --tee=4 prog").unwrap_err();
        assert!(err.contains("'4' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"), "{err}");
    }

    #[test]
    fn an_unknown_option_is_named_and_torchruns_say_what_they_do() {
        let err = parse("cohort run -n 2 --bogus 3 train.py").unwrap_err();
        assert!(err.contains("unknown option '--bogus' for `cohort run`"), "{err}");
        assert!(!err.contains("tip"), "{err}");
        let err = parse("cohort run -x train.py").unwrap_err();
        assert!(err.contains("unknown option '-x'"), "{err}");
        for name in ["--logs-specs", "--logs_specs", "--numa-binding", "--signals_to_handle", "--event-log-handler"] {
            let err = parse(&format!("cohort run {name}=x train.py")).unwrap_err();
            assert!(err.starts_with(&format!("{name} is torchrun's option that ")), "{err}");
            assert!(err.contains("cohort"), "says what cohort does instead: {err}");
        }
        let err = parse("cohort run --rdzv_backend=etcd-v2 p").unwrap_err();
        assert!(err.contains("etcd-v2 rendezvous") && err.contains("use c10d"), "{err}");
        assert!(parse("cohort run --start-method=thread p").unwrap_err().contains("'thread'"));
    }

    /// Every option of torchrun (torch/distributed/run.py), in each of its
    /// spellings, is either one of cohort's or one whose error says what it
    /// does.
    #[test]
    fn every_torchrun_option_is_known() {
        let torchrun: &[(&str, &str)] = &[
            ("--nnodes", "1:2"),
            ("--nproc-per-node", "2"),
            ("--nproc_per_node", "auto"),
            ("--rdzv-backend", "c10d"),
            ("--rdzv_backend", "static"),
            ("--rdzv-endpoint", "h:1"),
            ("--rdzv_endpoint", "h"),
            ("--rdzv-id", "x"),
            ("--rdzv_id", "x"),
            ("--rdzv-conf", "join_timeout=5"),
            ("--rdzv_conf", "is_host=true"),
            ("--standalone", ""),
            ("--max-restarts", "1"),
            ("--max_restarts", "1"),
            ("--monitor-interval", "0.1"),
            ("--monitor_interval", "5"),
            ("--start-method", "spawn"),
            ("--start_method", "forkserver"),
            ("--role", "default"),
            ("-m", ""),
            ("--module", ""),
            ("--no-python", ""),
            ("--no_python", ""),
            ("--run-path", ""),
            ("--run_path", ""),
            ("--log-dir", "d"),
            ("--log_dir", "d"),
            ("-r", "3"),
            ("--redirects", "0:3"),
            ("-t", "3"),
            ("--tee", "1:2"),
            ("--local-ranks-filter", "0"),
            ("--local_ranks_filter", "0,1"),
            ("--node-rank", "0"),
            ("--node_rank", "0"),
            ("--master-addr", "h"),
            ("--master_addr", "h"),
            ("--master-port", "1"),
            ("--master_port", "1"),
            ("--local-addr", "h"),
            ("--local_addr", "h"),
        ];
        for (name, value) in torchrun {
            let line = format!("cohort run {name} {value} prog");
            let a = parse(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
            let expected = if name.starts_with("-m") || *name == "--module" { "" } else { "prog" };
            assert_eq!(program(&a), expected, "{line}");
        }
        for (names, _) in TORCHRUN_ONLY {
            for name in *names {
                assert!(parse(&format!("cohort run {name} x prog")).unwrap_err().contains("torchrun's option"));
            }
        }
    }

    /// torchrun's argparse takes a long option's unambiguous start for it
    /// (`--nnode=1`, seen in the wild): so does `cohort run`.
    #[test]
    fn a_long_options_unambiguous_start_is_the_option() {
        let a = parse("cohort run --nnode=1 --nproc_per 2 --stand --rdzv_b c10d --max_r=3 p --nn x").unwrap();
        assert_eq!((a.nnodes.max, a.nproc_per_node, a.standalone), (1, Nproc::Count(2), true));
        assert_eq!((a.rdzv_backend, a.max_restarts, program(&a).as_str()), (Some(RdzvBackend::C10d), 3, "p --nn x"));
        let a = parse("cohort run --mod pkg.train --lr 1").unwrap();
        assert_eq!((a.module.as_deref(), program(&a).as_str()), (Some("pkg.train"), "--lr 1"));
        let err = parse("cohort run --r 3 p").unwrap_err();
        assert!(err.contains("'--r' is the start of several options") && err.contains("--redirects"), "{err}");
        assert!(err.contains("--rdzv-backend") && err.contains("--role"), "{err}");
        assert!(parse("cohort run --numa=node p").unwrap_err().contains("--numa is torchrun's option that binds"));
        assert!(parse("cohort run --bogus p").unwrap_err().contains("unknown option '--bogus'"));
    }

    /// torchrun's default of --rdzv-endpoint, --rdzv-conf and
    /// --local-ranks-filter is "": an empty value (a script's unset
    /// variable, `--rdzv_endpoint=$EP`) leaves the option unset there.
    #[test]
    fn an_empty_value_of_an_option_whose_default_is_empty_leaves_it_unset() {
        for line in [
            "cohort run --rdzv_endpoint= --local_ranks_filter= --rdzv_conf= p",
            "cohort run --rdzv-endpoint  --local-ranks-filter  --rdzv-conf  p",
        ] {
            let argv: Vec<OsString> =
                line.split(' ').map(|a| if a.is_empty() { "" } else { a }).map(OsString::from).collect();
            let argv = split_program(argv).unwrap();
            let Command::Run(a) = Cli::try_parse_from(argv).unwrap().command else { unreachable!() };
            assert_eq!((&a.rdzv_endpoint, &a.local_ranks_filter, &a.rdzv_conf), (&None, &None, &None), "{line}");
            assert_eq!(program(&a), "p");
        }
        // Others still need a value.
        assert!(parse("cohort run --master_addr= p").unwrap_err().contains("--master-addr"));
    }

    /// As under torchrun (argparse), an option given twice takes its last
    /// value (`torchrun $DEFAULTS --nproc_per_node=4 ...`).
    #[test]
    fn an_option_given_twice_takes_its_last_value() {
        let a = parse("cohort run -n 2 --nproc_per_node 3 --standalone --standalone --tee 1 -t 2 p").unwrap();
        assert_eq!((a.nproc_per_node, a.standalone, a.tee), (Nproc::Count(3), true, Some(Streams::All(2))));
        let a = parse("cohort run --local_ranks_filter=0,1 --local-ranks-filter 2 p").unwrap();
        assert_eq!(a.local_ranks_filter, Some(vec![2]));
    }

    #[test]
    fn other_subcommands_are_left_alone() {
        let argv: Vec<OsString> = ["cohort", "trace", "--bogus", "d"].map(OsString::from).to_vec();
        assert_eq!(split_program(argv.clone()), Ok(argv));
    }

    #[test]
    fn streams_values() {
        assert_eq!("3".parse::<Streams>(), Ok(Streams::All(3)));
        let map = "0:1,12:3".parse::<Streams>().unwrap();
        assert_eq!((map.of(0), map.of(12), map.of(5), map.highest_rank()), (1, 3, 0, Some(12)));
        assert!("0:1,0:2".parse::<Streams>().unwrap_err().contains("local rank 0 is named twice"));
        assert!("a:1".parse::<Streams>().unwrap_err().contains("'a' in 'a:1' is not a local rank"));
        assert!("0:1,".parse::<Streams>().unwrap_err().contains("'' is not LOCAL_RANK:STREAMS"));
        assert!("stdout".parse::<Streams>().is_err());
    }

    #[test]
    fn redirects_and_tee_choose_files_and_console_per_rank() {
        let s = |v: &str| v.parse::<Streams>().unwrap();
        let plan = |r: Option<&str>, t: Option<&str>| {
            output_plan(3, r.map(s).as_ref(), t.map(s).as_ref()).map(|p| (p.files, p.console.into_iter().collect()))
        };
        let all = vec![0, 1, 2];
        assert_eq!(plan(None, None), None, "cohort's own meaning of --log-dir holds");
        assert_eq!(plan(Some("0"), Some("0")), Some((false, all.clone())));
        assert_eq!(plan(Some("3"), None), Some((true, vec![])));
        assert_eq!(plan(None, Some("3")), Some((true, all.clone())));
        assert_eq!(plan(Some("3"), Some("3")), Some((true, all.clone())));
        // stdout to a file, stderr still on the console: shown.
        assert_eq!(plan(Some("1"), None), Some((true, all.clone())));
        assert_eq!(plan(Some("3"), Some("2")), Some((true, all)));
        // Rank 0 silenced, rank 1 only half: both files, ranks 1 and 2 shown.
        assert_eq!(plan(Some("0:3,1:1"), None), Some((true, vec![1, 2])));
        assert_eq!(plan(Some("3"), Some("2:1")), Some((true, vec![2])));
    }

    #[test]
    fn rendezvous_values() {
        let e = |s: &str| s.parse::<Endpoint>().map(|e| (e.host, e.port));
        assert_eq!(e("node0"), Ok(("node0".into(), 29400)));
        assert_eq!(e("127.0.0.1:1234"), Ok(("127.0.0.1".into(), 1234)));
        assert_eq!(e("localhost:0"), Ok(("localhost".into(), 0)));
        assert_eq!(e("[::1]:5"), Ok(("::1".into(), 5)));
        assert_eq!(e("[::1]"), Ok(("::1".into(), 29400)));
        assert_eq!(e("[fe80::1]:8080"), Ok(("fe80::1".into(), 8080)));
        // Without brackets an IPv6 address and a port cannot be told apart
        // (`::1:8080` is an address; torchrun reads it as ::1, port 8080).
        for bare in ["fe80::1", "::1:8080", "::1:29400", "::"] {
            let err = e(bare).unwrap_err();
            assert!(err.contains("in brackets") && err.contains("[::1]:29400"), "{bare}: {err}");
        }
        assert!(e("h:99999").unwrap_err().contains("'99999' in 'h:99999' is not a port number"));
        assert!(e(":29400").unwrap_err().contains("names no host"));
        assert!(e("[::1").unwrap_err().contains("no closing ']'"));

        let c = |s: &str| s.parse::<RdzvConf>();
        assert_eq!(c("join_timeout=5"), Ok(RdzvConf { join_timeout: Some(5.0), last_call_timeout: None }));
        assert_eq!(
            c("last_call_timeout=2.5, join_timeout=900,close_timeout=1,read_timeout=60,is_host=True"),
            Ok(RdzvConf { join_timeout: Some(900.0), last_call_timeout: Some(2.5) })
        );
        assert_eq!(c(""), Ok(RdzvConf::default()));
        // An empty item is refused, as torchrun refuses it.
        for bad in ["join_timeout=5,,last_call_timeout=1", "join_timeout=5,", ",", ",,="] {
            let err = c(bad).unwrap_err();
            assert!(err.contains(&format!("'{bad}' has an empty item: write KEY=VALUE,KEY=VALUE")), "{bad}: {err}");
        }
        let err = c("join_timeout=5,bogus=1").unwrap_err();
        assert!(
            err.contains("'bogus' is not a rendezvous setting cohort knows") && err.contains("join_timeout"),
            "{err}"
        );
        assert!(c("join_timeout").unwrap_err().contains("'join_timeout' is not KEY=VALUE"));
        assert!(c("join_timeout=soon").unwrap_err().contains("join_timeout: 'soon' is not a number of seconds"));
        assert!(c("is_host=maybe").unwrap_err().contains("is_host: 'maybe' is not true or false"));
        assert!(c("store_type=file").unwrap_err().contains("TCP only"));

        assert_eq!("c10d".parse::<RdzvBackend>(), Ok(RdzvBackend::C10d));
        assert_eq!("static".parse::<RdzvBackend>(), Ok(RdzvBackend::Static));
        assert!("etcd".parse::<RdzvBackend>().unwrap_err().contains("not available in cohort yet"));
        assert!("zk".parse::<RdzvBackend>().unwrap_err().contains("'zk' is not a rendezvous backend"));
    }
}
