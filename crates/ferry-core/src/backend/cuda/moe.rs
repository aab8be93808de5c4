//! The MoE block on the GPU (moe.cu): loading a layer's routed experts (a resident slab, or the offload's bank),
//! routing on the device, the decode kernels that read the experts through the layer's table of block addresses
//! (under offload, resident experts first and each copied expert once its copy lands), and the grouped prefill
//! path, which gathers each expert's rows and runs them through cuBLAS. Experts are bf16, FP8 or MXFP4 (see
//! expert_format.rs), with or without biases, computing silu(gate) * up or gpt-oss's clamped SwiGLU: the decode
//! kernels read FP8 and MXFP4 blocks directly, the grouped path widens each expert to bf16 first. With the
//! offload's CPU lane, both paths leave the host's experts out and moe_combine reads their products from the
//! lane's upload.

use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{GEMV_MAX_ROWS, MOE_DOWN_ROWS, MOE_WARPS, ROUTER_MAX_EXPERTS};

use super::elementwise::copy_rows;
use super::expert_format::{dequantized, widened_mxfp4, with_f32_biases, ExpertFormat, ExpertGlu};
use super::launch::{grid_1d, kernel, per_row, ptr, Ptr, BLOCK_THREADS};
use super::linear::Bf16Halves;
use super::offload::{LayerCopies, Offload};
use super::workspace::MOE_GROUP_ROWS;
use super::{cuda_err, Bf16Matrix, CudaBackend, CudaExperts, CudaRouting, CudaTensor, CudaWeight};
use crate::backend::{ExpertActivation, ExpertTensors, Router, RouterKind};
use crate::{Error, Result};

/// Rows of a batch up to which the MoE block runs its decode kernels (routing never leaves the device, unless the
/// experts are offloaded).
pub(super) const MOE_DECODE_MAX_ROWS: usize = GEMV_MAX_ROWS;

kernel! {
    /// moe.cu's `route_softmax_topk`: softmax over each row's `num_experts` logits, then its `top_k` largest, one
    /// warp per row.
    struct RouteSoftmaxTopk = "route_softmax_topk" {
        logits: Ptr<f32>,
        num_experts: i32,
        top_k: i32,
        renormalize: i32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `route_sigmoid_grouped_topk`: [`RouterKind::SigmoidGroupedTopK`] over each row's `num_experts`
    /// logits with the per-expert correction `bias`, one warp per row.
    struct RouteSigmoidGroupedTopk = "route_sigmoid_grouped_topk" {
        logits: Ptr<f32>,
        bias: Ptr<f32>,
        num_experts: i32,
        n_group: i32,
        topk_group: i32,
        top_k: i32,
        renormalize: i32,
        scaling: f32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
    }
}

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
    /// order. Also `moe_down_mxfp4`.
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
    /// moe.cu's `moe_down_fp8`: [`MoeDown`] over FP8 expert blocks.
    struct MoeDownFp8 = "moe_down_fp8" {
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
    }
}

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

kernel! {
    /// moe.cu's `moe_combine`: `out[r] = sum_k weights[r, k] * y[r * top_k + k]`, in router order, a pair's product
    /// read from row `host_index[pair]` of `host_y` where that is not negative (the CPU lane's; null: none).
    struct MoeCombine = "moe_combine" {
        y: Ptr<f32>,
        weights: Ptr<f32>,
        top_k: i32,
        hidden: i32,
        host_y: Ptr<f32>,
        host_index: Ptr<i32>,
        out: Ptr<f32>,
    }
}

/// The CPU lane's products of a batch on the device: `[host pairs, hidden]`, and per (row, k) pair of the batch its
/// row there or -1.
struct HostProducts {
    products: CudaTensor,
    index: CudaSlice<i32>,
}

/// One group of rows of the grouped MoE path, and the experts' shape.
struct ExpertGroup {
    first_row: usize,
    rows: usize,
    hidden: usize,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
}

/// [`crate::backend::Backend::experts`]: into the offload's bank when offload is on, else into one slab of the
/// layer's expert blocks (gate, up, down, back to back: the layout moe.cu reads).
pub(super) fn upload_experts(
    cuda: &CudaBackend,
    experts: Vec<ExpertTensors>,
    activation: ExpertActivation,
) -> Result<CudaExperts> {
    let format = ExpertFormat::of(&experts)?;
    let biased = experts.iter().any(ExpertTensors::has_bias);
    let (inter, hidden) = (experts[0].gate.shape[0], experts[0].gate.shape[1]);
    let glu = ExpertGlu::new(activation, format, inter, hidden, biased);
    if matches!(format, ExpertFormat::Fp8(_)) && !glu.is_plain() {
        return Err(Error::Config(format!(
            "the CUDA backend has no FP8 expert kernels for {activation:?}{} yet (bf16 and MXFP4 have)",
            if biased { " with biases" } else { "" }
        )));
    }
    let experts: Vec<ExpertTensors> = experts
        .into_iter()
        .map(|e| with_f32_biases(e, biased))
        .collect::<Result<_>>()?;
    if let Some(offload) = &cuda.offload {
        let layer = offload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_layer(&cuda.stream, &experts, glu)?;
        let table = cuda
            .stream
            .alloc_zeros::<u64>(experts.len())
            .map_err(cuda_err("allocating a slot table"))?;
        return Ok(CudaExperts::Offloaded {
            layer,
            table,
            hidden,
            inter,
            format,
            glu,
        });
    }
    let block = format.block_bytes(inter, hidden, biased);
    let mut slab: CudaSlice<u8> = cuda.alloc(block * experts.len())?;
    for (e, expert) in experts.iter().enumerate() {
        let mut start = e * block;
        for bytes in format.block_parts(expert)? {
            let mut dst = slab.slice_mut(start..start + bytes.len());
            cuda.stream
                .memcpy_htod(bytes, &mut dst)
                .map_err(cuda_err("uploading experts"))?;
            start += bytes.len();
        }
    }
    let base = ptr(&slab).address();
    let addresses: Vec<u64> = (0..experts.len()).map(|e| base + (e * block) as u64).collect();
    Ok(CudaExperts::Resident {
        table: cuda.copy_to_device(&addresses)?,
        _slab: slab,
        addresses,
        hidden,
        inter,
        format,
        glu,
    })
}

/// [`crate::backend::Backend::check_router`]: moe.cu has a kernel for every [`RouterKind`].
pub(super) fn check_router(kind: RouterKind) -> Result<()> {
    match kind {
        RouterKind::SoftmaxTopK { .. } | RouterKind::SigmoidGroupedTopK { .. } => Ok(()),
    }
}

/// [`crate::backend::Backend::route`]: the router kernel of the kind, on the device, whether the routing stays
/// there (decode) or its ids go to the host (offload's plan).
pub(super) fn route(cuda: &CudaBackend, logits: &CudaTensor, router: Router<'_, CudaWeight>) -> Result<CudaRouting> {
    let (kind, top_k) = (router.kind, router.top_k);
    kind.check(logits.cols, top_k)
        .map_err(|e| Error::Shape(format!("route: {e}")))?;
    if logits.cols > ROUTER_MAX_EXPERTS {
        return Err(Error::Cuda(format!(
            "{} experts is over the router kernel's {ROUTER_MAX_EXPERTS}",
            logits.cols
        )));
    }
    let ids: CudaSlice<i32> = cuda.alloc(logits.rows * top_k)?;
    let weights: CudaSlice<f32> = cuda.alloc(logits.rows * top_k)?;
    let grid = per_row(logits.rows, 32);
    match (kind, router.correction_bias) {
        (RouterKind::SoftmaxTopK { renormalize }, None) => RouteSoftmaxTopk {
            logits: ptr(&logits.data),
            num_experts: logits.cols as i32,
            top_k: top_k as i32,
            renormalize: renormalize as i32,
            ids: ptr(&ids),
            weights: ptr(&weights),
        }
        .launch(cuda, grid)?,
        (
            RouterKind::SigmoidGroupedTopK {
                n_group,
                topk_group,
                renormalize,
                scaling,
            },
            Some(bias),
        ) => {
            let bias = match bias {
                CudaWeight::Vector(v) if v.len() == logits.cols => ptr(v),
                _ => {
                    return Err(Error::Shape(format!(
                        "route: the correction bias is not a vector of the {} experts",
                        logits.cols
                    )))
                }
            };
            RouteSigmoidGroupedTopk {
                logits: ptr(&logits.data),
                bias,
                num_experts: logits.cols as i32,
                n_group: n_group as i32,
                topk_group: topk_group as i32,
                top_k: top_k as i32,
                renormalize: renormalize as i32,
                scaling,
                ids: ptr(&ids),
                weights: ptr(&weights),
            }
            .launch(cuda, grid)?
        }
        (kind, bias) => {
            return Err(Error::Shape(format!(
                "route: {kind:?} {} a correction bias",
                if bias.is_none() { "needs" } else { "takes no" }
            )))
        }
    }
    Ok(CudaRouting {
        ids,
        weights,
        rows: logits.rows,
        top_k,
    })
}

pub(super) fn routing_to_host(cuda: &CudaBackend, routing: &CudaRouting) -> Result<Vec<u32>> {
    let ids = cuda
        .stream
        .clone_dtoh(&routing.ids)
        .map_err(cuda_err("routing to host"))?;
    Ok(ids
        .into_iter()
        .take(routing.rows * routing.top_k)
        .map(|e| e as u32)
        .collect())
}

pub(super) fn routing_from_host(cuda: &CudaBackend, ids: &[u32], weights: &[f32], top_k: usize) -> Result<CudaRouting> {
    let signed: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
    Ok(CudaRouting {
        ids: cuda.copy_to_device(&signed)?,
        weights: cuda.copy_to_device(weights)?,
        rows: ids.len() / top_k.max(1),
        top_k,
    })
}

/// [`crate::backend::Backend::moe_experts`]: the decode kernels for a few rows, the grouped path for more.
pub(super) fn moe_experts(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    experts: &CudaExperts,
) -> Result<CudaTensor> {
    let (hidden, inter) = experts.shape();
    let (format, glu) = (experts.format(), experts.glu());
    let (table, layer) = match experts {
        CudaExperts::Resident { table, addresses, .. } => {
            if x.rows > MOE_DECODE_MAX_ROWS {
                let ids = cuda
                    .stream
                    .clone_dtoh(&routing.ids)
                    .map_err(cuda_err("routing to host"))?;
                return moe_experts_grouped(cuda, x, routing, &ids, addresses, hidden, inter, format, glu);
            }
            return moe_decode(cuda, x, routing, table, hidden, inter, format, glu);
        }
        CudaExperts::Offloaded { layer, table, .. } => (table, *layer),
    };
    let offload = cuda
        .offload
        .as_ref()
        .ok_or_else(|| Error::Cuda("offloaded experts without offload".into()))?;
    let mut offload = offload.lock().unwrap_or_else(|e| e.into_inner());
    let copies = offload.prepare_layer(&cuda.stream, layer, routing, table, x)?;
    if !copies.host.is_empty() {
        return moe_with_host_lane(
            cuda,
            &mut offload,
            layer,
            x,
            routing,
            table,
            &copies,
            inter,
            format,
            glu,
        );
    }
    drop(offload);
    if x.rows > MOE_DECODE_MAX_ROWS || copies.fetched.is_empty() {
        cuda.stream
            .wait(copies.all_ready())
            .map_err(cuda_err("waiting for expert copies"))?;
        if x.rows > MOE_DECODE_MAX_ROWS {
            return moe_experts_grouped(
                cuda,
                x,
                routing,
                &copies.ids,
                &copies.addresses,
                hidden,
                inter,
                format,
                glu,
            );
        }
        return moe_decode(cuda, x, routing, table, hidden, inter, format, glu);
    }
    moe_decode_under_copies(cuda, x, routing, table, &copies, hidden, inter, format, glu)
}

/// The decode kernels over every (row, k) pair: moe_gate_up, then moe_down, which sums a row's experts in router
/// order.
#[allow(clippy::too_many_arguments)]
fn moe_decode(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    hidden: usize,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
) -> Result<CudaTensor> {
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
        }
        .launch_kernel(
            cuda,
            if format == ExpertFormat::Mxfp4 {
                "moe_down_mxfp4"
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
            }
            .launch(cuda, config)?
        }
    }
    Ok(out)
}

/// moe_gate_up (or its FP8 or MXFP4 twin) over `pairs` pairs: those listed from `order`, or the first `pairs` when
/// `order` is null.
#[allow(clippy::too_many_arguments)]
fn launch_gate_up(
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
    let config = LaunchConfig {
        grid_dim: (inter.div_ceil(MOE_WARPS) as u32, pairs as u32, 1),
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
/// result is the same to the bit; only when each expert's work starts differs.
#[allow(clippy::too_many_arguments)]
fn moe_decode_under_copies(
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
    let y = decode_products(cuda, x, routing, table, copies, hidden, inter, format, glu)?;
    let out = cuda.tensor(routing.rows, hidden)?;
    launch_combine(cuda, &y, routing, 0..routing.rows, None, &out)?;
    Ok(out)
}

/// The decode path's unweighted products `[pairs, hidden]` of every pair on a device expert (resident first, then
/// each copied expert once its copy has landed); the rows of pairs on host experts are left unwritten.
#[allow(clippy::too_many_arguments)]
fn decode_products(
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

/// moe_combine over `rows` of the batch: `y` holds those rows' products (its first row is `rows.start`'s first
/// pair), `host` the lane's products of the whole batch.
fn launch_combine(
    cuda: &CudaBackend,
    y: &CudaTensor,
    routing: &CudaRouting,
    rows: std::ops::Range<usize>,
    host: Option<&HostProducts>,
    out: &CudaTensor,
) -> Result<()> {
    let (top_k, hidden) = (routing.top_k, out.cols);
    let first_pair = rows.start * top_k;
    let (host_y, host_index) = match host {
        Some(h) => (ptr(&h.products.data), ptr(&h.index).offset(first_pair)),
        None => (Ptr::null(), Ptr::null()),
    };
    let combine = MoeCombine {
        y: ptr(&y.data),
        weights: ptr(&routing.weights).offset(first_pair),
        top_k: top_k as i32,
        hidden: hidden as i32,
        host_y,
        host_index,
        out: ptr(&out.data).offset(rows.start * hidden),
    };
    combine.launch(cuda, per_row(rows.len(), BLOCK_THREADS))
}

/// The MoE block under offload when the CPU lane takes some of this layer's misses (`copies.host`): the lane
/// starts on their pairs from the bank and this thread queues the GPU's share (every decode pair, or the first
/// row group of a larger batch), then the stream's wait for the lane and the products' upload, then moe_combine,
/// which sums each row's pairs in router order, each from wherever it was computed. The host does not wait for
/// the lane here: it goes on queuing the rest of the layer and the next while the lane and the GPU compute. Each product differs from the GPU's only in the order of its
/// dot products' additions (f32 on both sides); the sum over a row's experts is the same expression in the same
/// order.
#[allow(clippy::too_many_arguments)]
fn moe_with_host_lane(
    cuda: &CudaBackend,
    offload: &mut Offload,
    layer: usize,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    copies: &LayerCopies,
    inter: usize,
    format: ExpertFormat,
    glu: ExpertGlu,
) -> Result<CudaTensor> {
    let hidden = x.cols;
    let pairs = routing.rows * routing.top_k;
    // Per expert id, its place in `copies.host` (or -1).
    let mut host_at = vec![-1i32; copies.addresses.len()];
    for (at, &e) in copies.host.iter().enumerate() {
        *host_at.get_mut(e as usize).ok_or_else(|| {
            Error::Cuda(format!(
                "routed to expert {e} of a layer of {} experts",
                copies.addresses.len()
            ))
        })? = at as i32;
    }
    let mut index = vec![-1i32; pairs];
    let mut host_pairs: Vec<(u32, u32)> = Vec::new();
    for (pair, &e) in copies.ids[..pairs].iter().enumerate() {
        let at = host_at.get(e as usize).copied().unwrap_or(-1);
        if at >= 0 {
            index[pair] = host_pairs.len() as i32;
            host_pairs.push(((pair / routing.top_k) as u32, at as u32));
        }
    }
    let host = HostProducts {
        products: cuda.tensor(host_pairs.len(), hidden)?,
        index: cuda.copy_to_device(&index)?,
    };
    let on_host = |pair: usize| index[pair] >= 0;
    let out = cuda.tensor(routing.rows, hidden)?;
    offload.start_on_host(layer, (x.rows, hidden), inter, &copies.host, host_pairs)?;
    if x.rows <= MOE_DECODE_MAX_ROWS {
        let y = decode_products(cuda, x, routing, table, copies, hidden, inter, format, glu)?;
        offload.queue_host_products(&cuda.stream, &host.products)?;
        launch_combine(cuda, &y, routing, 0..routing.rows, Some(&host), &out)?;
        return Ok(out);
    }
    cuda.stream
        .wait(copies.all_ready())
        .map_err(cuda_err("waiting for expert copies"))?;
    let groups: Vec<ExpertGroup> = (0..routing.rows)
        .step_by(MOE_GROUP_ROWS)
        .map(|first_row| ExpertGroup {
            first_row,
            rows: MOE_GROUP_ROWS.min(routing.rows - first_row),
            hidden,
            inter,
            format,
            glu,
        })
        .collect();
    let products =
        |group: &ExpertGroup| group_products(cuda, x, routing, &copies.ids, &copies.addresses, group, &on_host);
    let first = products(&groups[0])?;
    offload.queue_host_products(&cuda.stream, &host.products)?;
    launch_combine(cuda, &first, routing, 0..groups[0].rows, Some(&host), &out)?;
    drop(first);
    for group in &groups[1..] {
        let y = products(group)?;
        launch_combine(
            cuda,
            &y,
            routing,
            group.first_row..group.first_row + group.rows,
            Some(&host),
            &out,
        )?;
    }
    Ok(out)
}

/// The MoE block for a batch too large for the decode kernels, its routed `ids` on the host: the rows run in
/// groups of at most [`MOE_GROUP_ROWS`] (bounding the workspace of long steps), each expert's rows of a group
/// gathered and run through cuBLAS, and the results combined in router order.
#[allow(clippy::too_many_arguments)]
fn moe_experts_grouped(
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
fn group_products(
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
