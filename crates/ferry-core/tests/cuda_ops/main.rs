//! Every CUDA op against the CPU backend on fresh random inputs (the backend-ops check): the same function on
//! any valid input, within f32-level relative error. Ignored unless asked for: they need an NVIDIA GPU and run
//! on the GPU machine through scripts/device/gpu-tests.sh.

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::workspace::MOE_GROUP_ROWS;
use ferry_core::backend::cuda::{CudaBackend, GEMV_MAX_ROWS};
use ferry_core::backend::{
    AttentionParams, Backend, DeltaRuleParams, ExpertActivation, ExpertTensors, MlaParams, QkNormWeights, ResidualNorm,
    Rope, Router, RouterKind, SeqSlice,
};
use ferry_core::kv::{KvCache, KvLayerSpec, KvSpec, RecurrentSpec};
use ferry_core::loader::{quantize_fp8, DType, Fp8Scheme, TensorRef};
use ferry_core::Error;

/// Relative error limit for ops computed in f32 on both sides (products with bf16 weights are exact in f32;
/// what differs is the order of summation and the libm of each side).
const F32_LIMIT: f32 = 2e-5;
/// Relative error limit for the prefill attention kernel, whose tensor-core products take each f32 operand as two
/// bf16 halves (hi + lo, three products for one): about 16 significant bits per product instead of 24, a relative
/// error near 2^-17 per product. A float64 simulation of the kernel's arithmetic on these inputs (queries of up to
/// 3, keys and values of up to 1, head dims 16 to 256) puts the worst row at 1.3e-5; a key masked wrongly or
/// missed moves a row by more than 1e-2.
const FLASH_LIMIT: f32 = 1e-4;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// 32 random bits.
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
    }

    fn unit(&mut self) -> f32 {
        ((self.next() >> 8) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }

    fn bf16(&mut self, name: &str, shape: &[usize], scale: f32) -> TensorRef {
        let n = shape.iter().product();
        let bytes = self
            .values(n, scale)
            .into_iter()
            .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        TensorRef::from_bytes(name, DType::BF16, shape.to_vec(), bytes).unwrap()
    }

    /// A random `[rows, cols]` MXFP4 matrix packed as gpt-oss's loader packs it: every nibble value, scales from
    /// 2^-7 to 2^-4 (weights up to 0.375, mostly about 0.03).
    fn mxfp4(&mut self, name: &str, rows: usize, cols: usize) -> TensorRef {
        let groups = cols / 32;
        let values: Vec<u8> = (0..rows * groups * 16).map(|_| (self.next() >> 24) as u8).collect();
        let scales: Vec<u8> = (0..rows * groups).map(|_| 120 + (self.next() >> 30) as u8).collect();
        let blocks =
            TensorRef::from_bytes(&format!("{name}_blocks"), DType::U8, vec![rows, groups, 16], values).unwrap();
        let scales = TensorRef::from_bytes(&format!("{name}_scales"), DType::U8, vec![rows, groups], scales).unwrap();
        TensorRef::mxfp4(name, &blocks, &scales, 0..rows).unwrap()
    }

    /// `count` unbiased experts of `hidden` inputs and `inter` features.
    fn experts(&mut self, count: usize, hidden: usize, inter: usize) -> Vec<ExpertTensors> {
        (0..count)
            .map(|e| {
                ExpertTensors::unbiased(
                    self.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.1),
                    self.bf16(&format!("e{e}.up"), &[inter, hidden], 0.1),
                    self.bf16(&format!("e{e}.down"), &[hidden, inter], 0.1),
                )
            })
            .collect()
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let diff: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (diff.sqrt() / norm.sqrt().max(1e-30)) as f32
}

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

fn pair() -> Pair {
    Pair {
        cpu: CpuBackend,
        gpu: CudaBackend::new(0).expect("a CUDA GPU"),
    }
}

fn check(what: &str, got: Vec<f32>, want: Vec<f32>, limit: f32) {
    let err = rel_err(&got, &want);
    println!("{what:<40} rel err {err:.2e}");
    assert!(err <= limit, "{what}: relative error {err} over {limit}");
}

/// Runs `op` on both backends over the same host inputs and compares.
macro_rules! same_on_both {
    ($p:expr, $what:expr, $limit:expr, |$be:ident| $body:expr) => {{
        let cpu = {
            let $be = &$p.cpu;
            $body
        };
        let gpu = {
            let $be = &$p.gpu;
            $body
        };
        check($what, gpu, cpu, $limit);
    }};
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn linear_gemv_and_gemm_paths() {
    let p = pair();
    let mut rng = Rng::new(1);
    // (rows, k, n, bias). Every GEMV shape runs with each row count up to GEMV_MAX_ROWS (one kernel per count);
    // together they reach each path of the GEMV kernels. 9 and 300 rows take the cuBLAS path.
    let gemv_rows: Vec<usize> = (1..=GEMV_MAX_ROWS).collect();
    let shapes: [(&[usize], usize, usize, bool); 7] = [
        // Router-sized: k split across all 8 warps of a block, one k-step each.
        (&gemv_rows, 2048, 128, false),
        // k = 3 * 256 + 8: k split 4 ways (2 at 2 rows), the last warp's k-step partial.
        (&gemv_rows, 776, 200, true),
        // k not a multiple of 8: the unaligned scalar path, k split 2 ways.
        (&gemv_rows, 515, 33, true),
        // k shorter than one k-step.
        (&gemv_rows, 64, 96, false),
        // Many blocks, the last one partial; several staged chunks per warp, then a partial k-step.
        (&gemv_rows, 2312, 12003, true),
        (&[9], 256, 130, true),
        (&[300], 1024, 512, false),
    ];
    for (row_counts, k, n, bias) in shapes {
        let w = rng.bf16("w", &[n, k], 0.05);
        let b = rng.bf16("b", &[n], 0.5);
        for &rows in row_counts {
            let x = rng.values(rows * k, 1.0);
            same_on_both!(p, &format!("linear {rows}x{k} -> {n} bias={bias}"), F32_LIMIT, |be| {
                let bias_weight = be.weight(b.clone()).unwrap();
                let out = be
                    .linear(
                        &be.upload(&x, rows, k).unwrap(),
                        &be.weight(w.clone()).unwrap(),
                        bias.then_some(&bias_weight),
                    )
                    .unwrap();
                be.to_host(&out).unwrap()
            });
        }
    }
}

/// Dense FP8 weights (128 x 128 blocks with f32 scales, per channel, and blocks that do not divide the matrix) read
/// as FP8: the GEMV kernels (every row count; aligned rows 16 weights per lane, k = 520 one at a time) and the
/// cuBLAS path (weights as bf16 halves) against the CPU's dequantizing GEMV, at the f32 limit. Weights rounded to
/// bf16 (what the upload did before) differ by ~1e-3 here.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn linear_fp8_weights_gemv_and_gemm_paths() {
    let p = pair();
    let mut rng = Rng::new(12);
    let row_counts: Vec<usize> = (1..=GEMV_MAX_ROWS).chain([9, 300]).collect();
    for (k, n) in [(2048, 384), (520, 200), (64, 33)] {
        let w = rng.bf16("w", &[n, k], 0.05);
        let b = rng.bf16("b", &[n], 0.5);
        for scheme in [
            Fp8Scheme::BLOCK_128,
            Fp8Scheme::PerChannel,
            Fp8Scheme::Blocks { rows: 48, cols: 80 },
        ] {
            let fp8 = quantize_fp8(&w, scheme).unwrap();
            for &rows in &row_counts {
                let x = rng.values(rows * k, 1.0);
                let what = format!("FP8 ({scheme:?}) linear {rows}x{k} -> {n}");
                same_on_both!(p, &what, F32_LIMIT, |be| {
                    let bias = be.weight(b.clone()).unwrap();
                    let out = be
                        .linear(
                            &be.upload(&x, rows, k).unwrap(),
                            &be.weight(fp8.clone()).unwrap(),
                            Some(&bias),
                        )
                        .unwrap();
                    be.to_host(&out).unwrap()
                });
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn elementwise_ops() {
    let p = pair();
    let mut rng = Rng::new(2);
    let (rows, cols, head_dim) = (5, 384, 128);
    let x = rng.values(rows * cols, 2.0);
    let y = rng.values(rows * cols, 2.0);
    let gate = rng.values(rows, 3.0);
    let norm = rng.bf16("norm", &[cols], 1.0);
    let head_norm = rng.bf16("head_norm", &[head_dim], 1.0);
    let table = rng.bf16("table", &[50, cols], 1.0);
    same_on_both!(p, "rms_norm (row)", F32_LIMIT, |be| {
        let t = be.upload(&x, rows, cols).unwrap();
        be.to_host(&be.rms_norm(&t, &be.weight(norm.clone()).unwrap(), cols, 1e-6).unwrap())
            .unwrap()
    });
    same_on_both!(p, "rms_norm (per head)", F32_LIMIT, |be| {
        let t = be.upload(&x, rows, cols).unwrap();
        be.to_host(
            &be.rms_norm(&t, &be.weight(head_norm.clone()).unwrap(), head_dim, 1e-6)
                .unwrap(),
        )
        .unwrap()
    });
    same_on_both!(p, "embed", 0.0, |be| {
        be.to_host(&be.embed(&be.weight(table.clone()).unwrap(), &[3, 0, 49, 3]).unwrap())
            .unwrap()
    });
    same_on_both!(p, "add_assign", 0.0, |be| {
        let mut a = be.upload(&x, rows, cols).unwrap();
        be.add_assign(&mut a, &be.upload(&y, rows, cols).unwrap()).unwrap();
        be.to_host(&a).unwrap()
    });
    same_on_both!(p, "silu_mul", F32_LIMIT, |be| {
        let out = be
            .silu_mul(&be.upload(&x, rows, cols).unwrap(), &be.upload(&y, rows, cols).unwrap())
            .unwrap();
        be.to_host(&out).unwrap()
    });
    same_on_both!(p, "sigmoid_gate", F32_LIMIT, |be| {
        let mut a = be.upload(&x, rows, cols).unwrap();
        be.sigmoid_gate(&mut a, &be.upload(&gate, rows, 1).unwrap()).unwrap();
        be.to_host(&a).unwrap()
    });
    same_on_both!(p, "select_rows", 0.0, |be| {
        be.to_host(&be.select_rows(&be.upload(&x, rows, cols).unwrap(), &[4, 0, 2]).unwrap())
            .unwrap()
    });
}

mod attention;
mod experts;
mod fused;
mod recurrent;

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn argmax_rows_chooses_as_the_cpu_does() {
    let p = pair();
    let mut rng = Rng::new(3);
    for (cols, sampled) in [(151_936, 151_936), (151_936, 151_665), (1_001, 997), (7, 7)] {
        let mut rows: Vec<Vec<f32>> = (0..4).map(|_| rng.values(cols, 20.0)).collect();
        // The largest value twice (the lower index wins), NaN among numbers (at the front too), a row of -inf,
        // a row of NaN.
        let (first, second) = (cols / 3, 2 * cols / 3);
        rows[1][first] = 100.0;
        rows[1][second] = 100.0;
        rows[2][0] = f32::NAN;
        rows[2][cols / 2] = f32::NAN;
        rows[3][cols - 1] = f32::NAN;
        rows.push(vec![f32::NEG_INFINITY; cols]);
        rows.push(vec![f32::NAN; cols]);
        let data: Vec<f32> = rows.concat();
        let cpu = p
            .cpu
            .argmax_rows(&p.cpu.upload(&data, rows.len(), cols).unwrap(), sampled)
            .unwrap();
        let gpu = p
            .gpu
            .argmax_rows(&p.gpu.upload(&data, rows.len(), cols).unwrap(), sampled)
            .unwrap();
        assert_eq!(gpu, cpu, "{cols} columns, {sampled} sampled");
        assert_eq!(cpu[1], first as u32);
        assert_eq!(&cpu[4..], &[0, 0]);
    }
    let x = p.gpu.upload(&[1.0; 6], 2, 3).unwrap();
    assert!(matches!(p.gpu.argmax_rows(&x, 4), Err(Error::Shape(_))));
}
