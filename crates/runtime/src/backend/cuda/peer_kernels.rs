//! Peer-memory collectives: one-shot and two-shot all-reduce and all-gather
//! kernels (`peer_kernels.cu`, compiled by NVRTC per element type and
//! operator) over one staging arena per member and device set.
//!
//! Each member's arena is plain device memory: the members of one process
//! reach each other's through peer access, the members of other processes
//! through CUDA IPC handles (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
//! A call is one kernel per member, queued like an NCCL part (after the
//! device's earlier collective parts, an event after it, polled by the same
//! machinery): its blocks copy the input into the arena, meet the same
//! blocks of every other member through flags in the arenas, and read the
//! peers' staging. Flags take the next value of a counter at every barrier
//! and calls alternate between two staging slots, so nothing is reset
//! between calls; the counters live in the arena and the kernel advances
//! them, so a call captured in a CUDA graph replays correctly. A barrier gives up after the collective's timeout,
//! writing the rank it waited for into a host-mapped word that the host
//! reads once the kernel's event fired; the host writes that word itself to
//! stop a kernel whose collective failed elsewhere. No kernel spins forever.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use cudarc::driver::sys;

use super::driver::driver_error;
use super::CudaBackend;
use crate::backend::{PeerAlgo, PeerCall, PeerSpec, PEER_ARENA_BYTES, PEER_MAX_BYTES, PEER_MAX_RANKS};
use crate::dtype::{DType, ReduceOp};
use crate::error::ServerError;

const SOURCE: &str = include_str!("peer_kernels.cu");

/// Threads per block and the most blocks (flags are laid out per block).
const THREADS: u32 = 512;
const MAX_BLOCKS: u64 = 128;
const FLAGS_BYTES: u64 = 16384;
const SLOT_BYTES: u64 = 2 * PEER_MAX_BYTES;

/// The host-mapped word a peer kernel writes when it gives up (1 + the
/// rank it waited for); the host writes [`STOP`] into it to end a kernel
/// whose collective failed elsewhere.
pub(crate) const STOP: u32 = u32::MAX;

/// The kernel's argument block (matches `struct PeerArgs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct PeerArgs {
    arenas: [u64; PEER_MAX_RANKS],
    input: u64,
    output: u64,
    count: u64,
    error: u64,
    timeout_ns: u64,
    slot_bytes: u64,
    rank: u32,
    ranks: u32,
    op: u32,
    barriers: u32,
    epoch: u32,
    parity: u32,
}

/// Every arena this process allocated or opened (any device, any set),
/// with its device set's key: a peer call may name no other address, so
/// safe code cannot aim a kernel at arbitrary device memory.
static KNOWN_ARENAS: parking_lot::Mutex<Vec<(u64, u64)>> = parking_lot::Mutex::new(Vec::new());

fn know_arena(set: u64, ptr: u64) {
    KNOWN_ARENAS.lock().push((set, ptr));
}

fn forget_arena(ptr: u64) {
    KNOWN_ARENAS.lock().retain(|&(_, p)| p != ptr);
}

fn is_known_arena(ptr: u64) -> bool {
    KNOWN_ARENAS.lock().iter().any(|&(_, p)| p == ptr)
}

/// One device set's arena on this device.
pub(crate) struct PeerSet {
    arena: sys::CUdeviceptr,
    /// Host-mapped error word: host and device addresses.
    error_host: *mut u32,
    error_device: u64,
    /// Other processes' arenas opened here.
    opened: Vec<sys::CUdeviceptr>,
}

impl PeerSet {
    /// Closes the opened handles, frees the arena and the error word.
    ///
    /// # Safety
    /// Once per set, with no kernel of the set still running; the device's
    /// context is current.
    unsafe fn free(self) {
        for ptr in self.opened {
            forget_arena(ptr);
            // SAFETY: the caller's contract.
            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
        }
        forget_arena(self.arena);
        // SAFETY: the caller's contract.
        unsafe {
            let _ = sys::cuMemFree_v2(self.arena);
            let _ = sys::cuMemFreeHost(self.error_host.cast());
        }
    }
}

/// The peer-memory state of one device.
#[derive(Default)]
pub(crate) struct PeerSets {
    sets: HashMap<u64, PeerSet>,
    /// Each element type's kernels, in [`KERNELS`] order.
    functions: HashMap<DType, Vec<sys::CUfunction>>,
    /// The blocks of a kernel (by its function's address) that fit on one
    /// SM at once, asked of the driver once per function.
    blocks_per_sm: HashMap<usize, u64>,
}

impl PeerSets {
    /// Frees every arena and error word, and closes opened handles (the
    /// device drained first; its context is current).
    pub(crate) fn close(&mut self) {
        for (_, set) in self.sets.drain() {
            // SAFETY: memory this state allocated or opened; released once.
            unsafe { set.free() };
        }
        self.functions.clear();
        self.blocks_per_sm.clear();
    }

    /// Closes the set's opened handles and, with `own_arena`, frees its
    /// arena and error word (its parts ended first; the peers that opened
    /// this arena closed their handles first: see
    /// `DeviceCollectives::release_peer`).
    pub(crate) fn release(&mut self, set: u64, own_arena: bool) {
        if own_arena {
            if let Some(found) = self.sets.remove(&set) {
                // SAFETY: memory this state allocated or opened, out of the
                // map now, so released once; no part of the set is pending.
                unsafe { found.free() };
            }
        } else if let Some(found) = self.sets.get_mut(&set) {
            for ptr in found.opened.drain(..) {
                forget_arena(ptr);
                // SAFETY: a handle this state opened, out of the list now;
                // no part of the set is pending.
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            }
        }
    }

    /// The host-mapped error word of `set`.
    pub(crate) fn error_word(&self, set: u64) -> Option<*mut u32> {
        self.sets.get(&set).map(|s| s.error_host)
    }
}

/// Every kernel of `SOURCE`, compiled together once per element type.
const KERNELS: [&str; 6] = [
    "cohort_peer_one_shot_wide",
    "cohort_peer_one_shot_narrow",
    "cohort_peer_two_shot_wide",
    "cohort_peer_two_shot_narrow",
    "cohort_peer_gather_wide",
    "cohort_peer_gather_narrow",
];

fn op_code(op: ReduceOp) -> u32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// The preamble that makes `SOURCE` the kernels of `dtype`.
fn preamble(dtype: DType) -> String {
    let (elem, unsigned, kind) = match dtype {
        DType::I8 => ("signed char", "unsigned char", 0),
        DType::U8 => ("unsigned char", "unsigned char", 0),
        DType::I32 => ("int", "unsigned int", 0),
        DType::U32 => ("unsigned int", "unsigned int", 0),
        DType::I64 => ("long long", "unsigned long long", 0),
        DType::U64 => ("unsigned long long", "unsigned long long", 0),
        DType::F32 => ("float", "float", 1),
        DType::F64 => ("double", "double", 1),
        DType::F16 => ("unsigned short", "unsigned short", 2),
        DType::BF16 => ("unsigned short", "unsigned short", 3),
    };
    format!("#define ELEM_T {elem}\n#define ELEM_U {unsigned}\n#define ELEM_KIND {kind}\n")
}

/// Blocks for `work` packs (at least one, at most `MAX_BLOCKS`).
fn blocks_for(work: u64) -> u32 {
    work.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS) as u32
}

/// The blocks of `function` (of `THREADS` threads) one SM holds at once,
/// as the driver reports.
fn blocks_per_sm(function: sys::CUfunction) -> Result<u64, String> {
    let mut per_sm: c_int = 0;
    // SAFETY: a loaded function of the current context; writes one int.
    let code = unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, function, THREADS as c_int, 0) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuOccupancyMaxActiveBlocksPerMultiprocessor: {}", super::driver::describe(code)));
    }
    Ok(per_sm.max(0) as u64)
}

/// The element type whose kernels run `call`: an all-gather moves bytes.
fn kernel_dtype(call: &PeerCall) -> DType {
    match *call {
        PeerCall::AllReduce { dtype, .. } => dtype,
        PeerCall::AllGather { .. } => DType::U8,
    }
}

/// Which kernel runs a call, how many elements it sees, and its grid. The
/// wide kernels move 16 bytes at a time and run when the size is a multiple
/// of 16; the choice, and so the split of work between blocks, follows
/// from the size alone, which every member shares (each member's pointers
/// may be aligned differently: the kernels read and write a misaligned
/// caller's buffer byte by byte within the same packs).
fn plan(call: &PeerCall, ranks: u64) -> (&'static str, DType, ReduceOp, u64, u32) {
    match *call {
        PeerCall::AllReduce { src, dtype, op, algo, .. } => {
            let wide = src.size.is_multiple_of(16);
            let elems = src.size / dtype.size() as u64;
            let packs = if wide { src.size / 16 } else { elems };
            let (name, work) = match (algo, wide) {
                (PeerAlgo::OneShot, true) => ("cohort_peer_one_shot_wide", packs),
                (PeerAlgo::OneShot, false) => ("cohort_peer_one_shot_narrow", packs),
                (PeerAlgo::TwoShot, true) => ("cohort_peer_two_shot_wide", packs.div_ceil(ranks)),
                (PeerAlgo::TwoShot, false) => ("cohort_peer_two_shot_narrow", packs.div_ceil(ranks)),
            };
            (name, dtype, op, elems, blocks_for(work))
        }
        PeerCall::AllGather { src, .. } => {
            let wide = src.size.is_multiple_of(16);
            let name = if wide { "cohort_peer_gather_wide" } else { "cohort_peer_gather_narrow" };
            let work = if wide { src.size / 16 } else { src.size };
            (name, kernel_dtype(call), ReduceOp::Sum, src.size, blocks_for(work))
        }
    }
}

impl CudaBackend {
    fn peer_set(&mut self, set: u64) -> Result<&mut PeerSet, ServerError> {
        if !self.nccl.peer.sets.contains_key(&set) {
            let device = self.device;
            let mut arena: sys::CUdeviceptr = 0;
            // SAFETY: context current on the task's thread; writes one address.
            let code = unsafe { sys::cuMemAlloc_v2(&mut arena, PEER_ARENA_BYTES as usize) };
            if code != sys::CUresult::CUDA_SUCCESS {
                return Err(driver_error(device, "cuMemAlloc (peer arena)", code));
            }
            // Flags and counters start at 0 (the first barrier waits for 1),
            // cleared on a stream of its own and waited for there: the
            // device's other streams may be capturing, which forbids a
            // context-wide sync and the legacy stream.
            let code = zero_on_own_stream(arena, FLAGS_BYTES as usize);
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut mapped: sys::CUdeviceptr = 0;
            let code = if code == sys::CUresult::CUDA_SUCCESS {
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                // SAFETY: context current; writes one host pointer.
                unsafe { sys::cuMemHostAlloc(&mut host, 64, flags) }
            } else {
                code
            };
            let code = if code == sys::CUresult::CUDA_SUCCESS {
                // SAFETY: `host` was just allocated mapped; writes one address.
                unsafe {
                    host.cast::<u32>().write_volatile(0);
                    sys::cuMemHostGetDevicePointer_v2(&mut mapped, host, 0)
                }
            } else {
                code
            };
            if code != sys::CUresult::CUDA_SUCCESS {
                // SAFETY: releases what was allocated above, once.
                unsafe {
                    let _ = sys::cuMemFree_v2(arena);
                    if !host.is_null() {
                        let _ = sys::cuMemFreeHost(host);
                    }
                }
                return Err(driver_error(device, "peer arena set-up", code));
            }
            know_arena(set, arena);
            let state = PeerSet { arena, error_host: host.cast(), error_device: mapped, opened: Vec::new() };
            self.nccl.peer.sets.insert(set, state);
        }
        Ok(self.nccl.peer.sets.get_mut(&set).expect("inserted above"))
    }

    /// This device's arena of `set`, after letting the devices of this
    /// process that can reach it address it.
    pub(crate) fn peer_arena(&mut self, set: u64) -> Result<u64, ServerError> {
        self.check_lost()?;
        if let Some(found) = self.nccl.peer.sets.get(&set) {
            // Shared when it was made (every call asks).
            return Ok(found.arena);
        }
        super::peer::share(self)?;
        Ok(self.peer_set(set)?.arena)
    }

    /// The arena of `set` as a CUDA IPC handle (64 bytes).
    pub(crate) fn peer_arena_handle(&mut self, set: u64) -> Result<Vec<u8>, ServerError> {
        self.check_lost()?;
        let device = self.device;
        let arena = self.peer_set(set)?.arena;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `arena` is a live allocation of this context; writes 64 bytes.
        let code = unsafe { sys::cuIpcGetMemHandle(&mut handle, arena) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(device, "cuIpcGetMemHandle (peer arena)", code));
        }
        Ok(handle.reserved.iter().map(|&c| c as u8).collect())
    }

    /// Opens another process's arena for `set`.
    pub(crate) fn peer_open(&mut self, set: u64, bytes: &[u8]) -> Result<u64, ServerError> {
        self.check_lost()?;
        if bytes.len() != 64 {
            return Err(ServerError::InvalidArgument(format!(
                "a CUDA IPC memory handle has 64 bytes, not {}",
                bytes.len()
            )));
        }
        let device = self.device;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (to, from) in handle.reserved.iter_mut().zip(bytes) {
            *to = *from as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: context current; the driver checks the handle and writes
        // one address.
        let code = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_error(device, "cuIpcOpenMemHandle (a peer's arena)", code));
        }
        match self.peer_set(set) {
            Ok(state) => state.opened.push(ptr),
            Err(err) => {
                // SAFETY: the handle just opened, tracked nowhere else.
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
                return Err(err);
            }
        }
        know_arena(set, ptr);
        Ok(ptr)
    }

    /// Refuses a peer call whose arguments cannot run (nothing queued, the
    /// set left as it was): the member count, this member's arena, sizes.
    pub(crate) fn check_peer(&self, spec: &PeerSpec<'_>, call: &PeerCall) -> Result<(), String> {
        let ranks = spec.arenas.len();
        if ranks == 0 || ranks > PEER_MAX_RANKS || spec.rank >= ranks {
            return Err(format!(
                "a peer-memory collective takes 1 to {PEER_MAX_RANKS} members (rank {} of {ranks} given)",
                spec.rank
            ));
        }
        let (src, dst) = match *call {
            PeerCall::AllReduce { src, dst, .. } => (src, dst),
            PeerCall::AllGather { src, dst } => (src, dst),
        };
        if src.size > PEER_MAX_BYTES {
            return Err(format!(
                "a peer-memory collective takes at most {PEER_MAX_BYTES} bytes per member, not {}",
                src.size
            ));
        }
        let want = match call {
            PeerCall::AllReduce { .. } => src.size,
            PeerCall::AllGather { .. } => src.size * ranks as u64,
        };
        if dst.size != want {
            return Err(format!("a destination of {} bytes where {want} are written", dst.size));
        }
        if let PeerCall::AllReduce { dtype, .. } = call {
            if src.size % dtype.size() as u64 != 0 {
                return Err(format!("{} bytes are not whole {dtype:?} elements", src.size));
            }
        }
        if let Some(r) = spec.arenas.iter().position(|&a| !is_known_arena(a)) {
            return Err(format!(
                "rank {r}'s arena {:#x} is no arena of this process (peer_arena or peer_open gives them)",
                spec.arenas[r]
            ));
        }
        let arena = self.nccl.peer.sets.get(&spec.set).map(|s| s.arena);
        match arena {
            None => Err("the device set has no peer arena here (peer_arena was not called)".into()),
            Some(arena) if spec.arenas[spec.rank] != arena => {
                Err(format!("rank {}'s arena in the set's list is not its own", spec.rank))
            }
            Some(_) => Ok(()),
        }
    }

    /// Compiles and loads the kernels of `call`'s element type (see
    /// `DeviceCollectives::peer_prepare`).
    pub(crate) fn peer_prepare(&mut self, call: &PeerCall) -> Result<(), String> {
        self.peer_functions(kernel_dtype(call)).map(|_| ())
    }

    /// The peer kernels of `dtype` (in [`KERNELS`] order), compiled and
    /// loaded on first use.
    fn peer_functions(&mut self, dtype: DType) -> Result<&[sys::CUfunction], String> {
        if !self.nccl.peer.functions.contains_key(&dtype) {
            let source = format!("{}{SOURCE}", preamble(dtype));
            let functions = self.kernels.functions_of(&KERNELS, &source)?;
            self.nccl.peer.functions.insert(dtype, functions);
        }
        Ok(&self.nccl.peer.functions[&dtype])
    }

    /// The blocks of `function` each of `sharing` members on this GPU may
    /// run so that all of theirs are resident at once (at least 1): every
    /// member on the GPU computes the same.
    fn resident_share(&mut self, function: sys::CUfunction, sharing: usize) -> Result<u32, String> {
        let cached = self.nccl.peer.blocks_per_sm.get(&(function as usize)).copied();
        let per_sm = match cached {
            Some(per_sm) => per_sm,
            None => {
                let per_sm = blocks_per_sm(function)?;
                self.nccl.peer.blocks_per_sm.insert(function as usize, per_sm);
                per_sm
            }
        };
        let resident = per_sm * u64::from(self.properties.compute_units);
        Ok((resident / sharing as u64).max(1) as u32)
    }

    /// Queues one member's peer kernel on `stream` (the caller orders it
    /// after the device's earlier parts). Returns the set's error word.
    pub(crate) fn launch_peer(
        &mut self,
        stream: sys::CUstream,
        spec: &PeerSpec<'_>,
        call: &PeerCall,
        timeout: std::time::Duration,
    ) -> Result<(), String> {
        self.check_peer(spec, call)?;
        let ranks = spec.arenas.len();
        let (src, dst) = match *call {
            PeerCall::AllReduce { src, dst, .. } => (src, dst),
            PeerCall::AllGather { src, dst } => (src, dst),
        };
        let input = self.pages.ptr(src).map_err(|e| e.to_string())?;
        let output = self.pages.ptr(dst).map_err(|e| e.to_string())?;
        let (name, dtype, op, count, grid) = plan(call, ranks as u64);
        let at = KERNELS.iter().position(|k| *k == name).expect("a kernel of the source");
        let function = self.peer_functions(dtype)?[at];
        let grid = match spec.sharing {
            0 | 1 => grid,
            sharing => grid.min(self.resident_share(function, sharing)?),
        };
        let barriers = match call {
            PeerCall::AllReduce { algo: PeerAlgo::TwoShot, .. } => 2,
            _ => 1,
        };
        let set = self
            .nccl
            .peer
            .sets
            .get_mut(&spec.set)
            .ok_or_else(|| "the device set has no peer arena here (peer_arena was not called)".to_string())?;
        let mut arenas = [0u64; PEER_MAX_RANKS];
        arenas[..ranks].copy_from_slice(spec.arenas);
        let mut args = PeerArgs {
            arenas,
            input,
            output,
            count,
            error: set.error_device,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            slot_bytes: SLOT_BYTES,
            rank: spec.rank as u32,
            ranks: ranks as u32,
            op: op_code(op),
            barriers,
            epoch: 0,
            parity: 0,
        };
        let mut params = [(&mut args as *mut PeerArgs).cast::<c_void>()];
        // SAFETY: `function` is loaded in this context and takes one
        // `PeerArgs` by value, which `params` points at until the call
        // returns (the driver copies it). Every address in it is live: the
        // input and output pages are held by the task, the arenas by their
        // owners until the set is closed.
        let code = unsafe {
            sys::cuLaunchKernel(
                function,
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuLaunchKernel ({name}): {}", super::driver::describe(code)));
        }
        Ok(())
    }
}

/// Clears `bytes` at `ptr` on a new non-blocking stream and waits there.
fn zero_on_own_stream(ptr: sys::CUdeviceptr, bytes: usize) -> sys::CUresult {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: context current; the stream is made, used and destroyed
    // here, and `ptr` holds `bytes` (the caller's allocation).
    unsafe {
        let code = sys::cuStreamCreate(&mut stream, flags);
        if code != sys::CUresult::CUDA_SUCCESS {
            return code;
        }
        let mut code = sys::cuMemsetD8Async(ptr, 0, bytes, stream);
        if code == sys::CUresult::CUDA_SUCCESS {
            code = sys::cuStreamSynchronize(stream);
        }
        let _ = sys::cuStreamDestroy_v2(stream);
        code
    }
}

/// What a peer kernel's error word says, in words (`None`: all is well).
pub(crate) fn gave_up(word: u32, ranks_hint: &str, timeout: std::time::Duration) -> Option<String> {
    match word {
        0 => None,
        STOP => Some("stopped because the collective failed on another member".into()),
        rank => Some(format!(
            "rank {} of the peer-memory set never arrived within {:.1} s ({ranks_hint}): its kernel never ran (stopped, hung or failed before its part); raise COHORT_TIMEOUT if it is legitimately that late",
            rank - 1,
            timeout.as_secs_f64()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Binding;
    use crate::memory::PageId;

    fn b(size: u64) -> Binding {
        Binding { page: PageId(1), offset: 0, size }
    }

    #[test]
    fn the_kernel_and_grid_follow_from_the_size_alone() {
        let call = PeerCall::AllReduce {
            src: b(64),
            dst: b(64),
            dtype: DType::F32,
            op: ReduceOp::Sum,
            algo: PeerAlgo::OneShot,
        };
        // Every member plans the same kernel and grid whatever its pointers.
        assert_eq!(plan(&call, 2).0, "cohort_peer_one_shot_wide");
        let odd = PeerCall::AllReduce {
            src: b(12),
            dst: b(12),
            dtype: DType::F32,
            op: ReduceOp::Sum,
            algo: PeerAlgo::TwoShot,
        };
        let (name, _, _, count, grid) = plan(&odd, 2);
        assert_eq!((name, count, grid), ("cohort_peer_two_shot_narrow", 3, 1));
        let gather = PeerCall::AllGather { src: b(1 << 20), dst: b(2 << 20) };
        let (name, dtype, _, count, grid) = plan(&gather, 2);
        assert_eq!((name, dtype, count, grid), ("cohort_peer_gather_wide", DType::U8, 1 << 20, 128));
        let ragged = PeerCall::AllGather { src: b(1000), dst: b(2000) };
        assert_eq!(plan(&ragged, 2).0, "cohort_peer_gather_narrow");
    }

    #[test]
    fn the_error_word_names_the_rank_that_never_arrived() {
        let t = std::time::Duration::from_secs(2);
        assert_eq!(gave_up(0, "", t), None);
        assert!(gave_up(2, "x", t).unwrap().starts_with("rank 1 of the peer-memory set never arrived within 2.0 s"));
        assert!(gave_up(STOP, "", t).unwrap().contains("another member"));
    }

    #[test]
    fn the_arena_holds_the_flags_and_two_slots_of_input_and_result() {
        assert_eq!(PEER_ARENA_BYTES, FLAGS_BYTES + 2 * SLOT_BYTES);
        assert!(MAX_BLOCKS * PEER_MAX_RANKS as u64 * 4 <= FLAGS_BYTES);
    }
}
