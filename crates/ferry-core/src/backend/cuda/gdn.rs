//! Gated DeltaNet on the GPU (gdn.cu): the causal conv1d with its rolling state and the gated delta rule over
//! each sequence's recurrent state, token by token for short slices (decode) and in chunks for long ones
//! (prefill).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::kv::{DeviceBatch, DeviceKv, RecurrentBatch};
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::backend::{DeltaRuleParams, DELTA_RULE_CHUNK, DELTA_RULE_CHUNKED_MIN_LEN};
use crate::{Error, Result};

/// gdn.cu's MAX_K_HEAD_DIM: the state column a thread keeps in registers.
const MAX_K_HEAD_DIM: usize = 128;
/// gdn.cu's CHUNK_COLUMNS: the state columns of a head one block of the chunked kernel takes.
const CHUNK_COLUMNS: usize = 32;
/// gdn.cu's CHUNK_THREADS.
const CHUNK_THREADS: u32 = 256;

/// The chunked kernel's dynamic shared memory for keys of `dk` (its layout in gdn.cu): k and q rows of dk + 1,
/// q's space shared with A and u, P, the block's state columns, G and beta.
const fn chunked_shared_bytes(dk: usize) -> usize {
    let c = DELTA_RULE_CHUNK;
    let rows = c * (dk + 1);
    let solve = c * (c + 1) + c * (CHUNK_COLUMNS + 4);
    let q_space = if rows > solve { rows } else { solve };
    4 * (rows + q_space + c * (c + 1) + dk * CHUNK_COLUMNS + 2 * c)
}

/// What the chunked kernel may ask for (97.25 KiB at dk = 128: within the 99 KiB a block may have on every GPU
/// the fatbin targets).
pub(super) const CHUNKED_MAX_SHARED_BYTES: usize = chunked_shared_bytes(MAX_K_HEAD_DIM);

fn recurrent(batch: &DeviceBatch) -> Result<&RecurrentBatch> {
    batch
        .recurrent
        .as_ref()
        .ok_or_else(|| Error::Kv("a Gated DeltaNet layer in a model without recurrent state".into()))
}

impl CudaBackend {
    pub(super) fn causal_conv1d_on_device(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
        batch: &DeviceBatch,
    ) -> Result<CudaTensor> {
        let (w, channels, kernel) = self.matrix(weight)?;
        let r = recurrent(batch)?;
        let conv_offset = kv.recurrent_offsets(layer)?.conv;
        let y = self.tensor(x.rows, channels)?;
        let (channels32, kernel32) = (channels as i32, kernel as i32);
        let blocks = channels.div_ceil(256) as u32;
        self.launch(
            "causal_conv1d",
            LaunchConfig {
                grid_dim: (blocks, x.rows as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            |kernel| {
                kernel
                    .arg(&x.data)
                    .arg(w)
                    .arg(&y.data)
                    .arg(&r.row_slice)
                    .arg(&r.slice_start_row)
                    .arg(&r.slice_state)
                    .arg(&conv_offset)
                    .arg(&channels32)
                    .arg(&kernel32);
            },
        )?;
        self.launch(
            "conv_state_update",
            LaunchConfig {
                grid_dim: (blocks, r.slices as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            |kernel| {
                kernel
                    .arg(&x.data)
                    .arg(&r.slice_start_row)
                    .arg(&r.slice_len)
                    .arg(&r.slice_state)
                    .arg(&conv_offset)
                    .arg(&channels32)
                    .arg(&kernel32);
            },
        )?;
        Ok(y)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_rule_on_device(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        kv: &mut DeviceKv,
        layer: usize,
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
        let delta_offset = kv.recurrent_offsets(layer)?.delta;
        let (a_log, dt_bias) = (self.vector(a_log)?, self.vector(dt_bias)?);
        let out = self.tensor(qkv.rows, p.num_v_heads * p.v_head_dim)?;
        let (k_heads, v_heads, dk, dv) = (
            p.num_k_heads as i32,
            p.num_v_heads as i32,
            p.k_head_dim as i32,
            p.v_head_dim as i32,
        );
        // Short slices (decode) go token by token, long ones (prefill) in chunks: each kernel leaves the other's
        // slices alone, and neither is launched for a batch without slices of its kind.
        let mut kernels = Vec::new();
        if r.lens.iter().any(|&len| len < DELTA_RULE_CHUNKED_MIN_LEN) {
            // Threads: one per state column, and at least the 65 that normalise q and k and compute the gates.
            let threads = p.v_head_dim.max(65).div_ceil(32) as u32 * 32;
            let cfg = LaunchConfig {
                grid_dim: (r.slices as u32, p.num_v_heads as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            kernels.push(("gated_delta_rule", cfg));
        }
        if r.lens.iter().any(|&len| len >= DELTA_RULE_CHUNKED_MIN_LEN) {
            let cfg = LaunchConfig {
                grid_dim: (
                    r.slices as u32,
                    p.num_v_heads as u32,
                    p.v_head_dim.div_ceil(CHUNK_COLUMNS) as u32,
                ),
                block_dim: (CHUNK_THREADS, 1, 1),
                shared_mem_bytes: chunked_shared_bytes(p.k_head_dim) as u32,
            };
            kernels.push(("gated_delta_rule_chunked", cfg));
        }
        let chunked_from = DELTA_RULE_CHUNKED_MIN_LEN as i32;
        for (name, cfg) in kernels {
            self.launch(name, cfg, |kernel| {
                kernel
                    .arg(&qkv.data)
                    .arg(&a.data)
                    .arg(&b.data)
                    .arg(a_log)
                    .arg(dt_bias)
                    .arg(&out.data)
                    .arg(&r.slice_start_row)
                    .arg(&r.slice_len)
                    .arg(&r.slice_state)
                    .arg(&delta_offset)
                    .arg(&k_heads)
                    .arg(&v_heads)
                    .arg(&dk)
                    .arg(&dv)
                    .arg(&chunked_from);
            })?;
        }
        Ok(out)
    }
}
