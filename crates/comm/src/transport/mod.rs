//! Host transports between the processes of a job: byte streams from one
//! rank to another over shared memory (same node, [`shm`]) or TCP (other
//! nodes, [`tcp`]), and the progress engine that drives several sends and
//! receives at once without blocking on any one of them.
//!
//! Every link is non-blocking: [`Link::try_send`] takes what fits now and
//! [`Link::try_recv`] hands over what has arrived. [`Exchange`] loops over
//! its pending operations, so a rank can send to its ring successor while it
//! receives from its predecessor even when both messages are larger than
//! any buffer in between (no deadlock), and it backs off from spinning to
//! yielding to short sleeps while nothing moves.

#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub(crate) mod shm;
pub(crate) mod tcp;

use std::cell::RefCell;
use std::io;

use crate::ops::{combine, DType, Element, ReduceOp};
use crate::with_dtype;

/// One rank's full-duplex byte stream to one peer.
pub(crate) trait Link: Send {
    /// Copies as much of `data` as fits now into the link; returns how many
    /// bytes it took (0 when the link is full). Never blocks.
    fn try_send(&mut self, data: &[u8]) -> io::Result<usize>;
    /// Offers the bytes that have arrived to `take`, which returns how many
    /// of them it consumed; returns that count (0 when nothing arrived).
    /// Never blocks.
    fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize>;
    /// "shm", "tcp" or "mpi", for messages.
    fn kind(&self) -> &'static str;
}

/// Where received bytes go.
pub(crate) enum Sink<'a> {
    /// Copied into this slice.
    Copy(&'a mut [u8]),
    /// Combined element-wise into this slice (`acc = acc op received`, or
    /// `received op acc` when `received_first`, so every rank combines in
    /// the same order and gets bit-identical results).
    Reduce { acc: &'a mut [u8], dtype: DType, op: ReduceOp, received_first: bool },
    /// `acc = base op received`: an out-of-place reduction that never
    /// copies `base` into `acc` up front (each piece is copied while hot in
    /// cache, right before it is combined).
    ReduceFrom { acc: &'a mut [u8], base: &'a [u8], dtype: DType, op: ReduceOp },
}

impl Sink<'_> {
    fn len(&self) -> usize {
        match self {
            Sink::Copy(d) => d.len(),
            Sink::Reduce { acc, .. } | Sink::ReduceFrom { acc, .. } => acc.len(),
        }
    }
}

/// A pending send of `data` to `peer`.
pub(crate) struct SendOp<'a> {
    pub peer: usize,
    pub data: &'a [u8],
    done: usize,
}

/// A pending receive from `peer` into a sink.
pub(crate) struct RecvOp<'a> {
    pub peer: usize,
    sink: Sink<'a>,
    done: usize,
    /// A partial element carried between two arrivals (reductions only).
    carry: [u8; 16],
    carried: usize,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        SendOp { peer, data, done: 0 }
    }
}

impl<'a> RecvOp<'a> {
    pub fn copy(peer: usize, dst: &'a mut [u8]) -> Self {
        RecvOp { peer, sink: Sink::Copy(dst), done: 0, carry: [0; 16], carried: 0 }
    }

    pub fn reduce(peer: usize, acc: &'a mut [u8], dtype: DType, op: ReduceOp, received_first: bool) -> Self {
        let sink = Sink::Reduce { acc, dtype, op, received_first };
        RecvOp { peer, sink, done: 0, carry: [0; 16], carried: 0 }
    }

    pub fn reduce_from(peer: usize, acc: &'a mut [u8], base: &'a [u8], dtype: DType, op: ReduceOp) -> Self {
        let sink = Sink::ReduceFrom { acc, base, dtype, op };
        RecvOp { peer, sink, done: 0, carry: [0; 16], carried: 0 }
    }

    fn remaining(&self) -> usize {
        self.sink.len() - self.done - self.carried
    }

    /// Consumes arrived bytes; returns how many.
    fn take(&mut self, bytes: &[u8]) -> usize {
        let want = self.remaining().min(bytes.len());
        if want == 0 {
            return 0;
        }
        match &mut self.sink {
            Sink::Copy(dst) => {
                dst[self.done..self.done + want].copy_from_slice(&bytes[..want]);
                self.done += want;
                want
            }
            Sink::Reduce { .. } | Sink::ReduceFrom { .. } => {
                let (acc, base, dtype, op, first): (&mut [u8], Option<&[u8]>, DType, ReduceOp, bool) =
                    match &mut self.sink {
                        Sink::Reduce { acc, dtype, op, received_first } => (acc, None, *dtype, *op, *received_first),
                        Sink::ReduceFrom { acc, base, dtype, op } => (acc, Some(base), *dtype, *op, false),
                        Sink::Copy(_) => unreachable!("matched above"),
                    };
                let elem = dtype.size();
                // Out of place: the accumulator's piece starts as the base's.
                let reduce = |acc: &mut [u8], at: usize, x: &[u8]| {
                    if let Some(base) = base {
                        acc[at..at + x.len()].copy_from_slice(&base[at..at + x.len()]);
                    }
                    reduce_into(&mut acc[at..at + x.len()], x, dtype, op, first);
                };
                let mut used = 0;
                if self.carried > 0 {
                    let fill = (elem - self.carried).min(want);
                    self.carry[self.carried..self.carried + fill].copy_from_slice(&bytes[..fill]);
                    self.carried += fill;
                    used = fill;
                    if self.carried < elem {
                        return used;
                    }
                    let carry = self.carry;
                    reduce(acc, self.done, &carry[..elem]);
                    self.done += elem;
                    self.carried = 0;
                }
                let whole = (want - used) / elem * elem;
                reduce(acc, self.done, &bytes[used..used + whole]);
                self.done += whole;
                used += whole;
                let rest = want - used;
                self.carry[..rest].copy_from_slice(&bytes[used..want]);
                self.carried = rest;
                want
            }
        }
    }

    fn finished(&self) -> bool {
        self.done == self.sink.len()
    }
}

thread_local! {
    /// Aligned copies of unaligned arrivals and accumulators.
    static ALIGNED: RefCell<(Vec<u128>, Vec<u128>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `acc = acc op x` (or `x op acc` when `x_first`), element-wise, for any
/// alignment of either slice.
pub(crate) fn reduce_into(acc: &mut [u8], x: &[u8], dtype: DType, op: ReduceOp, x_first: bool) {
    with_dtype!(dtype, T => reduce_typed::<T>(acc, x, op, x_first))
}

fn reduce_typed<T: Element>(acc: &mut [u8], x: &[u8], op: ReduceOp, x_first: bool) {
    if acc.is_empty() {
        return;
    }
    ALIGNED.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (xs, accs) = &mut *guard;
        let words = acc.len().div_ceil(16);
        if xs.len() < words {
            xs.resize(words, 0);
            accs.resize(words, 0);
        }
        let x_aligned: &[T] = match bytemuck::try_cast_slice::<u8, T>(x) {
            Ok(v) => v,
            Err(_) => {
                let bytes = &mut bytemuck::cast_slice_mut::<u128, u8>(xs)[..x.len()];
                bytes.copy_from_slice(x);
                bytemuck::cast_slice::<u8, T>(bytes)
            }
        };
        let combine_ordered = |a: &mut [T]| {
            if x_first {
                // a = x op a, computed as a copy of x combined with a.
                let mut tmp: Vec<T> = x_aligned.to_vec();
                combine(&mut tmp, a, op);
                a.copy_from_slice(&tmp);
            } else {
                combine(a, x_aligned, op);
            }
        };
        match bytemuck::try_cast_slice_mut::<u8, T>(acc) {
            Ok(a) => combine_ordered(a),
            Err(_) => {
                let len = acc.len();
                let bytes = &mut bytemuck::cast_slice_mut::<u128, u8>(accs)[..len];
                bytes.copy_from_slice(acc);
                combine_ordered(bytemuck::cast_slice_mut::<u8, T>(bytes));
                acc.copy_from_slice(bytes);
            }
        }
    })
}

/// Why an exchange stopped before its operations finished.
#[derive(Debug)]
pub(crate) enum Stop<E> {
    /// A link failed (the peer closed its end: it exited or crashed).
    Link { peer: usize, error: io::Error },
    /// The caller's idle hook gave up (deadline, abort): its error.
    Idle(E),
}

/// The idle hook of [`exchange`]: consecutive idle passes and the peers
/// still owed bytes; an error stops the exchange.
pub(crate) type Idle<'a, E> = dyn FnMut(u64, &[usize]) -> Result<(), E> + 'a;

/// Drives sends and receives until all finish.
///
/// `links[p]` is the link to rank `p`. `idle(waited)` is called whenever a
/// pass moved no byte, with how many consecutive idle passes there were; it
/// waits a little (spin, yield, sleep) and returns an error to stop (a
/// deadline passed, the job aborted).
pub(crate) fn exchange<E>(
    links: &mut [Option<Box<dyn Link>>],
    sends: &mut [SendOp<'_>],
    recvs: &mut [RecvOp<'_>],
    idle: &mut Idle<'_, E>,
) -> Result<(), Stop<E>> {
    let mut idle_passes = 0u64;
    loop {
        let mut moved = false;
        let mut pending = false;
        for i in 0..sends.len() {
            // Messages to one peer go out in order.
            let (before, rest) = sends.split_at_mut(i);
            let s = &mut rest[0];
            if s.done == s.data.len() || before.iter().any(|b| b.peer == s.peer && b.done < b.data.len()) {
                pending |= s.done < s.data.len();
                continue;
            }
            let link = links[s.peer].as_mut().expect("a link to every peer");
            let n = link.try_send(&s.data[s.done..]).map_err(|error| Stop::Link { peer: s.peer, error })?;
            s.done += n;
            moved |= n > 0;
            pending |= s.done < s.data.len();
        }
        for i in 0..recvs.len() {
            let (before, rest) = recvs.split_at_mut(i);
            let r = &mut rest[0];
            if r.finished() || before.iter().any(|b| b.peer == r.peer && !b.finished()) {
                pending |= !r.finished();
                continue;
            }
            let link = links[r.peer].as_mut().expect("a link to every peer");
            let n = link.try_recv(&mut |bytes| r.take(bytes)).map_err(|error| Stop::Link { peer: r.peer, error })?;
            moved |= n > 0;
            pending |= !r.finished();
        }
        if !pending {
            return Ok(());
        }
        if moved {
            idle_passes = 0;
        } else {
            idle_passes += 1;
            let waiting_on: Vec<usize> = recvs
                .iter()
                .filter(|r| !r.finished())
                .map(|r| r.peer)
                .chain(sends.iter().filter(|s| s.done < s.data.len()).map(|s| s.peer))
                .collect();
            idle(idle_passes, &waiting_on).map_err(Stop::Idle)?;
        }
    }
}

/// The default back-off for [`exchange`]'s idle passes: spin briefly, then
/// yield the core, then sleep in short steps (a sleeping rank wakes within
/// ~50 µs of its peer's bytes).
pub(crate) fn back_off(idle_passes: u64) {
    if idle_passes < 64 {
        std::hint::spin_loop();
    } else if idle_passes < 2048 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Whether a failed link means the peer went away (rather than a local
/// problem), for messages: the store's check (the transports build on the
/// store, so it owns the one copy).
pub(crate) use crate::store::peer_gone;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_sink_carries_partial_elements() {
        let mut acc = bytemuck::cast_slice::<f32, u8>(&[1.0f32, 2.0, 3.0]).to_vec();
        let x = bytemuck::cast_slice::<f32, u8>(&[10.0f32, 20.0, 30.0]).to_vec();
        let mut r = RecvOp::reduce(0, &mut acc, DType::F32, ReduceOp::Sum, false);
        assert_eq!(r.take(&x[..3]), 3);
        assert_eq!(r.take(&x[3..9]), 6);
        assert_eq!(r.take(&x[9..]), 3);
        assert!(r.finished());
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&acc), &[11.0, 22.0, 33.0]);
    }
}
