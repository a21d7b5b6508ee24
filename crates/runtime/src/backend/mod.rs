//! The contract between the device-independent runtime and each backend.
//!
//! A backend owns one device's driver state (contexts, streams, compiled
//! kernels) and lives on that device's server thread, so it need not be `Send`.
//! The runtime resolves handles to [`Binding`]s (a page and a byte range) before
//! calling it, keeps the memory pools, marks failed buffers, and records graphs;
//! a backend only moves bytes and runs kernels.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub mod wgpu;

mod blas;
mod collectives;

use std::any::Any;
use std::time::Instant;

pub use blas::{DeviceBlas, Gemm};
pub use collectives::{
    CollectiveMonitor, CommSpec, Completion, DeviceCall, DeviceCollectives, EndSignal, PeerAlgo, PeerCall, PeerSpec,
    PeerToken, PendingPart, END_SIGNAL_REPOLL, PEER_ARENA_BYTES, PEER_MAX_BYTES, PEER_MAX_RANKS,
};

use crate::bytes::AlignedBytes;
use crate::error::ServerError;
use crate::id::StreamId;
use crate::kernel::{Kernel, Scalar};
use crate::memory::{PageId, PageStorage};
use crate::profile::{ProfileDuration, TimingMethod};
use crate::properties::DeviceProperties;

/// Where a handle's bytes live: `size` bytes at `offset` into `page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    pub page: PageId,
    pub offset: u64,
    pub size: u64,
}

/// A launch grid with its dynamic form resolved to the buffer holding it.
#[derive(Debug, Clone, Copy)]
pub enum ResolvedGrid {
    Static([u32; 3]),
    /// Three little-endian `u32`s in device memory, read when the launch runs.
    Dynamic(Binding),
}

/// A started device-side timer, closed by [`Backend::timing_end`].
pub enum TimerStart {
    /// Host clock, taken after the stream drained.
    Host(Instant),
    /// Backend-specific device events.
    Device(Box<dyn Any>),
}

/// Something a host thread can wait on for a stream's work queued so far.
pub trait FenceWait: Send {
    /// Blocks until the work the fence was raised after has finished.
    fn wait(self: Box<Self>) -> Result<(), ServerError>;

    /// Whether that work has finished, without waiting (a failed device
    /// counts as finished: nothing of it runs any more).
    fn is_complete(&self) -> bool;
}

/// A fence that is already complete (the work ran when it was queued).
pub struct CompletedFence;

impl FenceWait for CompletedFence {
    fn wait(self: Box<Self>) -> Result<(), ServerError> {
        Ok(())
    }

    fn is_complete(&self) -> bool {
        true
    }
}

/// Host memory a backend lends out (pinned memory, say), seen as bytes through
/// [`AlignedBytes::from_host_memory`]; dropping it hands it back.
pub trait HostMemory: Send + Sync {
    /// Start of the memory: 16-byte aligned, valid for `capacity()` bytes
    /// while `self` lives, and used by nothing else meanwhile.
    fn as_ptr(&self) -> *mut u8;
    /// Bytes available at [`HostMemory::as_ptr`].
    fn capacity(&self) -> usize;
}

/// What a backend changed on a caller's thread to run a task there
/// ([`Backend::enter_caller`]), undone by [`Backend::leave_caller`]: on
/// CUDA, the context that was current on the thread before.
#[derive(Debug, Default)]
pub struct CallerEntry {
    /// Read by the CUDA backend alone.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) previous: usize,
}

/// One device's driver state, driven from the device's server thread.
pub trait Backend: 'static {
    /// Name and capabilities of the device.
    fn properties(&self) -> &DeviceProperties;

    /// The storage the memory pools take pages from.
    fn storage(&mut self) -> &mut dyn PageStorage;

    /// Copies `data` into `dst`, ordered after the stream's earlier work.
    fn write(&mut self, stream: StreamId, dst: Binding, data: &[u8]) -> Result<(), ServerError>;

    /// Copies each binding to the host, after the stream's earlier work; waits
    /// for the copies.
    fn read(&mut self, stream: StreamId, sources: &[Binding]) -> Result<Vec<AlignedBytes>, ServerError>;

    /// Copies `src` into `dst` on the device (equal sizes).
    fn copy(&mut self, stream: StreamId, src: Binding, dst: Binding) -> Result<(), ServerError>;

    /// Copies each (source, destination) pair of `regions` (equal sizes, no
    /// destination overlapping another pair's bytes: checked by the
    /// caller) on the device, after the stream's earlier work; does not
    /// wait. The default copies pair by pair; CUDA runs one kernel.
    fn copy_regions(&mut self, stream: StreamId, regions: &[(Binding, Binding)]) -> Result<(), ServerError> {
        regions.iter().try_for_each(|&(src, dst)| self.copy(stream, src, dst))
    }

    /// Queues `kernel` on the stream. Errors known at launch time (no source,
    /// compile error, invalid arguments) are returned; faults found later are
    /// returned by the next `sync`.
    fn launch(
        &mut self,
        stream: StreamId,
        kernel: &Kernel,
        grid: ResolvedGrid,
        buffers: &[Binding],
        scalars: &[Scalar],
    ) -> Result<(), ServerError>;

    /// Hands queued work to the device without waiting for it.
    fn flush(&mut self, stream: StreamId) -> Result<(), ServerError>;

    /// Waits for everything queued on the stream.
    fn sync(&mut self, stream: StreamId) -> Result<(), ServerError>;

    /// Makes `waiter` wait for the work queued so far on `target` without
    /// blocking the host (an event on CUDA, a submission index on wgpu).
    fn order_streams(&mut self, waiter: StreamId, target: StreamId) -> Result<(), ServerError>;

    /// A fence after the stream's work queued so far.
    fn fence(&mut self, stream: StreamId) -> Result<Box<dyn FenceWait>, ServerError>;

    /// Starts a timer on the stream. The default drains the stream and reads
    /// the host clock.
    fn timing_start(&mut self, stream: StreamId) -> Result<TimerStart, ServerError> {
        self.sync(stream)?;
        Ok(TimerStart::Host(Instant::now()))
    }

    /// Stops a timer started by [`Backend::timing_start`].
    fn timing_end(&mut self, stream: StreamId, start: TimerStart) -> Result<ProfileDuration, ServerError> {
        self.sync(stream)?;
        match start {
            TimerStart::Host(t) => Ok(ProfileDuration { duration: t.elapsed(), method: TimingMethod::Host }),
            TimerStart::Device(_) => Err(ServerError::InvalidState {
                operation: "timing_end",
                reason: "a device timer reached a backend without device timing".into(),
            }),
        }
    }

    /// Records a timestamp on the stream after the work queued on it so far.
    /// The default drains the stream and reads the host clock; CUDA records
    /// a timing event and returns at once.
    fn timestamp(&mut self, stream: StreamId) -> Result<TimerStart, ServerError> {
        self.sync(stream)?;
        Ok(TimerStart::Host(Instant::now()))
    }

    /// Milliseconds from `from` to `to` (both from [`Backend::timestamp`] on
    /// this device, any streams; negative where `to` came first), and how
    /// they were taken. Waits until both were reached.
    fn time_between(&mut self, from: &TimerStart, to: &TimerStart) -> Result<(f64, TimingMethod), ServerError> {
        match (from, to) {
            (TimerStart::Host(a), TimerStart::Host(b)) => {
                let ms = if b >= a {
                    b.duration_since(*a).as_secs_f64() * 1e3
                } else {
                    -(a.duration_since(*b).as_secs_f64() * 1e3)
                };
                Ok((ms, TimingMethod::Host))
            }
            _ => Err(ServerError::InvalidState {
                operation: "time_between",
                reason: "a device timestamp reached a backend without device timing".into(),
            }),
        }
    }

    /// Starts a native graph capture on the stream. Returns `false` when the
    /// backend has none: the runtime then records launches itself and replays
    /// them one by one.
    fn begin_native_capture(&mut self, _stream: StreamId) -> Result<bool, ServerError> {
        Ok(false)
    }

    /// Ends a native capture and returns the executable graph.
    fn end_native_capture(&mut self, stream: StreamId) -> Result<Box<dyn Any>, ServerError> {
        let _ = stream;
        Err(ServerError::Unsupported { feature: "native graph capture", backend: self.properties().backend })
    }

    /// Replays a graph from [`Backend::end_native_capture`] on the stream.
    fn replay_native(&mut self, stream: StreamId, graph: &mut dyn Any) -> Result<(), ServerError> {
        let _ = (stream, graph);
        Err(ServerError::Unsupported { feature: "native graph replay", backend: self.properties().backend })
    }

    /// Host-addressable bytes of a binding, for backends whose device memory is
    /// host memory (the CPU backend): lets host-staged collectives read and
    /// write device memory without a copy. `None` elsewhere.
    fn host_bytes(&mut self, _binding: Binding) -> Option<&mut [u8]> {
        None
    }

    /// The address of a binding's first byte where the memory has one a
    /// caller can use outside cohort (a host pointer on the CPU backend, a
    /// `CUdeviceptr` on CUDA: for DLPack export); `None` elsewhere (wgpu).
    fn address(&mut self, _binding: Binding) -> Option<u64> {
        None
    }

    /// `len` bytes of host memory that uploads read without an extra host copy
    /// (pinned memory), contents unspecified; `None` where the backend has
    /// none, which is the default. Used by `Client::staging`.
    fn staging_memory(&mut self, _len: usize) -> Option<AlignedBytes> {
        None
    }

    /// Whether a launch can fail after it was queued (a device fault found at
    /// the next sync, as on CUDA): the runtime then remembers each stream's
    /// unsynced outputs to mark them. Backends that run or validate launches
    /// when they are queued return `false` and skip that bookkeeping.
    fn faults_are_deferred(&self) -> bool {
        false
    }

    /// Waits until no device collective is running, ending (aborting) the
    /// ones that failed or expired meanwhile; before memory is freed, which
    /// can wait for the whole device. A no-op where collectives complete
    /// when they are queued, which is the default.
    fn settle(&mut self) {}

    /// Waits until the device collectives queued on `stream` ended (or
    /// were aborted), not the stream's other work: before a read on another
    /// stream returns bytes they wrote, which their end may yet mark failed
    /// (a check that completes after the calls). A no-op by default.
    fn settle_collectives_on(&mut self, _stream: StreamId) {}

    /// Releases what the backend keeps for a stream that has no more work.
    fn release_stream(&mut self, _stream: StreamId) {}

    /// Whether a caller's thread may run this device's tasks itself, under
    /// the device state's lock, while the device thread is idle (see
    /// `DeviceHandle::run_inline`): true where nothing of the backend is
    /// bound to its thread (the CPU backend: host memory; CUDA: driver
    /// handles usable from any thread with the context current, see
    /// [`Backend::enter_caller`]). Asked once, when the device opens.
    fn runs_on_callers(&self) -> bool {
        false
    }

    /// Whether a kernel launch only queues work for the device, which runs
    /// it later (CUDA): then a caller's thread may issue it itself on an
    /// idle device (see [`Backend::runs_on_callers`]) and still return at
    /// once. `false`, the default, where a launch runs the kernel (the CPU
    /// backend): run on the caller's thread it would hold the caller for
    /// the kernel's whole run, and kernels of several devices launched by
    /// one thread would no longer run at once. Asked once.
    fn launches_only_queue(&self) -> bool {
        false
    }

    /// Whether `kernel` is ready to launch without compiling it first (a
    /// launch on a caller's thread must not hold it, and the device, for a
    /// compile: the first launch of a kernel stays on the device thread, so
    /// one thread launching on several devices compiles on all at once).
    fn kernel_ready(&self, kernel: &crate::kernel::Kernel) -> bool {
        let _ = kernel;
        true
    }

    /// Makes the calling thread (a caller's, not the device thread) ready
    /// to run one task of this device: `None` when no task may run there
    /// now, and it is queued instead (a CUDA stream capturing). Every
    /// `Some` is handed back to [`Backend::leave_caller`] on the same
    /// thread before the state's lock is let go.
    fn enter_caller(&mut self) -> Option<CallerEntry> {
        Some(CallerEntry::default())
    }

    /// Undoes [`Backend::enter_caller`] on the caller's thread.
    fn leave_caller(&mut self, entry: CallerEntry) {
        let _ = entry;
    }

    /// Device-to-device collectives and peer access (NCCL and peer copies on
    /// CUDA); `None`, the default, where the backend has none and the
    /// communication layer stages through the host.
    fn device_collectives(&mut self) -> Option<&mut dyn DeviceCollectives> {
        None
    }

    /// Makes `stream` wait on the device for the work queued so far on
    /// `external` (a stream another library owns), without blocking the
    /// host: on CUDA an event recorded on `external` and waited on by
    /// `stream`. Refused where the backend has no such stream.
    fn wait_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        let _ = (stream, external);
        Err(ServerError::Unsupported {
            feature: "ordering with an external stream",
            backend: self.properties().backend,
        })
    }

    /// Makes `external` wait on the device for the work queued so far on
    /// `stream`: work the other library queues on `external` after this
    /// returns starts after it. On CUDA an event recorded on `stream` and
    /// waited on by `external`; on an adopted wgpu queue, a submission of
    /// the pending work. Refused where the backend has no such stream.
    fn signal_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        let _ = (stream, external);
        Err(ServerError::Unsupported {
            feature: "ordering with an external stream",
            backend: self.properties().backend,
        })
    }

    /// Runs `stream`'s later work on `external` itself (see
    /// `Client::bind_external`): on CUDA the stream is bound to the
    /// caller's `CUstream`, which first waits (an event) for what the
    /// stream queued before; binding to the stream it is bound to does
    /// nothing. The default, for a backend whose streams all run in one
    /// queue in order (wgpu), orders as [`Backend::wait_external`] does
    /// (so refuses what it refuses: the CPU's lack of external streams).
    fn bind_external(&mut self, stream: StreamId, external: &crate::ExternalStream) -> Result<(), ServerError> {
        self.wait_external(stream, external)
    }

    /// Undoes [`Backend::bind_external`]: `stream`'s later work goes to its
    /// own stream again, after what was queued on the external one. Does
    /// nothing where `stream` is not bound, which is the default.
    fn unbind_external(&mut self, stream: StreamId) -> Result<(), ServerError> {
        let _ = stream;
        Ok(())
    }

    /// Called once the work queued so far on `stream` was handed to the
    /// backend, before the caller queues more on a stream `stream` is
    /// bound to: on CUDA it records the end event of a collective part
    /// left last on a bound stream. Nothing by default.
    fn hand_over(&mut self, stream: StreamId) -> Result<(), ServerError> {
        let _ = stream;
        Ok(())
    }

    /// Matrix products through the backend's vendor BLAS (cuBLAS on CUDA);
    /// `None`, the default, where it has none (kernels do the work there).
    fn blas(&mut self) -> Option<&mut dyn DeviceBlas> {
        None
    }
}
