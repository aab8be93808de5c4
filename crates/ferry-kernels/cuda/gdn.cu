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

// One value head of a Gated DeltaNet layer's inputs, for the chunked kernels: where its q, k and v sit in a row of
// qkv, and its gates.
struct ChunkHead {
    const float* qkv;
    const float* a;
    const float* b;
    const float* a_log;
    const float* dt_bias;
    int h, num_k_heads, num_v_heads, dk, dv;

    __device__ int row_width() const { return 2 * num_k_heads * dk + num_v_heads * dv; }
    // The key (and query) head this value head reads.
    __device__ int k_head() const { return h / (num_v_heads / num_k_heads); }
    __device__ const float* query(size_t row) const { return qkv + row * row_width() + k_head() * dk; }
    __device__ const float* key(size_t row) const { return query(row) + num_k_heads * dk; }
    __device__ float value(size_t row, int col) const {
        return qkv[row * row_width() + 2 * num_k_heads * dk + h * dv + col];
    }
};

// A chunk's q (scaled by 1/sqrt(dk)) and k l2-normalised into rows of dk + 1, and its G (the running sum of g
// from the chunk's start) and beta; rows past the chunk's n are zeros with g = beta = 0, which makes them no-ops.
__device__ __forceinline__ void chunk_keys_and_gates(const ChunkHead& c, size_t row0, int n, float* q_s, float* k_s,
                                                     float* g_s, float* beta_s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = c.dk + 1;
    const float scale = rsqrtf(static_cast<float>(c.dk));
    for (int i = warp; i < DELTA_CHUNK; i += CHUNK_WARPS) {
        if (i < n) {
            if (q_s != nullptr) warp_l2_normalize(c.query(row0 + i), c.dk, scale, q_s + i * stride);
            warp_l2_normalize(c.key(row0 + i), c.dk, 1.0f, k_s + i * stride);
        } else {
            for (int d = lane; d < c.dk; d += 32) {
                if (q_s != nullptr) q_s[i * stride + d] = 0.0f;
                k_s[i * stride + d] = 0.0f;
            }
        }
    }
    if (warp == 0) {
        for (int i = lane; i < DELTA_CHUNK; i += 32) {
            float g = 0.0f, beta = 0.0f;
            if (i < n) delta_gates(c.a, c.b, c.a_log, c.dt_bias, row0 + i, c.h, c.num_v_heads, g, beta);
            g_s[i] = g;
            beta_s[i] = beta;
        }
        __syncwarp();
        if (lane == 0)  // in token order, as the CPU sums
            for (int i = 1; i < DELTA_CHUNK; ++i) g_s[i] += g_s[i - 1];
    }
}

// A_ij = -beta_i (k_i . k_j) e^(G_i - G_j) below the diagonal, zeros elsewhere, into rows of CHUNK_MATRIX_STRIDE.
__device__ __forceinline__ void chunk_key_matrix(const float* k_s, int stride, int dk, const float* g_s,
                                                 const float* beta_s, float* a_s) {
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[4][4];
    chunk_products(k_s, k_s, stride, dk, acc);
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = ty + 16 * p, j = tx + 16 * q;
            a_s[i * CHUNK_MATRIX_STRIDE + j] = j < i ? -beta_s[i] * acc[p][q] * expf(g_s[i] - g_s[j]) : 0.0f;
        }
}

// P_ij = (q_i . k_j) e^(G_i - G_j) on and below the diagonal into p_s, and the outputs' part from the chunk's
// initial state, o[r] = e^G_i q_i . S[:, lane] for i = warp + CHUNK_WARPS r.
__device__ __forceinline__ void chunk_scores_and_state_outputs(const float* q_s, const float* k_s, int stride, int dk,
                                                               const float* g_s, const float* state_s, float* p_s,
                                                               float o[ROWS_PER_WARP]) {
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4, warp = threadIdx.x >> 5;
    float acc[4][4];
    chunk_products(q_s, k_s, stride, dk, acc);
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = ty + 16 * p, j = tx + 16 * q;
            p_s[i * CHUNK_MATRIX_STRIDE + j] = j <= i ? acc[p][q] * expf(g_s[i] - g_s[j]) : 0.0f;
        }
    rows_times_state(q_s, stride, state_s, dk, o);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) o[r] *= expf(g_s[warp + CHUNK_WARPS * r]);
}

// With u (rows of CHUNK_U_STRIDE, the block's columns) known: the chunk's outputs o_i + sum_{j<=i} P_ij u_j into
// `out`, then the state: S = e^G_last S + sum_j e^(G_last - G_j) k_j u_j^T.
__device__ __forceinline__ void chunk_outputs_and_state(const ChunkHead& c, size_t row0, int n,
                                                        const float o[ROWS_PER_WARP], const float* p_s,
                                                        const float* u_s, const float* k_s, const float* g_s,
                                                        float* state_s, float* __restrict__ out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = c.dk + 1;
    const int col = blockIdx.z * DELTA_CHUNK_COLUMNS + lane;
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = warp + CHUNK_WARPS * r;
        if (i >= n) continue;
        float sum = o[r];
        for (int j = 0; j <= i; ++j) sum = fmaf(p_s[i * CHUNK_MATRIX_STRIDE + j], u_s[j * CHUNK_U_STRIDE + lane], sum);
        if (col < c.dv) out[(row0 + i) * c.num_v_heads * c.dv + c.h * c.dv + col] = sum;
    }
    const float g_last = g_s[n - 1];
    const float decay = expf(g_last);
    float next[MAX_K_HEAD_DIM / CHUNK_WARPS];
#pragma unroll
    for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
        const int d = warp + CHUNK_WARPS * r;
        next[r] = d < c.dk ? state_s[d * DELTA_CHUNK_COLUMNS + lane] * decay : 0.0f;
    }
    for (int j = 0; j < n; ++j) {
        const float w = u_s[j * CHUNK_U_STRIDE + lane] * expf(g_last - g_s[j]);
#pragma unroll
        for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
            const int d = warp + CHUNK_WARPS * r;
            if (d < c.dk) next[r] = fmaf(k_s[j * stride + d], w, next[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MAX_K_HEAD_DIM / CHUNK_WARPS; ++r) {
        const int d = warp + CHUNK_WARPS * r;
        if (d < c.dk) state_s[d * DELTA_CHUNK_COLUMNS + lane] = next[r];
    }
}

// The block's state columns (entries (d, col) with d = warp + CHUNK_WARPS r: each thread loads, updates and
// stores its own alone) from a head's state into shared memory, and back; columns past dv are zeros.
__device__ __forceinline__ void load_state_columns(const float* state, int dk, int dv, int col, float* state_s) {
    const int lane = threadIdx.x & 31;
    for (int d = threadIdx.x >> 5; d < dk; d += CHUNK_WARPS)
        state_s[d * DELTA_CHUNK_COLUMNS + lane] = col < dv ? state[static_cast<size_t>(d) * dv + col] : 0.0f;
}

__device__ __forceinline__ void store_state_columns(const float* state_s, int dk, int dv, int col, float* state) {
    const int lane = threadIdx.x & 31;
    for (int d = threadIdx.x >> 5; d < dk; d += CHUNK_WARPS)
        if (col < dv) state[static_cast<size_t>(d) * dv + col] = state_s[d * DELTA_CHUNK_COLUMNS + lane];
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
    constexpr int C = DELTA_CHUNK;
    static_assert(DELTA_CHUNK_COLUMNS == 32 && DELTA_CHUNK_COLUMNS == 4 * CHUNK_WARPS,
                  "a lane per state column; the solve gives each warp 4 columns");
    static_assert(C == 64 && DELTA_CHUNK_THREADS == 256, "the C x C products: 16 x 16 threads of 4 x 4");
    const int s = blockIdx.x, h = blockIdx.y, col = blockIdx.z * DELTA_CHUNK_COLUMNS + (threadIdx.x & 31);
    const int len = static_cast<int>(slice_len[s]);
    if (len < chunked_from) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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

    const ChunkHead c{qkv, a, b, a_log, dt_bias, h, num_k_heads, num_v_heads, dk, dv};
    float* state = reinterpret_cast<float*>(slice_state[s]) + delta_offset + static_cast<size_t>(h) * dk * dv;
    load_state_columns(state, dk, dv, col, state_s);

    for (int t0 = 0; t0 < len; t0 += C) {
        const int n = min(C, len - t0);
        const size_t row0 = slice_start_row[s] + t0;
        __syncthreads();  // the last chunk is done with k, q's space and P; the state is loaded
        chunk_keys_and_gates(c, row0, n, q_s, k_s, g_s, beta_s);
        __syncthreads();
        float o[ROWS_PER_WARP];
        chunk_scores_and_state_outputs(q_s, k_s, stride, dk, g_s, state_s, p_s, o);
        __syncthreads();  // q's space becomes A and u

        // A, and u's right-hand side.
        chunk_key_matrix(k_s, stride, dk, g_s, beta_s, a_s);
        float predicted[ROWS_PER_WARP];
        rows_times_state(k_s, stride, state_s, dk, predicted);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = warp + CHUNK_WARPS * r;
            const float v = i < n && col_in ? c.value(row0 + i, col) : 0.0f;
            u_s[i * CHUNK_U_STRIDE + lane] = beta_s[i] * (v - expf(g_s[i]) * predicted[r]);
        }
        __syncthreads();

        // u_i += sum_{j<i} A_ij u_j, row after row. Columns are independent, so each warp solves 4 of them alone,
        // 8 lanes sharing each row's sum; rows past the slice's end stay zero.
        {
            const int column = 4 * warp + (lane >> 3), part = lane & 7;
            for (int i = 1; i < n; ++i) {
                float sum = 0.0f;
                for (int j = part; j < i; j += 8)
                    sum = fmaf(a_s[i * CHUNK_MATRIX_STRIDE + j], u_s[j * CHUNK_U_STRIDE + column], sum);
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                if (part == 0) u_s[i * CHUNK_U_STRIDE + column] += sum;
                __syncwarp();
            }
        }
        __syncthreads();

        chunk_outputs_and_state(c, row0, n, o, p_s, u_s, k_s, g_s, state_s, out);
    }
    store_state_columns(state_s, dk, dv, col, state);
}

// The chunked gated delta rule in the WY form (flash-linear-attention's chunk_gated_delta_rule), in two passes.
// Within a chunk (the notation of gated_delta_rule_chunked) u = (I - A)^-1 beta (v - e^G S^T k): so with
// T = (I - A)^-1, W = T (beta e^G k) and U = T (beta v), which do not depend on the state, u = U - W S. The first
// pass, gated_delta_rule_wy, computes W and U for every chunk of every slice at once; the second,
// gated_delta_rule_states, walks each slice's chunks in order, where a chunk now costs a few products and no
// sequential solve.
//
// gated_delta_rule_wy: block (chunk, value head), the chunks of the slices at least chunked_from long counted
// slice after slice. W and U solve (I - A) X = [beta e^G k | beta v] by forward substitution, a column of X per
// thread (DELTA_CHUNK_THREADS columns a pass), the column's rows in shared memory. w: [rows, Hv * dk], u: [rows,
// Hv * dv] (rows of other slices untouched). Dynamic shared memory: gdn.rs's wy_shared_bytes(dk).
extern "C" __global__ void __launch_bounds__(DELTA_CHUNK_THREADS)
    gated_delta_rule_wy(const float* __restrict__ qkv, const float* __restrict__ a, const float* __restrict__ b,
                        const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ w,
                        float* __restrict__ u, const uint32_t* __restrict__ slice_start_row,
                        const uint32_t* __restrict__ slice_len, int slices, int num_k_heads, int num_v_heads, int dk,
                        int dv, int chunked_from) {
    constexpr int C = DELTA_CHUNK, THREADS = DELTA_CHUNK_THREADS;
    const int stride = dk + 1;
    extern __shared__ float smem[];
    float* k_s = smem;  // [C][stride], then X: [C][THREADS]
    float* x_s = smem;
    float* a_s = smem + max(C * stride, C * THREADS);  // [C][CHUNK_MATRIX_STRIDE]
    float* g_s = a_s + C * CHUNK_MATRIX_STRIDE;        // [C]
    float* beta_s = g_s + C;                            // [C]
    int* found = reinterpret_cast<int*>(beta_s + C);
    const auto chunks_of = [&](int len) { return len >= chunked_from ? (len + C - 1) / C : 0; };
    int s, chunk;
    if (!find_slice_tile(slice_len, slices, blockIdx.x, chunks_of, found, s, chunk)) return;
    const int h = blockIdx.y, n = min(C, static_cast<int>(slice_len[s]) - chunk * C);
    const size_t row0 = slice_start_row[s] + static_cast<size_t>(chunk) * C;
    const ChunkHead c{qkv, a, b, a_log, dt_bias, h, num_k_heads, num_v_heads, dk, dv};
    for (int first = 0; first < dk + dv; first += THREADS) {
        __syncthreads();  // the last pass is done with X
        chunk_keys_and_gates(c, row0, n, nullptr, k_s, g_s, beta_s);
        __syncthreads();
        chunk_key_matrix(k_s, stride, dk, g_s, beta_s, a_s);
        // The right-hand side of this thread's column; rows past n are 0 (and their rows of A are 0, so stay 0).
        const int col = first + threadIdx.x;
        float rhs[C];
#pragma unroll
        for (int i = 0; i < C; ++i) {
            rhs[i] = 0.0f;
            if (i < n && col < dk) rhs[i] = beta_s[i] * expf(g_s[i]) * k_s[i * stride + col];
            if (i < n && col >= dk && col < dk + dv) rhs[i] = beta_s[i] * c.value(row0 + i, col - dk);
        }
        __syncthreads();  // k's space becomes X
#pragma unroll
        for (int i = 0; i < C; ++i) x_s[i * THREADS + threadIdx.x] = rhs[i];
        // x_i = rhs_i + sum_{j<i} A_ij x_j, the thread's own column alone.
        for (int i = 1; i < n; ++i) {
            float sum = x_s[i * THREADS + threadIdx.x];
            for (int j = 0; j < i; ++j) sum = fmaf(a_s[i * CHUNK_MATRIX_STRIDE + j], x_s[j * THREADS + threadIdx.x], sum);
            x_s[i * THREADS + threadIdx.x] = sum;
        }
        for (int i = 0; i < n; ++i) {
            const float x = x_s[i * THREADS + threadIdx.x];
            if (col < dk)
                w[(row0 + i) * num_v_heads * dk + h * dk + col] = x;
            else if (col < dk + dv)
                u[(row0 + i) * num_v_heads * dv + h * dv + col - dk] = x;
        }
    }
}

// gated_delta_rule_states: block (slice, value head, DELTA_CHUNK_COLUMNS state columns), as
// gated_delta_rule_chunked, for slices at least chunked_from long, reading W and U from gated_delta_rule_wy.
// Dynamic shared memory: gdn.rs's chunked_shared_bytes(dk) (the same layout, q's space holding W, then u).
extern "C" __global__ void __launch_bounds__(DELTA_CHUNK_THREADS)
    gated_delta_rule_states(const float* __restrict__ qkv, const float* __restrict__ a, const float* __restrict__ b,
                            const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                            const float* __restrict__ w, const float* __restrict__ u, float* __restrict__ out,
                            const uint32_t* __restrict__ slice_start_row, const uint32_t* __restrict__ slice_len,
                            const uint64_t* __restrict__ slice_state, size_t delta_offset, int num_k_heads,
                            int num_v_heads, int dk, int dv, int chunked_from) {
    constexpr int C = DELTA_CHUNK;
    const int s = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.z * DELTA_CHUNK_COLUMNS + lane;
    const int len = static_cast<int>(slice_len[s]);
    if (len < chunked_from) return;
    const int stride = dk + 1;
    extern __shared__ float smem[];
    float* k_s = smem;              // [C][stride]
    float* q_s = k_s + C * stride;  // [C][stride], then W ([C][stride]), then u ([C][CHUNK_U_STRIDE])
    float* p_s = q_s + max(C * stride, C * (CHUNK_MATRIX_STRIDE + CHUNK_U_STRIDE));  // [C][CHUNK_MATRIX_STRIDE]
    float* state_s = p_s + C * CHUNK_MATRIX_STRIDE;                                 // [dk][DELTA_CHUNK_COLUMNS]
    float* g_s = state_s + dk * DELTA_CHUNK_COLUMNS;                                // [C]: G
    float* beta_s = g_s + C;                                                        // [C]

    const ChunkHead c{qkv, a, b, a_log, dt_bias, h, num_k_heads, num_v_heads, dk, dv};
    float* state = reinterpret_cast<float*>(slice_state[s]) + delta_offset + static_cast<size_t>(h) * dk * dv;
    load_state_columns(state, dk, dv, col, state_s);
    for (int t0 = 0; t0 < len; t0 += C) {
        const int n = min(C, len - t0);
        const size_t row0 = slice_start_row[s] + t0;
        __syncthreads();  // the last chunk is done with k, q's space and P; the state is loaded
        chunk_keys_and_gates(c, row0, n, q_s, k_s, g_s, beta_s);
        __syncthreads();
        float o[ROWS_PER_WARP];
        chunk_scores_and_state_outputs(q_s, k_s, stride, dk, g_s, state_s, p_s, o);
        __syncthreads();  // q's space becomes W
        for (int i = warp; i < C; i += CHUNK_WARPS)
            for (int d = lane; d < dk; d += 32)
                q_s[i * stride + d] = i < n ? w[(row0 + i) * num_v_heads * dk + h * dk + d] : 0.0f;
        __syncthreads();
        float u_rows[ROWS_PER_WARP];
        rows_times_state(q_s, stride, state_s, dk, u_rows);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = warp + CHUNK_WARPS * r;
            u_rows[r] = i < n && col < dv ? u[(row0 + i) * num_v_heads * dv + h * dv + col] - u_rows[r] : 0.0f;
        }
        __syncthreads();  // W's space becomes u
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) q_s[(warp + CHUNK_WARPS * r) * CHUNK_U_STRIDE + lane] = u_rows[r];
        __syncthreads();
        chunk_outputs_and_state(c, row0, n, o, p_s, q_s, k_s, g_s, state_s, out);
    }
    store_state_columns(state_s, dk, dv, col, state);
}

// x[i] *= sigmoid(gate[i]): gated attention's per-element output gate.
extern "C" __global__ void sigmoid_gate_elementwise(float* __restrict__ x, const float* __restrict__ gate, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
