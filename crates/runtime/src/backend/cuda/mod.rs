//! The CUDA backend, on cudarc with dynamic loading: it builds anywhere and
//! reports a missing driver, NVRTC or device as an error naming the library.
//!
//! One backend per device lives on the device's server thread with the
//! device's primary context current there. A caller's thread may run a task
//! of an idle device itself, under the device state's lock, with the
//! context made current on it for the task (see `Backend::enter_caller`):
//! the driver's handles this backend keeps (context, streams, events,
//! modules, NCCL communicators, the cuBLAS handle) may be used from any
//! thread that has their context current, one thread at a time, which the
//! lock guarantees. Its parts, a module each:
//! [`driver`](self) loading and discovery, `storage` (device pages), `pinned`
//! (the pinned host pool) and `transfer` (staged copies), `streams`, `events`
//! (pooled events for fences and cross-stream order), `external` (streams
//! of other libraries to order with), `kernels` (NVRTC and
//! its caches), `graphs` (stream capture), `timing` (event timers), `nccl`
//! and `nccl_lib` (NCCL communicators and collectives, behind
//! [`crate::backend::DeviceCollectives`]) and `peer` (peer access and copies).
//!
//! # Faults
//!
//! A kernel that faults (an illegal address, say) is found at the next sync,
//! read or fence of the device: that call returns
//! [`ServerError::KernelFailed`] naming the kernels queued since the last
//! sync, and the runtime marks the error on the buffers those launches wrote.
//! Such a fault is *sticky* in CUDA: the context is lost, and every later call
//! on the device returns the same error without reaching the driver. CUDA
//! cannot recover it inside the process (seen on an H200: even a reset
//! primary context cannot be retained again), so once the device is closed
//! ([`crate::Client::close`]) opening it again is refused with an error that
//! says to restart the process. Other devices, and other runtimes' clients,
//! are unaffected. Errors that are not sticky (a compile error, a launch with
//! too many threads) fail only the call that made them.
//!
//! # Sharing the primary context
//!
//! Each GPU's primary context is shared: by the devices
//! `COHORT_CUDA_DEVICES` shows on it, and by any other library of the
//! process that uses it (cudarc's `CudaContext::new`, PyTorch, CuPy; see
//! [`CudaRuntime::client_for_context`]). So cohort touches only its own
//! work in it: closing a device waits for that device's streams, never for
//! the whole context (`cuCtxSynchronize` would wait for the other
//! library's work too), and lets go of its retain of the context without
//! resetting it, even after a sticky fault (a reset would destroy every
//! other holder's allocations; after the fault the context is lost for all
//! of them anyway, and goes when the last lets go). A sticky fault in
//! another library's kernel loses the context for cohort too: cohort's
//! calls then return it, as for a fault of its own. Work is ordered with a
//! stream of the other library's by events
//! ([`crate::Client::wait_external`], [`crate::Client::signal_external`]),
//! or runs on that stream itself ([`crate::Client::bind_external`]; see
//! `external` for how a bound stream's handle is used).

mod blas;
mod copy_regions;
mod disk_cache;
mod driver;
mod events;
mod external;
mod graphs;
mod kernels;
mod nccl;
mod nccl_lib;
mod peer;
mod peer_kernels;
mod pinned;
mod signal;
mod storage;
mod streams;
mod timing;
mod transfer;

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The cudarc crate this backend is built on, for raw baselines in benches.
pub use cudarc;
use cudarc::driver::sys;

use crate::backend::{
    Backend, Binding, CallerEntry, CompletedFence, DeviceCollectives, FenceWait, ResolvedGrid, TimerStart,
};
use crate::bytes::AlignedBytes;
use crate::client::Client;
use crate::device::BackendFactory;
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};
use crate::kernel::{Kernel, Scalar};
use crate::memory::PageStorage;
use crate::profile::ProfileDuration;
use crate::properties::{Capabilities, DeviceProperties};
use crate::runtime::Runtime;
use crate::stages::{self, Stage};

use driver::{describe, driver_error, is_sticky, BACKEND};
use events::EventPool;
use graphs::GraphExec;
use kernels::Kernels;
use storage::DevicePages;
use streams::Streams;
use transfer::Staging;

pub use disk_cache::nvrtc_cache_dir;
pub use kernels::{nvrtc_cache_stats, NvrtcCacheStats};

pub use blas::cublas_version;

/// Whether NCCL can be used in this process: `Ok` with its version
/// (`2.28.7`) once libnccl loaded, or why not (no library, or
/// `COHORT_DISABLE_NCCL` set). Probes once; never panics.
pub fn nccl_version() -> Result<String, String> {
    nccl_lib::load().map(|lib| lib.version_text())
}

/// The CUDA runtime: one client per CUDA device the driver sees.
#[derive(Debug, Clone, Copy)]
pub struct CudaRuntime;

impl Runtime for CudaRuntime {
    const NAME: &'static str = "cuda";

    fn device_count() -> Result<usize, ServerError> {
        match driver::device_count()? {
            0 => Err(ServerError::Backend {
                backend: BACKEND,
                device: driver::device_id(0),
                message: "no CUDA device: libcuda.so loaded but the driver reports no devices (check CUDA_VISIBLE_DEVICES and nvidia-smi)".into(),
            }),
            n => Ok(n),
        }
    }

    fn client(index: usize) -> Result<Client, ServerError> {
        let count = Self::device_count()?;
        if index >= count {
            let seen = match crate::config::CUDA_DEVICES.get() {
                Ok(Some(n)) => format!("COHORT_CUDA_DEVICES={n} shows {count}"),
                _ => format!("the driver sees {count}"),
            };
            return Err(ServerError::InvalidArgument(format!("CUDA device {index} does not exist: {seen}")));
        }
        Client::load(driver::device_id(index), || -> BackendFactory {
            Box::new(move || Ok(Box::new(CudaBackend::new(index)?) as Box<dyn Backend>))
        })
    }
}

impl CudaRuntime {
    /// The client of the device that runs on `ctx`'s GPU, for a caller that
    /// already uses CUDA through cudarc (candle, burn's cubecl): cohort's
    /// work and the caller's then share the GPU's primary context, so
    /// memory and streams of either are valid for the other. Opens the
    /// device if it is not open; waits for nothing on the GPU.
    ///
    /// `ctx` must be the GPU's primary context (cudarc's
    /// `CudaContext::new`, which PyTorch and CuPy use too): cohort always
    /// runs on primary contexts. Any other context (`cuCtxCreate`,
    /// cudarc's `CudaContext::new_non_primary`) is refused with an error
    /// that says so; nothing is opened then. Where `COHORT_CUDA_DEVICES`
    /// shows several devices on one GPU, this is the first of them (device
    /// `g` for GPU `g`); a GPU that no shown device runs on is refused.
    pub fn client_for_context(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<Client, ServerError> {
        driver::ensure_driver()?;
        let index = driver::device_of_primary(ctx.cu_device(), ctx.cu_ctx())?;
        Self::client(index)
    }
}

/// Driver allocations of device pages made by this process's CUDA backends.
pub fn device_page_allocations() -> u64 {
    PAGE_ALLOCATIONS.load(Ordering::Relaxed)
}

static PAGE_ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Numbers each backend opened in this process, so a caller's thread knows
/// whether it made the context current for this backend or an earlier one
/// of the same device (a primary context released and retained again may
/// come back with the same handle).
static NEXT_BACKEND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// The backend (its number) that last made its context current on this
    /// caller's thread in `enter_caller`.
    static ENTERED_FOR: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// GPUs whose context a sticky fault lost, with the fault: CUDA cannot
/// give this process a working context on them again (nor to any device
/// shown on the same GPU, which shares the context).
static LOST_DEVICES: parking_lot::Mutex<Vec<(usize, String)>> = parking_lot::Mutex::new(Vec::new());

/// One CUDA device's state, on its server thread.
pub struct CudaBackend {
    properties: DeviceProperties,
    device: DeviceId,
    raw_device: sys::CUdevice,
    /// The GPU (driver ordinal) it runs on: its index unless
    /// `COHORT_CUDA_DEVICES` shows several devices per GPU.
    gpu: usize,
    /// The GPU's primary context (shared by the devices shown on it),
    /// retained in `new`, released in `drop`.
    ctx: sys::CUcontext,
    /// This backend's number in the process (see [`NEXT_BACKEND`]).
    serial: u64,
    pages: DevicePages,
    streams: Streams,
    events: EventPool,
    timing_events: EventPool,
    staging: Staging,
    kernels: Kernels,
    buffers: Vec<(sys::CUdeviceptr, u64)>,
    graphs_alive: Arc<AtomicBool>,
    nccl: nccl::NcclState,
    /// The device's cuBLAS handle (null until first used), made in its
    /// context by whichever thread runs the first product, destroyed in
    /// `drop` while the context lives.
    blas_handle: cudarc::cublas::sys::cublasHandle_t,
    /// The sticky fault that lost the context, returned by every later call.
    lost: Option<ServerError>,
    /// The last external stream found to be of this context (see
    /// `external_stream`): the same stream again is not asked about.
    checked_external: Option<usize>,
}

impl CudaBackend {
    /// Opens device `index`: retains its primary context and makes it current
    /// on the calling (device) thread. An unusable `COHORT_PINNED_LIMIT_MB`
    /// or `COHORT_DISABLE_NCCL` is an error here, before the device is touched.
    pub fn new(index: usize) -> Result<Self, ServerError> {
        let pinned_limit_mib = crate::config::PINNED_LIMIT_MB.get()?;
        nccl_lib::disabled()?;
        driver::ensure_driver()?;
        let gpu = driver::gpu_of(index)?;
        if let Some(fault) = LOST_DEVICES.lock().iter().find(|(g, _)| *g == gpu) {
            return Err(ServerError::Backend {
                backend: BACKEND,
                device: driver::device_id(index),
                message: format!(
                    "GPU {gpu}, which CUDA device {index} runs on, had a sticky fault earlier in this process ({}); CUDA cannot recover from it inside the process: restart the process to use the device again",
                    fault.1
                ),
            });
        }
        let info = driver::device_info(index)?;
        let devices_on_gpu = driver::devices_on(gpu)? as u32;
        let device = driver::device_id(index);
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is initialised and `info.raw` is a valid device;
        // the call writes the retained primary context.
        let code = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, info.raw) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(device, "cuDevicePrimaryCtxRetain", code));
        }
        driver::set_current(device, ctx)?;
        Ok(Self {
            properties: DeviceProperties {
                device,
                backend: BACKEND,
                name: info.name,
                memory_bytes: Some(info.memory_bytes),
                compute_units: info.multiprocessors,
                compute_capability: Some(info.capability),
                gpu: Some(info.gpu as u32),
                devices_on_gpu,
                max_binding_size: info.memory_bytes,
                device_timing: true,
                native_graphs: true,
                capabilities: Capabilities {
                    host_addressable_memory: false,
                    device_collectives: true,
                    peer_access: true,
                },
            },
            device,
            raw_device: info.raw,
            gpu: info.gpu,
            ctx,
            serial: NEXT_BACKEND.fetch_add(1, Ordering::Relaxed),
            pages: DevicePages::new(device, (devices_on_gpu > 1).then_some(info.gpu)),
            streams: Streams::new(device),
            events: EventPool::new(device, ctx, false),
            timing_events: EventPool::new(device, ctx, true),
            staging: Staging::new(device, pinned_limit_mib),
            kernels: Kernels::new(info.capability),
            buffers: Vec::new(),
            graphs_alive: Arc::new(AtomicBool::new(true)),
            nccl: nccl::NcclState::default(),
            blas_handle: std::ptr::null_mut(),
            lost: None,
            checked_external: None,
        })
    }

    fn check_lost(&self) -> Result<(), ServerError> {
        match &self.lost {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// Turns a failed call into the error to return: when the context holds
    /// a sticky fault, the fault (naming the kernels that may have caused it),
    /// kept for every later call; otherwise `err` itself.
    fn classify(&mut self, stream: StreamId, err: ServerError) -> ServerError {
        if self.lost.is_some() {
            return self.lost.clone().expect("checked");
        }
        let code = match self.streams.raw(stream) {
            // SAFETY: a live stream of the current context; the query only
            // reads its state.
            Ok(raw) => unsafe { sys::cuStreamQuery(raw) },
            Err(_) => return err,
        };
        if !is_sticky(code) {
            return err;
        }
        let mut suspects = self.streams.take_suspects(stream);
        suspects.extend(self.streams.take_all_suspects());
        suspects.dedup();
        let kernel = if suspects.is_empty() { "(unknown)".to_string() } else { suspects.join(", ") };
        let fault = ServerError::KernelFailed {
            kernel,
            device: self.device,
            reason: format!(
                "{} found while draining the device; the CUDA context is lost (a sticky fault): every later call on this device (and on any other device shown on its GPU) fails, and CUDA cannot give this process the GPU again: restart the process",
                describe(code)
            ),
        };
        tracing::error!(device = %self.device, "{fault}");
        LOST_DEVICES.lock().push((self.gpu, describe(code)));
        self.lost = Some(fault.clone());
        fault
    }

    /// `stream`'s handle, to queue work on it. When the device's last
    /// collective part ran on this stream without an event of its own (see
    /// `nccl`'s module doc), its event is recorded first: parts share an
    /// event only while nothing else is queued behind them, so a part's end
    /// is never seen later than the part's own.
    fn raw_stream(&mut self, stream: StreamId) -> Result<sys::CUstream, ServerError> {
        self.close_run_on(stream);
        self.streams.raw(stream)
    }

    /// Holds page frees while a capture is open or a device collective is
    /// pending (`cuMemFree` may wait for the whole device, and a collective
    /// may never complete until it is aborted), and frees what was held once
    /// neither is.
    fn update_held_frees(&mut self) {
        let hold = self.streams.any_capturing() || self.nccl.has_pending_parts();
        self.pages.hold_frees(hold);
    }

    /// Whether `stream` is inside a capture: cohort's (known), or, for a
    /// stream bound to a caller's `CUstream` (`bind_external`), the
    /// caller's own (`cuStreamIsCapturing`, asked only of bound streams).
    ///
    /// A fence of such a stream records nothing and is complete at once
    /// ([`Backend::fence`]): an event recorded there would join the capture
    /// (the caller's graph, for a bound stream) instead of marking the work
    /// queued so far, and CUDA forbids querying it (a query error counted
    /// as "finished" made every release, revoke and reclaim of adopted
    /// memory used there return at once). Completing at once is right:
    /// - work queued before cohort's capture finished before it began
    ///   (`begin_native_capture` syncs the stream first);
    /// - work queued during the capture runs only at a replay; a replay
    ///   after a revoke or reclaim is refused (graph.rs), and a graph keeps
    ///   its handles so the release of the last one comes after the graph;
    /// - a replay in flight (launched before the revoke) ran on a stream
    ///   not capturing then, noted on the memory (graph.rs `note_foreign`):
    ///   its fence is an event recorded after the replay, and a capture
    ///   begun there since synced the stream, so the replay had finished.
    ///
    /// Left open: a bound caller stream whose owner began its own capture
    /// after cohort queued work there: that earlier work cannot be fenced
    /// without touching the caller's capture (no record, no sync, no query
    /// of it is allowed), so it is not waited for; a caller capturing its
    /// own stream must finish its capture (or sync) before ending a borrow.
    fn in_capture(&self, stream: StreamId) -> bool {
        if self.streams.is_capturing(stream) {
            return true;
        }
        self.streams.bound_to(stream).is_some_and(|raw| {
            graphs::capture_status(self.device, raw)
                .is_ok_and(|status| status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        })
    }

    fn check(&mut self, stream: StreamId, call: &str, code: sys::CUresult) -> Result<(), ServerError> {
        if code == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let err = driver_error(self.device, call, code);
        Err(self.classify(stream, err))
    }

    fn stream_sync(&mut self, stream: StreamId) -> Result<(), ServerError> {
        let raw = self.raw_stream(stream)?;
        self.settle_collectives(raw);
        // SAFETY: a live stream of the current context.
        let code = unsafe { sys::cuStreamSynchronize(raw) };
        self.check(stream, "cuStreamSynchronize", code)?;
        self.streams.forget_suspects(stream);
        Ok(())
    }

    fn resolve_grid(&mut self, stream: StreamId, grid: ResolvedGrid) -> Result<[u32; 3], ServerError> {
        let binding = match grid {
            ResolvedGrid::Static(g) => return Ok(g),
            ResolvedGrid::Dynamic(binding) => binding,
        };
        if self.streams.is_capturing(stream) {
            return Err(ServerError::InvalidState {
                operation: "a launch with a dynamic grid",
                reason: "a CUDA graph cannot read its grid from a buffer at replay; use a static grid inside capture windows".into(),
            });
        }
        let raw = self.raw_stream(stream)?;
        self.settle_collectives(raw);
        let src = self.pages.ptr(Binding { size: 12, ..binding })?;
        let device = self.device;
        let sync = move || {
            // SAFETY: a live stream of the current context.
            let code = unsafe { sys::cuStreamSynchronize(raw) };
            if code == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(driver_error(device, "cuStreamSynchronize", code))
            }
        };
        let bytes = match self.staging.read(raw, &[(src, 12)], sync) {
            Ok(mut bytes) => bytes.pop().expect("one read"),
            Err(err) => return Err(self.classify(stream, err)),
        };
        let words: Vec<u32> =
            bytes.as_slice().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok([words[0], words[1], words[2]])
    }
}

impl Backend for CudaBackend {
    fn properties(&self) -> &DeviceProperties {
        &self.properties
    }

    fn storage(&mut self) -> &mut dyn PageStorage {
        &mut self.pages
    }

    fn write(&mut self, stream: StreamId, dst: Binding, data: &[u8]) -> Result<(), ServerError> {
        self.check_lost()?;
        let ptr = self.pages.ptr(dst)?;
        let raw = self.raw_stream(stream)?;
        // A staged copy can wait for the stream's earlier work.
        self.settle_collectives(raw);
        let result = self.staging.write(raw, ptr, data);
        result.map_err(|err| self.classify(stream, err))
    }

    fn read(&mut self, stream: StreamId, sources: &[Binding]) -> Result<Vec<AlignedBytes>, ServerError> {
        self.check_lost()?;
        let raw = self.raw_stream(stream)?;
        self.settle_collectives(raw);
        // One source (the most frequent read) needs no vector.
        let (one, many);
        let addresses: &[(sys::CUdeviceptr, usize)] = match sources {
            [binding] => {
                one = [(self.pages.ptr(*binding)?, binding.size as usize)];
                &one
            }
            _ => {
                many = sources
                    .iter()
                    .map(|b| Ok((self.pages.ptr(*b)?, b.size as usize)))
                    .collect::<Result<Vec<_>, ServerError>>()?;
                &many
            }
        };
        let device = self.device;
        let sync = move || {
            // SAFETY: a live stream of the current context.
            let code = unsafe { sys::cuStreamSynchronize(raw) };
            if code == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(driver_error(device, "cuStreamSynchronize", code))
            }
        };
        match self.staging.read(raw, addresses, sync) {
            Ok(bytes) => {
                self.streams.forget_suspects(stream);
                Ok(bytes)
            }
            Err(err) => Err(self.classify(stream, err)),
        }
    }

    fn copy(&mut self, stream: StreamId, src: Binding, dst: Binding) -> Result<(), ServerError> {
        self.check_lost()?;
        if src.size != dst.size {
            return Err(ServerError::InvalidArgument(format!("copy of {} bytes into {} bytes", src.size, dst.size)));
        }
        if src.size == 0 {
            return Ok(());
        }
        let (from, to) = (self.pages.ptr(src)?, self.pages.ptr(dst)?);
        let raw = self.raw_stream(stream)?;
        // SAFETY: both ranges lie in live pages (checked by `ptr`) and the
        // stream is live.
        let code = unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, src.size as usize, raw) };
        self.check(stream, "cuMemcpyDtoDAsync", code)
    }

    fn copy_regions(&mut self, stream: StreamId, regions: &[(Binding, Binding)]) -> Result<(), ServerError> {
        self.copy_regions_batched(stream, regions)
    }

    fn launch(
        &mut self,
        stream: StreamId,
        kernel: &Kernel,
        grid: ResolvedGrid,
        buffers: &[Binding],
        scalars: &[Scalar],
    ) -> Result<(), ServerError> {
        self.check_lost()?;
        let Some(source) = kernel.cuda_source() else {
            return Err(ServerError::MissingKernelSource { kernel: kernel.name().to_string(), backend: BACKEND });
        };
        let grid = self.resolve_grid(stream, grid)?;
        if grid.contains(&0) {
            return Ok(());
        }
        let function = self.kernels.function(kernel, source).map_err(|reason| ServerError::KernelFailed {
            kernel: kernel.name().to_string(),
            device: self.device,
            reason,
        })?;
        let mut resolved = std::mem::take(&mut self.buffers);
        resolved.clear();
        for binding in buffers {
            resolved.push((self.pages.ptr(*binding)?, binding.size));
        }
        let raw = self.raw_stream(stream)?;
        stages::mark(Stage::LaunchFound);
        let code = self.kernels.launch(function, grid, kernel.block(), raw, &resolved, scalars);
        stages::mark(Stage::LaunchQueued);
        self.buffers = resolved;
        if code != sys::CUresult::CUDA_SUCCESS {
            let err = ServerError::KernelFailed {
                kernel: kernel.name().to_string(),
                device: self.device,
                reason: format!("cuLaunchKernel with grid {grid:?} and block {:?}: {}", kernel.block(), describe(code)),
            };
            return Err(self.classify(stream, err));
        }
        self.streams.note_kernel(stream, kernel.shared_name());
        Ok(())
    }

    fn flush(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        // CUDA hands work to the device as it is queued.
        self.check_lost()
    }

    fn sync(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.check_lost()?;
        self.stream_sync(stream)
    }

    fn order_streams(&mut self, waiter: StreamId, target: StreamId) -> Result<(), ServerError> {
        self.check_lost()?;
        if waiter == target || self.streams.is_capturing(target) {
            // Work captured on `target` has not run; nothing to wait for.
            return Ok(());
        }
        let target_raw = self.raw_stream(target)?;
        let result = if self.streams.is_capturing(waiter) {
            // A capture may not wait on an event recorded outside it: wait on
            // the host instead (the data is then ready for the capture).
            self.settle_collectives(target_raw);
            self.events.wait_host(target_raw)
        } else {
            let waiter_raw = self.raw_stream(waiter)?;
            self.events.order(waiter_raw, target_raw)
        };
        result.map_err(|err| self.classify(target, err))
    }

    /// A fence after the work queued so far on `stream` (a pooled event
    /// recorded there), or, where the stream is inside a capture, an
    /// already completed fence that records nothing (see
    /// `CudaBackend::in_capture`).
    fn fence(&mut self, stream: StreamId) -> Result<Box<dyn FenceWait>, ServerError> {
        self.check_lost()?;
        if self.in_capture(stream) {
            return Ok(Box::new(CompletedFence));
        }
        let raw = self.raw_stream(stream)?;
        match self.events.fence(raw) {
            Ok(fence) => Ok(Box::new(fence)),
            Err(err) => Err(self.classify(stream, err)),
        }
    }

    /// A pooled event recorded on `external` and waited on by `stream`
    /// (`cuEventRecord`, `cuStreamWaitEvent`; `cuStreamGetCtx` the first
    /// time a stream is seen), the event given back at once: the wait
    /// keeps the record it saw. Nothing where `stream` is bound to
    /// `external` (one stream is in order).
    fn wait_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.check_lost()?;
        self.refuse_external_in_capture(stream)?;
        let external = self.external_stream(external)?;
        if self.streams.bound_to(stream) == Some(external) {
            return Ok(());
        }
        let raw = self.raw_stream(stream)?;
        self.events.order(raw, external).map_err(|err| self.external_error(stream, err))
    }

    /// A pooled event recorded on `stream` and waited on by `external`, as
    /// in `wait_external`; where `stream` is bound to `external`, what
    /// `hand_over` does instead.
    fn signal_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.check_lost()?;
        self.refuse_external_in_capture(stream)?;
        let external = self.external_stream(external)?;
        if self.streams.bound_to(stream) == Some(external) {
            return self.hand_over_bound(stream);
        }
        let raw = self.raw_stream(stream)?;
        self.events.order(external, raw).map_err(|err| self.external_error(stream, err))
    }

    fn bind_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.bind_external_stream(stream, external)
    }

    fn unbind_external(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.unbind_external_stream(stream)
    }

    fn hand_over(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.hand_over_bound(stream)
    }

    fn timing_start(&mut self, stream: StreamId) -> Result<TimerStart, ServerError> {
        self.check_lost()?;
        let raw = self.raw_stream(stream)?;
        let timer = timing::start(&self.timing_events, self.device, raw)?;
        Ok(TimerStart::Device(Box::new(timer)))
    }

    fn timing_end(&mut self, stream: StreamId, start: TimerStart) -> Result<ProfileDuration, ServerError> {
        self.check_lost()?;
        let raw = self.raw_stream(stream)?;
        self.settle_collectives(raw);
        let timer = match start {
            TimerStart::Device(any) => {
                any.downcast::<timing::DeviceTimer>().map_err(|_| ServerError::InvalidState {
                    operation: "timing_end",
                    reason: "the timer was not started by the CUDA backend".into(),
                })?
            }
            TimerStart::Host(t) => {
                self.stream_sync(stream)?;
                return Ok(ProfileDuration { duration: t.elapsed(), method: crate::profile::TimingMethod::Host });
            }
        };
        let result = timing::end(&self.timing_events, self.device, raw, *timer);
        result.map_err(|err| self.classify(stream, err))
    }

    fn timestamp(&mut self, stream: StreamId) -> Result<TimerStart, ServerError> {
        self.timing_start(stream)
    }

    fn time_between(
        &mut self,
        from: &TimerStart,
        to: &TimerStart,
    ) -> Result<(f64, crate::profile::TimingMethod), ServerError> {
        self.check_lost()?;
        let (TimerStart::Device(from), TimerStart::Device(to)) = (from, to) else {
            return Err(ServerError::InvalidState {
                operation: "time_between",
                reason: "a host timestamp reached the CUDA backend".into(),
            });
        };
        let (Some(from), Some(to)) =
            (from.downcast_ref::<timing::DeviceTimer>(), to.downcast_ref::<timing::DeviceTimer>())
        else {
            return Err(ServerError::InvalidState {
                operation: "time_between",
                reason: "the timestamp was not taken by the CUDA backend".into(),
            });
        };
        // A collective that failed or expired is ended rather than waited
        // for forever.
        self.settle();
        let ms = timing::between(self.device, from, to)?;
        Ok((ms, crate::profile::TimingMethod::Device))
    }

    fn begin_native_capture(&mut self, stream: StreamId) -> Result<bool, ServerError> {
        self.check_lost()?;
        self.refuse_capture_of_bound(stream)?;
        // The stream's earlier work finishes first (this stream alone, not
        // the device): a fence asked of the stream during the capture is
        // complete at once (see `in_capture`), which is true only so.
        self.stream_sync(stream)?;
        let raw = self.raw_stream(stream)?;
        // Held before the capture begins: no free (this device's, or where
        // devices share the GPU another's) may land inside it.
        self.pages.hold_frees(true);
        if let Err(err) = graphs::begin(self.device, raw) {
            self.update_held_frees();
            return Err(err);
        }
        self.streams.entry(stream)?.capturing = true;
        Ok(true)
    }

    fn end_native_capture(&mut self, stream: StreamId) -> Result<Box<dyn Any>, ServerError> {
        let raw = self.raw_stream(stream)?;
        self.streams.entry(stream)?.capturing = false;
        // Frees held during the window wait until the capture has ended.
        let ended = self.check_lost().and_then(|()| graphs::end(self.device, raw, &self.graphs_alive));
        self.update_held_frees();
        Ok(Box::new(ended?))
    }

    fn replay_native(&mut self, stream: StreamId, graph: &mut dyn Any) -> Result<(), ServerError> {
        self.check_lost()?;
        let Some(exec) = graph.downcast_ref::<GraphExec>() else {
            return Err(ServerError::InvalidState {
                operation: "graph replay",
                reason: "the graph was not captured by the CUDA backend".into(),
            });
        };
        let raw = self.raw_stream(stream)?;
        let result = graphs::replay(self.device, exec, raw);
        result.map_err(|err| self.classify(stream, err))
    }

    fn staging_memory(&mut self, len: usize) -> Option<AlignedBytes> {
        if self.lost.is_some() || len == 0 {
            return None;
        }
        let block = self.staging.pool.take(len, true).ok().flatten()?;
        Some(AlignedBytes::from_host_memory(Box::new(block), len))
    }

    fn release_stream(&mut self, stream: StreamId) {
        if !self.streams.is_capturing(stream) {
            self.streams.release(stream);
        }
    }

    fn faults_are_deferred(&self) -> bool {
        // A kernel's illegal access surfaces at the next sync.
        true
    }

    fn settle(&mut self) {
        self.settle_all_collectives();
    }

    fn settle_collectives_on(&mut self, stream: StreamId) {
        self.settle_parts_on(stream);
    }

    fn runs_on_callers(&self) -> bool {
        true
    }

    fn launches_only_queue(&self) -> bool {
        true
    }

    fn kernel_ready(&self, kernel: &crate::kernel::Kernel) -> bool {
        // Without CUDA source the launch fails at once: nothing to compile.
        kernel.cuda_source().is_none_or(|source| self.kernels.has(kernel, source))
    }

    /// Makes the device's primary context current on the caller's thread
    /// (one `cuCtxGetCurrent` when it already is: a thread that calls again
    /// keeps it current from the last call). A thread that had another
    /// context current gets it back in `leave_caller`; one that had none
    /// keeps this one, so the next call finds it. `None` (queue instead)
    /// while a stream of the device is capturing, so a capture sees its
    /// work from the device thread alone, and once the context is lost.
    fn enter_caller(&mut self) -> Option<CallerEntry> {
        if self.lost.is_some() || self.streams.any_capturing() {
            return None;
        }
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context (null if none).
        if unsafe { sys::cuCtxGetCurrent(&mut current) } != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let entered = ENTERED_FOR.with(|e| e.get());
        if current == self.ctx && entered == self.serial {
            return Some(CallerEntry::default());
        }
        driver::set_current(self.device, self.ctx).ok()?;
        ENTERED_FOR.with(|e| e.set(self.serial));
        // A thread that had this same context current (set by its own
        // code, or by an earlier backend of the device) keeps it.
        let previous = if current == self.ctx { 0 } else { current as usize };
        Some(CallerEntry { previous })
    }

    fn leave_caller(&mut self, entry: CallerEntry) {
        if entry.previous != 0 {
            // SAFETY: the context that was current on this thread when the
            // task began, put back as it was (its owner keeps it alive: it
            // was current on this thread until a moment ago).
            let _ = unsafe { sys::cuCtxSetCurrent(entry.previous as sys::CUcontext) };
        }
    }

    fn device_collectives(&mut self) -> Option<&mut dyn DeviceCollectives> {
        Some(self)
    }

    fn address(&mut self, binding: Binding) -> Option<u64> {
        self.pages.ptr(binding).ok()
    }

    fn blas(&mut self) -> Option<&mut dyn crate::backend::DeviceBlas> {
        Some(self)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        PAGE_ALLOCATIONS.fetch_add(self.pages.allocations, Ordering::Relaxed);
        // Collectives still queued end (or are aborted) before their memory
        // goes.
        self.settle_all_collectives();
        if self.lost.is_none() {
            // SAFETY: the context is current on this thread. Waiting for
            // this device's work (its own streams) before freeing what that
            // work uses, never for the whole context's: other devices shown
            // on the GPU, and other libraries (a cudarc caller,
            // `CudaRuntime::client_for_context`), share the primary context,
            // and a context-wide sync would wait for their work too (a
            // collective of theirs that waits for other ranks, forever) and
            // end a capture of theirs.
            unsafe { self.streams.synchronize_all() };
        }
        self.graphs_alive.store(false, Ordering::Release);
        if self.lost.is_none() {
            self.nccl.close();
        }
        blas::release(&mut self.blas_handle);
        self.kernels.release_all();
        self.streams.release_all();
        self.events.close();
        self.timing_events.close();
        self.staging.close();
        self.pages.release_all();
        // The work that writes the end signals drained (or the context is
        // lost); waiters holding one keep reading the page.
        self.nccl.signals.close();
        // SAFETY: the primary context was retained in `new`; this lets go
        // of that retain only. It is never reset, not even after a sticky
        // fault: a reset would destroy the allocations and streams of every
        // other holder of the context (another library in the process),
        // and gives cohort nothing (CUDA does not give the GPU back to the
        // process after a sticky fault: `new` refuses it). The context,
        // lost for every holder, goes when the last one lets go.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.raw_device);
        }
    }
}
