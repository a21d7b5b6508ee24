//! Element types and reduction operators of collectives: what device
//! collectives (NCCL) and the communication layer's host engine compute.
//! The communication crate re-exports them (`cohort::comm::{DType,
//! ReduceOp}`).

use std::fmt;

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

impl DType {
    /// The type's name as Rust spells it (`f32`, `bf16`, `u8`): what
    /// `Display` writes, without formatting.
    pub fn name(self) -> &'static str {
        match self {
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
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
