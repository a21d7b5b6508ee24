//! The typed front door: every collective over `Buffer<T>` through the
//! `Collectives` trait, one generic check run on a `ClientGroup` (one
//! process, four devices) and on `Communicator`s (two ranks of two devices,
//! one thread each); and bad input refused before anything is queued, with
//! the destinations left as they were.

mod common;

use std::thread;

use cohort_comm::store::StoreServer;
use cohort_comm::{Buffer, ClientGroup, Collectives, CommError, Communicator, Error, ReduceOp, World};

/// Elements per member's segment (uneven, so blocks cannot line up by luck).
const K: usize = 37;

/// Member `m`'s input: element `j` is `m × 1000 + j`, distinct in every
/// member and every block.
fn input(m: usize, len: usize) -> Vec<f32> {
    (0..len).map(|j| (m * 1000 + j) as f32).collect()
}

/// One buffer per local device, each filled by `fill(member)`.
fn per_member<C: Collectives>(c: &C, fill: impl Fn(usize) -> Vec<f32>) -> Vec<Buffer<f32>> {
    let first = c.first_member();
    c.clients().iter().enumerate().map(|(l, client)| Buffer::from_slice(client, &fill(first + l)).unwrap()).collect()
}

/// Runs every typed collective and compares every local destination with
/// the result computed on the host; returns the first difference.
fn check_every_collective<C: Collectives>(c: &C) -> Result<(), String> {
    let n = c.members();
    let first = c.first_member();
    let root = n - 1;
    let sentinel = |len: usize| move |_| vec![-1.0f32; len];
    let compare = |what: &str, bufs: &[Buffer<f32>], want: &dyn Fn(usize) -> Vec<f32>| -> Result<(), String> {
        for (l, b) in bufs.iter().enumerate() {
            let got = b.to_vec().map_err(|e| format!("{what}: {e}"))?;
            if got != want(first + l) {
                return Err(format!(
                    "{what}: member {} got {:?}..., want {:?}...",
                    first + l,
                    &got[..4],
                    &want(first + l)[..4]
                ));
            }
        }
        Ok(())
    };
    let sum_of = |j: usize| (0..n).map(|m| (m * 1000 + j) as f32).sum::<f32>();

    let src = per_member(c, |m| input(m, K));
    let dst = per_member(c, sentinel(K));
    c.all_reduce(&src, &dst, ReduceOp::Sum).map_err(|e| e.to_string())?;
    compare("all_reduce", &dst, &|_| (0..K).map(sum_of).collect())?;

    let dst = per_member(c, sentinel(K));
    c.reduce(&src, &dst, ReduceOp::Max, root).map_err(|e| e.to_string())?;
    compare("reduce", &dst, &|m| if m == root { input(n - 1, K) } else { vec![-1.0; K] })?;

    let dst = per_member(c, sentinel(K));
    c.broadcast(&src, &dst, root).map_err(|e| e.to_string())?;
    compare("broadcast", &dst, &|_| input(root, K))?;

    let dst = per_member(c, sentinel(n * K));
    c.all_gather(&src, &dst).map_err(|e| e.to_string())?;
    compare("all_gather", &dst, &|_| (0..n).flat_map(|m| input(m, K)).collect())?;

    let wide = per_member(c, |m| input(m, n * K));
    let dst = per_member(c, sentinel(K));
    c.reduce_scatter(&wide, &dst, ReduceOp::Sum).map_err(|e| e.to_string())?;
    compare("reduce_scatter", &dst, &|m| (m * K..(m + 1) * K).map(sum_of).collect())?;

    let dst = per_member(c, sentinel(n * K));
    c.all_to_all(&wide, &dst).map_err(|e| e.to_string())?;
    compare("all_to_all", &dst, &|q| (0..n).flat_map(|p| input(p, n * K)[q * K..(q + 1) * K].to_vec()).collect())?;

    let dst = per_member(c, sentinel(n * K));
    c.gather(&src, &dst, root).map_err(|e| e.to_string())?;
    compare("gather", &dst, &|m| {
        if m == root {
            (0..n).flat_map(|p| input(p, K)).collect()
        } else {
            vec![-1.0; n * K]
        }
    })?;

    let dst = per_member(c, sentinel(K));
    c.scatter(&wide, &dst, root).map_err(|e| e.to_string())?;
    compare("scatter", &dst, &|m| input(root, n * K)[m * K..(m + 1) * K].to_vec())?;

    // Member 0 sends to the last member; each process passes what it holds.
    let dst = per_member(c, sentinel(K));
    let src0 = c.local_slot(0).map(|l| &src[l]);
    let dst_last = c.local_slot(root).map(|l| &dst[l]);
    c.send_recv(0, src0, root, dst_last).map_err(|e| e.to_string())?;
    compare("send_recv", &dst, &|m| if m == root { input(0, K) } else { vec![-1.0; K] })?;
    c.barrier().map_err(|e| e.to_string())
}

#[test]
fn every_typed_collective_on_a_client_group() {
    let group = common::group(4);
    check_every_collective(&group).unwrap();
    // The same code through `World`, which is a ClientGroup without a launcher.
    let world = World::join(common::clients(4)).unwrap();
    assert!(matches!(world, World::Local(_)));
    check_every_collective(&world).unwrap();
}

#[test]
fn every_typed_collective_on_communicators_of_two_devices_per_rank() {
    common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.local_addr().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                // Devices 4..8: the group test uses 0..4 at the same time.
                let clients = vec![common::clients(8)[4 + 2 * rank].clone(), common::clients(8)[5 + 2 * rank].clone()];
                let comm = Communicator::connect(rank, 2, &addr, "secret", clients).unwrap();
                assert_eq!((comm.members(), Collectives::first_member(&comm)), (4, 2 * rank));
                check_every_collective(&comm)
            })
        })
        .collect();
    for rank in ranks {
        rank.join().unwrap().unwrap();
    }
}

#[test]
fn a_length_mismatch_is_refused_before_anything_is_queued() {
    let group = common::group(2);
    let src = group.replicate(&[1.0f32; 10]).unwrap();
    let dst = group.replicate(&[7.0f32; 12]).unwrap();
    let err = group.all_reduce(&src, &dst, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::WrongSize { .. })), "{err}");
    // Nothing ran: the destinations still hold what they held.
    assert_eq!(dst[1].to_vec().unwrap(), [7.0; 12]);

    let err = group.all_reduce(&src[..1], &src[..1], ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::BufferCount { expected: 2, got: 1, .. })), "{err}");
    // A buffer of member 1's device passed for member 0.
    let swapped = vec![src[1].clone(), src[0].clone()];
    let err = group.all_reduce(&swapped, &swapped, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::ForeignHandle { member: 0, .. })), "{err}");
    let err = group.broadcast(&src, &src, 2).unwrap_err();
    assert!(matches!(err, Error::Comm(CommError::NotAMember { index: 2, .. })), "{err}");
    let err = group.send_recv(0, Some(&src[0]), 1, None).unwrap_err();
    assert!(err.to_string().contains("destination of member 1 is missing"), "{err}");
    assert_eq!(src[0].to_vec().unwrap(), [1.0; 10]);
}

/// A size error counts elements of the buffers' type first, then bytes:
/// what a typed caller wrote, and what the collective needs.
#[test]
fn a_size_error_counts_elements_of_the_type_then_bytes() {
    let group = common::group(2);
    let src = group.replicate(&[1.0f32; 4]).unwrap();
    let dst = group.zeros::<f32>(3).unwrap();
    let err = group.all_gather(&src, &dst).unwrap_err().to_string();
    assert!(
        err.contains(
            "all_gather: destination of member 0 holds 3 f32 elements (12 bytes) but must hold 8 f32 elements (32 \
             bytes) (2 members × the source size)"
        ),
        "{err}"
    );
    let one = group.zeros::<u64>(1).unwrap();
    let err = group.all_reduce(&group.zeros::<u64>(2).unwrap(), &one, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("holds 1 u64 element (8 bytes) but must hold 2 u64 elements (16 bytes)"), "{err}");
    // Untyped handles with a size that is no whole number of elements.
    let clients = group.clients();
    let odd: Vec<_> = clients.iter().map(|c| c.create_from_slice(&[0u8; 10])).collect();
    let whole: Vec<_> = clients.iter().map(|c| c.create_from_slice(&[0u8; 8])).collect();
    let err = group.all_reduce_handles(&whole, &odd, cohort_comm::DType::F32, ReduceOp::Sum).unwrap_err();
    assert!(
        err.to_string().contains("holds 10 bytes (not a whole number of f32 elements) but must hold 2 f32"),
        "{err}"
    );
}

#[test]
fn buffers_refuse_sizes_and_ranges_that_cannot_be() {
    let client = &common::clients(1)[0];
    let err = Buffer::<f64>::zeros(client, usize::MAX / 2).unwrap_err();
    assert!(err.to_string().contains("larger than memory can address"), "{err}");
    let b = Buffer::from_slice(client, &[1u32, 2, 3, 4]).unwrap();
    assert_eq!(b.slice(1..3).unwrap().to_vec().unwrap(), [2, 3]);
    assert!(b.slice(3..5).unwrap_err().to_string().contains("not inside a buffer of 4"));
    assert!(b.write(&[1, 2]).unwrap_err().to_string().contains("writing 2 elements into a buffer of 4"));
    b.write(&[9, 8, 7, 6]).unwrap();
    assert_eq!(b.to_vec().unwrap(), [9, 8, 7, 6]);
    let odd = client.create_from_slice(&[0u8; 6]);
    let err = Buffer::<u32>::from_handle(client, odd).unwrap_err();
    assert!(err.to_string().contains("not a whole number of u32 elements"), "{err}");
    let other = &common::clients(2)[1];
    let err = Buffer::<u32>::from_handle(other, b.handle().clone()).unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err}");
}

#[test]
fn a_group_of_one_process_reports_rank_zero_of_one() {
    let group: ClientGroup = common::group(3);
    assert_eq!((Collectives::rank(&group), group.world_size(), group.members(), group.first_member()), (0, 1, 3, 0));
    assert_eq!(group.local_slot(2), Some(2));
    assert_eq!(group.local_slot(3), None);
}

#[test]
fn empty_buffers_run_every_collective_as_a_no_op() {
    let group = common::group(2);
    let empty = group.zeros::<f64>(0).unwrap();
    group.all_reduce(&empty, &empty, ReduceOp::Sum).unwrap();
    group.all_gather(&empty, &empty).unwrap();
    group.broadcast(&empty, &empty, 1).unwrap();
    group.reduce_scatter(&empty, &empty, ReduceOp::Max).unwrap();
    assert!(empty[0].to_vec().unwrap().is_empty());
    // Still usable afterwards.
    let ones = group.replicate(&[1i64; 5]).unwrap();
    group.all_reduce(&ones, &ones, ReduceOp::Sum).unwrap();
    assert_eq!(ones[1].to_vec().unwrap(), [2; 5]);
}
