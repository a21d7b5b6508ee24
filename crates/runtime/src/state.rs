//! What a device's server thread owns: the backend, each stream's memory pools,
//! capture state, and the bookkeeping that turns failures into marked buffers.

use crate::id::IdMap;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use crate::backend::{Backend, Binding, PendingPart, ResolvedGrid, TimerStart};
use crate::error::ServerError;
use crate::foreign::ForeignPages;
use crate::handle::{Allocation, Handle};
use crate::id::{ServiceId, StreamId};
use crate::kernel::{GridCount, Kernel, LaunchBuffers, LaunchScalars};
use crate::memory::{
    AllocationMode, Cleanup, MemoryPools, MemoryPoolsConfig, MemoryUsage, PageId, PageStorage, PoolReport,
};
use crate::stages::{self, Stage};

/// A launch recorded inside a capture window, replayed by `Graph::replay`.
#[derive(Clone)]
pub(crate) struct RecordedLaunch {
    pub kernel: Kernel,
    pub grid: GridCount,
    pub buffers: LaunchBuffers,
    pub scalars: LaunchScalars,
}

/// The capture window of one stream.
pub(crate) struct Capture {
    pub native: bool,
    pub launches: Vec<RecordedLaunch>,
    /// The first thing that went wrong inside the window; `stop_capture`
    /// returns it.
    pub failure: Option<ServerError>,
}

pub(crate) struct StreamState {
    pub pools: MemoryPools,
    pub mode: AllocationMode,
    /// Set by `graph_prepare`: allocations go to the persistent pool.
    pub prepared: bool,
    pub capture: Option<Capture>,
    /// Allocations written by launches queued since the stream last drained:
    /// a device fault found later (at a sync or read) is marked on them.
    pub unsynced: Vec<Weak<Allocation>>,
}

/// A device collective queued by a task that returned before it completed.
struct PendingCollective {
    part: PendingPart,
    /// The task's stream: work queued there after it may have read its
    /// outputs.
    stream: StreamId,
    /// The task's outputs, marked if the collective fails.
    outputs: Vec<Weak<Allocation>>,
}

/// How many unsynced outputs a stream remembers; past it the oldest half is
/// forgotten (a stream that never syncs would otherwise grow without bound).
const MAX_UNSYNCED: usize = 4096;

/// Counters a test or a report can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Cross-stream waits queued with a fence (never a device-wide sync).
    pub stream_fences: u64,
    /// Explicit synchronisations of a stream.
    pub stream_syncs: u64,
    /// Launches run (replays included).
    pub launches: u64,
    /// Tasks a caller's thread ran itself because the device was idle
    /// (buffer tasks of [`crate::Client::submit_buffers_inline`], kernel
    /// launches and reads; on the CPU and CUDA backends).
    pub inline_tasks: u64,
    /// Inline tasks whose caller found the device busy with nothing queued
    /// and waited for it rather than hand the task over.
    pub inline_after_waiting: u64,
}

/// Memory of one stream in a [`crate::MemoryReport`].
#[derive(Debug, Clone)]
pub struct StreamMemory {
    pub stream: StreamId,
    pub usage: MemoryUsage,
    pub pools: Vec<PoolReport>,
}

/// A storage that refuses new pages: used inside capture windows, where a
/// fresh allocation would not be part of the recorded graph.
struct NoNewPages<'a> {
    inner: &'a mut dyn PageStorage,
}

impl PageStorage for NoNewPages<'_> {
    fn alloc_page(&mut self, size: u64) -> Result<PageId, ServerError> {
        Err(ServerError::InvalidState {
            operation: "allocation",
            reason: format!(
                "a new page of {size} bytes was needed inside a capture window; call graph_prepare and run the work once before start_capture so its memory is reserved"
            ),
        })
    }

    fn free_page(&mut self, page: PageId) {
        self.inner.free_page(page)
    }

    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }
}

pub(crate) struct DeviceState {
    /// Adopted memory released by its handles, and owners waiting for
    /// their fences. First, so a state dropped without `release_all` (a
    /// panic) lets its owners go before the backend goes.
    pub foreign: ForeignPages,
    pub service: ServiceId,
    pub backend: Box<dyn Backend>,
    pub streams: IdMap<StreamId, StreamState>,
    pub pool_config: MemoryPoolsConfig,
    /// Errors of fire-and-forget tasks, returned by the stream's next `sync`,
    /// `flush` or `check`.
    pub pending_errors: IdMap<StreamId, ServerError>,
    pub stats: DeviceStats,
    pub profiles: HashMap<u64, TimerStart>,
    /// Timestamps from `Client::timestamp`, by token (or why one was not taken).
    pub timestamps: HashMap<u64, Result<TimerStart, ServerError>>,
    pub next_profile: u64,
    pub graphs: HashMap<u64, Box<dyn Any>>,
    pub next_graph: u64,
    /// Reused by every launch and buffer task for its resolved bindings.
    pub(crate) scratch_bindings: Vec<Binding>,
    /// Device collectives queued and still running
    /// ([`crate::BufferAccess::run_collective`]), with the outputs their
    /// failure marks.
    pending_collectives: VecDeque<PendingCollective>,
}

impl DeviceState {
    pub fn new(service: ServiceId, backend: Box<dyn Backend>) -> Self {
        Self {
            foreign: ForeignPages::default(),
            service,
            backend,
            streams: IdMap::default(),
            pool_config: MemoryPoolsConfig::default(),
            pending_errors: IdMap::default(),
            stats: DeviceStats::default(),
            profiles: HashMap::new(),
            timestamps: HashMap::new(),
            next_profile: 0,
            graphs: HashMap::new(),
            next_graph: 0,
            scratch_bindings: Vec::new(),
            pending_collectives: VecDeque::new(),
        }
    }

    /// Remembers `outputs` of a device collective still running on
    /// `stream`, to mark them if it fails.
    pub fn note_pending_collective<'h>(
        &mut self,
        part: PendingPart,
        stream: StreamId,
        outputs: impl IntoIterator<Item = &'h Handle>,
    ) {
        let outputs = outputs.into_iter().map(|h| Arc::downgrade(&h.alloc)).collect();
        self.pending_collectives.push_back(PendingCollective { part, stream, outputs });
    }

    /// Whether device collectives are still running, or ended unreported,
    /// or released foreign memory waits to be retired (the device thread
    /// then polls them while idle).
    pub fn has_pending_collectives(&mut self) -> bool {
        self.foreign.pending()
            || !self.pending_collectives.is_empty()
            || self.backend.device_collectives().is_some_and(|collectives| collectives.has_pending())
    }

    pub fn pending_collectives_count(&self) -> usize {
        self.pending_collectives.len()
    }

    /// Asks the backend which running collectives ended, without waiting.
    /// A failed one marks its outputs, and the outputs of the launches
    /// queued on its stream since that stream last drained (they may have
    /// read its results), as a kernel fault does.
    ///
    /// Also retires released foreign memory (see [`DeviceState::poll_foreign`]).
    pub fn poll_collectives(&mut self) {
        self.poll_foreign();
        let Some(collectives) = self.backend.device_collectives() else { return };
        if self.pending_collectives.is_empty() && !collectives.has_pending() {
            return;
        }
        for (part, outcome) in collectives.poll() {
            // Parts mostly end in the order they were queued: found at once.
            let Some(at) = self.pending_collectives.iter().position(|p| p.part == part) else { continue };
            let pending = self.pending_collectives.remove(at).expect("found above");
            if let Err(err) = outcome {
                for alloc in pending.outputs.iter().filter_map(Weak::upgrade) {
                    alloc.mark_failed(&err);
                }
                if let Some(state) = self.streams.get(&pending.stream) {
                    for alloc in state.unsynced.iter().filter_map(Weak::upgrade) {
                        alloc.mark_failed(&err);
                    }
                }
            }
        }
    }

    /// Takes the foreign memory its last handles released to the device
    /// thread (the storage forgets each page; fences are raised on the
    /// streams that used it) and drops the owners whose fences completed.
    /// Never waits.
    pub fn poll_foreign(&mut self) {
        self.foreign.poll(self.backend.as_mut());
    }

    /// A host word the device writes once the device collectives running
    /// now ended ([`crate::backend::DeviceCollectives::end_signal`]).
    pub fn collectives_end_signal(&mut self) -> Option<crate::backend::EndSignal> {
        self.backend.device_collectives()?.end_signal()
    }

    /// Waits until no device collective runs (see [`Backend::settle`]) and
    /// marks the outputs of those that failed.
    pub fn settle_collectives(&mut self) {
        self.backend.settle();
        self.poll_collectives();
    }

    pub fn stream(&mut self, stream: StreamId) -> &mut StreamState {
        let config = &self.pool_config;
        self.streams.entry(stream).or_insert_with(|| StreamState {
            pools: MemoryPools::new(config).expect("the stored pool layout was validated"),
            mode: AllocationMode::Auto,
            prepared: false,
            capture: None,
            unsynced: Vec::new(),
        })
    }

    pub fn is_capturing(&self, stream: StreamId) -> bool {
        self.streams.get(&stream).is_some_and(|s| s.capture.is_some())
    }

    /// Reserves memory for a new handle from its stream's pools. A failure is
    /// marked on the handle and returned.
    pub fn reserve(&mut self, handle: &Handle) -> Result<(), ServerError> {
        let stream_id = handle.stream();
        let size = handle.alloc.size;
        self.stream(stream_id);
        let state = self.streams.get_mut(&stream_id).expect("stream exists");
        let capturing = state.capture.is_some();
        let mode = if state.prepared || capturing { AllocationMode::Persistent } else { state.mode };
        let storage = self.backend.storage();
        let result = if capturing {
            state.pools.reserve(&mut NoNewPages { inner: storage }, size, mode)
        } else {
            state.pools.reserve(storage, size, mode)
        };
        match result {
            Ok(slice) => {
                let _ = handle.alloc.slice.set(slice);
                Ok(())
            }
            Err(err) => {
                if let Some(capture) = state.capture.as_mut() {
                    capture.failure.get_or_insert_with(|| err.clone());
                }
                handle.set_error(Some(err.clone()));
                Err(err)
            }
        }
    }

    /// Where a handle's bytes are. A handle whose reservation failed returns
    /// that failure.
    pub fn binding(&self, handle: &Handle) -> Result<Binding, ServerError> {
        if let Some(adopted) = &handle.alloc.foreign {
            if let Some(err) = handle.given_back() {
                return Err(err);
            }
            return Ok(Binding { page: adopted.page, offset: adopted.offset + handle.offset, size: handle.size });
        }
        match handle.alloc.slice.get() {
            Some(slice) => {
                Ok(Binding { page: slice.page(), offset: slice.offset() + handle.offset, size: handle.size })
            }
            None => Err(handle.error().unwrap_or_else(|| ServerError::InvalidState {
                operation: "binding",
                reason: "the handle's memory was never reserved".into(),
            })),
        }
    }

    /// Orders `stream` after the last writer of each handle, with a fence per
    /// other stream (never a device-wide sync).
    pub fn order_after_writers<'h>(
        &mut self,
        stream: StreamId,
        handles: impl IntoIterator<Item = &'h Handle>,
    ) -> Result<(), ServerError> {
        let mut waited: Vec<StreamId> = Vec::new();
        for handle in handles {
            // A stream that queues work on adopted memory is noted on it:
            // its release and a revoke wait for that stream's work. It is
            // known to the state too, even where it never allocated, so a
            // closing device waits for it (see `ForeignPages::close`).
            if let Some(adopted) = &handle.alloc.foreign {
                adopted.used_on(stream);
                if !self.streams.contains_key(&stream) {
                    self.stream(stream);
                }
            }
            let writer = handle.last_writer();
            if writer != stream && !waited.contains(&writer) && self.streams.contains_key(&writer) {
                self.backend.order_streams(stream, writer)?;
                self.stats.stream_fences += 1;
                waited.push(writer);
            }
        }
        Ok(())
    }

    /// The first error marked on any of `inputs`, wrapped to say which
    /// operation it stopped. The cause is always the root failure, so a chain of dependent
    /// launches reports the original error once, not wrapped per step.
    pub fn poisoned_input<'h>(inputs: impl IntoIterator<Item = &'h Handle>, operation: &str) -> Option<ServerError> {
        inputs.into_iter().find_map(|h| h.error()).map(|cause| ServerError::Poisoned {
            operation: operation.to_string(),
            cause: Arc::new(cause.root_cause().clone()),
        })
    }

    /// Records the outcome of an operation on the handles it should have
    /// written: the error, or (on success) a clean mark and the new writer.
    pub fn mark_outputs<'h>(
        stream: StreamId,
        outputs: impl IntoIterator<Item = &'h Handle>,
        result: &Result<(), ServerError>,
    ) {
        for handle in outputs {
            // Never written: a refusal says so to the caller, not to the
            // memory's later readers.
            if handle.access() == crate::Access::ReadOnly {
                continue;
            }
            match result {
                Ok(()) => {
                    handle.set_error(None);
                    handle.set_last_writer(stream);
                }
                Err(err) => handle.set_error(Some(err.clone())),
            }
        }
    }

    /// Writes `data` into `handle` in place.
    pub fn write(&mut self, stream: StreamId, handle: &Handle, data: &[u8]) -> Result<(), ServerError> {
        if self.is_capturing(stream) {
            let err = ServerError::InvalidState {
                operation: "write",
                reason: "the stream is inside a capture window; write before start_capture or after stop_capture"
                    .into(),
            };
            self.fail_capture(stream, &err);
            return Err(err);
        }
        let result = (|| {
            handle.check_writable("a write")?;
            if data.len() as u64 != handle.size {
                return Err(ServerError::InvalidArgument(format!(
                    "write of {} bytes into a handle of {} bytes",
                    data.len(),
                    handle.size
                )));
            }
            let binding = self.binding(handle)?;
            self.order_after_writers(stream, [handle])?;
            self.backend.write(stream, binding, data)
        })();
        Self::mark_outputs(stream, [handle], &result);
        self.keep_read_only_refusal(stream, [handle], &result);
        result
    }

    /// A refusal to write read-only memory is marked on no buffer (the
    /// memory is fine): it is kept for the stream's next `sync` or `flush`,
    /// so a fire-and-forget write or launch still reports it.
    fn keep_read_only_refusal<'h>(
        &mut self,
        stream: StreamId,
        outputs: impl IntoIterator<Item = &'h Handle>,
        result: &Result<(), ServerError>,
    ) {
        if let Err(err) = result {
            if outputs.into_iter().any(|h| h.access() == crate::Access::ReadOnly) {
                self.pending_errors.entry(stream).or_insert_with(|| err.clone());
            }
        }
    }

    /// Runs (or, inside a capture window, records) a launch.
    pub fn launch(&mut self, stream: StreamId, launch: &RecordedLaunch) -> Result<(), ServerError> {
        if let Some(capture) = self.streams.get_mut(&stream).and_then(|s| s.capture.as_mut()) {
            // Recorded either way: the graph keeps the launch's buffers alive.
            capture.launches.push(launch.clone());
            if !capture.native {
                return Ok(());
            }
        }
        self.launch_now(stream, launch)
    }

    pub fn launch_now(&mut self, stream: StreamId, launch: &RecordedLaunch) -> Result<(), ServerError> {
        let outputs = &launch.buffers;
        let mut bindings = std::mem::take(&mut self.scratch_bindings);
        bindings.clear();
        let result = (|| {
            if outputs.iter().any(|h| h.error().is_some()) {
                let operation = format!("launch of kernel `{}`", launch.kernel.name());
                return Err(Self::poisoned_input(outputs, &operation).expect("an input is marked"));
            }
            for handle in outputs {
                if handle.access() == crate::Access::ReadOnly {
                    let operation =
                        format!("launch of kernel `{}` (it may write any of its buffers)", launch.kernel.name());
                    handle.check_writable(&operation)?;
                }
                bindings.push(self.binding(handle)?);
            }
            let grid = match &launch.grid {
                GridCount::Static(x, y, z) => ResolvedGrid::Static([*x, *y, *z]),
                GridCount::Dynamic(handle) => {
                    if handle.size < 12 {
                        return Err(ServerError::InvalidArgument(format!(
                            "a dynamic grid needs a buffer of 3 u32 (12 bytes); this one has {} bytes",
                            handle.size
                        )));
                    }
                    self.order_after_writers(stream, [handle])?;
                    ResolvedGrid::Dynamic(self.binding(handle)?)
                }
            };
            if let ResolvedGrid::Static(g) = grid {
                if g.contains(&0) {
                    return Ok(());
                }
            }
            self.order_after_writers(stream, outputs)?;
            self.stats.launches += 1;
            stages::mark(Stage::LaunchBound);
            self.backend.launch(stream, &launch.kernel, grid, &bindings, &launch.scalars)?;
            if !self.backend.faults_are_deferred() {
                return Ok(());
            }
            if let Some(state) = self.streams.get_mut(&stream) {
                if state.unsynced.len() >= MAX_UNSYNCED {
                    state.unsynced.drain(..MAX_UNSYNCED / 2);
                }
                for handle in outputs {
                    // A buffer launched on again and again is remembered once.
                    if !state
                        .unsynced
                        .last()
                        .is_some_and(|last| std::ptr::eq(last.as_ptr(), Arc::as_ptr(&handle.alloc)))
                    {
                        state.unsynced.push(Arc::downgrade(&handle.alloc));
                    }
                }
            }
            Ok(())
        })();
        let result = result.map_err(|err| match err {
            err @ (ServerError::Poisoned { .. }
            | ServerError::MissingKernelSource { .. }
            | ServerError::KernelFailed { .. }) => err,
            other => ServerError::KernelFailed {
                kernel: launch.kernel.name().to_string(),
                device: self.service.device,
                reason: other.to_string(),
            },
        });
        Self::mark_outputs(stream, outputs, &result);
        self.keep_read_only_refusal(stream, outputs, &result);
        self.scratch_bindings = bindings;
        stages::mark(Stage::LaunchNoted);
        result
    }

    /// Reads handles to the host after the work that writes them.
    pub fn read(
        &mut self,
        stream: StreamId,
        handles: &[Handle],
    ) -> Result<Vec<crate::bytes::AlignedBytes>, ServerError> {
        self.refuse_in_capture(stream, "read")?;
        if let Some(err) = handles.iter().find_map(|h| h.error()) {
            return Err(err);
        }
        // The bindings go in the state's scratch vector (no allocation per
        // read); it is put back on every return.
        let mut bindings = std::mem::take(&mut self.scratch_bindings);
        bindings.clear();
        let result: Result<_, ServerError> = (|| {
            for handle in handles {
                bindings.push(self.binding(handle)?);
            }
            self.order_after_writers(stream, handles)?;
            // A collective on another stream that wrote them ends first:
            // its end may mark them failed after its calls completed.
            for handle in handles {
                let writer = handle.last_writer();
                if writer != stream {
                    self.backend.settle_collectives_on(writer);
                }
            }
            Ok(self.backend.read(stream, &bindings))
        })();
        self.scratch_bindings = bindings;
        let result = result?;
        // A collective that wrote these handles (or the launches after it
        // that read them) may have failed while the read waited: its error,
        // not the bytes, is the answer. Polled before the stream's unsynced
        // launches are forgotten.
        self.poll_collectives();
        self.drained(stream, result.as_ref().err());
        if let Some(err) = handles.iter().find_map(|h| h.error()) {
            return Err(err);
        }
        result
    }

    /// Waits for the stream's queued work in the backend, marking a device
    /// fault it reports on the outputs of unsynced launches.
    pub fn backend_sync(&mut self, stream: StreamId) -> Result<(), ServerError> {
        let result = self.backend.sync(stream);
        self.poll_collectives();
        self.drained(stream, result.as_ref().err());
        result
    }

    /// After the stream drained: forgets its unsynced outputs, or, when the
    /// drain reported a fault, marks it on the unsynced outputs of every
    /// stream (a device fault stops the whole device's queued work).
    fn drained(&mut self, stream: StreamId, fault: Option<&ServerError>) {
        match fault {
            None => {
                if let Some(state) = self.streams.get_mut(&stream) {
                    state.unsynced.clear();
                }
            }
            Some(err) => {
                for state in self.streams.values_mut() {
                    for alloc in state.unsynced.drain(..).filter_map(|w| w.upgrade()) {
                        alloc.mark_failed(err);
                    }
                }
            }
        }
    }

    pub fn refuse_in_capture(&mut self, stream: StreamId, operation: &'static str) -> Result<(), ServerError> {
        if self.is_capturing(stream) {
            let err = ServerError::InvalidState {
                operation,
                reason: "the stream is inside a capture window; only launches may be recorded until stop_capture"
                    .into(),
            };
            self.fail_capture(stream, &err);
            return Err(err);
        }
        Ok(())
    }

    fn fail_capture(&mut self, stream: StreamId, err: &ServerError) {
        if let Some(capture) = self.streams.get_mut(&stream).and_then(|s| s.capture.as_mut()) {
            capture.failure.get_or_insert_with(|| err.clone());
        }
    }

    /// Waits for the stream's work and returns the first error a
    /// fire-and-forget task left on it.
    pub fn sync(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.refuse_in_capture(stream, "sync")?;
        self.stats.stream_syncs += 1;
        let result = self.backend_sync(stream);
        self.take_pending(stream)?;
        result
    }

    pub fn take_pending(&mut self, stream: StreamId) -> Result<(), ServerError> {
        match self.pending_errors.remove(&stream) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    pub fn memory_usage(&self, stream: Option<StreamId>) -> MemoryUsage {
        self.streams
            .iter()
            .filter(|(id, _)| stream.is_none_or(|s| s == **id))
            .fold(MemoryUsage::default(), |acc, (_, s)| acc.combine(s.pools.usage()))
    }

    pub fn memory_streams(&self, stream: Option<StreamId>) -> Vec<StreamMemory> {
        let mut out: Vec<StreamMemory> = self
            .streams
            .iter()
            .filter(|(id, _)| stream.is_none_or(|s| s == **id))
            .map(|(id, s)| StreamMemory { stream: *id, usage: s.pools.usage(), pools: s.pools.report() })
            .collect();
        out.sort_by_key(|s| s.stream);
        out
    }

    /// Gives back every page nothing holds, on every stream.
    pub fn cleanup(&mut self, kind: Cleanup) {
        self.poll_foreign();
        let storage = self.backend.storage();
        for state in self.streams.values_mut() {
            state.pools.cleanup(storage, kind);
        }
    }

    /// Frees every page before the thread exits, once no device collective
    /// still uses them.
    pub fn release_all(&mut self) {
        self.settle_collectives();
        let streams: Vec<StreamId> = self.streams.keys().copied().collect();
        self.foreign.close(self.backend.as_mut(), &streams);
        let storage = self.backend.storage();
        for state in self.streams.values_mut() {
            state.pools.release_all(storage);
        }
    }
}
