//! What a collective computes: element types, reduction operators, and the
//! element-wise reduction loops the host engine runs.

use std::fmt;

use half::{bf16, f16};

/// The element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// IEEE half precision (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// `i8`.
    I8,
    /// `u8`.
    U8,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
    /// `i64`.
    I64,
    /// `u64`.
    U64,
}

impl DType {
    /// Every element type, in a fixed order (for tests and benches).
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The name nccl-tests prints ("float", "half", "int32", ...).
    pub fn nccl_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
        }
    }

    /// Parses a name as nccl-tests (`float`, `half`, `int32`) or Rust
    /// (`f32`, `f16`, `i32`) spells it.
    pub fn parse(name: &str) -> Option<DType> {
        let lower = name.to_ascii_lowercase();
        DType::ALL.into_iter().find(|d| d.nccl_name() == lower || d.to_string() == lower)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        };
        f.write_str(name)
    }
}

/// How a reduction combines the members' elements.
///
/// Integer `Sum` and `Prod` wrap on overflow; `Avg` is the sum (wrapping for
/// integers) divided by the number of members (truncating for integers).
/// Members are combined in member order, so every destination of one
/// collective gets bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The smallest element.
    Min,
    /// The largest element.
    Max,
    /// The sum divided by the number of members.
    Avg,
}

impl ReduceOp {
    /// Every operator, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The name nccl-tests prints.
    pub fn nccl_name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses `sum`, `prod`, `min`, `max` or `avg`.
    pub fn parse(name: &str) -> Option<ReduceOp> {
        let lower = name.to_ascii_lowercase();
        ReduceOp::ALL.into_iter().find(|op| op.nccl_name() == lower)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.nccl_name())
    }
}

/// An element type the host engine reduces. Implemented for the ten types
/// of [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
    /// The smaller of `a` and `b`.
    fn min(a: Self, b: Self) -> Self;
    /// The larger of `a` and `b`.
    fn max(a: Self, b: Self) -> Self;
    /// `a / n` (truncating for integers), the last step of `Avg`.
    fn div_count(a: Self, n: usize) -> Self;
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            #[inline(always)]
            fn div_count(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
int_element!(i8, u8, i32, u32, i64, u64);

macro_rules! float_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a + b }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a * b }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)]
            fn div_count(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
float_element!(f32, f64);

macro_rules! half_element {
    ($($t:ty),*) => {$(
        // Each step computes in f32 and rounds back, as a GPU's half
        // arithmetic does.
        impl Element for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() + b.to_f32()) }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() * b.to_f32()) }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)]
            fn div_count(a: Self, n: usize) -> Self { <$t>::from_f32(a.to_f32() / n as f32) }
        }
    )*};
}
half_element!(f16, bf16);

/// `acc[i] = op(acc[i], x[i])` for every `i` (`Avg` combines as `Sum`).
pub fn combine<T: Element>(acc: &mut [T], x: &[T], op: ReduceOp) {
    debug_assert_eq!(acc.len(), x.len());
    // One loop per operator, so each compiles to a vectorisable body.
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::add(*a, b)),
        ReduceOp::Prod => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::mul(*a, b)),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::min(*a, b)),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::max(*a, b)),
    }
}

/// The last step of a reduction over `members` inputs: divides by `members`
/// for `Avg`, nothing for the others.
pub fn finish<T: Element>(acc: &mut [T], op: ReduceOp, members: usize) {
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a = T::div_count(*a, members));
    }
}

/// Calls `$body` with `$T` bound to the Rust type of `$dtype`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

/// Reduces `inputs` (each `len` bytes of `dtype` elements) element-wise with
/// `op`, in order, into `out`. A host reference for tests and checks: plain
/// loops over unaligned bytes, no parallelism.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    with_dtype!(dtype, T => {
        let mut acc: Vec<T> = bytemuck::pod_collect_to_vec(inputs[0]);
        for input in &inputs[1..] {
            let x: Vec<T> = bytemuck::pod_collect_to_vec(input);
            combine(&mut acc, &x, op);
        }
        finish(&mut acc, op, inputs.len());
        out.copy_from_slice(bytemuck::cast_slice(&acc));
    })
}
