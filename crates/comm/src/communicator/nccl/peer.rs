//! The peer-memory fast path of a Communicator on NCCL: with one CUDA
//! device per rank, 2 to 8 ranks on one host, small all-reduces and
//! all-gathers run as cohort's peer kernels (see `crate::device::peer`)
//! instead of NCCL calls.
//!
//! Set-up, at connect time through the store, after the NCCL set-up: every
//! rank writes `nccl/peer/arena/<r>`: `ok <pid> <host> <address> <handle>`
//! (its arena's address in its process and its CUDA IPC handle, both hex)
//! or `no <why>`; rank 0 first writes `nccl/peer/choice`, its `COHORT_ALGO`
//! and crossover sizes, which every rank follows (so every rank takes the
//! same path for every call whatever its own environment says), and which
//! every rank reads before making an arena (none when the choice is NCCL).
//! The path is on only where `COHORT_ALGO` forces it (`oneshot` or
//! `twoshot` on rank 0): by default a Communicator runs on NCCL. A rank
//! then opens every other rank's arena (the address itself for a rank of
//! its own process, the IPC handle for one of its host) and writes
//! `nccl/peer/ready/<r>`; the path is on only if every rank is ready.

use std::time::Instant;

use cohort_runtime::backend::PEER_MAX_RANKS;
use cohort_runtime::Client;

use crate::device::ask;
use crate::device::peer::{algo_from_env, choose_with, machine_table, Algo, Crossover, CrossoverRow, Path, TableKind};
use crate::op::Op;
use crate::store::StoreClient;

use super::super::error::ConnectError;
use super::super::keys;

/// Every rank's arena as this process addresses it, and the choice every
/// rank follows.
pub(crate) struct PeerPath {
    pub arenas: Vec<u64>,
    algo: Algo,
    table: Crossover,
}

impl PeerPath {
    /// The path of `op` among the communicator's members.
    pub(crate) fn path(&self, op: &Op) -> Path {
        choose_with(&self.table, self.algo, op, self.arenas.len(), "*")
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes into our buffer.
    let code = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if code != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// This rank's arena entry.
fn my_entry(client: &Client, set: u64) -> String {
    let arena = ask(client, move |dc| dc.peer_arena(set).and_then(|a| Ok((a, dc.peer_arena_handle(set)?))));
    match arena {
        Some(Ok((address, handle))) => {
            format!("ok {} {} {address:x} {}", std::process::id(), host_name(), hex(&handle))
        }
        Some(Err(err)) => format!("no {err}"),
        None => "no its device offers no device collectives".into(),
    }
}

/// Rank 0's choice as text under `algo` (its `COHORT_ALGO`): algo, one-shot
/// and two-shot all-reduce maxima, all-gather maximum, for `ranks` members
/// of `device`. A Communicator
/// takes the peer path only when `COHORT_ALGO` forces it (`oneshot`,
/// `twoshot`): unset or `auto`, it runs on NCCL.
fn choice_text(algo: Algo, device: &str, ranks: usize) -> String {
    let table = machine_table();
    let algo = match algo {
        Algo::Auto | Algo::Nccl => "nccl",
        Algo::OneShot => "oneshot",
        Algo::TwoShot => "twoshot",
    };
    let ar = table.row(device, ranks, TableKind::AllReduce).map_or((0, 0), |r| (r.one_shot_max, r.two_shot_max));
    let ag = table.row(device, ranks, TableKind::AllGather).map_or(0, |r| r.one_shot_max);
    format!("{algo} {} {} {ag}", ar.0, ar.1)
}

fn parse_choice(text: &str) -> Option<(Algo, Crossover)> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let [algo, one, two, gather] = fields[..] else { return None };
    let algo = cohort_runtime::config::parse_algo(std::ffi::OsStr::new(algo)).ok()?;
    let number = |s: &str| s.parse::<u64>().ok();
    let row = |kind, one_shot_max, two_shot_max| CrossoverRow {
        device: "*".into(),
        ranks: 0,
        kind,
        one_shot_max,
        two_shot_max,
    };
    let table = Crossover {
        rows: vec![
            row(TableKind::AllReduce, number(one)?, number(two)?),
            row(TableKind::AllGather, number(gather)?, 0),
        ],
    };
    Some((algo, table))
}

/// Sets the fast path up with every rank (see the module's documentation);
/// `None` where any rank cannot take it. Waits for every rank until
/// `deadline`.
pub(crate) fn setup(
    store: &StoreClient,
    prefix: &str,
    rank: usize,
    size: usize,
    clients: &[Client],
    set: u64,
    deadline: Instant,
) -> Result<Option<PeerPath>, ConnectError> {
    let left = || deadline.saturating_duration_since(Instant::now());
    if rank == 0 {
        store.set(
            &keys::peer_choice(prefix),
            choice_text(algo_from_env(), &clients[0].properties().name, size).as_bytes(),
        )?;
    }
    // Rank 0's choice first: no rank allocates an arena the path will not use.
    store.wait(&[keys::peer_choice(prefix).as_str()], left())?;
    let choice = String::from_utf8_lossy(&store.get(&keys::peer_choice(prefix))?.unwrap_or_default()).into_owned();
    let parsed = parse_choice(&choice);
    let entry = if clients.len() != 1 {
        "no the fast path of a Communicator takes one device per rank".to_string()
    } else if !(2..=PEER_MAX_RANKS).contains(&size) {
        format!("no the fast path takes 2 to {PEER_MAX_RANKS} ranks, not {size}")
    } else if parsed.as_ref().is_none_or(|(algo, _)| *algo == Algo::Nccl) {
        "no rank 0 chose NCCL (COHORT_ALGO unset, auto or nccl)".to_string()
    } else {
        my_entry(&clients[0], set)
    };
    store.set(&keys::peer_arena(prefix, rank), entry.as_bytes())?;
    let wanted: Vec<String> = (0..size).map(|r| keys::peer_arena(prefix, r)).collect();
    store.wait(&wanted.iter().map(String::as_str).collect::<Vec<_>>(), left())?;
    let Some((algo, table)) = parsed else { return Ok(None) };
    let entries: Vec<String> = (0..size)
        .map(
            |r| Ok(String::from_utf8_lossy(&store.get(&keys::peer_arena(prefix, r))?.unwrap_or_default()).into_owned()),
        )
        .collect::<Result<_, ConnectError>>()?;
    // Every rank writes its readiness, so that none waits for a missing key.
    let opened =
        if algo == Algo::Nccl { Err("rank 0 chose NCCL".to_string()) } else { open_all(clients, set, &entries) };
    let ready = match &opened {
        Ok(_) => "yes".to_string(),
        Err(why) => format!("no {why}"),
    };
    store.set(&keys::peer_ready(prefix, rank), ready.as_bytes())?;
    let readiness: Vec<String> = (0..size).map(|r| keys::peer_ready(prefix, r)).collect();
    store.wait(&readiness.iter().map(String::as_str).collect::<Vec<_>>(), left())?;
    for (r, key) in readiness.iter().enumerate() {
        let theirs = String::from_utf8_lossy(&store.get(key)?.unwrap_or_default()).into_owned();
        if theirs != "yes" {
            tracing::debug!(rank = r, why = %theirs, "the communicator's peer-memory path is off");
            return Ok(None);
        }
    }
    Ok(opened.ok().map(|arenas| PeerPath { arenas, algo, table }))
}

/// Every rank's arena as this process addresses it, or why not.
fn open_all(clients: &[Client], set: u64, entries: &[String]) -> Result<Vec<u64>, String> {
    let (pid, host) = (std::process::id().to_string(), host_name());
    let mut arenas = Vec::with_capacity(entries.len());
    for (r, entry) in entries.iter().enumerate() {
        let fields: Vec<&str> = entry.split(' ').collect();
        match fields[..] {
            ["ok", their_pid, their_host, address, handle] => {
                if their_host != host {
                    return Err(format!("rank {r} runs on {their_host}, not on {host}"));
                }
                let address = u64::from_str_radix(address, 16).map_err(|_| format!("rank {r}: a bad arena address"))?;
                if their_pid == pid {
                    arenas.push(address);
                    continue;
                }
                let handle = unhex(handle).ok_or_else(|| format!("rank {r}: a bad IPC handle"))?;
                match ask(&clients[0], move |dc| dc.peer_open(set, &handle)) {
                    Some(Ok(opened)) => arenas.push(opened),
                    Some(Err(err)) => return Err(format!("rank {r}'s arena cannot be opened here: {err}")),
                    None => return Err("the device offers no device collectives".into()),
                }
            }
            _ => return Err(format!("rank {r} has no arena: {}", entry.trim_start_matches("no "))),
        }
    }
    Ok(arenas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zeros_choice_survives_the_store() {
        let (algo, table) = parse_choice("twoshot 1024 4096 2048").unwrap();
        assert_eq!(algo, Algo::TwoShot);
        let op = Op::all_reduce(crate::ops::DType::F32, crate::ops::ReduceOp::Sum, 256);
        let path = PeerPath { arenas: vec![0, 0], algo: Algo::Auto, table: table.clone() };
        assert_eq!(path.path(&op), Path::OneShot);
        let big = Op::all_reduce(crate::ops::DType::F32, crate::ops::ReduceOp::Sum, 1024);
        assert_eq!(path.path(&big), Path::TwoShot);
        let bigger = Op::all_reduce(crate::ops::DType::F32, crate::ops::ReduceOp::Sum, 4096);
        assert_eq!(path.path(&bigger), Path::Nccl);
        assert!(parse_choice("auto 1 2").is_none());
        assert!(parse_choice("ring 1 2 3").is_none());
        assert_eq!(unhex(&hex(&[0, 255, 16])), Some(vec![0, 255, 16]));
        // A Communicator takes the peer kernels only where they are forced.
        for (algo, forced) in [(Algo::Auto, Algo::Nccl), (Algo::Nccl, Algo::Nccl), (Algo::OneShot, Algo::OneShot)] {
            let (sent, _) = parse_choice(&choice_text(algo, "NVIDIA H200", 2)).unwrap();
            assert_eq!(sent, forced, "{algo:?}");
        }
        assert_eq!(unhex("abc"), None);
    }
}
