// Gated DeltaNet on the device: the causal depthwise conv1d with its rolling state, and the gated delta rule,
// token by token (decode, short slices) or a chunk of tokens at a time (long prefills), with each sequence's state
// in device memory. A sequence's recurrent state is one allocation:
// per Gated DeltaNet layer, the conv state [(K - 1), C] then the delta-rule state [Hv, dk, dv]; kernels get the
// sequence's base address and the layer's offsets. Batch rows are grouped in slices, one per sequence.
#include "common.cuh"

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + expf(-v)); }

// y[r, c] = silu(sum_j w[c, j] * in[p - (K - 1) + j, c]); `in` is the slice's state rows followed by its rows of x.
// Grid: (ceil(C / 256), rows).
extern "C" __global__ void causal_conv1d(const float* __restrict__ x, const uint16_t* __restrict__ weight,
                                         float* __restrict__ y, const uint32_t* __restrict__ row_slice,
                                         const uint32_t* __restrict__ slice_start_row,
                                         const uint64_t* __restrict__ slice_state, size_t conv_offset, int channels,
                                         int kernel) {
    wait_for_previous_kernel();
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
    wait_for_previous_kernel();
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

// Row x (dk values) l2-normalised (FLA's epsilon, as the CPU's l2_normalized) and scaled, into dst, by one warp.
__device__ __forceinline__ void warp_l2_normalize(const float* __restrict__ x, int dk, float scale, float* dst) {
    const int lane = threadIdx.x & 31;
    float sq = 0.0f;
    for (int i = lane; i < dk; i += 32) sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(warp_sum(sq) + 1e-6f);
    for (int i = lane; i < dk; i += 32) dst[i] = x[i] * inv * scale;
}

// Row r's gates for value head h: the log-decay g = -exp(a_log) softplus(a + dt_bias) and beta = sigmoid(b).
__device__ __forceinline__ void delta_gates(const float* __restrict__ a, const float* __restrict__ b,
                                            const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                            size_t r, int h, int num_v_heads, float& g, float& beta) {
    const float x = a[r * num_v_heads + h] + dt_bias[h];
    const float softplus = x > 20.0f ? x : log1pf(expf(x));
    g = -expf(a_log[h]) * softplus;
    beta = 1.0f / (1.0f + expf(-b[r * num_v_heads + h]));
}

// The gated delta rule for one slice and value head (one block, thread j owning column j of the [dk, dv] state,
// held in registers across the slice's tokens), for slices shorter than chunked_from (the others are
// gated_delta_rule_chunked's). Per token: q, k l2-normalised (q scaled by 1/sqrt(dk)),
// g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b); S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
extern "C" __global__ void gated_delta_rule(const float* __restrict__ qkv, const float* __restrict__ a,
                                            const float* __restrict__ b, const float* __restrict__ a_log,
                                            const float* __restrict__ dt_bias, float* __restrict__ out,
                                            const uint32_t* __restrict__ slice_start_row,
                                            const uint32_t* __restrict__ slice_len,
                                            const uint64_t* __restrict__ slice_state, size_t delta_offset,
                                            int num_k_heads, int num_v_heads, int dk, int dv, int chunked_from) {
    wait_for_previous_kernel();
    __shared__ float q_s[MAX_K_HEAD_DIM], k_s[MAX_K_HEAD_DIM];
    __shared__ float decay_s, beta_s;
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    if (static_cast<int>(slice_len[s]) >= chunked_from) return;
    const int i_head = h / (num_v_heads / num_k_heads);
    const int key_dim = num_k_heads * dk, row_width = 2 * key_dim + num_v_heads * dv;
    float* state = reinterpret_cast<float*>(slice_state[s]) + delta_offset + static_cast<size_t>(h) * dk * dv;
    float col[MAX_K_HEAD_DIM];
#pragma unroll
    for (int i = 0; i < MAX_K_HEAD_DIM; ++i) col[i] = (i < dk && j < dv) ? state[i * dv + j] : 0.0f;
    const float scale = rsqrtf(static_cast<float>(dk));
    for (uint32_t t = 0; t < slice_len[s]; ++t) {
        const size_t r = slice_start_row[s] + t;
        const float* row = qkv + r * row_width;
        // l2 norms of q and k: one warp each.
        if (threadIdx.x < 32) {
            warp_l2_normalize(row + i_head * dk, dk, scale, q_s);
        } else if (threadIdx.x < 64) {
            warp_l2_normalize(row + key_dim + i_head * dk, dk, 1.0f, k_s);
        } else if (threadIdx.x == 64) {
            float g;
            delta_gates(a, b, a_log, dt_bias, r, h, num_v_heads, g, beta_s);
            decay_s = expf(g);
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

// The chunked gated delta rule. A block takes one slice, one value head and DELTA_CHUNK_COLUMNS of its state's
// columns (the columns of S never mix: only q, k, g and beta are shared, and each block recomputes them), keeps
// those columns in shared memory and walks the slice DELTA_CHUNK tokens at a time. Within a chunk, with S the state at
// its start and G_i the sum of g from the chunk's start through token i (the CPU's delta_rule_head_chunked):
//   u_i = beta_i (v_i - e^G_i S^T k_i) + sum_{j<i} A_ij u_j,  A_ij = -beta_i (k_i . k_j) e^(G_i - G_j)
//         (forward substitution, row by row)
//   o_i = e^G_i S^T q_i + sum_{j<=i} P_ij u_j,               P_ij = (q_i . k_j) e^(G_i - G_j)
//   S   = e^G_last S + sum_j e^(G_last - G_j) k_j u_j^T
// Only differences of G within the chunk are exponentiated, each <= 0: nothing overflows.
constexpr int CHUNK_WARPS = DELTA_CHUNK_THREADS / 32;
constexpr int ROWS_PER_WARP = DELTA_CHUNK / CHUNK_WARPS;
// Row strides in shared memory (gdn.rs's chunked_shared_bytes mirrors the layout): k and q rows of dk + 1 (odd
// for even dk, so the C x C products read them without bank conflicts); A and P rows of C + 1; u rows of
// DELTA_CHUNK_COLUMNS + 4, so that the solve's 8 lanes x 4 columns of a warp hit 32 different banks.
constexpr int CHUNK_MATRIX_STRIDE = DELTA_CHUNK + 1;
constexpr int CHUNK_U_STRIDE = DELTA_CHUNK_COLUMNS + 4;

// acc[p][q] = x_i . y_j over dk for i = ty + 16 p, j = tx + 16 q, thread (tx, ty) of 16 x 16: a C x C product of
// rows in shared memory, in 4 x 4 register tiles.
__device__ __forceinline__ void chunk_products(const float* x, const float* y, int stride, int dk, float acc[4][4]) {
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[p][q] = 0.0f;
    for (int d = 0; d < dk; ++d) {
        float xs[4], ys[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            xs[p] = x[(ty + 16 * p) * stride + d];
            ys[p] = y[(tx + 16 * p) * stride + d];
        }
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[p][q] = fmaf(xs[p], ys[q], acc[p][q]);
    }
}

// out[r] = x_i . S[:, lane] for i = warp + CHUNK_WARPS r: the chunk's rows of x times the block's state columns.
__device__ __forceinline__ void rows_times_state(const float* x, int stride, const float* state_s, int dk,
                                                 float out[ROWS_PER_WARP]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) out[r] = 0.0f;
    for (int d = 0; d < dk; ++d) {
        const float sd = state_s[d * DELTA_CHUNK_COLUMNS + lane];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) out[r] = fmaf(x[(warp + CHUNK_WARPS * r) * stride + d], sd, out[r]);
    }
}

// Grid: (slices, Hv, ceil(dv / DELTA_CHUNK_COLUMNS)), DELTA_CHUNK_THREADS threads; slices shorter than
// chunked_from are gated_delta_rule's. Dynamic shared memory: gdn.rs's chunked_shared_bytes(dk).
extern "C" __global__ void __launch_bounds__(DELTA_CHUNK_THREADS)
    gated_delta_rule_chunked(const float* __restrict__ qkv, const float* __restrict__ a, const float* __restrict__ b,
                             const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                             float* __restrict__ out, const uint32_t* __restrict__ slice_start_row,
                             const uint32_t* __restrict__ slice_len, const uint64_t* __restrict__ slice_state,
                             size_t delta_offset, int num_k_heads, int num_v_heads, int dk, int dv,
                             int chunked_from) {
    wait_for_previous_kernel();
    constexpr int C = DELTA_CHUNK;
    static_assert(DELTA_CHUNK_COLUMNS == 32 && DELTA_CHUNK_COLUMNS == 4 * CHUNK_WARPS,
                  "a lane per state column; the solve gives each warp 4 columns");
    static_assert(C == 64 && DELTA_CHUNK_THREADS == 256, "the C x C products: 16 x 16 threads of 4 x 4");
    const int s = blockIdx.x, h = blockIdx.y, col = blockIdx.z * DELTA_CHUNK_COLUMNS + (threadIdx.x & 31);
    const int len = static_cast<int>(slice_len[s]);
    if (len < chunked_from) return;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool col_in = col < dv;
    const int stride = dk + 1;
    extern __shared__ float smem[];
    float* k_s = smem;                 // [C][stride]
    float* q_s = k_s + C * stride;     // [C][stride], then (q no longer needed) A and u:
    float* a_s = q_s;                  // [C][CHUNK_MATRIX_STRIDE]
    float* u_s = q_s + C * CHUNK_MATRIX_STRIDE;  // [C][CHUNK_U_STRIDE]
    float* p_s = q_s + max(C * stride, C * (CHUNK_MATRIX_STRIDE + CHUNK_U_STRIDE));  // [C][CHUNK_MATRIX_STRIDE]
    float* state_s = p_s + C * CHUNK_MATRIX_STRIDE;    // [dk][DELTA_CHUNK_COLUMNS]
    float* g_s = state_s + dk * DELTA_CHUNK_COLUMNS;  // [C]: G
    float* beta_s = g_s + C;                           // [C]

    const int i_head = h / (num_v_heads / num_k_heads);
    const int key_dim = num_k_heads * dk, row_width = 2 * key_dim + num_v_heads * dv;
    float* state = reinterpret_cast<float*>(slice_state[s]) + delta_offset + static_cast<size_t>(h) * dk * dv;
    const float scale = rsqrtf(static_cast<float>(dk));
    // Each thread loads, updates and stores the state entries (d = warp + CHUNK_WARPS r, col) alone.
    for (int d = warp; d < dk; d += CHUNK_WARPS)
        state_s[d * DELTA_CHUNK_COLUMNS + lane] = col_in ? state[static_cast<size_t>(d) * dv + col] : 0.0f;

    for (int t0 = 0; t0 < len; t0 += C) {
        const int n = min(C, len - t0);
        const size_t row0 = slice_start_row[s] + t0;
        __syncthreads();  // the last chunk is done with k, q's space and P; the state is loaded
        // q and k; rows past the slice's end are zeros with g = beta = 0, which makes them no-ops.
        for (int i = warp; i < C; i += CHUNK_WARPS) {
            if (i < n) {
                const float* row = qkv + (row0 + i) * row_width;
                warp_l2_normalize(row + i_head * dk, dk, scale, q_s + i * stride);
                warp_l2_normalize(row + key_dim + i_head * dk, dk, 1.0f, k_s + i * stride);
            } else {
                for (int d = lane; d < dk; d += 32) q_s[i * stride + d] = k_s[i * stride + d] = 0.0f;
            }
        }
        if (warp == 0) {
            for (int i = lane; i < C; i += 32) {
                float g = 0.0f, beta = 0.0f;
                if (i < n) delta_gates(a, b, a_log, dt_bias, row0 + i, h, num_v_heads, g, beta);
                g_s[i] = g;
                beta_s[i] = beta;
            }
            __syncwarp();
            if (lane == 0)  // in token order, as the CPU sums
                for (int i = 1; i < C; ++i) g_s[i] += g_s[i - 1];
        }
        __syncthreads();

        // P, and the outputs' part from the chunk's initial state.
        float acc[4][4];
        chunk_products(q_s, k_s, stride, dk, acc);
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = ty + 16 * p, j = tx + 16 * q;
                p_s[i * CHUNK_MATRIX_STRIDE + j] = j <= i ? acc[p][q] * expf(g_s[i] - g_s[j]) : 0.0f;
            }
        float o[ROWS_PER_WARP];
        rows_times_state(q_s, stride, state_s, dk, o);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) o[r] *= expf(g_s[warp + CHUNK_WARPS * r]);
        __syncthreads();  // q's space becomes A and u

        // A, and u's right-hand side.
        chunk_products(k_s, k_s, stride, dk, acc);
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = ty + 16 * p, j = tx + 16 * q;
                a_s[i * CHUNK_MATRIX_STRIDE + j] = j < i ? -beta_s[i] * acc[p][q] * expf(g_s[i] - g_s[j]) : 0.0f;
            }
        float predicted[ROWS_PER_WARP];
        rows_times_state(k_s, stride, state_s, dk, predicted);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = warp + CHUNK_WARPS * r;
            const float v = i < n && col_in ? qkv[(row0 + i) * row_width + 2 * key_dim + h * dv + col] : 0.0f;
            u_s[i * CHUNK_U_STRIDE + lane] = beta_s[i] * (v - expf(g_s[i]) * predicted[r]);
        }
        __syncthreads();

        // u_i += sum_{j<i} A_ij u_j, row after row. Columns are independent, so each warp solves 4 of them alone,
        // 8 lanes sharing each row's sum; rows past the slice's end stay zero.
        {
            const int c = 4 * warp + (lane >> 3), part = lane & 7;
            for (int i = 1; i < n; ++i) {
                float sum = 0.0f;
                for (int j = part; j < i; j += 8)
                    sum = fmaf(a_s[i * CHUNK_MATRIX_STRIDE + j], u_s[j * CHUNK_U_STRIDE + c], sum);
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                if (part == 0) u_s[i * CHUNK_U_STRIDE + c] += sum;
                __syncwarp();
            }
        }
        __syncthreads();

        // The outputs, then the state: S = e^G_last S + sum_j e^(G_last - G_j) k_j u_j^T.
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = warp + CHUNK_WARPS * r;
            if (i >= n) continue;
            float sum = o[r];
            for (int j = 0; j <= i; ++j)
                sum = fmaf(p_s[i * CHUNK_MATRIX_STRIDE + j], u_s[j * CHUNK_U_STRIDE + lane], sum);
            if (col_in) out[(row0 + i) * num_v_heads * dv + h * dv + col] = sum;
        }
        const float g_last = g_s[n - 1];
        const float decay = expf(g_last);
        float next[MAX_K_HEAD_DIM / CHUNK_WARPS];
#pragma unroll
        for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
            const int d = warp + CHUNK_WARPS * r;
            next[r] = d < dk ? state_s[d * DELTA_CHUNK_COLUMNS + lane] * decay : 0.0f;
        }
        for (int j = 0; j < n; ++j) {
            const float w = u_s[j * CHUNK_U_STRIDE + lane] * expf(g_last - g_s[j]);
#pragma unroll
            for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
                const int d = warp + CHUNK_WARPS * r;
                if (d < dk) next[r] = fmaf(k_s[j * stride + d], w, next[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
            const int d = warp + CHUNK_WARPS * r;
            if (d < dk) state_s[d * DELTA_CHUNK_COLUMNS + lane] = next[r];
        }
    }
    for (int d = warp; d < dk; d += CHUNK_WARPS)
        if (col_in) state[static_cast<size_t>(d) * dv + col] = state_s[d * DELTA_CHUNK_COLUMNS + lane];
}

// x[i] *= sigmoid(gate[i]): gated attention's per-element output gate.
extern "C" __global__ void sigmoid_gate_elementwise(float* __restrict__ x, const float* __restrict__ gate, size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
