//! Forming a communicator's links through the rendezvous store.
//!
//! Keys, under `cohort/comm/<k>/` where `k` counts the communicators this
//! rank formed (every rank forms them in the same order):
//! - `job`: rank 0's random job id (names the shared-memory files) and TCP
//!   link token;
//! - `peers`: the directory, one line per rank appended by that rank (its
//!   rank, node id, TCP listening address and local device count), and
//!   `node/<node id>/peers`, the same lines of one node's ranks; barrier
//!   `joined` opens once every rank appended to both and answers each rank
//!   its node's directory (with `job`), and rank 0 the whole directory too;
//! - `verdict`: rank 0's check of the whole directory (every rank once, all
//!   with the same device count), answered to all by barrier `checked`;
//! - `shm/<r>`: the path of rank r's shared-memory file (a fresh name when
//!   something else held the usual one), answered to its node's ranks by
//!   barrier `created/<lowest rank of the node>`;
//! - barriers `mapped` (every file is mapped: owners unlink them) and
//!   `ready`;
//! - `timings`: rank 0's start-up phases (see `timings`).
//!
//! Every step is one round trip per rank, so a communicator of thousands of
//! ranks forms without per-rank sequential reads or key scans. Each rank
//! reads its node's entries (O(ranks per node) bytes); only rank 0 reads
//! the whole directory, and a rank reads another node's rank's address only
//! when it first links to it (`examples/rendezvous_bench.rs` measures the
//! pattern).
//!
//! Ranks with the same node id (host name and boot id, plus the launcher's
//! node rank `GROUP_RANK` when set) talk through shared memory; the others
//! through TCP, connected when a collective first uses the link (`addr/<r>`
//! holds rank r's listening address when the communicator spans nodes).

use std::net::{TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::config::{self, TransportChoice};

use crate::store::StoreClient;
use crate::transport::shm::{self, Segment, ShmLink};
use crate::transport::tcp::{self, LazyTcpLink, TOKEN_LEN};
use crate::transport::Link;

use super::error::ConnectError;
use super::keys;
use super::timings;
use super::world::World;

/// One rank's entry in the store.
struct Peer {
    node: String,
    devices: usize,
}

/// This machine's identity: host name and boot id, plus `GROUP_RANK` when a
/// launcher set it (so two launchers on one host act as two nodes).
fn node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let group = std::env::var("GROUP_RANK").unwrap_or_default();
    format!("{}/{}/{}", host.trim(), boot.trim(), group.trim())
}

/// The local address this host uses to reach `store_addr` (a UDP "connect"
/// sends nothing); loopback when it cannot tell.
fn local_ip(store_addr: &str) -> String {
    let ip = UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect(store_addr).map(|_| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip().to_string());
    ip.unwrap_or_else(|_| "127.0.0.1".into())
}

fn random_hex(bytes: usize) -> Result<String, ConnectError> {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).map_err(|e| ConnectError::Setup(format!("no randomness for the job id: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// One rank's line in a communicator's directory:
/// `<rank> <node> <address> <devices>` (tab-separated).
fn directory_line(rank: usize, node: &str, addr: &str, devices: usize) -> String {
    format!("{rank}\t{node}\t{addr}\t{devices}\n")
}

/// The entries of a directory (the communicator's or a node's), by rank:
/// each rank at most once, every rank below `size`.
fn parse_entries(listing: &[u8], size: usize) -> Result<Vec<Option<Peer>>, ConnectError> {
    let text = String::from_utf8_lossy(listing);
    let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
    for line in text.lines() {
        let mut fields = line.split('\t');
        let (r, node, addr, devices) = (fields.next(), fields.next(), fields.next(), fields.next());
        let (Some(Ok(r)), Some(node), Some(_addr), Some(Ok(devices))) =
            (r.map(str::parse::<usize>), node, addr, devices.map(str::parse::<usize>))
        else {
            return Err(ConnectError::Setup(format!("malformed entry in the communicator's directory: {line:?}")));
        };
        let Some(slot) = peers.get_mut(r) else {
            return Err(ConnectError::Setup(format!(
                "rank {r} joined a communicator of {size} ranks: every rank must pass the same world size"
            )));
        };
        if slot.is_some() {
            return Err(ConnectError::Setup(format!(
                "two processes joined as rank {r}: every rank of a communicator needs its own rank"
            )));
        }
        *slot = Some(Peer { node: node.into(), devices });
    }
    Ok(peers)
}

/// Rank 0's check of the whole directory: every rank of `0..size` exactly
/// once, each with rank 0's `devices`.
fn check_directory(listing: &[u8], size: usize, devices: usize) -> Result<(), ConnectError> {
    let peers = parse_entries(listing, size)?;
    if let Some(r) = peers.iter().position(Option::is_none) {
        return Err(ConnectError::Setup(format!("rank {r} is missing from the directory")));
    }
    for (r, p) in peers.iter().enumerate() {
        let p = p.as_ref().expect("checked above");
        if p.devices != devices {
            return Err(ConnectError::Setup(format!(
                "rank {r} brings {} local devices but rank 0 brings {devices}: every rank of a communicator \
                 must pass the same number of clients",
                p.devices
            )));
        }
    }
    Ok(())
}

/// The error for a `joined` barrier that timed out: names the ranks that
/// never published their entry (read from the directory).
fn missing_ranks(store: &StoreClient, directory: &str, size: usize, waited: Duration) -> ConnectError {
    let mut seen = vec![false; size];
    if let Ok(Some(listing)) = store.get(directory) {
        for line in String::from_utf8_lossy(&listing).lines() {
            if let Some(Ok(r)) = line.split('\t').next().map(str::parse::<usize>) {
                if r < size {
                    seen[r] = true;
                }
            }
        }
    }
    let missing: Vec<String> = (0..size).filter(|&r| !seen[r]).map(|r| r.to_string()).collect();
    let shown = if missing.len() > 32 {
        format!("{} and {} more", missing[..32].join(", "), missing.len() - 32)
    } else {
        missing.join(", ")
    };
    let joined = size - missing.len();
    ConnectError::Setup(format!(
        "{joined} of {size} ranks joined within {waited:?}; still missing: rank(s) {shown} (not started, \
         crashed, or given another world size or store address)"
    ))
}

/// Forms `rank`'s links to every other rank of a world of `size` (shared
/// memory within its node now, TCP to other nodes on first use) and returns
/// the world. Waits for every rank up to `timeout`.
pub(crate) fn form(
    store: StoreClient,
    rank: usize,
    size: usize,
    devices: usize,
    timeout: Duration,
) -> Result<World, ConnectError> {
    let k = store.add(&keys::instance_counter(rank), 1)?;
    form_under(store, keys::prefix(k), rank, size, devices, timeout)
}

/// [`form`] under a given key `prefix` (a subgroup's, under its parent's),
/// over `store` (a group's is its parent's connection).
pub(crate) fn form_under(
    store: impl Into<Arc<StoreClient>>,
    prefix: String,
    rank: usize,
    size: usize,
    devices: usize,
    timeout: Duration,
) -> Result<World, ConnectError> {
    let store: Arc<StoreClient> = store.into();
    let deadline = Instant::now() + timeout;
    let key = |name: &str| keys::under(&prefix, name);
    if rank == 0 {
        let value = format!("{} {}", random_hex(8)?, random_hex(TOKEN_LEN)?);
        store.set(&key("job"), value.as_bytes())?;
    }
    let ip = local_ip(store.addr());
    let listener = TcpListener::bind((ip.as_str(), 0))
        .map_err(|e| ConnectError::Setup(format!("cannot listen for data links on {ip}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| ConnectError::Setup(e.to_string()))?;
    // Publish this rank's entry: one append to the communicator's directory
    // (read whole by rank 0 only, and by `cohort status`) and one to its
    // node's, in one round trip, then one barrier for all that answers each rank the job key
    // and its node's entries as they stood when the last rank arrived; rank
    // 0 also reads the whole directory and checks it, and a second barrier
    // answers every rank its verdict. Each rank reads O(ranks on its node)
    // bytes, whatever the world size.
    let node = node_id();
    let line = directory_line(rank, &node, &addr.to_string(), devices);
    let directory = keys::directory(&prefix);
    let node_directory = keys::node_directory(&prefix, &node);
    store.append_each(&[(&directory, line.as_bytes()), (&node_directory, line.as_bytes())])?;
    let joined = key("joined");
    let job_key = key("job");
    let left = deadline.saturating_duration_since(Instant::now());
    let mut reads = vec![job_key.as_str(), node_directory.as_str()];
    if rank == 0 {
        reads.push(directory.as_str());
    }
    let (job, node_listing, whole) = match store.barrier_get(&joined, size as u32, left, &reads) {
        Ok(values) => {
            let mut values = values.into_iter();
            (values.next().flatten(), values.next().flatten(), values.next().flatten())
        }
        Err(crate::store::StoreError::BarrierTimeout { waited, .. }) => {
            return Err(missing_ranks(&store, &directory, size, waited));
        }
        Err(e) => return Err(e.into()),
    };
    let verdict_key = keys::verdict(&prefix);
    if rank == 0 {
        let verdict = match check_directory(&whole.unwrap_or_default(), size, devices) {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        };
        store.set(&verdict_key, verdict.as_bytes())?;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let verdict = store.barrier_get(&key("checked"), size as u32, left, &[verdict_key.as_str()])?;
    let verdict = verdict.into_iter().next().flatten().unwrap_or_default();
    if !verdict.is_empty() {
        return Err(ConnectError::Setup(String::from_utf8_lossy(&verdict).into_owned()));
    }
    let joined_at = Instant::now();
    let job = String::from_utf8_lossy(&job.unwrap_or_default()).into_owned();
    let (job_id, token_hex) = job.split_once(' ').ok_or_else(|| ConnectError::Setup("malformed job entry".into()))?;
    let mut token = [0u8; TOKEN_LEN];
    for (i, t) in token.iter_mut().enumerate() {
        *t = u8::from_str_radix(token_hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16).unwrap_or(0);
    }
    let peers = parse_entries(&node_listing.unwrap_or_default(), size)?;
    let local: Vec<usize> = (0..size).filter(|&r| peers[r].as_ref().is_some_and(|p| p.node == node)).collect();
    if !local.contains(&rank) {
        return Err(ConnectError::Setup(format!("rank {rank} is missing from its node's directory")));
    }
    let mut links: Vec<Option<Box<dyn Link>>> = (0..size).map(|_| None).collect();

    // Shared memory within the node.
    if local.len() > 1 {
        let capacity = shm::ring_capacity()?;
        let me_local = local.iter().position(|&r| r == rank).expect("in its own node");
        let (mut mine, mine_path) = shm::create_for(job_id, rank, local.len(), capacity)
            .map_err(|e| ConnectError::Setup(format!("cannot create {}: {e}", shm::path(job_id, rank))))?;
        store.set(&keys::shm(&prefix, rank), mine_path.as_bytes())?;
        // One barrier per node (as `mapped` below) that answers every local
        // rank's path: its usual one, or a fresh one if that was taken.
        let shm_keys: Vec<String> = local.iter().map(|&r| keys::shm(&prefix, r)).collect();
        let refs: Vec<&str> = shm_keys.iter().map(String::as_str).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        let paths = store.barrier_get(&keys::created(&prefix, local[0]), local.len() as u32, left, &refs)?;
        let mut theirs = Vec::new();
        for (&r, published) in local.iter().zip(paths) {
            if r != rank {
                let at = String::from_utf8_lossy(&published.unwrap_or_default()).into_owned();
                if !shm::is_own_path(job_id, r, &at) {
                    return Err(ConnectError::Setup(format!(
                        "rank {r} published {at:?} as its shared memory, not a file of this job's ({})",
                        shm::path(job_id, r)
                    )));
                }
                let seg = Segment::open(&at, local.len(), capacity)
                    .map_err(|e| ConnectError::Setup(format!("cannot map rank {r}'s shared memory: {e}")))?;
                theirs.push((r, Arc::new(seg)));
            }
        }
        // One barrier per node (named by its lowest rank): with one name for
        // the job, the first `local.len()` arrivals from any nodes would open
        // it, and a segment could be unlinked before its node's ranks mapped it.
        let mapped = keys::mapped(&prefix, local[0]);
        store.barrier(&mapped, local.len() as u32, deadline.saturating_duration_since(Instant::now()))?;
        mine.unlink();
        let mine = Arc::new(mine);
        for (r, seg) in theirs {
            let peer_local = local.iter().position(|&x| x == r).expect("local");
            links[r] = Some(Box::new(ShmLink::new(&mine, &seg, me_local, peer_local)));
        }
    }

    // TCP to the other nodes, formed when a collective first uses a link:
    // the higher rank of two connects (reading the lower one's address from
    // the store then), the lower one's background acceptor files the
    // connection by rank. Set-up opens no socket to another node.
    let remote: Vec<usize> = (0..size).filter(|r| !local.contains(r)).collect();
    if !remote.is_empty() {
        store.set(&keys::link_addr(&prefix, rank), addr.to_string().as_bytes())?;
        let higher: Vec<usize> = remote.iter().copied().filter(|&r| r > rank).collect();
        let acceptor = match higher.is_empty() {
            true => None,
            false => Some(
                tcp::LinkAcceptor::start(listener, token, higher)
                    .map_err(|e| ConnectError::Setup(format!("cannot accept data connections: {e}")))?,
            ),
        };
        for &r in &remote {
            let link = match &acceptor {
                Some(acceptor) if r > rank => LazyTcpLink::accept(rank, r, acceptor.clone()),
                _ => {
                    let (store, key) = (store.clone(), keys::link_addr(&prefix, r));
                    LazyTcpLink::dial(rank, r, token, move || {
                        let value = store.get(&key).map_err(std::io::Error::other)?;
                        Ok(value.map(|v| String::from_utf8_lossy(&v).into_owned()))
                    })
                }
            };
            links[r] = Some(Box::new(link));
        }
    }
    store.barrier(&key("ready"), size as u32, deadline.saturating_duration_since(Instant::now()))?;
    // The start-up phases the launcher reports (`cohort run --timings`).
    timings::passed(&store, &prefix, rank, "joined", joined_at);
    timings::passed(&store, &prefix, rank, "links", Instant::now());
    // Every rank is in: none needs the job's secret file any more.
    super::env::remove_secret_file();
    tracing::debug!(rank, size, local = local.len(), remote = remote.len(), "communicator links formed");
    Ok(World::new(rank, size, links, store, prefix, timeout))
}

/// Forms `rank`'s world over links made elsewhere (MPI's): registers in the
/// store as [`form`] does (instance, local device count) and waits for every
/// rank, up to `timeout`.
#[cfg(feature = "mpi")]
pub(crate) fn form_with_links(
    store: StoreClient,
    rank: usize,
    size: usize,
    devices: usize,
    timeout: Duration,
    links: Vec<Option<Box<dyn Link>>>,
) -> Result<World, ConnectError> {
    let deadline = Instant::now() + timeout;
    let k = store.add(&keys::instance_counter(rank), 1)?;
    let prefix = keys::prefix(k);
    store.set(&keys::peer(&prefix, rank), devices.to_string().as_bytes())?;
    let peer_keys: Vec<String> = (0..size).map(|r| keys::peer(&prefix, r)).collect();
    let refs: Vec<&str> = peer_keys.iter().map(String::as_str).collect();
    store.wait(&refs, deadline.saturating_duration_since(Instant::now()))?;
    for (r, value) in store.multi_get(&refs)?.into_iter().enumerate() {
        let theirs = String::from_utf8_lossy(&value.unwrap_or_default()).parse::<usize>().ok();
        if theirs != Some(devices) {
            return Err(ConnectError::Setup(format!(
                "rank {r} brings {theirs:?} local devices but rank {rank} brings {devices}: every rank of a \
                 communicator must pass the same number of clients"
            )));
        }
    }
    store.barrier(&keys::under(&prefix, "ready"), size as u32, deadline.saturating_duration_since(Instant::now()))?;
    tracing::debug!(rank, size, "communicator links formed over MPI");
    Ok(World::new(rank, size, links, store, prefix, timeout))
}

/// Whether [`Communicator::from_env`](super::Communicator::from_env) takes
/// MPI: `COHORT_TRANSPORT=mpi` says yes, `host` (or `shm`, `tcp`) says no,
/// and unset (or `auto`) means yes under `mpirun` (`OMPI_COMM_WORLD_RANK`)
/// when the `mpi` feature is built.
pub(crate) fn mpi_wanted() -> Result<bool, ConnectError> {
    match config::TRANSPORT.get()? {
        TransportChoice::Mpi if cfg!(feature = "mpi") => Ok(true),
        TransportChoice::Mpi => Err(ConnectError::Config(
            "COHORT_TRANSPORT=mpi, but cohort-comm was built without its `mpi` feature: build with \
             `--features cohort-comm/mpi` (Open MPI or MPICH and libclang installed) or unset COHORT_TRANSPORT"
                .into(),
        )),
        TransportChoice::Auto => Ok(cfg!(feature = "mpi") && std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()),
        TransportChoice::Host => Ok(false),
    }
}
