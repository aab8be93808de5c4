//! The CPU's MoE ops: routers of every [`RouterKind`] and the routed experts of every [`ExpertActivation`], each
//! expert's rows gathered so its weights are read once per batch.

use rayon::prelude::*;

use super::{check_shape, check_vector, matmul, sigmoid, silu, CpuTensor};
use crate::backend::{ExpertActivation, ExpertTensors, Router, RouterKind};
use crate::loader::TensorRef;
use crate::{Error, Result};

/// Per-row routing decision of a MoE router: `top_k` expert ids and their combine weights, in router order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// The experts `ranked` by `score`, highest first; equal scores by lower expert id, so that the choice never
/// depends on the batch.
fn rank(ranked: &mut [usize], score: impl Fn(usize) -> f32) {
    ranked.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
}

/// [`crate::backend::Backend::route`] on the CPU.
pub(super) fn route(logits: &CpuTensor, router: Router<'_, TensorRef>) -> Result<Routing> {
    let Router {
        kind,
        top_k,
        correction_bias,
    } = router;
    let experts = logits.cols;
    kind.check(experts, top_k)
        .map_err(|e| Error::Shape(format!("route: {e}")))?;
    let bias = match (kind.has_correction_bias(), correction_bias) {
        (true, Some(bias)) => {
            check_vector(bias, experts, "route")?;
            bias.to_f32_vec()
        }
        (false, None) => Vec::new(),
        (needed, _) => {
            return Err(Error::Shape(format!(
                "route: {kind:?} {} a correction bias",
                if needed { "needs" } else { "takes no" }
            )))
        }
    };
    let mut routing = Routing {
        top_k,
        ids: Vec::with_capacity(logits.rows * top_k),
        weights: Vec::with_capacity(logits.rows * top_k),
    };
    for r in 0..logits.rows {
        let (chosen, weights) = match kind {
            RouterKind::SoftmaxTopK { renormalize } => softmax_top_k(logits.row(r), top_k, renormalize),
            RouterKind::SigmoidGroupedTopK {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => sigmoid_grouped_top_k(logits.row(r), &bias, top_k, n_group, topk_group, renormalize, scaling),
        };
        routing.ids.extend(chosen.iter().map(|&e| e as u32));
        routing.weights.extend(weights);
    }
    Ok(routing)
}

/// Softmax over all experts, the `top_k` most probable, their probabilities rescaled to sum to one when
/// `renormalize`.
fn softmax_top_k(logits: &[f32], top_k: usize, renormalize: bool) -> (Vec<usize>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    rank(&mut order, |e| exps[e]);
    order.truncate(top_k);
    let kept: f32 = order.iter().map(|&e| exps[e] / total).sum();
    let weights = order
        .iter()
        .map(|&e| {
            let p = exps[e] / total;
            if renormalize {
                p / kept
            } else {
                p
            }
        })
        .collect();
    (order, weights)
}

/// [`RouterKind::SigmoidGroupedTopK`] for one row, as transformers' `DeepseekV3TopkRouter` computes it: experts
/// outside the best groups are out of the choice (their biased score -inf), and the renormalising sum gets 1e-20
/// added.
fn sigmoid_grouped_top_k(
    logits: &[f32],
    bias: &[f32],
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    renormalize: bool,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let mut biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let group_size = logits.len() / n_group;
    let group_score = |g: usize| {
        let mut members: Vec<usize> = (g * group_size..(g + 1) * group_size).collect();
        rank(&mut members, |e| biased[e]);
        biased[members[0]] + biased[members[1]]
    };
    let group_scores: Vec<f32> = (0..n_group).map(group_score).collect();
    let mut groups: Vec<usize> = (0..n_group).collect();
    rank(&mut groups, |g| group_scores[g]);
    for &g in &groups[topk_group..] {
        biased[g * group_size..(g + 1) * group_size].fill(f32::NEG_INFINITY);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    rank(&mut order, |e| biased[e]);
    order.truncate(top_k);
    let total: f32 = match renormalize {
        true => order.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20,
        false => 1.0,
    };
    let weights = order.iter().map(|&e| scores[e] / total * scaling).collect();
    (order, weights)
}

/// One MoE layer's routed experts, read in place, and what each computes between its projections; in an
/// expert-parallel group, only this rank's (None for another rank's: their pairs add nothing here).
pub struct CpuExperts {
    experts: Vec<Option<ExpertTensors>>,
    activation: ExpertActivation,
    hidden: usize,
}

impl CpuExperts {
    /// Checks that the experts share one shape, `gate` and `up` `[inter, hidden]`, `down` `[hidden, inter]`, with
    /// biases to match.
    pub(super) fn new(experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<Self> {
        Self::shard(experts.into_iter().map(Some).collect(), activation)
    }

    /// [`CpuExperts::new`] for a rank's part of the layer: `experts[e]` None for another rank's expert.
    pub(super) fn shard(experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<Self> {
        let first = experts
            .iter()
            .flatten()
            .next()
            .ok_or_else(|| Error::Config("a MoE layer (or a rank's part of one) without experts".into()))?;
        let (inter, hidden) = match first.gate.shape.as_slice() {
            &[inter, hidden] => (inter, hidden),
            shape => {
                return Err(Error::tensor(
                    &first.gate.name,
                    format!("expected a matrix, found {shape:?}"),
                ))
            }
        };
        for e in experts.iter().flatten() {
            for (t, shape) in [
                (&e.gate, [inter, hidden]),
                (&e.up, [inter, hidden]),
                (&e.down, [hidden, inter]),
            ] {
                t.clone().expect_shape(&shape)?;
            }
            for (b, len) in [(&e.gate_bias, inter), (&e.up_bias, inter), (&e.down_bias, hidden)] {
                if let Some(b) = b {
                    b.clone().expect_shape(&[len])?;
                }
            }
        }
        Ok(CpuExperts {
            experts,
            activation,
            hidden,
        })
    }

    /// [`crate::backend::Backend::moe_experts`] on the CPU.
    pub(super) fn forward(&self, x: &CpuTensor, routing: &Routing) -> Result<CpuTensor> {
        let hidden = self.hidden;
        check_shape(x.cols == hidden && routing.ids.len() == x.rows * routing.top_k, || {
            format!(
                "moe_experts: [{}, {}] rows, {} routed slots of top-{}, experts of {hidden}",
                x.rows,
                x.cols,
                routing.ids.len(),
                routing.top_k
            )
        })?;
        check_shape(routing.weights.len() == routing.ids.len(), || {
            format!(
                "moe_experts: {} weights for {} routed slots",
                routing.weights.len(),
                routing.ids.len()
            )
        })?;
        // Group the batch's rows by expert, so each expert's weights are read once for all rows routed to it.
        let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (slot, &e) in routing.ids.iter().enumerate() {
            rows_of
                .get_mut(e as usize)
                .ok_or_else(|| Error::Shape(format!("moe_experts: expert {e} of {}", self.experts.len())))?
                .push(slot);
        }
        let per_expert: Vec<(usize, Vec<f32>)> = rows_of
            .par_iter()
            .enumerate()
            .filter_map(|(e, slots)| Some((e, slots, self.experts[e].as_ref()?)))
            .filter(|(_, slots, _)| !slots.is_empty())
            .map(|(e, slots, tensors)| {
                let gathered: Vec<f32> = slots
                    .iter()
                    .flat_map(|&slot| x.row(slot / routing.top_k).iter().copied())
                    .collect();
                Ok((e, self.expert_forward(&gathered, slots.len(), tensors)?))
            })
            .collect::<Result<_>>()?;
        // Scatter each (row, k) result, then sum every row's experts in router order: the sum does not depend on
        // which other rows share the batch. Another rank's pairs have no result and add nothing.
        let mut by_slot: Vec<&[f32]> = vec![&[]; routing.ids.len()];
        for (e, y) in &per_expert {
            for (slot, out) in rows_of[*e].iter().zip(y.chunks(x.cols)) {
                by_slot[*slot] = out;
            }
        }
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        for (r, row) in out.data.chunks_mut(x.cols).enumerate() {
            for k in 0..routing.top_k {
                let slot = r * routing.top_k + k;
                let w = routing.weights[slot];
                row.iter_mut().zip(by_slot[slot]).for_each(|(o, y)| *o += w * y);
            }
        }
        Ok(out)
    }

    /// One expert over the rows of `x` (`[rows, hidden]`).
    fn expert_forward(&self, x: &[f32], rows: usize, e: &ExpertTensors) -> Result<Vec<f32>> {
        let gate = with_bias(matmul(x, rows, &e.gate)?, e.gate_bias.as_ref());
        let up = with_bias(matmul(x, rows, &e.up)?, e.up_bias.as_ref());
        let act: Vec<f32> = match self.activation {
            ExpertActivation::SiluGlu => gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect(),
            ExpertActivation::ClampedSwiGlu { alpha, limit } => gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| {
                    let g = g.min(limit);
                    (u.clamp(-limit, limit) + 1.0) * g * sigmoid(alpha * g)
                })
                .collect(),
        };
        Ok(with_bias(matmul(&act, rows, &e.down)?, e.down_bias.as_ref()))
    }
}

/// `y` (rows of `bias.len()` features) plus `bias` in every row, when there is one.
fn with_bias(mut y: Vec<f32>, bias: Option<&TensorRef>) -> Vec<f32> {
    if let Some(bias) = bias {
        let b = bias.to_f32_vec();
        for row in y.chunks_mut(b.len()) {
            row.iter_mut().zip(&b).for_each(|(v, b)| *v += b);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, cols: usize, data: Vec<f32>) -> CpuTensor {
        CpuTensor { data, rows, cols }
    }

    /// DeepSeek-V3's router written out plainly, apart from the backend's: the best `topk_group` groups by the sum
    /// of their two best biased scores, the other groups' experts left out, the top k of what remains.
    fn reference_grouped(logits: &[f32], bias: &[f32], top_k: usize, groups: usize, keep: usize) -> Vec<(u32, f32)> {
        let scores: Vec<f32> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
        let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let size = logits.len() / groups;
        let mut group_scores: Vec<(f32, usize)> = biased
            .chunks(size)
            .enumerate()
            .map(|(g, chunk)| {
                let mut sorted = chunk.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                (sorted[0] + sorted[1], g)
            })
            .collect();
        group_scores.sort_by(|a, b| b.0.total_cmp(&a.0));
        let kept: Vec<usize> = group_scores[..keep].iter().map(|&(_, g)| g).collect();
        let mut candidates: Vec<(f32, usize)> = biased
            .iter()
            .enumerate()
            .filter(|&(e, _)| kept.contains(&(e / size)))
            .map(|(e, &s)| (s, e))
            .collect();
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        let chosen = &candidates[..top_k];
        let sum: f32 = chosen.iter().map(|&(_, e)| scores[e]).sum();
        chosen.iter().map(|&(_, e)| (e as u32, scores[e] / sum * 2.5)).collect()
    }

    #[test]
    fn grouped_sigmoid_router_keeps_the_best_groups_and_weighs_by_unbiased_scores() {
        let kind = RouterKind::SigmoidGroupedTopK {
            n_group: 4,
            topk_group: 2,
            renormalize: true,
            scaling: 2.5,
        };
        // By hand: 8 experts in 4 groups of 2. The bias lifts expert 7 (group 3) to the top although its logit is
        // the lowest, and sinks expert 0, whose group is then left out although its logit is the highest.
        let logits = [2.0f32, 0.0, 1.0, 1.0, -1.0, -1.0, 0.0, -3.0];
        let bias = [-1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9];
        let bias_ref = TensorRef::from_f32("bias", vec![8], &bias).unwrap();
        let router = |top_k, correction_bias| Router {
            kind,
            top_k,
            correction_bias,
        };
        let routing = route(&tensor(1, 8, logits.to_vec()), router(2, Some(&bias_ref))).unwrap();
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Group scores: g0 = s(2) - 1 + s(0) = 0.38, g1 = 2 s(1) = 1.46, g2 = 2 s(-1) = 0.54, g3 = s(0) + s(-3) +
        // 0.9 = 1.45. Kept: g1 and g3; by biased score: expert 7 (0.947), then 2 and 3 (0.731, the lower id first).
        assert_eq!(routing.ids, [7, 2]);
        let (s7, s2) = (sigmoid(-3.0), sigmoid(1.0));
        let want = [s7 / (s7 + s2) * 2.5, s2 / (s7 + s2) * 2.5];
        for (got, want) in routing.weights.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{:?} against {want:?}", routing.weights);
        }

        // Against the plain implementation on random rows: 64 experts in 8 groups, top 6 of the best 3 groups.
        let kind = RouterKind::SigmoidGroupedTopK {
            n_group: 8,
            topk_group: 3,
            renormalize: true,
            scaling: 2.5,
        };
        let mut state = 12345u32;
        let mut random = || {
            state = state.wrapping_mul(1664525).wrapping_add(1013904223);
            (state >> 8) as f32 / (1 << 24) as f32 * 8.0 - 4.0
        };
        let (rows, experts) = (5, 64);
        let logits: Vec<f32> = (0..rows * experts).map(|_| random()).collect();
        let bias: Vec<f32> = (0..experts).map(|_| random() / 8.0).collect();
        let bias_ref = TensorRef::from_f32("bias", vec![experts], &bias).unwrap();
        let router = |correction_bias| Router {
            kind,
            top_k: 6,
            correction_bias,
        };
        let routing = route(&tensor(rows, experts, logits.clone()), router(Some(&bias_ref))).unwrap();
        for r in 0..rows {
            let want = reference_grouped(&logits[r * experts..(r + 1) * experts], &bias, 6, 8, 3);
            for (k, (id, weight)) in want.into_iter().enumerate() {
                assert_eq!(routing.ids[r * 6 + k], id, "row {r}");
                assert!((routing.weights[r * 6 + k] - weight).abs() < 1e-6, "row {r}");
            }
        }
        assert!(
            matches!(
                route(&tensor(rows, experts, logits), router(None)),
                Err(Error::Shape(_))
            ),
            "the grouped router needs its correction bias"
        );
    }

    /// The experts of the groups left out are out of the choice (transformers masks them with -inf), even when
    /// every biased score of the kept groups is negative.
    #[test]
    fn grouped_sigmoid_router_never_chooses_from_groups_left_out() {
        let kind = RouterKind::SigmoidGroupedTopK {
            n_group: 2,
            topk_group: 1,
            renormalize: false,
            scaling: 1.0,
        };
        // Scores 0.5 each; biased -0.1, -0.2 (group 0: -0.3) and 0.4, -0.4 (group 1: 0.0): group 1 is kept, and
        // expert 3 (-0.4) is chosen over group 0's experts, whose zeroed scores would have beaten it.
        let bias = TensorRef::from_f32("bias", vec![4], &[-0.6, -0.7, -0.1, -0.9]).unwrap();
        let routing = route(
            &tensor(1, 4, vec![0.0; 4]),
            Router {
                kind,
                top_k: 2,
                correction_bias: Some(&bias),
            },
        )
        .unwrap();
        assert_eq!(routing.ids, [2, 3]);
        assert_eq!(routing.weights, [0.5, 0.5]);
    }

    #[test]
    fn clamped_swiglu_experts_with_biases() {
        // One expert, hidden 2, intermediate 2: gate = identity + bias, up = identity, down = identity + bias.
        let identity = |name: &str| TensorRef::from_f32(name, vec![2, 2], &[1.0, 0.0, 0.0, 1.0]).unwrap();
        let expert = ExpertTensors {
            gate_bias: Some(TensorRef::from_f32("gate_bias", vec![2], &[0.5, 0.0]).unwrap()),
            down_bias: Some(TensorRef::from_f32("down_bias", vec![2], &[0.25, -0.25]).unwrap()),
            ..ExpertTensors::unbiased(identity("gate"), identity("up"), identity("down"))
        };
        let (alpha, limit) = (1.702, 7.0);
        let experts = CpuExperts::new(vec![expert], ExpertActivation::ClampedSwiGlu { alpha, limit }).unwrap();
        let x = tensor(2, 2, vec![1.0, -2.0, 9.0, 8.0]);
        let routing = Routing {
            top_k: 1,
            ids: vec![0, 0],
            weights: vec![1.0, 0.5],
        };
        let out = experts.forward(&x, &routing).unwrap();
        // (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit), then the down bias, times the route weight.
        let glu = |gate: f32, up: f32| {
            let g = gate.min(limit);
            (up.clamp(-limit, limit) + 1.0) * g / (1.0 + (-alpha * g).exp())
        };
        let want = [
            glu(1.5, 1.0) + 0.25,
            glu(-2.0, -2.0) - 0.25,
            0.5 * (glu(7.0, 7.0) + 0.25),
            0.5 * (glu(8.0, 7.0) - 0.25),
        ];
        for (got, want) in out.data.iter().zip(want) {
            assert!((got - want).abs() < 1e-5, "{:?} against {want}", out.data);
        }
        let silu = CpuExperts::shard(experts.experts.clone(), ExpertActivation::SiluGlu).unwrap();
        let plain = silu.forward(&x, &routing).unwrap();
        assert!((plain.data[0] - (1.5 / (1.0 + (-1.5f32).exp()) + 0.25)).abs() < 1e-6);
        assert!(
            matches!(
                experts.forward(&tensor(1, 3, vec![0.0; 3]), &routing),
                Err(Error::Shape(_))
            ),
            "rows of the wrong width"
        );
    }
}
