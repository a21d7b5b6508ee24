//! [`OnStream`]: collectives ordered on streams the caller owns (a
//! `CUstream` of cudarc, candle or PyTorch; the queue of an adopted wgpu
//! device), as NCCL users order them with `cudaStreamWaitEvent`.

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
///   work the caller queued on that device's stream before the call (an
///   event recorded there, waited on by cohort's stream on the device; the
///   host does not wait);
/// - **after**: work the caller queues on the stream after the call
///   returns starts only after the collective's part on that device (an
///   event recorded on cohort's stream, waited on by the caller's).
///
/// No call syncs a device. Every other behaviour is `comm`'s: each call
/// returns its [`Work`] at once, and waiting on it or reading a
/// destination through cohort works as without streams. On a wgpu device
/// the stream is its queue (`ExternalStream::WgpuQueue`): cohort's part
/// is submitted before the call returns, so the caller's later
/// submissions run after it. A backend without such streams (the CPU)
/// refuses the call before anything is queued.
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

    /// `call` between the caller's streams: every local device's stream
    /// for this thread first waits for its caller's stream, and once
    /// `call` has queued its parts every caller's stream waits for
    /// cohort's. A refused call queues nothing but the first waits (they
    /// only order, and are harmless).
    fn ordered(
        &self,
        operation: &'static str,
        call: impl FnOnce() -> Result<Work, CommError>,
    ) -> Result<Work, CommError> {
        let first = self.comm.first_member();
        let each = |f: fn(&Client, &ExternalStream) -> Result<(), cohort_runtime::ServerError>| {
            for (slot, (client, stream)) in self.comm.clients().iter().zip(&self.streams).enumerate() {
                f(client, stream).map_err(|source| CommError::Enqueue {
                    operation,
                    member: first + slot,
                    device: client.device_id(),
                    source,
                })?;
            }
            Ok::<(), CommError>(())
        };
        each(Client::wait_external)?;
        let work = call()?;
        each(Client::signal_external)?;
        Ok(work)
    }
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
