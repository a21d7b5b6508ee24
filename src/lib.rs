//! cohort: collective communication across GPUs.
//!
//! * [`runtime`] — per-device runtimes: clients, memory pools, streams,
//!   kernels, graphs and profiling, with the `cpu` backend always built.
//! * [`comm`] — collectives over groups of devices and across processes:
//!   the [`Collectives`](comm::Collectives) trait over typed
//!   [`Buffer`](comm::Buffer)s.
//!
//! * [`ddp`] — data-parallel training: [`ddp::DistributedDataParallel`],
//!   gradient buckets all-reduced while backward runs.
//! * [`nn`] — a model worth measuring on device kernels: an MLP of
//!   configurable width and depth, SGD with momentum, teacher data.
//!
//! [`Error`] is the one error type a program needs: every error of the
//! layers beneath converts into it, and its `Debug` prints the message.

pub use cohort_comm as comm;
pub use cohort_comm::Error;
pub use cohort_runtime as runtime;
pub use cohort_train::{ddp, nn};

/// The names most programs need: the runtime's, and the collectives'.
///
/// ```
/// use cohort::prelude::*;
///
/// fn main() -> Result<(), Error> {
///     // A job of one process over one CPU device, laid out as a 1 × 1 mesh.
///     let world = World::Local(ClientGroup::new(vec![CpuRuntime::client(0)?])?);
///     let mesh = Mesh::new(&world, &[("dp", 1), ("tp", 1)])?;
///     let tp = mesh.group_of("tp", 0)?;
///     let x: Vec<Buffer<f32>> = tp.replicate(&[1.0, 2.0])?;
///     tp.all_reduce(&x, &x, ReduceOp::Sum)?.wait()?;
///     assert_eq!(x[0].to_vec()?, [1.0, 2.0]);
///     Ok(())
/// }
/// ```
pub mod prelude {
    pub use cohort_comm::{
        rank_clients, Buffer, ClientGroup, Collectives, Communicator, DType, Element, Error, Mesh, OnStream, ReduceOp,
        Transport, Work, World,
    };
    pub use cohort_runtime::prelude::*;
    pub use cohort_runtime::ExternalStream;
}

/// The README's code, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
