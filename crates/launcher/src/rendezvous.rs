//! How the launchers of a job meet: node 0 serves the store, every launcher
//! registers its node, and they agree on when each attempt starts and how it
//! ended.
//!
//! Keys (all under [`PREFIX`], which survives the reset between attempts):
//! - `node/<n>`: node n's launcher registered (`<nproc> <host>`);
//! - `ready/<a>`: barrier before attempt a's ranks start;
//! - `ok/<a>`: count of nodes whose ranks all succeeded in attempt a;
//! - `verdict/<a>`: the job's verdict for attempt a (see [`Verdict`]): set
//!   to `ok` by the last node to succeed, or to a failure by the first node
//!   to fail; each launcher's watcher connection leaves a will on it, so a
//!   launcher that dies unannounced fails the attempt for everyone;
//! - `left/<a>`, `all-left/<a>`: the other nodes have read the final
//!   verdict, so node 0 may stop serving.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::store::{StoreClient, StoreError, StoreServer};
use crossbeam::channel::Sender;

use crate::config::{JobConfig, LaunchError};
use crate::summary::Verdict;
use crate::supervisor::Event;

/// Key prefix of the launchers' own keys.
pub const PREFIX: &str = "cohort/launcher/";
/// Longest the launchers wait for each other when no `--timeout` is given.
const RENDEZVOUS_LIMIT: Duration = Duration::from_secs(900);
/// How long node 0 keeps serving for the others to read the final verdict.
const LEAVE_LIMIT: Duration = Duration::from_secs(5);

fn key(name: &str, attempt: u32) -> String {
    format!("{PREFIX}{name}/{attempt}")
}

/// This launcher's place in the job's rendezvous.
pub struct Rendezvous {
    node_rank: u32,
    nnodes: u32,
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
        let client = StoreClient::connect(addr.as_str(), &cfg.secret, limit)?;
        let watcher = Arc::new(client.duplicate()?);
        let me = Rendezvous { node_rank: cfg.node_rank, nnodes: cfg.nnodes, server, port, client, watcher, deadline };
        let entry = format!("{} {}", cfg.nproc, hostname());
        let node_key = format!("{PREFIX}node/{}", cfg.node_rank);
        if let cohort_comm::store::CompareSet::Mismatch(Some(other)) =
            me.client.compare_set(&node_key, None, entry.as_bytes())?
        {
            return Err(LaunchError::Rendezvous(format!(
                "node rank {} is already taken by another launcher (with -n {}); give each node \
                 its own --node-rank from 0 to {}",
                cfg.node_rank,
                String::from_utf8_lossy(&other),
                cfg.nnodes - 1
            )));
        }
        Ok(me)
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
    pub fn begin(&self, cfg: &JobConfig, attempt: u32, events: Sender<Event>) -> Result<(), LaunchError> {
        if self.nnodes > 1 || attempt > 0 {
            let limit = time_left(self.deadline);
            self.client.barrier(&key("ready", attempt), self.nnodes, limit).map_err(|e| match e {
                StoreError::BarrierTimeout { arrived, world_size, waited, .. } => LaunchError::Rendezvous(format!(
                    "waited {waited:.0?} for the launchers of the other nodes: {arrived} of \
                             {world_size} arrived; start `cohort run --nnodes {world_size} \
                             --node-rank <n> --master-addr {} --master-port {} --store-port {}` on every node",
                    cfg.master_addr, cfg.master_port, self.port
                )),
                e => e.into(),
            })?;
            if attempt == 0 {
                self.check_nodes_agree(cfg)?;
            }
            if attempt > 0 {
                if let Some(server) = &self.server {
                    server.reset_except(PREFIX);
                }
                // Nobody starts ranks before node 0 has cleared the store.
                let limit = time_left(self.deadline);
                self.client.barrier(&key("cleared", attempt), self.nnodes, limit)?;
            }
        }
        let verdict_key = key("verdict", attempt);
        let will = Verdict::Failed {
            restartable: false,
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
        Ok(())
    }

    /// Reports that this node's ranks all succeeded in `attempt`; the last
    /// node to do so sets the verdict to `ok`.
    pub fn report_success(&self, attempt: u32) -> Result<(), StoreError> {
        let n = self.client.add(&key("ok", attempt), 1)?;
        if n == i64::from(self.nnodes) {
            self.client.compare_set(&key("verdict", attempt), None, &Verdict::Ok.encode())?;
        }
        Ok(())
    }

    /// Reports that `attempt` failed here; the first failure reported becomes
    /// the job's verdict.
    pub fn report_failure(&self, attempt: u32, verdict: &Verdict) -> Result<(), StoreError> {
        self.client.compare_set(&key("verdict", attempt), None, &verdict.encode())?;
        Ok(())
    }

    /// Leaves the job after its final verdict for `attempt`: other nodes say
    /// they have read it; node 0 waits (briefly) for them before it stops
    /// serving the store.
    pub fn finish(mut self, attempt: u32) {
        let _ = self.watcher.clear_will();
        if self.nnodes == 1 {
            return;
        }
        if self.node_rank != 0 {
            if let Ok(n) = self.client.add(&key("left", attempt), 1) {
                if n == i64::from(self.nnodes) - 1 {
                    let _ = self.client.set(&key("all-left", attempt), b"");
                }
            }
            return;
        }
        if let Err(e) = self.client.wait(&[&key("all-left", attempt)], LEAVE_LIMIT) {
            tracing::warn!("not every node read the job's verdict before the store closed: {e}");
        }
        if let Some(mut s) = self.server.take() {
            s.shutdown();
        }
    }
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
    format!("on host {}", String::from_utf8_lossy(&buf[..end]))
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
        for n in 0..self.nnodes {
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
