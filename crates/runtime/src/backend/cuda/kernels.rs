//! Kernels: CUDA C compiled by NVRTC for the device's architecture, cached in
//! memory (per kernel and per source) and on disk, and launched with the
//! runtime's argument convention.
//!
//! The disk cache (see [`super::disk_cache`]) lives in a folder of the
//! user's own; each entry is named by the SHA-256 of the source, the kernel's
//! name, the compile options (the architecture among them) and the NVRTC
//! version, and is checked against it before the driver loads it.
//! A compile error is kept (per kernel) and returned on every launch with the
//! compiler's log.

use crate::id::IdMap;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;

use super::disk_cache::{entry_key, DiskCache};
use super::driver::{describe, ensure_nvrtc};
use crate::kernel::{Kernel, Scalar};

static COMPILES: AtomicU64 = AtomicU64::new(0);
static MEMORY_HITS: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);

/// Counts of the NVRTC cache in this process, across devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvrtcCacheStats {
    /// Sources compiled by NVRTC.
    pub compiles: u64,
    /// Kernels found compiled in memory (same source, another `Kernel`).
    pub memory_hits: u64,
    /// Kernels loaded from the disk cache.
    pub disk_hits: u64,
}

/// The NVRTC cache counters so far.
pub fn nvrtc_cache_stats() -> NvrtcCacheStats {
    NvrtcCacheStats {
        compiles: COMPILES.load(Ordering::Relaxed),
        memory_hits: MEMORY_HITS.load(Ordering::Relaxed),
        disk_hits: DISK_HITS.load(Ordering::Relaxed),
    }
}

/// Compiled functions of one device.
pub(crate) struct Kernels {
    arch: String,
    nvrtc_version: String,
    by_id: IdMap<u64, Result<sys::CUfunction, String>>,
    by_key: HashMap<[u8; 32], Result<sys::CUfunction, String>>,
    modules: Vec<sys::CUmodule>,
    params: Vec<u64>,
    pointers: Vec<*mut c_void>,
}

impl Kernels {
    pub fn new(capability: (u32, u32)) -> Self {
        Self {
            arch: format!("sm_{}{}", capability.0, capability.1),
            nvrtc_version: String::new(),
            by_id: IdMap::default(),
            by_key: HashMap::new(),
            modules: Vec::new(),
            params: Vec::new(),
            pointers: Vec::new(),
        }
    }

    /// Whether `kernel` (of CUDA `source`) launches without a compile: it
    /// was loaded (or failed to load) already, or another kernel object of
    /// the same name and source was (one hash of the source).
    pub fn has(&self, kernel: &Kernel, source: &str) -> bool {
        if self.by_id.contains_key(&kernel.id()) {
            return true;
        }
        // Before the first load the NVRTC version is unknown: nothing loaded.
        !self.nvrtc_version.is_empty() && self.by_key.contains_key(&self.memory_key(kernel.name(), source).0)
    }

    /// The in-memory cache key of kernel `name` of `source` (source, name,
    /// options, NVRTC version), with the compile options it stands for.
    fn memory_key(&self, name: &str, source: &str) -> ([u8; 32], [String; 1]) {
        let options = [format!("--gpu-architecture={}", self.arch)];
        let key =
            entry_key(&[source.as_bytes(), name.as_bytes(), options[0].as_bytes(), self.nvrtc_version.as_bytes()]);
        (key, options)
    }

    /// The loaded function of `kernel`, compiling it on first use. The error
    /// is a message for `KernelFailed`.
    pub fn function(&mut self, kernel: &Kernel, source: &str) -> Result<sys::CUfunction, String> {
        if let Some(found) = self.by_id.get(&kernel.id()) {
            return found.clone();
        }
        let found = self.load(kernel.name(), source);
        self.by_id.insert(kernel.id(), found.clone());
        found
    }

    /// The loaded functions `names` of the backend's own `source`, compiled
    /// once into one module (through the disk cache). Callers keep the
    /// functions: this hashes the source.
    pub fn functions_of(&mut self, names: &[&str], source: &str) -> Result<Vec<sys::CUfunction>, String> {
        ensure_nvrtc()?;
        let options = [format!("--gpu-architecture={}", self.arch)];
        let joined = names.join(",");
        let version = self.nvrtc_version();
        let key = entry_key(&[source.as_bytes(), joined.as_bytes(), options[0].as_bytes(), version.as_bytes()]);
        let disk = DiskCache::open_default();
        let cubin = match disk.as_ref().and_then(|d| d.load(&key)) {
            Some(cubin) => {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                cubin
            }
            None => {
                let cubin = compile(names[0], source, &options)?;
                COMPILES.fetch_add(1, Ordering::Relaxed);
                if let Some(disk) = &disk {
                    disk.store(&key, &cubin);
                }
                cubin
            }
        };
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the context is current on the task's thread (the device
        // thread, or a caller's made ready by `enter_caller`); `cubin` is an
        // image NVRTC produced (a bad one is refused with an error code).
        let code = unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr().cast()) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuModuleLoadData: {}", describe(code)));
        }
        self.modules.push(module);
        names
            .iter()
            .map(|name| {
                let entry = CString::new(*name).map_err(|_| format!("kernel name {name:?} contains a NUL byte"))?;
                let mut function: sys::CUfunction = std::ptr::null_mut();
                // SAFETY: live module; the call writes one handle.
                let code = unsafe { sys::cuModuleGetFunction(&mut function, module, entry.as_ptr()) };
                if code != sys::CUresult::CUDA_SUCCESS {
                    return Err(format!("the module has no function `{name}` ({})", describe(code)));
                }
                load_now(function).map_err(|e| format!("`{name}`: {e}"))?;
                Ok(function)
            })
            .collect()
    }

    fn nvrtc_version(&mut self) -> String {
        if self.nvrtc_version.is_empty() {
            let (mut major, mut minor) = (0 as c_int, 0 as c_int);
            // SAFETY: NVRTC is present (checked by the callers); the call
            // writes two ints.
            unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
            self.nvrtc_version = format!("{major}.{minor}");
        }
        self.nvrtc_version.clone()
    }

    fn load(&mut self, name: &str, source: &str) -> Result<sys::CUfunction, String> {
        ensure_nvrtc()?;
        if self.nvrtc_version.is_empty() {
            let (mut major, mut minor) = (0 as c_int, 0 as c_int);
            // SAFETY: NVRTC is present; the call writes two ints.
            unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
            self.nvrtc_version = format!("{major}.{minor}");
        }
        let (key, options) = self.memory_key(name, source);
        if let Some(found) = self.by_key.get(&key) {
            MEMORY_HITS.fetch_add(1, Ordering::Relaxed);
            return found.clone();
        }
        let disk = DiskCache::open_default();
        let mut found = None;
        if let Some(cubin) = disk.as_ref().and_then(|d| d.load(&key)) {
            if let Ok(function) = self.load_cubin(name, &cubin) {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                found = Some(Ok(function));
            }
        }
        let found = match found {
            Some(found) => found,
            None => compile(name, source, &options).and_then(|cubin| {
                COMPILES.fetch_add(1, Ordering::Relaxed);
                if let Some(disk) = &disk {
                    disk.store(&key, &cubin);
                }
                self.load_cubin(name, &cubin)
            }),
        };
        self.by_key.insert(key, found.clone());
        found
    }

    fn load_cubin(&mut self, name: &str, cubin: &[u8]) -> Result<sys::CUfunction, String> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the context is current on the task's thread (the device
        // thread, or a caller's made ready by `enter_caller`); `cubin` is an
        // image NVRTC produced (a bad one is refused with an error code).
        let code = unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr().cast()) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuModuleLoadData: {}", describe(code)));
        }
        self.modules.push(module);
        let entry = CString::new(name).map_err(|_| format!("kernel name {name:?} contains a NUL byte"))?;
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: live module; the call writes one handle.
        let code = unsafe { sys::cuModuleGetFunction(&mut function, module, entry.as_ptr()) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(format!(
                "the CUDA source has no `extern \"C\" __global__` function named `{name}` ({})",
                describe(code)
            ));
        }
        load_now(function)?;
        Ok(function)
    }

    /// Queues `function` with the runtime's argument convention: every
    /// buffer's address, every buffer's length in bytes, then the scalars.
    pub fn launch(
        &mut self,
        function: sys::CUfunction,
        grid: [u32; 3],
        block: [u32; 3],
        stream: sys::CUstream,
        buffers: &[(sys::CUdeviceptr, u64)],
        scalars: &[Scalar],
    ) -> sys::CUresult {
        self.params.clear();
        self.params.extend(buffers.iter().map(|b| b.0));
        self.params.extend(buffers.iter().map(|b| b.1));
        self.params.extend(scalars.iter().map(|s| match *s {
            Scalar::F32(v) => v.to_bits() as u64,
            Scalar::F64(v) => v.to_bits(),
            Scalar::I32(v) => v as u32 as u64,
            Scalar::U32(v) => v as u64,
            Scalar::I64(v) => v as u64,
            Scalar::U64(v) => v,
        }));
        self.pointers.clear();
        let base = self.params.as_mut_ptr();
        // Each argument is read from the start of its 8-byte slot: little
        // endian puts a 4-byte value there.
        // SAFETY (of the adds): every index is below `params.len()`.
        self.pointers.extend((0..self.params.len()).map(|i| unsafe { base.add(i) }.cast::<c_void>()));
        // SAFETY: `function` is loaded in the current context; `pointers`
        // holds one pointer per kernel parameter, each to a live value of
        // the parameter's size, valid until the call returns (the driver
        // copies them).
        unsafe {
            sys::cuLaunchKernel(
                function,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                stream,
                self.pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }

    /// Unloads every module.
    pub fn release_all(&mut self) {
        for module in self.modules.drain(..) {
            // SAFETY: each module was loaded once and is unloaded once.
            unsafe {
                let _ = sys::cuModuleUnload(module);
            }
        }
        self.by_id.clear();
        self.by_key.clear();
    }
}

/// Loads `function` onto the device now (`cuFuncLoad`, drivers of CUDA
/// 12.4 on) rather than at its first launch, as lazy loading (the default
/// from CUDA 12.2) would: that load may wait for every kernel of the
/// context to finish, and a kernel that waits for this one (a peer kernel
/// of another device shown on the same GPU) never would. Older drivers
/// load at module load and need nothing.
fn load_now(function: sys::CUfunction) -> Result<(), String> {
    static DRIVER: OnceLock<c_int> = OnceLock::new();
    let version = *DRIVER.get_or_init(|| {
        let mut version: c_int = 0;
        // SAFETY: the driver is loaded (a context exists); writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) };
        version
    });
    if version < 12040 {
        return Ok(());
    }
    // SAFETY: a function of a live module of the current context; the
    // symbol exists from driver 12.4 on (checked above).
    let code = unsafe { sys::cuFuncLoad(function) };
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuFuncLoad: {}", describe(code)))
    }
}

/// Compiles `source` to a cubin; a failure carries the compiler's log and the
/// source lines it points at.
fn compile(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| "the CUDA source contains a NUL byte".to_string())?;
    let file = CString::new(format!("{name}.cu")).map_err(|_| format!("kernel name {name:?} contains a NUL byte"))?;
    let options: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).expect("no NUL in options")).collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut program: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC is loaded (checked by the caller); the strings are NUL
    // terminated and outlive the program, which is destroyed below.
    unsafe {
        let code =
            nvrtc::nvrtcCreateProgram(&mut program, src.as_ptr(), file.as_ptr(), 0, std::ptr::null(), std::ptr::null());
        if code != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcCreateProgram failed: {code:?}"));
        }
        let code = nvrtc::nvrtcCompileProgram(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let result = if code != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            let log = program_log(program);
            Err(format!(
                "NVRTC could not compile it ({}):\n{}",
                options_text(&options),
                with_excerpt(&log, source, name)
            ))
        } else {
            let mut size = 0usize;
            let code = nvrtc::nvrtcGetCUBINSize(program, &mut size);
            if code != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(format!("NVRTC made no cubin ({code:?}); the architecture may be newer than this NVRTC"))
            } else {
                let mut cubin = vec![0u8; size];
                let code = nvrtc::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast());
                if code == nvrtc::nvrtcResult::NVRTC_SUCCESS {
                    Ok(cubin)
                } else {
                    Err(format!("nvrtcGetCUBIN failed: {code:?}"))
                }
            }
        };
        let _ = nvrtc::nvrtcDestroyProgram(&mut program);
        result
    }
}

fn options_text(options: &[CString]) -> String {
    options.iter().map(|o| o.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
}

/// The program's log.
///
/// # Safety
/// `program` must be a live NVRTC program.
unsafe fn program_log(program: nvrtc::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: live program (the caller's contract); writes one size.
    if unsafe { nvrtc::nvrtcGetProgramLogSize(program, &mut size) } != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: the buffer holds the `size` bytes NVRTC said the log needs.
    unsafe { nvrtc::nvrtcGetProgramLog(program, log.as_mut_ptr().cast()) };
    String::from_utf8_lossy(&log).trim_end_matches('\0').trim_end().to_string()
}

/// The log, followed by each source line an error points at when the log
/// does not quote it already.
fn with_excerpt(log: &str, source: &str, name: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let marker = format!("{name}.cu(");
    let mut out = log.to_string();
    let mut quoted = Vec::new();
    for line in log.lines() {
        let Some(rest) = line.strip_prefix(&marker) else { continue };
        let Some(number) = rest.split(')').next().and_then(|n| n.parse::<usize>().ok()) else { continue };
        if quoted.contains(&number) {
            continue;
        }
        quoted.push(number);
        if let Some(text) = lines.get(number.wrapping_sub(1)) {
            if !log.contains(text.trim()) {
                out.push_str(&format!("\n  line {number}: {}", text.trim()));
            }
        }
    }
    out
}
