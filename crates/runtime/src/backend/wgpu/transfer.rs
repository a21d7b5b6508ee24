//! Moving bytes: host to device (`queue.write_buffer`), device to host
//! (staging buffers and `map_async`), and device to device.
//!
//! wgpu copies whole 4-byte words at 4-byte offsets. A binding whose start or
//! end falls inside a word is read through the enclosing words; a write to
//! one first reads the one or two edge words it shares with its neighbours,
//! so bytes outside the binding keep their values.
//!
//! Transfers are cut into chunks of at most [`CHUNK`] bytes (and never more
//! than the device's `max_buffer_size`), so a transfer larger than one
//! binding may span (128 MiB on lavapipe) is chunked, never refused, and
//! host-side staging stays modest.
//!
//! Reads: the copies into a `MAP_READ` staging buffer are recorded after the
//! work already queued, submitted, and the staging buffer mapped with
//! `map_async`; the device thread then polls with `PollType::Wait` for that
//! one submission. `Backend::read` returns the bytes, so the device thread
//! has to wait for them; waiting on the submission index (not on the whole
//! device) keeps the wait to the copy and the work before it. Callers that
//! must not wait use `Client::read_async`, whose caller thread is never
//! blocked. Up to two chunks are in flight, so the copy of one overlaps the
//! host's copy out of the previous one. Staging buffers are pooled.

use std::collections::VecDeque;
use std::sync::mpsc;

use crate::backend::Binding;
use crate::bytes::AlignedBytes;
use crate::error::ServerError;
use crate::memory::PageId;

use super::adapter::Gpu;
use super::queue::{wait_for, Submitter};
use super::storage::WgpuPages;

/// Largest piece one copy, staging buffer or buffer write moves.
pub(crate) const CHUNK: u64 = 32 << 20;

/// Staging buffers kept for reuse, in bytes at most.
const STAGING_POOL_BYTES: u64 = 2 * CHUNK;

/// The chunk size on a device (a multiple of 4, at most `max_buffer_size`).
pub(crate) fn chunk_size(gpu: &Gpu) -> u64 {
    (CHUNK.min(gpu.limits.max_buffer_size) & !3).max(4)
}

/// A reusable pool of `MAP_READ | COPY_DST` staging buffers.
#[derive(Default)]
pub(crate) struct StagingPool {
    free: Vec<wgpu::Buffer>,
}

impl StagingPool {
    fn acquire(&mut self, gpu: &Gpu, size: u64) -> wgpu::Buffer {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.size() >= size)
            .min_by_key(|(_, b)| b.size())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return self.free.swap_remove(i);
        }
        let rounded = size.next_power_of_two().clamp(64 << 10, chunk_size(gpu).max(size));
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cohort staging"),
            size: rounded.max(size),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    fn release(&mut self, buffer: wgpu::Buffer) {
        self.free.push(buffer);
        self.free.sort_by_key(|b| b.size());
        while self.free.iter().map(|b| b.size()).sum::<u64>() > STAGING_POOL_BYTES {
            // Drop the largest first: small reads are the common case.
            self.free.pop();
        }
    }
}

/// One word-aligned piece of a read: `len` bytes at `src_offset` of `page`,
/// part of (the words around) output `output`.
#[derive(Clone, Copy)]
struct Piece {
    output: usize,
    page: PageId,
    src_offset: u64,
    len: u64,
}

/// A batch of pieces copied into one staging buffer in one submission.
struct InFlight {
    staging: wgpu::Buffer,
    pieces: Vec<(Piece, u64)>,
    used: u64,
    index: wgpu::SubmissionIndex,
    mapped: mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
}

/// What reads and writes need from the backend, borrowed together.
pub(crate) struct Transfer<'a> {
    pub gpu: &'a Gpu,
    pub pages: &'a WgpuPages,
    pub submitter: &'a mut Submitter,
    pub staging: &'a mut StagingPool,
}

impl Transfer<'_> {
    /// Reads each binding to the host, after all work queued so far.
    pub fn read(&mut self, sources: &[Binding]) -> Result<Vec<AlignedBytes>, ServerError> {
        let mut outputs: Vec<AlignedBytes> = sources.iter().map(|b| AlignedBytes::zeroed(b.size as usize)).collect();
        let chunk = chunk_size(self.gpu);
        let mut batches: Vec<Vec<(Piece, u64)>> = Vec::new();
        let mut current: Vec<(Piece, u64)> = Vec::new();
        let mut used = 0u64;
        for (output, binding) in sources.iter().enumerate() {
            if binding.size == 0 {
                continue;
            }
            self.pages.checked(*binding)?;
            let start = binding.offset & !3;
            let end = (binding.offset + binding.size).next_multiple_of(4);
            let mut at = start;
            while at < end {
                if used == chunk {
                    batches.push(std::mem::take(&mut current));
                    used = 0;
                }
                let len = (end - at).min(chunk - used);
                current.push((Piece { output, page: binding.page, src_offset: at, len }, used));
                used += len;
                at += len;
            }
        }
        if !current.is_empty() {
            batches.push(current);
        }
        let mut in_flight: VecDeque<InFlight> = VecDeque::new();
        for batch in batches {
            if in_flight.len() == 2 {
                let done = in_flight.pop_front().expect("two in flight");
                self.finish(done, sources, &mut outputs)?;
            }
            in_flight.push_back(self.start(batch)?);
        }
        while let Some(done) = in_flight.pop_front() {
            self.finish(done, sources, &mut outputs)?;
        }
        Ok(outputs)
    }

    /// Records the copies of one batch, submits them and asks for the map.
    fn start(&mut self, pieces: Vec<(Piece, u64)>) -> Result<InFlight, ServerError> {
        let used = pieces.iter().map(|(p, at)| at + p.len).max().unwrap_or(4);
        let staging = self.staging.acquire(self.gpu, used);
        let encoder = self.submitter.encoder(self.gpu);
        for (piece, at) in &pieces {
            let page = self.pages.buffer(piece.page)?;
            encoder.copy_buffer_to_buffer(page, piece.src_offset, &staging, *at, piece.len);
        }
        let index = match self.submitter.submit_checked(self.gpu) {
            Ok(index) => index,
            Err(err) => {
                self.staging.release(staging);
                return Err(err);
            }
        };
        let (tx, rx) = mpsc::channel();
        staging.slice(0..used).map_async(wgpu::MapMode::Read, move |result| {
            let _ = tx.send(result);
        });
        Ok(InFlight { staging, pieces, used, index, mapped: rx })
    }

    /// Waits for one batch's map and copies its bytes to the outputs.
    fn finish(
        &mut self,
        batch: InFlight,
        sources: &[Binding],
        outputs: &mut [AlignedBytes],
    ) -> Result<(), ServerError> {
        wait_for(&self.gpu.device, batch.index.clone()).map_err(|m| self.gpu.error(m))?;
        let mapped = match batch.mapped.try_recv() {
            Ok(result) => result,
            // The callback runs during the poll; wait for the device once
            // more in case the driver reported the submission done early.
            Err(_) => {
                wait_for(&self.gpu.device, batch.index.clone()).map_err(|m| self.gpu.error(m))?;
                batch.mapped.recv().map_err(|_| self.gpu.error("the staging buffer's map never completed"))?
            }
        };
        mapped.map_err(|e| self.gpu.error(format!("mapping a staging buffer for a read failed: {e}")))?;
        {
            let view =
                batch.staging.slice(0..batch.used).get_mapped_range().map_err(|e| self.gpu.error(e.to_string()))?;
            for (piece, at) in &batch.pieces {
                let binding = sources[piece.output];
                // The piece covers [src_offset, src_offset + len) of the page;
                // keep its intersection with the binding.
                let lo = piece.src_offset.max(binding.offset);
                let hi = (piece.src_offset + piece.len).min(binding.offset + binding.size);
                if lo >= hi {
                    continue;
                }
                let from = (at + lo - piece.src_offset) as usize;
                let to = (lo - binding.offset) as usize;
                let len = (hi - lo) as usize;
                outputs[piece.output].as_mut_slice()[to..to + len].copy_from_slice(&view[from..from + len]);
            }
        }
        batch.staging.unmap();
        self.staging.release(batch.staging);
        Ok(())
    }

    /// Writes `data` into `dst`, after all work queued so far.
    pub fn write(&mut self, dst: Binding, data: &[u8]) -> Result<(), ServerError> {
        if data.len() as u64 != dst.size {
            return Err(ServerError::InvalidArgument(format!(
                "write of {} bytes into a buffer of {} bytes",
                data.len(),
                dst.size
            )));
        }
        if dst.size == 0 {
            return Ok(());
        }
        self.pages.checked(dst)?;
        let start = dst.offset & !3;
        let end = (dst.offset + dst.size).next_multiple_of(4);
        if start == dst.offset && end == dst.offset + dst.size {
            return self.write_words(dst.page, start, data);
        }
        // Unaligned edges: merge with the words the binding shares.
        let mut words = vec![0u8; (end - start) as usize];
        let head = Binding { page: dst.page, offset: start, size: 4 };
        let tail = Binding { page: dst.page, offset: end - 4, size: 4 };
        let edges = if end - start == 4 { vec![head] } else { vec![head, tail] };
        let read = self.read(&edges)?;
        words[..4].copy_from_slice(read[0].as_slice());
        if let Some(tail) = read.get(1) {
            let n = words.len();
            words[n - 4..].copy_from_slice(tail.as_slice());
        }
        let at = (dst.offset - start) as usize;
        words[at..at + data.len()].copy_from_slice(data);
        self.write_words(dst.page, start, &words)
    }

    /// `queue.write_buffer` in chunks; `offset` and the length are multiples
    /// of 4. Between chunks the queue is submitted so wgpu can release each
    /// chunk's staging memory as the copies finish.
    fn write_words(&mut self, page: PageId, offset: u64, data: &[u8]) -> Result<(), ServerError> {
        self.submitter.before_queue_write(self.gpu);
        let buffer = self.pages.buffer(page)?;
        let chunk = chunk_size(self.gpu) as usize;
        let chunks = data.len().div_ceil(chunk);
        let (_, error) = self.gpu.scoped(|| {
            for (i, piece) in data.chunks(chunk).enumerate() {
                self.gpu.queue.write_buffer(buffer, offset + (i * chunk) as u64, piece);
                if i + 1 < chunks {
                    self.gpu.queue.submit(std::iter::empty());
                }
            }
        });
        self.submitter.wrote();
        match error {
            None => Ok(()),
            Some(error) => Err(self.gpu.error(format!("buffer write failed: {error}"))),
        }
    }

    /// Copies `src` into `dst` on the device, after all work queued so far.
    pub fn copy(&mut self, src: Binding, dst: Binding) -> Result<(), ServerError> {
        if src.size != dst.size {
            return Err(ServerError::InvalidArgument(format!("copy of {} bytes into {} bytes", src.size, dst.size)));
        }
        if src.size == 0 {
            return Ok(());
        }
        let aligned = src.offset.is_multiple_of(4) && dst.offset.is_multiple_of(4) && src.size.is_multiple_of(4);
        let overlap = src.page == dst.page && src.offset < dst.offset + dst.size && dst.offset < src.offset + src.size;
        if !aligned || overlap {
            // Through the host: wgpu copies whole words and never within
            // overlapping ranges.
            let bytes = self.read(&[src])?;
            return self.write(dst, bytes[0].as_slice());
        }
        let source = self.pages.checked(src)?;
        let target = self.pages.checked(dst)?;
        let (_, error) = self.gpu.scoped(|| {
            if src.page == dst.page {
                // A buffer may not be both source and destination of one
                // copy: go through a temporary buffer.
                let temp = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("cohort copy"),
                    size: src.size,
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                let encoder = self.submitter.encoder(self.gpu);
                encoder.copy_buffer_to_buffer(source, src.offset, &temp, 0, src.size);
                encoder.copy_buffer_to_buffer(&temp, 0, target, dst.offset, src.size);
            } else {
                let encoder = self.submitter.encoder(self.gpu);
                encoder.copy_buffer_to_buffer(source, src.offset, target, dst.offset, src.size);
            }
        });
        self.submitter.recorded(self.gpu);
        match error {
            None => Ok(()),
            Some(error) => Err(self.gpu.error(format!("device copy failed: {error}"))),
        }
    }
}
