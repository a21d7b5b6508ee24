//! The collectives between ranks, on host bytes, over a [`World`]'s links.
//!
//! * all-reduce: recursive halving-doubling below [`RING_FROM`] bytes
//!   (2 log₂ N steps: latency), the ring above (2 (N-1) steps moving 1/N of
//!   the buffer each: bandwidth). Non-power-of-two worlds fold the extra
//!   ranks into their neighbours first. Each block is reduced on one rank
//!   and then copied, so every rank gets bit-identical results.
//! * reduce-scatter and all-gather: the ring; broadcast: a binomial tree;
//!   all-to-all, gather and scatter: every pair at once (the progress engine
//!   interleaves them); barrier: dissemination (log₂ N rounds).
//!
//! Every collective first checks fingerprints with the other ranks
//! (`World::collective_check`; the barrier checks them in each of its
//! rounds).

use crate::ops::{DType, ReduceOp};
use crate::transport::{RecvOp, SendOp};

use super::failure::Failure;
use super::fingerprint::Fingerprint;
use super::world::World;

/// All-reduces of this many bytes and more take the ring.
pub(crate) const RING_FROM: usize = 256 * 1024;

type R = Result<(), Failure>;

/// `(a, b)`: disjoint ranges of `buf` as a shared and a mutable slice.
fn split(buf: &mut [u8], a: (usize, usize), b: (usize, usize)) -> (&[u8], &mut [u8]) {
    assert!(a.1 <= b.0 || b.1 <= a.0, "ranges overlap");
    // `a` lies before `b` (an empty `a` at `b`'s start counts as before).
    if a.1 <= b.0 {
        let (lo, hi) = buf.split_at_mut(b.0);
        (&lo[a.0..a.1], &mut hi[..b.1 - b.0])
    } else {
        let (lo, hi) = buf.split_at_mut(a.0);
        (&hi[..a.1 - a.0], &mut lo[b.0..b.1])
    }
}

/// Byte ranges of `parts` nearly equal blocks of whole elements.
fn blocks(len: usize, elem: usize, parts: usize) -> Vec<(usize, usize)> {
    let count = len / elem;
    (0..parts)
        .map(|i| {
            let lo = count * i / parts * elem;
            let hi = count * (i + 1) / parts * elem;
            (lo, hi)
        })
        .collect()
}

#[cfg(test)]
mod split_tests {
    use super::split;

    #[test]
    fn empty_ranges_at_the_other_range_start() {
        let mut buf = [1u8, 2, 3, 4];
        let (a, b) = split(&mut buf, (0, 0), (0, 4));
        assert!(a.is_empty());
        assert_eq!(b, &[1, 2, 3, 4]);
        let (a, b) = split(&mut buf, (4, 4), (0, 4));
        assert!(a.is_empty());
        assert_eq!(b.len(), 4);
        let (a, b) = split(&mut buf, (2, 4), (0, 2));
        assert_eq!((a, &*b), (&[3u8, 4][..], &[1u8, 2][..]));
    }
}

impl World {
    pub(super) fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    pub(super) fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// One ring reduce-scatter step out of place: sends `send` (from `src`
    /// in the first step, from `buf` later) while `buf[recv] = src[recv] op
    /// received`.
    #[allow(clippy::too_many_arguments)]
    fn step_from(
        &mut self,
        buf: &mut [u8],
        src: &[u8],
        first: bool,
        send: (usize, usize),
        recv: (usize, usize),
        dtype: DType,
        op: ReduceOp,
    ) -> R {
        let (to, from) = (self.next(), self.prev());
        let (out, inp) = split(buf, send, recv);
        let out = if first { &src[send.0..send.1] } else { out };
        let mut sends = [SendOp::new(to, out)];
        let mut recvs = [RecvOp::reduce_from(from, inp, &src[recv.0..recv.1], dtype, op)];
        self.exchange(&mut sends, &mut recvs)
    }

    /// One step: sends `buf[send]` to `to` while receiving into `buf[recv]`
    /// from `from` (reducing into it when `reduce` is given).
    fn step(
        &mut self,
        buf: &mut [u8],
        to: usize,
        send: (usize, usize),
        from: usize,
        recv: (usize, usize),
        reduce: Option<(DType, ReduceOp)>,
    ) -> R {
        let (out, inp) = split(buf, send, recv);
        let mut sends = [SendOp::new(to, out)];
        let mut recvs = [match reduce {
            Some((dtype, op)) => RecvOp::reduce(from, inp, dtype, op, false),
            None => RecvOp::copy(from, inp),
        }];
        self.exchange(&mut sends, &mut recvs)
    }

    /// Ring reduce-scatter over `ranges` (one per rank): rank r ends with
    /// range r fully reduced.
    /// With `src`, out of place: `buf` starts undefined and `src` holds this
    /// rank's data (block r - 1, never written here, is the all-gather's).
    fn ring_reduce_scatter(
        &mut self,
        buf: &mut [u8],
        src: Option<&[u8]>,
        ranges: &[(usize, usize)],
        dtype: DType,
        op: ReduceOp,
    ) -> R {
        let n = self.size;
        let (to, from) = (self.next(), self.prev());
        for s in 0..n - 1 {
            let send = ranges[(self.rank + 2 * n - s - 1) % n];
            let recv = ranges[(self.rank + 2 * n - s - 2) % n];
            match src {
                Some(src) => self.step_from(buf, src, s == 0, send, recv, dtype, op)?,
                None => self.step(buf, to, send, from, recv, Some((dtype, op)))?,
            }
        }
        Ok(())
    }

    /// Ring all-gather over `ranges`: rank r brings range r.
    fn ring_all_gather(&mut self, buf: &mut [u8], ranges: &[(usize, usize)]) -> R {
        let n = self.size;
        let (to, from) = (self.next(), self.prev());
        for s in 0..n - 1 {
            let send = ranges[(self.rank + n - s) % n];
            let recv = ranges[(self.rank + 2 * n - s - 1) % n];
            self.step(buf, to, send, from, recv, None)?;
        }
        Ok(())
    }

    /// Reduces `buf` across ranks, in place (`Avg` must be passed as `Sum`:
    /// the caller divides).
    /// With `src`, out of place: `buf` is only written (the ring never
    /// copies `src` into it up front).
    pub(crate) fn all_reduce(
        &mut self,
        fp: &Fingerprint,
        buf: &mut [u8],
        src: Option<&[u8]>,
        dtype: DType,
        op: ReduceOp,
    ) -> R {
        self.collective_check(fp)?;
        let elem = dtype.size();
        let ring = self.size > 1 && buf.len() >= RING_FROM && buf.len() / elem >= self.size;
        if !ring {
            if let Some(src) = src {
                buf.copy_from_slice(src);
            }
        }
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        if ring {
            let ranges = blocks(buf.len(), elem, self.size);
            self.ring_reduce_scatter(buf, src, &ranges, dtype, op)?;
            self.ring_all_gather(buf, &ranges)
        } else {
            self.halving_doubling(buf, dtype, op)
        }
    }

    /// Recursive halving (reduce-scatter) then doubling (all-gather) over
    /// the largest power of two of ranks; the others fold in first.
    fn halving_doubling(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> R {
        let (n, r, len) = (self.size, self.rank, buf.len());
        let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p2;
        // Fold: in the first 2·rem ranks, odd ranks hand their data to the
        // even rank below and sit out.
        let virt = if r < 2 * rem {
            if r % 2 == 1 {
                self.exchange(&mut [SendOp::new(r - 1, buf)], &mut [])?;
                return self.exchange(&mut [], &mut [RecvOp::copy(r - 1, buf)]);
            }
            self.exchange(&mut [], &mut [RecvOp::reduce(r + 1, buf, dtype, op, false)])?;
            r / 2
        } else {
            r - rem
        };
        let real = |v: usize| if v < rem { 2 * v } else { v + rem };
        let elem = dtype.size();
        let mut range = (0, len);
        let mut history = Vec::new();
        let mut mask = p2 / 2;
        while mask > 0 {
            let partner = real(virt ^ mask);
            let count = (range.1 - range.0) / elem;
            let mid = range.0 + count / 2 * elem;
            let (keep, give) =
                if virt & mask == 0 { ((range.0, mid), (mid, range.1)) } else { ((mid, range.1), (range.0, mid)) };
            self.step(buf, partner, give, partner, keep, Some((dtype, op)))?;
            history.push((partner, keep, give));
            range = keep;
            mask /= 2;
        }
        while let Some((partner, keep, give)) = history.pop() {
            self.step(buf, partner, keep, partner, give, None)?;
        }
        if r < 2 * rem {
            self.exchange(&mut [SendOp::new(r + 1, buf)], &mut [])?;
        }
        Ok(())
    }

    /// Copies `buf` of rank `root` to every rank's `buf` (binomial tree).
    pub(crate) fn broadcast(&mut self, fp: &Fingerprint, buf: &mut [u8], root: usize) -> R {
        self.collective_check(fp)?;
        let n = self.size;
        let v = (self.rank + n - root) % n;
        let real = |x: usize| (x + root) % n;
        let mut mask = 1;
        while mask < n {
            if v & mask != 0 {
                self.exchange(&mut [], &mut [RecvOp::copy(real(v - mask), buf)])?;
                break;
            }
            mask <<= 1;
        }
        let mut sends = Vec::new();
        mask >>= 1;
        while mask > 0 {
            if v + mask < n {
                sends.push(SendOp::new(real(v + mask), buf));
            }
            mask >>= 1;
        }
        self.exchange(&mut sends, &mut [])
    }

    /// `buf` holds one `seg`-byte block per rank, this rank's in place;
    /// fills the others (ring).
    pub(crate) fn all_gather(&mut self, fp: &Fingerprint, buf: &mut [u8], seg: usize) -> R {
        self.collective_check(fp)?;
        let ranges: Vec<_> = (0..self.size).map(|k| (k * seg, (k + 1) * seg)).collect();
        self.ring_all_gather(buf, &ranges)
    }

    /// Reduces `work` (one `seg` block per rank; overwritten) across ranks
    /// and copies block `rank` of the result to `out` (ring).
    pub(crate) fn reduce_scatter(
        &mut self,
        fp: &Fingerprint,
        work: &mut [u8],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> R {
        self.collective_check(fp)?;
        let seg = out.len();
        let ranges: Vec<_> = (0..self.size).map(|k| (k * seg, (k + 1) * seg)).collect();
        if self.size > 1 {
            self.ring_reduce_scatter(work, None, &ranges, dtype, op)?;
        }
        out.copy_from_slice(&work[self.rank * seg..(self.rank + 1) * seg]);
        Ok(())
    }

    /// Block k of `src` goes to rank k; block k of `dst` comes from rank k.
    pub(crate) fn all_to_all(&mut self, fp: &Fingerprint, src: &[u8], dst: &mut [u8]) -> R {
        self.collective_check(fp)?;
        let (n, me) = (self.size, self.rank);
        let seg = src.len() / n;
        dst[me * seg..(me + 1) * seg].copy_from_slice(&src[me * seg..(me + 1) * seg]);
        let mut sends: Vec<SendOp<'_>> = (1..n)
            .map(|k| {
                let to = (me + k) % n;
                SendOp::new(to, &src[to * seg..(to + 1) * seg])
            })
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = Vec::new();
        for (k, block) in dst.chunks_mut(seg.max(1)).enumerate().take(n) {
            if k != me {
                recvs.push(RecvOp::copy(k, block));
            }
        }
        self.exchange(&mut sends, &mut recvs)
    }

    /// Every rank's `src` lands in block `rank` of `dst` on `root` (`dst`
    /// only there).
    pub(crate) fn gather(&mut self, fp: &Fingerprint, src: &[u8], dst: Option<&mut [u8]>, root: usize) -> R {
        self.collective_check(fp)?;
        let seg = src.len();
        match dst {
            Some(dst) => {
                dst[root * seg..(root + 1) * seg].copy_from_slice(src);
                let mut recvs: Vec<RecvOp<'_>> = dst
                    .chunks_mut(seg.max(1))
                    .enumerate()
                    .take(self.size)
                    .filter(|(k, _)| *k != root)
                    .map(|(k, block)| RecvOp::copy(k, block))
                    .collect();
                self.exchange(&mut [], &mut recvs)
            }
            None => self.exchange(&mut [SendOp::new(root, src)], &mut []),
        }
    }

    /// Block k of `src` (on `root` only) lands in rank k's `dst`.
    pub(crate) fn scatter(&mut self, fp: &Fingerprint, src: Option<&[u8]>, dst: &mut [u8], root: usize) -> R {
        self.collective_check(fp)?;
        let seg = dst.len();
        match src {
            Some(src) => {
                dst.copy_from_slice(&src[root * seg..(root + 1) * seg]);
                let mut sends: Vec<SendOp<'_>> = (0..self.size)
                    .filter(|k| *k != root)
                    .map(|k| SendOp::new(k, &src[k * seg..(k + 1) * seg]))
                    .collect();
                self.exchange(&mut sends, &mut [])
            }
            None => self.exchange(&mut [], &mut [RecvOp::copy(root, dst)]),
        }
    }

    /// Returns once every rank called it (dissemination: ⌈log₂ N⌉ rounds of
    /// fingerprints).
    pub(crate) fn barrier(&mut self, fp: &Fingerprint) -> R {
        let mut dist = 1;
        while dist < self.size {
            let to = (self.rank + dist) % self.size;
            let from = (self.rank + self.size - dist) % self.size;
            self.check_fingerprint(fp, to, from, fp)?;
            dist *= 2;
        }
        Ok(())
    }

    /// Sends `fp` then `data` to `to`.
    pub(crate) fn send(&mut self, fp: &Fingerprint, data: &[u8], to: usize) -> R {
        let header = fp.encode();
        self.exchange(&mut [SendOp::new(to, &header), SendOp::new(to, data)], &mut [])
    }

    /// Receives a message from `from` into `buf`, checking its fingerprint
    /// against `expected`.
    pub(crate) fn recv(&mut self, expected: &Fingerprint, buf: &mut [u8], from: usize) -> R {
        let rank = self.rank;
        self.check_fingerprint(expected, rank, from, expected)?;
        self.exchange(&mut [], &mut [RecvOp::copy(from, buf)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_whole_elements() {
        assert_eq!(blocks(40, 4, 3), vec![(0, 12), (12, 24), (24, 40)]);
        let mut buf = [1u8, 2, 3, 4];
        let (a, b) = split(&mut buf, (2, 4), (0, 2));
        assert_eq!((a, &*b), (&[3u8, 4][..], &[1u8, 2][..]));
    }
}
