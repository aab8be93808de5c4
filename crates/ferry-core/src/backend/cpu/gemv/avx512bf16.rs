//! The `avx512bf16` path's BF16 kernel: `vdpbf16ps` on bf16 weights and the bf16 hi/lo split of the activations
//! (see `bf16_split`), 32 weights per step. Its F32 and F16 kernels are `avx512`'s.

use std::arch::x86_64::*;

use super::prefetch::prefetch_rows;
use super::{Block, Kernels, XFormat};

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn ld32_bf16(p: *const u8, m: __mmask32) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(m, p.cast()))
}

/// # Safety
/// See [`super::BlockFn`]; `x` is in the `Bf16Split` layout; needs avx512f/bw/vl and avx512bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn avx512_bf16_dp<const R: usize, const T: usize>(
    w: *const u8,
    ws: usize,
    x: *const u8,
    xs: usize,
    k: usize,
    res: &mut Block,
) {
    #[inline]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn step<const R: usize, const T: usize>(
        acc: &mut [[__m512; T]; R],
        acc_lo: &mut [[__m512; T]; R],
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        i: usize,
        m: __mmask32,
    ) {
        let mut wv = [ld32_bf16(w, 0); R];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = ld32_bf16(w.add(r * ws + 2 * i), m);
        }
        for t in 0..T {
            // Block i / 32 of token t: 64 bytes of hi, then 64 bytes of lo (zero padded past k).
            let xp = x.add(t * xs + 4 * i);
            let hi = ld32_bf16(xp, !0);
            let lo = ld32_bf16(xp.add(64), !0);
            for r in 0..R {
                if SPLIT_ACC(T) {
                    acc_lo[r][t] = _mm512_dpbf16_ps(acc_lo[r][t], lo, wv[r]);
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], hi, wv[r]);
                } else {
                    acc[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][t], lo, wv[r]), hi, wv[r]);
                }
            }
        }
    }

    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut acc_lo = [[_mm512_setzero_ps(); T]; R];
    let mut i = 0;
    while i + 32 <= k {
        prefetch_rows::<R>(w, ws, 2 * i);
        step(&mut acc, &mut acc_lo, w, ws, x, xs, i, !0);
        i += 32;
    }
    if i < k {
        step(
            &mut acc,
            &mut acc_lo,
            w,
            ws,
            x,
            xs,
            i,
            ((1u64 << (k - i)) - 1) as __mmask32,
        );
    }
    for ((res_r, acc_r), lo_r) in res.iter_mut().zip(&acc).zip(&acc_lo) {
        for ((o, a), l) in res_r.iter_mut().zip(acc_r).zip(lo_r) {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(*a, *l));
        }
    }
}

/// Whether the dpbf16 kernel keeps the `lo` products in accumulators of their own (twice the independent
/// dependency chains; only for few tokens, where latency rather than throughput limits).
#[allow(non_snake_case)]
const fn SPLIT_ACC(tokens: usize) -> bool {
    tokens <= 2
}

pub(super) static BF16_KERNELS: Kernels = kernel_table!(
    "avx512bf16 bf16 (vdpbf16ps, hi+lo)",
    XFormat::Bf16Split,
    avx512_bf16_dp,
    rows = 4,
    tokens = 4
);
