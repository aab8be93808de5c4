//! The CPU backend: f32 activations, weights read in place from the mapped checkpoint in their stored dtype,
//! rayon for threads and [`gemv`]'s SIMD kernels for every product with a weight matrix.
//!
//! It is the numerical reference every other backend is tested against, CI's backend, and (later) the lane that
//! computes expert misses straight from host RAM.

pub mod gemv;

use rayon::prelude::*;

use super::{
    batch_positions, AttentionParams, Backend, DeltaRuleParams, ExpertTensors, QkNormWeights, Rope, RouterKind,
    SeqSlice, DELTA_RULE_CHUNK, DELTA_RULE_CHUNKED_MIN_LEN,
};
use crate::kv::{HostKv, KvSpec, RecurrentLayer};
use crate::loader::{DType, TensorRef};
use crate::{Error, Result};
use gemv::WeightDType;

/// A `[rows, cols]` row-major f32 tensor.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Columns `cols` of every row, as a tensor of their own.
    fn columns(&self, cols: std::ops::Range<usize>) -> CpuTensor {
        let data = self
            .data
            .chunks(self.cols)
            .flat_map(|row| &row[cols.clone()])
            .copied()
            .collect();
        CpuTensor {
            data,
            rows: self.rows,
            cols: cols.len(),
        }
    }
}

/// Rotates `x` (`[rows, heads * head_dim]`) in place, each row at its position.
fn rope(x: &mut CpuTensor, positions: &[u32], rope: &Rope) {
    let cols = x.cols;
    let half = rope.rotary_dim / 2;
    x.data.par_chunks_mut(cols).zip(positions).for_each(|(row, &pos)| {
        let (cos, sin): (Vec<f32>, Vec<f32>) = rope
            .inv_freq
            .iter()
            .map(|&f| {
                let angle = pos as f32 * f;
                (angle.cos(), angle.sin())
            })
            .unzip();
        for head in row.chunks_mut(rope.head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    });
}

#[derive(Default)]
pub struct CpuBackend;

/// A batch as the CPU ops see it: its slices and each row's position.
pub struct CpuBatch {
    slices: Vec<SeqSlice>,
    positions: Vec<u32>,
}

/// Per-row routing decision of a MoE router: `top_k` expert ids and their combine weights, in router order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

fn weight_dtype(dtype: DType) -> WeightDType {
    match dtype {
        DType::F32 => WeightDType::F32,
        DType::F16 => WeightDType::F16,
        DType::BF16 => WeightDType::BF16,
    }
}

/// `x W^T` for a weight `[n, k]` held in place.
fn matmul(x: &[f32], rows: usize, w: &TensorRef) -> Vec<f32> {
    let (n, k) = (w.shape[0], w.shape[1]);
    let mut out = vec![0.0; rows * n];
    gemv::matmul(x, rows, k, w.bytes(), weight_dtype(w.dtype), n, &mut out);
    out
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

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

fn dot(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
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

/// One expert's SwiGLU over the rows of `x` (`[rows, hidden]`).
fn expert_forward(x: &[f32], rows: usize, e: &ExpertTensors) -> Vec<f32> {
    let gate = matmul(x, rows, &e.gate);
    let up = matmul(x, rows, &e.up);
    let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
    matmul(&act, rows, &e.down)
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = TensorRef;
    type Experts = Vec<ExpertTensors>;
    type Kv = HostKv;
    type Batch = CpuBatch;
    type Routing = Routing;
    type RopeTable = Rope;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn weight(&self, tensor: TensorRef) -> Result<TensorRef> {
        if tensor.shape.len() > 2 {
            return Err(Error::tensor(
                &tensor.name,
                format!("expected a matrix or vector, found shape {:?}", tensor.shape),
            ));
        }
        Ok(tensor)
    }

    fn experts(&self, experts: Vec<ExpertTensors>) -> Result<Vec<ExpertTensors>> {
        Ok(experts)
    }

    fn rope_table(&self, rope: &Rope) -> Result<Rope> {
        Ok(rope.clone())
    }

    fn new_kv(&self, spec: KvSpec) -> Result<HostKv> {
        Ok(HostKv::new(spec))
    }

    fn prepare_batch(&self, kv: &mut HostKv, batch: &[SeqSlice]) -> Result<CpuBatch> {
        kv.reserve(&batch.iter().map(|s| (s.seq, s.start_pos, s.len)).collect::<Vec<_>>())?;
        Ok(CpuBatch {
            slices: batch.to_vec(),
            positions: batch_positions(batch),
        })
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        if data.len() != rows * cols {
            return Err(Error::Request(format!(
                "{} values for a [{rows}, {cols}] tensor",
                data.len()
            )));
        }
        Ok(CpuTensor {
            data: data.to_vec(),
            rows,
            cols,
        })
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn shape(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &TensorRef, ids: &[u32]) -> Result<CpuTensor> {
        let hidden = table.shape[1];
        let mut out = CpuTensor::zeros(ids.len(), hidden);
        for (row, &id) in out.data.chunks_mut(hidden).zip(ids) {
            let id = id as usize;
            row.copy_from_slice(&table.rows(id, id + 1)?.to_f32_vec());
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &TensorRef, group: usize, eps: f32) -> Result<CpuTensor> {
        let w = weight.to_f32_vec();
        let mut out = x.clone();
        out.data.par_chunks_mut(group).for_each(|chunk| {
            let mean_sq = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            for (v, &g) in chunk.iter_mut().zip(&w) {
                *v = *v * inv * g;
            }
        });
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &TensorRef, bias: Option<&TensorRef>) -> Result<CpuTensor> {
        let mut data = matmul(&x.data, x.rows, w);
        let n = w.shape[0];
        if let Some(bias) = bias {
            let b = bias.to_f32_vec();
            for row in data.chunks_mut(n) {
                row.iter_mut().zip(&b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(CpuTensor {
            data,
            rows: x.rows,
            cols: n,
        })
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_rms_norm(&self, x: &mut CpuTensor, y: &CpuTensor, weight: &TensorRef, eps: f32) -> Result<CpuTensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, x.cols, eps)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        Ok(CpuTensor {
            data: gate.data.iter().zip(&up.data).map(|(&g, &u)| silu(g) * u).collect(),
            rows: gate.rows,
            cols: gate.cols,
        })
    }

    fn sigmoid_gate(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        let cols = x.cols;
        if gate.cols == cols {
            x.data.iter_mut().zip(&gate.data).for_each(|(v, &g)| *v *= sigmoid(g));
            return Ok(());
        }
        for (row, g) in x.data.chunks_mut(cols).zip(&gate.data) {
            let s = sigmoid(*g);
            row.iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CpuTensor,
        qk_norm: Option<QkNormWeights<'_, TensorRef>>,
        rope_table: &Rope,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
        p: &AttentionParams,
    ) -> Result<CpuTensor> {
        let (q_width, kv_width) = (p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim);
        p.check_qkv_width(qkv.cols)?;
        let mut q = qkv.columns(0..q_width);
        let mut k = qkv.columns(q_width..q_width + kv_width);
        let v = qkv.columns(q_width + kv_width..qkv.cols);
        if let Some(n) = qk_norm {
            let group = |width| if n.per_head { p.head_dim } else { width };
            q = self.rms_norm(&q, n.q, group(q_width), n.eps)?;
            k = self.rms_norm(&k, n.k, group(kv_width), n.eps)?;
        }
        rope(&mut q, &batch.positions, rope_table);
        rope(&mut k, &batch.positions, rope_table);
        let group = p.num_heads / p.num_kv_heads;
        let mut out = CpuTensor::zeros(q.rows, q.cols);
        let mut row0 = 0;
        for s in &batch.slices {
            let rows = row0..row0 + s.len;
            kv.append(
                s.seq,
                layer,
                s.start_pos,
                &k.data[rows.start * kv_width..rows.end * kv_width],
                &v.data[rows.start * kv_width..rows.end * kv_width],
            )?;
            let (keys, values) = kv.layer(s.seq, layer)?;
            let out_rows = &mut out.data[rows.start * q.cols..rows.end * q.cols];
            out_rows.par_chunks_mut(p.head_dim).enumerate().for_each(|(i, o)| {
                let (t, h) = (i / p.num_heads, i % p.num_heads);
                let pos = s.start_pos + t;
                let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let kh = h / group;
                let qh = &q.row(row0 + t)[h * p.head_dim..(h + 1) * p.head_dim];
                let scores: Vec<f32> = (first..=pos)
                    .map(|j| {
                        let kj = &keys[j * kv_width + kh * p.head_dim..][..p.head_dim];
                        dot(qh, kj) * p.scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = exps.iter().sum();
                for (j, e) in (first..=pos).zip(&exps) {
                    let vj = &values[j * kv_width + kh * p.head_dim..][..p.head_dim];
                    let w = e / total;
                    o.iter_mut().zip(vj).for_each(|(o, v)| *o += w * v);
                }
            });
            row0 = rows.end;
        }
        Ok(out)
    }

    fn causal_conv1d(
        &self,
        x: &CpuTensor,
        weight: &TensorRef,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
    ) -> Result<CpuTensor> {
        let (channels, kernel) = (weight.shape[0], weight.shape[1]);
        let w = weight.to_f32_vec();
        let history = kernel - 1;
        let mut out = CpuTensor::zeros(x.rows, channels);
        let mut row0 = 0;
        for s in &batch.slices {
            let state = kv.recurrent(s.seq, layer)?;
            RecurrentLayer::check_continues(state.conv_tokens, s.start_pos, "conv")?;
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

    /// In parallel over value heads; per slice token by token, or in chunks from [`DELTA_RULE_CHUNKED_MIN_LEN`]
    /// tokens on (prefill), as the GPU does. The two forms cost the CPU about the same multiply-adds (`4 dk dv` per
    /// token and head, on a state that stays in cache); the chunked one is here to be the GPU's reference.
    fn gated_delta_rule(
        &self,
        qkv: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &TensorRef,
        dt_bias: &TensorRef,
        kv: &mut HostKv,
        layer: usize,
        batch: &CpuBatch,
        p: &DeltaRuleParams,
    ) -> Result<CpuTensor> {
        let (dk, dv, hv) = (p.k_head_dim, p.v_head_dim, p.num_v_heads);
        let key_dim = p.num_k_heads * dk;
        let per_key_head = hv / p.num_k_heads;
        let scale = 1.0 / (dk as f32).sqrt();
        let (a_log, dt_bias) = (a_log.to_f32_vec(), dt_bias.to_f32_vec());
        let mut out = CpuTensor::zeros(qkv.rows, hv * dv);
        let mut row0 = 0;
        for s in &batch.slices {
            let state = kv.recurrent(s.seq, layer)?;
            RecurrentLayer::check_continues(state.delta_tokens, s.start_pos, "delta-rule")?;
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

    fn route(&self, logits: &CpuTensor, top_k: usize, kind: RouterKind) -> Result<Routing> {
        let RouterKind::SoftmaxTopK { renormalize } = kind;
        let mut routing = Routing {
            top_k,
            ids: Vec::with_capacity(logits.rows * top_k),
            weights: Vec::with_capacity(logits.rows * top_k),
        };
        for r in 0..logits.rows {
            let row = logits.row(r);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = row.iter().map(|l| (l - max).exp()).collect();
            let total: f32 = exps.iter().sum();
            let mut order: Vec<usize> = (0..row.len()).collect();
            // Highest probability first; equal ones by lower expert id, so the choice never depends on the batch.
            order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
            let chosen = &order[..top_k];
            let kept: f32 = chosen.iter().map(|&e| exps[e] / total).sum();
            for &e in chosen {
                let p = exps[e] / total;
                routing.ids.push(e as u32);
                routing.weights.push(if renormalize { p / kept } else { p });
            }
        }
        Ok(routing)
    }

    fn routing_to_host(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(routing.ids.clone())
    }

    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<Routing> {
        Ok(Routing {
            top_k,
            ids: ids.to_vec(),
            weights: weights.to_vec(),
        })
    }

    fn moe_experts(&self, x: &CpuTensor, routing: &Routing, experts: &Vec<ExpertTensors>) -> Result<CpuTensor> {
        // Group the batch's rows by expert, so each expert's weights are read once for all rows routed to it.
        let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        for (slot, &e) in routing.ids.iter().enumerate() {
            rows_of[e as usize].push(slot);
        }
        let per_expert: Vec<(usize, Vec<f32>)> = rows_of
            .par_iter()
            .enumerate()
            .filter(|(_, slots)| !slots.is_empty())
            .map(|(e, slots)| {
                let gathered: Vec<f32> = slots
                    .iter()
                    .flat_map(|&slot| x.row(slot / routing.top_k).iter().copied())
                    .collect();
                (e, expert_forward(&gathered, slots.len(), &experts[e]))
            })
            .collect();
        // Scatter each (row, k) result, then sum every row's experts in router order: the sum does not depend on
        // which other rows share the batch.
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

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let data = rows.iter().flat_map(|&r| x.row(r).iter().copied()).collect();
        Ok(CpuTensor {
            data,
            rows: rows.len(),
            cols: x.cols,
        })
    }
}

/// Host memory read bandwidth in GB/s with rayon's threads: the best of a few parallel sums over `bytes`.
pub fn measure_read_bandwidth(bytes: usize) -> f64 {
    let words: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    (0..5)
        .map(|_| {
            let started = std::time::Instant::now();
            let sum: u64 = words
                .par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
                .sum();
            std::hint::black_box(sum);
            bytes as f64 / started.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
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
