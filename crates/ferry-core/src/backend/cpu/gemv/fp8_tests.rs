//! Tests of the FP8 (E4M3 with block scales) kernels of every path this CPU has: each output against the dot
//! product with the weights dequantized first (E4M3 value times its block's scale, in f64), for block shapes that
//! do and do not divide the matrix, per-channel scales, several row tasks, and NaN bytes.

use super::driver::run;
use super::kernel_tests::{error_bound, isas, reference, Rng};
use super::*;
use crate::loader::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};

/// A random `[n, k]` FP8 matrix in `block`-sized blocks: its bytes, its scale bytes, and every weight
/// dequantized in f64.
fn fp8_matrix(rng: &mut Rng, n: usize, k: usize, block: [usize; 2]) -> (Vec<u8>, Vec<u8>, Vec<f64>) {
    let per_row = k.div_ceil(block[1]);
    let scales: Vec<f32> = (0..n.div_ceil(block[0]) * per_row)
        .map(|_| (rng.uniform().abs() + 0.01) / 448.0)
        .collect();
    let bytes: Vec<u8> = (0..n * k).map(|_| f32_to_fp8_e4m3(rng.uniform() * 448.0)).collect();
    let dequantized = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            fp8_e4m3_to_f32(bytes[i]) as f64 * scales[(r / block[0]) * per_row + c / block[1]] as f64
        })
        .collect();
    (
        bytes,
        scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        dequantized,
    )
}

#[allow(clippy::too_many_arguments)]
fn call(isa: Isa, parallel: bool, x: &[f32], m: usize, k: usize, w: &[u8], scales: BlockScales, n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * n];
    let encoding = WeightEncoding {
        dtype: WeightDType::F8E4M3,
        scales: Some(scales),
    };
    run(isa, x, m, k, w, encoding, n, &mut out, parallel);
    out
}

#[test]
fn fp8_paths_match_dequantized_reference() {
    let mut rng = Rng(0x51ed_2701);
    // (k, n, block): blocks that divide and do not, 128 x 128, per channel (one block per row); k = 2051 with 100
    // rows splits into several row tasks, so scales are read at each task's row offset.
    let cases: &[(usize, usize, [usize; 2])] = &[
        (7, 3, [2, 3]),
        (33, 9, [4, 16]),
        (130, 5, [128, 128]),
        (300, 130, [128, 128]),
        (64, 7, [1, 64]),
        (2051, 100, [128, 128]),
        (2051, 100, [1, 2051]),
    ];
    for isa in isas() {
        for &(k, n, block) in cases {
            let (w, scale_bytes, dequantized) = fp8_matrix(&mut rng, n, k, block);
            let scales = BlockScales {
                bytes: &scale_bytes,
                block_rows: block[0],
                block_cols: block[1],
            };
            // Each block's sum rounds as the kernel's does over the block; the blocks' scaled sums add a rounding
            // each.
            let u = f64::powi(2.0, -24);
            let bound = error_bound(isa, WeightDType::F8E4M3, block[1].min(k)) + (k.div_ceil(block[1]) + 2) as f64 * u;
            for m in [1, 2, 3, 5, 9] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
                let (exact, abs) = reference(&x, m, k, &dequantized, n);
                for parallel in [false, true] {
                    let out = call(isa, parallel, &x, m, k, &w, scales, n);
                    for (i, &o) in out.iter().enumerate() {
                        let err = (o as f64 - exact[i]).abs() / abs[i];
                        assert!(
                            err <= bound,
                            "{isa:?} k={k} n={n} block={block:?} m={m} parallel={parallel} i={i}: out {o} exact {} \
                             normalized error {err:e} > {bound:e}",
                            exact[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn fp8_nan_bytes_make_their_row_nan() {
    let (m, k, n, block) = (2, 67, 5, [2, 32]);
    let mut rng = Rng(11);
    let (mut w, scale_bytes, _) = fp8_matrix(&mut rng, n, k, block);
    // 0xff is -NaN in E4M3, at row 3's tail.
    w[3 * k + 66] = 0xff;
    let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
    let scales = BlockScales {
        bytes: &scale_bytes,
        block_rows: block[0],
        block_cols: block[1],
    };
    for isa in isas() {
        let out = call(isa, false, &x, m, k, &w, scales, n);
        for (i, v) in out.iter().enumerate() {
            assert_eq!(v.is_nan(), i % n == 3, "{isa:?}: out[{i}] = {v}");
        }
    }
}

#[test]
#[should_panic(expected = "scale bytes")]
fn fp8_short_scales_panic() {
    let mut out = vec![0.0; 2];
    let scales = BlockScales {
        bytes: &[0; 4],
        block_rows: 1,
        block_cols: 4,
    };
    let encoding = WeightEncoding {
        dtype: WeightDType::F8E4M3,
        scales: Some(scales),
    };
    matmul(&[0.0; 4], 1, 4, &[0; 8], encoding, 2, &mut out);
}

#[test]
#[should_panic(expected = "with scales None")]
fn fp8_without_scales_panics() {
    let mut out = vec![0.0; 2];
    matmul(&[0.0; 4], 1, 4, &[0; 8], WeightDType::F8E4M3, 2, &mut out);
}
