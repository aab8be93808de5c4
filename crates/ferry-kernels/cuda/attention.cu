// Paged KV cache: keys and values of a layer live in pools of `block_size`-token blocks; a sequence's block
// table lists its blocks in order. Row r of a batch is at position row_pos[r] of the sequence whose block table
// starts at block_tables[row_table[r]].
#include "common.cuh"

constexpr int MAX_DIMS_PER_LANE = 8;  // head_dim <= 256

// Copies each batch row's new key and value into its slot (slot = block * block_size + offset).
extern "C" __global__ void kv_append(const float* __restrict__ k, const float* __restrict__ v,
                                     float* __restrict__ k_pool, float* __restrict__ v_pool,
                                     const uint32_t* __restrict__ row_slot, int width) {
    const size_t src = static_cast<size_t>(blockIdx.x) * width;
    const size_t dst = static_cast<size_t>(row_slot[blockIdx.x]) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_pool[dst + i] = k[src + i];
        v_pool[dst + i] = v[src + i];
    }
}

constexpr int ATTN_WARPS = 8;

// Causal attention of one query row and head (one block) over keys first..=pos of its sequence; window == 0 means
// no sliding window. The block's warps take interleaved chunks of 32 keys, one key per lane for the scores, with
// an online softmax (no scores matrix is ever stored); the warps' partial results are merged at the end. Works
// for decode (one row, many keys, spread over all warps) and prefill (every row at once).
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ k_pool,
                                     const float* __restrict__ v_pool, float* __restrict__ out,
                                     const uint32_t* __restrict__ row_pos, const uint32_t* __restrict__ row_table,
                                     const uint32_t* __restrict__ block_tables, int num_heads, int num_kv_heads,
                                     int head_dim, float scale, int window, int block_size) {
    __shared__ float q_shared[MAX_DIMS_PER_LANE * 32];
    __shared__ float warp_max_score[ATTN_WARPS], warp_denominator[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][MAX_DIMS_PER_LANE * 32];
    const int r = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q_cols = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const int kv_head = h / (num_heads / num_kv_heads);
    const uint32_t pos = row_pos[r];
    const uint32_t first = (window > 0 && pos + 1 > static_cast<uint32_t>(window)) ? pos + 1 - window : 0;
    const uint32_t* table = block_tables + row_table[r];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        q_shared[d] = q[static_cast<size_t>(r) * q_cols + h * head_dim + d];
    __syncthreads();

    float acc[MAX_DIMS_PER_LANE] = {};
    float running_max = -INFINITY, denominator = 0.0f;
    for (uint32_t base = first + warp * 32; base <= pos; base += ATTN_WARPS * 32) {
        const uint32_t j = base + lane;
        const bool valid = j <= pos;
        const size_t slot = valid ? static_cast<size_t>(table[j / block_size]) * block_size + j % block_size : 0;
        float score = -INFINITY;
        if (valid) {
            const float* kj = k_pool + slot * kv_width + kv_head * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot = fmaf(q_shared[d], kj[d], dot);
            score = dot * scale;
        }
        const float new_max = fmaxf(running_max, warp_max(score));
        const float correction = expf(running_max - new_max);
        const float p = valid ? expf(score - new_max) : 0.0f;
        denominator = denominator * correction + warp_sum(p);
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) acc[i] *= correction;
        const int keys = min(32u, pos - base + 1);
        for (int t = 0; t < keys; ++t) {
            const float pt = __shfl_sync(0xffffffffu, p, t);
            const size_t slot_t = __shfl_sync(0xffffffffu, slot, t);
            const float* vt = v_pool + slot_t * kv_width + kv_head * head_dim;
#pragma unroll
            for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) acc[i] = fmaf(pt, vt[d], acc[i]);
            }
        }
        running_max = new_max;
    }
    if (lane == 0) {
        warp_max_score[warp] = running_max;
        warp_denominator[warp] = denominator;
    }
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) warp_acc[warp][d] = acc[i];
    }
    __syncthreads();
    float total_max = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; ++w) total_max = fmaxf(total_max, warp_max_score[w]);
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) total += warp_denominator[w] * expf(warp_max_score[w] - total_max);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) o += warp_acc[w][d] * expf(warp_max_score[w] - total_max);
        out[static_cast<size_t>(r) * q_cols + h * head_dim + d] = o / total;
    }
}
