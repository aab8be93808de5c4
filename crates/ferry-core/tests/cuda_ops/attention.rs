//! Attention against the CPU: paged attention over several sequences (prefill, then decode rows over contexts
//! split across blocks), the flash prefill kernel over lengths, groups, windows and sinks, and multi-head latent
//! attention over its latent cache.

use super::*;

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

/// The batches of [`latent_attention_prefill_then_decode`]: (sequence, start, len) slices per call.
/// The fourth call's 71 rows take two rounds of the kernels (MLA_ROWS_PER_LAUNCH); the last decodes at 110 keys,
/// split among blocks.
const MLA_CALLS: [&[(usize, usize, usize)]; 5] = [
    &[(0, 0, 37), (1, 0, 5)],
    &[(0, 37, 1), (1, 5, 1)],
    &[(1, 6, 20), (0, 38, 1)],
    &[(0, 39, 70), (1, 26, 1)],
    &[(0, 109, 1), (1, 27, 1)],
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
            capacity_tokens: 256,
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
/// nope 128, rope 64 interleaved, values of 128) with 16 heads (one group of mla_attend), a small rotate-half shape
/// of 4 heads and one of 20 (a group and part of another; a latent width not a multiple of 4); a prefill of two
/// sequences, a decode step of both, then prefill chunks batched with a decode row, then decode at a longer
/// context; kv_b in bf16 and in FP8.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn latent_attention_prefill_then_decode() {
    let p = pair();
    let mut rng = Rng::new(11);
    for (heads, rank, nope, rope_dim, v_dim, interleaved) in [
        (16, 512, 128, 64, 128, true),
        (4, 32, 16, 8, 12, false),
        (20, 64, 32, 6, 24, false),
    ] {
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
