// Attention's inputs from its fused q/k/v projection, in one pass: the q/k RMSNorm, RoPE, and the new keys and
// values written into the paged KV pool. Doing this per head in one kernel replaces five short launches per layer
// (two norms, two rotations, the KV append), which at decode cost more than their arithmetic.
#include "common.cuh"

// Block (row r, head h), one thread per feature of the head (blockDim.x = head_dim rounded up to 32).
// Heads 0..num_heads-1 are query heads, written to q_out [rows, num_heads * head_dim]; the next num_kv_heads are
// key heads, whose key (normalised, rotated) and value go to slot row_slot[r] of k_pool and v_pool.
// qkv is [rows, (num_heads + 2 * num_kv_heads) * head_dim]: queries, keys, values.
// RoPE rotates feature pairs (i, i + rotary_dim / 2) by positions[r] * inv_freq[i], cos and sin times
// attention_factor. q_norm / k_norm null: no norm. norm_per_head: scales of head_dim per head; otherwise the norm
// runs over all the row's queries (or keys) at once, with scales of that full width.
extern "C" __global__ void qkv_rope_kv_append(const float* __restrict__ qkv, int num_heads, int num_kv_heads,
                                              int head_dim, const float* __restrict__ q_norm,
                                              const float* __restrict__ k_norm, int norm_per_head, float eps,
                                              const uint32_t* __restrict__ positions,
                                              const float* __restrict__ inv_freq, int rotary_dim,
                                              float attention_factor,
                                              const uint32_t* __restrict__ row_slot, float* __restrict__ q_out,
                                              float* __restrict__ k_pool, float* __restrict__ v_pool) {
    wait_for_previous_kernel();
    __shared__ float head_values[MAX_HEAD_DIM];
    const int r = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const int q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const float* row = qkv + static_cast<size_t>(r) * (q_width + 2 * kv_width);
    const bool is_query = head < num_heads;
    const int kv_head = head - num_heads;
    // The part of the row this head belongs to (all queries, or all keys) and the head's offset in it.
    const float* part = is_query ? row : row + q_width;
    const int part_width = is_query ? q_width : kv_width;
    const int offset = (is_query ? head : kv_head) * head_dim;
    float x = d < head_dim ? part[offset + d] : 0.0f;

    const float* scales = is_query ? q_norm : k_norm;
    if (scales != nullptr) {
        float sum = 0.0f;
        if (norm_per_head) {
            sum = x * x;
        } else {
            for (int i = d; i < part_width; i += blockDim.x) sum += part[i] * part[i];
        }
        const int group = norm_per_head ? head_dim : part_width;
        const float inv = 1.0f / sqrtf(block_sum(sum) / group + eps);
        if (d < head_dim) x = x * inv * scales[norm_per_head ? d : offset + d];
    }

    if (d < head_dim) head_values[d] = x;
    __syncthreads();
    const int half = rotary_dim / 2;
    if (d < rotary_dim) {
        float sin_angle, cos_angle;
        sincosf(static_cast<float>(positions[r]) * inv_freq[d % half], &sin_angle, &cos_angle);
        // YaRN's attention factor scales cos and sin (1 for plain RoPE), as transformers scales its tables.
        sin_angle *= attention_factor;
        cos_angle *= attention_factor;
        x = d < half ? x * cos_angle - head_values[d + half] * sin_angle
                     : x * cos_angle + head_values[d - half] * sin_angle;
    }
    if (d >= head_dim) return;
    if (is_query) {
        q_out[static_cast<size_t>(r) * q_width + offset + d] = x;
        return;
    }
    const size_t slot = static_cast<size_t>(row_slot[r]) * kv_width + offset + d;
    k_pool[slot] = x;
    v_pool[slot] = row[q_width + kv_width + offset + d];
}
