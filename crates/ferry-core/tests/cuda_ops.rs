//! Every CUDA op against the CPU backend on fresh random inputs (the backend-ops check): the same function on
//! any valid input, within f32-level relative error. Ignored unless asked for: they need an NVIDIA GPU and run
//! on the GPU machine through scripts/device/gpu-tests.sh.

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::{CudaBackend, GEMV_MAX_ROWS};
use ferry_core::backend::{AttentionParams, Backend, DeltaRuleParams, ExpertTensors, Rope, RouterKind, SeqSlice};
use ferry_core::kv::{KvCache, KvSpec, RecurrentSpec};
use ferry_core::loader::{DType, TensorRef};

/// Relative error limit for ops computed in f32 on both sides (products with bf16 weights are exact in f32;
/// what differs is the order of summation and the libm of each side).
const F32_LIMIT: f32 = 2e-5;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
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
    for rotary_dim in [head_dim, head_dim / 4] {
        let rope = Rope::new(1e6, head_dim, rotary_dim);
        same_on_both!(p, &format!("rope (rotary_dim {rotary_dim})"), F32_LIMIT, |be| {
            let mut kv = be
                .new_kv(KvSpec {
                    num_layers: 1,
                    num_kv_heads: 1,
                    head_dim,
                    capacity_tokens: 4096,
                    recurrent: None,
                })
                .unwrap();
            let seq = kv.alloc_seq();
            // Positions 3000.. so the angles are large, as in long contexts.
            let warmup = SeqSlice {
                seq,
                start_pos: 0,
                len: 3000,
            };
            be.prepare_batch(&mut kv, &[warmup]).unwrap();
            let batch = be
                .prepare_batch(
                    &mut kv,
                    &[SeqSlice {
                        seq,
                        start_pos: 3000,
                        len: rows,
                    }],
                )
                .unwrap();
            let mut t = be.upload(&x, rows, cols).unwrap();
            be.rope(&mut t, &batch, &be.rope_table(&rope).unwrap()).unwrap();
            be.to_host(&t).unwrap()
        });
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn attention_over_paged_cache_prefill_then_decode() {
    let p = pair();
    let mut rng = Rng::new(3);
    for (heads, kv_heads, head_dim, window) in [(4, 2, 16, None), (32, 4, 128, None), (8, 8, 64, Some(7))] {
        let params = AttentionParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
        };
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        // Step 1: two sequences prefill 37 and 5 tokens; step 2: both decode one token.
        let steps: [&[(usize, usize)]; 2] = [&[(0, 37), (0, 5)], &[(37, 1), (5, 1)]];
        let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = steps
            .iter()
            .map(|s| {
                let rows: usize = s.iter().map(|(_, l)| l).sum();
                (
                    rng.values(rows * q_cols, 1.0),
                    rng.values(rows * kv_cols, 1.0),
                    rng.values(rows * kv_cols, 1.0),
                )
            })
            .collect();
        same_on_both!(
            p,
            &format!("attention h{heads}/{kv_heads} d{head_dim} w{window:?}"),
            F32_LIMIT,
            |be| {
                let mut kv = be
                    .new_kv(KvSpec {
                        num_layers: 1,
                        num_kv_heads: kv_heads,
                        head_dim,
                        capacity_tokens: 100,
                        recurrent: None,
                    })
                    .unwrap();
                let seqs = [kv.alloc_seq(), kv.alloc_seq()];
                let mut outputs = Vec::new();
                for (step, (q, k, v)) in steps.iter().zip(&inputs) {
                    let slices: Vec<SeqSlice> = step
                        .iter()
                        .zip(seqs)
                        .map(|(&(start_pos, len), seq)| SeqSlice { seq, start_pos, len })
                        .collect();
                    let rows: usize = step.iter().map(|(_, l)| l).sum();
                    let batch = be.prepare_batch(&mut kv, &slices).unwrap();
                    let out = be
                        .attention(
                            &be.upload(q, rows, q_cols).unwrap(),
                            &be.upload(k, rows, kv_cols).unwrap(),
                            &be.upload(v, rows, kv_cols).unwrap(),
                            &mut kv,
                            0,
                            &batch,
                            &params,
                        )
                        .unwrap();
                    outputs.extend(be.to_host(&out).unwrap());
                }
                outputs
            }
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn router_and_routed_experts() {
    let p = pair();
    let mut rng = Rng::new(4);
    // (experts, top_k, hidden, inter), each reaching other paths of the decode kernels: a Qwen3-30B-A3B-sized
    // expert (several staged chunks per warp); top_k 4 and 2 (moe_down's warps share a row's experts with 2 and 4
    // feature groups), top_k 10 (more experts than warps); inter = 100 (down rows not 16-byte aligned: scalar
    // path); hidden = 520 (a partial k-step in gate/up, a partial last block in down).
    for (experts, top_k, hidden, inter) in [
        (16, 8, 2048, 768),
        (16, 4, 256, 96),
        (12, 10, 520, 100),
        (8, 2, 520, 64),
    ] {
        let bank: Vec<ExpertTensors> = (0..experts)
            .map(|e| ExpertTensors {
                gate: rng.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.1),
                up: rng.bf16(&format!("e{e}.up"), &[inter, hidden], 0.1),
                down: rng.bf16(&format!("e{e}.down"), &[hidden, inter], 0.1),
            })
            .collect();
        // 1, 3 and 8 rows take the decode kernels; 40 rows the grouped GEMM path.
        for rows in [1, 3, 8, 40] {
            let x = rng.values(rows * hidden, 1.0);
            // Logits spread wide so the top-k choice is never a near tie between the two backends.
            let logits = rng.values(rows * experts, 8.0);
            for renormalize in [false, true] {
                let kind = RouterKind::SoftmaxTopK { renormalize };
                same_on_both!(
                    p,
                    &format!(
                        "route + moe_experts e{experts} k{top_k} {hidden}x{inter} rows={rows} renorm={renormalize}"
                    ),
                    F32_LIMIT,
                    |be| {
                        let set = be.experts(bank.clone()).unwrap();
                        let routing = be
                            .route(&be.upload(&logits, rows, experts).unwrap(), top_k, kind)
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
        .map(|e| ExpertTensors {
            gate: rng.bf16(&format!("e{e}.gate"), &[inter, hidden], 0.2),
            up: rng.bf16(&format!("e{e}.up"), &[inter, hidden], 0.2),
            down: rng.bf16(&format!("e{e}.down"), &[hidden, inter], 0.2),
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
        let set = be.experts(bank.clone()).unwrap();
        let routing = be.routing_from_host(&ids, &weights, top_k).unwrap();
        be.to_host(
            &be.moe_experts(&be.upload(&hidden_in, 3, hidden).unwrap(), &routing, &set)
                .unwrap(),
        )
        .unwrap()
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn gated_deltanet_ops_carry_state_across_calls_and_sequences() {
    let p = pair();
    let mut rng = Rng::new(6);
    let (k_heads, v_heads, dk, dv, kernel) = (2, 4, 32, 48, 4);
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
    let spec = || KvSpec {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 2,
        capacity_tokens: 256,
        recurrent: Some(RecurrentSpec {
            num_layers: 1,
            conv_channels: channels,
            conv_kernel: kernel,
            num_heads: v_heads,
            k_head_dim: dk,
            v_head_dim: dv,
        }),
    };
    // Two calls: sequence A prefills 21 tokens with B's 2; then A decodes 1 and B continues with 3.
    let steps: [&[(usize, usize)]; 2] = [&[(0, 21), (0, 2)], &[(21, 1), (2, 3)]];
    let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = steps
        .iter()
        .map(|s| {
            let rows: usize = s.iter().map(|(_, l)| l).sum();
            (
                rng.values(rows * channels, 1.0),
                rng.values(rows * v_heads, 2.0),
                rng.values(rows * v_heads, 2.0),
            )
        })
        .collect();
    same_on_both!(p, "causal_conv1d + gated_delta_rule, two calls", F32_LIMIT, |be| {
        let mut kv = be.new_kv(spec()).unwrap();
        let seqs = [kv.alloc_seq(), kv.alloc_seq()];
        let (conv_w, a_log_w, dt_w) = (
            be.weight(conv.clone()).unwrap(),
            be.weight(a_log.clone()).unwrap(),
            be.weight(dt_bias.clone()).unwrap(),
        );
        let mut outputs = Vec::new();
        for (step, (x, a, b)) in steps.iter().zip(&inputs) {
            let slices: Vec<SeqSlice> = step
                .iter()
                .zip(seqs)
                .map(|(&(start_pos, len), seq)| SeqSlice { seq, start_pos, len })
                .collect();
            let rows: usize = step.iter().map(|(_, l)| l).sum();
            let batch = be.prepare_batch(&mut kv, &slices).unwrap();
            let mixed = be
                .causal_conv1d(&be.upload(x, rows, channels).unwrap(), &conv_w, &mut kv, 0, &batch)
                .unwrap();
            let (a, b) = (
                be.upload(a, rows, v_heads).unwrap(),
                be.upload(b, rows, v_heads).unwrap(),
            );
            let out = be
                .gated_delta_rule(&mixed, &a, &b, &a_log_w, &dt_w, &mut kv, 0, &batch, &params)
                .unwrap();
            outputs.extend(be.to_host(&mixed).unwrap());
            outputs.extend(be.to_host(&out).unwrap());
        }
        outputs
    });
}
