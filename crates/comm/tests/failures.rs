//! Failures inside a collective mark every destination, on every member,
//! with the cause; a member that never arrives times out on the others with
//! its name; two groups sharing devices never deadlock.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use cohort_comm::{to_client, ClientGroup, DType, HostPath, ReduceOp};
use cohort_runtime::{Bytes, GridCount, Handle, Kernel, KernelArguments, ServerError};

fn buffers(group: &ClientGroup, bytes: usize, value: u8) -> Vec<Handle> {
    group.clients().iter().map(|c| c.create(Bytes::from(vec![value; bytes]))).collect()
}

#[test]
fn a_poisoned_input_poisons_every_destination() {
    for path in [HostPath::Direct, HostPath::Staged] {
        let group = common::group(4).with_host_path(path).unwrap();
        let src = buffers(&group, 64, 1);
        let dst = buffers(&group, 64, 0);
        // Member 2's source is written by a kernel that fails.
        let boom = Kernel::new("boom").with_cpu(|_| panic!("the kernel blew up"));
        group.client(2).launch(&boom, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src[2])).unwrap();
        group.all_reduce_handles(&src, &dst, DType::F32, ReduceOp::Sum).unwrap();
        for (m, d) in dst.iter().enumerate() {
            let err = group.client(m).read_one(d.clone()).unwrap_err();
            let message = err.to_string();
            assert!(message.contains("all_reduce") && message.contains("blew up"), "member {m} ({path:?}): {message}");
        }
        // The group still works afterwards.
        let fresh = buffers(&group, 64, 1);
        group.all_reduce_handles(&fresh, &dst, DType::U8, ReduceOp::Sum).unwrap();
        assert!(group.client(3).read_one(dst[3].clone()).unwrap().iter().all(|&b| b == 4));
    }
}

#[test]
fn a_member_that_never_arrives_times_out_naming_it() {
    let group = common::group(3).with_timeout(Duration::from_millis(300));
    let src = buffers(&group, 16, 1);
    let dst = buffers(&group, 16, 0);
    // Member 1's device is busy until member 0 has given up: it cannot
    // arrive in time, however slow the machine.
    let (release, busy) = mpsc::channel::<()>();
    group
        .client(1)
        .submit(move |_| {
            let _ = busy.recv();
        })
        .unwrap();
    group.all_reduce_handles(&src, &dst, DType::U8, ReduceOp::Sum).unwrap();
    let err = group.client(0).read_one(dst[0].clone()).unwrap_err();
    release.send(()).unwrap();
    let message = err.to_string();
    assert!(message.contains("member 1 (cpu:1)") && message.contains("did not arrive"), "{message}");
    assert!(!message.contains("member 2"), "member 2 arrived: {message}");
    for (m, d) in dst.iter().enumerate().skip(1) {
        let err = group.client(m).read_one(d.clone()).unwrap_err();
        assert!(err.to_string().contains("did not arrive"), "member {m}: {err}");
    }
}

#[test]
fn a_closed_member_fails_the_collective_at_once() {
    // Devices 6 and 7 are used only here (closing is process-wide).
    let clients = common::clients(8);
    let group = ClientGroup::new(vec![clients[6].clone(), clients[7].clone()]).unwrap();
    let src = buffers(&group, 8, 1);
    let dst = buffers(&group, 8, 0);
    group.client(1).submit(|_| std::thread::sleep(Duration::from_millis(200))).unwrap();
    clients[7].close();
    let err = group.all_reduce_handles(&src, &dst, DType::U8, ReduceOp::Sum).unwrap_err();
    assert!(err.to_string().contains("could not queue member 1"), "{err}");
    let err = group.client(0).read_one(dst[0].clone()).unwrap_err();
    assert!(matches!(err.root_cause(), ServerError::DeviceClosed { .. }), "{err}");
}

#[test]
fn two_groups_sharing_devices_never_deadlock() {
    let clients = common::clients(4);
    let a = ClientGroup::new(vec![clients[0].clone(), clients[1].clone(), clients[2].clone()]).unwrap();
    let b = ClientGroup::new(vec![clients[2].clone(), clients[1].clone(), clients[3].clone()]).unwrap();
    let (tx, rx) = mpsc::channel();
    for group in [a, b] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let src = buffers(&group, 256, 1);
            let dst = buffers(&group, 256, 0);
            for _ in 0..200 {
                group.all_reduce_handles(&src, &dst, DType::U8, ReduceOp::Sum).unwrap();
                group.broadcast_handles(&src[1], &dst, DType::U8, 1).unwrap();
            }
            group.barrier().unwrap();
            let ok = group.client(2).read_one(dst[2].clone()).unwrap().iter().all(|&b| b == 1);
            tx.send(ok).unwrap();
        });
    }
    for _ in 0..2 {
        let ok = rx.recv_timeout(Duration::from_secs(60)).expect("a group deadlocked");
        assert!(ok);
    }
}

#[test]
fn barrier_and_to_client() {
    let group = common::group(3);
    group.barrier().unwrap();
    let src = group.client(0).create(Bytes::from_elems(&[1u32, 2, 3]));
    let moved = group.to_client(&src, 0, 2).unwrap();
    assert_eq!(group.client(2).read_one(moved).unwrap().to_elems::<u32>(), [1, 2, 3]);
    let moved = to_client(&src, group.client(0), group.client(1)).unwrap();
    assert_eq!(group.client(1).read_one(moved).unwrap().to_elems::<u32>(), [1, 2, 3]);
    let same = to_client(&src, group.client(0), group.client(0)).unwrap();
    assert_eq!(group.client(0).read_one(same).unwrap().to_elems::<u32>(), [1, 2, 3]);
}
