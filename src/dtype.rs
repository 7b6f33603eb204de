//! Element types and the casts between floating-point types.
//!
//! Bytes are little-endian, as torch, safetensors and DCP store them. Casts go
//! through `f32`, the way torch's CPU kernels do: `float64 -> bfloat16` is
//! `float64 -> float32 -> bfloat16`, two roundings, because that is what
//! `tensor.to(torch.bfloat16)` produces and the output must be bit-identical
//! to it. Every rounding is to nearest, ties to even; subnormals are kept.
//!
//! NaN stays NaN; its bits are not promised beyond that, since torch's own
//! differ between CPUs and even between tensor lengths. Where torch (2.x,
//! x86-64) is consistent we follow it: `float32`/`float64 -> bfloat16` gives
//! `0xFFFF` (the AVX2/AVX-512 kernels' NaN), `float16 -> bfloat16` gives
//! `0x7FC0`; every other cast keeps the sign and the top payload bits and sets
//! the quiet bit, as the hardware conversions do.

use std::fmt;
use std::str::FromStr;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use thiserror::Error;

/// The element type of a chunk's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

/// A dtype name that Ravex does not know, or a cast it does not do.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DTypeError {
    #[error(
        "unknown dtype {0:?}; expected one of float32, float64, float16, bfloat16, \
         int64, int32, int16, int8, uint8, bool"
    )]
    Unknown(String),
    #[error(
        "cannot cast {from} to {to}: only float32, float64, float16 and bfloat16 \
         convert into each other; other dtypes must match"
    )]
    Cast { from: DType, to: DType },
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
    ];

    /// The name torch and the Python side use (`torch.float32` -> `"float32"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = DTypeError;

    fn from_str(s: &str) -> Result<DType, DTypeError> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| DTypeError::Unknown(s.to_string()))
    }
}

/// Whether elements of `from` can be written as `to`: equal dtypes (a byte
/// copy) or two floating-point dtypes (a cast).
pub fn check_cast(from: DType, to: DType) -> Result<(), DTypeError> {
    if from == to || (from.is_float() && to.is_float()) {
        Ok(())
    } else {
        Err(DTypeError::Cast { from, to })
    }
}

/// Elements converted per step: the scratch lives on the stack, so a cast
/// needs no memory beyond its output.
const BLOCK: usize = 4096;

/// Converts the elements in `src` (`from`, little-endian) into `dst` (`to`).
/// `src` and `dst` must hold the same number of elements and the cast must
/// pass [`check_cast`]. Equal dtypes are a byte copy.
pub fn cast_into(from: DType, to: DType, src: &[u8], dst: &mut [u8]) {
    let n = src.len() / from.size();
    assert_eq!(src.len(), n * from.size(), "partial source element");
    assert_eq!(dst.len(), n * to.size(), "source and target lengths differ");
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    assert!(
        from.is_float() && to.is_float(),
        "cannot cast {from} to {to}"
    );
    let mut scratch = [0f32; BLOCK];
    for (s, d) in src
        .chunks(BLOCK * from.size())
        .zip(dst.chunks_mut(BLOCK * to.size()))
    {
        let vals = &mut scratch[..s.len() / from.size()];
        decode_f32(from, s, vals);
        encode_f32(from, to, vals, d);
    }
}

/// Reads little-endian floats of `dtype` into `out`, exactly for 16-bit
/// types and rounded to nearest even for `float64`.
fn decode_f32(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes(b.try_into().unwrap());
            }
        }
        DType::F64 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(8)) {
                *o = f64::from_le_bytes(b.try_into().unwrap()) as f32;
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        DType::F16 => {
            let mut halves = [f16::ZERO; BLOCK];
            let halves = &mut halves[..out.len()];
            for (h, b) in halves.iter_mut().zip(src.chunks_exact(2)) {
                *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
            }
            // The slice form uses F16C where the CPU has it.
            halves.convert_to_f32_slice(out);
        }
        _ => unreachable!("{dtype} is not a float"),
    }
}

/// Writes `vals` as little-endian `to`; `from` is the dtype they were read
/// from, which decides the bits of a NaN written as bfloat16.
fn encode_f32(from: DType, to: DType, vals: &[f32], dst: &mut [u8]) {
    match to {
        DType::F32 => {
            for (v, b) in vals.iter().zip(dst.chunks_exact_mut(4)) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F64 => {
            for (v, b) in vals.iter().zip(dst.chunks_exact_mut(8)) {
                b.copy_from_slice(&f64::from(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            let nan = if from == DType::F16 { 0x7FC0 } else { 0xFFFF };
            for (v, b) in vals.iter().zip(dst.chunks_exact_mut(2)) {
                let bits = if v.is_nan() {
                    nan
                } else {
                    bf16::from_f32(*v).to_bits()
                };
                b.copy_from_slice(&bits.to_le_bytes());
            }
        }
        DType::F16 => {
            let mut halves = [f16::ZERO; BLOCK];
            let halves = &mut halves[..vals.len()];
            halves.convert_from_f32_slice(vals);
            for (h, b) in halves.iter().zip(dst.chunks_exact_mut(2)) {
                b.copy_from_slice(&h.to_bits().to_le_bytes());
            }
        }
        _ => unreachable!("{to} is not a float"),
    }
}

/// The value of element `i` of `src` as `f64`: exact for every dtype except
/// `int64` beyond 2^53. For comparisons, not for copies.
pub fn value_f64(dtype: DType, src: &[u8], i: usize) -> f64 {
    let at = |n: usize| &src[i * n..(i + 1) * n];
    match dtype {
        DType::F32 => f64::from(f32::from_le_bytes(at(4).try_into().unwrap())),
        DType::F64 => f64::from_le_bytes(at(8).try_into().unwrap()),
        DType::F16 => f64::from(f16::from_le_bytes(at(2).try_into().unwrap()).to_f32()),
        DType::BF16 => f64::from(bf16::from_le_bytes(at(2).try_into().unwrap()).to_f32()),
        _ => value_i128(dtype, src, i) as f64,
    }
}

/// The value of element `i` of an integer or bool `src`, exactly.
pub fn value_i128(dtype: DType, src: &[u8], i: usize) -> i128 {
    let at = |n: usize| &src[i * n..(i + 1) * n];
    match dtype {
        DType::I64 => i64::from_le_bytes(at(8).try_into().unwrap()).into(),
        DType::I32 => i32::from_le_bytes(at(4).try_into().unwrap()).into(),
        DType::I16 => i16::from_le_bytes(at(2).try_into().unwrap()).into(),
        DType::I8 => i8::from_le_bytes(at(1).try_into().unwrap()).into(),
        DType::U8 | DType::Bool => src[i].into(),
        _ => unreachable!("{dtype} is not an integer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round-to-nearest-even on the bits, the way c10's `round_to_nearest_even`
    /// writes it: add 0x7FFF plus the lowest kept bit, then truncate.
    fn reference_bf16(bits: u32) -> u16 {
        let lsb = (bits >> 16) & 1;
        ((bits as u64 + 0x7FFF + lsb as u64) >> 16) as u16
    }

    fn f32_to_bf16_bits(values: &[f32]) -> Vec<u16> {
        let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut dst = vec![0u8; values.len() * 2];
        cast_into(DType::F32, DType::BF16, &src, &mut dst);
        dst.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    fn cast_bits(from: DType, to: DType, src: &[u8]) -> Vec<u8> {
        let mut dst = vec![0u8; src.len() / from.size() * to.size()];
        cast_into(from, to, src, &mut dst);
        dst
    }

    #[test]
    fn names_and_sizes_round_trip() {
        let sizes = [4, 8, 2, 2, 8, 4, 2, 1, 1, 1];
        for (d, size) in DType::ALL.into_iter().zip(sizes) {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.size(), size);
        }
        let err = "float8".parse::<DType>().unwrap_err();
        assert!(err
            .to_string()
            .starts_with("unknown dtype \"float8\"; expected one of"));
    }

    #[test]
    fn only_floats_cast() {
        assert!(check_cast(DType::F32, DType::BF16).is_ok());
        assert!(check_cast(DType::I64, DType::I64).is_ok());
        let err = check_cast(DType::I32, DType::I64).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot cast int32 to int64: only float32, float64, float16 and bfloat16 \
             convert into each other; other dtypes must match"
        );
        assert!(check_cast(DType::F32, DType::Bool).is_err());
    }

    #[test]
    fn bf16_rounds_to_nearest_even_for_every_high_half() {
        // Every sign/exponent/high-mantissa pattern, each with the low halves
        // that decide rounding: exact, just below, at and above the tie.
        let lows = [
            0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000,
        ];
        let mut inputs = Vec::new();
        for high in 0u32..=0xFFFF {
            for &low in &lows {
                let bits = high << 16 | low;
                if !f32::from_bits(bits).is_nan() {
                    inputs.push(f32::from_bits(bits));
                }
            }
        }
        let got = f32_to_bf16_bits(&inputs);
        for (v, g) in inputs.iter().zip(got) {
            assert_eq!(g, reference_bf16(v.to_bits()), "bits {:#010x}", v.to_bits());
        }
    }

    #[test]
    fn bf16_ties_go_to_even() {
        // 1 + 2^-8 sits halfway between 1 and 1 + 2^-7: down to even 1.
        assert_eq!(f32_to_bf16_bits(&[1.0 + 2f32.powi(-8)]), [0x3F80]);
        // 1 + 3*2^-8 sits halfway between odd 1 + 2^-7 and even 1 + 2^-6: up.
        assert_eq!(f32_to_bf16_bits(&[1.0 + 3.0 * 2f32.powi(-8)]), [0x3F82]);
        // Just above the tie rounds up.
        assert_eq!(f32_to_bf16_bits(&[f32::from_bits(0x3F80_8001)]), [0x3F81]);
    }

    #[test]
    fn bf16_special_values() {
        let got = f32_to_bf16_bits(&[
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,                    // rounds up into infinity
            f32::from_bits(0x0000_8000), // smallest subnormal tie: down to 0
            f32::from_bits(0x0001_8000), // subnormal tie, odd: up
            f32::from_bits(0x8000_0001), // -tiny: -0
            -0.0,
        ]);
        assert_eq!(
            got,
            [0x7F80, 0xFF80, 0x7F80, 0x0000, 0x0002, 0x8000, 0x8000]
        );
        let nans = [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFF81_2345),
        ];
        for bits in f32_to_bf16_bits(&nans) {
            assert!(f32::from_bits(u32::from(bits) << 16).is_nan());
            assert_eq!(bits, 0xFFFF, "torch's x86 kernels write 0xFFFF");
        }
        let from_half = cast_bits(DType::F16, DType::BF16, &0x7E00u16.to_le_bytes());
        assert_eq!(from_half, 0x7FC0u16.to_le_bytes());
    }

    #[test]
    fn float64_casts_round_twice_through_float32_like_torch() {
        // Directly, 1 + 2^-8 + 2^-30 would round up to 1 + 2^-7; through
        // float32 it first becomes the tie 1 + 2^-8 and then rounds to even 1.
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        assert_eq!(
            cast_bits(DType::F64, DType::BF16, &v.to_le_bytes()),
            [0x80, 0x3F]
        );
        let v = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(
            cast_bits(DType::F64, DType::F16, &v.to_le_bytes()),
            0x3C00u16.to_le_bytes()
        );
    }

    #[test]
    fn float16_rounding_and_range() {
        let vals: Vec<u8> = [
            65519.0f32,
            65520.0,
            1.0 + 2f32.powi(-11),
            2f32.powi(-25),
            2f32.powi(-24),
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        let got: Vec<u16> = cast_bits(DType::F32, DType::F16, &vals)
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(got, [0x7BFF, 0x7C00, 0x3C00, 0x0000, 0x0001]);
        let nan = cast_bits(DType::F32, DType::F16, &0xFF81_2345u32.to_le_bytes());
        assert_eq!(nan, 0xFE09u16.to_le_bytes());
    }

    #[test]
    fn widening_casts_are_exact_and_round_trip() {
        let halves: Vec<u16> = (0..=0xFFFFu16).collect();
        let src: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
        for dtype in [DType::F16, DType::BF16] {
            for wide in [DType::F32, DType::F64] {
                let back = cast_bits(wide, dtype, &cast_bits(dtype, wide, &src));
                for (i, (a, b)) in src.chunks(2).zip(back.chunks(2)).enumerate() {
                    let (a, b) = (
                        u16::from_le_bytes([a[0], a[1]]),
                        u16::from_le_bytes([b[0], b[1]]),
                    );
                    let nan = (a & 0x7FFF) > if dtype == DType::F16 { 0x7C00 } else { 0x7F80 };
                    assert!(
                        a == b || nan,
                        "{dtype} -> {wide} -> {dtype}: {i:#06x} gave {b:#06x}"
                    );
                }
            }
        }
    }

    #[test]
    fn same_dtype_is_a_byte_copy_for_any_dtype() {
        let src: Vec<u8> = (0..64).collect();
        for d in DType::ALL {
            let n = src.len() / d.size() * d.size();
            assert_eq!(cast_bits(d, d, &src[..n]), &src[..n]);
        }
    }

    #[test]
    fn long_inputs_cross_block_boundaries() {
        let vals: Vec<f32> = (0..3 * BLOCK + 7).map(|i| i as f32 * 0.37).collect();
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let half = cast_bits(DType::F32, DType::F16, &src);
        for (i, b) in half.chunks_exact(2).enumerate() {
            assert_eq!(f16::from_le_bytes([b[0], b[1]]), f16::from_f32(vals[i]));
        }
    }

    #[test]
    fn values_for_comparison() {
        let b = (-3i16).to_le_bytes();
        assert_eq!(value_i128(DType::I16, &b, 0), -3);
        assert_eq!(value_f64(DType::I16, &b, 0), -3.0);
        assert_eq!(value_f64(DType::BF16, &[0x80, 0x3F, 0x00, 0x40], 1), 2.0);
        assert_eq!(value_i128(DType::Bool, &[0, 1], 1), 1);
    }
}
