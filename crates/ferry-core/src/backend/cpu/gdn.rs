//! The CPU's Gated DeltaNet ops: the causal convolution over each sequence's conv state, and the gated delta rule
//! over its per-head state matrices, token by token (decode) or chunked (prefill, the GPU's reference form).

use rayon::prelude::*;

use super::{check_shape, check_vector, dot, sigmoid, silu, CpuBatch, CpuTensor};
use crate::backend::{DeltaRuleParams, DELTA_RULE_CHUNK, DELTA_RULE_CHUNKED_MIN_LEN};
use crate::kv::{HostKv, RecurrentLayer};
use crate::loader::TensorRef;
use crate::{Error, Result};

/// torch's softplus (beta 1, threshold 20): the identity above 20, where `ln(1 + e^x)` equals x in f32 anyway.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum x^2 + 1e-6)`, the l2 norm Gated DeltaNet applies to queries and keys (FLA's epsilon).
fn l2_normalized(x: &[f32]) -> Vec<f32> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// One token of one value head as the delta rule reads it.
struct DeltaToken<'a> {
    /// The l2-normalised query, scaled by `1 / sqrt(dk)`.
    q: Vec<f32>,
    /// The l2-normalised key.
    k: Vec<f32>,
    v: &'a [f32],
    /// The log of the state's decay, `g <= 0`.
    g: f32,
    beta: f32,
}

/// `y += c x`.
fn add_scaled(y: &mut [f32], c: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += c * x);
}

/// One value head's delta rule over `rows` tokens, token by token, updating its state `s` (`[dk, dv]`) in place;
/// returns the head's outputs, `[rows, dv]`. `token(t)` gives row t.
fn delta_rule_head<'a>(s: &mut [f32], rows: usize, dv: usize, token: impl Fn(usize) -> DeltaToken<'a>) -> Vec<f32> {
    let mut out = vec![0.0; rows * dv];
    let mut delta = vec![0.0; dv];
    for (t, o) in out.chunks_mut(dv).enumerate() {
        let DeltaToken { q, k, v, g, beta } = token(t);
        let decay = g.exp();
        s.iter_mut().for_each(|x| *x *= decay);
        // delta = beta (v - S^T k): what the state predicts for this key, corrected towards the value.
        delta.copy_from_slice(v);
        for (row, &ki) in s.chunks(dv).zip(&k) {
            add_scaled(&mut delta, -ki, row);
        }
        delta.iter_mut().for_each(|d| *d *= beta);
        for (row, (&ki, &qi)) in s.chunks_mut(dv).zip(k.iter().zip(&q)) {
            row.iter_mut().zip(&delta).zip(o.iter_mut()).for_each(|((x, &d), o)| {
                *x += ki * d;
                *o += *x * qi;
            });
        }
    }
    out
}

/// The same recurrence as [`delta_rule_head`], [`DELTA_RULE_CHUNK`] tokens at a time in the WY form that gdn.cu's
/// chunked kernel (and HF's `torch_chunk_gated_delta_rule`) use, so that the GPU's chunked path has a reference
/// computed the same way. With S the state at the chunk's start and `G_i` the sum of `g` over the chunk up to
/// token i, unrolling the recurrence gives each token's correction `u_i` (what `k_i u_i^T` adds to the state) by
/// forward substitution, `u_i = beta_i (v_i - e^G_i S^T k_i - sum_{j<i} (k_i . k_j) e^(G_i - G_j) u_j)`, the
/// outputs `o_i = e^G_i S^T q_i + sum_{j<=i} (q_i . k_j) e^(G_i - G_j) u_j`, and the next chunk's state
/// `e^G_last S + sum_j e^(G_last - G_j) k_j u_j^T`. Only differences of G within the chunk are exponentiated
/// (each one <= 0, like G itself), so nothing overflows however strong the decays.
fn delta_rule_head_chunked<'a>(
    s: &mut [f32],
    rows: usize,
    dv: usize,
    token: impl Fn(usize) -> DeltaToken<'a>,
) -> Vec<f32> {
    let mut out = vec![0.0; rows * dv];
    for (chunk, out) in out.chunks_mut(DELTA_RULE_CHUNK * dv).enumerate() {
        let tokens: Vec<DeltaToken> = (0..out.len() / dv)
            .map(|i| token(chunk * DELTA_RULE_CHUNK + i))
            .collect();
        let g_cum: Vec<f32> = tokens
            .iter()
            .scan(0.0, |sum, t| {
                *sum += t.g;
                Some(*sum)
            })
            .collect();
        let mut u = vec![0.0; tokens.len() * dv];
        for (i, t) in tokens.iter().enumerate() {
            let (earlier, rest) = u.split_at_mut(i * dv);
            let ui = &mut rest[..dv];
            ui.copy_from_slice(t.v);
            let decay = g_cum[i].exp();
            for (row, &kd) in s.chunks(dv).zip(&t.k) {
                add_scaled(ui, -kd * decay, row);
            }
            for (j, uj) in earlier.chunks(dv).enumerate() {
                add_scaled(ui, -dot(&t.k, &tokens[j].k) * (g_cum[i] - g_cum[j]).exp(), uj);
            }
            ui.iter_mut().for_each(|x| *x *= t.beta);
        }
        for (i, (t, o)) in tokens.iter().zip(out.chunks_mut(dv)).enumerate() {
            let decay = g_cum[i].exp();
            for (row, &qd) in s.chunks(dv).zip(&t.q) {
                add_scaled(o, qd * decay, row);
            }
            for (j, uj) in u.chunks(dv).take(i + 1).enumerate() {
                add_scaled(o, dot(&t.q, &tokens[j].k) * (g_cum[i] - g_cum[j]).exp(), uj);
            }
        }
        let g_last = g_cum[tokens.len() - 1];
        let decay = g_last.exp();
        s.iter_mut().for_each(|x| *x *= decay);
        for (j, (t, uj)) in tokens.iter().zip(u.chunks(dv)).enumerate() {
            let to_end = (g_last - g_cum[j]).exp();
            for (row, &kd) in s.chunks_mut(dv).zip(&t.k) {
                add_scaled(row, kd * to_end, uj);
            }
        }
    }
    out
}

/// The operands of one [`crate::backend::Backend::causal_conv1d`] call.
pub(super) struct ConvInputs<'a> {
    pub x: &'a CpuTensor,
    pub weight: &'a TensorRef,
}

impl ConvInputs<'_> {
    /// The convolution on the CPU, each sequence's slice after the inputs its conv state holds.
    pub(super) fn run(self, kv: &mut HostKv, layer: usize, batch: &CpuBatch) -> Result<CpuTensor> {
        let ConvInputs { x, weight } = self;
        let &[channels, kernel] = weight.shape.as_slice() else {
            return Err(Error::Shape(format!(
                "causal_conv1d: {} of shape {:?}",
                weight.name, weight.shape
            )));
        };
        check_shape(x.cols == channels && kernel > 0, || {
            format!("causal_conv1d: {} channels, weight [{channels}, {kernel}]", x.cols)
        })?;
        batch.expect_rows(x, "causal_conv1d")?;
        let w = weight.to_f32_vec();
        let history = kernel - 1;
        let mut out = CpuTensor::zeros(x.rows, channels);
        let mut row0 = 0;
        for s in &batch.slices {
            let state = kv.recurrent(s.seq, layer)?;
            RecurrentLayer::check_continues(state.conv_tokens, s.start_pos, "conv")?;
            check_shape(state.conv.len() == history * channels, || {
                format!(
                    "causal_conv1d: a conv state of {} for [{history}, {channels}]",
                    state.conv.len()
                )
            })?;
            // The state's rows, then this slice's: row j of `window` is the input at position start - history + j.
            let mut window = state.conv.clone();
            window.extend_from_slice(&x.data[row0 * channels..(row0 + s.len) * channels]);
            out.data[row0 * channels..(row0 + s.len) * channels]
                .par_chunks_mut(channels)
                .enumerate()
                .for_each(|(t, y)| {
                    for (c, y) in y.iter_mut().enumerate() {
                        let taps = &w[c * kernel..(c + 1) * kernel];
                        let sum: f32 = taps
                            .iter()
                            .enumerate()
                            .map(|(j, &wj)| wj * window[(t + j) * channels + c])
                            .sum();
                        *y = silu(sum);
                    }
                });
            state.conv = window[window.len() - history * channels..].to_vec();
            state.conv_tokens += s.len;
            row0 += s.len;
        }
        Ok(out)
    }
}

/// The operands of one [`crate::backend::Backend::gated_delta_rule`] call.
pub(super) struct DeltaRuleInputs<'a> {
    pub qkv: &'a CpuTensor,
    pub a: &'a CpuTensor,
    pub b: &'a CpuTensor,
    pub a_log: &'a TensorRef,
    pub dt_bias: &'a TensorRef,
}

impl DeltaRuleInputs<'_> {
    /// The delta rule on the CPU, in parallel over value heads; per slice token by token, or in chunks from
    /// [`DELTA_RULE_CHUNKED_MIN_LEN`] tokens on (prefill), as the GPU does. The two forms cost the CPU about the
    /// same multiply-adds (`4 dk dv` per token and head, on a state that stays in cache); the chunked one is here
    /// to be the GPU's reference.
    pub(super) fn run(self, kv: &mut HostKv, layer: usize, batch: &CpuBatch, p: &DeltaRuleParams) -> Result<CpuTensor> {
        let DeltaRuleInputs {
            qkv,
            a,
            b,
            a_log,
            dt_bias,
        } = self;
        let (dk, dv, hv) = (p.k_head_dim, p.v_head_dim, p.num_v_heads);
        let key_dim = p.num_k_heads * dk;
        check_shape(
            p.num_k_heads > 0 && hv.is_multiple_of(p.num_k_heads) && qkv.cols == 2 * key_dim + hv * dv,
            || format!("gated_delta_rule: {} features for {p:?}", qkv.cols),
        )?;
        for (gate, name) in [(a, "a"), (b, "b")] {
            check_shape(gate.rows == qkv.rows && gate.cols == hv, || {
                format!(
                    "gated_delta_rule: {name} is [{}, {}], expected [{}, {hv}]",
                    gate.rows, gate.cols, qkv.rows
                )
            })?;
        }
        check_vector(a_log, hv, "gated_delta_rule")?;
        check_vector(dt_bias, hv, "gated_delta_rule")?;
        batch.expect_rows(qkv, "gated_delta_rule")?;
        let per_key_head = hv / p.num_k_heads;
        let scale = 1.0 / (dk as f32).sqrt();
        let (a_log, dt_bias) = (a_log.to_f32_vec(), dt_bias.to_f32_vec());
        let mut out = CpuTensor::zeros(qkv.rows, hv * dv);
        let mut row0 = 0;
        for s in &batch.slices {
            let state = kv.recurrent(s.seq, layer)?;
            RecurrentLayer::check_continues(state.delta_tokens, s.start_pos, "delta-rule")?;
            check_shape(state.delta.len() == hv * dk * dv, || {
                format!("gated_delta_rule: a state of {} for {p:?}", state.delta.len())
            })?;
            let heads: Vec<Vec<f32>> = state
                .delta
                .par_chunks_mut(dk * dv)
                .enumerate()
                .map(|(h, state)| {
                    let i = h / per_key_head;
                    let token = |t| {
                        let r = row0 + t;
                        let row = qkv.row(r);
                        let q = l2_normalized(&row[i * dk..(i + 1) * dk]);
                        DeltaToken {
                            q: q.iter().map(|x| x * scale).collect(),
                            k: l2_normalized(&row[key_dim + i * dk..key_dim + (i + 1) * dk]),
                            v: &row[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv],
                            g: -a_log[h].exp() * softplus(a.row(r)[h] + dt_bias[h]),
                            beta: sigmoid(b.row(r)[h]),
                        }
                    };
                    if s.len >= DELTA_RULE_CHUNKED_MIN_LEN {
                        delta_rule_head_chunked(state, s.len, dv, token)
                    } else {
                        delta_rule_head(state, s.len, dv, token)
                    }
                })
                .collect();
            for (h, head) in heads.iter().enumerate() {
                for (t, o) in head.chunks(dv).enumerate() {
                    out.data[(row0 + t) * hv * dv + h * dv..][..dv].copy_from_slice(o);
                }
            }
            state.delta_tokens += s.len;
            row0 += s.len;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;

    fn relative_error(got: &[f32], want: &[f32]) -> f64 {
        let diff: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        (diff / norm).sqrt()
    }

    /// The chunked delta rule equals the token-by-token one to f32 rounding: two calls (150 then 77 tokens: full
    /// chunks, partial ones, the state carried from the first call into the second), keys that share a direction
    /// (as real ones do, so the forward substitution has work to do), decays from none to strong.
    #[test]
    fn chunked_delta_rule_equals_the_recurrence() {
        let (dk, dv) = (64, 48);
        let mut rng = StdRng::seed_from_u64(7);
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let shared_key = random(dk);
        let rows = 227;
        let (q, k, v, gates) = (
            random(rows * dk),
            random(rows * dk),
            random(rows * dv),
            random(2 * rows),
        );
        let token = |t: usize| {
            let key: Vec<f32> = k[t * dk..(t + 1) * dk]
                .iter()
                .zip(&shared_key)
                .map(|(x, s)| x + 2.0 * s)
                .collect();
            DeltaToken {
                q: l2_normalized(&q[t * dk..(t + 1) * dk])
                    .iter()
                    .map(|x| x / (dk as f32).sqrt())
                    .collect(),
                k: l2_normalized(&key),
                v: &v[t * dv..(t + 1) * dv],
                g: -softplus(4.0 * gates[2 * t]),
                beta: sigmoid(3.0 * gates[2 * t + 1]),
            }
        };
        let (mut chunked_state, mut recurrent_state) = (vec![0.0; dk * dv], vec![0.0; dk * dv]);
        let (mut chunked, mut recurrent) = (Vec::new(), Vec::new());
        for (start, len) in [(0, 150), (150, 77)] {
            chunked.extend(delta_rule_head_chunked(&mut chunked_state, len, dv, |t| {
                token(start + t)
            }));
            recurrent.extend(delta_rule_head(&mut recurrent_state, len, dv, |t| token(start + t)));
        }
        let (out_err, state_err) = (
            relative_error(&chunked, &recurrent),
            relative_error(&chunked_state, &recurrent_state),
        );
        assert!(out_err < 1e-5, "outputs differ by {out_err}");
        assert!(state_err < 1e-5, "states differ by {state_err}");
    }
}
