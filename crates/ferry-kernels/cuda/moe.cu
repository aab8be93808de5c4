// The MoE block on the device: the routers (softmax top-k; DeepSeek-V3's grouped sigmoid top-k), and the routed
// experts of a few tokens (decode) read through a per-layer table of expert pointers, so where an expert lives
// (resident, or a cache slot) is the table's business alone. An expert's block holds gate [inter, hidden], then up
// [inter, hidden], then down [hidden, inter].
#include "common.cuh"

constexpr int MAX_EXPERTS_PER_LANE = ROUTER_MAX_EXPERTS / 32;

// The warp's largest value and its index (the lower index among equals), left in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& best_id) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
        if (other > best || (other == best && other_id < best_id)) {
            best = other;
            best_id = other_id;
        }
    }
}

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
        warp_argmax(best, best_id);
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

// One warp per row: DeepSeek-V3's and GLM-4.5's router (RouterKind::SigmoidGroupedTopK), as the CPU backend
// computes it. score = sigmoid(logit) and choice = score + bias[e]; the n_group groups of consecutive experts rank
// by the sum of their two best choices, the experts of the best topk_group groups (the others are out) give the
// top_k best choices in order, ties to the lower id (groups likewise); weight = score / (sum of the chosen scores +
// 1e-20, when renormalize) * scaling.
extern "C" __global__ void route_sigmoid_grouped_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                                      int num_experts, int n_group, int topk_group, int top_k,
                                                      int renormalize, float scaling, int* __restrict__ ids,
                                                      float* __restrict__ weights) {
    // A group holds at least two experts, so there are at most ROUTER_MAX_EXPERTS / 2 groups.
    __shared__ float scores[ROUTER_MAX_EXPERTS];
    __shared__ float choices[ROUTER_MAX_EXPERTS];
    __shared__ float group_scores[ROUTER_MAX_EXPERTS / 2];
    __shared__ int group_kept[ROUTER_MAX_EXPERTS / 2];
    const int r = blockIdx.x, lane = threadIdx.x;
    const int group_size = num_experts / n_group;
    const float* row = logits + static_cast<size_t>(r) * num_experts;
    for (int x = lane; x < num_experts; x += 32) {
        const float score = 1.0f / (1.0f + expf(-row[x]));
        scores[x] = score;
        choices[x] = score + bias[x];
    }
    __syncwarp();
    for (int g = lane; g < n_group; g += 32) {
        float first = -INFINITY, second = -INFINITY;
        for (int j = 0; j < group_size; ++j) {
            const float v = choices[g * group_size + j];
            if (v > first) {
                second = first;
                first = v;
            } else if (v > second) {
                second = v;
            }
        }
        group_scores[g] = first + second;
        group_kept[g] = 0;
    }
    __syncwarp();
    for (int t = 0; t < topk_group; ++t) {
        float best = -INFINITY;
        int best_g = 0x7fffffff;
        for (int g = lane; g < n_group; g += 32)
            if (!group_kept[g] && (group_scores[g] > best || (group_scores[g] == best && g < best_g))) {
                best = group_scores[g];
                best_g = g;
            }
        warp_argmax(best, best_g);
        if (lane == 0) group_kept[best_g] = 1;
        __syncwarp();
    }
    // Each lane's candidates: its experts of the kept groups; an expert chosen or left out is marked taken.
    float candidate[MAX_EXPERTS_PER_LANE];
    bool taken[MAX_EXPERTS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
        const int x = lane + 32 * i;
        taken[i] = x >= num_experts || !group_kept[x / group_size];
        candidate[i] = taken[i] ? -INFINITY : choices[x];
    }
    float total = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        float best = -INFINITY;
        int best_id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
            const int x = lane + 32 * i;
            if (!taken[i] && (candidate[i] > best || (candidate[i] == best && x < best_id))) {
                best = candidate[i];
                best_id = x;
            }
        }
        warp_argmax(best, best_id);
        total += scores[best_id];
        if (lane == 0) ids[r * top_k + k] = best_id;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == best_id) taken[i] = true;
    }
    const float denominator = renormalize ? total + 1e-20f : 1.0f;
    if (lane == 0)
        for (int k = 0; k < top_k; ++k) weights[r * top_k + k] = scores[ids[r * top_k + k]] / denominator * scaling;
}

// act[(r * top_k + k), i] = silu(gate_e[i] . x_r) * (up_e[i] . x_r), e = ids[r * top_k + k].
// Grid: (ceil(inter / MOE_WARPS), pairs); one warp per output feature, its gate and up rows read together. Block y
// takes pair order[y], or pair y when order is null: under offload a step runs the pairs of resident experts
// first and each copied expert's pairs once its copy has landed, each pair computed exactly as in one launch.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up(const float* __restrict__ x, int hidden, int inter, int top_k, const int* __restrict__ ids,
                const int* __restrict__ order, const uint16_t* const* __restrict__ experts, float* __restrict__ act) {
    __shared__ WarpStaging staging[MOE_WARPS];
    const int warp = threadIdx.x >> 5;
    const int i = blockIdx.x * MOE_WARPS + warp;
    const int pair = order != nullptr ? order[blockIdx.y] : blockIdx.y;
    if (i >= inter) return;
    const uint16_t* block = experts[ids[pair]];
    const uint16_t* rows[2] = {block + static_cast<size_t>(i) * hidden,
                               block + static_cast<size_t>(inter + i) * hidden};
    float acc[2][1] = {};
    warp_rows_dot<2, 1>(rows, x + static_cast<size_t>(pair / top_k) * hidden, hidden, hidden, 0, 1, staging[warp], acc);
    const float gs = warp_sum(acc[0][0]), us = warp_sum(acc[1][0]);
    if ((threadIdx.x & 31) == 0) act[static_cast<size_t>(pair) * inter + i] = gs / (1.0f + expf(-gs)) * us;
}

// out[r, h] = sum_k w[r, k] * (down_e[h] . act[r * top_k + k]), summed in router order.
// Grid: (ceil(hidden / (feature_groups * MOE_DOWN_ROWS)), rows); dynamic shared memory: top_k * feature_groups *
// MOE_DOWN_ROWS floats. A block's features form feature_groups groups of MOE_DOWN_ROWS rows; its warps take the
// (expert, group) items in turn, so the experts of a row are read in parallel rather than one after another, and
// the block sums their products in router order (deterministic). feature_groups = MOE_WARPS / top_k (at least 1)
// keeps every warp busy when top_k is small.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down(const float* __restrict__ act, int hidden, int inter, int top_k, const int* __restrict__ ids,
             const float* __restrict__ weights, const uint16_t* const* __restrict__ experts, int feature_groups,
             float* __restrict__ out) {
    __shared__ WarpStaging staging[MOE_WARPS];
    extern __shared__ float products[];  // [top_k][block_features]
    const int warp = threadIdx.x >> 5, r = blockIdx.y;
    const int block_features = feature_groups * MOE_DOWN_ROWS;
    const int first = blockIdx.x * block_features;
    for (int item = warp; item < top_k * feature_groups; item += MOE_WARPS) {
        const int k = item / feature_groups, group = item % feature_groups;
        const int pair = r * top_k + k;
        const uint16_t* down = experts[ids[pair]] + 2 * static_cast<size_t>(inter) * hidden;
        // Features past hidden (the last block) repeat feature hidden - 1 and are not stored.
        const uint16_t* rows[MOE_DOWN_ROWS];
#pragma unroll
        for (int j = 0; j < MOE_DOWN_ROWS; ++j)
            rows[j] = down + static_cast<size_t>(min(first + group * MOE_DOWN_ROWS + j, hidden - 1)) * inter;
        float acc[MOE_DOWN_ROWS][1] = {};
        warp_rows_dot<MOE_DOWN_ROWS, 1>(rows, act + static_cast<size_t>(pair) * inter, inter, inter, 0, 1,
                                        staging[warp], acc);
#pragma unroll
        for (int j = 0; j < MOE_DOWN_ROWS; ++j) {
            const float s = warp_sum(acc[j][0]);
            if ((threadIdx.x & 31) == 0) products[k * block_features + group * MOE_DOWN_ROWS + j] = s;
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < block_features; j += blockDim.x) {
        const int h = first + j;
        if (h >= hidden) continue;
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) sum += weights[r * top_k + k] * products[k * block_features + j];
        out[static_cast<size_t>(r) * hidden + h] = sum;
    }
}

// y[pair, h] = down_e[h] . act[pair], e = ids[pair], for the pairs order[blockIdx.y]: moe_down's products, one
// (row, k) pair at a time, for the offload's decode path, which runs each copied expert's pairs once its copy has
// landed; moe_combine then sums a row's products in router order exactly as moe_down does, so the result is the
// same to the bit. Grid: (ceil(hidden / (MOE_WARPS * MOE_DOWN_ROWS)), pairs of this launch); each warp takes a group
// of MOE_DOWN_ROWS features, the same groups (multiples of MOE_DOWN_ROWS) as moe_down's.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_pairs(const float* __restrict__ act, int hidden, int inter, const int* __restrict__ ids,
                   const int* __restrict__ order, const uint16_t* const* __restrict__ experts, float* __restrict__ y) {
    __shared__ WarpStaging staging[MOE_WARPS];
    const int warp = threadIdx.x >> 5;
    const int pair = order[blockIdx.y];
    const int first = (blockIdx.x * MOE_WARPS + warp) * MOE_DOWN_ROWS;
    if (first >= hidden) return;
    const uint16_t* down = experts[ids[pair]] + 2 * static_cast<size_t>(inter) * hidden;
    // Features past hidden (the last group) repeat feature hidden - 1 and are not stored, as in moe_down.
    const uint16_t* rows[MOE_DOWN_ROWS];
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j) rows[j] = down + static_cast<size_t>(min(first + j, hidden - 1)) * inter;
    float acc[MOE_DOWN_ROWS][1] = {};
    warp_rows_dot<MOE_DOWN_ROWS, 1>(rows, act + static_cast<size_t>(pair) * inter, inter, inter, 0, 1, staging[warp],
                                    acc);
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j) {
        const float s = warp_sum(acc[j][0]);
        if ((threadIdx.x & 31) == 0 && first + j < hidden) y[static_cast<size_t>(pair) * hidden + first + j] = s;
    }
}

// Gathers rows of x: out[i] = x[rows[i]] (the tokens routed to one expert, for its GEMMs in prefill).
extern "C" __global__ void gather_rows(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                       float* __restrict__ out, int cols) {
    const float* src = x + static_cast<size_t>(rows[blockIdx.x]) * cols;
    float* dst = out + static_cast<size_t>(blockIdx.x) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// out[r] = sum_k weights[r, k] * y[r * top_k + k], in router order (the prefill path's combine, and the offload
// decode path's after moe_down_pairs: the same sum, in the same order, as moe_down's). With the CPU lane, a pair p
// with host_index[p] >= 0 was computed on the host: its product is row host_index[p] of host_y instead, summed in
// its place, so the lane's share costs no extra pass over the output (host_index null: every pair is in y).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights, int top_k,
                                       int hidden, const float* __restrict__ host_y,
                                       const int* __restrict__ host_index, float* __restrict__ out) {
    const int r = blockIdx.x;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            const int pair = r * top_k + k;
            const int host = host_index != nullptr ? host_index[pair] : -1;
            const float product = host >= 0 ? host_y[static_cast<size_t>(host) * hidden + h]
                                             : y[static_cast<size_t>(pair) * hidden + h];
            sum += weights[pair] * product;
        }
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
