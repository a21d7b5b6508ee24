//! Kernel launches, graph capture and profiling.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::Client;
use crate::device::panic_message;
use crate::error::{ProfileError, ServerError};
use crate::graph::Graph;
use crate::kernel::{GridCount, Kernel, KernelArguments};
use crate::profile::{ProfileDuration, ProfileWindow};
use crate::stages::{self, Stage};
use crate::state::{Capture, RecordedLaunch};

impl Client {
    /// Queues `kernel` over `count` blocks with `args`; returns at once.
    ///
    /// Refused before anything is queued (with an error): a handle of another
    /// device, a buffer larger than a binding may be, or two buffers that
    /// overlap. Failures while running (no source for this backend, a panic, a
    /// fault) mark every buffer of the launch, so reading one returns the
    /// cause. A grid with a zero dimension is a no-op.
    pub fn launch(&self, kernel: &Kernel, count: GridCount, args: KernelArguments) -> Result<(), ServerError> {
        let max = self.properties().max_binding_size;
        for handle in &args.buffers {
            if handle.size() > max {
                return Err(ServerError::InvalidArgument(format!(
                    "kernel `{}`: a buffer of {} bytes is larger than the {} bytes one binding may span on {}",
                    kernel.name(),
                    handle.size(),
                    max,
                    self.device_id()
                )));
            }
        }
        for (i, a) in args.buffers.iter().enumerate() {
            for (j, b) in args.buffers.iter().enumerate().skip(i + 1) {
                let overlap =
                    a.same_allocation(b) && a.offset() < b.offset() + b.size() && b.offset() < a.offset() + a.size();
                if overlap && a.size() > 0 && b.size() > 0 {
                    return Err(ServerError::InvalidArgument(format!(
                        "kernel `{}`: buffers {i} and {j} overlap; pass each buffer once",
                        kernel.name()
                    )));
                }
            }
        }
        // SAFETY: the checks above are the ones `launch_unchecked` skips.
        unsafe { self.launch_unchecked(kernel, count, args) }
    }

    /// [`Client::launch`] without the size and overlap checks.
    ///
    /// # Safety
    /// The kernel must not read or write outside its buffers, and must
    /// terminate. Overlapping buffers are still refused on backends that hand
    /// kernels host slices (the CPU), where aliasing would be undefined.
    pub unsafe fn launch_unchecked(
        &self,
        kernel: &Kernel,
        count: GridCount,
        args: KernelArguments,
    ) -> Result<(), ServerError> {
        for handle in &args.buffers {
            self.check_owned(handle)?;
            if handle.access() == crate::Access::ReadOnly {
                handle.check_writable(&format!(
                    "a launch of kernel `{}` (it may write any of its buffers)",
                    kernel.name()
                ))?;
            }
        }
        if let GridCount::Dynamic(handle) = &count {
            self.check_owned(handle)?;
        }
        stages::mark(Stage::LaunchChecked);
        let stream = self.stream_id();
        let launch =
            RecordedLaunch { kernel: kernel.clone(), grid: count, buffers: args.buffers, scalars: args.scalars };
        let result = self.device().submit_launch(stream, launch);
        stages::mark(Stage::LaunchReturned);
        result
    }

    /// Prepares this stream for a capture: its allocations go to the
    /// persistent pool from now on, so a warm-up run reserves the memory the
    /// captured run will reuse. Call it, run the work once, then
    /// [`Client::start_capture`]. Pin the client to a dedicated stream first.
    pub fn graph_prepare(&self) -> Result<(), ServerError> {
        self.refuse_if_capturing("graph_prepare")?;
        let stream = self.stream_id();
        self.device().run(stream, move |state| state.stream(stream).prepared = true)
    }

    /// Starts recording this stream's launches into a graph instead of running
    /// them. Until [`Client::stop_capture`], reads, syncs, writes and
    /// allocations that need a new page are refused (and fail the capture).
    /// Waits for the work queued on this stream before it (on CUDA the
    /// stream is synced, not the device, so fences of adopted memory used
    /// there need not be recorded inside the capture).
    pub fn start_capture(&self) -> Result<(), ServerError> {
        self.refuse_if_capturing("start_capture")?;
        let stream = self.stream_id();
        self.device().run(stream, move |state| {
            let native = state.backend.begin_native_capture(stream)?;
            state.stream(stream).capture = Some(Capture { native, launches: Vec::new(), failure: None });
            Ok::<_, ServerError>(())
        })??;
        self.device().capturing.lock().insert(stream);
        Ok(())
    }

    /// Whether this client's stream is inside a capture window.
    pub fn is_capturing(&self) -> bool {
        self.device().capturing.lock().contains(&self.stream_id())
    }

    /// Ends the capture window and returns the graph, or the first thing that
    /// went wrong inside the window.
    pub fn stop_capture(&self) -> Result<Graph, ServerError> {
        let stream = self.stream_id();
        let result = self.device().run(stream, move |state| {
            let Some(capture) = state.stream(stream).capture.take() else {
                return Err(ServerError::InvalidState {
                    operation: "stop_capture",
                    reason: "this stream is not capturing; call start_capture first".into(),
                });
            };
            state.stream(stream).prepared = false;
            let native = if capture.native {
                let graph = state.backend.end_native_capture(stream)?;
                state.next_graph += 1;
                state.graphs.insert(state.next_graph, graph);
                Some(state.next_graph)
            } else {
                None
            };
            if let Some(err) = capture.failure {
                if let Some(id) = native {
                    state.graphs.remove(&id);
                }
                return Err(err);
            }
            Ok((Arc::new(capture.launches), native))
        });
        self.device().capturing.lock().remove(&stream);
        let (launches, native) = result??;
        Ok(Graph::new(self.with_stream(stream), launches, native))
    }

    /// Opens a profile window on this stream (draining it first where the
    /// backend times on the host).
    pub fn profile_start(&self) -> Result<ProfileWindow, ProfileError> {
        let stream = self.stream_id();
        let token = self.device().run(stream, move |state| {
            let start = state.backend.timing_start(stream)?;
            state.next_profile += 1;
            state.profiles.insert(state.next_profile, start);
            Ok::<_, ServerError>(state.next_profile)
        })??;
        Ok(ProfileWindow { stream, token })
    }

    /// Closes a profile window: waits for the work queued inside it and
    /// returns its duration and how it was measured.
    pub fn profile_end(&self, window: ProfileWindow) -> Result<ProfileDuration, ProfileError> {
        let stream = self.stream_id();
        if window.stream != stream {
            return Err(ProfileError::WrongStream { opened: window.stream, closed: stream });
        }
        let token = window.token;
        let duration = self.device().run(stream, move |state| {
            let start = state.profiles.remove(&token).ok_or(ServerError::InvalidState {
                operation: "profile_end",
                reason: "this window was already closed".into(),
            })?;
            state.backend.timing_end(stream, start)
        })??;
        Ok(duration)
    }

    /// Drops a profile window without measuring.
    pub fn profile_abandon(&self, window: ProfileWindow) {
        let token = window.token;
        let _ = self.device().submit(window.stream, move |state| {
            state.profiles.remove(&token);
        });
    }

    /// Runs `func` inside a profile window and returns its output and the
    /// duration of the device work it queued. `name` labels the trace span.
    pub fn profile<O: Send + 'static>(
        &self,
        func: impl FnOnce() -> O + Send,
        name: &str,
    ) -> Result<(O, ProfileDuration), ProfileError> {
        let _span = tracing::debug_span!("profile", name).entered();
        let window = self.profile_start()?;
        let output = match catch_unwind(AssertUnwindSafe(func)) {
            Ok(output) => output,
            Err(payload) => {
                self.profile_abandon(window);
                return Err(ProfileError::Panicked(panic_message(payload.as_ref())));
            }
        };
        let duration = self.profile_end(window)?;
        Ok((output, duration))
    }
}
