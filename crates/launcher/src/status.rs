//! `cohort status`: where every rank of a running (or hung) job is, read
//! from the job's rendezvous store in a few round trips.
//!
//! For each rank: its state, the collective it is in (sequence number,
//! kind, bytes, communicator) and for how long, its last heartbeat, and
//! which ranks the others wait for: the ranks behind the furthest call (not
//! yet in it), the ones whose heartbeat stopped (stopped, hung in the
//! kernel) and the ones that left. It reads only what the ranks publish
//! anyway (their heartbeat and progress, written by a thread of their own),
//! so asking costs a running job nothing.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::time::{Duration, Instant};

use cohort_comm::launch_env::MAX_WORLD_SIZE;
use cohort_comm::published::{
    abort_key, call_key, communicator_prefix, directory_key, gone_key, newest_communicator_key, parse_progress,
    progress_key, CurrentCall,
};
use cohort_comm::store::{StoreClient, StoreError};
use cohort_comm::trace::printable;
use cohort_comm::{job_heartbeat_key, HEARTBEAT_PERIOD};
use cohort_runtime::config;
use serde::Serialize;

use crate::cli::StatusArgs;
use crate::rendezvous::PREFIX;
use crate::run_file;

/// Nodes looked up in one request (`cohort/launcher/node/<n>`), and at most.
const NODE_BATCH: usize = 64;
const MAX_NODES: usize = 1 << 16;
/// Ranks whose entries are read in one request.
const RANK_BATCH: usize = 1024;

/// A heartbeat older than this many periods counts as stopped.
const SILENT_PERIODS: u32 = 3;

/// One rank, as `cohort status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RankStatus {
    pub rank: usize,
    /// `in-collective`, `idle`, `silent`, `gone`, `not-joined` or `no-communicator`.
    pub state: String,
    /// The process id from its heartbeat.
    pub pid: Option<u32>,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_s: Option<f64>,
    /// Sequence numbers of the last collective it called and finished.
    pub issued: Option<u64>,
    pub finished: Option<u64>,
    /// The collective it is in now (or last called).
    pub call: Option<CallStatus>,
    /// Why it left (its `gone` entry).
    pub gone: Option<String>,
    /// The ranks this one waits for (empty unless it is in a collective).
    pub waiting_for: Vec<usize>,
}

/// A collective a rank called.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CallStatus {
    pub seq: u64,
    pub kind: String,
    pub bytes: u64,
    /// The communicator (`comm<k>`).
    pub group: String,
    /// Seconds since it was called.
    pub for_s: f64,
}

/// The whole job.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JobStatus {
    pub store: String,
    pub world_size: usize,
    pub nodes: usize,
    /// The newest communicator rank 0 formed (`comm<k>`).
    pub communicator: Option<String>,
    /// The first failure reported in it.
    pub abort: Option<String>,
    /// Ranks every other waits for (behind, silent or gone while others are
    /// in a collective).
    pub stuck_on: Vec<usize>,
    pub ranks: Vec<RankStatus>,
    /// The first rank not shown: from it on, a batch of ranks of which
    /// fewer than half had anything in the store (not started yet, or a
    /// `world` entry that claims more ranks than the job has), so the rest
    /// was not read.
    pub not_shown_from: Option<usize>,
    /// Milliseconds the store took to answer.
    pub answered_in_ms: f64,
}

/// Runs `cohort status`; returns its exit code.
pub fn status(args: StatusArgs) -> std::process::ExitCode {
    let (addr, secret) = match target(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cohort status: error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let store = match StoreClient::connect(addr.as_str(), &secret, Duration::from_secs_f64(args.connect_timeout)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cohort status: error: cannot reach the job's store at {addr}: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    loop {
        let shown = match collect(&store) {
            Ok(job) if args.json => match serde_json::to_string_pretty(&job) {
                Ok(text) => format!("{text}\n"),
                Err(e) => {
                    eprintln!("cohort status: error: {e}");
                    return std::process::ExitCode::from(1);
                }
            },
            // Clear the screen and home the cursor between reports.
            Ok(job) if args.watch.is_some() => format!("\x1b[2J\x1b[H{}", render(&job)),
            Ok(job) => render(&job),
            Err(e) => {
                eprintln!("cohort status: error: {e}");
                return std::process::ExitCode::from(1);
            }
        };
        // A closed pipe (`| head`) ends it quietly.
        let mut out = std::io::stdout().lock();
        if out.write_all(shown.as_bytes()).and_then(|()| out.flush()).is_err() {
            return std::process::ExitCode::SUCCESS;
        }
        drop(out);
        match args.watch {
            Some(period) => std::thread::sleep(Duration::from_secs_f64(period)),
            None => return std::process::ExitCode::SUCCESS,
        }
    }
}

/// The store address and secret: flags first, then the job's environment,
/// then the run files of this user's jobs on this machine (the newest job;
/// the others are listed on stderr with the line that shows each).
fn target(args: &StatusArgs) -> Result<(String, String), String> {
    let addr = match &args.store_addr {
        Some(a) => Some(a.clone()),
        None => config::STORE_ADDR.get().map_err(|e| e.to_string())?,
    };
    let (addr, found) = match addr {
        Some(a) => (a, None),
        None => {
            let job = running_job()?;
            (job.addr.clone(), Some(job))
        }
    };
    let secret = match (&args.secret_file, found) {
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the secret from {}: {e}", path.display()))?
            .trim()
            .to_string(),
        (None, Some(job)) => job.secret,
        (None, None) => config::JOB_SECRET
            .get()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no job secret: pass --secret-file PATH or set {}", config::JOB_SECRET.name))?,
    };
    if secret.is_empty() {
        return Err("the job secret is empty".into());
    }
    Ok((addr, secret))
}

/// The newest job of this user's that runs on this machine (its run files,
/// see [`run_file`]); an error saying how to name a store when none runs.
fn running_job() -> Result<run_file::Job, String> {
    let no_address = format!("no store address: pass --store-addr HOST:PORT or set {}", config::STORE_ADDR.name);
    let jobs =
        run_file::live().map_err(|e| format!("{no_address} (cannot look for jobs of yours on this machine: {e})"))?;
    let Some((newest, others)) = jobs.split_first() else {
        return Err(format!(
            "{no_address} (no `cohort run` of yours runs on this machine: none in {})",
            run_file::folder().display()
        ));
    };
    if !others.is_empty() {
        eprintln!(
            "cohort status: {} jobs of yours run on this machine; showing the newest (launcher pid {}, store {}). \
             The others:",
            jobs.len(),
            newest.pid,
            newest.addr
        );
        for job in others {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            eprintln!(
                "  launcher pid {} (started {} s ago): {}",
                job.pid,
                now.saturating_sub(job.since),
                run_file::status_line(&job.addr, &job.secret_file)
            );
        }
    }
    Ok(newest.clone())
}

fn text(v: &Option<Vec<u8>>) -> Option<String> {
    v.as_ref().map(|b| String::from_utf8_lossy(b).into_owned())
}

/// What a rank or another program wrote, safe to show on a terminal (and
/// to hand to scripts): control characters escaped (see
/// [`cohort_comm::trace::printable`]).
fn shown(v: &Option<Vec<u8>>) -> Option<String> {
    v.as_ref().map(|b| printable(&String::from_utf8_lossy(b)).into_owned())
}

fn now_ms() -> u64 {
    cohort_comm::trace::now_micros() / 1000
}

/// Why `cohort status` could not show the job.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An entry no launcher writes (another program's, or garbage).
    #[error(
        "the store's {key} holds \"{value}\", {why}: not what `cohort run` writes (is this a cohort job's store? \
         something else wrote there)"
    )]
    Bogus { key: String, value: String, why: String },
}

/// The job's size from the launchers' `world` entry (`<ranks> <nodes>`):
/// an error naming the value unless it is a size a job can have (at most
/// [`MAX_WORLD_SIZE`] ranks on at most [`MAX_NODES`] nodes, each with at
/// least one).
fn parse_world(value: &[u8]) -> Result<(usize, usize), StatusError> {
    let text = String::from_utf8_lossy(value);
    let bogus = |why: String| {
        let all = printable(&text);
        let mut value: String = all.chars().take(80).collect();
        if value.len() < all.len() {
            value.push('…');
        }
        StatusError::Bogus { key: format!("{PREFIX}world"), value, why }
    };
    let numbers: Vec<&str> = text.split_whitespace().collect();
    let [ranks, nodes] = numbers[..] else { return Err(bogus("which is not `<ranks> <nodes>`".into())) };
    let (Ok(ranks), Ok(nodes)) = (ranks.parse::<u64>(), nodes.parse::<u64>()) else {
        return Err(bogus("whose counts are not whole numbers".into()));
    };
    if ranks == 0 || ranks > MAX_WORLD_SIZE as u64 {
        return Err(bogus(format!("{ranks} ranks, where a job has 1 to {MAX_WORLD_SIZE}")));
    }
    if nodes == 0 || nodes > ranks || nodes > MAX_NODES as u64 {
        return Err(bogus(format!(
            "{nodes} nodes for {ranks} ranks (a job has 1 to {MAX_NODES} nodes, each with a rank)"
        )));
    }
    Ok((ranks as usize, nodes as usize))
}

/// The values of `keys` (`None` where not set), in order: one multi-get,
/// or one get per key when the store refuses to answer them together (too
/// large for one answer, where each alone fits).
fn values(store: &StoreClient, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.multi_get(&refs) {
        Err(StoreError::Refused { .. }) => refs.iter().map(|k| store.get(k)).collect(),
        answered => answered,
    }
}

/// Reads the job's state: a round trip to find the world and the newest
/// communicator (more with over 64 nodes), one for its directory and abort,
/// and one per [`RANK_BATCH`] ranks for their entries. A world that claims
/// more ranks than wrote anything is read only up to the first batch of
/// ranks of which fewer than half did (see [`JobStatus::not_shown_from`]),
/// so what this holds is bounded by what the store holds (at most two ranks
/// shown per rank that wrote, beside the first batch), whatever the `world`
/// entry says.
pub fn collect(store: &StoreClient) -> Result<JobStatus, StatusError> {
    let started = Instant::now();
    // The launchers' nodes (`<nproc> <host>`), a batch at a time until one
    // is missing, and rank 0's newest communicator with the first batch.
    let mut nodes: Vec<usize> = Vec::new();
    let mut newest = None;
    let mut world_entry = None;
    while nodes.len() < MAX_NODES {
        let from = nodes.len();
        let mut keys: Vec<String> = (from..from + NODE_BATCH).map(|n| format!("{PREFIX}node/{n}")).collect();
        if from == 0 {
            keys.push(newest_communicator_key(0));
            keys.push(format!("{PREFIX}world"));
        }
        let mut batch = values(store, &keys)?;
        if from == 0 {
            // The attempt running now (an elastic job's nodes change).
            world_entry = batch.pop().flatten();
            newest = text(&batch.pop().flatten()).and_then(|k| k.trim().parse::<u64>().ok());
        }
        nodes.extend(batch.iter().map_while(|v| text(v).and_then(|e| e.split(' ').next()?.parse::<usize>().ok())));
        if nodes.len() < from + NODE_BATCH {
            break;
        }
    }
    let prefix = newest.map(communicator_prefix);
    let (directory, abort) = match &prefix {
        Some(p) => {
            let mut v = values(store, &[directory_key(p), abort_key(p)])?.into_iter();
            (v.next().flatten(), shown(&v.next().flatten()))
        }
        None => (None, None),
    };
    let joined: HashSet<usize> = text(&directory)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split('\t').next()?.parse().ok())
        .filter(|&r| r < MAX_WORLD_SIZE)
        .collect();
    let (world_size, node_count) = match world_entry {
        Some(w) => parse_world(&w)?,
        None if nodes.is_empty() => (joined.iter().max().map_or(0, |r| r + 1), 0),
        None => {
            let sum = nodes.iter().try_fold(0usize, |a, &n| a.checked_add(n)).filter(|&s| s <= MAX_WORLD_SIZE);
            let sum = sum.ok_or_else(|| StatusError::Bogus {
                key: format!("{PREFIX}node/<n>"),
                value: nodes.iter().map(usize::to_string).collect::<Vec<_>>().join(" + "),
                why: format!("more than a job's {MAX_WORLD_SIZE} ranks in all"),
            })?;
            (sum, nodes.len())
        }
    };

    // Every rank's heartbeat, progress, current call and `gone`, a batch of
    // ranks at a time.
    let group = newest.map(|k| format!("comm{k}"));
    let mut ranks = Vec::new();
    let mut not_shown_from = None;
    for first in (0..world_size).step_by(RANK_BATCH) {
        let batch = first..(first + RANK_BATCH).min(world_size);
        let mut keys = Vec::with_capacity(4 * batch.len());
        for r in batch.clone() {
            keys.push(job_heartbeat_key(r));
            if let Some(p) = &prefix {
                keys.extend([progress_key(p, r), call_key(p, r), gone_key(p, r)]);
            }
        }
        let answered = values(store, &keys)?;
        let per_rank = keys.len() / batch.len();
        let wrote = answered.chunks(per_rank).filter(|entries| entries.iter().any(Option::is_some)).count();
        if first > 0 && wrote * 2 < batch.len() {
            not_shown_from = Some(first);
            break;
        }
        let now = now_ms();
        let mut answered = answered.into_iter();
        for r in batch {
            ranks.push(rank_status(r, &mut answered, prefix.is_some(), &joined, now, &group));
        }
    }
    let answered_in_ms = started.elapsed().as_secs_f64() * 1e3;
    let stuck_on = waited_for(&mut ranks);
    Ok(JobStatus {
        store: store.addr().to_string(),
        world_size,
        nodes: node_count,
        communicator: group,
        abort,
        stuck_on,
        ranks,
        not_shown_from,
        answered_in_ms,
    })
}

/// Rank `r` from its entries, next in `values`: its heartbeat, then (when
/// there is a communicator) its progress, current call and `gone`.
fn rank_status(
    r: usize,
    values: &mut impl Iterator<Item = Option<Vec<u8>>>,
    communicator: bool,
    joined: &HashSet<usize>,
    now: u64,
    group: &Option<String>,
) -> RankStatus {
    let beat = text(&values.next().flatten());
    let mut fields = beat.as_deref().unwrap_or("").split(' ');
    let pid = fields.next().and_then(|p| p.parse().ok());
    let beat_ms = fields.nth(1).and_then(|t| t.parse::<u64>().ok());
    let heartbeat_age_s = beat_ms.map(|t| now.saturating_sub(t) as f64 / 1e3);
    let (progress, call, gone) = if communicator {
        let progress = values.next().flatten().and_then(|v| parse_progress(&v));
        let call = values.next().flatten().and_then(|v| CurrentCall::parse(&v));
        (progress, call, shown(&values.next().flatten()))
    } else {
        (None, None, None)
    };
    let silent = heartbeat_age_s.is_some_and(|a| a > (HEARTBEAT_PERIOD * SILENT_PERIODS).as_secs_f64());
    let in_call = progress.is_some_and(|(issued, finished)| issued > finished);
    let state = if gone.is_some() {
        "gone"
    } else if silent {
        "silent"
    } else if !communicator {
        "no-communicator"
    } else if !joined.contains(&r) {
        "not-joined"
    } else if in_call {
        "in-collective"
    } else {
        "idle"
    };
    let call = call.filter(|c| progress.is_some_and(|(issued, _)| issued == c.seq)).map(|c| CallStatus {
        for_s: now.saturating_sub(c.since_ms) as f64 / 1e3,
        seq: c.seq,
        kind: printable(&c.kind).into_owned(),
        bytes: c.bytes,
        group: group.clone().unwrap_or_default(),
    });
    RankStatus {
        rank: r,
        state: state.into(),
        pid,
        heartbeat_age_s,
        issued: progress.map(|p| p.0),
        finished: progress.map(|p| p.1),
        call,
        gone,
        waiting_for: Vec::new(),
    }
}

/// Fills each waiting rank's `waiting_for` and returns the ranks the job
/// waits on: while some ranks are in collective S, the ranks that have not
/// called S yet, and the ones that went silent or left.
fn waited_for(ranks: &mut [RankStatus]) -> Vec<usize> {
    let Some(furthest) = ranks.iter().filter(|r| r.state == "in-collective").filter_map(|r| r.issued).max() else {
        return Vec::new();
    };
    let culprits: Vec<usize> = ranks
        .iter()
        .filter(|r| {
            r.issued.is_none_or(|i| i < furthest) || r.state == "silent" || r.state == "gone" || r.state == "not-joined"
        })
        .map(|r| r.rank)
        .collect();
    for r in ranks.iter_mut() {
        if r.state == "in-collective" {
            r.waiting_for = culprits.iter().copied().filter(|&c| c != r.rank).collect();
        }
    }
    culprits
}

fn ranks_list(ranks: &[usize]) -> String {
    // Ranges: 0-3, 5, 7-9.
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if i == j { ranks[i].to_string() } else { format!("{}-{}", ranks[i], ranks[j]) });
        i = j + 1;
    }
    out.join(", ")
}

/// The human-readable report.
pub fn render(job: &JobStatus) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "job at {}: {} ranks on {} node(s), communicator {} (store answered in {:.1} ms)\n",
        job.store,
        job.world_size,
        job.nodes,
        job.communicator.as_deref().unwrap_or("not formed yet"),
        job.answered_in_ms
    ));
    if let Some(a) = &job.abort {
        out.push_str(&format!("aborted: {a}\n"));
    }
    out.push_str(&format!(
        "{:>5}  {:<15} {:>8} {:>9}  {}\n",
        "rank", "state", "pid", "heartbeat", "collective (seq kind bytes, for)"
    ));
    for r in &job.ranks {
        let beat = r.heartbeat_age_s.map_or("-".to_string(), |a| format!("{a:.1}s ago"));
        let call = match (&r.call, r.state.as_str()) {
            (Some(c), "in-collective") if r.issued > r.finished => {
                format!("#{} {} {} B in {}, for {:.1}s", c.seq, c.kind, c.bytes, c.group, c.for_s)
            }
            (Some(c), "silent") if r.issued > r.finished => {
                format!("last reported: #{} {} {} B in {}, {:.1}s ago", c.seq, c.kind, c.bytes, c.group, c.for_s)
            }
            _ => r.finished.map_or(String::new(), |f| format!("finished #{f}")),
        };
        let gone = r.gone.as_deref().map_or(String::new(), |g| format!(" (left: {g})"));
        out.push_str(&format!(
            "{:>5}  {:<15} {:>8} {:>9}  {call}{gone}\n",
            r.rank,
            r.state,
            r.pid.map_or("-".into(), |p| p.to_string()),
            beat
        ));
    }
    if let Some(from) = job.not_shown_from {
        out.push_str(&format!(
            "ranks {from}-{} not shown: fewer than half of ranks {from}-{} have written anything to the store (not \
             started yet, or the store's world entry claims more ranks than there are)\n",
            job.world_size - 1,
            (from + RANK_BATCH).min(job.world_size) - 1
        ));
    }
    if job.stuck_on.is_empty() {
        out.push_str("no rank is waiting for another\n");
    } else {
        let mut waiting: BTreeMap<usize, usize> = BTreeMap::new();
        for r in &job.ranks {
            if !r.waiting_for.is_empty() {
                *waiting.entry(r.issued.unwrap_or(0) as usize).or_default() += 1;
            }
        }
        let culprits: Vec<String> = job
            .stuck_on
            .iter()
            .map(|&c| {
                let r = &job.ranks[c];
                let at = r.finished.map_or("nothing finished".to_string(), |f| format!("finished #{f}"));
                format!("rank {c} ({}, {at})", r.state)
            })
            .collect();
        let (seq, n) = waiting.iter().next_back().map(|(s, n)| (*s, *n)).unwrap_or((0, 0));
        out.push_str(&format!(
            "{n} rank(s) wait in #{seq} for {}: {}\n",
            ranks_list(&job.stuck_on),
            culprits.join("; ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: usize, state: &str, issued: u64, finished: u64) -> RankStatus {
        RankStatus {
            rank: r,
            state: state.into(),
            pid: Some(100 + r as u32),
            heartbeat_age_s: Some(0.2),
            issued: Some(issued),
            finished: Some(finished),
            call: None,
            gone: None,
            waiting_for: vec![],
        }
    }

    #[test]
    fn ranks_behind_the_furthest_call_are_the_ones_waited_for() {
        let mut ranks =
            vec![rank(0, "in-collective", 21, 20), rank(1, "in-collective", 21, 20), rank(2, "silent", 20, 20)];
        assert_eq!(waited_for(&mut ranks), vec![2]);
        assert_eq!(ranks[0].waiting_for, vec![2]);
        assert!(ranks[2].waiting_for.is_empty());
        // Nobody in a collective: nobody waits.
        let mut idle = vec![rank(0, "idle", 5, 5), rank(1, "idle", 4, 4)];
        assert!(waited_for(&mut idle).is_empty());
        assert_eq!(ranks_list(&[0, 1, 2, 3, 5, 7, 8]), "0-3, 5, 7-8");
    }
}
