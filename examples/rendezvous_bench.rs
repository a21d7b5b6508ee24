//! Rendezvous at scale: N simulated ranks, each with its own store
//! connection, doing what a rank does while it forms a communicator: prove
//! the job secret (its first request right behind the proof), publish its
//! entry (an append to the directory and one to its node's, in one write),
//! wait for every rank, read its node's entries (rank 0: every
//! entry), get rank 0's verdict through barrier `checked`, and pass the
//! `ready` barrier. `--per-node K` sets the ranks per simulated node
//! (default 8); `--per-node 0` is the pattern where every rank appends to
//! and reads the whole directory (no node directories, no verdict).
//!
//! The ranks are state machines on non-blocking sockets, driven by a few
//! threads (`--threads`, default: the cores less one, at most 8), not a
//! thread each, so the count is bounded by descriptors and memory only.
//! The store runs in a child process (as the launcher's does), so each
//! process holds N descriptors, not 2N. At most `--window` connections
//! (default 256) are being opened at once: the kernel's listening
//! queue never overflows (a dropped SYN costs a second), and no more are
//! in the store's handshake than it lets wait
//! ([`MAX_UNAUTHENTICATED`](cohort_comm::store::MAX_UNAUTHENTICATED)).
//!
//! Three runs per count, each against a fresh server:
//! - `cohort`: the Communicator's pattern: `append`s, then `barrier_get`
//!   (the barrier answers the job key and the rank's directory), rank 0's
//!   `set` of its verdict and `barrier_get` of `checked`, then the `ready`
//!   barrier;
//! - `cohort-2rt`: the same with the read as its own round trip (`barrier`
//!   then `multi_get`), the pattern before `barrier_get`;
//! - `tcpstore`: PyTorch's TCPStore (libuv backend), when `--tcpstore CMD`
//!   names a command that serves one and prints its port
//!   (`python3 scripts/anchors/tcpstore_bench.py --serve`), spoken to by
//!   the same client machinery in its own wire format: `append`, torch's
//!   store barrier (`add` to a counter, the last sets a key, all `wait` for
//!   it), `multi_get` of the job key and the rank's directory, rank 0's
//!   `set` of its verdict, a barrier, a `multi_get` of the verdict, a last
//!   barrier.
//!   TCPStore's `set` and `append` have no answer, so its `published` is
//!   when the request was written; its connect includes one round trip
//!   (what torch's client does to check the server: here `getNumKeys`);
//! - `baseline`: `cohort`'s pattern against another build's store, when
//!   `--baseline CMD` names a command that serves one and prints its port
//!   (that build's `rendezvous_bench --serve`, the secret read from stdin):
//!   compares two versions of the store in one run. `--baseline` may be
//!   given several times, each `NAME=CMD` to name its run (default
//!   `baseline`, `baseline2`, ...);
//! - `unpipelined` (with `--unpipelined`): `cohort`'s pattern against this
//!   build's store, each rank waiting for the verdict before its first
//!   request (as a client of protocol 1 did);
//! - `relay` (with `--relay`): `cohort`'s pattern through node relays, as
//!   `cohort run` does it: each simulated node (`--per-node` ranks, 8 when
//!   0) has a [`StoreRelay`]. Before the release each node's relay is
//!   prepared ([`StoreRelay::prepare`]: its socket pairs made, its ranks
//!   holding their ends, as a launcher's ranks inherit theirs); from the
//!   release each joins the store on its own thread
//!   ([`UnjoinedRelay::join`](cohort_comm::store::UnjoinedRelay::join), the
//!   second half of the [`StoreRelay::spawn`] the launcher calls), at most
//!   `--window` relays joining at once (the window counts connections to
//!   the store, and a relay is one), while every rank sends its first
//!   requests at once: they wait in its socket until its relay has joined.
//!   So the relay's connection and handshake are inside the timed window,
//!   as a launcher's are; a rank counts as connected when its first
//!   answer comes back. The relays run in relay host processes, one per
//!   client thread (as each node's launcher is a process of its own; this
//!   process then holds one descriptor per rank, not two), up before the
//!   release, which pass the ranks' ends back over a Unix socket; their CPU
//!   is in `clients cpu`.
//!
//! Before the runs the bench grows its descriptor table (and each relay
//! host its own) to its limit on open files while it has one thread
//! ([`reserve_descriptors`]: in a process of several threads each
//! doubling of the table waits for an RCU grace period), and connects once
//! from every simulated node's source address, so that a count's first run
//! pays nothing the later ones do not.
//!
//! For every run it prints when the last rank had connected, published,
//! joined (passed the first barrier), read its directory and passed
//! `ready`, from the common release, and the CPU time the server's process
//! and the clients spent: a store busy for most of the run is the
//! bottleneck. Under it, where the connect time went (per rank, or per
//! relay start) and each rank's time in each later step (median and 99th
//! percentile). Then ratios against TCPStore at every count.
//!
//! Run: `cargo run --release --example rendezvous_bench -- [--tcpstore CMD]
//! [--baseline [NAME=]CMD]... [--unpipelined] [--relay] [--threads T]
//! [--window W] [--store-workers S] [--no-two-trips] [counts...]` (default counts 1024 4096 16384; `--store-workers` sets the
//! threads serving cohort's authenticated clients, default one per two
//! cores up to 8).
//! It raises its descriptor limit to 65,536 where it may (a privileged
//! process), else its soft limit to the hard one; counts above that
//! (`ulimit -Hn`) are skipped with a note.

use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cohort_comm::store::raw::{self, Handshake};
use cohort_comm::store::{generate_secret, reserve_descriptors, StoreServer};
use mio::net::{TcpStream, UnixStream};
use mio::{Events, Interest, Poll, Token};

const TIMEOUT: Duration = Duration::from_secs(300);
const JOB: &[u8] = b"0123456789abcdef 00112233445566778899aabbccddeeff";

/// Serves a cohort store until stdin closes (the child's side), with
/// `workers` threads serving authenticated clients (0: the default).
fn serve(workers: usize) {
    let mut secret = String::new();
    std::io::stdin().read_line(&mut secret).expect("secret on stdin");
    let server = if workers == 0 {
        StoreServer::bind("127.0.0.1:0", secret.trim())
    } else {
        StoreServer::bind_with_workers("127.0.0.1:0", secret.trim(), workers)
    };
    let server = server.expect("bind the store");
    println!("{}", server.local_addr().port());
    std::io::stdout().flush().expect("stdout");
    let mut rest = String::new();
    while std::io::stdin().read_line(&mut rest).map(|n| n > 0).unwrap_or(false) {}
}

/// A store server in a child process.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    /// Starts `cmd` (the first word the program), writes `stdin_line` to it
    /// and reads the port it prints.
    fn start(cmd: &[String], stdin_line: &str) -> Server {
        let mut child = Command::new(&cmd[0])
            .args(&cmd[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the store server {cmd:?}: {e}"));
        writeln!(child.stdin.as_mut().expect("stdin"), "{stdin_line}").expect("write to the server");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its port");
        let port: u16 = line.trim().parse().unwrap_or_else(|_| panic!("{cmd:?} printed {line:?}, not a port"));
        Server { child, addr: SocketAddr::from(([127, 0, 0, 1], port)) }
    }

    /// CPU time (user + system) the server's process has used.
    fn cpu(&self) -> Duration {
        cpu_of(&format!("/proc/{}/stat", self.child.id()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// User + system CPU time of the process whose `stat` file is `path`.
fn cpu_of(path: &str) -> Duration {
    let Ok(stat) = std::fs::read_to_string(path) else { return Duration::ZERO };
    // Fields after the command name (which may hold spaces), from field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0) + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros(ticks * 1_000_000 / hz)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// cohort's store, `barrier_get` after the append.
    Cohort,
    /// cohort's store, `barrier` then `multi_get`.
    CohortTwoTrips,
    /// PyTorch's TCPStore.
    TcpStore,
}

/// When a rank passed each step, from the common release.
#[derive(Default, Clone, Copy)]
struct Times {
    /// The rank's connect call (when the window let it start).
    began: Duration,
    /// Its socket reported connected (the kernel's handshake done).
    tcp_up: Duration,
    /// cohort: the server's greeting arrived (TCPStore: as `tcp_up`).
    greeted: Duration,
    /// Through relays: its node's relay was asked to join the store
    /// (`began` is then when that was asked, and `connected` when the
    /// rank's first answer came back through the joined relay).
    relayed: bool,
    connected: Duration,
    published: Duration,
    joined: Duration,
    read: Duration,
    /// The verdict read (as `read` without one).
    verdict: Duration,
    ready: Duration,
}

/// What the rank waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Connecting,
    Greeting,
    Verdict,
    /// TCPStore: the round trip that checks the server.
    Checked,
    JobSet,
    Appended,
    /// cohort: the joined barrier (with the directory for `Cohort`).
    Joined,
    /// TCPStore: the counter of barrier `joined` (0) or `ready` (1).
    Counted(u8),
    /// TCPStore: the wait of barrier `joined` (0) or `ready` (1).
    Waited(u8),
    Read,
    /// cohort: rank 0 set its verdict on the directory.
    VerdictSet,
    /// The verdict is read (cohort: barrier `checked` answered it).
    VerdictRead,
    /// cohort: the node directory is appended too.
    AppendedNode,
    Ready,
    Done,
}

/// A field of the answer being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// A cohort frame's length, then its body (small answers).
    FrameLen,
    FrameBody,
    /// A cohort `Values` answer: length, code and count (9 bytes).
    ValuesHead,
    /// A cohort value's present flag, then its length.
    ValueFlag,
    ValueLen,
    /// TCPStore: an i64, a u8, a value's u64 length.
    TcpI64,
    TcpU8,
    TcpLen,
    /// A value's bytes, counted as they stream by (never kept whole).
    Blob,
}

/// A simulated rank's socket: its own connection to the store, or its end
/// of its node relay's socket pair.
enum Sock {
    Tcp(TcpStream),
    Relay(UnixStream),
}

impl Sock {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.read(buf),
            Sock::Relay(s) => s.read(buf),
        }
    }
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.write(buf),
            Sock::Relay(s) => s.write(buf),
        }
    }
    fn take_error(&self) -> std::io::Result<Option<std::io::Error>> {
        match self {
            Sock::Tcp(s) => s.take_error(),
            Sock::Relay(s) => s.take_error(),
        }
    }
    fn peer_addr(&self) -> std::io::Result<()> {
        match self {
            Sock::Tcp(s) => s.peer_addr().map(|_| ()),
            Sock::Relay(_) => Ok(()),
        }
    }
}

/// One simulated rank.
struct Rank {
    rank: usize,
    stream: Sock,
    step: Step,
    out: Vec<u8>,
    out_at: usize,
    /// The field being read: its bytes so far and how many it needs.
    field: Field,
    head: Vec<u8>,
    need: usize,
    /// Values still to read in a multi-value answer, and which one this is.
    values_left: u32,
    value_index: u32,
    /// Lines counted in the directory value.
    lines: usize,
    handshake: Option<Handshake>,
    times: Times,
    /// Ranks per simulated node (0: every rank reads the whole directory).
    per_node: usize,
    /// Wait for the verdict before the first request, whatever the version.
    wait_verdict: bool,
}

/// The outcome of one answer.
enum Answered {
    Frame(Vec<u8>),
    Int(i64),
    Byte,
    /// A multi-value answer, with the lines of its directory value.
    Values(usize),
}

/// TCPStore's wire format (torch/csrc/distributed/c10d): a command byte,
/// keys and values as a u64 length then bytes, integers in native order.
mod tcp {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const ADD: u8 = 4;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MAGIC: u32 = 0x3C85_F7CE;

    pub fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u64).to_ne_bytes());
        out.extend_from_slice(b);
    }
    pub fn keys(out: &mut Vec<u8>, cmd: u8, keys: &[&str]) {
        out.push(cmd);
        out.extend_from_slice(&(keys.len() as u64).to_ne_bytes());
        for k in keys {
            bytes(out, k.as_bytes());
        }
    }
}

impl Rank {
    /// The directory this rank reads: its node's, or the whole one.
    fn my_directory(&self) -> String {
        match self.rank.checked_div(self.per_node) {
            None => "c/1/peers".into(),
            Some(node) => format!("c/1/node/{node}/peers"),
        }
    }

    /// What the rank reads when every rank joined: the job key and its
    /// directory (and rank 0, with per-node directories, the whole one).
    fn reads(&self) -> Vec<String> {
        let mut keys = vec!["c/1/job".to_string(), self.my_directory()];
        if self.per_node > 0 && self.rank == 0 {
            keys.push("c/1/peers".into());
        }
        keys
    }

    /// Entries the rank's directory holds once all joined.
    fn expected_lines(&self, n: usize) -> usize {
        match self.rank.checked_div(self.per_node) {
            None => n,
            Some(node) => (n - node * self.per_node).min(self.per_node),
        }
    }

    fn expect(&mut self, field: Field, need: usize) {
        self.field = field;
        self.need = need;
        self.head.clear();
    }

    /// Starts reading a `Values` answer of `n` values.
    fn expect_values(&mut self, kind: Kind, n: u32) {
        self.values_left = n;
        self.value_index = 0;
        self.lines = 0;
        if kind == Kind::TcpStore {
            self.expect(Field::TcpLen, 8);
        } else {
            self.expect(Field::ValuesHead, 9);
        }
    }

    /// Feeds received bytes; returns an answer once one is whole.
    fn feed(&mut self, kind: Kind, data: &mut &[u8]) -> Result<Option<Answered>, String> {
        while !data.is_empty() {
            let take = self.need.min(data.len());
            if self.field == Field::Blob {
                if self.value_index == 1 {
                    self.lines += data[..take].iter().filter(|&&b| b == b'\n').count();
                }
            } else {
                self.head.extend_from_slice(&data[..take]);
            }
            *data = &data[take..];
            self.need -= take;
            if self.need > 0 {
                continue;
            }
            let h = &self.head;
            let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
            match self.field {
                Field::FrameLen => {
                    let len = u32_at(0) as usize;
                    if len > 1 << 16 {
                        return Err(format!("unexpected answer of {len} bytes"));
                    }
                    self.expect(Field::FrameBody, len);
                    if len == 0 {
                        return Ok(Some(Answered::Frame(Vec::new())));
                    }
                }
                Field::FrameBody => return Ok(Some(Answered::Frame(std::mem::take(&mut self.head)))),
                Field::ValuesHead => {
                    if h[4] != 10 {
                        return Err(format!("answer code {} where values were expected", h[4]));
                    }
                    if u32_at(5) != self.values_left {
                        return Err(format!("{} values where {} were asked", u32_at(5), self.values_left));
                    }
                    self.expect(Field::ValueFlag, 1);
                }
                Field::ValueFlag => {
                    if h[0] == 1 {
                        self.expect(Field::ValueLen, 4);
                    } else if let Some(a) = self.next_value(kind) {
                        return Ok(Some(a));
                    }
                }
                Field::ValueLen => {
                    let len = u32_at(0) as usize;
                    self.expect(Field::Blob, len);
                    if len == 0 {
                        if let Some(a) = self.next_value(kind) {
                            return Ok(Some(a));
                        }
                    }
                }
                Field::TcpLen => {
                    let len = u64::from_ne_bytes(h[..8].try_into().expect("8 bytes")) as usize;
                    self.expect(Field::Blob, len);
                    if len == 0 {
                        if let Some(a) = self.next_value(kind) {
                            return Ok(Some(a));
                        }
                    }
                }
                Field::Blob => {
                    if let Some(a) = self.next_value(kind) {
                        return Ok(Some(a));
                    }
                }
                Field::TcpI64 => {
                    return Ok(Some(Answered::Int(i64::from_ne_bytes(h[..8].try_into().expect("8 bytes")))))
                }
                Field::TcpU8 => return Ok(Some(Answered::Byte)),
            }
        }
        Ok(None)
    }

    /// One value of a multi-value answer is read: the next, or the end.
    fn next_value(&mut self, kind: Kind) -> Option<Answered> {
        self.values_left -= 1;
        self.value_index += 1;
        if self.values_left == 0 {
            return Some(Answered::Values(self.lines));
        }
        if kind == Kind::TcpStore {
            self.expect(Field::TcpLen, 8);
        } else {
            self.expect(Field::ValueFlag, 1);
        }
        None
    }

    fn send(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// Writes what the socket takes.
    fn flush(&mut self) -> Result<(), String> {
        while self.out_at < self.out.len() {
            match self.stream.write(&self.out[self.out_at..]) {
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("write: {e}")),
            }
        }
        self.out.clear();
        self.out_at = 0;
        Ok(())
    }

    /// The rank's first bytes once connected.
    fn on_connected(&mut self, kind: Kind, t0: Instant) {
        self.times.tcp_up = t0.elapsed();
        self.times.greeted = self.times.tcp_up;
        if kind == Kind::TcpStore {
            let mut b = vec![tcp::VALIDATE];
            b.extend_from_slice(&tcp::MAGIC.to_ne_bytes());
            b.push(tcp::GETNUMKEYS);
            self.send(&b);
            self.step = Step::Checked;
            self.expect(Field::TcpI64, 8);
        } else {
            self.step = Step::Greeting;
            self.expect(Field::FrameLen, 4);
        }
    }

    /// The first request once the proof is sent (or accepted): rank 0 sets
    /// the job key, the others publish their entries.
    fn first_request(&mut self, kind: Kind, n: usize, t0: Instant) {
        if self.rank == 0 {
            self.send(&raw::set("c/1/job", JOB));
            self.step = Step::JobSet;
            self.expect(Field::FrameLen, 4);
        } else {
            self.publish(kind, n, t0);
        }
    }

    /// Publishes this rank's entry (after the job key, for rank 0).
    fn publish(&mut self, kind: Kind, n: usize, t0: Instant) {
        let line = format!(
            "{}\thost-{}/boot-id-0000-1111-2222/0\t127.0.0.1:{}\t1\n",
            self.rank,
            self.rank / 8,
            20000 + self.rank
        );
        if kind == Kind::TcpStore {
            let mut b = Vec::new();
            if self.rank == 0 {
                b.push(tcp::SET);
                tcp::bytes(&mut b, b"c/1/job");
                tcp::bytes(&mut b, JOB);
            }
            b.push(tcp::APPEND);
            tcp::bytes(&mut b, b"c/1/peers");
            tcp::bytes(&mut b, line.as_bytes());
            if self.per_node > 0 {
                b.push(tcp::APPEND);
                tcp::bytes(&mut b, self.my_directory().as_bytes());
                tcp::bytes(&mut b, line.as_bytes());
            }
            self.send(&b);
            // No answer to wait for: published once written.
            self.times.published = t0.elapsed();
            self.tcp_barrier(0);
            let _ = n;
        } else {
            // Both appends in one write, as the Communicator's
            // `append_each` sends them.
            self.send(&raw::append("c/1/peers", line.as_bytes()));
            if self.per_node > 0 {
                self.send(&raw::append(&self.my_directory(), line.as_bytes()));
            }
            self.step = Step::Appended;
            self.expect(Field::FrameLen, 4);
        }
    }

    /// TCPStore: torch's store barrier, first request (the counter).
    fn tcp_barrier(&mut self, which: u8) {
        let mut b = vec![tcp::ADD];
        tcp::bytes(&mut b, format!("c/1/{}/count", tcp_barrier_name(which)).as_bytes());
        b.extend_from_slice(&1i64.to_ne_bytes());
        self.send(&b);
        self.step = Step::Counted(which);
        self.expect(Field::TcpI64, 8);
    }

    /// Acts on a whole answer; returns whether the rank is done.
    fn on_answer(
        &mut self,
        kind: Kind,
        n: usize,
        t0: Instant,
        answer: Answered,
        secret: &[u8],
    ) -> Result<bool, String> {
        let ok = |a: &Answered| match a {
            Answered::Frame(body) => match raw::parse_answer(body) {
                raw::Answer::Ok => Ok(()),
                other => Err(format!("{other:?}")),
            },
            _ => Err("unexpected answer".to_string()),
        };
        match (self.step, answer) {
            (Step::Greeting, Answered::Frame(body)) => {
                self.times.greeted = t0.elapsed();
                let (hs, frame) = Handshake::answer(secret, &body).map_err(|e| e.to_string())?;
                self.send(&frame);
                if hs.pipelines() && !self.wait_verdict {
                    // The first request goes behind the proof; the verdict
                    // comes before its answer.
                    self.handshake = Some(hs);
                    self.first_request(kind, n, t0);
                } else {
                    self.handshake = Some(hs);
                    self.step = Step::Verdict;
                    self.expect(Field::FrameLen, 4);
                }
            }
            (Step::Verdict, Answered::Frame(body)) => {
                self.handshake.take().expect("answered").check(secret, &body).map_err(|e| e.to_string())?;
                self.times.connected = t0.elapsed();
                self.first_request(kind, n, t0);
            }
            (_, Answered::Frame(body)) if self.handshake.is_some() => {
                // The verdict, ahead of the first request's answer.
                self.handshake.take().expect("answered").check(secret, &body).map_err(|e| e.to_string())?;
                self.times.connected = t0.elapsed();
                self.expect(Field::FrameLen, 4);
            }
            (Step::Checked, Answered::Int(_)) => {
                self.times.connected = t0.elapsed();
                self.publish(kind, n, t0);
            }
            (Step::JobSet, a) => {
                ok(&a)?;
                self.publish(kind, n, t0);
            }
            (Step::Appended, a) if self.per_node > 0 => {
                // The node directory's answer follows.
                ok(&a)?;
                self.step = Step::AppendedNode;
                self.expect(Field::FrameLen, 4);
            }
            (Step::Appended | Step::AppendedNode, a) => {
                ok(&a)?;
                self.times.published = t0.elapsed();
                let reads = self.reads();
                let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
                if kind == Kind::Cohort {
                    self.send(&raw::barrier_get("c/1/joined", n as u32, TIMEOUT, &reads));
                    self.expect_values(kind, reads.len() as u32);
                } else {
                    self.send(&raw::barrier("c/1/joined", n as u32, TIMEOUT));
                    self.expect(Field::FrameLen, 4);
                }
                self.step = Step::Joined;
            }
            (Step::Joined, Answered::Values(lines)) => {
                self.times.joined = t0.elapsed();
                self.times.read = self.times.joined;
                self.read_done(kind, lines, n)?;
            }
            (Step::Joined, a) => {
                ok(&a)?;
                self.times.joined = t0.elapsed();
                let reads = self.reads();
                let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
                self.send(&raw::multi_get(&reads));
                self.expect_values(kind, reads.len() as u32);
                self.step = Step::Read;
            }
            (Step::VerdictSet, a) => {
                ok(&a)?;
                self.send(&raw::barrier_get("c/1/checked", n as u32, TIMEOUT, &["c/1/verdict"]));
                self.expect_values(kind, 1);
                self.step = Step::VerdictRead;
            }
            (Step::VerdictRead, Answered::Values(_)) => {
                self.times.verdict = t0.elapsed();
                self.ready_barrier(kind, n)
            }
            (Step::Waited(2), Answered::Byte) => {
                let mut b = Vec::new();
                tcp::keys(&mut b, tcp::MULTI_GET, &["c/1/verdict"]);
                self.send(&b);
                self.expect_values(kind, 1);
                self.step = Step::VerdictRead;
            }
            (Step::Counted(which), Answered::Int(count)) => {
                let done = format!("c/1/{}/done", tcp_barrier_name(which));
                let done = done.as_bytes();
                let mut b = Vec::new();
                if count == n as i64 {
                    b.push(tcp::SET);
                    tcp::bytes(&mut b, done);
                    tcp::bytes(&mut b, b"1");
                }
                tcp::keys(&mut b, tcp::WAIT, &[std::str::from_utf8(done).expect("ascii")]);
                self.send(&b);
                self.step = Step::Waited(which);
                self.expect(Field::TcpU8, 1);
            }
            (Step::Waited(0), Answered::Byte) => {
                self.times.joined = t0.elapsed();
                let reads = self.reads();
                let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
                let mut b = Vec::new();
                tcp::keys(&mut b, tcp::MULTI_GET, &reads);
                self.send(&b);
                self.expect_values(kind, reads.len() as u32);
                self.step = Step::Read;
            }
            (Step::Waited(_), Answered::Byte) => {
                self.times.ready = t0.elapsed();
                self.step = Step::Done;
                return Ok(true);
            }
            (Step::Read, Answered::Values(lines)) => {
                self.times.read = t0.elapsed();
                self.read_done(kind, lines, n)?;
            }
            (Step::Ready, a) => {
                ok(&a)?;
                self.times.ready = t0.elapsed();
                self.step = Step::Done;
                return Ok(true);
            }
            (step, _) => return Err(format!("unexpected answer at step {step:?}")),
        }
        Ok(false)
    }

    /// The directory is read: check it, then (with per-node directories)
    /// rank 0's verdict, then the `ready` barrier.
    fn read_done(&mut self, kind: Kind, lines: usize, n: usize) -> Result<(), String> {
        let want = self.expected_lines(n);
        if lines != want {
            return Err(format!("rank {} read {lines} entries of {want}", self.rank));
        }
        if self.per_node == 0 {
            self.ready_barrier(kind, n);
            return Ok(());
        }
        // Rank 0 checked the whole directory: it publishes its verdict,
        // which a second barrier answers to every rank.
        if kind == Kind::TcpStore {
            if self.rank == 0 {
                let mut b = vec![tcp::SET];
                tcp::bytes(&mut b, b"c/1/verdict");
                tcp::bytes(&mut b, b"");
                self.send(&b);
            }
            self.tcp_barrier(2);
        } else if self.rank == 0 {
            self.send(&raw::set("c/1/verdict", b""));
            self.step = Step::VerdictSet;
            self.expect(Field::FrameLen, 4);
        } else {
            self.send(&raw::barrier_get("c/1/checked", n as u32, TIMEOUT, &["c/1/verdict"]));
            self.expect_values(kind, 1);
            self.step = Step::VerdictRead;
        }
        Ok(())
    }

    /// The last step: the `ready` barrier.
    fn ready_barrier(&mut self, kind: Kind, n: usize) {
        self.times.verdict = self.times.verdict.max(self.times.read);
        if kind == Kind::TcpStore {
            self.tcp_barrier(1);
        } else {
            self.send(&raw::barrier("c/1/ready", n as u32, TIMEOUT));
            self.step = Step::Ready;
            self.expect(Field::FrameLen, 4);
        }
    }

    fn connecting(&self) -> bool {
        self.handshake.is_some()
            || matches!(self.step, Step::Connecting | Step::Greeting | Step::Verdict | Step::Checked)
    }
}

/// The name of TCPStore barrier `which`: 0 `joined`, 1 `ready`, 2 `checked`.
fn tcp_barrier_name(which: u8) -> &'static str {
    match which {
        0 => "joined",
        1 => "ready",
        _ => "checked",
    }
}

/// The loopback address simulated rank `rank` connects from: its node's
/// own (`127.1.0.0` and up, one per `per_node` ranks, 8 when 0), as ranks
/// on different hosts do, or `None` (the kernel picks 127.0.0.1) with
/// `--one-source` or a server off loopback.
///
/// With every rank on one address, Linux picks each new connection's
/// source port by scanning the ports already connected to the same server
/// (`__inet_hash_connect`, `__inet_check_established`): quadratic in the
/// ranks, and most of the clients' CPU at 16,384 of them. Real ranks of a
/// large job come from hundreds of hosts, each with its own ports.
fn source_of(rank: usize, per_node: usize, server: SocketAddr, one_source: bool) -> Option<std::net::Ipv4Addr> {
    if one_source || !server.ip().is_loopback() || !server.is_ipv4() {
        return None;
    }
    let node = rank / if per_node == 0 { 8 } else { per_node };
    Some(std::net::Ipv4Addr::new(127, 1 + (node >> 16) as u8, (node >> 8) as u8, node as u8))
}

/// A non-blocking connection to `addr` from `source` (the port left to the
/// kernel, chosen at connect time: `IP_BIND_ADDRESS_NO_PORT`).
fn connect_from(source: std::net::Ipv4Addr, addr: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let std::net::SocketAddr::V4(to) = addr else { return TcpStream::connect(addr) };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: socket() takes no pointers; the descriptor it returns is owned
    // by `fd` at once, so it is closed on every path below.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let one: libc::c_int = 1;
    let from = sockaddr(source, 0);
    let server = sockaddr(*to.ip(), to.port());
    // SAFETY: the pointers are to locals that outlive the calls, with the
    // lengths given; `raw` stays open (owned by `fd`) throughout.
    unsafe {
        if libc::setsockopt(
            raw,
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) != 0
            || libc::bind(raw, (&from as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        if libc::connect(raw, (&server as *const libc::sockaddr_in).cast(), len) != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
        }
    }
    Ok(TcpStream::from_std(std::net::TcpStream::from(fd)))
}

/// A new simulated rank on `stream`.
fn new_rank(rank: usize, stream: Sock, per_node: usize, began: Duration) -> Rank {
    Rank {
        rank,
        stream,
        step: Step::Connecting,
        out: Vec::new(),
        out_at: 0,
        field: Field::FrameLen,
        head: Vec::new(),
        need: 4,
        values_left: 0,
        value_index: 0,
        lines: 0,
        handshake: None,
        times: Times { began, ..Times::default() },
        per_node,
        wait_verdict: false,
    }
}

/// The ranks of one simulated node, for relays (`--per-node`, 8 when 0).
fn relay_group(per_node: usize) -> usize {
    if per_node == 0 {
        8
    } else {
        per_node
    }
}

/// Adds the ranks of a node whose relay is prepared (its ends `ends`, in
/// a relay host process, as each node's launcher makes its own) to
/// `slots`: registered, their first requests not yet sent.
fn add_node(
    node: &[usize],
    ends: Vec<std::os::unix::net::UnixStream>,
    per_node: usize,
    poll: &Poll,
    slots: &mut Vec<Rank>,
) -> Result<(), String> {
    if ends.len() != node.len() {
        return Err(format!("relay host gave {} ends for ranks {node:?}", ends.len()));
    }
    for (&rank, end) in node.iter().zip(ends) {
        end.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut stream = UnixStream::from_std(end);
        let token = Token(slots.len());
        poll.registry()
            .register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)
            .map_err(|e| e.to_string())?;
        let mut r = new_rank(rank, Sock::Relay(stream), per_node, Duration::ZERO);
        r.times.relayed = true;
        slots.push(r);
    }
    Ok(())
}

/// Prepares the relay of each node of `ranks` in `host` and adds its ranks
/// to `slots`; returns each node's (id, first slot, ranks).
fn prepare_nodes(
    host: &relay_host::Host,
    ranks: &[usize],
    per_node: usize,
    poll: &Poll,
    slots: &mut Vec<Rank>,
) -> Result<Vec<(u32, usize, usize)>, String> {
    let group = relay_group(per_node);
    let mut nodes = Vec::new();
    let mut at = 0;
    while at < ranks.len() {
        let first = ranks[at];
        let node: Vec<usize> = ranks[at..].iter().copied().take_while(|r| r / group == first / group).collect();
        at += node.len();
        let id = nodes.len() as u32;
        host.request(relay_host::PREPARE, id, node.len())?;
        let ends = match host.reply()? {
            (got, Ok(ends)) if got == id => ends,
            (got, Ok(_)) => return Err(format!("relay host answered {got} where {id} was asked")),
            (_, Err(e)) => return Err(format!("relay of ranks {node:?}: {e}")),
        };
        nodes.push((id, slots.len(), node.len()));
        add_node(&node, ends, per_node, poll, slots)?;
    }
    Ok(nodes)
}

/// Drives `ranks` through the pattern on one thread; returns their times.
/// With `relay`, `ranks` are whole nodes, each started through its relay.
#[allow(clippy::too_many_arguments)]
fn drive(
    kind: Kind,
    addr: SocketAddr,
    ranks: Vec<usize>,
    n: usize,
    secret: &[u8],
    window: usize,
    per_node: usize,
    go: &Barrier,
    start: &parking_lot::Mutex<Option<Instant>>,
    connected: &AtomicUsize,
    one_source: bool,
    relay_host: Option<Arc<relay_host::Host>>,
    wait_verdict: bool,
) -> Result<Vec<Times>, String> {
    let relay = relay_host.is_some();
    let mut poll = Poll::new().map_err(|e| e.to_string())?;
    let mut events = Events::with_capacity(4096);
    let mut slots: Vec<Rank> = Vec::with_capacity(ranks.len());
    // Through relays: each node's relay is prepared in the host before the
    // release (its ranks hold their ends, as a launcher's ranks inherit
    // theirs); after it, each is asked to join the store, at most a
    // window's worth at once (the window counts connections to the store,
    // and a relay is one), while every rank sends its first requests at
    // once (they wait in its socket until its relay has joined).
    const HOST: Token = Token(usize::MAX);
    // (id, first slot, ranks) of each node, and which have joined (their
    // first rank's first answer came back).
    let nodes = match &relay_host {
        Some(host) => prepare_nodes(host, &ranks, per_node, &poll, &mut slots),
        None => Ok(Vec::new()),
    };
    // Ready (relays prepared, or not: an error is returned once released,
    // so that no thread is left at the barrier), then the release.
    go.wait();
    go.wait();
    let nodes = nodes?;
    let node_of = |slot: usize| nodes.partition_point(|&(_, first, _)| first <= slot) - 1;
    let mut node_joined = vec![false; nodes.len()];
    // A relay host speaks again only when a join failed.
    let _watch = match &relay_host {
        Some(host) => {
            // Watched through a second descriptor of the socket (mio
            // registers sockets of its own types).
            let fd = host.control_fd().try_clone_to_owned().map_err(|e| e.to_string())?;
            let mut watch = mio::net::UnixDatagram::from_std(std::os::unix::net::UnixDatagram::from(fd));
            poll.registry().register(&mut watch, HOST, Interest::READABLE).map_err(|e| e.to_string())?;
            Some(watch)
        }
        None => None,
    };
    let (mut next_node, mut starting) = (0usize, 0usize);
    let mut buf = vec![0u8; 256 << 10];
    let t0 = start.lock().expect("set before the release");
    let (mut connecting, mut done) = (0usize, 0usize);
    let mut released = false;
    loop {
        if relay && next_node < nodes.len() && starting < window {
            // The nodes the window lets join now, asked in a few messages
            // (a host's threads share them; ids are the nodes' indices).
            let asking = (window - starting).min(nodes.len() - next_node);
            let began = t0.elapsed();
            for &(_, first, count) in &nodes[next_node..next_node + asking] {
                for r in &mut slots[first..first + count] {
                    r.times.began = began;
                }
            }
            let host = relay_host.as_ref().expect("relays have a host");
            let chunk = asking.div_ceil(relay_host::TAKERS);
            for at in (next_node..next_node + asking).step_by(chunk) {
                let count = chunk.min(next_node + asking - at);
                host.request(relay_host::JOIN, nodes[at].0, count)?;
            }
            next_node += asking;
            starting += asking;
        }
        if relay && !released {
            released = true;
            for r in &mut slots {
                r.first_request(kind, n, t0);
                r.flush()?;
            }
        }
        if let Some(host) = &relay_host {
            // Edge-triggered: every message waiting.
            if let Some((id, failed)) = host.try_reply()? {
                return Err(format!("the relay of node {id} did not join: {:?}", failed.err()));
            }
        }
        while !relay && connecting < window && slots.len() < ranks.len() {
            let rank = ranks[slots.len()];
            let mut stream = match source_of(rank, per_node, addr, one_source) {
                Some(source) => connect_from(source, addr).map_err(|e| {
                    format!("rank {rank}: connect from {source}: {e} (--one-source connects from 127.0.0.1)")
                }),
                None => TcpStream::connect(addr).map_err(|e| format!("rank {rank}: connect: {e}")),
            }?;
            // As both stores' own clients do: no Nagle delay on small requests.
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let token = Token(slots.len());
            poll.registry()
                .register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)
                .map_err(|e| e.to_string())?;
            let mut r = new_rank(rank, Sock::Tcp(stream), per_node, t0.elapsed());
            r.wait_verdict = wait_verdict;
            slots.push(r);
            connecting += 1;
        }
        if done == ranks.len() {
            return Ok(slots.iter().map(|r| r.times).collect());
        }
        if t0.elapsed() > TIMEOUT {
            let stuck = slots.iter().find(|r| r.step != Step::Done).map(|r| (r.rank, r.step));
            return Err(format!("{} of {} ranks done after {TIMEOUT:?}; first stuck: {stuck:?}", done, ranks.len()));
        }
        poll.poll(&mut events, Some(Duration::from_millis(100))).map_err(|e| e.to_string())?;
        for ev in events.iter() {
            if ev.token() == HOST {
                continue;
            }
            let r = &mut slots[ev.token().0];
            if r.step == Step::Done {
                continue;
            }
            let was_connecting = r.connecting();
            if r.step == Step::Connecting {
                if let Ok(Some(e)) | Err(e) = r.stream.take_error() {
                    return Err(format!("rank {} could not connect: {e}", r.rank));
                }
                match r.stream.peer_addr() {
                    Ok(()) => r.on_connected(kind, t0),
                    Err(e) if e.kind() == std::io::ErrorKind::NotConnected => continue,
                    Err(e) => return Err(format!("rank {} could not connect: {e}", r.rank)),
                }
            }
            r.flush()?;
            // Edge-triggered: read on a readable event only, until a short
            // read (the socket is empty; more brings another event) or, when
            // the peer's end was reported, until it shows.
            let closing = ev.is_read_closed() || ev.is_error();
            let mut readable = ev.is_readable() || closing;
            while readable {
                let k = match r.stream.read(&mut buf) {
                    Ok(0) => return Err(format!("the server closed rank {}'s connection at {:?}", r.rank, r.step)),
                    Ok(k) => k,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(format!("rank {}: read: {e}", r.rank)),
                };
                readable = k == buf.len() || closing;
                let mut data = &buf[..k];
                while let Some(answer) = r.feed(kind, &mut data)? {
                    if r.times.relayed && r.times.connected == Duration::ZERO {
                        // Its relay has joined the store.
                        r.times.connected = t0.elapsed();
                        r.times.tcp_up = r.times.connected;
                        r.times.greeted = r.times.connected;
                        connected.fetch_add(1, Ordering::Relaxed);
                        let node = node_of(ev.token().0);
                        if !node_joined[node] {
                            node_joined[node] = true;
                            starting -= 1;
                        }
                    }
                    if r.on_answer(kind, n, t0, answer, secret)? {
                        done += 1;
                    }
                    r.flush()?;
                }
            }
            if was_connecting && !r.connecting() {
                connecting -= 1;
                connected.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The latest of each step over all ranks, and the CPU time the server
/// and this process (the clients) spent.
struct Run {
    last: Times,
    /// Every rank's times.
    each: Vec<Times>,
    connect_phase: ConnectPhase,
    server_cpu: Duration,
    client_cpu: Duration,
}

/// CPU spent until every rank had connected.
struct ConnectPhase {
    /// From the release until the main thread saw the last rank connected.
    wall: Duration,
    server_cpu: Duration,
    /// The server's two busiest threads then: names and CPU times.
    busiest: String,
    client_cpu: Duration,
}

/// CPU time of each thread of process `pid`, by thread id, with its name.
fn thread_cpu(pid: u32) -> HashMap<String, (String, Duration)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in dir.flatten() {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default().trim().to_string();
        let cpu = cpu_of(&path.join("stat").to_string_lossy());
        out.insert(task.file_name().to_string_lossy().into_owned(), (name, cpu));
    }
    out
}

/// The two threads that used the most CPU between two [`thread_cpu`]
/// samples, as "name time, name time".
fn busiest_threads(
    before: &HashMap<String, (String, Duration)>,
    after: &HashMap<String, (String, Duration)>,
) -> String {
    let mut used: Vec<(String, Duration)> = after
        .iter()
        .map(|(tid, (name, cpu))| {
            let was = before.get(tid).map_or(Duration::ZERO, |(_, c)| *c);
            (name.clone(), cpu.saturating_sub(was))
        })
        .collect();
    used.sort_by_key(|(_, cpu)| std::cmp::Reverse(*cpu));
    used.iter().take(2).map(|(name, cpu)| format!("{name} {:.0} ms", ms(*cpu))).collect::<Vec<_>>().join(", ")
}

/// How a run's clients go about it.
#[derive(Clone, Copy)]
struct How {
    /// Client threads.
    threads: usize,
    /// Connections (ranks' worth, through relays) being opened at once.
    window: usize,
    per_node: usize,
    /// Every rank connects from 127.0.0.1.
    one_source: bool,
    /// Through node relays.
    relay: bool,
    /// Each rank waits for the verdict before its first request (as a
    /// client of protocol 1 did).
    wait_verdict: bool,
}

/// Runs `n` simulated ranks of `kind` against `server` (through node
/// relays with `how.relay`).
fn simulate(kind: Kind, server: &Server, n: usize, secret: &str, how: How) -> Result<Run, String> {
    let How { threads, window, per_node, one_source, relay, wait_verdict } = how;
    let threads = threads.min(n).max(1);
    let go = Arc::new(Barrier::new(threads + 1));
    let start = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let connected = Arc::new(AtomicUsize::new(0));
    let addr = server.addr;
    // Through relays: one relay host process per client thread.
    let hosts = match relay {
        true => {
            if relay_group(per_node) > relay_host::MAX_NODE {
                return Err(format!(
                    "--per-node {per_node}: a relay host serves at most {} ranks a node",
                    relay_host::MAX_NODE
                ));
            }
            let me = std::env::current_exe().map_err(|e| e.to_string())?;
            let me = me.to_string_lossy();
            (0..threads)
                .map(|_| relay_host::Host::start(&me, addr, secret.as_bytes()).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?
        }
        false => Vec::new(),
    };
    let hosts_cpu = |hosts: &[Arc<relay_host::Host>]| hosts.iter().map(|h| h.cpu()).sum::<Duration>();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (go, start, secret) = (go.clone(), start.clone(), secret.as_bytes().to_vec());
            let connected = connected.clone();
            let host = hosts.get(t).cloned();
            // Through relays, each thread drives whole nodes.
            let group = relay_group(per_node);
            let ranks: Vec<usize> = if relay {
                (0..n).filter(|r| (r / group) % threads == t).collect()
            } else {
                (t..n).step_by(threads).collect()
            };
            let window = window.div_ceil(threads);
            std::thread::spawn(move || {
                drive(
                    kind,
                    addr,
                    ranks,
                    n,
                    &secret,
                    window,
                    per_node,
                    &go,
                    &start,
                    &connected,
                    one_source,
                    host,
                    wait_verdict,
                )
            })
        })
        .collect();
    // The clients' CPU: this process's and the relay hosts'.
    // Every client thread is ready (through relays: its nodes' relays
    // prepared); then the clock starts and they are released.
    go.wait();
    let (server_before, client_before) = (server.cpu(), cpu_of("/proc/self/stat") + hosts_cpu(&hosts));
    let threads_before = thread_cpu(server.child.id());
    let t0 = Instant::now();
    *start.lock() = Some(t0);
    go.wait();
    // The connect phase's CPU: sampled once every rank is connected.
    while connected.load(Ordering::Relaxed) < n && !workers.iter().all(|w| w.is_finished()) {
        std::thread::sleep(Duration::from_micros(500));
    }
    let connect_phase = ConnectPhase {
        wall: t0.elapsed(),
        server_cpu: server.cpu() - server_before,
        busiest: busiest_threads(&threads_before, &thread_cpu(server.child.id())),
        client_cpu: cpu_of("/proc/self/stat") + hosts_cpu(&hosts) - client_before,
    };
    let mut last = Times::default();
    let mut each = Vec::with_capacity(n);
    let mut failure = None;
    for w in workers {
        match w.join().expect("a client thread panicked") {
            Ok(times) => {
                each.extend_from_slice(&times);
                for t in times {
                    last.connected = last.connected.max(t.connected);
                    last.published = last.published.max(t.published);
                    last.joined = last.joined.max(t.joined);
                    last.read = last.read.max(t.read);
                    last.ready = last.ready.max(t.ready);
                }
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(Run {
        last,
        each,
        connect_phase,
        server_cpu: server.cpu() - server_before,
        client_cpu: cpu_of("/proc/self/stat") + hosts_cpu(&hosts) - client_before,
    })
}

/// Raises the soft limit on open descriptors to the hard one (the store's
/// child process inherits it) and returns it.
/// The descriptor limit the bench asks for when it may raise the hard one.
const WANTED_DESCRIPTORS: u64 = 1 << 16;

fn fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        // A privileged process (root in a container) may raise the hard
        // limit itself (a run of 16,384 ranks holds more than 16,384).
        let wanted = WANTED_DESCRIPTORS.max(lim.rlim_max);
        let raised = libc::rlimit { rlim_cur: wanted, rlim_max: wanted };
        if wanted > lim.rlim_cur && libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
            lim = raised;
        } else if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

/// Where the ranks' connect time went: each rank's time from its connect
/// call to its last handshake answer (median and 99th percentile), split
/// into the kernel's handshake (`tcp`), waiting for the server's greeting
/// and waiting for its verdict (TCPStore: no greeting, and the answer of
/// the round trip that checks the server), and how many ranks were connecting at once
/// on average (the sum of those times over the connect phase's length): at
/// the window, the window and each connection's latency set the phase.
fn connect_breakdown(each: &[Times], window: usize) -> String {
    let pick = |f: &dyn Fn(&Times) -> Duration| -> (f64, f64) {
        let mut v: Vec<Duration> = each.iter().map(f).collect();
        v.sort();
        let at = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
        (at(0.5), at(0.99))
    };
    let total = pick(&|t| t.connected.saturating_sub(t.began));
    if each.iter().any(|t| t.relayed) {
        // Through relays: `began` is when its node's relay was asked to
        // join the store, `connected` when the rank's first answer came
        // back through it.
        let asked = pick(&|t| t.began);
        let last_asked = each.iter().map(|t| t.began).max().unwrap_or_default();
        return format!(
            "relay join per rank (asked to first answer): median {:.0} us, p99 {:.0} us; joins asked at median \
             {:.1} ms, the last at {:.1} ms (window {window} connections)",
            total.0,
            total.1,
            asked.0 / 1e3,
            ms(last_asked)
        );
    }
    let tcp = pick(&|t| t.tcp_up.saturating_sub(t.began));
    let greeting = pick(&|t| t.greeted.saturating_sub(t.tcp_up));
    let verdict = pick(&|t| t.connected.saturating_sub(t.greeted));
    let busy: f64 = each.iter().map(|t| t.connected.saturating_sub(t.began).as_secs_f64()).sum();
    let phase = each.iter().map(|t| t.connected).max().unwrap_or_default().as_secs_f64().max(1e-9);
    format!(
        "connect per rank: median {:.0} us (tcp {:.0}, greeting {:.0}, verdict {:.0}), p99 {:.0} us (tcp {:.0}, \
         greeting {:.0}, verdict {:.0}); {:.0} connecting at once on average (window {window})",
        total.0,
        tcp.0,
        greeting.0,
        verdict.0,
        total.1,
        tcp.1,
        greeting.1,
        verdict.1,
        busy / phase
    )
}

/// Each rank's time in each step past connecting (median and 99th
/// percentile, microseconds): publishing (its appends' answers), the
/// `joined` barrier with its reads, rank 0's verdict (barrier `checked`) and
/// the `ready` barrier.
fn phase_breakdown(each: &[Times]) -> String {
    let pick = |f: &dyn Fn(&Times) -> Duration| -> String {
        let mut v: Vec<Duration> = each.iter().map(f).collect();
        v.sort();
        let at = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
        format!("{:.0}/{:.0}", at(0.5), at(0.99))
    };
    format!(
        "per rank, median/p99 us: publish {}, joined+read {}, verdict {}, ready {}",
        pick(&|t| t.published.saturating_sub(t.connected)),
        pick(&|t| t.read.saturating_sub(t.published)),
        pick(&|t| t.verdict.saturating_sub(t.read)),
        pick(&|t| t.ready.saturating_sub(t.verdict)),
    )
}

/// Opens `count` connections to a fresh server one after another, each
/// through its handshake (cohort: greeting, proof, verdict; TCPStore: its
/// checking round trip), and closes them: `--warm`, to see how much of a
/// run's connect time is the server's (or the machine's) first moments.
fn warm_up(kind: Kind, addr: SocketAddr, secret: &[u8], count: usize) -> Result<(), String> {
    use std::net::TcpStream as StdTcp;
    let read_frame = |s: &mut StdTcp| -> Result<Vec<u8>, String> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).map_err(|e| e.to_string())?;
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).map_err(|e| e.to_string())?;
        Ok(body)
    };
    for _ in 0..count {
        let mut s = StdTcp::connect(addr).map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        if kind == Kind::TcpStore {
            let mut b = vec![tcp::VALIDATE];
            b.extend_from_slice(&tcp::MAGIC.to_ne_bytes());
            b.push(tcp::GETNUMKEYS);
            s.write_all(&b).map_err(|e| e.to_string())?;
            let mut keys = [0u8; 8];
            s.read_exact(&mut keys).map_err(|e| e.to_string())?;
        } else {
            let greeting = read_frame(&mut s)?;
            let (hs, proof) = Handshake::answer(secret, &greeting).map_err(|e| e.to_string())?;
            s.write_all(&proof).map_err(|e| e.to_string())?;
            hs.check(secret, &read_frame(&mut s)?).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Connects once from the source address of each simulated node of `ranks`
/// (see [`source_of`]) to a listener of this process, a window's worth at
/// a time, and closes the connections: the kernel's first connection from
/// a new address is then outside the timed runs.
fn warm_sources(ranks: usize, per_node: usize, one_source: bool) -> Result<(), String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let group = if per_node == 0 { 8 } else { per_node };
    let sources: Vec<_> =
        (0..ranks.div_ceil(group)).filter_map(|node| source_of(node * group, per_node, addr, one_source)).collect();
    for batch in sources.chunks(256) {
        let mut open = Vec::with_capacity(batch.len());
        for &source in batch {
            open.push(connect_from(source, addr).map_err(|e| format!("from {source}: {e}"))?);
        }
        for _ in batch {
            open.push(TcpStream::from_std(listener.accept().map_err(|e| e.to_string())?.0));
        }
    }
    Ok(())
}

/// Where a run's ranks go: straight to this build's store, through node
/// relays to it, straight to it waiting for the verdict before their first
/// request (`--unpipelined`), or to baseline build `i`'s store.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    Direct,
    Relay,
    Unpipelined,
    Baseline(usize),
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut counts = Vec::new();
    let mut tcpstore: Option<Vec<String>> = None;
    // (name, command) of each `--baseline [NAME=]CMD`.
    let mut baselines: Vec<(String, Vec<String>)> = Vec::new();
    let mut unpipelined = false;
    let mut warm = 0usize;
    let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
    let mut threads = cores.saturating_sub(1).clamp(1, 8);
    let mut window = 256;
    let mut two_trips = true;
    let mut store_workers = 0usize;
    let mut per_node = 8usize;
    let mut one_source = false;
    let mut relay = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--serve" => return serve(args.next().and_then(|v| v.parse().ok()).unwrap_or(0)),
            "--relay-host" => return relay_host::serve(args.next().expect("--relay-host takes the store's address")),
            "--store-workers" => {
                store_workers = args.next().and_then(|v| v.parse().ok()).expect("--store-workers takes a number")
            }
            "--tcpstore" => {
                let cmd = args.next().expect("--tcpstore takes a command");
                tcpstore = Some(cmd.split_whitespace().map(String::from).collect());
            }
            "--baseline" => {
                let cmd = args.next().expect("--baseline takes a command");
                // `NAME=CMD` names it (the first word holds `=`, a program's path does not).
                let (name, cmd) = match cmd.split_once('=') {
                    Some((name, rest)) if !name.contains(char::is_whitespace) && !name.contains('/') => {
                        (name.to_string(), rest.to_string())
                    }
                    _ => (
                        if baselines.is_empty() {
                            "baseline".into()
                        } else {
                            format!("baseline{}", baselines.len() + 1)
                        },
                        cmd,
                    ),
                };
                baselines.push((name, cmd.split_whitespace().map(String::from).collect()));
            }
            "--threads" => threads = args.next().and_then(|v| v.parse().ok()).expect("--threads takes a number"),
            "--window" => window = args.next().and_then(|v| v.parse().ok()).expect("--window takes a number"),
            "--no-two-trips" => two_trips = false,
            "--one-source" => one_source = true,
            "--relay" => relay = true,
            "--unpipelined" => unpipelined = true,
            "--warm" => warm = args.next().and_then(|v| v.parse().ok()).expect("--warm takes a number"),
            "--per-node" => per_node = args.next().and_then(|v| v.parse().ok()).expect("--per-node takes a number"),
            n => counts.push(n.parse::<usize>().unwrap_or_else(|_| panic!("not a count or option: {n}"))),
        }
    }
    if counts.is_empty() {
        counts = vec![1024, 4096, 16384];
    }
    let limit = fd_limit();
    // This process's descriptor table grown once, while it has one thread
    // (no grace period to wait for): its connections never wait for it to
    // grow inside a timed run (the store's process grows its own at bind).
    if let Err(e) = reserve_descriptors(limit as usize) {
        println!("could not grow the descriptor table ahead of the runs: {e}");
    }
    // Every source address connects once before the runs, so that the first
    // run of a count pays nothing the later ones do not.
    let most = counts.iter().copied().max().unwrap_or(0);
    if let Err(e) = warm_sources(most, per_node, one_source) {
        println!("could not connect from each source address before the runs: {e}");
    }
    let warming = match warm {
        0 => String::new(),
        w => format!("{w} connections open and close on each server before its run (--warm); "),
    };
    println!(
        "rendezvous_bench: simulated ranks on {threads} client threads (non-blocking sockets, {window} connecting at \
         once), each server in a child process; fd limit {limit}; {cores} cores; {warming}{}",
        if per_node == 0 {
            "every rank reads the whole directory".to_string()
        } else {
            format!("{per_node} ranks per node, each reads its node's directory, rank 0 the whole one")
        }
    );
    println!(
        "{:>7} {:<11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12} {:>12}",
        "ranks", "store", "connected", "published", "joined", "read", "ready", "store cpu", "clients cpu"
    );
    let me = std::env::current_exe().expect("own path").to_string_lossy().into_owned();
    let mut ratios = Vec::new();
    let mut against_baseline = Vec::new();
    let mut relay_ratios = Vec::new();
    for &n in &counts {
        if n as u64 + 64 > limit {
            println!("{n:>7} skipped: needs {} descriptors per process, the limit is {limit} (ulimit -Hn)", n + 64);
            continue;
        }
        let mut kinds = vec![Kind::Cohort];
        if two_trips {
            kinds.push(Kind::CohortTwoTrips);
        }
        if tcpstore.is_some() {
            kinds.push(Kind::TcpStore);
        }
        // (pattern, the baseline build's store)
        let mut runs: Vec<(Kind, Target)> = kinds.into_iter().map(|k| (k, Target::Direct)).collect();
        if relay {
            // This process holds one end per rank; each relay host the
            // other ends of its share and a connection per node.
            let t = threads.min(n).max(1);
            let nodes = n.div_ceil(relay_group(per_node));
            let descriptors = (n + 4 * t + 64).max(n.div_ceil(t) + 3 * nodes.div_ceil(t) + 64);
            if descriptors as u64 > limit {
                println!("{n:>7} relay skipped: needs {descriptors} descriptors, the limit is {limit} (ulimit -Hn)");
            } else {
                runs.push((Kind::Cohort, Target::Relay));
            }
        }
        if unpipelined {
            runs.push((Kind::Cohort, Target::Unpipelined));
        }
        for i in 0..baselines.len() {
            runs.push((Kind::Cohort, Target::Baseline(i)));
        }
        let mut ready = Vec::new();
        let mut base = Vec::new();
        let mut relayed = None;
        for (kind, target) in runs {
            let secret = generate_secret().expect("secret");
            let server = match (kind, &tcpstore, target) {
                (Kind::TcpStore, Some(cmd), _) => Server::start(cmd, "-"),
                (_, _, Target::Baseline(i)) => {
                    let mut cmd = baselines[i].1.clone();
                    cmd.push(store_workers.to_string());
                    Server::start(&cmd, &secret)
                }
                _ => Server::start(&[me.clone(), "--serve".into(), store_workers.to_string()], &secret),
            };
            if let Err(e) = warm_up(kind, server.addr, secret.as_bytes(), warm) {
                println!("{n:>7} warm-up failed: {e}");
            }
            let name = match (kind, target) {
                (_, Target::Baseline(i)) => baselines[i].0.as_str(),
                (_, Target::Relay) => "relay",
                (_, Target::Unpipelined) => "unpipelined",
                (Kind::Cohort, _) => "cohort",
                (Kind::CohortTwoTrips, _) => "cohort-2rt",
                (Kind::TcpStore, _) => "tcpstore",
            };
            let through_relays = target == Target::Relay;
            let wait_verdict = target == Target::Unpipelined;
            let how = How { threads, window, per_node, one_source, relay: through_relays, wait_verdict };
            match simulate(kind, &server, n, &secret, how) {
                Ok(run) => {
                    let t = run.last;
                    println!(
                        "{n:>7} {name:<11} {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>10.0}ms {:>10.0}ms",
                        ms(t.connected),
                        ms(t.published),
                        ms(t.joined),
                        ms(t.read),
                        ms(t.ready),
                        ms(run.server_cpu),
                        ms(run.client_cpu)
                    );
                    println!("{:>19} {}", "", connect_breakdown(&run.each, window));
                    println!("{:>19} {}", "", phase_breakdown(&run.each));
                    let c = &run.connect_phase;
                    println!(
                        "{:>19} until all connected ({:.1} ms): store cpu {:.0} ms (busiest threads {}), clients \
                         cpu {:.0} ms",
                        "",
                        ms(c.wall),
                        ms(c.server_cpu),
                        c.busiest,
                        ms(c.client_cpu)
                    );
                    if let Target::Baseline(_) | Target::Unpipelined = target {
                        base.push((name.to_string(), t));
                    } else if through_relays {
                        relayed = Some(t);
                    } else {
                        ready.push((kind, t));
                    }
                }
                Err(e) => println!("{n:>7} {name:<11} failed: {e}"),
            }
        }
        let cohort = ready.iter().find(|(k, _)| *k == Kind::Cohort).map(|(_, t)| *t);
        let torch = ready.iter().find(|(k, _)| *k == Kind::TcpStore).map(|(_, t)| *t);
        if let (Some(c), Some(t)) = (cohort, torch) {
            ratios.push((n, c, t));
        }
        if let Some(c) = cohort {
            for (name, b) in &base {
                against_baseline.push((n, c, name.clone(), *b));
            }
        }
        if let Some(r) = relayed {
            relay_ratios.push((n, r, cohort, torch));
        }
    }
    for (n, r, direct, torch) in relay_ratios {
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        let mut line = format!("{n:>7} ranks: through relays ready {:.1} ms", ms(r.ready));
        for (name, other) in [("direct", direct), ("TCPStore", torch)] {
            if let Some(o) = other {
                line += &format!(
                    "; vs {name} {:.1} ms: {:.2}x (connect {:.2}x)",
                    ms(o.ready),
                    ratio(o.ready, r.ready),
                    ratio(o.connected, r.connected)
                );
            }
        }
        println!("{line}");
    }
    for (n, c, name, b) in against_baseline {
        let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "{n:>7} ranks: against {name}: connect {:.1} ms vs {:.1} ms: {:.2}x; ready {:.1} ms vs {:.1} \
             ms: {:.2}x",
            ms(c.connected),
            ms(b.connected),
            r(b.connected, c.connected),
            ms(c.ready),
            ms(b.ready),
            r(b.ready, c.ready)
        );
    }
    for (n, c, t) in ratios {
        let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "{n:>7} ranks: ready {:.1} ms (cohort) vs {:.1} ms (TCPStore): {:.1}x; by phase: connect {:.1}x, \
             publish+join+read {:.1}x, ready barrier {:.1}x",
            ms(c.ready),
            ms(t.ready),
            r(t.ready, c.ready),
            r(t.connected, c.connected),
            r(t.read - t.connected, c.read - c.connected),
            r(t.ready - t.read, c.ready - c.read)
        );
    }
}

/// Node relays in processes of their own, as each node's launcher is one:
/// the bench's process then holds one descriptor per rank (its end of the
/// rank's socket pair), not two, so 16,384 ranks through relays fit a
/// descriptor limit of 20,000. One host process per client thread prepares
/// that thread's relays when asked, passes the ranks' ends back over a
/// `SOCK_SEQPACKET` socket (`SCM_RIGHTS`), and has them join the store
/// when asked. A host first sends `[b'R']`
/// once it is up (the bench waits for every host before its release, so
/// starting the hosts' processes is not in the timed window, as the ranks'
/// own processes are not). A request is `[kind u8, id u32, count u32]`
/// ([`relay_host::PREPARE`] or [`relay_host::JOIN`]); a reply `[id u32,
/// status u8]` (0: prepared, with `count` descriptors; 1: failed, then the
/// reason's bytes).
mod relay_host {
    use std::collections::HashMap;
    use std::io;
    use std::net::SocketAddr;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::net::UnixStream as StdUnixStream;
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use cohort_comm::store::{StoreRelay, UnjoinedRelay};

    /// A request's kind: make a node's socket pairs and pass its ranks'
    /// ends back (answered with them).
    pub const PREPARE: u8 = 0;
    /// A request's kind: the relays of nodes `id` to `id + count - 1` join
    /// the store (answered only when one cannot start).
    pub const JOIN: u8 = 1;
    /// Most descriptors one message carries (Linux's `SCM_MAX_FD`): the
    /// largest simulated node a relay host serves.
    pub const MAX_NODE: usize = 253;
    /// Threads of a host that take requests.
    pub const TAKERS: usize = 4;
    /// The variable that carries the job secret to a host.
    const SECRET_VAR: &str = "RENDEZVOUS_BENCH_SECRET";

    /// A relay host process and this side of its control socket.
    pub struct Host {
        child: Child,
        control: OwnedFd,
    }

    impl Host {
        /// Starts `me --relay-host ADDR` (this program) for the store at `addr`.
        pub fn start(me: &str, addr: SocketAddr, secret: &[u8]) -> Result<Host, String> {
            let (ours, theirs) = seqpacket_pair().map_err(|e| format!("relay host's socket: {e}"))?;
            let child = Command::new(me)
                .arg("--relay-host")
                .arg(addr.to_string())
                .env(SECRET_VAR, String::from_utf8_lossy(secret).as_ref())
                .stdin(Stdio::from(theirs))
                .spawn()
                .map_err(|e| format!("cannot start a relay host ({me}): {e}"))?;
            let host = Host { child, control: ours };
            // Its first message says it is up.
            let mut buf = [0u8; 8];
            match recv(host.control.as_raw_fd(), &mut buf) {
                Ok((1, _)) if buf[0] == b'R' => Ok(host),
                Ok((len, _)) => Err(format!("the relay host ({me}) sent {len} bytes where it should say it is up")),
                Err(e) => Err(format!("the relay host ({me}) did not come up: {e}")),
            }
        }

        /// CPU time (user + system) the host's process has used.
        pub fn cpu(&self) -> Duration {
            super::cpu_of(&format!("/proc/{}/stat", self.child.id()))
        }

        /// Asks for `what`: [`PREPARE`] node `id`'s relay of `count`
        /// ranks, or [`JOIN`] the relays of `count` nodes from `id`.
        pub fn request(&self, what: u8, id: u32, count: usize) -> Result<(), String> {
            let mut req = vec![what];
            req.extend_from_slice(&id.to_le_bytes());
            req.extend_from_slice(&(count as u32).to_le_bytes());
            send(self.control.as_raw_fd(), &req, &[]).map_err(|e| format!("relay host: {e}"))
        }

        /// This side of the control socket (to watch for replies).
        pub fn control_fd(&self) -> std::os::fd::BorrowedFd<'_> {
            use std::os::fd::AsFd;
            self.control.as_fd()
        }

        /// The next reply, waiting for it: its id and the ranks' ends, or
        /// why the host could not do what was asked.
        pub fn reply(&self) -> Result<(u32, Result<Vec<StdUnixStream>, String>), String> {
            let mut buf = [0u8; 1024];
            let got = recv(self.control.as_raw_fd(), &mut buf).map_err(|e| format!("relay host: {e}"))?;
            parse(&buf, got)
        }

        /// [`Host::reply`] if one is waiting.
        #[allow(clippy::type_complexity)]
        pub fn try_reply(&self) -> Result<Option<(u32, Result<Vec<StdUnixStream>, String>)>, String> {
            let mut buf = [0u8; 1024];
            match recv_with(self.control.as_raw_fd(), &mut buf, libc::MSG_DONTWAIT) {
                Ok(got) => parse(&buf, got).map(Some),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                Err(e) => Err(format!("relay host: {e}")),
            }
        }
    }

    /// A reply `[id u32, status u8]` (0: the ends attached; 1: the reason
    /// follows).
    #[allow(clippy::type_complexity)]
    fn parse(
        buf: &[u8],
        (len, fds): (usize, Vec<OwnedFd>),
    ) -> Result<(u32, Result<Vec<StdUnixStream>, String>), String> {
        if len < 5 {
            return Err(format!("the relay host sent {len} bytes (it is gone?)"));
        }
        let id = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
        Ok(match buf[4] {
            0 => (id, Ok(fds.into_iter().map(StdUnixStream::from).collect())),
            _ => (id, Err(String::from_utf8_lossy(&buf[5..len]).into_owned())),
        })
    }

    impl Drop for Host {
        fn drop(&mut self) {
            // SAFETY: shutting down a socket this struct owns; its reader
            // thread then sees the end and returns.
            unsafe {
                libc::shutdown(self.control.as_raw_fd(), libc::SHUT_RDWR);
            }
            let _ = self.child.wait();
        }
    }

    /// The host's side (`--relay-host ADDR`): starts a relay for each
    /// request on standard input ([`StoreRelay::spawn`], as `cohort run`'s
    /// launcher does: each joins the store on its own thread) and keeps
    /// them until standard input closes.
    pub fn serve(addr: String) {
        let secret = std::env::var(SECRET_VAR).expect("the job secret in RENDEZVOUS_BENCH_SECRET");
        // The table grown while this process has one thread (as the bench's
        // own): its relays' sockets never wait for it to grow.
        let _ = cohort_comm::store::reserve_descriptors(1 << 16);
        // SAFETY: standard input is the control socket the bench passed;
        // this process takes it over.
        let control = unsafe { OwnedFd::from_raw_fd(0) };
        // A few threads, started before the host says it is up, take the
        // requests (each message whole: the socket keeps message bounds).
        let control = std::sync::Arc::new(control);
        let prepared = std::sync::Arc::new(parking_lot::Mutex::new(HashMap::<u32, UnjoinedRelay>::new()));
        let relays = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<StoreRelay>::new()));
        let takers: Vec<_> = (0..TAKERS)
            .map(|_| {
                let (control, prepared, relays, addr, secret) =
                    (control.clone(), prepared.clone(), relays.clone(), addr.clone(), secret.clone());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 9];
                    while let Ok((9, _)) = recv(control.as_raw_fd(), &mut buf) {
                        let id = u32::from_le_bytes(buf[1..5].try_into().expect("4 bytes"));
                        let count = u32::from_le_bytes(buf[5..].try_into().expect("4 bytes")) as usize;
                        let mut reply = id.to_le_bytes().to_vec();
                        let failed = match buf[0] {
                            PREPARE => match StoreRelay::prepare(&addr, &secret, count.min(MAX_NODE)) {
                                Ok((unjoined, ends)) => {
                                    prepared.lock().insert(id, unjoined);
                                    reply.push(0);
                                    let fds: Vec<RawFd> = ends.iter().map(|e| e.as_raw_fd()).collect();
                                    let _ = send(control.as_raw_fd(), &reply, &fds);
                                    None
                                }
                                Err(e) => Some(e.to_string()),
                            },
                            // As the launcher's relay does: it joins the
                            // store on its own thread.
                            _ => (id..id + count as u32).find_map(|node| {
                                match prepared.lock().remove(&node).map(|u| u.join(super::TIMEOUT)) {
                                    Some(Ok(relay)) => {
                                        relays.lock().push(relay);
                                        None
                                    }
                                    Some(Err(e)) => Some(format!("node {node}: {e}")),
                                    None => Some(format!("node {node} was not prepared")),
                                }
                            }),
                        };
                        if let Some(why) = failed {
                            reply.push(1);
                            reply.extend_from_slice(why.as_bytes());
                            reply.truncate(1024);
                            let _ = send(control.as_raw_fd(), &reply, &[]);
                        }
                    }
                })
            })
            .collect();
        if send(control.as_raw_fd(), b"R", &[]).is_err() {
            return;
        }
        for t in takers {
            let _ = t.join();
        }
    }

    fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: socketpair writes two descriptors into `fds`, which
        // outlives the call.
        let rc =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: two fresh descriptors that nothing else owns.
        Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
    }

    /// Room for the control message of `MAX_NODE` descriptors, aligned.
    fn control_buffer() -> Vec<u64> {
        // SAFETY: CMSG_SPACE computes a size from a length; no memory.
        let space = unsafe { libc::CMSG_SPACE((MAX_NODE * std::mem::size_of::<RawFd>()) as u32) } as usize;
        vec![0u64; space.div_ceil(8)]
    }

    /// Sends `data` as one message with `fds` attached.
    fn send(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
        let mut cbuf = control_buffer();
        // SAFETY: a zeroed msghdr is a valid empty one.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let bytes = std::mem::size_of_val(fds);
            msg.msg_control = cbuf.as_mut_ptr().cast();
            // SAFETY: as above, sizes only.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as _;
            // SAFETY: `msg` points at `cbuf`, which has room for one header
            // and `MAX_NODE` descriptors (`fds` holds at most that many: the
            // host caps a node's ranks), so the first header and its data
            // are inside it.
            unsafe {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
                std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), bytes);
            }
        }
        // SAFETY: `msg` and everything it points at outlive the call.
        let rc = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives one message into `buf`, with the descriptors attached to it
    /// (close-on-exec); `(0, [])` at the end of the stream.
    fn recv(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
        recv_with(sock, buf, 0)
    }

    /// [`recv`] with `flags` (`MSG_DONTWAIT`: a `WouldBlock` error when
    /// nothing waits).
    fn recv_with(sock: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<(usize, Vec<OwnedFd>)> {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut cbuf = control_buffer();
        // SAFETY: a zeroed msghdr is a valid empty one.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = (cbuf.len() * 8) as _;
        let len = loop {
            // SAFETY: `msg` points at `buf` and `cbuf`, which outlive the call.
            let rc = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | flags) };
            if rc >= 0 {
                break rc as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `cbuf` with `msg.msg_controllen` bytes
        // of control messages; the CMSG macros walk exactly those, and each
        // SCM_RIGHTS message carries descriptors now owned by this process.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    for i in 0..bytes / std::mem::size_of::<RawFd>() {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok((len, fds))
    }
}
