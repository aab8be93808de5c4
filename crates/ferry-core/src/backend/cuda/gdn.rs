//! Gated DeltaNet on the GPU (gdn.cu): the causal conv1d with its rolling state and the gated delta rule over
//! each sequence's recurrent state, token by token.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::kv::{DeviceBatch, DeviceKv, RecurrentBatch};
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::backend::DeltaRuleParams;
use crate::{Error, Result};

/// gdn.cu's MAX_K_HEAD_DIM: the state column a thread keeps in registers.
const MAX_K_HEAD_DIM: usize = 128;

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
        // Threads: one per state column, and at least the 65 that normalise q and k and compute the gates.
        let threads = p.v_head_dim.max(65).div_ceil(32) as u32 * 32;
        self.launch(
            "gated_delta_rule",
            LaunchConfig {
                grid_dim: (r.slices as u32, p.num_v_heads as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
            |kernel| {
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
                    .arg(&dv);
            },
        )?;
        Ok(out)
    }
}
