//! Handles: names for slices of device memory, and the tensor layouts over them.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::error::ServerError;
use crate::foreign::{Access, Adopted};
use crate::id::{ServiceId, StreamId};
use crate::memory::SliceHandle;

static NEXT_ALLOCATION: AtomicU64 = AtomicU64::new(1);

/// One reservation of device memory, shared by every handle cut from it.
///
/// The client creates it at once (so `create` and `empty` return without
/// waiting) and the device thread fills in the slice when it runs the
/// reservation. The memory goes back to its stream's pool when the last handle
/// (including those held by queued tasks and recorded graphs) is dropped;
/// adopted memory ([`crate::Client::adopt`]) is already in place when the
/// handle is made, and is released instead (its owner dropped once the work
/// queued on it ended).
pub(crate) struct Allocation {
    pub(crate) id: u64,
    pub(crate) service: ServiceId,
    /// The stream whose pool the memory comes from.
    pub(crate) stream: StreamId,
    pub(crate) size: u64,
    pub(crate) slice: OnceLock<SliceHandle>,
    /// The error of the last operation that should have written this memory.
    pub(crate) error: Mutex<Option<ServerError>>,
    /// Whether `error` holds one: lets the hot path skip the lock.
    pub(crate) has_error: AtomicBool,
    /// The stream that last queued work writing this memory (for cross-stream
    /// fences).
    pub(crate) last_writer: AtomicU64,
    /// Set for memory cohort did not allocate (`Client::adopt`): its page
    /// (outside every pool; `slice` stays empty), and its owner, released
    /// when this drops. Kept inline: adopting memory allocates this
    /// allocation alone.
    pub(crate) foreign: Option<Adopted>,
}

impl Drop for Allocation {
    /// Adopted memory is released: its page forgotten and its owner
    /// dropped once the work queued on it ended (see [`Adopted::release`]).
    /// Pooled memory needs nothing: the pool sees its slice free.
    fn drop(&mut self) {
        if let Some(adopted) = &mut self.foreign {
            adopted.release();
        }
    }
}

/// A slice of memory on one device. Cheap to clone; the memory stays reserved
/// while any clone is alive.
#[derive(Clone)]
pub struct Handle {
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

impl Allocation {
    /// Sets (or, with `None`, clears) the error every handle of this memory
    /// reports.
    pub(crate) fn set_error(&self, error: Option<ServerError>) {
        if error.is_none() && !self.has_error.load(Ordering::Acquire) {
            return;
        }
        let mut slot = self.error.lock();
        self.has_error.store(error.is_some(), Ordering::Release);
        *slot = error;
    }

    /// Marks `err` unless the memory already carries an error.
    pub(crate) fn mark_failed(&self, err: &ServerError) {
        let mut slot = self.error.lock();
        slot.get_or_insert_with(|| err.clone());
        self.has_error.store(true, Ordering::Release);
    }
}

impl Handle {
    pub(crate) fn new_allocation(service: ServiceId, stream: StreamId, size: u64) -> Handle {
        Handle::with_allocation(service, stream, size, None)
    }

    /// A handle over adopted memory: `size` bytes at the page and offset
    /// `adopted` names.
    pub(crate) fn adopted(service: ServiceId, stream: StreamId, size: u64, adopted: Adopted) -> Handle {
        Handle::with_allocation(service, stream, size, Some(adopted))
    }

    /// A whole new allocation of `size` bytes, pooled (`foreign` `None`,
    /// its slice filled in when reserved) or adopted.
    fn with_allocation(service: ServiceId, stream: StreamId, size: u64, foreign: Option<Adopted>) -> Handle {
        let alloc = Arc::new(Allocation {
            id: NEXT_ALLOCATION.fetch_add(1, Ordering::Relaxed),
            service,
            stream,
            size,
            slice: OnceLock::new(),
            error: Mutex::new(None),
            has_error: AtomicBool::new(false),
            last_writer: AtomicU64::new(stream.value),
            foreign,
        });
        Handle { alloc, offset: 0, size }
    }

    /// Whether calls may write this memory: [`Access::ReadOnly`] for
    /// foreign memory adopted read-only (a DLPack tensor so marked),
    /// [`Access::ReadWrite`] otherwise.
    pub fn access(&self) -> Access {
        self.alloc.foreign.as_ref().map_or(Access::ReadWrite, |f| f.access)
    }

    /// Whether this handle names memory cohort did not allocate
    /// ([`crate::Client::adopt`]).
    pub fn is_foreign(&self) -> bool {
        self.alloc.foreign.is_some()
    }

    /// Marks adopted memory as lent only for a scope (a borrow that
    /// [`crate::Client::revoke`] ends, as comm's `Buffer::with_borrowed`
    /// does): from then on, on every clone and slice, whatever hands the
    /// memory's address out of cohort's reach, where a revoke cannot take
    /// it back (DLPack export), refuses it. One way: it cannot be unmarked.
    /// Call it right after adopting, before the handle is shared. Nothing
    /// for memory cohort allocated.
    pub fn lend_for_scope(&self) {
        if let Some(adopted) = &self.alloc.foreign {
            adopted.lent.store(true, Ordering::Release);
        }
    }

    /// Whether this handle's memory is only lent for a scope
    /// ([`Handle::lend_for_scope`]).
    pub fn is_lent(&self) -> bool {
        self.alloc.foreign.as_ref().is_some_and(|adopted| adopted.lent.load(Ordering::Acquire))
    }

    /// Refuses a read-only handle as the destination of `operation`, with
    /// an error saying what to do; `Ok` for every other handle. Checked by
    /// the runtime's writes and launches (every kernel argument may be
    /// written), and by collectives for their outputs.
    pub fn check_writable(&self, operation: &str) -> Result<(), ServerError> {
        if self.access() == Access::ReadOnly {
            return Err(ServerError::InvalidArgument(format!(
                "{operation} would write a read-only handle ({} bytes of foreign memory adopted with \
                 Access::ReadOnly): write into a cohort buffer (or a writable tensor) instead, and copy it out",
                self.size
            )));
        }
        Ok(())
    }

    /// The error binding this handle returns where its foreign memory was
    /// given back ([`crate::Client::revoke`], `reclaim`); `None` otherwise.
    pub(crate) fn given_back(&self) -> Option<ServerError> {
        let adopted = self.alloc.foreign.as_ref()?;
        adopted.given_back.load(Ordering::Acquire).then(|| Adopted::given_back_error(self.alloc.size))
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Byte offset inside its allocation (non-zero for handles cut by
    /// `create_tensors` or [`Handle::slice`]).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The device server this handle belongs to.
    pub fn service(&self) -> ServiceId {
        self.alloc.service
    }

    /// The stream whose memory pool holds this handle's memory.
    pub fn stream(&self) -> StreamId {
        self.alloc.stream
    }

    /// A handle over `len` bytes starting `start` bytes into this one.
    pub fn slice(&self, start: u64, len: u64) -> Result<Handle, ServerError> {
        if start.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(ServerError::InvalidArgument(format!(
                "slice {start}..{} is outside a handle of {} bytes",
                start.saturating_add(len),
                self.size
            )));
        }
        Ok(Handle { alloc: self.alloc.clone(), offset: self.offset + start, size: len })
    }

    /// An identity of the handle's allocation, equal for exactly the
    /// handles that [`Handle::same_allocation`] pairs while they live (to
    /// sort or hash handles by allocation).
    pub fn allocation_key(&self) -> usize {
        Arc::as_ptr(&self.alloc) as *const () as usize
    }

    /// Whether both handles share one allocation.
    pub fn same_allocation(&self, other: &Handle) -> bool {
        Arc::ptr_eq(&self.alloc, &other.alloc)
    }

    pub(crate) fn error(&self) -> Option<ServerError> {
        if !self.alloc.has_error.load(Ordering::Acquire) {
            return None;
        }
        self.alloc.error.lock().clone()
    }

    pub(crate) fn set_error(&self, error: Option<ServerError>) {
        self.alloc.set_error(error)
    }

    pub(crate) fn last_writer(&self) -> StreamId {
        StreamId { value: self.alloc.last_writer.load(Ordering::Acquire) }
    }

    pub(crate) fn set_last_writer(&self, stream: StreamId) {
        self.alloc.last_writer.store(stream.value, Ordering::Release);
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("allocation", &self.alloc.id)
            .field("service", &self.alloc.service)
            .field("stream", &self.alloc.stream)
            .field("offset", &self.offset)
            .field("size", &self.size)
            .field("foreign", &self.alloc.foreign.as_ref().map(|f| f.access))
            .finish()
    }
}

/// A handle with the shape and strides (in elements) of the tensor it holds.
#[derive(Debug, Clone)]
pub struct MemoryLayout {
    pub handle: Handle,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub elem_size: usize,
}

impl MemoryLayout {
    /// The descriptor that reads this tensor back.
    pub fn descriptor(&self) -> CopyDescriptor {
        CopyDescriptor {
            handle: self.handle.clone(),
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            elem_size: self.elem_size,
        }
    }

    /// Whether rows are stored back to back with no padding.
    pub fn is_contiguous(&self) -> bool {
        self.strides == contiguous_strides(&self.shape)
    }
}

/// The shape and element size of a tensor to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLayoutDescriptor {
    pub shape: Vec<usize>,
    pub elem_size: usize,
}

impl MemoryLayoutDescriptor {
    pub fn new(shape: impl Into<Vec<usize>>, elem_size: usize) -> Self {
        Self { shape: shape.into(), elem_size }
    }
}

/// What to read: a handle and the layout of the tensor in it.
#[derive(Debug, Clone)]
pub struct CopyDescriptor {
    pub handle: Handle,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub elem_size: usize,
}

impl CopyDescriptor {
    /// A contiguous tensor of `shape` in `handle`.
    pub fn contiguous(handle: Handle, shape: impl Into<Vec<usize>>, elem_size: usize) -> Self {
        let shape = shape.into();
        let strides = contiguous_strides(&shape);
        Self { handle, shape, strides, elem_size }
    }
}

/// How a runtime lays out tensors it creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayoutPolicy {
    /// Rows back to back.
    #[default]
    Contiguous,
    /// Each row of the last dimension padded to a multiple of `row_alignment`
    /// bytes ("pitched"), for tensors of rank 2 and more.
    Pitched { row_alignment: usize },
}

/// Row-major strides, in elements, of a contiguous tensor.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

impl LayoutPolicy {
    /// Strides (in elements) and total bytes of a tensor of `shape`.
    pub fn layout(&self, shape: &[usize], elem_size: usize) -> (Vec<usize>, usize) {
        let elems: usize = shape.iter().product();
        match *self {
            LayoutPolicy::Pitched { row_alignment } if shape.len() >= 2 && elem_size > 0 && row_alignment > 0 => {
                let row = shape[shape.len() - 1];
                let row_bytes = (row * elem_size).div_ceil(row_alignment) * row_alignment;
                if row_bytes % elem_size != 0 {
                    return (contiguous_strides(shape), elems * elem_size);
                }
                let pitch = row_bytes / elem_size;
                let strides = pitched_strides(shape, pitch);
                let rows: usize = shape[..shape.len() - 1].iter().product();
                let bytes = if elems == 0 { 0 } else { rows * pitch * elem_size };
                (strides, bytes)
            }
            _ => (contiguous_strides(shape), elems * elem_size),
        }
    }
}

/// Copies a contiguous tensor into the (possibly padded) layout of `strides`.
/// Only the last dimension may be padded (as [`LayoutPolicy`] makes them).
pub(crate) fn pack_rows(data: &[u8], shape: &[usize], strides: &[usize], elem_size: usize, total: usize) -> Vec<u8> {
    if strides == contiguous_strides(shape).as_slice() {
        return data.to_vec();
    }
    let row = shape[shape.len() - 1] * elem_size;
    let pitch = strides[shape.len() - 2] * elem_size;
    let mut out = vec![0u8; total];
    for (i, chunk) in data.chunks(row.max(1)).enumerate() {
        out[i * pitch..i * pitch + chunk.len()].copy_from_slice(chunk);
    }
    out
}

/// Copies a tensor stored with `strides` into a contiguous buffer.
pub(crate) fn unpack_rows(
    data: &[u8],
    shape: &[usize],
    strides: &[usize],
    elem_size: usize,
) -> Result<Vec<u8>, ServerError> {
    let contiguous = contiguous_strides(shape);
    let elems: usize = shape.iter().product();
    if strides == contiguous.as_slice() || elems == 0 {
        let bytes = elems * elem_size;
        if data.len() < bytes {
            return Err(ServerError::InvalidArgument(format!(
                "tensor of shape {shape:?} needs {bytes} bytes but its handle holds {}",
                data.len()
            )));
        }
        return Ok(data[..bytes].to_vec());
    }
    let rank = shape.len();
    if rank < 2
        || strides[rank - 1] != 1
        || strides[..rank - 2] != pitched_strides(shape, strides[rank - 2])[..rank - 2]
    {
        return Err(ServerError::InvalidArgument(format!(
            "strides {strides:?} for shape {shape:?} are not readable: only the last dimension may be padded"
        )));
    }
    let row = shape[rank - 1] * elem_size;
    let pitch = strides[rank - 2] * elem_size;
    let rows = elems / shape[rank - 1];
    if rows > 0 && (rows - 1) * pitch + row > data.len() {
        return Err(ServerError::InvalidArgument(format!(
            "tensor of shape {shape:?} with strides {strides:?} is larger than its handle ({} bytes)",
            data.len()
        )));
    }
    let mut out = Vec::with_capacity(elems * elem_size);
    for r in 0..rows {
        out.extend_from_slice(&data[r * pitch..r * pitch + row]);
    }
    Ok(out)
}

/// Row-major strides, in elements, of a tensor of rank ≥ 2 whose rows are
/// `pitch` elements apart (only the last dimension padded).
fn pitched_strides(shape: &[usize], pitch: usize) -> Vec<usize> {
    let rank = shape.len();
    let mut strides = vec![1; rank];
    strides[rank - 2] = pitch;
    for i in (0..rank - 2).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pitched_layout_pads_rows_and_round_trips() {
        let policy = LayoutPolicy::Pitched { row_alignment: 16 };
        let (strides, bytes) = policy.layout(&[3, 5], 4);
        assert_eq!(strides, vec![8, 1]);
        assert_eq!(bytes, 3 * 8 * 4);
        let data: Vec<u8> = (0..60u8).collect();
        let packed = pack_rows(&data, &[3, 5], &strides, 4, bytes);
        assert_eq!(&packed[32..52], &data[20..40]);
        assert_eq!(unpack_rows(&packed, &[3, 5], &strides, 4).unwrap(), data);
    }

    #[test]
    fn unreadable_strides_are_refused() {
        let err = unpack_rows(&[0u8; 64], &[2, 2], &[1, 2], 4).unwrap_err();
        assert!(err.to_string().contains("only the last dimension"), "{err}");
    }
}
