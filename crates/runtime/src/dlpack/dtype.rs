//! cohort's element types as DLPack data types, and back.

use dlpark::ffi::{DLDataType, DLDataTypeCode};

use super::refused;
use crate::dtype::DType;
use crate::error::ServerError;

/// The DLPack data type of `dtype`: one lane of its code and width
/// (`f16` is IEEE `float` 16, `bf16` is `bfloat` 16).
pub fn dtype_to_dlpack(dtype: DType) -> DLDataType {
    let code = match dtype {
        DType::F32 | DType::F64 | DType::F16 => DLDataTypeCode::FLOAT,
        DType::BF16 => DLDataTypeCode::BFLOAT,
        DType::I8 | DType::I32 | DType::I64 => DLDataTypeCode::INT,
        DType::U8 | DType::U32 | DType::U64 => DLDataTypeCode::UINT,
    };
    DLDataType::scalar(code, (dtype.size() * 8) as u8)
}

/// The cohort element type of a DLPack data type. Refused, with an error
/// naming the type and listing what cohort takes: `bool`, complex, the
/// 8-, 6- and 4-bit floats, other widths (`int16`, `float128`), and vector
/// types (more than one lane).
pub fn dtype_from_dlpack(dtype: DLDataType) -> Result<DType, ServerError> {
    DType::ALL.into_iter().find(|&d| dtype_to_dlpack(d).matches(dtype)).ok_or_else(|| {
        let supported: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        refused(format!(
            "DLPack element type {} is not supported: cohort takes {} (one lane each)",
            describe(dtype),
            supported.join(", ")
        ))
    })
}

/// A DLPack data type as NumPy and PyTorch spell it (`float32`, `bool`,
/// `complex64`, `float8_e4m3fn`), with `x<lanes>` for a vector type.
pub(crate) fn describe(dtype: DLDataType) -> String {
    let bits = dtype.bits;
    let name = match dtype.code {
        DLDataTypeCode::INT => format!("int{bits}"),
        DLDataTypeCode::UINT => format!("uint{bits}"),
        DLDataTypeCode::FLOAT => format!("float{bits}"),
        DLDataTypeCode::BFLOAT => format!("bfloat{bits}"),
        DLDataTypeCode::COMPLEX => format!("complex{bits}"),
        DLDataTypeCode::BOOL => "bool".to_string(),
        DLDataTypeCode::OPAQUEHANDLE => format!("opaque handle ({bits} bits)"),
        DLDataTypeCode::FLOAT8_E3M4 => "float8_e3m4".to_string(),
        DLDataTypeCode::FLOAT8_E4M3 => "float8_e4m3".to_string(),
        DLDataTypeCode::FLOAT8_E4M3B11FNUZ => "float8_e4m3b11fnuz".to_string(),
        DLDataTypeCode::FLOAT8_E4M3FN => "float8_e4m3fn".to_string(),
        DLDataTypeCode::FLOAT8_E4M3FNUZ => "float8_e4m3fnuz".to_string(),
        DLDataTypeCode::FLOAT8_E5M2 => "float8_e5m2".to_string(),
        DLDataTypeCode::FLOAT8_E5M2FNUZ => "float8_e5m2fnuz".to_string(),
        DLDataTypeCode::FLOAT8_E8M0FNU => "float8_e8m0fnu".to_string(),
        DLDataTypeCode::FLOAT6_E2M3FN => "float6_e2m3fn".to_string(),
        DLDataTypeCode::FLOAT6_E3M2FN => "float6_e3m2fn".to_string(),
        DLDataTypeCode::FLOAT4_E2M1FN => "float4_e2m1fn".to_string(),
        other => format!("type code {} ({bits} bits)", other.0),
    };
    match dtype.lanes {
        1 => name,
        lanes => format!("{name}x{lanes}"),
    }
}
