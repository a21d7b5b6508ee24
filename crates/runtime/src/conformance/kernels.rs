//! Kernels the conformance suite launches, with a source for each backend.
//!
//! Conventions every backend follows: buffers bind in argument order, then
//! scalars. CUDA kernels take every buffer's pointer, then every buffer's
//! length in bytes (`unsigned long long`), then the scalars by value. WGSL
//! kernels bind buffer `i` at `@group(0) @binding(i)` and read scalars from a
//! storage buffer of 32-bit words bound after the buffers.

use crate::kernel::Kernel;

/// `x[i] *= factor` for `i < len(x)`; arguments: buffer x (f32), scalar
/// factor (f32).
pub fn scale() -> Kernel {
    Kernel::new("scale")
        .with_cpu(|ctx| {
            let factor = ctx.scalar(0).as_f64() as f32;
            for v in ctx.buffer::<f32>(0) {
                *v *= factor;
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void scale(float* x, unsigned long long len_bytes, float factor) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < len_bytes / 4) x[i] *= factor;
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> scalars: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i < arrayLength(&x)) { x[i] = x[i] * bitcast<f32>(scalars[0]); }
}"#,
        )
}

/// `out[i] = a[i] + b[i]`; arguments: buffers a, b, out (f32).
pub fn add() -> Kernel {
    Kernel::new("add")
        .with_cpu(|ctx| {
            let a = ctx.buffer::<f32>(0).to_vec();
            let b = ctx.buffer::<f32>(1).to_vec();
            for (i, o) in ctx.buffer::<f32>(2).iter_mut().enumerate() {
                *o = a[i] + b[i];
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void add(const float* a, const float* b, float* out,
                                unsigned long long a_bytes, unsigned long long b_bytes, unsigned long long len_bytes) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < len_bytes / 4) out[i] = a[i] + b[i];
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i < arrayLength(&out)) { out[i] = a[i] + b[i]; }
}"#,
        )
}

/// Writes 1.0 into `x[0]` and counts its launches in `x[1]`; used to see
/// whether a launch ran at all.
pub fn mark_ran() -> Kernel {
    Kernel::new("mark_ran")
        .with_block([1, 1, 1])
        .with_cpu(|ctx| {
            let x = ctx.buffer::<f32>(0);
            x[0] = 1.0;
            x[1] += 1.0;
        })
        .with_cuda(
            r#"extern "C" __global__ void mark_ran(float* x, unsigned long long len_bytes) {
    if (blockIdx.x == 0 && threadIdx.x == 0) { x[0] = 1.0f; x[1] += 1.0f; }
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x == 0u && gid.y == 0u && gid.z == 0u) { x[0] = 1.0; x[1] = x[1] + 1.0; }
}"#,
        )
}

/// Fails on every backend: panics on the CPU, reads far outside its buffer on
/// CUDA, and does not compile on wgpu.
pub fn failing() -> Kernel {
    Kernel::new("failing")
        .with_cpu(|_| panic!("deliberate failure in the test kernel"))
        .with_cuda(
            r#"extern "C" __global__ void failing(float* x, unsigned long long len_bytes) {
    this does not compile: deliberate failure in the test kernel
}"#,
        )
        .with_wgsl("deliberate failure in the test kernel: this is not WGSL")
}

/// A kernel with a source for every backend but `backend`, to launch where
/// it has none.
pub fn without_source_for(backend: &str) -> Kernel {
    let mut kernel = Kernel::new(format!("no_{backend}_source"));
    if backend != "cpu" {
        kernel = kernel.with_cpu(|ctx| ctx.buffer::<f32>(0).fill(7.0));
    }
    if backend != "cuda" {
        kernel = kernel.with_cuda("extern \"C\" __global__ void k(float* x, unsigned long long n) {}");
    }
    if backend != "wgpu" {
        kernel = kernel.with_wgsl("@compute @workgroup_size(1) fn main() {}");
    }
    kernel
}
