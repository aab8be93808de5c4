// The MoE block on the device: router top-k, and the routed experts of a few tokens (decode) read through a
// per-layer table of expert pointers, so where an expert lives (resident, or a cache slot) is the table's
// business alone. An expert's block holds gate [inter, hidden], then up [inter, hidden], then down [hidden, inter].
#include "common.cuh"

constexpr int MAX_EXPERTS_PER_LANE = 16;  // num_experts <= 512
constexpr int MOE_WARPS = 8;

// One warp per row: softmax over the experts, then the top_k largest in order (ties to the lower id), with
// weights renormalised over the chosen ones when asked.
extern "C" __global__ void route_softmax_topk(const float* __restrict__ logits, int num_experts, int top_k,
                                              int renormalize, int* __restrict__ ids, float* __restrict__ weights) {
    const int r = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + static_cast<size_t>(r) * num_experts;
    float e[MAX_EXPERTS_PER_LANE];
    float local_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
        const int x = lane + 32 * i;
        e[i] = x < num_experts ? row[x] : -INFINITY;
        local_max = fmaxf(local_max, e[i]);
    }
    const float max = warp_max(local_max);
    float local_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
        const int x = lane + 32 * i;
        e[i] = x < num_experts ? expf(e[i] - max) : -1.0f;
        if (x < num_experts) local_sum += e[i];
    }
    const float total = warp_sum(local_sum);
    float kept = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        float best = -1.0f;
        int best_id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
            const int x = lane + 32 * i;
            if (e[i] > best || (e[i] == best && x < best_id)) {
                best = e[i];
                best_id = x;
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
            if (other > best || (other == best && other_id < best_id)) {
                best = other;
                best_id = other_id;
            }
        }
        const float p = best / total;
        kept += p;
        if (lane == 0) {
            ids[r * top_k + k] = best_id;
            weights[r * top_k + k] = p;
        }
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == best_id) e[i] = -1.0f;
    }
    if (renormalize && lane == 0)
        for (int k = 0; k < top_k; ++k) weights[r * top_k + k] /= kept;
}

// act[(r * top_k + k), i] = silu(gate_e[i] . x_r) * (up_e[i] . x_r), e = ids[r * top_k + k].
// Grid: (ceil(inter / MOE_WARPS), rows * top_k); one warp per output feature.
extern "C" __global__ void moe_gate_up(const float* __restrict__ x, int hidden, int inter, int top_k,
                                       const int* __restrict__ ids, const uint16_t* const* __restrict__ experts,
                                       float* __restrict__ act) {
    const int i = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    const int pair = blockIdx.y;
    if (i >= inter) return;
    const uint16_t* block = experts[ids[pair]];
    const float* xr = x + static_cast<size_t>(pair / top_k) * hidden;
    float g[1] = {0.0f}, u[1] = {0.0f};
    warp_row_dot<1>(block + static_cast<size_t>(i) * hidden, xr, hidden, hidden, 1, g);
    warp_row_dot<1>(block + static_cast<size_t>(inter + i) * hidden, xr, hidden, hidden, 1, u);
    const float gs = warp_sum(g[0]), us = warp_sum(u[0]);
    if ((threadIdx.x & 31) == 0) act[static_cast<size_t>(pair) * inter + i] = gs / (1.0f + expf(-gs)) * us;
}

// out[r, h] = sum_k w[r, k] * (down_e[h] . act[r * top_k + k]), summed in router order.
// Grid: (ceil(hidden / MOE_WARPS), rows); one warp per output feature.
extern "C" __global__ void moe_down(const float* __restrict__ act, int hidden, int inter, int top_k,
                                    const int* __restrict__ ids, const float* __restrict__ weights,
                                    const uint16_t* const* __restrict__ experts, float* __restrict__ out) {
    const int h = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    const int r = blockIdx.y;
    if (h >= hidden) return;
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        const int pair = r * top_k + k;
        const uint16_t* down = experts[ids[pair]] + 2 * static_cast<size_t>(inter) * hidden;
        float d[1] = {0.0f};
        warp_row_dot<1>(down + static_cast<size_t>(h) * inter, act + static_cast<size_t>(pair) * inter, inter, inter,
                        1, d);
        sum += weights[pair] * warp_sum(d[0]);
    }
    if ((threadIdx.x & 31) == 0) out[static_cast<size_t>(r) * hidden + h] = sum;
}

// Gathers rows of x: out[i] = x[rows[i]] (the tokens routed to one expert, for its GEMMs in prefill).
extern "C" __global__ void gather_rows(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                       float* __restrict__ out, int cols) {
    const float* src = x + static_cast<size_t>(rows[blockIdx.x]) * cols;
    float* dst = out + static_cast<size_t>(blockIdx.x) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// out[r] = sum_k weights[r, k] * y[r * top_k + k], in router order (the prefill path's combine).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights, int top_k,
                                       int hidden, float* __restrict__ out) {
    const int r = blockIdx.x;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k)
            sum += weights[r * top_k + k] * y[(static_cast<size_t>(r) * top_k + k) * hidden + h];
        out[static_cast<size_t>(r) * hidden + h] = sum;
    }
}

// Scatters rows of x: out[rows[i]] = x[i] (an expert's results back to their (row, k) slots).
extern "C" __global__ void scatter_rows(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                        float* __restrict__ out, int cols) {
    const float* src = x + static_cast<size_t>(blockIdx.x) * cols;
    float* dst = out + static_cast<size_t>(rows[blockIdx.x]) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}
