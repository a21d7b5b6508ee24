//! Checking collectives against the host: buffer layouts for each
//! collective (in and out of place), input patterns, a host reference
//! computed independently of the engine, and an element-wise comparison.
//! The tests and `all_reduce_bench` share it.
//!
//! The reference reduces floats in `f64` (member order) and rounds once, so
//! floats are compared within a relative tolerance ([`tolerance`]); integers
//! are reduced with wrapping arithmetic and compared exactly.

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

/// Input pattern of `member`: small positive integers, exact in every type.
pub fn pattern(dtype: DType, member: usize, bytes: usize) -> Vec<u8> {
    fill(dtype, bytes / dtype.size(), |i| Value::F(((member * 7 + i * 3) % 11 + 1) as f64))
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
        match self.op {
            Collective::AllReduce => group.all_reduce(&self.src, &self.dst, dtype, op),
            Collective::Reduce => group.reduce(&self.src, &self.dst[root], dtype, op, root),
            Collective::Broadcast => group.broadcast(&self.src[root], &self.dst, dtype, root),
            Collective::AllGather => group.all_gather(&self.src, &self.dst, dtype),
            Collective::ReduceScatter => group.reduce_scatter(&self.src, &self.dst, dtype, op),
            Collective::AllToAll => group.all_to_all(&self.src, &self.dst, dtype),
            Collective::Gather => group.gather(&self.src, &self.dst[root], dtype, root),
            Collective::Scatter => group.scatter(&self.src[root], &self.dst, dtype, root),
            Collective::SendRecv => {
                (0..n).try_for_each(|m| group.send_recv(m, &self.src[m], (m + 1) % n, &self.dst[(m + 1) % n], dtype))
            }
            Collective::Barrier => group.barrier(),
        }
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
    /// from the host reference (beyond [`tolerance`] for floats).
    pub fn wrong(&self, group: &ClientGroup, op: ReduceOp) -> Result<usize, ServerError> {
        let n = group.len();
        let want = expected(self.op, self.dtype, op, self.root, self.block, &self.inputs);
        let mut wrong = 0;
        for m in self.written(n) {
            let got = group.client(m).read_one(self.dst[m].clone())?;
            wrong += count_wrong(self.dtype, &got, want[m].as_deref().unwrap_or(&[]), n);
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

/// Relative tolerance of float comparisons against the reference over `n`
/// members: the engine rounds after every step in the element type, the
/// reference once. f64: 1e-12 · n, f32: 1e-6 · n, f16: 1e-3 · n, bf16:
/// 8e-3 · n; integers: exact.
pub fn tolerance(dtype: DType, n: usize) -> f64 {
    let per_step = match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        _ => 0.0,
    };
    per_step * n as f64
}

/// How many elements of `got` differ from `want` (length differences count
/// every missing element).
pub fn count_wrong(dtype: DType, got: &[u8], want: &[u8], n: usize) -> usize {
    use rayon::prelude::*;
    let e = dtype.size();
    let tol = tolerance(dtype, n);
    let mismatched: usize = got
        .par_chunks(e << 16)
        .zip(want.par_chunks(e << 16))
        .map(|(g, w)| {
            g.chunks_exact(e)
                .zip(w.chunks_exact(e))
                .filter(|(g, w)| match (decode(dtype, g), decode(dtype, w)) {
                    (Value::F(g), Value::F(w)) => {
                        !(g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol * w.abs().max(1.0))
                    }
                    (g, w) => g != w,
                })
                .count()
        })
        .sum();
    mismatched + (got.len() / e).abs_diff(want.len() / e)
}
