//! Multi-head latent attention on the GPU (mla.cu): the latent row of each token appended to its layer's latent
//! pool, then, for prefill and decode alike, rounds of at most MLA_ROWS_PER_LAUNCH rows (their temporaries bounded
//! whatever the step's length, and counted in the workspace): the rows' queries taken into latent space
//! (`mla_absorb_query`, a block per head and chunk of MLA_CHUNK_ROWS rows, so that each weight it reads serves the
//! chunk), attended over the latent rows on tensor cores by blocks of 16 heads that share every key tile they read
//! (`mla_attend`, the keys split among blocks to fill the GPU at decode and merged by attention.cu's
//! `attention_combine`), and the values expanded from the attended latent (`mla_expand`, chunked like the
//! queries). The form is the CPU backend's (`cpu/mla.rs`), so the two agree to rounding: products in f32, or in
//! 3xTF32 on the tensor cores. `kv_b_proj` is read as stored: bf16, or E4M3 times its block's f32 scale
//! (DeepSeek-V3's checkpoints; the CPU reference's dequantized weight exactly).

use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{
    MLA_ATTEND_THREADS, MLA_CHUNK_ROWS, MLA_GROUP_HEADS, MLA_KEYS_PER_TILE, MLA_MAX_RANK, MLA_ROWS_PER_LAUNCH,
};

use super::attention::{blocks_per_multiprocessor, combine_splits, split_keys};
use super::kv::{DeviceBatch, DeviceKv};
use super::launch::{kernel, per_row, ptr, Ptr};
use super::{CudaBackend, CudaRope, CudaTensor, CudaWeight};
use crate::backend::MlaParams;
use crate::{Error, Result};

kernel! {
    /// Block per row: c normalised, the shared key rotated, the row written to slot `row_slot[row]` of `pool`.
    struct MlaLatentAppend = "mla_latent_append" {
        compressed: Ptr<f32>,
        kv_norm: Ptr<f32>,
        rank: i32,
        rope_dim: i32,
        eps: f32,
        positions: Ptr<u32>,
        inv_freq: Ptr<f32>,
        interleaved: i32,
        rope_scale: f32,
        row_slot: Ptr<u32>,
        pool: Ptr<f32>,
    }
}

kernel! {
    /// Block per (head, chunk of rows) of a round of rows: the head's query in latent space,
    /// `[W_k[h]^T q_nope, rope(q_rope)]`.
    struct MlaAbsorbQuery = "mla_absorb_query" {
        q: Ptr<f32>,
        kv_b_bf16: Ptr<u16>,
        kv_b_fp8: Ptr<u8>,
        kv_b_scales: Ptr<f32>,
        block_rows: i32,
        block_cols: i32,
        row_pos: Ptr<u32>,
        first_row: i32,
        round_rows: i32,
        inv_freq: Ptr<f32>,
        interleaved: i32,
        rope_scale: f32,
        heads: i32,
        rank: i32,
        nope: i32,
        rope_dim: i32,
        v_dim: i32,
        q_lat: Ptr<f32>,
    }
}

kernel! {
    /// Block per (row, group of heads, split): the group's attention over the split's latent rows, o_c (one split)
    /// or its partials for attention_combine.
    struct MlaAttend = "mla_attend" {
        q_lat: Ptr<f32>,
        pool: Ptr<f32>,
        row_pos: Ptr<u32>,
        row_table: Ptr<u32>,
        block_tables: Ptr<u32>,
        first_row: i32,
        heads: i32,
        rank: i32,
        width: i32,
        scale: f32,
        split_len: i32,
        oc: Ptr<f32>,
        partial_out: Ptr<f32>,
        partial_stats: Ptr<f32>,
    }
}

kernel! {
    /// Block per (head, chunk of rows) of a round: the head's output `W_v[h] o_c`.
    struct MlaExpand = "mla_expand" {
        oc: Ptr<f32>,
        kv_b_bf16: Ptr<u16>,
        kv_b_fp8: Ptr<u8>,
        kv_b_scales: Ptr<f32>,
        block_rows: i32,
        block_cols: i32,
        first_row: i32,
        round_rows: i32,
        heads: i32,
        rank: i32,
        nope: i32,
        v_dim: i32,
        out: Ptr<f32>,
    }
}

/// Every kernel of mla.cu.
pub(super) const KERNELS: [&str; 4] = ["mla_latent_append", "mla_absorb_query", "mla_attend", "mla_expand"];

/// kv_b_proj as the kernels read it: bf16, or E4M3 with its block scales (the other pointers null).
struct KvB {
    bf16: Ptr<u16>,
    fp8: Ptr<u8>,
    scales: Ptr<f32>,
    block: [i32; 2],
    rows: usize,
    cols: usize,
}

impl KvB {
    fn of(w: &CudaWeight) -> Result<Self> {
        Ok(match w.fp8_matrix() {
            Some(m) if !m.block[1].is_multiple_of(4) => {
                return Err(Error::Shape(format!(
                    "an FP8 kv_b_proj with scale blocks {} columns wide: the MLA kernels read 4 weights of one \
                     scale at a time",
                    m.block[1]
                )))
            }
            Some(m) => KvB {
                bf16: Ptr::null(),
                fp8: m.data,
                scales: m.scales,
                block: m.block.map(|b| b as i32),
                rows: m.rows,
                cols: m.cols,
            },
            None => {
                let m = w.matrix()?;
                KvB {
                    bf16: m.data,
                    fp8: Ptr::null(),
                    scales: Ptr::null(),
                    block: [1, 1],
                    rows: m.rows,
                    cols: m.cols,
                }
            }
        })
    }
}

/// Bytes of shared memory of an mla_attend block for latent rows of `width` floats: the group's queries and a tile
/// of keys (rows padded as mla.cu pads them), the score quarters and probabilities of the tile (probability rows
/// padded by 4), the heads' correction, max and denominator, the tile's slots.
fn attend_shared_bytes(width: usize) -> usize {
    let stride = width.div_ceil(32) * 32 + 4;
    let (g, kt) = (MLA_GROUP_HEADS, MLA_KEYS_PER_TILE);
    4 * ((g + kt) * stride + 4 * g * kt + g * (kt + 4) + 3 * g + kt)
}

/// Threads per block of the append kernel.
const APPEND_THREADS: u32 = 128;

/// A grid of `x * y * z` blocks of `threads` threads.
fn grid(x: usize, y: usize, z: usize, threads: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    }
}

/// [`crate::backend::Backend::mla_attention`] on the device.
#[allow(clippy::too_many_arguments)]
pub(super) fn mla_attention(
    cuda: &CudaBackend,
    q: &CudaTensor,
    compressed: &CudaTensor,
    kv_norm: &CudaWeight,
    kv_b: &CudaWeight,
    rope: &CudaRope,
    kv: &DeviceKv,
    layer: usize,
    batch: &DeviceBatch,
    p: &MlaParams,
) -> Result<CudaTensor> {
    let (rank, rope_dim) = (p.kv_lora_rank, p.qk_rope_head_dim);
    let kv_b = KvB::of(kv_b)?;
    if q.cols != p.q_width()
        || compressed.cols != p.latent_width()
        || compressed.rows != q.rows
        || (kv_b.rows, kv_b.cols) != (p.kv_b_rows(), rank)
        || kv_b.rows * kv_b.cols > i32::MAX as usize
        || rope.rotary_dim != rope_dim
    {
        return Err(Error::Shape(format!(
            "mla_attention: q [{}, {}], compressed kv [{}, {}], kv_b [{}, {}], RoPE over {} for {p:?}",
            q.rows, q.cols, compressed.rows, compressed.cols, kv_b.rows, kv_b.cols, rope.rotary_dim
        )));
    }
    if !rank.is_multiple_of(32) || rank > MLA_MAX_RANK {
        return Err(Error::Cuda(format!(
            "kv_lora_rank {rank} is outside the MLA kernels' limits (a multiple of 32 up to {MLA_MAX_RANK})"
        )));
    }
    let pool = kv.latent_pool(layer, p.latent_width())?;
    let (rows, heads, width) = (q.rows, p.num_heads, p.latent_width());
    let interleaved = p.rope_interleaved as i32;
    MlaLatentAppend {
        compressed: ptr(&compressed.data),
        kv_norm: kv_norm.vector()?,
        rank: rank as i32,
        rope_dim: rope_dim as i32,
        eps: p.eps,
        positions: batch.positions,
        inv_freq: ptr(&rope.inv_freq),
        interleaved,
        rope_scale: rope.attention_factor,
        row_slot: batch.row_slot,
        pool: ptr(pool),
    }
    .launch(cuda, per_row(rows, APPEND_THREADS))?;
    let out = cuda.tensor(rows, p.out_width())?;
    let groups = heads.div_ceil(MLA_GROUP_HEADS);
    let shared_bytes = attend_shared_bytes(width);
    let per_multiprocessor =
        blocks_per_multiprocessor(cuda, "mla_attend", MLA_ATTEND_THREADS as u32, shared_bytes)?.max(1);
    // Splits fill the GPU at decode, but never past MLA_ROWS_PER_LAUNCH rows' worth of partials per round.
    let resident = (per_multiprocessor * cuda.multiprocessors).min(MLA_ROWS_PER_LAUNCH * groups);
    for first in (0..rows).step_by(MLA_ROWS_PER_LAUNCH) {
        let round = MLA_ROWS_PER_LAUNCH.min(rows - first);
        let chunks = round.div_ceil(MLA_CHUNK_ROWS);
        let q_lat: CudaSlice<f32> = cuda.alloc(round * heads * width)?;
        MlaAbsorbQuery {
            q: ptr(&q.data),
            kv_b_bf16: kv_b.bf16,
            kv_b_fp8: kv_b.fp8,
            kv_b_scales: kv_b.scales,
            block_rows: kv_b.block[0],
            block_cols: kv_b.block[1],
            row_pos: batch.positions,
            first_row: first as i32,
            round_rows: round as i32,
            inv_freq: ptr(&rope.inv_freq),
            interleaved,
            rope_scale: rope.attention_factor,
            heads: heads as i32,
            rank: rank as i32,
            nope: p.qk_nope_head_dim as i32,
            rope_dim: rope_dim as i32,
            v_dim: p.v_head_dim as i32,
            q_lat: ptr(&q_lat),
        }
        .launch(cuda, grid(heads, chunks, 1, MLA_ATTEND_THREADS as u32, 0))?;
        let splits = split_keys(round * groups, batch.key_span, MLA_KEYS_PER_TILE, resident);
        let oc: CudaSlice<f32> = cuda.alloc(round * heads * rank)?;
        let partials = if splits.count > 1 {
            round * heads * splits.count
        } else {
            0
        };
        let partial_out: CudaSlice<f32> = cuda.alloc(partials * rank)?;
        let partial_stats: CudaSlice<f32> = cuda.alloc(partials * 2)?;
        MlaAttend {
            q_lat: ptr(&q_lat),
            pool: ptr(pool),
            row_pos: batch.positions,
            row_table: batch.row_table,
            block_tables: batch.block_tables,
            first_row: first as i32,
            heads: heads as i32,
            rank: rank as i32,
            width: width as i32,
            scale: p.scale,
            split_len: splits.len as i32,
            oc: ptr(&oc),
            partial_out: ptr(&partial_out),
            partial_stats: ptr(&partial_stats),
        }
        .launch(
            cuda,
            grid(
                round,
                groups,
                splits.count,
                MLA_ATTEND_THREADS as u32,
                shared_bytes as u32,
            ),
        )?;
        if splits.count > 1 {
            combine_splits(
                cuda,
                (&partial_out, &partial_stats),
                Ptr::null(),
                ptr(&oc),
                (round, heads, rank),
                splits.count,
            )?;
        }
        MlaExpand {
            oc: ptr(&oc),
            kv_b_bf16: kv_b.bf16,
            kv_b_fp8: kv_b.fp8,
            kv_b_scales: kv_b.scales,
            block_rows: kv_b.block[0],
            block_cols: kv_b.block[1],
            first_row: first as i32,
            round_rows: round as i32,
            heads: heads as i32,
            rank: rank as i32,
            nope: p.qk_nope_head_dim as i32,
            v_dim: p.v_head_dim as i32,
            out: ptr(&out.data),
        }
        .launch(cuda, grid(heads, chunks, 1, MLA_ATTEND_THREADS as u32, 0))?;
    }
    Ok(out)
}
