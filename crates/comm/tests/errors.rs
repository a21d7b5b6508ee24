//! Argument errors: each refused before anything is queued, with a message
//! that names the problem, and no buffer written.

mod common;

use cohort_comm::{ClientGroup, CommError, DType, ReduceOp};
use cohort_runtime::{Bytes, Client, Handle};

fn filled(client: &Client, bytes: usize, value: u8) -> Handle {
    client.create(Bytes::from(vec![value; bytes]))
}

/// Asserts `result` is an error whose message contains every word, and that
/// `untouched` buffers still hold `value`.
fn refused(
    result: Result<cohort_comm::Work, CommError>,
    words: &[&str],
    group: &ClientGroup,
    untouched: &[Handle],
    value: u8,
) {
    let err = result.expect_err("the call must be refused");
    let message = err.to_string();
    for word in words {
        assert!(message.contains(word), "{message:?} should mention {word:?}");
    }
    for (m, handle) in untouched.iter().enumerate() {
        let bytes = group.client(m).read_one(handle.clone()).expect("an untouched buffer reads");
        assert!(bytes.iter().all(|&b| b == value), "member {m}'s buffer was written after {message}");
    }
}

#[test]
fn group_formation_is_checked() {
    let err = ClientGroup::new(Vec::new()).unwrap_err();
    assert!(err.to_string().contains("at least one client"), "{err}");
    let mut clients = common::clients(3);
    clients.push(clients[1].clone());
    let err = ClientGroup::new(clients).unwrap_err();
    assert!(matches!(err, CommError::DuplicateDevice { first: 1, second: 3, .. }), "{err}");
    assert!(err.to_string().contains("listed twice"), "{err}");
}

#[test]
fn argument_errors_write_nothing() {
    let group = common::group(3);
    let c = group.clients();
    let src: Vec<Handle> = c.iter().map(|c| filled(c, 64, 1)).collect();
    let dst: Vec<Handle> = c.iter().map(|c| filled(c, 64, 7)).collect();

    // Not one buffer per member.
    refused(
        group.all_reduce_handles(&src[..2], &dst, DType::F32, ReduceOp::Sum),
        &["2 buffers", "3 members"],
        &group,
        &dst,
        7,
    );
    // Not a whole number of elements.
    let odd: Vec<Handle> = c.iter().map(|c| filled(c, 10, 1)).collect();
    let odd_dst: Vec<Handle> = c.iter().map(|c| filled(c, 10, 7)).collect();
    refused(
        group.all_reduce_handles(&odd, &odd_dst, DType::F64, ReduceOp::Sum),
        &["10 bytes", "whole number", "f64"],
        &group,
        &odd_dst,
        7,
    );
    // Wrong destination size.
    let small: Vec<Handle> = c.iter().map(|c| filled(c, 32, 7)).collect();
    refused(
        group.all_reduce_handles(&src, &small, DType::F32, ReduceOp::Sum),
        &["destination", "32 bytes", "64 bytes"],
        &group,
        &small,
        7,
    );
    refused(group.all_gather_handles(&src, &dst, DType::F32), &["192 bytes", "3 members"], &group, &dst, 7);
    // Root out of range.
    refused(group.broadcast_handles(&src[0], &dst, DType::U8, 3), &["root 3", "not a member"], &group, &dst, 7);
    refused(group.reduce_handles(&src, &dst[0], DType::U8, ReduceOp::Max, 5), &["root 5"], &group, &dst, 7);
    // A handle of another member's device.
    let mut foreign = dst.clone();
    foreign[2] = dst[1].clone();
    refused(
        group.all_reduce_handles(&src, &foreign, DType::F32, ReduceOp::Sum),
        &["member 2", "cpu:1", "cpu:2"],
        &group,
        &dst,
        7,
    );
    refused(group.send_recv_handles(0, &src[1], 1, &dst[1], DType::U8), &["member 0", "cpu:1"], &group, &dst, 7);
    // Source and destination overlapping without being in place.
    let shifted: Vec<Handle> = src.iter().map(|s| s.slice(4, 32).unwrap()).collect();
    let head: Vec<Handle> = src.iter().map(|s| s.slice(0, 32).unwrap()).collect();
    refused(group.all_reduce_handles(&head, &shifted, DType::F32, ReduceOp::Sum), &["overlap"], &group, &dst, 7);
    // all_to_all that does not split into one block per member.
    refused(group.all_to_all_handles(&src, &dst, DType::F64), &["equal blocks"], &group, &dst, 7);
    // Sources of different sizes.
    let mut uneven = src.clone();
    uneven[1] = filled(&c[1], 32, 1);
    refused(
        group.all_reduce_handles(&uneven, &dst, DType::F32, ReduceOp::Sum),
        &["member 1", "member 0's"],
        &group,
        &dst,
        7,
    );
}
