//! Two programs that one rank runs at once (`cohort run -- sh -c "prog &
//! prog"`) both inherit the rank's node relay sockets (`COHORT_STORE_FD`):
//! exactly one takes them and the other connects to the store directly,
//! so neither reads the other's answers (they once crossed, "unexpected
//! answer Int(2)", and the job hung to its timeout 4 runs of 5). Two
//! programs that one rank runs one after the other, the first killed
//! before an answer came, never cross answers either.

mod common;

use std::time::Duration;

use cohort_comm::store::StoreClient;
use common::*;

/// Set in the programs the job runs: [`relay_claim_probe`] does its work.
const PROBE: &str = "RELAY_CLAIM_PROBE";

#[test]
fn two_programs_of_one_rank_get_their_own_store_answers() {
    let me = std::env::current_exe().expect("this test binary");
    let probe = format!("{} relay_claim_probe --exact --ignored --nocapture", me.display());
    // Both programs at once; the shell fails when either does.
    let script = format!("{probe} & first=$!; {probe}; second=$?; wait $first || exit 1; exit $second");
    let mut cmd = cohort_run_program("sh", &["-n", "2", "--no-python"], &["-c", &script]);
    cmd.env(PROBE, "1").env("OMP_NUM_THREADS", "1");
    let out = output_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    for rank in 0..2 {
        let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with(&format!("[rank {rank}]"))).collect();
        let said = |how: &str| lines.iter().filter(|l| l.contains(&format!("relay claim probe: {how}"))).count();
        assert_eq!((said("relayed"), said("direct")), (1, 1), "rank {rank}: {stdout}");
        assert_eq!(lines.iter().filter(|l| l.contains("1 passed")).count(), 2, "rank {rank}: {stdout}");
    }
}

#[test]
#[ignore = "run by two_programs_of_one_rank_get_their_own_store_answers, as a program of a rank"]
fn relay_claim_probe() {
    if std::env::var_os(PROBE).is_none() {
        return;
    }
    let store = rank_store(Duration::from_secs(30));
    let how = path(&store);
    println!("relay claim probe: {how}");
    let me = format!("{}/{}", std::env::var("RANK").expect("RANK"), std::process::id());
    round_trips(&store, &me, 300);
}

/// Set in the programs of [`a_program_after_one_killed_mid_request_gets_its_own_store_answers`]:
/// what the probe does (`waits` or `after`).
const SEQ_PROBE: &str = "RELAY_SEQ_PROBE";

/// A rank runs one program, then another (`prog1; prog2`, `until prog;
/// do sleep 1; done`): the first sends a `wait` through the rank's relay
/// socket and is killed before its answer; the answer comes later, into
/// the socket the rank's shell still holds. The second program takes the
/// socket and gets its own answers, never that stale one (it got
/// "unexpected answer WaitTimeout" for its first add).
#[test]
fn a_program_after_one_killed_mid_request_gets_its_own_store_answers() {
    let me = std::env::current_exe().expect("this test binary");
    let probe = format!("{} relay_seq_probe --exact --ignored --nocapture", me.display());
    let mark = std::env::temp_dir().join(format!("cohort-relay-seq-{}", std::process::id()));
    let mark = mark.display();
    let script = format!(
        "rm -f {mark}.$RANK; RELAY_SEQ_PROBE=waits {probe} & first=$!; \
         while [ ! -e {mark}.$RANK ]; do sleep 0.1; done; kill -9 $first; wait $first; rm -f {mark}.$RANK; \
         RELAY_SEQ_PROBE=after {probe}"
    );
    let mut cmd = cohort_run_program("sh", &["-n", "2", "--no-python"], &["-c", &script]);
    cmd.env("RELAY_SEQ_MARK", mark.to_string()).env("OMP_NUM_THREADS", "1");
    let out = output_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    for rank in 0..2 {
        let said = |what: &str| {
            stdout.lines().filter(|l| l.starts_with(&format!("[rank {rank}]")) && l.contains(what)).count()
        };
        assert_eq!(said("relay seq probe waits: relayed"), 1, "rank {rank}: {stdout}");
        assert_eq!(said("relay seq probe after: relayed"), 1, "rank {rank}: {stdout}");
        assert_eq!(said("1 passed"), 1, "rank {rank}: {stdout}");
    }
}

#[test]
#[ignore = "run by a_program_after_one_killed_mid_request_gets_its_own_store_answers, as a program of a rank"]
fn relay_seq_probe() {
    let Some(mode) = std::env::var_os(SEQ_PROBE) else { return };
    let mode = mode.to_string_lossy().into_owned();
    let store = rank_store(Duration::from_secs(30));
    let how = path(&store);
    println!("relay seq probe {mode}: {how}");
    let rank = std::env::var("RANK").expect("RANK");
    if mode == "waits" {
        // A wait whose answer (a timeout) comes after this program is
        // killed, once the shell sees the mark.
        let key = format!("never/{rank}");
        std::thread::spawn(move || store.wait(&[&key], Duration::from_secs(4)));
        std::thread::sleep(Duration::from_millis(300));
        let mark = std::env::var("RELAY_SEQ_MARK").expect("RELAY_SEQ_MARK");
        std::fs::write(format!("{mark}.{rank}"), b"").expect("write the mark");
        std::thread::sleep(Duration::from_secs(60));
        panic!("the program that waits was to be killed");
    }
    round_trips(&store, &rank, 50);
}

/// Set in the rank of [`a_forked_child_of_a_rank_gets_its_own_store_answers`].
const FORK_PROBE: &str = "RELAY_FORK_PROBE";

/// A rank that forks (no exec) after it reached the store through its relay:
/// the child has a copy of the rank's unclaimed relay sockets in memory and
/// the rank's client. Its own client must be its own (it connects directly:
/// the relay sockets are the rank's), and the rank's client used in the
/// child is refused, naming the fork, instead of reading the rank's answers.
#[test]
fn a_forked_child_of_a_rank_gets_its_own_store_answers() {
    let me = std::env::current_exe().expect("this test binary");
    let me = me.to_str().expect("a UTF-8 path");
    let args = ["relay_fork_probe", "--exact", "--ignored", "--nocapture", "--test-threads=1"];
    let mut cmd = cohort_run_program(me, &["-n", "2", "--no-python"], &args);
    cmd.env(FORK_PROBE, "1").env("OMP_NUM_THREADS", "1");
    let out = output_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    for rank in 0..2 {
        let said = |what: &str| {
            stdout.lines().filter(|l| l.starts_with(&format!("[rank {rank}]")) && l.contains(what)).count()
        };
        assert_eq!(said("fork probe child: own client direct"), 1, "rank {rank}: {stdout}");
        assert_eq!(said("fork probe child: the rank's client refused"), 1, "rank {rank}: {stdout}");
        assert_eq!(said("fork probe child: done"), 1, "rank {rank}: {stdout}");
        assert_eq!(said("1 passed"), 1, "rank {rank}: {stdout}");
    }
}

/// The store client of a program of a rank, made from the environment
/// `cohort run` gives it (through the node's relay where it may).
fn rank_store(timeout: Duration) -> StoreClient {
    let addr = std::env::var("COHORT_STORE_ADDR").expect("COHORT_STORE_ADDR");
    let secret = std::env::var("COHORT_JOB_SECRET").expect("COHORT_JOB_SECRET");
    StoreClient::connect_rank(&addr, secret, timeout).expect("reach the store")
}

/// How `store` reaches the store: `relayed` or `direct`.
fn path(store: &StoreClient) -> &'static str {
    match format!("{store:?}").contains("through this node's relay") {
        true => "relayed",
        false => "direct",
    }
}

/// `n` adds, sets and gets on keys of `who`'s own, each answer checked:
/// an answer meant for another program fails it.
fn round_trips(store: &StoreClient, who: &str, n: i64) {
    for i in 1..=n {
        assert_eq!(store.add(&format!("count/{who}"), 1).expect("add"), i, "{who}");
        let value = format!("{who}/{i}");
        store.set(&format!("last/{who}"), value.as_bytes()).expect("set");
        assert_eq!(store.get(&format!("last/{who}")).expect("get").as_deref(), Some(value.as_bytes()), "{who}");
    }
}

#[test]
#[ignore = "run by a_forked_child_of_a_rank_gets_its_own_store_answers, as a rank"]
fn relay_fork_probe() {
    if std::env::var_os(FORK_PROBE).is_none() {
        return;
    }
    let store = rank_store(Duration::from_secs(10));
    assert_eq!(path(&store), "relayed", "{store:?}");
    let rank = std::env::var("RANK").expect("RANK");
    // SAFETY: fork(2); the child only uses the store and then leaves with
    // _exit, never returning into the test harness.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let own = store.duplicate().expect("the child's own client");
            println!("fork probe child: own client {}", path(&own));
            round_trips(&own, &format!("{rank}/child"), 200);
            match store.add(&format!("count/{rank}/child-shared"), 1) {
                Err(e) if e.to_string().contains("fork") => {
                    println!("fork probe child: the rank's client refused: {e}")
                }
                other => panic!("the rank's client in a forked child: {other:?}"),
            }
            println!("fork probe child: done");
        }));
        // SAFETY: _exit(2) ends the forked child without running the
        // parent's exit handlers or the harness.
        unsafe { libc::_exit(if run.is_ok() { 0 } else { 1 }) };
    }
    let second = store.duplicate().expect("the rank's second client");
    round_trips(&store, &format!("{rank}/rank"), 200);
    round_trips(&second, &format!("{rank}/rank-second"), 200);
    let mut status = 0;
    // SAFETY: waitpid(2) on our own child, writing one int.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the forked child failed: {status:#x}");
}
