//! Rendezvous at a size CI affords: 512 simulated ranks (threads, one store
//! connection each) do a communicator's set-up pattern against one store,
//! and a communicator whose ranks do not all come names the missing ones.
//! `examples/rendezvous_bench.rs` times the same pattern at thousands.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use cohort_comm::store::{StoreClient, StoreServer};
use cohort_comm::{Communicator, ConnectError};
use cohort_runtime::{CpuRuntime, Runtime};

const RANKS: usize = 512;
const T: Duration = Duration::from_secs(120);

/// Raises the soft descriptor limit to the hard one: this process holds
/// both ends of every connection (2 × 512 descriptors).
fn enough_descriptors() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// One simulated rank: publish an entry, barrier, read every entry at once,
/// barrier; returns the directory as it read it.
fn rank(addr: &str, rank: usize) -> Vec<u8> {
    let store = StoreClient::connect(addr, "secret", T).expect("connect");
    store
        .append("c/peers", format!("{rank}\t10.0.{}.{}:{}\n", rank / 256, rank % 256, 30000 + rank).as_bytes())
        .unwrap();
    store.barrier("c/joined", RANKS as u32, T).unwrap();
    let mut values = store.multi_get(&["c/peers", "c/absent"]).unwrap();
    assert_eq!(values[1], None);
    let directory = values.remove(0).expect("the directory is set");
    store.barrier("c/ready", RANKS as u32, T).unwrap();
    directory
}

#[test]
fn rendezvous_512_simulated_ranks_each_read_every_peer() {
    enough_descriptors();
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = Arc::new(server.local_addr().to_string());
    let handles: Vec<_> = (0..RANKS)
        .map(|r| {
            let addr = addr.clone();
            thread::Builder::new().stack_size(256 << 10).spawn(move || rank(&addr, r)).unwrap()
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let directory = String::from_utf8(h.join().unwrap()).unwrap();
        // Every rank's entry, once, with the address it published.
        let mut seen = vec![false; RANKS];
        for line in directory.lines() {
            let (who, addr) = line.split_once('\t').unwrap();
            let who: usize = who.parse().unwrap();
            assert_eq!(addr, format!("10.0.{}.{}:{}", who / 256, who % 256, 30000 + who), "rank {r} read {line:?}");
            assert!(!seen[who], "rank {r} read rank {who} twice");
            seen[who] = true;
        }
        assert!(seen.iter().all(|&s| s), "rank {r} misses entries");
    }
}

#[test]
fn communicator_setup_names_the_ranks_that_never_joined() {
    std::env::set_var("COHORT_TIMEOUT", "1.5");
    std::env::set_var("COHORT_CPU_DEVICES", "4");
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    // Ranks 0 and 2 of 4 come; 1 and 3 never do.
    let handles: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                let client = CpuRuntime::client(r).unwrap();
                Communicator::connect(r, 4, &addr, "secret", vec![client]).map(|_| ())
            })
        })
        .collect();
    for h in handles {
        let err = h.join().unwrap().unwrap_err();
        assert!(matches!(err, ConnectError::Setup(_)), "{err}");
        let text = err.to_string();
        assert!(text.contains("2 of 4 ranks joined") && text.contains("rank(s) 1, 3"), "{text}");
    }
}

#[test]
fn the_flight_recorder_keeps_the_start_up_phases() {
    std::env::set_var("COHORT_CPU_DEVICES", "4");
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                let client = CpuRuntime::client(2 + r).unwrap();
                Communicator::connect(r, 2, &addr, "secret", vec![client]).unwrap()
            })
        })
        .collect();
    let comms: Vec<Communicator> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let dump = cohort_comm::trace::FlightRecorder::global().dump("request");
    let names: Vec<&str> = dump.startup.iter().map(|(n, _)| n.as_str()).collect();
    for phase in ["joined", "links", "ready"] {
        assert_eq!(names.iter().filter(|&&n| n == phase).count(), 2, "both ranks kept {phase}: {names:?}");
    }
    let at = |phase: &str| dump.startup.iter().filter(|(n, _)| n == phase).map(|(_, t)| *t).max().unwrap();
    assert!(at("joined") <= at("links") && at("links") <= at("ready"), "{:?}", dump.startup);
    // Rank 0 published them for the launcher, in order.
    let store = StoreClient::connect(addr.as_str(), "secret", T).unwrap();
    let published = store.get(&cohort_comm::published::startup_timings_key(1)).unwrap().expect("published");
    let phases = cohort_comm::published::parse_phases(&published);
    let names: Vec<&str> = phases.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["joined", "links", "ready"]);
    drop(comms);
}

#[test]
fn communicator_setup_names_a_rank_with_another_device_count() {
    std::env::set_var("COHORT_CPU_DEVICES", "4");
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    // Ranks 0 and 1 bring one device, rank 2 brings two: only rank 0 reads
    // the whole directory, and every rank gets its verdict.
    let handles: Vec<_> = (0..3usize)
        .map(|r| {
            let addr = addr.clone();
            thread::spawn(move || {
                let clients = if r == 2 {
                    vec![CpuRuntime::client(2).unwrap(), CpuRuntime::client(3).unwrap()]
                } else {
                    vec![CpuRuntime::client(r).unwrap()]
                };
                Communicator::connect(r, 3, &addr, "secret", clients).map(|_| ())
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let err = h.join().unwrap().unwrap_err();
        assert!(matches!(err, ConnectError::Setup(_)), "rank {r}: {err}");
        let text = err.to_string();
        assert!(text.contains("rank 2 brings 2 local devices but rank 0 brings 1"), "rank {r}: {text}");
    }
}
