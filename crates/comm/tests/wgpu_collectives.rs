//! Every collective on wgpu devices (the staged host path: wgpu memory is
//! not host-addressable), against the host reference of `cohort_comm::verify`:
//! copies, integers, sums, products, minima and maxima exactly (the patterns
//! keep them exact), averages within `verify::max_error`.
//!
//! Runs on lavapipe in CI: `COHORT_WGPU_DEVICES=8` opens eight devices on
//! the one adapter (a value of 8 or more already in the environment is
//! kept). lavapipe is slow, so the matrix is pruned, not every product
//! (about a minute in a debug build on 2 busy cores):
//! - every collective × element type × reduction at 2, 3, 4, 5 and 8
//!   members and 37 elements per block (odd), in place and out of place, in
//!   64-byte chunks;
//! - every collective × element type at group sizes 1 to 4 (four types of
//!   every width and kind at 5 to 8) × 0, 1 and 37 elements per block, in
//!   and out of place, the reduction rotating;
//! - 2-3 MiB for the bandwidth collectives, in 1 MiB pipelined chunks.

use std::sync::Once;

use cohort_comm::op::Collective;
use cohort_comm::verify::Buffers;
use cohort_comm::{ClientGroup, DType, ReduceOp};
use cohort_runtime::{Client, Runtime, WgpuRuntime};

/// Clients of wgpu devices `0..n`, every one on adapter 0.
fn clients(n: usize) -> Vec<Client> {
    static DEVICES: Once = Once::new();
    // Before the adapters are enumerated (every test calls this first).
    DEVICES.call_once(|| {
        let set = std::env::var("COHORT_WGPU_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok());
        if set.is_none_or(|d| d < 8) {
            std::env::set_var("COHORT_WGPU_DEVICES", "8");
        }
    });
    (0..n).map(|i| WgpuRuntime::client(i).unwrap_or_else(|e| panic!("wgpu device {i}: {e}"))).collect()
}

/// A group over wgpu devices `0..n`, with `chunk` bytes per staged chunk.
fn group(n: usize, chunk: usize) -> ClientGroup {
    let group = ClientGroup::new(clients(n)).expect("a valid group").with_stage_chunk(chunk);
    assert!(!group.is_direct(), "wgpu memory is not host-addressable: the staged path");
    group
}

fn check(group: &ClientGroup, coll: Collective, dtype: DType, op: ReduceOp, elems: usize, in_place: bool) {
    let n = group.len();
    let size = elems * dtype.size() * if coll.blocked() { n } else { 1 };
    let root = n / 2;
    let what = format!("{coll:?} {dtype} {op} n={n} elems={elems} in_place={in_place}");
    let bufs = Buffers::new(group, coll, dtype, size, in_place, root);
    bufs.run(group, op).unwrap_or_else(|e| panic!("{what}: {e}"));
    let wrong = bufs.wrong(group, op).unwrap_or_else(|e| panic!("{what}: read failed: {e}"));
    assert_eq!(wrong, 0, "{what}: {wrong} wrong elements");
}

fn ops(coll: Collective) -> &'static [ReduceOp] {
    if coll.reduces() {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    }
}

/// Every collective × element type × reduction at `n` members and 37
/// elements per block, in place and out of place.
fn full_matrix(n: usize) {
    // 64-byte chunks: 37 elements of 8 bytes cross several chunks.
    let group = group(n, 64);
    for coll in Collective::ALL {
        for dtype in DType::ALL {
            for &op in ops(coll) {
                for in_place in [false, true] {
                    check(&group, coll, dtype, op, 37, in_place);
                }
            }
        }
    }
}

#[test]
fn every_collective_type_and_op_at_two_members() {
    full_matrix(2);
}

#[test]
fn every_collective_type_and_op_at_three_members() {
    full_matrix(3);
}

#[test]
fn every_collective_type_and_op_at_four_members() {
    full_matrix(4);
}

#[test]
fn every_collective_type_and_op_at_five_and_eight_members() {
    // 6 and 7 members meet every collective in the group-size test below.
    full_matrix(5);
    full_matrix(8);
}

#[test]
fn every_collective_at_group_sizes_one_to_eight_and_sizes_0_1_odd() {
    let mut turn = 0;
    for n in 1..=8 {
        let group = group(n, 48);
        // Past 4 members, four types of every width and kind (the full
        // matrix above has every type at those sizes already).
        let dtypes: &[DType] = if n <= 4 { &DType::ALL } else { &[DType::F64, DType::BF16, DType::I8, DType::U32] };
        for coll in Collective::ALL {
            for &dtype in dtypes {
                for elems in [0, 1, 37] {
                    for in_place in [false, true] {
                        // Rotate the reduction so every size meets each.
                        let op = ops(coll)[turn % ops(coll).len()];
                        turn += 1;
                        check(&group, coll, dtype, op, elems, in_place);
                    }
                }
            }
        }
    }
}

#[test]
fn several_mib_in_pipelined_chunks() {
    // 1 MiB chunks: 2-3 MiB buffers cross several.
    let group = group(4, 1 << 20);
    let mib = 2 << 20;
    for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::AllToAll] {
        let per_block = if coll.blocked() { mib / 4 / 4 } else { mib / 4 };
        check(&group, coll, DType::F32, ReduceOp::Sum, per_block + 3, coll == Collective::AllReduce);
    }
    check(&group, Collective::Broadcast, DType::U8, ReduceOp::Sum, mib + 1, false);
    check(&group, Collective::AllReduce, DType::BF16, ReduceOp::Avg, mib / 2 + 1, true);
    let pair = self::group(2, 1 << 20);
    check(&pair, Collective::AllReduce, DType::I64, ReduceOp::Max, (3 << 20) / 8 + 5, false);
    check(&pair, Collective::SendRecv, DType::F64, ReduceOp::Sum, (3 << 20) / 8 + 1, false);
}

#[test]
fn destinations_of_all_members_agree_bit_for_bit() {
    let group = group(4, 1024);
    let bufs = Buffers::new(&group, Collective::AllReduce, DType::F32, 4099 * 4, false, 0);
    bufs.run(&group, ReduceOp::Avg).unwrap();
    let first = group.client(0).read_one(bufs.dst[0].clone()).unwrap().to_vec();
    for m in 1..4 {
        assert_eq!(group.client(m).read_one(bufs.dst[m].clone()).unwrap().to_vec(), first, "member {m}");
    }
}
