//! Data-parallel training for cohort.
//!
//! * [`nn`]: an MLP of configurable width and depth whose forward,
//!   backward and optimizer step run as device kernels, and synthetic data
//!   from a teacher network.
//! * [`ddp`]: [`ddp::DistributedDataParallel`], gradient buckets
//!   all-reduced while backward runs, over any
//!   [`Collectives`](cohort_comm::Collectives).

pub mod ddp;
pub mod nn;
