#![allow(dead_code)]

//! Raw NCCL through cudarc, the baseline the benches measure cohort
//! against in the same process: one communicator per device
//! (`ncclCommInitAll`), or this process's one rank of a job
//! (`ncclCommInitRank`), on a stream of its own in the device's primary
//! context. Included by the CUDA examples (`#[path]`), not an example
//! itself.

use cohort::comm::op::Collective;
use cohort::runtime::backend::cuda::cudarc;
use cudarc::driver::sys;
use cudarc::nccl::sys as nccl;

pub fn ok(code: sys::CUresult, what: &str) -> Result<(), String> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}"))
    }
}

pub fn nok(code: nccl::ncclResult_t, what: &str) -> Result<(), String> {
    if code == nccl::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}"))
    }
}

/// Raw NCCL on `n` devices from this thread: one communicator each
/// (`ncclCommInitAll`), a stream and two buffers each in the device's
/// primary context.
pub struct Raw {
    /// One event per device, recorded after every call (`--raw-events`).
    pub events: Option<Vec<sys::CUevent>>,
    pub ctxs: Vec<sys::CUcontext>,
    pub comms: Vec<nccl::ncclComm_t>,
    pub streams: Vec<sys::CUstream>,
    /// Each device's source and destination, of the `bytes` asked for.
    pub bufs: Vec<(sys::CUdeviceptr, sys::CUdeviceptr)>,
    /// Ranks of the communicators: the devices here, or the job's ranks.
    pub world: usize,
}

/// Whether cudarc finds libnccl (it panics on a call where it does not).
fn nccl_present() -> Result<(), String> {
    // SAFETY: probing only tries to dlopen cudarc's candidate names.
    if !unsafe { nccl::is_culib_present() } {
        return Err("cudarc finds no libnccl.so (link libnccl.so.2 as libnccl.so on LD_LIBRARY_PATH)".into());
    }
    Ok(())
}

/// A fresh NCCL unique id (rank 0 makes it; every rank of the job passes
/// it to [`Raw::rank`]).
pub fn unique_id() -> Result<[u8; 128], String> {
    nccl_present()?;
    let mut id = nccl::ncclUniqueId { internal: [0; 128] };
    // SAFETY: writes the id into our struct.
    nok(unsafe { nccl::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

impl Raw {
    /// Raw NCCL on the first `n` devices, with buffers of `bytes` (sources
    /// filled with 1.0f32) and, `with_events`, an event per device.
    pub fn new(n: usize, bytes: usize, with_events: bool) -> Result<Raw, String> {
        nccl_present()?;
        let mut raw = Raw::on_devices(0..n, n, bytes, with_events)?;
        let devs: Vec<i32> = (0..n as i32).collect();
        // SAFETY: one communicator slot per device, devices that exist.
        nok(unsafe { nccl::ncclCommInitAll(raw.comms.as_mut_ptr(), n as i32, devs.as_ptr()) }, "ncclCommInitAll")?;
        Ok(raw)
    }

    /// Rank `rank` of a job of `world` ranks on device `device`, its
    /// communicator made from rank 0's `id` (`ncclCommInitRank`: waits for
    /// every rank), with buffers of `bytes`.
    pub fn rank(id: &[u8; 128], rank: usize, world: usize, device: usize, bytes: usize) -> Result<Raw, String> {
        nccl_present()?;
        let mut raw = Raw::on_devices(device..device + 1, world, bytes, false)?;
        let id = nccl::ncclUniqueId { internal: id.map(|b| b as _) };
        // SAFETY: our communicator slot; the device's context is current
        // (made so by `on_devices`).
        let code = unsafe { nccl::ncclCommInitRank(&mut raw.comms[0], world as i32, id, rank as i32) };
        nok(code, "ncclCommInitRank")?;
        Ok(raw)
    }

    /// Streams, buffers (sources filled with 1.0f32) and events on
    /// `devices`, communicators not made yet.
    fn on_devices(
        devices: std::ops::Range<usize>,
        world: usize,
        bytes: usize,
        with_events: bool,
    ) -> Result<Raw, String> {
        let mut raw = Raw {
            events: with_events.then(Vec::new),
            ctxs: Vec::new(),
            comms: vec![std::ptr::null_mut(); devices.len()],
            streams: Vec::new(),
            bufs: Vec::new(),
            world,
        };
        // SAFETY (whole block): plain driver calls on primary contexts
        // retained here, each made current before its device's calls;
        // every result is checked.
        unsafe {
            for i in devices {
                let mut device = 0;
                ok(sys::cuDeviceGet(&mut device, i as i32), "cuDeviceGet")?;
                let mut ctx = std::ptr::null_mut();
                ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "retain")?;
                ok(sys::cuCtxSetCurrent(ctx), "set current")?;
                let mut stream = std::ptr::null_mut();
                ok(sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "stream")?;
                let (mut a, mut b) = (0, 0);
                ok(sys::cuMemAlloc_v2(&mut a, bytes.max(4)), "alloc")?;
                ok(sys::cuMemAlloc_v2(&mut b, bytes.max(4)), "alloc")?;
                // On the NCCL stream, which does not wait for the legacy
                // default one; synchronized before the first call.
                ok(sys::cuMemsetD32Async(a, 1.0f32.to_bits(), bytes.max(4) / 4, stream), "memset")?;
                ok(sys::cuStreamSynchronize(stream), "sync")?;
                if let Some(events) = raw.events.as_mut() {
                    let mut event = std::ptr::null_mut();
                    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                    ok(sys::cuEventCreate(&mut event, flags), "event")?;
                    events.push(event);
                }
                raw.ctxs.push(ctx);
                raw.streams.push(stream);
                raw.bufs.push((a, b));
            }
        }
        Ok(raw)
    }

    /// Queues one `coll` of `bytes` (nccl-tests' size; f32, sum, root 0)
    /// on every device, in one NCCL group, without waiting; records the
    /// events (`with_events`) after it.
    pub fn queue(&self, coll: Collective, bytes: usize) -> Result<(), String> {
        use nccl::ncclDataType_t::ncclFloat32 as F32;
        use nccl::ncclRedOp_t::ncclSum as SUM;
        let n = self.world;
        let (count, block) = (bytes / 4, bytes / 4 / n);
        // SAFETY: communicators, streams and buffers made in `new`, of at
        // least `bytes` bytes each (a block is `bytes / n`); one thread
        // issues every device's calls inside one NCCL group, as NCCL
        // requires; events (`--raw-events`) are ours, recorded in their
        // own contexts.
        unsafe {
            nok(nccl::ncclGroupStart(), "group start")?;
            for i in 0..self.comms.len() {
                let (a, b) = self.bufs[i];
                let (comm, s) = (self.comms[i], self.streams[i] as nccl::cudaStream_t);
                let (src, dst) = (a as *const _, b as *mut _);
                match coll {
                    Collective::AllReduce => {
                        nok(nccl::ncclAllReduce(src, dst, count, F32, SUM, comm, s), "ncclAllReduce")?
                    }
                    Collective::AllGather => nok(nccl::ncclAllGather(src, dst, block, F32, comm, s), "ncclAllGather")?,
                    Collective::ReduceScatter => {
                        nok(nccl::ncclReduceScatter(src, dst, block, F32, SUM, comm, s), "ncclReduceScatter")?
                    }
                    Collective::Broadcast => {
                        nok(nccl::ncclBroadcast(src, dst, count, F32, 0, comm, s), "ncclBroadcast")?
                    }
                    Collective::AllToAll => {
                        for peer in 0..n {
                            let at = (peer * block * 4) as u64;
                            let to = (a + at) as *const _;
                            nok(nccl::ncclSend(to, block, F32, peer as i32, comm, s), "ncclSend")?;
                            nok(nccl::ncclRecv((b + at) as *mut _, block, F32, peer as i32, comm, s), "ncclRecv")?;
                        }
                    }
                    other => return Err(format!("{} has no raw baseline here", other.name())),
                }
            }
            nok(nccl::ncclGroupEnd(), "group end")?;
            for (i, event) in self.events.iter().flatten().enumerate() {
                ok(sys::cuCtxSetCurrent(self.ctxs[i]), "set current")?;
                ok(sys::cuEventRecord(*event, self.streams[i]), "event record")?;
            }
            Ok(())
        }
    }

    /// Waits for every device's stream: `cuStreamSynchronize`, or, `spin`,
    /// `cuStreamQuery` until it is done (as cohort's waiters poll).
    pub fn sync(&self, spin: bool) -> Result<(), String> {
        for (ctx, stream) in self.ctxs.iter().zip(&self.streams) {
            // SAFETY: our context and stream, made in `new`.
            unsafe {
                ok(sys::cuCtxSetCurrent(*ctx), "set current")?;
                if !spin {
                    ok(sys::cuStreamSynchronize(*stream), "sync")?;
                    continue;
                }
                loop {
                    match sys::cuStreamQuery(*stream) {
                        sys::CUresult::CUDA_SUCCESS => break,
                        sys::CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
                        other => return Err(format!("stream query: {other:?}")),
                    }
                }
            }
        }
        Ok(())
    }
}
