//! Groups in one process: a 2×4 mesh of 8 devices all-reduces and
//! all-gathers along each dimension (checked against a host reference), on
//! CPU devices and on wgpu (lavapipe in CI); `split` orders members by key
//! and leaves colorless members out; bad layouts are refused.

mod common;

use std::sync::Once;

use cohort_comm::{Buffer, ClientGroup, Collectives, CommError, Mesh, ReduceOp};
use cohort_runtime::{Client, Runtime, WgpuRuntime};

const K: usize = 5;

fn input(m: usize) -> Vec<f32> {
    (0..K).map(|j| (m * 10 + j) as f32).collect()
}

/// All-reduce and all-gather along each dimension of a `rows`×`cols` mesh
/// of `group`'s members, compared with the host's answer.
fn mesh_collectives(group: &ClientGroup, rows: usize, cols: usize) {
    let n = rows * cols;
    let mesh = Mesh::new(group, &[("dp", rows), ("tp", cols)]).unwrap();
    assert_eq!((mesh.names(), mesh.shape()), (&["dp".to_string(), "tp".to_string()][..], &[rows, cols][..]));
    assert_eq!(mesh.coords(n - 1), [rows - 1, cols - 1]);
    for (dim, size, stride) in [("dp", rows, cols), ("tp", cols, 1)] {
        let groups = mesh.groups(dim).unwrap();
        assert_eq!(groups.len(), n / size, "{dim}");
        for m in 0..n {
            let sub = mesh.group_of(dim, m).unwrap();
            // The members of m's line along `dim`, in coordinate order.
            let coord = mesh.coords(m)[if dim == "dp" { 0 } else { 1 }];
            let line: Vec<usize> = (0..size).map(|k| m - coord * stride + k * stride).collect();
            assert_eq!(sub.clients()[coord].device_id(), group.client(m).device_id(), "{dim} member {m}");
            if coord != 0 {
                continue; // one check per line
            }
            let src: Vec<Buffer<f32>> = line
                .iter()
                .enumerate()
                .map(|(i, &g)| Buffer::from_slice(&sub.clients()[i], &input(g)).unwrap())
                .collect();
            let sum: Vec<f32> = (0..K).map(|j| line.iter().map(|&g| input(g)[j]).sum()).collect();
            let dst = sub.zeros::<f32>(K).unwrap();
            sub.all_reduce(&src, &dst, ReduceOp::Sum).unwrap().wait().unwrap();
            for d in &dst {
                assert_eq!(d.to_vec().unwrap(), sum, "all_reduce along {dim} through member {m}");
            }
            let gathered: Vec<f32> = line.iter().flat_map(|&g| input(g)).collect();
            let dst = sub.zeros::<f32>(K * size).unwrap();
            sub.all_gather(&src, &dst).unwrap();
            for d in &dst {
                assert_eq!(d.to_vec().unwrap(), gathered, "all_gather along {dim} through member {m}");
            }
        }
    }
}

#[test]
fn a_two_by_four_mesh_of_cpu_devices_reduces_and_gathers_along_each_dimension() {
    mesh_collectives(&common::group(8), 2, 4);
}

fn wgpu_clients(n: usize) -> Vec<Client> {
    static DEVICES: Once = Once::new();
    DEVICES.call_once(|| {
        let set = std::env::var("COHORT_WGPU_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok());
        if set.is_none_or(|d| d < 8) {
            std::env::set_var("COHORT_WGPU_DEVICES", "8");
        }
    });
    (0..n).map(|i| WgpuRuntime::client(i).unwrap_or_else(|e| panic!("wgpu device {i}: {e}"))).collect()
}

#[test]
fn a_two_by_four_mesh_of_wgpu_devices_reduces_and_gathers_along_each_dimension() {
    mesh_collectives(&ClientGroup::new(wgpu_clients(8)).unwrap(), 2, 4);
}

#[test]
fn split_orders_by_key_then_member_and_leaves_colorless_members_out() {
    let group = common::group(6);
    // Colors: members 0, 2, 4 → 7; 1, 3 → 9; 5 → none. Keys reverse 0, 2, 4.
    let colors = [Some(7), Some(9), Some(7), Some(9), Some(7), None];
    let keys = [3, 0, 2, 0, 1, 5];
    let split = group.split(&colors, &keys).unwrap();
    assert!(split[5].is_none());
    let seven = split[0].as_ref().unwrap();
    let order: Vec<_> = seven.clients().iter().map(|c| c.device_id()).collect();
    assert_eq!(order, [4, 2, 0].map(|m| group.client(m).device_id()), "by key");
    let nine = split[3].as_ref().unwrap();
    let order: Vec<_> = nine.clients().iter().map(|c| c.device_id()).collect();
    assert_eq!(order, [1, 3].map(|m| group.client(m).device_id()), "equal keys: by member");
    // The split group runs collectives in its own numbering.
    let src: Vec<Buffer<f32>> =
        [4, 2, 0].iter().enumerate().map(|(i, &m)| Buffer::from_slice(seven.client(i), &input(m)).unwrap()).collect();
    let dst = seven.zeros::<f32>(3 * K).unwrap();
    seven.all_gather(&src, &dst).unwrap();
    assert_eq!(dst[1].to_vec().unwrap(), [4, 2, 0].iter().flat_map(|&m| input(m)).collect::<Vec<_>>());
}

#[test]
fn bad_layouts_and_names_are_refused() {
    let group = common::group(4);
    for dims in [&[("a", 3)][..], &[("a", 2), ("a", 2)], &[("a", 4), ("b", 0)], &[]] {
        let err = Mesh::new(&group, dims).unwrap_err();
        assert!(matches!(err, CommError::MeshShape { members: 4, .. }), "{err}");
    }
    let mesh = Mesh::new(&group, &[("a", 2), ("b", 2)]).unwrap();
    let err = mesh.groups("c").unwrap_err();
    assert!(err.to_string().contains("no dimension \"c\"; its dimensions are a, b"), "{err}");
    assert!(matches!(group.subgroup(&[0, 4]).unwrap_err(), CommError::NotAMember { index: 4, .. }));
    assert!(matches!(group.subgroup(&[1, 1]).unwrap_err(), CommError::DuplicateDevice { .. }));
    assert!(matches!(group.split(&[Some(0)], &[0, 0, 0, 0]).unwrap_err(), CommError::BufferCount { .. }));
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_a_mesh_of_the_gpus_reduces_and_gathers_along_each_dimension_through_nccl() {
    let n = cohort_runtime::CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    assert!(n >= 2, "this test needs two GPUs or more, found {n}");
    let n = n / 2 * 2;
    let clients: Vec<Client> = (0..n).map(|i| cohort_runtime::CudaRuntime::client(i).unwrap()).collect();
    let group = ClientGroup::new(clients).unwrap();
    assert_eq!(group.transport(), cohort_comm::Transport::Nccl, "the name promises NCCL");
    mesh_collectives(&group, 2, n / 2);
}
