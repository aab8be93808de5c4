//! The CPU's multi-head latent attention (DeepSeek-V3's MLA) over the latent KV cache.
//!
//! Every row, prefill and decode alike, is computed in latent space: `W_k[h]` is absorbed into the query
//! (`q_c = W_k[h]^T q_nope`, once per row and head) and `W_v[h]` into the output (`W_v[h] (sum_j p_j c_j)`), so each
//! cached position is read as its `kv_lora_rank + rope` features and never expanded into per-head keys and values.
//! One form for every row keeps the reference short and is the form the GPU kernel computes; in exact arithmetic
//! it equals transformers' expanded keys and values, which the unit test below holds it to.

use super::attention::{attend_heads, softmax_with_sink};
use super::{check_shape, dot, CpuBackend, CpuBatch, CpuTensor};
use crate::backend::{Backend, MlaParams, Rope};
use crate::kv::HostKv;
use crate::loader::TensorRef;
use crate::Result;

/// Rotates one head's rope features `x` at `pos`: pairs (2i, 2i + 1) when `interleaved`, else (i, i + half), each
/// by the angle `pos * inv_freq[i]`, with cos and sin times the RoPE's attention factor.
fn rotate(x: &mut [f32], pos: u32, rope: &Rope, interleaved: bool) {
    let scale = rope.attention_factor;
    let half = x.len() / 2;
    for (i, &f) in rope.inv_freq.iter().enumerate().take(half) {
        let angle = pos as f32 * f;
        let (cos, sin) = (angle.cos() * scale, angle.sin() * scale);
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (xa, xb) = (x[a], x[b]);
        x[a] = xa * cos - xb * sin;
        x[b] = xb * cos + xa * sin;
    }
}

/// The operands of one [`Backend::mla_attention`] call.
pub(super) struct MlaInputs<'a> {
    pub q: &'a CpuTensor,
    pub compressed: &'a CpuTensor,
    pub kv_norm: &'a TensorRef,
    pub kv_b: &'a TensorRef,
    pub rope: &'a Rope,
    pub params: &'a MlaParams,
}

impl MlaInputs<'_> {
    /// [`Backend::mla_attention`] on the CPU.
    pub(super) fn run(self, be: &CpuBackend, kv: &mut HostKv, layer: usize, batch: &CpuBatch) -> Result<CpuTensor> {
        let MlaInputs {
            q,
            compressed,
            kv_norm,
            kv_b,
            rope,
            params: p,
        } = self;
        let (rank, nope, rope_dim, v_dim) = (p.kv_lora_rank, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim);
        let latent_width = p.latent_width();
        batch.expect_rows(q, "mla_attention")?;
        batch.expect_rows(compressed, "mla_attention")?;
        let cache = kv.layer_spec(layer)?;
        check_shape(
            q.cols == p.q_width()
                && compressed.cols == latent_width
                && cache.latent
                && cache.width() == latent_width
                && kv_b.shape == [p.kv_b_rows(), rank]
                && rope_dim.is_multiple_of(2)
                && rope.inv_freq.len() == rope_dim / 2,
            || {
                format!(
                    "mla_attention: q [{}, {}], compressed kv [{}, {}], kv_b {:?}, {} RoPE frequencies for {p:?}; \
                     KV layer {layer} is {cache:?}",
                    q.rows,
                    q.cols,
                    compressed.rows,
                    compressed.cols,
                    kv_b.shape,
                    rope.inv_freq.len()
                )
            },
        )?;
        // Each row's latent: c normalised, then the shared key rotated at the row's position.
        let c = be.rms_norm(&compressed.columns(0..rank), kv_norm, rank, p.eps)?;
        let mut latent = compressed.clone();
        for (r, row) in latent.data.chunks_mut(latent_width).enumerate() {
            row[..rank].copy_from_slice(c.row(r));
            rotate(&mut row[rank..], batch.positions[r], rope, p.rope_interleaved);
        }
        let kv_b = kv_b.to_f32_vec();
        let head_rows = (nope + v_dim) * rank;
        let new_rows = (&latent.data[..], &[][..]);
        attend_heads(
            kv,
            layer,
            batch,
            new_rows,
            p.num_heads,
            v_dim,
            |cached, row, h, pos, o| {
                let query = &q.row(row)[h * (nope + rope_dim)..(h + 1) * (nope + rope_dim)];
                let mut q_rope = query[nope..].to_vec();
                rotate(&mut q_rope, pos as u32, rope, p.rope_interleaved);
                let (w_k, w_v) = kv_b[h * head_rows..(h + 1) * head_rows].split_at(nope * rank);
                let mut q_c = vec![0.0; rank];
                for (&qi, w_row) in query[..nope].iter().zip(w_k.chunks(rank)) {
                    q_c.iter_mut().zip(w_row).for_each(|(a, w)| *a += qi * w);
                }
                let mut weights: Vec<f32> = (0..=pos)
                    .map(|j| {
                        let (c_j, k_j) = cached.key(j).split_at(rank);
                        (dot(&q_c, c_j) + dot(&q_rope, k_j)) * p.scale
                    })
                    .collect();
                softmax_with_sink(&mut weights, None);
                let mut o_c = vec![0.0; rank];
                for (j, weight) in weights.iter().enumerate() {
                    o_c.iter_mut()
                        .zip(&cached.key(j)[..rank])
                        .for_each(|(o, c)| *o += weight * c);
                }
                o.iter_mut()
                    .zip(w_v.chunks(rank))
                    .for_each(|(o, w_row)| *o = dot(w_row, &o_c));
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqSlice;
    use crate::kv::{KvCache, KvLayerSpec, KvSpec};

    fn values(n: usize, salt: usize) -> Vec<f32> {
        (0..n).map(|i| (((i + salt) * 37 % 29) as f32 - 14.0) / 9.0).collect()
    }

    /// transformers' expanded form for one sequence from position 0: keys `[W_k c, k_r]` and values `W_v c` per
    /// head, plain causal attention.
    fn expanded(q: &[f32], compressed: &[f32], kv_b: &[f32], rope: &Rope, p: &MlaParams, rows: usize) -> Vec<f32> {
        let (rank, nope, rd, vd) = (p.kv_lora_rank, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim);
        let lw = p.latent_width();
        let latent: Vec<Vec<f32>> = (0..rows)
            .map(|t| {
                let row = &compressed[t * lw..(t + 1) * lw];
                let rms = (row[..rank].iter().map(|x| x * x).sum::<f32>() / rank as f32 + p.eps).sqrt();
                let mut out: Vec<f32> = row[..rank].iter().map(|x| x / rms).collect();
                let mut k_r = row[rank..].to_vec();
                rotate(&mut k_r, t as u32, rope, p.rope_interleaved);
                out.extend(k_r);
                out
            })
            .collect();
        let mut out = vec![0.0; rows * p.out_width()];
        for h in 0..p.num_heads {
            let w = &kv_b[h * (nope + vd) * rank..(h + 1) * (nope + vd) * rank];
            let project = |c: &[f32], from: usize, n: usize| -> Vec<f32> {
                (from..from + n).map(|r| dot(&w[r * rank..(r + 1) * rank], c)).collect()
            };
            for t in 0..rows {
                let query = &q[t * p.q_width() + h * (nope + rd)..][..nope + rd];
                let mut q_r = query[nope..].to_vec();
                rotate(&mut q_r, t as u32, rope, p.rope_interleaved);
                let scores: Vec<f32> = (0..=t)
                    .map(|j| {
                        let k_nope = project(&latent[j][..rank], 0, nope);
                        (dot(&query[..nope], &k_nope) + dot(&q_r, &latent[j][rank..])) * p.scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let v = project(&latent[j][..rank], nope, vd);
                    for (d, v) in v.iter().enumerate() {
                        out[t * p.out_width() + h * vd + d] += (s - max).exp() / total * v;
                    }
                }
            }
        }
        out
    }

    /// A prefill of 4 tokens and a decode step in latent space against the expanded form, for interleaved and
    /// rotate-half RoPE, and a KV layer of the wrong kind refused.
    #[test]
    fn latent_attention_equals_the_expanded_form() {
        let be = CpuBackend;
        for interleaved in [true, false] {
            let p = MlaParams {
                num_heads: 3,
                kv_lora_rank: 8,
                qk_nope_head_dim: 4,
                qk_rope_head_dim: 4,
                v_head_dim: 5,
                scale: 0.4,
                rope_interleaved: interleaved,
                eps: 1e-6,
            };
            let rows = 5;
            let rope = Rope {
                attention_factor: 1.1,
                ..Rope::new(100.0, 4, 4)
            };
            let (q, compressed) = (values(rows * p.q_width(), 1), values(rows * p.latent_width(), 2));
            let kv_b = values(p.kv_b_rows() * p.kv_lora_rank, 3);
            let kv_b_ref = TensorRef::from_f32("kv_b", vec![p.kv_b_rows(), p.kv_lora_rank], &kv_b).unwrap();
            let norm = TensorRef::from_f32("norm", vec![p.kv_lora_rank], &[1.0; 8]).unwrap();
            let mut kv = be
                .new_kv(KvSpec {
                    layers: vec![
                        KvLayerSpec::heads(1, p.latent_width()),
                        KvLayerSpec::latent(p.latent_width()),
                    ],
                    capacity_tokens: 16,
                    recurrent: None,
                })
                .unwrap();
            let seq = kv.alloc_seq();
            let mut got = Vec::new();
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
                let q_part = be
                    .upload(&q[start * p.q_width()..][..len * p.q_width()], len, p.q_width())
                    .unwrap();
                let lw = p.latent_width();
                let c_part = be.upload(&compressed[start * lw..][..len * lw], len, lw).unwrap();
                let run = |kv: &mut HostKv, layer| {
                    be.mla_attention(&q_part, &c_part, &norm, &kv_b_ref, &rope, kv, layer, &batch, &p)
                };
                assert!(
                    matches!(run(&mut kv, 0), Err(crate::Error::Shape(_))),
                    "KV layer 0 keeps keys and values, not latents"
                );
                got.extend(run(&mut kv, 1).unwrap().data);
            }
            let want = expanded(&q, &compressed, &kv_b, &rope, &p, rows);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(err < 1e-4, "interleaved {interleaved}: off by {err}");
        }
    }
}
