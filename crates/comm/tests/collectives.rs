//! Every collective × element type × reduction × group size 1..=8 × sizes
//! (0, 1 and an odd number of elements per block, and a few of several MiB),
//! in place and out of place, against the host reference of
//! `cohort_comm::verify`: copies, integers, sums, products, minima and
//! maxima exactly (the patterns keep them exact), averages within
//! `verify::max_error`.

mod common;

use cohort_comm::op::Collective;
use cohort_comm::verify::Buffers;
use cohort_comm::{ClientGroup, DType, HostPath, ReduceOp};

fn check(group: &ClientGroup, coll: Collective, dtype: DType, op: ReduceOp, elems: usize, in_place: bool) {
    let n = group.len();
    let blocked = coll.blocked();
    let size = elems * dtype.size() * if blocked { n } else { 1 };
    let root = n / 2;
    let bufs = Buffers::new(group, coll, dtype, size, in_place, root);
    bufs.run(group, op).unwrap_or_else(|e| panic!("{coll:?} {dtype} {op} n={n} elems={elems}: {e}"));
    let wrong = bufs.wrong(group, op).unwrap_or_else(|e| panic!("{coll:?} {dtype} {op} n={n}: read failed: {e}"));
    assert_eq!(wrong, 0, "{coll:?} {dtype} {op} n={n} elems={elems} in_place={in_place}: {wrong} wrong elements");
}

fn matrix(path: HostPath, sizes: &[usize], dtypes: &[DType]) {
    for n in 1..=8 {
        let group = common::group(n).with_host_path(path).unwrap().with_stage_chunk(64);
        for coll in Collective::ALL {
            for &dtype in dtypes {
                let ops: &[ReduceOp] = if coll.reduces() { &ReduceOp::ALL } else { &[ReduceOp::Sum] };
                for &op in ops {
                    for &elems in sizes {
                        for in_place in [false, true] {
                            check(&group, coll, dtype, op, elems, in_place);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_collective_type_op_and_group_size_direct() {
    matrix(HostPath::Direct, &[0, 1, 37], &DType::ALL);
}

#[test]
fn every_collective_and_group_size_staged_in_pipelined_chunks() {
    // 64-byte chunks: 37 f64 elements cross several chunks.
    matrix(HostPath::Staged, &[0, 1, 37], &[DType::F64, DType::BF16, DType::I8, DType::U32]);
}

#[test]
fn several_mib() {
    let group = common::group(4);
    let mib = 3 << 20;
    for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::AllToAll] {
        for in_place in [false, true] {
            check(&group, coll, DType::F32, ReduceOp::Sum, mib / 4 / 4 + 3, in_place);
        }
    }
    check(&group, Collective::AllReduce, DType::BF16, ReduceOp::Avg, mib / 2 + 1, false);
    let staged = common::group(3).with_host_path(HostPath::Staged).unwrap().with_stage_chunk(1 << 20);
    check(&staged, Collective::AllReduce, DType::I32, ReduceOp::Sum, mib / 4 + 5, true);
}

#[test]
fn destinations_of_all_members_agree_bit_for_bit() {
    let group = common::group(5);
    let bufs = Buffers::new(&group, Collective::AllReduce, DType::F32, 4099 * 4, false, 0);
    bufs.run(&group, ReduceOp::Avg).unwrap();
    let first = group.client(0).read_one(bufs.dst[0].clone()).unwrap().to_vec();
    for m in 1..5 {
        assert_eq!(group.client(m).read_one(bufs.dst[m].clone()).unwrap().to_vec(), first, "member {m}");
    }
}
