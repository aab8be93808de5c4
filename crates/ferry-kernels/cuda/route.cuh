// The routers, one warp per row, as device functions: moe.cu's router kernels run them alone, and the router GEMV's
// fused epilogue (gemv.cu's gemv_route_R) runs them in its last block, on the logits the other blocks wrote. The
// logits are read through L2 (ld.global.cg) for that reason.
#pragma once
#include "common.cuh"

constexpr int MAX_EXPERTS_PER_LANE = ROUTER_MAX_EXPERTS / 32;

// Floats of scratch route_row_sigmoid_grouped needs for `experts` experts in `groups` groups: each expert's score
// and choice, each group's score and whether it is kept (route.rs checks the same sum against the fused
// router's room, FUSED_router_scratch_floats).
__host__ __device__ constexpr int router_scratch_floats(int experts, int groups) { return 2 * experts + 2 * groups; }

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

// An order-preserving key of a softmax weight e in [0, 1] for the warp's unsigned max (redux.sync): its bits plus
// one; 0 for an expert taken, absent or NaN (e not >= 0), which never wins while another is left.
__device__ __forceinline__ unsigned softmax_key(float e) { return e >= 0.0f ? __float_as_uint(e) + 1u : 0u; }

// One row's softmax over its experts' logits, then the top_k (at most 32, ROUTER_MAX_TOP_K) largest in order, ties
// to the lower id, into ids and weights (top_k each), the weights renormalised over the chosen ones when asked.
// Each round takes the warp's largest key and then the lowest id holding it, one redux.sync each, where an argmax
// by shuffles takes ten dependent ones; lane k keeps round k's choice and stores it at the end. Every lane of the
// warp calls it.
__device__ __forceinline__ void route_row_softmax_topk(const float* row, int num_experts, int top_k, int renormalize,
                                                       int* __restrict__ ids, float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float e[MAX_EXPERTS_PER_LANE];
    float local_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
        const int x = lane + 32 * i;
        e[i] = x < num_experts ? __ldcg(row + x) : -INFINITY;
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
    float kept = 0.0f, mine = 0.0f;
    int mine_id = 0;
    for (int k = 0; k < top_k; ++k) {
        // The lane's largest key, at its lowest index among equals (x grows with i).
        unsigned key = 0;
        int id = NO_INDEX;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
            const unsigned candidate = softmax_key(e[i]);
            if (candidate > key) {
                key = candidate;
                id = lane + 32 * i;
            }
        }
        const WarpBest best = warp_best(key, id);
        // In bounds even for a row of NaN logits.
        const int best_id = min(best.index, num_experts - 1);
        const float p = (best.key == 0 ? 0.0f : __uint_as_float(best.key - 1u)) / total;
        kept += p;
        if (lane == k) {
            mine = p;
            mine_id = best_id;
        }
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == best_id) e[i] = -1.0f;
    }
    if (lane < top_k) {
        ids[lane] = mine_id;
        weights[lane] = renormalize ? mine / kept : mine;
    }
}

// One row of DeepSeek-V3's and GLM-4.5's router (RouterKind::SigmoidGroupedTopK), as the CPU backend computes it.
// score = sigmoid(logit) and choice = score + bias[e]; the n_group groups of consecutive experts rank by the sum of
// their two best choices, the experts of the best topk_group groups (the others are out) give the top_k best
// choices in order (at most 32, ROUTER_MAX_TOP_K; by redux.sync as route_row_softmax_topk's), ties to the lower id
// (groups likewise); weight = score / (sum of the chosen scores + 1e-20, when renormalize) * scaling. `scratch`: router_scratch_floats(num_experts, n_group) floats of shared memory the
// warp owns. Every lane of the warp calls it.
__device__ __forceinline__ void route_row_sigmoid_grouped(const float* row, const float* __restrict__ bias,
                                                          int num_experts, int n_group, int topk_group, int top_k,
                                                          int renormalize, float scaling, int* __restrict__ ids,
                                                          float* __restrict__ weights, float* scratch) {
    float* scores = scratch;
    float* choices = scores + num_experts;
    float* group_scores = choices + num_experts;
    int* group_kept = reinterpret_cast<int*>(group_scores + n_group);
    const int lane = threadIdx.x & 31;
    const int group_size = num_experts / n_group;
    for (int x = lane; x < num_experts; x += 32) {
        const float score = 1.0f / (1.0f + expf(-__ldcg(row + x)));
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
    int mine_id = 0;
    for (int k = 0; k < top_k; ++k) {
        unsigned key = 0;
        int id = NO_INDEX;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
            const unsigned c = taken[i] ? 0u : ordered_key(candidate[i]);
            if (c > key) {
                key = c;
                id = lane + 32 * i;
            }
        }
        const int best_id = min(warp_best(key, id).index, num_experts - 1);
        total += scores[best_id];
        if (lane == k) mine_id = best_id;
#pragma unroll
        for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i)
            if (lane + 32 * i == best_id) taken[i] = true;
    }
    const float denominator = renormalize ? total + 1e-20f : 1.0f;
    if (lane < top_k) {
        ids[lane] = mine_id;
        weights[lane] = scores[mine_id] / denominator * scaling;
    }
}
