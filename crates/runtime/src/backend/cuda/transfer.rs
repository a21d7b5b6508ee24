//! Moving bytes between the host and the device through pinned memory.
//!
//! - Uploads from pinned memory (bytes passed through `Client::staging`) are
//!   one DMA copy, queued without waiting.
//! - Small uploads from pageable memory go straight to the driver, which
//!   stages them at once, so the call returns without waiting for the copy.
//! - Large uploads from pageable memory go through a ring of pinned chunks:
//!   the host fills one chunk while the copy engine drains the last.
//! - Small reads are copied into a pinned scratch block (one stream sync for
//!   all of them), then out to host bytes.
//! - Large reads land in a pinned block lent to the caller (no host copy), or,
//!   when the pinned pool is full, go through the chunk ring, the host
//!   copying out one chunk while the next transfers.

use std::collections::VecDeque;

use cudarc::driver::sys;

use super::driver::{driver_error, SendPtr};
use super::pinned::{PinnedBlock, PinnedPool};
use crate::backend::HostMemory;
use crate::bytes::AlignedBytes;
use crate::error::ServerError;
use crate::id::DeviceId;

/// Below this, copies skip the chunk ring and the pinned read blocks.
pub(crate) const SMALL: usize = 256 << 10;
/// Bytes in one ring chunk.
const CHUNK: usize = 8 << 20;
/// Host copies of a chunk are split into pieces of this size, copied in
/// parallel: one thread's memcpy (about 5–6 GB/s measured on an H200 host)
/// would otherwise bound pageable uploads far below the DMA's 55 GB/s.
const PIECE: usize = 1 << 20;

/// Copies `len` bytes from `src` to `dst` with several threads.
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and not overlap.
unsafe fn parallel_copy(src: *const u8, dst: *mut u8, len: usize) {
    use rayon::prelude::*;
    let (src, dst) = (src as usize, dst as usize);
    (0..len.div_ceil(PIECE)).into_par_iter().for_each(|i| {
        let at = i * PIECE;
        let n = PIECE.min(len - at);
        // SAFETY: the caller's contract; pieces are disjoint ranges of it.
        unsafe { std::ptr::copy_nonoverlapping((src + at) as *const u8, (dst + at) as *mut u8, n) };
    });
}
/// Chunks in the ring.
const SLOTS: usize = 4;

struct Slot {
    block: PinnedBlock,
    event: SendPtr<sys::CUevent>,
    pending: bool,
}

/// The staging state of one device: the chunk ring and the read scratch.
pub(crate) struct Staging {
    device: DeviceId,
    pub pool: PinnedPool,
    ring: Vec<Slot>,
    scratch: Option<PinnedBlock>,
}

fn check(device: DeviceId, call: &str, code: sys::CUresult) -> Result<(), ServerError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(device, call, code))
    }
}

impl Staging {
    /// Staging for `device`, its pinned pool holding at most `limit_mib` MiB.
    pub fn new(device: DeviceId, limit_mib: usize) -> Self {
        Self { device, pool: PinnedPool::new(device, limit_mib), ring: Vec::new(), scratch: None }
    }

    /// Ring slot `index`, waiting until the copy that last used it is done.
    fn slot(&mut self, index: usize) -> Result<&mut Slot, ServerError> {
        while self.ring.len() <= index {
            let block = self.pool.take(CHUNK, true)?.ok_or_else(|| ServerError::OutOfMemory {
                device: self.device,
                requested: CHUNK as u64,
                reason: "the pinned host pool is full (raise COHORT_PINNED_LIMIT_MB)".into(),
            })?;
            let mut event: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: the task's thread, context current; writes one handle.
            check(self.device, "cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
            self.ring.push(Slot { block, event: SendPtr(event), pending: false });
        }
        let device = self.device;
        let slot = &mut self.ring[index];
        if slot.pending {
            slot.pending = false;
            // SAFETY: the slot's own event, recorded after its last copy.
            check(device, "cuEventSynchronize (staging)", unsafe { sys::cuEventSynchronize(slot.event.0) })?;
        }
        Ok(slot)
    }

    /// Queues the upload of `data` to `dst` on `stream`.
    pub fn write(&mut self, stream: sys::CUstream, dst: sys::CUdeviceptr, data: &[u8]) -> Result<(), ServerError> {
        if data.is_empty() {
            return Ok(());
        }
        let device = self.device;
        if self.pool.contains(data.as_ptr(), data.len()) {
            // SAFETY: `data` lies in a pinned block; the DMA reads it after
            // this returns, and `mark_busy` keeps the block from being handed
            // out again before the copy is done.
            check(device, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), stream)
            })?;
            return self.pool.mark_busy(data.as_ptr(), stream);
        }
        if data.len() < SMALL {
            // SAFETY: from pageable memory the driver copies `data` into its
            // own staging before returning, so `data` may go right after.
            return check(device, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), stream)
            });
        }
        for (k, chunk) in data.chunks(CHUNK).enumerate() {
            let slot = self.slot(k % SLOTS)?;
            // SAFETY: the slot's block holds CHUNK bytes, no copy uses it
            // (waited above), and `chunk.len() <= CHUNK`.
            unsafe {
                parallel_copy(chunk.as_ptr(), slot.block.as_ptr(), chunk.len());
                let at = dst + (k * CHUNK) as u64;
                check(
                    device,
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(at, slot.block.as_ptr().cast(), chunk.len(), stream),
                )?;
                check(device, "cuEventRecord", sys::cuEventRecord(slot.event.0, stream))?;
            }
            slot.pending = true;
        }
        Ok(())
    }

    /// Copies each `(address, len)` to the host after the stream's queued
    /// work, and waits. `sync` drains the stream (and reports its faults).
    pub fn read(
        &mut self,
        stream: sys::CUstream,
        sources: &[(sys::CUdeviceptr, usize)],
        sync: impl Fn() -> Result<(), ServerError>,
    ) -> Result<Vec<AlignedBytes>, ServerError> {
        let device = self.device;
        let small_total: usize = sources.iter().filter(|s| s.1 < SMALL).map(|s| s.1.div_ceil(16) * 16).sum();
        if self.scratch.as_ref().is_none_or(|s| s.capacity() < small_total) {
            self.scratch = None;
            self.scratch =
                Some(self.pool.take(small_total.max(64 << 10), true)?.ok_or_else(|| ServerError::OutOfMemory {
                    device,
                    requested: small_total as u64,
                    reason: "the pinned host pool is full (raise COHORT_PINNED_LIMIT_MB)".into(),
                })?);
        }
        let scratch = self.scratch.as_ref().expect("set above").as_ptr();
        if let [(src, len)] = *sources {
            if len > 0 && len < SMALL {
                // One small read, the most frequent kind: no plan to keep.
                // SAFETY: the scratch block holds at least `len` bytes;
                // nothing else uses it until this read returns.
                check(device, "cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(scratch.cast(), src, len, stream)
                })?;
                sync()?;
                // SAFETY: the copy finished (the stream drained).
                return Ok(vec![AlignedBytes::from_slice(unsafe { std::slice::from_raw_parts(scratch, len) })]);
            }
        }
        enum Plan {
            Scratch(usize),
            Lent(PinnedBlock),
            Ring,
        }
        let mut plans = Vec::with_capacity(sources.len());
        let mut offset = 0usize;
        for &(src, len) in sources {
            if len == 0 {
                plans.push(Plan::Scratch(0));
                continue;
            }
            let plan = if len < SMALL {
                let at = offset;
                offset += len.div_ceil(16) * 16;
                // SAFETY: the scratch block holds `small_total` bytes and
                // `at + len <= small_total`; nothing else uses it until this
                // read returns.
                check(device, "cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(scratch.add(at).cast(), src, len, stream)
                })?;
                Plan::Scratch(at)
            } else if let Some(block) = self.pool.take(len, true)? {
                // SAFETY: the block holds at least `len` bytes and is ours.
                check(device, "cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(block.as_ptr().cast(), src, len, stream)
                })?;
                Plan::Lent(block)
            } else {
                Plan::Ring
            };
            plans.push(plan);
        }
        let mut ring_reads = Vec::with_capacity(sources.len());
        for (plan, &(src, len)) in plans.iter().zip(sources) {
            ring_reads.push(match plan {
                Plan::Ring => Some(self.read_through_ring(stream, src, len)?),
                _ => None,
            });
        }
        sync()?;
        let mut results = Vec::with_capacity(sources.len());
        for ((plan, ring_read), &(_, len)) in plans.into_iter().zip(ring_reads).zip(sources) {
            results.push(match plan {
                Plan::Scratch(_) if len == 0 => AlignedBytes::default(),
                // SAFETY: the copy into scratch at `at` finished (the stream
                // drained) and `at + len <= small_total`.
                Plan::Scratch(at) => {
                    AlignedBytes::from_slice(unsafe { std::slice::from_raw_parts(scratch.add(at), len) })
                }
                Plan::Lent(block) => AlignedBytes::from_host_memory(Box::new(block), len),
                Plan::Ring => ring_read.expect("read above"),
            });
        }
        Ok(results)
    }

    /// A large read through the chunk ring, the host copying one chunk out
    /// while the next ones transfer.
    fn read_through_ring(
        &mut self,
        stream: sys::CUstream,
        src: sys::CUdeviceptr,
        len: usize,
    ) -> Result<AlignedBytes, ServerError> {
        let device = self.device;
        let mut out = AlignedBytes::zeroed(len);
        let mut pending: VecDeque<(usize, usize, usize)> = VecDeque::new();
        let chunks = len.div_ceil(CHUNK);
        for k in 0..chunks {
            if pending.len() == SLOTS {
                let (slot, at, n) = pending.pop_front().expect("non-empty");
                self.drain_slot(slot, &mut out.as_mut_slice()[at..at + n])?;
            }
            let at = k * CHUNK;
            let n = CHUNK.min(len - at);
            let slot = self.slot(k % SLOTS)?;
            // SAFETY: the slot's block holds CHUNK >= n bytes and no copy uses
            // it (waited in `slot`).
            unsafe {
                check(
                    device,
                    "cuMemcpyDtoHAsync",
                    sys::cuMemcpyDtoHAsync_v2(slot.block.as_ptr().cast(), src + at as u64, n, stream),
                )?;
                check(device, "cuEventRecord", sys::cuEventRecord(slot.event.0, stream))?;
            }
            slot.pending = true;
            pending.push_back((k % SLOTS, at, n));
        }
        while let Some((slot, at, n)) = pending.pop_front() {
            self.drain_slot(slot, &mut out.as_mut_slice()[at..at + n])?;
        }
        Ok(out)
    }

    /// Waits for a ring slot's copy and moves its bytes into `into`.
    fn drain_slot(&mut self, index: usize, into: &mut [u8]) -> Result<(), ServerError> {
        let slot = self.slot(index)?;
        // SAFETY: `slot` waited for the copy into the block, which holds at
        // least `into.len()` bytes.
        unsafe { parallel_copy(slot.block.as_ptr(), into.as_mut_ptr(), into.len()) };
        Ok(())
    }

    /// Frees the ring and scratch, then the pool (the device drained first).
    pub fn close(&mut self) {
        for slot in self.ring.drain(..) {
            // SAFETY: the ring's own events; the device drained.
            unsafe {
                let _ = sys::cuEventDestroy_v2(slot.event.0);
            }
        }
        self.scratch = None;
        self.pool.close();
    }
}
