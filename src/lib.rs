//! cohort: collective communication across GPUs.
//!
//! * [`runtime`] — per-device runtimes: clients, memory pools, streams,
//!   kernels, graphs and profiling, with the `cpu` backend always built.
//! * [`comm`] — collectives over groups of devices.

pub use cohort_comm as comm;
pub use cohort_runtime as runtime;

/// The names most programs need.
pub mod prelude {
    pub use cohort_runtime::prelude::*;
}

/// The README's code, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
