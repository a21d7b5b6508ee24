//! Groups of a Communicator across ranks (one thread per rank, shared
//! memory between them): `split` orders by key and leaves colorless ranks
//! out (and so does `World::split`, alone and as ranks), `subgroup` refuses
//! lists the ranks disagree on (naming them) and bad lists on every rank, a
//! 2×4 mesh of 4 ranks × 2 devices all-reduces and all-gathers along each
//! dimension against a host reference, a desync inside a group names the
//! group, and a grouped call of 100 tensors of mixed sizes and types equals
//! 100 separate calls.

mod common;

use std::thread;
use std::time::Duration;

use cohort_comm::{Buffer, Collectives, CommError, Communicator, Mesh, ReduceOp};
use cohort_runtime::{CpuRuntime, Runtime};

/// Runs `body(comm)` on `n` ranks of `local` CPU devices each (rank r:
/// devices `first + r × local` onwards; tests running at once use distinct
/// devices) over a fresh store.
fn ranks<T: Send + 'static>(first: usize, n: usize, local: usize, body: fn(Communicator) -> T) -> Vec<T> {
    common::communicator_ranks(64, first, n, local, body)
}

/// A tensor of f32 and one of i64, one buffer per local device each.
type Pair = (Vec<Buffer<f32>>, Vec<Buffer<i64>>);

/// An all-gather's source and destination (u8) and a broadcast's buffer (f64).
type Extra = (Vec<Buffer<u8>>, Vec<Buffer<u8>>, Vec<Buffer<f64>>);

fn input(m: usize, k: usize) -> Vec<f32> {
    (0..k).map(|j| (m * 100 + j) as f32).collect()
}

#[test]
fn split_orders_ranks_by_key_and_leaves_colorless_ranks_out() {
    // 5 ranks: even ranks color 0 (keys reverse them), odd ranks color 1,
    // rank 4 no color.
    let results = ranks(0, 5, 1, |comm| {
        let r = comm.rank();
        let color = (r != 4).then_some((r % 2) as u32);
        let group = comm.split(color, -(r as i64)).unwrap();
        let Some(group) = group else {
            comm.barrier().unwrap();
            return (r, None);
        };
        let mine = group.replicate(&input(r, 3)).unwrap();
        let all = group.zeros::<f32>(3 * group.members()).unwrap();
        group.all_gather(&mine, &all).unwrap();
        let sum = group.zeros::<f32>(3).unwrap();
        group.all_reduce(&mine, &sum, ReduceOp::Sum).unwrap();
        // The parent still works after its split.
        comm.barrier().unwrap();
        let info = (group.rank(), group.size(), group.group_name(), group.job_ranks());
        (r, Some((info, all[0].to_vec().unwrap(), sum[0].to_vec().unwrap())))
    });
    for (r, got) in results {
        let Some(((rank, size, name, job_ranks), all, sum)) = got else {
            assert_eq!(r, 4, "only rank 4 joins no group");
            continue;
        };
        let order: Vec<usize> = if r % 2 == 0 { vec![2, 0] } else { vec![3, 1] };
        assert_eq!((rank, size), (order.iter().position(|&x| x == r).unwrap(), 2), "rank {r}");
        assert_eq!(job_ranks, order, "rank {r}");
        assert!(name.starts_with("comm") && name.ends_with(&format!(".s0c{}", r % 2)), "{name}");
        assert_eq!(all, order.iter().flat_map(|&m| input(m, 3)).collect::<Vec<_>>(), "rank {r}");
        let expected: Vec<f32> = (0..3).map(|j| order.iter().map(|&m| input(m, 3)[j]).sum()).collect();
        assert_eq!(sum, expected, "rank {r}");
    }
}

#[test]
fn subgroups_the_ranks_disagree_on_are_refused_naming_them() {
    let results = ranks(5, 4, 1, |comm| {
        // Rank 2 lists another subgroup than the others.
        let list: &[usize] = if comm.rank() == 2 { &[0, 2] } else { &[0, 1] };
        let disagree = comm.subgroup(list).map(|g| g.is_some());
        let twice = comm.subgroup(&[1, 3, 1]).map(|g| g.is_some());
        let outside = comm.subgroup(&[0, 4]).map(|g| g.is_some());
        // Nothing hangs and the parent still works.
        comm.barrier().unwrap();
        let fine = comm.subgroup(&[3, 1]).unwrap().map(|g| (g.rank(), g.job_ranks()));
        (disagree, twice, outside, fine)
    });
    for (rank, (disagree, twice, outside, fine)) in results.into_iter().enumerate() {
        match disagree {
            Err(CommError::GroupDisagreement { operation: "subgroup", detail }) => {
                assert!(detail.contains("rank(s) 2 passed a different member list than rank 0"), "{detail}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(
            matches!(&twice, Err(CommError::InvalidGroup { detail, .. }) if detail.contains("member 1 is listed twice")),
            "rank {rank}: {twice:?}"
        );
        assert!(
            matches!(&outside, Err(CommError::InvalidGroup { detail, .. }) if detail.contains("member 4 is not a member")),
            "rank {rank}: {outside:?}"
        );
        let expected = match rank {
            3 => Some((0, vec![3, 1])),
            1 => Some((1, vec![3, 1])),
            _ => None,
        };
        assert_eq!(fine, expected, "rank {rank}");
    }
}

/// A 2×4 mesh over 4 ranks × 2 devices: along "tp" (size 4) each group
/// holds two ranks' two devices, along "dp" (size 2) one device of two
/// ranks; every group all-reduces and all-gathers against the host's answer.
#[test]
fn a_two_by_four_mesh_of_four_ranks_of_two_devices_reduces_and_gathers_along_each_dimension() {
    const K: usize = 5;
    let results = ranks(10, 4, 2, |comm| {
        let mesh = Mesh::new(&comm, &[("dp", 2), ("tp", 4)]).unwrap();
        let mut checked = Vec::new();
        for (dim, size, stride) in [("dp", 2usize, 4usize), ("tp", 4, 1)] {
            for slot in 0..2 {
                let m = comm.rank() * 2 + slot;
                let group = mesh.group_of(dim, m).unwrap();
                let coord = mesh.coords(m)[if dim == "dp" { 0 } else { 1 }];
                let line: Vec<usize> = (0..size).map(|k| m - coord * stride + k * stride).collect();
                // This group's local members (in its local order) and their inputs.
                let first = group.first_member();
                if coord != first {
                    continue; // one check per group and process, from its first local member
                }
                let src: Vec<Buffer<f32>> = (0..group.clients().len())
                    .map(|l| Buffer::from_slice(&group.clients()[l], &input(line[first + l], K)).unwrap())
                    .collect();
                let dst = group.zeros::<f32>(K).unwrap();
                group.all_reduce(&src, &dst, ReduceOp::Sum).unwrap().wait().unwrap();
                let all = group.zeros::<f32>(K * size).unwrap();
                group.all_gather(&src, &all).unwrap();
                for (d, a) in dst.iter().zip(&all) {
                    checked.push((dim, line.clone(), d.to_vec().unwrap(), a.to_vec().unwrap()));
                }
            }
        }
        checked
    });
    let mut seen = 0;
    for checked in results {
        for (dim, line, sum, all) in checked {
            let expected: Vec<f32> = (0..K).map(|j| line.iter().map(|&m| input(m, K)[j]).sum()).collect();
            assert_eq!(sum, expected, "all_reduce along {dim} over {line:?}");
            assert_eq!(all, line.iter().flat_map(|&m| input(m, K)).collect::<Vec<_>>(), "all_gather along {dim}");
            seen += 1;
        }
    }
    // Every member checked its result along both dimensions.
    assert_eq!(seen, 16);
}

#[test]
fn a_desync_inside_a_group_names_the_group() {
    let results = ranks(18, 4, 1, |comm| {
        let group = comm.split(Some((comm.rank() % 2) as u32), 0).unwrap().unwrap();
        group.set_timeout(Duration::from_secs(20));
        let x = group.replicate(&[1.0f32; 16]).unwrap();
        // In the group of ranks 1 and 3, rank 3 calls a broadcast where rank 1
        // all-reduces.
        if comm.rank() == 3 {
            group.broadcast(&x, &x, 0).unwrap();
        } else {
            group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
        }
        (comm.rank(), x[0].to_vec())
    });
    for (rank, got) in results {
        if rank % 2 == 0 {
            assert_eq!(got.unwrap(), [2.0; 16], "rank {rank}: its group is fine");
            continue;
        }
        let err = got.unwrap_err().to_string();
        assert!(err.contains("collective mismatch in group comm") && err.contains("(ranks 1, 3)"), "{err}");
        assert!(!err.contains("timed out"), "{err}");
    }
}

#[test]
fn a_grouped_call_of_a_hundred_mixed_tensors_equals_a_hundred_separate_calls() {
    let results = ranks(22, 3, 2, |comm| {
        let member = |l: usize| comm.rank() * 2 + l;
        let len = |i: usize| 1 + (i * 37) % 300;
        let make = |i: usize| -> Pair {
            let f = (0..2).map(|l| {
                let data: Vec<f32> = (0..len(i)).map(|j| (member(l) * 7 + i + j) as f32).collect();
                Buffer::from_slice(&comm.clients()[l], &data).unwrap()
            });
            let n = (0..2).map(|l| {
                let data: Vec<i64> = (0..len(i) / 2 + 1).map(|j| (member(l) * 3 + i * j) as i64).collect();
                Buffer::from_slice(&comm.clients()[l], &data).unwrap()
            });
            (f.collect(), n.collect())
        };
        let (grouped, separate): (Vec<_>, Vec<_>) = (0..50).map(|i| (make(i), make(i))).unzip();
        // Beside them, calls that are not all-reduces: an all-gather of
        // u8 and a broadcast of f64 from member 3.
        let bytes = |l: usize| Buffer::from_slice(&comm.clients()[l], &[member(l) as u8; 3]).unwrap();
        let floats = |l: usize| Buffer::from_slice(&comm.clients()[l], &[member(l) as f64 + 0.5; 7]).unwrap();
        let extra =
            || -> Extra { ((0..2).map(bytes).collect(), comm.zeros::<u8>(18).unwrap(), (0..2).map(floats).collect()) };
        let (gx, sx) = (extra(), extra());
        let work = comm
            .group(|g| {
                for (i, (f, n)) in grouped.iter().enumerate() {
                    let op = if i % 3 == 0 { ReduceOp::Max } else { ReduceOp::Avg };
                    g.all_reduce(f, f, if i % 2 == 0 { ReduceOp::Sum } else { ReduceOp::Avg })?;
                    g.all_reduce(n, n, if op == ReduceOp::Max { op } else { ReduceOp::Sum })?;
                }
                g.all_gather(&gx.0, &gx.1)?;
                g.broadcast(&gx.2, &gx.2, 3)
            })
            .unwrap();
        work.wait().unwrap();
        for (i, (f, n)) in separate.iter().enumerate() {
            let op = if i % 3 == 0 { ReduceOp::Max } else { ReduceOp::Avg };
            comm.all_reduce(f, f, if i % 2 == 0 { ReduceOp::Sum } else { ReduceOp::Avg }).unwrap();
            comm.all_reduce(n, n, if op == ReduceOp::Max { op } else { ReduceOp::Sum }).unwrap();
        }
        comm.all_gather(&sx.0, &sx.1).unwrap();
        comm.broadcast(&sx.2, &sx.2, 3).unwrap();
        let extras = |x: &Extra| (x.1[1].to_vec().unwrap(), x.2[0].to_vec().unwrap());
        assert_eq!(extras(&gx), extras(&sx));
        assert_eq!(extras(&gx).0, (0..6u8).flat_map(|m| [m; 3]).collect::<Vec<_>>());
        assert_eq!(extras(&gx).1, [3.5; 7]);
        let read = |set: &[Pair]| -> Vec<(Vec<f32>, Vec<i64>)> {
            set.iter().flat_map(|(f, n)| (0..2).map(|l| (f[l].to_vec().unwrap(), n[l].to_vec().unwrap()))).collect()
        };
        (read(&grouped), read(&separate))
    });
    for (rank, (grouped, separate)) in results.into_iter().enumerate() {
        assert_eq!(grouped.len(), 100);
        assert_eq!(grouped, separate, "rank {rank}");
        // And against the host: the f32 sum of tensor 0 over 6 members.
        let expected: Vec<f32> = (0..1).map(|j| (0..6).map(|m| (m * 7 + j) as f32).sum()).collect();
        assert_eq!(grouped[0].0[..1], expected[..], "rank {rank}");
    }
}

#[test]
fn a_timeout_inside_a_group_names_the_group_and_stays_in_it() {
    // A group's abort stays in the group: ranks 0 and 2 keep working.
    let results = ranks(28, 4, 1, |comm| {
        let group = comm.split(Some((comm.rank() % 2) as u32), 0).unwrap().unwrap();
        group.set_timeout(Duration::from_millis(800));
        let x = group.replicate(&[1.0f32; 4]).unwrap();
        let mut waited = None;
        if comm.rank() != 3 {
            let work = group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
            if comm.rank() == 1 {
                waited = Some(work.wait_timeout(Duration::from_millis(100)).unwrap_err().to_string());
            }
        }
        let got = x[0].to_vec().map_err(|e| format!("{e} | {}", waited.unwrap_or_default()));
        if comm.rank() == 3 {
            // Alive (not gone) until rank 1 timed out.
            thread::sleep(Duration::from_secs(3));
        }
        (comm.rank(), got)
    });
    for (rank, got) in results {
        match rank {
            0 | 2 => assert_eq!(got.unwrap(), [2.0; 4]),
            1 => {
                let text = got.unwrap_err();
                assert!(text.contains("timed out") && text.contains("in group comm"), "{text}");
                // The handle's timed wait names the rank and group too.
                assert!(
                    text.contains("has not finished within 100 ms") && text.contains("on rank 1 in group comm"),
                    "{text}"
                );
                assert!(text.contains("rank(s) 3 never arrived"), "{text}");
            }
            _ => assert_eq!(got.unwrap(), [1.0; 4], "rank 3 called nothing"),
        }
    }
}

#[test]
fn a_grouped_call_against_separate_calls_is_a_mismatch_naming_both() {
    let results = ranks(34, 2, 1, |comm| {
        comm.set_timeout(Duration::from_secs(20));
        let a = comm.replicate(&[1.0f32; 8]).unwrap();
        let b = comm.replicate(&[2i32; 8]).unwrap();
        if comm.rank() == 0 {
            let _ = comm.group(|g| {
                g.all_reduce(&a, &a, ReduceOp::Sum)?;
                g.all_reduce(&b, &b, ReduceOp::Sum)
            });
        } else {
            comm.all_reduce(&a, &a, ReduceOp::Sum).unwrap();
        }
        a[0].to_vec().map_err(|e| e.to_string())
    });
    for (rank, got) in results.into_iter().enumerate() {
        let err = got.unwrap_err();
        assert!(err.contains("collective mismatch"), "rank {rank}: {err}");
        assert!(err.contains("called group #1 (2 calls") && err.contains("called all_reduce #1 (f32 × 8"), "{err}");
    }
}

#[test]
fn splits_that_cannot_be_formed_across_processes_are_refused_on_every_rank() {
    // 2 ranks × 2 devices (members 0, 1 | 2, 3).
    let results = ranks(36, 2, 2, |comm| {
        let r = comm.rank() as i64;
        // Wrong lengths: refused before anything is exchanged.
        let count = comm.split_members(&[Some(0)], &[0, 0]).map(|g| g.len());
        // Keys interleave the ranks' devices: 0, 2 | 1, 3 → members 0, 2, 1, 3.
        let apart = comm.split_members(&[Some(0), Some(0)], &[r, r + 2]).map(|g| g.len());
        // Rank 0 brings two devices, rank 1 one.
        let colors = if r == 0 { [Some(5), Some(5)] } else { [Some(5), None] };
        let uneven = comm.split_members(&colors, &[0, 0]).map(|g| g.len());
        // A mesh asks for a group this process holds no member of.
        let mesh = Mesh::new(&comm, &[("a", 2), ("b", 2)]).unwrap();
        let foreign = if r == 0 { 3 } else { 0 };
        let elsewhere = mesh.group_of("b", foreign).map(|g| g.members());
        let bad_dims = Mesh::new(&comm, &[("a", 3)]).map(|m| m.shape().to_vec());
        comm.barrier().unwrap();
        (count, apart, uneven, elsewhere, bad_dims)
    });
    for (rank, (count, apart, uneven, elsewhere, bad_dims)) in results.into_iter().enumerate() {
        assert!(matches!(count, Err(CommError::BufferCount { what: "colors", expected: 2, got: 1, .. })), "{count:?}");
        assert!(
            matches!(&apart, Err(CommError::InvalidGroup { detail, .. }) if detail.contains("rank 0's devices apart")),
            "rank {rank}: {apart:?}"
        );
        assert!(
            matches!(&uneven, Err(CommError::InvalidGroup { detail, .. })
                if detail.contains("takes 2 device(s) of rank 0 but 1 of rank 1")),
            "rank {rank}: {uneven:?}"
        );
        assert!(
            matches!(&elsewhere, Err(CommError::InvalidGroup { detail, .. }) if detail.contains("holds no device of this process")),
            "rank {rank}: {elsewhere:?}"
        );
        assert!(matches!(bad_dims, Err(CommError::MeshShape { members: 4, .. })), "{bad_dims:?}");
    }
}

#[test]
fn a_world_of_ranks_splits_and_subgroups_like_a_world_alone() {
    use cohort_comm::World;
    // As ranks: 2 ranks × 2 devices, members 0..4; alone: one group of 4.
    let ranks_side = ranks(40, 2, 2, |comm| {
        let world = World::Ranks(comm);
        let split = world.split_members(&[Some(1), Some(2)], &[0, 0]).unwrap();
        let sub = world.subgroup(&[3, 0]).unwrap().unwrap();
        let ones = split[0].as_ref().unwrap();
        let x = ones.replicate(&[world.first_member() as f32]).unwrap();
        ones.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
        (x[0].to_vec().unwrap(), sub.members(), sub.first_member())
    });
    assert_eq!(ranks_side[0], (vec![2.0], 2, 1), "rank 0: members 0 and 2 sum 0 + 2; member 0 is second of [3, 0]");
    assert_eq!(ranks_side[1], (vec![2.0], 2, 0), "rank 1: member 3 is first of [3, 0]");
    std::env::set_var("COHORT_CPU_DEVICES", "64");
    let alone = World::Local(
        cohort_comm::ClientGroup::new((44..48).map(|i| CpuRuntime::client(i).unwrap()).collect()).unwrap(),
    );
    let split = alone.split_members(&[Some(1), Some(2), Some(1), None], &[0; 4]).unwrap();
    assert!(split[3].is_none());
    assert_eq!(split[0].as_ref().unwrap().members(), 2);
    assert_eq!(alone.subgroup(&[3, 0]).unwrap().unwrap().members(), 2);
}

/// `World::split(color, key)` is `MPI_Comm_split` over the job's
/// processes, every local device of a process taking its color and key:
/// as ranks, `Communicator::split`; alone, the one process's group of all
/// its devices (or none without a color).
#[test]
fn a_world_splits_its_processes_by_color_and_key() {
    use cohort_comm::World;
    // 3 ranks × 2 devices: ranks 0 and 2 in color 5 (keys reverse them),
    // rank 1 in none.
    let ranks_side = ranks(54, 3, 2, |comm| {
        let r = comm.rank();
        let world = World::Ranks(comm);
        let color = (r != 1).then_some(5);
        let Some(group) = world.split(color, -(r as i64)).unwrap() else {
            world.barrier().unwrap();
            return (r, None);
        };
        let x = group.replicate(&[world.first_member() as f32]).unwrap();
        group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
        world.barrier().unwrap();
        let (rank, size, members, first) = (group.rank(), group.world_size(), group.members(), group.first_member());
        (r, Some((rank, size, members, first, x[1].to_vec().unwrap())))
    });
    assert_eq!(ranks_side[1], (1, None), "rank 1 passed no color");
    // Members 0, 1 (rank 0, each holding 0) and 4, 5 (rank 2, each 4).
    assert_eq!(ranks_side[0], (0, Some((1, 2, 4, 2, vec![8.0]))), "rank 0 is second by key");
    assert_eq!(ranks_side[2], (2, Some((0, 2, 4, 0, vec![8.0]))), "rank 2 is first by key");
    std::env::set_var("COHORT_CPU_DEVICES", "64");
    let clients: Vec<_> = (60..62).map(|i| CpuRuntime::client(i).unwrap()).collect();
    let alone = World::Local(cohort_comm::ClientGroup::new(clients.clone()).unwrap());
    let group = alone.split(Some(3), 7).unwrap().expect("a color joins a group");
    let ids = |w: &World| w.clients().iter().map(|c| c.device_id()).collect::<Vec<_>>();
    assert_eq!(ids(&group), ids(&alone), "alone, the group is every device, in order");
    assert!(matches!(group, World::Local(_)));
    let x = group.replicate(&[1.5f32, 2.0]).unwrap();
    group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
    assert_eq!(x[1].to_vec().unwrap(), [3.0, 4.0]);
    assert!(alone.split(None, 0).unwrap().is_none(), "no color, no group");
}

#[test]
fn a_rank_that_leaves_a_group_is_named_by_its_job_rank() {
    let results = ranks(50, 4, 1, |comm| {
        // Group of ranks 3 and 1 (keys reverse them): rank 3 is the group's rank 0.
        let group = comm.split(Some((comm.rank() % 2) as u32), -(comm.rank() as i64)).unwrap().unwrap();
        group.set_timeout(Duration::from_secs(30));
        let x = group.replicate(&[1.0f32; 4]).unwrap();
        if comm.rank() == 3 {
            // Leaves without calling: its group's heartbeat says it is gone.
            drop((x, group));
            thread::sleep(Duration::from_secs(2));
            return (3, Ok(vec![]));
        }
        group.all_reduce(&x, &x, ReduceOp::Sum).unwrap();
        (comm.rank(), x[0].to_vec().map_err(|e| e.to_string()))
    });
    for (rank, got) in results {
        match rank {
            0 | 2 => assert_eq!(got.unwrap(), [2.0; 4]),
            1 => {
                let err = got.unwrap_err();
                assert!(err.contains("in group comm") && err.contains("(ranks 3, 1)"), "{err}");
                assert!(err.contains("rank 3 went away") && !err.contains("timed out"), "{err}");
            }
            _ => {}
        }
    }
}
