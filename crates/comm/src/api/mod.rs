//! The front door: typed buffers and the collectives every communicator
//! offers, with one error type.
//!
//! - [`Buffer<T>`]: device memory with its element type and length,
//!   cohort's own or memory someone else owns (a `Vec`, a borrowed slice, a
//!   cudarc `CudaSlice`, a `wgpu::Buffer`, a DLPack tensor), zero-copy.
//! - [`Collectives`]: all-reduce, reduce, broadcast, all-gather,
//!   reduce-scatter, all-to-all, gather, scatter, send/recv and barrier over
//!   typed buffers, implemented by [`ClientGroup`](crate::ClientGroup) (one
//!   process), [`Communicator`](crate::Communicator) (one rank of many) and
//!   [`World`] (whichever this process is).
//! - [`OnStream`]: the same collectives ordered on the caller's streams.
//! - [`rank_clients`]: the devices a rank brings (one per `LOCAL_RANK`).
//! - [`Error`]: every error beneath converts into it.

mod buffer;
mod collectives;
mod error;
mod foreign;
mod on_stream;
mod world;

pub use buffer::Buffer;
pub use collectives::{Collectives, Grouped};
pub use error::Error;
pub use foreign::{IntoOwnerError, Refused};
pub use on_stream::OnStream;
pub use world::{rank_clients, World};
