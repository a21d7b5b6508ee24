//! Batched copies on CUDA: one launch of `copy_regions.cu`'s gather kernel
//! per [`MAX_REGIONS`] regions, their addresses and sizes passed by value as
//! the kernel's argument (no table is uploaded, so a stream capture records
//! the launch whole and a replay needs nothing else).

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::CudaBackend;
use crate::backend::Binding;
use crate::error::ServerError;
use crate::id::StreamId;
use crate::kernel::Kernel;

const SOURCE: &str = include_str!("copy_regions.cu");
const NAME: &str = "cohort_copy_regions";

/// Regions per launch (matches `MAX_REGIONS` in the source; the argument
/// then takes 3 KiB of the 4 KiB a kernel argument may hold).
const MAX_REGIONS: usize = 128;
const THREADS: u32 = 256;
/// The most blocks along one region (each moves up to 4 KiB per pass).
const MAX_BLOCKS_X: u64 = 1024;

/// The kernel's argument (matches `struct CopyTable`).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyTable {
    src: [u64; MAX_REGIONS],
    dst: [u64; MAX_REGIONS],
    bytes: [u64; MAX_REGIONS],
    count: u32,
}

/// The kernel, one per process: [`Kernels`](super::kernels::Kernels) keeps
/// its compiled function per device under its id.
fn kernel() -> &'static Kernel {
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    KERNEL.get_or_init(|| Kernel::new(NAME).with_block([THREADS, 1, 1]).with_cuda(SOURCE))
}

impl CudaBackend {
    /// Queues the copies of `regions` on `stream`: one kernel per
    /// [`MAX_REGIONS`] of them (see the module docs). Does not wait.
    pub(crate) fn copy_regions_batched(
        &mut self,
        stream: StreamId,
        regions: &[(Binding, Binding)],
    ) -> Result<(), ServerError> {
        self.check_lost()?;
        let failed = |device, reason: String| ServerError::KernelFailed { kernel: NAME.to_string(), device, reason };
        let function = self.kernels.function(kernel(), SOURCE).map_err(|reason| failed(self.device, reason))?;
        let raw = self.raw_stream(stream)?;
        for batch in regions.chunks(MAX_REGIONS) {
            let mut table =
                CopyTable { src: [0; MAX_REGIONS], dst: [0; MAX_REGIONS], bytes: [0; MAX_REGIONS], count: 0 };
            let mut most = 0u64;
            for &(src, dst) in batch {
                if src.size != dst.size {
                    return Err(ServerError::InvalidArgument(format!(
                        "a copy region of {} bytes into {} bytes",
                        src.size, dst.size
                    )));
                }
                let at = table.count as usize;
                table.src[at] = self.pages.ptr(src)?;
                table.dst[at] = self.pages.ptr(dst)?;
                table.bytes[at] = src.size;
                table.count += 1;
                most = most.max(src.size);
            }
            if most == 0 {
                continue;
            }
            let blocks_x = most.div_ceil(16 * THREADS as u64).clamp(1, MAX_BLOCKS_X) as u32;
            let mut params = [(&mut table as *mut CopyTable).cast::<c_void>()];
            // SAFETY: `function` is loaded in this context and takes one
            // `CopyTable` by value, which `params` points at until the call
            // returns (the driver copies it). Every range in it lies in a
            // live page of this device (checked by `ptr`), held by the task
            // that asked for the copies.
            let code = unsafe {
                sys::cuLaunchKernel(
                    function,
                    blocks_x,
                    table.count,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    raw,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            if code != sys::CUresult::CUDA_SUCCESS {
                let err = failed(
                    self.device,
                    format!("cuLaunchKernel of {} regions: {}", table.count, super::driver::describe(code)),
                );
                return Err(self.classify(stream, err));
            }
            self.streams.note_launch(stream, NAME);
        }
        Ok(())
    }
}
