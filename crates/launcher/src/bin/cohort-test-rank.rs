//! A tiny rank program for the launcher's integration tests (not for users).
//!
//! Runs its arguments as a list of steps, in order:
//! - `env`: print `RANK=.. LOCAL_RANK=.. WORLD_SIZE=.. ...` on one line;
//! - `pid DIR`: write this process's id to `DIR/rank<RANK>.pid`;
//! - `store`: connect to `COHORT_STORE_ADDR` with `COHORT_JOB_SECRET`, set
//!   `rank/<RANK>` and pass a barrier of `WORLD_SIZE` ranks;
//! - `say TEXT`: print TEXT on stdout; `warn TEXT`: on stderr;
//! - `exit-if-rank R CODE`: exit with CODE when RANK is R;
//! - `signal-if-rank R SIG`: raise signal number SIG when RANK is R;
//! - `fail-first-attempt R`: exit 1 when RANK is R and COHORT_RESTART_COUNT is 0;
//! - `sleep SECS`: sleep;
//! - `sleep-first-attempt SECS`: sleep when COHORT_RESTART_COUNT is 0;
//! - `master-store`: what PyTorch's TCPStore does with MASTER_ADDR and
//!   MASTER_PORT: rank 0 listens there and answers every other rank, which
//!   connects (retrying) and reads the answer; prints `master store ok`;
//! - `wait-file PATH`: wait (up to 60 s) until PATH exists;
//! - `argv ARGS...`: print `ARGV=` and the arguments after it joined by `|`
//!   (they are the program's own, not steps: nothing runs after it).

use std::time::Duration;

use cohort_comm::store::StoreClient;
use cohort_runtime::config;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "<unset>".into())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank: usize = var("RANK").parse().unwrap_or(usize::MAX);
    let mut it = args.iter();
    while let Some(step) = it.next() {
        let mut arg = || it.next().expect("missing argument").clone();
        match step.as_str() {
            "env" => {
                let names = [
                    "RANK",
                    "LOCAL_RANK",
                    "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE",
                    "GROUP_RANK",
                    "GROUP_WORLD_SIZE",
                    "ROLE_RANK",
                    "ROLE_WORLD_SIZE",
                    "ROLE_NAME",
                    "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS",
                    "OMP_NUM_THREADS",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    config::STORE_ADDR.name,
                    config::RESTART_COUNT.name,
                    config::TIMEOUT.name,
                    config::TRACE_DIR.name,
                ];
                // The values exactly as the launcher set them (what the tests check).
                let line: Vec<String> = names.iter().map(|n| format!("{n}={}", var(n))).collect();
                let secret_len = config::JOB_SECRET.get().expect("a usable secret").map_or(0, |s| s.len());
                println!("{} SECRET_LEN={secret_len}", line.join(" "));
            }
            "pid" => {
                let dir = arg();
                std::fs::write(format!("{dir}/rank{rank}.pid"), std::process::id().to_string())
                    .expect("write pid file");
            }
            "store" => {
                let addr = config::STORE_ADDR.get().expect("a usable store address").expect("COHORT_STORE_ADDR");
                let secret = config::JOB_SECRET.get().expect("a usable secret").expect("COHORT_JOB_SECRET");
                let store = StoreClient::connect(addr, secret, Duration::from_secs(30)).expect("connect to the store");
                store.set(&format!("rank/{rank}"), b"here").expect("set");
                let world: u32 = var("WORLD_SIZE").parse().expect("WORLD_SIZE");
                store.barrier("test-rank", world, Duration::from_secs(30)).expect("barrier");
                println!("store barrier of {world} passed");
            }
            "say" => println!("{}", arg()),
            "warn" => eprintln!("{}", arg()),
            "exit-if-rank" => {
                let (r, code): (usize, i32) = (arg().parse().unwrap(), arg().parse().unwrap());
                if r == rank {
                    std::process::exit(code);
                }
            }
            "signal-if-rank" => {
                let (r, sig): (usize, i32) = (arg().parse().unwrap(), arg().parse().unwrap());
                if r == rank {
                    // SAFETY: raise(3) has no memory-safety preconditions.
                    unsafe {
                        libc::raise(sig);
                    }
                }
            }
            "fail-first-attempt" => {
                let r: usize = arg().parse().unwrap();
                if r == rank && config::RESTART_COUNT.get().expect("a usable restart count") == 0 {
                    eprintln!("failing on purpose in the first attempt");
                    std::process::exit(1);
                }
            }
            "sleep" => std::thread::sleep(Duration::from_secs_f64(arg().parse().unwrap())),
            "sleep-first-attempt" => {
                let secs: f64 = arg().parse().unwrap();
                if config::RESTART_COUNT.get().expect("a usable restart count") == 0 {
                    std::thread::sleep(Duration::from_secs_f64(secs));
                }
            }
            "master-store" => master_store(rank),
            "wait-file" => {
                let path = arg();
                let end = std::time::Instant::now() + Duration::from_secs(60);
                while !std::path::Path::new(&path).exists() {
                    assert!(std::time::Instant::now() < end, "{path} never appeared");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            "argv" => {
                println!("ARGV={}", it.by_ref().map(String::as_str).collect::<Vec<_>>().join("|"));
            }
            other => panic!("unknown step {other}"),
        }
    }
}

/// Listens on MASTER_ADDR:MASTER_PORT on rank 0 and meets every other rank
/// there, as torch.distributed's TCPStore does.
fn master_store(rank: usize) {
    use std::io::{Read, Write};
    let addr = format!("{}:{}", var("MASTER_ADDR"), var("MASTER_PORT"));
    let world: usize = var("WORLD_SIZE").parse().expect("WORLD_SIZE");
    if rank == 0 {
        let listener =
            std::net::TcpListener::bind(&addr).unwrap_or_else(|e| panic!("rank 0 cannot listen on {addr}: {e}"));
        for _ in 1..world {
            let (mut s, _) = listener.accept().expect("accept");
            s.write_all(b"ok").expect("answer");
        }
    } else {
        let end = std::time::Instant::now() + Duration::from_secs(30);
        let mut s = loop {
            match std::net::TcpStream::connect(&addr) {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() < end => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("cannot reach rank 0 at {addr}: {e}"),
            }
        };
        let mut ok = [0u8; 2];
        s.read_exact(&mut ok).expect("rank 0's answer");
        assert_eq!(&ok, b"ok");
    }
    println!("master store ok");
}
