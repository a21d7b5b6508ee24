//! `COHORT_WGPU_DEVICES=N`: N wgpu devices, each its own `wgpu::Device` and
//! queue, all on the first adapter (lavapipe in CI, which is one adapter).
//! Its own process: the variable is read once, with the adapters.

use std::sync::Once;

use cohort_runtime::{Bytes, Client, GridCount, Kernel, KernelArguments, Runtime, Scalar, WgpuRuntime};

const DEVICES: usize = 3;

fn clients() -> Vec<Client> {
    static SET: Once = Once::new();
    // Set before the adapters are enumerated (every test calls this first).
    SET.call_once(|| std::env::set_var("COHORT_WGPU_DEVICES", DEVICES.to_string()));
    WgpuRuntime::clients().unwrap_or_else(|e| panic!("no wgpu devices: {e}"))
}

fn add_kernel() -> Kernel {
    Kernel::new("add_scalar").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<u32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] + scalars[0]; }
}"#,
    )
}

#[test]
fn devices_share_the_first_adapter_and_say_so() {
    let clients = clients();
    assert_eq!(WgpuRuntime::device_count().unwrap(), DEVICES);
    assert_eq!(clients.len(), DEVICES);
    let adapters = WgpuRuntime::adapters().unwrap();
    assert!(!adapters.is_empty());
    assert_eq!(adapters[0].devices, (0..DEVICES).collect::<Vec<_>>(), "every device sits on adapter 0");
    assert!(adapters[1..].iter().all(|a| a.devices.is_empty()), "other adapters get no device");
    for (i, client) in clients.iter().enumerate() {
        assert_eq!(WgpuRuntime::adapter_of(i).unwrap(), 0);
        let props = client.properties();
        assert_eq!(props.backend, "wgpu");
        assert_eq!(props.device.index, i as u32);
        assert!(props.name.contains(&adapters[0].name), "{} names adapter {}", props.name, adapters[0].name);
        assert!(props.name.ends_with("adapter 0)"), "{} says which adapter", props.name);
        assert_eq!(props.max_binding_size, adapters[0].max_binding_size);
    }
    let ids: std::collections::HashSet<_> = clients.iter().map(|c| c.device_id()).collect();
    assert_eq!(ids.len(), DEVICES, "distinct devices");
    let err = WgpuRuntime::client(DEVICES).unwrap_err().to_string();
    assert!(err.contains("does not exist") && err.contains("COHORT_WGPU_DEVICES=3"), "{err}");
    assert!(WgpuRuntime::adapter_of(DEVICES).is_err());
}

#[test]
fn each_device_has_its_own_memory_and_queue() {
    let clients = clients();
    let n = 1000;
    let handles: Vec<_> = clients.iter().map(|c| c.create(Bytes::from_elems(&vec![1u32; n]))).collect();
    // Different work on each device, queued before any is read.
    for (i, (client, h)) in clients.iter().zip(&handles).enumerate() {
        for _ in 0..=i {
            let args = KernelArguments::new().buffer(h).scalar(Scalar::U32(10 * (i as u32 + 1)));
            client.launch(&add_kernel(), GridCount::cover(n, 64), args).unwrap();
        }
    }
    for (i, (client, h)) in clients.iter().zip(&handles).enumerate() {
        let want = 1 + 10 * (i as u32 + 1) * (i as u32 + 1);
        assert_eq!(client.read_one(h.clone()).unwrap().to_elems::<u32>(), vec![want; n], "device {i}");
    }
    // A handle of one device is refused by another.
    let err = clients[0].read_one(handles[1].clone()).unwrap_err();
    assert!(err.to_string().contains("wgpu:1"), "{err}");
    // Moving bytes between devices of one adapter goes through the host.
    let moved = clients[2].to_client(&handles[2], &clients[0]).unwrap();
    assert_eq!(clients[0].read_one(moved).unwrap().to_elems::<u32>(), vec![91; n]);
    for client in &clients {
        client.sync().unwrap();
    }
}

#[test]
fn devices_work_from_threads_at_once() {
    let clients = clients();
    std::thread::scope(|scope| {
        for (i, client) in clients.iter().enumerate() {
            scope.spawn(move || {
                let h = client.create(Bytes::from_elems(&vec![i as u32; 4096]));
                for _ in 0..20 {
                    let args = KernelArguments::new().buffer(&h).scalar(Scalar::U32(1));
                    client.launch(&add_kernel(), GridCount::cover(4096, 64), args).unwrap();
                }
                let back = client.read_one(h).unwrap().to_elems::<u32>();
                assert!(back.iter().all(|&v| v == i as u32 + 20), "device {i}");
            });
        }
    });
}
