//! The decode kernels (up to [`MOE_DECODE_MAX_ROWS`](super::MOE_DECODE_MAX_ROWS) rows): every (row, k) pair's expert read through the
//! layer's table of block addresses, bf16, FP8 or MXFP4 in registers; under offload, resident experts first and
//! each copied expert once its copy lands, summed in router order by moe_combine.

use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{MOE_DOWN_ROWS, MOE_FP8_GATE_UP_FEATURES, MOE_WARPS};

use super::{launch_combine, ResidualEpilogue};
use crate::backend::cuda::expert_format::{ExpertFormat, ExpertGlu};
use crate::backend::cuda::launch::{kernel, ptr, Ptr};
use crate::backend::cuda::offload::LayerCopies;
use crate::backend::cuda::{cuda_err, CudaBackend, CudaRouting, CudaTensor};
use crate::Result;

kernel! {
    /// moe.cu's `moe_gate_up`: `act[pair] = expert_glu(gate_e x_r, up_e x_r)` (biases added, then silu(gate) * up
    /// or the clamped SwiGLU, by [`ExpertGlu`]) for each (row, k) pair of the launch (`order[y]`, or every pair when
    /// `order` is null), the expert blocks read through the table `experts`. Also `moe_gate_up_mxfp4`, the same over
    /// MXFP4 blocks (launched by format).
    struct MoeGateUp {
        x: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u8>>,
        bias_at: i64,
        clamped: i32,
        alpha: f32,
        limit: f32,
        act: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down_pairs`: `y[pair] = down_e act[pair]` (+ its down bias) for the pairs `order[y]` of the
    /// launch, unweighted (moe_combine sums them). Also `moe_down_pairs_mxfp4`.
    struct MoeDownPairs {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u8>>,
        bias_at: i64,
        y: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down`: `out[r] = sum_k weights[r, k] * (down_e act[r * top_k + k] + down bias_e)`, in router
    /// order; with a `residual` (else null) the [`ResidualEpilogue`], its last block (counted on `counter`)
    /// normalising. Also `moe_down_mxfp4`, and each one's `_shard` twin for a table with null entries (another
    /// rank's experts under expert parallelism, which add nothing).
    struct MoeDown {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
        experts: Ptr<Ptr<u8>>,
        bias_at: i64,
        feature_groups: i32,
        out: Ptr<f32>,
        shared: Ptr<f32>,
        residual: Ptr<f32>,
        norm: Ptr<f32>,
        eps: f32,
        counter: Ptr<u32>,
    }
}

kernel! {
    /// moe.cu's `moe_gate_up_fp8`: [`MoeGateUp`] over FP8 expert blocks, whose scales cover the given blocks.
    struct MoeGateUpFp8 = "moe_gate_up_fp8" {
        x: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u8>>,
        gate_up_block_rows: i32,
        gate_up_block_cols: i32,
        down_block_rows: i32,
        down_block_cols: i32,
        act: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down_pairs_fp8`: [`MoeDownPairs`] over FP8 expert blocks.
    struct MoeDownPairsFp8 = "moe_down_pairs_fp8" {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u8>>,
        gate_up_block_rows: i32,
        gate_up_block_cols: i32,
        down_block_rows: i32,
        down_block_cols: i32,
        y: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down_fp8` (and `moe_down_fp8_shard`): [`MoeDown`] over FP8 expert blocks.
    struct MoeDownFp8 {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
        experts: Ptr<Ptr<u8>>,
        gate_up_block_rows: i32,
        gate_up_block_cols: i32,
        down_block_rows: i32,
        down_block_cols: i32,
        feature_groups: i32,
        out: Ptr<f32>,
        shared: Ptr<f32>,
        residual: Ptr<f32>,
        norm: Ptr<f32>,
        eps: f32,
        counter: Ptr<u32>,
    }
}

/// The decode kernels over every (row, k) pair: moe_gate_up, then moe_down, which sums a row's experts in router
/// order (and applies the epilogue, when given).
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_decode(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    hidden: usize,
    inter: usize,
    (format, glu, shard): (ExpertFormat, ExpertGlu, bool),
    epilogue: Option<ResidualEpilogue>,
) -> Result<CudaTensor> {
    let ([shared, residual, norm], eps) = ResidualEpilogue::pointers(epilogue);
    let counter = ptr(&cuda.block_counter);
    let pairs = routing.rows * routing.top_k;
    let act = cuda.tensor(pairs, inter)?;
    launch_gate_up(cuda, x, routing, table, Ptr::null(), pairs, &act, format, glu)?;
    let out = cuda.tensor(routing.rows, hidden)?;
    // Each warp takes (expert, feature group) items: with few experts per row, more feature groups per block
    // keep every warp busy.
    let feature_groups = (MOE_WARPS / routing.top_k).max(1);
    let block_features = feature_groups * MOE_DOWN_ROWS;
    let config = LaunchConfig {
        grid_dim: (hidden.div_ceil(block_features) as u32, routing.rows as u32, 1),
        block_dim: (MOE_WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: (routing.top_k * block_features * std::mem::size_of::<f32>()) as u32,
    };
    match format {
        ExpertFormat::Bf16 | ExpertFormat::Mxfp4 => MoeDown {
            act: ptr(&act.data),
            hidden: hidden as i32,
            inter: inter as i32,
            top_k: routing.top_k as i32,
            ids: ptr(&routing.ids),
            weights: ptr(&routing.weights),
            experts: ptr(table).cast(),
            bias_at: glu.bias_at,
            feature_groups: feature_groups as i32,
            out: ptr(&out.data),
            shared,
            residual,
            norm,
            eps,
            counter,
        }
        .launch_kernel(
            cuda,
            if format == ExpertFormat::Mxfp4 {
                if shard {
                    "moe_down_mxfp4_shard"
                } else {
                    "moe_down_mxfp4"
                }
            } else if shard {
                "moe_down_shard"
            } else {
                "moe_down"
            },
            config,
        )?,
        ExpertFormat::Fp8(blocks) => {
            let [gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols] =
                ExpertFormat::fp8_block_args(blocks);
            MoeDownFp8 {
                act: ptr(&act.data),
                hidden: hidden as i32,
                inter: inter as i32,
                top_k: routing.top_k as i32,
                ids: ptr(&routing.ids),
                weights: ptr(&routing.weights),
                experts: ptr(table).cast(),
                gate_up_block_rows,
                gate_up_block_cols,
                down_block_rows,
                down_block_cols,
                feature_groups: feature_groups as i32,
                out: ptr(&out.data),
                shared,
                residual,
                norm,
                eps,
                counter,
            }
            .launch_kernel(cuda, if shard { "moe_down_fp8_shard" } else { "moe_down_fp8" }, config)?
        }
    }
    Ok(out)
}

/// moe_gate_up (or its FP8 or MXFP4 twin) over `pairs` pairs: those listed from `order`, or the first `pairs` when
/// `order` is null.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_gate_up(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    order: Ptr<i32>,
    pairs: usize,
    act: &CudaTensor,
    format: ExpertFormat,
    glu: ExpertGlu,
) -> Result<()> {
    let inter = act.cols;
    let features_a_warp = match format {
        ExpertFormat::Fp8(_) => MOE_FP8_GATE_UP_FEATURES,
        ExpertFormat::Bf16 | ExpertFormat::Mxfp4 => 1,
    };
    let config = LaunchConfig {
        grid_dim: (inter.div_ceil(MOE_WARPS * features_a_warp) as u32, pairs as u32, 1),
        block_dim: (MOE_WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    match format {
        ExpertFormat::Bf16 | ExpertFormat::Mxfp4 => MoeGateUp {
            x: ptr(&x.data),
            hidden: x.cols as i32,
            inter: inter as i32,
            top_k: routing.top_k as i32,
            ids: ptr(&routing.ids),
            order,
            experts: ptr(table).cast(),
            bias_at: glu.bias_at,
            clamped: glu.clamped,
            alpha: glu.alpha,
            limit: glu.limit,
            act: ptr(&act.data),
        }
        .launch_kernel(
            cuda,
            if format == ExpertFormat::Mxfp4 {
                "moe_gate_up_mxfp4"
            } else {
                "moe_gate_up"
            },
            config,
        ),
        ExpertFormat::Fp8(blocks) => {
            let [gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols] =
                ExpertFormat::fp8_block_args(blocks);
            MoeGateUpFp8 {
                x: ptr(&x.data),
                hidden: x.cols as i32,
                inter: inter as i32,
                top_k: routing.top_k as i32,
                ids: ptr(&routing.ids),
                order,
                experts: ptr(table).cast(),
                gate_up_block_rows,
                gate_up_block_cols,
                down_block_rows,
                down_block_cols,
                act: ptr(&act.data),
            }
            .launch(cuda, config)
        }
    }
}

/// The decode kernels under offload while this layer's copies are in flight: the (row, k) pairs of resident
/// experts run at once, each copied expert's pairs as soon as its copy has landed (the compute stream waits on its
/// event), each pair's down product kept apart (moe_down_pairs), and moe_combine sums each row's products in router
/// order. Every pair is computed as in moe_gate_up + moe_down over all pairs, and summed in the same order, so the
/// result is the same to the bit; only when each expert's work starts differs. moe_combine applies the epilogue,
/// when given, as moe_down would.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_decode_under_copies(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    copies: &LayerCopies,
    hidden: usize,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
    epilogue: Option<ResidualEpilogue>,
) -> Result<CudaTensor> {
    let y = decode_products(cuda, x, routing, table, copies, hidden, inter, format, glu)?;
    let out = cuda.tensor(routing.rows, hidden)?;
    launch_combine(cuda, &y, routing, 0..routing.rows, None, &out, epilogue)?;
    Ok(out)
}

/// The decode path's unweighted products `[pairs, hidden]` of every pair on a device expert (resident first, then
/// each copied expert once its copy has landed); the rows of pairs on host experts are left unwritten.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_products(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    copies: &LayerCopies,
    hidden: usize,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
) -> Result<CudaTensor> {
    let pairs = routing.rows * routing.top_k;
    let ids = &copies.ids[..pairs];
    let elsewhere = |e: i32| copies.fetched.iter().any(|&(f, _)| f as i32 == e) || copies.host.contains(&(e as u32));
    // The run order: pairs on resident experts, then each fetched expert's pairs, in plan order.
    let mut order: Vec<i32> = (0..pairs as i32).filter(|&p| !elsewhere(ids[p as usize])).collect();
    let mut runs = vec![(None, 0, order.len())];
    for (expert, event) in &copies.fetched {
        let first = order.len();
        order.extend((0..pairs as i32).filter(|&p| ids[p as usize] == *expert as i32));
        runs.push((Some(event), first, order.len() - first));
    }
    let order = cuda.copy_to_device(&order)?;
    let act = cuda.tensor(pairs, inter)?;
    let y = cuda.tensor(pairs, hidden)?;
    let down_blocks = hidden.div_ceil(MOE_WARPS * MOE_DOWN_ROWS) as u32;
    cuda.stream
        .wait(&copies.resident_ready)
        .map_err(cuda_err("waiting for resident experts"))?;
    for (ready, first, len) in runs {
        if let Some(event) = ready {
            cuda.stream
                .wait(event)
                .map_err(cuda_err("waiting for an expert copy"))?;
        }
        if len == 0 {
            continue;
        }
        let run = ptr(&order).offset(first);
        launch_gate_up(cuda, x, routing, table, run, len, &act, format, glu)?;
        let config = LaunchConfig {
            grid_dim: (down_blocks, len as u32, 1),
            block_dim: (MOE_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        match format {
            ExpertFormat::Bf16 | ExpertFormat::Mxfp4 => MoeDownPairs {
                act: ptr(&act.data),
                hidden: hidden as i32,
                inter: inter as i32,
                ids: ptr(&routing.ids),
                order: run,
                experts: ptr(table).cast(),
                bias_at: glu.bias_at,
                y: ptr(&y.data),
            }
            .launch_kernel(
                cuda,
                if format == ExpertFormat::Mxfp4 {
                    "moe_down_pairs_mxfp4"
                } else {
                    "moe_down_pairs"
                },
                config,
            )?,
            ExpertFormat::Fp8(blocks) => {
                let [gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols] =
                    ExpertFormat::fp8_block_args(blocks);
                MoeDownPairsFp8 {
                    act: ptr(&act.data),
                    hidden: hidden as i32,
                    inter: inter as i32,
                    ids: ptr(&routing.ids),
                    order: run,
                    experts: ptr(table).cast(),
                    gate_up_block_rows,
                    gate_up_block_cols,
                    down_block_rows,
                    down_block_cols,
                    y: ptr(&y.data),
                }
                .launch(cuda, config)?
            }
        }
    }
    Ok(y)
}
