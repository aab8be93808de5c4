// The MoE block on the device: the routers (softmax top-k; DeepSeek-V3's grouped sigmoid top-k), and the routed
// experts of a few tokens (decode) read through a per-layer table of expert pointers, so where an expert lives
// (resident, or a cache slot) is the table's business alone. An expert's block holds gate [inter, hidden], then up
// [inter, hidden], then down [hidden, inter] (bf16; FP8 experts, at the end of this file, add their scales).
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
        // Found unless the scores are NaN; the index stays in bounds even then.
        best_g = min(best_g, n_group - 1);
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
        best_id = min(best_id, num_experts - 1);
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

// ---- FP8 experts ----------------------------------------------------------------------------------------------
// An FP8 expert's block: gate [inter, hidden], up [inter, hidden], down [hidden, inter] as E4M3 bytes, then (from
// the next multiple of 16 bytes) their f32 scales: gate's and up's grids of [ceil(inter / gate_up_block_rows),
// ceil(hidden / gate_up_block_cols)] and down's of [ceil(hidden / down_block_rows), ceil(inter / down_block_cols)],
// each row-major. A weight's value is its E4M3 value times its block's scale (per channel: one row per block, the
// block as wide as the row). The kernels dequantize in registers and accumulate in f32: no FP8 instructions, so every
// architecture ferry builds for runs them.
struct Fp8Layout {
    int inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols;

    // Columns and block shape of matrix m (0 gate, 1 up, 2 down).
    __device__ __forceinline__ int cols(int m) const { return m < 2 ? hidden : inter; }
    __device__ __forceinline__ int block_rows(int m) const { return m < 2 ? gate_up_block_rows : down_block_rows; }
    __device__ __forceinline__ int block_cols(int m) const { return m < 2 ? gate_up_block_cols : down_block_cols; }
    __device__ __forceinline__ int scales_per_row(int m) const { return (cols(m) + block_cols(m) - 1) / block_cols(m); }

    // Row r of matrix m, and the scales of its blocks.
    __device__ __forceinline__ const uint8_t* row(const uint8_t* block, int m, int r) const {
        return block + static_cast<size_t>(m) * inter * hidden + static_cast<size_t>(r) * cols(m);
    }
    __device__ __forceinline__ const float* scale_row(const uint8_t* block, int m, int r) const {
        const size_t scales_at = (3 * static_cast<size_t>(inter) * hidden + 15) / 16 * 16;
        const size_t gate_grid =
            static_cast<size_t>((inter + gate_up_block_rows - 1) / gate_up_block_rows) * scales_per_row(0);
        const float* scales = reinterpret_cast<const float*>(block + scales_at) + m * gate_grid;
        return scales + static_cast<size_t>(r / block_rows(m)) * scales_per_row(m);
    }
};

// Dot products of ROWS rows of matrix m of an FP8 expert block with the f32 activations x (cols(m) values), by
// one warp (common.cuh's warp_rows_dot_fp8 over the rows and their scales); acc[r] ends as the lane's partial sum
// (the caller reduces across the warp).
template <int ROWS>
__device__ __forceinline__ void expert_rows_dot_fp8(const Fp8Layout& layout, const uint8_t* block, int m,
                                                    const int (&rows)[ROWS], const float* __restrict__ x,
                                                    float (&acc)[ROWS]) {
    const uint8_t* w[ROWS];
    const float* scales[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        w[r] = layout.row(block, m, rows[r]);
        scales[r] = layout.scale_row(block, m, rows[r]);
    }
    float sums[ROWS][1] = {};
    warp_rows_dot_fp8<ROWS, 1>(w, scales, layout.block_cols(m), x, layout.cols(m), sums);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = sums[r][0];
}

// moe_gate_up for FP8 expert blocks: the same grid, pairs and output.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up_fp8(const float* __restrict__ x, int hidden, int inter, int top_k, const int* __restrict__ ids,
                    const int* __restrict__ order, const uint8_t* const* __restrict__ experts, int gate_up_block_rows,
                    int gate_up_block_cols, int down_block_rows, int down_block_cols, float* __restrict__ act) {
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    const int warp = threadIdx.x >> 5;
    const int i = blockIdx.x * MOE_WARPS + warp;
    const int pair = order != nullptr ? order[blockIdx.y] : blockIdx.y;
    if (i >= inter) return;
    const uint8_t* block = experts[ids[pair]];
    const float* xr = x + static_cast<size_t>(pair / top_k) * hidden;
    const int row[1] = {i};
    float gate[1] = {}, up[1] = {};
    expert_rows_dot_fp8<1>(layout, block, 0, row, xr, gate);
    expert_rows_dot_fp8<1>(layout, block, 1, row, xr, up);
    const float gs = warp_sum(gate[0]), us = warp_sum(up[0]);
    if ((threadIdx.x & 31) == 0) act[static_cast<size_t>(pair) * inter + i] = gs / (1.0f + expf(-gs)) * us;
}

// The MOE_DOWN_ROWS features from `first` of down_e . act for one (row, k) pair, by one warp: features past hidden
// repeat feature hidden - 1 (moe_down_fp8 and moe_down_pairs_fp8 share it, so both sum the same products).
__device__ __forceinline__ void down_rows_fp8(const Fp8Layout& layout, const uint8_t* block, int first,
                                              const float* act_pair, float (&sums)[MOE_DOWN_ROWS]) {
    int rows[MOE_DOWN_ROWS];
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j) rows[j] = min(first + j, layout.hidden - 1);
    float acc[MOE_DOWN_ROWS] = {};
    expert_rows_dot_fp8<MOE_DOWN_ROWS>(layout, block, 2, rows, act_pair, acc);
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j) sums[j] = warp_sum(acc[j]);
}

// moe_down for FP8 expert blocks: the same grid, shared memory and router-order sum.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_fp8(const float* __restrict__ act, int hidden, int inter, int top_k, const int* __restrict__ ids,
                 const float* __restrict__ weights, const uint8_t* const* __restrict__ experts,
                 int gate_up_block_rows, int gate_up_block_cols, int down_block_rows, int down_block_cols,
                 int feature_groups, float* __restrict__ out) {
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    extern __shared__ float products[];  // [top_k][block_features]
    const int warp = threadIdx.x >> 5, r = blockIdx.y;
    const int block_features = feature_groups * MOE_DOWN_ROWS;
    const int first = blockIdx.x * block_features;
    for (int item = warp; item < top_k * feature_groups; item += MOE_WARPS) {
        const int k = item / feature_groups, group = item % feature_groups;
        const int pair = r * top_k + k;
        float sums[MOE_DOWN_ROWS];
        down_rows_fp8(layout, experts[ids[pair]], first + group * MOE_DOWN_ROWS,
                      act + static_cast<size_t>(pair) * inter, sums);
#pragma unroll
        for (int j = 0; j < MOE_DOWN_ROWS; ++j)
            if ((threadIdx.x & 31) == 0) products[k * block_features + group * MOE_DOWN_ROWS + j] = sums[j];
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

// moe_down_pairs for FP8 expert blocks: the same grid and products as moe_down_fp8's, one pair at a time.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_pairs_fp8(const float* __restrict__ act, int hidden, int inter, const int* __restrict__ ids,
                       const int* __restrict__ order, const uint8_t* const* __restrict__ experts,
                       int gate_up_block_rows, int gate_up_block_cols, int down_block_rows, int down_block_cols,
                       float* __restrict__ y) {
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    const int warp = threadIdx.x >> 5;
    const int pair = order[blockIdx.y];
    const int first = (blockIdx.x * MOE_WARPS + warp) * MOE_DOWN_ROWS;
    if (first >= hidden) return;
    float sums[MOE_DOWN_ROWS];
    down_rows_fp8(layout, experts[ids[pair]], first, act + static_cast<size_t>(pair) * inter, sums);
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j)
        if ((threadIdx.x & 31) == 0 && first + j < hidden) y[static_cast<size_t>(pair) * hidden + first + j] = sums[j];
}

// Matrices first..first + count - 1 of an FP8 expert block dequantized to two bf16 halves (common.cuh's
// store_bf16_halves), back to back in each (gate and up as one [2 * inter, hidden] matrix, or down): the grouped
// prefill path runs both through the same cuBLAS products as bf16 experts and adds them. A grid-stride loop over
// their inter * hidden * count values.
extern "C" __global__ void dequantize_fp8_expert(const uint8_t* __restrict__ block, int hidden, int inter,
                                                 int gate_up_block_rows, int gate_up_block_cols,
                                                 int down_block_rows, int down_block_cols,
                                                 int first, int count, uint16_t* __restrict__ hi,
                                                 uint16_t* __restrict__ lo) {
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    const size_t per_matrix = static_cast<size_t>(inter) * hidden;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < per_matrix * count;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int m = first + static_cast<int>(i / per_matrix);
        const size_t within = i % per_matrix;
        const int cols = layout.cols(m);
        const int r = static_cast<int>(within / cols), c = static_cast<int>(within % cols);
        const float scale = layout.scale_row(block, m, r)[c / layout.block_cols(m)];
        store_bf16_halves(fp8_e4m3_to_float(layout.row(block, m, r)[c]) * scale, i, hi, lo);
    }
}
