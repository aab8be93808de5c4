//! The grouped path's expert products as a few batched cuBLAS calls instead of one per expert: each expert's run
//! of (row, k) pairs is padded to a whole number of tiles of equal rows, and every tile is one problem of
//! `cublasGemmBatchedEx` (bf16 operands, f32 output and compute, the same hi + lo products as one GEMM per
//! expert), reading its expert's weights through a device array of pointers built on the host, where the routing
//! of the grouped path already is, and uploaded once per projection.
//!
//! Why tiles and not `cublasGemmGroupedBatchedEx` (one problem per expert, row counts free): the grouped API takes
//! one data type for A, B and C (bf16 in, bf16 out, as SGLang's and ZhiLight's callers use it), and rounding the
//! f32 outputs of the hi + lo split to bf16 would throw away the accuracy the split is there for. The batched API
//! takes bf16 in and f32 out, and has been in cuBLAS since 9.1, so no fallback for older libraries is needed.

use cudarc::driver::CudaSlice;

use super::ExpertGroup;
use crate::backend::cuda::expert_format::{dequantized, widened_mxfp4, ExpertFormat};
use crate::backend::cuda::launch::{ptr, Ptr};
use crate::backend::cuda::linear::{BatchedProduct, Bf16Halves};
use crate::backend::cuda::{Bf16Matrix, CudaBackend, CudaTensor};
use crate::Result;

/// Bounds of a tile's rows: fewer leaves the tensor cores idle, more wastes rows on padding.
const MIN_TILE_ROWS: usize = 16;
const MAX_TILE_ROWS: usize = 128;

/// Bytes of bf16 weights that FP8 and MXFP4 experts are widened into at once: experts are widened and multiplied
/// in chunks that fit, so that the scratch stays bounded whatever the number of experts.
const WIDENED_BYTES: usize = 128 << 20;

/// Pointers that cuBLAS reads through an array are assumed aligned like this (it cannot check them).
const POINTER_ALIGN: u64 = 16;

/// One expert's run of pairs in the padded layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) expert: usize,
    /// Its first row in the padded buffers: a multiple of the tile rows.
    pub(super) first_row: usize,
    pub(super) pairs: usize,
}

/// Where each expert's run of pairs lies in the padded buffers of a group.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct TileLayout {
    pub(super) tile_rows: usize,
    pub(super) runs: Vec<Run>,
    /// Rows of the padded buffers: every run rounded up to whole tiles.
    pub(super) padded_rows: usize,
}

impl TileLayout {
    /// The layout of runs of `(expert, pairs)`, in order. The tile is the power of two nearest below half a run's
    /// mean length (within the bounds), so that padding adds at most about a quarter of the rows on average.
    pub(super) fn new(runs: &[(usize, usize)]) -> Self {
        let pairs: usize = runs.iter().map(|&(_, n)| n).sum();
        let half_mean = (pairs / (2 * runs.len().max(1))).max(1);
        let below = 1usize << (usize::BITS - 1 - half_mean.leading_zeros());
        let tile_rows = below.clamp(MIN_TILE_ROWS, MAX_TILE_ROWS);
        let mut first_row = 0;
        let runs = runs
            .iter()
            .map(|&(expert, pairs)| {
                let run = Run {
                    expert,
                    first_row,
                    pairs,
                };
                first_row += pairs.div_ceil(tile_rows) * tile_rows;
                run
            })
            .collect();
        TileLayout {
            tile_rows,
            runs,
            padded_rows: first_row,
        }
    }

    fn tiles(&self, run: &Run) -> usize {
        run.pairs.div_ceil(self.tile_rows)
    }
}

/// One projection of a group, for every run: `out[rows] = x[rows] W_e^T` over the padded rows of each expert e's
/// run, W_e its gate and up (`[2 * inter, hidden]`) or, when `down`, its down (`[hidden, inter]`). Bf16 experts are
/// read in place; FP8 experts are dequantized to bf16 halves and MXFP4 experts widened to bf16, a chunk of experts
/// at a time. Launches: per chunk, the widening (one per expert of FP8 or MXFP4) and one batched GEMM per pair of
/// weight and activation halves (2 for bf16 and MXFP4, 4 for FP8); bf16 is one chunk.
pub(super) fn project(
    cuda: &CudaBackend,
    layout: &TileLayout,
    x: &Bf16Halves,
    addresses: &[u64],
    group: &ExpertGroup,
    down: bool,
    out: &CudaTensor,
) -> Result<()> {
    let (inter, hidden) = (group.inter, group.hidden);
    let (n, k) = if down { (hidden, inter) } else { (2 * inter, hidden) };
    // Scratch per widened expert (FP8: hi then lo, each 2 * inter * hidden; see dequantized()), rounded up so that
    // every expert's matrices start aligned.
    let scratch_stride = match group.format {
        ExpertFormat::Bf16 => 0,
        ExpertFormat::Fp8(_) => (4 * inter * hidden).next_multiple_of(8),
        ExpertFormat::Mxfp4 => (2 * inter * hidden).next_multiple_of(8),
    };
    let chunk_experts = match scratch_stride {
        0 => layout.runs.len(),
        stride => (WIDENED_BYTES / (2 * stride)).clamp(1, layout.runs.len()),
    };
    let scratch: Option<CudaSlice<u16>> = match scratch_stride {
        0 => None,
        stride => Some(cuda.alloc(chunk_experts * stride)?),
    };
    // Each run's weights, bf16 halves (hi, and lo for FP8): in place, or the slot of its chunk in the scratch.
    let weight_halves = |slot: usize, expert: usize| -> [Ptr<u16>; 2] {
        match &scratch {
            None => {
                let block = Ptr::<u16>::at(addresses[expert]);
                let w = if down { block.offset(2 * inter * hidden) } else { block };
                [w, Ptr::null()]
            }
            Some(scratch) => {
                let w = ptr(scratch).offset(slot * scratch_stride);
                [w, w.offset(2 * inter * hidden)]
            }
        }
    };
    let weight_parts = if matches!(group.format, ExpertFormat::Fp8(_)) {
        2
    } else {
        1
    };
    // The pointer arrays of every tile, chunk after chunk: weight hi, weight lo, x hi, x lo, out.
    let tiles: usize = layout.runs.iter().map(|r| layout.tiles(r)).sum();
    let mut arrays = vec![0u64; 5 * tiles];
    let mut chunks = Vec::new(); // (runs, first tile, tiles)
    let mut tile = 0;
    for runs in layout.runs.chunks(chunk_experts) {
        let first_tile = tile;
        for (slot, run) in runs.iter().enumerate() {
            let [w_hi, w_lo] = weight_halves(slot, run.expert);
            for t in 0..layout.tiles(run) {
                let row = run.first_row + t * layout.tile_rows;
                let pointers = [
                    w_hi.address(),
                    w_lo.address(),
                    x.hi().offset(row * k).address(),
                    x.lo().offset(row * k).address(),
                    ptr(&out.data).offset(row * n).address(),
                ];
                for (array, pointer) in pointers.into_iter().enumerate() {
                    arrays[array * tiles + tile] = pointer;
                }
                tile += 1;
            }
        }
        chunks.push((runs, first_tile, tile - first_tile));
    }
    let aligned = arrays.iter().all(|&p| p % POINTER_ALIGN == 0);
    let arrays_dev = cuda.copy_to_device(&arrays)?;
    let array = |index: usize, first_tile: usize| ptr(&arrays_dev).offset(index * tiles + first_tile);
    for (runs, first_tile, count) in chunks {
        if let Some(scratch) = &scratch {
            for (slot, run) in runs.iter().enumerate() {
                let at = ptr(scratch).offset(slot * scratch_stride);
                match group.format {
                    ExpertFormat::Fp8(blocks) => {
                        dequantized(cuda, addresses[run.expert], blocks, inter, hidden, down, at)?;
                    }
                    _ => {
                        widened_mxfp4(cuda, addresses[run.expert], inter, hidden, down, at)?;
                    }
                }
            }
        }
        // The products in the order one GEMM per expert sums them: W_hi x_hi, + W_hi x_lo, (+ W_lo x_hi, + W_lo x_lo).
        for part in 0..weight_parts {
            for half in 0..2 {
                let accumulate = part + half > 0;
                let batch = BatchedProduct {
                    w: array(part, first_tile).cast(),
                    x: array(2 + half, first_tile).cast(),
                    out: array(4, first_tile).cast(),
                    rows: layout.tile_rows,
                    n,
                    k,
                    count,
                };
                if aligned {
                    cuda.gemm_bf16_batched(&batch, accumulate)?;
                } else {
                    // Weights cuBLAS may not read through an array (a down matrix whose offset in its block is no
                    // multiple of 16 bytes): the same problems, one call each.
                    for t in first_tile..first_tile + count {
                        let [w, x, out] = [part, 2 + half, 4].map(|a| arrays[a * tiles + t]);
                        let w = Bf16Matrix {
                            data: Ptr::at(w),
                            rows: n,
                            cols: k,
                        };
                        cuda.gemm_bf16(Ptr::at(x), layout.tile_rows, w, Ptr::at(out), n, accumulate)?;
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_padded_to_whole_tiles_of_a_power_of_two_rows() {
        // 1000 pairs over 4 runs: half the mean is 125, so tiles of 64 rows.
        let layout = TileLayout::new(&[(3, 1), (7, 64), (9, 65), (12, 870)]);
        assert_eq!(layout.tile_rows, 64);
        let firsts: Vec<usize> = layout.runs.iter().map(|r| r.first_row).collect();
        assert_eq!(firsts, [0, 64, 128, 256]);
        assert_eq!(layout.padded_rows, 256 + 896);
        assert_eq!(
            layout.runs[3],
            Run {
                expert: 12,
                first_row: 256,
                pairs: 870
            }
        );
    }

    #[test]
    fn tiles_stay_within_their_bounds() {
        assert_eq!(TileLayout::new(&[(0, 1), (1, 2)]).tile_rows, MIN_TILE_ROWS);
        assert_eq!(TileLayout::new(&[(0, 5000)]).tile_rows, MAX_TILE_ROWS);
        assert_eq!(TileLayout::new(&[(0, 5000)]).padded_rows, 5120);
    }
}
