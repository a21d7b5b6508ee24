//! Captured graphs: recorded work replayed against the same buffers.

use std::fmt;
use std::sync::Arc;

use crate::client::Client;
use crate::error::ServerError;
use crate::state::RecordedLaunch;

/// Work captured between `start_capture` and `stop_capture`, replayed on the
/// capture stream against the same buffers (which it keeps alive). Refresh
/// inputs between replays with `Client::write` on the capture stream.
///
/// On CUDA a replay is one graph launch; elsewhere it re-issues the recorded
/// launches in order.
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

    /// Launches recorded (0 for a native graph, whose launches live in the
    /// driver).
    pub fn len(&self) -> usize {
        self.launches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.launches.is_empty() && self.native.is_none()
    }

    /// Queues one replay on the capture stream and returns at once; failures
    /// mark the buffers the graph writes.
    pub fn replay(&self) -> Result<(), ServerError> {
        let stream = self.client.stream_id();
        let launches = self.launches.clone();
        let native = self.native.as_ref().map(|n| n.id);
        self.client.device().submit(stream, move |state| {
            if let Some(id) = native {
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

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("launches", &self.launches.len()).field("native", &self.native.is_some()).finish()
    }
}
