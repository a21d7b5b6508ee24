//! The wgpu backend: Vulkan, Metal, DX12 and GL devices, and lavapipe (a
//! software Vulkan driver) where there is no GPU.
//!
//! - `adapter`: adapters, device creation and adoption, properties, error
//!   scopes.
//! - `open_devices`: the open devices' wgpu devices and queues, adoptions.
//! - `storage`: memory pool pages as wgpu buffers.
//! - `queue`: the shared encoder, submissions, submission-index fences.
//! - `pipeline`: WGSL compiled once into cached compute pipelines.
//! - `launch`: bindings, scalars and dispatches of one launch.
//! - `transfer`: chunked writes, staged reads, device copies.
//! - `timing`: timestamp queries.
//!
//! Graphs: wgpu has no native graph, so `begin_native_capture` keeps its
//! default (`false`); the runtime records the launches of a capture window and
//! a replay re-encodes that dispatch list, each launch reusing its cached
//! pipeline and scalar buffer.
//!
//! Nothing here panics on a wgpu error: validation and out-of-memory errors
//! are caught in error scopes and returned (a launch's become errors on its
//! outputs), and errors outside those narrow scopes are caught by scopes
//! the device thread keeps open underneath them (every call of the backend
//! runs on that thread, and wgpu's scopes are per thread) and returned by
//! the next `sync`. They never reach the device's uncaptured-error handler:
//! on cohort's own devices a handler that keeps errors for `sync` (for
//! errors of other threads; wgpu's default panics), on an adopted device
//! (`WgpuRuntime::adopt`) the caller's, which cohort leaves in place.

mod adapter;
mod launch;
mod open_devices;
mod pipeline;
mod queue;
mod storage;
mod timing;
mod transfer;

pub use adapter::WgpuAdapterInfo;

use crate::backend::{Backend, Binding, FenceWait, ResolvedGrid, TimerStart};
use crate::bytes::AlignedBytes;
use crate::client::Client;
use crate::device::BackendFactory;
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};
use crate::kernel::{Kernel, Scalar};
use crate::memory::PageStorage;
use crate::profile::ProfileDuration;
use crate::properties::DeviceProperties;
use crate::runtime::Runtime;

use adapter::Gpu;
use launch::{Launcher, ScalarCache};
use pipeline::PipelineCache;
use queue::{wait_for, SubmissionFence, Submitter};
use storage::WgpuPages;
use timing::{DeviceTimer, TimestampMode};
use transfer::{StagingPool, Transfer};

/// The wgpu runtime: one device per adapter of the backends wgpu supports on
/// this OS (Vulkan and GL on Linux, Metal on macOS, DX12, Vulkan and GL on
/// Windows), real GPUs first; or, with `COHORT_WGPU_DEVICES=N`, `N` devices
/// (each its own `wgpu::Device` and queue) all on the first adapter, so
/// multi-device code runs where there is one adapter (lavapipe in CI). GL
/// adapters are a fallback, used only where no other backend finds one (a
/// GPU would otherwise appear twice).
/// `COHORT_WGPU_BACKEND` (`vulkan`, `gl`, `metal`, `dx12`, or a
/// comma-separated list) names the backends to use instead; it is read once,
/// when the adapters are first enumerated, as is `COHORT_WGPU_DEVICES`.
/// A device's [`DeviceProperties::name`] ends with the adapter it is on
/// (`"..., adapter 0)"`); [`WgpuRuntime::adapter_of`] gives its index.
#[derive(Debug, Clone, Copy)]
pub struct WgpuRuntime;

impl WgpuRuntime {
    /// Every adapter the runtime sees, in adapter order: name, graphics API,
    /// kind, driver, limits, timestamp support and the devices opened on it.
    /// Enumerates the adapters on first use (this can take a while with some
    /// drivers). There are as many adapters as devices unless
    /// `COHORT_WGPU_DEVICES` is set.
    pub fn adapters() -> Result<Vec<WgpuAdapterInfo>, ServerError> {
        adapter::adapter_infos()
    }

    /// The index (in [`WgpuRuntime::adapters`]) of the adapter device
    /// `device` is opened on: `device` itself by default, 0 with
    /// `COHORT_WGPU_DEVICES`. An error when there is no such device (an
    /// adopted device is on no adapter of the runtime's).
    pub fn adapter_of(device: usize) -> Result<usize, ServerError> {
        adapter::adapter_of(device)
    }

    /// A client on a `wgpu::Device` and its `Queue` that the caller made
    /// (another framework's, burn's say), instead of one the runtime
    /// opens: cohort's buffers, kernels and collectives then run on that
    /// device, and the caller's own `wgpu::Buffer`s of it can be adopted
    /// as foreign memory. Returns once the device's server thread runs.
    ///
    /// The device gets the index after every enumerated device and every
    /// earlier adoption ([`Runtime::device_count`] and
    /// [`crate::clients_of`] still count only the enumerated ones);
    /// [`Runtime::client`] with that index gives the same client while it
    /// is open. Adopting a device already open in cohort (adopted earlier,
    /// or cohort's own from [`WgpuRuntime::device_and_queue`]) returns that
    /// device's client (a queue wgpu can tell is not that device's is refused:
    /// pass the queue `request_device` returned with the device).
    /// Properties come from the device's limits, features and adapter info.
    ///
    /// Errors: the caller's uncaptured-error handler and device-lost
    /// callback are left as they are (none is installed). Every wgpu call
    /// cohort makes runs on the device's server thread inside error scopes
    /// of that thread, so cohort's errors come back from cohort's calls
    /// (on the buffers a launch writes, or from the next `sync`) and never
    /// reach the caller's handler; the caller's own errors, made on its
    /// threads, reach its handler (or wgpu's default, which panics, where
    /// it set none) and never cohort's calls. A lost device shows as errors
    /// of cohort's later calls; cohort has no callback to hear of it sooner.
    ///
    /// Work order: the device has one queue, which runs submissions in
    /// order; call [`crate::Client::signal_external`] with
    /// [`crate::ExternalStream::WgpuQueue`] before the caller submits work
    /// that must see cohort's results. Closing the client
    /// ([`crate::Client::close`]) lets go of cohort's clones of the device
    /// and queue; the caller's keep working.
    pub fn adopt(device: wgpu::Device, queue: wgpu::Queue) -> Result<Client, ServerError> {
        let adoption = open_devices::adoption(&device, &queue)?;
        let (index, serial) = (adoption.index, adoption.serial);
        let loaded = Client::load(DeviceId::new(DeviceId::WGPU, index as u32), || -> BackendFactory {
            Box::new(move || Ok(Box::new(WgpuBackend::adopt(index, device, queue, serial)?) as Box<dyn Backend>))
        });
        if loaded.is_err() && adoption.new {
            open_devices::unregister(serial);
        }
        loaded
    }

    /// The `wgpu::Device` and `Queue` a wgpu client runs on (clones: the
    /// same device and queue), so the caller can make buffers on cohort's
    /// own device (to adopt as foreign memory) or submit work on its
    /// queue. Costs a lock; waits for nothing. An error for a client of
    /// another backend or of a closed device.
    pub fn device_and_queue(client: &Client) -> Result<(wgpu::Device, wgpu::Queue), ServerError> {
        let id = client.device_id();
        if id.type_id != DeviceId::WGPU {
            return Err(ServerError::InvalidArgument(format!(
                "WgpuRuntime::device_and_queue takes a wgpu client; this one is of {id}"
            )));
        }
        if client.device().is_closed() {
            return Err(ServerError::DeviceClosed { device: id });
        }
        open_devices::device_and_queue(id.index as usize).ok_or(ServerError::DeviceClosed { device: id })
    }
}

impl Runtime for WgpuRuntime {
    const NAME: &'static str = "wgpu";

    fn device_count() -> Result<usize, ServerError> {
        adapter::device_count()
    }

    /// The client of enumerated device `index`, or of an adopted device
    /// still open ([`WgpuRuntime::adopt`]).
    fn client(index: usize) -> Result<Client, ServerError> {
        let device = DeviceId::new(DeviceId::WGPU, index as u32);
        if let Some((gpu, queue, serial)) = open_devices::adopted(index) {
            return Client::load(device, || -> BackendFactory {
                Box::new(move || Ok(Box::new(WgpuBackend::adopt(index, gpu, queue, serial)?) as Box<dyn Backend>))
            });
        }
        adapter::adapter_of(index)?;
        Client::load(device, || -> BackendFactory {
            Box::new(move || Ok(Box::new(WgpuBackend::open(index)?) as Box<dyn Backend>))
        })
    }
}

/// One wgpu device's state, living on its server thread.
pub struct WgpuBackend {
    properties: DeviceProperties,
    gpu: Gpu,
    pages: WgpuPages,
    submitter: Submitter,
    pipelines: PipelineCache,
    scalars: ScalarCache,
    staging: StagingPool,
    timestamps: TimestampMode,
}

impl WgpuBackend {
    /// Opens device `index`: adapter `index` (in [`WgpuRuntime::adapters`]
    /// order), or adapter 0 with `COHORT_WGPU_DEVICES`.
    pub fn open(index: usize) -> Result<Self, ServerError> {
        let (gpu, properties) = Gpu::open(index)?;
        Ok(Self::on(gpu, properties))
    }

    /// Runs on a device the caller made, as device `index` (see
    /// [`WgpuRuntime::adopt`]).
    fn adopt(index: usize, device: wgpu::Device, queue: wgpu::Queue, serial: u64) -> Result<Self, ServerError> {
        let (gpu, properties) = Gpu::adopt(index, device, queue, serial)?;
        Ok(Self::on(gpu, properties))
    }

    fn on(gpu: Gpu, properties: DeviceProperties) -> Self {
        tracing::debug!(device = %gpu.id, "opened {}", properties.name);
        Self {
            properties,
            pages: WgpuPages::new(&gpu),
            submitter: Submitter::new(),
            pipelines: PipelineCache::default(),
            scalars: ScalarCache::default(),
            staging: StagingPool::default(),
            timestamps: TimestampMode::of(gpu.features),
            gpu,
        }
    }

    fn transfer(&mut self) -> Transfer<'_> {
        Transfer { gpu: &self.gpu, pages: &self.pages, submitter: &mut self.submitter, staging: &mut self.staging }
    }

    /// Refuses an external stream that is not a wgpu queue.
    fn queue_of(&self, external: &crate::ExternalStream) -> Result<(), ServerError> {
        match external {
            crate::ExternalStream::WgpuQueue => Ok(()),
            #[allow(unreachable_patterns)]
            other => Err(ServerError::InvalidArgument(format!(
                "{other:?} is not a stream of wgpu device {}: a wgpu client orders only with its device's queue (ExternalStream::WgpuQueue)",
                self.gpu.id
            ))),
        }
    }

    /// The errors found after their work was queued: a batch that failed
    /// validation, wgpu errors outside scopes, device loss.
    fn background_errors(&mut self) -> Result<(), ServerError> {
        self.submitter.take_deferred()?;
        self.gpu.take_background_errors()
    }
}

impl Backend for WgpuBackend {
    fn properties(&self) -> &DeviceProperties {
        &self.properties
    }

    fn storage(&mut self) -> &mut dyn PageStorage {
        &mut self.pages
    }

    fn write(&mut self, _stream: StreamId, dst: Binding, data: &[u8]) -> Result<(), ServerError> {
        self.transfer().write(dst, data)
    }

    fn read(&mut self, _stream: StreamId, sources: &[Binding]) -> Result<Vec<AlignedBytes>, ServerError> {
        self.transfer().read(sources)
    }

    fn copy(&mut self, _stream: StreamId, src: Binding, dst: Binding) -> Result<(), ServerError> {
        self.transfer().copy(src, dst)
    }

    fn launch(
        &mut self,
        _stream: StreamId,
        kernel: &Kernel,
        grid: ResolvedGrid,
        buffers: &[Binding],
        scalars: &[Scalar],
    ) -> Result<(), ServerError> {
        Launcher {
            gpu: &self.gpu,
            pages: &self.pages,
            pipelines: &mut self.pipelines,
            scalars: &mut self.scalars,
            submitter: &mut self.submitter,
        }
        .launch(kernel, grid, buffers, scalars)
    }

    fn flush(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        self.submitter.flush(&self.gpu);
        self.background_errors()
    }

    /// Waits for all work queued on the device so far: with one queue, the
    /// stream's work cannot finish before the work queued ahead of it.
    fn sync(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        if let Some(index) = self.submitter.flush(&self.gpu) {
            wait_for(&self.gpu.device, index).map_err(|m| self.gpu.error(m))?;
        }
        self.background_errors()
    }

    /// A no-op: every stream records into the device's one encoder, in the
    /// order the device thread runs their tasks, and the one queue runs
    /// submissions in order; so the target's work queued so far (recorded, or
    /// submitted under an earlier submission index) runs before anything the
    /// waiter queues next. The fence is the submission index order itself.
    fn order_streams(&mut self, _waiter: StreamId, _target: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    /// The device's queue (the caller's, on an adopted device) runs
    /// submissions in order, so the caller's work submitted before this
    /// call already precedes everything cohort submits later: nothing to
    /// do. A CUDA stream is refused.
    fn wait_external(&mut self, _stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.queue_of(external)
    }

    /// Submits cohort's pending work (recorded commands and buffer writes)
    /// so it precedes the caller's next submission on the queue; waits for
    /// nothing on the device.
    fn signal_external(&mut self, _stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.queue_of(external)?;
        self.submitter.flush(&self.gpu);
        Ok(())
    }

    /// Submits the pending work and returns its submission index, which any
    /// thread can wait on with `device.poll`.
    fn fence(&mut self, _stream: StreamId) -> Result<Box<dyn FenceWait>, ServerError> {
        let index = self.submitter.flush(&self.gpu);
        Ok(Box::new(SubmissionFence { device: self.gpu.device.clone(), index, id: self.gpu.id }))
    }

    fn timing_start(&mut self, stream: StreamId) -> Result<TimerStart, ServerError> {
        if self.timestamps == TimestampMode::None {
            self.sync(stream)?;
            return Ok(TimerStart::Host(std::time::Instant::now()));
        }
        let timer = timing::start(&self.gpu, &mut self.submitter, self.timestamps)?;
        Ok(TimerStart::Device(Box::new(timer)))
    }

    fn timing_end(&mut self, stream: StreamId, start: TimerStart) -> Result<ProfileDuration, ServerError> {
        match start {
            TimerStart::Host(t) => {
                self.sync(stream)?;
                Ok(ProfileDuration { duration: t.elapsed(), method: crate::profile::TimingMethod::Host })
            }
            TimerStart::Device(timer) => {
                let timer = timer.downcast::<DeviceTimer>().map_err(|_| ServerError::InvalidState {
                    operation: "timing_end",
                    reason: "the timer was started by another backend".into(),
                })?;
                let duration = timing::end(&self.gpu, &mut self.submitter, self.timestamps, *timer)?;
                self.background_errors()?;
                Ok(duration)
            }
        }
    }
}
