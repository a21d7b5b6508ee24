//! DLPack, both ways, with no copy: take a tensor that PyTorch, JAX, CuPy,
//! NumPy, candle or any other DLPack producer owns as a cohort [`Handle`](crate::Handle)
//! ([`import`]), and hand cohort's memory to a DLPack consumer
//! ([`export`]).
//!
//! The ABI structs, flags and descriptor checks come from the [`dlpark`]
//! crate (re-exported here, so callers name the same version): an imported
//! tensor is a [`dlpark::Managed`] of either ABI, the versioned one of
//! DLPack 1.x ([`Versioned`]) or the legacy `DLManagedTensor`
//! ([`Legacy`]); [`export`] gives a [`Versioned`] tensor and
//! [`export_legacy`] a [`Legacy`] one.
//!
//! What maps to what:
//!
//! | DLPack device | cohort client |
//! |---|---|
//! | `kDLCPU`, `kDLCUDAHost` | a `cpu` client |
//! | `kDLCUDA`, `device_id` n | a `cuda` client on GPU n ([`DeviceProperties::gpu`](crate::DeviceProperties::gpu)) |
//! | anything else | refused |
//!
//! Element types are cohort's [`DType`](crate::DType)s with one lane
//! ([`dtype_to_dlpack`], [`dtype_from_dlpack`]). Imports are compact
//! row-major (dimensions of size 1 may carry any stride); a tensor that
//! is not, a misaligned `byte_offset`, an unsupported element type or a
//! device the client is not is refused with an error naming it, and the
//! refused tensor's deleter runs at once.

mod device;
mod dtype;
mod export;
mod exported;
mod import;

pub use device::dlpack_device;
pub use dlpark;
pub use dtype::{dtype_from_dlpack, dtype_to_dlpack};
pub use export::{export, export_legacy};
pub use import::{import, DlpackImport};

/// A DLPack 1.x managed tensor (`DLManagedTensorVersioned`): it carries
/// its version and flags (read-only, copied). What [`export`] gives and
/// what `__dlpack__(max_version=(1, _))` hands over.
pub type Versioned = dlpark::versioned::Dlpack;

/// A legacy DLPack managed tensor (`DLManagedTensor`, before 1.0): no
/// version, no flags. What [`export_legacy`] gives, for consumers that ask
/// for no version.
pub type Legacy = dlpark::legacy::Dlpack;

use crate::error::ServerError;

/// The error every refusal of this module returns.
fn refused(message: String) -> ServerError {
    ServerError::InvalidArgument(message)
}
