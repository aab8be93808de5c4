// Paged KV cache: keys and values of a layer live in pools of KV_BLOCK_SIZE-token blocks; a sequence's block
// table lists its blocks in order. Row r of a batch is at position row_pos[r] of the sequence whose block table
// starts at block_tables[row_table[r]].
#include "common.cuh"

static_assert(MAX_HEAD_DIM <= 2 * 32 * 4, "a lane holds at most two float4 chunks of a value row");
constexpr uint32_t NO_SLOT = 0xffffffffu;

// 16 bytes global -> shared without passing through registers; with `fill` false nothing is read and the 16
// bytes are zeroed (keys past the end of a split: zero values keep 0 * v finite).
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, bool fill) {
    const uint32_t dst_shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `pending` (stages - 2) of this thread's latest copy groups are in flight.
static_assert(ATTENTION_MAX_STAGES - 2 <= 1, "cp_async_wait takes pending 0 or 1");
__device__ __forceinline__ void cp_async_wait(int pending) {
    if (pending == 0)
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    else
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

__device__ __forceinline__ float component(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void fma4(float p, const float4& v, float4& acc) {
    acc.x = fmaf(p, v.x, acc.x);
    acc.y = fmaf(p, v.y, acc.y);
    acc.z = fmaf(p, v.z, acc.z);
    acc.w = fmaf(p, v.w, acc.w);
}

// A softmax denominator `total` of terms exp(s - max), plus the sink's exp(sinks[h] - max) when there are sinks
// (gpt-oss): a logit in the denominator only. A row with no keys (max -inf) never reaches here.
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

// One block's work (see `attention`), with HEADS query heads per warp and CHUNKS float4 chunks of a value row
// per lane (1: head_dim <= 128, 2: head_dim <= 256).
template <int HEADS, int CHUNKS>
__device__ __forceinline__ void attend_split(const AttentionArgs& a) {
    extern __shared__ float4 shared4[];
    const int group = a.num_heads / a.num_kv_heads;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = a.head_dim >> 2;
    // Rows padded by 4 floats: lanes reading float4s of different keys' rows fall in different banks.
    const int stride = a.head_dim + 4;
    const int stage_floats = 2 * KEYS_PER_TILE * stride;
    float* pipeline = reinterpret_cast<float*>(shared4);  // [stages][keys, values][KEYS_PER_TILE][stride]
    float* q_group = pipeline + a.stages * stage_floats;  // [group][head_dim]
    float* warp_probs = q_group + group * a.head_dim + warp * HEADS * KEYS_PER_TILE;  // [HEADS][KEYS_PER_TILE]

    const int r = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int q_cols = a.num_heads * a.head_dim, kv_width = a.num_kv_heads * a.head_dim;
    const uint32_t pos = a.row_pos[r];
    const uint32_t first = (a.window > 0 && pos + 1 > static_cast<uint32_t>(a.window)) ? pos + 1 - a.window : 0;
    const uint32_t begin = first + static_cast<uint32_t>(split) * a.split_len;
    const uint32_t end = min(pos + 1, begin + a.split_len);  // exclusive; <= begin for a split past the row's keys
    const int tiles = begin < end ? static_cast<int>((end - begin + KEYS_PER_TILE - 1) / KEYS_PER_TILE) : 0;
    const uint32_t* table = a.block_tables + a.row_table[r];

    const float4* q_src = reinterpret_cast<const float4*>(a.q + static_cast<size_t>(r) * q_cols +
                                                          static_cast<size_t>(kv_head) * group * a.head_dim);
    for (int i = threadIdx.x; i < group * chunks; i += blockDim.x) reinterpret_cast<float4*>(q_group)[i] = q_src[i];

    // This warp's heads within the group; past the group's end a warp repeats its first head and writes nothing.
    const int head0 = warp * HEADS, warp_heads = min(HEADS, group - head0);
    int q_offset[HEADS];  // in float4s from q_group
#pragma unroll
    for (int i = 0; i < HEADS; ++i) q_offset[i] = (i < warp_heads ? head0 + i : head0) * chunks;
    int lane_chunk[CHUNKS];  // the value chunks this lane accumulates, clamped in range (the extra ones unwritten)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) lane_chunk[c] = min(lane + 32 * c, chunks - 1);

    // Lane l's key in tile n: its slot in the pool, or NO_SLOT past the split's end.
    auto lane_slot = [&](int n) -> uint32_t {
        const uint32_t j = begin + static_cast<uint32_t>(n) * KEYS_PER_TILE + lane;
        return n < tiles && j < end ? table[j / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + j % KV_BLOCK_SIZE : NO_SLOT;
    };
    // Starts the copy of a tile (the slot of key `lane` in `slot`) into stage `stage`: a warp per key row, so each
    // row's slot is looked up once and its copy is one contiguous run of 16-byte pieces.
    auto issue = [&](uint32_t slot, int stage) {
        float* k_dst = pipeline + stage * stage_floats;
        float* v_dst = k_dst + KEYS_PER_TILE * stride;
        for (int t = warp; t < KEYS_PER_TILE; t += warps) {
            const uint32_t key_slot = __shfl_sync(0xffffffffu, slot, t);
            const bool present = key_slot != NO_SLOT;
            const size_t at = static_cast<size_t>(present ? key_slot : 0) * kv_width +
                              static_cast<size_t>(kv_head) * a.head_dim;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int chunk = lane + 32 * c;
                if (chunk < chunks) {
                    cp_async_16(k_dst + t * stride + 4 * chunk, a.k_pool + at + 4 * chunk, present);
                    cp_async_16(v_dst + t * stride + 4 * chunk, a.v_pool + at + 4 * chunk, present);
                }
            }
        }
    };

    float4 acc[HEADS][CHUNKS];
    float running_max[HEADS], lane_sum[HEADS];  // lane_sum: this lane's keys' share of the denominator
#pragma unroll
    for (int i = 0; i < HEADS; ++i) {
        running_max[i] = -INFINITY;
        lane_sum[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) acc[i][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }

    // Pipeline: tiles k + 1 .. k + stages - 1 are in flight while tile k is computed. Copy group g holds tile g
    // (empty past the last tile), so waiting for all but the latest stages - 2 groups means tile k has landed.
    // The slot of the next tile to copy is loaded one tile ahead, so a copy never waits on the block table.
    uint32_t next_slot = lane_slot(0);
    for (int n = 0; n < a.stages - 1; ++n) {
        const uint32_t following = lane_slot(n + 1);
        if (n < tiles) issue(next_slot, n);
        cp_async_commit();
        next_slot = following;
    }
    for (int k = 0; k < tiles; ++k) {
        cp_async_wait(a.stages - 2);
        __syncthreads();  // tile k is visible to all; every warp is done with tile k - 1, whose stage is reused
        const int n = k + a.stages - 1;
        const uint32_t following = lane_slot(n + 1);
        if (n < tiles) issue(next_slot, n % a.stages);
        cp_async_commit();
        next_slot = following;

        const float* k_tile = pipeline + (k % a.stages) * stage_floats;
        const float* v_tile = k_tile + KEYS_PER_TILE * stride;
        const int keys = min(KEYS_PER_TILE, static_cast<int>(end - begin) - k * KEYS_PER_TILE);
        // Scores: lane = key, every head of the warp against it.
        float score[HEADS];
#pragma unroll
        for (int i = 0; i < HEADS; ++i) score[i] = 0.0f;
        const float4* k_row = reinterpret_cast<const float4*>(k_tile + lane * stride);
        const float4* q4 = reinterpret_cast<const float4*>(q_group);
        for (int c = 0; c < chunks; ++c) {
            const float4 kc = k_row[c];
#pragma unroll
            for (int i = 0; i < HEADS; ++i) {
                const float4 qc = q4[q_offset[i] + c];
                score[i] = fmaf(qc.x, kc.x, score[i]);
                score[i] = fmaf(qc.y, kc.y, score[i]);
                score[i] = fmaf(qc.z, kc.z, score[i]);
                score[i] = fmaf(qc.w, kc.w, score[i]);
            }
        }
        // Online softmax: rescale what was summed so far to the new maximum.
#pragma unroll
        for (int i = 0; i < HEADS; ++i) {
            const float s = lane < keys ? score[i] * a.scale : -INFINITY;
            const float new_max = fmaxf(running_max[i], warp_max(s));
            const float correction = expf(running_max[i] - new_max);
            const float p = expf(s - new_max);
            lane_sum[i] = fmaf(lane_sum[i], correction, p);
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                acc[i][c].x *= correction;
                acc[i][c].y *= correction;
                acc[i][c].z *= correction;
                acc[i][c].w *= correction;
            }
            warp_probs[i * KEYS_PER_TILE + lane] = p;
            running_max[i] = new_max;
        }
        __syncwarp();
        // Values: lane = value chunk; keys past `keys` have p = 0 and zeroed values.
        const float4* probs4 = reinterpret_cast<const float4*>(warp_probs);
        for (int t = 0; t < keys; t += 4) {
            float4 p4[HEADS];
#pragma unroll
            for (int i = 0; i < HEADS; ++i) p4[i] = probs4[(i * KEYS_PER_TILE + t) >> 2];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float4* v_row = reinterpret_cast<const float4*>(v_tile + (t + u) * stride);
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c) {
                    const float4 vc = v_row[lane_chunk[c]];
#pragma unroll
                    for (int i = 0; i < HEADS; ++i) fma4(component(p4[i], u), vc, acc[i][c]);
                }
            }
        }
        // The next write of warp_probs comes after the next tile's __syncthreads, so no barrier is needed here.
    }

#pragma unroll
    for (int i = 0; i < HEADS; ++i) {
        const float total = warp_sum(lane_sum[i]);
        if (i >= warp_heads) continue;
        const int h = kv_head * group + head0 + i;
        const size_t part = (static_cast<size_t>(r) * a.num_heads + h) * splits + split;
        float4* dst = splits == 1
                          ? reinterpret_cast<float4*>(a.out + static_cast<size_t>(r) * q_cols + h * a.head_dim)
                          : reinterpret_cast<float4*>(a.partial_out + part * a.head_dim);
        // With one split the output is final, its denominator with the head's sink; with several, the partial
        // (max, denominator, unnormalised sum) is for attention_combine, which adds the sink.
        const float denominator = splits == 1 ? with_sink(total, running_max[i], a.sinks, h) : total;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            if (lane + 32 * c >= chunks) continue;
            float4 o = acc[i][c];
            if (splits == 1) {
                o.x /= denominator;
                o.y /= denominator;
                o.z /= denominator;
                o.w /= denominator;
            }
            dst[lane + 32 * c] = o;
        }
        if (splits > 1 && lane == 0) {
            a.partial_stats[2 * part] = running_max[i];
            a.partial_stats[2 * part + 1] = total;
        }
    }
}

template <int CHUNKS>
__device__ __forceinline__ void attend_split_heads(int heads_per_warp, const AttentionArgs& a) {
    switch (heads_per_warp) {
        case 1: attend_split<1, CHUNKS>(a); break;
        case 2: attend_split<2, CHUNKS>(a); break;
        case 4: attend_split<4, CHUNKS>(a); break;
        default: attend_split<8, CHUNKS>(a); break;
    }
}

// Causal attention, split along the keys: block (row r, kv head g, split s) takes the query heads that share kv
// head g over keys [first + s * split_len, first + (s + 1) * split_len) of row r's range first..=pos, where
// first is where the sliding window starts (0 without one: window == 0). Each of the block's warps takes
// heads_per_warp (1, 2, 4 or 8) of the group's heads. Keys and values come into shared memory KEYS_PER_TILE at a
// time through a pipeline of `stages` (2 or 3) tiles filled by cp.async, so a block keeps whole tiles of loads in
// flight while it computes; the group's heads read each tile once. Scores take one lane per key, values one lane
// per float4 chunk of head_dim (a multiple of 4, at most 256), with an online softmax in f32 (no scores matrix
// is stored). With one split the block writes the output; with several it writes its partial (max, denominator,
// unnormalised output) for attention_combine. `sinks` (null: none) holds a logit per query head that joins the
// softmax's denominator only. Dynamic shared memory, in floats:
// stages * 2 * KEYS_PER_TILE * (head_dim + 4) + group * head_dim + warps * heads_per_warp * KEYS_PER_TILE.
extern "C" __global__ void __launch_bounds__(ATTENTION_MAX_WARPS * 32)
    attention(const float* __restrict__ q, const float* __restrict__ k_pool, const float* __restrict__ v_pool,
              float* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_stats,
              const uint32_t* __restrict__ row_pos, const uint32_t* __restrict__ row_table,
              const uint32_t* __restrict__ block_tables, const float* __restrict__ sinks, int num_heads,
              int num_kv_heads, int head_dim, float scale, int window, int split_len, int heads_per_warp, int stages) {
    wait_for_previous_kernel();
    const AttentionArgs a{q,         k_pool,       v_pool, out,       partial_out,  partial_stats,
                          row_pos,   row_table,    block_tables, sinks,     num_heads,    num_kv_heads,
                          head_dim,  scale,        window, split_len, stages};
    if (head_dim <= 128)
        attend_split_heads<1>(heads_per_warp, a);
    else
        attend_split_heads<2>(heads_per_warp, a);
}

// Merges the splits' partials of every (row, head): block (r, h). Warp 0 turns the splits' maxima into weights;
// then every thread sums one float4 chunk of head_dim over an interleaved share of the splits, and the shares
// are added in shared memory; the head's sink (if `sinks` is not null) joins the denominator.
// splits <= ATTENTION_MAX_SPLITS, head_dim / 4 <= ATTENTION_COMBINE_THREADS.
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
    const int chunks = head_dim >> 2;
    const int shares_n = blockDim.x / chunks;
    const int share = threadIdx.x / chunks, chunk = threadIdx.x % chunks;
    const float4* parts = reinterpret_cast<const float4*>(partial_out) + head * splits * chunks;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (share < shares_n) {
#pragma unroll 8
        for (int s = share; s < splits; s += shares_n)
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
