//! A wgpu device the caller made, adopted by the runtime
//! (`WgpuRuntime::adopt`): cohort's work runs on it, in order with the
//! caller's own work on its queue (`Client::signal_external` and
//! `wait_external` with `ExternalStream::WgpuQueue`), and the caller's
//! error handler stays the caller's. Runs on lavapipe in CI.

#![cfg(feature = "wgpu")]

use std::sync::Arc;

use cohort_runtime::{
    Access, Bytes, Client, ExternalStream, ForeignMemory, GridCount, Kernel, KernelArguments, Runtime, Scalar,
    ServerError, WgpuRuntime,
};
use parking_lot::Mutex;

/// A device and queue made with wgpu directly, as another framework would
/// (its own instance, adapter and `request_device`, default limits), with
/// an uncaptured-error handler that records what reaches it.
struct CallerDevice {
    device: wgpu::Device,
    queue: wgpu::Queue,
    errors: Arc<Mutex<Vec<String>>>,
}

fn caller_device() -> CallerDevice {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
        .unwrap_or_else(|e| panic!("no wgpu adapter for the caller's device: {e}"));
    let (device, queue) = pollster::block_on(
        adapter.request_device(&wgpu::DeviceDescriptor { label: Some("the caller's device"), ..Default::default() }),
    )
    .unwrap();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    device.on_uncaptured_error(Arc::new(move |error: wgpu::Error| seen.lock().push(error.to_string())));
    CallerDevice { device, queue, errors }
}

fn add_one() -> Kernel {
    Kernel::new("add_one").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] + 1.0; }
}"#,
    )
}

fn scale() -> Kernel {
    Kernel::new("scale").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] * bitcast<f32>(scalars[0]); }
}"#,
    )
}

/// A buffer of the caller's, usable by cohort (storage, copies) and read
/// back by the caller through `staging`.
fn caller_buffer(device: &wgpu::Device, len: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("the caller's buffer"),
        size: len,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// The caller reads `buffer` on its own: a copy into a mapped staging
/// buffer, submitted on its queue, mapped and waited for with wgpu alone.
fn caller_read(caller: &CallerDevice, buffer: &wgpu::Buffer) -> Vec<f32> {
    let staging = caller.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("the caller's staging"),
        size: buffer.size(),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = caller.device.create_command_encoder(&Default::default());
    encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, buffer.size());
    caller.queue.submit([encoder.finish()]);
    staging.slice(..).map_async(wgpu::MapMode::Read, |r| r.unwrap());
    caller.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let values = bytemuck::cast_slice::<u8, f32>(&staging.slice(..).get_mapped_range().unwrap()).to_vec();
    values
}

/// Adopts `buffer` (the caller's) as foreign memory of `client`.
fn adopt_buffer(client: &Client, buffer: &wgpu::Buffer) -> cohort_runtime::Handle {
    let memory = ForeignMemory::Wgpu { buffer: buffer.clone(), offset: 0, len: buffer.size() };
    // SAFETY: the buffer lives in `owner` (a clone keeps it) and the test
    // touches it only in order with cohort's work (signal/wait below).
    unsafe { client.adopt(memory, Box::new(buffer.clone()), Access::ReadWrite) }.unwrap()
}

#[test]
fn an_adopted_device_runs_cohort_work_under_a_new_index() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    let enumerated = WgpuRuntime::device_count().unwrap();
    let index = client.device_id().index as usize;
    assert!(index >= enumerated, "adopted as wgpu:{index}, after the {enumerated} enumerated devices");
    assert_eq!(WgpuRuntime::device_count().unwrap(), enumerated, "device_count still counts the enumerated ones");
    let props = client.properties();
    assert!(props.name.contains("adopted"), "{}", props.name);
    assert!(props.name.contains(&caller.device.adapter_info().name), "{}", props.name);
    let limits = caller.device.limits();
    assert_eq!(props.max_binding_size, limits.max_storage_buffer_binding_size.min(limits.max_buffer_size));
    // The same index gives the same device while it is open.
    assert_eq!(WgpuRuntime::client(index).unwrap().service_id(), client.service_id());

    let h = client.create(Bytes::from_elems(&[1.0f32, 2.0, 3.0, 4.0]));
    client
        .launch(&scale(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h).scalar(Scalar::F32(2.0)))
        .unwrap();
    client.launch(&add_one(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h)).unwrap();
    assert_eq!(client.read_one(h.clone()).unwrap().to_elems::<f32>(), vec![3.0, 5.0, 7.0, 9.0]);
    client.write(&h, Bytes::from_elems(&[-1.0f32; 4])).unwrap();
    assert_eq!(client.read_one(h).unwrap().to_elems::<f32>(), vec![-1.0; 4]);
    client.sync().unwrap();
    assert!(caller.errors.lock().is_empty(), "{:?}", caller.errors.lock());
}

#[test]
fn cohort_work_and_the_callers_are_ordered_on_the_shared_queue() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    let external = ExternalStream::WgpuQueue;
    let n = 1024usize;
    let buffer = caller_buffer(&caller.device, (n * 4) as u64);
    let handle = adopt_buffer(&client, &buffer);

    // The caller writes; after wait_external cohort's work sees it.
    let start: Vec<f32> = (0..n).map(|i| i as f32).collect();
    caller.queue.write_buffer(&buffer, 0, bytemuck::cast_slice(&start));
    caller.queue.submit([]);
    client.wait_external(&external).unwrap();
    client.launch(&add_one(), GridCount::Static(n as u32 / 64, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    // Cohort's launch is recorded, not submitted (launches are batched):
    // after signal_external the caller's next submission comes after it.
    client.signal_external(&external).unwrap();
    let seen = caller_read(&caller, &buffer);
    let expected: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
    assert_eq!(seen, expected, "the caller's copy after signal_external sees cohort's kernel");

    // And the caller's own compute pass after cohort's: a second add.
    client.launch(&add_one(), GridCount::Static(n as u32 / 64, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    client.signal_external(&external).unwrap();
    let module = caller.device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: None,
        source: wgpu::ShaderSource::Wgsl(add_one().wgsl_source().unwrap().into()),
    });
    let pipeline = caller.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: None,
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind = caller.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry { binding: 0, resource: buffer.as_entire_binding() }],
    });
    let mut encoder = caller.device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(n as u32 / 64, 1, 1);
    }
    caller.queue.submit([encoder.finish()]);
    // Cohort reads after the caller's pass (wait_external: nothing to do
    // on one queue, but the call is the contract).
    client.wait_external(&external).unwrap();
    let read = client.read_one(handle.clone()).unwrap().to_elems::<f32>();
    let expected: Vec<f32> = (0..n).map(|i| i as f32 + 3.0).collect();
    assert_eq!(read, expected, "cohort's second add, then the caller's pass");
    client.sync().unwrap();
    assert!(caller.errors.lock().is_empty(), "{:?}", caller.errors.lock());
}

#[test]
fn the_callers_error_handler_stays_the_callers_and_cohorts_errors_stay_cohorts() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    // A validation error of the caller's, outside cohort: a buffer with
    // usages wgpu refuses together.
    let _bad = caller.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("MAP_READ with STORAGE"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let caught = caller.errors.lock().clone();
    assert_eq!(caught.len(), 1, "the caller's handler got its own error: {caught:?}");
    // It is not cohort's: cohort's next sync is clean.
    client.sync().unwrap();
    // A kernel that does not compile is cohort's error, on its outputs,
    // and never reaches the caller's handler.
    let broken = Kernel::new("broken").with_wgsl("@compute @workgroup_size(1) fn main() { let x: u32 = 1.0; }");
    let h = client.create(Bytes::from_elems(&[0.0f32; 4]));
    client.launch(&broken, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&h)).unwrap();
    let err = client.read_one(h).unwrap_err();
    assert!(matches!(err, ServerError::KernelFailed { .. }), "{err}");
    client.sync().unwrap();
    assert_eq!(caller.errors.lock().len(), 1, "cohort's errors stay cohort's: {:?}", caller.errors.lock());
}

#[test]
fn device_and_queue_round_trip_and_adopting_twice_gives_the_same_client() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    let (device, queue) = WgpuRuntime::device_and_queue(&client).unwrap();
    assert!(device == caller.device && queue == caller.queue, "the adopted device and queue come back");
    let again = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    assert_eq!(again.service_id(), client.service_id(), "adopting the same device twice gives its client");

    // Cohort's own device: its device and queue, and adopting them gives
    // that same client back.
    let own = WgpuRuntime::client(0).unwrap();
    let (own_device, own_queue) = WgpuRuntime::device_and_queue(&own).unwrap();
    let same = WgpuRuntime::adopt(own_device.clone(), own_queue).unwrap();
    assert_eq!(same.service_id(), own.service_id());
    // Not a wgpu client; a closed one.
    let cpu = cohort_runtime::CpuRuntime::client(0).unwrap();
    let err = WgpuRuntime::device_and_queue(&cpu).unwrap_err();
    assert!(err.to_string().contains("takes a wgpu client"), "{err}");
    client.close();
    let err = WgpuRuntime::device_and_queue(&client).unwrap_err();
    assert!(matches!(err, ServerError::DeviceClosed { .. }), "{err}");
    // Once closed, cohort holds nothing of the device; adopting it again
    // gives a new client, and the caller's device still works.
    let reopened = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    assert_ne!(reopened.service_id(), client.service_id());
    let h = reopened.create(Bytes::from_elems(&[2.0f32; 4]));
    assert_eq!(reopened.read_one(h).unwrap().to_elems::<f32>(), vec![2.0; 4]);
}

/// Devices of different `wgpu::Instance`s share ids (wgpu compares
/// devices by id alone): each is still adopted as its own device, and
/// neither is taken for cohort's own device 0.
#[test]
fn devices_of_different_instances_are_different_devices() {
    let (first, second) = (caller_device(), caller_device());
    let own = WgpuRuntime::client(0).unwrap();
    let a = WgpuRuntime::adopt(first.device.clone(), first.queue.clone()).unwrap();
    let b = WgpuRuntime::adopt(second.device.clone(), second.queue.clone()).unwrap();
    assert_ne!(a.service_id(), b.service_id(), "two devices, two clients");
    assert_ne!(a.service_id(), own.service_id());
    assert_ne!(b.service_id(), own.service_id());
    let (device, _) = WgpuRuntime::device_and_queue(&b).unwrap();
    let again = WgpuRuntime::adopt(device, second.queue.clone()).unwrap();
    assert_eq!(again.service_id(), b.service_id());
    assert!(first.errors.lock().is_empty() && second.errors.lock().is_empty(), "the probe's error reached no handler");
}

#[test]
fn external_streams_of_another_backend_are_refused() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    #[cfg(feature = "cuda")]
    {
        let err = client.wait_external(&unsafe { ExternalStream::cuda_raw(0) }).unwrap_err();
        assert!(err.to_string().contains("not a stream of wgpu device"), "{err}");
        let err = client.signal_external(&unsafe { ExternalStream::cuda_raw(0) }).unwrap_err();
        assert!(err.to_string().contains("not a stream of wgpu device"), "{err}");
    }
    client.signal_external(&ExternalStream::WgpuQueue).unwrap();
    let cpu = cohort_runtime::CpuRuntime::client(0).unwrap();
    let err = cpu.wait_external(&ExternalStream::WgpuQueue).unwrap_err();
    assert!(matches!(err, ServerError::Unsupported { .. }), "{err}");
    let err = cpu.signal_external(&ExternalStream::WgpuQueue).unwrap_err();
    assert!(matches!(err, ServerError::Unsupported { .. }), "{err}");
}

/// A caller that destroys a buffer cohort still uses gets cohort's error
/// from cohort's call; nothing of it reaches the caller's handler (cohort's
/// wgpu calls are all in error scopes of its device thread).
#[test]
fn errors_of_cohorts_calls_on_a_destroyed_buffer_stay_cohorts() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    let buffer = caller_buffer(&caller.device, 256);
    let handle = adopt_buffer(&client, &buffer);
    client.sync().unwrap();
    buffer.destroy();
    let read = client.read_one(handle.clone());
    let launched = client.launch(&add_one(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle));
    let synced = client.sync();
    println!("read: {read:?}\nlaunch: {launched:?}\nsync: {synced:?}");
    assert!(read.is_err() || synced.is_err(), "cohort's calls report the destroyed buffer");
    assert!(caller.errors.lock().is_empty(), "nothing reached the caller's handler: {:?}", caller.errors.lock());
}

/// A caller that destroys its device: cohort's later calls fail with
/// cohort's errors, and none of cohort's errors reaches the caller's
/// handler.
#[test]
fn a_device_the_caller_destroyed_fails_cohorts_calls_not_the_callers_handler() {
    let caller = caller_device();
    let client = WgpuRuntime::adopt(caller.device.clone(), caller.queue.clone()).unwrap();
    let h = client.create(Bytes::from_elems(&[1.0f32; 64]));
    client.sync().unwrap();
    caller.device.destroy();
    let read = client.read_one(h.clone());
    let fresh = client.create(Bytes::from_elems(&[1.0f32; 64]));
    let launched = client.launch(&add_one(), GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&fresh));
    let synced = client.sync();
    println!("read: {read:?}\nlaunch: {launched:?}\nsync: {synced:?}");
    assert!(read.is_err(), "cohort's read reports the lost device");
    assert!(caller.errors.lock().is_empty(), "nothing reached the caller's handler: {:?}", caller.errors.lock());
}
