//! Host bytes read from or written to a device, aligned for any element type.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use crate::backend::HostMemory;
use crate::error::ServerError;

/// A byte buffer whose start is aligned to 16 bytes, so it can be viewed as a
/// slice of any plain element type (`f32`, `u64`, `f16`, ...) without a copy.
///
/// Usually plain host memory; a backend may also lend memory of its own
/// (pinned memory on CUDA) that goes back to it when the bytes are dropped.
/// Cloning always makes plain host memory.
#[derive(Default)]
pub struct AlignedBytes {
    words: Vec<u128>,
    host: Option<Box<dyn HostMemory>>,
    len: usize,
}

impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        match self.host {
            None => Self { words: self.words.clone(), host: None, len: self.len },
            Some(_) => Self::from_slice(self.as_slice()),
        }
    }
}

impl AlignedBytes {
    /// `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Self {
        Self { words: vec![0u128; len.div_ceil(16)], host: None, len }
    }

    /// The first `len` bytes of memory a backend lends (pinned memory, say).
    /// Panics when `len` exceeds its capacity or its start is not 16-byte
    /// aligned.
    pub fn from_host_memory(memory: Box<dyn HostMemory>, len: usize) -> Self {
        assert!(len <= memory.capacity(), "{len} bytes asked of host memory of {} bytes", memory.capacity());
        assert!((memory.as_ptr() as usize).is_multiple_of(16), "host memory must be 16-byte aligned");
        Self { words: Vec::new(), host: Some(memory), len }
    }

    /// The backend memory these bytes live in, if a backend lent it.
    pub fn host_memory(&self) -> Option<&dyn HostMemory> {
        self.host.as_deref()
    }

    /// A copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut out = Self::zeroed(data.len());
        out.as_mut_slice().copy_from_slice(data);
        out
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.host {
            // SAFETY: the lender guarantees `capacity` bytes at `as_ptr` while
            // it lives (it lives as long as `self`), and `len <= capacity`.
            Some(host) => unsafe { std::slice::from_raw_parts(host.as_ptr(), self.len) },
            None => &bytemuck::cast_slice::<u128, u8>(&self.words)[..self.len],
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.host {
            // SAFETY: as in `as_slice`; `&mut self` makes the access unique,
            // since the lent memory belongs to these bytes alone.
            Some(host) => unsafe { std::slice::from_raw_parts_mut(host.as_ptr(), self.len) },
            None => &mut bytemuck::cast_slice_mut::<u128, u8>(&mut self.words)[..self.len],
        }
    }
}

/// A deferred read: the device-to-host copy runs on first access.
pub(crate) type LazyRead = Box<dyn FnOnce() -> Result<AlignedBytes, ServerError> + Send>;

struct Lazy {
    read: parking_lot::Mutex<Option<LazyRead>>,
    value: OnceLock<Result<AlignedBytes, ServerError>>,
}

enum Repr {
    Owned(AlignedBytes),
    Lazy(Arc<Lazy>),
}

/// Bytes moving between the host and a device.
///
/// Owned bytes are plain aligned host memory. Bytes from `Client::read_lazy`
/// copy from the device on first access (and keep the source buffer alive until
/// then); use [`Bytes::try_get`] to see a failed lazy read as an error, since
/// dereferencing a failed lazy read panics with its cause.
pub struct Bytes {
    repr: Repr,
}

impl Bytes {
    /// A copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        Self { repr: Repr::Owned(AlignedBytes::from_slice(data)) }
    }

    /// The bytes of a slice of plain elements.
    pub fn from_elems<T: bytemuck::Pod>(elems: &[T]) -> Self {
        Self::from_slice(bytemuck::cast_slice(elems))
    }

    /// `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Self {
        Self { repr: Repr::Owned(AlignedBytes::zeroed(len)) }
    }

    pub(crate) fn from_aligned(bytes: AlignedBytes) -> Self {
        Self { repr: Repr::Owned(bytes) }
    }

    pub(crate) fn lazy(read: LazyRead) -> Self {
        Self { repr: Repr::Lazy(Arc::new(Lazy { read: parking_lot::Mutex::new(Some(read)), value: OnceLock::new() })) }
    }

    /// The bytes, running a deferred read if this is the first access; a failed
    /// read returns its error (every later call returns it too).
    pub fn try_get(&self) -> Result<&[u8], ServerError> {
        match &self.repr {
            Repr::Owned(bytes) => Ok(bytes.as_slice()),
            Repr::Lazy(lazy) => {
                let value = lazy.value.get_or_init(|| {
                    let read = lazy.read.lock().take();
                    match read {
                        Some(read) => read(),
                        None => Err(ServerError::InvalidState {
                            operation: "lazy read",
                            reason: "the read was already consumed".into(),
                        }),
                    }
                });
                value.as_ref().map(|b| b.as_slice()).map_err(Clone::clone)
            }
        }
    }

    /// Whether these bytes live in memory a backend lent (pinned memory).
    pub fn is_backend_memory(&self) -> bool {
        matches!(&self.repr, Repr::Owned(bytes) if bytes.host_memory().is_some())
    }

    /// Whether a deferred read has not run yet.
    pub fn is_pending(&self) -> bool {
        match &self.repr {
            Repr::Owned(_) => false,
            Repr::Lazy(lazy) => lazy.value.get().is_none(),
        }
    }

    /// The bytes viewed as elements of `T`. Panics when the length is not a
    /// whole number of elements.
    pub fn cast<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self)
    }

    /// The bytes copied into a vector of `T`.
    pub fn to_elems<T: bytemuck::Pod>(&self) -> Vec<T> {
        self.cast::<T>().to_vec()
    }

    /// The owned bytes (materialising a lazy read).
    pub fn into_aligned(self) -> Result<AlignedBytes, ServerError> {
        match self.repr {
            Repr::Owned(bytes) => Ok(bytes),
            Repr::Lazy(_) => self.try_get().map(AlignedBytes::from_slice),
        }
    }
}

impl Deref for Bytes {
    type Target = [u8];

    /// Panics with the read's error if a deferred read failed: use
    /// [`Bytes::try_get`] to handle that case.
    fn deref(&self) -> &[u8] {
        match self.try_get() {
            Ok(bytes) => bytes,
            Err(err) => panic!("lazy device read failed: {err}"),
        }
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            Repr::Owned(b) => write!(f, "Bytes({} bytes)", b.len()),
            Repr::Lazy(_) if self.is_pending() => write!(f, "Bytes(lazy, pending)"),
            Repr::Lazy(_) => write!(f, "Bytes(lazy, read)"),
        }
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(value: Vec<u8>) -> Self {
        Self::from_slice(&value)
    }
}

impl From<&[u8]> for Bytes {
    fn from(value: &[u8]) -> Self {
        Self::from_slice(value)
    }
}
