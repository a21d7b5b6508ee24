//! [`Buffer<T>`]: device memory that knows its element type and length.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use cohort_runtime::{Bytes, Client, Handle};

use super::Error;
use crate::ops::Element;

/// `len` elements of `T` in one device's memory: a runtime [`Handle`] with
/// its element type and length attached, and the [`Client`] of its device.
///
/// The collectives of [`Collectives`](super::Collectives) take buffers and
/// infer the element type and count from them, so a type mismatch is a
/// compile error and a length mismatch is refused before anything is queued.
/// Creating a buffer returns at once (the upload is queued on this thread's
/// stream); [`Buffer::to_vec`] waits for every write queued before it.
///
/// Cloning is cheap: clones name the same memory.
///
/// ```
/// use cohort_comm::{Buffer, Error};
/// use cohort_runtime::{CpuRuntime, Runtime};
///
/// fn main() -> Result<(), Error> {
///     let client = CpuRuntime::client(0)?;
///     let x = Buffer::from_slice(&client, &[1.0f32, 2.0, 3.0])?;
///     let zeros = Buffer::<u32>::zeros(&client, 4)?;
///     assert_eq!(x.len(), 3);
///     assert_eq!(x.to_vec()?, [1.0, 2.0, 3.0]);
///     assert_eq!(zeros.to_vec()?, [0, 0, 0, 0]);
///     Ok(())
/// }
/// ```
pub struct Buffer<T: Element> {
    client: Client,
    handle: Handle,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T: Element> Clone for Buffer<T> {
    fn clone(&self) -> Self {
        Buffer { client: self.client.clone(), handle: self.handle.clone(), len: self.len, _element: PhantomData }
    }
}

impl<T: Element> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer<{}>[{}] on {}", T::DTYPE, self.len, self.client.device_id())
    }
}

/// Bytes of `len` elements of `T`, or why that is not a size.
pub(super) fn byte_len<T: Element>(len: usize) -> Result<usize, Error> {
    len.checked_mul(std::mem::size_of::<T>()).filter(|b| *b <= isize::MAX as usize).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "a buffer of {len} {} elements is larger than memory can address; ask for fewer elements",
            T::DTYPE
        ))
    })
}

impl<T: Element> Buffer<T> {
    /// A buffer of `len` zeros on `client`'s device. Returns once the zeros
    /// are queued for upload.
    pub fn zeros(client: &Client, len: usize) -> Result<Buffer<T>, Error> {
        let bytes = byte_len::<T>(len)?;
        let handle = client.create(Bytes::zeroed(bytes));
        Ok(Buffer::wrap(client, handle, len))
    }

    /// A buffer holding a copy of `data` on `client`'s device. Returns once
    /// the upload is queued.
    pub fn from_slice(client: &Client, data: &[T]) -> Result<Buffer<T>, Error> {
        byte_len::<T>(data.len())?;
        let handle = client.create(Bytes::from_elems(data));
        Ok(Buffer::wrap(client, handle, data.len()))
    }

    /// A buffer of `len` elements whose contents are unspecified until
    /// something writes them (a collective's destination, say).
    pub fn uninit(client: &Client, len: usize) -> Result<Buffer<T>, Error> {
        let handle = client.empty(byte_len::<T>(len)?);
        Ok(Buffer::wrap(client, handle, len))
    }

    /// Views `handle`, a buffer of `client`'s device, as elements of `T`.
    /// Refuses a handle of another device and one that is not a whole
    /// number of elements.
    pub fn from_handle(client: &Client, handle: Handle) -> Result<Buffer<T>, Error> {
        client.check_owned(&handle)?;
        let size = std::mem::size_of::<T>() as u64;
        if !handle.size().is_multiple_of(size) {
            return Err(Error::InvalidArgument(format!(
                "a handle of {} bytes is not a whole number of {} elements ({size} bytes each)",
                handle.size(),
                T::DTYPE
            )));
        }
        let len = (handle.size() / size) as usize;
        Ok(Buffer::wrap(client, handle, len))
    }

    pub(super) fn wrap(client: &Client, handle: Handle, len: usize) -> Buffer<T> {
        Buffer { client: client.clone(), handle, len, _element: PhantomData }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The client of the device that holds it.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The untyped runtime handle beneath (for kernels and the runtime's
    /// calls).
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The untyped runtime handle, consuming the buffer.
    pub fn into_handle(self) -> Handle {
        self.handle
    }

    /// Elements `range` of this buffer, naming the same memory.
    pub fn slice(&self, range: Range<usize>) -> Result<Buffer<T>, Error> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument(format!(
                "elements {}..{} are not inside a buffer of {} elements",
                range.start, range.end, self.len
            )));
        }
        let size = std::mem::size_of::<T>() as u64;
        let handle = self.handle.slice(range.start as u64 * size, (range.end - range.start) as u64 * size)?;
        Ok(Buffer::wrap(&self.client, handle, range.end - range.start))
    }

    /// Overwrites the whole buffer with `data` (queued on this thread's
    /// stream; returns at once). `data` must hold exactly `len()` elements.
    pub fn write(&self, data: &[T]) -> Result<(), Error> {
        if data.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "writing {} elements into a buffer of {}; pass exactly as many elements as the buffer holds",
                data.len(),
                self.len
            )));
        }
        Ok(self.client.write(&self.handle, Bytes::from_elems(data))?)
    }

    /// The buffer's elements, read back to the host. Waits for the work
    /// queued before it that writes the buffer; a failed write, launch or
    /// collective returns its error here.
    pub fn to_vec(&self) -> Result<Vec<T>, Error> {
        Ok(self.client.read_one(self.handle.clone())?.to_elems())
    }
}

/// The handles beneath `buffers`, in order.
pub(crate) fn handles<T: Element>(buffers: &[Buffer<T>]) -> crate::CallHandles {
    buffers.iter().map(|b| b.handle.clone()).collect()
}
