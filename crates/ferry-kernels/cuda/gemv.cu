// out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) for a few tokens (decode): each weight row is read once for
// every token. One kernel per token count, gemv_bf16_1 .. gemv_bf16_8, so that the loops over tokens and rows are
// unrolled and the accumulators stay in registers.
//
// A block of GEMV_WARPS warps covers GEMV_WARPS / k_slices groups of rows_per_warp consecutive rows; the
// k_slices warps of a group split each row's k-steps between them and are summed in shared memory in slice order
// (deterministic). k_slices > 1 is for small n, where one warp per row would leave most of the GPU idle.
#include "common.cuh"

static_assert(GEMV_MAX_ROWS == 8, "one GEMV_KERNEL below per row count");

template <int TOKENS>
__device__ __forceinline__ void gemv(const float* __restrict__ x, int k, const uint16_t* __restrict__ w, int n,
                                     int k_slices, const float* __restrict__ bias, float* __restrict__ out) {
    // Each activation value a lane loads serves ROWS weight rows, which keeps the activation reads of many tokens
    // from outgrowing the weight stream.
    constexpr int ROWS = GEMV_ROWS_PER_WARP[TOKENS - 1];
    __shared__ WarpStaging staging[GEMV_WARPS];
    __shared__ float partial[GEMV_WARPS][ROWS][TOKENS];
    const int warp = threadIdx.x >> 5;
    const int group = warp / k_slices, slice = warp % k_slices;
    const int block_rows = GEMV_WARPS / k_slices * ROWS;
    const int first_row = blockIdx.x * block_rows;
    // Rows past n (the last block) repeat row n - 1 and are not stored, so that every warp reaches the barrier.
    const uint16_t* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = w + static_cast<size_t>(min(first_row + group * ROWS + r, n - 1)) * k;
    float acc[ROWS][TOKENS] = {};
    warp_rows_dot<ROWS, TOKENS>(rows, x, k, k, slice, k_slices, staging[warp], acc);
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
        out[static_cast<size_t>(t) * n + row] = s + (bias ? bias[row] : 0.0f);
    }
}

#define GEMV_KERNEL(TOKENS)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                  \
        gemv_bf16_##TOKENS(const float* __restrict__ x, int k, const uint16_t* __restrict__ w, int n,             \
                           int k_slices, const float* __restrict__ bias, float* __restrict__ out) {                \
        gemv<TOKENS>(x, k, w, n, k_slices, bias, out);                                                              \
    }

GEMV_KERNEL(1)
GEMV_KERNEL(2)
GEMV_KERNEL(3)
GEMV_KERNEL(4)
GEMV_KERNEL(5)
GEMV_KERNEL(6)
GEMV_KERNEL(7)
GEMV_KERNEL(8)
