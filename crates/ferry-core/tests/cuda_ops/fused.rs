//! The fused decode ops against the unfused ones they replace (to the bit) and against the CPU: the residual norm
//! with the output projection, the router's GEMV with its top-k, the routed experts with the residual norm.

use super::experts::random_bank;
use super::*;

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
/// block normalising), with bf16 and with block-FP8 weights: against the CPU's linear then add_rms_norm within
/// f32's limit, and against the GPU's own unfused GEMV and add_rms_norm to the bit (the summation order is theirs),
/// for every GEMV row count (9 rows take the unfused path), q30's o_proj shape, a bias with a partial last block of
/// rows and k split between warps, and k not a multiple of 8 (nor, for FP8, of 16: the scalar path). Each shape's
/// launches follow one another, so a block counter left unreset shows.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn fused_linear_residual_norm() {
    let p = pair();
    let mut rng = Rng::new(12);
    for (k, n, biased) in [(4096, 2048, false), (776, 200, true), (515, 33, true)] {
        let bf16 = rng.bf16("w", &[n, k], 0.05);
        let fp8 = quantize_fp8(&bf16, Fp8Scheme::BLOCK_128).unwrap();
        let bias = TensorRef::from_f32("bias", vec![n], &rng.values(n, 0.5)).unwrap();
        for (rows, (w, format)) in (1..=GEMV_MAX_ROWS + 1).flat_map(|r| [(r, (&bf16, "bf16")), (r, (&fp8, "FP8"))]) {
            let x = rng.values(rows * k, 1.0);
            let case = ResidualCase::new(&mut rng, rows, n);
            let bias = biased.then_some(&bias);
            let what = format!("linear_add_rms_norm {format} {n}x{k} bias={biased} rows={rows}");
            let gpu = linear_into(&p.gpu, &case, &x, w, bias, true);
            check(
                &what,
                gpu.clone(),
                linear_into(&p.cpu, &case, &x, w, bias, true),
                F32_LIMIT,
            );
            let unfused = linear_into(&p.gpu, &case, &x, w, bias, false);
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
