//! Routers and routed experts against the CPU: softmax and grouped sigmoid routing, bf16, FP8, MXFP4 and gpt-oss
//! experts through the decode kernels and the grouped path (uneven row counts included), and the expert kinds
//! without kernels refused at load.

use super::*;

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

pub(super) fn random_bank(rng: &mut Rng, experts: usize, hidden: usize, inter: usize) -> Vec<ExpertTensors> {
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
