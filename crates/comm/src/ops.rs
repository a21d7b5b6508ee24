//! What a collective computes: element types, reduction operators, and the
//! element-wise reduction loops the host engine runs.

use half::{bf16, f16};

pub use cohort_runtime::{DType, ReduceOp};

/// An element type of typed buffers and of the host engine's reductions.
/// Implemented for the ten types of [`DType`]: `f32`, `f64`, `half::f16`,
/// `half::bf16`, `i8`, `u8`, `i32`, `u32`, `i64`, `u64`.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The [`DType`] that names this type in collectives and fingerprints.
    const DTYPE: DType;
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
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
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
int_element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64);

macro_rules! float_element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
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
float_element!(f32 => F32, f64 => F64);

macro_rules! half_element {
    ($($t:ty => $d:ident),*) => {$(
        // Each step computes in f32 and rounds back, as a GPU's half
        // arithmetic does.
        impl Element for $t {
            const DTYPE: DType = DType::$d;
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
half_element!(f16 => F16, bf16 => BF16);

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
