//! Peer access between CUDA devices of one process, and peer copies.
//!
//! A peer copy is two halves on two device threads: the sender records an
//! event after the work that wrote the source (`export`), the receiver makes
//! its stream wait on that event and copies device to device on it
//! (`cuMemcpyAsync` with unified addresses: straight over NVLink or PCIe
//! where peer access is enabled, staged by the driver otherwise) and records
//! a completion event (`import`), which the sender's stream waits on
//! (`finish`) so the source is not overwritten before it is read. Neither
//! half blocks the host. Each event is destroyed by the side that waits on
//! it, right after queueing the wait (the driver frees it once it fired).

use cudarc::driver::sys;

use super::driver::{device_id, driver_error, BACKEND};
use super::CudaBackend;
use crate::backend::{Binding, PeerToken};
use crate::error::ServerError;
use crate::id::{DeviceId, StreamId};

fn check(device: DeviceId, call: &str, code: sys::CUresult) -> Result<(), ServerError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(device, call, code))
    }
}

/// The driver's handle of the GPU that device `index` runs on.
fn raw_device(device: DeviceId, index: u32) -> Result<sys::CUdevice, ServerError> {
    let gpu = super::driver::gpu_of(index as usize)?;
    let mut raw: sys::CUdevice = 0;
    // SAFETY: the driver is initialised (a backend exists); writes one int.
    check(device, "cuDeviceGet", unsafe { sys::cuDeviceGet(&mut raw, gpu as i32) })?;
    Ok(raw)
}

/// Whether `backend`'s device can address `peer`'s memory: always where
/// both are shown on one GPU (`COHORT_CUDA_DEVICES`), which is one memory.
pub(crate) fn can_access(backend: &mut CudaBackend, peer: DeviceId) -> bool {
    if peer.type_id != DeviceId::CUDA {
        return false;
    }
    if peer == backend.device || super::driver::gpu_of(peer.index as usize).is_ok_and(|gpu| gpu == backend.gpu) {
        return true;
    }
    let Ok(other) = raw_device(backend.device, peer.index) else { return false };
    let mut answer = 0;
    // SAFETY: two valid devices; writes one int.
    let code = unsafe { sys::cuDeviceCanAccessPeer(&mut answer, backend.raw_device, other) };
    code == sys::CUresult::CUDA_SUCCESS && answer == 1
}

/// Enables access to this device's memory from every device that can reach
/// it (in each peer GPU's primary context, once per GPU); returns those
/// devices. Devices shown on this device's own GPU share its context and
/// reach its memory already.
pub(crate) fn share(backend: &mut CudaBackend) -> Result<Vec<DeviceId>, ServerError> {
    backend.check_lost()?;
    if let Some(shared) = &backend.nccl.shared {
        return Ok(shared.clone());
    }
    let device = backend.device;
    let count = super::driver::device_count()?;
    let mut own: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the task's thread (the device thread, or a caller's made
    // ready by `enter_caller`) has this device's context current.
    check(device, "cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut own) })?;
    let mut reached = Vec::new();
    let mut enabled_gpus = Vec::new();
    for index in 0..count as u32 {
        if index == device.index {
            continue;
        }
        let gpu = super::driver::gpu_of(index as usize)?;
        if gpu == backend.gpu || enabled_gpus.contains(&gpu) {
            reached.push(device_id(index as usize));
            continue;
        }
        let other = raw_device(device, index)?;
        let mut answer = 0;
        // SAFETY: valid devices; writes one int.
        check(device, "cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut answer, other, backend.raw_device)
        })?;
        if answer != 1 {
            continue;
        }
        // SAFETY: the peer's primary context is retained for the call and
        // released after; it is current on this thread only between the push
        // and the pop, and our own context is current again afterwards.
        unsafe {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check(device, "cuDevicePrimaryCtxRetain (peer)", sys::cuDevicePrimaryCtxRetain(&mut ctx, other))?;
            let pushed = sys::cuCtxPushCurrent_v2(ctx);
            let enabled = if pushed == sys::CUresult::CUDA_SUCCESS {
                let code = sys::cuCtxEnablePeerAccess(own, 0);
                let mut popped: sys::CUcontext = std::ptr::null_mut();
                let _ = sys::cuCtxPopCurrent_v2(&mut popped);
                code
            } else {
                pushed
            };
            let _ = sys::cuDevicePrimaryCtxRelease_v2(other);
            if enabled != sys::CUresult::CUDA_SUCCESS
                && enabled != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(driver_error(device, "cuCtxEnablePeerAccess", enabled));
            }
        }
        enabled_gpus.push(gpu);
        reached.push(device_id(index as usize));
    }
    tracing::debug!(%device, peers = ?reached, "peer access enabled");
    backend.nccl.shared = Some(reached.clone());
    Ok(reached)
}

fn record(backend: &mut CudaBackend, stream: sys::CUstream) -> Result<sys::CUevent, ServerError> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: context current; the new event is recorded on a live stream.
    unsafe {
        check(backend.device, "cuEventCreate (peer)", sys::cuEventCreate(&mut event, flags))?;
        let code = sys::cuEventRecord(event, stream);
        if code != sys::CUresult::CUDA_SUCCESS {
            let _ = sys::cuEventDestroy_v2(event);
            return Err(driver_error(backend.device, "cuEventRecord (peer)", code));
        }
    }
    Ok(event)
}

/// Waits (on the device) for a token's event on `stream`, then destroys it.
fn consume(backend: &mut CudaBackend, stream: sys::CUstream, token: &PeerToken) -> Result<(), ServerError> {
    let event = token.event as usize as sys::CUevent;
    // SAFETY: the event was created by the token's sender and is destroyed
    // only here, once; the wait keeps the state it saw, and the driver frees
    // the event after it fired.
    unsafe {
        let code = sys::cuStreamWaitEvent(stream, event, 0);
        let _ = sys::cuEventDestroy_v2(event);
        check(backend.device, "cuStreamWaitEvent (peer)", code)
    }
}

/// The sender's half: `src`'s address and an event after its writers.
/// Enables peer access to this device's memory first (once): without it the
/// receiver's copy still works through unified addressing, but the driver
/// stages it through host memory (37 GB/s measured between two NVLinked
/// H200s, where a peer copy should run at NVLink speed).
pub(crate) fn export(backend: &mut CudaBackend, stream: StreamId, src: Binding) -> Result<PeerToken, ServerError> {
    backend.check_lost()?;
    share(backend)?;
    let address = backend.pages.ptr(src)?;
    let raw = backend.raw_stream(stream)?;
    let event = record(backend, raw)?;
    Ok(PeerToken { device: backend.device, address, size: src.size, event: event as usize as u64 })
}

/// The receiver's half: waits for the sender's event, copies, and returns
/// a token for the copy's completion.
pub(crate) fn import(
    backend: &mut CudaBackend,
    stream: StreamId,
    from: &PeerToken,
    dst: Binding,
) -> Result<PeerToken, ServerError> {
    backend.check_lost()?;
    if from.device.type_id != DeviceId::CUDA {
        return Err(ServerError::Unsupported { feature: "peer copies from another backend", backend: BACKEND });
    }
    if from.size != dst.size {
        return Err(ServerError::InvalidArgument(format!(
            "a peer copy of {} bytes into {} bytes",
            from.size, dst.size
        )));
    }
    let to = backend.pages.ptr(dst)?;
    let raw = backend.raw_stream(stream)?;
    consume(backend, raw, from)?;
    if dst.size > 0 {
        // SAFETY: `to` lies in a live page of this device; `from.address`
        // in one of the sender's, kept alive by the sender's task until
        // `finish` ordered its stream after this copy. Unified addressing
        // lets the driver find both devices.
        let code = unsafe { sys::cuMemcpyAsync(to, from.address, dst.size as usize, raw) };
        check(backend.device, "cuMemcpyAsync (peer copy)", code).map_err(|err| backend.classify(stream, err))?;
    }
    let event = record(backend, raw)?;
    Ok(PeerToken { device: backend.device, address: 0, size: dst.size, event: event as usize as u64 })
}

/// The sender's end: its stream waits for the receiver's copy.
pub(crate) fn finish(backend: &mut CudaBackend, stream: StreamId, done: &PeerToken) -> Result<(), ServerError> {
    backend.check_lost()?;
    let raw = backend.raw_stream(stream)?;
    consume(backend, raw, done)
}
