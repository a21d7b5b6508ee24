//! The runtime conformance suite, written once and run on every backend.
//!
//! Each function checks one contract of the runtime on the devices of `R` and
//! panics with a message naming what broke. `conformance_tests!` turns them
//! into `#[test]`s for a backend; a GPU backend passes
//! `#[ignore = "..."]` so the suite compiles everywhere and runs with
//! `--include-ignored` where the GPU is.
//!
//! Tests share the process-wide devices and run in parallel, so each checks
//! its own stream's memory (every test runs on its own thread, hence stream)
//! rather than the whole device's.

mod allocations;
mod cases;
mod graph_cases;
pub mod kernels;
mod stream_cases;

pub use allocations::CountingAllocator;
pub use cases::*;
pub use graph_cases::*;
pub use stream_cases::*;

use crate::{Client, Runtime};

/// Client of device 0 of `R`, or a panic saying why there is none.
pub fn first_client<R: Runtime>() -> Client {
    R::client(0).unwrap_or_else(|e| panic!("{} backend has no device 0: {e}", R::NAME))
}

/// Expands to one `#[test]` per conformance case for runtime `$runtime`,
/// each carrying the given attributes (e.g. `#[ignore = "needs a GPU"]`).
#[macro_export]
macro_rules! conformance_tests {
    ($runtime:ty $(, #[$attr:meta])*) => {
        $crate::conformance_tests!(@cases $runtime, [$(#[$attr])*],
            create_and_read_round_trip, empty_then_write_in_place, read_async_and_read_one,
            tensors_contiguous_and_pitched, read_lazy_defers_the_copy, memory_accounting_is_exact,
            streams_are_isolated_per_thread, cross_stream_use_is_ordered_by_a_fence,
            failed_launch_marks_its_outputs, missing_source_marks_outputs, poison_propagates_to_dependents,
            foreign_handles_are_refused, zero_sized_grid_is_a_no_op, dynamic_grid_reads_its_buffer,
            graph_replay_matches_direct_launches, capture_window_refusals, eight_threads_share_one_device,
            pool_layout_configuration, allocation_modes,
            task_panics_reach_the_caller, exclusive_runs_client_calls_inline, capabilities_match_the_backend,
            high_priority_streams_behave_like_others, timestamps_follow_stream_order);
    };
    (@cases $runtime:ty, $attrs:tt, $($case:ident),*) => {
        $( $crate::conformance_tests!(@one $runtime, $attrs, $case); )*
    };
    (@one $runtime:ty, [$(#[$attr:meta])*], $case:ident) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            $crate::conformance::$case::<$runtime>();
        }
    };
}
