//! Prefill attention on tensor cores (flash_attention.cu): the batch's slices as the kernel reads them, which
//! kernel and block shape a layer's head takes, and the launch. attention.rs sends every batch with a prefill
//! slice (more than one row) here; batches of single rows (decode) stay on attention.cu's split kernel.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use ferry_kernels::constants::{FLASH_MAX_KEYS_PER_TILE, FLASH_TILE_FEATURES, FLASH_WARP_ROWS, MAX_HEAD_DIM};

use super::kv::DeviceBatch;
use super::launch::{kernel, ptr, Ptr};
use super::{cuda_err, CudaBackend, CudaTensor};
use crate::backend::{AttentionParams, SeqSlice};
use crate::{Error, Result};

/// Every flash kernel, by padded head dim and warps per block (see [`FlashShape`]).
pub(super) const FLASH_KERNELS: [&str; 6] = [
    "flash_attention_d16_w4",
    "flash_attention_d32_w4",
    "flash_attention_d64_w4",
    "flash_attention_d128_w4",
    "flash_attention_d256_w4",
    "flash_attention_d256_w2",
];

/// The head dims the kernels (these and attention.rs's) are built for: a head is padded (with zeros) up to the
/// first that holds it.
pub(super) const PADDED_HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];

kernel! {
    /// flash_attention.cu's `flash_attention_d{D}_w{W}`: block (tile, kv head) attends a tile of one slice's
    /// (row, query head) pairs over the slice's keys, writing `out`.
    struct FlashAttention {
        q: Ptr<f32>,
        k_pool: Ptr<f32>,
        v_pool: Ptr<f32>,
        out: Ptr<f32>,
        row_pos: Ptr<u32>,
        row_table: Ptr<u32>,
        block_tables: Ptr<u32>,
        slice_start_row: Ptr<u32>,
        slice_len: Ptr<u32>,
        slices: i32,
        sinks: Ptr<f32>,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        scale: f32,
        window: i32,
    }
}

/// A batch's slices on the device for the flash kernel: each slice's first row, then each slice's length, in one
/// upload; made by [`PrefillSlices::for_batch`] only for batches with a prefill slice.
pub struct PrefillSlices {
    table: CudaSlice<u32>,
    lens: Vec<usize>,
}

impl PrefillSlices {
    /// The slices of `batch` when one of them is longer than a row (a prefill, whole or chunked); None otherwise.
    pub(super) fn for_batch(stream: &Arc<CudaStream>, batch: &[SeqSlice]) -> Result<Option<Self>> {
        if batch.iter().all(|s| s.len <= 1) {
            return Ok(None);
        }
        let starts = batch.iter().scan(0u32, |row, s| {
            let start = *row;
            *row += s.len as u32;
            Some(start)
        });
        let table: Vec<u32> = starts.chain(batch.iter().map(|s| s.len as u32)).collect();
        Ok(Some(PrefillSlices {
            table: stream
                .clone_htod(&table)
                .map_err(cuda_err("uploading batch metadata"))?,
            lens: batch.iter().map(|s| s.len).collect(),
        }))
    }
}

/// A block of a flash kernel for one head size.
#[derive(Debug, PartialEq, Eq)]
struct FlashShape {
    kernel: &'static str,
    warps: usize,
    shared_bytes: usize,
}

impl FlashShape {
    /// The kernel for heads of `head_dim`, with four warps where their shared memory fits in `max_shared_bytes`,
    /// else two.
    fn new(head_dim: usize, max_shared_bytes: usize) -> Result<Self> {
        let padded = PADDED_HEAD_DIMS.into_iter().find(|&d| d >= head_dim);
        let Some(padded) = padded.filter(|_| head_dim > 0 && head_dim.is_multiple_of(4) && head_dim <= MAX_HEAD_DIM)
        else {
            return Err(Error::Cuda(format!(
                "attention heads of {head_dim} are outside the prefill kernel's limits (a multiple of 4 up to \
                 {MAX_HEAD_DIM})"
            )));
        };
        let keys = (FLASH_TILE_FEATURES / padded).min(FLASH_MAX_KEYS_PER_TILE);
        // bf16 halves of the queries and of a key and a value tile, rows of padded + 8; then the tile's slice.
        let shared_bytes = |warps: usize| 2 * (padded + 8) * (2 * warps * FLASH_WARP_ROWS + 4 * keys) + 8;
        let warps = [4, 2]
            .into_iter()
            .find(|&w| shared_bytes(w) <= max_shared_bytes)
            .ok_or_else(|| {
                Error::Cuda(format!(
                    "prefill attention with heads of {head_dim} needs {} bytes of shared memory per block; this GPU \
                     has {max_shared_bytes}",
                    shared_bytes(2)
                ))
            })?;
        let name = format!("flash_attention_d{padded}_w{warps}");
        let kernel = FLASH_KERNELS
            .into_iter()
            .find(|k| *k == name)
            .ok_or_else(|| Error::Cuda(format!("no prefill attention kernel {name}")))?;
        Ok(FlashShape {
            kernel,
            warps,
            shared_bytes: shared_bytes(warps),
        })
    }
}

/// Blocks per kv head: each slice's (row, query head) pairs in tiles of `block_rows`.
fn tiles(lens: &[usize], group: usize, block_rows: usize) -> usize {
    lens.iter().map(|len| (len * group).div_ceil(block_rows)).sum()
}

/// Causal attention of `q` (`[rows, num_heads * head_dim]`) over the layer's KV `pools` (keys, values), which
/// already hold the batch's keys and values: [`crate::backend::Backend::attention`] after the append, for a batch
/// with a prefill. `sinks`: per-head sink logits or null (checked by the caller).
pub(super) fn attend(
    cuda: &CudaBackend,
    q: &CudaTensor,
    sinks: Ptr<f32>,
    pools: (&CudaSlice<f32>, &CudaSlice<f32>),
    batch: &DeviceBatch,
    slices: &PrefillSlices,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let rows: usize = slices.lens.iter().sum();
    if rows != q.rows {
        return Err(Error::Shape(format!(
            "prefill attention: q has {} rows, the batch's slices {rows}",
            q.rows
        )));
    }
    let shape = FlashShape::new(p.head_dim, cuda.max_shared_per_block)?;
    let group = p.num_heads / p.num_kv_heads;
    let blocks = tiles(&slices.lens, group, shape.warps * FLASH_WARP_ROWS);
    let out = cuda.tensor(q.rows, q.cols)?;
    let table = ptr(&slices.table);
    let attention = FlashAttention {
        q: ptr(&q.data),
        k_pool: ptr(pools.0),
        v_pool: ptr(pools.1),
        out: ptr(&out.data),
        row_pos: batch.positions,
        row_table: batch.row_table,
        block_tables: batch.block_tables,
        slice_start_row: table,
        slice_len: table.offset(slices.lens.len()),
        slices: slices.lens.len() as i32,
        sinks,
        num_heads: p.num_heads as i32,
        num_kv_heads: p.num_kv_heads as i32,
        head_dim: p.head_dim as i32,
        scale: p.scale,
        window: p.sliding_window.unwrap_or(0) as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, p.num_kv_heads as u32, 1),
        block_dim: (shape.warps as u32 * 32, 1, 1),
        shared_mem_bytes: shape.shared_bytes as u32,
    };
    attention.launch_kernel(cuda, shape.kernel, cfg)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The opt-in shared memory per block of an H200 (sm_90) and of an sm_86/89/120 GPU.
    const HOPPER_SHARED: usize = 227 * 1024;
    const SMALL_SHARED: usize = 99 * 1024;

    #[test]
    fn every_head_size_has_a_kernel_that_fits() {
        for head_dim in (4..=MAX_HEAD_DIM).step_by(4) {
            for max_shared in [HOPPER_SHARED, SMALL_SHARED] {
                let shape = FlashShape::new(head_dim, max_shared).unwrap();
                assert!(shape.shared_bytes <= max_shared, "{head_dim}: {shape:?}");
                assert!(FLASH_KERNELS.contains(&shape.kernel), "{head_dim}: {shape:?}");
            }
        }
        for head_dim in [0, 6, 130, 260] {
            assert!(FlashShape::new(head_dim, HOPPER_SHARED).is_err(), "{head_dim}");
        }
    }

    #[test]
    fn heads_are_padded_to_the_next_kernel_and_four_warps_where_they_fit() {
        let shape = |head_dim, shared| FlashShape::new(head_dim, shared).unwrap();
        // Qwen3-30B-A3B's heads: 32 keys of 136 bf16 per row; halves of 64 query rows, 32 keys and 32 values.
        assert_eq!(
            shape(128, HOPPER_SHARED),
            FlashShape {
                kernel: "flash_attention_d128_w4",
                warps: 4,
                shared_bytes: 2 * 136 * (2 * 64 + 4 * 32) + 8,
            }
        );
        assert_eq!(shape(128, SMALL_SHARED).warps, 4);
        assert_eq!(shape(16, SMALL_SHARED).kernel, "flash_attention_d16_w4");
        assert_eq!(shape(20, SMALL_SHARED).kernel, "flash_attention_d32_w4");
        assert_eq!(shape(80, HOPPER_SHARED).kernel, "flash_attention_d128_w4");
        // Qwen3.5's gated attention (256): four warps on an H200, two where shared memory is 99 KiB.
        assert_eq!(shape(256, HOPPER_SHARED).kernel, "flash_attention_d256_w4");
        assert_eq!(shape(256, SMALL_SHARED).kernel, "flash_attention_d256_w2");
    }

    #[test]
    fn each_slice_takes_whole_tiles_of_its_row_head_pairs() {
        // Four heads per kv head, 64 pairs per tile: 16 rows a tile; a decode row is one tile of 4 pairs.
        assert_eq!(tiles(&[1], 4, 64), 1);
        assert_eq!(tiles(&[16], 4, 64), 1);
        assert_eq!(tiles(&[17], 4, 64), 2);
        assert_eq!(tiles(&[300, 1, 1], 4, 64), 19 + 2);
        // A group of 6 does not divide a tile: tiles hold parts of rows.
        assert_eq!(tiles(&[15], 6, 64), 2);
        assert_eq!(tiles(&[1000], 1, 32), 32);
    }
}
