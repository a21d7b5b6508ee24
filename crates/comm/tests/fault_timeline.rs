//! COHORT_TIMELINE: a group's collectives and its copies (`to_client`)
//! become Chrome trace events (its own test binary: the timeline is opened
//! once per process, from the environment).

use cohort_comm::{ClientGroup, DType, ReduceOp};
use cohort_runtime::{Bytes, CpuRuntime, Runtime};

#[test]
fn collectives_and_copies_become_trace_events() {
    let path = std::env::temp_dir().join(format!("cohort-fault-timeline-{}.json", std::process::id()));
    std::env::set_var("COHORT_TIMELINE", &path);
    std::env::remove_var("RANK");
    std::env::set_var("COHORT_CPU_DEVICES", "4");
    let group = ClientGroup::new(vec![CpuRuntime::client(0).unwrap(), CpuRuntime::client(1).unwrap()]).unwrap();
    let bufs: Vec<_> = group.clients().iter().map(|c| c.create(Bytes::from(vec![1u8; 64]))).collect();
    group.all_reduce_handles(&bufs, &bufs, DType::U8, ReduceOp::Sum).unwrap();
    let copy = group.to_client(&bufs[0], 0, 1).unwrap();
    assert_eq!(group.client(1).read_one(copy).unwrap().to_vec(), vec![2u8; 64]);
    group.barrier().unwrap();
    // An event is written once the last part of its collective returned,
    // right after the barrier lets this thread go: wait for the third.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let (text, mut events) = loop {
        let text = std::fs::read_to_string(&path).unwrap();
        let strict = format!("{}]", text.trim_end().trim_end_matches(','));
        let events: Vec<serde_json::Value> = serde_json::from_str(&strict).unwrap();
        if events.len() >= 3 || std::time::Instant::now() > deadline {
            break (text, events);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    events.sort_by_key(|e| e["ts"].as_u64());
    let seen: Vec<(&str, &str)> =
        events.iter().map(|e| (e["name"].as_str().unwrap(), e["cat"].as_str().unwrap())).collect();
    assert_eq!(seen, [("all_reduce", "collective"), ("send_recv", "copy"), ("barrier", "collective")], "{text}");
    assert!(events.iter().all(|e| e["ph"] == "X" && e["ts"].as_u64().unwrap() > 0), "{text}");
    assert_eq!(events[1]["args"]["count"], 64);
    let _ = std::fs::remove_file(path);
}
