// Gated DeltaNet on the device: the causal depthwise conv1d with its rolling state, and the gated delta rule,
// token by token, with each sequence's state in device memory. A sequence's recurrent state is one allocation:
// per Gated DeltaNet layer, the conv state [(K - 1), C] then the delta-rule state [Hv, dk, dv]; kernels get the
// sequence's base address and the layer's offsets. Batch rows are grouped in slices, one per sequence.
#include "common.cuh"

constexpr int MAX_K_HEAD_DIM = 128;

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + expf(-v)); }

// y[r, c] = silu(sum_j w[c, j] * in[p - (K - 1) + j, c]); `in` is the slice's state rows followed by its rows of x.
// Grid: (ceil(C / 256), rows).
extern "C" __global__ void causal_conv1d(const float* __restrict__ x, const uint16_t* __restrict__ weight,
                                         float* __restrict__ y, const uint32_t* __restrict__ row_slice,
                                         const uint32_t* __restrict__ slice_start_row,
                                         const uint64_t* __restrict__ slice_state, size_t conv_offset, int channels,
                                         int kernel) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y;
    if (c >= channels) return;
    const uint32_t s = row_slice[r];
    const int t = r - static_cast<int>(slice_start_row[s]);
    const float* state = reinterpret_cast<const float*>(slice_state[s]) + conv_offset;
    const int history = kernel - 1;
    float sum = 0.0f;
    for (int j = 0; j < kernel; ++j) {
        const int idx = t + j;  // index into state rows then slice rows
        const float in = idx < history ? state[idx * channels + c]
                                       : x[static_cast<size_t>(slice_start_row[s] + idx - history) * channels + c];
        sum = fmaf(bf16_to_float(weight[c * kernel + j]), in, sum);
    }
    y[static_cast<size_t>(r) * channels + c] = silu_f(sum);
}

// After causal_conv1d: each slice's state becomes the last K - 1 inputs (state rows then the slice's rows).
// Grid: (ceil(C / 256), slices). In place: row i reads row i + len, which no earlier i has written.
extern "C" __global__ void conv_state_update(const float* __restrict__ x, const uint32_t* __restrict__ slice_start_row,
                                             const uint32_t* __restrict__ slice_len,
                                             const uint64_t* __restrict__ slice_state, size_t conv_offset,
                                             int channels, int kernel) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= channels) return;
    float* state = reinterpret_cast<float*>(slice_state[s]) + conv_offset;
    const int history = kernel - 1, len = slice_len[s];
    for (int i = 0; i < history; ++i) {
        const int idx = i + len;
        state[i * channels + c] = idx < history ? state[idx * channels + c]
                                                : x[static_cast<size_t>(slice_start_row[s] + idx - history) * channels + c];
    }
}

// The gated delta rule for one slice and value head (one block, thread j owning column j of the [dk, dv] state,
// held in registers across the slice's tokens). Per token: q, k l2-normalised (q scaled by 1/sqrt(dk)),
// g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b); S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
extern "C" __global__ void gated_delta_rule(const float* __restrict__ qkv, const float* __restrict__ a,
                                            const float* __restrict__ b, const float* __restrict__ a_log,
                                            const float* __restrict__ dt_bias, float* __restrict__ out,
                                            const uint32_t* __restrict__ slice_start_row,
                                            const uint32_t* __restrict__ slice_len,
                                            const uint64_t* __restrict__ slice_state, size_t delta_offset,
                                            int num_k_heads, int num_v_heads, int dk, int dv) {
    __shared__ float q_s[MAX_K_HEAD_DIM], k_s[MAX_K_HEAD_DIM];
    __shared__ float decay_s, beta_s;
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int i_head = h / (num_v_heads / num_k_heads);
    const int key_dim = num_k_heads * dk, row_width = 2 * key_dim + num_v_heads * dv;
    float* state = reinterpret_cast<float*>(slice_state[s]) + delta_offset + static_cast<size_t>(h) * dk * dv;
    float col[MAX_K_HEAD_DIM];
#pragma unroll
    for (int i = 0; i < MAX_K_HEAD_DIM; ++i) col[i] = (i < dk && j < dv) ? state[i * dv + j] : 0.0f;
    const float scale = rsqrtf(static_cast<float>(dk));
    const float a_decay = -expf(a_log[h]);
    for (uint32_t t = 0; t < slice_len[s]; ++t) {
        const size_t r = slice_start_row[s] + t;
        const float* row = qkv + r * row_width;
        // l2 norms of q and k: dk <= 128, one warp each.
        if (threadIdx.x < 32) {
            float sq = 0.0f;
            for (int i = threadIdx.x; i < dk; i += 32) sq += row[i_head * dk + i] * row[i_head * dk + i];
            const float inv = 1.0f / sqrtf(warp_sum(sq) + 1e-6f);
            for (int i = threadIdx.x; i < dk; i += 32) q_s[i] = row[i_head * dk + i] * inv * scale;
        } else if (threadIdx.x < 64) {
            const int lane = threadIdx.x - 32;
            float sq = 0.0f;
            for (int i = lane; i < dk; i += 32) sq += row[key_dim + i_head * dk + i] * row[key_dim + i_head * dk + i];
            const float inv = 1.0f / sqrtf(warp_sum(sq) + 1e-6f);
            for (int i = lane; i < dk; i += 32) k_s[i] = row[key_dim + i_head * dk + i] * inv;
        } else if (threadIdx.x == 64) {
            const float x = a[r * num_v_heads + h] + dt_bias[h];
            const float softplus = x > 20.0f ? x : log1pf(expf(x));
            decay_s = expf(a_decay * softplus);
            beta_s = 1.0f / (1.0f + expf(-b[r * num_v_heads + h]));
        }
        __syncthreads();
        if (j < dv) {
            const float decay = decay_s;
            float predicted = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_K_HEAD_DIM; ++i)
                if (i < dk) {
                    col[i] *= decay;
                    predicted = fmaf(col[i], k_s[i], predicted);
                }
            const float delta = beta_s * (row[2 * key_dim + h * dv + j] - predicted);
            float o = 0.0f;
#pragma unroll
            for (int i = 0; i < MAX_K_HEAD_DIM; ++i)
                if (i < dk) {
                    col[i] = fmaf(k_s[i], delta, col[i]);
                    o = fmaf(col[i], q_s[i], o);
                }
            out[r * num_v_heads * dv + h * dv + j] = o;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < MAX_K_HEAD_DIM; ++i)
        if (i < dk && j < dv) state[i * dv + j] = col[i];
}

// x[i] *= sigmoid(gate[i]): gated attention's per-element output gate.
extern "C" __global__ void sigmoid_gate_elementwise(float* __restrict__ x, const float* __restrict__ gate, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
