//! Device tasks over resolved buffers: the hook the communication layer uses
//! to move and reduce bytes on a device's own thread.

use super::client::Client;
use std::borrow::Cow;
use std::sync::Arc;

use crate::backend::{
    Binding, CollectiveMonitor, CommSpec, Completion, DeviceCall, DeviceCollectives, PeerCall, PeerSpec, PendingPart,
};
use crate::bytes::AlignedBytes;
use crate::device::panic_message;
use crate::error::ServerError;
use crate::handle::Handle;
use crate::id::StreamId;
use crate::state::DeviceState;

/// The handles a buffer task is queued with (its inputs, or its outputs):
/// kept inline, without a heap allocation, for up to two, as most tasks
/// have. A `Vec<Handle>` converts into it.
pub type TaskHandles = smallvec::SmallVec<[Handle; 2]>;

/// A raw view of a buffer that lives in host memory (CPU backend). Valid while
/// the task that got it runs; the task decides who may touch it when.
#[derive(Debug, Clone, Copy)]
pub struct HostPtr {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a HostPtr is an address and a length; sending it to another thread
// is harmless by itself. Dereferencing it is unsafe and its users must
// guarantee the buffer is alive and accesses do not race.
unsafe impl Send for HostPtr {}
// SAFETY: as above: sharing the address does not access memory.
unsafe impl Sync for HostPtr {}

/// What a buffer task sees: its buffers (inputs first, then outputs, as
/// given to [`Client::submit_buffers`]) on the device thread (or on a
/// caller's thread that runs the task inline, holding the device's state).
pub struct BufferAccess<'a> {
    state: &'a mut DeviceState,
    stream: StreamId,
    bindings: Vec<Binding>,
    /// The task's outputs: a collective it queues that is still running
    /// when it returns marks them if it fails later.
    outputs: &'a [Handle],
}

impl BufferAccess<'_> {
    /// The stream the task runs on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Number of buffers (inputs then outputs).
    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    /// Size in bytes of buffer `index`.
    pub fn size(&self, index: usize) -> u64 {
        self.bindings[index].size
    }

    /// Buffer `index` as host memory, on backends whose device memory is host
    /// memory (the CPU); `None` elsewhere. Valid until the task returns.
    pub fn host_ptr(&mut self, index: usize) -> Option<HostPtr> {
        let binding = self.bindings[index];
        self.state.backend.host_bytes(binding).map(|b| HostPtr { ptr: b.as_mut_ptr(), len: b.len() })
    }

    /// Copies buffer `index` to the host (waits for the copy).
    pub fn read(&mut self, index: usize) -> Result<AlignedBytes, ServerError> {
        let binding = self.bindings[index];
        Ok(self.state.backend.read(self.stream, &[binding])?.pop().expect("one binding in, one read out"))
    }

    /// Copies `data` into buffer `index` (sizes must match).
    pub fn write(&mut self, index: usize, data: &[u8]) -> Result<(), ServerError> {
        let binding = self.bindings[index];
        if data.len() as u64 != binding.size {
            return Err(ServerError::InvalidArgument(format!(
                "write of {} bytes into a buffer of {} bytes",
                data.len(),
                binding.size
            )));
        }
        self.state.backend.write(self.stream, binding, data)
    }

    /// Copies buffer `src` into buffer `dst` on the device.
    pub fn copy(&mut self, src: usize, dst: usize) -> Result<(), ServerError> {
        let (s, d) = (self.bindings[src], self.bindings[dst]);
        self.state.backend.copy(self.stream, s, d)
    }

    /// Copies every region of `regions` between this task's buffers on the
    /// device, as one operation queued on the task's stream (see
    /// [`crate::copy_regions`]); does not wait. Refuses, before copying
    /// anything, a region past its buffer and destinations that overlap
    /// another region's bytes.
    pub fn copy_regions(&mut self, regions: &[crate::CopyRegion]) -> Result<(), ServerError> {
        let pairs = crate::copy_regions::resolve(&self.bindings, regions)?;
        if pairs.is_empty() {
            return Ok(());
        }
        self.state.backend.copy_regions(self.stream, &pairs)
    }

    /// Waits for the stream's queued work.
    pub fn sync(&mut self) -> Result<(), ServerError> {
        self.state.backend.sync(self.stream)
    }

    /// Where buffer `index` lives (page, offset, size), for backend hooks
    /// such as [`BufferAccess::device_collectives`].
    pub fn binding(&self, index: usize) -> Binding {
        self.bindings[index]
    }

    /// The backend's device-to-device collectives (NCCL on CUDA), or `None`
    /// where it has none. Calls on it run on the task's thread; pass them
    /// [`BufferAccess::stream`] and the task's [`BufferAccess::binding`]s.
    pub fn device_collectives(&mut self) -> Option<&mut dyn DeviceCollectives> {
        self.state.backend.device_collectives()
    }

    /// The backend's BLAS (cuBLAS on CUDA), or `None` where it has none.
    /// Calls on it run on the task's thread; pass them
    /// [`BufferAccess::stream`] and the task's [`BufferAccess::binding`]s.
    pub fn blas(&mut self) -> Option<&mut dyn crate::backend::DeviceBlas> {
        self.state.backend.blas()
    }

    /// Queues `calls` on the backend's communicator of `comm`, on this
    /// task's stream (see [`DeviceCollectives::run`]). With
    /// [`Completion::Defer`] it returns once they are queued: later work on
    /// the stream is ordered after them on the device, and if they fail
    /// later their error marks this task's outputs (found when the device
    /// polls, waits for a stream or is read). With [`Completion::Wait`] it
    /// returns when they are done. Fails at once where the backend has no
    /// device collectives.
    pub fn run_collective(
        &mut self,
        comm: &CommSpec<'_>,
        calls: &[DeviceCall],
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<(), ServerError> {
        let stream = self.stream;
        let collectives = self.offered_collectives("a device-path collective")?;
        let part = collectives.run(stream, comm, calls, monitor, completion)?;
        self.defer(part);
        Ok(())
    }

    /// Queues this member's part of a peer-memory collective on this task's
    /// stream (see [`DeviceCollectives::run_peer`]); completes as
    /// [`BufferAccess::run_collective`] does.
    pub fn run_peer_collective(
        &mut self,
        spec: &PeerSpec<'_>,
        call: &PeerCall,
        monitor: Arc<dyn CollectiveMonitor>,
        completion: Completion,
    ) -> Result<(), ServerError> {
        let stream = self.stream;
        let collectives = self.offered_collectives("a peer-memory collective")?;
        let part = collectives.run_peer(stream, spec, call, monitor, completion)?;
        self.defer(part);
        Ok(())
    }

    /// Remembers a collective still running (`Some`) with the task's
    /// outputs, which its failure marks when the device finds it.
    fn defer(&mut self, part: Option<PendingPart>) {
        if let Some(part) = part {
            self.state.note_pending_collective(part, self.stream, self.outputs);
        }
    }

    /// The backend's device collectives, or an error saying `operation`
    /// needs them and this device has none.
    fn offered_collectives(&mut self, operation: &'static str) -> Result<&mut dyn DeviceCollectives, ServerError> {
        self.state.backend.device_collectives().ok_or_else(|| ServerError::InvalidState {
            operation,
            reason: "the device's backend offers no device collectives".into(),
        })
    }
}

impl Client {
    /// Queues `task` on the device thread with `inputs` and `outputs`
    /// resolved; returns at once. Refuses foreign handles before queueing.
    ///
    /// On the device thread the task runs after the work that writes its
    /// buffers (cross-stream fences included). If an input already carries an
    /// error the task is skipped and the outputs are marked poisoned; if the
    /// task fails or panics, its error marks every output. `operation` names
    /// the task in those errors ("all_reduce", say).
    pub fn submit_buffers(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(&mut BufferAccess<'_>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(), ServerError> {
        // The task is skipped when its buffers are not ready: the error it
        // is handed marks the outputs unchanged.
        self.submit_buffers_always(operation, inputs, outputs, move |access| match access {
            Ok(access) => task(access),
            Err(err) => Err(err),
        })
    }

    /// Like [`Client::submit_buffers`], but the task always runs: when an
    /// input already carries an error, or a buffer cannot be bound, the task
    /// gets that error (`Err`) instead of the buffers. Tasks that meet tasks
    /// of other devices (collectives) use it so every member still arrives
    /// and learns of the failure; the task's result marks the outputs as
    /// with `submit_buffers`. Returns at once.
    pub fn submit_buffers_always(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(), ServerError> {
        self.refuse_if_capturing("a buffer task")?;
        self.submit_buffers_recorded(operation, inputs, outputs, task)
    }

    /// [`Client::submit_buffers_always`], also inside a capture window: for
    /// tasks that only queue device work on their stream (kernels, device
    /// copies, device collectives), which the capture records; a task that
    /// reads, waits or allocates there fails the capture.
    pub fn submit_buffers_recorded(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(), ServerError> {
        let (stream, task) = self.checked_buffer_task(operation, inputs, outputs, task)?;
        self.device().submit(stream, task)
    }

    /// The device-thread task of [`Client::submit_buffers_recorded`] and
    /// [`Client::submit_buffers_inline`], once every buffer is checked to be
    /// this device's, and the stream it goes to.
    fn checked_buffer_task(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(StreamId, impl FnOnce(&mut DeviceState) + Send + 'static), ServerError> {
        let (inputs, outputs): (TaskHandles, TaskHandles) = (inputs.into(), outputs.into());
        for handle in inputs.iter().chain(&outputs) {
            self.check_owned(handle)?;
        }
        let operation = operation.into();
        for handle in &outputs {
            handle.check_writable(&operation)?;
        }
        let stream = self.stream_id();
        // Named in errors only: a static name is kept as it is, not copied.
        let task = buffer_task(inputs, outputs, stream, operation, self.device_id(), task);
        Ok((stream, task))
    }

    /// [`Client::submit_buffers_always`], run on the calling thread before
    /// it returns where that keeps the device's order: when the device has
    /// nothing queued or running (then it would have run next anyway,
    /// without the hand-over to the device thread and the wake-up), on the
    /// backends that allow it (CPU, and CUDA with the device's context made
    /// current on the calling thread while no stream of the device
    /// captures). Otherwise queued as `submit_buffers_always` queues it.
    ///
    /// For short tasks that wait for nothing else on this device and for no
    /// task not queued yet (a small collective of one device); a task that
    /// waits for another device's part would wait on the caller's thread.
    pub fn submit_buffers_inline(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(), ServerError> {
        self.refuse_if_capturing("a buffer task")?;
        self.submit_buffers_recorded_inline(operation, inputs, outputs, task)
    }

    /// [`Client::submit_buffers_recorded`] (also inside a capture window,
    /// for tasks that only queue device work on their stream), run on the
    /// calling thread where [`Client::submit_buffers_inline`] would run it.
    /// While a stream of the device captures, CUDA queues it: the capture
    /// records it from the device thread.
    pub fn submit_buffers_recorded_inline(
        &self,
        operation: impl Into<Cow<'static, str>>,
        inputs: impl Into<TaskHandles>,
        outputs: impl Into<TaskHandles>,
        task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
    ) -> Result<(), ServerError> {
        let (stream, task) = self.checked_buffer_task(operation, inputs, outputs, task)?;
        self.device().run_inline(stream, task).or_else(|task| self.device().submit(stream, task))
    }
}

/// The device-thread side of a buffer task: binds `inputs` and `outputs`,
/// orders the task after their writers, runs `task` (or hands it the
/// error that stopped the binding) and marks the outputs with its result.
fn buffer_task(
    inputs: TaskHandles,
    outputs: TaskHandles,
    stream: StreamId,
    operation: Cow<'static, str>,
    device: crate::id::DeviceId,
    task: impl FnOnce(Result<&mut BufferAccess<'_>, ServerError>) -> Result<(), ServerError> + Send + 'static,
) -> impl FnOnce(&mut DeviceState) + Send + 'static {
    move |state| {
        // The bindings go in the state's reused vector (no allocation
        // per task); a task nested inside (`exclusive`) takes its own.
        let mut bindings = std::mem::take(&mut state.scratch_bindings);
        bindings.clear();
        let prepared = (|| {
            if let Some(err) = DeviceState::poisoned_input(&inputs, &operation) {
                return Err(err);
            }
            for handle in inputs.iter().chain(&outputs) {
                bindings.push(state.binding(handle)?);
            }
            state.order_after_writers(stream, inputs.iter().chain(&outputs))
        })();
        let run = std::panic::AssertUnwindSafe(|| match prepared {
            Ok(()) => {
                let mut access = BufferAccess { state: &mut *state, stream, bindings, outputs: &outputs };
                let result = task(Ok(&mut access));
                (result, access.bindings)
            }
            Err(err) => (task(Err(err)), bindings),
        });
        let (result, bindings) = std::panic::catch_unwind(run).unwrap_or_else(|payload| {
            (Err(ServerError::TaskPanicked { device, message: panic_message(payload.as_ref()) }), Vec::new())
        });
        state.scratch_bindings = bindings;
        DeviceState::mark_outputs(stream, &outputs, &result);
        crate::stages::mark(crate::stages::Stage::OutputsMarked);
    }
}
