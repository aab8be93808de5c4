// out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) for a few tokens (decode): each weight row is read once for
// every token. One kernel per token count and weight format, gemv_bf16_1 .. gemv_bf16_8 and gemv_fp8_1 ..
// gemv_fp8_8, so that the loops over tokens and rows are unrolled and the accumulators stay in registers.
//
// A block of GEMV_WARPS warps covers GEMV_WARPS / k_slices groups of rows_per_warp consecutive rows; the
// k_slices warps of a group split each row's k-steps between them and are summed in shared memory in slice order
// (deterministic). k_slices > 1 is for small n, where one warp per row would leave most of the GPU idle.
//
// Two fused epilogues save a decode step a launch each (and the gap before it) where the next op needs the whole
// product: gemv_bf16_R or gemv_fp8_R with a residual adds the product to the residual stream and its last block
// RMS-normalises every row (an output projection followed by the next norm), and gemv_route_R routes each row in
// its last block (the router GEMV followed by its top-k). Both count finished blocks on a counter (common.cuh's
// last_block_done).
#include "common.cuh"
#include "route.cuh"

static_assert(GEMV_MAX_ROWS == 8, "one GEMV_KERNEL below per row count");
static_assert(GEMV_MAX_ROWS <= GEMV_WARPS, "the fused router gives each row a warp of the last block");
static_assert(GEMV_WARPS * 32 == 256, "the fused norm runs at add_rms_norm's block size, so both give the same bits");
static_assert(sizeof(WarpStaging) >= FUSED_ROUTER_SCRATCH_FLOATS * sizeof(float),
              "the fused router's scratch lives in a warp's staging slots");

// The weight matrices of the GEMVs, W [n, k] row-major, and a warp's rows of them (common.cuh's formats).
struct Bf16Matrix {
    const uint16_t* w;
    int k;

    template <int ROWS>
    __device__ __forceinline__ Bf16Rows<ROWS> rows(const int (&index)[ROWS]) const {
        Bf16Rows<ROWS> rows;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) rows.w[r] = w + static_cast<size_t>(index[r]) * k;
        return rows;
    }
};

// E4M3 with f32 scales, [ceil(n / block_rows), ceil(k / block_cols)] row-major (per channel: one row per block,
// block_cols = k), read exactly: an E4M3 value times its f32 scale needs more than bf16's 8 significant bits, so
// these weights are never rounded to bf16.
struct Fp8Matrix {
    const uint8_t* w;
    const float* scales;
    int k, block_rows, block_cols;

    template <int ROWS>
    __device__ __forceinline__ Fp8Rows<ROWS> rows(const int (&index)[ROWS]) const {
        Fp8Rows<ROWS> rows;
        rows.block_cols = block_cols;
        const size_t scales_per_row = (k + block_cols - 1) / block_cols;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            rows.w[r] = w + static_cast<size_t>(index[r]) * k;
            rows.scales[r] = scales + static_cast<size_t>(index[r] / block_rows) * scales_per_row;
        }
        return rows;
    }
};

// The product of `TOKENS` rows of x with W (a matrix above) into out, each value through store_or_add: stored, or
// added to the residual when there is one. `staging` is the block's shared staging (the fused router reuses it
// afterwards). The kernels pass WaitForPreviousKernel as inputs_ready: W is a model's weight, which no kernel
// writes, so its first stages are copied before the wait and everything else after.
template <int TOKENS, typename Matrix, typename InputsReady>
__device__ __forceinline__ void gemv(const float* __restrict__ x, const Matrix& w, int n, int k_slices,
                                     const float* __restrict__ bias, WarpStaging (&staging)[GEMV_WARPS],
                                     float* residual, float* __restrict__ out, InputsReady inputs_ready) {
    // Each activation value a lane loads serves ROWS weight rows, which keeps the activation reads of many tokens
    // from outgrowing the weight stream.
    constexpr int ROWS = GEMV_ROWS_PER_WARP[TOKENS - 1];
    __shared__ float partial[GEMV_WARPS][ROWS][TOKENS];
    const int warp = threadIdx.x >> 5;
    const int group = warp / k_slices, slice = warp % k_slices;
    const int block_rows = GEMV_WARPS / k_slices * ROWS;
    const int first_row = blockIdx.x * block_rows;
    // Rows past n (the last block) repeat row n - 1 and are not stored, so that every warp reaches the barrier.
    int index[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) index[r] = min(first_row + group * ROWS + r, n - 1);
    float acc[ROWS][TOKENS] = {};
    warp_rows_dot<ROWS, TOKENS>(w.template rows<ROWS>(index), x, w.k, w.k, slice, k_slices, staging[warp], acc,
                                inputs_ready);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            const float s = warp_sum(acc[r][t]);
            if ((threadIdx.x & 31) == 0) partial[warp][r][t] = s;
        }
    __syncthreads();
    // Thread i sums output (t, j) = (i / block_rows, i % block_rows): consecutive threads store consecutive rows.
    for (int i = threadIdx.x; i < block_rows * TOKENS; i += blockDim.x) {
        const int t = i / block_rows, j = i % block_rows, row = first_row + j;
        if (row >= n) continue;
        const int first_warp = j / ROWS * k_slices, r = j % ROWS;
        float s = partial[first_warp][r][t];
        for (int sl = 1; sl < k_slices; ++sl) s += partial[first_warp + sl][r][t];
        store_or_add(s + (bias ? bias[row] : 0.0f), static_cast<size_t>(t) * n + row, nullptr, residual, out);
    }
}

// out = x W^T (+ bias); or, with a residual (`[TOKENS, n]`), residual += x W^T (+ bias) and out = the RMSNorm of
// each residual row times `norm` (add_rms_norm's result, to the bit), `counter` counting the blocks.
#define GEMV_KERNEL(TOKENS)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                  \
        gemv_bf16_##TOKENS(const float* __restrict__ x, int k, const uint16_t* __restrict__ w, int n,             \
                           int k_slices, const float* __restrict__ bias, float* __restrict__ out, float* residual, \
                           const float* __restrict__ norm, float eps, unsigned int* counter) {                     \
        __shared__ WarpStaging staging[GEMV_WARPS];                                                                 \
        gemv<TOKENS>(x, Bf16Matrix{w, k}, n, k_slices, bias, staging, residual, out, WaitForPreviousKernel());      \
        if (residual != nullptr) last_block_rms_norm(residual, norm, eps, counter, TOKENS, n, out);                 \
    }

GEMV_KERNEL(1)
GEMV_KERNEL(2)
GEMV_KERNEL(3)
GEMV_KERNEL(4)
GEMV_KERNEL(5)
GEMV_KERNEL(6)
GEMV_KERNEL(7)
GEMV_KERNEL(8)

// The router: logits = x W^T (+ bias) for TOKENS rows (n = experts), then in the last block warp t routes row t
// as moe.cu's router kernel of its kind would (grouped: route_sigmoid_grouped_topk with the per-expert
// `correction`, scratch in the warp's staging slots; else route_softmax_topk), writing ids and weights
// `[TOKENS, top_k]`.
#define GEMV_ROUTE_KERNEL(TOKENS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                  \
        gemv_route_##TOKENS(const float* __restrict__ x, int k, const uint16_t* __restrict__ w, int n,            \
                            int k_slices, const float* __restrict__ bias, float* logits, unsigned int* counter,   \
                            int top_k, int renormalize, int grouped, const float* __restrict__ correction,         \
                            int n_group, int topk_group, float scaling, int* __restrict__ ids,                     \
                            float* __restrict__ weights) {                                                         \
        __shared__ WarpStaging staging[GEMV_WARPS];                                                                 \
        gemv<TOKENS>(x, Bf16Matrix{w, k}, n, k_slices, bias, staging, nullptr, logits, WaitForPreviousKernel());    \
        const int warp = threadIdx.x >> 5;                                                                          \
        if (!last_block_done(counter) || warp >= TOKENS) return;                                                    \
        const float* row = logits + static_cast<size_t>(warp) * n;                                                  \
        if (grouped)                                                                                                \
            route_row_sigmoid_grouped(row, correction, n, n_group, topk_group, top_k, renormalize, scaling,       \
                                      ids + warp * top_k, weights + warp * top_k,                                  \
                                      reinterpret_cast<float*>(&staging[warp]));                                   \
        else                                                                                                        \
            route_row_softmax_topk(row, n, top_k, renormalize, ids + warp * top_k, weights + warp * top_k);         \
    }

GEMV_ROUTE_KERNEL(1)
GEMV_ROUTE_KERNEL(2)
GEMV_ROUTE_KERNEL(3)
GEMV_ROUTE_KERNEL(4)
GEMV_ROUTE_KERNEL(5)
GEMV_ROUTE_KERNEL(6)
GEMV_ROUTE_KERNEL(7)
GEMV_ROUTE_KERNEL(8)

// gemv_fp8_R: gemv_bf16_R for an FP8 W (gemv.cu's Fp8Matrix), dequantized in registers and accumulated in f32,
// with the same warps, k-splits, staged copies and residual epilogue.
#define GEMV_FP8_KERNEL(TOKENS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                  \
        gemv_fp8_##TOKENS(const float* __restrict__ x, int k, const uint8_t* __restrict__ w,                      \
                          const float* __restrict__ scales, int block_rows, int block_cols, int n, int k_slices,   \
                          const float* __restrict__ bias, float* __restrict__ out, float* residual,                \
                          const float* __restrict__ norm, float eps, unsigned int* counter) {                      \
        __shared__ WarpStaging staging[GEMV_WARPS];                                                                 \
        gemv<TOKENS>(x, Fp8Matrix{w, scales, k, block_rows, block_cols}, n, k_slices, bias, staging, residual, out, \
                     WaitForPreviousKernel());                                                                      \
        if (residual != nullptr) last_block_rms_norm(residual, norm, eps, counter, TOKENS, n, out);                 \
    }

GEMV_FP8_KERNEL(1)
GEMV_FP8_KERNEL(2)
GEMV_FP8_KERNEL(3)
GEMV_FP8_KERNEL(4)
GEMV_FP8_KERNEL(5)
GEMV_FP8_KERNEL(6)
GEMV_FP8_KERNEL(7)
GEMV_FP8_KERNEL(8)

// W dequantized to two bf16 halves (common.cuh's store_bf16_halves), for products of more than GEMV_MAX_ROWS rows:
// cuBLAS multiplies the split activations by each half and sums in f32. A grid-stride loop over the n * k weights.
extern "C" __global__ void dequantize_fp8(const uint8_t* __restrict__ w, const float* __restrict__ scales,
                                          int block_rows, int block_cols, int n, int k, uint16_t* __restrict__ hi,
                                          uint16_t* __restrict__ lo) {
    wait_for_previous_kernel();
    const int scales_per_row = (k + block_cols - 1) / block_cols;
    const size_t total = static_cast<size_t>(n) * k;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(i / k), c = static_cast<int>(i % k);
        const float scale = scales[static_cast<size_t>(r / block_rows) * scales_per_row + c / block_cols];
        store_bf16_halves(fp8_e4m3_to_float(w[i]) * scale, i, hi, lo);
    }
}
