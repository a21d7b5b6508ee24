//! The seed timing on the wgpu backend: three rounds of creating a buffer of
//! 1M floats, launching a scale kernel over it and reading it back, each
//! step timed on the host as the caller sees it (create and launch return at
//! once; read_one waits for the work before it).
//!
//! Run: `cargo run --release --example wgpu_seed` (set COHORT_WGPU_BACKEND to
//! pick vulkan, gl, metal or dx12).

use std::time::Instant;

use cohort::prelude::*;
use cohort::runtime::WgpuRuntime;

/// `x[i] *= factor`, one thread per element, 256 per workgroup.
const SCALE: &str = r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i < arrayLength(&x)) { x[i] = x[i] * bitcast<f32>(scalars[0]); }
}"#;

fn main() {
    if let Err(err) = run() {
        eprintln!("wgpu_seed: {err}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), ServerError> {
    let client = WgpuRuntime::client(0)?;
    println!("wgpu_seed on {}", client.properties().name);
    let kernel = Kernel::new("scale").with_wgsl(SCALE);
    let n = 1 << 20;
    let data = vec![1.0f32; n];
    for round in 0..3 {
        let t = Instant::now();
        let h = client.create_from_slice(bytemuck::cast_slice(&data));
        let t_create = t.elapsed();
        let t = Instant::now();
        let args = KernelArguments::new().buffer(&h).scalar(Scalar::F32(2.0));
        client.launch(&kernel, GridCount::cover(n, 256), args)?;
        let t_launch = t.elapsed();
        let t = Instant::now();
        let bytes = client.read_one(h)?;
        let t_read = t.elapsed();
        let x0 = bytes.cast::<f32>()[0];
        println!("round {round}: create {t_create:?}, launch {t_launch:?}, read_one {t_read:?} (x[0] = {x0})");
    }
    cohort::runtime::shutdown();
    Ok(())
}
