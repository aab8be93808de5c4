//! MXFP4 (OCP microscaling FP4), the format gpt-oss's experts ship in: each value an e2m1 nibble (two per byte, the
//! low nibble first), each run of 32 values along a row sharing one e8m0 scale (a power of two, bias 127).
//!
//! A checkpoint stores a projection as `*_blocks` `[.., out, in / 32, 16]` and `*_scales` `[.., out, in / 32]`;
//! [`TensorRef::mxfp4`] packs chosen rows of one matrix into a single [`DType::Mxfp4`] tensor `[rows, in]`: every
//! row's blocks (`in / 2` bytes each), then every row's scales (`in / 32` bytes each), so one matrix is one
//! contiguous run of bytes (what an expert slot holds) and the blocks stay 16-byte aligned for vector loads.

use super::weights::{DType, TensorRef};
use crate::{Error, Result};

/// Values sharing one scale.
pub const MXFP4_BLOCK: usize = 32;

/// The e2m1 values of the 16 nibbles (sign, two exponent bits, one mantissa bit).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The power of two an e8m0 byte stands for, `2^(byte - 127)`, exact in f32 (255, NaN in the standard, gives
/// infinity as transformers' dequantization does).
pub fn e8m0_scale(byte: u8) -> f32 {
    match byte {
        0 => f32::from_bits(1 << 22),
        255 => f32::INFINITY,
        b => f32::from_bits((b as u32) << 23),
    }
}

/// Row `row` of a packed `[rows, cols]` MXFP4 matrix (`bytes` as [`TensorRef::mxfp4`] lays them out), widened to
/// f32 into `out` (`cols` values).
pub fn dequantize_row(bytes: &[u8], rows: usize, cols: usize, row: usize, out: &mut [f32]) {
    let groups = cols / MXFP4_BLOCK;
    let blocks = &bytes[row * cols / 2..][..cols / 2];
    let scales = &bytes[rows * cols / 2 + row * groups..][..groups];
    for ((out, block), &scale) in out
        .chunks_exact_mut(MXFP4_BLOCK)
        .zip(blocks.chunks_exact(16))
        .zip(scales)
    {
        let scale = e8m0_scale(scale);
        for (pair, &byte) in out.chunks_exact_mut(2).zip(block) {
            pair[0] = E2M1_VALUES[(byte & 0x0f) as usize] * scale;
            pair[1] = E2M1_VALUES[(byte >> 4) as usize] * scale;
        }
    }
}

impl TensorRef {
    /// The rows `rows` (in that order) of one MXFP4 matrix stored as `blocks` `[out, in / 32, 16]` and `scales`
    /// `[out, in / 32]` (u8), packed into one `[rows, in]` [`DType::Mxfp4`] tensor named `name`.
    pub fn mxfp4(
        name: &str,
        blocks: &TensorRef,
        scales: &TensorRef,
        rows: impl Iterator<Item = usize> + Clone,
    ) -> Result<TensorRef> {
        let (out, groups) = match (blocks.shape.as_slice(), scales.shape.as_slice()) {
            (&[out, groups, 16], &[s_out, s_groups]) if (s_out, s_groups) == (out, groups) => (out, groups),
            _ => {
                return Err(Error::tensor(
                    name,
                    format!(
                        "MXFP4 blocks {:?} and scales {:?} do not match",
                        blocks.shape, scales.shape
                    ),
                ))
            }
        };
        for t in [blocks, scales] {
            if t.dtype != DType::U8 {
                return Err(Error::tensor(
                    &t.name,
                    format!("MXFP4 parts are u8, not {}", t.dtype.name()),
                ));
            }
        }
        let (block_bytes, scale_bytes) = (blocks.bytes(), scales.bytes());
        let mut bytes = Vec::with_capacity(rows.clone().count() * groups * 17);
        let mut count = 0;
        for r in rows.clone() {
            if r >= out {
                return Err(Error::tensor(name, format!("row {r} of {out}")));
            }
            bytes.extend_from_slice(&block_bytes[r * groups * 16..][..groups * 16]);
            count += 1;
        }
        for r in rows {
            bytes.extend_from_slice(&scale_bytes[r * groups..][..groups]);
        }
        TensorRef::from_bytes(name, DType::Mxfp4, vec![count, groups * MXFP4_BLOCK], bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_dequantize_as_transformers_does() {
        // Two rows of 32: row 0 all nibbles 0x1 / 0x9 (0.5 / -0.5) at scale 2^1, row 1 nibbles 0x7 / 0xf (6 / -6)
        // at scale 2^-2; transformers: lut[low nibble] then lut[high nibble], times 2^(scale - 127).
        let blocks = [[0x91u8; 16], [0xf7u8; 16]].concat();
        let scales = vec![128u8, 125];
        let blocks = TensorRef::from_bytes("b", DType::U8, vec![2, 1, 16], blocks).unwrap();
        let scales = TensorRef::from_bytes("s", DType::U8, vec![2, 1], scales).unwrap();
        let swapped = TensorRef::mxfp4("w", &blocks, &scales, [1, 0].into_iter()).unwrap();
        assert_eq!(
            (swapped.dtype, swapped.shape.clone(), swapped.byte_len()),
            (DType::Mxfp4, vec![2, 32], 34)
        );
        let mut row = vec![0.0; 32];
        dequantize_row(swapped.bytes(), 2, 32, 0, &mut row);
        assert!(row.chunks(2).all(|p| p == [1.5, -1.5]), "{row:?}");
        dequantize_row(swapped.bytes(), 2, 32, 1, &mut row);
        assert!(row.chunks(2).all(|p| p == [1.0, -1.0]), "{row:?}");
        assert!(TensorRef::mxfp4("w", &blocks, &scales, [2].into_iter()).is_err());
    }

    #[test]
    fn e8m0_covers_every_exponent() {
        assert_eq!(e8m0_scale(127), 1.0);
        assert_eq!(e8m0_scale(0), 2f32.powi(-127));
        assert_eq!(e8m0_scale(254), 2f32.powi(127));
        assert_eq!(e8m0_scale(255), f32::INFINITY);
    }
}
