//! The MoE block under offload when the CPU lane takes some of the layer's misses.

use cudarc::driver::CudaSlice;

use super::decode::decode_products;
use super::grouped::{group_products, ExpertGroup};
use super::{launch_combine, HostProducts, MOE_DECODE_MAX_ROWS};
use crate::backend::cuda::expert_format::{ExpertFormat, ExpertGlu};
use crate::backend::cuda::offload::{LayerCopies, Offload};
use crate::backend::cuda::workspace::MOE_GROUP_ROWS;
use crate::backend::cuda::{cuda_err, CudaBackend, CudaRouting, CudaTensor};
use crate::Result;

/// The MoE block under offload when the CPU lane takes some of this layer's misses (`copies.host`): the lane has
/// started on their pairs from the bank ([`Offload::prepare_layer`]) and this thread queues the GPU's share
/// (every decode pair, or the first row group of a larger batch), then the stream's wait for the lane and the
/// products' upload, then moe_combine, which sums each row's pairs in router order, each from wherever it was
/// computed. The host does not wait for the lane here: it goes on queuing the rest of the layer and the next while
/// the lane and the GPU compute. Each product differs from the GPU's only in the order of its dot products'
/// additions (f32 on both sides); the sum over a row's experts is the same expression in the same order.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_with_host_lane(
    cuda: &CudaBackend,
    offload: &mut Offload,
    x: &CudaTensor,
    routing: &CudaRouting,
    table: &CudaSlice<u64>,
    copies: &LayerCopies,
    inter: usize,
    (format, glu, shard): (ExpertFormat, ExpertGlu, bool),
) -> Result<CudaTensor> {
    let hidden = x.cols;
    // The lane's products, then (for a rank's share under expert parallelism) the zero row other ranks' pairs read.
    let host_rows = copies.host_index.iter().max().map_or(0, |&at| at + 1).max(0) as usize;
    let host = HostProducts {
        products: if shard {
            cuda.zeros(host_rows, hidden)?
        } else {
            cuda.tensor(host_rows, hidden)?
        },
        index: cuda.copy_to_device(&copies.host_index)?,
    };
    let on_host = |pair: usize| copies.host_index[pair] >= 0;
    let out = cuda.tensor(routing.rows, hidden)?;
    if x.rows <= MOE_DECODE_MAX_ROWS {
        let y = decode_products(cuda, x, routing, table, copies, hidden, inter, format, glu)?;
        offload.queue_host_products(&cuda.stream, &host.products)?;
        launch_combine(cuda, &y, routing, 0..routing.rows, Some(&host), &out, None)?;
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
    launch_combine(cuda, &first, routing, 0..groups[0].rows, Some(&host), &out, None)?;
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
            None,
        )?;
    }
    Ok(out)
}
