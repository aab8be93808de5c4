//! The grouped path for batches past the decode kernels: a row group's (row, k) pairs gathered by expert into
//! whole tiles of rows and run through a few batched cuBLAS GEMMs (tiles.rs; FP8 experts as bf16 halves, MXFP4
//! widened to bf16), the activation and biases applied, the products combined in router order.

use cudarc::driver::CudaSlice;

use super::{launch_combine, HostProducts};
use crate::backend::cuda::elementwise::copy_rows;
use crate::backend::cuda::expert_format::{ExpertFormat, ExpertGlu};
use crate::backend::cuda::launch::{grid_1d, kernel, ptr, Ptr, BLOCK_THREADS};
use crate::backend::cuda::workspace::MOE_GROUP_ROWS;
use crate::backend::cuda::{CudaBackend, CudaRouting, CudaTensor};
use crate::Result;
use tiles::{project, TileLayout};

mod tiles;

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
/// gathered and run through batched cuBLAS GEMMs, and the results combined in router order. Pairs routed to an
/// expert this backend does not hold (a null address: another rank's, under expert parallelism) are left out and
/// add nothing: moe_combine reads them from a row of zeros.
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
    let elsewhere: Vec<bool> = ids.iter().map(|&e| addresses[e as usize] == 0).collect();
    let zeros = match elsewhere.iter().any(|&absent| absent) {
        true => Some(HostProducts {
            products: cuda.zeros(1, hidden)?,
            index: cuda.copy_to_device(
                &elsewhere
                    .iter()
                    .map(|&absent| if absent { 0 } else { -1 })
                    .collect::<Vec<i32>>(),
            )?,
        }),
        false => None,
    };
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
        let y = group_products(cuda, x, routing, ids, addresses, &group, &|pair| elsewhere[pair])?;
        launch_combine(
            cuda,
            &y,
            routing,
            first_row..first_row + group.rows,
            zeros.as_ref(),
            &out,
            None,
        )?;
    }
    Ok(out)
}

/// The unweighted products `[group pairs, hidden]` of rows `group.first_row..+group.rows`, except the pairs (of
/// the whole batch) for which `on_host` holds, whose rows hold another pair's product (moe_combine reads theirs
/// from the CPU lane's).
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
        glu,
        ..
    } = group;
    let top_k = routing.top_k;
    let first_pair = first_row * top_k;
    let group_pairs = rows * top_k;
    let ids = &ids[first_pair..first_pair + group_pairs];
    // The group's device pairs ordered by expert (stably, so rows keep their order): each expert's pairs are one
    // run, laid out in whole tiles (tiles.rs) in the padded buffers below.
    let mut order: Vec<u32> = (0..group_pairs as u32)
        .filter(|&pair| !on_host(first_pair + pair as usize))
        .collect();
    if order.is_empty() {
        return cuda.tensor(group_pairs, hidden);
    }
    order.sort_by_key(|&pair| ids[pair as usize]);
    let mut runs: Vec<(usize, usize)> = Vec::new(); // (expert, pairs)
    for &pair in &order {
        let e = ids[pair as usize] as usize;
        match runs.last_mut() {
            Some((last, len)) if *last == e => *len += 1,
            _ => runs.push((e, 1)),
        }
    }
    let layout = TileLayout::new(&runs);
    // Per padded row, the row of x it is gathered from (padding: the group's first, computed and never read) and,
    // with biases, its expert's block address; per pair of the group, its padded row (the host's: any).
    let mut source_rows = vec![first_row as u32; layout.padded_rows];
    let mut row_blocks = vec![0u64; layout.padded_rows];
    let mut padded_row_of_pair = vec![0u32; group_pairs];
    let mut sorted = order.iter();
    for run in &layout.runs {
        for (row, &pair) in (run.first_row..).zip(sorted.by_ref().take(run.pairs)) {
            source_rows[row] = (first_row + pair as usize / top_k) as u32;
            padded_row_of_pair[pair as usize] = row as u32;
        }
        let padded_end = run.first_row + run.pairs.div_ceil(layout.tile_rows) * layout.tile_rows;
        row_blocks[run.first_row..padded_end].fill(addresses[run.expert]);
    }
    let padded = layout.padded_rows;
    // Each buffer is dropped (freed in stream order) once read, so that at most 2 * (hidden + inter) floats per
    // padded row are alive at once (budget.rs's workspace estimate counts them per pair; the padding adds under
    // half the pairs, a quarter on average, or under 16 rows per expert when runs are short: within the margin
    // of the estimate, which doubles the activations).
    // Launches per group (bf16 experts): gather, split, 2 batched GEMMs for gate and up together (one per
    // activation half), the activation, split, 2 batched GEMMs for down, (the down bias,) the gather back into
    // router order: 9 (10), then moe_combine. FP8 adds a GEMM per activation half per projection and chunk of
    // experts (WIDENED_BYTES), and FP8 and MXFP4 a widening launch per expert and projection.
    let gathered = cuda.tensor(padded, hidden)?;
    copy_rows(
        cuda,
        "gather_rows",
        x,
        &cuda.copy_to_device(&source_rows)?,
        padded,
        &gathered,
    )?;
    let gate_up = cuda.tensor(padded, 2 * inter)?;
    let halves = cuda.split_bf16(&gathered)?;
    drop(gathered);
    project(cuda, &layout, &halves, addresses, group, false, &gate_up)?;
    drop(halves);
    let act = cuda.tensor(padded, inter)?;
    let row_blocks: Option<CudaSlice<u64>> = match glu.biased() {
        true => Some(cuda.copy_to_device(&row_blocks)?),
        false => None,
    };
    let row_blocks_ptr = row_blocks.as_ref().map_or(Ptr::null(), |b| ptr(b).cast());
    let values = grid_1d(padded * inter, BLOCK_THREADS);
    if glu.is_plain() {
        let silu_mul = SiluMulHalves {
            x: ptr(&gate_up.data),
            half: inter as i32,
            out: ptr(&act.data),
            n: padded * inter,
        };
        silu_mul.launch(cuda, values)?;
    } else {
        let launch = MoeGluGrouped {
            gate_up: ptr(&gate_up.data),
            inter: inter as i32,
            pair_blocks: row_blocks_ptr,
            bias_at: glu.bias_at,
            clamped: glu.clamped,
            alpha: glu.alpha,
            limit: glu.limit,
            act: ptr(&act.data),
            n: padded * inter,
        };
        launch.launch(cuda, values)?;
    }
    drop(gate_up);
    let halves = cuda.split_bf16(&act)?;
    drop(act);
    let by_expert = cuda.tensor(padded, hidden)?;
    project(cuda, &layout, &halves, addresses, group, true, &by_expert)?;
    drop(halves);
    if glu.biased() {
        let launch = MoeAddDownBias {
            y: ptr(&by_expert.data),
            hidden: hidden as i32,
            inter: inter as i32,
            pair_blocks: row_blocks_ptr,
            bias_at: glu.bias_at,
            n: padded * hidden,
        };
        launch.launch(cuda, grid_1d(padded * hidden, BLOCK_THREADS))?;
    }
    let y = cuda.tensor(group_pairs, hidden)?;
    let padded_rows_dev = cuda.copy_to_device(&padded_row_of_pair)?;
    copy_rows(cuda, "gather_rows", &by_expert, &padded_rows_dev, group_pairs, &y)?;
    Ok(y)
}
