//! Loading the CUDA driver and NVRTC, finding devices, and turning driver
//! status codes into [`ServerError`]s.
//!
//! cudarc loads its libraries on first use and panics when one is missing, so
//! every entry point here probes the library first and answers its absence
//! with an error that names the library it looked for.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc_sys;

use crate::error::ServerError;
use crate::id::DeviceId;

/// The backend name used in errors.
pub(crate) const BACKEND: &str = "cuda";

/// Device id of CUDA device `index`.
pub(crate) fn device_id(index: usize) -> DeviceId {
    DeviceId::new(DeviceId::CUDA, index as u32)
}

/// A driver error as a [`ServerError::Backend`] on `device`, saying which call
/// failed.
pub(crate) fn driver_error(device: DeviceId, call: &str, code: sys::CUresult) -> ServerError {
    ServerError::Backend { backend: BACKEND, device, message: format!("{call} failed: {}", describe(code)) }
}

/// `NAME (description)` of a driver status code.
pub(crate) fn describe(code: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string owned by the
    // driver (or leave it null on an unknown code); we read it only if set.
    unsafe {
        let _ = sys::cuGetErrorName(code, &mut name);
        let _ = sys::cuGetErrorString(code, &mut text);
    }
    let read = |p: *const c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-null pointers from cuGetError* are NUL-terminated
            // static strings.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (read(name), read(text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("{code:?}"),
    }
}

/// Whether `code` is a sticky fault: the context that saw it is lost and
/// every later call in it fails the same way.
pub(crate) fn is_sticky(code: sys::CUresult) -> bool {
    use sys::CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// File names cudarc tries for a library, for error messages.
fn candidates(lib: &str) -> String {
    let mut names = cudarc::get_lib_name_candidates(lib);
    names.truncate(4);
    names.join(", ")
}

/// Loads the driver and runs `cuInit` once per process; the outcome is kept.
pub(crate) fn ensure_driver() -> Result<(), ServerError> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    let outcome = INIT.get_or_init(|| {
        // SAFETY: probing only tries to dlopen the candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(format!(
                "no CUDA driver: libcuda.so not found (looked for {}, ...); install the NVIDIA driver or add its folder to LD_LIBRARY_PATH",
                candidates("cuda")
            ));
        }
        // SAFETY: the library is present; cuInit takes flags 0 and may be
        // called more than once.
        let code = unsafe { sys::cuInit(0) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("the CUDA driver was found but cuInit failed: {}", describe(code)));
        }
        Ok(())
    });
    outcome.clone().map_err(|message| ServerError::Backend { backend: BACKEND, device: device_id(0), message })
}

/// Loads NVRTC once per process; the error names the library looked for.
pub(crate) fn ensure_nvrtc() -> Result<(), String> {
    static PRESENT: OnceLock<Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            // SAFETY: probing only tries to dlopen the candidate names.
            if unsafe { nvrtc_sys::is_culib_present() } {
                Ok(())
            } else {
                Err(format!(
                    "no NVRTC: libnvrtc.so not found (looked for {}, ...); install the CUDA runtime compiler (libnvrtc) or add its folder to LD_LIBRARY_PATH",
                    candidates("nvrtc")
                ))
            }
        })
        .clone()
}

/// Number of GPUs the driver sees; an error says why there are none to
/// count.
pub(crate) fn gpu_count() -> Result<usize, ServerError> {
    ensure_driver()?;
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; the call writes one int.
    let code = unsafe { sys::cuDeviceGetCount(&mut count) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device_id(0), "cuDeviceGetCount", code));
    }
    Ok(count.max(0) as usize)
}

/// The most devices `COHORT_CUDA_DEVICES` may show on one GPU.
pub(crate) const MAX_DEVICES_PER_GPU: usize = 16;

/// Number of devices the backend shows: one per GPU, or
/// `COHORT_CUDA_DEVICES` (read once) spread over the GPUs (see [`gpu_of`]).
pub(crate) fn device_count() -> Result<usize, ServerError> {
    static ASKED: OnceLock<Result<Option<usize>, ServerError>> = OnceLock::new();
    let gpus = gpu_count()?;
    let asked = ASKED.get_or_init(|| Ok(crate::config::CUDA_DEVICES.get()?)).clone()?;
    shown(gpus, asked).map_err(ServerError::InvalidArgument)
}

/// The devices shown on `gpus` GPUs with `COHORT_CUDA_DEVICES` = `asked`;
/// more than [`MAX_DEVICES_PER_GPU`] on each is refused, naming the
/// variable.
fn shown(gpus: usize, asked: Option<usize>) -> Result<usize, String> {
    match asked {
        Some(n) if gpus > 0 && n > MAX_DEVICES_PER_GPU * gpus => Err(format!(
            "COHORT_CUDA_DEVICES={n} would show more than {MAX_DEVICES_PER_GPU} devices on each of the {gpus} GPU(s) the driver sees: use at most {}",
            MAX_DEVICES_PER_GPU * gpus
        )),
        Some(n) if gpus > 0 => Ok(n),
        _ => Ok(gpus),
    }
}

/// How many of the devices shown run on GPU `gpu`.
pub(crate) fn devices_on(gpu: usize) -> Result<usize, ServerError> {
    let gpus = gpu_count()?.max(1);
    Ok((0..device_count()?).filter(|i| i % gpus == gpu).count())
}

/// The GPU (the driver's ordinal) that device `index` runs on: device `i`
/// on GPU `i mod G` of the `G` the driver sees. Devices of one GPU share
/// its primary context and memory; each has its own thread and streams.
pub(crate) fn gpu_of(index: usize) -> Result<usize, ServerError> {
    match gpu_count()? {
        0 => Err(ServerError::Backend {
            backend: BACKEND,
            device: device_id(index),
            message: "no CUDA device: the driver reports no GPUs".into(),
        }),
        gpus => Ok(index % gpus),
    }
}

/// The device index of the first device shown on the GPU `raw` (a
/// `CUdevice`), after checking `ctx` is that GPU's primary context: an
/// error, saying how to get one, for any other context (and for a GPU
/// whose primary context is not active: `ctx` cannot be it then, and
/// asking would make one). Retains and releases the primary context once
/// (a count: the caller's retain keeps it).
pub(crate) fn device_of_primary(raw: sys::CUdevice, ctx: sys::CUcontext) -> Result<usize, ServerError> {
    let gpus = gpu_count()?;
    let gpu = (0..gpus)
        .find(|&g| {
            let mut found: sys::CUdevice = 0;
            // SAFETY: the driver is initialised; the call writes one handle.
            let code = unsafe { sys::cuDeviceGet(&mut found, g as c_int) };
            code == sys::CUresult::CUDA_SUCCESS && found == raw
        })
        .ok_or_else(|| {
            ServerError::InvalidArgument(format!(
                "the context's device ({raw}) is none of the {gpus} GPU(s) the driver shows this process"
            ))
        })?;
    let device = device_id(gpu);
    let not_primary = || {
        ServerError::InvalidArgument(format!(
            "the CUDA context {ctx:?} is not the primary context of GPU {gpu}: cohort runs on (and shares) each GPU's primary context, so its memory and streams are valid only there; make the context with cudarc's CudaContext::new({gpu}) (or cuDevicePrimaryCtxRetain), not cuCtxCreate or CudaContext::new_non_primary"
        ))
    };
    let (mut flags, mut active): (std::ffi::c_uint, c_int) = (0, 0);
    // SAFETY: `raw` is a valid device (found above); writes two integers.
    let code = unsafe { sys::cuDevicePrimaryCtxGetState(raw, &mut flags, &mut active) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuDevicePrimaryCtxGetState", code));
    }
    if active == 0 {
        return Err(not_primary());
    }
    let mut primary: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the primary context is active (someone holds it), so this
    // retain only counts; released right after.
    let code = unsafe { sys::cuDevicePrimaryCtxRetain(&mut primary, raw) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_error(device, "cuDevicePrimaryCtxRetain", code));
    }
    // SAFETY: releases the retain just made.
    let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(raw) };
    if primary != ctx {
        return Err(not_primary());
    }
    let shown = device_count()?;
    if gpu >= shown {
        return Err(ServerError::InvalidArgument(format!(
            "GPU {gpu} runs none of the {shown} CUDA device(s) COHORT_CUDA_DEVICES shows (device i runs on GPU i mod {gpus}): show at least {} to use it",
            gpu + 1
        )));
    }
    // Device i runs on GPU i mod G: the first one shown on `gpu` is `gpu`.
    Ok(gpu)
}

/// What the driver says about one device.
pub(crate) struct DeviceInfo {
    pub raw: sys::CUdevice,
    /// The driver's ordinal of the GPU.
    pub gpu: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub capability: (u32, u32),
}

/// Reads name, memory, SM count and compute capability of the GPU that
/// device `index` runs on.
pub(crate) fn device_info(index: usize) -> Result<DeviceInfo, ServerError> {
    let device = device_id(index);
    let gpu = gpu_of(index)?;
    let check = |call: &str, code: sys::CUresult| {
        if code == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(driver_error(device, call, code))
        }
    };
    let mut raw: sys::CUdevice = 0;
    // SAFETY: the driver is initialised (callers ran ensure_driver); each
    // call writes into the local it is given.
    unsafe {
        check("cuDeviceGet", sys::cuDeviceGet(&mut raw, gpu as c_int))?;
        let mut name = [0 as c_char; 256];
        check("cuDeviceGetName", sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, raw))?;
        let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        let mut memory: usize = 0;
        check("cuDeviceTotalMem", sys::cuDeviceTotalMem_v2(&mut memory, raw))?;
        let attribute = |attr: sys::CUdevice_attribute| -> Result<u32, ServerError> {
            let mut value: c_int = 0;
            check("cuDeviceGetAttribute", sys::cuDeviceGetAttribute(&mut value, attr, raw))?;
            Ok(value.max(0) as u32)
        };
        use sys::CUdevice_attribute::*;
        Ok(DeviceInfo {
            raw,
            gpu,
            name,
            memory_bytes: memory as u64,
            multiprocessors: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            capability: (
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
        })
    }
}

/// A raw driver pointer that may cross threads: CUDA handles are plain
/// addresses that the driver lets any thread use once a context is current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SendPtr<T>(pub T);

// SAFETY: the wrapped values are driver handles (contexts, events) or host
// addresses; moving the address between threads does not touch what it names,
// and every use sets the owning context current first.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above; shared references only copy the address.
unsafe impl<T> Sync for SendPtr<T> {}

/// Makes `ctx` current on the calling thread.
pub(crate) fn set_current(device: DeviceId, ctx: sys::CUcontext) -> Result<(), ServerError> {
    // SAFETY: `ctx` is a retained primary context (callers keep it alive).
    let code = unsafe { sys::cuCtxSetCurrent(ctx) };
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(device, "cuCtxSetCurrent", code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cohort_cuda_devices_shows_that_many_devices_up_to_a_bound_per_gpu() {
        assert_eq!(shown(2, None), Ok(2), "one per GPU by default");
        assert_eq!(shown(1, Some(3)), Ok(3));
        assert_eq!(shown(8, Some(2)), Ok(2), "fewer than the GPUs");
        assert_eq!(shown(0, Some(4)), Ok(0), "no GPU: nothing to show");
        assert_eq!(shown(2, Some(2 * MAX_DEVICES_PER_GPU)), Ok(2 * MAX_DEVICES_PER_GPU));
        for huge in [2 * MAX_DEVICES_PER_GPU + 1, usize::MAX] {
            let err = shown(2, Some(huge)).unwrap_err();
            assert!(err.contains(&format!("COHORT_CUDA_DEVICES={huge}")) && err.contains("at most 32"), "{err}");
        }
    }
}
