//! Errors and failures of collectives on wgpu devices, and moving buffers
//! between the CPU and wgpu runtimes: a group mixing them is refused, a
//! buffer moves with `to_client` both ways, argument errors name wgpu
//! devices and write nothing, a failed kernel poisons every destination, a
//! member that never arrives times out by name.
//!
//! Four devices on the first adapter (`COHORT_WGPU_DEVICES=4`; lavapipe in CI).

use std::sync::Once;
use std::time::Duration;

use cohort_comm::{to_client, ClientGroup, CommError, DType, ReduceOp};
use cohort_runtime::{Bytes, Client, CpuRuntime, GridCount, Handle, Kernel, KernelArguments, Runtime, WgpuRuntime};

/// Clients of wgpu devices `0..n`, every one on adapter 0.
fn clients(n: usize) -> Vec<Client> {
    static DEVICES: Once = Once::new();
    // Before the adapters are enumerated (every test calls this first).
    DEVICES.call_once(|| {
        let set = std::env::var("COHORT_WGPU_DEVICES").ok().and_then(|v| v.trim().parse::<usize>().ok());
        if set.is_none_or(|d| d < 4) {
            std::env::set_var("COHORT_WGPU_DEVICES", "4");
        }
    });
    (0..n).map(|i| WgpuRuntime::client(i).unwrap_or_else(|e| panic!("wgpu device {i}: {e}"))).collect()
}

fn buffers(group: &ClientGroup, bytes: usize, value: u8) -> Vec<Handle> {
    group.clients().iter().map(|c| c.create(Bytes::from(vec![value; bytes]))).collect()
}

#[test]
fn a_group_of_cpu_and_wgpu_clients_is_refused() {
    let wgpu = clients(1).remove(0);
    let cpu = CpuRuntime::client(0).unwrap();
    for (clients, member, first, other) in
        [(vec![cpu.clone(), wgpu.clone()], 1, "cpu", "wgpu"), (vec![wgpu, cpu], 1, "wgpu", "cpu")]
    {
        let err = ClientGroup::new(clients).unwrap_err();
        assert_eq!(err, CommError::MixedRuntimes { member, first, other });
        let message = err.to_string();
        assert!(message.contains("one runtime") && message.contains("to_client"), "{message}");
    }
}

#[test]
fn to_client_moves_buffers_between_cpu_and_wgpu_both_ways() {
    let wgpu = clients(2);
    let cpu = CpuRuntime::client(0).unwrap();
    let values: Vec<u32> = (0..1001).map(|i| i * 3 + 1).collect();
    // CPU -> wgpu.
    let on_cpu = cpu.create(Bytes::from_elems(&values));
    let on_wgpu = to_client(&on_cpu, &cpu, &wgpu[1]).unwrap();
    assert_eq!(on_wgpu.service(), wgpu[1].service_id());
    assert_eq!(wgpu[1].read_one(on_wgpu.clone()).unwrap().to_elems::<u32>(), values);
    // wgpu -> wgpu (another device of the adapter: a send/recv).
    let moved = to_client(&on_wgpu, &wgpu[1], &wgpu[0]).unwrap();
    assert_eq!(wgpu[0].read_one(moved.clone()).unwrap().to_elems::<u32>(), values);
    // wgpu -> CPU.
    let back = to_client(&moved, &wgpu[0], &cpu).unwrap();
    assert_eq!(back.service(), cpu.service_id());
    assert_eq!(cpu.read_one(back).unwrap().to_elems::<u32>(), values);
    // Empty buffers move too.
    let empty = to_client(&cpu.empty(0), &cpu, &wgpu[0]).unwrap();
    assert_eq!(empty.size(), 0);
    // A handle that is not the sender's is refused.
    let err = to_client(&on_cpu, &wgpu[0], &cpu).unwrap_err();
    assert!(err.to_string().contains("to_client"), "{err}");
}

#[test]
fn argument_errors_name_wgpu_devices_and_write_nothing() {
    let group = ClientGroup::new(clients(3)).unwrap();
    let src = buffers(&group, 64, 1);
    let dst = buffers(&group, 64, 7);
    let mut foreign = dst.clone();
    foreign[2] = dst[1].clone();
    let err = group.all_reduce_handles(&src, &foreign, DType::F32, ReduceOp::Sum).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("member 2") && message.contains("wgpu:1") && message.contains("wgpu:2"), "{message}");
    let small: Vec<Handle> = group.clients().iter().map(|c| c.create(Bytes::from(vec![7u8; 32]))).collect();
    let err = group.reduce_scatter_handles(&src, &small, DType::F64, ReduceOp::Max).unwrap_err();
    assert!(err.to_string().contains("96 bytes") && err.to_string().contains("3 members"), "{err}");
    let err = group.broadcast_handles(&src[0], &dst, DType::U8, 3).unwrap_err();
    assert!(err.to_string().contains("root 3"), "{err}");
    for (m, d) in dst.iter().chain(&small).enumerate() {
        let bytes = group.client(m % 3).read_one(d.clone()).unwrap();
        assert!(bytes.iter().all(|&b| b == 7), "buffer {m} was written by a refused call");
    }
}

#[test]
fn a_failed_kernel_poisons_every_destination() {
    let group = ClientGroup::new(clients(4)).unwrap();
    let src = buffers(&group, 64, 1);
    let dst = buffers(&group, 64, 0);
    // Member 2's source is written by a kernel that does not compile.
    let broken = Kernel::new("broken_wgsl").with_wgsl(
        "@group(0) @binding(0) var<storage, read_write> x: array<u32>;\n@compute @workgroup_size(1)\nfn main() { x[0] = no_such_name; }",
    );
    group.client(2).launch(&broken, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&src[2])).unwrap();
    group.all_reduce_handles(&src, &dst, DType::F32, ReduceOp::Sum).unwrap();
    for (m, d) in dst.iter().enumerate() {
        let message = group.client(m).read_one(d.clone()).unwrap_err().to_string();
        assert!(message.contains("all_reduce") && message.contains("no_such_name"), "member {m}: {message}");
    }
    // The group still works afterwards.
    let fresh = buffers(&group, 64, 1);
    group.all_reduce_handles(&fresh, &dst, DType::U8, ReduceOp::Sum).unwrap();
    assert!(group.client(3).read_one(dst[3].clone()).unwrap().iter().all(|&b| b == 4));
}

#[test]
fn a_member_that_never_arrives_times_out_naming_it() {
    let group = ClientGroup::new(clients(3)).unwrap().with_timeout(Duration::from_millis(500));
    let src = buffers(&group, 16, 1);
    let dst = buffers(&group, 16, 0);
    group.sync().unwrap();
    // Member 1's device is busy until member 0 has given up: it cannot
    // arrive in time, however slow the machine.
    let (release, busy) = std::sync::mpsc::channel::<()>();
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
    assert!(message.contains("member 1 (wgpu:1)") && message.contains("did not arrive"), "{message}");
    group.client(1).sync().unwrap();
}
