//! The `avx512` path (avx512f/bw/vl): 16 weights per step converted to f32 in registers (F16 with `vcvtph2ps`,
//! BF16 by zero-extend and `<< 16`, FP8 E4M3 as [`e4m3_to_f32`] says), FMA with f32 activations, a masked load for
//! the tail of a row. Its F32, F16 and FP8 kernels serve the `avx512bf16` path too.

use std::arch::x86_64::*;

use super::prefetch::prefetch_rows;
use super::{Block, Kernels, XFormat};

/// 16 weights at `p` as f32; `mask` selects the elements to load (the others read as 0 and are not touched).
macro_rules! avx512_loaders {
    ($($name:ident($p:ident, $m:ident) => $e:expr;)*) => {$(
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn $name($p: *const u8, $m: __mmask16) -> __m512 {
            $e
        }
    )*};
}
avx512_loaders! {
    ld16_f32(p, m) => _mm512_maskz_loadu_ps(m, p.cast());
    ld16_f16(p, m) => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()));
    ld16_bf16(p, m) => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(m, p.cast()),
    )));
    ld16_f8(p, m) => e4m3_to_f32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p.cast())));
}

/// 16 E4M3 bytes (one per 32-bit lane) as f32: the magnitude bits placed as an f32's (subnormal for exponent 0)
/// times 2^120, which rebiases the exponent exactly; `S.1111.111` lanes become NaN; then the sign.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn e4m3_to_f32(bytes: __m512i) -> __m512 {
    let magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7f));
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)));
    let value = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32::<20>(magnitude)),
        _mm512_set1_ps(f32::from_bits((120 + 127) << 23)),
    );
    let nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7f));
    let value = _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign))
}

macro_rules! avx512_kernel {
    ($name:ident, $size:literal, $load:ident) => {
        /// # Safety
        /// See [`super::BlockFn`]; needs avx512f/bw/vl.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn $name<const R: usize, const T: usize>(
            w: *const u8,
            ws: usize,
            x: *const u8,
            xs: usize,
            k: usize,
            res: &mut Block,
        ) {
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            unsafe fn step<const R: usize, const T: usize>(
                acc: &mut [[__m512; T]; R],
                w: *const u8,
                ws: usize,
                x: *const u8,
                xs: usize,
                i: usize,
                m: __mmask16,
            ) {
                let mut wv = [_mm512_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = $load(w.add(r * ws + i * $size), m);
                }
                for t in 0..T {
                    let xv = _mm512_maskz_loadu_ps(m, x.add(t * xs + 4 * i).cast());
                    for r in 0..R {
                        acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                    }
                }
            }

            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let mut i = 0;
            while i + 16 <= k {
                if (i * $size) % 64 == 0 {
                    prefetch_rows::<R>(w, ws, i * $size);
                }
                step(&mut acc, w, ws, x, xs, i, !0);
                i += 16;
            }
            if i < k {
                step(&mut acc, w, ws, x, xs, i, ((1u32 << (k - i)) - 1) as __mmask16);
            }
            for (res_r, acc_r) in res.iter_mut().zip(&acc) {
                for (o, a) in res_r.iter_mut().zip(acc_r) {
                    *o = _mm512_reduce_add_ps(*a);
                }
            }
        }
    };
}
avx512_kernel!(avx512_f32, 4, ld16_f32);
avx512_kernel!(avx512_f16, 2, ld16_f16);
avx512_kernel!(avx512_bf16, 2, ld16_bf16);
avx512_kernel!(avx512_f8, 1, ld16_f8);

pub(super) static F32_KERNELS: Kernels = kernel_table!("avx512 f32", XFormat::F32, avx512_f32, rows = 4, tokens = 4);
pub(super) static F16_KERNELS: Kernels =
    kernel_table!("avx512 f16 (vcvtph2ps)", XFormat::F32, avx512_f16, rows = 4, tokens = 4);
pub(super) static BF16_KERNELS: Kernels =
    kernel_table!("avx512 bf16 (shift)", XFormat::F32, avx512_bf16, rows = 4, tokens = 4);
pub(super) static F8_KERNELS: Kernels = kernel_table!(
    "avx512 fp8 e4m3 (shift, scale)",
    XFormat::F32,
    avx512_f8,
    rows = 4,
    tokens = 4
);
