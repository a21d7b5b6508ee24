//! Taking a DLPack tensor as a cohort handle, with no copy.

use dlpark::{DlpackFlags, Managed, ManagedTensorBase};

use super::dtype::{describe, dtype_from_dlpack};
use super::exported::exported_handle;
use super::{device, refused};
use crate::client::Client;
use crate::dtype::DType;
use crate::error::ServerError;
use crate::foreign::Access;
use crate::handle::Handle;

/// A DLPack tensor taken by [`import`]: a handle over its memory, and what
/// the memory holds. The tensor itself became the handle's owner: its
/// deleter runs once, when the last clone of the handle is gone and no
/// work cohort queued on the memory still needs it (a tensor cohort
/// exported is deleted at once instead: the handle is a slice of the
/// exported one).
#[derive(Debug, Clone)]
pub struct DlpackImport {
    /// The tensor's bytes (from its `data + byte_offset`, `shape`'s product
    /// times the element size), read-only
    /// ([`Access::ReadOnly`], see [`Handle::access`]) where the tensor's
    /// DLPack 1.x flags say so.
    pub handle: Handle,
    /// The element type.
    pub dtype: DType,
    /// The shape, outermost dimension first (row-major, compact).
    pub shape: Vec<usize>,
}

impl DlpackImport {
    /// The number of elements (the product of the shape).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Takes `tensor` (a [`Versioned`](super::Versioned) or
/// [`Legacy`](super::Legacy) DLPack tensor) as a handle of `client`, with
/// no copy: the handle's [`Client::device_address`] is the tensor's
/// `data + byte_offset`, and what cohort writes there the producer sees.
/// Waits, as [`Client::adopt`] does, for the device to register the memory
/// (after the work queued on it before this call).
///
/// The tensor must be on `client`'s device (`kDLCPU` or `kDLCUDAHost` on a
/// `cpu` client, `kDLCUDA` on the `cuda` client of that GPU), of a cohort
/// element type with one lane, compact row-major (a null `strides`, or
/// strides where only dimensions of size 1 may differ from row-major),
/// its `data + byte_offset` aligned to the element size. Anything else is
/// refused with an error naming it, before anything is queued, and the
/// tensor is dropped (its deleter runs) before this returns. That is
/// DLPack's contract (a consumer that took a tensor calls its deleter once,
/// whatever it made of it) and loses nothing: the deleter releases only the
/// consumer's reference, and the memory stays the producer's tensor's
/// (PyTorch's, CuPy's), untouched.
///
/// A tensor cohort itself exported ([`export`](super::export),
/// [`export_legacy`](super::export_legacy)), recognised by its context,
/// gives a slice of the exported handle (the same allocation, not a second
/// one over the same bytes, so overlap checks see both names), and its
/// deleter runs before this returns: the slice keeps the memory. It must
/// come back to the client that exported it, over bytes of that handle,
/// and flagged read-only only where the handle is.
///
/// A tensor with no elements gives an empty cohort buffer (its deleter runs
/// before this returns): there is no memory to share.
///
/// A tensor flagged read-only (DLPack 1.x `DLPACK_FLAG_BITMASK_READ_ONLY`)
/// gives a [`Access::ReadOnly`] handle: writes, launches and collectives
/// that would write it are refused. The producer's pending work on the memory is not waited for:
/// on CUDA, order cohort after the producer's stream
/// ([`Client::wait_external`] on it, as DLPack's `stream` argument asks)
/// before using the handle. On the CPU, [`Client::adopt`] also wants
/// `data + byte_offset` 16-byte aligned.
pub fn import<M>(client: &Client, tensor: Managed<M>) -> Result<DlpackImport, ServerError>
where
    M: ManagedTensorBase + 'static,
{
    let view =
        tensor.validate().map_err(|err| refused(format!("DLPack: the tensor's descriptor is invalid: {err}")))?;
    let dtype = dtype_from_dlpack(view.dtype())?;
    let shape = view.shape();
    check_compact(shape, view.strides())?;
    // Counted in bits by `validate`, without overflow: far below isize::MAX.
    let len = view.num_bytes();
    let base = view.data_ptr().cast_mut().cast::<u8>();
    let byte_offset = usize::try_from(view.byte_offset())
        .ok()
        .filter(|&offset| (base as usize).checked_add(offset).and_then(|a| a.checked_add(len)).is_some())
        .ok_or_else(|| {
            refused(format!(
                "DLPack: data {base:p} + byte_offset {} + {len} bytes overflows the address space",
                view.byte_offset()
            ))
        })?;
    // Arithmetic only (never read through here): the sum was checked above.
    let data = base.wrapping_add(byte_offset);
    if len > 0 {
        if base.is_null() {
            return Err(refused(format!(
                "DLPack: a tensor of shape {shape:?} with {len} bytes has a null data pointer"
            )));
        }
        if !(data as usize).is_multiple_of(dtype.size()) {
            return Err(refused(format!(
                "DLPack: data {base:p} + byte_offset {byte_offset} = {data:p} is not aligned to the {} bytes of a {} \
                 element ({})",
                dtype.size(),
                dtype,
                describe(view.dtype())
            )));
        }
    }
    let memory = device::foreign_memory(client, view.device(), data, len)?;
    let shape = shape.iter().map(|&dim| dim as usize).collect();
    // SAFETY: `tensor` is a valid managed tensor (`validate` read it); only
    // its context pointer is copied.
    let context = unsafe { (*tensor.as_ptr()).manager_ctx() };
    if let Some(original) = exported_handle(context) {
        let read_only = tensor.flags().contains(DlpackFlags::READ_ONLY);
        let handle = slice_of_export(client, &original, data as u64, len as u64, read_only)?;
        // The slice keeps the memory: the tensor's own clone goes now.
        drop(tensor);
        return Ok(DlpackImport { handle, dtype, shape });
    }
    if len == 0 {
        // Nothing to share, and nothing of the tensor to keep: an empty
        // cohort buffer stands for it, and its deleter runs now.
        drop(tensor);
        return Ok(DlpackImport { handle: client.empty(0), dtype, shape });
    }
    let access = if tensor.flags().contains(DlpackFlags::READ_ONLY) { Access::ReadOnly } else { Access::ReadWrite };
    // SAFETY: by the DLPack contract the producer keeps `data + byte_offset`
    // and the `len` bytes after it valid until the tensor's deleter runs,
    // and the tensor (whose drop runs the deleter) is the owner, which
    // cohort drops only once no handle or queued work needs the memory.
    // The memory is on `client`'s device (checked above; `adopt` checks the
    // CUDA context), and a read-only tensor is adopted read-only.
    let handle = unsafe { client.adopt(memory, Box::new(tensor), access)? };
    Ok(DlpackImport { handle, dtype, shape })
}

/// The `len` bytes at `data` of a tensor cohort exported from `original`,
/// as a slice of `original` itself: the same allocation, so the overlap
/// checks of launches and collectives see the two names of these bytes
/// (two allocations over them would pass those checks and alias).
/// Refused where `original` is another client's (import the tensor on
/// the client that exported it), where the bytes are not inside
/// `original` (the tensor was changed after the export), and where the
/// tensor is flagged read-only over a writable handle (a read-only slice
/// of writable memory cannot be made).
fn slice_of_export(
    client: &Client,
    original: &Handle,
    data: u64,
    len: u64,
    read_only: bool,
) -> Result<Handle, ServerError> {
    client.check_owned(original).map_err(|err| {
        refused(format!(
            "DLPack: this tensor is cohort's export of another client's handle ({err}): import it on the client that \
             exported it"
        ))
    })?;
    if read_only && original.access() == Access::ReadWrite {
        return Err(refused(
            "DLPack: this tensor is cohort's export of a writable handle, flagged read-only since: use the handle, \
             or clear the flag"
                .to_string(),
        ));
    }
    if len == 0 {
        return Ok(client.empty(0));
    }
    let start = client.device_address(original)?;
    let offset =
        data.checked_sub(start).filter(|offset| offset.checked_add(len).is_some_and(|end| end <= original.size()));
    let offset = offset.ok_or_else(|| {
        refused(format!(
            "DLPack: this tensor is cohort's export of {} bytes at {start:#x}, but names {len} bytes at {data:#x}, \
             outside them",
            original.size()
        ))
    })?;
    original.slice(offset, len)
}

/// Refuses strides that are not compact row-major. A null `strides` (before
/// DLPack 1.2) is compact; dimensions of size 1 may carry any stride
/// (PyTorch gives them several); a tensor with no elements is compact.
fn check_compact(shape: &[i64], strides: Option<&[i64]>) -> Result<(), ServerError> {
    let Some(strides) = strides else { return Ok(()) };
    if shape.contains(&0) {
        return Ok(());
    }
    let mut expected = 1i64;
    for (&dim, &stride) in shape.iter().zip(strides).rev() {
        if dim != 1 && stride != expected {
            let compact = dlpark::tensor::compact_strides(shape).unwrap_or_default();
            return Err(refused(format!(
                "DLPack: non-contiguous strides {strides:?} for shape {shape:?} (compact row-major is {compact:?}): \
                 cohort takes compact tensors only; call .contiguous() first"
            )));
        }
        // Cannot overflow: the element count was checked by `validate`.
        expected = expected.saturating_mul(dim);
    }
    Ok(())
}
