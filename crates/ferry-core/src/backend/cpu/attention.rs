//! The CPU's attention: q/k norms and RoPE over a fused q/k/v projection, keys and values appended to the host
//! KV cache, then causal softmax attention of each row over its sequence (within the layer's window), one head at
//! a time in parallel.

use rayon::prelude::*;

use super::{check_shape, check_vector, dot, CpuBackend, CpuBatch, CpuTensor};
use crate::backend::{AttentionParams, Backend, QkNormWeights, Rope};
use crate::kv::{HostKv, LayerView};
use crate::loader::TensorRef;
use crate::Result;

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
                (angle.cos() * rope.attention_factor, angle.sin() * rope.attention_factor)
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

/// The operands of one [`Backend::attention`] call.
pub(super) struct AttentionInputs<'a> {
    pub qkv: &'a CpuTensor,
    pub qk_norm: Option<QkNormWeights<'a, TensorRef>>,
    pub sinks: Option<&'a TensorRef>,
    pub rope: &'a Rope,
    pub params: &'a AttentionParams,
}

impl AttentionInputs<'_> {
    /// [`Backend::attention`] on the CPU.
    pub(super) fn run(self, be: &CpuBackend, kv: &mut HostKv, layer: usize, batch: &CpuBatch) -> Result<CpuTensor> {
        let AttentionInputs {
            qkv,
            qk_norm,
            sinks,
            rope: rope_table,
            params: p,
        } = self;
        let (q_width, kv_width) = (p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim);
        p.check_qkv_width(qkv.cols)?;
        batch.expect_rows(qkv, "attention")?;
        let cache = kv.layer_spec(layer)?;
        check_shape(
            p.num_kv_heads > 0
                && p.num_heads.is_multiple_of(p.num_kv_heads)
                && !cache.latent
                && cache.width() == kv_width,
            || {
                format!(
                    "attention: {} heads over {} kv heads of {}, KV layer {layer} holds {} kv heads of {}",
                    p.num_heads, p.num_kv_heads, p.head_dim, cache.num_kv_heads, cache.head_dim
                )
            },
        )?;
        check_shape(
            rope_table.head_dim == p.head_dim && rope_table.rotary_dim <= p.head_dim,
            || {
                format!(
                    "attention: RoPE over {} of {} features, heads of {}",
                    rope_table.rotary_dim, rope_table.head_dim, p.head_dim
                )
            },
        )?;
        let sinks = match sinks {
            Some(s) => {
                check_vector(s, p.num_heads, "attention sinks")?;
                Some(s.to_f32_vec())
            }
            None => None,
        };
        let mut q = qkv.columns(0..q_width);
        let mut k = qkv.columns(q_width..q_width + kv_width);
        let v = qkv.columns(q_width + kv_width..qkv.cols);
        if let Some(n) = qk_norm {
            let group = |width| if n.per_head { p.head_dim } else { width };
            q = be.rms_norm(&q, n.q, group(q_width), n.eps)?;
            k = be.rms_norm(&k, n.k, group(kv_width), n.eps)?;
        }
        rope(&mut q, &batch.positions, rope_table);
        rope(&mut k, &batch.positions, rope_table);
        let group = p.num_heads / p.num_kv_heads;
        attend_heads(
            kv,
            layer,
            batch,
            (&k.data, &v.data),
            p.num_heads,
            p.head_dim,
            |cached, row, h, pos, o| {
                let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let kh = h / group;
                let qh = &q.row(row)[h * p.head_dim..(h + 1) * p.head_dim];
                let mut weights: Vec<f32> = (first..=pos)
                    .map(|j| {
                        let kj = &cached.key(j)[kh * p.head_dim..][..p.head_dim];
                        dot(qh, kj) * p.scale
                    })
                    .collect();
                softmax_with_sink(&mut weights, sinks.as_ref().map(|s| s[h]));
                for (j, w) in (first..=pos).zip(&weights) {
                    let vj = &cached.value(j)[kh * p.head_dim..][..p.head_dim];
                    o.iter_mut().zip(vj).for_each(|(o, v)| *o += w * v);
                }
            },
        )
    }
}

/// Appends each slice's new `keys` and `values` rows to KV layer `layer` (MLA's latent rows come without values),
/// then fills the `heads` heads of `head_width` of every output row in parallel: `head(cached, row, h, pos, out)`
/// computes head `h` of batch row `row`, at position `pos`, from the sequence's cached positions.
pub(super) fn attend_heads(
    kv: &mut HostKv,
    layer: usize,
    batch: &CpuBatch,
    (keys, values): (&[f32], &[f32]),
    heads: usize,
    head_width: usize,
    head: impl Fn(&LayerView, usize, usize, usize, &mut [f32]) + Sync,
) -> Result<CpuTensor> {
    let rows = batch.positions.len();
    let (key_width, value_width) = (keys.len() / rows.max(1), values.len() / rows.max(1));
    let mut out = CpuTensor::zeros(rows, heads * head_width);
    let mut row0 = 0;
    for s in &batch.slices {
        let slice_rows = row0..row0 + s.len;
        kv.append(
            s.seq,
            layer,
            s.start_pos,
            &keys[slice_rows.start * key_width..slice_rows.end * key_width],
            &values[slice_rows.start * value_width..slice_rows.end * value_width],
        )?;
        let cached = kv.layer(s.seq, layer)?;
        let out_rows = &mut out.data[slice_rows.start * out.cols..slice_rows.end * out.cols];
        out_rows.par_chunks_mut(head_width).enumerate().for_each(|(i, o)| {
            let (t, h) = (i / heads, i % heads);
            head(&cached, row0 + t, h, s.start_pos + t, o)
        });
        row0 = slice_rows.end;
    }
    Ok(out)
}

/// `scores` made softmax weights in place; a `sink` logit takes its share of the weight and has no value.
pub(super) fn softmax_with_sink(scores: &mut [f32], sink: Option<f32>) {
    let max = scores.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
    scores.iter_mut().for_each(|s| *s = (*s - max).exp());
    let total = scores.iter().sum::<f32>() + sink.map_or(0.0, |s| (s - max).exp());
    scores.iter_mut().for_each(|s| *s /= total);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqSlice;
    use crate::kv::{KvCache, KvLayerSpec, KvSpec};

    /// Plain causal attention of every row of `qkv` (one sequence from position 0, RoPE left out) over the rows up
    /// to it, within `p.sliding_window`.
    fn reference(qkv: &[f32], rows: usize, p: &AttentionParams) -> Vec<f32> {
        let d = p.head_dim;
        let cols = (p.num_heads + 2 * p.num_kv_heads) * d;
        let (k_at, v_at) = (p.num_heads * d, (p.num_heads + p.num_kv_heads) * d);
        let mut out = vec![0.0; rows * p.num_heads * d];
        for t in 0..rows {
            let first = p.sliding_window.map_or(0, |w| (t + 1).saturating_sub(w));
            for h in 0..p.num_heads {
                let kh = h / (p.num_heads / p.num_kv_heads);
                let q = &qkv[t * cols + h * d..][..d];
                let scores: Vec<f32> = (first..=t)
                    .map(|j| dot(q, &qkv[j * cols + k_at + kh * d..][..d]) * p.scale)
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in (first..=t).zip(&scores) {
                    let v = &qkv[j * cols + v_at + kh * d..][..d];
                    for (i, v) in v.iter().enumerate() {
                        out[(t * p.num_heads + h) * d + i] += (s - max).exp() / total * v;
                    }
                }
            }
        }
        out
    }

    /// Two attention layers of different KV widths in one cache (one kv head of 4 with a window of 2; two kv heads
    /// of 8, full causal), each run over a prefill of 4 tokens and a decode step, against plain attention.
    #[test]
    fn layers_of_different_kv_widths_and_windows() {
        let be = CpuBackend;
        let layers = [
            AttentionParams {
                num_heads: 2,
                num_kv_heads: 1,
                head_dim: 4,
                scale: 0.5,
                sliding_window: Some(2),
            },
            AttentionParams {
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 8,
                scale: 0.35,
                sliding_window: None,
            },
        ];
        let mut kv = be
            .new_kv(KvSpec {
                layers: layers
                    .iter()
                    .map(|p| KvLayerSpec::heads(p.num_kv_heads, p.head_dim))
                    .collect(),
                capacity_tokens: 16,
                recurrent: None,
            })
            .unwrap();
        let seq = kv.alloc_seq();
        let rows = 5;
        let inputs: Vec<Vec<f32>> = layers
            .iter()
            .map(|p| {
                let cols = (p.num_heads + 2 * p.num_kv_heads) * p.head_dim;
                (0..rows * cols).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect()
            })
            .collect();
        let mut got = vec![Vec::new(); layers.len()];
        for (start, len) in [(0, 4), (4, 1)] {
            let batch = be
                .prepare_batch(
                    &mut kv,
                    &[SeqSlice {
                        seq,
                        start_pos: start,
                        len,
                    }],
                )
                .unwrap();
            for (layer, (p, input)) in layers.iter().zip(&inputs).enumerate() {
                let cols = input.len() / rows;
                let qkv = be
                    .upload(&input[start * cols..(start + len) * cols], len, cols)
                    .unwrap();
                let rope = Rope::new(1e4, p.head_dim, 0);
                let out = be
                    .attention(&qkv, None, None, &rope, &mut kv, layer, &batch, p)
                    .unwrap();
                got[layer].extend(out.data);
            }
        }
        for (layer, (p, input)) in layers.iter().zip(&inputs).enumerate() {
            let want = reference(input, rows, p);
            let err = got[layer]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-5, "layer {layer}: off by {err}");
        }
        let batch = be
            .prepare_batch(
                &mut kv,
                &[SeqSlice {
                    seq,
                    start_pos: 5,
                    len: 1,
                }],
            )
            .unwrap();
        let narrow = be.upload(&inputs[0][..16], 1, 16).unwrap();
        assert!(
            matches!(
                be.attention(
                    &narrow,
                    None,
                    None,
                    &Rope::new(1e4, 4, 0),
                    &mut kv,
                    1,
                    &batch,
                    &layers[0]
                ),
                Err(crate::Error::Shape(_))
            ),
            "layer 1 keeps two kv heads of 8, not one of 4"
        );
    }
}
