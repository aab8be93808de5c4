//! The activation layout of the `vdpbf16ps` kernel ([`super::XFormat::Bf16Split`]): each f32 activation split
//! once per call into bf16 `hi` and `lo` with `hi + lo` equal to it to a relative 2^-16.

use super::{available, Isa};

/// Splits every activation into bf16 `hi` and `lo` (see [`split_bf16`]) in the [`super::XFormat::Bf16Split`]
/// layout.
pub(super) fn prepare_bf16_split(x: &[f32], m: usize, k: usize) -> Vec<u16> {
    let per_token = k.div_ceil(32) * 64;
    let mut buf = vec![0u16; m * per_token];
    let body = |buf: &mut [u16]| {
        for (xt, bt) in x.chunks_exact(k).zip(buf.chunks_exact_mut(per_token)) {
            for (xc, bc) in xt.chunks(32).zip(bt.chunks_exact_mut(64)) {
                let (hi, lo) = bc.split_at_mut(32);
                for ((&v, h), l) in xc.iter().zip(hi).zip(lo) {
                    (*h, *l) = split_bf16(v);
                }
            }
        }
    };
    #[cfg(target_arch = "x86_64")]
    {
        /// The same loop compiled for AVX-512 (where LLVM vectorizes the branch-free [`split_bf16`]).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn vectorized(body: impl FnOnce(&mut [u16]), buf: &mut [u16]) {
            body(buf)
        }
        if available(Isa::Avx512) {
            // SAFETY: the CPU supports the target features (checked just above).
            unsafe { vectorized(body, &mut buf) };
            return buf;
        }
    }
    body(&mut buf);
    buf
}

/// `(hi, lo)` bf16 bits with `hi + lo ≈ v` to a relative 2^-16 (|v - hi - lo| ≤ 2^-16 |v|): `hi` is `v` rounded
/// to nearest even (truncated instead if rounding would overflow to infinity), `lo` is the exact remainder
/// `v - hi` rounded to nearest even. Non-finite `v`: `hi` is `v` (a NaN stays NaN), `lo` is 0. Branch-free so that
/// it vectorizes.
#[inline(always)]
fn split_bf16(v: f32) -> (u16, u16) {
    /// Round to nearest even on the 16 dropped bits (meaningful for finite inputs).
    #[inline(always)]
    fn round(bits: u32) -> u32 {
        bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16
    }
    let bits = v.to_bits();
    let finite = bits & 0x7f80_0000 != 0x7f80_0000;
    let rounded = round(bits);
    let hi_finite = if rounded & 0x7f80 == 0x7f80 {
        bits >> 16
    } else {
        rounded
    };
    // ±Inf keeps its bits; a NaN is quieted so that dropping the low mantissa bits cannot turn it into Inf.
    let hi_non_finite = if bits & 0x007f_ffff != 0 {
        bits | 0x0040_0000
    } else {
        bits
    } >> 16;
    let hi = if finite { hi_finite } else { hi_non_finite };
    // Exact: the bits of v below hi's precision.
    let lo = if finite { v - f32::from_bits(hi << 16) } else { 0.0 };
    (hi as u16, round(lo.to_bits()) as u16)
}

#[cfg(test)]
mod tests {
    use super::super::kernel_tests::Rng;
    use super::*;

    #[test]
    fn split_bf16_represents_x() {
        let check = |v: f32| {
            let (h, l) = split_bf16(v);
            let (hf, lf) = (f32::from_bits(u32::from(h) << 16), f32::from_bits(u32::from(l) << 16));
            if v.is_nan() {
                assert!(hf.is_nan(), "{v}");
            } else if v.is_infinite() {
                assert_eq!((hf, lf), (v, 0.0));
            } else {
                assert!(hf.is_finite() && lf.is_finite(), "{v}: {hf} {lf}");
                let err = (v as f64 - (hf as f64 + lf as f64)).abs();
                // 2^-16 relative, plus half a bf16 subnormal ulp (2^-134) for a subnormal `lo`.
                assert!(
                    err <= v.abs() as f64 * f64::powi(2.0, -16) + f64::powi(2.0, -134),
                    "{v:e}: {hf:e} + {lf:e}, err {err:e}"
                );
            }
        };
        let mut rng = Rng(11);
        for _ in 0..100_000 {
            check(f32::from_bits(rng.next() as u32));
            check(rng.uniform());
        }
        for v in [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            check(v);
        }
        check(f32::NAN);
        check(f32::from_bits(0x7f80_0001)); // NaN whose payload is only in the low bits
    }
}
