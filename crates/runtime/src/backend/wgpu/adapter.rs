//! Adapter discovery, device creation and what a device reports about itself.
//!
//! Adapters are enumerated once per process (the first call to
//! `WgpuRuntime::device_count`, `client` or `adapters`), from every backend
//! wgpu supports on this OS, or only those named by `COHORT_WGPU_BACKEND`;
//! without that variable GL is used only where no Vulkan, Metal or DX12
//! adapter exists (see `discover`).
//! They are ordered real GPUs first (discrete, integrated, virtual, then
//! software), and within a kind Vulkan, Metal, DX12, GL.
//!
//! Devices: by default device `i` of the runtime is adapter `i` of that
//! order. With `COHORT_WGPU_DEVICES=N` (read once, with the adapters) the
//! runtime has `N` devices instead, every one a separate `wgpu::Device` and
//! queue requested from adapter 0: several logical devices on one adapter,
//! so multi-device paths run where there is one adapter only (lavapipe in
//! CI). Such devices share the adapter's memory and compute; they are
//! separate devices to wgpu (no shared buffers), like separate GPUs.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::config::{self, GraphicsApi};
use crate::error::ServerError;
use crate::id::DeviceId;
use crate::properties::{Capabilities, DeviceProperties};

use super::open_devices;

/// The backends tried when `COHORT_WGPU_BACKEND` is unset.
const DEFAULT_BACKENDS: wgpu::Backends =
    wgpu::Backends::VULKAN.union(wgpu::Backends::METAL).union(wgpu::Backends::DX12).union(wgpu::Backends::GL);

/// The timestamp features requested where the adapter has them.
const TIMESTAMP_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS)
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);

/// One adapter as the wgpu runtime sees it: what it is and what it allows.
#[derive(Debug, Clone)]
pub struct WgpuAdapterInfo {
    /// The adapter's index in adapter order (its device index too, unless
    /// `COHORT_WGPU_DEVICES` is set).
    pub index: usize,
    /// The runtime's devices opened on this adapter: `[index]` by default;
    /// with `COHORT_WGPU_DEVICES=N`, `0..N` on adapter 0 and none elsewhere.
    pub devices: Vec<usize>,
    /// The adapter's name as its driver reports it (e.g. "llvmpipe (LLVM 15.0.6, 256 bits)").
    pub name: String,
    /// The graphics API it is reached through.
    pub api: wgpu::Backend,
    /// Discrete, integrated, virtual GPU, or a CPU (software) driver.
    pub device_type: wgpu::DeviceType,
    /// Driver name and version, where the driver reports them.
    pub driver: String,
    /// The adapter's limits; the device is opened with all of them.
    pub limits: wgpu::Limits,
    /// Whether timestamp queries are available (device-side profiling).
    pub timestamp_query: bool,
    /// Largest range one kernel binding may span:
    /// min(max_storage_buffer_binding_size, max_buffer_size).
    pub max_binding_size: u64,
}

/// The process-wide wgpu instance and its adapters, in adapter order.
struct Discovery {
    /// Kept so adapters outlive nothing they depend on.
    _instance: wgpu::Instance,
    adapters: Vec<wgpu::Adapter>,
    /// `COHORT_WGPU_DEVICES`: that many devices, all on adapter 0; `None`:
    /// one device per adapter.
    shared: Option<usize>,
}

impl Discovery {
    /// How many devices the runtime has.
    fn device_count(&self) -> usize {
        self.shared.unwrap_or(self.adapters.len())
    }

    /// The adapter index device `device` is opened on (`None`: no such device).
    fn adapter_of(&self, device: usize) -> Option<usize> {
        (device < self.device_count()).then_some(if self.shared.is_some() { 0 } else { device })
    }

    /// The devices opened on adapter `adapter`.
    fn devices_on(&self, adapter: usize) -> Vec<usize> {
        match self.shared {
            Some(n) if adapter == 0 => (0..n).collect(),
            Some(_) => Vec::new(),
            None => vec![adapter],
        }
    }
}

/// Reads `COHORT_WGPU_DEVICES`: `None` when unset, else a positive number
/// of devices to open on adapter 0.
fn requested_devices() -> Result<Option<usize>, ServerError> {
    Ok(config::WGPU_DEVICES.get()?)
}

/// Reads `COHORT_WGPU_BACKEND` (a comma-separated list of vulkan, gl,
/// metal, dx12): the set it names, or `None` when it is unset.
fn requested_backends() -> Result<Option<wgpu::Backends>, ServerError> {
    let Some(apis) = config::WGPU_BACKEND.get()? else {
        return Ok(None);
    };
    Ok(Some(apis.into_iter().fold(wgpu::Backends::empty(), |set, api| {
        set | match api {
            GraphicsApi::Vulkan => wgpu::Backends::VULKAN,
            GraphicsApi::Gl => wgpu::Backends::GL,
            GraphicsApi::Metal => wgpu::Backends::METAL,
            GraphicsApi::Dx12 => wgpu::Backends::DX12,
        }
    })))
}

/// Human names of the backends in `set` that this build can use.
fn backend_names(set: wgpu::Backends) -> String {
    let enabled = wgpu::Instance::enabled_backend_features();
    let names: Vec<&str> = [
        (wgpu::Backends::VULKAN, "Vulkan"),
        (wgpu::Backends::METAL, "Metal"),
        (wgpu::Backends::DX12, "DX12"),
        (wgpu::Backends::GL, "GL"),
    ]
    .into_iter()
    .filter(|(b, _)| set.contains(*b) && enabled.contains(*b))
    .map(|(_, n)| n)
    .collect();
    if names.is_empty() {
        "none (this build of wgpu enables none of the requested backends)".into()
    } else {
        names.join(", ")
    }
}

fn order_key(adapter: &wgpu::Adapter) -> (u8, u8) {
    let info = adapter.get_info();
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    let api = match info.backend {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        wgpu::Backend::Gl => 3,
        _ => 4,
    };
    (kind, api)
}

/// The adapters of `backends` that can run compute shaders, in device order.
fn enumerate(backends: wgpu::Backends) -> (wgpu::Instance, Vec<wgpu::Adapter>) {
    let descriptor = wgpu::InstanceDescriptor {
        backends,
        flags: wgpu::InstanceFlags::from_build_config().with_env(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    };
    let instance = wgpu::Instance::new(descriptor);
    let mut adapters: Vec<wgpu::Adapter> = pollster::block_on(instance.enumerate_adapters(backends))
        .into_iter()
        // An adapter without compute shaders cannot run a kernel.
        .filter(|a| a.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS))
        .collect();
    adapters.sort_by_key(order_key);
    (instance, adapters)
}

/// Enumerates the adapters. Without `COHORT_WGPU_BACKEND`, GL is a fallback,
/// tried only when Vulkan, Metal and DX12 find nothing: a GPU reachable
/// through both would otherwise appear as two devices (and probing GL is
/// slow and noisy on headless machines).
fn discover() -> Result<Discovery, ServerError> {
    let requested = requested_backends()?;
    let shared = requested_devices()?;
    let explicit = requested.is_some();
    let backends = requested.unwrap_or(DEFAULT_BACKENDS);
    let (instance, adapters) = if explicit || !backends.contains(wgpu::Backends::GL) {
        enumerate(backends)
    } else {
        let (instance, adapters) = enumerate(backends - wgpu::Backends::GL);
        if adapters.is_empty() {
            enumerate(wgpu::Backends::GL)
        } else {
            (instance, adapters)
        }
    };
    if adapters.is_empty() {
        let hint = if cfg!(target_os = "linux") {
            "; on Linux the Debian/Ubuntu package `mesa-vulkan-drivers` provides a software Vulkan driver (lavapipe) that runs everywhere"
        } else {
            ""
        };
        return Err(ServerError::Backend {
            backend: "wgpu",
            device: DeviceId::new(DeviceId::WGPU, 0),
            message: format!(
                "no wgpu adapter with compute shaders was found (backends tried: {}; set COHORT_WGPU_BACKEND to choose){hint}",
                backend_names(backends)
            ),
        });
    }
    if let Some(n) = shared {
        tracing::debug!("COHORT_WGPU_DEVICES={n}: {n} devices on adapter 0 ({})", adapters[0].get_info().name);
    }
    Ok(Discovery { _instance: instance, adapters, shared })
}

fn discovery() -> Result<&'static Discovery, ServerError> {
    static DISCOVERY: OnceLock<Result<Discovery, ServerError>> = OnceLock::new();
    DISCOVERY.get_or_init(discover).as_ref().map_err(Clone::clone)
}

/// How many devices the runtime enumerates, 0 where it finds no adapter
/// (the index adopted devices are numbered from).
pub(crate) fn enumerated_devices() -> usize {
    discovery().map(Discovery::device_count).unwrap_or(0)
}

/// How many devices the runtime has: one per adapter, or
/// `COHORT_WGPU_DEVICES`.
pub(crate) fn device_count() -> Result<usize, ServerError> {
    Ok(discovery()?.device_count())
}

/// The adapter index device `device` is opened on.
pub(crate) fn adapter_of(device: usize) -> Result<usize, ServerError> {
    let discovery = discovery()?;
    discovery.adapter_of(device).ok_or_else(|| no_such_device(device, discovery))
}

fn no_such_device(device: usize, discovery: &Discovery) -> ServerError {
    let why = match discovery.shared {
        Some(n) => format!("COHORT_WGPU_DEVICES={n} opens {n} devices on adapter 0"),
        None => format!("there are {} adapters, one device each", discovery.adapters.len()),
    };
    ServerError::InvalidArgument(format!("wgpu device {device} does not exist: {why} (see WgpuRuntime::adapters)"))
}

fn max_binding_size(limits: &wgpu::Limits) -> u64 {
    limits.max_storage_buffer_binding_size.min(limits.max_buffer_size)
}

fn describe(index: usize, adapter: &wgpu::Adapter, devices: Vec<usize>) -> WgpuAdapterInfo {
    let info = adapter.get_info();
    let limits = adapter.limits();
    let driver = [info.driver.as_str(), info.driver_info.as_str()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    WgpuAdapterInfo {
        index,
        devices,
        name: info.name.clone(),
        api: info.backend,
        device_type: info.device_type,
        driver,
        max_binding_size: max_binding_size(&limits),
        timestamp_query: adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY),
        limits,
    }
}

/// Every adapter the runtime sees, in adapter order.
pub(crate) fn adapter_infos() -> Result<Vec<WgpuAdapterInfo>, ServerError> {
    let discovery = discovery()?;
    Ok(discovery.adapters.iter().enumerate().map(|(i, a)| describe(i, a, discovery.devices_on(i))).collect())
}

/// Errors wgpu reported outside any error scope to the handler cohort
/// installs on its own devices, and the reason such a device was lost, if
/// it was; shared with wgpu's callbacks, drained by `sync`.
#[derive(Default)]
pub(crate) struct ErrorSink {
    pub uncaptured: Mutex<Vec<String>>,
    pub lost: Mutex<Option<String>>,
}

/// One error scope of each kind (internal, out of memory, validation)
/// pushed on a device for the calling thread, popped together: how
/// [`Gpu::scoped`] catches a call's errors, and, kept open underneath
/// those on the device thread for the device's life ([`Gpu`]'s
/// `catch_all`), how every other error of cohort's own calls is caught
/// (every call of the backend runs on that thread, and scopes are per
/// thread): none reaches the device's uncaptured-error handler, which on
/// an adopted device is the caller's. Each scope keeps the first error of
/// its kind.
pub(crate) struct ErrorScopes {
    /// Pushed in this order, popped in reverse.
    scopes: Vec<wgpu::ErrorScopeGuard>,
}

impl ErrorScopes {
    const FILTERS: [wgpu::ErrorFilter; 3] =
        [wgpu::ErrorFilter::Internal, wgpu::ErrorFilter::OutOfMemory, wgpu::ErrorFilter::Validation];

    pub fn push(device: &wgpu::Device) -> Self {
        Self { scopes: Self::FILTERS.iter().map(|f| device.push_error_scope(*f)).collect() }
    }

    /// Pops the scopes: the errors they caught, validation first. Popping
    /// resolves at once on native wgpu.
    pub fn pop(self) -> Vec<wgpu::Error> {
        self.scopes.into_iter().rev().filter_map(|scope| pollster::block_on(scope.pop())).collect()
    }
}

/// An open wgpu device and what it allows.
pub(crate) struct Gpu {
    pub id: DeviceId,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    pub errors: Arc<ErrorSink>,
    /// Its entry in the open devices (`open_devices`).
    serial: u64,
    catch_all: Option<ErrorScopes>,
}

impl Gpu {
    /// Opens device `index` (a wgpu device of its own, on the adapter
    /// `Discovery::adapter_of` gives) with all of the adapter's limits (so
    /// bindings and buffers may be as large as the adapter allows) and its
    /// timestamp features. Installs an uncaptured-error handler that logs and
    /// keeps the error (wgpu's default handler panics) and a device-lost
    /// callback.
    pub fn open(index: usize) -> Result<(Gpu, DeviceProperties), ServerError> {
        let id = DeviceId::new(DeviceId::WGPU, index as u32);
        let discovery = discovery()?;
        let adapter_index = discovery.adapter_of(index).ok_or_else(|| no_such_device(index, discovery))?;
        let adapter = &discovery.adapters[adapter_index];
        let described = describe(adapter_index, adapter, discovery.devices_on(adapter_index));
        let descriptor = wgpu::DeviceDescriptor {
            label: Some("cohort"),
            required_features: adapter.features() & TIMESTAMP_FEATURES,
            required_limits: adapter.limits(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) =
            pollster::block_on(adapter.request_device(&descriptor)).map_err(|e| ServerError::Backend {
                backend: "wgpu",
                device: id,
                message: format!("could not open {} ({:?}): {e}", described.name, described.api),
            })?;
        let errors = Arc::new(ErrorSink::default());
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |error: wgpu::Error| {
            tracing::error!(device = %id, "wgpu error outside an error scope: {error}");
            let mut kept = sink.uncaptured.lock();
            if kept.len() < 16 {
                kept.push(error.to_string());
            }
        }));
        let sink = errors.clone();
        device.set_device_lost_callback(move |reason, message| {
            if reason != wgpu::DeviceLostReason::Destroyed {
                tracing::error!(device = %id, "wgpu device lost ({reason:?}): {message}");
            }
            *sink.lost.lock() = Some(format!("the device was lost ({reason:?}): {message}"));
        });
        let serial = open_devices::register(index, &device, &queue);
        // The adapter is named in the device's name: with
        // COHORT_WGPU_DEVICES several devices share one.
        let name =
            format!("{} ({:?}, {:?}, adapter {adapter_index})", described.name, described.api, described.device_type);
        Ok(Self::on(id, device, queue, errors, serial, name, described.device_type))
    }

    /// A device the caller made (`WgpuRuntime::adopt`), as device `index`,
    /// registered under `serial` by `open_devices::adoption`. Installs no
    /// handler: the caller's uncaptured-error handler and device-lost
    /// callback stay as they are (cohort's own calls are in its error
    /// scopes).
    pub fn adopt(
        index: usize,
        device: wgpu::Device,
        queue: wgpu::Queue,
        serial: u64,
    ) -> Result<(Gpu, DeviceProperties), ServerError> {
        let id = DeviceId::new(DeviceId::WGPU, index as u32);
        let info = device.adapter_info();
        let name = format!("{} ({:?}, {:?}, adopted)", info.name, info.backend, info.device_type);
        Ok(Self::on(id, device, queue, Arc::default(), serial, name, info.device_type))
    }

    #[allow(clippy::too_many_arguments)]
    fn on(
        id: DeviceId,
        device: wgpu::Device,
        queue: wgpu::Queue,
        errors: Arc<ErrorSink>,
        serial: u64,
        name: String,
        device_type: wgpu::DeviceType,
    ) -> (Gpu, DeviceProperties) {
        let limits = device.limits();
        let features = device.features();
        let compute_units = match device_type {
            wgpu::DeviceType::Cpu => std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
            // wgpu does not report a GPU's compute units.
            _ => 1,
        };
        let properties = DeviceProperties {
            device: id,
            backend: "wgpu",
            name,
            memory_bytes: None,
            compute_units,
            compute_capability: None,
            gpu: None,
            devices_on_gpu: 1,
            max_binding_size: max_binding_size(&limits),
            device_timing: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            native_graphs: false,
            capabilities: Capabilities::default(),
        };
        let catch_all = Some(ErrorScopes::push(&device));
        (Gpu { id, device, queue, limits, features, errors, serial, catch_all }, properties)
    }

    /// A driver error of this device.
    pub fn error(&self, message: impl Into<String>) -> ServerError {
        ServerError::Backend { backend: "wgpu", device: self.id, message: message.into() }
    }

    /// Runs `f` inside validation, out-of-memory and internal error scopes and
    /// returns its value with the first error the scopes caught. Popping a
    /// scope resolves at once on native wgpu.
    pub fn scoped<T>(&self, f: impl FnOnce() -> T) -> (T, Option<wgpu::Error>) {
        let scopes = ErrorScopes::push(&self.device);
        let value = f();
        (value, scopes.pop().into_iter().next())
    }

    /// The errors of cohort's calls that no narrower scope caught (see
    /// [`CatchAll`]) and those wgpu reported to cohort's own handler since
    /// the last call, and device loss, as one error. Runs on the device
    /// thread (its scopes are that thread's).
    pub fn take_background_errors(&mut self) -> Result<(), ServerError> {
        let caught = self.catch_all.take().map(ErrorScopes::pop).unwrap_or_default();
        self.catch_all = Some(ErrorScopes::push(&self.device));
        if let Some(lost) = self.errors.lost.lock().clone() {
            return Err(self.error(lost));
        }
        let mut errors: Vec<String> = caught.iter().map(ToString::to_string).collect();
        errors.append(&mut std::mem::take(&mut *self.errors.uncaptured.lock()));
        match errors.first() {
            None => Ok(()),
            Some(first) => {
                Err(self
                    .error(format!("queued work failed validation ({} error(s)); the first: {first}", errors.len())))
            }
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The scopes go first, in reverse order, then the entry: the device
        // is no longer cohort's.
        if let Some(scopes) = self.catch_all.take() {
            scopes.pop();
        }
        open_devices::unregister(self.serial);
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use crate::config;

    #[test]
    fn device_counts_parse() {
        assert_eq!(config::WGPU_DEVICES.parse_value(OsStr::new("4")), Ok(4));
        assert_eq!(config::WGPU_DEVICES.parse_value(OsStr::new(" 2 ")), Ok(2));
        for bad in ["0", "-1", "two", "1.5"] {
            let err = config::WGPU_DEVICES.parse_value(OsStr::new(bad)).unwrap_err().to_string();
            assert!(err.contains("COHORT_WGPU_DEVICES") && err.contains("at least 1"), "{bad}: {err}");
        }
    }
}
