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

// Causal attention of one query row and head (one warp) over keys first..=pos of its sequence, with an online
// softmax: no scores matrix is ever stored. window == 0 means no sliding window.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ k_pool,
                                     const float* __restrict__ v_pool, float* __restrict__ out,
                                     const uint32_t* __restrict__ row_pos, const uint32_t* __restrict__ row_table,
                                     const uint32_t* __restrict__ block_tables, int num_heads, int num_kv_heads,
                                     int head_dim, float scale, int window, int block_size) {
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int q_cols = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const int kv_head = h / (num_heads / num_kv_heads);
    const uint32_t pos = row_pos[r];
    const uint32_t first = (window > 0 && pos + 1 > static_cast<uint32_t>(window)) ? pos + 1 - window : 0;
    const uint32_t* table = block_tables + row_table[r];
    const float* qh = q + static_cast<size_t>(r) * q_cols + h * head_dim;

    float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? qh[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float running_max = -INFINITY, denominator = 0.0f;
    for (uint32_t j = first; j <= pos; ++j) {
        const size_t slot = static_cast<size_t>(table[j / block_size]) * block_size + j % block_size;
        const float* kj = k_pool + slot * kv_width + kv_head * head_dim;
        const float* vj = v_pool + slot * kv_width + kv_head * head_dim;
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) partial = fmaf(qv[i], kj[d], partial);
        }
        const float score = warp_sum(partial) * scale;
        const float new_max = fmaxf(running_max, score);
        const float correction = expf(running_max - new_max);
        const float p = expf(score - new_max);
        denominator = denominator * correction + p;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * correction + p * vj[d];
        }
        running_max = new_max;
    }
    float* oh = out + static_cast<size_t>(r) * q_cols + h * head_dim;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) oh[d] = acc[i] / denominator;
    }
}
