//! Creating buffers and moving bytes between the host and a device.

use std::future::Future;

use super::Client;
use crate::bytes::{AlignedBytes, Bytes};
use crate::error::ServerError;
use crate::handle::{pack_rows, unpack_rows, CopyDescriptor, Handle, MemoryLayout, MemoryLayoutDescriptor};
use crate::state::DeviceState;

/// The most bytes a read may take in all to run on the caller's thread
/// (see [`Client::read`]). A larger read goes to the device thread: its
/// host copies may run on rayon's pool, and a caller's thread that holds
/// the device while it waits for them may be a rayon worker, which runs
/// the caller's other jobs meanwhile (a second call for the same device
/// among them, nested inside the first).
pub(crate) const INLINE_READ_MAX: u64 = 64 << 10;

impl Client {
    fn new_handle(&self, size: u64) -> Handle {
        Handle::new_allocation(self.service_id(), self.stream_id(), size)
    }

    /// Reserves memory for `data` and queues its upload; returns at once. A
    /// failed reservation or upload is marked on the handle (reads return it).
    pub fn create(&self, data: Bytes) -> Handle {
        let handle = self.new_handle(data.len() as u64);
        let task_handle = handle.clone();
        let stream = self.stream_id();
        let queued = self.device().submit(stream, move |state| {
            if state.reserve(&task_handle).is_ok() {
                let _ = state.write(stream, &task_handle, &data);
            }
        });
        if let Err(err) = queued {
            handle.set_error(Some(err));
        }
        handle
    }

    /// [`Client::create`] from a slice (one extra host copy).
    pub fn create_from_slice(&self, data: &[u8]) -> Handle {
        self.create(Bytes::from_slice(data))
    }

    /// Reserves `size` uninitialised bytes; returns at once.
    pub fn empty(&self, size: usize) -> Handle {
        let handle = self.new_handle(size as u64);
        let task_handle = handle.clone();
        let queued = self.device().submit(self.stream_id(), move |state| {
            let _ = state.reserve(&task_handle);
        });
        if let Err(err) = queued {
            handle.set_error(Some(err));
        }
        handle
    }

    /// Stores a tensor given as contiguous bytes, in this client's layout
    /// (contiguous, or pitched rows); index it with the returned strides.
    pub fn create_tensor(&self, bytes: Bytes, shape: impl Into<Vec<usize>>, elem_size: usize) -> MemoryLayout {
        let descriptor = MemoryLayoutDescriptor::new(shape, elem_size);
        self.create_tensors(vec![(descriptor, bytes)]).pop().expect("one tensor in, one out")
    }

    /// [`Client::create_tensor`] from a slice.
    pub fn create_tensor_from_slice(
        &self,
        data: &[u8],
        shape: impl Into<Vec<usize>>,
        elem_size: usize,
    ) -> MemoryLayout {
        self.create_tensor(Bytes::from_slice(data), shape, elem_size)
    }

    /// Stores several tensors in one reservation, each at an aligned offset.
    /// Data whose length does not match its shape marks that tensor's handle.
    pub fn create_tensors(&self, tensors: Vec<(MemoryLayoutDescriptor, Bytes)>) -> Vec<MemoryLayout> {
        let (descriptors, data): (Vec<_>, Vec<_>) = tensors.into_iter().unzip();
        let layouts = self.empty_tensors(descriptors);
        for (layout, bytes) in layouts.iter().zip(data) {
            let expected = layout.shape.iter().product::<usize>() * layout.elem_size;
            if bytes.len() != expected {
                layout.handle.set_error(Some(ServerError::InvalidArgument(format!(
                    "tensor of shape {:?} × {} bytes needs {expected} bytes of data, got {}",
                    layout.shape,
                    layout.elem_size,
                    bytes.len()
                ))));
                continue;
            }
            let packed =
                pack_rows(&bytes, &layout.shape, &layout.strides, layout.elem_size, layout.handle.size() as usize);
            if let Err(err) = self.write(&layout.handle, Bytes::from(packed)) {
                layout.handle.set_error(Some(err));
            }
        }
        layouts
    }

    /// Reserves an uninitialised tensor in this client's layout.
    pub fn empty_tensor(&self, shape: impl Into<Vec<usize>>, elem_size: usize) -> MemoryLayout {
        self.empty_tensors(vec![MemoryLayoutDescriptor::new(shape, elem_size)]).pop().expect("one tensor in, one out")
    }

    /// Reserves several tensors in one allocation.
    pub fn empty_tensors(&self, descriptors: Vec<MemoryLayoutDescriptor>) -> Vec<MemoryLayout> {
        const ALIGN: usize = 256;
        let mut offsets = Vec::with_capacity(descriptors.len());
        let mut total = 0usize;
        let mut laid_out = Vec::with_capacity(descriptors.len());
        for descriptor in &descriptors {
            let (strides, bytes) = self.layout.layout(&descriptor.shape, descriptor.elem_size);
            total = total.div_ceil(ALIGN) * ALIGN;
            offsets.push(total);
            total += bytes;
            laid_out.push((strides, bytes));
        }
        let base = self.empty(total);
        descriptors
            .into_iter()
            .zip(offsets)
            .zip(laid_out)
            .map(|((descriptor, offset), (strides, bytes))| MemoryLayout {
                handle: base.slice(offset as u64, bytes as u64).expect("the layout fits its allocation"),
                shape: descriptor.shape,
                strides,
                elem_size: descriptor.elem_size,
            })
            .collect()
    }

    /// Overwrites `handle` in place (same device memory) with `data`, ordered
    /// after earlier work on this stream. Returns at once; refuses a foreign
    /// handle or data of the wrong size before queueing anything.
    pub fn write(&self, handle: &Handle, data: Bytes) -> Result<(), ServerError> {
        self.check_owned(handle)?;
        handle.check_writable("a write")?;
        if data.len() as u64 != handle.size() {
            return Err(ServerError::InvalidArgument(format!(
                "write of {} bytes into a handle of {} bytes",
                data.len(),
                handle.size()
            )));
        }
        self.refuse_if_capturing("write")?;
        let handle = handle.clone();
        let stream = self.stream_id();
        self.device().submit(stream, move |state| {
            let _ = state.write(stream, &handle, &data);
        })
    }

    /// Reads handles to the host, after the work that writes them; waits.
    /// Returns the error marked on any of them. Where the device is idle
    /// (nothing queued or running on its thread) and the read is small
    /// (64 KiB in all, `INLINE_READ_MAX`), the calling thread makes the copy
    /// and waits for it itself, with no hand-over to the device thread and
    /// back.
    pub fn read(&self, handles: Vec<Handle>) -> Result<Vec<Bytes>, ServerError> {
        for handle in &handles {
            self.check_owned(handle)?;
        }
        self.refuse_if_capturing("read")?;
        let stream = self.stream_id();
        let bytes = handles.iter().map(Handle::size).sum();
        let read = self.run_read(bytes, move |state| state.read(stream, &handles))?;
        Ok(read.into_iter().map(Bytes::from_aligned).collect())
    }

    /// Reads one handle; see [`Client::read`].
    pub fn read_one(&self, handle: Handle) -> Result<Bytes, ServerError> {
        self.check_owned(&handle)?;
        self.refuse_if_capturing("read")?;
        let stream = self.stream_id();
        let mut read = self.run_read(handle.size(), move |state| state.read(stream, std::slice::from_ref(&handle)))?;
        Ok(Bytes::from_aligned(read.pop().expect("one handle in, one read out")))
    }

    /// Runs a read of `bytes` in all on this client's stream: on the
    /// calling thread where the device is idle and the read small
    /// ([`INLINE_READ_MAX`]), else on the device thread; waits.
    fn run_read(
        &self,
        bytes: u64,
        read: impl FnOnce(&mut DeviceState) -> Result<Vec<AlignedBytes>, ServerError> + Send,
    ) -> Result<Vec<AlignedBytes>, ServerError> {
        let stream = self.stream_id();
        match bytes <= INLINE_READ_MAX {
            true => self.device().run_inline_or_wait(stream, read)?,
            false => self.device().run(stream, read)?,
        }
    }

    /// Reads one handle and panics with the cause when that fails (for tests).
    pub fn read_one_unchecked(&self, handle: Handle) -> Bytes {
        match self.read_one(handle) {
            Ok(bytes) => bytes,
            Err(err) => panic!("read failed: {err}"),
        }
    }

    /// Queues a read and returns a future of its bytes; the calling thread does
    /// not wait.
    pub fn read_async(&self, handles: Vec<Handle>) -> impl Future<Output = Result<Vec<Bytes>, ServerError>> + Send {
        let (tx, rx) = futures_channel::oneshot::channel::<Result<Vec<AlignedBytes>, ServerError>>();
        let checked =
            handles.iter().try_for_each(|h| self.check_owned(h)).and_then(|()| self.refuse_if_capturing("read_async"));
        let device = self.device_id();
        let queued = checked.and_then(|()| {
            let stream = self.stream_id();
            self.device().submit(stream, move |state| {
                let _ = tx.send(state.read(stream, &handles));
            })
        });
        async move {
            queued?;
            let bytes = rx.await.map_err(|_| ServerError::DeviceClosed { device })??;
            Ok(bytes.into_iter().map(Bytes::from_aligned).collect())
        }
    }

    /// Reads tensors, returning each as contiguous bytes. Only the last
    /// dimension may be padded (as this runtime lays tensors out).
    pub fn read_tensor(&self, descriptors: Vec<CopyDescriptor>) -> Result<Vec<Bytes>, ServerError> {
        let handles = descriptors.iter().map(|d| d.handle.clone()).collect();
        let raw = self.read(handles)?;
        descriptors
            .iter()
            .zip(raw)
            .map(|(d, bytes)| unpack_rows(&bytes, &d.shape, &d.strides, d.elem_size).map(Bytes::from))
            .collect()
    }

    /// A tensor read whose copy runs on first access of the returned bytes,
    /// keeping the source buffer alive until then. Do not change the buffer in
    /// between: the bytes reflect the device at first access.
    pub fn read_lazy(&self, descriptor: CopyDescriptor) -> Bytes {
        let client = self.clone();
        Bytes::lazy(Box::new(move || {
            let bytes = client.read_tensor(vec![descriptor])?.pop().expect("one tensor in, one out");
            bytes.into_aligned()
        }))
    }

    /// Copies `src` to a new buffer of `dst`'s device, through the host; waits
    /// for the read. Works between devices of any runtimes.
    pub fn to_client(&self, src: &Handle, dst: &Client) -> Result<Handle, ServerError> {
        let bytes = self.read_one(src.clone())?;
        Ok(dst.create(bytes))
    }

    /// Marks host bytes as staging memory for faster uploads: backends with
    /// pinned host memory (CUDA) move them there, one host copy now so that
    /// later uploads of them copy straight from the host by DMA; elsewhere, or
    /// when the backend has no pinned memory to spare, this does nothing.
    /// Waits for one device task per buffer.
    pub fn staging<'a>(&self, bytes: impl Iterator<Item = &'a mut Bytes>) {
        let stream = self.stream_id();
        for item in bytes {
            if item.is_backend_memory() {
                continue;
            }
            let Ok(source) = item.try_get() else { continue };
            let len = source.len();
            if len == 0 {
                continue;
            }
            let Ok(Some(mut pinned)) = self.device().run(stream, move |state| state.backend.staging_memory(len)) else {
                continue;
            };
            pinned.as_mut_slice().copy_from_slice(source);
            *item = Bytes::from_aligned(pinned);
        }
    }
}
