// Paged KV cache: keys and values of a layer live in pools of KV_BLOCK_SIZE-token blocks; a sequence's block
// table lists its blocks in order. Row r of a batch is at position row_pos[r] of the sequence whose block table
// starts at block_tables[row_table[r]].
//
// Decode attention on tensor cores. A decode row has one query per head, too few to fill a tensor-core tile by
// rows, so the tiles run the other way round: the query heads sharing a kv head, 8 at a time (padded), are the
// n = 8 of m16n8k8 products, 16 keys (scores) or 16 features (values) their m. Precision: the KV cache and the queries are
// f32, and products are taken in 3xTF32: each operand x is split into tf32 parts hi + lo (split_tf32), and a
// product is hi*hi + hi*lo + lo*hi accumulated in f32, leaving out lo*lo (relative error near 2^-20, against 2^-17
// for the bf16 halves of the prefill kernel).
#include "common.cuh"
#include "tensor_core.cuh"

constexpr uint32_t NO_SLOT = 0xffffffffu;
// The slot of a row's own key (at its position) in a tile copied before the kernel waits: the kernel just before
// (qkv_rope_kv_append) writes that key, so it is copied after the wait (see attend_split).
constexpr uint32_t LATE_SLOT = 0xfffffffeu;
// Warps that share a block's key tiles and a group's heads: each takes 16 of a tile's keys.
constexpr int KEY_WARPS = 2;
static_assert(KEYS_PER_TILE == 16 * KEY_WARPS, "a tile is the 16-key m of each key warp's products");
static_assert(ATTENTION_MAX_WARPS == KEY_WARPS * 4, "up to four blocks of 8 heads: groups of up to 32 heads");
static_assert(ATTENTION_MAX_STAGES - 2 <= 2, "wait_copies takes up to two pending groups");
// Splits' partial chunks an attention_combine thread holds in registers, loaded with the splits' statistics.
constexpr int COMBINE_HELD = 16;

__device__ __forceinline__ void fma4(float p, const float4& v, float4& acc) {
    acc.x = fmaf(p, v.x, acc.x);
    acc.y = fmaf(p, v.y, acc.y);
    acc.z = fmaf(p, v.z, acc.z);
    acc.w = fmaf(p, v.w, acc.w);
}

// A softmax denominator `total` of terms exp2(s - max) (scores in base 2), plus the sink's term when there are
// sinks (gpt-oss): a logit in the denominator only. A row with no keys (max -inf) never reaches here.
__device__ __forceinline__ float with_sink_log2(float total, float max, const float* sinks, int h) {
    return sinks == nullptr ? total : total + exp2f(sinks[h] * 1.4426950408889634f - max);
}

// The same in natural units (attention_combine's maxima).
__device__ __forceinline__ float with_sink(float total, float max, const float* sinks, int h) {
    return sinks == nullptr ? total : total + expf(sinks[h] - max);
}

struct AttentionArgs {
    const float* q;
    const float* k_pool;
    const float* v_pool;
    float* out;
    float* partial_out;
    float* partial_stats;
    const uint32_t* row_pos;
    const uint32_t* row_table;
    const uint32_t* block_tables;
    const float* sinks;
    int num_heads, num_kv_heads, head_dim;
    float scale;
    int window, split_len, stages;
};

// Shared-memory rows of a D-feature head: keys D + 4 floats apart, so that a key fragment's lanes (key g, feature
// t) fall in 32 banks; values D + 8 apart, for a value fragment's (key t, feature g).
template <int D>
__host__ __device__ constexpr int key_stride() {
    return D + 4;
}
template <int D>
__host__ __device__ constexpr int value_stride() {
    return D + 8;
}

// One block's work (see `attention_d*`). D: head_dim padded up to a multiple of 16 (the padding is zeros).
// inputs_ready() runs once the first tiles' copies are in flight: a decode step's keys before each row's position
// were appended by earlier steps and its batch metadata uploaded before its first kernel, so only the row's own key
// and the queries (the kernel before this one writes both) wait for it.
template <int D, typename InputsReady>
__device__ __forceinline__ void attend_split(const AttentionArgs& a, InputsReady inputs_ready) {
    constexpr int KS = key_stride<D>(), VS = value_stride<D>();
    constexpr int STEPS = D / 8;  // k-steps of a score product
    constexpr int FEATURE_BLOCKS = D / 16;  // m16 blocks of the output's features
    constexpr int STAGE_FLOATS = KEYS_PER_TILE * (KS + VS);
    constexpr int MERGE_FLOATS = 4 + 4 * FEATURE_BLOCKS;  // a lane's maxima, sums and outputs, for the merge
    static_assert(ATTENTION_MAX_WARPS / KEY_WARPS * (KEY_WARPS - 1) * MERGE_FLOATS * 32 <= 2 * STAGE_FLOATS,
                  "the key warps' merge fits in the pipeline's two stages at least");
    extern __shared__ float4 shared4[];
    const int group = a.num_heads / a.num_kv_heads, head_blocks = (group + 7) / 8;
    float* pipeline = reinterpret_cast<float*>(shared4);  // [stages][keys KS-strided, then values VS-strided]
    // The queries as split B fragments: [head block][k-step][lane] = (b0 hi, b1 hi, b0 lo, b1 lo).
    float4* q_frags = reinterpret_cast<float4*>(pipeline + a.stages * STAGE_FLOATS);
    float* probs_all = reinterpret_cast<float*>(q_frags + head_blocks * STEPS * 32);  // [warp][16 keys][8 heads]

    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int head_block = warp / KEY_WARPS, key_warp = warp % KEY_WARPS;
    const int r = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int q_cols = a.num_heads * a.head_dim, kv_width = a.num_kv_heads * a.head_dim;
    const int chunks = a.head_dim >> 2;
    const uint32_t pos = a.row_pos[r];
    const uint32_t first = (a.window > 0 && pos + 1 > static_cast<uint32_t>(a.window)) ? pos + 1 - a.window : 0;
    const uint32_t begin = first + static_cast<uint32_t>(split) * a.split_len;
    const uint32_t end = min(pos + 1, begin + a.split_len);  // exclusive; <= begin for a split past the row's keys
    const int tiles = begin < end ? static_cast<int>((end - begin + KEYS_PER_TILE - 1) / KEYS_PER_TILE) : 0;
    const uint32_t* table = a.block_tables + a.row_table[r];

    // Key features past head_dim are zeros (the copies never write them), so that they add nothing to a score.
    if (a.head_dim < D) {
        const int pad = D - a.head_dim;
        for (int i = threadIdx.x; i < a.stages * KEYS_PER_TILE * pad; i += blockDim.x)
            pipeline[(i / pad / KEYS_PER_TILE) * STAGE_FLOATS + (i / pad % KEYS_PER_TILE) * KS + a.head_dim + i % pad] =
                0.0f;
    }

    // Key j's slot in the pool.
    auto slot_of = [&](uint32_t j) { return table[j / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + j % KV_BLOCK_SIZE; };
    // Lane l's key in tile n: its slot in the pool, or NO_SLOT past the split's end; LATE_SLOT for the row's own
    // key in a tile copied before the wait (`early`).
    auto lane_slot = [&](int n, bool early) -> uint32_t {
        const uint32_t j = begin + static_cast<uint32_t>(n) * KEYS_PER_TILE + lane;
        if (n >= tiles || j >= end) return NO_SLOT;
        return early && j == pos ? LATE_SLOT : slot_of(j);
    };
    // Starts the copy of a tile (the slot of key `lane` in `slot`) into stage `stage`: a warp per key row, so each
    // row's slot is looked up once and its copy is one contiguous run of 16-byte pieces, a lane's pieces at most
    // D / 128 (rounded up), unrolled. A LATE_SLOT key is copied after the wait, through registers.
    constexpr int CHUNK_ROUNDS = (D / 4 + 31) / 32;
    auto issue = [&](uint32_t slot, int stage) {
        float* k_dst = pipeline + stage * STAGE_FLOATS;
        float* v_dst = k_dst + KEYS_PER_TILE * KS;
        for (int key = warp; key < KEYS_PER_TILE; key += warps) {
            const uint32_t key_slot = __shfl_sync(0xffffffffu, slot, key);
            if (key_slot == LATE_SLOT) continue;
            const bool present = key_slot != NO_SLOT;
            const size_t at = static_cast<size_t>(present ? key_slot : 0) * kv_width +
                              static_cast<size_t>(kv_head) * a.head_dim;
#pragma unroll
            for (int round = 0; round < CHUNK_ROUNDS; ++round) {
                const int chunk = lane + 32 * round;
                if (chunk < chunks) {
                    cp_async_16(k_dst + key * KS + 4 * chunk, a.k_pool + at + 4 * chunk, present);
                    cp_async_16(v_dst + key * VS + 4 * chunk, a.v_pool + at + 4 * chunk, present);
                }
            }
        }
    };

    // Pipeline: tiles k + 1 .. k + stages - 1 are in flight while tile k is computed. Copy group g holds tile g
    // (empty past the last tile), so waiting for all but the latest stages - 2 groups means tile k has landed.
    // The slot of the next tile to copy is loaded one tile ahead, so a copy never waits on the block table.
    // The first stages - 1 tiles are copied before the wait, the rest after it.
    uint32_t next_slot = lane_slot(0, true);
    for (int n = 0; n < a.stages - 1; ++n) {
        const uint32_t following = lane_slot(n + 1, n + 1 < a.stages - 1);
        if (n < tiles) issue(next_slot, n);
        commit_copies();
        next_slot = following;
    }
    inputs_ready();
    // The row's own key, if one of those tiles holds it: its warp copies it through registers, before the first
    // tile's barrier.
    if (pos >= begin && pos < end && (pos - begin) / KEYS_PER_TILE < static_cast<uint32_t>(a.stages - 1)) {
        const int n = static_cast<int>((pos - begin) / KEYS_PER_TILE);
        const int key = static_cast<int>((pos - begin) % KEYS_PER_TILE);
        if (key % warps == warp) {
            const size_t at = static_cast<size_t>(slot_of(pos)) * kv_width + static_cast<size_t>(kv_head) * a.head_dim;
            float* k_dst = pipeline + n * STAGE_FLOATS;
            float* v_dst = k_dst + KEYS_PER_TILE * KS;
            for (int chunk = lane; chunk < chunks; chunk += 32) {
                *reinterpret_cast<float4*>(k_dst + key * KS + 4 * chunk) =
                    __ldcg(reinterpret_cast<const float4*>(a.k_pool + at) + chunk);
                *reinterpret_cast<float4*>(v_dst + key * VS + 4 * chunk) =
                    __ldcg(reinterpret_cast<const float4*>(a.v_pool + at) + chunk);
            }
        }
    }
    // Query fragments: B (feature t or t + 4 of k-step s, head g); heads past the group and features past
    // head_dim are zeros. Built while the first tiles are on their way: every thread builds D / 16 (the block has
    // KEY_WARPS = 2 warps of 32 lanes for each head block's D / 8 k-steps of 32 fragments).
    static_assert(KEY_WARPS == 2, "D / 16 query fragments a thread");
    const float* q_row = a.q + static_cast<size_t>(r) * q_cols + static_cast<size_t>(kv_head) * group * a.head_dim;
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        const int i = threadIdx.x + n * blockDim.x;
        const int l = i & 31, step = (i >> 5) % STEPS, head = 8 * ((i >> 5) / STEPS) + (l >> 2);
        const int f = 8 * step + (l & 3);
        const bool in_group = head < group;
        const float b0 = in_group && f < a.head_dim ? q_row[head * a.head_dim + f] : 0.0f;
        const float b1 = in_group && f + 4 < a.head_dim ? q_row[head * a.head_dim + f + 4] : 0.0f;
        uint32_t hi0, lo0, hi1, lo1;
        split_tf32(b0, hi0, lo0);
        split_tf32(b1, hi1, lo1);
        q_frags[i] = make_float4(__uint_as_float(hi0), __uint_as_float(hi1), __uint_as_float(lo0), __uint_as_float(lo1));
    }

    // out^T: features 16 f + g (+ 8) of heads 2t, 2t + 1 of the warp's head block, as C fragments.
    float o[FEATURE_BLOCKS][4];
#pragma unroll
    for (int f = 0; f < FEATURE_BLOCKS; ++f) o[f][0] = o[f][1] = o[f][2] = o[f][3] = 0.0f;
    // Per head 2t + h: the maximum of the scores so far (base 2), and this lane's keys' share of the denominator.
    float running_max[2] = {-INFINITY, -INFINITY}, lane_sum[2] = {0.0f, 0.0f};
    const float scale_log2 = a.scale * 1.4426950408889634f;  // exp(s) = exp2(s * log2(e))
    const float4* warp_q = q_frags + head_block * STEPS * 32 + lane;
    float* probs = probs_all + warp * 16 * 8;

    for (int k = 0; k < tiles; ++k) {
        wait_copies(a.stages - 2);
        __syncthreads();  // tile k is visible to all; every warp is done with tile k - 1, whose stage is reused
        const int n = k + a.stages - 1;
        const uint32_t following = lane_slot(n + 1, false);
        if (n < tiles) issue(next_slot, n % a.stages);
        commit_copies();
        next_slot = following;

        const float* keys = pipeline + (k % a.stages) * STAGE_FLOATS + 16 * key_warp * KS;
        const float* values = pipeline + (k % a.stages) * STAGE_FLOATS + KEYS_PER_TILE * KS + 16 * key_warp * VS;
        // Scores^T = K Q^T: 16 keys by 8 heads. Two accumulators each for hi*hi and the cross terms (even and odd
        // k-steps), so that consecutive products do not wait on each other.
        float main_part[2][4] = {}, cross_part[2][4] = {};
#pragma unroll
        for (int step = 0; step < STEPS; ++step) {
            uint32_t k_hi[4], k_lo[4];
            load_a_split(keys + 8 * step, KS, 1, g, t, k_hi, k_lo);
            const float4 qf = warp_q[step * 32];
            const uint32_t q0_hi = __float_as_uint(qf.x), q1_hi = __float_as_uint(qf.y);
            mma_tf32(main_part[step & 1], k_hi, q0_hi, q1_hi);
            mma_tf32(cross_part[step & 1], k_hi, __float_as_uint(qf.z), __float_as_uint(qf.w));
            mma_tf32(cross_part[step & 1], k_lo, q0_hi, q1_hi);
        }
        // Score e of this lane: key g + 8 (e >> 1) of the warp's 16, head 2t + (e & 1); masked past the split's end.
        const uint32_t key0 = begin + static_cast<uint32_t>(k * KEYS_PER_TILE + 16 * key_warp + g);
        float s[4], tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float score = (main_part[0][e] + main_part[1][e]) + (cross_part[0][e] + cross_part[1][e]);
            s[e] = key0 + 8 * (e >> 1) < end ? score * scale_log2 : -INFINITY;
            tile_max[e & 1] = fmaxf(tile_max[e & 1], s[e]);
        }
        // Online softmax over the warp's keys (the lanes of one t share heads): rescale what was summed so far.
        float base[2], correction[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int offset = 4; offset < 32; offset <<= 1)
                tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], offset));
            const float new_max = fmaxf(running_max[h], tile_max[h]);
            // A warp that has seen no key yet keeps max -inf; exponents are then taken against 0 (every p is 0).
            base[h] = new_max == -INFINITY ? 0.0f : new_max;
            correction[h] = exp2f(running_max[h] - base[h]);
            running_max[h] = new_max;
            lane_sum[h] *= correction[h];
        }
#pragma unroll
        for (int f = 0; f < FEATURE_BLOCKS; ++f) {
            o[f][0] *= correction[0];
            o[f][1] *= correction[1];
            o[f][2] *= correction[0];
            o[f][3] *= correction[1];
        }
        // The probabilities, through the warp's shared rows, into B fragments (key t or t + 4, head g).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[e] = exp2f(s[e] - base[e & 1]);
            lane_sum[e & 1] += s[e];
        }
        *reinterpret_cast<float2*>(probs + g * 8 + 2 * t) = make_float2(s[0], s[1]);
        *reinterpret_cast<float2*>(probs + (g + 8) * 8 + 2 * t) = make_float2(s[2], s[3]);
        __syncwarp();
        // out^T += V^T P^T: features by 8 heads, 8 keys a product.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint32_t p_hi[2], p_lo[2];
            split_tf32(probs[(8 * half + t) * 8 + g], p_hi[0], p_lo[0]);
            split_tf32(probs[(8 * half + t + 4) * 8 + g], p_hi[1], p_lo[1]);
#pragma unroll
            for (int f = 0; f < FEATURE_BLOCKS; ++f) {
                uint32_t v_hi[4], v_lo[4];
                load_a_split(values + 8 * half * VS + 16 * f, 1, VS, g, t, v_hi, v_lo);
                mma_tf32(o[f], v_lo, p_hi[0], p_hi[1]);
                mma_tf32(o[f], v_hi, p_lo[0], p_lo[1]);
                mma_tf32(o[f], v_hi, p_hi[0], p_hi[1]);
            }
        }
        // The next write of probs comes after the next tile's __syncthreads, so no barrier is needed here.
    }

    // The denominators over the warp's keys; then the key warps of a head block merge into the first.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int offset = 4; offset < 32; offset <<= 1) lane_sum[h] += __shfl_xor_sync(0xffffffffu, lane_sum[h], offset);
    __syncthreads();  // every warp is done with the pipeline, which now holds the merge
    float* merge = pipeline + (head_block * (KEY_WARPS - 1)) * MERGE_FLOATS * 32 + lane;  // [warp][float][lane]
    if (key_warp > 0) {
        float* mine = merge + (key_warp - 1) * MERGE_FLOATS * 32;
        mine[0] = running_max[0], mine[32] = running_max[1], mine[64] = lane_sum[0], mine[96] = lane_sum[1];
#pragma unroll
        for (int f = 0; f < FEATURE_BLOCKS; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(4 + 4 * f + e) * 32] = o[f][e];
    }
    __syncthreads();
    if (key_warp > 0) return;
    for (int other = 1; other < KEY_WARPS; ++other) {
        const float* theirs = merge + (other - 1) * MERGE_FLOATS * 32;
        float mine_weight[2], their_weight[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float their_max = theirs[32 * h];
            const float new_max = fmaxf(running_max[h], their_max);
            const float base = new_max == -INFINITY ? 0.0f : new_max;
            mine_weight[h] = exp2f(running_max[h] - base);
            their_weight[h] = exp2f(their_max - base);
            running_max[h] = new_max;
            lane_sum[h] = lane_sum[h] * mine_weight[h] + theirs[64 + 32 * h] * their_weight[h];
        }
#pragma unroll
        for (int f = 0; f < FEATURE_BLOCKS; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[f][e] = o[f][e] * mine_weight[e & 1] + theirs[(4 + 4 * f + e) * 32] * their_weight[e & 1];
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int head_in_group = 8 * head_block + 2 * t + h;
        if (head_in_group >= group) continue;
        const int head = kv_head * group + head_in_group;
        const size_t part = (static_cast<size_t>(r) * a.num_heads + head) * splits + split;
        // With one split the output is final, its denominator with the head's sink; with several, the partial
        // (max in natural units, denominator, unnormalised sum) is for attention_combine, which adds the sink.
        float* dst = splits == 1 ? a.out + static_cast<size_t>(r) * q_cols + head * a.head_dim
                                 : a.partial_out + part * a.head_dim;
        const float scale_out = splits == 1 ? 1.0f / with_sink_log2(lane_sum[h], running_max[h], a.sinks, head) : 1.0f;
#pragma unroll
        for (int f = 0; f < FEATURE_BLOCKS; ++f)
#pragma unroll
            for (int upper = 0; upper < 2; ++upper) {
                const int feature = 16 * f + g + 8 * upper;
                if (feature < a.head_dim) dst[feature] = o[f][2 * upper + h] * scale_out;
            }
        if (splits > 1 && g == 0) {
            a.partial_stats[2 * part] = running_max[h] * 0.6931471805599453f;  // log2 -> natural units
            a.partial_stats[2 * part + 1] = lane_sum[h];
        }
    }
}

// Causal attention, split along the keys: block (row r, kv head g, split s) takes the query heads that share kv
// head g over keys [first + s * split_len, first + (s + 1) * split_len) of row r's range first..=pos, where
// first is where the sliding window starts (0 without one: window == 0). The block has KEY_WARPS warps for each
// 8 of the group's heads (padded up); keys and values come into shared memory KEYS_PER_TILE at a time through a
// pipeline of `stages` (2 or 3) tiles filled by cp.async, and each key warp takes 16 keys of a tile against its
// heads on tensor cores (see the top of the file), with an online softmax in f32 (no scores matrix is stored);
// the key warps then merge. With one split the block writes the output; with several it writes its partial
// (max, denominator, unnormalised output) for attention_combine. `sinks` (null: none) holds a logit per query
// head that joins the softmax's denominator only. The first tiles' copies start before the wait for the kernel
// before it (attend_split). attention_d{D}: D the head_dim padded up (attention.rs's BlockShape gives the kernel
// and its dynamic shared memory).
#define ATTENTION_KERNEL(D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(ATTENTION_MAX_WARPS * 32) attention_d##D(                         \
        const float* __restrict__ q, const float* __restrict__ k_pool, const float* __restrict__ v_pool,           \
        float* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_stats,               \
        const uint32_t* __restrict__ row_pos, const uint32_t* __restrict__ row_table,                              \
        const uint32_t* __restrict__ block_tables, const float* __restrict__ sinks, int num_heads, int num_kv_heads, \
        int head_dim, float scale, int window, int split_len, int stages) {                                         \
        const AttentionArgs a{q,         k_pool,       v_pool, out,       partial_out,  partial_stats,             \
                              row_pos,   row_table,    block_tables, sinks,     num_heads,    num_kv_heads,        \
                              head_dim,  scale,        window, split_len, stages};                                  \
        attend_split<D>(a, WaitForPreviousKernel());                                                               \
    }

ATTENTION_KERNEL(16)
ATTENTION_KERNEL(32)
ATTENTION_KERNEL(64)
ATTENTION_KERNEL(128)
ATTENTION_KERNEL(256)
// Merges the splits' partials of every (row, head): block (r, h). Warp 0 turns the splits' maxima into weights;
// then every thread sums one float4 chunk of head_dim over an interleaved share of the splits, and the shares
// are added in shared memory; the head's sink (if `sinks` is not null) joins the denominator. A thread loads its
// first COMBINE_HELD splits' chunks together with warp 0's loads of the maxima, so that the block waits on one
// round of loads, not two. splits <= ATTENTION_MAX_SPLITS, head_dim / 4 <= ATTENTION_COMBINE_THREADS.
extern "C" __global__ void __launch_bounds__(ATTENTION_COMBINE_THREADS)
    attention_combine(const float* __restrict__ partial_out, const float* __restrict__ partial_stats,
                      const float* __restrict__ sinks, float* __restrict__ out, int num_heads, int head_dim,
                      int splits) {
    wait_for_previous_kernel();
    __shared__ float weight[ATTENTION_MAX_SPLITS];
    __shared__ float denominator;
    __shared__ float4 shares[ATTENTION_COMBINE_THREADS];
    const size_t head = static_cast<size_t>(blockIdx.x) * num_heads + blockIdx.y;
    const float2* stats = reinterpret_cast<const float2*>(partial_stats) + head * splits;  // (max, denominator)
    const int chunks = head_dim >> 2;
    const int shares_n = blockDim.x / chunks;
    const int share = threadIdx.x / chunks, chunk = threadIdx.x % chunks;
    const float4* parts = reinterpret_cast<const float4*>(partial_out) + head * splits * chunks;
    // Split share + i * shares_n's chunk, for the first COMBINE_HELD of the thread's splits.
    float4 held[COMBINE_HELD];
#pragma unroll
    for (int i = 0; i < COMBINE_HELD; ++i) {
        const int s = share + i * shares_n;
        held[i] = share < shares_n && s < splits ? parts[static_cast<size_t>(s) * chunks + chunk]
                                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (threadIdx.x < 32) {
        constexpr int PER_LANE = ATTENTION_MAX_SPLITS / 32;
        float2 mine[PER_LANE];
        float total_max = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int s = threadIdx.x + 32 * i;
            mine[i] = s < splits ? stats[s] : make_float2(-INFINITY, 0.0f);
            total_max = fmaxf(total_max, mine[i].x);
        }
        total_max = warp_max(total_max);
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int s = threadIdx.x + 32 * i;
            // A split with no keys has max -inf and a zero sum: weight 0.
            const float w = mine[i].x == -INFINITY ? 0.0f : expf(mine[i].x - total_max);
            if (s < splits) weight[s] = w;
            total = fmaf(w, mine[i].y, total);
        }
        total = warp_sum(total);
        if (threadIdx.x == 0) denominator = with_sink(total, total_max, sinks, blockIdx.y);
    }
    __syncthreads();
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (share < shares_n) {
#pragma unroll
        for (int i = 0; i < COMBINE_HELD; ++i) {
            const int s = share + i * shares_n;
            if (s < splits) fma4(weight[s], held[i], sum);
        }
#pragma unroll 8
        for (int s = share + COMBINE_HELD * shares_n; s < splits; s += shares_n)
            fma4(weight[s], parts[static_cast<size_t>(s) * chunks + chunk], sum);
    }
    shares[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x < chunks) {
        float4 o = shares[threadIdx.x];
        for (int i = 1; i < shares_n; ++i) {
            const float4 x = shares[i * chunks + threadIdx.x];
            o.x += x.x;
            o.y += x.y;
            o.z += x.z;
            o.w += x.w;
        }
        reinterpret_cast<float4*>(out + head * head_dim)[threadIdx.x] =
            make_float4(o.x / denominator, o.y / denominator, o.z / denominator, o.w / denominator);
    }
}
