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

/// One attention call: its slices as (sequence, start position, rows).
struct AttentionCall {
    slices: &'static [(usize, usize, usize)],
    /// Each row attends to its own key alone: fills a long context at little cost to the CPU side (the cache gets
    /// the same keys and values either way).
    fill: bool,
}

/// The q/k norm of a case: query and key scales, and whether they apply per head.
type NormScales = (Vec<f32>, Vec<f32>, bool);

/// Runs `calls` on `be` over one fresh cache of `sequences` sequences, each call's input its rows' fused q/k/v
/// projection; returns each call's output.
#[allow(clippy::too_many_arguments)]
fn attention_calls<B: Backend>(
    be: &B,
    params: &AttentionParams,
    rope: &Rope,
    norm: Option<&NormScales>,
    sinks: Option<&[f32]>,
    calls: &[AttentionCall],
    inputs: &[Vec<f32>],
    sequences: usize,
) -> Vec<Vec<f32>> {
    let qkv_cols = (params.num_heads + 2 * params.num_kv_heads) * params.head_dim;
    let tokens: usize = calls.iter().flat_map(|c| c.slices).map(|&(_, _, len)| len).sum();
    let mut kv = be
        .new_kv(KvSpec {
            layers: vec![KvLayerSpec::heads(params.num_kv_heads, params.head_dim)],
            capacity_tokens: tokens + 16 * sequences,
            recurrent: None,
        })
        .unwrap();
    let rope_table = be.rope_table(rope).unwrap();
    let scales = norm.map(|(q, k, per_head)| {
        let weight = |v: &Vec<f32>| {
            be.weight(TensorRef::from_f32("norm", vec![v.len()], v).unwrap())
                .unwrap()
        };
        (weight(q), weight(k), *per_head)
    });
    let sinks = sinks.map(|v| {
        be.weight(TensorRef::from_f32("sinks", vec![v.len()], v).unwrap())
            .unwrap()
    });
    let seqs: Vec<_> = (0..sequences).map(|_| kv.alloc_seq()).collect();
    let fill = AttentionParams {
        sliding_window: Some(1),
        ..params.clone()
    };
    calls
        .iter()
        .zip(inputs)
        .map(|(call, qkv)| {
            let slices: Vec<SeqSlice> = call
                .slices
                .iter()
                .map(|&(s, start_pos, len)| SeqSlice {
                    seq: seqs[s],
                    start_pos,
                    len,
                })
                .collect();
            let rows = qkv.len() / qkv_cols;
            let batch = be.prepare_batch(&mut kv, &slices).unwrap();
            let qk_norm = scales.as_ref().map(|(q, k, per_head)| QkNormWeights {
                q,
                k,
                per_head: *per_head,
                eps: 1e-6,
            });
            let out = be
                .attention(
                    &be.upload(qkv, rows, qkv_cols).unwrap(),
                    qk_norm,
                    sinks.as_ref(),
                    &rope_table,
                    &mut kv,
                    0,
                    &batch,
                    if call.fill { &fill } else { params },
                )
                .unwrap();
            be.to_host(&out).unwrap()
        })
        .collect()
}

/// Paged attention against the CPU backend, row by row (a long context's output is small next to a short one's,
/// so a whole call's error would hide it). Shapes: groups of 1 to 32 query heads per kv head (1, 2, 4 and 8 per
/// warp, and a warp with repeated heads: 6), head_dim 16 to 256 (one and two value chunks per lane), sliding
/// windows, the three- and two-stage copy pipelines (32 heads of 256 per kv head take two). Calls: prefill then
/// decode of short sequences; and a 4K-token context with a batch of decode rows of different lengths (one at
/// position 0), whose keys are split over many blocks, then a prefill chunk batched with decode rows. Calls with a
/// prefill slice run the prefill kernel (flash_attention.cu), batches of single rows the split one.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn attention_over_paged_cache_prefill_then_decode() {
    let p = pair();
    let mut rng = Rng::new(3);
    let short: &[AttentionCall] = &[
        AttentionCall {
            slices: &[(0, 0, 37), (1, 0, 5)],
            fill: false,
        },
        AttentionCall {
            slices: &[(0, 37, 1), (1, 5, 1)],
            fill: false,
        },
    ];
    let long: &[AttentionCall] = &[
        AttentionCall {
            slices: &[(0, 0, 4095), (1, 0, 1000), (2, 0, 37), (3, 0, 5)],
            fill: true,
        },
        AttentionCall {
            slices: &[(0, 4095, 1), (1, 1000, 1), (2, 37, 1), (3, 5, 1), (4, 0, 1)],
            fill: false,
        },
        AttentionCall {
            slices: &[(2, 38, 40), (0, 4096, 1), (1, 1001, 1)],
            fill: false,
        },
    ];
    // (heads, kv heads, head_dim, sliding window, q/k norm: none, per head (true) or over all heads, rotary features)
    type Shape = (usize, usize, usize, Option<usize>, Option<bool>, usize);
    let short_shapes: [Shape; 3] = [
        (4, 2, 16, None, None, 16),
        (32, 4, 128, None, Some(true), 128),
        (8, 8, 64, Some(7), Some(false), 16),
    ];
    let long_shapes: [Shape; 6] = [
        (32, 4, 128, None, Some(true), 128),
        (16, 4, 64, None, None, 64),
        (16, 2, 256, Some(1500), Some(true), 64),
        (8, 8, 128, Some(1000), None, 128),
        (12, 2, 64, None, Some(false), 32),
        (32, 1, 256, None, None, 256),
    ];
    let cases = short_shapes
        .into_iter()
        .map(|shape| ("short", short, shape))
        .chain(long_shapes.into_iter().map(|shape| ("long", long, shape)));
    for (name, calls, (heads, kv_heads, head_dim, window, norm, rotary_dim)) in cases {
        let params = AttentionParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
        };
        let rope = Rope::new(1e6, head_dim, rotary_dim);
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        let norm_scales: Option<NormScales> = norm.map(|per_head| {
            let (q_width, k_width) = if per_head {
                (head_dim, head_dim)
            } else {
                (q_cols, kv_cols)
            };
            let mut scales = |width| rng.values(width, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<f32>>();
            (scales(q_width), scales(k_width), per_head)
        });
        let sequences = calls
            .iter()
            .flat_map(|c| c.slices)
            .map(|&(s, _, _)| s + 1)
            .max()
            .unwrap();
        let inputs = attention_inputs(&mut rng, calls, q_cols, kv_cols);
        let norm = norm_scales.as_ref();
        let want = attention_calls(&p.cpu, &params, &rope, norm, None, calls, &inputs, sequences);
        let got = attention_calls(&p.gpu, &params, &rope, norm, None, calls, &inputs, sequences);
        for (call, (got, want)) in got.iter().zip(&want).enumerate() {
            check_attention_rows(
                &format!("attention {name} h{heads}/{kv_heads} d{head_dim} w{window:?} norm {norm:?} rot {rotary_dim} call {call}"),
                got,
                want,
                q_cols,
                attention_limit(&calls[call]),
            );
        }
    }
}

/// Each call's fused q/k/v rows: queries scaled up so that the softmax has clear peaks, not a near-uniform average.
fn attention_inputs(rng: &mut Rng, calls: &[AttentionCall], q_cols: usize, kv_cols: usize) -> Vec<Vec<f32>> {
    calls
        .iter()
        .map(|c| {
            let rows: usize = c.slices.iter().map(|&(_, _, len)| len).sum();
            (0..rows)
                .flat_map(|_| [rng.values(q_cols, 3.0), rng.values(2 * kv_cols, 1.0)].concat())
                .collect()
        })
        .collect()
}

/// Calls with a prefill slice run the prefill (tensor-core) kernel, batches of single rows the split one.
fn attention_limit(call: &AttentionCall) -> f32 {
    match call.slices.iter().any(|&(_, _, len)| len > 1) {
        true => FLASH_LIMIT,
        false => F32_LIMIT,
    }
}

/// Compares one attention call's output row by row (a long context's output is small next to a short one's, so a
/// whole call's error would hide it), reporting the worst row.
fn check_attention_rows(what: &str, got: &[f32], want: &[f32], q_cols: usize, limit: f32) {
    let rows: Vec<(&[f32], &[f32])> = got.chunks(q_cols).zip(want.chunks(q_cols)).collect();
    let (row, &(g, w)) = rows
        .iter()
        .enumerate()
        .max_by(|a, b| rel_err(a.1 .0, a.1 .1).total_cmp(&rel_err(b.1 .0, b.1 .1)))
        .unwrap();
    check(&format!("{what} row {row}"), g.to_vec(), w.to_vec(), limit);
}

/// The prefill attention kernel against the CPU backend: slices of 1, 15, 16, 17, 64 and 300 rows in one batch (a
/// single row among prefill slices, tiles of (row, head) pairs full, partial and split across rows), then chunks
/// continuing over a prefix already in the cache (the chunked prefill and prefix-cache hits), then a decode batch
/// (the split kernel) over the same cache. Shapes: groups of 1, 4, 5, 6 and 8 query heads per kv head (a tile
/// holding parts of rows when the group does not divide it), head dims 16 to 256 (80 padded to 128), sliding
/// windows shorter and longer than a tile, and gpt-oss's per-head sinks.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn prefill_attention_lengths_groups_windows_sinks() {
    let p = pair();
    let mut rng = Rng::new(11);
    let calls: &[AttentionCall] = &[
        AttentionCall {
            slices: &[(0, 0, 1), (1, 0, 15), (2, 0, 16), (3, 0, 17), (4, 0, 300), (5, 0, 64)],
            fill: false,
        },
        AttentionCall {
            slices: &[(4, 300, 33), (0, 1, 1), (2, 16, 100), (5, 64, 65), (1, 15, 2)],
            fill: false,
        },
        AttentionCall {
            slices: &[(4, 333, 1), (3, 17, 1), (2, 116, 1)],
            fill: false,
        },
    ];
    // (heads, kv heads, head_dim, sliding window, sinks)
    let shapes: [(usize, usize, usize, Option<usize>, bool); 7] = [
        (4, 2, 16, None, false),
        (32, 4, 128, None, false),
        (16, 2, 256, None, false),
        (64, 8, 64, Some(128), true),
        (12, 2, 80, Some(20), true),
        (8, 8, 32, None, true),
        (20, 4, 256, Some(7), false),
    ];
    for (heads, kv_heads, head_dim, window, with_sinks) in shapes {
        let params = AttentionParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
        };
        let rope = Rope::new(1e4, head_dim, head_dim);
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        let sinks = with_sinks.then(|| rng.values(heads, 2.0));
        let inputs = attention_inputs(&mut rng, calls, q_cols, kv_cols);
        let sinks = sinks.as_deref();
        let want = attention_calls(&p.cpu, &params, &rope, None, sinks, calls, &inputs, 6);
        let got = attention_calls(&p.gpu, &params, &rope, None, sinks, calls, &inputs, 6);
        for (call, (got, want)) in got.iter().zip(&want).enumerate() {
            check_attention_rows(
                &format!(
                    "prefill attention h{heads}/{kv_heads} d{head_dim} w{window:?} sinks {with_sinks} call {call}"
                ),
                got,
                want,
                q_cols,
                attention_limit(&calls[call]),
            );
        }
    }
}

/// The routed experts of one bank, routed by random logits for 1, 3 and 8 rows (the decode kernels), 40 rows (the
/// grouped GEMM path) and, when `many`, more rows than one group of it, on both backends.
fn check_routed_experts(p: &Pair, rng: &mut Rng, bank: &[ExpertTensors], top_k: usize, many: bool, what: &str) {
    check_routed_experts_of(p, rng, bank, ExpertActivation::SiluGlu, top_k, many, what)
}

/// [`check_routed_experts`] with experts computing `activation`.
fn check_routed_experts_of(
    p: &Pair,
    rng: &mut Rng,
    bank: &[ExpertTensors],
    activation: ExpertActivation,
    top_k: usize,
    many: bool,
    what: &str,
) {
    let (experts, inter, hidden) = (bank.len(), bank[0].gate.shape[0], bank[0].gate.shape[1]);
    for rows in [1, 3, 8, 40].into_iter().chain(many.then_some(MOE_GROUP_ROWS + 40)) {
        let x = rng.values(rows * hidden, 1.0);
        // Logits spread wide so the top-k choice is never a near tie between the two backends.
        let logits = rng.values(rows * experts, 8.0);
        for renormalize in [false, true] {
            let kind = RouterKind::SoftmaxTopK { renormalize };
            same_on_both!(
                p,
                &format!(
                    "route + moe_experts {what} e{experts} k{top_k} {hidden}x{inter} rows={rows} renorm={renormalize}"
                ),
                F32_LIMIT,
                |be| {
                    let set = be.experts(bank.to_vec(), activation).unwrap();
                    let routing = be
                        .route(
                            &be.upload(&logits, rows, experts).unwrap(),
                            Router {
                                kind,
                                top_k,
                                correction_bias: None,
                            },
                        )
                        .unwrap();
                    be.to_host(
                        &be.moe_experts(&be.upload(&x, rows, hidden).unwrap(), &routing, &set)
                            .unwrap(),
                    )
                    .unwrap()
                }
            );
        }
    }
}

/// (experts, top_k, hidden, inter), each reaching other paths of the decode kernels: a Qwen3-30B-A3B-sized expert
/// (several staged chunks per warp); top_k 4 and 2 (moe_down's warps share a row's experts with 2 and 4 feature
/// groups), top_k 10 (more experts than warps); inter = 100 (down rows not 16-byte aligned: scalar path); hidden =
/// 520 (a partial k-step in gate/up, a partial last block in down).
const EXPERT_SHAPES: [(usize, usize, usize, usize); 4] = [
    (16, 8, 2048, 768),
    (16, 4, 256, 96),
    (12, 10, 520, 100),
    (8, 2, 520, 64),
];

fn random_bank(rng: &mut Rng, experts: usize, hidden: usize, inter: usize) -> Vec<ExpertTensors> {
    (0..experts)
        .map(|e| {
            ExpertTensors::unbiased(
                rng.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.1),
                rng.bf16(&format!("e{e}.up"), &[inter, hidden], 0.1),
                rng.bf16(&format!("e{e}.down"), &[hidden, inter], 0.1),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn router_and_routed_experts() {
    let p = pair();
    let mut rng = Rng::new(4);
    for (experts, top_k, hidden, inter) in EXPERT_SHAPES {
        let bank = random_bank(&mut rng, experts, hidden, inter);
        check_routed_experts(&p, &mut rng, &bank, top_k, hidden * inter <= 520 * 100, "bf16");
    }
}

/// FP8 experts (128 x 128 blocks, and per channel) on the FP8 decode kernels (aligned rows 16 weights per lane,
/// others one: inter 100 and hidden 520) and the grouped path (dequantized to bf16), against the CPU's
/// dequantizing GEMV.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn routed_fp8_experts() {
    let p = pair();
    let mut rng = Rng::new(5);
    for (experts, top_k, hidden, inter) in EXPERT_SHAPES {
        let bank = random_bank(&mut rng, experts, hidden, inter);
        for scheme in [Fp8Scheme::BLOCK_128, Fp8Scheme::PerChannel] {
            let quantized: Vec<ExpertTensors> = bank
                .iter()
                .map(|e| {
                    let q = |t: &TensorRef| quantize_fp8(t, scheme).unwrap();
                    ExpertTensors::unbiased(q(&e.gate), q(&e.up), q(&e.down))
                })
                .collect();
            check_routed_experts(
                &p,
                &mut rng,
                &quantized,
                top_k,
                hidden * inter <= 520 * 100,
                &format!("{scheme:?}"),
            );
        }
    }
}

/// gpt-oss's experts (biases on gate, up and down; the clamped SwiGLU), in bf16 and in MXFP4, on the decode
/// kernels and the grouped path (MXFP4 widened to bf16), against the CPU: gpt-oss's expert shape (2880 x 2880, top
/// 4), the fixtures', and one whose rows hold a number of 32-value groups that is no multiple of 32 lanes (544 = 17
/// groups, 96 = 3). Gate values reach past the clamp's limit: with weights of 0.1
/// and 2880 inputs their spread is about 3, and the limit is set at 2.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn routed_gpt_oss_experts() {
    let p = pair();
    let mut rng = Rng::new(9);
    let clamped = ExpertActivation::ClampedSwiGlu {
        alpha: 1.702,
        limit: 2.0,
    };
    for (experts, top_k, hidden, inter) in [(16, 4, 2880, 2880), (8, 2, 64, 32), (12, 4, 544, 96)] {
        let biased = |rng: &mut Rng, e: usize, gate: TensorRef, up: TensorRef, down: TensorRef| ExpertTensors {
            gate_bias: Some(rng.bf16(&format!("e{e}.gate_bias"), &[inter], 0.5)),
            up_bias: Some(TensorRef::from_f32(&format!("e{e}.up_bias"), vec![inter], &rng.values(inter, 0.5)).unwrap()),
            down_bias: Some(rng.bf16(&format!("e{e}.down_bias"), &[hidden], 0.5)),
            ..ExpertTensors::unbiased(gate, up, down)
        };
        let bf16: Vec<ExpertTensors> = (0..experts)
            .map(|e| {
                let gate = rng.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.1);
                let up = rng.bf16(&format!("e{e}.up"), &[inter, hidden], 0.1);
                let down = rng.bf16(&format!("e{e}.down"), &[hidden, inter], 0.1);
                biased(&mut rng, e, gate, up, down)
            })
            .collect();
        let many = hidden * inter <= 544 * 96;
        check_routed_experts_of(&p, &mut rng, &bf16, clamped, top_k, many, "gpt-oss bf16");
        let mxfp4: Vec<ExpertTensors> = (0..experts)
            .map(|e| {
                let gate = rng.mxfp4(&format!("e{e}.gate"), inter, hidden);
                let up = rng.mxfp4(&format!("e{e}.up"), inter, hidden);
                let down = rng.mxfp4(&format!("e{e}.down"), hidden, inter);
                biased(&mut rng, e, gate, up, down)
            })
            .collect();
        check_routed_experts_of(&p, &mut rng, &mxfp4, clamped, top_k, many, "gpt-oss MXFP4");
        // Unbiased MXFP4 experts computing silu(gate) * up: the kernels' other arithmetic.
        let plain: Vec<ExpertTensors> = mxfp4
            .iter()
            .map(|e| ExpertTensors::unbiased(e.gate.clone(), e.up.clone(), e.down.clone()))
            .collect();
        check_routed_experts(&p, &mut rng, &plain, top_k, many, "MXFP4 unbiased");
    }
}

/// A router with a correction bias over `logits` (`[rows, experts]`), then the routed experts of `bank` on `x`.
struct RouterCase<'a> {
    kind: RouterKind,
    top_k: usize,
    rows: usize,
    logits: &'a [f32],
    bias: &'a TensorRef,
    x: &'a [f32],
    bank: &'a [ExpertTensors],
}

impl RouterCase<'_> {
    /// The routed ids, and the experts' weighted sum (which the weights decide).
    fn run<B: Backend>(&self, be: &B) -> (Vec<u32>, Vec<f32>) {
        let experts = self.bank.len();
        let set = be.experts(self.bank.to_vec(), ExpertActivation::SiluGlu).unwrap();
        let bias = be.weight(self.bias.clone()).unwrap();
        let router = Router {
            kind: self.kind,
            top_k: self.top_k,
            correction_bias: Some(&bias),
        };
        let routing = be
            .route(&be.upload(self.logits, self.rows, experts).unwrap(), router)
            .unwrap();
        let hidden = self.x.len() / self.rows;
        let out = be
            .moe_experts(&be.upload(self.x, self.rows, hidden).unwrap(), &routing, &set)
            .unwrap();
        (be.routing_to_host(&routing).unwrap(), be.to_host(&out).unwrap())
    }
}

/// DeepSeek-V3's and GLM-4.5's router on the device against the CPU's: the same experts in the same order, and
/// the same weights (seen through the routed experts' weighted sum), with the correction bias, for the shapes of
/// the released models and of the fixture, groups kept or left out, a last lane partly filled.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn grouped_sigmoid_router() {
    let p = pair();
    let mut rng = Rng::new(8);
    let (hidden, inter) = (64, 32);
    // (experts, n_group, topk_group, top_k): GLM-4.5(-Air), DeepSeek-V3, the glm4_moe fixture, 96 experts (the
    // last lane holds experts of two groups' ends), the router kernel's most experts.
    for (experts, n_group, topk_group, top_k) in [
        (128, 1, 1, 8),
        (160, 1, 1, 8),
        (256, 8, 4, 8),
        (8, 2, 1, 2),
        (96, 4, 3, 6),
        (512, 16, 4, 8),
    ] {
        let bank = rng.experts(experts, hidden, inter);
        let bias = TensorRef::from_f32("bias", vec![experts], &rng.values(experts, 0.1)).unwrap();
        for rows in [1, 5, 40] {
            let x = rng.values(rows * hidden, 1.0);
            // Logits within +-4: sigmoid scores far from saturating to equal values.
            let logits = rng.values(rows * experts, 4.0);
            for (renormalize, scaling) in [(true, 2.5), (false, 1.0)] {
                let kind = RouterKind::SigmoidGroupedTopK {
                    n_group,
                    topk_group,
                    renormalize,
                    scaling,
                };
                let what = format!("grouped router e{experts} g{n_group}/{topk_group} k{top_k} rows={rows} {kind:?}");
                let case = RouterCase {
                    kind,
                    top_k,
                    rows,
                    logits: &logits,
                    bias: &bias,
                    x: &x,
                    bank: &bank,
                };
                let (cpu, gpu) = (case.run(&p.cpu), case.run(&p.gpu));
                assert_eq!(gpu.0, cpu.0, "{what}: routed ids");
                check(&what, gpu.1, cpu.1, F32_LIMIT);
            }
        }
    }
}

/// The expert kinds the CUDA backend has no kernels for yet (FP8 experts with biases or the clamped SwiGLU) are
/// refused when a model loads, with a configuration error naming them, rather than run wrongly; every router kind
/// has a kernel.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn expert_kinds_without_kernels_are_refused_at_load() {
    let p = pair();
    for kind in [
        RouterKind::SoftmaxTopK { renormalize: true },
        RouterKind::SigmoidGroupedTopK {
            n_group: 8,
            topk_group: 4,
            renormalize: true,
            scaling: 2.5,
        },
    ] {
        p.gpu.check_router(kind).unwrap();
    }
    let mut rng = Rng::new(6);
    let fp8 = |t: TensorRef| quantize_fp8(&t, Fp8Scheme::BLOCK_128).unwrap();
    let expert = ExpertTensors::unbiased(
        fp8(rng.bf16("gate", &[32, 64], 0.1)),
        fp8(rng.bf16("up", &[32, 64], 0.1)),
        fp8(rng.bf16("down", &[64, 32], 0.1)),
    );
    let clamped = ExpertActivation::ClampedSwiGlu {
        alpha: 1.702,
        limit: 7.0,
    };
    let refused = p.gpu.experts(vec![expert.clone()], clamped).err().unwrap();
    assert!(
        matches!(refused, Error::Config(ref m) if m.contains("ClampedSwiGlu")),
        "{refused}"
    );
    let biased = ExpertTensors {
        down_bias: Some(rng.bf16("down_bias", &[64], 0.1)),
        ..expert
    };
    assert!(matches!(
        p.gpu.experts(vec![biased], ExpertActivation::SiluGlu),
        Err(Error::Config(_))
    ));
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn fused_residual_norm_elementwise_gate_and_routing_round_trip() {
    let p = pair();
    let mut rng = Rng::new(5);
    let (rows, cols) = (3, 2048);
    let x = rng.values(rows * cols, 2.0);
    let y = rng.values(rows * cols, 2.0);
    let gate = rng.values(rows * cols, 3.0);
    let norm = rng.bf16("norm", &[cols], 1.0);
    same_on_both!(p, "add_rms_norm (sum and norm)", F32_LIMIT, |be| {
        let mut a = be.upload(&x, rows, cols).unwrap();
        let normed = be
            .add_rms_norm(
                &mut a,
                &be.upload(&y, rows, cols).unwrap(),
                &be.weight(norm.clone()).unwrap(),
                1e-6,
            )
            .unwrap();
        [be.to_host(&a).unwrap(), be.to_host(&normed).unwrap()].concat()
    });
    same_on_both!(p, "sigmoid_gate (per element)", F32_LIMIT, |be| {
        let mut a = be.upload(&x, rows, cols).unwrap();
        be.sigmoid_gate(&mut a, &be.upload(&gate, rows, cols).unwrap()).unwrap();
        be.to_host(&a).unwrap()
    });
    // A routing made on the host comes back as it went, and drives the experts as the router's own would.
    let (experts, top_k, hidden, inter) = (8, 2, 64, 32);
    let bank: Vec<ExpertTensors> = (0..experts)
        .map(|e| {
            ExpertTensors::unbiased(
                rng.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.2),
                rng.bf16(&format!("e{e}.up"), &[inter, hidden], 0.2),
                rng.bf16(&format!("e{e}.down"), &[hidden, inter], 0.2),
            )
        })
        .collect();
    let ids = [3u32, 5, 0, 7, 5, 1];
    let weights = [0.75f32, 0.25, 0.5, 0.5, 0.9, 0.1];
    let hidden_in = rng.values(3 * hidden, 1.0);
    assert_eq!(
        p.gpu
            .routing_to_host(&p.gpu.routing_from_host(&ids, &weights, top_k).unwrap())
            .unwrap(),
        ids
    );
    same_on_both!(p, "moe_experts on a host-made routing", F32_LIMIT, |be| {
        let set = be.experts(bank.clone(), ExpertActivation::SiluGlu).unwrap();
        let routing = be.routing_from_host(&ids, &weights, top_k).unwrap();
        be.to_host(
            &be.moe_experts(&be.upload(&hidden_in, 3, hidden).unwrap(), &routing, &set)
                .unwrap(),
        )
        .unwrap()
    });
}

/// A Gated DeltaNet layer's shapes and inputs, and the calls that feed it: `calls[c][s]` is sequence s's
/// (start_pos, len) in call c.
struct GatedDeltaNetCase {
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    /// Added to every `a`: negative values give softplus(a + dt_bias) near 0, weak decays that carry the state far.
    decay_bias: f32,
    calls: &'static [&'static [(usize, usize)]],
}

/// causal_conv1d then gated_delta_rule over `case`'s calls on both backends; each op's outputs of every call
/// compared.
fn check_gated_deltanet(p: &Pair, rng: &mut Rng, what: &str, case: &GatedDeltaNetCase) {
    let GatedDeltaNetCase {
        k_heads,
        v_heads,
        dk,
        dv,
        ..
    } = *case;
    let kernel = 4;
    let channels = 2 * k_heads * dk + v_heads * dv;
    let params = DeltaRuleParams {
        num_k_heads: k_heads,
        num_v_heads: v_heads,
        k_head_dim: dk,
        v_head_dim: dv,
    };
    let conv = rng.bf16("conv1d", &[channels, kernel], 0.5);
    let a_log = rng.bf16("A_log", &[v_heads], 1.0);
    let dt_bias = rng.bf16("dt_bias", &[v_heads], 1.0);
    // Every sequence's tokens, each rounded up to the device cache's 16-token blocks.
    let capacity_tokens = (0..case.calls[0].len())
        .map(|s| {
            case.calls
                .iter()
                .map(|call| call[s].1)
                .sum::<usize>()
                .next_multiple_of(16)
        })
        .sum();
    let spec = || KvSpec {
        layers: vec![KvLayerSpec::heads(1, 2)],
        capacity_tokens,
        recurrent: Some(RecurrentSpec {
            num_layers: 1,
            conv_channels: channels,
            conv_kernel: kernel,
            num_heads: v_heads,
            k_head_dim: dk,
            v_head_dim: dv,
        }),
    };
    let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = case
        .calls
        .iter()
        .map(|call| {
            let rows: usize = call.iter().map(|(_, l)| l).sum();
            let x = rng.values(rows * channels, 1.0);
            let a = rng.values(rows * v_heads, 2.0);
            (
                x,
                a.iter().map(|a| a + case.decay_bias).collect(),
                rng.values(rows * v_heads, 2.0),
            )
        })
        .collect();
    fn run<B: Backend>(
        be: &B,
        case: &GatedDeltaNetCase,
        spec: KvSpec,
        weights: [&TensorRef; 3],
        inputs: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        params: &DeltaRuleParams,
    ) -> (Vec<f32>, Vec<f32>) {
        let (channels, v_heads) = (weights[0].shape[0], params.num_v_heads);
        let mut kv = be.new_kv(spec).unwrap();
        let seqs: Vec<_> = case.calls[0].iter().map(|_| kv.alloc_seq()).collect();
        let [conv_w, a_log_w, dt_w] = weights.map(|w| be.weight(w.clone()).unwrap());
        let (mut conv_out, mut delta_out) = (Vec::new(), Vec::new());
        for (call, (x, a, b)) in case.calls.iter().zip(inputs) {
            let slices: Vec<SeqSlice> = call
                .iter()
                .zip(&seqs)
                .map(|(&(start_pos, len), &seq)| SeqSlice { seq, start_pos, len })
                .collect();
            let rows: usize = call.iter().map(|(_, l)| l).sum();
            let batch = be.prepare_batch(&mut kv, &slices).unwrap();
            let mixed = be
                .causal_conv1d(&be.upload(x, rows, channels).unwrap(), &conv_w, &mut kv, 0, &batch)
                .unwrap();
            let (a, b) = (
                be.upload(a, rows, v_heads).unwrap(),
                be.upload(b, rows, v_heads).unwrap(),
            );
            let out = be
                .gated_delta_rule(&mixed, &a, &b, &a_log_w, &dt_w, &mut kv, 0, &batch, params)
                .unwrap();
            conv_out.extend(be.to_host(&mixed).unwrap());
            delta_out.extend(be.to_host(&out).unwrap());
        }
        (conv_out, delta_out)
    }
    let weights = [&conv, &a_log, &dt_bias];
    let (cpu_conv, cpu_delta) = run(&p.cpu, case, spec(), weights, &inputs, &params);
    let (gpu_conv, gpu_delta) = run(&p.gpu, case, spec(), weights, &inputs, &params);
    check(&format!("causal_conv1d, {what}"), gpu_conv, cpu_conv, F32_LIMIT);
    check(&format!("gated_delta_rule, {what}"), gpu_delta, cpu_delta, F32_LIMIT);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn gated_deltanet_ops_carry_state_across_calls_and_sequences() {
    // Sequence A prefills 21 tokens (one partial chunk) with B's 2; then A decodes 1 and B continues with 3.
    let case = GatedDeltaNetCase {
        k_heads: 2,
        v_heads: 4,
        dk: 32,
        dv: 48,
        decay_bias: 0.0,
        calls: &[&[(0, 21), (0, 2)], &[(21, 1), (2, 3)]],
    };
    check_gated_deltanet(&pair(), &mut Rng::new(6), "two calls", &case);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn chunked_delta_rule_for_long_slices_among_short_ones() {
    let p = pair();
    let mut rng = Rng::new(7);
    // Three sequences over three calls, each batch mixing chunked slices (full chunks, partial last chunks, one of
    // exactly 64 tokens) with token-by-token ones (1 token, and 15: one short of the chunked form), and every
    // sequence passing its state from one form to the other: A 300, 150, 1; B 130, 1, 64; C 1, 70, 15. The chunked
    // slices run in gdn.cu's gated_delta_rule_chunked.
    let calls: &[&[(usize, usize)]] = &[
        &[(0, 300), (0, 130), (0, 1)],
        &[(300, 150), (130, 1), (1, 70)],
        &[(450, 1), (131, 64), (71, 15)],
    ];
    // The shortest chunked slices (16, 17) beside a chunk and one token short of two (63 + 64 = 127, from a state
    // the token-by-token form left), then a chunk's worth more each.
    let short_calls: &[&[(usize, usize)]] = &[&[(0, 16), (0, 17), (0, 1)], &[(16, 64), (17, 63), (1, 127)]];
    // The real models' heads (128 x 128), then heads that fill the kernel's blocks partly (dk 64, dv 48: one and a
    // half blocks of 32 columns) with three value heads per key head, then the fixtures' (16 x 16).
    for (k_heads, v_heads, dk, dv, calls) in [
        (2, 4, 128, 128, calls),
        (1, 3, 64, 48, calls),
        (2, 4, 16, 16, short_calls),
        (2, 4, 128, 128, short_calls),
    ] {
        let case = GatedDeltaNetCase {
            k_heads,
            v_heads,
            dk,
            dv,
            decay_bias: -3.0,
            calls,
        };
        check_gated_deltanet(
            &p,
            &mut rng,
            &format!("{k_heads}/{v_heads} heads of {dk} x {dv}, {} calls", calls.len()),
            &case,
        );
    }
}

/// The batches of [`latent_attention_prefill_then_decode`]: (sequence, start, len) slices per call.
const MLA_CALLS: [&[(usize, usize, usize)]; 3] = [
    &[(0, 0, 37), (1, 0, 5)],
    &[(0, 37, 1), (1, 5, 1)],
    &[(1, 6, 20), (0, 38, 1)],
];

/// Runs each call's (q, compressed kv) through `mla_attention` over one latent KV layer of two sequences.
fn mla_calls<B: Backend>(
    be: &B,
    params: &MlaParams,
    kv_b: &TensorRef,
    norm: &[f32],
    rope: &Rope,
    inputs: &[(Vec<f32>, Vec<f32>)],
) -> Vec<Vec<f32>> {
    let mut kv = be
        .new_kv(KvSpec {
            layers: vec![KvLayerSpec::latent(params.latent_width())],
            capacity_tokens: 128,
            recurrent: None,
        })
        .unwrap();
    let seqs = [kv.alloc_seq(), kv.alloc_seq()];
    let kv_b = be.weight(kv_b.clone()).unwrap();
    let norm = be
        .weight(TensorRef::from_f32("kv_norm", vec![norm.len()], norm).unwrap())
        .unwrap();
    let rope = be.rope_table(rope).unwrap();
    MLA_CALLS
        .iter()
        .zip(inputs)
        .map(|(call, (q, compressed))| {
            let slices: Vec<SeqSlice> = call
                .iter()
                .map(|&(s, start_pos, len)| SeqSlice {
                    seq: seqs[s],
                    start_pos,
                    len,
                })
                .collect();
            let rows = q.len() / params.q_width();
            let batch = be.prepare_batch(&mut kv, &slices).unwrap();
            let q = be.upload(q, rows, params.q_width()).unwrap();
            let compressed = be.upload(compressed, rows, params.latent_width()).unwrap();
            let out = be
                .mla_attention(&q, &compressed, &norm, &kv_b, &rope, &mut kv, 0, &batch, params)
                .unwrap();
            be.to_host(&out).unwrap()
        })
        .collect()
}

/// Multi-head latent attention against the CPU backend: DeepSeek-V3's head shape (rank 512, the kernels' largest;
/// nope 128, rope 64 interleaved, values of 128) with 16 heads, and a small rotate-half shape; a prefill of two
/// sequences, a decode step of both, then a prefill chunk batched with a decode row; kv_b in bf16 and in FP8.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn latent_attention_prefill_then_decode() {
    let p = pair();
    let mut rng = Rng::new(11);
    for (heads, rank, nope, rope_dim, v_dim, interleaved) in [(16, 512, 128, 64, 128, true), (4, 32, 16, 8, 12, false)]
    {
        let params = MlaParams {
            num_heads: heads,
            kv_lora_rank: rank,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope_dim,
            v_head_dim: v_dim,
            scale: 0.07,
            rope_interleaved: interleaved,
            eps: 1e-6,
        };
        let kv_b = rng.bf16("kv_b", &[params.kv_b_rows(), rank], 0.1);
        // DeepSeek-V3's checkpoints store kv_b_proj in 128 x 128 block FP8.
        let kv_b_fp8 = quantize_fp8(&kv_b, Fp8Scheme::BLOCK_128).unwrap();
        let norm: Vec<f32> = rng.values(rank, 0.2).iter().map(|v| 1.0 + v).collect();
        let rope = Rope {
            attention_factor: 1.1,
            ..Rope::new(1e4, rope_dim, rope_dim)
        };
        let inputs: Vec<(Vec<f32>, Vec<f32>)> = MLA_CALLS
            .iter()
            .map(|call| {
                let rows: usize = call.iter().map(|s| s.2).sum();
                (
                    rng.values(rows * params.q_width(), 1.0),
                    rng.values(rows * params.latent_width(), 1.0),
                )
            })
            .collect();
        for (kv_b, format) in [(&kv_b, "bf16"), (&kv_b_fp8, "FP8")] {
            let cpu = mla_calls(&p.cpu, &params, kv_b, &norm, &rope, &inputs);
            let gpu = mla_calls(&p.gpu, &params, kv_b, &norm, &rope, &inputs);
            for (i, (gpu, cpu)) in gpu.into_iter().zip(cpu).enumerate() {
                check(
                    &format!("mla {heads} heads of rank {rank}, {format} kv_b, call {i}"),
                    gpu,
                    cpu,
                    F32_LIMIT,
                );
            }
        }
    }
}

/// A residual `[rows, cols]` and the RMSNorm weight of `cols`, for the fused residual epilogues.
struct ResidualCase {
    rows: usize,
    residual: Vec<f32>,
    norm: TensorRef,
}

impl ResidualCase {
    fn new(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        ResidualCase {
            rows,
            residual: rng.values(rows * cols, 2.0),
            norm: rng.bf16("norm", &[cols], 1.0),
        }
    }

    /// `op` given this case's residual and norm on `be`; the residual after it, then what it returned.
    fn run<B: Backend>(
        &self,
        be: &B,
        op: impl FnOnce(ResidualNorm<'_, B::Tensor, B::Weight>) -> B::Tensor,
    ) -> Vec<f32> {
        let cols = self.residual.len() / self.rows;
        let mut residual = be.upload(&self.residual, self.rows, cols).unwrap();
        let weight = be.weight(self.norm.clone()).unwrap();
        let normed = op(ResidualNorm {
            residual: &mut residual,
            weight: &weight,
            eps: 1e-6,
        });
        [be.to_host(&residual).unwrap(), be.to_host(&normed).unwrap()].concat()
    }
}

/// Fails unless `fused` and `unfused` are the same to the bit.
fn check_same_bits(what: &str, fused: &[f32], unfused: &[f32]) {
    let differ = fused
        .iter()
        .zip(unfused)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        differ == 0 && fused.len() == unfused.len(),
        "{what}: {differ} values differ from the unfused ops"
    );
}

/// `x W^T (+ bias)` added to `case`'s residual and normalised: by `linear_add_rms_norm` when `fused`, else by
/// `linear` then `add_rms_norm`.
fn linear_into<B: Backend>(
    be: &B,
    case: &ResidualCase,
    x: &[f32],
    w: &TensorRef,
    bias: Option<&TensorRef>,
    fused: bool,
) -> Vec<f32> {
    let bias = bias.map(|b| be.weight(b.clone()).unwrap());
    let (x, w) = (
        be.upload(x, case.rows, w.shape[1]).unwrap(),
        be.weight(w.clone()).unwrap(),
    );
    case.run(be, |into| match fused {
        true => be.linear_add_rms_norm(&x, &w, bias.as_ref(), into).unwrap(),
        false => {
            let y = be.linear(&x, &w, bias.as_ref()).unwrap();
            be.add_rms_norm(into.residual, &y, into.weight, into.eps).unwrap()
        }
    })
}

/// The output projection fused with the residual add and the next RMSNorm (gemv.cu's residual epilogue, its last
/// block normalising): against the CPU's linear then add_rms_norm within f32's limit, and against the GPU's own
/// unfused GEMV and add_rms_norm to the bit (the summation order is theirs), for every GEMV row count (9 rows take
/// the unfused path), q30's o_proj shape, a bias with a partial last block of rows and k split between warps, and
/// k not a multiple of 8. Each shape's launches follow one another, so a block counter left unreset shows.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn fused_linear_residual_norm() {
    let p = pair();
    let mut rng = Rng::new(12);
    for (k, n, biased) in [(4096, 2048, false), (776, 200, true), (515, 33, true)] {
        let w = rng.bf16("w", &[n, k], 0.05);
        let bias = TensorRef::from_f32("bias", vec![n], &rng.values(n, 0.5)).unwrap();
        for rows in 1..=GEMV_MAX_ROWS + 1 {
            let x = rng.values(rows * k, 1.0);
            let case = ResidualCase::new(&mut rng, rows, n);
            let bias = biased.then_some(&bias);
            let what = format!("linear_add_rms_norm {n}x{k} bias={biased} rows={rows}");
            let gpu = linear_into(&p.gpu, &case, &x, &w, bias, true);
            check(
                &what,
                gpu.clone(),
                linear_into(&p.cpu, &case, &x, &w, bias, true),
                F32_LIMIT,
            );
            let unfused = linear_into(&p.gpu, &case, &x, &w, bias, false);
            check_same_bits(&what, &gpu, &unfused);
        }
    }
}

/// A router's weights (bias and correction bias when it has them) over `x`, then the routed experts of `bank`.
struct FusedRouterCase<'a> {
    kind: RouterKind,
    top_k: usize,
    rows: usize,
    x: &'a [f32],
    w: &'a TensorRef,
    bias: Option<&'a TensorRef>,
    correction: Option<&'a TensorRef>,
    bank: &'a [ExpertTensors],
}

impl FusedRouterCase<'_> {
    /// The routed ids, and the experts' weighted sum (which the weights decide): routed by `route_linear` when
    /// `fused`, else by `linear` then `route`.
    fn run<B: Backend>(&self, be: &B, fused: bool) -> (Vec<u32>, Vec<f32>) {
        let hidden = self.x.len() / self.rows;
        let set = be.experts(self.bank.to_vec(), ExpertActivation::SiluGlu).unwrap();
        let weight = |t: Option<&TensorRef>| t.map(|t| be.weight(t.clone()).unwrap());
        let (bias, correction) = (weight(self.bias), weight(self.correction));
        let router = Router {
            kind: self.kind,
            top_k: self.top_k,
            correction_bias: correction.as_ref(),
        };
        let (x, w) = (
            be.upload(self.x, self.rows, hidden).unwrap(),
            be.weight(self.w.clone()).unwrap(),
        );
        let routing = match fused {
            true => be.route_linear(&x, &w, bias.as_ref(), router).unwrap(),
            false => be.route(&be.linear(&x, &w, bias.as_ref()).unwrap(), router).unwrap(),
        };
        let out = be.moe_experts(&x, &routing, &set).unwrap();
        (be.routing_to_host(&routing).unwrap(), be.to_host(&out).unwrap())
    }
}

/// The router's GEMV with its top-k in one launch (gemv.cu's gemv_route_R) against the CPU's linear then route
/// (the same experts in the same order, weights within f32's limit as the routed experts' sum shows them) and
/// against the GPU's own linear then route to the bit, for every GEMV row count (9 rows take the unfused path):
/// q30's router (128 experts, top 8) with and without renormalising, experts that leave the last lanes partly
/// empty with a router bias (gpt-oss's kind), and the grouped sigmoid router at GLM-4.5's and DeepSeek-V3's shapes
/// (the largest whose scratch fits: 2 x 256 + 2 x 8 floats) and at 512 experts (which takes the unfused path).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn fused_router_gemv_and_top_k() {
    let p = pair();
    let mut rng = Rng::new(13);
    let (hidden, inter) = (256, 32);
    let grouped = |n_group, topk_group| RouterKind::SigmoidGroupedTopK {
        n_group,
        topk_group,
        renormalize: true,
        scaling: 2.5,
    };
    let cases = [
        (128, 8, RouterKind::SoftmaxTopK { renormalize: true }, false),
        (128, 8, RouterKind::SoftmaxTopK { renormalize: false }, false),
        (60, 4, RouterKind::SoftmaxTopK { renormalize: true }, true),
        (160, 8, grouped(1, 1), false),
        (256, 8, grouped(8, 4), false),
        (512, 8, grouped(16, 4), false),
    ];
    for (experts, top_k, kind, biased) in cases {
        // Weights of +-0.5 over 256 inputs of +-1: logits spread by about 2.7, far from near ties.
        let w = rng.bf16("router", &[experts, hidden], 0.5);
        let bias = TensorRef::from_f32("router_bias", vec![experts], &rng.values(experts, 0.5)).unwrap();
        let correction = TensorRef::from_f32("correction", vec![experts], &rng.values(experts, 0.1)).unwrap();
        let bank = rng.experts(experts, hidden, inter);
        for rows in 1..=GEMV_MAX_ROWS + 1 {
            let x = rng.values(rows * hidden, 1.0);
            let what = format!("route_linear e{experts} k{top_k} {kind:?} bias={biased} rows={rows}");
            let case = FusedRouterCase {
                kind,
                top_k,
                rows,
                x: &x,
                w: &w,
                bias: biased.then_some(&bias),
                correction: kind.has_correction_bias().then_some(&correction),
                bank: &bank,
            };
            let gpu = case.run(&p.gpu, true);
            let cpu = case.run(&p.cpu, true);
            assert_eq!(gpu.0, cpu.0, "{what}: routed ids");
            check(&what, gpu.1.clone(), cpu.1, F32_LIMIT);
            let unfused = case.run(&p.gpu, false);
            assert_eq!(gpu.0, unfused.0, "{what}: routed ids against linear then route");
            check_same_bits(&what, &gpu.1, &unfused.1);
        }
    }
}

/// Routed experts of `bank` over `x`, routed by `logits`, plus a shared expert's output when given, into a residual.
struct MoeResidualCase<'a> {
    bank: &'a [ExpertTensors],
    top_k: usize,
    x: &'a [f32],
    logits: &'a [f32],
    shared: Option<&'a [f32]>,
    residual: &'a ResidualCase,
}

impl MoeResidualCase<'_> {
    /// The residual and the normalised rows: by `moe_experts_add_rms_norm` when `fused`, else by `moe_experts`,
    /// `add_assign` of the shared output and `add_rms_norm`.
    fn run<B: Backend>(&self, be: &B, fused: bool) -> Vec<f32> {
        let rows = self.residual.rows;
        let (experts, hidden) = (self.bank.len(), self.x.len() / rows);
        let set = be.experts(self.bank.to_vec(), ExpertActivation::SiluGlu).unwrap();
        let router = Router {
            kind: RouterKind::SoftmaxTopK { renormalize: true },
            top_k: self.top_k,
            correction_bias: None,
        };
        let routing = be
            .route(&be.upload(self.logits, rows, experts).unwrap(), router)
            .unwrap();
        let x = be.upload(self.x, rows, hidden).unwrap();
        let shared = self.shared.map(|s| be.upload(s, rows, hidden).unwrap());
        self.residual.run(be, |into| match fused {
            true => be
                .moe_experts_add_rms_norm(&x, &routing, &set, shared.as_ref(), into)
                .unwrap(),
            false => {
                let mut out = be.moe_experts(&x, &routing, &set).unwrap();
                if let Some(shared) = &shared {
                    be.add_assign(&mut out, shared).unwrap();
                }
                be.add_rms_norm(into.residual, &out, into.weight, into.eps).unwrap()
            }
        })
    }
}

/// The routed experts fused with the residual add and the next RMSNorm (moe_down's epilogue, its last block
/// normalising), with and without a shared expert's output added, against the CPU's moe_experts, add_assign and
/// add_rms_norm within f32's limit, and against the GPU's own unfused ops to the bit: bf16 experts at q30's shape
/// and one whose down rows are unaligned, FP8 experts, for 1, 3 and 8 rows (the decode kernels) and 40 (the grouped
/// path, which leaves the epilogue to the unfused ops). The offload's moe_combine epilogue is held to moe_down's by
/// cuda_offload's tests (offload equal to resident to the bit, decode through these ops).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn fused_routed_experts_residual_norm() {
    let p = pair();
    let mut rng = Rng::new(14);
    for (experts, top_k, hidden, inter) in [(16, 8, 2048, 768), (12, 10, 520, 100)] {
        let bf16 = random_bank(&mut rng, experts, hidden, inter);
        let fp8: Vec<ExpertTensors> = bf16
            .iter()
            .map(|e| {
                let q = |t: &TensorRef| quantize_fp8(t, Fp8Scheme::BLOCK_128).unwrap();
                ExpertTensors::unbiased(q(&e.gate), q(&e.up), q(&e.down))
            })
            .collect();
        for (bank, format) in [(&bf16, "bf16"), (&fp8, "FP8")] {
            for rows in [1, 3, 8, 40] {
                let x = rng.values(rows * hidden, 1.0);
                let logits = rng.values(rows * experts, 8.0);
                let shared_out = rng.values(rows * hidden, 1.0);
                let residual = ResidualCase::new(&mut rng, rows, hidden);
                for with_shared in [false, true] {
                    let case = MoeResidualCase {
                        bank,
                        top_k,
                        x: &x,
                        logits: &logits,
                        shared: with_shared.then_some(&shared_out[..]),
                        residual: &residual,
                    };
                    let what = format!(
                        "moe_experts_add_rms_norm {format} e{experts} k{top_k} {hidden}x{inter} rows={rows} \
                         shared={with_shared}"
                    );
                    let gpu = case.run(&p.gpu, true);
                    check(&what, gpu.clone(), case.run(&p.cpu, true), F32_LIMIT);
                    check_same_bits(&what, &gpu, &case.run(&p.gpu, false));
                }
            }
        }
    }
}

/// Logits `[rows, experts]` that route row r's k-th choice to `choose(r, k)` (distinct within a row): chosen
/// experts at 10, 8, 6, ... and the others below -4, so both backends pick alike.
fn steered_logits(
    rng: &mut Rng,
    rows: usize,
    experts: usize,
    top_k: usize,
    choose: impl Fn(usize, usize) -> usize,
) -> Vec<f32> {
    let mut logits: Vec<f32> = rng.values(rows * experts, 1.0).iter().map(|v| v - 5.0).collect();
    for r in 0..rows {
        for k in 0..top_k {
            logits[r * experts + choose(r, k)] = 10.0 - 2.0 * k as f32 + 0.5 * rng.unit();
        }
    }
    logits
}

/// The grouped path's batched tiles over 72 experts of very uneven row counts: expert 0 takes every row, expert 1
/// one row, experts 2..=30 a share each, 31..=53 rows by a quadratic residue (some none), 54..=60 a skewed share
/// and 61..=71 none; 40 rows (the smallest tiles), 700, and past one row group. Bf16, FP8 (both schemes) and MXFP4
/// experts, and bf16 experts whose down matrices sit 8 bytes off a 16-byte boundary in their blocks (hidden 130,
/// inter 99): the batched call takes only aligned pointers, so their down tiles run one cuBLAS call each.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn grouped_experts_of_uneven_row_counts() {
    let p = pair();
    let mut rng = Rng::new(14);
    let (experts, top_k) = (72, 4);
    let choose = |r: usize, k: usize| match k {
        0 => 0,
        1 if r == 0 => 1,
        1 => 2 + r % 29,
        2 => 31 + (r * r) % 23,
        _ => 54 + (r % 13).min(r % 7),
    };
    let mut banks: Vec<(String, Vec<ExpertTensors>)> = Vec::new();
    let bf16 = random_bank(&mut rng, experts, 256, 128);
    for scheme in [Fp8Scheme::BLOCK_128, Fp8Scheme::PerChannel] {
        let quantized = bf16
            .iter()
            .map(|e| {
                let q = |t: &TensorRef| quantize_fp8(t, scheme).unwrap();
                ExpertTensors::unbiased(q(&e.gate), q(&e.up), q(&e.down))
            })
            .collect();
        banks.push((format!("{scheme:?}"), quantized));
    }
    banks.push(("bf16".into(), bf16));
    let mxfp4 = (0..experts)
        .map(|e| {
            ExpertTensors::unbiased(
                rng.mxfp4(&format!("e{e}.gate"), 128, 256),
                rng.mxfp4(&format!("e{e}.up"), 128, 256),
                rng.mxfp4(&format!("e{e}.down"), 256, 128),
            )
        })
        .collect();
    banks.push(("MXFP4".into(), mxfp4));
    banks.push(("bf16 unaligned down".into(), random_bank(&mut rng, experts, 130, 99)));
    for (what, bank) in &banks {
        let hidden = bank[0].gate.shape[1];
        for rows in [40, 700, MOE_GROUP_ROWS + 40] {
            let x = rng.values(rows * hidden, 1.0);
            let logits = steered_logits(&mut rng, rows, experts, top_k, choose);
            same_on_both!(
                p,
                &format!("grouped tiles {what} e{experts} rows={rows}"),
                F32_LIMIT,
                |be| {
                    let set = be.experts(bank.clone(), ExpertActivation::SiluGlu).unwrap();
                    let router = Router {
                        kind: RouterKind::SoftmaxTopK { renormalize: true },
                        top_k,
                        correction_bias: None,
                    };
                    let routing = be.route(&be.upload(&logits, rows, experts).unwrap(), router).unwrap();
                    let ids = be.routing_to_host(&routing).unwrap();
                    let mut per_expert = vec![0usize; experts];
                    ids.iter().for_each(|&e| per_expert[e as usize] += 1);
                    assert_eq!(
                        (per_expert[0], per_expert[1], per_expert[71]),
                        (rows, 1, 0),
                        "routing steered as meant"
                    );
                    be.to_host(
                        &be.moe_experts(&be.upload(&x, rows, hidden).unwrap(), &routing, &set)
                            .unwrap(),
                    )
                    .unwrap()
                }
            );
        }
    }
}
