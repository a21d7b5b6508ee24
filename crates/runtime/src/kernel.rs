//! Kernels: one compute function with a source per backend, and its launch
//! arguments.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::handle::Handle;

static NEXT_KERNEL: AtomicU64 = AtomicU64::new(1);

/// What a CPU kernel sees: the grid it was launched with, its buffers (as
/// mutable byte slices of device memory) and its scalars.
pub struct CpuKernelContext<'a> {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub buffers: Vec<&'a mut [u8]>,
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
pub type CpuKernelFn = Arc<dyn Fn(&mut CpuKernelContext<'_>) + Send + Sync>;

/// A kernel: a name, a block size and a source for each backend it runs on.
///
/// A launch on a backend the kernel has no source for fails, and marks the
/// launch's buffers with [`crate::ServerError::MissingKernelSource`].
#[derive(Clone)]
pub struct Kernel {
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
        Self {
            id: NEXT_KERNEL.fetch_add(1, Ordering::Relaxed),
            name: Arc::from(name.into()),
            block: [256, 1, 1],
            cpu: None,
            cuda: None,
            wgsl: None,
        }
    }

    /// The threads of one block (workgroup).
    pub fn with_block(mut self, block: [u32; 3]) -> Self {
        self.block = block;
        self
    }

    /// Adds the CPU source.
    pub fn with_cpu(mut self, f: impl Fn(&mut CpuKernelContext<'_>) + Send + Sync + 'static) -> Self {
        self.cpu = Some(Arc::new(f));
        self
    }

    /// Adds CUDA C source, whose entry point is an `extern "C" __global__`
    /// function named like the kernel.
    pub fn with_cuda(mut self, source: impl Into<Arc<str>>) -> Self {
        self.cuda = Some(source.into());
        self
    }

    /// Adds WGSL source, whose entry point is `main`.
    pub fn with_wgsl(mut self, source: impl Into<Arc<str>>) -> Self {
        self.wgsl = Some(source.into());
        self
    }

    /// Unique per kernel built with [`Kernel::new`] (clones share it): the key
    /// compiled pipelines are cached under.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn block(&self) -> [u32; 3] {
        self.block
    }

    pub fn cpu_source(&self) -> Option<&CpuKernelFn> {
        self.cpu.as_ref()
    }

    pub fn cuda_source(&self) -> Option<&str> {
        self.cuda.as_deref()
    }

    pub fn wgsl_source(&self) -> Option<&str> {
        self.wgsl.as_deref()
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.name)
            .field("block", &self.block)
            .field("cpu", &self.cpu.is_some())
            .field("cuda", &self.cuda.is_some())
            .field("wgsl", &self.wgsl.is_some())
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

/// The buffers and scalars of a launch, in the order the kernel declares them.
/// Every buffer is treated as written by the launch: a failed launch marks all
/// of them.
#[derive(Debug, Clone, Default)]
pub struct KernelArguments {
    pub buffers: Vec<Handle>,
    pub scalars: Vec<Scalar>,
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
