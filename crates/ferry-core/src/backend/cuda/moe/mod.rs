//! The MoE block on the GPU (moe.cu): loading a layer's routed experts (a resident slab, or the offload's bank),
//! routing on the device, the decode kernels that read the experts through the layer's table of block addresses
//! (under offload, resident experts first and each copied expert once its copy lands), and the grouped prefill
//! path, which gathers each expert's rows and runs them through cuBLAS. Experts are bf16, FP8 or MXFP4 (see
//! expert_format.rs), with or without biases, computing silu(gate) * up or gpt-oss's clamped SwiGLU: the decode
//! kernels read FP8 and MXFP4 blocks directly, the grouped path widens each expert to bf16 first. With the
//! offload's CPU lane, both paths leave the host's experts out and moe_combine reads their products from the
//! lane's upload. The decode paths can end in a fused residual epilogue ([`ResidualEpilogue`]: the residual add and
//! the next RMSNorm inside moe_down or moe_combine).

use cudarc::driver::CudaSlice;
use ferry_kernels::constants::GEMV_MAX_ROWS;

use super::expert_format::{with_f32_biases, ExpertFormat, ExpertGlu};
use super::launch::{kernel, per_row, ptr, Ptr, BLOCK_THREADS};
use super::{cuda_err, CudaBackend, CudaExperts, CudaRouting, CudaTensor};
use crate::backend::{ExpertActivation, ExpertTensors};
use crate::{Error, Result};

/// Rows of a batch up to which the MoE block runs its decode kernels (routing never leaves the device, unless the
/// experts are offloaded).
pub(super) const MOE_DECODE_MAX_ROWS: usize = GEMV_MAX_ROWS;

mod decode;
mod grouped;
mod lane;
mod route;

use decode::{moe_decode, moe_decode_under_copies};
use grouped::moe_experts_grouped;
use lane::moe_with_host_lane;
pub(super) use route::{check_router, route, route_linear, routing_from_host, routing_to_host};

kernel! {
    /// moe.cu's `moe_combine`: `out[r] = sum_k weights[r, k] * y[r * top_k + k]`, in router order, a pair's product
    /// read from row `host_index[pair]` of `host_y` where that is not negative (the CPU lane's; null: none). With a
    /// `residual` (else null), the [`ResidualEpilogue`].
    struct MoeCombine = "moe_combine" {
        y: Ptr<f32>,
        weights: Ptr<f32>,
        top_k: i32,
        hidden: i32,
        host_y: Ptr<f32>,
        host_index: Ptr<i32>,
        out: Ptr<f32>,
        shared: Ptr<f32>,
        residual: Ptr<f32>,
        norm: Ptr<f32>,
        eps: f32,
    }
}

/// The fused residual epilogue of the decode expert kernels ([`crate::backend::Backend::moe_experts_add_rms_norm`]):
/// each row's routed sum, plus `shared` (a shared expert's output; null: none), is added to `residual`, whose rows
/// are then RMS-normalised times `norm` into the output. Same bits as moe_combine or moe_down alone, then
/// add_assign and add_rms_norm.
#[derive(Clone, Copy)]
pub(in crate::backend::cuda) struct ResidualEpilogue {
    pub shared: Ptr<f32>,
    pub residual: Ptr<f32>,
    pub norm: Ptr<f32>,
    pub eps: f32,
}

impl ResidualEpilogue {
    /// The epilogue's pointers, or nulls for none: `[shared, residual, norm]`.
    fn pointers(epilogue: Option<ResidualEpilogue>) -> ([Ptr<f32>; 3], f32) {
        epilogue.map_or(([Ptr::null(); 3], 0.0), |e| ([e.shared, e.residual, e.norm], e.eps))
    }
}

/// Products read from outside the batch's GPU products by moe_combine: `[rows, hidden]`, and per (row, k) pair of
/// the batch its row there or -1. The CPU lane's products fill the first rows; under expert parallelism, a pair
/// routed to another rank's expert reads a row of zeros (it adds nothing to this rank's partial sum).
struct HostProducts {
    products: CudaTensor,
    index: CudaSlice<i32>,
}

/// A layer's experts as the kernels read them: biases widened to f32 where the format keeps them so, and their
/// format, activation and shape, or why the CUDA backend cannot run them. `held[e]`: whether this backend holds
/// expert e (all of them, except for a rank's share under expert parallelism); `experts` are the held ones.
struct PreparedExperts {
    experts: Vec<ExpertTensors>,
    held: Vec<bool>,
    format: ExpertFormat,
    glu: ExpertGlu,
    inter: usize,
    hidden: usize,
    biased: bool,
}

fn prepare_experts(experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<PreparedExperts> {
    let held: Vec<bool> = experts.iter().map(Option::is_some).collect();
    let experts: Vec<ExpertTensors> = experts.into_iter().flatten().collect();
    let first = experts
        .first()
        .ok_or_else(|| Error::Config("a MoE layer (or a rank's part of one) without experts".into()))?;
    let format = ExpertFormat::of(&experts)?;
    let biased = experts.iter().any(ExpertTensors::has_bias);
    let (inter, hidden) = (first.gate.shape[0], first.gate.shape[1]);
    let glu = ExpertGlu::new(activation, format, inter, hidden, biased);
    if matches!(format, ExpertFormat::Fp8(_)) && !glu.is_plain() {
        return Err(Error::Config(format!(
            "the CUDA backend has no FP8 expert kernels for {activation:?}{} yet (bf16 and MXFP4 have)",
            if biased { " with biases" } else { "" }
        )));
    }
    let experts = experts
        .into_iter()
        .map(|e| with_f32_biases(e, biased))
        .collect::<Result<_>>()?;
    Ok(PreparedExperts {
        experts,
        held,
        format,
        glu,
        inter,
        hidden,
        biased,
    })
}

/// Into the offload's bank when offload is on, else into one resident slab whose table holds each held expert's
/// block address and null for the others (which the decode kernels pass over and the grouped path leaves out).
fn upload(cuda: &CudaBackend, prepared: PreparedExperts) -> Result<CudaExperts> {
    let shard = prepared.held.contains(&false);
    if let Some(offload) = &cuda.offload {
        let layer = offload.lock().unwrap_or_else(|e| e.into_inner()).add_layer(
            &cuda.stream,
            &prepared.experts,
            &prepared.held,
            prepared.glu,
        )?;
        let table = cuda
            .stream
            .alloc_zeros::<u64>(prepared.held.len())
            .map_err(cuda_err("allocating a slot table"))?;
        return Ok(CudaExperts::Offloaded {
            layer,
            table,
            hidden: prepared.hidden,
            inter: prepared.inter,
            format: prepared.format,
            glu: prepared.glu,
            shard,
        });
    }
    // One slab of the held experts' blocks (gate, up, down, back to back: the layout moe.cu reads).
    let block = prepared
        .format
        .block_bytes(prepared.inter, prepared.hidden, prepared.biased);
    let mut slab: CudaSlice<u8> = cuda.alloc(block * prepared.experts.len())?;
    for (e, expert) in prepared.experts.iter().enumerate() {
        let mut start = e * block;
        for bytes in prepared.format.block_parts(expert)? {
            let mut dst = slab.slice_mut(start..start + bytes.len());
            cuda.stream
                .memcpy_htod(bytes, &mut dst)
                .map_err(cuda_err("uploading experts"))?;
            start += bytes.len();
        }
    }
    let base = ptr(&slab).address();
    let mut blocks = (0..prepared.experts.len()).map(|e| base + (e * block) as u64);
    let addresses: Vec<u64> = prepared
        .held
        .iter()
        .map(|&held| if held { blocks.next().unwrap_or(0) } else { 0 })
        .collect();
    Ok(CudaExperts::Resident {
        table: cuda.copy_to_device(&addresses)?,
        _slab: slab,
        addresses,
        hidden: prepared.hidden,
        inter: prepared.inter,
        format: prepared.format,
        glu: prepared.glu,
        shard,
    })
}

/// [`crate::backend::Backend::experts`].
pub(super) fn upload_experts(
    cuda: &CudaBackend,
    experts: Vec<ExpertTensors>,
    activation: ExpertActivation,
) -> Result<CudaExperts> {
    upload(
        cuda,
        prepare_experts(experts.into_iter().map(Some).collect(), activation)?,
    )
}

/// [`crate::backend::Backend::expert_shard`]: this rank's experts, resident or in the offload's bank, the others'
/// table entries null (under offload their pairs are never planned: each rank caches and streams its own).
pub(super) fn upload_expert_shard(
    cuda: &CudaBackend,
    experts: Vec<Option<ExpertTensors>>,
    activation: ExpertActivation,
) -> Result<CudaExperts> {
    upload(cuda, prepare_experts(experts, activation)?)
}

/// [`crate::backend::Backend::moe_experts`]: the decode kernels for a few rows, the grouped path for more. With an
/// epilogue, the decode paths apply it (the output is then the normalised residual) and say so; the grouped path
/// and the CPU lane's leave it to the caller (false).
pub(super) fn moe_experts(
    cuda: &CudaBackend,
    x: &CudaTensor,
    routing: &CudaRouting,
    experts: &CudaExperts,
    epilogue: Option<ResidualEpilogue>,
) -> Result<(CudaTensor, bool)> {
    let fused = epilogue.is_some();
    let (hidden, inter) = experts.shape();
    let (format, glu, shard) = (experts.format(), experts.glu(), experts.shard());
    let (table, layer) = match experts {
        CudaExperts::Resident { table, addresses, .. } => {
            if x.rows > MOE_DECODE_MAX_ROWS {
                let ids = cuda
                    .stream
                    .clone_dtoh(&routing.ids)
                    .map_err(cuda_err("routing to host"))?;
                let out = moe_experts_grouped(cuda, x, routing, &ids, addresses, hidden, inter, format, glu)?;
                return Ok((out, false));
            }
            let out = moe_decode(cuda, x, routing, table, hidden, inter, (format, glu, shard), epilogue)?;
            return Ok((out, fused));
        }
        CudaExperts::Offloaded { layer, table, .. } => (table, *layer),
    };
    let offload = cuda
        .offload
        .as_ref()
        .ok_or_else(|| Error::Cuda("offloaded experts without offload".into()))?;
    let mut offload = offload.lock().unwrap_or_else(|e| e.into_inner());
    let copies = offload.prepare_layer(&cuda.stream, layer, routing, table, (x, inter))?;
    if !copies.host.is_empty() {
        let out = moe_with_host_lane(
            cuda,
            &mut offload,
            x,
            routing,
            table,
            &copies,
            inter,
            (format, glu, shard),
        )?;
        return Ok((out, false));
    }
    drop(offload);
    if x.rows > MOE_DECODE_MAX_ROWS || copies.fetched.is_empty() {
        cuda.stream
            .wait(copies.all_ready())
            .map_err(cuda_err("waiting for expert copies"))?;
        if x.rows > MOE_DECODE_MAX_ROWS {
            let out = moe_experts_grouped(
                cuda,
                x,
                routing,
                &copies.ids,
                &copies.addresses,
                hidden,
                inter,
                format,
                glu,
            )?;
            return Ok((out, false));
        }
        let out = moe_decode(cuda, x, routing, table, hidden, inter, (format, glu, shard), epilogue)?;
        return Ok((out, fused));
    }
    let out = moe_decode_under_copies(cuda, x, routing, table, &copies, hidden, inter, format, glu, epilogue)?;
    Ok((out, fused))
}

/// moe_combine over `rows` of the batch: `y` holds those rows' products (its first row is `rows.start`'s first
/// pair), `host` the lane's products of the whole batch; with the residual epilogue when given (its pointers address
/// the whole batch's rows).
fn launch_combine(
    cuda: &CudaBackend,
    y: &CudaTensor,
    routing: &CudaRouting,
    rows: std::ops::Range<usize>,
    host: Option<&HostProducts>,
    out: &CudaTensor,
    epilogue: Option<ResidualEpilogue>,
) -> Result<()> {
    let (top_k, hidden) = (routing.top_k, out.cols);
    let first_pair = rows.start * top_k;
    let (host_y, host_index) = match host {
        Some(h) => (ptr(&h.products.data), ptr(&h.index).offset(first_pair)),
        None => (Ptr::null(), Ptr::null()),
    };
    let ([shared, residual, norm], eps) = ResidualEpilogue::pointers(epilogue);
    let first_value = rows.start * hidden;
    let at = |p: Ptr<f32>| if p.address() == 0 { p } else { p.offset(first_value) };
    let combine = MoeCombine {
        y: ptr(&y.data),
        weights: ptr(&routing.weights).offset(first_pair),
        top_k: top_k as i32,
        hidden: hidden as i32,
        host_y,
        host_index,
        out: ptr(&out.data).offset(first_value),
        shared: at(shared),
        residual: at(residual),
        norm,
        eps,
    };
    combine.launch(cuda, per_row(rows.len(), BLOCK_THREADS))
}
