//! What happened to each collective: a flight recorder of the last ones per
//! process, a Chrome/Perfetto timeline, and the merge of every rank's
//! recorder that points at the collective not every rank finished.
//!
//! * [`FlightRecorder`] keeps the last `COHORT_FLIGHT_RECORDER` collectives
//!   (default 2000) of this process in memory: cheap enough to stay on. It is
//!   written as JSON on a timeout, on SIGUSR1 (see [`install_dump_on_signal`])
//!   or on request, to `COHORT_TRACE_DIR` (default `cohort-trace`).
//! * [`Timeline`] appends one Chrome trace event per collective or copy to
//!   `COHORT_TIMELINE=path` (per rank: `path.rank<N>.json` when several ranks
//!   share it); open it in `chrome://tracing` or ui.perfetto.dev.
//! * [`merge`] reads every rank's dump and reports, per collective sequence
//!   number, which ranks finished it: the first one some rank did not finish
//!   is where a hang started.

mod merge;
mod printable;
mod recorder;
mod timeline;
mod watch;

/// The most ranks a dump may claim for its job (`world_size`): a job's own
/// limit. A dump claiming more is set aside.
pub use crate::launch_env::MAX_WORLD_SIZE;
pub use merge::{merge, merge_files, MergeReport, Skipped, Straggler, MAX_DUMP_BYTES};
pub use printable::printable;
pub(crate) use recorder::Ranks;
pub use recorder::{
    install_dump_on_signal, trace_dir, CollectiveFingerprint, CollectiveRecord, FlightRecorder, RecordId, RecordState,
    RecorderDump,
};
pub use timeline::{Timeline, TimelineEvent};
pub(crate) use watch::{timeline_copy, Row, Watched};

/// Microseconds since the Unix epoch: comparable across processes of one
/// machine (and across machines as far as their clocks agree).
pub fn now_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}
