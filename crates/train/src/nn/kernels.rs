//! The kernels of training: matrix products, bias and activation, the loss,
//! the optimizer step and the casts of the compression hooks, each with a CPU
//! (Rust), a CUDA C and a WGSL source.
//!
//! Every kernel follows the runtime's convention (see
//! [`cohort_runtime::CpuKernelFn`]): buffers in order, then scalars; the
//! element count travels as a scalar; every sum runs in a fixed order, so a
//! launch gives the same bits every time on its backend (the replicas of a
//! data-parallel job stay bit-identical).
//!
//! Every WGSL buffer is bound `read_write`: small buffers share one pooled
//! wgpu buffer, and wgpu refuses one buffer bound both read-only and
//! read-write in one dispatch.

use std::sync::OnceLock;

use cohort_runtime::{GridCount, Kernel};

/// Threads per block of the element-wise kernels.
pub const BLOCK: u32 = 256;
/// The side of the square tile of the GPU matrix products.
pub const TILE: u32 = 16;

/// The grid of an element-wise launch over `count` elements.
pub fn cover(count: usize) -> GridCount {
    GridCount::cover(count, BLOCK)
}

/// The grid of a matrix product with an `m × n` result.
pub fn matmul_grid(m: usize, n: usize) -> GridCount {
    GridCount::Static((n as u32).div_ceil(TILE), (m as u32).div_ceil(TILE), 1)
}

/// Every kernel, built once per process (a kernel's id keys its compiled
/// pipeline, so one instance is shared by every launch).
pub struct Kernels {
    pub matmul: Kernel,
    pub columns: Kernel,
    pub bias_act: Kernel,
    pub relu_grad: Kernel,
    pub mse_grad: Kernel,
    pub mse_partial: Kernel,
    pub mse_loss: Kernel,
    pub sgd_momentum: Kernel,
    pub fill: Kernel,
    pub compress: Kernel,
    pub decompress: Kernel,
}

/// The process's kernels.
pub fn kernels() -> &'static Kernels {
    static KERNELS: OnceLock<Kernels> = OnceLock::new();
    KERNELS.get_or_init(|| Kernels {
        matmul: matmul(),
        columns: columns(),
        bias_act: bias_act(),
        relu_grad: relu_grad(),
        mse_grad: mse_grad(),
        mse_partial: mse_partial(),
        mse_loss: mse_loss(),
        sgd_momentum: sgd_momentum(),
        fill: fill(),
        compress: compress(),
        decompress: decompress(),
    })
}

fn u(ctx: &cohort_runtime::CpuKernelContext<'_>, i: usize) -> usize {
    ctx.scalar(i).as_u64() as usize
}

fn f(ctx: &cohort_runtime::CpuKernelContext<'_>, i: usize) -> f32 {
    ctx.scalar(i).as_f64() as f32
}

/// `C = op(A) · op(B)`, or `C += op(A) · op(B)` with `accumulate = 1`, all
/// row-major f32. Buffers `a`, `b`, `c`; scalars `m`, `n`, `k`, `trans_a`,
/// `trans_b`, `accumulate` (u32). `op(A)` is `m × k`: `A` is stored `m × k`,
/// or `k × m` when `trans_a` is 1; `op(B)` is `k × n`: `B` is stored `k × n`,
/// or `n × k` when `trans_b` is 1.
///
/// CPU: `matrixmultiply::sgemm` (packed, vectorised). CUDA and WGSL: tiles
/// of `TILE × TILE` in shared memory, one thread per element of `C`, the
/// sum over `k` in order.
fn matmul() -> Kernel {
    let cuda = format!(
        r#"#define TILE {TILE}
extern "C" __global__ void matmul(const float* a, const float* b, float* c,
    unsigned long long a_bytes, unsigned long long b_bytes, unsigned long long c_bytes,
    unsigned int m, unsigned int n, unsigned int k, unsigned int ta, unsigned int tb, unsigned int acc) {{
    __shared__ float as[TILE][TILE + 1];
    __shared__ float bs[TILE][TILE + 1];
    unsigned int tx = threadIdx.x, ty = threadIdx.y;
    unsigned int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float sum = 0.0f;
    for (unsigned int t = 0; t < k; t += TILE) {{
        unsigned int ak = t + tx, bk = t + ty;
        as[ty][tx] = (row < m && ak < k) ? (ta ? a[(unsigned long long)ak * m + row] : a[(unsigned long long)row * k + ak]) : 0.0f;
        bs[ty][tx] = (bk < k && col < n) ? (tb ? b[(unsigned long long)col * k + bk] : b[(unsigned long long)bk * n + col]) : 0.0f;
        __syncthreads();
        #pragma unroll
        for (unsigned int i = 0; i < TILE; i++) sum += as[ty][i] * bs[i][tx];
        __syncthreads();
    }}
    if (row < m && col < n) {{
        unsigned long long at = (unsigned long long)row * n + col;
        c[at] = acc ? c[at] + sum : sum;
    }}
}}"#
    );
    let wgsl = format!(
        r#"const TILE: u32 = {TILE}u;
@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read> s: array<u32>;
var<workgroup> as_: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> bs_: array<array<f32, {TILE}>, {TILE}>;
@compute @workgroup_size({TILE}, {TILE}, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let m = s[0]; let n = s[1]; let k = s[2]; let ta = s[3]; let tb = s[4]; let acc = s[5];
    let tx = lid.x; let ty = lid.y;
    let row = wg.y * TILE + ty; let col = wg.x * TILE + tx;
    var sum = 0.0;
    for (var t = 0u; t < k; t += TILE) {{
        let ak = t + tx; let bk = t + ty;
        var av = 0.0;
        if (row < m && ak < k) {{ if (ta == 1u) {{ av = a[ak * m + row]; }} else {{ av = a[row * k + ak]; }} }}
        var bv = 0.0;
        if (bk < k && col < n) {{ if (tb == 1u) {{ bv = b[col * k + bk]; }} else {{ bv = b[bk * n + col]; }} }}
        as_[ty][tx] = av;
        bs_[ty][tx] = bv;
        workgroupBarrier();
        for (var i = 0u; i < TILE; i++) {{ sum += as_[ty][i] * bs_[i][tx]; }}
        workgroupBarrier();
    }}
    if (row < m && col < n) {{
        let at = row * n + col;
        if (acc == 1u) {{ c[at] = c[at] + sum; }} else {{ c[at] = sum; }}
    }}
}}"#
    );
    Kernel::new("matmul")
        .with_block([TILE, TILE, 1])
        .with_cpu(|ctx| {
            let (m, n, k) = (u(ctx, 0), u(ctx, 1), u(ctx, 2));
            let (ta, tb, acc) = (u(ctx, 3) == 1, u(ctx, 4) == 1, u(ctx, 5) == 1);
            let [a, b, c] = &mut ctx.buffers[..] else { panic!("matmul takes 3 buffers") };
            let (a, b, c): (&[f32], &[f32], &mut [f32]) =
                (bytemuck::cast_slice(a), bytemuck::cast_slice(b), bytemuck::cast_slice_mut(c));
            assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "matmul: a buffer is too small");
            let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
            let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
            // SAFETY: the three slices are distinct buffers (their handles
            // are different allocations) and hold at least m·k, k·n and m·n
            // floats, checked above; every index sgemm forms from these
            // dimensions and strides lies inside them.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    rsa,
                    csa,
                    b.as_ptr(),
                    rsb,
                    csb,
                    if acc { 1.0 } else { 0.0 },
                    c.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        })
        .with_cuda(cuda)
        .with_wgsl(wgsl)
}

/// `out[r, j] = in[r, first + j]` for `r < rows`, `j < width`: columns
/// `first..first + width` of the row-major `rows × cols` matrix `in`, as a
/// row-major `rows × width` matrix. Buffers `in`, `out`; scalars `rows`,
/// `cols`, `first`, `width`. Copies only (the bits are moved, not changed).
fn columns() -> Kernel {
    Kernel::new("columns")
        .with_cpu(|ctx| {
            let (rows, cols, first, width) = (u(ctx, 0), u(ctx, 1), u(ctx, 2), u(ctx, 3));
            let (src, dst) = ctx.buffer_pair::<f32, f32>(0, 1);
            assert!(src.len() >= rows * cols && dst.len() >= rows * width && first + width <= cols, "columns: out of range");
            for r in 0..rows {
                dst[r * width..(r + 1) * width].copy_from_slice(&src[r * cols + first..r * cols + first + width]);
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void columns(const float* in, float* out,
    unsigned long long i_bytes, unsigned long long o_bytes, unsigned int rows, unsigned int cols, unsigned int first, unsigned int width) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)rows * width) return;
    unsigned long long r = i / width, j = i % width;
    out[i] = in[r * cols + first + j];
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let rows = s[0]; let cols = s[1]; let first = s[2]; let width = s[3];
    if (i >= rows * width) { return; }
    dst[i] = src[(i / width) * cols + first + i % width];
}"#,
        )
}

/// `out[r, j] = act(out[r, j] + bias[j])`, `act` ReLU when `relu` is 1, else
/// the identity. Buffers `out`, `bias`; scalars `count` (rows × cols),
/// `cols`, `relu`.
fn bias_act() -> Kernel {
    Kernel::new("bias_act")
        .with_cpu(|ctx| {
            let (count, cols, relu) = (u(ctx, 0), u(ctx, 1), u(ctx, 2) == 1);
            let (out, bias) = ctx.buffer_pair::<f32, f32>(0, 1);
            for (i, v) in out[..count].iter_mut().enumerate() {
                let z = *v + bias[i % cols];
                *v = if relu { z.max(0.0) } else { z };
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void bias_act(float* out, const float* bias,
    unsigned long long o_bytes, unsigned long long b_bytes, unsigned int count, unsigned int cols, unsigned int relu) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float z = out[i] + bias[i % cols];
    out[i] = relu ? fmaxf(z, 0.0f) : z;
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read_write> bias: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= s[0]) { return; }
    let z = out[i] + bias[i % s[1]];
    if (s[2] == 1u) { out[i] = max(z, 0.0); } else { out[i] = z; }
}"#,
        )
}

/// `grad[i] = h[i] > 0 ? grad[i] : 0` (ReLU's backward from its output).
/// Buffers `grad`, `h`; scalar `count`.
fn relu_grad() -> Kernel {
    Kernel::new("relu_grad")
        .with_cpu(|ctx| {
            let count = u(ctx, 0);
            let (grad, h) = ctx.buffer_pair::<f32, f32>(0, 1);
            for (g, h) in grad[..count].iter_mut().zip(h.iter()) {
                if *h <= 0.0 {
                    *g = 0.0;
                }
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void relu_grad(float* grad, const float* h,
    unsigned long long g_bytes, unsigned long long h_bytes, unsigned int count) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    if (h[i] <= 0.0f) grad[i] = 0.0f;
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> grad: array<f32>;
@group(0) @binding(1) var<storage, read_write> h: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= s[0]) { return; }
    if (h[i] <= 0.0) { grad[i] = 0.0; }
}"#,
        )
}

/// The gradient of the mean squared error: `dy[i] = scale · (y[i] - t[i])`.
/// Buffers `y`, `t`, `dy`; scalars `count`, `scale` (f32).
fn mse_grad() -> Kernel {
    Kernel::new("mse_grad")
        .with_cpu(|ctx| {
            let (count, scale) = (u(ctx, 0), f(ctx, 1));
            let [y, t, dy] = &mut ctx.buffers[..] else { panic!("mse_grad takes 3 buffers") };
            let (y, t, dy): (&[f32], &[f32], &mut [f32]) =
                (bytemuck::cast_slice(y), bytemuck::cast_slice(t), bytemuck::cast_slice_mut(dy));
            for i in 0..count {
                dy[i] = scale * (y[i] - t[i]);
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void mse_grad(const float* y, const float* t, float* dy,
    unsigned long long y_bytes, unsigned long long t_bytes, unsigned long long d_bytes, unsigned int count, float scale) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    dy[i] = scale * (y[i] - t[i]);
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read_write> t: array<f32>;
@group(0) @binding(2) var<storage, read_write> dy: array<f32>;
@group(0) @binding(3) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= s[0]) { return; }
    dy[i] = bitcast<f32>(s[1]) * (y[i] - t[i]);
}"#,
        )
}

/// Blocks of the first stage of the loss: each sums a fixed share of the
/// squared errors.
pub const LOSS_PARTS: usize = 128;

/// The first stage of the mean squared error: `partial[b]` = the sum of
/// `(y - t)²` over elements `b·256 + i + k·(PARTS·256)` (thread `i` of block
/// `b`), the block's 256 sums added as a fixed tree. Buffers `y`, `t`,
/// `partial` (`LOSS_PARTS` floats); scalar `count`. Grid: `LOSS_PARTS`
/// blocks. A fixed order everywhere: deterministic.
fn mse_partial() -> Kernel {
    let cuda = format!(
        r#"#define PARTS {LOSS_PARTS}
extern "C" __global__ void mse_partial(const float* y, const float* t, float* partial,
    unsigned long long y_bytes, unsigned long long t_bytes, unsigned long long p_bytes, unsigned int count) {{
    __shared__ float sums[256];
    unsigned int i = threadIdx.x;
    float sum = 0.0f;
    for (unsigned int at = blockIdx.x * 256 + i; at < count; at += PARTS * 256) {{ float e = y[at] - t[at]; sum += e * e; }}
    sums[i] = sum;
    __syncthreads();
    for (unsigned int half = 128; half > 0; half >>= 1) {{
        if (i < half) sums[i] += sums[i + half];
        __syncthreads();
    }}
    if (i == 0) partial[blockIdx.x] = sums[0];
}}"#
    );
    let wgsl = format!(
        r#"const PARTS: u32 = {LOSS_PARTS}u;
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read_write> t: array<f32>;
@group(0) @binding(2) var<storage, read_write> partial: array<f32>;
@group(0) @binding(3) var<storage, read> s: array<u32>;
var<workgroup> sums: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) i: u32, @builtin(workgroup_id) wg: vec3<u32>) {{
    let count = s[0];
    var sum = 0.0;
    for (var at = wg.x * 256u + i; at < count; at += PARTS * 256u) {{ let e = y[at] - t[at]; sum += e * e; }}
    sums[i] = sum;
    workgroupBarrier();
    for (var half = 128u; half > 0u; half = half >> 1u) {{
        if (i < half) {{ sums[i] = sums[i] + sums[i + half]; }}
        workgroupBarrier();
    }}
    if (i == 0u) {{ partial[wg.x] = sums[0]; }}
}}"#
    );
    Kernel::new("mse_partial")
        .with_cpu(|ctx| {
            let count = u(ctx, 0);
            let [y, t, partial] = &mut ctx.buffers[..] else { panic!("mse_partial takes 3 buffers") };
            let (y, t, partial): (&[f32], &[f32], &mut [f32]) =
                (bytemuck::cast_slice(y), bytemuck::cast_slice(t), bytemuck::cast_slice_mut(partial));
            // The GPU sources' order: per block, 256 strided sums, then a tree.
            let mut sums = [0.0f32; 256];
            for (b, p) in partial[..LOSS_PARTS].iter_mut().enumerate() {
                for (i, sum) in sums.iter_mut().enumerate() {
                    *sum = 0.0;
                    let mut at = b * 256 + i;
                    while at < count {
                        let e = y[at] - t[at];
                        *sum += e * e;
                        at += LOSS_PARTS * 256;
                    }
                }
                let mut half = 128;
                while half > 0 {
                    for i in 0..half {
                        sums[i] += sums[i + half];
                    }
                    half >>= 1;
                }
                *p = sums[0];
            }
        })
        .with_cuda(cuda)
        .with_wgsl(wgsl)
}

/// The second stage: `loss[slot] = Σ partial / count`, the `LOSS_PARTS`
/// partial sums added in order by one thread. Buffers `partial`, `loss`;
/// scalars `count`, `slot`.
fn mse_loss() -> Kernel {
    Kernel::new("mse_loss")
        .with_block([1, 1, 1])
        .with_cpu(|ctx| {
            let (count, slot) = (u(ctx, 0), u(ctx, 1));
            let (partial, loss) = ctx.buffer_pair::<f32, f32>(0, 1);
            loss[slot] = partial[..LOSS_PARTS].iter().fold(0.0f32, |a, p| a + p) / count as f32;
        })
        .with_cuda(format!(
            r#"extern "C" __global__ void mse_loss(const float* partial, float* loss,
    unsigned long long p_bytes, unsigned long long l_bytes, unsigned int count, unsigned int slot) {{
    float total = 0.0f;
    for (int p = 0; p < {LOSS_PARTS}; p++) total += partial[p];
    loss[slot] = total / (float)count;
}}"#
        ))
        .with_wgsl(format!(
            r#"@group(0) @binding(0) var<storage, read_write> partial: array<f32>;
@group(0) @binding(1) var<storage, read_write> loss: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
@compute @workgroup_size(1)
fn main() {{
    var total = 0.0;
    for (var p = 0u; p < {LOSS_PARTS}u; p++) {{ total += partial[p]; }}
    loss[s[1]] = total / f32(s[0]);
}}"#
        ))
}

/// SGD with momentum (PyTorch's form): `v = μ·v + g; p -= lr·v`. Buffers
/// `p`, `g`, `v`; scalars `count`, `lr`, `momentum` (f32).
fn sgd_momentum() -> Kernel {
    Kernel::new("sgd_momentum")
        .with_cpu(|ctx| {
            let (count, lr, mu) = (u(ctx, 0), f(ctx, 1), f(ctx, 2));
            let [p, g, v] = &mut ctx.buffers[..] else { panic!("sgd_momentum takes 3 buffers") };
            let (p, g, v): (&mut [f32], &[f32], &mut [f32]) =
                (bytemuck::cast_slice_mut(p), bytemuck::cast_slice(g), bytemuck::cast_slice_mut(v));
            for i in 0..count {
                v[i] = mu * v[i] + g[i];
                p[i] -= lr * v[i];
            }
        })
        .with_cuda(
            r#"extern "C" __global__ void sgd_momentum(float* p, const float* g, float* v,
    unsigned long long p_bytes, unsigned long long g_bytes, unsigned long long v_bytes,
    unsigned int count, float lr, float mu) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float vi = __fadd_rn(__fmul_rn(mu, v[i]), g[i]);
    v[i] = vi;
    p[i] = __fsub_rn(p[i], __fmul_rn(lr, vi));
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> p: array<f32>;
@group(0) @binding(1) var<storage, read_write> g: array<f32>;
@group(0) @binding(2) var<storage, read_write> v: array<f32>;
@group(0) @binding(3) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= s[0]) { return; }
    let vi = bitcast<f32>(s[2]) * v[i] + g[i];
    v[i] = vi;
    p[i] = p[i] - bitcast<f32>(s[1]) * vi;
}"#,
        )
}

/// `x[i] = value` for `i < count`. Buffer `x`; scalars `count`, `value`
/// (f32).
fn fill() -> Kernel {
    Kernel::new("fill")
        .with_cpu(|ctx| {
            let (count, value) = (u(ctx, 0), f(ctx, 1));
            ctx.buffer::<f32>(0)[..count].fill(value);
        })
        .with_cuda(
            r#"extern "C" __global__ void fill(float* x, unsigned long long x_bytes, unsigned int count, float value) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = value;
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < s[0]) { x[i] = bitcast<f32>(s[1]); }
}"#,
        )
}

/// f32 → 16-bit floats, two per 32-bit word (element `2w` in the low half
/// of word `w`, as little-endian `u16`s lie): `format` 0 is bf16 (round to
/// nearest even), 1 is IEEE fp16. Buffers `src` (f32), `dst` (16-bit);
/// scalars `count` (even), `format`. One thread per pair.
fn compress() -> Kernel {
    Kernel::new("compress16")
        .with_cpu(|ctx| {
            let (count, format) = (u(ctx, 0), u(ctx, 1));
            let (src, dst) = ctx.buffer_pair::<f32, u16>(0, 1);
            for i in 0..count {
                dst[i] = if format == 0 {
                    half::bf16::from_f32(src[i]).to_bits()
                } else {
                    half::f16::from_f32(src[i]).to_bits()
                };
            }
        })
        .with_cuda(
            r#"__device__ unsigned int to16(float x, unsigned int format) {
    if (format == 0) {
        unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
        return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    }
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
extern "C" __global__ void compress16(const float* src, unsigned int* dst,
    unsigned long long s_bytes, unsigned long long d_bytes, unsigned int count, unsigned int format) {
    unsigned int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * w >= count) return;
    dst[w] = to16(src[2 * w], format) | (to16(src[2 * w + 1], format) << 16);
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
fn bf16(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.x;
    if (2u * w >= s[0]) { return; }
    if (s[1] == 0u) {
        dst[w] = bf16(src[2u * w]) | (bf16(src[2u * w + 1u]) << 16u);
    } else {
        dst[w] = pack2x16float(vec2<f32>(src[2u * w], src[2u * w + 1u]));
    }
}"#,
        )
}

/// 16-bit floats → f32, the inverse layout of [`compress`]. Buffers `src`
/// (16-bit), `dst` (f32); scalars `count` (even), `format`.
fn decompress() -> Kernel {
    Kernel::new("decompress16")
        .with_cpu(|ctx| {
            let (count, format) = (u(ctx, 0), u(ctx, 1));
            let (src, dst) = ctx.buffer_pair::<u16, f32>(0, 1);
            for i in 0..count {
                dst[i] = if format == 0 {
                    half::bf16::from_bits(src[i]).to_f32()
                } else {
                    half::f16::from_bits(src[i]).to_f32()
                };
            }
        })
        .with_cuda(
            r#"__device__ float from16(unsigned int h, unsigned int format) {
    if (format == 0) return __uint_as_float(h << 16);
    float x;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(s));
    return x;
}
extern "C" __global__ void decompress16(const unsigned int* src, float* dst,
    unsigned long long s_bytes, unsigned long long d_bytes, unsigned int count, unsigned int format) {
    unsigned int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * w >= count) return;
    unsigned int word = src[w];
    dst[2 * w] = from16(word & 0xffffu, format);
    dst[2 * w + 1] = from16(word >> 16, format);
}"#,
        )
        .with_wgsl(
            r#"@group(0) @binding(0) var<storage, read_write> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> s: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.x;
    if (2u * w >= s[0]) { return; }
    let word = src[w];
    if (s[1] == 0u) {
        dst[2u * w] = bitcast<f32>(word << 16u);
        dst[2u * w + 1u] = bitcast<f32>(word & 0xffff0000u);
    } else {
        let v = unpack2x16float(word);
        dst[2u * w] = v.x;
        dst[2u * w + 1u] = v.y;
    }
}"#,
        )
}

/// Appends `u32` scalars to kernel arguments.
pub trait U32s {
    /// These arguments with `values` appended as `Scalar::U32`s.
    fn u32s<const N: usize>(self, values: [usize; N]) -> Self;
}

impl U32s for cohort_runtime::KernelArguments {
    fn u32s<const N: usize>(self, values: [usize; N]) -> Self {
        values.into_iter().fold(self, |args, v| args.scalar(cohort_runtime::Scalar::U32(v as u32)))
    }
}
