//! Multi-head latent attention on the GPU (mla.cu): the latent row of each token appended to its layer's latent
//! pool, then, for prefill and decode alike, one block per (row, head) that takes the head's query into latent
//! space, attends over the latent rows and expands the head's values from the attended latent. The form is the CPU
//! backend's (`cpu/mla.rs`), so the two agree to rounding. Simple rather than fast: each block reads its head's
//! `kv_b_proj` rows and its sequence's latent rows by itself (FlashMLA's kind of kernel, many heads of a row sharing
//! each key tile in shared memory and tensor-core products, is the step after). An FP8 `kv_b_proj` (DeepSeek-V3's
//! checkpoints) is dequantized on each call into bf16 halves `hi + lo` (linear.rs), which the kernel sums: its
//! weights keep 16 significant bits, where bf16 alone would round them to 8.

use cudarc::driver::LaunchConfig;
use ferry_kernels::constants::{MLA_ATTEND_WARPS, MLA_MAX_RANK};

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
    /// Block per (row, head): the head's query taken into latent space, causal attention over the sequence's latent
    /// rows, the head's output `W_v o_c`.
    struct MlaAttend = "mla_attend" {
        q: Ptr<f32>,
        kv_b: Ptr<u16>,
        kv_b_lo: Ptr<u16>,
        pool: Ptr<f32>,
        row_pos: Ptr<u32>,
        row_table: Ptr<u32>,
        block_tables: Ptr<u32>,
        inv_freq: Ptr<f32>,
        interleaved: i32,
        rope_scale: f32,
        heads: i32,
        rank: i32,
        nope: i32,
        rope_dim: i32,
        v_dim: i32,
        scale: f32,
        out: Ptr<f32>,
    }
}

/// Threads per block of the append kernel.
const APPEND_THREADS: u32 = 128;

/// A grid of one block per (row, head).
fn per_row_and_head(rows: usize, heads: usize, threads: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, heads as u32, 1),
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
    let fp8_halves = kv_b.fp8_matrix().map(|w| cuda.dequantize_fp8(w)).transpose()?;
    let (kv_b, kv_b_lo) = match &fp8_halves {
        Some(halves) => (halves.hi(), halves.lo().data),
        None => (kv_b.matrix()?, Ptr::null()),
    };
    if q.cols != p.q_width()
        || compressed.cols != p.latent_width()
        || compressed.rows != q.rows
        || (kv_b.rows, kv_b.cols) != (p.kv_b_rows(), rank)
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
    let (rows, heads) = (q.rows, p.num_heads);
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
    let shared_floats = p.latent_width() + rank + MLA_ATTEND_WARPS * (rank + 2);
    MlaAttend {
        q: ptr(&q.data),
        kv_b: kv_b.data,
        kv_b_lo,
        pool: ptr(pool),
        row_pos: batch.positions,
        row_table: batch.row_table,
        block_tables: batch.block_tables,
        inv_freq: ptr(&rope.inv_freq),
        interleaved,
        rope_scale: rope.attention_factor,
        heads: heads as i32,
        rank: rank as i32,
        nope: p.qk_nope_head_dim as i32,
        rope_dim: rope_dim as i32,
        v_dim: p.v_head_dim as i32,
        scale: p.scale,
        out: ptr(&out.data),
    }
    .launch(
        cuda,
        per_row_and_head(rows, heads, (MLA_ATTEND_WARPS * 32) as u32, (4 * shared_floats) as u32),
    )?;
    Ok(out)
}
