//! Handles: every collective returns a `Work` to wait on (with or without a
//! bound) or poll; a bounded wait that expires names who has not finished
//! (in one process: members not finished, never "not arrived", since one
//! call queued them all; on a communicator: the other ranks not arrived
//! yet, or arrived and not finished, then this rank's devices), and
//! dropping the handle cancels nothing.
//!
//! A member is held busy by a task that blocks its device thread until the
//! test releases it through a channel, so every order is set by
//! synchronisation, never by time.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use cohort_comm::store::StoreServer;
use cohort_comm::{Buffer, Collectives, CommError, Communicator, ReduceOp};

#[test]
fn a_timed_wait_names_the_members_not_finished_and_is_done_flips_after() {
    let clients = common::clients(2);
    let group = cohort_comm::ClientGroup::new(clients.clone()).unwrap();
    let bufs: Vec<Buffer<f32>> =
        (0..2).map(|m| Buffer::from_slice(&clients[m], &[m as f32 + 1.0; 5]).unwrap()).collect();
    let release = common::hold(&clients[1]);
    let work = group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
    assert_eq!(work.operation(), "all_reduce");
    assert!(!work.is_done(), "member 1's device is held: the all-reduce cannot have finished");
    let err = work.wait_timeout(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(err, CommError::Unfinished { .. }), "{err}");
    let text = err.to_string();
    // Both were called; member 1's part is queued behind the held task
    // (member 0's has started by now, or soon will, and waits for it).
    assert!(text.contains("member 0 (cpu:0), member 1 (cpu:1) not finished ("), "{text}");
    assert!(text.contains("started yet: still queued on"), "{text}");
    assert!(!text.contains("arrived"), "one call queued every member: none is 'not arrived': {text}");
    assert!(text.starts_with("all_reduce has not finished within 20 ms"), "{text}");
    assert!(!work.is_done(), "an expired wait cancels nothing");
    release.send(()).unwrap();
    work.wait().unwrap();
    assert!(work.is_done());
    work.wait_timeout(Duration::from_millis(1)).unwrap();
    for b in &bufs {
        assert_eq!(b.to_vec().unwrap(), [3.0; 5]);
    }
}

/// A wait of 1 ns on a collective every member was called for (one call
/// queues them all) says they have not finished, never that they have not
/// arrived; the collective then ends as if no one had waited.
#[test]
fn a_one_nanosecond_wait_says_the_members_have_not_finished() {
    let clients = common::clients(8);
    let clients = vec![clients[6].clone(), clients[2].clone()];
    let group = cohort_comm::ClientGroup::new(clients.clone()).unwrap();
    // 16 MiB per member: far more than a nanosecond's work.
    let n = 4 << 20;
    let bufs: Vec<Buffer<f32>> =
        (0..2).map(|m| Buffer::from_slice(&clients[m], &vec![m as f32 + 1.0; n]).unwrap()).collect();
    let work = group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
    let err = work.wait_timeout(Duration::from_nanos(1)).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CommError::Unfinished { .. }), "{text}");
    assert!(text.contains("not finished") && !text.contains("arrived"), "{text}");
    work.wait().unwrap();
    assert!(bufs.iter().all(|b| b.to_vec().unwrap() == vec![3.0; n]));
}

#[test]
fn dropping_the_handle_still_completes_the_work() {
    let clients = common::clients(4)[2..4].to_vec();
    let group = cohort_comm::ClientGroup::new(clients.clone()).unwrap();
    let src: Vec<Buffer<i32>> = (0..2).map(|m| Buffer::from_slice(&clients[m], &[m as i32 + 10; 3]).unwrap()).collect();
    let dst: Vec<Buffer<i32>> = (0..2).map(|m| Buffer::zeros(&clients[m], 6).unwrap()).collect();
    let release = common::hold(&clients[0]);
    drop(group.all_gather(&src, &dst).unwrap());
    release.send(()).unwrap();
    for d in &dst {
        assert_eq!(d.to_vec().unwrap(), [10, 10, 10, 11, 11, 11]);
    }
}

#[test]
fn a_communicators_handle_waits_for_its_rank_and_names_its_device() {
    common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let (go, gate) = mpsc::channel::<()>();
    let (timed, timed_out) = mpsc::channel::<String>();
    let mut gates = [None, Some(gate)];
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            let gate = gates[rank].take();
            let timed = timed.clone();
            thread::spawn(move || {
                let client = common::clients(8)[4 + rank].clone();
                let comm = Communicator::connect(rank, 2, &addr, "secret", vec![client.clone()]).unwrap();
                let bufs = vec![Buffer::from_slice(&client, &[rank as f64 + 1.0; 4]).unwrap()];
                if let Some(gate) = gate {
                    // Rank 1 calls only once rank 0's bounded wait expired.
                    let _ = gate.recv();
                }
                let work = comm.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
                if rank == 0 {
                    let err = work.wait_timeout(Duration::from_millis(20)).unwrap_err();
                    timed.send(err.to_string()).unwrap();
                }
                work.wait().unwrap();
                assert!(work.is_done());
                bufs[0].to_vec().unwrap()
            })
        })
        .collect();
    let text = timed_out.recv().unwrap();
    assert!(text.contains("all_reduce on rank 0 has not finished"), "{text}");
    // The rank it waits for first, as the collective's timeout names it;
    // then this rank's device.
    assert!(text.contains("rank(s) 1 not arrived yet at all_reduce #1"), "{text}");
    assert!(text.contains("; this rank's cpu:4 not finished"), "{text}");
    go.send(()).unwrap();
    for rank in ranks {
        assert_eq!(rank.join().unwrap(), [3.0; 4]);
    }
}

/// Rank 0's device is held, so its part of the all-reduce it called waits
/// there: rank 1's timed wait names rank 0 as arrived (its published
/// progress says it called the all-reduce) and not finished, and rank 0's
/// own names its device's part as not started.
#[test]
fn a_communicators_timed_wait_tells_a_rank_that_arrived_from_one_that_did_not() {
    use cohort_comm::published::{communicator_prefix, parse_progress, progress_key};
    use cohort_comm::store::StoreClient;
    let clients = common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let (timed, timed_out) = mpsc::channel::<(usize, String)>();
    let (go, gate) = mpsc::channel::<()>();
    let mut gates = [Some(gate), None];
    let devices = [clients[6].clone(), clients[3].clone()];
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (addr, client, timed, gate) = (addr.clone(), devices[rank].clone(), timed.clone(), gates[rank].take());
            thread::spawn(move || {
                let comm = Communicator::connect(rank, 2, &addr, "secret", vec![client.clone()]).unwrap();
                let bufs = vec![Buffer::from_slice(&client, &[rank as f32 + 1.0; 4]).unwrap()];
                let release = (rank == 0).then(|| common::hold(&client));
                let work = comm.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
                if rank == 1 {
                    // Rank 0's progress says it called #1 (its heartbeat
                    // publishes it within 50 ms).
                    let store = StoreClient::connect(addr.as_str(), "secret", Duration::from_secs(30)).unwrap();
                    let key = progress_key(&communicator_prefix(1), 0);
                    let called = || store.get(&key).unwrap().and_then(|v| parse_progress(&v)).is_some_and(|p| p.0 >= 1);
                    let deadline = std::time::Instant::now() + Duration::from_secs(30);
                    while !called() {
                        assert!(std::time::Instant::now() < deadline, "rank 0 never published its call");
                        thread::sleep(Duration::from_millis(5));
                    }
                }
                timed.send((rank, work.wait_timeout(Duration::from_millis(20)).unwrap_err().to_string())).unwrap();
                if let (Some(gate), Some(release)) = (gate, release) {
                    // Rank 0's device is held until both timed waits expired.
                    let _ = gate.recv();
                    release.send(()).unwrap();
                }
                work.wait().unwrap();
                bufs[0].to_vec().unwrap()
            })
        })
        .collect();
    let mut texts = [timed_out.recv().unwrap(), timed_out.recv().unwrap()];
    texts.sort();
    let [(_, zero), (_, one)] = texts;
    go.send(()).unwrap();
    assert!(one.contains("rank(s) 0 arrived at all_reduce #1, not finished"), "{one}");
    assert!(!one.contains("not arrived"), "{one}");
    assert!(one.contains("; this rank's cpu:3 not finished"), "{one}");
    assert!(zero.contains("this rank's cpu:6 not finished (not started yet: still queued on its device)"), "{zero}");
    for rank in ranks {
        assert_eq!(rank.join().unwrap(), [3.0; 4]);
    }
}

/// A message's timed wait names the other end: rank 0's receive waits for
/// rank 1, which has not sent yet.
#[test]
fn a_timed_wait_for_a_message_names_the_other_end() {
    let clients = common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let (timed, timed_out) = mpsc::channel::<String>();
    let (go, gate) = mpsc::channel::<()>();
    let mut gates = [None, Some(gate)];
    let devices = [clients[1].clone(), clients[5].clone()];
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (addr, client, timed, gate) = (addr.clone(), devices[rank].clone(), timed.clone(), gates[rank].take());
            thread::spawn(move || {
                let comm = Communicator::connect(rank, 2, &addr, "secret", vec![client.clone()]).unwrap();
                let buf = Buffer::from_slice(&client, &[rank as i32 + 7; 3]).unwrap();
                if let Some(gate) = gate {
                    // Rank 1 sends once rank 0's timed wait expired.
                    let _ = gate.recv();
                    comm.send_recv(1, Some(&buf), 0, None).unwrap().wait().unwrap();
                    return buf.to_vec().unwrap();
                }
                let work = comm.send_recv(1, None, 0, Some(&buf)).unwrap();
                timed.send(work.wait_timeout(Duration::from_millis(20)).unwrap_err().to_string()).unwrap();
                work.wait().unwrap();
                buf.to_vec().unwrap()
            })
        })
        .collect();
    let text = timed_out.recv().unwrap();
    go.send(()).unwrap();
    assert!(text.contains("send_recv on rank 0 has not finished within 20 ms"), "{text}");
    assert!(text.contains("it waits for rank 1, the other end of send_recv #1"), "{text}");
    for rank in ranks {
        assert_eq!(rank.join().unwrap(), [8; 3]);
    }
}

#[test]
fn a_timeout_of_duration_max_means_no_limit_and_overflows_nothing() {
    let clients = common::clients(2);
    let group = cohort_comm::ClientGroup::new(clients.clone()).unwrap().with_timeout(Duration::MAX);
    assert!(group.timeout() >= Duration::from_secs(365 * 24 * 3600), "{:?}", group.timeout());
    let bufs: Vec<Buffer<f32>> =
        (0..2).map(|m| Buffer::from_slice(&clients[m], &[m as f32 + 1.0; 5]).unwrap()).collect();
    let work = group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
    work.wait_timeout(Duration::MAX).unwrap();
    assert_eq!(bufs[1].to_vec().unwrap(), vec![3.0; 5]);

    let server = StoreServer::bind("127.0.0.1:0", "handles-max").unwrap();
    let addr = server.local_addr().to_string();
    let comm = Communicator::connect(0, 1, &addr, "handles-max", vec![clients[0].clone()]).unwrap();
    comm.set_timeout(Duration::MAX);
    let one = [bufs[0].clone()];
    comm.all_reduce(&one, &one, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(bufs[0].to_vec().unwrap(), vec![3.0; 5]);
}

#[test]
fn a_small_collective_of_one_idle_device_is_done_when_the_call_returns_and_waits_its_turn_otherwise() {
    // Device 7: no other test of this file uses it, so it is idle here.
    let client = common::clients(8)[7].clone();
    let group = cohort_comm::ClientGroup::new(vec![client.clone()]).unwrap();
    let src = [Buffer::from_slice(&client, &[1.5f32, -2.0, 4.0]).unwrap()];
    let dst = [Buffer::<f32>::zeros(&client, 3).unwrap()];
    assert_eq!(dst[0].to_vec().unwrap(), [0.0; 3]);
    // Idle after a read: the caller's thread runs the part itself (no
    // hand-over), so the call returns with it done. The device thread lets
    // go of its state a moment after it answered the read, and a loaded
    // machine may take it off its core in that moment: a few tries.
    // The device counts the tasks a caller ran itself: done when the call
    // returned is not enough (a queued part may finish that fast too).
    let ran_inline = || client.stats().unwrap().inline_tasks;
    let before = ran_inline();
    let inline = (0..100).any(|_| {
        dst[0].to_vec().unwrap();
        let done = group.all_reduce(&src, &dst, ReduceOp::Sum).unwrap().is_done();
        done && ran_inline() > before
    });
    assert!(inline, "a one-device all-reduce of 12 bytes on an idle device never ran inside the call");
    assert_eq!(dst[0].to_vec().unwrap(), [1.5, -2.0, 4.0]);
    // Busy: the part is queued behind the held task, and runs after it.
    let held = ran_inline();
    let release = common::hold(&client);
    let work = group.all_reduce(&dst, &dst, ReduceOp::Max).unwrap();
    let bigger = group.broadcast(&src, &dst, 0).unwrap();
    assert!(!work.is_done() && !bigger.is_done(), "the device is held: neither can have run");
    release.send(()).unwrap();
    bigger.wait().unwrap();
    assert!(work.is_done(), "parts run in queue order");
    assert_eq!(ran_inline(), held, "a part queued behind a held task ran inline");
    assert_eq!(dst[0].to_vec().unwrap(), [1.5, -2.0, 4.0]);
}
