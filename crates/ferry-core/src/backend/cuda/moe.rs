//! The MoE block on the GPU (moe.cu): loading a layer's routed experts (a resident slab, or the offload's bank),
//! routing on the device, the decode kernels that read the experts through the layer's table of block addresses
//! (under offload, resident experts first and each copied expert once its copy lands), and the grouped prefill
//! path, which gathers each expert's rows and runs them through cuBLAS.

use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{GEMV_MAX_ROWS, MOE_DOWN_ROWS, MOE_WARPS, ROUTER_MAX_EXPERTS};

use super::elementwise::copy_rows;
use super::launch::{grid_1d, kernel, per_row, ptr, Ptr, BLOCK_THREADS};
use super::memory::bf16_bytes;
use super::offload::LayerCopies;
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
    /// moe.cu's `moe_gate_up`: `act[pair] = silu(gate_e x_r) * (up_e x_r)` for each (row, k) pair of the launch
    /// (`order[y]`, or every pair when `order` is null), the expert blocks read through the table `experts`.
    struct MoeGateUp = "moe_gate_up" {
        x: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u16>>,
        act: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down_pairs`: `y[pair] = down_e act[pair]` for the pairs `order[y]` of the launch, unweighted
    /// (moe_combine sums them).
    struct MoeDownPairs = "moe_down_pairs" {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        ids: Ptr<i32>,
        order: Ptr<i32>,
        experts: Ptr<Ptr<u16>>,
        y: Ptr<f32>,
    }
}

kernel! {
    /// moe.cu's `moe_down`: `out[r] = sum_k weights[r, k] * down_e act[r * top_k + k]`, in router order.
    struct MoeDown = "moe_down" {
        act: Ptr<f32>,
        hidden: i32,
        inter: i32,
        top_k: i32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
        experts: Ptr<Ptr<u16>>,
        feature_groups: i32,
        out: Ptr<f32>,
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
    /// moe.cu's `moe_combine`: `out[r] = sum_k weights[r, k] * y[r * top_k + k]`, in router order.
    struct MoeCombine = "moe_combine" {
        y: Ptr<f32>,
        weights: Ptr<f32>,
        top_k: i32,
        hidden: i32,
        out: Ptr<f32>,
    }
}

/// One group of rows of the grouped MoE path, and the experts' shape.
struct ExpertGroup {
    first_row: usize,
    rows: usize,
    hidden: usize,
    inter: usize,
}

/// [`crate::backend::Backend::experts`]: into the offload's bank when offload is on, else into one slab of the
/// layer's expert blocks (gate, up, down, back to back: the layout moe.cu reads).
pub(super) fn upload_experts(
    cuda: &CudaBackend,
    experts: Vec<ExpertTensors>,
    activation: ExpertActivation,
) -> Result<CudaExperts> {
    let biased = experts.iter().any(ExpertTensors::has_bias);
    if activation != ExpertActivation::SiluGlu || biased {
        let biases = if biased { " with biases" } else { "" };
        return Err(Error::Config(format!(
            "the CUDA backend has no expert kernels for {activation:?}{biases} yet (the CPU backend has)"
        )));
    }
    let first = experts
        .first()
        .ok_or_else(|| Error::Cuda("a MoE layer without experts".into()))?;
    let (inter, hidden) = (first.gate.shape[0], first.gate.shape[1]);
    if let Some(offload) = &cuda.offload {
        let layer = offload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_layer(&cuda.stream, &experts)?;
        let table = cuda
            .stream
            .alloc_zeros::<u64>(experts.len())
            .map_err(cuda_err("allocating a slot table"))?;
        return Ok(CudaExperts::Offloaded {
            layer,
            table,
            hidden,
            inter,
        });
    }
    // One expert's gate, up and down, back to back, in bytes.
    let block = 3 * inter * hidden * 2;
    let mut slab: CudaSlice<u8> = cuda.alloc(block * experts.len())?;
    for (e, expert) in experts.iter().enumerate() {
        for (part, t) in [&expert.gate, &expert.up, &expert.down].into_iter().enumerate() {
            let bytes = bf16_bytes(t)?;
            let start = e * block + part * inter * hidden * 2;
            let mut dst = slab.slice_mut(start..start + bytes.len());
            cuda.stream
                .memcpy_htod(bytes, &mut dst)
                .map_err(cuda_err("uploading experts"))?;
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
    let (table, layer) = match experts {
        CudaExperts::Resident { table, addresses, .. } => {
            if x.rows > MOE_DECODE_MAX_ROWS {
                let ids = cuda
                    .stream
                    .clone_dtoh(&routing.ids)
                    .map_err(cuda_err("routing to host"))?;
                return moe_experts_grouped(cuda, x, routing, &ids, addresses, hidden, inter);
            }
            return moe_decode(cuda, x, routing, table, hidden, inter);
        }
        CudaExperts::Offloaded { layer, table, .. } => (table, *layer),
    };
    let offload = cuda
        .offload
        .as_ref()
        .ok_or_else(|| Error::Cuda("offloaded experts without offload".into()))?;
    let copies =
        offload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .prepare_layer(&cuda.stream, layer, routing, table)?;
    if x.rows > MOE_DECODE_MAX_ROWS || copies.fetched.is_empty() {
        cuda.stream
            .wait(copies.all_ready())
            .map_err(cuda_err("waiting for expert copies"))?;
        if x.rows > MOE_DECODE_MAX_ROWS {
            return moe_experts_grouped(cuda, x, routing, &copies.ids, &copies.addresses, hidden, inter);
        }
        return moe_decode(cuda, x, routing, table, hidden, inter);
    }
    moe_decode_under_copies(cuda, x, routing, table, &copies, hidden, inter)
}

/// The decode kernels over every (row, k) pair: moe_gate_up, then moe_down, which sums a row's experts in router
/// order.
fn moe_decode(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    hidden: usize,
    inter: usize,
) -> Result<CudaTensor> {
    let pairs = routing.rows * routing.top_k;
    let act = cuda.tensor(pairs, inter)?;
    launch_gate_up(cuda, x, routing, table, Ptr::null(), pairs, &act)?;
    let out = cuda.tensor(routing.rows, hidden)?;
    // Each warp takes (expert, feature group) items: with few experts per row, more feature groups per block
    // keep every warp busy.
    let feature_groups = (MOE_WARPS / routing.top_k).max(1);
    let block_features = feature_groups * MOE_DOWN_ROWS;
    let down = MoeDown {
        act: ptr(&act.data),
        hidden: hidden as i32,
        inter: inter as i32,
        top_k: routing.top_k as i32,
        ids: ptr(&routing.ids),
        weights: ptr(&routing.weights),
        experts: ptr(table).cast(),
        feature_groups: feature_groups as i32,
        out: ptr(&out.data),
    };
    down.launch(
        cuda,
        LaunchConfig {
            grid_dim: (hidden.div_ceil(block_features) as u32, routing.rows as u32, 1),
            block_dim: (MOE_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: (routing.top_k * block_features * std::mem::size_of::<f32>()) as u32,
        },
    )?;
    Ok(out)
}

/// moe_gate_up over `pairs` pairs: those listed from `order`, or the first `pairs` when `order` is null.
fn launch_gate_up(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    order: Ptr<i32>,
    pairs: usize,
    act: &CudaTensor,
) -> Result<()> {
    let inter = act.cols;
    let gate_up = MoeGateUp {
        x: ptr(&x.data),
        hidden: x.cols as i32,
        inter: inter as i32,
        top_k: routing.top_k as i32,
        ids: ptr(&routing.ids),
        order,
        experts: ptr(table).cast(),
        act: ptr(&act.data),
    };
    gate_up.launch(
        cuda,
        LaunchConfig {
            grid_dim: (inter.div_ceil(MOE_WARPS) as u32, pairs as u32, 1),
            block_dim: (MOE_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}

/// The decode kernels under offload while this layer's copies are in flight: the (row, k) pairs of resident
/// experts run at once, each copied expert's pairs as soon as its copy has landed (the compute stream waits on its
/// event), each pair's down product kept apart (moe_down_pairs), and moe_combine sums each row's products in router
/// order. Every pair is computed as in moe_gate_up + moe_down over all pairs, and summed in the same order, so the
/// result is the same to the bit; only when each expert's work starts differs.
fn moe_decode_under_copies(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    copies: &LayerCopies,
    hidden: usize,
    inter: usize,
) -> Result<CudaTensor> {
    let pairs = routing.rows * routing.top_k;
    let ids = &copies.ids[..pairs];
    let fetched = |e: i32| copies.fetched.iter().any(|&(f, _)| f as i32 == e);
    // The run order: pairs on resident experts, then each fetched expert's pairs, in plan order.
    let mut order: Vec<i32> = (0..pairs as i32).filter(|&p| !fetched(ids[p as usize])).collect();
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
        launch_gate_up(cuda, x, routing, table, run, len, &act)?;
        let down = MoeDownPairs {
            act: ptr(&act.data),
            hidden: hidden as i32,
            inter: inter as i32,
            ids: ptr(&routing.ids),
            order: run,
            experts: ptr(table).cast(),
            y: ptr(&y.data),
        };
        down.launch(
            cuda,
            LaunchConfig {
                grid_dim: (down_blocks, len as u32, 1),
                block_dim: (MOE_WARPS as u32 * 32, 1, 1),
                shared_mem_bytes: 0,
            },
        )?;
    }
    let out = cuda.tensor(routing.rows, hidden)?;
    let combine = MoeCombine {
        y: ptr(&y.data),
        weights: ptr(&routing.weights),
        top_k: routing.top_k as i32,
        hidden: hidden as i32,
        out: ptr(&out.data),
    };
    combine.launch(cuda, per_row(routing.rows, BLOCK_THREADS))?;
    Ok(out)
}

/// The MoE block for a batch too large for the decode kernels, its routed `ids` on the host: the rows run in
/// groups of at most [`MOE_GROUP_ROWS`] (bounding the workspace of long steps), each expert's rows of a group
/// gathered and run through cuBLAS, and the results combined in router order.
fn moe_experts_grouped(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    ids: &[i32],
    addresses: &[u64],
    hidden: usize,
    inter: usize,
) -> Result<CudaTensor> {
    let out = cuda.tensor(routing.rows, hidden)?;
    for first_row in (0..routing.rows).step_by(MOE_GROUP_ROWS) {
        let group = ExpertGroup {
            first_row,
            rows: MOE_GROUP_ROWS.min(routing.rows - first_row),
            hidden,
            inter,
        };
        moe_expert_group(cuda, x, routing, ids, addresses, &group, &out)?;
    }
    Ok(out)
}

/// Rows `group.first_row..+group.rows` of the grouped MoE block, written to the same rows of `out`.
fn moe_expert_group(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    ids: &[i32],
    addresses: &[u64],
    group: &ExpertGroup,
    out: &CudaTensor,
) -> Result<()> {
    let &ExpertGroup {
        first_row,
        rows,
        hidden,
        inter,
    } = group;
    let top_k = routing.top_k;
    let pairs = rows * top_k;
    let ids = &ids[first_row * top_k..first_row * top_k + pairs];
    // The group's (row, k) pairs ordered by expert (stably, so rows keep their order): each expert's pairs are
    // one contiguous run, which its GEMMs read and write in place.
    let mut order: Vec<u32> = (0..pairs as u32).collect();
    order.sort_by_key(|&pair| ids[pair as usize]);
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
    // Gate and up are adjacent in an expert's block: one [2 * inter, hidden] product; down follows them.
    let gate_up_of = |e: usize| Bf16Matrix {
        data: Ptr::at(addresses[e]),
        rows: 2 * inter,
        cols: hidden,
    };
    let down_of = |e: usize| Bf16Matrix {
        data: Ptr::at(addresses[e]).offset(2 * inter * hidden),
        rows: hidden,
        cols: inter,
    };
    let gate_up = cuda.tensor(pairs, 2 * inter)?;
    let halves = cuda.split_bf16(&gathered)?;
    drop(gathered);
    for &(e, first, len) in &runs {
        cuda.gemm_split(&halves, first, len, gate_up_of(e), &gate_up)?;
    }
    drop(halves);
    let act = cuda.tensor(pairs, inter)?;
    let silu_mul = SiluMulHalves {
        x: ptr(&gate_up.data),
        half: inter as i32,
        out: ptr(&act.data),
        n: pairs * inter,
    };
    silu_mul.launch(cuda, grid_1d(pairs * inter, BLOCK_THREADS))?;
    drop(gate_up);
    let halves = cuda.split_bf16(&act)?;
    drop(act);
    let by_expert = cuda.tensor(pairs, hidden)?;
    for &(e, first, len) in &runs {
        cuda.gemm_split(&halves, first, len, down_of(e), &by_expert)?;
    }
    drop(halves);
    let y = cuda.tensor(pairs, hidden)?;
    copy_rows(cuda, "scatter_rows", &by_expert, &order_dev, pairs, &y)?;
    // The group's router weights and output rows, within the whole batch's.
    let combine = MoeCombine {
        y: ptr(&y.data),
        weights: ptr(&routing.weights).offset(first_row * top_k),
        top_k: top_k as i32,
        hidden: hidden as i32,
        out: ptr(&out.data).offset(first_row * hidden),
    };
    combine.launch(cuda, per_row(rows, BLOCK_THREADS))
}
