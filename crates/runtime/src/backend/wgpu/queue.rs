//! The device's one queue: the command encoder work is recorded into, its
//! submissions, and fences on submission indexes.
//!
//! Every stream of a device shares one encoder and one queue. The device
//! thread runs tasks one at a time, so commands are recorded in task order
//! and submitted in that order; a queue runs submissions in order, so work
//! of one stream queued before work of another also runs before it. That is
//! why cross-stream ordering costs nothing on wgpu (see
//! `WgpuBackend::order_streams`).
//!
//! `queue.write_buffer` copies run at the start of the *next* submission,
//! before its command buffers; [`Submitter::before_queue_write`] submits
//! recorded commands first so a write never overtakes earlier launches.

use crate::backend::FenceWait;
use crate::error::ServerError;

use super::adapter::Gpu;

/// Commands recorded before the encoder is submitted without being asked:
/// enough to batch small launches, few enough to keep the device fed.
const AUTO_SUBMIT_COMMANDS: u32 = 64;

/// The pending encoder and the last submission.
pub(crate) struct Submitter {
    encoder: Option<wgpu::CommandEncoder>,
    commands: u32,
    writes_pending: bool,
    last: Option<wgpu::SubmissionIndex>,
    /// An error found when submitting work that no single buffer owns (a
    /// batched command that failed validation); returned by the next `sync`.
    deferred: Option<ServerError>,
}

impl Submitter {
    pub fn new() -> Self {
        Self { encoder: None, commands: 0, writes_pending: false, last: None, deferred: None }
    }

    /// The encoder to record the next command into.
    pub fn encoder(&mut self, gpu: &Gpu) -> &mut wgpu::CommandEncoder {
        self.encoder.get_or_insert_with(|| {
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("cohort") })
        })
    }

    /// Counts a recorded command; submits once enough have gathered.
    /// Fewer wait for the next read, sync, fence or `Client::flush`: one
    /// submission per launch costs about 40% more per launch on lavapipe,
    /// and asking the device whether it is idle before each costs more still.
    pub fn recorded(&mut self, gpu: &Gpu) {
        self.commands += 1;
        if self.commands >= AUTO_SUBMIT_COMMANDS {
            self.submit(gpu);
        }
    }

    /// Notes a `queue.write_buffer` (it runs with the next submission).
    pub fn wrote(&mut self) {
        self.writes_pending = true;
    }

    /// Submits recorded commands before a `queue.write_buffer`, which would
    /// otherwise run ahead of them.
    pub fn before_queue_write(&mut self, gpu: &Gpu) {
        if self.commands > 0 {
            self.submit(gpu);
        }
    }

    /// Whether anything waits to be submitted.
    pub fn has_pending(&self) -> bool {
        self.commands > 0 || self.writes_pending || self.encoder.is_some()
    }

    /// Submits what was recorded (possibly nothing: the submission still
    /// carries pending buffer writes) and returns its index. A validation
    /// error in the batch is kept for the next `sync`.
    pub fn submit(&mut self, gpu: &Gpu) -> wgpu::SubmissionIndex {
        let encoder = self.encoder.take();
        let (index, error) = gpu.scoped(|| {
            let buffers: Vec<wgpu::CommandBuffer> = encoder.map(|e| e.finish()).into_iter().collect();
            gpu.queue.submit(buffers)
        });
        if let Some(error) = error {
            tracing::error!(device = %gpu.id, "a batch of queued work failed validation: {error}");
            self.deferred.get_or_insert_with(|| gpu.error(format!("queued work failed validation: {error}")));
        }
        self.commands = 0;
        self.writes_pending = false;
        self.last = Some(index.clone());
        index
    }

    /// [`Submitter::submit`], returning the error when this submission
    /// failed validation (its copies did not run, so their results must not
    /// be used). The error is also kept for the next `sync`.
    pub fn submit_checked(&mut self, gpu: &Gpu) -> Result<wgpu::SubmissionIndex, ServerError> {
        let clean = self.deferred.is_none();
        let index = self.submit(gpu);
        match &self.deferred {
            Some(err) if clean => Err(err.clone()),
            _ => Ok(index),
        }
    }

    /// Submits if anything is pending; the index covering all work so far.
    pub fn flush(&mut self, gpu: &Gpu) -> Option<wgpu::SubmissionIndex> {
        if self.has_pending() {
            Some(self.submit(gpu))
        } else {
            self.last.clone()
        }
    }

    /// The error kept from an earlier submission, if any.
    pub fn take_deferred(&mut self) -> Result<(), ServerError> {
        match self.deferred.take() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

/// Blocks until submission `index` (and every earlier one) has finished and
/// its callbacks (buffer maps) have run.
pub(crate) fn wait_for(device: &wgpu::Device, index: wgpu::SubmissionIndex) -> Result<(), String> {
    device
        .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
        .map(|_| ())
        .map_err(|e| format!("waiting for queued work failed: {e}"))
}

/// A fence on wgpu: the submission index the work was submitted in. Waiting
/// polls the device until that submission has finished; it can be waited on
/// from any thread.
pub(crate) struct SubmissionFence {
    pub device: wgpu::Device,
    pub index: Option<wgpu::SubmissionIndex>,
    pub id: crate::id::DeviceId,
}

impl FenceWait for SubmissionFence {
    fn wait(self: Box<Self>) -> Result<(), ServerError> {
        match self.index {
            None => Ok(()),
            Some(index) => wait_for(&self.device, index).map_err(|message| ServerError::Backend {
                backend: "wgpu",
                device: self.id,
                message,
            }),
        }
    }

    /// Asks the device without blocking (a zero timeout) whether the
    /// submission finished; a lost device counts as finished.
    fn is_complete(&self) -> bool {
        match &self.index {
            None => true,
            Some(index) => !matches!(
                self.device.poll(wgpu::PollType::Wait {
                    submission_index: Some(index.clone()),
                    timeout: Some(std::time::Duration::ZERO)
                }),
                Err(wgpu::PollError::Timeout)
            ),
        }
    }
}
