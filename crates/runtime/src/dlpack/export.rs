//! Handing cohort's memory to a DLPack consumer, with no copy.

use std::ffi::c_void;

use dlpark::metadata::Dynamic;
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};

use super::device::dlpack_device;
use super::dtype::dtype_to_dlpack;
use super::exported::Exported;
use super::{refused, Legacy, Versioned};
use crate::client::Client;
use crate::dtype::DType;
use crate::error::ServerError;
use crate::foreign::Access;
use crate::handle::Handle;

/// A DLPack 1.x tensor over `handle`'s memory, with no copy: its data is
/// the handle's [`Client::device_address`], its device `client`'s
/// ([`dlpack_device`](super::dlpack_device): `kDLCPU`, or `kDLCUDA` with
/// the GPU's ordinal), its element type `dtype`, its shape `shape` with
/// explicit compact row-major strides, flagged read-only where the handle
/// is [`Access::ReadOnly`].
///
/// The tensor holds a clone of the handle, so cohort keeps the memory (and
/// an imported tensor's own owner) until the consumer calls the deleter
/// (drops the tensor), on whatever thread. Handed back to [`import`](super::import),
/// it is recognised and gives a slice of this handle, not a second handle
/// over the same bytes.
///
/// Waits for the handle's memory to be reserved, not for the work queued
/// on it: the consumer must order its reads after cohort's work, by
/// syncing first ([`Client::sync`], [`Client::sync_buffers`]) or, on CUDA,
/// by ordering its stream after cohort's ([`Client::signal_external`] on
/// the consumer's stream: what DLPack's `stream` argument asks of a
/// producer). Likewise cohort's later work on the memory must be ordered
/// after the consumer's ([`Client::wait_external`]).
///
/// Refused before anything else: a handle of another client, memory only
/// lent for a scope ([`Handle::lend_for_scope`]: comm's
/// `Buffer::with_borrowed`, `with_cuda_slice`, and slices of them; the
/// consumer would keep a raw pointer past the borrow, which the scope's
/// revoke cannot take back), a shape whose element count times `dtype`'s
/// size is not the handle's size, a wgpu client (DLPack cannot carry a
/// wgpu buffer).
pub fn export(client: &Client, handle: &Handle, dtype: DType, shape: &[usize]) -> Result<Versioned, ServerError> {
    export_as(client, handle, dtype, shape)
}

/// [`export`] as a legacy `DLManagedTensor`, for consumers that ask for no
/// DLPack version. It has no flags, so a read-only handle is refused (as
/// NumPy refuses a read-only array) rather than handed over writable.
pub fn export_legacy(client: &Client, handle: &Handle, dtype: DType, shape: &[usize]) -> Result<Legacy, ServerError> {
    if handle.access() == Access::ReadOnly {
        return Err(refused(
            "DLPack: a read-only handle cannot be exported as a legacy tensor, which has no read-only flag: \
             export it as a versioned (DLPack 1.x) tensor"
                .to_string(),
        ));
    }
    export_as(client, handle, dtype, shape)
}

fn export_as<M: ManagedTensorBase>(
    client: &Client,
    handle: &Handle,
    dtype: DType,
    shape: &[usize],
) -> Result<Managed<M>, ServerError> {
    client.check_owned(handle)?;
    if handle.is_lent() {
        return Err(refused(
            "DLPack export: this memory is only lent to cohort for a scope (Buffer::with_borrowed, \
             with_cuda_slice): a DLPack consumer would keep its address after the borrow ends; give cohort the \
             memory itself to export it (Buffer::from_vec, Buffer::from_cuda_slice)"
                .to_string(),
        ));
    }
    let device = dlpack_device(client)?;
    let bytes = shape.iter().try_fold(dtype.size() as u64, |acc, &dim| acc.checked_mul(dim as u64));
    if bytes != Some(handle.size()) {
        let bytes = bytes.map_or_else(|| "more than 2^64".to_string(), |b| b.to_string());
        return Err(refused(format!(
            "DLPack export: shape {shape:?} of {dtype} is {bytes} bytes but the handle holds {} bytes",
            handle.size()
        )));
    }
    let address = client.device_address(handle)?;
    let mut tensor = Dynamic::compact(shape)
        .initialize_as::<M>(Exported::new(handle.clone()))
        .map_err(|err| refused(format!("DLPack export: shape {shape:?}: {err}")))?;
    tensor
        .set_data(std::ptr::with_exposed_provenance_mut::<c_void>(address as usize))
        .set_device(device)
        .set_dtype(dtype_to_dlpack(dtype))
        .set_byte_offset(0);
    if handle.access() == Access::ReadOnly {
        tensor
            .set_flags(DlpackFlags::READ_ONLY)
            .map_err(|err| refused(format!("DLPack export: the read-only flag: {err}")))?;
    }
    // SAFETY: the data is the handle's memory, `handle.size()` bytes (the
    // shape's, checked above) at `address` on `device`; the context, dropped
    // by the deleter, is a clone of the handle, which keeps that memory
    // reserved until then (and is what `import` hands back). Shape and strides live in the tensor's own
    // allocation (copied, compact). The flags claim nothing but read-only,
    // and that only for a read-only handle.
    Ok(unsafe { tensor.finish() })
}
