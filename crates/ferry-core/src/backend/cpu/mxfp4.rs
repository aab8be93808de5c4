//! Products with MXFP4 weight matrices on the CPU (gpt-oss's experts): rows are widened to f32 a tile at a time
//! into a buffer that stays in cache, then multiplied by [`gemv`]'s F32 SIMD kernels against every token, so each
//! packed weight byte is read from memory once per call, as with the other dtypes.

use std::ops::Range;

use rayon::prelude::*;

use super::gemv::{self, WeightDType};
use crate::loader::mxfp4::dequantize_row;

/// Rows widened per tile: 16 rows of gpt-oss's 2880 inputs are 184 KB of f32.
pub(super) const TILE_ROWS: usize = 16;

/// `out = x W^T` for `tokens` rows of `x` (`[tokens, k]`) and `w` a packed `[n, k]` MXFP4 matrix; `out` is
/// `[tokens, n]`. Tiles run in parallel on rayon's threads.
pub(super) fn matmul(x: &[f32], tokens: usize, k: usize, w: &[u8], n: usize, out: &mut [f32]) {
    let tiles = n.div_ceil(TILE_ROWS);
    let tile = |t: usize| -> Vec<f32> {
        let rows = t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n);
        let mut widened = vec![0.0; rows.len() * k];
        let mut tile_out = vec![0.0; tokens * rows.len()];
        tile_product(x, tokens, k, w, n, rows, &mut widened, &mut tile_out);
        tile_out
    };
    let results: Vec<Vec<f32>> = (0..tiles).into_par_iter().map(tile).collect();
    for (t, tile_out) in results.iter().enumerate() {
        let width = tile_out.len() / tokens.max(1);
        for (token, values) in tile_out.chunks_exact(width.max(1)).enumerate() {
            out[token * n + t * TILE_ROWS..][..width].copy_from_slice(values);
        }
    }
}

/// Rows `rows` (one tile: at most [`TILE_ROWS`], starting on a multiple of it) of the packed `[n, k]` MXFP4
/// matrix `w` against the `tokens` rows of `x`: widened into `widened` (at least `rows.len() * k` values), then
/// multiplied into `tile_out` (`[tokens, rows.len()]`). The CPU lane calls it tile by tile too, so its products
/// equal [`matmul`]'s to the bit.
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_product(
    x: &[f32],
    tokens: usize,
    k: usize,
    w: &[u8],
    n: usize,
    rows: Range<usize>,
    widened: &mut [f32],
    tile_out: &mut [f32],
) {
    let widened = &mut widened[..rows.len() * k];
    for (r, row) in rows.clone().zip(widened.chunks_exact_mut(k)) {
        dequantize_row(w, n, k, r, row);
    }
    // SAFETY: any f32 is four initialised bytes; the GEMV kernels read them as little-endian f32 (all the targets
    // they build for are little-endian) and need no alignment.
    let bytes = unsafe { std::slice::from_raw_parts(widened.as_ptr().cast::<u8>(), widened.len() * 4) };
    gemv::matmul_serial(x, tokens, k, bytes, WeightDType::F32, rows.len(), tile_out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain product with the dequantized matrix, for 3 tokens and 37 rows (two full tiles and a
    /// partial one) of 64 inputs.
    #[test]
    fn mxfp4_product_matches_the_dequantized_matrix() {
        let (n, k, tokens) = (37, 64, 3);
        let mut bytes: Vec<u8> = (0..n * k / 2).map(|i| (i * 97 % 251) as u8).collect();
        bytes.extend((0..n * k / 32).map(|i| 124 + (i % 5) as u8));
        let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let mut got = vec![0.0; tokens * n];
        matmul(&x, tokens, k, &bytes, n, &mut got);
        let mut row = vec![0.0; k];
        for r in 0..n {
            dequantize_row(&bytes, n, k, r, &mut row);
            for t in 0..tokens {
                let want: f32 = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(w, x)| w * x).sum();
                let err = (got[t * n + r] - want).abs();
                assert!(
                    err <= 1e-5 * want.abs().max(1.0),
                    "token {t}, row {r}: {} against {want}",
                    got[t * n + r]
                );
            }
        }
    }
}
