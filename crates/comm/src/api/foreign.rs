//! [`Buffer<T>`] over memory cohort did not allocate: a `Vec` or any value
//! that holds a slice, a borrowed slice for the length of a closure, raw
//! host or CUDA pointers, cudarc's `CudaSlice<T>`, a `wgpu::Buffer` of an
//! adopted device, and DLPack tensors both ways.
//!
//! Every constructor is zero-copy: the buffer names the caller's memory
//! itself (the runtime's `Client::adopt`), so collectives read and write it
//! in place. Whatever keeps the memory alive (the `Vec`, the `CudaSlice`,
//! a DLPack deleter) is held by cohort until the last clone of the buffer
//! is gone *and* the work queued on it has finished; then it is dropped
//! (by the drop of the last clone, on its thread, where the device is idle
//! and that work is over, else on the device's thread), or handed back by
//! [`Buffer::into_owner`]. A
//! refusal (memory of another device, a pointer not aligned for `T`, a
//! length past what memory can address) is an error before anything is
//! queued, and loses nothing: a [`Refused`] that gives back what the call
//! took (the `Vec`, the owner, the `CudaSlice`, the `wgpu::Buffer`),
//! untouched. A refused DLPack tensor is the exception DLPack asks for: its
//! deleter runs (the producer's memory stays the producer's).
//!
//! On the CPU, host memory must start at a 16-byte boundary (every
//! allocator gives a `Vec` one; a sub-slice at another offset is refused:
//! the host engine views memory as elements of any type in place) and hold
//! at least one element (an empty `Vec` is refused: there is nothing to
//! share; make an empty cohort buffer instead).

use std::any::Any;
use std::fmt;

use cohort_runtime::{dlpack, Access, Client, ForeignMemory};

use super::buffer::byte_len;
use super::{Buffer, Error};
use crate::ops::Element;

impl<T: Element> Buffer<T> {
    /// A buffer over `data`'s own memory, no copy: collectives read and
    /// write the `Vec`'s elements in place. [`Buffer::into_vec`] gives the
    /// `Vec` back (the same allocation); dropping every clone of the buffer
    /// drops it once the work queued on it has finished.
    ///
    /// Host memory: a client of a CPU device only (another device's client
    /// refuses it, naming both). A refusal gives `data` back untouched
    /// ([`Refused::into_inner`]).
    ///
    /// ```
    /// use cohort_comm::{Buffer, ClientGroup, Collectives, Error, ReduceOp};
    /// use cohort_runtime::{CpuRuntime, Runtime};
    ///
    /// fn main() -> Result<(), Error> {
    ///     let group = ClientGroup::new(vec![CpuRuntime::client(0)?])?;
    ///     let grads = vec![Buffer::from_vec(&group.clients()[0], vec![1.0f32, 2.0, 3.0])?];
    ///     group.all_reduce(&grads, &grads, ReduceOp::Sum)?;
    ///     let back: Vec<f32> = grads.into_iter().next().unwrap().into_vec()?; // waits for the all-reduce
    ///     assert_eq!(back, [1.0, 2.0, 3.0]);
    ///     Ok(())
    /// }
    /// ```
    pub fn from_vec(client: &Client, data: Vec<T>) -> Result<Buffer<T>, Refused<Vec<T>>> {
        Buffer::adopt_owner(client, data)
    }

    /// A buffer over the elements `owner` holds (`owner.as_mut()`, taken
    /// once), no copy; cohort keeps `owner` until the buffer's last clone
    /// is gone and its queued work has finished, or until
    /// [`Buffer::into_owner`] gives it back. `Vec<T>`, `Box<[T]>`, arrays
    /// and any type that holds its elements at a fixed place will do.
    ///
    /// Host memory: a client of a CPU device only. A refusal gives `owner`
    /// back untouched.
    pub fn adopt_owner<O>(client: &Client, owner: O) -> Result<Buffer<T>, Refused<O>>
    where
        O: AsMut<[T]> + Send + 'static,
    {
        // Boxed first: the elements of an owner that holds them inline (an
        // array) stay where they are when the box moves.
        let mut owner = Box::new(owner);
        let elements = (*owner).as_mut();
        let (ptr, len) = (elements.as_mut_ptr(), elements.len());
        // SAFETY: the memory is the owner's, which moves into cohort with
        // the box (its contents do not move) and is dropped only after the
        // last handle and the work queued on it are gone; nothing else can
        // reach the elements meanwhile (the owner was moved in).
        unsafe { Buffer::adopt_host(client, ptr, len, owner, Access::ReadWrite) }
    }

    /// `len` elements of host memory at `ptr`, no copy, kept valid by
    /// `owner` (any value: the allocation, a guard, `()` where the memory
    /// is static), which cohort drops once the buffer's last clone is gone
    /// and the work queued on it has finished.
    ///
    /// Refused before anything is queued: a null or misaligned `ptr` (an
    /// address not a multiple of `T`'s alignment, or of 16 bytes), no
    /// element, a length past what memory can address, a client that is
    /// not a CPU device's. A refusal gives `owner` back.
    ///
    /// # Safety
    ///
    /// `ptr` must point to `len` initialised elements of `T` that stay
    /// valid, and that nothing but cohort reads or writes while cohort may
    /// use them: until `owner` is dropped (or given back by
    /// [`Buffer::into_owner`]).
    pub unsafe fn from_host_ptr<O: Send + 'static>(
        client: &Client,
        ptr: *mut T,
        len: usize,
        owner: O,
    ) -> Result<Buffer<T>, Refused<O>> {
        // SAFETY: the caller's promise, passed on.
        unsafe { Buffer::adopt_host(client, ptr, len, Box::new(owner), Access::ReadWrite) }
    }

    /// Lends `data` to cohort as a buffer for as long as `body` runs, no
    /// copy, and returns what `body` returned. Before it returns it waits
    /// for the work queued on the buffer (a collective `body` started and
    /// did not wait for) and revokes the buffer: a clone `body` kept
    /// elsewhere fails with an error from then on, never touching `data`.
    /// `data` holds the results when it returns.
    ///
    /// Host memory: a client of a CPU device only.
    ///
    /// ```
    /// use cohort_comm::{Buffer, ClientGroup, Collectives, Error, ReduceOp};
    /// use cohort_runtime::{CpuRuntime, Runtime};
    ///
    /// fn main() -> Result<(), Error> {
    ///     let group = ClientGroup::new(CpuRuntime::clients()?)?;
    ///     let mut grads: Vec<Vec<f32>> = (0..group.members()).map(|m| vec![m as f32; 4]).collect();
    ///     // One borrowed slice per device, all lent at once.
    ///     fn lend(group: &ClientGroup, rest: &mut [Vec<f32>], lent: Vec<Buffer<f32>>) -> Result<(), Error> {
    ///         match rest.split_first_mut() {
    ///             None => group.all_reduce(&lent, &lent, ReduceOp::Max)?.wait().map_err(Error::from),
    ///             Some((first, rest)) => {
    ///                 let client = &group.clients()[lent.len()];
    ///                 Buffer::with_borrowed(client, first, |buf| {
    ///                     lend(group, rest, lent.iter().cloned().chain([buf.clone()]).collect())
    ///                 })?
    ///             }
    ///         }
    ///     }
    ///     lend(&group, &mut grads, Vec::new())?;
    ///     let top = (group.members() - 1) as f32;
    ///     assert!(grads.iter().all(|g| g == &[top; 4]));
    ///     Ok(())
    /// }
    /// ```
    pub fn with_borrowed<R>(client: &Client, data: &mut [T], body: impl FnOnce(&Buffer<T>) -> R) -> Result<R, Error> {
        // SAFETY: `data` is borrowed mutably for this whole call, and the
        // scope revokes the buffer (waiting for its queued work) before the
        // call returns or unwinds.
        let buffer =
            unsafe { Buffer::adopt_host(client, data.as_mut_ptr(), data.len(), Box::new(()), Access::ReadWrite)? };
        Lent::new(buffer).run(body)
    }

    /// Adopts host memory (`len` elements at `ptr`).
    ///
    /// # Safety
    ///
    /// As [`Buffer::from_host_ptr`], with `owner` keeping the memory valid.
    unsafe fn adopt_host<O: Send + 'static>(
        client: &Client,
        ptr: *mut T,
        len: usize,
        owner: Box<O>,
        access: Access,
    ) -> Result<Buffer<T>, Refused<O>> {
        let bytes = match fits::<T>(ptr as u64, len, "host pointer") {
            Ok(bytes) => bytes,
            Err(error) => return Err(Refused::new(*owner, error)),
        };
        let memory = ForeignMemory::Host { ptr: ptr.cast(), len: bytes };
        // SAFETY: the caller's promise: the memory is valid and left to
        // cohort while `owner` lives.
        unsafe { Buffer::adopt(client, memory, owner, access, len) }
    }

    /// Adopts `memory` (`len` elements) with `owner`, given back on a
    /// refusal.
    ///
    /// # Safety
    ///
    /// As `Client::adopt`.
    unsafe fn adopt<O: Send + 'static>(
        client: &Client,
        memory: ForeignMemory,
        owner: Box<O>,
        access: Access,
        len: usize,
    ) -> Result<Buffer<T>, Refused<O>> {
        // SAFETY: the caller's promise, passed on.
        match unsafe { client.adopt(memory, owner, access) } {
            Ok(handle) => Ok(Buffer::wrap(client, handle, len)),
            Err(refused) => {
                let (error, _, owner) = refused.into_parts();
                let owner = owner.downcast::<O>().expect("adopt gives back the owner it was given");
                Err(Refused::new(*owner, error))
            }
        }
    }

    /// Gives back the owner the buffer was made with
    /// ([`Buffer::adopt_owner`], [`Buffer::from_vec`],
    /// `Buffer::from_cuda_slice`, a raw pointer's owner), as type `O`,
    /// once the work queued on the buffer's device has finished (it
    /// waits). The memory is the caller's again: no copy was made either
    /// way.
    ///
    /// Refused where other clones of the buffer (or slices of it) are
    /// alive, for memory cohort allocated itself, and for an owner of
    /// another type than `O` (the error names `O`): the error gives the
    /// buffer back ([`Refused::into_inner`]), its owner kept, nothing given
    /// up, as `Arc::try_unwrap` does.
    pub fn into_owner<O: Any>(self) -> Result<O, IntoOwnerError<T>> {
        let (client, len) = (self.client().clone(), self.len());
        client
            .reclaim_as::<O>(self.into_handle())
            .map_err(|(handle, error)| Refused::new(Buffer::wrap(&client, handle, len), error))
    }

    /// The `Vec` a buffer made by [`Buffer::from_vec`] holds, the same
    /// allocation (no copy), once the work queued on its device has
    /// finished (it waits). Refused, giving the buffer back, where other
    /// clones of it are alive (see [`Buffer::into_owner`]).
    pub fn into_vec(self) -> Result<Vec<T>, IntoOwnerError<T>> {
        self.into_owner::<Vec<T>>()
    }

    /// A buffer over a DLPack tensor's memory, no copy: PyTorch's, JAX's,
    /// CuPy's, NumPy's or candle's tensor handed over as a
    /// `DLManagedTensorVersioned` ([`dlpack::Versioned`]) or legacy
    /// `DLManagedTensor` ([`dlpack::Legacy`]). The tensor's elements in
    /// row-major order, whatever its shape; its deleter runs once the
    /// buffer's last clone is gone and the work queued on it has finished.
    /// A tensor flagged read-only gives a buffer that collectives refuse as
    /// a destination.
    ///
    /// Refused before anything is queued (the tensor is dropped): an element
    /// type other than `T`'s (the error names both), a tensor of another
    /// device than `client`'s, strides that are not compact row-major, a
    /// `byte_offset` that breaks `T`'s alignment, an element type cohort
    /// does not have. The producer's pending work is not waited for: on
    /// CUDA, order cohort after the producer's stream with
    /// [`OnStream`](crate::OnStream).
    pub fn from_dlpack<M>(client: &Client, tensor: dlpack::dlpark::Managed<M>) -> Result<Buffer<T>, Error>
    where
        M: dlpack::dlpark::ManagedTensorBase + 'static,
    {
        let import = dlpack::import(client, tensor)?;
        if import.dtype != T::DTYPE {
            return Err(Error::InvalidArgument(format!(
                "a DLPack tensor of {} elements cannot be a Buffer<{}>: ask for Buffer::<{}>::from_dlpack, or convert \
                 the tensor to {} first",
                import.dtype,
                T::DTYPE,
                import.dtype,
                T::DTYPE
            )));
        }
        let len = import.len();
        Ok(Buffer::wrap(client, import.handle, len))
    }

    /// The buffer as a DLPack 1.x tensor of one dimension (`len()`
    /// elements of `T`), no copy, for PyTorch's `from_dlpack` and the rest:
    /// it holds a clone of the buffer, so the memory stays until the
    /// consumer drops the tensor; a read-only buffer gives a tensor flagged
    /// read-only. Waits for the buffer's memory to be reserved, not for the
    /// work queued on it: sync first ([`Buffer::to_vec`]'s device, or
    /// `Client::sync`), or on CUDA order the consumer's stream after
    /// cohort's ([`Client::signal_external`]). A wgpu buffer is refused
    /// (DLPack cannot carry one), and so is a buffer only lent for a scope
    /// ([`Buffer::with_borrowed`], `with_cuda_slice`, slices of them): the
    /// consumer would keep its address after the borrow ends; export a
    /// buffer that owns its memory ([`Buffer::from_vec`],
    /// `Buffer::from_cuda_slice`).
    pub fn to_dlpack(&self) -> Result<dlpack::Versioned, Error> {
        Ok(dlpack::export(self.client(), self.handle(), T::DTYPE, &[self.len()])?)
    }

    /// Whether this buffer names memory cohort did not allocate.
    pub fn is_foreign(&self) -> bool {
        self.handle().is_foreign()
    }
}

/// A refused call that took a value of the caller's (the `Vec` of
/// [`Buffer::from_vec`], an owner, a `CudaSlice`, a `wgpu::Buffer`; the
/// buffer of [`Buffer::into_owner`]), with that value given back untouched
/// ([`Refused::into_inner`]): nothing is lost, as `Arc::try_unwrap` does.
/// Displays as the error; converts into [`Error`], so `?` works where the
/// value does not matter (it is dropped then).
pub struct Refused<V> {
    value: V,
    /// Boxed: an `Err` as small as the value.
    error: Box<Error>,
}

/// Why [`Buffer::into_owner`] (or [`Buffer::into_vec`]) gave nothing back,
/// with the buffer itself, still cohort's (other clones alive, memory
/// cohort allocated, an owner of another type): use it on, or try again
/// once the clones are gone.
pub type IntoOwnerError<T> = Refused<Buffer<T>>;

impl<V> Refused<V> {
    pub(crate) fn new(value: V, error: impl Into<Error>) -> Refused<V> {
        Refused { value, error: Box::new(error.into()) }
    }

    /// The value the call was given, as it was.
    pub fn into_inner(self) -> V {
        self.value
    }

    /// Why.
    pub fn error(&self) -> &Error {
        &self.error
    }
}

impl<V> fmt::Display for Refused<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<V> fmt::Debug for Refused<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<V> std::error::Error for Refused<V> {}

impl<V> From<Refused<V>> for Error {
    fn from(err: Refused<V>) -> Error {
        *err.error
    }
}

/// A buffer lent for a scope: revoked (after its queued work) when the
/// scope ends, by return or by unwinding.
struct Lent<T: Element> {
    buffer: Option<Buffer<T>>,
}

impl<T: Element> Lent<T> {
    /// Marks the buffer's memory lent for the scope
    /// (`Handle::lend_for_scope`: DLPack export refuses it, whose consumer
    /// would keep its address past the revoke).
    fn new(buffer: Buffer<T>) -> Lent<T> {
        buffer.handle().lend_for_scope();
        Lent { buffer: Some(buffer) }
    }

    /// Runs `body` on the buffer, then revokes it; a failed revoke (a
    /// device that failed the buffer's work) is the error returned.
    fn run<R>(mut self, body: impl FnOnce(&Buffer<T>) -> R) -> Result<R, Error> {
        let out = body(self.buffer.as_ref().expect("lent until revoked"));
        self.revoke()?;
        Ok(out)
    }

    fn revoke(&mut self) -> Result<(), Error> {
        match self.buffer.take() {
            Some(buffer) => Ok(buffer.client().revoke(buffer.handle())?),
            None => Ok(()),
        }
    }
}

impl<T: Element> Drop for Lent<T> {
    /// On unwinding out of the body: the memory must not outlive the
    /// borrow, whatever happened.
    fn drop(&mut self) {
        let _ = self.revoke();
    }
}

/// The bytes of `len` elements of `T` at `address`: refuses a length past
/// what memory can address and a null or misaligned address (`what` names
/// it: "host pointer").
fn fits<T: Element>(address: u64, len: usize, what: &str) -> Result<usize, Error> {
    let bytes = byte_len::<T>(len)?;
    aligned::<T>(address, what)?;
    Ok(bytes)
}

/// Refuses an address that is not a multiple of `T`'s alignment (or null).
pub(crate) fn aligned<T: Element>(address: u64, what: &str) -> Result<(), Error> {
    let align = std::mem::align_of::<T>() as u64;
    if address == 0 || !address.is_multiple_of(align) {
        return Err(Error::InvalidArgument(format!(
            "a {what} at {address:#x} cannot hold {} elements: it must be non-null and a multiple of {align} bytes; \
             pass memory allocated for {} (or offset by whole elements)",
            T::DTYPE,
            T::DTYPE
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use cohort_runtime::backend::cuda::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
    use cohort_runtime::{Access, Client, ExternalStream, ForeignMemory};

    use super::{fits, Buffer, Error, Lent, Refused};
    use crate::ops::Element;

    impl<T: Element> Buffer<T> {
        /// `len` elements of CUDA device memory at `ptr` (a `CUdeviceptr`
        /// in the primary context of `client`'s GPU, cudarc's and
        /// PyTorch's), no copy, kept valid by `owner`, which cohort drops
        /// once the buffer's last clone is gone and the work queued on it
        /// has finished.
        ///
        /// Refused before anything is queued: a null or misaligned `ptr`, a
        /// length past what memory can address, memory of another GPU or
        /// context, a client that is not a CUDA device's. A refusal gives
        /// `owner` back.
        ///
        /// # Safety
        ///
        /// `ptr` must point to `len` elements of `T` of device memory that
        /// stay allocated while `owner` lives, and that nothing but cohort
        /// writes meanwhile unless ordered with cohort's work
        /// ([`OnStream`](crate::OnStream)).
        pub unsafe fn from_device_ptr<O: Send + 'static>(
            client: &Client,
            ptr: u64,
            len: usize,
            owner: O,
        ) -> Result<Buffer<T>, Refused<O>> {
            let bytes = match fits::<T>(ptr, len, "device pointer") {
                Ok(bytes) => bytes,
                Err(error) => return Err(Refused::new(owner, error)),
            };
            let memory = ForeignMemory::Cuda { ptr, len: bytes };
            // SAFETY: the caller's promise.
            unsafe { Buffer::adopt(client, memory, Box::new(owner), Access::ReadWrite, len) }
        }

        /// A buffer over cudarc's `slice`, no copy; cohort holds the slice
        /// until the buffer's last clone is gone and its work has finished
        /// (then cudarc frees it, on its own stream), or until
        /// `into_owner::<CudaSlice<T>>()` gives it back.
        ///
        /// Cohort's work on the buffer starts after the work queued on the
        /// slice's stream before this call (an event, no host wait). Work
        /// queued there later is not ordered with cohort's: order it with
        /// [`OnStream`](crate::OnStream), or wait for the collective.
        ///
        /// Refused as [`Buffer::from_device_ptr`] is (memory of another GPU,
        /// a client that is not a CUDA device's), or where cohort cannot
        /// order on the slice's stream: the slice comes back untouched.
        pub fn from_cuda_slice(client: &Client, slice: CudaSlice<T>) -> Result<Buffer<T>, Refused<CudaSlice<T>>> {
            let stream = slice.stream().clone();
            let (ptr, read) = slice.device_ptr(&stream);
            drop(read);
            let len = slice.len();
            // SAFETY: the slice owns the allocation and moves into cohort as
            // its owner; it is freed only when cohort drops it, after the
            // work queued on the memory.
            let buffer = unsafe { Buffer::from_device_ptr(client, ptr, len, slice)? };
            // Nothing is queued on the buffer yet: its first work follows.
            match client.wait_external(&ExternalStream::from_cudarc(&stream)) {
                Ok(()) => Ok(buffer),
                Err(error) => {
                    // Nothing ran on it: the only handle of memory just
                    // adopted gives its owner back (a closed device too).
                    let slice = buffer.into_owner::<CudaSlice<T>>().expect("the slice just adopted comes back");
                    Err(Refused::new(slice, error))
                }
            }
        }

        /// Lends cudarc's `slice` to cohort as a buffer for as long as
        /// `body` runs, no copy, and returns what `body` returned.
        ///
        /// Cohort's work starts after the work queued on the slice's stream
        /// before the call (an event, no host wait). Before it returns it
        /// waits for the work queued on the buffer and revokes it: a clone
        /// kept elsewhere fails from then on, and the slice's later users
        /// (on any stream) see cohort's results.
        pub fn with_cuda_slice<R>(
            client: &Client,
            slice: &mut CudaSlice<T>,
            body: impl FnOnce(&Buffer<T>) -> R,
        ) -> Result<R, Error> {
            let stream = slice.stream().clone();
            let len = slice.len();
            // Cudarc's own bookkeeping: later users of the slice wait for a
            // write recorded on its stream when `_written` drops, after the
            // revoke below waited for cohort's work.
            let (ptr, _written) = slice.device_ptr_mut(&stream);
            // SAFETY: the slice is borrowed mutably for this whole call, and
            // the scope revokes the buffer (waiting for its queued work)
            // before the call returns or unwinds.
            let buffer = unsafe { Buffer::from_device_ptr(client, ptr, len, ())? };
            let lent = Lent::new(buffer);
            // Nothing is queued on the buffer yet: its first work follows.
            client.wait_external(&ExternalStream::from_cudarc(&stream))?;
            lent.run(body)
        }
    }
}

#[cfg(feature = "wgpu")]
mod wgpu_buffer {
    use cohort_runtime::{Access, Client, ForeignMemory};

    use super::{byte_len, Buffer, Error, Refused};
    use crate::ops::Element;

    impl<T: Element> Buffer<T> {
        /// `len` elements at byte `offset` of `buffer`, a `wgpu::Buffer`
        /// made on the device `client` runs on (one the runtime adopted
        /// with `WgpuRuntime::adopt`), no copy. The buffer is kept (as the
        /// owner: `into_owner::<wgpu::Buffer>()` gives it back) until the
        /// last clone of the returned one is gone and the work queued on it
        /// has finished.
        ///
        /// Refused before anything is queued, the buffer given back: a
        /// buffer of another device, one without the usages collectives
        /// need (`STORAGE`, `COPY_SRC`, `COPY_DST`), an offset not a
        /// multiple of 4 bytes and of `T`'s size, or a range past the
        /// buffer's end.
        pub fn from_wgpu(
            client: &Client,
            buffer: wgpu::Buffer,
            offset: u64,
            len: usize,
        ) -> Result<Buffer<T>, Refused<wgpu::Buffer>> {
            let bytes = match byte_len::<T>(len) {
                Ok(bytes) => bytes,
                Err(error) => return Err(Refused::new(buffer, error)),
            };
            let size = std::mem::size_of::<T>() as u64;
            if !offset.is_multiple_of(size) || !offset.is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT) {
                let error = Error::InvalidArgument(format!(
                    "a wgpu buffer's {} elements cannot start at byte {offset}: the offset must be a multiple of \
                     {size} (the element size) and of {} (wgpu's copy alignment)",
                    T::DTYPE,
                    wgpu::COPY_BUFFER_ALIGNMENT
                ));
                return Err(Refused::new(buffer, error));
            }
            let memory = ForeignMemory::Wgpu { buffer: buffer.clone(), offset, len: bytes as u64 };
            // SAFETY: a wgpu buffer is reference-counted: the clones inside
            // `memory` and the owner keep it alive as long as cohort holds
            // it, and wgpu orders every use of it on its device's queue.
            unsafe { Buffer::adopt(client, memory, Box::new(buffer), Access::ReadWrite, len) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_refused_naming_the_type_and_the_address() {
        let err = aligned::<f32>(0x1002, "host pointer").unwrap_err().to_string();
        assert!(err.contains("0x1002") && err.contains("f32") && err.contains("multiple of 4"), "{err}");
        assert!(aligned::<f32>(0, "host pointer").is_err());
        assert!(aligned::<f32>(0x1004, "host pointer").is_ok());
        assert!(aligned::<u8>(0x1001, "host pointer").is_ok());
    }
}
