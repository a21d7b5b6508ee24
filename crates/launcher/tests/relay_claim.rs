//! Two programs that one rank runs at once (`cohort run -- sh -c "prog &
//! prog"`) both inherit the rank's node relay sockets (`COHORT_STORE_FD`):
//! exactly one takes them and the other connects to the store directly,
//! so neither reads the other's answers (they once crossed, "unexpected
//! answer Int(2)", and the job hung to its timeout 4 runs of 5).

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
    let addr = std::env::var("COHORT_STORE_ADDR").expect("COHORT_STORE_ADDR");
    let secret = std::env::var("COHORT_JOB_SECRET").expect("COHORT_JOB_SECRET");
    let store = StoreClient::connect_rank(&addr, secret, Duration::from_secs(30)).expect("reach the store");
    let how = if format!("{store:?}").contains("through this node's relay") { "relayed" } else { "direct" };
    println!("relay claim probe: {how}");
    let me = format!("{}/{}", std::env::var("RANK").expect("RANK"), std::process::id());
    for i in 1..=300i64 {
        assert_eq!(store.add(&format!("count/{me}"), 1).expect("add"), i, "{me} ({how})");
        let value = format!("{me}/{i}");
        store.set(&format!("last/{me}"), value.as_bytes()).expect("set");
        assert_eq!(store.get(&format!("last/{me}")).expect("get").as_deref(), Some(value.as_bytes()), "{me} ({how})");
    }
}
