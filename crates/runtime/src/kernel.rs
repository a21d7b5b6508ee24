//! Kernels: one compute function with a source per backend, and its launch
//! arguments.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::handle::Handle;

static NEXT_KERNEL: AtomicU64 = AtomicU64::new(1);

/// What a CPU kernel is given, once per launch: the grid it was launched
/// with, its buffers (whole, as mutable byte slices of device memory) and
/// its scalars. See [`CpuKernelFn`] for how a CPU kernel differs from a GPU
/// one.
pub struct CpuKernelContext<'a> {
    /// Blocks (workgroups) of the launch along x, y, z: a dynamic grid is
    /// already read from its buffer. Information only: the kernel runs once
    /// whatever the grid (a zero-sized grid does not run it at all).
    pub grid: [u32; 3],
    /// Threads per block, from [`Kernel::with_block`].
    pub block: [u32; 3],
    /// The launch's buffers, in the order of [`KernelArguments::buffer`]:
    /// each the whole byte range of its handle, readable and writable.
    pub buffers: Vec<&'a mut [u8]>,
    /// The launch's scalars, in the order of [`KernelArguments::scalar`].
    pub scalars: &'a [Scalar],
}

impl CpuKernelContext<'_> {
    /// Buffer `index` viewed as elements of `T`. Panics (which marks the
    /// launch's outputs with the message) when the size is not a whole number
    /// of `T` or the index is out of range.
    pub fn buffer<T: bytemuck::Pod>(&mut self, index: usize) -> &mut [T] {
        let count = self.buffers.len();
        let bytes =
            self.buffers.get_mut(index).unwrap_or_else(|| panic!("kernel reads buffer {index} but was given {count}"));
        bytemuck::cast_slice_mut(bytes)
    }

    /// Two distinct buffers at once, e.g. an input and an output.
    pub fn buffer_pair<A: bytemuck::Pod, B: bytemuck::Pod>(
        &mut self,
        first: usize,
        second: usize,
    ) -> (&mut [A], &mut [B]) {
        assert_ne!(first, second, "buffer_pair needs two different buffers");
        let count = self.buffers.len();
        assert!(first < count && second < count, "kernel reads buffers {first} and {second} but was given {count}");
        let (lo, hi) = if first < second { (first, second) } else { (second, first) };
        let (left, right) = self.buffers.split_at_mut(hi);
        let (a, b) = (&mut left[lo], &mut right[0]);
        if first < second {
            (bytemuck::cast_slice_mut(a), bytemuck::cast_slice_mut(b))
        } else {
            (bytemuck::cast_slice_mut(b), bytemuck::cast_slice_mut(a))
        }
    }

    /// Scalar `index`.
    pub fn scalar(&self, index: usize) -> Scalar {
        self.scalars[index]
    }

    /// Total number of threads the grid and block describe along x.
    pub fn threads_x(&self) -> usize {
        self.grid[0] as usize * self.block[0] as usize
    }
}

/// The CPU source of a kernel: a Rust function run on the device's thread.
///
/// **It runs once per launch, over whole buffers, whatever the grid.** A
/// CUDA or WGSL kernel runs once per thread of the grid and finds its
/// element from its thread index; the CPU function is called a single time
/// with a [`CpuKernelContext`] and does the whole launch's work itself,
/// usually in a loop. The grid and block are there to read, not a loop it
/// is put in. A panic in it fails the launch: the message marks the
/// launch's buffers, and the next read of one returns it.
///
/// # One kernel that behaves the same on every backend
///
/// - **Pass the element count as a scalar** and let every source stop
///   there: the CPU loops `0..n`; CUDA and WGSL return when their index is
///   `>= n`, because [`GridCount::cover`] rounds the grid up to whole blocks.
///   Do not take the count from a buffer's length: a wgpu binding is rounded
///   up to whole 4-byte words, and a handle may be a slice of a larger page.
/// - **Keep the argument order**: buffer `i` is `ctx.buffer(i)` on the CPU,
///   the `i`-th pointer parameter in CUDA, `@group(0) @binding(i)` in WGSL;
///   scalars follow (in CUDA as the next parameters, in WGSL packed as
///   32-bit words into one storage buffer bound after the buffers).
/// - **Write only your own elements.** GPU threads run in no particular
///   order; a CPU loop runs in order. A result that depends on that order
///   (element `i` reading element `i - 1` of the same launch's output)
///   differs between backends.
/// - **Use the same arithmetic.** `f32` on the CPU for `float`/`f32` on the
///   GPU; results may still differ in the last bit where a GPU compiler
///   fuses a multiply and an add, so compare floating-point results with a
///   tolerance.
///
/// ```
/// use cohort_runtime::{GridCount, Kernel, KernelArguments, Scalar};
///
/// // y[i] = a * x[i] + y[i] for i < n, on any backend.
/// let axpy = Kernel::new("axpy")
///     .with_cpu(|ctx| {
///         let a = ctx.scalar(0).as_f64() as f32;
///         let n = ctx.scalar(1).as_f64() as usize;
///         let (x, y) = ctx.buffer_pair::<f32, f32>(0, 1);
///         for i in 0..n {
///             y[i] += a * x[i];
///         }
///     })
///     .with_cuda(
///         r#"extern "C" __global__ void axpy(const float* x, float* y, float a, unsigned int n) {
///             unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
///             if (i >= n) return;
///             y[i] += a * x[i];
///         }"#,
///     )
///     .with_wgsl(
///         r#"@group(0) @binding(0) var<storage, read_write> x: array<f32>;
///         @group(0) @binding(1) var<storage, read_write> y: array<f32>;
///         @group(0) @binding(2) var<storage, read> s: array<u32>;
///         @compute @workgroup_size(256)
///         fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
///             let i = gid.x;
///             if (i >= s[1]) { return; }
///             y[i] += bitcast<f32>(s[0]) * x[i];
///         }"#,
///     );
/// // On the CPU backend here (on CUDA or wgpu, the same call runs the
/// // other sources).
/// use cohort_runtime::{Bytes, CpuRuntime, Runtime};
/// let client = CpuRuntime::client(0)?;
/// let n = 1000;
/// let x = client.create(Bytes::from_elems(&vec![1.0f32; n]));
/// let y = client.create(Bytes::from_elems(&vec![0.5f32; n]));
/// let args = KernelArguments::new().buffer(&x).buffer(&y).scalar(Scalar::F32(2.0)).scalar(Scalar::U32(n as u32));
/// client.launch(&axpy, GridCount::cover(n, 256), args)?;
/// let y: Vec<f32> = client.read_one(y)?.to_elems();
/// assert!(y.iter().all(|&v| v == 2.5));
/// # Ok::<(), cohort_runtime::ServerError>(())
/// ```
pub type CpuKernelFn = Arc<dyn Fn(&mut CpuKernelContext<'_>) + Send + Sync>;

/// A kernel: a name, a block size and a source for each backend it runs on.
///
/// A launch on a backend the kernel has no source for fails, and marks the
/// launch's buffers with [`crate::ServerError::MissingKernelSource`].
/// Cloning one costs a reference count (a launch keeps its kernel).
#[derive(Clone)]
pub struct Kernel {
    inner: Arc<KernelInner>,
}

#[derive(Clone)]
struct KernelInner {
    id: u64,
    name: Arc<str>,
    block: [u32; 3],
    cpu: Option<CpuKernelFn>,
    cuda: Option<Arc<str>>,
    wgsl: Option<Arc<str>>,
}

impl Kernel {
    /// A kernel with no sources yet and a block of 256 × 1 × 1.
    pub fn new(name: impl Into<String>) -> Self {
        let inner = KernelInner {
            id: NEXT_KERNEL.fetch_add(1, Ordering::Relaxed),
            name: Arc::from(name.into()),
            block: [256, 1, 1],
            cpu: None,
            cuda: None,
            wgsl: None,
        };
        Self { inner: Arc::new(inner) }
    }

    /// This kernel's own fields to change (copied first where a clone
    /// shares them), under a fresh id where a source changes: a compiled
    /// pipeline cached under the old id is of the old source.
    fn edit(&mut self, source_changes: bool) -> &mut KernelInner {
        let inner = Arc::make_mut(&mut self.inner);
        if source_changes {
            inner.id = NEXT_KERNEL.fetch_add(1, Ordering::Relaxed);
        }
        inner
    }

    /// The threads of one block (workgroup).
    pub fn with_block(mut self, block: [u32; 3]) -> Self {
        self.edit(false).block = block;
        self
    }

    /// Adds the CPU source: a function run **once per launch over whole
    /// buffers**, not once per thread (see [`CpuKernelFn`] for what it is
    /// given and how to make one kernel behave the same on every backend).
    pub fn with_cpu(mut self, f: impl Fn(&mut CpuKernelContext<'_>) + Send + Sync + 'static) -> Self {
        self.edit(true).cpu = Some(Arc::new(f));
        self
    }

    /// Adds CUDA C source, whose entry point is an `extern "C" __global__`
    /// function named like the kernel.
    pub fn with_cuda(mut self, source: impl Into<Arc<str>>) -> Self {
        self.edit(true).cuda = Some(source.into());
        self
    }

    /// Adds WGSL source, whose entry point is `main`.
    pub fn with_wgsl(mut self, source: impl Into<Arc<str>>) -> Self {
        self.edit(true).wgsl = Some(source.into());
        self
    }

    /// Unique per kernel and its sources (clones share it; adding a source
    /// gives a fresh one): the key compiled pipelines are cached under.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The name, shared: keeping it costs a reference count, not a copy.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn shared_name(&self) -> &Arc<str> {
        &self.inner.name
    }

    pub fn block(&self) -> [u32; 3] {
        self.inner.block
    }

    pub fn cpu_source(&self) -> Option<&CpuKernelFn> {
        self.inner.cpu.as_ref()
    }

    pub fn cuda_source(&self) -> Option<&str> {
        self.inner.cuda.as_deref()
    }

    pub fn wgsl_source(&self) -> Option<&str> {
        self.inner.wgsl.as_deref()
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("Kernel")
            .field("name", &inner.name)
            .field("block", &inner.block)
            .field("cpu", &inner.cpu.is_some())
            .field("cuda", &inner.cuda.is_some())
            .field("wgsl", &inner.wgsl.is_some())
            .finish()
    }
}

/// How many blocks to launch.
#[derive(Debug, Clone)]
pub enum GridCount {
    /// A fixed grid.
    Static(u32, u32, u32),
    /// Three `u32`s (x, y, z) read from a buffer when the launch runs.
    Dynamic(Handle),
}

impl GridCount {
    /// Enough blocks of `block` threads to cover `threads` along x.
    pub fn cover(threads: usize, block: u32) -> Self {
        GridCount::Static((threads as u32).div_ceil(block.max(1)), 1, 1)
    }
}

/// A scalar kernel argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    F32(f32),
    F64(f64),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
}

impl Scalar {
    /// The value as `f64` (for CPU kernels that take any numeric scalar).
    pub fn as_f64(&self) -> f64 {
        match *self {
            Scalar::F32(v) => v as f64,
            Scalar::F64(v) => v,
            Scalar::I32(v) => v as f64,
            Scalar::U32(v) => v as f64,
            Scalar::I64(v) => v as f64,
            Scalar::U64(v) => v as f64,
        }
    }

    /// The value as `u64`, truncating floats and negative integers to 0.
    pub fn as_u64(&self) -> u64 {
        match *self {
            Scalar::F32(v) => v.max(0.0) as u64,
            Scalar::F64(v) => v.max(0.0) as u64,
            Scalar::I32(v) => v.max(0) as u64,
            Scalar::U32(v) => v as u64,
            Scalar::I64(v) => v.max(0) as u64,
            Scalar::U64(v) => v,
        }
    }

    /// The little-endian bytes of the value (4 or 8 bytes).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match *self {
            Scalar::F32(v) => v.to_le_bytes().to_vec(),
            Scalar::F64(v) => v.to_le_bytes().to_vec(),
            Scalar::I32(v) => v.to_le_bytes().to_vec(),
            Scalar::U32(v) => v.to_le_bytes().to_vec(),
            Scalar::I64(v) => v.to_le_bytes().to_vec(),
            Scalar::U64(v) => v.to_le_bytes().to_vec(),
        }
    }
}

/// A launch's buffers: inline (no heap allocation) for up to four.
pub type LaunchBuffers = smallvec::SmallVec<[Handle; 4]>;

/// A launch's scalars: inline for up to four.
pub type LaunchScalars = smallvec::SmallVec<[Scalar; 4]>;

/// The buffers and scalars of a launch, in the order the kernel declares them.
/// Every buffer is treated as written by the launch: a failed launch marks all
/// of them. Up to four of each are kept without a heap allocation.
#[derive(Debug, Clone, Default)]
pub struct KernelArguments {
    pub buffers: LaunchBuffers,
    pub scalars: LaunchScalars,
}

impl KernelArguments {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn buffer(mut self, handle: &Handle) -> Self {
        self.buffers.push(handle.clone());
        self
    }

    pub fn scalar(mut self, value: Scalar) -> Self {
        self.scalars.push(value);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_shares_the_id_and_a_new_source_gets_a_fresh_one() {
        let base = Kernel::new("k").with_cuda("extern \"C\" __global__ void k() {}");
        let clone = base.clone();
        assert_eq!(clone.id(), base.id());
        let reblocked = base.clone().with_block([64, 1, 1]);
        assert_eq!(reblocked.id(), base.id(), "the block is given at launch, not compiled in");
        assert_eq!(reblocked.block(), [64, 1, 1]);
        assert_eq!(base.block(), [256, 1, 1], "the original keeps its block");
        let other = base.clone().with_cuda("extern \"C\" __global__ void k() { /* other */ }");
        assert_ne!(other.id(), base.id(), "a cached pipeline of the old source must not run for the new one");
        assert_eq!(base.cuda_source(), Some("extern \"C\" __global__ void k() {}"));
        assert!(other.cuda_source().unwrap().contains("other"));
        let id = other.id();
        let other = other.with_wgsl("@compute @workgroup_size(1) fn main() {}");
        assert_ne!(other.id(), id, "a kernel given a source of its own (no clone) changes its id too");
    }
}
