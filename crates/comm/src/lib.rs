//! Collective communication over cohort runtimes.
pub mod store;
