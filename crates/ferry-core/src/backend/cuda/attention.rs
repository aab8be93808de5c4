//! Attention on the GPU: qkv.cu's fused q/k norm, RoPE and KV append, then attention over the paged KV cache
//! (attention.cu): how a call is laid out (warps per block, depth of the copy pipeline, how many splits of the
//! keys) and the launches of `attention` and, when the keys are split, `attention_combine`. Batches with a prefill
//! slice go to flash_attention.rs instead.

use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{
    ATTENTION_COMBINE_THREADS, ATTENTION_MAX_SPLITS, ATTENTION_MAX_STAGES, ATTENTION_MAX_WARPS, KEYS_PER_TILE,
    MAX_HEAD_DIM,
};

use super::flash_attention::{self, PADDED_HEAD_DIMS};
use super::kv::{DeviceBatch, DeviceKv};
use super::launch::{kernel, ptr, Ptr};
use super::{cuda_err, CudaBackend, CudaRope, CudaTensor, CudaWeight};
use crate::backend::{AttentionParams, QkNormWeights};
use crate::{Error, Result};

/// A split takes at least this many tiles, so that its block has loads of several tiles in flight at once.
const MIN_TILES_PER_SPLIT: usize = 2;

kernel! {
    /// qkv.cu's `qkv_rope_kv_append`: block (row, head) normalises and rotates its query or key head, writing
    /// queries to `q_out` and keys and values to slot `row_slot[row]` of the pools; `q_norm`, `k_norm` may be null.
    struct QkvRopeKvAppend = "qkv_rope_kv_append" {
        qkv: Ptr<f32>,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        q_norm: Ptr<f32>,
        k_norm: Ptr<f32>,
        norm_per_head: i32,
        eps: f32,
        positions: Ptr<u32>,
        inv_freq: Ptr<f32>,
        rotary_dim: i32,
        attention_factor: f32,
        row_slot: Ptr<u32>,
        q_out: Ptr<f32>,
        k_pool: Ptr<f32>,
        v_pool: Ptr<f32>,
    }
}

kernel! {
    /// attention.cu's `attention_d{D}`: block (row, kv head, split) attends the split's keys with the query heads
    /// that share the kv head, writing `out` (one split) or the split's partials (several).
    struct Attention {
        q: Ptr<f32>,
        k_pool: Ptr<f32>,
        v_pool: Ptr<f32>,
        out: Ptr<f32>,
        partial_out: Ptr<f32>,
        partial_stats: Ptr<f32>,
        row_pos: Ptr<u32>,
        row_table: Ptr<u32>,
        block_tables: Ptr<u32>,
        sinks: Ptr<f32>,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        scale: f32,
        window: i32,
        split_len: i32,
        stages: i32,
    }
}

kernel! {
    /// attention.cu's `attention_combine`: block (row, head) merges the splits' partials into `out`, the head's
    /// sink (`sinks` may be null) in the denominator.
    struct AttentionCombine = "attention_combine" {
        partial_out: Ptr<f32>,
        partial_stats: Ptr<f32>,
        sinks: Ptr<f32>,
        out: Ptr<f32>,
        num_heads: i32,
        head_dim: i32,
        splits: i32,
    }
}

/// The decode kernel of each padded head dim (the prefill kernels' [`PADDED_HEAD_DIMS`], a head padded with zeros
/// up to the first that holds it), in their order.
pub(super) const ATTENTION_KERNELS: [&str; 5] = [
    "attention_d16",
    "attention_d32",
    "attention_d64",
    "attention_d128",
    "attention_d256",
];

/// Every kernel of attention.cu.
pub(super) const KERNELS: [&str; 6] = [
    ATTENTION_KERNELS[0],
    ATTENTION_KERNELS[1],
    ATTENTION_KERNELS[2],
    ATTENTION_KERNELS[3],
    ATTENTION_KERNELS[4],
    "attention_combine",
];

/// Warps of a decode block that take the keys of a tile between them, 16 each, for each 8 of a group's heads.
const KEY_WARPS: usize = KEYS_PER_TILE / 16;

/// A block of the decode attention kernel: one query row's group of heads (those sharing a kv head).
#[derive(Debug, PartialEq, Eq)]
struct BlockShape {
    kernel: &'static str,
    warps: usize,
    stages: usize,
    shared_bytes: usize,
}

impl BlockShape {
    /// The block for `group` query heads per kv head of `head_dim`, with the deepest copy pipeline that fits in
    /// `max_shared_bytes`.
    fn new(group: usize, head_dim: usize, max_shared_bytes: usize) -> Result<Self> {
        // KEY_WARPS warps for each 8 heads: the n of the kernel's tensor-core products.
        let head_blocks = group.div_ceil(8);
        let warps = KEY_WARPS * head_blocks;
        let padded = PADDED_HEAD_DIMS.iter().position(|&d| d >= head_dim);
        let padded = match padded {
            Some(i) if group > 0 && warps <= ATTENTION_MAX_WARPS && head_dim.is_multiple_of(4) => i,
            _ => {
                return Err(Error::Cuda(format!(
                    "attention with {group} query heads per kv head of dim {head_dim} is outside the kernel's limits \
                     (1 to {} heads per kv head, head_dim a multiple of 4 up to {MAX_HEAD_DIM})",
                    ATTENTION_MAX_WARPS / KEY_WARPS * 8
                )))
            }
        };
        let d = PADDED_HEAD_DIMS[padded];
        // Keys (rows of d + 4 floats) and values (d + 8) of each stage; the queries' split fragments (4 floats a
        // lane and k-step of 8 features, for each head block); a warp's probabilities, 16 keys by 8 heads.
        let shared_bytes =
            |stages: usize| 4 * (stages * KEYS_PER_TILE * (2 * d + 12) + head_blocks * d / 8 * 32 * 4 + warps * 16 * 8);
        let stages = (2..=ATTENTION_MAX_STAGES)
            .rev()
            .find(|&s| shared_bytes(s) <= max_shared_bytes)
            .ok_or_else(|| {
                Error::Cuda(format!(
                    "attention with {group} query heads per kv head of dim {head_dim} needs {} bytes of shared \
                     memory per block; this GPU has {max_shared_bytes}",
                    shared_bytes(2)
                ))
            })?;
        Ok(BlockShape {
            kernel: ATTENTION_KERNELS[padded],
            warps,
            stages,
            shared_bytes: shared_bytes(stages),
        })
    }
}

/// How each row's keys are divided among blocks: `count` splits of `len` keys.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Splits {
    pub(super) count: usize,
    pub(super) len: usize,
}

/// Splits rows of up to `max_keys` keys, in tiles of `tile_keys`, so that the `row_blocks` blocks of one split
/// each (rows x kv heads) become about `resident_blocks`, what the GPU runs at once: decode fills the GPU in one
/// wave, each block with its tiles all in flight; prefill, with blocks enough, takes one split and needs no combine.
pub(super) fn split_keys(row_blocks: usize, max_keys: usize, tile_keys: usize, resident_blocks: usize) -> Splits {
    let tiles = max_keys.div_ceil(tile_keys).max(1);
    let wanted = resident_blocks.div_ceil(row_blocks.max(1));
    let count = wanted
        .min(tiles.div_ceil(MIN_TILES_PER_SPLIT))
        .clamp(1, ATTENTION_MAX_SPLITS);
    let len = tiles.div_ceil(count) * tile_keys;
    Splits {
        count: max_keys.div_ceil(len).max(1),
        len,
    }
}

/// Blocks of kernel `name` (`threads` threads, `shared_bytes` of dynamic shared memory) one multiprocessor runs
/// at once.
pub(super) fn blocks_per_multiprocessor(
    cuda: &CudaBackend,
    name: &'static str,
    threads: u32,
    shared_bytes: usize,
) -> Result<usize> {
    let mut known = cuda
        .attention_blocks_per_multiprocessor
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let key = (name, threads, shared_bytes);
    if let Some(&blocks) = known.get(&key) {
        return Ok(blocks);
    }
    // The occupancy query, unlike a launch, does not make the context current itself.
    cuda.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
    let blocks = cuda
        .function(name)?
        .occupancy_max_active_blocks_per_multiprocessor(threads, shared_bytes, None)
        .map_err(cuda_err("attention occupancy"))? as usize;
    known.insert(key, blocks);
    Ok(blocks)
}

/// The first half of [`crate::backend::Backend::attention`]: q and k normalised and rotated, the keys and values
/// written into the layer's KV pools (`pools`, keys then values); returns the queries, `[rows, num_heads *
/// head_dim]`.
pub(super) fn qkv_rope_kv_append(
    cuda: &CudaBackend,
    qkv: &CudaTensor,
    qk_norm: Option<QkNormWeights<'_, CudaWeight>>,
    rope: &CudaRope,
    pools: (&CudaSlice<f32>, &CudaSlice<f32>),
    batch: &DeviceBatch,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    if p.head_dim > MAX_HEAD_DIM {
        return Err(Error::Cuda(format!(
            "head_dim {} is over the attention kernel's {MAX_HEAD_DIM}",
            p.head_dim
        )));
    }
    p.check_qkv_width(qkv.cols)?;
    let q = cuda.tensor(qkv.rows, p.num_heads * p.head_dim)?;
    let (q_norm, k_norm) = match &qk_norm {
        Some(n) => (n.q.vector()?, n.k.vector()?),
        None => (Ptr::null(), Ptr::null()),
    };
    let (per_head, eps) = qk_norm.map_or((1, 0.0f32), |n| (n.per_head as i32, n.eps));
    let append = QkvRopeKvAppend {
        qkv: ptr(&qkv.data),
        num_heads: p.num_heads as i32,
        num_kv_heads: p.num_kv_heads as i32,
        head_dim: p.head_dim as i32,
        q_norm,
        k_norm,
        norm_per_head: per_head,
        eps,
        positions: batch.positions,
        inv_freq: ptr(&rope.inv_freq),
        rotary_dim: rope.rotary_dim as i32,
        attention_factor: rope.attention_factor,
        row_slot: batch.row_slot,
        q_out: ptr(&q.data),
        k_pool: ptr(pools.0),
        v_pool: ptr(pools.1),
    };
    let cfg = LaunchConfig {
        grid_dim: (qkv.rows as u32, (p.num_heads + p.num_kv_heads) as u32, 1),
        block_dim: (p.head_dim.div_ceil(32) as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    append.launch(cuda, cfg)?;
    Ok(q)
}

/// Causal attention of `q` (`[rows, num_heads * head_dim]`) over layer `layer` of the cache, which already holds
/// the keys and values of the batch's rows: [`crate::backend::Backend::attention`] after the append. `sinks`:
/// the per-head sink logits (`[num_heads]`), if any.
pub(super) fn attend(
    cuda: &CudaBackend,
    q: &CudaTensor,
    sinks: Option<&CudaWeight>,
    kv: &DeviceKv,
    layer: usize,
    batch: &DeviceBatch,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    if p.num_kv_heads == 0 || !p.num_heads.is_multiple_of(p.num_kv_heads) || q.cols != p.num_heads * p.head_dim {
        return Err(Error::Shape(format!(
            "attention: q [{}, {}] is not {} heads of {} sharing {} kv heads",
            q.rows, q.cols, p.num_heads, p.head_dim, p.num_kv_heads
        )));
    }
    let sinks = match sinks {
        Some(CudaWeight::Vector(s)) if s.len() == p.num_heads => ptr(s),
        Some(_) => {
            return Err(Error::Shape(format!(
                "attention: sinks are not a vector of {} heads",
                p.num_heads
            )))
        }
        None => Ptr::null(),
    };
    // Batches with a prefill go to the tensor-core kernel (flash_attention.rs); without this `if`, to the split one.
    if let Some(slices) = &batch.prefill {
        let pools = kv.layer_pools(layer, p.num_kv_heads * p.head_dim)?;
        return flash_attention::attend(cuda, q, sinks, pools, batch, slices, p);
    }
    let shape = BlockShape::new(p.num_heads / p.num_kv_heads, p.head_dim, cuda.max_shared_per_block)?;
    let per_multiprocessor =
        blocks_per_multiprocessor(cuda, shape.kernel, (shape.warps * 32) as u32, shape.shared_bytes)?;
    let max_keys = match p.sliding_window {
        Some(window) if window > 0 => window.min(batch.key_span),
        _ => batch.key_span,
    };
    let splits = split_keys(
        q.rows * p.num_kv_heads,
        max_keys,
        KEYS_PER_TILE,
        per_multiprocessor.max(1) * cuda.multiprocessors,
    );
    let out = cuda.tensor(q.rows, q.cols)?;
    let partials = if splits.count > 1 {
        q.rows * p.num_heads * splits.count
    } else {
        0
    };
    let partial_out: CudaSlice<f32> = cuda.alloc(partials * p.head_dim)?;
    let partial_stats: CudaSlice<f32> = cuda.alloc(partials * 2)?;
    let (k_pool, v_pool) = kv.layer_pools(layer, p.num_kv_heads * p.head_dim)?;
    let attention = Attention {
        q: ptr(&q.data),
        k_pool: ptr(k_pool),
        v_pool: ptr(v_pool),
        out: ptr(&out.data),
        partial_out: ptr(&partial_out),
        partial_stats: ptr(&partial_stats),
        row_pos: batch.positions,
        row_table: batch.row_table,
        block_tables: batch.block_tables,
        sinks,
        num_heads: p.num_heads as i32,
        num_kv_heads: p.num_kv_heads as i32,
        head_dim: p.head_dim as i32,
        scale: p.scale,
        window: p.sliding_window.unwrap_or(0) as i32,
        split_len: splits.len as i32,
        stages: shape.stages as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (q.rows as u32, p.num_kv_heads as u32, splits.count as u32),
        block_dim: ((shape.warps * 32) as u32, 1, 1),
        shared_mem_bytes: shape.shared_bytes as u32,
    };
    attention.launch_kernel(cuda, shape.kernel, cfg)?;
    if splits.count > 1 {
        let partials = (&partial_out, &partial_stats);
        combine_splits(
            cuda,
            partials,
            sinks,
            ptr(&out.data),
            (q.rows, p.num_heads, p.head_dim),
            splits.count,
        )?;
    }
    Ok(out)
}

/// attention_combine: the `splits` partials (outputs, then (max, denominator) pairs) of each (row, head) merged
/// into `out`, `[rows, heads * head_dim]`, each head's sink (`sinks` may be null) in its denominator.
pub(super) fn combine_splits(
    cuda: &CudaBackend,
    (partial_out, partial_stats): (&CudaSlice<f32>, &CudaSlice<f32>),
    sinks: Ptr<f32>,
    out: Ptr<f32>,
    (rows, heads, head_dim): (usize, usize, usize),
    splits: usize,
) -> Result<()> {
    let combine = AttentionCombine {
        partial_out: ptr(partial_out),
        partial_stats: ptr(partial_stats),
        sinks,
        out,
        num_heads: heads as i32,
        head_dim: head_dim as i32,
        splits: splits as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, heads as u32, 1),
        block_dim: (ATTENTION_COMBINE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    combine.launch(cuda, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The opt-in shared memory per block of an H200 (sm_90) and of an sm_86/89/120 GPU.
    const HOPPER_SHARED: usize = 227 * 1024;
    const SMALL_SHARED: usize = 99 * 1024;

    #[test]
    fn every_head_of_a_group_has_a_warp_and_heads_pad_to_a_kernel() {
        for group in 1..=32 {
            let shape = BlockShape::new(group, 128, HOPPER_SHARED).unwrap();
            assert_eq!(shape.warps, KEY_WARPS * group.div_ceil(8), "group {group}: {shape:?}");
            assert!(shape.warps <= ATTENTION_MAX_WARPS, "group {group}: {shape:?}");
            assert_eq!(shape.kernel, "attention_d128");
        }
        for (head_dim, kernel) in [
            (4, "attention_d16"),
            (16, "attention_d16"),
            (80, "attention_d128"),
            (256, "attention_d256"),
        ] {
            assert_eq!(BlockShape::new(8, head_dim, HOPPER_SHARED).unwrap().kernel, kernel);
        }
        assert!(BlockShape::new(33, 128, HOPPER_SHARED).is_err());
        assert!(BlockShape::new(0, 128, HOPPER_SHARED).is_err());
        assert!(BlockShape::new(8, 130, HOPPER_SHARED).is_err());
        assert!(BlockShape::new(8, 260, HOPPER_SHARED).is_err());
    }

    #[test]
    fn the_pipeline_is_as_deep_as_shared_memory_allows() {
        // Qwen3-30B-A3B: three stages, two blocks per multiprocessor on an H200 (228 KiB, 1 KiB reserved a block).
        let qwen3 = BlockShape::new(8, 128, HOPPER_SHARED).unwrap();
        assert_eq!(
            qwen3,
            BlockShape {
                kernel: "attention_d128",
                warps: 2,
                stages: 3,
                shared_bytes: 4 * (3 * 32 * (132 + 136) + 16 * 32 * 4 + 2 * 16 * 8),
            }
        );
        assert!(2 * (qwen3.shared_bytes + 1024) <= 228 * 1024);
        // 32 heads of 256 per kv head (in the GPU tests): only two stages fit, even on an H200.
        assert_eq!(BlockShape::new(32, 256, HOPPER_SHARED).unwrap().stages, 2);
        assert_eq!(BlockShape::new(8, 256, HOPPER_SHARED).unwrap().stages, 3);
        assert_eq!(BlockShape::new(8, 128, SMALL_SHARED).unwrap().stages, 2);
        assert!(BlockShape::new(8, 256, SMALL_SHARED).is_err());
    }

    #[test]
    fn decode_splits_fill_the_gpu_and_prefill_takes_one_split() {
        // Decode at a 4K context, 4 kv heads, 132 multiprocessors with 2 blocks each: 64 splits of 2 tiles.
        assert_eq!(split_keys(4, 4096, KEYS_PER_TILE, 264), Splits { count: 64, len: 64 });
        // Prefill: more blocks than the GPU holds.
        assert_eq!(
            split_keys(2048 * 4, 4096, KEYS_PER_TILE, 264),
            Splits { count: 1, len: 4096 }
        );
        assert_eq!(split_keys(4, 5, KEYS_PER_TILE, 264), Splits { count: 1, len: 32 });
        for row_blocks in [1, 3, 4, 20, 100, 263, 264, 10_000] {
            for max_keys in [1, 31, 32, 33, 100, 1000, 4097, 100_000, 1_000_000] {
                let s = split_keys(row_blocks, max_keys, KEYS_PER_TILE, 264);
                assert!(s.count >= 1 && s.count <= ATTENTION_MAX_SPLITS, "{s:?}");
                assert!(s.len.is_multiple_of(KEYS_PER_TILE), "{s:?}");
                // Every key has a split and no split is empty for the longest row.
                assert!(s.count * s.len >= max_keys && (s.count - 1) * s.len < max_keys, "{s:?}");
                assert!(s.count == 1 || row_blocks * s.count <= 264 + row_blocks, "{s:?}");
            }
        }
    }
}
