//! Rendezvous at scale: N simulated ranks, each a thread with its own store
//! connection, doing what a rank does while it forms a communicator: prove
//! the job secret, publish its entry (one append to the directory), wait
//! for every rank (barrier `joined`), read every peer's entry (one
//! multi-get of the directory and the job key), and pass the `ready`
//! barrier. The store runs in a child process (as the launcher's does), so
//! each process holds N descriptors, not 2N.
//!
//! For every count it prints the time until all ranks connected, all
//! joined and all passed `ready`, measured from the moment the threads are
//! released. At the smallest count it also runs, on a fresh store, the key
//! pattern set-up used before (each rank sets `peer/<r>`, waits for every
//! peer key, then reads them one `get` at a time: N² round trips in all) as
//! the baseline, and prints the ratio.
//!
//! `scripts/anchors/tcpstore_bench.py` runs the same pattern against
//! PyTorch's TCPStore (libuv) for the cross-framework ratio.
//!
//! Run: `cargo run --release --example rendezvous_bench -- [counts...]`
//! (default 1024 4096 16384). It raises its soft descriptor limit to the
//! hard one; counts above that (`ulimit -Hn`) are skipped with a note.

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cohort_comm::store::{generate_secret, StoreClient, StoreServer};

const TIMEOUT: Duration = Duration::from_secs(300);

/// Serves a store until stdin closes (the child's side).
fn serve() {
    let mut secret = String::new();
    std::io::stdin().read_line(&mut secret).expect("secret on stdin");
    let server = StoreServer::bind("127.0.0.1:0", secret.trim()).expect("bind the store");
    println!("{}", server.local_addr());
    std::io::stdout().flush().expect("stdout");
    let mut rest = String::new();
    while std::io::stdin().read_line(&mut rest).map(|n| n > 0).unwrap_or(false) {}
}

/// A store in a child process: (child, address).
fn spawn_store(secret: &str) -> (Child, String) {
    let exe = std::env::current_exe().expect("own path");
    let mut child = Command::new(exe)
        .arg("--serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the store process");
    writeln!(child.stdin.as_mut().expect("stdin"), "{secret}").expect("send the secret");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its address");
    (child, line.trim().to_string())
}

/// When each rank passed each step, from the common release.
#[derive(Default, Clone, Copy)]
struct Steps {
    connected: Duration,
    published: Duration,
    joined: Duration,
    ready: Duration,
}

/// The pattern of `Communicator` set-up (crates/comm/src/communicator/setup.rs).
fn rank_now(store: &StoreClient, rank: usize, n: usize, start: Instant) -> Steps {
    let mut steps = Steps { connected: start.elapsed(), ..Default::default() };
    if rank == 0 {
        store.set("c/1/job", b"0123456789abcdef 00112233445566778899aabbccddeeff").expect("job");
    }
    let line = format!("{rank}\thost-{}/boot-id-0000-1111-2222/0\t127.0.0.1:{}\t1\n", rank / 8, 20000 + rank);
    store.append("c/1/peers", line.as_bytes()).expect("append");
    steps.published = start.elapsed();
    store.barrier("c/1/joined", n as u32, TIMEOUT).expect("joined");
    steps.joined = start.elapsed();
    let values = store.multi_get(&["c/1/job", "c/1/peers"]).expect("multi_get");
    let listing = values[1].as_ref().expect("the directory");
    let lines = listing.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    assert_eq!(lines, n, "rank {rank} read {lines} entries of {n}");
    store.barrier("c/1/ready", n as u32, TIMEOUT).expect("ready");
    steps.ready = start.elapsed();
    steps
}

/// The key pattern used before: a key per rank, read one round trip each.
fn rank_before(store: &StoreClient, rank: usize, n: usize, start: Instant) -> Steps {
    let mut steps = Steps { connected: start.elapsed(), ..Default::default() };
    let line = format!("host-{}/boot-id-0000-1111-2222/0\n127.0.0.1:{}\n1", rank / 8, 20000 + rank);
    store.set(&format!("c/1/peer/{rank}"), line.as_bytes()).expect("set");
    steps.published = start.elapsed();
    let keys: Vec<String> = (0..n).map(|r| format!("c/1/peer/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&refs, TIMEOUT).expect("wait");
    steps.joined = start.elapsed();
    for k in &refs {
        store.get(k).expect("get").expect("present");
    }
    store.barrier("c/1/ready", n as u32, TIMEOUT).expect("ready");
    steps.ready = start.elapsed();
    steps
}

type Pattern = fn(&StoreClient, usize, usize, Instant) -> Steps;

/// Runs `n` simulated ranks through `pattern` against a fresh store;
/// returns the latest of each step.
fn simulate(n: usize, pattern: Pattern) -> Steps {
    let secret = generate_secret().expect("secret");
    let (mut child, addr) = spawn_store(&secret);
    let go = Arc::new(Barrier::new(n + 1));
    let start = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (go, start, addr, secret) = (go.clone(), start.clone(), addr.clone(), secret.clone());
            std::thread::Builder::new()
                .stack_size(128 << 10)
                .spawn(move || {
                    go.wait();
                    let t0 = start.lock().expect("set before release");
                    let store = StoreClient::connect(addr.as_str(), &secret, TIMEOUT).expect("connect");
                    let steps = pattern(&store, rank, n, t0);
                    // Hold the connection until every rank is through, as
                    // ranks do (they keep it for the job).
                    (steps, store)
                })
                .expect("thread")
        })
        .collect();
    *start.lock() = Some(Instant::now());
    go.wait();
    let results: Vec<(Steps, StoreClient)> = threads.into_iter().map(|t| t.join().expect("rank thread")).collect();
    let mut last = Steps::default();
    for (s, _) in &results {
        last.connected = last.connected.max(s.connected);
        last.published = last.published.max(s.published);
        last.joined = last.joined.max(s.joined);
        last.ready = last.ready.max(s.ready);
    }
    drop(results);
    drop(child.stdin.take());
    let _ = child.wait();
    last
}

/// Raises the soft limit on open descriptors to the hard one (the store's
/// child process inherits it) and returns it.
fn fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--serve") {
        serve();
        return;
    }
    let counts: Vec<usize> = if args.is_empty() {
        vec![1024, 4096, 16384]
    } else {
        args.iter().map(|a| a.parse().expect("counts are numbers")).collect()
    };
    let limit = fd_limit();
    println!("rendezvous_bench: simulated ranks as threads, store in a child process; fd limit {limit}");
    println!("{:>7} {:>12} {:>12} {:>12} {:>12}", "ranks", "connected", "published", "joined", "ready");
    let mut first = None;
    let skip_baseline = std::env::var_os("RENDEZVOUS_BENCH_NO_BASELINE").is_some();
    for &n in &counts {
        // Each process holds one descriptor per rank, plus a few.
        if n as u64 + 64 > limit {
            println!("{n:>7} skipped: needs {} descriptors per process, the limit is {limit} (ulimit -n)", n + 64);
            continue;
        }
        let s = simulate(n, rank_now);
        println!(
            "{n:>7} {:>10.1}ms {:>10.1}ms {:>10.1}ms {:>10.1}ms",
            s.connected.as_secs_f64() * 1e3,
            s.published.as_secs_f64() * 1e3,
            s.joined.as_secs_f64() * 1e3,
            s.ready.as_secs_f64() * 1e3
        );
        first.get_or_insert((n, s.ready));
    }
    if let Some((n, now)) = first.filter(|_| !skip_baseline) {
        let before = simulate(n, rank_before);
        println!(
            "baseline at {n} ranks, a key per rank read one get at a time: ready in {:.1} ms; directory pattern \
             {:.1} ms; ratio {:.1}x",
            before.ready.as_secs_f64() * 1e3,
            now.as_secs_f64() * 1e3,
            before.ready.as_secs_f64() / now.as_secs_f64()
        );
    }
}
