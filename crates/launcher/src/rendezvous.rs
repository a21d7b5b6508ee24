//! How the launchers of a job meet: node 0 serves the store, every launcher
//! registers its node, and they agree on when each attempt starts and how it
//! ended.
//!
//! Keys (all under [`PREFIX`], which survives the reset between attempts):
//! - `node/<n>`: node n's launcher registered (`<nproc> <host> #<id>`,
//!   `<id>` a random id of that launcher);
//! - `node-gone/<n>/<id>`: the will of that launcher's store connection:
//!   set once it is gone (killed, or done), so that a replacement of the
//!   node may take `node/<n>` over (see [`Rendezvous::start`]);
//! - `ready/<a>`: barrier before attempt a's ranks start;
//! - `ok/<a>`: count of nodes whose ranks all succeeded in attempt a;
//! - `verdict/<a>`: the job's verdict for attempt a (see [`Verdict`]): set
//!   to `ok` by the last node to succeed, or to a failure by the first node
//!   to fail; each launcher's watcher connection leaves a will on it, so a
//!   launcher that dies unannounced fails the attempt for everyone;
//! - `left/<a>`, `all-left/<a>`: the other nodes have read the final
//!   verdict, so node 0 may stop serving;
//! - `world`: `<world size> <nodes>` of the attempt running now (for
//!   `cohort status`).
//!
//! Elastic jobs (`--nnodes MIN:MAX`) form each attempt's group anew:
//! - `members/<a>`: the node ranks that want to take part in attempt a, one
//!   line each, appended as they arrive;
//! - `closed/<a>`: the nodes of attempt a (sorted node ranks), set once by
//!   the first launcher to see MAX nodes, or MIN and the last call passed;
//!   a node's place in it is its GROUP_RANK for the attempt. A node that
//!   arrives after it closed waits for attempt a+1;
//! - `current`: the newest attempt that closed, where a late node starts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::store::{CompareSet, StoreClient, StoreError, StoreServer};
use crossbeam::channel::Sender;

use crate::config::{JobConfig, LaunchError};
use crate::summary::Verdict;
use crate::supervisor::Event;

/// Key prefix of the launchers' own keys.
pub const PREFIX: &str = "cohort/launcher/";
/// Longest the launchers wait for each other when no `--timeout` is given.
const RENDEZVOUS_LIMIT: Duration = Duration::from_secs(900);
/// How often a launcher that waits for node 0's store says so.
const WAIT_NOTICE_EVERY: Duration = Duration::from_secs(5);
/// How long node 0 keeps serving for the others to read the final verdict.
const LEAVE_LIMIT: Duration = Duration::from_secs(5);
/// How long a launcher whose node rank another launcher registered waits
/// for that launcher's connection to the store to be gone (the store may
/// learn of a launcher killed a moment ago a little later) before the node
/// rank is an error.
const TAKE_OVER_WAIT: Duration = Duration::from_secs(5);

fn key(name: &str, attempt: u32) -> String {
    format!("{PREFIX}{name}/{attempt}")
}

/// This launcher's place in the job's rendezvous.
pub struct Rendezvous {
    node_rank: u32,
    /// Nodes in the attempt running now (all of them in a fixed job).
    nnodes: AtomicU32,
    elastic: bool,
    /// The store, on node 0.
    server: Option<StoreServer>,
    /// The port the store listens on.
    port: u16,
    /// For barriers and reports.
    client: StoreClient,
    /// For the watcher thread's long waits and the will.
    watcher: Arc<StoreClient>,
    deadline: Option<Instant>,
}

impl Rendezvous {
    /// Serves the store (node 0) or finds it (other nodes), and registers this
    /// node. Waits for node 0's store up to the rendezvous limit.
    ///
    /// A node rank that another launcher registered is taken over once that
    /// launcher's connection to the store is gone (it was killed: its
    /// replacement comes back into an elastic job), waiting up to 5 s for
    /// the store to see it go; a launcher still connected keeps it, and
    /// this is an error naming it.
    pub fn start(cfg: &JobConfig, deadline: Option<Instant>) -> Result<Self, LaunchError> {
        let (server, port) = if cfg.node_rank == 0 && !cfg.external_store {
            let bind_addr = cfg.store_addr(cfg.store_port);
            let server = StoreServer::bind(bind_addr.as_str(), &cfg.secret)?;
            let port = server.local_addr().port();
            (Some(server), port)
        } else {
            (None, cfg.store_port)
        };
        let addr = cfg.store_addr(port);
        let limit = time_left(deadline);
        let client = if server.is_some() {
            StoreClient::connect(addr.as_str(), &cfg.secret, limit)?
        } else {
            connect_saying_so(&addr, &cfg.secret, limit, cfg.node_rank, WAIT_NOTICE_EVERY)?
        };
        let watcher = Arc::new(client.duplicate()?);
        let me = Rendezvous {
            node_rank: cfg.node_rank,
            nnodes: AtomicU32::new(cfg.nnodes),
            elastic: cfg.elastic,
            server,
            port,
            client,
            watcher,
            deadline,
        };
        me.register(cfg)?;
        Ok(me)
    }

    /// Registers this node as `node/<n>` (see [`Rendezvous::start`]), with
    /// a will on its connection that says when this launcher is gone.
    fn register(&self, cfg: &JobConfig) -> Result<(), LaunchError> {
        let id = &cohort_comm::store::generate_secret()?[..16];
        let entry = format!("{} {} #{id}", cfg.nproc, hostname());
        let n = cfg.node_rank;
        self.client.set_will(&format!("{PREFIX}node-gone/{n}/{id}"), b"")?;
        let node_key = format!("{PREFIX}node/{n}");
        let mut expected = None;
        loop {
            let other = match self.client.compare_set(&node_key, expected.as_deref(), entry.as_bytes())? {
                CompareSet::Swapped => return Ok(()),
                // Deleted meanwhile: register afresh.
                CompareSet::Mismatch(None) => {
                    expected = None;
                    continue;
                }
                CompareSet::Mismatch(Some(other)) => other,
            };
            let (shown, holder) = split_entry(&other);
            let taken = |why: &str| {
                LaunchError::Rendezvous(format!(
                    "node rank {n} is already taken by another launcher (with -n {shown}){why}; give each node its \
                     own --node-rank from 0 to {}",
                    cfg.nnodes - 1
                ))
            };
            let Some(holder) = holder else { return Err(taken("")) };
            let gone = format!("{PREFIX}node-gone/{n}/{holder}");
            match self.client.wait(&[&gone], TAKE_OVER_WAIT) {
                Ok(()) => {}
                Err(StoreError::WaitTimeout { .. }) => {
                    return Err(taken(&format!(", still connected to the store after {TAKE_OVER_WAIT:.0?}")))
                }
                Err(e) => return Err(e.into()),
            }
            say!("cohort: node {n}'s previous launcher (with -n {shown}) is gone; this one takes its place");
            expected = Some(other);
        }
    }

    /// This launcher's connection to the store.
    pub fn store(&self) -> &StoreClient {
        &self.client
    }

    /// The port of the store (the real one where `--master-port 0` was given).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits for every node to be ready for `attempt`, clears what ranks of
    /// the previous attempt left in the store, and starts the watcher that
    /// sends [`Event::Verdict`] once the attempt's verdict is known.
    ///
    /// In an elastic job this first forms the attempt's group (see the
    /// module docs) and returns this node's place in it; a fixed job's is
    /// always its own node rank of all nodes.
    pub fn begin(&self, cfg: &JobConfig, attempt: u32, events: Sender<Event>) -> Result<Round, LaunchError> {
        let round = if self.elastic {
            match self.join(cfg, attempt)? {
                Round::Member { position, members, attempt } => {
                    self.nnodes.store(members, Ordering::SeqCst);
                    Round::Member { position, members, attempt }
                }
                Round::JobDone => return Ok(Round::JobDone),
            }
        } else {
            Round::Member { position: cfg.node_rank, members: cfg.nnodes, attempt }
        };
        // A late node's first attempt is a later one.
        let attempt = match round {
            Round::Member { attempt, .. } => attempt,
            Round::JobDone => attempt,
        };
        let nnodes = self.nnodes();
        if nnodes > 1 || attempt > 0 {
            let limit = time_left(self.deadline);
            self.client.barrier(&key("ready", attempt), nnodes, limit).map_err(|e| match e {
                StoreError::BarrierTimeout { arrived, world_size, waited, .. } => LaunchError::Rendezvous(format!(
                    "waited {waited:.0?} for the launchers of the other nodes: {arrived} of \
                             {world_size} arrived; start `cohort run --nnodes {world_size} \
                             --node-rank <n> --master-addr {} --master-port {} --store-port {}` on every node",
                    cfg.master_addr, cfg.master_port, self.port
                )),
                e => e.into(),
            })?;
            if attempt == 0 && !self.elastic {
                self.check_nodes_agree(cfg)?;
            }
            if attempt > 0 {
                if let Some(server) = &self.server {
                    server.reset_except(PREFIX);
                }
                // Nobody starts ranks before node 0 has cleared the store.
                let limit = time_left(self.deadline);
                self.client.barrier(&key("cleared", attempt), nnodes, limit)?;
            }
        }
        if matches!(round, Round::Member { position: 0, .. }) {
            let world = format!("{} {nnodes}", cfg.nproc * nnodes as usize);
            self.client.set(&format!("{PREFIX}world"), world.as_bytes())?;
        }
        let verdict_key = key("verdict", attempt);
        let will = Verdict::Failed {
            // An elastic job goes on without the node.
            restartable: self.elastic,
            exit_code: 1,
            summary: format!(
                "the launcher of node {} went away without a word (killed?); its ranks died with it",
                self.node_rank
            ),
        };
        self.watcher.set_will(&verdict_key, &will.encode())?;
        let watcher = self.watcher.clone();
        std::thread::Builder::new()
            .name("cohort-verdict".into())
            .spawn(move || {
                let result = watch(&watcher, &verdict_key);
                let _ = events.send(Event::Verdict { attempt, result });
            })
            .map_err(|e| LaunchError::Rendezvous(format!("cannot start the watcher thread: {e}")))?;
        Ok(round)
    }

    /// Nodes in the attempt running now.
    fn nnodes(&self) -> u32 {
        self.nnodes.load(Ordering::SeqCst)
    }

    /// Joins the group of elastic attempt `attempt` (or, for a node that
    /// arrives late, of the next attempt to form): appends this node, then
    /// waits until the group closes with MAX nodes, or with MIN once the
    /// last call passed. Fails when MIN nodes do not come within
    /// `--join-timeout`; returns [`Round::JobDone`] when the job ended
    /// before this node was needed.
    fn join(&self, cfg: &JobConfig, attempt: u32) -> Result<Round, LaunchError> {
        let current = self.client.get(&format!("{PREFIX}current"))?;
        let current = current.and_then(|v| String::from_utf8_lossy(&v).parse::<u32>().ok());
        // A late node joins the attempt after the one running now.
        let mut attempt = match current {
            Some(c) if c >= attempt => c + 1,
            _ => attempt,
        };
        let me = cfg.node_rank;
        // When this attempt could first form.
        let mut start = Instant::now();
        let mut appended = None;
        loop {
            if appended != Some(attempt) {
                self.client.append(&key("members", attempt), format!("{me}\n").as_bytes())?;
                appended = Some(attempt);
            }
            let closed_key = key("closed", attempt);
            let values = self.client.multi_get(&[
                &closed_key,
                &key("members", attempt),
                &key("verdict", attempt.saturating_sub(1)),
            ])?;
            if let Some(closed) = &values[0] {
                let nodes = parse_nodes(closed);
                match nodes.iter().position(|&n| n == me) {
                    Some(p) => {
                        tracing::info!(attempt, nodes = ?nodes, "elastic attempt formed");
                        return Ok(Round::Member { position: p as u32, members: nodes.len() as u32, attempt });
                    }
                    // Closed without this node: wait for the next attempt.
                    None => {
                        attempt += 1;
                        continue;
                    }
                }
            }
            // Attempt a forms once attempt a-1 failed: until then a late
            // node only waits (however long the job runs).
            let previous = values[2].as_deref().map(Verdict::decode);
            match previous {
                Some(Verdict::Ok) if attempt > 0 => return Ok(Round::JobDone),
                None if attempt > 0 => {
                    start = Instant::now();
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                _ => {}
            }
            let mut arrived = parse_nodes(values[1].as_deref().unwrap_or_default());
            arrived.dedup();
            let waited = start.elapsed();
            let enough = arrived.len() as u32 >= cfg.min_nodes;
            let full = arrived.len() as u32 >= cfg.nnodes;
            if full || (enough && waited >= cfg.last_call) {
                arrived.truncate(cfg.nnodes as usize);
                let list: String = arrived.iter().map(|n| format!("{n}\n")).collect();
                if self.client.compare_set(&closed_key, None, list.as_bytes())?.swapped() {
                    self.client.set(&format!("{PREFIX}current"), attempt.to_string().as_bytes())?;
                }
                continue;
            }
            if !enough && waited >= cfg.join_timeout {
                return Err(LaunchError::Rendezvous(format!(
                    "waited {:.1} s (--join-timeout) for at least {} nodes (--nnodes {}:{}) to start attempt \
                     {attempt}, but only {} joined (node(s) {}); stopping",
                    waited.as_secs_f64(),
                    cfg.min_nodes,
                    cfg.min_nodes,
                    cfg.nnodes,
                    arrived.len(),
                    arrived.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reports that this node's ranks all succeeded in `attempt`; the last
    /// node to do so sets the verdict to `ok`.
    pub fn report_success(&self, attempt: u32) -> Result<(), StoreError> {
        let n = self.client.add(&key("ok", attempt), 1)?;
        if n == i64::from(self.nnodes()) {
            self.client.compare_set(&key("verdict", attempt), None, &Verdict::Ok.encode())?;
        }
        Ok(())
    }

    /// Reports that `attempt` failed here; the first failure reported becomes
    /// the job's verdict, which this returns (this one, or the one another
    /// node reported first).
    pub fn report_failure(&self, attempt: u32, verdict: &Verdict) -> Result<Verdict, StoreError> {
        match self.client.compare_set(&key("verdict", attempt), None, &verdict.encode())? {
            CompareSet::Mismatch(Some(first)) => Ok(Verdict::decode(&first)),
            _ => Ok(verdict.clone()),
        }
    }

    /// Leaves the job after its final verdict for `attempt`: other nodes say
    /// they have read it; node 0 waits (briefly) for them before it stops
    /// serving the store.
    pub fn finish(mut self, attempt: u32) {
        let _ = self.watcher.clear_will();
        let nnodes = self.nnodes();
        if nnodes == 1 && !self.elastic {
            return;
        }
        if self.node_rank != 0 {
            if let Ok(n) = self.client.add(&key("left", attempt), 1) {
                if n == i64::from(nnodes) - 1 {
                    let _ = self.client.set(&key("all-left", attempt), b"");
                }
            }
            return;
        }
        if nnodes == 1 {
            // Alone in the last attempt (an elastic job): nobody to wait for.
        } else if let Err(e) = self.client.wait(&[&key("all-left", attempt)], LEAVE_LIMIT) {
            tracing::warn!("not every node read the job's verdict before the store closed: {e}");
        }
        if let Some(mut s) = self.server.take() {
            s.shutdown();
        }
    }
}

/// This node's place in an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Node `position` of `members` (GROUP_RANK, GROUP_WORLD_SIZE) in
    /// `attempt` (later than asked for a node that came late).
    Member { position: u32, members: u32, attempt: u32 },
    /// The job ended (every rank succeeded) before this late node was needed.
    JobDone,
}

/// A `node/<n>` value as messages show it (`<nproc> <host>`), and the id
/// of the launcher that registered it (none from an older launcher).
fn split_entry(value: &[u8]) -> (String, Option<String>) {
    let text = String::from_utf8_lossy(value);
    match text.rsplit_once(" #") {
        Some((shown, id)) => (shown.to_string(), Some(id.to_string())),
        None => (text.into_owned(), None),
    }
}

/// The node ranks of a `members/<a>` or `closed/<a>` value, sorted.
fn parse_nodes(value: &[u8]) -> Vec<u32> {
    let mut nodes: Vec<u32> = String::from_utf8_lossy(value).lines().filter_map(|l| l.trim().parse().ok()).collect();
    nodes.sort_unstable();
    nodes
}

/// Blocks until `key` is set and returns its value.
fn watch(client: &StoreClient, key: &str) -> Result<Vec<u8>, String> {
    loop {
        match client.wait(&[key], Duration::from_secs(3600)) {
            Ok(()) => {}
            Err(StoreError::WaitTimeout { .. }) => continue,
            Err(e) => return Err(e.to_string()),
        }
        match client.get(key) {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// This host's name, for messages about which launcher holds a node rank.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "an unknown host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    format!("on host {}", cohort_comm::trace::printable(&String::from_utf8_lossy(&buf[..end])))
}

/// Connects to node 0's store, trying for up to `limit`, and says on
/// stderr every `every` that it still waits and for what (the store's
/// address), so that a node whose node 0 never comes up is not silent.
fn connect_saying_so(
    addr: &str,
    secret: &str,
    limit: Duration,
    node_rank: u32,
    every: Duration,
) -> Result<StoreClient, StoreError> {
    let start = Instant::now();
    loop {
        let slice = limit.saturating_sub(start.elapsed()).min(every);
        match StoreClient::connect(addr, secret, slice) {
            Ok(client) => {
                if start.elapsed() >= every {
                    say!("cohort: node {node_rank} reached node 0's store at {addr}");
                }
                return Ok(client);
            }
            Err(StoreError::Connect { source, .. }) => {
                let waited = start.elapsed();
                if waited >= limit {
                    return Err(StoreError::Connect { addr: addr.to_string(), waited, source });
                }
                say!(
                    "cohort: node {node_rank} is waiting for node 0's store at {addr} ({} s so far, giving up after \
                     {} s; last error: {source}): is node 0's launcher running, given the same --master-addr and \
                     --master-port (or --store-port, --store-addr)?",
                    waited.as_secs(),
                    limit.as_secs()
                );
            }
            Err(e) => return Err(e),
        }
    }
}

fn time_left(deadline: Option<Instant>) -> Duration {
    match deadline {
        Some(d) => d.saturating_duration_since(Instant::now()).min(RENDEZVOUS_LIMIT),
        None => RENDEZVOUS_LIMIT,
    }
}

impl Rendezvous {
    /// After the first barrier: every node must run the same number of ranks.
    fn check_nodes_agree(&self, cfg: &JobConfig) -> Result<(), LaunchError> {
        for n in 0..self.nnodes() {
            let entry = self.client.get(&format!("{PREFIX}node/{n}"))?;
            let entry = entry.map(|e| String::from_utf8_lossy(&e).into_owned());
            let nproc = entry.as_deref().and_then(|e| e.split(' ').next()?.parse::<usize>().ok());
            if nproc != Some(cfg.nproc) {
                return Err(LaunchError::Rendezvous(format!(
                    "node {n} runs {} ranks but this node (node {}) runs {}: give every node the \
                     same -n/--nproc-per-node",
                    nproc.map_or("an unknown number of".to_string(), |p| p.to_string()),
                    cfg.node_rank,
                    cfg.nproc
                )));
            }
        }
        Ok(())
    }
}
