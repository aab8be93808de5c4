//! MXFP4 rows against a few tokens, read packed: each block of 32 values is looked up from its nibbles in
//! registers, in a 16-value e2m1 table scaled once a block by its e8m0 scale (a power of two, so the weights are
//! `dequantize_row`'s to the bit: the same f32 products), and multiplied into the tokens' sums; only the order of
//! the additions differs from widening the rows and running the F32 kernel.
//!
//! - `avx512`: a block's 16 bytes are zero-extended to 16 lanes; `vpermps` on 16 entries reads a lane's low 4 bits,
//!   so the bytes give the even values and the bytes shifted right by 4 the odd ones, multiplied by the tokens'
//!   activations split once per call into each block's even and odd values.
//! - `avx2`: each 4-byte word is broadcast to the 8 lanes and shifted right by 0, 4, .., 28, so lane j's low bits
//!   hold value j; `vpermps` on 8 entries reads 3 bits, the magnitude, and the word shifted left by 28, 24, .., 0
//!   puts the nibble's sign bit where an f32's is.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::hsum256;
use crate::loader::mxfp4::{e8m0_scale, E2M1_VALUES, MXFP4_BLOCK};

/// Most tokens one call multiplies: each keeps two accumulators in registers, beside the lookup's constants.
pub(in crate::backend::cpu) const MXFP4_FUSED_TOKENS: usize = 4;

/// The `avx2` path's product, needing its features (the caller checked): `out[t * rows.len() + i] = x[t] ·
/// W[rows.start + i]` for the tokens of `x` (`[tokens, k]`, at most [`MXFP4_FUSED_TOKENS`]) and rows `rows` of the
/// packed `[n, k]` MXFP4 matrix `w` (loader/mxfp4.rs's layout). Panics on shapes that do not fit.
pub(super) fn avx2_rows(x: &[f32], tokens: usize, k: usize, w: &[u8], n: usize, rows: Range<usize>, out: &mut [f32]) {
    check_shapes(x, tokens, k, w, n, &rows, out);
    // SAFETY: the shapes are checked; the features are the caller's check.
    unsafe {
        match tokens {
            1 => avx2_kernel::<1>(x, k, w, n, rows, out),
            2 => avx2_kernel::<2>(x, k, w, n, rows, out),
            3 => avx2_kernel::<3>(x, k, w, n, rows, out),
            4 => avx2_kernel::<4>(x, k, w, n, rows, out),
            _ => unreachable!("checked"),
        }
    }
}

/// [`avx2_rows`] on the `avx512` path, needing its features (the caller checked).
pub(super) fn avx512_rows(x: &[f32], tokens: usize, k: usize, w: &[u8], n: usize, rows: Range<usize>, out: &mut [f32]) {
    check_shapes(x, tokens, k, w, n, &rows, out);
    // Each block's 32 activations as its 16 even ones, then its 16 odd ones: the order the lookups give weights in.
    let mut split = vec![0.0; x.len()];
    for (block, values) in x.chunks_exact(MXFP4_BLOCK).enumerate() {
        let (even, odd) = split[block * MXFP4_BLOCK..][..MXFP4_BLOCK].split_at_mut(MXFP4_BLOCK / 2);
        for ((e, o), pair) in even.iter_mut().zip(odd).zip(values.chunks_exact(2)) {
            (*e, *o) = (pair[0], pair[1]);
        }
    }
    // SAFETY: the shapes are checked; the features are the caller's check.
    unsafe {
        match tokens {
            1 => avx512_kernel::<1>(&split, k, w, n, rows, out),
            2 => avx512_kernel::<2>(&split, k, w, n, rows, out),
            3 => avx512_kernel::<3>(&split, k, w, n, rows, out),
            4 => avx512_kernel::<4>(&split, k, w, n, rows, out),
            _ => unreachable!("checked"),
        }
    }
}

fn check_shapes(x: &[f32], tokens: usize, k: usize, w: &[u8], n: usize, rows: &Range<usize>, out: &[f32]) {
    assert!(
        (1..=MXFP4_FUSED_TOKENS).contains(&tokens),
        "the packed MXFP4 product takes 1 to {MXFP4_FUSED_TOKENS} tokens, not {tokens}"
    );
    assert!(
        k.is_multiple_of(MXFP4_BLOCK),
        "MXFP4 rows of {k} values are not whole blocks"
    );
    assert!(
        rows.end <= n && w.len() >= n * (k / 2 + k / MXFP4_BLOCK),
        "MXFP4 rows out of the matrix"
    );
    assert_eq!(x.len(), tokens * k, "MXFP4 product: x is not [tokens, k]");
    assert!(out.len() >= tokens * rows.len(), "MXFP4 product: out is too short");
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_kernel<const T: usize>(x: &[f32], k: usize, w: &[u8], n: usize, rows: Range<usize>, out: &mut [f32]) {
    let groups = k / MXFP4_BLOCK;
    let magnitudes = _mm256_loadu_ps(E2M1_VALUES.as_ptr());
    let to_value = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let to_sign = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    let sign = _mm256_set1_epi32(i32::MIN);
    let width = rows.len();
    for (i, r) in rows.enumerate() {
        let blocks = w.as_ptr().add(r * k / 2);
        let scales = &w[n * k / 2 + r * groups..][..groups];
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for (g, &scale) in scales.iter().enumerate() {
            let scaled = _mm256_mul_ps(magnitudes, _mm256_set1_ps(e8m0_scale(scale)));
            for q in 0..4 {
                let word = _mm256_set1_epi32(blocks.add(g * 16 + 4 * q).cast::<i32>().read_unaligned());
                let magnitude = _mm256_permutevar8x32_ps(scaled, _mm256_srlv_epi32(word, to_value));
                let signs = _mm256_and_si256(_mm256_sllv_epi32(word, to_sign), sign);
                let weights = _mm256_or_ps(magnitude, _mm256_castsi256_ps(signs));
                let column = g * MXFP4_BLOCK + 8 * q;
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(t * k + column));
                    acc[q & 1] = _mm256_fmadd_ps(weights, xv, acc[q & 1]);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            out[t * width + i] = hsum256(_mm256_add_ps(acc[0], acc[1]));
        }
    }
}

/// `split` is `x` with each block's even activations first, then its odd ones.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn avx512_kernel<const T: usize>(
    split: &[f32],
    k: usize,
    w: &[u8],
    n: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    let groups = k / MXFP4_BLOCK;
    let values = _mm512_loadu_ps(E2M1_VALUES.as_ptr());
    let width = rows.len();
    for (i, r) in rows.enumerate() {
        let blocks = w.as_ptr().add(r * k / 2);
        let scales = &w[n * k / 2 + r * groups..][..groups];
        let mut acc = [[_mm512_setzero_ps(); 2]; T];
        for (g, &scale) in scales.iter().enumerate() {
            let scaled = _mm512_mul_ps(values, _mm512_set1_ps(e8m0_scale(scale)));
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(blocks.add(g * 16).cast()));
            let even = _mm512_permutexvar_ps(bytes, scaled);
            let odd = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), scaled);
            let column = g * MXFP4_BLOCK;
            for (t, acc) in acc.iter_mut().enumerate() {
                let x = split.as_ptr().add(t * k + column);
                acc[0] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x), acc[0]);
                acc[1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x.add(16)), acc[1]);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            out[t * width + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
}
