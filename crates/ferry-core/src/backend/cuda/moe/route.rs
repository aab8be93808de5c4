//! Routing on the device (moe.cu's routers): softmax top-k and DeepSeek-V3's grouped sigmoid top-k, alone or
//! fused with the router's GEMV (gemv.cu's `gemv_route_R`: one launch for a decode step's routing), and the routes
//! to and from the host (offload's plan, replayed traces).

use cudarc::driver::CudaSlice;
use ferry_kernels::constants::{FUSED_ROUTER_SCRATCH_FLOATS, GEMV_MAX_ROWS, ROUTER_MAX_EXPERTS, ROUTER_MAX_TOP_K};

use crate::backend::cuda::launch::{kernel, per_row, ptr, Ptr};
use crate::backend::cuda::linear::{gemv_route_kernel, gemv_shape, LinearWeight};
use crate::backend::cuda::{cuda_err, CudaBackend, CudaRouting, CudaTensor, CudaWeight};
use crate::backend::{Router, RouterKind};
use crate::{Error, Result};

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
    /// gemv.cu's `gemv_route_R` (one kernel per row count R of x): `logits = x W^T (+ bias)` for the router W
    /// `[n, k]` (n experts), then, in the last block (counted on `counter`), each row routed as
    /// [`RouteSoftmaxTopk`] does, or as [`RouteSigmoidGroupedTopk`] with `correction` when `grouped`.
    struct GemvRoute {
        x: Ptr<f32>,
        k: i32,
        w: Ptr<u16>,
        n: i32,
        k_slices: i32,
        bias: Ptr<f32>,
        logits: Ptr<f32>,
        counter: Ptr<u32>,
        top_k: i32,
        renormalize: i32,
        grouped: i32,
        correction: Ptr<f32>,
        n_group: i32,
        topk_group: i32,
        scaling: f32,
        ids: Ptr<i32>,
        weights: Ptr<f32>,
    }
}

/// [`crate::backend::Backend::check_router`]: moe.cu has a kernel for every [`RouterKind`].
pub(in crate::backend::cuda) fn check_router(kind: RouterKind) -> Result<()> {
    match kind {
        RouterKind::SoftmaxTopK { .. } | RouterKind::SigmoidGroupedTopK { .. } => Ok(()),
    }
}

/// [`crate::backend::Backend::route`]: the router kernel of the kind, on the device, whether the routing stays
/// there (decode) or its ids go to the host (offload's plan).
pub(in crate::backend::cuda) fn route(
    cuda: &CudaBackend,
    logits: &CudaTensor,
    router: Router<'_, CudaWeight>,
) -> Result<CudaRouting> {
    let (kind, top_k) = (router.kind, router.top_k);
    kind.check(logits.cols, top_k)
        .map_err(|e| Error::Shape(format!("route: {e}")))?;
    if logits.cols > ROUTER_MAX_EXPERTS {
        return Err(Error::Cuda(format!(
            "{} experts is over the router kernel's {ROUTER_MAX_EXPERTS}",
            logits.cols
        )));
    }
    if top_k > ROUTER_MAX_TOP_K {
        return Err(Error::Cuda(format!(
            "top-{top_k} routing is over the router kernel's {ROUTER_MAX_TOP_K} experts a row"
        )));
    }
    let ids: CudaSlice<i32> = cuda.alloc(logits.rows * top_k)?;
    let weights: CudaSlice<f32> = cuda.alloc(logits.rows * top_k)?;
    let grid = per_row(logits.rows, 32);
    // Null only for the kinds without one (checked).
    let correction = correction_bias(&router, logits.cols)?.unwrap_or(Ptr::null());
    match kind {
        RouterKind::SoftmaxTopK { renormalize } => RouteSoftmaxTopk {
            logits: ptr(&logits.data),
            num_experts: logits.cols as i32,
            top_k: top_k as i32,
            renormalize: renormalize as i32,
            ids: ptr(&ids),
            weights: ptr(&weights),
        }
        .launch(cuda, grid)?,
        RouterKind::SigmoidGroupedTopK {
            n_group,
            topk_group,
            renormalize,
            scaling,
        } => RouteSigmoidGroupedTopk {
            logits: ptr(&logits.data),
            bias: correction,
            num_experts: logits.cols as i32,
            n_group: n_group as i32,
            topk_group: topk_group as i32,
            top_k: top_k as i32,
            renormalize: renormalize as i32,
            scaling,
            ids: ptr(&ids),
            weights: ptr(&weights),
        }
        .launch(cuda, grid)?,
    }
    Ok(CudaRouting {
        ids,
        weights,
        rows: logits.rows,
        top_k,
    })
}

/// [`crate::backend::Backend::route_linear`] in one launch of gemv.cu's `gemv_route_R`, for bf16 routers of 1 to
/// [`GEMV_MAX_ROWS`] rows whose grouped router's scratch fits a warp's staging slots (2 x experts + 2 x groups
/// floats, route.cuh's `router_scratch_floats`); None for the others, which take the router GEMV, then
/// [`route`]. The routing is the same as [`route`]'s over the same logits: route.cuh's functions serve both.
pub(in crate::backend::cuda) fn route_linear(
    cuda: &CudaBackend,
    x: &CudaTensor,
    w: &CudaWeight,
    bias: Option<&CudaWeight>,
    router: &Router<'_, CudaWeight>,
) -> Result<Option<CudaRouting>> {
    let CudaWeight::Matrix { .. } = w else {
        return Ok(None);
    };
    let w = w.matrix()?;
    let (experts, top_k) = (w.rows, router.top_k);
    let (grouped, n_group, topk_group, renormalize, scaling) = match router.kind {
        RouterKind::SoftmaxTopK { renormalize } => (false, 1, 1, renormalize, 1.0),
        RouterKind::SigmoidGroupedTopK {
            n_group,
            topk_group,
            renormalize,
            scaling,
        } => (true, n_group, topk_group, renormalize, scaling),
    };
    let scratch_fits = !grouped || 2 * experts + 2 * n_group <= FUSED_ROUTER_SCRATCH_FLOATS;
    if !(1..=GEMV_MAX_ROWS).contains(&x.rows)
        || experts > ROUTER_MAX_EXPERTS
        || top_k > ROUTER_MAX_TOP_K
        || !scratch_fits
    {
        return Ok(None);
    }
    if x.cols != w.cols {
        return Err(Error::Shape(format!(
            "route_linear: input has {} features, the router expects {}",
            x.cols, w.cols
        )));
    }
    router
        .kind
        .check(experts, top_k)
        .map_err(|e| Error::Shape(format!("route: {e}")))?;
    let correction = correction_bias(router, experts)?;
    let logits = cuda.tensor(x.rows, experts)?;
    let ids: CudaSlice<i32> = cuda.alloc(x.rows * top_k)?;
    let weights: CudaSlice<f32> = cuda.alloc(x.rows * top_k)?;
    let (k_slices, config) = gemv_shape(x.rows, LinearWeight::Bf16(w));
    GemvRoute {
        x: ptr(&x.data),
        k: w.cols as i32,
        w: w.data,
        n: experts as i32,
        k_slices,
        bias: bias.map(|b| b.vector()).transpose()?.unwrap_or(Ptr::null()),
        logits: ptr(&logits.data),
        counter: ptr(&cuda.block_counter),
        top_k: top_k as i32,
        renormalize: renormalize as i32,
        grouped: grouped as i32,
        correction: correction.unwrap_or(Ptr::null()),
        n_group: n_group as i32,
        topk_group: topk_group as i32,
        scaling,
        ids: ptr(&ids),
        weights: ptr(&weights),
    }
    .launch_kernel(cuda, gemv_route_kernel(x.rows), config)?;
    Ok(Some(CudaRouting {
        ids,
        weights,
        rows: x.rows,
        top_k,
    }))
}

/// The router's correction bias when its kind takes one (a vector of the `experts`), checked.
fn correction_bias(router: &Router<'_, CudaWeight>, experts: usize) -> Result<Option<Ptr<f32>>> {
    match (router.kind.has_correction_bias(), router.correction_bias) {
        (false, None) => Ok(None),
        (true, Some(CudaWeight::Vector(v))) if v.len() == experts => Ok(Some(ptr(v))),
        (true, Some(_)) => Err(Error::Shape(format!(
            "route: the correction bias is not a vector of the {experts} experts"
        ))),
        (needs, _) => Err(Error::Shape(format!(
            "route: {:?} {} a correction bias",
            router.kind,
            if needs { "needs" } else { "takes no" }
        ))),
    }
}

pub(in crate::backend::cuda) fn routing_to_host(cuda: &CudaBackend, routing: &CudaRouting) -> Result<Vec<u32>> {
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

pub(in crate::backend::cuda) fn routing_from_host(
    cuda: &CudaBackend,
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
) -> Result<CudaRouting> {
    let signed: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
    Ok(CudaRouting {
        ids: cuda.copy_to_device(&signed)?,
        weights: cuda.copy_to_device(weights)?,
        rows: ids.len() / top_k.max(1),
        top_k,
    })
}
