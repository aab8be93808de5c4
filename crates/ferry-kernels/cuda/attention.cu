// Paged KV cache: keys and values of a layer live in pools of `block_size`-token blocks; a sequence's block
// table lists its blocks in order. Row r of a batch is at position row_pos[r] of the sequence whose block table
// starts at block_tables[row_table[r]].
#include "common.cuh"

constexpr int MAX_DIMS_PER_LANE = 8;  // head_dim <= 256

constexpr int KEYS_PER_TILE = 32;

// Causal attention, split along the keys: block (row r, kv head g, split s) takes the query heads that share kv
// head g (one warp each) over keys [s * split_len, (s + 1) * split_len) of row r's range first..=pos. Keys and
// values come through shared memory a tile of 32 at a time, so the group's query heads read them once; scores use
// one lane per key and an online softmax (no scores matrix is stored). With one split the block writes the
// output; with several it writes its partial (max, denominator, unnormalised output) to `partial`, and
// attention_combine merges them. Dynamic shared memory: KEYS_PER_TILE * (2 * head_dim + 1) + group * head_dim
// floats. window == 0 means no sliding window.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ k_pool,
                                     const float* __restrict__ v_pool, float* __restrict__ out,
                                     float* __restrict__ partial, const uint32_t* __restrict__ row_pos,
                                     const uint32_t* __restrict__ row_table, const uint32_t* __restrict__ block_tables,
                                     int num_heads, int num_kv_heads, int head_dim, float scale, int window,
                                     int block_size, int split_len) {
    extern __shared__ float shared[];
    const int group = num_heads / num_kv_heads;
    float* k_tile = shared;                                           // [KEYS_PER_TILE][head_dim + 1]
    float* v_tile = k_tile + KEYS_PER_TILE * (head_dim + 1);          // [KEYS_PER_TILE][head_dim]
    float* q_tile = v_tile + KEYS_PER_TILE * head_dim;                // [group][head_dim]
    const int r = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = kv_head * group + warp;
    const int q_cols = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const uint32_t pos = row_pos[r];
    const uint32_t first = (window > 0 && pos + 1 > static_cast<uint32_t>(window)) ? pos + 1 - window : 0;
    const uint32_t begin = max(first, static_cast<uint32_t>(split) * split_len);
    const uint32_t end = min(pos + 1, static_cast<uint32_t>(split + 1) * split_len);  // exclusive
    const uint32_t* table = block_tables + row_table[r];
    for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x)
        q_tile[i] = q[static_cast<size_t>(r) * q_cols + (kv_head * group) * head_dim + i];

    float acc[MAX_DIMS_PER_LANE] = {};
    float running_max = -INFINITY, denominator = 0.0f;
    for (uint32_t base = begin; base < end; base += KEYS_PER_TILE) {
        const int keys = min(KEYS_PER_TILE, static_cast<int>(end - base));
        __syncthreads();  // the previous tile is consumed (and q_tile written, the first time)
        for (int i = threadIdx.x; i < keys * head_dim; i += blockDim.x) {
            const int t = i / head_dim, d = i % head_dim;
            const uint32_t j = base + t;
            const size_t slot = static_cast<size_t>(table[j / block_size]) * block_size + j % block_size;
            const size_t at = slot * kv_width + kv_head * head_dim + d;
            k_tile[t * (head_dim + 1) + d] = k_pool[at];
            v_tile[t * head_dim + d] = v_pool[at];
        }
        __syncthreads();
        float score = -INFINITY;
        if (lane < keys) {
            const float* kt = k_tile + lane * (head_dim + 1);
            const float* qh = q_tile + warp * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot = fmaf(qh[d], kt[d], dot);
            score = dot * scale;
        }
        const float new_max = fmaxf(running_max, warp_max(score));
        const float correction = expf(running_max - new_max);
        const float p = lane < keys ? expf(score - new_max) : 0.0f;
        denominator = denominator * correction + warp_sum(p);
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) acc[i] *= correction;
        for (int t = 0; t < keys; ++t) {
            const float pt = __shfl_sync(0xffffffffu, p, t);
#pragma unroll
            for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) acc[i] = fmaf(pt, v_tile[t * head_dim + d], acc[i]);
            }
        }
        running_max = new_max;
    }
    if (splits == 1) {
        float* oh = out + static_cast<size_t>(r) * q_cols + h * head_dim;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) oh[d] = acc[i] / denominator;
        }
        return;
    }
    // partial[(r * num_heads + h) * splits + split] = [max, denominator, acc[head_dim]]
    float* mine = partial + ((static_cast<size_t>(r) * num_heads + h) * splits + split) * (head_dim + 2);
    if (lane == 0) {
        mine[0] = running_max;
        mine[1] = denominator;
    }
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) mine[2 + d] = acc[i];
    }
}

// Merges the splits' partials of every (row, head): one block each, threads over head_dim.
extern "C" __global__ void attention_combine(const float* __restrict__ partial, float* __restrict__ out,
                                             int num_heads, int head_dim, int splits) {
    const int r = blockIdx.x, h = blockIdx.y;
    const float* parts = partial + (static_cast<size_t>(r) * num_heads + h) * splits * (head_dim + 2);
    float total_max = -INFINITY;
    for (int s = 0; s < splits; ++s) total_max = fmaxf(total_max, parts[s * (head_dim + 2)]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float m = parts[s * (head_dim + 2)];
        if (m != -INFINITY) total += parts[s * (head_dim + 2) + 1] * expf(m - total_max);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float m = parts[s * (head_dim + 2)];
            if (m != -INFINITY) o += parts[s * (head_dim + 2) + 2 + d] * expf(m - total_max);
        }
        out[(static_cast<size_t>(r) * num_heads + h) * head_dim + d] = o / total;
    }
}
