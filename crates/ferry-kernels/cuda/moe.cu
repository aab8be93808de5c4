// The MoE block on the device: the routers (softmax top-k; DeepSeek-V3's grouped sigmoid top-k), and the routed
// experts of a few tokens (decode) read through a per-layer table of expert pointers, so where an expert lives
// (resident, or a cache slot) is the table's business alone. An expert's block holds gate [inter, hidden], then up
// [inter, hidden], then down [hidden, inter] (bf16; FP8 and MXFP4 experts, at the end of this file, add their
// scales). Experts with biases (gpt-oss) end their block with them in f32, gate's, up's, then down's, from byte
// `bias_at` (a multiple of 16; -1: no biases).
#include "common.cuh"
#include "route.cuh"

static_assert(MOE_WARPS * 32 == 256, "moe_down's fused norm runs at add_rms_norm's block size: the same bits");

// The f32 biases of an expert block: gate's [inter], up's [inter], down's [hidden] (null: none).
__device__ __forceinline__ const float* expert_biases(const void* block, long long bias_at) {
    return bias_at < 0 ? nullptr : reinterpret_cast<const float*>(static_cast<const uint8_t*>(block) + bias_at);
}

// Feature i of an expert's activation from its gate and up products g and u, as the CPU backend computes it: the
// biases added (when there are), then silu(g) * u, or gpt-oss's clamped SwiGLU when `clamped`: g = min(g, limit),
// u clamped to +-limit, (u + 1) * g * sigmoid(alpha * g).
__device__ __forceinline__ float expert_glu(const float* biases, int inter, int i, float g, float u, int clamped,
                                            float alpha, float limit) {
    if (biases != nullptr) {
        g += biases[i];
        u += biases[inter + i];
    }
    if (!clamped) return g / (1.0f + expf(-g)) * u;
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

// Down's product for feature h plus its bias, when the block has biases.
__device__ __forceinline__ float with_down_bias(const float* biases, int inter, int h, float s) {
    return biases == nullptr ? s : s + biases[2 * inter + h];
}

// One warp per row (route.cuh's routers, which the router GEMV's fused epilogue in gemv.cu also runs).
extern "C" __global__ void route_softmax_topk(const float* __restrict__ logits, int num_experts, int top_k,
                                              int renormalize, int* __restrict__ ids, float* __restrict__ weights) {
    wait_for_previous_kernel();
    const int r = blockIdx.x;
    route_row_softmax_topk(logits + static_cast<size_t>(r) * num_experts, num_experts, top_k, renormalize,
                           ids + r * top_k, weights + r * top_k);
}

extern "C" __global__ void route_sigmoid_grouped_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                                      int num_experts, int n_group, int topk_group, int top_k,
                                                      int renormalize, float scaling, int* __restrict__ ids,
                                                      float* __restrict__ weights) {
    wait_for_previous_kernel();
    __shared__ float scratch[router_scratch_floats(ROUTER_MAX_EXPERTS, ROUTER_MAX_EXPERTS / 2)];
    const int r = blockIdx.x;
    route_row_sigmoid_grouped(logits + static_cast<size_t>(r) * num_experts, bias, num_experts, n_group, topk_group,
                              top_k, renormalize, scaling, ids + r * top_k, weights + r * top_k, scratch);
}

// A bf16 expert's block, [inter, hidden] gate and up then [hidden, inter] down, and a warp's rows of it
// (common.cuh's formats): the FP8 and MXFP4 ones (Fp8Layout, Mxfp4Layout, below) offer the same two, so one body of
// each decode kernel serves every format.
struct Bf16Layout {
    int inter, hidden;

    // Gate's and up's rows of features i .. i + F - 1 (past inter: the last feature's again), in the order gate
    // and up of i, gate and up of i + 1, ...
    template <int F>
    __device__ __forceinline__ Bf16Rows<2 * F> gate_up_rows(const void* block, int i) const {
        const uint16_t* gate = static_cast<const uint16_t*>(block);
        Bf16Rows<2 * F> rows;
#pragma unroll
        for (int f = 0; f < F; ++f) {
            const int r = min(i + f, inter - 1);
            rows.w[2 * f] = gate + static_cast<size_t>(r) * hidden;
            rows.w[2 * f + 1] = gate + static_cast<size_t>(inter + r) * hidden;
        }
        return rows;
    }
    // Down's rows features[0..ROWS).
    template <int ROWS>
    __device__ __forceinline__ Bf16Rows<ROWS> down_rows(const void* block, const int (&features)[ROWS]) const {
        const uint16_t* down = static_cast<const uint16_t*>(block) + 2 * static_cast<size_t>(inter) * hidden;
        Bf16Rows<ROWS> rows;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) rows.w[j] = down + static_cast<size_t>(features[j]) * inter;
        return rows;
    }
};

// act[(r * top_k + k), i] = expert_glu(gate_e[i] . x_r, up_e[i] . x_r), e = ids[r * top_k + k].
// Grid: (ceil(inter / (MOE_WARPS * FEATURES)), pairs); a warp per FEATURES output features, their gate and up rows
// read together (two features a warp halve the blocks of a launch whose registers would run it in two waves). Block y
// takes pair order[y], or pair y when order is null: under offload a step runs the pairs of resident experts
// first and each copied expert's pairs once its copy has landed, each pair computed exactly as in one launch.
// The kernels wait for the kernel before them first: the router wrote ids, and the offload wrote the table.
template <int FEATURES, typename Layout>
__device__ __forceinline__ void gate_up(const Layout& layout, const float* __restrict__ x, int top_k,
                                        const int* __restrict__ ids, const int* __restrict__ order,
                                        const void* const* __restrict__ experts, long long bias_at, int clamped,
                                        float alpha, float limit, float* __restrict__ act) {
    __shared__ WarpStaging staging[MOE_WARPS];
    const int warp = threadIdx.x >> 5;
    const int first = (blockIdx.x * MOE_WARPS + warp) * FEATURES;
    const int pair = order != nullptr ? order[blockIdx.y] : blockIdx.y;
    if (first >= layout.inter) return;
    const void* block = experts[ids[pair]];
    // Another rank's expert (expert parallelism): moe_down passes its pair over, so its act is never read.
    if (block == nullptr) return;
    float acc[2 * FEATURES][1] = {};
    warp_rows_dot<2 * FEATURES, 1>(layout.template gate_up_rows<FEATURES>(block, first),
                                   x + static_cast<size_t>(pair / top_k) * layout.hidden, layout.hidden,
                                   layout.hidden, 0, 1, staging[warp], acc, AlreadyWaited());
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) {
        const int i = first + f;
        const float gs = warp_sum(acc[2 * f][0]), us = warp_sum(acc[2 * f + 1][0]);
        if ((threadIdx.x & 31) == 0 && i < layout.inter)
            act[static_cast<size_t>(pair) * layout.inter + i] =
                expert_glu(expert_biases(block, bias_at), layout.inter, i, gs, us, clamped, alpha, limit);
    }
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up(const float* __restrict__ x, int hidden, int inter, int top_k, const int* __restrict__ ids,
                const int* __restrict__ order, const void* const* __restrict__ experts, long long bias_at,
                int clamped, float alpha, float limit, float* __restrict__ act) {
    wait_for_previous_kernel();
    gate_up<1>(Bf16Layout{inter, hidden}, x, top_k, ids, order, experts, bias_at, clamped, alpha, limit, act);
}

// moe_down's last step in every format, once the block's products are in shared memory: each feature's weighted
// sum of the row's products in router order, stored, or in the fused residual epilogue (residual not null) added
// with the shared expert's output to the residual stream, whose rows the last block then normalises into out
// (common.cuh's store_or_add and last_block_rms_norm: add_assign and add_rms_norm's result, to the bit).
__device__ __forceinline__ void down_finish(const float* products, const float* __restrict__ weights, int r,
                                            int top_k, int first, int block_features, int hidden,
                                            const float* __restrict__ shared, float* residual,
                                            const float* __restrict__ norm, float eps, unsigned int* counter,
                                            float* __restrict__ out) {
    __syncthreads();
    for (int j = threadIdx.x; j < block_features; j += blockDim.x) {
        const int h = first + j;
        if (h >= hidden) continue;
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) sum += weights[r * top_k + k] * products[k * block_features + j];
        store_or_add(sum, static_cast<size_t>(r) * hidden + h, shared, residual, out);
    }
    if (residual != nullptr) last_block_rms_norm(residual, norm, eps, counter, gridDim.y, hidden, out);
}

// The products of a warp's MOE_DOWN_ROWS down features from `first` with the pair's activations, plus the down
// bias when the block has biases: features past hidden (the last group) repeat feature hidden - 1 (and are not
// stored). moe_down and moe_down_pairs share it, so both sum the same products.
template <typename Layout, typename InputsReady>
__device__ __forceinline__ void down_products(const Layout& layout, const void* block, long long bias_at, int first,
                                              const float* act_pair, WarpStaging& staging,
                                              float (&sums)[MOE_DOWN_ROWS], InputsReady inputs_ready) {
    int features[MOE_DOWN_ROWS];
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j) features[j] = min(first + j, layout.hidden - 1);
    float acc[MOE_DOWN_ROWS][1] = {};
    warp_rows_dot<MOE_DOWN_ROWS, 1>(layout.down_rows(block, features), act_pair, layout.inter, layout.inter, 0, 1,
                                    staging, acc, inputs_ready);
    const float* biases = expert_biases(block, bias_at);
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j)
        sums[j] = with_down_bias(biases, layout.inter, features[j], warp_sum(acc[j][0]));
}

// out[r, h] = sum_k w[r, k] * (down_e[h] . act[r * top_k + k] + down bias_e[h]), summed in router order.
// Grid: (ceil(hidden / (feature_groups * MOE_DOWN_ROWS)), rows); dynamic shared memory: top_k * feature_groups *
// MOE_DOWN_ROWS floats. A block's features form feature_groups groups of MOE_DOWN_ROWS rows; its warps take the
// (expert, group) items in turn, so the experts of a row are read in parallel rather than one after another, and
// the block sums their products in router order (deterministic). feature_groups = MOE_WARPS / top_k (at least 1)
// keeps every warp busy when top_k is small.
//
// moe_gate_up runs just before it (moe_decode), and waited for the router's ids and the table: both were written
// before this kernel launched, so its first weights are copied before it waits for moe_gate_up's act (ids and
// table read through L2, where those writes are): the kernels pass WaitForPreviousKernel, and every thread waits
// before the sums.
//
// SHARD: the table may hold null entries (another rank's experts under expert parallelism), whose items add
// nothing; the moe_down*_shard kernels. Only they test for it: the test, even skipping before any of an item's
// work, costs moe_down registers or spills (63 -> 64 with 36 bytes spilled, moe_down_fp8 88 bytes).
template <bool SHARD, typename Layout, typename InputsReady>
__device__ __forceinline__ void down(const Layout& layout, const float* __restrict__ act, int top_k,
                                     const int* __restrict__ ids, const float* __restrict__ weights,
                                     const void* const* __restrict__ experts, long long bias_at, int feature_groups,
                                     float* __restrict__ out, const float* __restrict__ shared, float* residual,
                                     const float* __restrict__ norm, float eps, unsigned int* counter,
                                     InputsReady inputs_ready) {
    __shared__ WarpStaging staging[MOE_WARPS];
    extern __shared__ float products[];  // [top_k][block_features]
    const int warp = threadIdx.x >> 5, r = blockIdx.y;
    const int block_features = feature_groups * MOE_DOWN_ROWS;
    const int first = blockIdx.x * block_features;
    for (int item = warp; item < top_k * feature_groups; item += MOE_WARPS) {
        const int k = item / feature_groups, group = item % feature_groups;
        const int pair = r * top_k + k;
        const void* block = reinterpret_cast<const void*>(
            __ldcg(reinterpret_cast<const unsigned long long*>(experts) + __ldcg(ids + pair)));
        if constexpr (SHARD) {
            if (block == nullptr) {
                if ((threadIdx.x & 31) == 0)
#pragma unroll
                    for (int j = 0; j < MOE_DOWN_ROWS; ++j)
                        products[k * block_features + group * MOE_DOWN_ROWS + j] = 0.0f;
                continue;
            }
        }
        float sums[MOE_DOWN_ROWS];
        // After the first item the wait returns at once.
        down_products(layout, block, bias_at, first + group * MOE_DOWN_ROWS,
                      act + static_cast<size_t>(pair) * layout.inter, staging[warp], sums, inputs_ready);
#pragma unroll
        for (int j = 0; j < MOE_DOWN_ROWS; ++j)
            if ((threadIdx.x & 31) == 0) products[k * block_features + group * MOE_DOWN_ROWS + j] = sums[j];
    }
    // Warps without an item wait here, before down_finish reads the weights and the residual.
    inputs_ready();
    down_finish(products, weights, r, top_k, first, block_features, layout.hidden, shared, residual, norm, eps,
                counter, out);
}

// moe_down, and moe_down_shard (see down's SHARD).
#define MOE_DOWN_KERNEL(SUFFIX, SHARD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                       \
        moe_down##SUFFIX(const float* __restrict__ act, int hidden, int inter, int top_k, const int* __restrict__ ids, \
             const float* __restrict__ weights, const void* const* __restrict__ experts, long long bias_at,            \
             int feature_groups, float* __restrict__ out, const float* __restrict__ shared, float* residual,           \
             const float* __restrict__ norm, float eps, unsigned int* counter) {                                       \
        down<SHARD>(Bf16Layout{inter, hidden}, act, top_k, ids, weights, experts, bias_at, feature_groups, out, shared, \
                    residual, norm, eps, counter, WaitForPreviousKernel());                                            \
    }
MOE_DOWN_KERNEL(, false)
MOE_DOWN_KERNEL(_shard, true)

// y[pair, h] = down_e[h] . act[pair] + down bias_e[h], e = ids[pair], for the pairs order[blockIdx.y]: moe_down's
// products, one (row, k) pair at a time, for the offload's decode path, which runs each copied expert's pairs once
// its copy has landed; moe_combine then sums a row's products in router order exactly as moe_down does, so the
// result is the same to the bit. Grid: (ceil(hidden / (MOE_WARPS * MOE_DOWN_ROWS)), pairs of this launch); each
// warp takes a group of MOE_DOWN_ROWS features, the same groups (multiples of MOE_DOWN_ROWS) as moe_down's.
template <typename Layout>
__device__ __forceinline__ void down_pairs(const Layout& layout, const float* __restrict__ act,
                                           const int* __restrict__ ids, const int* __restrict__ order,
                                           const void* const* __restrict__ experts, long long bias_at,
                                           float* __restrict__ y) {
    __shared__ WarpStaging staging[MOE_WARPS];
    const int warp = threadIdx.x >> 5;
    const int pair = order[blockIdx.y];
    const int first = (blockIdx.x * MOE_WARPS + warp) * MOE_DOWN_ROWS;
    if (first >= layout.hidden) return;
    const void* block = experts[ids[pair]];
    // Another rank's expert (expert parallelism, a null entry): a product of zeros, which adds nothing.
    if (block == nullptr) {
#pragma unroll
        for (int j = 0; j < MOE_DOWN_ROWS; ++j)
            if ((threadIdx.x & 31) == 0 && first + j < layout.hidden)
                y[static_cast<size_t>(pair) * layout.hidden + first + j] = 0.0f;
        return;
    }
    float sums[MOE_DOWN_ROWS];
    down_products(layout, block, bias_at, first, act + static_cast<size_t>(pair) * layout.inter, staging[warp], sums,
                  AlreadyWaited());
#pragma unroll
    for (int j = 0; j < MOE_DOWN_ROWS; ++j)
        if ((threadIdx.x & 31) == 0 && first + j < layout.hidden)
            y[static_cast<size_t>(pair) * layout.hidden + first + j] = sums[j];
}

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_pairs(const float* __restrict__ act, int hidden, int inter, const int* __restrict__ ids,
                   const int* __restrict__ order, const void* const* __restrict__ experts, long long bias_at,
                   float* __restrict__ y) {
    wait_for_previous_kernel();
    down_pairs(Bf16Layout{inter, hidden}, act, ids, order, experts, bias_at, y);
}

// The grouped path's activation: act[p, i] = expert_glu(gate_up[p, i], gate_up[p, inter + i]) for the n values of
// act ([pairs, inter]) from the fused product gate_up ([pairs, 2 * inter]), pair p's biases read from the block at
// pair_blocks[p] (null: no biases).
extern "C" __global__ void moe_glu_grouped(const float* __restrict__ gate_up, int inter,
                                           const uint8_t* const* __restrict__ pair_blocks, long long bias_at,
                                           int clamped, float alpha, float limit, float* __restrict__ act,
                                           size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t p = i / inter;
        const int c = static_cast<int>(i % inter);
        const float* biases = pair_blocks != nullptr ? expert_biases(pair_blocks[p], bias_at) : nullptr;
        const float* row = gate_up + p * 2 * inter;
        act[i] = expert_glu(biases, inter, c, row[c], row[inter + c], clamped, alpha, limit);
    }
}

// The grouped path's down bias: y[p, h] += down bias of the block at pair_blocks[p], over the n values of y
// ([pairs, hidden]), as the decode kernels add it to each pair's product before the router-weighted sum.
extern "C" __global__ void moe_add_down_bias(float* __restrict__ y, int hidden, int inter,
                                             const uint8_t* const* __restrict__ pair_blocks, long long bias_at,
                                             size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t p = i / hidden;
        y[i] = with_down_bias(expert_biases(pair_blocks[p], bias_at), inter, static_cast<int>(i % hidden), y[i]);
    }
}

// Gathers rows of x: out[i] = x[rows[i]] (the grouped prefill path's rows into tiles by expert, and its products
// back into router order).
extern "C" __global__ void gather_rows(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                       float* __restrict__ out, int cols) {
    wait_for_previous_kernel();
    const float* src = x + static_cast<size_t>(rows[blockIdx.x]) * cols;
    float* dst = out + static_cast<size_t>(blockIdx.x) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// out[r] = sum_k weights[r, k] * y[r * top_k + k], in router order (the prefill path's combine, and the offload
// decode path's after moe_down_pairs: the same sum, in the same order, as moe_down's). With the CPU lane, a pair p
// with host_index[p] >= 0 was computed on the host: its product is row host_index[p] of host_y instead, summed in
// its place, so the lane's share costs no extra pass over the output (host_index null: every pair is in y). With a
// residual, moe_down's fused epilogue: the sum (plus `shared`) is added to the residual row, which the block then
// normalises into out, with the same arithmetic as moe_down's last block (one block of 256 threads per row).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights, int top_k,
                                       int hidden, const float* __restrict__ host_y,
                                       const int* __restrict__ host_index, float* __restrict__ out,
                                       const float* __restrict__ shared, float* residual,
                                       const float* __restrict__ norm, float eps) {
    wait_for_previous_kernel();
    // A thread sums ROW_LOADS features at once (its features h, h + blockDim.x, ..., as block_rms_norm_row takes
    // them), so each pair's products arrive in one round of loads: one feature at a time, a 1-row decode step's
    // block waited a memory latency per (feature, pair).
    const int r = blockIdx.x, stride = blockDim.x;
    for (int first = threadIdx.x; first < hidden; first += ROW_LOADS * stride) {
        float sum[ROW_LOADS] = {};
#pragma unroll 4
        for (int k = 0; k < top_k; ++k) {
            const int pair = r * top_k + k;
            const int host = host_index != nullptr ? host_index[pair] : -1;
            const float* products = host >= 0 ? host_y + static_cast<size_t>(host) * hidden
                                              : y + static_cast<size_t>(pair) * hidden;
            const float weight = weights[pair];
#pragma unroll
            for (int j = 0; j < ROW_LOADS; ++j)
                if (first + j * stride < hidden) sum[j] += weight * products[first + j * stride];
        }
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j)
            if (first + j * stride < hidden)
                store_or_add(sum[j], static_cast<size_t>(r) * hidden + first + j * stride, shared, residual, out);
    }
    // Each thread normalises the features it added (block_rms_norm_row's), so it reads back only its own writes.
    if (residual != nullptr)
        block_rms_norm_row(residual + static_cast<size_t>(r) * hidden, norm, out + static_cast<size_t>(r) * hidden,
                           hidden, eps);
}

// ---- FP8 experts ----------------------------------------------------------------------------------------------
// An FP8 expert's block: gate [inter, hidden], up [inter, hidden], down [hidden, inter] as E4M3 bytes, then (from
// the next multiple of 16 bytes) their f32 scales: gate's and up's grids of [ceil(inter / gate_up_block_rows),
// ceil(hidden / gate_up_block_cols)] and down's of [ceil(hidden / down_block_rows), ceil(inter / down_block_cols)],
// each row-major. A weight's value is its E4M3 value times its block's scale (per channel: one row per block, the
// block as wide as the row). The decode kernels are the bf16 ones' bodies over these rows (common.cuh's Fp8Rows:
// dequantized in registers, accumulated in f32), without biases.
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

    // Bf16Layout's two.
    template <int F>
    __device__ __forceinline__ Fp8Rows<2 * F> gate_up_rows(const void* block, int i) const {
        const uint8_t* bytes = static_cast<const uint8_t*>(block);
        Fp8Rows<2 * F> rows;
        rows.block_cols = gate_up_block_cols;
#pragma unroll
        for (int f = 0; f < F; ++f) {
            const int r = min(i + f, inter - 1);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                rows.w[2 * f + m] = row(bytes, m, r);
                rows.scales[2 * f + m] = scale_row(bytes, m, r);
            }
        }
        return rows;
    }
    template <int ROWS>
    __device__ __forceinline__ Fp8Rows<ROWS> down_rows(const void* block, const int (&features)[ROWS]) const {
        const uint8_t* bytes = static_cast<const uint8_t*>(block);
        Fp8Rows<ROWS> rows;
        rows.block_cols = down_block_cols;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            rows.w[j] = row(bytes, 2, features[j]);
            rows.scales[j] = scale_row(bytes, 2, features[j]);
        }
        return rows;
    }
};

// moe_gate_up, moe_down and moe_down_pairs for FP8 expert blocks: the same grids, pairs, shared memory and sums.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up_fp8(const float* __restrict__ x, int hidden, int inter, int top_k, const int* __restrict__ ids,
                    const int* __restrict__ order, const void* const* __restrict__ experts, int gate_up_block_rows,
                    int gate_up_block_cols, int down_block_rows, int down_block_cols, float* __restrict__ act) {
    wait_for_previous_kernel();
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    gate_up<MOE_FP8_GATE_UP_FEATURES>(layout, x, top_k, ids, order, experts, -1, 0, 0.0f, 0.0f, act);
}

// At most 64 registers a thread, so that four blocks fit a multiprocessor as moe_down's do: left alone the FP8
// layout's scales take 79 and three blocks, and q30's 512-block decode launch ran in two waves (15.5 us against
// 12.7 at four blocks, without spills).
#define MOE_DOWN_FP8_KERNEL(SUFFIX, SHARD)                                                                               \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, 4)                                                    \
        moe_down_fp8##SUFFIX(const float* __restrict__ act, int hidden, int inter, int top_k,                         \
             const int* __restrict__ ids, const float* __restrict__ weights, const void* const* __restrict__ experts,  \
             int gate_up_block_rows,       \
             int gate_up_block_cols, int down_block_rows, int down_block_cols, int feature_groups,                     \
             float* __restrict__ out, const float* __restrict__ shared, float* residual,                               \
             const float* __restrict__ norm, float eps, unsigned int* counter) {                                       \
        const Fp8Layout layout{inter,           hidden,          gate_up_block_rows,                                   \
                               gate_up_block_cols, down_block_rows, down_block_cols};                                  \
        down<SHARD>(layout, act, top_k, ids, weights, experts, -1, feature_groups, out, shared, residual, norm, eps,    \
                    counter, WaitForPreviousKernel());                                                                 \
    }
MOE_DOWN_FP8_KERNEL(, false)
MOE_DOWN_FP8_KERNEL(_shard, true)

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_pairs_fp8(const float* __restrict__ act, int hidden, int inter, const int* __restrict__ ids,
                       const int* __restrict__ order, const void* const* __restrict__ experts,
                       int gate_up_block_rows, int gate_up_block_cols, int down_block_rows, int down_block_cols,
                       float* __restrict__ y) {
    wait_for_previous_kernel();
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    down_pairs(layout, act, ids, order, experts, -1, y);
}

// Matrices first..first + count - 1 of an FP8 expert block dequantized to two bf16 halves (common.cuh's
// store_bf16_halves), back to back in each (gate and up as one [2 * inter, hidden] matrix, or down): the grouped
// prefill path runs both through the same cuBLAS products as bf16 experts and adds them. A grid-stride loop over
// their inter * hidden * count values, four at a time (one word of E4M3 bytes, never across a row or a scale block)
// where the rows and scale blocks are multiples of four wide; 32-bit indices (an expert's matrices are far below
// 2^31 values).
extern "C" __global__ void dequantize_fp8_expert(const uint8_t* __restrict__ block, int hidden, int inter,
                                                 int gate_up_block_rows, int gate_up_block_cols,
                                                 int down_block_rows, int down_block_cols,
                                                 int first, int count, uint16_t* __restrict__ hi,
                                                 uint16_t* __restrict__ lo) {
    wait_for_previous_kernel();
    const Fp8Layout layout{inter, hidden, gate_up_block_rows, gate_up_block_cols, down_block_rows, down_block_cols};
    const uint32_t per_matrix = static_cast<uint32_t>(inter) * hidden;
    const bool words = (hidden & 3) == 0 && (inter & 3) == 0 && (gate_up_block_cols & 3) == 0 &&
                       (down_block_cols & 3) == 0;
    const int width = words ? 4 : 1;
    const uint32_t groups = per_matrix * count / width;
    for (uint32_t g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
        const uint32_t i = g * width;
        const int m = first + static_cast<int>(i / per_matrix);
        const uint32_t within = i % per_matrix;
        const int cols = layout.cols(m);
        const int r = static_cast<int>(within / cols), c = static_cast<int>(within % cols);
        const float scale = layout.scale_row(block, m, r)[c / layout.block_cols(m)];
        const uint8_t* src = layout.row(block, m, r) + c;
        if (words) {
            float v[4];
            fp8x4_e4m3_to_float(*reinterpret_cast<const uint32_t*>(src), v);
#pragma unroll
            for (int j = 0; j < 4; ++j) store_bf16_halves(v[j] * scale, i + j, hi, lo);
        } else {
            store_bf16_halves(fp8_e4m3_to_float(*src) * scale, i, hi, lo);
        }
    }
}

// ---- MXFP4 experts ---------------------------------------------------------------------------------------------
// An MXFP4 expert's block (gpt-oss): gate [inter, hidden], up [inter, hidden], down [hidden, inter], each packed as
// loader/mxfp4.rs packs a matrix (every row's e2m1 values, two per byte, the low nibble first, then every row's
// e8m0 scales, one per 32 values along the row) and padded to a multiple of 16 bytes; then the f32 biases (from
// bias_at). hidden and inter are multiples of 32, so every row's values start 16-byte aligned. A weight is its
// e2m1 value times its group's power of two: the decode kernels sum each group of 32 products of e2m1 values and
// activations, then scale the sum (exact, a power of two); the grouped path widens experts to bf16, exactly.

// An e2m1 nibble (sign, two exponent bits, one mantissa bit) as f32, exactly: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
// their negatives.
__device__ __forceinline__ float e2m1_to_float(uint32_t nibble) {
    const uint32_t exponent = (nibble >> 1) & 3u, mantissa = nibble & 1u;
    const float magnitude =
        exponent != 0 ? __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22)) : 0.5f * mantissa;
    return (nibble & 8u) != 0 ? -magnitude : magnitude;
}

// An e8m0 scale, 2^(byte - 127), as f32 (byte 0 is the subnormal 2^-127; 255 infinity, as the CPU reads it).
__device__ __forceinline__ float e8m0_to_float(uint32_t byte) {
    return byte == 0 ? __uint_as_float(1u << 22) : __uint_as_float(byte << 23);
}

// A warp's MXFP4 rows for warp_rows_dot (common.cuh's formats): a 16-byte copy holds one group of 32 values, whose
// products are summed, then scaled by the group's power of two.
template <int ROWS>
struct Mxfp4Rows {
    static constexpr int COPY_COLS = 32;
    const uint8_t* values[ROWS];
    const uint8_t* scales[ROWS];

    __device__ __forceinline__ bool copies_whole(int k) const { return rows_aligned(values) && (k & 31) == 0; }
    __device__ __forceinline__ const void* at(int r, int col) const { return values[r] + col / 2; }
    __device__ __forceinline__ float scale(int r, int col) const { return e8m0_to_float(scales[r][col / 32]); }
    __device__ __forceinline__ float value(int r, int col) const {
        const uint32_t byte = values[r][col / 2];
        return e2m1_to_float(col % 2 == 0 ? byte & 15u : byte >> 4) * scale(r, col);
    }
    __device__ __forceinline__ static void widen(const uint4& packed, float (&v)[COPY_COLS]) {
        const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const uint32_t byte = words[j / 4] >> (8 * (j % 4));
            v[2 * j] = e2m1_to_float(byte & 15u);
            v[2 * j + 1] = e2m1_to_float((byte >> 4) & 15u);
        }
    }
    __device__ __forceinline__ static float add_copy(const float (&wf)[COPY_COLS], const float (&xv)[COPY_COLS],
                                                     float scale, float acc) {
        return add_scaled_copy(wf, xv, scale, acc);
    }
};

struct Mxfp4Layout {
    int inter, hidden;

    // Rows and columns of matrix m (0 gate, 1 up, 2 down).
    __device__ __forceinline__ int rows(int m) const { return m < 2 ? inter : hidden; }
    __device__ __forceinline__ int cols(int m) const { return m < 2 ? hidden : inter; }
    __device__ __forceinline__ size_t matrix_bytes() const {
        return (static_cast<size_t>(inter) * hidden / 32 * 17 + 15) / 16 * 16;
    }

    // Row r of matrix m: its packed values, and its scales.
    __device__ __forceinline__ const uint8_t* values(const uint8_t* block, int m, int r) const {
        return block + m * matrix_bytes() + static_cast<size_t>(r) * cols(m) / 2;
    }
    __device__ __forceinline__ const uint8_t* scales(const uint8_t* block, int m, int r) const {
        return block + m * matrix_bytes() + static_cast<size_t>(rows(m)) * cols(m) / 2 +
               static_cast<size_t>(r) * (cols(m) / 32);
    }

    // Bf16Layout's two.
    template <int F>
    __device__ __forceinline__ Mxfp4Rows<2 * F> gate_up_rows(const void* block, int i) const {
        const uint8_t* bytes = static_cast<const uint8_t*>(block);
        Mxfp4Rows<2 * F> rows;
#pragma unroll
        for (int f = 0; f < F; ++f) {
            const int r = min(i + f, inter - 1);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                rows.values[2 * f + m] = values(bytes, m, r);
                rows.scales[2 * f + m] = scales(bytes, m, r);
            }
        }
        return rows;
    }
    template <int ROWS>
    __device__ __forceinline__ Mxfp4Rows<ROWS> down_rows(const void* block, const int (&features)[ROWS]) const {
        const uint8_t* bytes = static_cast<const uint8_t*>(block);
        Mxfp4Rows<ROWS> rows;
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
            rows.values[j] = values(bytes, 2, features[j]);
            rows.scales[j] = scales(bytes, 2, features[j]);
        }
        return rows;
    }
};

// moe_gate_up, moe_down and moe_down_pairs for MXFP4 expert blocks: the same grids, pairs, shared memory and sums.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_gate_up_mxfp4(const float* __restrict__ x, int hidden, int inter, int top_k, const int* __restrict__ ids,
                      const int* __restrict__ order, const void* const* __restrict__ experts, long long bias_at,
                      int clamped, float alpha, float limit, float* __restrict__ act) {
    wait_for_previous_kernel();
    gate_up<1>(Mxfp4Layout{inter, hidden}, x, top_k, ids, order, experts, bias_at, clamped, alpha, limit, act);
}

#define MOE_DOWN_MXFP4_KERNEL(SUFFIX, SHARD)                                                                             \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                                       \
        moe_down_mxfp4##SUFFIX(const float* __restrict__ act, int hidden, int inter, int top_k,                       \
             const int* __restrict__ ids, const float* __restrict__ weights, const void* const* __restrict__ experts,  \
             long long bias_at, int feature_groups, float* __restrict__ out, const float* __restrict__ shared,         \
             float* residual, const float* __restrict__ norm, float eps, unsigned int* counter) {                      \
        down<SHARD>(Mxfp4Layout{inter, hidden}, act, top_k, ids, weights, experts, bias_at, feature_groups, out,       \
                    shared, residual, norm, eps, counter, WaitForPreviousKernel());                                    \
    }
MOE_DOWN_MXFP4_KERNEL(, false)
MOE_DOWN_MXFP4_KERNEL(_shard, true)

extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    moe_down_pairs_mxfp4(const float* __restrict__ act, int hidden, int inter, const int* __restrict__ ids,
                         const int* __restrict__ order, const void* const* __restrict__ experts,
                         long long bias_at, float* __restrict__ y) {
    wait_for_previous_kernel();
    down_pairs(Mxfp4Layout{inter, hidden}, act, ids, order, experts, bias_at, y);
}

// Matrices first..first + count - 1 of an MXFP4 expert block widened to bf16, back to back (gate and up as one
// [2 * inter, hidden] matrix, or down), for the grouped path's cuBLAS products: exact, since an e2m1 value times a
// power of two is a bf16 number (2 significant bits, f32's exponent range). A grid-stride loop over their
// inter * hidden * count values.
extern "C" __global__ void dequantize_mxfp4_expert(const uint8_t* __restrict__ block, int hidden, int inter,
                                                   int first, int count, uint16_t* __restrict__ out) {
    wait_for_previous_kernel();
    const Mxfp4Layout layout{inter, hidden};
    const size_t per_matrix = static_cast<size_t>(inter) * hidden;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < per_matrix * count;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const int m = first + static_cast<int>(i / per_matrix);
        const size_t within = i % per_matrix;
        const int cols = layout.cols(m);
        const int r = static_cast<int>(within / cols), c = static_cast<int>(within % cols);
        const uint32_t byte = layout.values(block, m, r)[c / 2];
        const float scale = e8m0_to_float(layout.scales(block, m, r)[c / 32]);
        const float value = e2m1_to_float(c % 2 == 0 ? byte & 15u : byte >> 4) * scale;
        out[i] = float_to_bf16(value);
    }
}
