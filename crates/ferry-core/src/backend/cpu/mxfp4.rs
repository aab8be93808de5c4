//! Products with MXFP4 weight matrices on the CPU (gpt-oss's experts). With a few tokens (decode, the CPU lane's
//! jobs) the selected GEMV path reads the packed rows in registers ([`gemv::mxfp4_fused`]); otherwise, and on
//! the scalar path, rows are widened to f32 a tile at a time into a buffer that stays in cache, then multiplied
//! by [`gemv`]'s F32 SIMD kernels against every token. Either way each packed weight byte is read from memory once
//! per call, as with the other dtypes.

use std::ops::Range;

use rayon::prelude::*;

use super::gemv::{self, Mxfp4RowsFn, WeightDType, MXFP4_FUSED_TOKENS};
use crate::loader::mxfp4::dequantize_row;

/// Rows widened at a time where the rows are not read packed: 16 rows of gpt-oss's 2880 inputs are 184 KB of f32.
pub(super) const TILE_ROWS: usize = 16;

/// Rows per rayon task of [`matmul`].
const TASK_ROWS: usize = 4 * TILE_ROWS;

/// The product that reads packed rows in registers, where the selected path has one and `tokens` is few enough.
fn fused_for(tokens: usize) -> Option<Mxfp4RowsFn> {
    gemv::mxfp4_fused().filter(|_| tokens <= MXFP4_FUSED_TOKENS)
}

/// Values of the buffer [`product_rows`] needs for `tokens` tokens and rows of `k` values: a tile's widened rows
/// and their products, or none where it reads the rows packed.
pub(super) fn tile_len(tokens: usize, k: usize) -> usize {
    if fused_for(tokens).is_some() {
        0
    } else {
        TILE_ROWS * (k + tokens)
    }
}

/// `out = x W^T` for `tokens` rows of `x` (`[tokens, k]`) and `w` a packed `[n, k]` MXFP4 matrix; `out` is
/// `[tokens, n]`. Runs [`TASK_ROWS`] rows a task on rayon's threads.
pub(super) fn matmul(x: &[f32], tokens: usize, k: usize, w: &[u8], n: usize, out: &mut [f32]) {
    let task = |t: usize| -> Vec<f32> {
        let rows = t * TASK_ROWS..((t + 1) * TASK_ROWS).min(n);
        let mut tile = vec![0.0; tile_len(tokens, k)];
        let mut task_out = vec![0.0; tokens * rows.len()];
        product_rows(x, tokens, k, w, n, rows, &mut task_out, &mut tile);
        task_out
    };
    let results: Vec<Vec<f32>> = (0..n.div_ceil(TASK_ROWS)).into_par_iter().map(task).collect();
    for (t, task_out) in results.iter().enumerate() {
        let width = task_out.len() / tokens.max(1);
        for (token, values) in task_out.chunks_exact(width.max(1)).enumerate() {
            out[token * n + t * TASK_ROWS..][..width].copy_from_slice(values);
        }
    }
}

/// Rows `rows` (starting on a multiple of [`TILE_ROWS`]) of the packed `[n, k]` MXFP4 matrix `w` against the
/// `tokens` rows of `x`, into `out` (`[tokens, rows.len()]`): read packed in one call where [`fused_for`] allows,
/// else a tile of rows at a time widened into `tile` (at least [`tile_len`] values), multiplied, and the tile's
/// products copied to their columns. A row's products do not depend on the other rows of the call, so the CPU
/// lane's equal [`matmul`]'s to the bit.
#[allow(clippy::too_many_arguments)]
pub(super) fn product_rows(
    x: &[f32],
    tokens: usize,
    k: usize,
    w: &[u8],
    n: usize,
    rows: Range<usize>,
    out: &mut [f32],
    tile: &mut [f32],
) {
    if let Some(fused) = fused_for(tokens) {
        return fused(x, tokens, k, w, n, rows, out);
    }
    let width = rows.len();
    let (widened, products) = tile.split_at_mut(TILE_ROWS * k);
    for first in rows.clone().step_by(TILE_ROWS) {
        let tile_rows = first..(first + TILE_ROWS).min(rows.end);
        let widened = &mut widened[..tile_rows.len() * k];
        for (r, row) in tile_rows.clone().zip(widened.chunks_exact_mut(k)) {
            dequantize_row(w, n, k, r, row);
        }
        // SAFETY: any f32 is four initialised bytes; the GEMV kernels read them as little-endian f32 (all the
        // targets they build for are little-endian) and need no alignment.
        let bytes = unsafe { std::slice::from_raw_parts(widened.as_ptr().cast::<u8>(), widened.len() * 4) };
        let products = &mut products[..tokens * tile_rows.len()];
        gemv::matmul_serial(x, tokens, k, bytes, WeightDType::F32, tile_rows.len(), products);
        for (t, values) in products.chunks_exact(tile_rows.len()).enumerate() {
            out[t * width + first - rows.start..][..values.len()].copy_from_slice(values);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain product with the dequantized matrix, for 37 rows (two full tiles and a partial one) of 64
    /// inputs and 1 to 6 tokens: read packed up to [`MXFP4_FUSED_TOKENS`] where the CPU can, widened beyond.
    #[test]
    fn mxfp4_product_matches_the_dequantized_matrix() {
        let matmul = |x: &[f32], tokens, k, w: &[u8], n, out: &mut [f32]| matmul(x, tokens, k, w, n, out);
        for tokens in 1..=6 {
            product_matches_the_dequantized_matrix(matmul, 37, 64, tokens);
        }
        // gpt-oss's width: 90 blocks a row.
        for tokens in 1..=MXFP4_FUSED_TOKENS + 1 {
            product_matches_the_dequantized_matrix(matmul, 5, 2880, tokens);
        }
    }

    /// Every packed product this CPU can run (`avx2`, `avx512`), not only the selected path's, likewise.
    #[test]
    fn every_packed_mxfp4_kernel_matches_the_dequantized_matrix() {
        for (name, fused) in gemv::mxfp4_fused_kernels() {
            eprintln!("{name}");
            let all_rows = |x: &[f32], tokens, k, w: &[u8], n, out: &mut [f32]| fused(x, tokens, k, w, n, 0..n, out);
            for tokens in 1..=MXFP4_FUSED_TOKENS {
                product_matches_the_dequantized_matrix(all_rows, 37, 64, tokens);
                product_matches_the_dequantized_matrix(all_rows, 5, 2880, tokens);
            }
        }
    }

    fn product_matches_the_dequantized_matrix(
        product: impl Fn(&[f32], usize, usize, &[u8], usize, &mut [f32]),
        n: usize,
        k: usize,
        tokens: usize,
    ) {
        let mut bytes: Vec<u8> = (0..n * k / 2).map(|i| (i * 97 % 251) as u8).collect();
        bytes.extend((0..n * k / 32).map(|i| 124 + (i % 5) as u8));
        // Row 1's first block scaled by e8m0's 255 (infinity, as transformers reads it), row 2's by 0 (2^-127).
        let scales = n * k / 2;
        bytes[scales + k / 32] = 255;
        bytes[scales + 2 * k / 32] = 0;
        let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let mut got = vec![0.0; tokens * n];
        product(&x, tokens, k, &bytes, n, &mut got);
        let mut row = vec![0.0; k];
        for r in 0..n {
            dequantize_row(&bytes, n, k, r, &mut row);
            for t in 0..tokens {
                let want: f32 = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(w, x)| w * x).sum();
                if !want.is_finite() {
                    let got = got[t * n + r];
                    assert!(
                        got.is_nan() == want.is_nan() && (want.is_nan() || got == want),
                        "token {t}, row {r}: {got} against {want}"
                    );
                    continue;
                }
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
