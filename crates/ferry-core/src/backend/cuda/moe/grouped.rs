//! The grouped path for batches past the decode kernels: each expert's rows of a row group gathered and run
//! through cuBLAS (FP8 experts as bf16 halves, MXFP4 widened to bf16), the activation and biases applied, the
//! products combined in router order.

use cudarc::driver::CudaSlice;

use super::launch_combine;
use crate::backend::cuda::elementwise::copy_rows;
use crate::backend::cuda::expert_format::{dequantized, widened_mxfp4, ExpertFormat, ExpertGlu};
use crate::backend::cuda::launch::{grid_1d, kernel, ptr, Ptr, BLOCK_THREADS};
use crate::backend::cuda::linear::Bf16Halves;
use crate::backend::cuda::workspace::MOE_GROUP_ROWS;
use crate::backend::cuda::{Bf16Matrix, CudaBackend, CudaRouting, CudaTensor};
use crate::Result;

kernel! {
    /// moe.cu's `moe_glu_grouped`: the grouped path's activation of `[pairs, 2 * inter]` gate/up products, pair p's
    /// biases read from the block at `pair_blocks[p]` (null: none).
    struct MoeGluGrouped = "moe_glu_grouped" {
        gate_up: Ptr<f32>,
        inter: i32,
        pair_blocks: Ptr<Ptr<u8>>,
        bias_at: i64,
        clamped: i32,
        alpha: f32,
        limit: f32,
        act: Ptr<f32>,
        n: usize,
    }
}

kernel! {
    /// moe.cu's `moe_add_down_bias`: each pair's down bias (of the block at `pair_blocks[p]`) added to its row of
    /// `y` (`[pairs, hidden]`, n values).
    struct MoeAddDownBias = "moe_add_down_bias" {
        y: Ptr<f32>,
        hidden: i32,
        inter: i32,
        pair_blocks: Ptr<Ptr<u8>>,
        bias_at: i64,
        n: usize,
    }
}

kernel! {
    /// elementwise.cu's `silu_mul_halves`: `out[r, i] = silu(x[r, i]) * x[r, half + i]` over the n values of out.
    struct SiluMulHalves = "silu_mul_halves" {
        x: Ptr<f32>,
        half: i32,
        out: Ptr<f32>,
        n: usize,
    }
}

/// One group of rows of the grouped MoE path, and the experts' shape.
pub(super) struct ExpertGroup {
    pub(super) first_row: usize,
    pub(super) rows: usize,
    pub(super) hidden: usize,
    pub(super) inter: usize,
    pub(super) format: ExpertFormat,
    pub(super) glu: ExpertGlu,
}

/// The MoE block for a batch too large for the decode kernels, its routed `ids` on the host: the rows run in
/// groups of at most [`MOE_GROUP_ROWS`] (bounding the workspace of long steps), each expert's rows of a group
/// gathered and run through cuBLAS, and the results combined in router order.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_experts_grouped(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    ids: &[i32],
    addresses: &[u64],
    hidden: usize,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
) -> Result<CudaTensor> {
    let out = cuda.tensor(routing.rows, hidden)?;
    for first_row in (0..routing.rows).step_by(MOE_GROUP_ROWS) {
        let group = ExpertGroup {
            first_row,
            rows: MOE_GROUP_ROWS.min(routing.rows - first_row),
            hidden,
            inter,
            format,
            glu,
        };
        let y = group_products(cuda, x, routing, ids, addresses, &group, &|_| false)?;
        launch_combine(cuda, &y, routing, first_row..first_row + group.rows, None, &out)?;
    }
    Ok(out)
}

/// The unweighted products `[group pairs, hidden]` of rows `group.first_row..+group.rows`, except the pairs (of
/// the whole batch) for which `on_host` holds, whose rows are left unwritten.
pub(super) fn group_products(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    ids: &[i32],
    addresses: &[u64],
    group: &ExpertGroup,
    on_host: &dyn Fn(usize) -> bool,
) -> Result<CudaTensor> {
    let &ExpertGroup {
        first_row,
        rows,
        hidden,
        inter,
        format,
        glu,
    } = group;
    let top_k = routing.top_k;
    let first_pair = first_row * top_k;
    let group_pairs = rows * top_k;
    let ids = &ids[first_pair..first_pair + group_pairs];
    // The group's device pairs ordered by expert (stably, so rows keep their order): each expert's pairs are one
    // contiguous run, which its GEMMs read and write in place.
    let mut order: Vec<u32> = (0..group_pairs as u32)
        .filter(|&pair| !on_host(first_pair + pair as usize))
        .collect();
    if order.is_empty() {
        return cuda.tensor(group_pairs, hidden);
    }
    order.sort_by_key(|&pair| ids[pair as usize]);
    let pairs = order.len();
    let source_rows: Vec<u32> = order
        .iter()
        .map(|&pair| (first_row + pair as usize / top_k) as u32)
        .collect();
    let (order_dev, source_rows_dev) = (cuda.copy_to_device(&order)?, cuda.copy_to_device(&source_rows)?);
    let gathered = cuda.tensor(pairs, hidden)?;
    copy_rows(cuda, "gather_rows", x, &source_rows_dev, pairs, &gathered)?;
    let mut runs: Vec<(usize, usize, usize)> = Vec::new(); // (expert, first pair, pairs)
    for (i, &pair) in order.iter().enumerate() {
        let e = ids[pair as usize] as usize;
        match runs.last_mut() {
            Some((last, _, len)) if *last == e => *len += 1,
            _ => runs.push((e, i, 1)),
        }
    }
    // Each buffer is dropped (freed in stream order) once read, so that at most 2 * (hidden + inter) floats per
    // pair are alive at once (budget.rs's workspace estimate counts on it).
    // Gate and up are adjacent in an expert's block: one [2 * inter, hidden] product; down follows them. FP8
    // experts are dequantized to bf16 first, each into the one scratch buffer (the stream orders its reuse).
    // (as bf16 halves hi + lo, one product each: see expert_format.rs). MXFP4 experts are widened to bf16, exactly.
    let scratch: Option<CudaSlice<u16>> = match format {
        ExpertFormat::Bf16 => None,
        ExpertFormat::Fp8(_) => Some(cuda.alloc(4 * inter * hidden)?),
        ExpertFormat::Mxfp4 => Some(cuda.alloc(2 * inter * hidden)?),
    };
    let product =
        |halves: &Bf16Halves, first: usize, len: usize, e: usize, down: bool, out: &CudaTensor| -> Result<()> {
            match (format, &scratch) {
                (ExpertFormat::Fp8(blocks), Some(scratch)) => {
                    let [hi, lo] = dequantized(cuda, addresses[e], blocks, inter, hidden, down, ptr(scratch))?;
                    cuda.gemm_split_into(halves, first, len, hi, out, false)?;
                    cuda.gemm_split_into(halves, first, len, lo, out, true)
                }
                (ExpertFormat::Mxfp4, Some(scratch)) => {
                    let widened = widened_mxfp4(cuda, addresses[e], inter, hidden, down, ptr(scratch))?;
                    cuda.gemm_split(halves, first, len, widened, out)
                }
                _ if down => cuda.gemm_split(
                    halves,
                    first,
                    len,
                    Bf16Matrix {
                        data: Ptr::at(addresses[e]).offset(2 * inter * hidden),
                        rows: hidden,
                        cols: inter,
                    },
                    out,
                ),
                _ => cuda.gemm_split(
                    halves,
                    first,
                    len,
                    Bf16Matrix {
                        data: Ptr::at(addresses[e]),
                        rows: 2 * inter,
                        cols: hidden,
                    },
                    out,
                ),
            }
        };
    let gate_up = cuda.tensor(pairs, 2 * inter)?;
    let halves = cuda.split_bf16(&gathered)?;
    drop(gathered);
    for &(e, first, len) in &runs {
        product(&halves, first, len, e, false, &gate_up)?;
    }
    drop(halves);
    let act = cuda.tensor(pairs, inter)?;
    // With biases, each pair's block address, for its biases.
    let pair_blocks: Option<CudaSlice<u64>> = match glu.biased() {
        true => {
            let blocks: Vec<u64> = order
                .iter()
                .map(|&pair| addresses[ids[pair as usize] as usize])
                .collect();
            Some(cuda.copy_to_device(&blocks)?)
        }
        false => None,
    };
    let pair_blocks_ptr = pair_blocks.as_ref().map_or(Ptr::null(), |b| ptr(b).cast());
    let values = grid_1d(pairs * inter, BLOCK_THREADS);
    if glu.is_plain() {
        let silu_mul = SiluMulHalves {
            x: ptr(&gate_up.data),
            half: inter as i32,
            out: ptr(&act.data),
            n: pairs * inter,
        };
        silu_mul.launch(cuda, values)?;
    } else {
        let launch = MoeGluGrouped {
            gate_up: ptr(&gate_up.data),
            inter: inter as i32,
            pair_blocks: pair_blocks_ptr,
            bias_at: glu.bias_at,
            clamped: glu.clamped,
            alpha: glu.alpha,
            limit: glu.limit,
            act: ptr(&act.data),
            n: pairs * inter,
        };
        launch.launch(cuda, values)?;
    }
    drop(gate_up);
    let halves = cuda.split_bf16(&act)?;
    drop(act);
    let by_expert = cuda.tensor(pairs, hidden)?;
    for &(e, first, len) in &runs {
        product(&halves, first, len, e, true, &by_expert)?;
    }
    drop(halves);
    if glu.biased() {
        let launch = MoeAddDownBias {
            y: ptr(&by_expert.data),
            hidden: hidden as i32,
            inter: inter as i32,
            pair_blocks: pair_blocks_ptr,
            bias_at: glu.bias_at,
            n: pairs * hidden,
        };
        launch.launch(cuda, grid_1d(pairs * hidden, BLOCK_THREADS))?;
    }
    let y = cuda.tensor(group_pairs, hidden)?;
    copy_rows(cuda, "scatter_rows", &by_expert, &order_dev, pairs, &y)?;
    Ok(y)
}
