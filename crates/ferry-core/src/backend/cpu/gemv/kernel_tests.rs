//! Tests of every kernel path this CPU has, through the driver: each output against the exact dot product (in
//! f64) within a rigorous error bound, many-token tiles, non-finite values, degenerate shapes, and the public
//! entry points.

use half::{bf16, f16};

use super::driver::run;
use super::*;

/// Rigorous bound on `|out - exact| / Σ_k |x_k · w_k|` for one output of `isa`'s kernel for `dtype` (exact = the
/// dot product of the given f32 activations and the stored weights, in real arithmetic). With `u = 2^-24` and
/// `n` the longest chain of f32 roundings an output goes through: `n·u·1.01`, where `n = ⌈k/L⌉ + log2 L (+1 for
/// the unfused scalar products)` with `L` = 8 (scalar, AVX2) or 16 (AVX-512) lanes; for `vdpbf16ps`,
/// `2^-16 + n·u·1.01` with `n = 4·⌈k/32⌉ + 4` (the `hi + lo` split represents x to a relative 2^-16).
pub(super) fn error_bound(isa: Isa, dtype: WeightDType, k: usize) -> f64 {
    let u = f64::powi(2.0, -24);
    let n = match (isa, dtype) {
        (Isa::Scalar, _) => k.div_ceil(8) + 3 + 1,
        (Isa::Avx2, _) => k.div_ceil(8) + 3,
        (Isa::Avx512Bf16, WeightDType::BF16) => 4 * k.div_ceil(32) + 4,
        (Isa::Avx512 | Isa::Avx512Bf16, _) => k.div_ceil(16) + 4,
    };
    let split = if (isa, dtype) == (Isa::Avx512Bf16, WeightDType::BF16) {
        f64::powi(2.0, -16)
    } else {
        0.0
    };
    split + n as f64 * u * 1.01
}

const DTYPES: [WeightDType; 3] = [WeightDType::F32, WeightDType::F16, WeightDType::BF16];

/// xorshift64*.
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub(super) fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u32 << 23) as f32 - 1.0
    }
}

pub(super) fn isas() -> Vec<Isa> {
    let v: Vec<Isa> = Isa::ALL.into_iter().filter(|&i| available(i)).collect();
    eprintln!("available gemv paths: {v:?}");
    v
}

/// Stores `vals` in `dtype` after `offset` padding bytes; returns the bytes and the stored values.
fn encode(vals: &[f32], dtype: WeightDType, offset: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = vec![0xa5u8; offset];
    let mut dec = Vec::with_capacity(vals.len());
    for &v in vals {
        match dtype {
            WeightDType::F32 => {
                bytes.extend_from_slice(&v.to_le_bytes());
                dec.push(v as f64);
            }
            WeightDType::F16 => {
                let h = f16::from_f32(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                dec.push(h.to_f64());
            }
            WeightDType::BF16 => {
                let h = bf16::from_f32(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                dec.push(h.to_f64());
            }
            WeightDType::F8E4M3 => {
                let q = crate::loader::f32_to_fp8_e4m3(v);
                bytes.push(q);
                dec.push(crate::loader::fp8_e4m3_to_f32(q) as f64);
            }
        }
    }
    (bytes, dec)
}

/// Exact-ish (f64) products: `(sum, sum of |terms|)` per `[m, n]` output.
pub(super) fn reference(x: &[f32], m: usize, k: usize, w: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for t in 0..m {
        for r in 0..n {
            for j in 0..k {
                let p = x[t * k + j] as f64 * w[r * k + j];
                out[t * n + r] += p;
                abs[t * n + r] += p.abs();
            }
        }
    }
    (out, abs)
}

#[allow(clippy::too_many_arguments)]
fn call(isa: Isa, parallel: bool, x: &[f32], m: usize, k: usize, w: &[u8], d: WeightDType, n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * n]; // poison: every value must be overwritten
    run(isa, x, m, k, w, d.into(), n, &mut out, parallel);
    out
}

#[test]
fn all_paths_match_f64_reference() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let shapes: &[(usize, usize)] = &[
        (1, 1),
        (17, 3),
        (31, 5),
        (32, 1),
        (33, 7),
        (64, 9),
        (100, 13),
        (2051, 37),
    ];
    let mut worst = std::collections::BTreeMap::new();
    for isa in isas() {
        for dtype in DTYPES {
            for &(k, n) in shapes {
                for m in 1..=9 {
                    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
                    let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
                    let offset = [0, 1, 2][m % 3];
                    let (wb, wd) = encode(&wv, dtype, offset);
                    let (exact, abs) = reference(&x, m, k, &wd, n);
                    let bound = error_bound(isa, dtype, k);
                    for parallel in [false, true] {
                        let out = call(isa, parallel, &x, m, k, &wb[offset..], dtype, n);
                        for (i, &o) in out.iter().enumerate() {
                            let err = (o as f64 - exact[i]).abs() / abs[i];
                            // Written so that NaN fails.
                            assert!(
                                err <= bound,
                                "{isa:?} {dtype:?} m={m} k={k} n={n} parallel={parallel} i={i}: out {o} exact {} \
                                 normalized error {err:e} > {bound:e}",
                                exact[i]
                            );
                            let e = worst.entry((isa, format!("{dtype:?}"), k == 2051)).or_insert(0.0f64);
                            *e = e.max(err);
                        }
                    }
                }
            }
        }
    }
    for ((isa, dtype, big), e) in worst {
        eprintln!(
            "{isa:?} {dtype:?} {}: max normalized error {e:.2e}",
            if big { "k=2051" } else { "k<=100" }
        );
    }
}

/// Plain relative error |out - exact| / |exact| on k = 2048 random dot products (statistics printed with
/// --nocapture), with a limit on the median: 1e-6 for the f32-exact paths, 5e-6 for vdpbf16ps.
#[test]
fn relative_error_k2048() {
    let (m, k, n) = (4, 2048, 256);
    let mut rng = Rng(42);
    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
    let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
    for dtype in DTYPES {
        let (wb, wd) = encode(&wv, dtype, 0);
        let (exact, _) = reference(&x, m, k, &wd, n);
        for isa in isas() {
            let out = call(isa, true, &x, m, k, &wb, dtype, n);
            let mut rel: Vec<f64> = out
                .iter()
                .zip(&exact)
                .map(|(&o, &e)| (o as f64 - e).abs() / e.abs().max(1e-30))
                .collect();
            rel.sort_by(f64::total_cmp);
            let (med, p90) = (rel[rel.len() / 2], rel[rel.len() * 9 / 10]);
            eprintln!("{isa:?} {dtype:?} k=2048: relative error median {med:.2e}, p90 {p90:.2e}");
            let limit = if (isa, dtype) == (Isa::Avx512Bf16, WeightDType::BF16) {
                5e-6
            } else {
                1e-6
            };
            assert!(
                med <= limit,
                "{isa:?} {dtype:?}: median relative error {med:e} > {limit:e}"
            );
        }
    }
}

#[test]
fn many_tokens_use_tiles() {
    // m large enough for several token tiles; compare against the scalar path's own f64 reference.
    let (m, k, n) = (70, 2051, 9);
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
    let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
    for dtype in DTYPES {
        let (wb, wd) = encode(&wv, dtype, 2);
        let (exact, abs) = reference(&x, m, k, &wd, n);
        for isa in isas() {
            let out = call(isa, true, &x, m, k, &wb[2..], dtype, n);
            let bound = error_bound(isa, dtype, k);
            for i in 0..m * n {
                let err = (out[i] as f64 - exact[i]).abs() / abs[i];
                assert!(err <= bound, "{isa:?} {dtype:?} i={i}: {err:e} > {bound:e}");
            }
        }
    }
}

#[test]
fn non_finite_values_propagate() {
    let (m, k, n) = (3, 67, 5);
    let mut rng = Rng(3);
    let x0: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
    let w0: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
    for isa in isas() {
        for dtype in DTYPES {
            // NaN in x[1, 40]: token 1 is NaN everywhere, other tokens finite.
            let mut x = x0.clone();
            x[k + 40] = f32::NAN;
            let (wb, _) = encode(&w0, dtype, 1);
            let out = call(isa, false, &x, m, k, &wb[1..], dtype, n);
            for t in 0..m {
                for r in 0..n {
                    let v = out[t * n + r];
                    assert_eq!(v.is_nan(), t == 1, "{isa:?} {dtype:?} NaN x: out[{t},{r}] = {v}");
                }
            }
            // NaN in W[2, 66] (the tail): row 2 is NaN for every token.
            let mut w = w0.clone();
            w[2 * k + 66] = f32::NAN;
            let (wb, _) = encode(&w, dtype, 0);
            let out = call(isa, false, &x0, m, k, &wb, dtype, n);
            for t in 0..m {
                for r in 0..n {
                    let v = out[t * n + r];
                    assert_eq!(v.is_nan(), r == 2, "{isa:?} {dtype:?} NaN w: out[{t},{r}] = {v}");
                }
            }
            // +Inf in x[0, 3] with W[:, 3] = 0.5: token 0 is +Inf, others finite.
            let mut x = x0.clone();
            x[3] = f32::INFINITY;
            let mut w = w0.clone();
            for r in 0..n {
                w[r * k + 3] = 0.5;
            }
            let (wb, _) = encode(&w, dtype, 0);
            let out = call(isa, false, &x, m, k, &wb, dtype, n);
            for t in 0..m {
                for r in 0..n {
                    let v = out[t * n + r];
                    if t == 0 {
                        assert_eq!(v, f32::INFINITY, "{isa:?} {dtype:?} Inf x: out[0,{r}]");
                    } else {
                        assert!(v.is_finite(), "{isa:?} {dtype:?} Inf x: out[{t},{r}] = {v}");
                    }
                }
            }
        }
    }
}

#[test]
fn degenerate_shapes() {
    for isa in isas() {
        for dtype in DTYPES {
            let mut out = vec![f32::NAN; 6];
            run(isa, &[], 2, 0, &[], dtype.into(), 3, &mut out, true);
            assert_eq!(out, [0.0; 6]);
            run(
                isa,
                &[],
                0,
                5,
                &[0; 60][..3 * 5 * dtype.size_bytes()],
                dtype.into(),
                3,
                &mut [],
                true,
            );
            run(isa, &[1.0; 10], 2, 5, &[], dtype.into(), 0, &mut [], true);
        }
    }
}

#[test]
fn public_entry_points_agree() {
    let (m, k, n) = (2, 300, 200);
    let mut rng = Rng(5);
    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
    let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
    for dtype in DTYPES {
        let (wb, _) = encode(&wv, dtype, 0);
        let mut a = vec![f32::NAN; m * n];
        let mut b = vec![f32::NAN; m * n];
        matmul(&x, m, k, &wb, dtype, n, &mut a);
        matmul_serial(&x, m, k, &wb, dtype, n, &mut b);
        assert_eq!(a, b, "{}", kernel_name(dtype));
    }
}

#[test]
#[should_panic(expected = "w has")]
fn short_weights_panic() {
    let mut out = vec![0.0; 2];
    matmul(&[0.0; 4], 1, 4, &[0; 15], WeightDType::BF16, 2, &mut out);
}

#[test]
#[should_panic(expected = "out has")]
fn wrong_out_panics() {
    let mut out = vec![0.0; 3];
    matmul_serial(&[0.0; 4], 1, 4, &[0; 16], WeightDType::BF16, 2, &mut out);
}
