//! The `avx2` path (avx2, fma, f16c): 8 weights per step converted to f32 in registers (F16 with `vcvtph2ps`,
//! BF16 by zero-extend and `<< 16`, FP8 E4M3 as [`e4m3_to_f32`] says), FMA with f32 activations, the tail of a
//! row copied into zero-padded buffers (AVX2 has no masked 16-bit loads).

use std::arch::x86_64::*;

use super::prefetch::prefetch_rows;
use super::{Block, Kernels, XFormat};

macro_rules! avx2_loaders {
    ($($name:ident($p:ident) => $e:expr;)*) => {$(
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name($p: *const u8) -> __m256 {
            $e
        }
    )*};
}
avx2_loaders! {
    ld8_f32(p) => _mm256_loadu_ps(p.cast());
    ld8_f16(p) => _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
    ld8_bf16(p) => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))));
    ld8_f8(p) => e4m3_to_f32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())));
}

/// 8 E4M3 bytes (one per 32-bit lane) as f32: the magnitude bits placed as an f32's (subnormal for exponent 0)
/// times 2^120, which rebiases the exponent exactly; `S.1111.111` lanes become NaN; then the sign.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn e4m3_to_f32(bytes: __m256i) -> __m256 {
    let magnitude = _mm256_and_si256(bytes, _mm256_set1_epi32(0x7f));
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(bytes, _mm256_set1_epi32(0x80)));
    let value = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32::<20>(magnitude)),
        _mm256_set1_ps(f32::from_bits((120 + 127) << 23)),
    );
    let nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7f)));
    let value = _mm256_blendv_ps(value, _mm256_set1_ps(f32::NAN), nan);
    _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s)))
}

macro_rules! avx2_kernel {
    ($name:ident, $size:literal, $load:ident) => {
        /// # Safety
        /// See [`super::BlockFn`]; needs avx2, fma and f16c.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name<const R: usize, const T: usize>(
            w: *const u8,
            ws: usize,
            x: *const u8,
            xs: usize,
            k: usize,
            res: &mut Block,
        ) {
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn step<const R: usize, const T: usize>(
                acc: &mut [[__m256; T]; R],
                w: *const u8,
                ws: usize,
                x: *const u8,
                xs: usize,
            ) {
                let mut wv = [_mm256_setzero_ps(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = $load(w.add(r * ws));
                }
                for t in 0..T {
                    let xv = _mm256_loadu_ps(x.add(t * xs).cast());
                    for r in 0..R {
                        acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                    }
                }
            }

            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let mut i = 0;
            while i + 8 <= k {
                if (i * $size) % 64 == 0 {
                    prefetch_rows::<R>(w, ws, i * $size);
                }
                step(&mut acc, w.add(i * $size), ws, x.add(4 * i), xs);
                i += 8;
            }
            if i < k {
                // Tail: copy the last k - i (< 8) elements of each row and token into zero-padded buffers.
                let n = k - i;
                let mut wb = [[0u8; 8 * $size]; R];
                for (r, b) in wb.iter_mut().enumerate() {
                    std::ptr::copy_nonoverlapping(w.add(r * ws + i * $size), b.as_mut_ptr(), n * $size);
                }
                let mut xb = [[0u8; 32]; T];
                for (t, b) in xb.iter_mut().enumerate() {
                    std::ptr::copy_nonoverlapping(x.add(t * xs + 4 * i), b.as_mut_ptr(), 4 * n);
                }
                step(&mut acc, wb.as_ptr().cast(), 8 * $size, xb.as_ptr().cast(), 32);
            }
            for (res_r, acc_r) in res.iter_mut().zip(&acc) {
                for (o, a) in res_r.iter_mut().zip(acc_r) {
                    *o = hsum256(*a);
                }
            }
        }
    };
}
avx2_kernel!(avx2_f32, 4, ld8_f32);
avx2_kernel!(avx2_f16, 2, ld8_f16);
avx2_kernel!(avx2_bf16, 2, ld8_bf16);
avx2_kernel!(avx2_f8, 1, ld8_f8);

pub(super) static F32_KERNELS: Kernels = kernel_table!("avx2 f32", XFormat::F32, avx2_f32, rows = 4, tokens = 2);
pub(super) static F16_KERNELS: Kernels =
    kernel_table!("avx2 f16 (vcvtph2ps)", XFormat::F32, avx2_f16, rows = 4, tokens = 2);
pub(super) static BF16_KERNELS: Kernels =
    kernel_table!("avx2 bf16 (shift)", XFormat::F32, avx2_bf16, rows = 4, tokens = 2);
pub(super) static F8_KERNELS: Kernels = kernel_table!(
    "avx2 fp8 e4m3 (shift, scale)",
    XFormat::F32,
    avx2_f8,
    rows = 4,
    tokens = 2
);
