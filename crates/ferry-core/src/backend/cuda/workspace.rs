//! What the CUDA backend allocates besides weights: the activation workspace of one forward pass and the bytes of
//! one KV value, as formulas a memory planner asks for before anything is on the device. The planner (above the
//! model) describes the model's activation widths in [`ActivationShapes`]; the backend, which knows how it
//! allocates, turns them into bytes. Not a model description: only the widths these formulas read.

use ferry_kernels::constants::MLA_ROWS_PER_LAUNCH;

/// Rows the grouped (prefill) expert path takes at once: a longer step runs its experts in groups of this many
/// rows, so the expert part of the workspace stops growing with the step.
pub const MOE_GROUP_ROWS: usize = 2048;

/// Bytes of one key or value element in the device KV cache ([`super::DeviceKv`] keeps them in f32).
pub const KV_VALUE_BYTES: u64 = std::mem::size_of::<f32>() as u64;

/// The widths of a model's activations that size the workspace, per row of a forward pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivationShapes {
    pub hidden: usize,
    /// Query heads times head size.
    pub q_width: usize,
    /// Key (or value) heads times head size; under multi-head latent attention, the compressed key-value width
    /// (latent and RoPE features) plus the query's low rank.
    pub kv_width: usize,
    /// The widest dense MLP or shared expert intermediate (0 if none).
    pub widest_mlp: usize,
    /// Gated DeltaNet layers' convolution and value widths (0 without such layers).
    pub gdn_conv: usize,
    pub gdn_value: usize,
    /// Routed experts per token and their intermediate width (0 without MoE layers).
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub vocab: usize,
    /// Weights of the largest dense FP8 matrix (0 without dense FP8 weights): products of more rows than a GEMV
    /// takes dequantize it into two bf16 halves for as long as they run (linear.rs).
    pub largest_fp8_matrix: usize,
    /// Multi-head latent attention's heads times its latent width (0 without MLA): a round of its kernels holds
    /// latent queries, o_c and split partials of this width per row (mla.rs).
    pub mla_heads_latent: usize,
}

/// Activations of one forward pass of `rows` tokens, with room for the memory pool's rounding, plus cuBLAS's
/// workspace: an upper estimate, so that what the backend allocates stays under a budget planned with it.
pub fn workspace_bytes(shapes: &ActivationShapes, rows: usize) -> u64 {
    let per_row = 6 * shapes.hidden
        + 3 * shapes.q_width
        + 4 * shapes.kv_width
        + 3 * shapes.widest_mlp
        + 2 * shapes.gdn_conv
        + 3 * shapes.gdn_value
        // split-bf16 halves of the widest GEMM input
        + shapes.q_width.max(shapes.hidden);
    // The grouped MoE path, per (row, expert) pair of a group of at most MOE_GROUP_ROWS rows.
    let grouped_experts = rows.min(MOE_GROUP_ROWS) * shapes.top_k * 2 * (shapes.hidden + shapes.expert_intermediate);
    let activations = ((rows * per_row + grouped_experts) * 4) as u64;
    let logits = (8 * shapes.vocab * 4) as u64;
    let fp8_halves = (shapes.largest_fp8_matrix * 2 * 2) as u64;
    // A round of MLA_ROWS_PER_LAUNCH rows: latent queries and o_c, and splits' partials of at most twice that many
    // rows (mla.rs caps the splits so).
    let mla_round = (4 * MLA_ROWS_PER_LAUNCH * shapes.mla_heads_latent * 4) as u64;
    const CUBLAS_AND_POOL: u64 = 256 << 20;
    2 * activations + logits + fp8_halves + mla_round + CUBLAS_AND_POOL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_one_group_of_rows_the_expert_buffers_stop_growing() {
        let shapes = ActivationShapes {
            hidden: 64,
            q_width: 128,
            kv_width: 32,
            widest_mlp: 0,
            gdn_conv: 0,
            gdn_value: 0,
            top_k: 4,
            expert_intermediate: 96,
            vocab: 1000,
            largest_fp8_matrix: 0,
            mla_heads_latent: 0,
        };
        let per_row = |rows: usize| workspace_bytes(&shapes, rows) - workspace_bytes(&shapes, rows - 1);
        let expert_pairs_per_row = (2 * 4 * (64 + 96) * 4 * 2) as u64;
        assert_eq!(
            per_row(MOE_GROUP_ROWS) - per_row(MOE_GROUP_ROWS + 1),
            expert_pairs_per_row
        );
    }
}
