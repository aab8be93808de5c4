//! Gated DeltaNet on the GPU (gdn.cu): the causal conv1d with its rolling state and the gated delta rule over
//! each sequence's recurrent state, token by token for short slices (decode) and in chunks for long ones
//! (prefill).

use cudarc::driver::LaunchConfig;
use ferry_kernels::constants::{DELTA_CHUNK, DELTA_CHUNK_COLUMNS, DELTA_CHUNK_THREADS, MAX_K_HEAD_DIM};

use super::kv::{DeviceBatch, RecurrentBatch};
use super::launch::{kernel, ptr, Ptr};
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::backend::{DeltaRuleParams, DELTA_RULE_CHUNKED_MIN_LEN};
use crate::{Error, Result};

/// Threads of a causal conv1d block, one per channel.
const CONV_THREADS: usize = 256;

kernel! {
    /// gdn.cu's `causal_conv1d`: `y = silu(conv(x))` per channel along each slice, after the slice's conv state.
    struct CausalConv1d = "causal_conv1d" {
        x: Ptr<f32>,
        weight: Ptr<u16>,
        y: Ptr<f32>,
        row_slice: Ptr<u32>,
        slice_start_row: Ptr<u32>,
        slice_state: Ptr<u64>,
        conv_offset: usize,
        channels: i32,
        kernel: i32,
    }
}

kernel! {
    /// gdn.cu's `conv_state_update`: each slice's conv state becomes its last `kernel - 1` inputs.
    struct ConvStateUpdate = "conv_state_update" {
        x: Ptr<f32>,
        slice_start_row: Ptr<u32>,
        slice_len: Ptr<u32>,
        slice_state: Ptr<u64>,
        conv_offset: usize,
        channels: i32,
        kernel: i32,
    }
}

kernel! {
    /// gdn.cu's `gated_delta_rule` (slices shorter than `chunked_from`, token by token) and
    /// `gated_delta_rule_chunked` (the others, in chunks): one signature, each kernel skipping the other's slices.
    struct GatedDeltaRule {
        qkv: Ptr<f32>,
        a: Ptr<f32>,
        b: Ptr<f32>,
        a_log: Ptr<f32>,
        dt_bias: Ptr<f32>,
        out: Ptr<f32>,
        slice_start_row: Ptr<u32>,
        slice_len: Ptr<u32>,
        slice_state: Ptr<u64>,
        delta_offset: usize,
        num_k_heads: i32,
        num_v_heads: i32,
        dk: i32,
        dv: i32,
        chunked_from: i32,
    }
}

/// The chunked kernel's dynamic shared memory for keys of `dk` (its layout in gdn.cu): k and q rows of dk + 1,
/// q's space shared with A and u, P, the block's state columns, G and beta.
const fn chunked_shared_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    let rows = c * (dk + 1);
    let solve = c * (c + 1) + c * (DELTA_CHUNK_COLUMNS + 4);
    let q_space = if rows > solve { rows } else { solve };
    4 * (rows + q_space + c * (c + 1) + dk * DELTA_CHUNK_COLUMNS + 2 * c)
}

/// What the chunked kernel may ask for (97.25 KiB at dk = 128: within the 99 KiB a block may have on every GPU
/// the fatbin targets).
pub(super) const CHUNKED_MAX_SHARED_BYTES: usize = chunked_shared_bytes(MAX_K_HEAD_DIM);

/// The inputs of the delta rule's gates (see [`crate::backend::Backend::gated_delta_rule`]): `a` and `b` per row
/// and value head, `a_log` and `dt_bias` per value head.
pub(super) struct Gates<'a> {
    pub a: &'a CudaTensor,
    pub b: &'a CudaTensor,
    pub a_log: &'a CudaWeight,
    pub dt_bias: &'a CudaWeight,
}

fn recurrent(batch: &DeviceBatch) -> Result<&RecurrentBatch> {
    batch
        .recurrent
        .as_ref()
        .ok_or_else(|| Error::Kv("a Gated DeltaNet layer in a model without recurrent state".into()))
}

/// Blocks of [`CONV_THREADS`] channels, `rows` of them.
fn channel_blocks(channels: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (channels.div_ceil(CONV_THREADS) as u32, rows as u32, 1),
        block_dim: (CONV_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// [`crate::backend::Backend::causal_conv1d`], with the layer's conv state at `conv_offset` in each sequence's
/// recurrent state.
pub(super) fn causal_conv1d(
    cuda: &CudaBackend,
    x: &CudaTensor,
    weight: &CudaWeight,
    conv_offset: usize,
    batch: &DeviceBatch,
) -> Result<CudaTensor> {
    let weight = weight.matrix()?;
    let (channels, kernel) = (weight.rows, weight.cols);
    let r = recurrent(batch)?;
    let y = cuda.tensor(x.rows, channels)?;
    let conv = CausalConv1d {
        x: ptr(&x.data),
        weight: weight.data,
        y: ptr(&y.data),
        row_slice: ptr(&r.row_slice),
        slice_start_row: ptr(&r.slice_start_row),
        slice_state: ptr(&r.slice_state),
        conv_offset,
        channels: channels as i32,
        kernel: kernel as i32,
    };
    conv.launch(cuda, channel_blocks(channels, x.rows))?;
    let update = ConvStateUpdate {
        x: ptr(&x.data),
        slice_start_row: ptr(&r.slice_start_row),
        slice_len: ptr(&r.slice_len),
        slice_state: ptr(&r.slice_state),
        conv_offset,
        channels: channels as i32,
        kernel: kernel as i32,
    };
    update.launch(cuda, channel_blocks(channels, r.slices))?;
    Ok(y)
}

/// [`crate::backend::Backend::gated_delta_rule`], with the layer's delta-rule state at `delta_offset` in each
/// sequence's recurrent state.
pub(super) fn gated_delta_rule(
    cuda: &CudaBackend,
    qkv: &CudaTensor,
    gates: &Gates<'_>,
    delta_offset: usize,
    batch: &DeviceBatch,
    p: &DeltaRuleParams,
) -> Result<CudaTensor> {
    if p.k_head_dim > MAX_K_HEAD_DIM || p.v_head_dim > 1024 {
        return Err(Error::Cuda(format!(
            "delta rule heads of {} x {} are over the kernel's {MAX_K_HEAD_DIM} x 1024",
            p.k_head_dim, p.v_head_dim
        )));
    }
    let r = recurrent(batch)?;
    let out = cuda.tensor(qkv.rows, p.num_v_heads * p.v_head_dim)?;
    let delta_rule = GatedDeltaRule {
        qkv: ptr(&qkv.data),
        a: ptr(&gates.a.data),
        b: ptr(&gates.b.data),
        a_log: gates.a_log.vector()?,
        dt_bias: gates.dt_bias.vector()?,
        out: ptr(&out.data),
        slice_start_row: ptr(&r.slice_start_row),
        slice_len: ptr(&r.slice_len),
        slice_state: ptr(&r.slice_state),
        delta_offset,
        num_k_heads: p.num_k_heads as i32,
        num_v_heads: p.num_v_heads as i32,
        dk: p.k_head_dim as i32,
        dv: p.v_head_dim as i32,
        chunked_from: DELTA_RULE_CHUNKED_MIN_LEN as i32,
    };
    // Short slices (decode) go token by token, long ones (prefill) in chunks: each kernel leaves the other's
    // slices alone, and neither is launched for a batch without slices of its kind.
    if r.lens.iter().any(|&len| len < DELTA_RULE_CHUNKED_MIN_LEN) {
        // Threads: one per state column, and at least the 65 that normalise q and k and compute the gates.
        let threads = p.v_head_dim.max(65).div_ceil(32) as u32 * 32;
        let cfg = LaunchConfig {
            grid_dim: (r.slices as u32, p.num_v_heads as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        delta_rule.launch_kernel(cuda, "gated_delta_rule", cfg)?;
    }
    if r.lens.iter().any(|&len| len >= DELTA_RULE_CHUNKED_MIN_LEN) {
        let cfg = LaunchConfig {
            grid_dim: (
                r.slices as u32,
                p.num_v_heads as u32,
                p.v_head_dim.div_ceil(DELTA_CHUNK_COLUMNS) as u32,
            ),
            block_dim: (DELTA_CHUNK_THREADS as u32, 1, 1),
            shared_mem_bytes: chunked_shared_bytes(p.k_head_dim) as u32,
        };
        delta_rule.launch_kernel(cuda, "gated_delta_rule_chunked", cfg)?;
    }
    Ok(out)
}
