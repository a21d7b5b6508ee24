//! A `wgpu::Buffer` made on a wgpu client's own device, adopted as foreign
//! memory (`Client::adopt`): used in place (the caller reads cohort's
//! writes from its own buffer), no cohort allocation, its owner dropped
//! once with its last handle; and the buffers that cannot be used refused,
//! naming why. Runs on lavapipe in CI.

#![cfg(feature = "wgpu")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cohort_runtime::{
    Access, Bytes, Client, ForeignMemory, GridCount, Kernel, KernelArguments, Runtime, ServerError, WgpuRuntime,
};

fn client() -> Client {
    WgpuRuntime::client(0).unwrap_or_else(|e| panic!("no wgpu device 0: {e}"))
}

const USAGES: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

fn buffer(device: &wgpu::Device, size: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("the caller's buffer"),
        size,
        usage,
        mapped_at_creation: false,
    })
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn float_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `len` bytes at `offset` of `buffer`, read by the caller with its own
/// copy and map (no cohort call).
fn read_without_cohort(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    offset: u64,
    len: u64,
) -> Vec<u8> {
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("the caller's read-back"),
        size: len,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
    encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, len);
    queue.submit([encoder.finish()]);
    staging.slice(..).map_async(wgpu::MapMode::Read, |r| r.unwrap());
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let bytes = staging.slice(..).get_mapped_range().expect("mapped above").to_vec();
    bytes
}

struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Adopts `len` bytes at `offset` of `buffer` on `client`.
fn adopt(client: &Client, buffer: &wgpu::Buffer, offset: u64, len: u64) -> Result<Handle, ServerError> {
    let memory = ForeignMemory::Wgpu { buffer: buffer.clone(), offset, len };
    // SAFETY: a wgpu buffer is reference counted: the clone in `memory`
    // keeps it alive; nothing else writes it while the tests use it.
    Ok(unsafe { client.adopt(memory, Box::new(()), Access::ReadWrite) }?)
}

use cohort_runtime::Handle;

#[test]
fn a_buffer_of_the_clients_device_is_used_in_place() {
    let client = client();
    let (device, queue) = WgpuRuntime::device_and_queue(&client).unwrap();
    let align = u64::from(device.limits().min_storage_buffer_offset_alignment).max(4);
    let buf = buffer(&device, align + 64, USAGES);
    let initial: Vec<f32> = (0..16).map(|i| i as f32).collect();
    queue.write_buffer(&buf, align, &float_bytes(&initial));
    queue.submit([]);

    let usage = client.memory_usage().unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let memory = ForeignMemory::Wgpu { buffer: buf.clone(), offset: align, len: 64 };
    // SAFETY: the clone in `memory` keeps the buffer alive; the test does
    // not touch it while cohort's work runs (it reads after a sync).
    let handle = unsafe { client.adopt(memory, Box::new(Counted(drops.clone())), Access::ReadWrite) }.unwrap();
    assert!(handle.is_foreign());
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), initial, "cohort sees the caller's data");

    let doubled: Vec<f32> = initial.iter().map(|x| x * 2.0).collect();
    client.write(&handle, Bytes::from_slice(&float_bytes(&doubled))).unwrap();
    let add_one = Kernel::new("add_one").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] + 1.0; }
}"#,
    );
    client.launch(&add_one, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    client.sync().unwrap();
    let expected: Vec<f32> = doubled.iter().map(|x| x + 1.0).collect();
    assert_eq!(floats(&read_without_cohort(&device, &queue, &buf, align, 64)), expected, "written in place");
    assert_eq!(floats(&client.read_one(handle.clone()).unwrap()), expected);
    assert_eq!(client.memory_usage().unwrap(), usage, "no cohort allocation");
    assert_eq!(
        floats(&read_without_cohort(&device, &queue, &buf, 0, 4)),
        [0.0],
        "the bytes before the offset are untouched"
    );
    assert!(client.device_address(&handle).unwrap_err().to_string().contains("not supported"));

    drop(handle);
    client.sync().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the owner goes once, with the last handle");
}

#[test]
fn buffers_cohort_cannot_use_are_refused_naming_why() {
    let client = client();
    let (device, _queue) = WgpuRuntime::device_and_queue(&client).unwrap();
    let align = u64::from(device.limits().min_storage_buffer_offset_alignment).max(4);

    let short = buffer(&device, 64, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST);
    let err = adopt(&client, &short, 0, 64).unwrap_err().to_string();
    assert!(err.contains("COPY_SRC") && err.contains("lacks the usages"), "{err}");

    let ok = buffer(&device, align * 2 + 64, USAGES);
    let misaligned = if align >= 8 { align / 2 } else { 2 };
    let err = adopt(&client, &ok, misaligned, 16).unwrap_err().to_string();
    assert!(err.contains("min_storage_buffer_offset_alignment"), "{err}");
    let err = adopt(&client, &ok, 0, 6).unwrap_err().to_string();
    assert!(err.contains("multiple of 4"), "{err}");
    let err = adopt(&client, &ok, 0, 0).unwrap_err().to_string();
    assert!(err.contains("0 bytes"), "{err}");
    let err = adopt(&client, &ok, align * 2, 128).unwrap_err().to_string();
    assert!(err.contains("run past the wgpu buffer"), "{err}");
    adopt(&client, &ok, align, 64).expect("the same buffer, within its bounds");

    let host = ForeignMemory::Host { ptr: std::ptr::NonNull::<u128>::dangling().as_ptr().cast(), len: 16 };
    // SAFETY: refused before the memory is touched.
    let err = unsafe { client.adopt(host, Box::new(()), Access::ReadWrite) }.unwrap_err().to_string();
    assert!(err.contains("cannot be adopted by a wgpu device"), "{err}");
}

#[test]
fn a_buffer_of_another_wgpu_device_or_instance_is_refused() {
    let client = client();
    // A device of another instance (another framework's, say).
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::all(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
        .unwrap_or_else(|e| panic!("no wgpu adapter for another device: {e}"));
    let (other, _queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default())).unwrap();
    // Its ids are not the client's instance's: the first buffers it makes
    // have none there.
    let foreign = buffer(&other, 64, USAGES);
    let err = adopt(&client, &foreign, 0, 64).unwrap_err().to_string();
    assert!(err.contains("another wgpu::Instance"), "{err}");
    // The client still works.
    let own = client.create(Bytes::from_slice(&[1, 2, 3, 4]));
    assert_eq!(&client.read_one(own).unwrap()[..], &[1, 2, 3, 4]);

    // A second device of the same instance as an adopted one: wgpu knows
    // its buffers, and says they are another device's.
    let (adopted_device, adopted_queue) =
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default())).unwrap();
    let adopted = WgpuRuntime::adopt(adopted_device.clone(), adopted_queue).unwrap();
    let err = adopt(&adopted, &foreign, 0, 64).unwrap_err().to_string();
    assert!(err.contains("another wgpu::Device"), "{err}");
    let mine = buffer(&adopted_device, 64, USAGES);
    adopt(&adopted, &mine, 0, 64).expect("a buffer of the adopted device itself");
    adopted.close();
}
