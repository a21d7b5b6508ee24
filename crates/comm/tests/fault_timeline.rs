//! COHORT_TIMELINE: a group's collectives and its copies (`to_client`)
//! become Chrome trace events (its own test binary: the timeline is opened
//! once per process, from the environment).

use std::process::Command;

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

/// Set in the child processes of
/// `a_timeline_that_cannot_be_written_is_logged_once_and_collectives_run`,
/// which run that same test as the child.
const CHILD: &str = "COHORT_TEST_TIMELINE_CHILD";
/// Bytes the child may write to a file (its timeline), where set.
const FILE_LIMIT: &str = "COHORT_TEST_TIMELINE_FILE_LIMIT";

/// The child: ten CPU all-reduces with `COHORT_TIMELINE` at a bad path,
/// logging to stderr.
fn timeline_child_runs_all_reduces() {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).init();
    if let Some(limit) = std::env::var_os(FILE_LIMIT) {
        // A disk that fills up mid-run: writes past `limit` bytes fail
        // (EFBIG; the signal that would otherwise end the process ignored).
        let limit: u64 = limit.to_str().unwrap().parse().unwrap();
        let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
        // SAFETY: plain libc calls with valid arguments.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &rlimit), 0);
        }
    }
    std::env::set_var("COHORT_CPU_DEVICES", "2");
    let group = ClientGroup::new(vec![CpuRuntime::client(0).unwrap(), CpuRuntime::client(1).unwrap()]).unwrap();
    for round in 1..=10u8 {
        let bufs: Vec<_> = group.clients().iter().map(|c| c.create(Bytes::from(vec![round; 16]))).collect();
        group.all_reduce_handles(&bufs, &bufs, DType::U8, ReduceOp::Sum).unwrap();
        assert_eq!(group.client(1).read_one(bufs[1].clone()).unwrap().to_vec(), vec![2 * round; 16]);
    }
    println!("all-reduces done");
}

/// Each bad `COHORT_TIMELINE` in a child process of its own (the timeline
/// is opened once per process): the child, this same test with [`CHILD`]
/// set, runs its collectives and logs the one failure, naming the path.
#[test]
fn a_timeline_that_cannot_be_written_is_logged_once_and_collectives_run() {
    const NAME: &str = "a_timeline_that_cannot_be_written_is_logged_once_and_collectives_run";
    if std::env::var_os(CHILD).is_some() {
        return timeline_child_runs_all_reduces();
    }
    let base = std::env::temp_dir().join(format!("cohort-bad-timeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("a-folder.json")).unwrap();
    let fifo = base.join("fifo.json");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let cases = [
        ("/dev/full".into(), "/dev/full", None),
        (base.join("a-folder.json"), "a-folder.json", None),
        (base.join("missing/folder/t.json"), "missing/folder", None),
        (fifo, "fifo.json", None),
        // Room for the opening `[` and about one event: the rest fail.
        (base.join("filling.json"), "writing the trace failed", Some("300")),
    ];
    let cases = cases.into_iter().map(|(path, named, limit)| (path, named, limit, None)).chain([
        // A RANK that is not a number must not steer the file elsewhere.
        (base.join("t.json"), "RANK=\"../escaped\"", None, Some("../escaped")),
    ]);
    for (path, named, file_limit, rank) in cases {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.env_remove("RANK");
        if let Some(limit) = file_limit {
            command.env(FILE_LIMIT, limit);
        }
        if let Some(rank) = rank {
            command.env("RANK", rank);
        }
        let mut child = command
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("COHORT_TIMELINE", &path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("COHORT_TIMELINE={}: the collectives hung", path.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let what = format!("COHORT_TIMELINE={}:\n{stdout}\n{stderr}", path.display());
        assert!(out.status.success() && stdout.contains("all-reduces done"), "{what}");
        assert!(stdout.contains("test result: ok. 1 passed;"), "the child ran one test: {what}");
        assert!(!stderr.contains("panicked"), "{what}");
        let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("COHORT_TIMELINE")).collect();
        assert_eq!(lines.len(), 1, "{what}");
        assert!(lines[0].contains(named), "{what}");
    }
    assert!(!base.join("escaped.json").exists() && !base.join("t.rank..").exists(), "a RANK steered the timeline");
    std::fs::remove_dir_all(&base).unwrap();
}
