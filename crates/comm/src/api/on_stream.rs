//! [`OnStream`]: collectives ordered on streams the caller owns (a
//! `CUstream` of cudarc, candle or PyTorch; the queue of an adopted wgpu
//! device). On CUDA cohort runs its part on the caller's stream itself
//! (`Client::bind_external`), as an NCCL user passes its `cudaStream_t`:
//! no event per call.

use cohort_runtime::{Client, ExternalStream, Handle};

use super::{Collectives, Error};
use crate::device::Transport;
use crate::error::CommError;
use crate::grouped::GroupCall;
use crate::ops::{DType, ReduceOp};
use crate::work::Work;

/// The collectives of `comm` (a [`World`](super::World),
/// [`ClientGroup`](crate::ClientGroup) or
/// [`Communicator`](crate::Communicator)), each ordered on the caller's
/// streams, one per local device (in [`clients`](Collectives::clients)
/// order):
///
/// - **before**: a collective's part on a device starts only after the
///   work the caller queued on that device's stream before the call;
/// - **after**: work the caller queues on the stream after the call
///   returns starts only after the collective's part on that device.
///
/// On CUDA each call binds the calling thread's stream of every local
/// device to the caller's stream ([`Client::bind_external`]: the part is
/// queued on the caller's `CUstream` itself, so both orders are the
/// stream's own), runs the collective, and returns once every part was
/// handed to the driver ([`Client::hand_over`]: at once where the part
/// was queued on the calling thread, as on an idle device; else once the
/// device thread queued it). The binding stays after the call, so the
/// next call on the same streams costs no driver call to order: a compare
/// per device, and on CUDA one `cuEventRecord` after the part (its end,
/// seen before the caller's later work there). It also means the calling
/// thread's other cohort work on those devices (reads, kernels, syncs)
/// goes to the caller's streams from then on, in order with the caller's
/// work, until [`Client::unbind_external`]; a sync then also waits for
/// the caller's earlier work there. The first call on a stream, and one
/// after another stream was bound, makes the caller's stream wait (an
/// event) for what cohort queued on the device's stream before. A stream
/// inside a capture (cohort's or its owner's) is refused before anything
/// is queued, as a stream of another context or device is.
///
/// On a wgpu device the stream is its queue (`ExternalStream::WgpuQueue`)
/// and nothing is bound: cohort's part is submitted before the call
/// returns ([`Client::signal_external`]), so the caller's later
/// submissions run after it, and the caller's earlier ones ran before
/// (one queue, in order). A backend without such streams (the CPU)
/// refuses the call before anything is queued.
///
/// No call syncs a device. Every other behaviour is `comm`'s: each call
/// returns its [`Work`] at once, and waiting on it or reading a
/// destination through cohort works as without streams.
///
/// ```no_run
/// # #[cfg(feature = "cuda")]
/// # fn main() -> Result<(), cohort_comm::Error> {
/// use cohort_comm::{rank_clients, Buffer, Collectives, OnStream, ReduceOp, World};
/// use cohort_runtime::backend::cuda::cudarc::driver::CudaContext;
/// use cohort_runtime::ExternalStream;
///
/// let world = World::join(rank_clients("cuda", Some(1))?)?;
/// let ctx = CudaContext::new(0).expect("a GPU");
/// let stream = ctx.new_stream().expect("a stream");
/// let mut grads = stream.alloc_zeros::<f32>(1 << 20).expect("memory");
/// // ... the caller's kernels write `grads` on `stream` ...
/// let on_stream = OnStream::new(&world, &[ExternalStream::from_cudarc(&stream)])?;
/// Buffer::with_cuda_slice(&world.clients()[0], &mut grads, |g| {
///     on_stream.all_reduce(std::slice::from_ref(g), std::slice::from_ref(g), ReduceOp::Avg)
/// })??;
/// // ... the caller's kernels on `stream` now see the average ...
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "cuda"))]
/// # fn main() {}
/// ```
#[derive(Debug, Clone)]
pub struct OnStream<'a, C: Collectives + ?Sized> {
    comm: &'a C,
    streams: Vec<ExternalStream>,
}

impl<'a, C: Collectives + ?Sized> OnStream<'a, C> {
    /// `comm`'s collectives ordered on `streams`, one per local device of
    /// `comm`; a count that differs is refused. Cheap: nothing is queued
    /// until a call.
    pub fn new(comm: &'a C, streams: &[ExternalStream]) -> Result<OnStream<'a, C>, Error> {
        let devices = comm.clients().len();
        if streams.len() != devices {
            return Err(Error::InvalidArgument(format!(
                "OnStream: {} streams for {devices} local devices; pass one stream per device, in clients() order",
                streams.len()
            )));
        }
        Ok(OnStream { comm, streams: streams.to_vec() })
    }

    /// The collectives beneath.
    pub fn inner(&self) -> &'a C {
        self.comm
    }

    /// The caller's streams, one per local device.
    pub fn streams(&self) -> &[ExternalStream] {
        &self.streams
    }

    /// `call` on the caller's streams: before it, each local device's
    /// stream for this thread is bound to its caller's stream (CUDA; a
    /// no-op when bound already) or waits for it (wgpu, the CPU's
    /// refusal); after it, each part is handed to the driver (CUDA) or
    /// submitted (wgpu). A refused call queues nothing but the bindings
    /// (they only order, and are harmless).
    fn ordered(
        &self,
        operation: &'static str,
        call: impl FnOnce() -> Result<Work, CommError>,
    ) -> Result<Work, CommError> {
        let first = self.comm.first_member();
        let each = |before: bool| {
            for (slot, (client, stream)) in self.comm.clients().iter().zip(&self.streams).enumerate() {
                let done = match (before, binds(stream)) {
                    (true, true) => client.bind_external(stream),
                    (true, false) => client.wait_external(stream),
                    (false, true) => client.hand_over(),
                    (false, false) => client.signal_external(stream),
                };
                done.map_err(|source| CommError::Enqueue {
                    operation,
                    member: first + slot,
                    device: client.device_id(),
                    source,
                })?;
            }
            Ok::<(), CommError>(())
        };
        each(true)?;
        let work = call()?;
        each(false)?;
        Ok(work)
    }
}

/// Whether cohort binds its stream to `stream` (a CUDA stream) rather
/// than ordering with it by a wait before and a signal after (a wgpu
/// queue; anything a backend refuses, refused by the wait).
fn binds(stream: &ExternalStream) -> bool {
    #[cfg(feature = "cuda")]
    if matches!(stream, ExternalStream::Cuda(_)) {
        return true;
    }
    let _ = stream;
    false
}

impl<C: Collectives + ?Sized> Collectives for OnStream<'_, C> {
    fn clients(&self) -> &[Client] {
        self.comm.clients()
    }
    fn members(&self) -> usize {
        self.comm.members()
    }
    fn first_member(&self) -> usize {
        self.comm.first_member()
    }
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn transport(&self) -> Transport {
        self.comm.transport()
    }
    /// `comm`'s sync: waits on the host for cohort's streams (not the
    /// caller's).
    fn sync(&self) -> Result<(), CommError> {
        self.comm.sync()
    }
    /// `comm`'s barrier: the host waits; nothing is ordered on the streams.
    fn barrier(&self) -> Result<(), CommError> {
        self.comm.barrier()
    }
    fn all_reduce_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        self.ordered("all_reduce", || self.comm.all_reduce_handles(src, dst, dtype, op))
    }
    fn reduce_handles(
        &self,
        src: &[Handle],
        dst: &Handle,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work, CommError> {
        self.ordered("reduce", || self.comm.reduce_handles(src, dst, dtype, op, root))
    }
    fn broadcast_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        self.ordered("broadcast", || self.comm.broadcast_handles(src, dst, dtype, root))
    }
    fn all_gather_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        self.ordered("all_gather", || self.comm.all_gather_handles(src, dst, dtype))
    }
    fn reduce_scatter_handles(
        &self,
        src: &[Handle],
        dst: &[Handle],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        self.ordered("reduce_scatter", || self.comm.reduce_scatter_handles(src, dst, dtype, op))
    }
    fn all_to_all_handles(&self, src: &[Handle], dst: &[Handle], dtype: DType) -> Result<Work, CommError> {
        self.ordered("all_to_all", || self.comm.all_to_all_handles(src, dst, dtype))
    }
    fn gather_handles(&self, src: &[Handle], dst: &Handle, dtype: DType, root: usize) -> Result<Work, CommError> {
        self.ordered("gather", || self.comm.gather_handles(src, dst, dtype, root))
    }
    fn scatter_handles(&self, src: &Handle, dst: &[Handle], dtype: DType, root: usize) -> Result<Work, CommError> {
        self.ordered("scatter", || self.comm.scatter_handles(src, dst, dtype, root))
    }
    fn send_recv_members(
        &self,
        from: usize,
        src: Option<&Handle>,
        to: usize,
        dst: Option<&Handle>,
        dtype: DType,
    ) -> Result<Work, CommError> {
        self.ordered("send_recv", || self.comm.send_recv_members(from, src, to, dst, dtype))
    }
    fn group_handles(&self, calls: Vec<GroupCall>) -> Result<Work, CommError> {
        self.ordered("group", || self.comm.group_handles(calls))
    }
}
