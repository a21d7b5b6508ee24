//! Tests of the store over loopback (every test name contains `store`, so
//! `cargo test -p cohort-comm store` runs them all).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::protocol::MAX_VALUE;
use super::*;

const SECRET: &str = "test-secret";
const T: Duration = Duration::from_secs(10);

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0", SECRET).expect("bind")
}

fn client(s: &StoreServer) -> StoreClient {
    StoreClient::connect(s.local_addr(), SECRET, T).expect("connect")
}

/// Everything logged by any thread of this test binary, captured once.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Capture(writer.clone()))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        buf
    })
    .clone()
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn store_set_get_delete() {
    let s = server();
    let c = client(&s);
    assert_eq!(c.get("a").unwrap(), None);
    c.set("a", b"one").unwrap();
    assert_eq!(c.get("a").unwrap().as_deref(), Some(&b"one"[..]));
    c.set("a", b"").unwrap();
    assert_eq!(c.get("a").unwrap().as_deref(), Some(&b""[..]));
    assert!(c.delete("a").unwrap());
    assert!(!c.delete("a").unwrap());
    assert_eq!(c.get("a").unwrap(), None);
    // Large values travel whole.
    let big = vec![7u8; 5 << 20];
    c.set("big", &big).unwrap();
    assert_eq!(c.get("big").unwrap().unwrap(), big);
    assert_eq!(s.num_keys(), 1);
}

#[test]
fn store_add_counts_and_refuses_non_counters() {
    let s = server();
    let c = client(&s);
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(c.add("n", -2).unwrap(), 3);
    assert_eq!(c.get("n").unwrap().as_deref(), Some(&b"3"[..]));
    c.set("text", b"hello").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(matches!(err, StoreError::NotACounter { .. }), "{err}");
    assert!(err.to_string().contains("'text'"), "{err}");
    // The connection is still usable after a refused request.
    assert_eq!(c.add("n", 1).unwrap(), 4);
}

#[test]
fn store_compare_set() {
    let s = server();
    let c = client(&s);
    assert_eq!(c.compare_set("k", None, b"first").unwrap(), CompareSet::Swapped);
    assert_eq!(c.compare_set("k", None, b"second").unwrap(), CompareSet::Mismatch(Some(b"first".to_vec())));
    assert_eq!(c.compare_set("k", Some(b"nope"), b"x").unwrap(), CompareSet::Mismatch(Some(b"first".to_vec())));
    assert!(c.compare_set("k", Some(b"first"), b"third").unwrap().swapped());
    assert_eq!(c.get("k").unwrap().as_deref(), Some(&b"third"[..]));
    assert_eq!(c.compare_set("absent", Some(b"x"), b"y").unwrap(), CompareSet::Mismatch(None));
}

#[test]
fn store_wait_returns_when_keys_are_set() {
    let s = server();
    let c = client(&s);
    let setter = c.duplicate().unwrap();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        setter.set("x", b"1").unwrap();
        setter.set("y", b"2").unwrap();
    });
    // Returns Ok once both are set (an error after T otherwise).
    c.wait(&["x", "y"], T).unwrap();
    t.join().unwrap();
    // Already present: returns at once.
    c.wait(&["x"], Duration::ZERO).unwrap();
}

#[test]
fn store_wait_timeout_names_missing_keys() {
    let s = server();
    let c = client(&s);
    c.set("present", b"").unwrap();
    let start = Instant::now();
    let err = c.wait(&["present", "rank3/ready", "rank7/ready"], Duration::from_millis(200)).unwrap_err();
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(200), "it waited its whole timeout: {waited:?}");
    match &err {
        StoreError::WaitTimeout { missing, .. } => {
            assert_eq!(missing, &["rank3/ready".to_string(), "rank7/ready".to_string()])
        }
        e => panic!("unexpected {e}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rank3/ready, rank7/ready") && !msg.contains("present"), "{msg}");
}

#[test]
fn store_concurrent_clients() {
    let s = server();
    let addr = s.local_addr();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let c = StoreClient::connect(addr, SECRET, T).unwrap();
                for j in 0..100 {
                    c.set(&format!("t{i}/k{j}"), format!("{i}:{j}").as_bytes()).unwrap();
                    c.add("counter", 1).unwrap();
                }
                c.compare_set("winner", None, format!("{i}").as_bytes()).unwrap();
                c.barrier("done", 8, T).unwrap();
                // Everyone's keys are visible after the barrier.
                for other in 0..8 {
                    let v = c.get(&format!("t{other}/k99")).unwrap().unwrap();
                    assert_eq!(v, format!("{other}:99").into_bytes());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = client(&s);
    assert_eq!(c.add("counter", 0).unwrap(), 800);
    assert!(c.get("winner").unwrap().is_some());
}

#[test]
fn store_barrier_opens_and_is_reusable() {
    let s = server();
    let addr = s.local_addr();
    for round in 0..3 {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let c = StoreClient::connect(addr, SECRET, T).unwrap();
                    c.barrier("step", 4, T).unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap_or_else(|_| panic!("round {round}"));
        }
    }
}

/// Waits until `n` participants wait in barrier `name` (the order of the
/// clients below is set by what the server saw, not by sleeps).
fn wait_arrivals(s: &StoreServer, name: &str, n: u32) {
    let deadline = Instant::now() + T;
    while s.barrier_arrivals(name) != n {
        assert!(Instant::now() < deadline, "{n} never arrived at '{name}'");
        std::thread::yield_now();
    }
}

#[test]
fn store_barrier_timeout_says_how_many_arrived() {
    let s = server();
    let a = client(&s);
    let b = client(&s);
    // `b` waits long enough to outlast `a`'s short wait on any machine.
    let t = std::thread::spawn(move || b.barrier("init", 4, Duration::from_secs(3)));
    wait_arrivals(&s, "init", 1);
    let err = a.barrier("init", 4, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, StoreError::BarrierTimeout { arrived: 2, world_size: 4, .. }), "{err}");
    assert!(err.to_string().contains("2 of 4 arrived"), "{err}");
    // `a` withdrew: the other participant times out alone.
    assert_eq!(s.barrier_arrivals("init"), 1);
    let err = t.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("1 of 4 arrived"), "{err}");
    // A world-size disagreement is named.
    let c = client(&s);
    let d = client(&s);
    let e = client(&s);
    let t = std::thread::spawn(move || c.barrier("mix", 2, T));
    wait_arrivals(&s, "mix", 1);
    let err = d.barrier("mix", 3, T).unwrap_err();
    assert!(matches!(err, StoreError::BarrierMismatch { this: 3, others: 2, .. }), "{err}");
    // The refused participant did not count: one more of size 2 opens it.
    e.barrier("mix", 2, T).unwrap();
    t.join().unwrap().unwrap();
}

#[test]
fn store_wrong_secret_is_refused_and_logged() {
    let logs = captured_logs();
    let s = server();
    let err = StoreClient::connect(s.local_addr(), "not-the-secret", T).unwrap_err();
    // Refused outright, not left to time out.
    assert!(matches!(err, StoreError::AuthRefused { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("refused") && msg.contains("COHORT_JOB_SECRET"), "{msg}");
    // The server logs the refusal with the peer's address.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        if text.contains("does not hold the job secret") && text.contains("peer=127.0.0.1:") {
            break;
        }
        assert!(Instant::now() < deadline, "no refusal logged: {text}");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A right client still gets in.
    client(&s).set("ok", b"").unwrap();
    assert!(matches!(StoreClient::connect(s.local_addr(), "", T), Err(StoreError::EmptySecret)));
}

#[test]
fn store_server_gone_is_an_error_not_a_hang() {
    let mut s = server();
    let c = client(&s);
    let waiter = c.duplicate().unwrap();
    let blocked = std::thread::spawn(move || waiter.wait(&["never"], Duration::from_secs(60)));
    std::thread::sleep(Duration::from_millis(50));
    s.shutdown();
    // Answered by the shutdown, not by its 60 s timeout (a WaitTimeout).
    let err = blocked.join().unwrap().unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. } | StoreError::Disconnected { .. }), "{err}");
    let err = c.get("a").unwrap_err();
    assert!(matches!(err, StoreError::Disconnected { .. }), "{err}");
    assert!(err.to_string().contains("launcher of node 0"), "{err}");
    // Later calls say the connection is broken rather than hang.
    assert!(matches!(c.get("a"), Err(StoreError::Broken { .. })));
}

#[test]
fn store_connect_retries_until_the_server_is_up() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let a2 = addr.clone();
    let t = std::thread::spawn(move || StoreClient::connect(a2.as_str(), SECRET, T));
    std::thread::sleep(Duration::from_millis(150));
    let _s = StoreServer::bind(addr.as_str(), SECRET).unwrap();
    let c = t.join().unwrap().unwrap();
    c.set("late", b"1").unwrap();
}

#[test]
fn store_connect_gives_up_after_its_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let err = StoreClient::connect(format!("127.0.0.1:{port}"), SECRET, Duration::from_millis(300)).unwrap_err();
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(300), "it tried for its whole timeout: {waited:?}");
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(err.to_string().contains(&port.to_string()), "{err}");
}

/// A host name the resolver does not know is looked up again only for the
/// grace (here cut short by a 2 s timeout), then reported as not resolving
/// rather than as unreachable, naming the address: a direct client, a
/// pipelined one and a node relay alike (one rule, `resolve_addrs`, for
/// all); an address that is not `host:port` fails at once. A name that
/// resolves but refuses is retried until the timeout (the tests above).
#[test]
fn store_connect_to_a_name_that_does_not_resolve_says_so() {
    let addr = "no-such-host.invalid:29500";
    // Not host:port at all: no retry can help.
    let start = Instant::now();
    let err = StoreClient::connect("no-port-here", SECRET, Duration::from_secs(30)).unwrap_err();
    // Not retried for its 30 s timeout.
    assert!(start.elapsed() < Duration::from_secs(10), "waited {:?}", start.elapsed());
    assert!(matches!(err, StoreError::Unresolvable { .. }), "{err:?}");
    assert!(err.to_string().contains("no-port-here") && err.to_string().contains("does not resolve"), "{err}");
    // Where no name server answers, the lookup fails only for the moment,
    // which is retried until the timeout like a refused connection.
    if let Err(super::client::Unresolved::Transient(e)) = super::client::resolve_addrs(addr, addr) {
        eprintln!("the resolver failed for the moment ({e}); the unknown name is not checked");
        return;
    }
    let timeout = Duration::from_secs(2);
    type Connect = fn(&str, Duration) -> Result<()>;
    let tries: [(&str, Connect); 3] = [
        ("connect", |a, t| StoreClient::connect(a, SECRET, t).map(drop)),
        ("connect_pipelined", |a, t| StoreClient::connect_pipelined(a, SECRET, t).map(drop)),
        ("a relay", |a, t| StoreRelay::start(a, SECRET, 1, t).map(drop)),
    ];
    for (what, connect) in tries {
        let start = Instant::now();
        let err = connect(addr, timeout).expect_err(what);
        let took = start.elapsed();
        // Its timeout, not the 60 s a name not known yet may get.
        assert!(took >= timeout && took < timeout * 10, "{what}: gave up after {took:?}");
        assert!(matches!(err, StoreError::Unresolvable { .. }), "{what}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains(addr) && msg.contains("does not resolve"), "{what}: {msg}");
    }
}

#[test]
fn store_port_in_use_is_a_clear_error() {
    let s = server();
    let err = StoreServer::bind(s.local_addr(), SECRET).err().expect("second bind must fail");
    let msg = err.to_string();
    let port = s.local_addr().port().to_string();
    assert!(msg.contains(&format!("port {port}")) && msg.contains("already in use"), "{msg}");
    assert!(msg.contains("--store-port") && msg.contains(" 0 "), "{msg}");
}

#[test]
fn store_will_is_set_when_a_client_vanishes() {
    let s = server();
    let watcher = client(&s);
    let dying = client(&s);
    dying.set_will("node1/gone", b"lost").unwrap();
    drop(dying);
    watcher.wait(&["node1/gone"], T).unwrap();
    assert_eq!(watcher.get("node1/gone").unwrap().as_deref(), Some(&b"lost"[..]));
    // A cleared will does nothing; a will does not overwrite an existing key.
    let polite = client(&s);
    polite.set_will("node2/gone", b"lost").unwrap();
    polite.clear_will().unwrap();
    drop(polite);
    watcher.set("node3/gone", b"first").unwrap();
    let late = client(&s);
    late.set_will("node3/gone", b"lost").unwrap();
    drop(late);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(watcher.get("node2/gone").unwrap(), None);
    assert_eq!(watcher.get("node3/gone").unwrap().as_deref(), Some(&b"first"[..]));
}

/// A client whose host vanishes (powered off, cut off: no FIN, no RST)
/// must still be seen gone, or its will never fires: an elastic node's
/// replacement would be refused for good as "still connected". The store
/// probes its idle connections (TCP keepalive): /proc/net/tcp shows the
/// keepalive timer (2) running on the store's end of an idle client's.
#[test]
fn store_probes_idle_connections_so_a_vanished_host_is_seen_gone() {
    let s = server();
    let c = client(&s);
    c.set("k", b"v").unwrap();
    let store_port = s.local_addr().port();
    let client_port = c.socket().local_addr().unwrap().port();
    // "sl local_address rem_address st tx_queue:rx_queue tr:tm->when ...",
    // addresses as HEXIP:HEXPORT; tr 1 while an answer's ACK is still due.
    let port_of = |addr: &str| addr.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
    let start = Instant::now();
    let (timer, table) = loop {
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        let timer = table.lines().find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 5 && port_of(f[1]) == Some(store_port) && port_of(f[2]) == Some(client_port))
                .then(|| f[5].split(':').next().unwrap_or_default().to_string())
        });
        if timer.as_deref() != Some("01") || start.elapsed() > Duration::from_secs(30) {
            break (timer, table);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(timer.as_deref(), Some("02"), "the store's end of the connection, in:\n{table}");
}

#[test]
fn store_reset_except_keeps_the_prefix() {
    let s = server();
    let c = client(&s);
    c.set("cohort/launcher/x", b"1").unwrap();
    c.set("rank/0", b"1").unwrap();
    s.reset_except("cohort/launcher/");
    assert!(c.get("cohort/launcher/x").unwrap().is_some());
    assert_eq!(c.get("rank/0").unwrap(), None);
}

#[test]
fn store_secret_generation() {
    let a = generate_secret().unwrap();
    let b = generate_secret().unwrap();
    assert_eq!(a.len(), 64);
    assert_ne!(a, b);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
}

/// A raw TCP client that has read the server's greeting.
fn raw(s: &StoreServer) -> std::net::TcpStream {
    use std::io::Read;
    let mut t = std::net::TcpStream::connect(s.local_addr()).expect("connect raw");
    t.set_read_timeout(Some(T)).unwrap();
    let mut len = [0u8; 4];
    t.read_exact(&mut len).expect("greeting length");
    let mut hello = vec![0u8; u32::from_le_bytes(len) as usize];
    t.read_exact(&mut hello).expect("greeting");
    t
}

/// Whether the server closed `t` (reads end or fail) within the test limit.
fn closed_by_server(t: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    t.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match t.read(&mut buf) {
            Ok(0) => return true,
            // The refusal byte, if any, then the close.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn store_preauth_frames_are_tiny() {
    use std::io::Write;
    let logs = captured_logs();
    let s = server();
    // A 64 MiB length before authenticating: closed at once, nothing
    // allocated for it (the limit is checked before the body is read).
    let mut t = raw(&s);
    t.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    assert!(closed_by_server(&mut t), "an oversized pre-auth frame must close the connection");
    // One byte over the answer's size is refused too.
    let mut t = raw(&s);
    t.write_all(&((PREAUTH_MAX_FRAME as u32) + 1).to_le_bytes()).unwrap();
    assert!(closed_by_server(&mut t));
    // Clients with the secret are unaffected, and may send large values.
    let c = client(&s);
    c.set("big", &vec![7u8; 1 << 20]).unwrap();
    assert_eq!(c.get("big").unwrap().map(|v| v.len()), Some(1 << 20));
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("dropped a client during the handshake") && text.contains("exceeds the limit"), "{text}");
}

#[test]
fn store_handshake_has_one_deadline_not_one_per_read() {
    use std::io::Write;
    let limits = server::Limits { handshake: Duration::from_millis(600), ..Default::default() };
    let s = StoreServer::bind_with("127.0.0.1:0", SECRET, limits).unwrap();
    let mut t = raw(&s);
    // Trickle a well-formed answer a byte every 100 ms: each read is quick,
    // the whole takes 6.8 s, far past the handshake's 0.6 s.
    let mut answer = (PREAUTH_MAX_FRAME as u32).to_le_bytes().to_vec();
    answer.extend_from_slice(&[0u8; PREAUTH_MAX_FRAME]);
    let mut cut_off = false;
    for b in answer {
        if t.write_all(&[b]).is_err() {
            cut_off = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(cut_off || closed_by_server(&mut t), "a trickling client must be cut off at the handshake's deadline");
    assert!(cut_off, "the server must close the connection before the trickled answer is complete");
}

#[test]
fn store_bounds_unauthenticated_connections_and_lets_the_secret_through() {
    let logs = captured_logs();
    let limits = server::Limits { unauthenticated: 8, handshake: Duration::from_secs(60), evict_after: Duration::ZERO };
    let s = StoreServer::bind_with("127.0.0.1:0", SECRET, limits).unwrap();
    // 40 idle clients that never answer: at most 8 (plus those being closed)
    // are held; the oldest are closed as new ones come.
    let mut idle: Vec<std::net::TcpStream> = Vec::new();
    for _ in 0..40 {
        match std::net::TcpStream::connect(s.local_addr()) {
            Ok(t) => idle.push(t),
            Err(e) => panic!("connect: {e}"),
        }
    }
    // Every connection beyond the 8 closes one: an older one in the
    // handshake, or itself when evicted ones have not finished closing.
    let is_closed = |t: &mut std::net::TcpStream| {
        use std::io::Read;
        t.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 128];
        loop {
            match t.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
    };
    let end = Instant::now() + T;
    let mut closed = 0;
    while Instant::now() < end {
        closed = idle.iter_mut().map(is_closed).filter(|&c| c).count();
        if closed >= 32 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(closed, 32, "40 idle clients, 8 allowed in the handshake: 32 must be closed");
    // A client with the secret still gets in while the flood holds its slots.
    let c = client(&s);
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("closed the oldest connection in the handshake"), "{text}");
}

#[test]
fn store_multi_get_answers_in_order_with_absent_keys() {
    let s = server();
    let c = client(&s);
    c.set("a", b"1").unwrap();
    c.set("c", b"333").unwrap();
    let got = c.multi_get(&["c", "b", "a", "c"]).unwrap();
    assert_eq!(got, vec![Some(b"333".to_vec()), None, Some(b"1".to_vec()), Some(b"333".to_vec())]);
    assert_eq!(c.multi_get(&[]).unwrap(), Vec::<Option<Vec<u8>>>::new());
}

#[test]
fn store_append_builds_a_value_and_wakes_waiters() {
    let s = server();
    let c = client(&s);
    let waiter = c.duplicate().unwrap();
    let t = std::thread::spawn(move || waiter.wait(&["dir"], T));
    std::thread::sleep(Duration::from_millis(100));
    c.append("dir", b"0 a\n").unwrap();
    t.join().unwrap().unwrap();
    c.append("dir", b"1 b\n").unwrap();
    assert_eq!(c.get("dir").unwrap().unwrap(), b"0 a\n1 b\n".to_vec());
    // A value may not grow past the limit: the append is refused, the value kept.
    let big = vec![b'x'; MAX_VALUE - 4];
    c.append("big", &big).unwrap();
    let err = c.append("big", b"12345").unwrap_err();
    assert!(err.to_string().contains("key 'big'") && err.to_string().contains("limit"), "{err}");
    assert_eq!(c.get("big").unwrap().unwrap().len(), MAX_VALUE - 4);
    // The connection still answers.
    assert_eq!(c.get("dir").unwrap().unwrap().len(), 8);
}

/// Polls `cond` for up to T.
fn wait_for(cond: impl Fn() -> bool) {
    let end = Instant::now() + T;
    while !cond() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn store_wait_sees_a_key_deleted_before_the_last_arrives() {
    let s = server();
    let c = client(&s);
    c.set("x", b"1").unwrap();
    let waiter = c.duplicate().unwrap();
    let t = std::thread::spawn(move || waiter.wait(&["x", "y"], Duration::from_millis(800)));
    std::thread::sleep(Duration::from_millis(100));
    // x goes away, then y arrives: the keys are never all set at once.
    assert!(c.delete("x").unwrap());
    c.set("y", b"2").unwrap();
    let err = t.join().unwrap().unwrap_err();
    match err {
        StoreError::WaitTimeout { missing, .. } => assert_eq!(missing, vec!["x".to_string()]),
        e => panic!("expected a timeout naming x, got {e}"),
    }
}

#[test]
fn store_many_waiters_on_one_key_all_wake() {
    let s = server();
    let c = client(&s);
    let waiters: Vec<_> = (0..32)
        .map(|_| {
            let w = c.duplicate().unwrap();
            std::thread::spawn(move || w.wait(&["go", "go"], T))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    c.set("go", b"").unwrap();
    for w in waiters {
        w.join().unwrap().unwrap();
    }
}

#[test]
fn store_shutdown_answers_blocked_waiters_and_barriers() {
    let mut s = server();
    let (a, b) = (client(&s), client(&s));
    let long = Duration::from_secs(120);
    let ta = std::thread::spawn(move || a.wait(&["never"], long));
    let tb = std::thread::spawn(move || b.barrier("bar", 2, long));
    wait_for(|| s.barrier_arrivals("bar") == 1);
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    s.shutdown();
    assert!(ta.join().unwrap().is_err());
    assert!(tb.join().unwrap().is_err());
    // Answered by the shutdown, long before their own timeouts.
    assert!(start.elapsed() < long / 2, "blocked requests answered at shutdown: {:?}", start.elapsed());
}

#[test]
fn store_a_client_that_dies_in_a_barrier_is_withdrawn_and_its_will_set() {
    let s = server();
    let dying = client(&s);
    dying.set_will("gone/dying", b"vanished").unwrap();
    let socket = dying.socket();
    let t = std::thread::spawn(move || dying.barrier("b", 2, T));
    wait_for(|| s.barrier_arrivals("b") == 1);
    // Its connection closes while it waits (the process died).
    socket.shutdown(std::net::Shutdown::Both).unwrap();
    let _ = t.join().unwrap();
    let c = client(&s);
    c.wait(&["gone/dying"], T).unwrap();
    assert_eq!(c.get("gone/dying").unwrap().as_deref(), Some(&b"vanished"[..]));
    wait_for(|| s.barrier_arrivals("b") == 0);
    assert_eq!(s.barrier_arrivals("b"), 0, "the dead client no longer counts");
    // So a new pair forms the barrier, not the dead client and one more.
    let other = client(&s);
    let t = std::thread::spawn(move || other.barrier("b", 2, T));
    wait_for(|| s.barrier_arrivals("b") == 1);
    assert_eq!(s.barrier_arrivals("b"), 1);
    c.barrier("b", 2, T).unwrap();
    t.join().unwrap().unwrap();
}

#[test]
fn store_barrier_get_answers_every_participant_the_values_at_the_opening() {
    let s = server();
    let n = 6;
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let c = client(&s);
            std::thread::spawn(move || {
                c.append("dir", format!("{r}\n").as_bytes()).unwrap();
                c.barrier_get("joined", n, T, &["dir", "absent"]).unwrap()
            })
        })
        .collect();
    for t in threads {
        let values = t.join().unwrap();
        assert_eq!(values.len(), 2);
        assert_eq!(values[1], None);
        let mut lines: Vec<u32> = String::from_utf8(values[0].clone().expect("the directory"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        lines.sort();
        assert_eq!(lines, (0..n).collect::<Vec<_>>(), "every participant reads every entry");
    }
    // A participant of a plain barrier and one of a barrier_get meet.
    let (a, b) = (client(&s), client(&s));
    let t = std::thread::spawn(move || a.barrier("mixed", 2, T));
    wait_arrivals(&s, "mixed", 1);
    assert_eq!(b.barrier_get("mixed", 2, T, &["dir"]).unwrap()[0].as_ref().map(Vec::len), Some(12));
    t.join().unwrap().unwrap();
    // Alone, it times out saying how many came; a world-size mismatch is named.
    let c = client(&s);
    let err = c.barrier_get("alone", 2, Duration::from_millis(100), &["dir"]).unwrap_err();
    assert!(matches!(err, StoreError::BarrierTimeout { arrived: 1, world_size: 2, .. }), "{err}");
    let d = client(&s);
    let t = std::thread::spawn(move || d.barrier_get("sizes", 2, T, &[]));
    wait_arrivals(&s, "sizes", 1);
    let err = c.barrier_get("sizes", 3, T, &[]).unwrap_err();
    assert!(matches!(err, StoreError::BarrierMismatch { this: 3, others: 2, .. }), "{err}");
    c.barrier_get("sizes", 2, T, &[]).unwrap();
    assert_eq!(t.join().unwrap().unwrap(), Vec::<Option<Vec<u8>>>::new());
}

#[test]
fn store_with_four_workers_wakes_clients_served_by_other_threads() {
    // Clients land on different worker threads (by connection number): a
    // barrier, a wait and a will must reach across them.
    let mut s = StoreServer::bind_workers("127.0.0.1:0", SECRET, server::Limits::default(), 4).unwrap();
    let n = 16u32;
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let c = client(&s);
            std::thread::spawn(move || {
                c.append("dir", format!("{r}\n").as_bytes()).unwrap();
                let dir = c.barrier_get("all", n, T, &["dir"]).unwrap().remove(0).unwrap();
                assert_eq!(dir.iter().filter(|&&b| b == b'\n').count(), n as usize, "client {r}");
                if r % 2 == 0 {
                    c.set(&format!("k{r}"), b"").unwrap();
                } else {
                    c.wait(&[&format!("k{}", r - 1)], T).unwrap();
                }
                c.barrier("end", n, T).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // A client that dies in a barrier is withdrawn and its will set, seen
    // by a waiter on another worker.
    let watcher = client(&s);
    let dying = client(&s);
    dying.set_will("gone", b"x").unwrap();
    let socket = dying.socket();
    let t = std::thread::spawn(move || dying.barrier("b", 2, T));
    wait_arrivals(&s, "b", 1);
    socket.shutdown(std::net::Shutdown::Both).unwrap();
    let _ = t.join().unwrap();
    watcher.wait(&["gone"], T).unwrap();
    wait_for(|| s.barrier_arrivals("b") == 0);
    assert_eq!(s.barrier_arrivals("b"), 0);
    // Shutdown answers blocked clients on every worker.
    let blocked: Vec<_> = (0..4)
        .map(|_| {
            let c = client(&s);
            std::thread::spawn(move || c.wait(&["never"], Duration::from_secs(120)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    s.shutdown();
    for b in blocked {
        assert!(b.join().unwrap().is_err());
    }
    // Answered by the shutdown, long before their own timeouts.
    assert!(start.elapsed() < Duration::from_secs(60), "{:?}", start.elapsed());
}

#[test]
fn store_hostile_clients_hammering_the_handshake_do_not_stall_authenticated_ones() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Few slots, and a handshake deadline far past the test: only eviction
    // can make room for the authenticated clients.
    let limits = server::Limits {
        unauthenticated: 16,
        handshake: Duration::from_secs(120),
        evict_after: Duration::from_millis(50),
    };
    let s = StoreServer::bind_workers("127.0.0.1:0", SECRET, limits, 2).unwrap();
    let addr = s.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    // Three kinds of attacker, each keeping up to 64 connections open:
    // idle after the greeting, trickling the first bytes of an answer (so
    // not silent), and answering with a wrong proof.
    let attackers: Vec<_> = (0..3)
        .map(|kind| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                let mut opened = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut t) = std::net::TcpStream::connect(addr) else { continue };
                    opened += 1;
                    let _ = match kind {
                        0 => Ok(()),
                        1 => t.write_all(&(PREAUTH_MAX_FRAME as u32).to_le_bytes()[..2]),
                        _ => {
                            let mut answer = (PREAUTH_MAX_FRAME as u32).to_le_bytes().to_vec();
                            answer.extend_from_slice(&[0u8; PREAUTH_MAX_FRAME]);
                            t.write_all(&answer)
                        }
                    };
                    held.push_back(t);
                    if held.len() > 64 {
                        held.pop_front();
                    }
                }
                opened
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    for i in 0..20 {
        let c = StoreClient::connect(addr, SECRET, T).unwrap_or_else(|e| panic!("client {i} under attack: {e}"));
        c.set(&format!("k{i}"), b"v").unwrap();
        assert_eq!(c.get(&format!("k{i}")).unwrap().as_deref(), Some(&b"v"[..]));
    }
    let took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let opened: u64 = attackers.into_iter().map(|a| a.join().unwrap()).sum();
    assert!(opened > 100, "the attackers opened only {opened} connections: no attack took place");
    // Not held until the attackers' 120 s handshake deadline.
    assert!(took < Duration::from_secs(60), "20 authenticated clients took {took:?} under attack");
}

#[test]
fn store_a_barrier_that_opens_at_a_waiters_deadline_answers_every_participant_alike() {
    // Rounds on four workers where the last arrival lands around the other
    // participants' deadline. A round either opens for all four or times
    // out for all: a participant withdrawn by its timer while the opening's
    // answer was already on its way (from its own thread or another) would
    // be told it timed out while the others went on.
    let s = StoreServer::bind_workers("127.0.0.1:0", SECRET, server::Limits::default(), 4).unwrap();
    let deadline = Duration::from_millis(30);
    let mut clients: Vec<StoreClient> = (0..4).map(|_| client(&s)).collect();
    let (mut opened, mut timed_out) = (0, 0);
    for round in 0..40u64 {
        let name = format!("round{round}");
        let late = deadline + Duration::from_micros(round % 9 * 1000) - Duration::from_millis(4);
        let threads: Vec<_> = clients
            .drain(..)
            .enumerate()
            .map(|(i, c)| {
                let name = name.clone();
                std::thread::spawn(move || {
                    if i == 3 {
                        std::thread::sleep(late);
                    }
                    let ok = c.barrier(&name, 4, deadline).is_ok();
                    (c, ok)
                })
            })
            .collect();
        let results: Vec<bool> = threads
            .into_iter()
            .map(|t| {
                let (c, ok) = t.join().unwrap();
                clients.push(c);
                ok
            })
            .collect();
        match results.iter().filter(|&&ok| ok).count() {
            4 => opened += 1,
            0 => timed_out += 1,
            _ => {
                panic!("round {round}: the barrier opened for some participants and timed out for others: {results:?}")
            }
        }
    }
    eprintln!("{opened} rounds opened, {timed_out} timed out");
}

/// A raw client's greeting: the server nonce it carries.
fn greeting_nonce(t: &mut std::net::TcpStream) -> [u8; protocol::NONCE_LEN] {
    let hello = protocol::read_frame(t).expect("greeting");
    protocol::parse_greeting(&hello).expect("a greeting of this version")
}

/// A frame (length prefix and body) as one buffer.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// The request frames a hostile client sends behind its proof.
fn requests_behind_the_proof() -> Vec<u8> {
    let mut reqs = framed(&protocol::Request::Set { key: "stolen".into(), value: b"x".to_vec() }.encode());
    reqs.extend(framed(&protocol::Request::Append { key: "dir".into(), value: b"evil\n".to_vec() }.encode()));
    reqs
}

#[test]
fn store_pipelined_requests_are_answered_after_the_verdict_in_one_round_trip() {
    use std::io::Write;
    let s = server();
    // A client that sends its proof and two requests in one write gets the
    // verdict (with the server's proof) and both answers, in order.
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    t.set_read_timeout(Some(T)).unwrap();
    let server_nonce = greeting_nonce(&mut t);
    let (client_nonce, answer) = protocol::client_answer(SECRET.as_bytes(), &server_nonce).unwrap();
    let mut out = framed(&answer);
    out.extend(framed(&protocol::Request::Set { key: "job".into(), value: b"j".to_vec() }.encode()));
    out.extend(framed(&protocol::Request::Get { key: "job".into() }.encode()));
    t.write_all(&out).unwrap();
    let verdict = protocol::read_frame(&mut t).unwrap();
    let v = protocol::read_verdict(SECRET.as_bytes(), &client_nonce, &server_nonce, &verdict);
    assert_eq!(v, protocol::Verdict::Accepted);
    assert_eq!(protocol::Response::decode(&protocol::read_frame(&mut t).unwrap()).unwrap(), protocol::Response::Ok);
    assert_eq!(
        protocol::Response::decode(&protocol::read_frame(&mut t).unwrap()).unwrap(),
        protocol::Response::Value(Some(Arc::new(b"j".to_vec())))
    );
    // StoreClient's pipelined connection: the first request rides on the
    // handshake and is answered; later ones as usual.
    let c = StoreClient::connect_pipelined(s.local_addr(), SECRET, T).unwrap();
    assert_eq!(c.add("n", 2).unwrap(), 2);
    assert_eq!(c.get("job").unwrap().as_deref(), Some(&b"j"[..]));
    // A first request that blocks (a barrier) works too.
    let c2 = StoreClient::connect_pipelined(s.local_addr(), SECRET, T).unwrap();
    let waiter = std::thread::spawn(move || c2.barrier_get("b", 2, T, &["job"]).unwrap());
    let c3 = StoreClient::connect_pipelined(s.local_addr(), SECRET, T).unwrap();
    assert_eq!(c3.barrier_get("b", 2, T, &["job"]).unwrap(), vec![Some(b"j".to_vec())]);
    assert_eq!(waiter.join().unwrap(), vec![Some(b"j".to_vec())]);
}

#[test]
fn store_requests_behind_a_wrong_proof_are_refused_and_never_executed() {
    use std::io::Write;
    let logs = captured_logs();
    let s = server();
    // A proof made with another secret, with a set and an append behind it
    // in the same write: refused, and neither request is executed.
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    t.set_read_timeout(Some(T)).unwrap();
    let server_nonce = greeting_nonce(&mut t);
    let (_, answer) = protocol::client_answer(b"not-the-secret", &server_nonce).unwrap();
    let mut out = framed(&answer);
    out.extend(requests_behind_the_proof());
    t.write_all(&out).unwrap();
    match protocol::read_frame(&mut t) {
        Ok(v) => assert_eq!(v, vec![protocol::AUTH_REFUSED]),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert!(closed_by_server(&mut t));
    // StoreClient's pipelined connection with a wrong secret: its first
    // request fails with the refusal, and is not executed either.
    let c = StoreClient::connect_pipelined(s.local_addr(), "not-the-secret", T).unwrap();
    let err = c.set("stolen-too", b"x").unwrap_err();
    assert!(matches!(err, StoreError::AuthRefused { .. }), "{err}");
    assert!(err.to_string().contains("COHORT_JOB_SECRET"), "{err}");
    // Later requests on it say the connection is unusable, not hang.
    assert!(c.get("stolen-too").is_err());
    let good = client(&s);
    assert_eq!(good.multi_get(&["stolen", "dir", "stolen-too"]).unwrap(), vec![None, None, None]);
    assert_eq!(s.num_keys(), 0, "nothing a refused client sent was executed");
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("does not hold the job secret"), "{text}");
}

#[test]
fn store_truncated_or_old_version_proofs_are_refused() {
    use std::io::Write;
    let logs = captured_logs();
    let s = server();
    // A proof cut short (a frame of 40 bytes): refused, nothing behind it run.
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    t.set_read_timeout(Some(T)).unwrap();
    let server_nonce = greeting_nonce(&mut t);
    let (_, answer) = protocol::client_answer(SECRET.as_bytes(), &server_nonce).unwrap();
    let mut out = framed(&answer[..40]);
    out.extend(requests_behind_the_proof());
    t.write_all(&out).unwrap();
    assert!(closed_by_server(&mut t), "a truncated proof must be refused");
    // A frame that announces the whole proof and ends early: dropped at
    // the close, not waited for.
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    let server_nonce = greeting_nonce(&mut t);
    let (_, answer) = protocol::client_answer(SECRET.as_bytes(), &server_nonce).unwrap();
    t.write_all(&framed(&answer)[..30]).unwrap();
    t.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_by_server(&mut t));
    // The previous version's answer (a right proof without the version
    // byte), with a request behind it: refused as another version.
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    t.set_read_timeout(Some(T)).unwrap();
    let server_nonce = greeting_nonce(&mut t);
    let (_, answer) = protocol::client_answer(SECRET.as_bytes(), &server_nonce).unwrap();
    let mut out = framed(&answer[1..]);
    out.extend(requests_behind_the_proof());
    t.write_all(&out).unwrap();
    assert!(closed_by_server(&mut t), "an answer of the previous version must be refused");
    assert_eq!(s.num_keys(), 0, "nothing behind a refused proof was executed");
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("speaks another protocol version"), "{text}");
    // A right client still gets in.
    client(&s).set("ok", b"").unwrap();
}

/// A fake store on loopback that greets with `greeting` and, once it has
/// the client's answer, sends `then` (the thread ends when the client leaves).
fn fake_store(greeting: Vec<u8>, then: Vec<u8>) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut t, _) = listener.accept().unwrap();
        t.write_all(&framed(&greeting)).unwrap();
        let mut answer = [0u8; 4 + protocol::PREAUTH_MAX_FRAME];
        if t.read_exact(&mut answer).is_ok() {
            let _ = t.write_all(&then);
        }
        let mut rest = Vec::new();
        let _ = t.read_to_end(&mut rest);
    });
    addr
}

#[test]
fn store_client_of_another_version_gets_a_clear_error() {
    // A store of the previous protocol version: the client stops at its
    // greeting and says which versions meet.
    let mut old = protocol::MAGIC.to_vec();
    old.push(2);
    old.extend_from_slice(&[7u8; protocol::NONCE_LEN]);
    for pipelined in [false, true] {
        let addr = fake_store(old.clone(), Vec::new());
        let err = if pipelined {
            StoreClient::connect_pipelined(addr, SECRET, T).unwrap_err()
        } else {
            StoreClient::connect(addr, SECRET, T).unwrap_err()
        };
        let msg = err.to_string();
        assert!(matches!(err, StoreError::Protocol { .. }), "{msg}");
        assert!(msg.contains("protocol version 2, this client 3"), "{msg}");
    }
    // And a client of the previous version, which compares the greeting's
    // version with its own (2), finds this store's version there.
    let s = server();
    let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
    let hello = protocol::read_frame(&mut t).unwrap();
    assert_eq!(&hello[..protocol::MAGIC.len()], protocol::MAGIC);
    assert_eq!(hello[protocol::MAGIC.len()], 3);
}

/// A proxy to `store` that drops each of its first connections once the
/// client's proof (and what it pipelined behind it) arrived, as a store
/// shedding handshakes does: `drops[i]` says how the i-th one goes, `true`
/// with the client's bytes unread (a reset), `false` after reading them (an
/// end of stream). Later connections are passed through both ways.
fn dropping_proxy(store: std::net::SocketAddr, drops: Vec<bool>) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for (i, conn) in listener.incoming().enumerate() {
            let Ok(mut client) = conn else { return };
            let mut upstream = std::net::TcpStream::connect(store).unwrap();
            if let Some(&reset) = drops.get(i) {
                let hello = protocol::read_frame(&mut upstream).unwrap();
                client.write_all(&framed(&hello)).unwrap();
                let mut proof = [0u8; 4 + protocol::PREAUTH_MAX_FRAME];
                client.read_exact(&mut proof).unwrap();
                if !reset {
                    client.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                    let _ = client.read(&mut [0u8; 4096]);
                }
                continue;
            }
            std::thread::spawn(move || pipe_both_ways(client, upstream));
        }
    });
    addr
}

/// Copies `client`'s bytes to `upstream` and back until each side ends,
/// passing each end of stream on.
fn pipe_both_ways(mut client: std::net::TcpStream, mut upstream: std::net::TcpStream) {
    let (mut c2, mut u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut c2, &mut u2);
        let _ = u2.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut upstream, &mut client);
    let _ = client.shutdown(std::net::Shutdown::Write);
}

#[test]
fn store_pipelined_client_reconnects_when_the_store_drops_it_before_the_verdict() {
    // The store closed the connection before it judged the proof (it sheds
    // handshakes past its limit): nothing behind the proof ran, so the
    // client connects again and sends it again, and the request runs once.
    let s = server();
    let addr = dropping_proxy(s.local_addr(), vec![true, false]);
    let c = StoreClient::connect_pipelined(addr, SECRET, T).unwrap();
    assert_eq!(c.add("runs", 1).unwrap(), 1, "the first request ran once");
    assert_eq!(c.add("runs", 1).unwrap(), 2);
    // A store that keeps dropping it: an error that says so, not a refused
    // secret.
    let addr = dropping_proxy(s.local_addr(), vec![true; 16]);
    let c = StoreClient::connect_pipelined(addr, SECRET, T).unwrap();
    let err = c.add("never", 1).unwrap_err();
    assert!(matches!(err, StoreError::HandshakeDropped { .. }), "{err}");
    assert!(client(&s).get("never").unwrap().is_none(), "nothing behind a dropped proof runs");
}

#[test]
fn store_pipelined_client_checks_the_servers_proof_before_any_answer() {
    // A server that says "accepted" without holding the secret, and then a
    // forged answer: the first request fails as not authentic, and the
    // forged answer is never taken.
    let mut hello = protocol::MAGIC.to_vec();
    hello.push(protocol::VERSION);
    hello.extend_from_slice(&[9u8; protocol::NONCE_LEN]);
    let mut then = framed(&[&[protocol::AUTH_OK][..], &[0u8; protocol::MAC_LEN]].concat());
    then.extend(framed(&protocol::Response::Value(Some(Arc::new(b"forged".to_vec()))).encode()));
    let addr = fake_store(hello, then);
    let c = StoreClient::connect_pipelined(addr, SECRET, T).unwrap();
    let err = c.get("job").unwrap_err();
    assert!(matches!(err, StoreError::ServerNotAuthentic { .. }), "{err}");
    // The connection is not used again.
    assert!(matches!(c.get("job"), Err(StoreError::Broken { .. })));
}

#[test]
fn store_append_each_applies_every_append_in_order() {
    let s = server();
    // As the first request of a pipelined connection: behind the proof,
    // the verdict, then one answer per append.
    let c = StoreClient::connect_pipelined(s.local_addr(), SECRET, T).unwrap();
    c.append_each(&[("dir", b"0 a\n"), ("node/0", b"0 a\n"), ("dir", b"1 b\n")]).unwrap();
    assert_eq!(c.multi_get(&["dir", "node/0"]).unwrap(), vec![Some(b"0 a\n1 b\n".to_vec()), Some(b"0 a\n".to_vec())]);
    // A key over the limit is refused before anything is sent.
    let long = "k".repeat(MAX_KEY + 1);
    let err = c.append_each(&[("dir", b"2 c\n"), (long.as_str(), b"x")]).unwrap_err();
    assert!(matches!(err, StoreError::TooLarge { what: "the key", .. }), "{err}");
    assert_eq!(c.get("dir").unwrap().as_deref(), Some(&b"0 a\n1 b\n"[..]), "nothing of a refused batch is sent");
    // With a wrong secret, none of them is applied.
    let bad = StoreClient::connect_pipelined(s.local_addr(), "not-the-secret", T).unwrap();
    let err = bad.append_each(&[("dir", b"evil\n"), ("other", b"evil\n")]).unwrap_err();
    assert!(matches!(err, StoreError::AuthRefused { .. }), "{err}");
    assert_eq!(c.multi_get(&["dir", "other"]).unwrap(), vec![Some(b"0 a\n1 b\n".to_vec()), None]);
}

/// An authenticated raw connection that speaks sessions, as a relay does.
struct Sessions(std::net::TcpStream);

impl Sessions {
    fn connect(s: &StoreServer) -> Sessions {
        use std::io::Write;
        let mut t = std::net::TcpStream::connect(s.local_addr()).unwrap();
        t.set_read_timeout(Some(T)).unwrap();
        let server_nonce = greeting_nonce(&mut t);
        let (client_nonce, answer) = protocol::client_answer(SECRET.as_bytes(), &server_nonce).unwrap();
        t.write_all(&framed(&answer)).unwrap();
        let verdict = protocol::read_frame(&mut t).unwrap();
        let v = protocol::read_verdict(SECRET.as_bytes(), &client_nonce, &server_nonce, &verdict);
        assert_eq!(v, protocol::Verdict::Accepted);
        Sessions(t)
    }

    fn raw(&mut self, code: u8, id: u32, body: &[u8]) {
        use std::io::Write;
        let mut f = protocol::session_head(code, id, body.len()).to_vec();
        f.extend_from_slice(body);
        self.0.write_all(&f).unwrap();
    }

    fn open(&mut self, id: u32) {
        self.raw(protocol::OPEN_SESSION, id, &[]);
    }

    fn close(&mut self, id: u32) {
        self.raw(protocol::CLOSE_SESSION, id, &[]);
    }

    fn send(&mut self, id: u32, req: protocol::Request) {
        self.raw(protocol::IN_SESSION, id, &req.encode());
    }

    /// The next answer: its session and the answer.
    fn answer(&mut self) -> (u32, protocol::Response) {
        let body = protocol::read_frame(&mut self.0).expect("an answer");
        let (id, inner) = protocol::session_answer(&body).expect("a session's answer");
        (id, protocol::Response::decode(inner).expect("a well-formed answer"))
    }
}

fn set(key: &str, value: &[u8]) -> protocol::Request {
    protocol::Request::Set { key: key.into(), value: value.to_vec() }
}

fn get(key: &str) -> protocol::Request {
    protocol::Request::Get { key: key.into() }
}

fn value(v: &[u8]) -> protocol::Response {
    protocol::Response::Value(Some(Arc::new(v.to_vec())))
}

#[test]
fn store_sessions_of_one_connection_block_independently() {
    use protocol::{Request, Response};
    let s = server();
    let mut c = Sessions::connect(&s);
    c.open(1);
    c.open(2);
    // Session 1 blocks in a barrier; it also sends a request behind it,
    // which waits its turn.
    c.send(1, Request::Barrier { name: "b".into(), world_size: 2, timeout_ms: 10_000 });
    c.send(1, get("later"));
    wait_for(|| s.barrier_arrivals("b") == 1);
    // Session 2 is served meanwhile, on the same connection.
    c.send(2, set("k", b"v"));
    assert_eq!(c.answer(), (2, Response::Ok));
    c.send(2, get("k"));
    assert_eq!(c.answer(), (2, value(b"v")));
    c.send(2, set("later", b"after"));
    assert_eq!(c.answer(), (2, Response::Ok));
    // A plain client completes the barrier: session 1 gets its answer, then
    // the answer to the request that waited behind it (the value set after).
    client(&s).barrier("b", 2, T).unwrap();
    assert_eq!(c.answer(), (1, Response::Ok));
    assert_eq!(c.answer(), (1, value(b"after")));
    // Two sessions of one connection waiting for keys at once: each is
    // answered when its own key comes.
    c.send(1, Request::Wait { keys: vec!["w1".into()], timeout_ms: 10_000 });
    c.send(2, Request::Wait { keys: vec!["w2".into()], timeout_ms: 10_000 });
    let setter = client(&s);
    std::thread::sleep(Duration::from_millis(20));
    setter.set("w2", b"").unwrap();
    assert_eq!(c.answer(), (2, Response::Ok));
    setter.set("w1", b"").unwrap();
    assert_eq!(c.answer(), (1, Response::Ok));
    // A session's wait times out alone, naming its key (long enough that
    // the other session's get is answered first on a loaded machine).
    c.send(1, Request::Wait { keys: vec!["never".into()], timeout_ms: 2_000 });
    c.send(2, get("w2"));
    assert_eq!(c.answer(), (2, value(b"")));
    assert_eq!(c.answer(), (1, Response::WaitTimeout { missing: vec!["never".into()] }));
    // Two sessions in one barrier: both are participants.
    c.send(1, Request::Barrier { name: "pair".into(), world_size: 2, timeout_ms: 10_000 });
    c.send(2, Request::Barrier { name: "pair".into(), world_size: 2, timeout_ms: 10_000 });
    let mut got = [c.answer(), c.answer()];
    got.sort_by_key(|a| a.0);
    assert_eq!(got, [(1, Response::Ok), (2, Response::Ok)]);
}

#[test]
fn store_session_close_sets_its_will_and_withdraws_it_from_its_barrier() {
    use protocol::{Request, Response};
    let s = server();
    let mut c = Sessions::connect(&s);
    for id in [1, 2, 3] {
        c.open(id);
        c.send(id, Request::SetWill { key: format!("gone/{id}"), value: b"dead".to_vec() });
        assert_eq!(c.answer(), (id, Response::Ok));
    }
    c.send(1, Request::Barrier { name: "b".into(), world_size: 3, timeout_ms: 10_000 });
    c.send(2, Request::Barrier { name: "b".into(), world_size: 3, timeout_ms: 10_000 });
    wait_for(|| s.barrier_arrivals("b") == 2);
    let watcher = client(&s);
    // Closing session 1 withdraws it from the barrier and sets its will;
    // session 2 still waits there, and session 3's will is not set.
    c.close(1);
    watcher.wait(&["gone/1"], T).unwrap();
    wait_for(|| s.barrier_arrivals("b") == 1);
    assert_eq!(s.barrier_arrivals("b"), 1);
    assert_eq!(watcher.get("gone/2").unwrap(), None);
    assert_eq!(watcher.get("gone/3").unwrap(), None);
    // A session cleared of its will leaves nothing behind.
    c.send(3, Request::ClearWill);
    assert_eq!(c.answer(), (3, Response::Ok));
    c.close(3);
    // The connection dropping ends the sessions still open: session 2 is
    // withdrawn and its will set.
    drop(c);
    watcher.wait(&["gone/2"], T).unwrap();
    wait_for(|| s.barrier_arrivals("b") == 0);
    assert_eq!(s.barrier_arrivals("b"), 0);
    assert_eq!(watcher.get("gone/3").unwrap(), None);
}

#[test]
fn store_frames_for_sessions_not_open_are_refused_not_fatal() {
    use protocol::Response;
    let s = server();
    let mut a = Sessions::connect(&s);
    let mut b = Sessions::connect(&s);
    let refused = |(id, r): (u32, Response), want: u32, says: &str| match r {
        Response::Refused(msg) if id == want && msg.contains(says) => {}
        other => panic!("session {id}: {other:?}, wanted a refusal saying {says:?}"),
    };
    // Never opened.
    a.send(9, get("k"));
    refused(a.answer(), 9, "session 9 is not open");
    // Opened on another connection (a foreign session).
    a.open(1);
    b.send(1, get("k"));
    refused(b.answer(), 1, "session 1 is not open on this connection");
    // Session 0 is the connection's own; a session opens once; an unopened
    // one cannot be closed.
    a.open(0);
    refused(a.answer(), 0, "session 0 is the connection's own");
    a.open(1);
    refused(a.answer(), 1, "already open");
    a.close(5);
    refused(a.answer(), 5, "session 5 is not open");
    // A malformed request ends its session, not the connection.
    a.open(2);
    a.raw(protocol::IN_SESSION, 2, &[200]);
    refused(a.answer(), 2, "unknown request code 200");
    a.send(2, get("k"));
    refused(a.answer(), 2, "session 2 is not open");
    // The connection and its other sessions still work.
    a.send(1, set("k", b"1"));
    assert_eq!(a.answer(), (1, Response::Ok));
    b.open(1);
    b.send(1, get("k"));
    assert_eq!(b.answer(), (1, value(b"1")));
    // A session frame too short to name its session closes the
    // connection, with a refusal that says so.
    use std::io::Write;
    b.0.write_all(&framed(&[protocol::IN_SESSION, 1])).unwrap();
    let body = protocol::read_frame(&mut b.0).unwrap();
    match Response::decode(&body).unwrap() {
        Response::Refused(msg) => assert!(msg.contains("no session id"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert!(closed_by_server(&mut b.0));
}

/// Reads answers until one of session `until` comes; returns it and the
/// answers of other sessions that came before it, in order.
fn answers_until(c: &mut Sessions, until: u32) -> (protocol::Response, Vec<(u32, protocol::Response)>) {
    let mut before = Vec::new();
    loop {
        let (id, r) = c.answer();
        if id == until {
            return (r, before);
        }
        before.push((id, r));
    }
}

fn refusal(r: &protocol::Response) -> &str {
    match r {
        protocol::Response::Refused(msg) => msg,
        other => panic!("{other:?}, wanted a refusal"),
    }
}

#[test]
fn store_session_queueing_past_its_limit_is_closed_with_every_answer_in_order() {
    use protocol::{Request, Response};
    let s = server();
    let setter = client(&s);
    setter.set("k", b"v").unwrap();
    let mut c = Sessions::connect(&s);
    c.open(1);
    c.open(2);
    c.send(1, Request::SetWill { key: "gone/1".into(), value: b"closed".to_vec() });
    assert_eq!(c.answer(), (1, Response::Ok));
    // Session 1 waits for a key never set and pipelines 65 gets behind it,
    // one more than it may queue.
    c.send(1, Request::Wait { keys: vec!["missing".into()], timeout_ms: 10_000 });
    for _ in 0..=super::server::MAX_QUEUED {
        c.send(1, get("k"));
    }
    c.send(2, get("k"));
    let (two, ones) = answers_until(&mut c, 2);
    assert_eq!(two, value(b"v"), "the connection's other sessions are served");
    // The key comes now: had the wait survived, this would answer it.
    setter.set("missing", b"").unwrap();
    c.send(1, get("k"));
    c.send(2, get("k"));
    let (two, more) = answers_until(&mut c, 2);
    assert_eq!(two, value(b"v"));
    let ones: Vec<Response> = ones
        .into_iter()
        .chain(more)
        .map(|(id, r)| {
            assert_eq!(id, 1);
            r
        })
        .collect();
    // One answer per request of session 1, in order: the wait's first
    // (the refusal that closed the session), then one per get, then the
    // get sent after the close, refused as not open.
    assert_eq!(ones.len(), 1 + super::server::MAX_QUEUED + 1 + 1, "{ones:?}");
    let first = refusal(&ones[0]);
    assert!(first.contains("session 1 sent 65 requests") && first.contains("the session is closed"), "{first}");
    for r in &ones[1..ones.len() - 1] {
        assert!(refusal(r).contains("not run: session 1 was closed"), "{r:?}");
    }
    assert!(refusal(ones.last().unwrap()).contains("session 1 is not open"));
    // Closing it set its will.
    assert_eq!(setter.get("gone/1").unwrap().as_deref(), Some(&b"closed"[..]));
}

#[test]
fn store_sessions_queue_at_most_a_few_mebibytes_per_connection() {
    use protocol::{Request, Response};
    let s = server();
    let mut c = Sessions::connect(&s);
    let budget = super::server::MAX_QUEUED_BYTES;
    let big = vec![7u8; budget / 4 - 1024];
    for id in [1, 2] {
        c.open(id);
        c.send(id, Request::Wait { keys: vec![format!("go/{id}")], timeout_ms: 10_000 });
    }
    // Session 1 queues three quarters of the budget, session 2 one quarter
    // (under it, with the keys), then one more set: over the budget, so the
    // session holding the most, 1, is closed (its wait refused, its sets
    // not run, in order), and session 2's set is queued.
    for i in 0..3 {
        c.send(1, set(&format!("one/{i}"), &big));
    }
    c.send(2, set("two/0", &big));
    c.send(2, set("two/1", &big));
    let (id, first) = c.answer();
    assert_eq!(id, 1);
    assert!(refusal(&first).contains("session 1 held the most") && refusal(&first).contains("closed"), "{first:?}");
    for _ in 0..3 {
        let (id, r) = c.answer();
        assert_eq!(id, 1);
        assert!(refusal(&r).contains("not run"), "{r:?}");
    }
    // Session 2 was left alone: its wait ends and its sets run, in order.
    let setter = client(&s);
    setter.set("go/2", b"").unwrap();
    for _ in 0..3 {
        assert_eq!(c.answer(), (2, Response::Ok));
    }
    assert_eq!(setter.get("two/1").unwrap().map(|v| v.len()), Some(big.len()));
    assert_eq!(setter.get("one/0").unwrap(), None, "a closed session's queue is not run");
    // One session alone past the budget is closed itself.
    c.open(4);
    c.send(4, Request::Wait { keys: vec!["go/4".into()], timeout_ms: 10_000 });
    for i in 0..5 {
        c.send(4, set(&format!("four/{i}"), &big));
    }
    let (id, r) = c.answer();
    assert_eq!(id, 4);
    assert!(refusal(&r).contains("session 4 sent 5 requests"), "{r:?}");
    for _ in 0..5 {
        assert!(refusal(&c.answer().1).contains("not run"));
    }
    // Its queue drained, the budget is free again: a new session queues as
    // much.
    c.open(3);
    c.send(3, Request::Wait { keys: vec!["go/3".into()], timeout_ms: 10_000 });
    for i in 0..3 {
        c.send(3, set(&format!("three/{i}"), &big));
    }
    setter.set("go/3", b"").unwrap();
    for _ in 0..4 {
        assert_eq!(c.answer(), (3, Response::Ok));
    }
}

/// A relay of `n` ranks to `s`, and a client over each rank's end.
fn relay(s: &StoreServer, n: usize) -> (StoreRelay, Vec<StoreClient>) {
    let addr = s.local_addr().to_string();
    let (relay, ends) = StoreRelay::start(&addr, SECRET, n, T).expect("start a relay");
    let clients = ends.into_iter().map(|e| StoreClient::over_relay(e, &addr, SECRET, T).unwrap()).collect();
    (relay, clients)
}

#[test]
fn store_relay_ranks_and_direct_ranks_meet_in_one_barrier() {
    let s = server();
    let (_relay, ranks) = relay(&s, 3);
    let direct = client(&s);
    // Ranks behind the relay and a direct one each publish an entry and
    // read the whole directory at one barrier.
    let mut threads = Vec::new();
    for (r, c) in ranks.into_iter().enumerate() {
        threads.push(std::thread::spawn(move || {
            c.set(&format!("addr/{r}"), format!("relayed {r}").as_bytes()).unwrap();
            let keys = ["addr/0", "addr/1", "addr/2", "addr/3"];
            let got = c.barrier_get("ready", 4, T, &keys).unwrap();
            assert!(c.add("count", 1).unwrap() > 0);
            got
        }));
    }
    direct.set("addr/3", b"direct 3").unwrap();
    let want: Vec<Option<Vec<u8>>> =
        (0..4).map(|r| Some(if r == 3 { b"direct 3".to_vec() } else { format!("relayed {r}").into_bytes() })).collect();
    assert_eq!(direct.barrier_get("ready", 4, T, &["addr/0", "addr/1", "addr/2", "addr/3"]).unwrap(), want);
    for t in threads {
        assert_eq!(t.join().unwrap(), want);
    }
    assert_eq!(direct.get("count").unwrap().as_deref(), Some(&b"3"[..]));
    // A client over a relay needs the secret too (for a direct duplicate).
    let end = std::os::unix::net::UnixStream::pair().unwrap().0;
    assert!(matches!(StoreClient::over_relay(end, "x", "", T), Err(StoreError::EmptySecret)));
}

#[test]
fn store_relay_rank_that_dies_is_withdrawn_and_its_will_set() {
    let s = server();
    let addr = s.local_addr().to_string();
    let (_relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let survivor = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let end = ends.pop().unwrap();
    let cut = end.try_clone().unwrap();
    let dying = StoreClient::over_relay(end, &addr, SECRET, T).unwrap();
    dying.set_will("gone/0", b"rank 0 vanished").unwrap();
    survivor.set_will("gone/1", b"rank 1 vanished").unwrap();
    let blocked = std::thread::spawn(move || dying.barrier("b", 3, T));
    wait_for(|| s.barrier_arrivals("b") == 1);
    // The rank's process dies while it waits: its end of the socket pair
    // closes (as the kernel closes it at exit).
    cut.shutdown(std::net::Shutdown::Both).unwrap();
    assert!(blocked.join().unwrap().is_err());
    let watcher = client(&s);
    watcher.wait(&["gone/0"], T).unwrap();
    assert_eq!(watcher.get("gone/0").unwrap().as_deref(), Some(&b"rank 0 vanished"[..]));
    wait_for(|| s.barrier_arrivals("b") == 0);
    assert_eq!(s.barrier_arrivals("b"), 0, "the dead rank no longer counts");
    // The other rank of the relay is untouched.
    assert_eq!(watcher.get("gone/1").unwrap(), None);
    survivor.set("alive", b"yes").unwrap();
    assert_eq!(watcher.get("alive").unwrap().as_deref(), Some(&b"yes"[..]));
    // Dropping the relay (the launcher exiting) ends its connection: the
    // wills of the sessions still open are set.
    drop(_relay);
    watcher.wait(&["gone/1"], T).unwrap();
}

#[test]
fn store_relay_losing_the_store_fails_every_rank_at_once() {
    let mut s = server();
    let (_relay, mut ranks) = relay(&s, 3);
    let idle = ranks.pop().unwrap();
    let waiting = ranks.pop().unwrap();
    let busy = ranks.pop().unwrap();
    busy.set("k", b"v").unwrap();
    let blocked = std::thread::spawn(move || waiting.barrier("b", 2, Duration::from_secs(60)));
    wait_for(|| s.barrier_arrivals("b") == 1);
    let start = Instant::now();
    s.shutdown();
    // The rank in the barrier is answered at once (not at its 60 s timeout),
    // and every rank's next call fails naming the store.
    let addr = s.local_addr().to_string();
    for err in [blocked.join().unwrap().unwrap_err(), busy.get("k").unwrap_err(), idle.set("x", b"y").unwrap_err()] {
        let msg = err.to_string();
        assert!(msg.contains(&addr), "{msg}");
        assert!(
            matches!(err, StoreError::Refused { .. } | StoreError::Disconnected { .. } | StoreError::Broken { .. }),
            "{msg}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(40), "took {:?}", start.elapsed());
    // Later calls fail too, rather than hang.
    assert!(busy.get("k").is_err() && idle.get("k").is_err());
}

#[test]
fn store_relay_checks_its_secret_and_the_ranks_requests() {
    let s = server();
    let addr = s.local_addr().to_string();
    // A relay with the wrong secret: each rank's first request fails with
    // the store's refusal, named.
    let (_bad, ends) = StoreRelay::start(&addr, "not the secret", 2, T).unwrap();
    for e in ends {
        let c = StoreClient::over_relay(e, &addr, SECRET, T).unwrap();
        let msg = c.get("k").unwrap_err().to_string();
        assert!(msg.contains("refused this client") && msg.contains(&addr), "{msg}");
    }
    // A relay to nothing fails to start within its timeout, naming the address.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let err = StoreRelay::start(&gone, SECRET, 1, Duration::from_millis(200)).unwrap_err();
    assert!(err.to_string().contains(&gone), "{err}");
    assert!(matches!(StoreRelay::start(&addr, "", 1, T), Err(StoreError::EmptySecret)));
    // A rank's frame over the relay's limit is refused and ends that rank
    // alone; its neighbour goes on.
    let (_relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let good = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let mut hostile = ends.pop().unwrap();
    use std::io::Write;
    hostile.write_all(&(u32::MAX).to_le_bytes()).unwrap();
    hostile.set_read_timeout(Some(T)).unwrap();
    let body = protocol::read_frame(&mut hostile).unwrap();
    match protocol::Response::decode(&body).unwrap() {
        protocol::Response::Refused(msg) => assert!(msg.contains("exceeds the store relay's limit"), "{msg}"),
        other => panic!("{other:?}"),
    }
    good.set("still", b"here").unwrap();
    assert_eq!(good.get("still").unwrap().as_deref(), Some(&b"here"[..]));
}

#[test]
fn store_relay_spawned_or_prepared_joins_the_store_behind_its_ranks_first_requests() {
    let s = server();
    let addr = s.local_addr().to_string();
    // The ranks write before the relay has joined the store (spawn returns
    // at once): their requests wait in their sockets, then are served.
    let (relay, ends) = StoreRelay::spawn(&addr, SECRET, 3, T).unwrap();
    let direct = client(&s);
    let mut threads = Vec::new();
    for (r, end) in ends.into_iter().enumerate() {
        let addr = addr.clone();
        threads.push(std::thread::spawn(move || {
            let c = StoreClient::over_relay(end, &addr, SECRET, T).unwrap();
            c.append("dir", format!("{r}\n").as_bytes()).unwrap();
            c.barrier_get("joined", 4, T, &["dir"]).unwrap()
        }));
    }
    direct.append("dir", b"3\n").unwrap();
    let got = direct.barrier_get("joined", 4, T, &["dir"]).unwrap();
    let mut lines: Vec<&str> = std::str::from_utf8(got[0].as_deref().unwrap()).unwrap().lines().collect();
    lines.sort();
    assert_eq!(lines, ["0", "1", "2", "3"]);
    for t in threads {
        assert_eq!(t.join().unwrap(), got);
    }
    drop(relay);

    // Prepared first, joined later: a request sent before the join is
    // answered once the relay has joined; one prepared and dropped unjoined
    // leaves its rank an end of stream (its client fails, it does not hang).
    let (unjoined, mut ends) = StoreRelay::prepare(&addr, SECRET, 2).unwrap();
    let early = StoreClient::over_relay(ends.remove(0), &addr, SECRET, T).unwrap();
    let sent = std::thread::spawn(move || early.set("early", b"before the join").map(|()| early));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(direct.get("early").unwrap(), None);
    let _joined = unjoined.join(T).unwrap();
    let early = sent.join().unwrap().unwrap();
    assert_eq!(direct.get("early").unwrap().as_deref(), Some(&b"before the join"[..]));
    assert_eq!(early.get("early").unwrap().as_deref(), Some(&b"before the join"[..]));
    let (never, ends) = StoreRelay::prepare(&addr, SECRET, 1).unwrap();
    drop(never);
    let orphan = StoreClient::over_relay(ends.into_iter().next().unwrap(), &addr, SECRET, T).unwrap();
    assert!(orphan.get("k").is_err());

    // A wrong secret, or no store at all: each rank's first request is
    // answered with a refusal saying why, naming the store's address.
    let (_bad, ends) = StoreRelay::spawn(&addr, "not the secret", 2, T).unwrap();
    for e in ends {
        let c = StoreClient::over_relay(e, &addr, SECRET, T).unwrap();
        let msg = c.get("k").unwrap_err().to_string();
        assert!(msg.contains("refused this client") && msg.contains(&addr), "{msg}");
    }
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (_none, ends) = StoreRelay::spawn(&gone, SECRET, 2, Duration::from_millis(200)).unwrap();
    for e in ends {
        let c = StoreClient::over_relay(e, &gone, SECRET, T).unwrap();
        let msg = c.set("k", b"v").unwrap_err().to_string();
        assert!(msg.contains("could not join the store") && msg.contains(&gone), "{msg}");
    }
    // A batch sent to a relay that could not join gets the reason too, not
    // the end of stream behind the refusal of its first request.
    let (_none, mut ends) = StoreRelay::spawn(&gone, SECRET, 1, Duration::from_millis(200)).unwrap();
    let c = StoreClient::over_relay(ends.remove(0), &gone, SECRET, T).unwrap();
    let msg = c.append_each(&[("a", b"1"), ("b", b"2")]).unwrap_err().to_string();
    assert!(msg.contains("could not join the store") && msg.contains(&gone), "{msg}");
    assert!(matches!(StoreRelay::spawn(&addr, "", 1, T), Err(StoreError::EmptySecret)));
    // Dropping a relay still joining a store that never answers returns at
    // once (its thread stops when its handshake gives up).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let (stuck, _ends) = StoreRelay::spawn(&silent_addr, SECRET, 1, Duration::from_secs(60)).unwrap();
    let began = std::time::Instant::now();
    drop(stuck);
    // Waiting for the thread would take its whole try (10 s).
    assert!(began.elapsed() < Duration::from_secs(5), "{:?}", began.elapsed());
}

#[test]
fn store_relay_closes_the_session_of_a_rank_that_exited_while_its_socket_is_held() {
    use std::io::Read;
    let s = server();
    let addr = s.local_addr().to_string();
    let (relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let neighbour = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let end = ends.pop().unwrap();
    // A process the rank started still holds its socket.
    let mut held = end.try_clone().unwrap();
    let rank = StoreClient::over_relay(end, &addr, SECRET, T).unwrap();
    rank.set_will("gone/0", b"rank 0 exited").unwrap();
    neighbour.set_will("gone/1", b"rank 1 exited").unwrap();
    let blocked = std::thread::spawn(move || rank.barrier("b", 3, T));
    wait_for(|| s.barrier_arrivals("b") == 1);
    let watcher = client(&s);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(watcher.get("gone/0").unwrap(), None, "the socket is still open: no end of stream");
    // The launcher saw the rank's process exit.
    relay.rank_exited(0..1);
    watcher.wait(&["gone/0"], T).unwrap();
    assert_eq!(watcher.get("gone/0").unwrap().as_deref(), Some(&b"rank 0 exited"[..]));
    wait_for(|| s.barrier_arrivals("b") == 0);
    // The relay closed its end: the holder reads the end of stream, and the
    // blocked call fails.
    held.set_read_timeout(Some(T)).unwrap();
    assert_eq!(held.read_to_end(&mut Vec::new()).unwrap(), 0);
    assert!(blocked.join().unwrap().is_err());
    // Its neighbour is untouched; an end already closed, or out of range,
    // is ignored.
    relay.rank_exited(0..1);
    relay.rank_exited(7..9);
    neighbour.set("alive", b"yes").unwrap();
    assert_eq!(watcher.get("gone/1").unwrap(), None);
    assert_eq!(watcher.get("alive").unwrap().as_deref(), Some(&b"yes"[..]));
}

#[test]
fn store_relay_connects_again_when_the_store_drops_it_before_its_verdict() {
    let s = server();
    // Dropped once after its proof (a reset), then let through: the relay
    // connects again and its ranks are served.
    let proxy = dropping_proxy(s.local_addr(), vec![true, false]).to_string();
    let (_relay, ends) = StoreRelay::start(&proxy, SECRET, 2, T).unwrap();
    let ranks: Vec<StoreClient> =
        ends.into_iter().map(|e| StoreClient::over_relay(e, &proxy, SECRET, T).unwrap()).collect();
    assert_eq!(ranks[0].add("n", 1).unwrap(), 1);
    assert_eq!(ranks[1].add("n", 1).unwrap(), 2);
    // Dropped many times (more than a client's own retries): it goes on
    // connecting while its time lasts, and its ranks are served.
    let proxy = dropping_proxy(s.local_addr(), vec![false; 8]).to_string();
    let (_relay, mut ends) = StoreRelay::spawn(&proxy, SECRET, 1, T).unwrap();
    let rank = StoreClient::over_relay(ends.remove(0), &proxy, SECRET, T).unwrap();
    assert_eq!(rank.add("n", 1).unwrap(), 3);
    // A store that keeps dropping it: starting fails when its time is up,
    // saying so.
    let proxy = dropping_proxy(s.local_addr(), vec![false; 10_000]).to_string();
    let err = StoreRelay::start(&proxy, SECRET, 1, Duration::from_millis(800)).unwrap_err();
    assert!(matches!(err, StoreError::HandshakeDropped { .. }), "{err}");
    assert!(err.to_string().contains(&proxy), "{err}");
}

/// A proxy to `store` that holds every connection `delay` before it passes
/// anything either way.
fn delaying_proxy(store: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { return };
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                if let Ok(upstream) = std::net::TcpStream::connect(store) {
                    pipe_both_ways(client, upstream);
                }
            });
        }
    });
    addr
}

#[test]
fn a_rank_that_exits_before_its_relay_joined_has_its_will_set_once_it_joins() {
    // The store lets the relay in late: one rank sends its will and exits
    // meanwhile (its end closed, the launcher says so); once the relay has
    // joined, the will reaches the store and is set (the session closed),
    // and the other rank is served.
    let s = server();
    let proxy = delaying_proxy(s.local_addr(), Duration::from_millis(400)).to_string();
    let (relay, mut ends) = StoreRelay::spawn(&proxy, SECRET, 2, T).unwrap();
    let survivor = StoreClient::over_relay(ends.pop().unwrap(), &proxy, SECRET, T).unwrap();
    let end = ends.pop().unwrap();
    let cut = end.try_clone().unwrap();
    let dying = StoreClient::over_relay(end, &proxy, SECRET, T).unwrap();
    let will = std::thread::spawn(move || dying.set_will("gone/0", b"rank 0 exited early"));
    std::thread::sleep(Duration::from_millis(100));
    cut.shutdown(std::net::Shutdown::Write).unwrap();
    relay.rank_exited(0..1);
    let watcher = client(&s);
    watcher.wait(&["gone/0"], T).unwrap();
    assert_eq!(watcher.get("gone/0").unwrap().as_deref(), Some(&b"rank 0 exited early"[..]));
    assert_eq!(survivor.add("n", 1).unwrap(), 1);
    let _ = will.join().unwrap();
}

#[test]
fn a_relay_dropped_while_it_joins_still_passes_on_what_exited_ranks_sent() {
    // The launcher's attempt ends (every rank exited, the relay dropped)
    // before a slow store let the relay in: the whole requests the ranks
    // had sent still reach the store once it does.
    let s = server();
    let proxy = delaying_proxy(s.local_addr(), Duration::from_millis(500)).to_string();
    let (relay, mut ends) = StoreRelay::spawn(&proxy, SECRET, 1, T).unwrap();
    let rank = StoreClient::over_relay(ends.remove(0), &proxy, SECRET, T).unwrap();
    let sent = std::thread::spawn(move || rank.set("last words", b"sent before the join"));
    std::thread::sleep(Duration::from_millis(100));
    relay.rank_exited(0..1);
    drop(relay);
    let direct = client(&s);
    let began = std::time::Instant::now();
    while direct.get("last words").unwrap().is_none() && began.elapsed() < T {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(direct.get("last words").unwrap().as_deref(), Some(&b"sent before the join"[..]));
    // The rank's own wait ends (its end is closed), it does not hang.
    let _ = sent.join().unwrap();
}

#[test]
fn store_relay_stops_reading_a_rank_that_sends_without_reading_its_answers() {
    use std::io::{Read, Write};
    let s = server();
    let addr = s.local_addr().to_string();
    let big = vec![5u8; 64];
    client(&s).set("k", &big).unwrap();
    let (_relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let neighbour = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let mut greedy = ends.pop().unwrap();
    greedy.set_nonblocking(true).unwrap();
    let request = framed(&get("k").encode());
    let batch = request.repeat(1000);
    // It writes requests and reads nothing, until its writes have blocked
    // for half a second or 16 MiB went out.
    let mut written = 0usize;
    let mut blocked_since: Option<Instant> = None;
    while written < 16 << 20 && blocked_since.is_none_or(|t| t.elapsed() < Duration::from_millis(500)) {
        let at = written % batch.len();
        match greedy.write(&batch[at..]) {
            Ok(n) => {
                written += n;
                blocked_since = None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                blocked_since.get_or_insert_with(Instant::now);
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(written < 4 << 20, "the relay read {written} bytes of requests whose answers were not read");
    // Meanwhile its neighbour is served.
    neighbour.set("x", b"y").unwrap();
    assert_eq!(neighbour.get("x").unwrap().as_deref(), Some(&b"y"[..]));
    // Once it reads, the relay reads on: every request is answered, in
    // order, and the rank goes on.
    greedy.set_nonblocking(false).unwrap();
    greedy.set_read_timeout(Some(T)).unwrap();
    let mut writer = greedy.try_clone().unwrap();
    let rest = request.len() - written % request.len();
    let tail = if rest == request.len() { Vec::new() } else { request[request.len() - rest..].to_vec() };
    let count = written.div_ceil(request.len());
    let finishing = std::thread::spawn(move || {
        writer.write_all(&tail).unwrap();
        writer.write_all(&framed(&set("after", b"1").encode())).unwrap();
    });
    for _ in 0..count {
        let body = protocol::read_frame(&mut greedy).unwrap();
        assert_eq!(protocol::Response::decode(&body).unwrap(), value(&big));
    }
    let body = protocol::read_frame(&mut greedy).unwrap();
    assert_eq!(protocol::Response::decode(&body).unwrap(), protocol::Response::Ok);
    finishing.join().unwrap();
    let mut none = [0u8; 1];
    greedy.set_nonblocking(true).unwrap();
    assert!(matches!(greedy.read(&mut none), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock));
}

/// A rank that asks for a large value many times at once and reads none
/// of the answers: the relay holds one answer for it, not all of them (it
/// once held every one: its launcher grew to 949 MB for 20 gets of
/// 30 MiB), while its neighbour's round trips go on; once the rank reads,
/// every answer comes, in order.
#[test]
fn store_relay_holds_at_most_its_budget_for_a_rank_that_does_not_read() {
    use std::io::Write;
    let s = server();
    let addr = s.local_addr().to_string();
    let big: Vec<u8> = (0..8 << 20).map(|i| (i % 241) as u8).collect();
    client(&s).set("big", &big).unwrap();
    let (relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let neighbour = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let mut hoarder = ends.pop().unwrap();
    const GETS: usize = 24;
    hoarder.write_all(&framed(&get("big").encode()).repeat(GETS)).unwrap();
    // The first answer comes (more than the sockets hold), and is held.
    wait_for(|| relay.peak_held() >= big.len());
    // The neighbour's round trips go on meanwhile (each behind whatever the
    // store answered the hoarder before it).
    for i in 1..=20 {
        assert_eq!(neighbour.add("n", 1).unwrap(), i);
    }
    assert_eq!(neighbour.get("big").unwrap().map(|v| v.len()), Some(big.len()));
    let peak = relay.peak_held();
    assert!(peak <= super::MAX_RELAY_HELD, "held {peak} bytes for one rank, over {}", super::MAX_RELAY_HELD);
    assert!(peak < 2 * big.len(), "held {peak} bytes for a rank that read none of its answers of {}", big.len());
    // Once it reads, every answer comes, in order, one at a time.
    hoarder.set_read_timeout(Some(T)).unwrap();
    for _ in 0..GETS {
        let body = protocol::read_frame(&mut hoarder).unwrap();
        assert_eq!(protocol::Response::decode(&body).unwrap(), value(&big));
    }
    assert!(relay.peak_held() < 2 * big.len(), "held {} bytes", relay.peak_held());
}

/// A rank's end that shuts its writing side (`shutdown(SHUT_WR)`) without
/// reading is not a rank that exited: it may still read, so its requests
/// keep to its budget (the relay once passed them all on at once, whatever
/// the budget: thousands of gets of a large value, all answered into the
/// relay's memory), and once it reads it gets every answer, in order, then
/// the end.
#[test]
fn store_relay_keeps_to_the_budget_of_a_rank_that_shut_its_writing_side() {
    use std::io::{Read, Write};
    let s = server();
    let addr = s.local_addr().to_string();
    let big: Vec<u8> = (0..8 << 20).map(|i| (i % 239) as u8).collect();
    let direct = client(&s);
    direct.set("big", &big).unwrap();
    let (relay, mut ends) = StoreRelay::start(&addr, SECRET, 2, T).unwrap();
    let neighbour = StoreClient::over_relay(ends.pop().unwrap(), &addr, SECRET, T).unwrap();
    let mut hoarder = ends.pop().unwrap();
    const GETS: i64 = 8;
    let add = framed(&protocol::Request::Add { key: "h".into(), delta: 1 }.encode());
    let sent: Vec<u8> = (0..GETS).flat_map(|_| [framed(&get("big").encode()), add.clone()].concat()).collect();
    hoarder.write_all(&sent).unwrap();
    // The first answer is held (the hoarder reads none), then it hangs up.
    wait_for(|| relay.peak_held() >= big.len());
    hoarder.shutdown(std::net::Shutdown::Write).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    for i in 1..=20 {
        assert_eq!(neighbour.add("n", 1).unwrap(), i);
    }
    assert_eq!(direct.get("h").unwrap(), None, "requests behind an unread answer went to the store");
    let peak = relay.peak_held();
    assert!(peak <= super::MAX_RELAY_HELD, "held {peak} bytes for one rank, over {}", super::MAX_RELAY_HELD);
    assert!(peak < 2 * big.len(), "held {peak} bytes for a rank that read none of its answers of {}", big.len());
    hoarder.set_read_timeout(Some(T)).unwrap();
    for i in 1..=GETS {
        let body = protocol::read_frame(&mut hoarder).unwrap();
        assert_eq!(protocol::Response::decode(&body).unwrap(), value(&big), "answer to get {i}");
        let body = protocol::read_frame(&mut hoarder).unwrap();
        assert_eq!(protocol::Response::decode(&body).unwrap(), protocol::Response::Int(i));
    }
    assert_eq!(hoarder.read(&mut [0u8; 1]).unwrap(), 0, "its end closes once every answer is read");
    assert!(relay.peak_held() < 2 * big.len(), "held {} bytes", relay.peak_held());
}

#[test]
fn store_relay_refuses_an_oversized_frame_behind_the_answers_in_flight() {
    use std::io::{Read, Write};
    let s = server();
    let addr = s.local_addr().to_string();
    // An answer larger than the socket holds: it is written in pieces.
    let big: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    client(&s).set("big", &big).unwrap();
    let (_relay, mut ends) = StoreRelay::start(&addr, SECRET, 1, T).unwrap();
    let mut rank = ends.pop().unwrap();
    // A get, and behind it a frame over the relay's limit, before reading.
    let mut sent = framed(&get("big").encode());
    sent.extend_from_slice(&u32::MAX.to_le_bytes());
    rank.write_all(&sent).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    rank.set_read_timeout(Some(T)).unwrap();
    // The get's whole answer first, then the refusal, then the end.
    let body = protocol::read_frame(&mut rank).unwrap();
    assert_eq!(protocol::Response::decode(&body).unwrap(), value(&big));
    let body = protocol::read_frame(&mut rank).unwrap();
    match protocol::Response::decode(&body).unwrap() {
        protocol::Response::Refused(msg) => assert!(msg.contains("exceeds the store relay's limit"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(rank.read(&mut [0u8; 1]).unwrap(), 0);
}

#[test]
fn store_rank_descriptor_is_checked() {
    // Not an open descriptor, and not a socket: clear errors naming the
    // variable (the first call of a process takes COHORT_STORE_FD; these
    // check the descriptor alone).
    let msg = super::rank_sockets::relay_socket(1 << 20).unwrap_err().to_string();
    assert!(msg.contains("descriptor 1048576 of COHORT_STORE_FD") && msg.contains("Bad file descriptor"), "{msg}");
    let file = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::IntoRawFd;
    let fd = file.into_raw_fd();
    let msg = super::rank_sockets::relay_socket(fd).unwrap_err().to_string();
    assert!(msg.contains(&format!("descriptor {fd} of COHORT_STORE_FD")) && msg.contains("non-socket"), "{msg}");
    // SAFETY: `fd` is the /dev/null descriptor opened above, owned here.
    unsafe { libc::close(fd) };
    // Open, a socket, but not one of a socket pair: refused too.
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    use std::os::fd::AsRawFd;
    let msg = super::rank_sockets::relay_socket(tcp.as_raw_fd()).unwrap_err().to_string();
    assert!(msg.contains("not a Unix-domain socket"), "{msg}");
    // A relayed client's address is the store's, host:port (what a rank
    // finds its own address for other nodes from), not the text errors show.
    let (end, _relay_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let relayed = StoreClient::over_relay(end, "10.1.2.3:29500", SECRET, T).unwrap();
    assert_eq!(relayed.addr().parse::<std::net::SocketAddr>().unwrap().port(), 29500);
    // What a process takes of the list: nothing when its first descriptor
    // is closed (the list was inherited from a rank by a program it
    // started); the sockets made for it, marked close-on-exec.
    use super::rank_sockets::claim_relay_sockets;
    assert!(claim_relay_sockets(vec![1 << 20, 1 << 20 | 1]).fds.is_empty());
    // Nor when the number is some other file's (reused in a program the
    // rank started): not taken, and its flags left as they were.
    let other = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: clearing FD_CLOEXEC on a descriptor this test owns.
    unsafe { libc::fcntl(other.as_raw_fd(), libc::F_SETFD, 0) };
    assert!(claim_relay_sockets(vec![other.as_raw_fd()]).fds.is_empty());
    // SAFETY: F_GETFD reads the flags of a descriptor this test owns.
    assert_eq!(unsafe { libc::fcntl(other.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC, 0);
    let (mine, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    let claim = claim_relay_sockets(vec![mine.as_raw_fd()]);
    assert_eq!(claim.fds, [mine.as_raw_fd()]);
    // SAFETY: F_GETFD reads the flags of a descriptor this test owns.
    let flags = unsafe { libc::fcntl(mine.as_raw_fd(), libc::F_GETFD) };
    assert!(flags & libc::FD_CLOEXEC != 0, "a claimed relay socket is closed on exec");
    // One claim at a time: while it is held, another process of the rank
    // (here a second claim) gets none and connects directly; once the
    // holder is gone (a program of the rank that exited), the next takes
    // them.
    assert!(claim_relay_sockets(vec![mine.as_raw_fd()]).fds.is_empty(), "claimed twice at once");
    drop(claim);
    assert_eq!(claim_relay_sockets(vec![mine.as_raw_fd()]).fds, [mine.as_raw_fd()]);
    // The variable holds a list of descriptors; anything else is an error
    // naming it.
    use cohort_runtime::config::STORE_FD;
    assert_eq!(STORE_FD.parse_value(std::ffi::OsStr::new("5")), Ok(vec![5]));
    assert_eq!(STORE_FD.parse_value(std::ffi::OsStr::new("5, 6,7")), Ok(vec![5, 6, 7]));
    for bad in ["five", "5,", "-1", "5,,6", "0", "2,5", "5,6,5", "99999999999"] {
        let msg = STORE_FD.parse_value(std::ffi::OsStr::new(bad)).unwrap_err().to_string();
        assert!(msg.starts_with(&format!("COHORT_STORE_FD=\"{bad}\"")), "{bad}: {msg}");
    }
}

/// The environment variable that makes
/// [`store_server_grows_the_descriptor_table_child`] run (in the fresh
/// process [`store_server_grows_the_descriptor_table_before_clients_come`]
/// starts).
#[cfg(target_os = "linux")]
const DESCRIPTORS_CHILD: &str = "STORE_DESCRIPTORS_CHILD";

/// A store grows its process's descriptor table for its clients once, at
/// bind, instead of doubling it while they connect (in a process of several
/// threads each doubling waited for an RCU grace period, which held every
/// greeting of a burst of connections tens of milliseconds). Checked in a
/// fresh process of this test binary, whose table is still small.
#[cfg(target_os = "linux")]
#[test]
fn store_server_grows_the_descriptor_table_before_clients_come() {
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["store::tests::store_server_grows_the_descriptor_table_child", "--exact", "--ignored", "--nocapture"])
        .env(DESCRIPTORS_CHILD, "1")
        .output()
        .expect("run this test binary again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}

#[cfg(target_os = "linux")]
#[test]
#[ignore = "run in a fresh process by store_server_grows_the_descriptor_table_before_clients_come"]
fn store_server_grows_the_descriptor_table_child() {
    if std::env::var_os(DESCRIPTORS_CHILD).is_none() {
        return;
    }
    let table = || descriptors::descriptor_table_size().expect("FDSize in /proc/self/status");
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `limit`, which outlives the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    let wanted = (descriptors::STORE_RESERVE as u64).min(limit.rlim_cur) as usize;
    let before = table();
    assert!(before < wanted, "the table already holds {before} descriptors of the {wanted} a store reserves");
    let mut s = server();
    s.wait_descriptors_reserved();
    let after = table();
    assert!(after >= wanted, "the table holds {after} descriptors after bind, {wanted} were reserved");
    // The store serves as before.
    let c = client(&s);
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    // Room for as many again as the table holds (up to the soft limit).
    let held = reserve_descriptors(after).expect("reserve");
    assert!(table() >= held, "reserved {held}, the table holds {}", table());
    if (limit.rlim_cur as usize) > after {
        assert!(held > after, "reserved {held} past a table of {after}, soft limit {}", limit.rlim_cur);
    }
}

/// The environment variable that makes [`store_relay_claim_child`] run,
/// holding the child's name.
const CLAIM_CHILD: &str = "STORE_RELAY_CLAIM_CHILD";

/// Runs [`store_relay_claim_child`] named `name` in a fresh process of
/// this test binary that inherits the rank's relay socket `fd` (as
/// `COHORT_STORE_FD`), as a rank's program does; it starts once `go`
/// exists.
fn claim_child(name: &str, go: &std::path::Path, addr: &str, fd: std::os::fd::RawFd) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args(["store::tests::store_relay_claim_child", "--exact", "--ignored", "--nocapture"])
        .env(CLAIM_CHILD, name)
        .env("CLAIM_CHILD_GO", go)
        .env("CLAIM_CHILD_STORE", addr)
        .env("COHORT_STORE_FD", fd.to_string())
        .env_remove("COHORT_LOG")
        .env_remove("RUST_LOG");
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls fcntl (async-signal-safe) on the rank's end, which the child
    // inherits as a rank does from its launcher.
    unsafe {
        cmd.pre_exec(move || {
            libc::fcntl(fd, libc::F_SETFD, 0);
            Ok(())
        });
    }
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    cmd.spawn().expect("run this test binary again")
}

/// Two programs that one rank runs one after the other (`prog1; prog2`,
/// `until prog; do sleep 1; done`): the first sends a `wait` through the
/// rank's relay socket and is killed before its answer comes; the answer
/// then sits in the socket (the rank's shell holds it open, as this test
/// does). The second takes the socket and never reads that stale answer
/// as its own: every answer it gets is right (it once got "unexpected
/// answer Ok" for its first add).
#[test]
fn store_a_program_killed_mid_request_leaves_no_answer_to_the_next_program_of_its_rank() {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let s = server();
    let addr = s.local_addr().to_string();
    let (_relay, ends) = StoreRelay::start(&addr, SECRET, 1, T).unwrap();
    let fd = ends[0].as_raw_fd();
    let go = std::env::temp_dir().join(format!("cohort-claim-seq-{}", std::process::id()));
    std::fs::write(&go, b"").unwrap();
    let mut first = claim_child("waits", &go, &addr, fd);
    let lines = std::io::BufReader::new(first.stdout.take().unwrap()).lines();
    let said = lines.map_while(|l| l.ok()).find(|l| l.contains("claim child:"));
    assert_eq!(said.as_deref(), Some("claim child: relayed"), "the first program takes the rank's relay socket");
    // Its wait is on its way (sent right after that line); kill it before
    // the answer, then let the answer come.
    std::thread::sleep(Duration::from_millis(500));
    first.kill().unwrap();
    first.wait().unwrap();
    client(&s).set("late", b"1").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let out = claim_child("b", &go, &addr, fd).wait_with_output().unwrap();
    let _ = std::fs::remove_file(&go);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
    assert!(text.contains("claim child: relayed"), "the second program takes the relay socket too: {text}");
}

/// A program of a rank killed half-way through writing a request leaves
/// half a frame in the rank's relay socket: the next program of the rank
/// does not use that socket (its first request would be read as the rest
/// of the dead one's), but connects to the store directly, and all its
/// answers are right.
#[test]
fn store_a_half_written_request_in_a_rank_relay_socket_makes_the_next_program_connect_directly() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let s = server();
    let addr = s.local_addr().to_string();
    let (_relay, mut ends) = StoreRelay::start(&addr, SECRET, 1, T).unwrap();
    let fd = ends[0].as_raw_fd();
    // A frame of 30 bytes of which 5 came (the first is no request's tag).
    let mut half = 30u32.to_le_bytes().to_vec();
    half.extend_from_slice(&[0xee; 5]);
    ends[0].write_all(&half).unwrap();
    let go = std::env::temp_dir().join(format!("cohort-claim-half-{}", std::process::id()));
    std::fs::write(&go, b"").unwrap();
    let out = claim_child("b", &go, &addr, fd).wait_with_output().unwrap();
    let _ = std::fs::remove_file(&go);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
    assert!(text.contains("claim child: direct"), "the program leaves the socket and connects directly: {text}");
}

/// Two programs that one rank runs at once (`sh -c "prog & prog; wait"`)
/// both inherit its relay sockets: exactly one takes them and the other
/// connects to the store directly, so neither ever reads the other's
/// answers (they once crossed: "unexpected answer Int(2)", then a hang).
/// Two fresh processes of this test binary, started together, hammer the
/// store through one rank's `COHORT_STORE_FD`.
#[test]
fn store_two_programs_of_one_rank_never_share_its_relay_sockets() {
    use std::os::fd::AsRawFd;
    let s = server();
    let addr = s.local_addr().to_string();
    let (_relay, ends) = StoreRelay::start(&addr, SECRET, 1, T).unwrap();
    let fd = ends[0].as_raw_fd();
    let go = std::env::temp_dir().join(format!("cohort-claim-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let children: Vec<_> = ["a", "b"].into_iter().map(|name| claim_child(name, &go, &addr, fd)).collect();
    std::fs::write(&go, b"").unwrap();
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success() && text.contains("1 passed"), "{text}");
            text
        })
        .collect();
    let _ = std::fs::remove_file(&go);
    let relayed = outs.iter().filter(|t| t.contains("claim child: relayed")).count();
    let direct = outs.iter().filter(|t| t.contains("claim child: direct")).count();
    assert_eq!((relayed, direct), (1, 1), "one program takes the relay, the other connects directly: {outs:?}");
}

#[test]
#[ignore = "run in a fresh process by store_two_programs_of_one_rank_never_share_its_relay_sockets"]
fn store_relay_claim_child() {
    let Some(name) = std::env::var_os(CLAIM_CHILD) else { return };
    let name = name.to_string_lossy().into_owned();
    let go = std::env::var_os("CLAIM_CHILD_GO").expect("CLAIM_CHILD_GO");
    let addr = std::env::var("CLAIM_CHILD_STORE").expect("CLAIM_CHILD_STORE");
    // Both start together: each waits for the go.
    wait_for(|| std::path::Path::new(&go).exists());
    let c = StoreClient::connect_rank(&addr, SECRET, T).unwrap();
    let how = if format!("{c:?}").contains("through this node's relay") { "relayed" } else { "direct" };
    println!("claim child: {how}");
    if name == "waits" {
        // Killed while it waits (see the test above).
        c.wait(&["late"], Duration::from_secs(60)).unwrap();
        panic!("the program that waits was to be killed before its answer");
    }
    for i in 1..=300i64 {
        assert_eq!(c.add(&format!("count/{name}"), 1).unwrap(), i, "{name} ({how})");
        let mine = format!("{name}/{i}");
        c.set(&format!("last/{name}"), mine.as_bytes()).unwrap();
        assert_eq!(c.get(&format!("last/{name}")).unwrap().as_deref(), Some(mine.as_bytes()), "{name} ({how})");
    }
}
