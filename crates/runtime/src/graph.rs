//! Captured graphs: recorded work replayed against the same buffers.

use std::fmt;
use std::sync::Arc;

use crate::client::Client;
use crate::error::ServerError;
use crate::handle::Handle;
use crate::id::StreamId;
use crate::kernel::GridCount;
use crate::state::RecordedLaunch;

/// Work captured between `start_capture` and `stop_capture`, replayed on the
/// capture stream against the same buffers (which it keeps alive). Refresh
/// inputs between replays with `Client::write` on the capture stream.
///
/// On CUDA a replay is one graph launch; elsewhere it re-issues the recorded
/// launches in order.
///
/// The graph keeps a clone of every handle its launches use (on CUDA too,
/// where the driver's graph holds their addresses), so the memory stays
/// reserved, and adopted memory's owner ([`Client::adopt`]) stays alive,
/// until the last clone of the graph goes; [`Client::reclaim`] of such
/// memory is refused while the graph lives (other clones are alive).
/// [`Client::revoke`] is not blocked by a graph (a scoped borrow must be
/// able to end): it gives the memory back all the same, and from then on
/// every replay of a graph that uses it is refused, naming the handle,
/// before anything runs (a CUDA graph's launch would write memory that is
/// the caller's again, maybe freed). Drop the graph and capture again over
/// memory adopted anew.
#[derive(Clone)]
pub struct Graph {
    client: Client,
    launches: Arc<Vec<RecordedLaunch>>,
    native: Option<Arc<NativeGraphId>>,
}

/// Frees the backend's graph when the last clone of the [`Graph`] goes.
struct NativeGraphId {
    client: Client,
    id: u64,
}

impl Drop for NativeGraphId {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self.client.device().submit(self.client.stream_id(), move |state| {
            state.graphs.remove(&id);
        });
    }
}

impl Graph {
    pub(crate) fn new(client: Client, launches: Arc<Vec<RecordedLaunch>>, native: Option<u64>) -> Self {
        let native = native.map(|id| Arc::new(NativeGraphId { client: client.clone(), id }));
        Self { client, launches, native }
    }

    /// Launches recorded (a native graph's too: it replays them as one
    /// driver graph).
    pub fn len(&self) -> usize {
        self.launches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.launches.is_empty() && self.native.is_none()
    }

    /// Queues one replay on the capture stream and returns at once; failures
    /// mark the buffers the graph writes.
    ///
    /// Refused, nothing queued, where a handle the graph uses is foreign
    /// memory given back ([`Client::revoke`]); a revoke queued after this
    /// call but before the replay ran fails the replay the same way, as a
    /// whole (the stream's next sync returns the error).
    pub fn replay(&self) -> Result<(), ServerError> {
        given_back(&self.launches)?;
        let stream = self.client.stream_id();
        let launches = self.launches.clone();
        let native = self.native.as_ref().map(|n| n.id);
        self.client.device().submit(stream, move |state| {
            // Checked again in device order: a revoke ahead of this task
            // forgot the memory on this thread.
            if let Err(err) = given_back(&launches) {
                state.pending_errors.entry(stream).or_insert(err);
                return;
            }
            if let Some(id) = native {
                note_foreign(&launches, stream);
                if let Some(mut graph) = state.graphs.remove(&id) {
                    let result = state.backend.replay_native(stream, graph.as_mut());
                    state.graphs.insert(id, graph);
                    if let Err(err) = result {
                        state.pending_errors.entry(stream).or_insert(err);
                    }
                }
                return;
            }
            for launch in launches.iter() {
                let _ = state.launch_now(stream, launch);
            }
        })
    }
}

/// The handles a launch uses: its buffers and a dynamic grid's.
fn handles_of(launch: &RecordedLaunch) -> impl Iterator<Item = &Handle> {
    let grid = match &launch.grid {
        GridCount::Dynamic(handle) => Some(handle),
        GridCount::Static(..) => None,
    };
    launch.buffers.iter().chain(grid)
}

/// Notes `stream` on the adopted memory that `launches` use, before a
/// native replay there (the replayed launches do not pass
/// `DeviceState::order_after_writers`, and the replay stream may not be
/// the capture's: a graph replayed from another thread): a revoke, a
/// reclaim or the release then raises a fence on that stream too, which
/// covers a replay in flight (queued before the revoke, still running).
fn note_foreign(launches: &[RecordedLaunch], stream: StreamId) {
    for adopted in launches.iter().flat_map(handles_of).filter_map(|handle| handle.alloc.foreign.as_ref()) {
        adopted.used_on(stream);
    }
}

/// Refuses a replay of `launches` where any handle they use (a buffer or
/// a dynamic grid) is foreign memory given back, naming it.
fn given_back(launches: &[RecordedLaunch]) -> Result<(), ServerError> {
    for (index, launch) in launches.iter().enumerate() {
        for handle in handles_of(launch) {
            if let Some(err) = handle.given_back() {
                return Err(ServerError::InvalidState {
                    operation: "Graph::replay",
                    reason: format!(
                        "launch {index} (kernel `{}`) of the graph uses {handle:?}, whose foreign memory was \
                         given back ({err}): the replay would touch memory that is no longer cohort's; capture \
                         a new graph over memory adopted again",
                        launch.kernel.name()
                    ),
                });
            }
        }
    }
    Ok(())
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("launches", &self.launches.len()).field("native", &self.native.is_some()).finish()
    }
}
