// out[t, n] = sum_k x[t, k] * W[n, k] for a few tokens (decode): one warp per weight row, the row read once for
// every token. bias may be null.
#include "common.cuh"

constexpr int GEMV_MAX_TOKENS = 8;
constexpr int GEMV_WARPS = 8;

extern "C" __global__ void gemv_bf16(const float* __restrict__ x, int tokens, int k, const uint16_t* __restrict__ w,
                                     int n, const float* __restrict__ bias, float* __restrict__ out) {
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;
    float acc[GEMV_MAX_TOKENS] = {};
    warp_row_dot<GEMV_MAX_TOKENS>(w + static_cast<size_t>(row) * k, x, k, k, tokens, acc);
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
        if (t < tokens) {
            const float s = warp_sum(acc[t]);
            if ((threadIdx.x & 31) == 0) out[static_cast<size_t>(t) * n + row] = s + (bias ? bias[row] : 0.0f);
        }
    }
}
