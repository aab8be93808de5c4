//! Routing on the device (moe.cu's routers): softmax top-k and DeepSeek-V3's grouped sigmoid top-k, and the
//! routes to and from the host (offload's plan, replayed traces).

use cudarc::driver::CudaSlice;
use ferry_kernels::constants::ROUTER_MAX_EXPERTS;

use crate::backend::cuda::launch::{kernel, per_row, ptr, Ptr};
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
