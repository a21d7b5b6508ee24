//! Checking collectives against the host: buffer layouts for each
//! collective (in and out of place), input patterns, a host reference
//! computed independently of the engine, and an element-wise comparison.
//! The tests and `all_reduce_bench` share it.
//!
//! The input [`pattern`] differs from element to element, block to block
//! and member to member (a pseudo-random sequence of each member), so a
//! misplaced element or block shows. Its floats are `±0.5`, `±1` and `±2`:
//! every partial sum and product of up to 64 members (15 for f16 products)
//! is exact in every float type, so sums, products, minima and maxima are
//! compared exactly whatever order the engine reduces in; only averages
//! round, and they are compared within the error bound of the way NCCL
//! computes them ([`max_error`]). Copies (broadcast, gathers, scatters,
//! all-to-all, send/recv) are compared bit for bit. Integers are reduced with
//! wrapping arithmetic and compared exactly. A result that is not finite is
//! always wrong: the patterns never make one.

use cohort_runtime::{Bytes, Handle, ServerError};
use half::{bf16, f16};

use crate::error::CommError;
use crate::group::ClientGroup;
use crate::op::Collective;
use crate::ops::{DType, ReduceOp};

/// The buffers of one collective call, and the host copy of its inputs.
pub struct Buffers {
    /// The collective the buffers are laid out for.
    pub op: Collective,
    /// Their element type.
    pub dtype: DType,
    /// The root of rooted collectives.
    pub root: usize,
    /// Whether sources and destinations share memory in the in-place layout.
    pub in_place: bool,
    /// Bytes of the largest buffer (nccl-tests' "size").
    pub size: usize,
    /// Bytes of one member's block (`size / n` for gathers and scatters).
    pub block: usize,
    /// Each member's source.
    pub src: Vec<Handle>,
    /// Each member's destination.
    pub dst: Vec<Handle>,
    /// What each member's source holds.
    pub inputs: Vec<Vec<u8>>,
}

/// Input pattern of `member`: element `i` is drawn from a pseudo-random
/// sequence of (`member`, `i`), so elements, blocks and members differ (not
/// periodic: a shift by any number of elements shows). Floats are `±0.5`,
/// `±1` or `±2` (sums and products stay exact, see the module's
/// documentation); integers are 1 to 11 (sums of up to 11 members fit an
/// `i8`).
pub fn pattern(dtype: DType, member: usize, bytes: usize) -> Vec<u8> {
    fill(dtype, bytes / dtype.size(), |i| pattern_value(dtype, member, i))
}

/// Element `i` of `member`'s [`pattern`].
pub fn pattern_value(dtype: DType, member: usize, i: usize) -> Value {
    let h = mix(((member as u64) << 40) ^ i as u64);
    if dtype.is_float() {
        let magnitude = [0.5, 1.0, 2.0][(h % 3) as usize];
        Value::F(if (h >> 8) & 1 == 1 { -magnitude } else { magnitude })
    } else {
        Value::I((h % 11 + 1) as i128)
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit value of `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Buffers {
    /// Buffers for `op` of about `size` bytes (rounded down to whole blocks
    /// of `dtype` per member) on every member, inputs filled with
    /// [`pattern`]. Queues the uploads and returns.
    pub fn new(group: &ClientGroup, op: Collective, dtype: DType, size: usize, in_place: bool, root: usize) -> Buffers {
        let n = group.len();
        let e = dtype.size();
        let blocked = op.blocked();
        let size = if blocked { size / (n * e) * n * e } else { size / e * e };
        let block = if blocked { size / n } else { size };
        let in_place = in_place && op.has_in_place();
        let (src_bytes, dst_bytes) = op.lengths(block, n);
        let mut src = Vec::new();
        let mut dst = Vec::new();
        let inputs: Vec<Vec<u8>> = (0..n).map(|m| pattern(dtype, m, src_bytes)).collect();
        for (m, client) in group.clients().iter().enumerate() {
            let input = Bytes::from(inputs[m].clone());
            let (s, d) = if !in_place {
                (client.create(input), client.create(Bytes::from(vec![0u8; dst_bytes])))
            } else {
                let outer_is_dst = matches!(op, Collective::AllGather | Collective::Gather);
                let outer = client.create(Bytes::from(vec![0u8; src_bytes.max(dst_bytes)]));
                let at = if matches!(op, Collective::Gather | Collective::Scatter) && m != root {
                    None
                } else if blocked && op != Collective::AllToAll {
                    Some((m * block) as u64)
                } else {
                    Some(0)
                };
                match at {
                    None if outer_is_dst => (client.create(input), outer),
                    None => (outer, client.create(Bytes::from(vec![0u8; dst_bytes]))),
                    Some(at) => {
                        let inner_len = if outer_is_dst { src_bytes } else { dst_bytes } as u64;
                        let inner = outer.slice(at, inner_len).expect("the block lies inside its buffer");
                        let (s, d) = if outer_is_dst { (inner, outer) } else { (outer, inner) };
                        client.write(&s, input).expect("the source is on its member's device");
                        (s, d)
                    }
                }
            };
            src.push(s);
            dst.push(d);
        }
        Buffers { op, dtype, root, in_place, size, block, src, dst, inputs }
    }

    /// Writes the inputs again (an in-place run overwrote them).
    pub fn refill(&self, group: &ClientGroup) -> Result<(), ServerError> {
        for (m, client) in group.clients().iter().enumerate() {
            client.write(&self.src[m], Bytes::from(self.inputs[m].clone()))?;
        }
        Ok(())
    }

    /// Queues the collective once (a ring of `n` transfers for send/recv).
    pub fn run(&self, group: &ClientGroup, op: ReduceOp) -> Result<(), CommError> {
        let (dtype, root, n) = (self.dtype, self.root, group.len());
        let queued = match self.op {
            Collective::AllReduce => group.all_reduce_handles(&self.src, &self.dst, dtype, op),
            Collective::Reduce => group.reduce_handles(&self.src, &self.dst[root], dtype, op, root),
            Collective::Broadcast => group.broadcast_handles(&self.src[root], &self.dst, dtype, root),
            Collective::AllGather => group.all_gather_handles(&self.src, &self.dst, dtype),
            Collective::ReduceScatter => group.reduce_scatter_handles(&self.src, &self.dst, dtype, op),
            Collective::AllToAll => group.all_to_all_handles(&self.src, &self.dst, dtype),
            Collective::Gather => group.gather_handles(&self.src, &self.dst[root], dtype, root),
            Collective::Scatter => group.scatter_handles(&self.src[root], &self.dst, dtype, root),
            Collective::SendRecv => {
                return (0..n).try_for_each(|m| {
                    group.send_recv_handles(m, &self.src[m], (m + 1) % n, &self.dst[(m + 1) % n], dtype).map(drop)
                })
            }
            Collective::Barrier => return group.barrier(),
        };
        queued.map(drop)
    }

    /// The destinations the collective writes, by member.
    pub fn written(&self, n: usize) -> Vec<usize> {
        match self.op {
            Collective::Reduce | Collective::Gather => vec![self.root],
            Collective::Barrier => Vec::new(),
            _ => (0..n).collect(),
        }
    }

    /// Reads every written destination and counts the elements that differ
    /// from the host reference (beyond [`max_error`] for averages).
    pub fn wrong(&self, group: &ClientGroup, op: ReduceOp) -> Result<usize, ServerError> {
        let n = group.len();
        let want = expected(self.op, self.dtype, op, self.root, self.block, &self.inputs);
        let rop = self.op.reduces().then_some(op);
        let mut wrong = 0;
        for m in self.written(n) {
            let got = group.client(m).read_one(self.dst[m].clone())?;
            wrong += count_wrong(self.dtype, rop, &got, want[m].as_deref().unwrap_or(&[]), n);
        }
        Ok(wrong)
    }
}

/// A decoded element: floats as `f64`, integers as `i128`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// A float element.
    F(f64),
    /// An integer element.
    I(i128),
}

/// Decodes one `dtype` element from its bytes.
fn decode(dtype: DType, c: &[u8]) -> Value {
    match dtype {
        DType::F32 => Value::F(f32::from_le_bytes(c.try_into().unwrap()) as f64),
        DType::F64 => Value::F(f64::from_le_bytes(c.try_into().unwrap())),
        DType::F16 => Value::F(f16::from_le_bytes(c.try_into().unwrap()).to_f64()),
        DType::BF16 => Value::F(bf16::from_le_bytes(c.try_into().unwrap()).to_f64()),
        DType::I8 => Value::I(c[0] as i8 as i128),
        DType::U8 => Value::I(c[0] as i128),
        DType::I32 => Value::I(i32::from_le_bytes(c.try_into().unwrap()) as i128),
        DType::U32 => Value::I(u32::from_le_bytes(c.try_into().unwrap()) as i128),
        DType::I64 => Value::I(i64::from_le_bytes(c.try_into().unwrap()) as i128),
        DType::U64 => Value::I(u64::from_le_bytes(c.try_into().unwrap()) as i128),
    }
}

/// Writes `v` into `slot`, one `dtype` element (integers wrap, floats
/// round).
fn encode(dtype: DType, v: Value, slot: &mut [u8]) {
    let (f, i) = match v {
        Value::F(f) => (f, f as i128),
        Value::I(i) => (i as f64, i),
    };
    match dtype {
        DType::F32 => slot.copy_from_slice(&(f as f32).to_le_bytes()),
        DType::F64 => slot.copy_from_slice(&f.to_le_bytes()),
        DType::F16 => slot.copy_from_slice(&f16::from_f64(f).to_le_bytes()),
        DType::BF16 => slot.copy_from_slice(&bf16::from_f64(f).to_le_bytes()),
        DType::I8 => slot.copy_from_slice(&(i as i8).to_le_bytes()),
        DType::U8 => slot.copy_from_slice(&(i as u8).to_le_bytes()),
        DType::I32 => slot.copy_from_slice(&(i as i32).to_le_bytes()),
        DType::U32 => slot.copy_from_slice(&(i as u32).to_le_bytes()),
        DType::I64 => slot.copy_from_slice(&(i as i64).to_le_bytes()),
        DType::U64 => slot.copy_from_slice(&(i as u64).to_le_bytes()),
    }
}

/// `count` elements of `dtype`, element `i` being `value(i)`, encoded in
/// parallel chunks of 64 Ki elements (a GiB takes moments).
fn fill(dtype: DType, count: usize, value: impl Fn(usize) -> Value + Sync) -> Vec<u8> {
    use rayon::prelude::*;
    let e = dtype.size();
    let mut out = vec![0u8; count * e];
    out.par_chunks_mut(e << 16).enumerate().for_each(|(chunk, slots)| {
        for (k, slot) in slots.chunks_exact_mut(e).enumerate() {
            encode(dtype, value((chunk << 16) + k), slot);
        }
    });
    out
}

/// Decodes `bytes` of `dtype` elements.
pub fn load(dtype: DType, bytes: &[u8]) -> Vec<Value> {
    bytes.chunks_exact(dtype.size()).map(|c| decode(dtype, c)).collect()
}

/// Encodes values as `dtype` elements (integers wrap, floats round).
pub fn store(dtype: DType, values: &[Value]) -> Vec<u8> {
    fill(dtype, values.len(), |i| values[i])
}

/// The host reference of an element-wise reduction of `inputs`, element by
/// element (no decoded copy of the inputs) and in parallel chunks, so the
/// reference of a GiB takes moments.
pub fn reduce_reference(dtype: DType, op: ReduceOp, inputs: &[&[u8]]) -> Vec<u8> {
    let (n, e) = (inputs.len(), dtype.size());
    // Wrapped to the element type, as the device's integers are.
    let wrap = |exact: i128| {
        let mut one = [0u8; 8];
        encode(dtype, Value::I(exact), &mut one[..e]);
        decode(dtype, &one[..e])
    };
    fill(dtype, inputs[0].len() / e, |i| {
        let at = |input: &[u8]| decode(dtype, &input[i * e..(i + 1) * e]);
        let mut acc = at(inputs[0]);
        for input in &inputs[1..] {
            acc = match (acc, at(input)) {
                (Value::F(a), Value::F(b)) => Value::F(match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }),
                (Value::I(a), Value::I(b)) => wrap(match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }),
                _ => unreachable!("one dtype decodes to one kind of value"),
            };
        }
        match (op, acc) {
            (ReduceOp::Avg, Value::F(a)) => Value::F(a / n as f64),
            (ReduceOp::Avg, Value::I(a)) => Value::I(a / n as i128),
            _ => acc,
        }
    })
}

/// What every member's destination must hold after `op` over `inputs`
/// (`None` where it is not written).
pub fn expected(
    op: Collective,
    dtype: DType,
    rop: ReduceOp,
    root: usize,
    block: usize,
    inputs: &[Vec<u8>],
) -> Vec<Option<Vec<u8>>> {
    let n = inputs.len();
    let all: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let blk = |m: usize, k: usize| &inputs[m][k * block..(k + 1) * block];
    let concat = || inputs.concat();
    // Computed once, cloned for every member that needs it.
    let reduced = matches!(op, Collective::AllReduce | Collective::Reduce).then(|| reduce_reference(dtype, rop, &all));
    (0..n)
        .map(|m| match op {
            Collective::AllReduce => reduced.clone(),
            Collective::Reduce => (m == root).then(|| reduced.clone().expect("computed above")),
            Collective::Broadcast => Some(inputs[root].clone()),
            Collective::AllGather => Some(concat()),
            Collective::Gather => (m == root).then(concat),
            Collective::ReduceScatter => {
                let parts: Vec<&[u8]> = (0..n).map(|k| blk(k, m)).collect();
                Some(reduce_reference(dtype, rop, &parts))
            }
            Collective::AllToAll => Some((0..n).flat_map(|k| blk(k, m).to_vec()).collect()),
            Collective::Scatter => Some(blk(root, m).to_vec()),
            Collective::SendRecv => Some(inputs[(m + n - 1) % n].clone()),
            Collective::Barrier => None,
        })
        .collect()
}

/// Unit roundoff of a float type (half the distance from 1 to the next
/// value): 2^-53, 2^-24, 2^-11 (f16), 2^-8 (bf16); 0 for integers.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON / 2.0,
        DType::F32 => f32::EPSILON as f64 / 2.0,
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// The largest absolute difference from the reference `want` that an
/// element of a reduction `op` over `n` members of [`pattern`] inputs may
/// show (`None`: a copy, compared bit for bit).
///
/// * Integers, minima and maxima: 0 (nothing rounds).
/// * Sums and products: 0 while every partial sum and product of the
///   pattern's `±0.5/±1/±2` is exact in the type, whatever the order: sums
///   while `4n` half-units fit the significand (n ≤ 64 for bf16), products
///   while `2^±n` is a normal number or exact subnormal (n ≤ 15 for f16).
///   Beyond that, the bound of `n - 1` roundings of sums of at most `2n` in
///   magnitude, `(n - 1)·u·2n`, plus the reference's own rounding.
/// * Averages: NCCL multiplies each input by `1/n` rounded to the type, then
///   sums (`n + 1` roundings of terms of at most `2/n`: `(n + 2)·u·2`, with
///   10 % for the second-order terms), plus the reference's rounding
///   `u·|want|`; the host engine's sum-then-divide stays within the same.
pub fn max_error(dtype: DType, op: Option<ReduceOp>, n: usize, want: f64) -> f64 {
    let Some(op) = op else { return 0.0 };
    let u = unit_roundoff(dtype);
    if u == 0.0 {
        return 0.0;
    }
    let significand = (-u.log2()).round() as i32; // bits, with the implicit one
    let n_f = n as f64;
    match op {
        ReduceOp::Min | ReduceOp::Max => 0.0,
        ReduceOp::Sum if (4 * n) as f64 <= 2f64.powi(significand) => 0.0,
        ReduceOp::Sum => (n_f - 1.0) * u * 2.0 * n_f * 1.1 + u * want.abs(),
        // Powers of two: exact while finite (and above 2^-24); an overflow
        // is not finite, which `count_wrong` counts wrong.
        ReduceOp::Prod => 0.0,
        ReduceOp::Avg => (n_f + 2.0) * u * 2.0 * 1.1 + u * want.abs(),
    }
}

/// How many elements of `got` differ from `want`, the reference of a
/// reduction `op` over `n` members (`None`: a copy); floats beyond
/// [`max_error`], a non-finite float always, integers and copies at all;
/// length differences count every missing element.
pub fn count_wrong(dtype: DType, op: Option<ReduceOp>, got: &[u8], want: &[u8], n: usize) -> usize {
    use rayon::prelude::*;
    let e = dtype.size();
    let mismatched: usize = got
        .par_chunks(e << 16)
        .zip(want.par_chunks(e << 16))
        .map(|(g, w)| {
            g.chunks_exact(e)
                .zip(w.chunks_exact(e))
                .filter(|(gb, wb)| {
                    if op.is_none() || !dtype.is_float() {
                        return gb != wb;
                    }
                    match (decode(dtype, gb), decode(dtype, wb)) {
                        (Value::F(g), Value::F(w)) => {
                            !(g.is_finite() && w.is_finite() && (g - w).abs() <= max_error(dtype, op, n, w))
                        }
                        (g, w) => g != w,
                    }
                })
                .count()
        })
        .sum();
    mismatched + (got.len() / e).abs_diff(want.len() / e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_bytes(values: &[f64]) -> Vec<u8> {
        values.iter().flat_map(|&v| bf16::from_f64(v).to_le_bytes()).collect()
    }

    fn inputs(dtype: DType, n: usize, bytes: usize) -> Vec<Vec<u8>> {
        (0..n).map(|m| pattern(dtype, m, bytes)).collect()
    }

    #[test]
    fn patterns_differ_under_every_shift_and_between_members() {
        for dtype in DType::ALL {
            let count = 4096;
            let a = load(dtype, &pattern(dtype, 0, count * dtype.size()));
            for shift in 1..=300 {
                let same = (0..count - shift).filter(|&i| a[i] == a[i + shift]).count();
                assert!(same < (count - shift) / 2, "{dtype}: a shift by {shift} matches {same} elements");
            }
            for member in 1..16 {
                let b = load(dtype, &pattern(dtype, member, count * dtype.size()));
                let same = (0..count).filter(|&i| a[i] == b[i]).count();
                assert!(same < count / 2, "{dtype}: members 0 and {member} share {same} elements");
            }
        }
    }

    /// A reduce-scatter that hands each member the block after its own, and
    /// an all-gather whose blocks each start one element late (44 elements a
    /// block: the old pattern repeated every 11 elements and missed both).
    #[test]
    fn a_planted_off_by_one_block_is_caught() {
        let (n, elems) = (4, 44);
        for dtype in [DType::F32, DType::BF16, DType::I32, DType::U8] {
            let e = dtype.size();
            let block = elems * e;
            let ins = inputs(dtype, n, n * block);
            let want = expected(Collective::ReduceScatter, dtype, ReduceOp::Sum, 0, block, &ins);
            for m in 0..n {
                let next = want[(m + 1) % n].as_deref().unwrap();
                let wrong = count_wrong(dtype, Some(ReduceOp::Sum), next, want[m].as_deref().unwrap(), n);
                assert!(wrong > elems / 2, "{dtype}: member {m} given the next block: {wrong} wrong");
            }
            let ins = inputs(dtype, n, block);
            let want = expected(Collective::AllGather, dtype, ReduceOp::Sum, 0, block, &ins);
            let whole = want[0].as_deref().unwrap();
            let mut late = whole.to_vec();
            for k in 0..n {
                late.copy_within(k * block..(k + 1) * block - e, k * block + e);
            }
            let wrong = count_wrong(dtype, None, &late, whole, n);
            assert!(wrong > n * elems / 2, "{dtype}: blocks one element late: {wrong} wrong");
        }
    }

    /// One element of a bf16 sum one unit in the last place too large is
    /// caught (the old 8e-3·n relative tolerance let ±3 on ~48 pass), for a
    /// sum, a product, a maximum and a copy.
    #[test]
    fn a_planted_one_ulp_bf16_error_is_caught() {
        let n = 8;
        let ins = inputs(DType::BF16, n, 2 * 256);
        for (op, rop) in [
            (Collective::AllReduce, Some(ReduceOp::Sum)),
            (Collective::AllReduce, Some(ReduceOp::Prod)),
            (Collective::AllReduce, Some(ReduceOp::Max)),
            (Collective::Broadcast, None),
        ] {
            let want = expected(op, DType::BF16, rop.unwrap_or(ReduceOp::Sum), 0, 2 * 256, &ins);
            let want = want[0].as_deref().unwrap();
            assert_eq!(count_wrong(DType::BF16, rop, want, want, n), 0);
            for at in [0, 17, 255] {
                let mut got = want.to_vec();
                let bits = u16::from_le_bytes([got[2 * at], got[2 * at + 1]]);
                // The next value away from zero: one ulp larger in magnitude.
                got[2 * at..2 * at + 2].copy_from_slice(&(bits + 1).to_le_bytes());
                assert_eq!(count_wrong(DType::BF16, rop, &got, want, n), 1, "{op:?} {rop:?} at {at}");
            }
        }
    }

    #[test]
    fn products_stay_finite_and_a_non_finite_result_is_wrong() {
        for n in 2..=15 {
            let ins = inputs(DType::F16, n, 2 * 1000);
            let want = expected(Collective::AllReduce, DType::F16, ReduceOp::Prod, 0, 2 * 1000, &ins);
            let values = load(DType::F16, want[0].as_deref().unwrap());
            assert!(values.iter().all(|v| matches!(v, Value::F(f) if f.is_finite() && *f != 0.0)), "n = {n}");
        }
        let inf = f16::INFINITY.to_le_bytes();
        assert_eq!(count_wrong(DType::F16, Some(ReduceOp::Prod), &inf, &inf, 8), 1, "inf is never right");
        let nan = f16::NAN.to_le_bytes();
        assert_eq!(count_wrong(DType::F16, Some(ReduceOp::Sum), &nan, &nan, 8), 1, "nor NaN");
    }

    /// Averages as NCCL computes them in bf16 (each input times 1/n rounded
    /// to bf16, each product and partial sum rounded) pass: the bound is
    /// not tighter than the real error. A result off by a quarter is not.
    #[test]
    fn nccl_style_averages_pass_and_a_wrong_one_does_not() {
        for n in [2, 3, 5, 7, 8] {
            let count = 2000;
            let ins = inputs(DType::BF16, n, 2 * count);
            let want = expected(Collective::AllReduce, DType::BF16, ReduceOp::Avg, 0, 2 * count, &ins);
            let want = want[0].as_deref().unwrap();
            let decoded: Vec<Vec<Value>> = ins.iter().map(|i| load(DType::BF16, i)).collect();
            let round = |v: f64| bf16::from_f64(v).to_f64();
            let scale = round(1.0 / n as f64);
            let premul: Vec<f64> = (0..count)
                .map(|i| {
                    let term = |m: usize| match decoded[m][i] {
                        Value::F(x) => round(x * scale),
                        Value::I(_) => unreachable!(),
                    };
                    (1..n).fold(term(0), |acc, m| round(acc + term(m)))
                })
                .collect();
            let got = bf16_bytes(&premul);
            assert_eq!(count_wrong(DType::BF16, Some(ReduceOp::Avg), &got, want, n), 0, "n = {n}");
            let off: Vec<f64> = premul.iter().map(|v| v + 0.25).collect();
            assert_eq!(count_wrong(DType::BF16, Some(ReduceOp::Avg), &bf16_bytes(&off), want, n), count, "n = {n}");
        }
    }
}
