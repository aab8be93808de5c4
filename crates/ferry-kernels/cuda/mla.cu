// Multi-head latent attention (DeepSeek-V3's MLA) over the latent paged cache, computed in latent space for every
// row (prefill and decode): kv_b_proj's key rows W_k[h] are absorbed into each head's query (q_c = W_k[h]^T q_nope)
// and its value rows W_v[h] into the output (W_v[h] o_c), so the cache holds one row of kv_lora_rank + rope floats
// per token and is never expanded per head. Two kernels:
//   mla_latent_append  block per row: c normalised by kv_a_layernorm, the shared key rotated, written to the row's
//                      cache slot;
//   mla_attend         block per (row, head): the head's query taken into latent space, causal softmax attention
//                      over the sequence's latent rows (o_c = sum p_j c_j), the output W_v[h] o_c; nothing of a
//                      head's work leaves the block, so a prefill needs no per-head temporaries in device memory.
#include "common.cuh"

// Rotates the rope features of `in` into `out` at position `pos`: pairs (2i, 2i + 1) when `interleaved`, else
// (i, i + half), by the angle pos * inv_freq[i], cos and sin times `scale`; threads stride over the pairs.
__device__ __forceinline__ void rotate_rope(const float* __restrict__ in, float* __restrict__ out, int rope_dim,
                                            uint32_t pos, const float* __restrict__ inv_freq, int interleaved,
                                            float scale) {
    const int half = rope_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float sin_angle, cos_angle;
        sincosf(static_cast<float>(pos) * inv_freq[i], &sin_angle, &cos_angle);
        cos_angle *= scale;
        sin_angle *= scale;
        const float x_a = in[a], x_b = in[b];
        out[a] = x_a * cos_angle - x_b * sin_angle;
        out[b] = x_b * cos_angle + x_a * sin_angle;
    }
}

// Block per row of `compressed` ([rows, rank + rope_dim]): RMSNorm of c times kv_norm, then the rotated shared key,
// into the pool row of slot row_slot[row].
extern "C" __global__ void mla_latent_append(const float* __restrict__ compressed, const float* __restrict__ kv_norm,
                                             int rank, int rope_dim, float eps, const uint32_t* __restrict__ positions,
                                             const float* __restrict__ inv_freq, int interleaved, float rope_scale,
                                             const uint32_t* __restrict__ row_slot, float* __restrict__ pool) {
    wait_for_previous_kernel();
    const int row = blockIdx.x, width = rank + rope_dim;
    const float* in = compressed + static_cast<size_t>(row) * width;
    float* out = pool + static_cast<size_t>(row_slot[row]) * width;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) squares += in[i] * in[i];
    const float inv_rms = rsqrtf(block_sum(squares) / static_cast<float>(rank) + eps);
    for (int i = threadIdx.x; i < rank; i += blockDim.x) out[i] = in[i] * inv_rms * kv_norm[i];
    rotate_rope(in + rank, out + rank, rope_dim, positions[row], inv_freq, interleaved, rope_scale);
}

// kv_b's weight i: bf16, or (an FP8 kv_b_proj, dequantized by mla.rs) the sum of two bf16 halves when lo is not null.
__device__ __forceinline__ float kv_b_weight(const uint16_t* __restrict__ hi, const uint16_t* __restrict__ lo,
                                             size_t i) {
    return lo != nullptr ? bf16_to_float(hi[i]) + bf16_to_float(lo[i]) : bf16_to_float(hi[i]);
}

// Block per (row, head) of MLA_ATTEND_WARPS warps. kv_b is [heads * (nope + v_dim), rank] bf16 (kv_b_lo null), or
// two bf16 halves of it: per head its key rows W_k[h], then its value rows W_v[h]. The block
//   1. takes the head's query into latent space: [W_k[h]^T q_nope, rope(q_rope)] (threads over features of c, so a
//      warp reads consecutive weights of one row);
//   2. attends over positions 0..row_pos[row] of the row's sequence (pool rows through its block table): each warp
//      takes every MLA_ATTEND_WARPS-th key with an online softmax, its lanes keeping features lane, lane + 32, ...
//      of sum p_j c_j; the warps' partials are merged through shared memory into o_c;
//   3. writes out[row, head * v_dim + d] = W_v[h][d] . o_c, a warp per output feature.
// rank is a multiple of 32 up to MLA_MAX_RANK. Dynamic shared memory (floats): the latent query (rank + rope_dim),
// o_c (rank), per warp its partial (rank) and its max and sum.
extern "C" __global__ void mla_attend(const float* __restrict__ q, const uint16_t* __restrict__ kv_b,
                                      const uint16_t* __restrict__ kv_b_lo, const float* __restrict__ pool, const uint32_t* __restrict__ row_pos,
                                      const uint32_t* __restrict__ row_table, const uint32_t* __restrict__ block_tables,
                                      const float* __restrict__ inv_freq, int interleaved, float rope_scale,
                                      int heads, int rank, int nope, int rope_dim, int v_dim, float scale,
                                      float* __restrict__ out) {
    wait_for_previous_kernel();
    extern __shared__ float shared[];
    const int row = blockIdx.x, head = blockIdx.y, width = rank + rope_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* query = shared;
    float* o_c = query + width;
    float* partial = o_c + rank;
    float* stats = partial + MLA_ATTEND_WARPS * rank;
    const float* q_head = q + (static_cast<size_t>(row) * heads + head) * (nope + rope_dim);
    const size_t w_k = static_cast<size_t>(head) * (nope + v_dim) * rank, w_v = w_k + static_cast<size_t>(nope) * rank;
    const uint32_t pos = row_pos[row];

    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nope; ++i) acc += q_head[i] * kv_b_weight(kv_b, kv_b_lo, w_k + static_cast<size_t>(i) * rank + c);
        query[c] = acc;
    }
    rotate_rope(q_head + nope, query + rank, rope_dim, pos, inv_freq, interleaved, rope_scale);
    __syncthreads();

    constexpr int PER_LANE = MLA_MAX_RANK / 32;
    const int per_lane = rank / 32;
    float acc[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.0f;
    float max_score = -INFINITY, total = 0.0f;
    const uint32_t* table = block_tables + row_table[row];
    for (int j = warp; j <= static_cast<int>(pos); j += MLA_ATTEND_WARPS) {
        const size_t slot = static_cast<size_t>(table[j / KV_BLOCK_SIZE]) * KV_BLOCK_SIZE + j % KV_BLOCK_SIZE;
        const float* key = pool + slot * width;
        float score = 0.0f;
        for (int i = lane; i < width; i += 32) score += query[i] * key[i];
        score = warp_sum(score) * scale;
        const float new_max = fmaxf(max_score, score);
        const float correction = expf(max_score - new_max), weight = expf(score - new_max);
        total = total * correction + weight;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            if (k < per_lane) acc[k] = acc[k] * correction + weight * key[lane + 32 * k];
        }
        max_score = new_max;
    }
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        if (k < per_lane) partial[warp * rank + lane + 32 * k] = acc[k];
    }
    if (lane == 0) {
        stats[2 * warp] = max_score;
        stats[2 * warp + 1] = total;
    }
    __syncthreads();

    float row_max = -INFINITY;
    for (int w = 0; w < MLA_ATTEND_WARPS; ++w) row_max = fmaxf(row_max, stats[2 * w]);
    float row_total = 0.0f;
    for (int w = 0; w < MLA_ATTEND_WARPS; ++w) {
        // A warp that had no key (a row near the sequence's start) keeps a max of -inf and adds nothing.
        if (stats[2 * w] > -INFINITY) row_total += stats[2 * w + 1] * expf(stats[2 * w] - row_max);
    }
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < MLA_ATTEND_WARPS; ++w) {
            if (stats[2 * w] > -INFINITY) sum += partial[w * rank + c] * expf(stats[2 * w] - row_max);
        }
        o_c[c] = sum / row_total;
    }
    __syncthreads();

    for (int d = warp; d < v_dim; d += MLA_ATTEND_WARPS) {
        float sum = 0.0f;
        for (int c = lane; c < rank; c += 32) sum += kv_b_weight(kv_b, kv_b_lo, w_v + static_cast<size_t>(d) * rank + c) * o_c[c];
        sum = warp_sum(sum);
        if (lane == 0) out[(static_cast<size_t>(row) * heads + head) * v_dim + d] = sum;
    }
}
