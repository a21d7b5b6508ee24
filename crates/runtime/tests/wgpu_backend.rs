//! What only the wgpu backend does: adapter listing, transfers larger than a
//! binding, compiler errors on outputs, timestamp timing, word-unaligned
//! transfers, grid folding and scalar packing. Runs on lavapipe in CI.

use cohort_runtime::{
    Bytes, Client, GridCount, Kernel, KernelArguments, Runtime, Scalar, ServerError, TimingMethod, WgpuRuntime,
};

fn client() -> Client {
    WgpuRuntime::client(0).unwrap_or_else(|e| panic!("no wgpu device 0: {e}"))
}

fn scale_kernel() -> Kernel {
    Kernel::new("scale").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i < arrayLength(&x)) { x[i] = x[i] * bitcast<f32>(scalars[0]); }
}"#,
    )
}

#[test]
fn adapters_and_properties_are_listed() {
    let adapters = WgpuRuntime::adapters().unwrap();
    // One device per adapter, or COHORT_WGPU_DEVICES on the first.
    let devices = WgpuRuntime::device_count().unwrap();
    assert_eq!(adapters.iter().map(|a| a.devices.len()).sum::<usize>(), devices);
    for a in &adapters {
        println!(
            "wgpu:{} {} [{:?}, {:?}] driver {:?}: max_binding_size {} (storage binding {}, buffer {}), workgroups/dim {}, timestamps {}",
            a.index,
            a.name,
            a.api,
            a.device_type,
            a.driver,
            a.max_binding_size,
            a.limits.max_storage_buffer_binding_size,
            a.limits.max_buffer_size,
            a.limits.max_compute_workgroups_per_dimension,
            a.timestamp_query
        );
        assert_eq!(a.max_binding_size, a.limits.max_storage_buffer_binding_size.min(a.limits.max_buffer_size));
    }
    let client = client();
    let props = client.properties();
    assert_eq!(props.backend, "wgpu");
    assert_eq!(client.name(), "wgpu");
    assert!(props.name.contains(&adapters[0].name), "{} names adapter {}", props.name, adapters[0].name);
    assert_eq!(props.max_binding_size, adapters[0].max_binding_size, "the device is opened with the adapter's limits");
    assert_eq!(props.device_timing, adapters[0].timestamp_query);
    assert!(!props.native_graphs);
    let err = WgpuRuntime::client(devices).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
}

fn word(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ 0x5bd1_e995
}

/// 160 MiB, more than lavapipe's 128 MiB per binding: written and read in
/// chunks, never refused. Compared against the generator, not a second copy.
#[test]
fn transfers_larger_than_a_binding_are_chunked() {
    let client = client();
    let words = 160 << 18; // 160 MiB of u32
    let data: Vec<u32> = (0..words).map(word).collect();
    let handle = client.create(Bytes::from_elems(&data));
    drop(data);
    let back = client.read_one(handle.clone()).unwrap();
    let back: &[u32] = back.cast();
    assert_eq!(back.len(), words);
    if let Some(i) = (0..words).find(|&i| back[i] != word(i)) {
        panic!("word {i} of 160 MiB read back as {:#x}, wrote {:#x}", back[i], word(i));
    }
    // A slice across chunk boundaries, at an offset inside a word.
    let at = (32 << 20) - 3;
    let len = (64 << 20) + 7;
    let slice = handle.slice(at as u64, len as u64).unwrap();
    let part = client.read_one(slice).unwrap();
    let bytes: &[u8] = bytemuck::cast_slice(back);
    assert!(part[..] == bytes[at..at + len], "an unaligned 64 MiB slice reads its own bytes");
    if client.properties().max_binding_size < handle.size() {
        let err = client
            .launch(&scale_kernel(), GridCount::cover(words, 256), KernelArguments::new().buffer(&handle))
            .unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }
}

#[test]
fn compile_errors_mark_outputs_with_the_compiler_message() {
    let client = client();
    let handle = client.create(Bytes::from_elems(&[1.0f32; 4]));
    let broken = Kernel::new("broken_wgsl").with_wgsl(
        "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n@compute @workgroup_size(1)\nfn main() { x[0] = undefined_name; }",
    );
    client.launch(&broken, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    let err = client.read_one(handle.clone()).unwrap_err();
    assert!(matches!(err, ServerError::KernelFailed { .. }), "{err}");
    let message = err.to_string();
    println!("{message}");
    assert!(message.contains("broken_wgsl"), "names the kernel: {message}");
    assert!(message.contains("undefined_name"), "carries the compiler's message: {message}");
    // A shader that parses but does not match its bindings fails the same way.
    let mismatched = Kernel::new("uniform_mismatch").with_wgsl(
        "@group(0) @binding(0) var<uniform> x: vec4<f32>;\n@compute @workgroup_size(1)\nfn main() { _ = x; }",
    );
    client.write(&handle, Bytes::from_elems(&[1.0f32; 4])).unwrap();
    client.launch(&mismatched, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    let err = client.read_one(handle.clone()).unwrap_err();
    assert!(err.to_string().contains("uniform_mismatch"), "{err}");
    // The device stays usable, and the error is cached (a second launch fails alike).
    client.write(&handle, Bytes::from_elems(&[1.0f32; 4])).unwrap();
    client.launch(&broken, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&handle)).unwrap();
    assert!(client.read_one(handle.clone()).unwrap_err().to_string().contains("undefined_name"));
    client.write(&handle, Bytes::from_elems(&[1.0f32; 4])).unwrap();
    client
        .launch(
            &scale_kernel(),
            GridCount::cover(4, 256),
            KernelArguments::new().buffer(&handle).scalar(Scalar::F32(3.0)),
        )
        .unwrap();
    assert_eq!(client.read_one(handle).unwrap().to_elems::<f32>(), vec![3.0; 4]);
    client.sync().unwrap();
}

/// lavapipe has timestamp queries: profiles are measured on the device.
#[test]
fn profiles_use_timestamp_queries() {
    let client = client();
    let adapter = &WgpuRuntime::adapters().unwrap()[0];
    let lavapipe = adapter.api == wgpu::Backend::Vulkan && adapter.name.contains("llvmpipe");
    if lavapipe {
        assert!(adapter.timestamp_query, "lavapipe reports TIMESTAMP_QUERY");
    }
    let n = 1 << 20;
    let h = client.create(Bytes::from_elems(&vec![1.0f32; n]));
    client.sync().unwrap();
    let ((), duration) = client
        .profile(
            || {
                for _ in 0..4 {
                    let args = KernelArguments::new().buffer(&h).scalar(Scalar::F32(2.0));
                    client.launch(&scale_kernel(), GridCount::cover(n, 256), args).unwrap();
                }
            },
            "scale x4",
        )
        .unwrap();
    println!("4 scales of 1M floats on {}: {duration}", client.properties().name);
    let expected = if adapter.timestamp_query { TimingMethod::Device } else { TimingMethod::Host };
    assert_eq!(duration.method, expected);
    assert!(duration.duration.as_nanos() > 0);
    assert_eq!(client.read_one(h).unwrap().cast::<f32>()[n - 1], 16.0, "the profiled work ran");
}

/// Writes into slices that start and end inside 4-byte words keep the bytes
/// around them.
#[test]
fn unaligned_writes_keep_their_neighbours() {
    let client = client();
    let handle = client.create_from_slice(&[0xAAu8; 16]);
    let inner = handle.slice(1, 6).unwrap();
    client.write(&inner, Bytes::from_slice(&[1, 2, 3, 4, 5, 6])).unwrap();
    let tiny = handle.slice(13, 2).unwrap();
    client.write(&tiny, Bytes::from_slice(&[9, 9])).unwrap();
    let back = client.read_one(handle.clone()).unwrap();
    assert_eq!(&back[..], &[0xAA, 1, 2, 3, 4, 5, 6, 0xAA, 0xAA, 0xAA, 0xAA, 0xAA, 0xAA, 9, 9, 0xAA]);
    assert_eq!(&client.read_one(handle.slice(2, 3).unwrap()).unwrap()[..], &[2, 3, 4]);
    let odd = client.create_from_slice(&[7u8; 5]);
    assert_eq!(&client.read_one(odd).unwrap()[..], &[7; 5]);
}

/// A 1-D grid beyond 65535 workgroups is folded into 2-D.
#[test]
fn long_grids_are_folded() {
    let client = client();
    let max = WgpuRuntime::adapters().unwrap()[0].limits.max_compute_workgroups_per_dimension as usize;
    let n = (max + 1000) * 256;
    let h = client.create(Bytes::from_elems(&vec![1.5f32; n]));
    let args = KernelArguments::new().buffer(&h).scalar(Scalar::F32(2.0));
    client.launch(&scale_kernel(), GridCount::cover(n, 256), args).unwrap();
    let back = client.read_one(h).unwrap();
    let back: &[f32] = back.cast();
    assert!(back.iter().all(|&v| v == 3.0), "every element scaled once");
}

/// Scalars pack as 32-bit words; 64-bit ones as two words, low first.
#[test]
fn scalars_pack_as_words() {
    let client = client();
    let out = client.empty(7 * 4);
    let kernel = Kernel::new("echo_scalars").with_block([1, 1, 1]).with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(1)
fn main() { for (var i = 0u; i < 7u; i++) { out[i] = scalars[i]; } }"#,
    );
    let args = KernelArguments::new()
        .buffer(&out)
        .scalar(Scalar::F32(1.5))
        .scalar(Scalar::I32(-2))
        .scalar(Scalar::U64(0x1122_3344_5566_7788))
        .scalar(Scalar::U32(9))
        .scalar(Scalar::I64(-1));
    client.launch(&kernel, GridCount::Static(1, 1, 1), args).unwrap();
    let words = client.read_one(out).unwrap().to_elems::<u32>();
    assert_eq!(words, vec![1.5f32.to_bits(), (-2i32) as u32, 0x5566_7788, 0x1122_3344, 9, u32::MAX, u32::MAX]);
}

/// Device-to-device copies (the path host-staged collectives use), aligned,
/// unaligned and within one page.
#[test]
fn device_copies() {
    let client = client();
    let a = client.create(Bytes::from_elems(&[1u32, 2, 3, 4]));
    let b = client.empty(16);
    let c = client.create_from_slice(&[0xFFu8; 8]);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    client
        .submit_buffers("copies", vec![a.clone()], vec![b.clone(), c.clone()], move |access| {
            access.copy(0, 1)?;
            access.sync()?;
            done_tx.send(()).unwrap();
            Ok(())
        })
        .unwrap();
    done_rx.recv().unwrap();
    assert_eq!(client.read_one(b.clone()).unwrap().to_elems::<u32>(), vec![1, 2, 3, 4]);
    let src = b.slice(3, 3).unwrap();
    let dst = c.slice(2, 3).unwrap();
    client.submit_buffers("unaligned copy", vec![src], vec![dst], |access| access.copy(0, 1)).unwrap();
    assert_eq!(&client.read_one(c).unwrap()[..], &[0xFF, 0xFF, 0, 2, 0, 0xFF, 0xFF, 0xFF]);
    client.sync().unwrap();
}

/// A kernel that reads one small buffer (`var<storage, read>`) and writes
/// another: both are slices of one pooled page, which wgpu would refuse to
/// bind read-only and writable at once.
#[test]
fn read_only_and_writable_slices_of_one_page() {
    let client = cohort_runtime::WgpuRuntime::client(0).unwrap();
    let kernel = cohort_runtime::Kernel::new("copy_in_out").with_wgsl(
        r#"@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&dst)) { dst[gid.x] = src[gid.x] * 2.0; }
}"#,
    );
    let src = client.create(cohort_runtime::Bytes::from_elems(&[1.0f32, 2.0, 3.0]));
    let dst = client.empty(12);
    client.sync().unwrap();
    client
        .launch(
            &kernel,
            cohort_runtime::GridCount::Static(1, 1, 1),
            cohort_runtime::KernelArguments::new().buffer(&src).buffer(&dst),
        )
        .unwrap();
    assert_eq!(client.read_one(dst).unwrap().to_elems::<f32>(), vec![2.0, 4.0, 6.0]);
}

/// A clone of a kernel given another source is another kernel: before each
/// kernel had one id for life, so a pipeline compiled for the first source
/// (cached by id) ran for the second.
#[test]
fn a_clone_given_another_source_runs_its_own_source() {
    let client = client();
    let doubling = scale_kernel();
    let adding_one = doubling.clone().with_wgsl(
        r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&x)) { x[gid.x] = x[gid.x] + bitcast<f32>(scalars[0]); }
}"#,
    );
    let x = client.create(Bytes::from_elems(&[3.0f32; 256]));
    let grid = || GridCount::Static(1, 1, 1);
    client.launch(&doubling, grid(), KernelArguments::new().buffer(&x).scalar(Scalar::F32(2.0))).unwrap();
    // The same bindings (one buffer, one scalar): the same pipeline layout.
    client.launch(&adding_one, grid(), KernelArguments::new().buffer(&x).scalar(Scalar::F32(1.0))).unwrap();
    let values: Vec<f32> = client.read_one(x).unwrap().to_elems();
    assert!(values.iter().all(|&v| v == 7.0), "3 × 2 + 1 = 7, got {:?}", &values[..4]);
}
