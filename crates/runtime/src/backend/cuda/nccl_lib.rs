//! Loading libnccl: probed once per process, never a panic.
//!
//! cudarc's own NCCL bindings load `libnccl.so` (or `.so.<CUDA major>`) on
//! first use and panic when it is missing, while NCCL installs itself as
//! `libnccl.so.2` (the pip wheels ship only that name). So the backend loads
//! the library itself: `COHORT_NCCL_LIBRARY` (a path) when set, else
//! `libnccl.so.2`, `libnccl.so` and cudarc's candidates, and resolves the few
//! entry points it calls. Status, type and operator codes are plain `c_int`s
//! as in NCCL's C header, so a code this build does not know is no UB.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::config::{self, ConfigError};

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `cudaStream_t` (the same handle as a driver `CUstream`).
pub(crate) type RawStream = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub internal: [c_char; 128],
}

/// The leading fields of `ncclConfig_t` as NCCL 2.18 laid them out (NCCL
/// reads `size` and `version` to know which fields a caller's struct has;
/// `splitShare` is read from 2.18 on): `blocking` is 0 and `splitShare` the
/// caller's, every other field is left "undefined" (NCCL's default).
#[repr(C)]
pub(crate) struct SplitConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl SplitConfig {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.18 (the first with
    /// `splitShare`) with `splitShare` = `share` and `blocking` = 1.
    ///
    /// Read in NCCL 2.28.3 (src/init.cc `ncclCommSplit`, src/group.cc
    /// `ncclAsyncLaunch`, `ncclGroupEndInternal`): whether the split itself
    /// waits for every member on the calling thread follows the *parent's*
    /// mode (blocking unless `NCCL_COMM_BLOCKING=0`), while this config sets
    /// the child's. A non-blocking child would launch every call of two or
    /// more ranks from a thread NCCL starts for it (starting and joining a
    /// thread alone took ~30 µs on the H200's host), so the child is
    /// blocking: its calls are queued on the caller's thread, as the
    /// world's are. `NCCL_COMM_BLOCKING=0` still
    /// makes both non-blocking (NCCL applies it over any config).
    pub(crate) fn new(share: bool) -> SplitConfig {
        const UNDEF: c_int = c_int::MIN;
        SplitConfig {
            size: std::mem::size_of::<SplitConfig>(),
            magic: 0xcafe_beef,
            version: 2 * 10000 + 18 * 100,
            blocking: 1,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: c_int::from(share),
        }
    }
}

/// `NCCL_SPLIT_NOCOLOR`.
pub(crate) const SPLIT_NOCOLOR: c_int = -1;

/// `ncclSuccess`.
pub(crate) const SUCCESS: c_int = 0;
/// `ncclInProgress`.
pub(crate) const IN_PROGRESS: c_int = 7;
/// `ncclUint8`: the type of byte moves.
pub(crate) const UINT8: c_int = 1;
/// `ncclFloat32`.
pub(crate) const FLOAT32: c_int = 7;
/// `ncclSum`.
pub(crate) const SUM: c_int = 0;

type Res = c_int;

/// The entry points the backend uses, resolved from one loaded library.
pub(crate) struct Nccl {
    /// The library's version code (22807 for 2.28.7).
    pub version: c_int,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    pub comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> Res,
    pub comm_destroy: unsafe extern "C" fn(RawComm) -> Res,
    pub comm_abort: unsafe extern "C" fn(RawComm) -> Res,
    pub comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Res) -> Res,
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    pub all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, RawComm, RawStream) -> Res,
    pub broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> Res,
    pub reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub group_start: unsafe extern "C" fn() -> Res,
    pub group_end: unsafe extern "C" fn() -> Res,
    /// `ncclCommSplit` (NCCL 2.18 and newer; `None` before).
    pub comm_split: Option<unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut SplitConfig) -> Res>,
    /// Which file was loaded, for logs.
    pub path: String,
    _library: libloading::Library,
}

// SAFETY: the struct holds function pointers into a library that stays
// loaded for the whole process (it is kept in a static), and NCCL's entry
// points may be called from any thread.
unsafe impl Send for Nccl {}
// SAFETY: as above; sharing only copies function pointers.
unsafe impl Sync for Nccl {}

/// Names tried, in order, when `COHORT_NCCL_LIBRARY` is not set.
fn candidates() -> Vec<String> {
    let mut names = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// Whether `COHORT_DISABLE_NCCL` is on (read once), or the error naming it
/// when its value cannot be used.
pub(crate) fn disabled() -> Result<bool, ConfigError> {
    static DISABLED: OnceLock<Result<bool, ConfigError>> = OnceLock::new();
    DISABLED.get_or_init(|| config::DISABLE_NCCL.get()).clone()
}

/// The loaded library, or why there is none (probed once per process; a
/// missing library or symbol, or an unusable `COHORT_DISABLE_NCCL` or
/// `COHORT_NCCL_LIBRARY`, is an error, never a panic).
pub fn load() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    if disabled().map_err(|e| e.to_string())? {
        return Err("NCCL is disabled by COHORT_DISABLE_NCCL".into());
    }
    LIB.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Nccl, String> {
    let names = match config::NCCL_LIBRARY.get().map_err(|e| e.to_string())? {
        Some(path) => vec![path.to_string_lossy().into_owned()],
        None => candidates(),
    };
    let mut last = String::new();
    for name in &names {
        // SAFETY: loading runs the library's initialisers; libnccl's only
        // set up its own globals.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => return resolve(library, name),
            Err(err) => last = err.to_string(),
        }
    }
    Err(format!(
        "no NCCL: libnccl not found (looked for {}; last error: {last}); install NCCL (libnccl2, or the nvidia-nccl pip wheel) and add its folder to LD_LIBRARY_PATH, or set COHORT_NCCL_LIBRARY to the file",
        names.iter().take(4).cloned().collect::<Vec<_>>().join(", ")
    ))
}

fn resolve(library: libloading::Library, path: &str) -> Result<Nccl, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is the one NCCL's header declares
            // for it (int-sized enums as c_int); the pointer is copied out and
            // stays valid while the library, kept alongside, is loaded.
            unsafe {
                *library
                    .get(concat!($name, "\0").as_bytes())
                    .map_err(|e| format!("{path} lacks {}: {e} (NCCL 2.19 or newer is needed)", $name))?
            }
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym!("ncclGetVersion");
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    unsafe { get_version(&mut version) };
    Ok(Nccl {
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        all_reduce: sym!("ncclAllReduce"),
        reduce: sym!("ncclReduce"),
        broadcast: sym!("ncclBroadcast"),
        all_gather: sym!("ncclAllGather"),
        reduce_scatter: sym!("ncclReduceScatter"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        // SAFETY: as `sym!`, for an entry point older libraries lack.
        comm_split: unsafe { library.get(b"ncclCommSplit\0").ok().map(|s| *s) },
        path: path.to_string(),
        _library: library,
    })
}

impl Nccl {
    /// `name (NCCL's text; the communicator's last error)` of a status code.
    pub(crate) fn describe(&self, code: c_int, comm: RawComm) -> String {
        let read = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated strings it owns.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: both calls only return pointers to strings NCCL owns.
        let text = read(unsafe { (self.get_error_string)(code) });
        let last = if comm.is_null() { String::new() } else { read(unsafe { (self.get_last_error)(comm) }) };
        if last.is_empty() {
            format!("NCCL error {code} ({text})")
        } else {
            format!("NCCL error {code} ({text}; {last})")
        }
    }

    /// The version as `2.28.7`.
    pub(crate) fn version_text(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
        }
    }
}
