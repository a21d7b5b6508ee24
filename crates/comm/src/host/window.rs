//! The host engine's kernel: moves and reduces one window of bytes between
//! the participants' segments (which segments each brings is the
//! description's, [`Op::in_blocks`] and [`Op::out_blocks`]).
//!
//! Every collective here works on segments of `S` bytes: a buffer holds one
//! segment or one per participant (all-gather's destination, say). A window
//! is the byte range `[a, a + len)` inside every segment at once, so a
//! collective splits into independent windows that run in parallel (direct
//! path) or one after the other as host staging fills (staged path).

use std::cell::RefCell;

use smallvec::SmallVec;

use crate::op::{Collective, Op};
use crate::ops::{combine, finish, DType, Element, ReduceOp};
use crate::with_dtype;

/// One participant's segment starts in one buffer: inline for the one
/// segment most buffers hold.
pub(crate) type Starts<T> = SmallVec<[T; 1]>;

/// Segment start addresses of every participant's input and output for one
/// window (empty where a participant brings none).
pub(crate) struct Window<'a> {
    pub ins: &'a [Starts<*const u8>],
    pub outs: &'a [Starts<*mut u8>],
    pub len: usize,
    /// Every participant's output is its input (direct path, in place):
    /// all-to-all then swaps instead of copying.
    pub in_place: bool,
    /// Write outputs with non-temporal stores (large collectives: the
    /// outputs will not be read from this core's cache soon, and streaming
    /// skips reading each destination line before overwriting it).
    pub stream: bool,
}

/// Runs `op` over one window; its roots and endpoints are slots (see
/// [`Op::on_slots`]).
///
/// # Safety
/// Every address must be valid for `len` bytes (reads for inputs, writes for
/// outputs) while this runs, and no other thread may touch these bytes
/// meanwhile. An input and an output either are the same address (in place,
/// as the collective's argument checks allow) or do not overlap.
pub(crate) unsafe fn run_window(op: &Op, w: &Window<'_>) {
    let n = w.ins.len();
    if w.len == 0 {
        return;
    }
    let root = op.root().unwrap_or(0);
    match op.collective() {
        Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter => {
            let (dtype, rop) = (op.dtype(), op.reduce_op().expect("a reducing collective has an operator"));
            if op.collective() == Collective::ReduceScatter {
                for m in 0..n {
                    let srcs: SmallVec<[*const u8; 8]> = w.ins.iter().map(|s| s[m]).collect();
                    reduce(dtype, rop, &srcs, w.len, &[w.outs[m][0]], w.stream);
                }
                return;
            }
            let srcs: SmallVec<[*const u8; 8]> = w.ins.iter().map(|s| s[0]).collect();
            let dsts: SmallVec<[*mut u8; 8]> = match op.root() {
                Some(root) => smallvec::smallvec![w.outs[root][0]],
                None => w.outs.iter().map(|s| s[0]).collect(),
            };
            reduce(dtype, rop, &srcs, w.len, &dsts, w.stream);
        }
        Collective::Broadcast => {
            for out in w.outs {
                copy(w.ins[root][0], out[0], w.len, w.stream);
            }
        }
        Collective::AllGather => {
            for out in w.outs {
                for (k, input) in w.ins.iter().enumerate() {
                    copy(input[0], out[k], w.len, w.stream);
                }
            }
        }
        Collective::AllToAll if w.in_place => {
            for m in 0..n {
                for k in m + 1..n {
                    // SAFETY (caller's contract): in place, out[m][k] and
                    // out[k][m] are distinct segments of distinct buffers.
                    std::ptr::swap_nonoverlapping(w.outs[m][k], w.outs[k][m], w.len);
                }
            }
        }
        Collective::AllToAll => {
            for (m, out) in w.outs.iter().enumerate() {
                for (k, input) in w.ins.iter().enumerate() {
                    copy(input[m], out[k], w.len, w.stream);
                }
            }
        }
        Collective::Gather => {
            for (k, input) in w.ins.iter().enumerate() {
                copy(input[0], w.outs[root][k], w.len, w.stream);
            }
        }
        Collective::Scatter => {
            for (m, out) in w.outs.iter().enumerate() {
                copy(w.ins[root][m], out[0], w.len, w.stream);
            }
        }
        Collective::SendRecv => {
            let (from, to) = op.endpoints().expect("a send/recv has endpoints");
            copy(w.ins[from][0], w.outs[to][0], w.len, w.stream)
        }
        Collective::Barrier => {}
    }
}

/// Copies `len` bytes; nothing when source and destination are the same
/// bytes (in place).
unsafe fn copy(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    if !std::ptr::eq(src, dst) {
        // Caller's contract: both valid for `len` bytes and, being
        // different addresses, not overlapping.
        store(src, dst, len, stream);
    }
}

/// Copies `len` bytes between non-overlapping ranges, with non-temporal
/// stores when `stream` is set (x86-64; a plain copy elsewhere).
unsafe fn store(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && len >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let body = (len - head) / 16;
        let (s, d) = (src.add(head), dst.add(head));
        for i in 0..body {
            // SAFETY (caller's contract): `d + 16 i` is 16-byte aligned (head
            // aligned it) and both ranges hold the 16 bytes; SSE2 is part of
            // every x86-64 CPU.
            let v = _mm_loadu_si128(s.add(16 * i).cast::<__m128i>());
            _mm_stream_si128(d.add(16 * i).cast::<__m128i>(), v);
        }
        let done = head + body * 16;
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
        // Order the streaming stores before whatever signals completion.
        _mm_sfence();
        return;
    }
    let _ = stream;
    std::ptr::copy_nonoverlapping(src, dst, len);
}

thread_local! {
    /// Per-thread accumulator and unaligned-input buffers (16-byte aligned
    /// words, so any element type can be viewed in them).
    static SCRATCH: RefCell<(Vec<u128>, Vec<u128>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

unsafe fn reduce(dtype: DType, op: ReduceOp, srcs: &[*const u8], len: usize, dsts: &[*mut u8], stream: bool) {
    with_dtype!(dtype, T => reduce_typed::<T>(op, srcs, len, dsts, stream))
}

/// Reduces `srcs` into a per-thread accumulator, then copies it to `dsts`.
/// The accumulator is written only after every source of this window was
/// read, so a destination that is also a source (in place) is safe.
unsafe fn reduce_typed<T: Element>(op: ReduceOp, srcs: &[*const u8], len: usize, dsts: &[*mut u8], stream: bool) {
    let size = std::mem::size_of::<T>();
    debug_assert_eq!(len % size, 0);
    let count = len / size;
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (acc_words, tmp_words) = &mut *guard;
        let words = len.div_ceil(16);
        if acc_words.len() < words {
            acc_words.resize(words, 0);
            tmp_words.resize(words, 0);
        }
        let acc: &mut [T] = &mut bytemuck::cast_slice_mut::<u128, T>(acc_words)[..count];
        // SAFETY: srcs[0] is valid for `len` bytes (caller) and the scratch is
        // this thread's own memory, so they cannot overlap.
        std::ptr::copy_nonoverlapping(srcs[0], acc.as_mut_ptr().cast::<u8>(), len);
        for &src in &srcs[1..] {
            if (src as usize).is_multiple_of(std::mem::align_of::<T>()) {
                // SAFETY: aligned for T, valid for `count` elements, and not
                // written by anyone while this window runs (caller).
                let x = std::slice::from_raw_parts(src.cast::<T>(), count);
                combine(acc, x, op);
            } else {
                let tmp: &mut [T] = &mut bytemuck::cast_slice_mut::<u128, T>(tmp_words)[..count];
                // SAFETY: as for srcs[0] above.
                std::ptr::copy_nonoverlapping(src, tmp.as_mut_ptr().cast::<u8>(), len);
                combine(acc, tmp, op);
            }
        }
        finish(acc, op, srcs.len());
        for &dst in dsts {
            // SAFETY: dst is valid for `len` bytes of writes (caller); the
            // accumulator is thread-local scratch, so they do not overlap.
            store(acc.as_ptr().cast::<u8>(), dst, len, stream);
        }
    })
}
