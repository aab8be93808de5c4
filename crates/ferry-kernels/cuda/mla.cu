// Multi-head latent attention (DeepSeek-V3's MLA) over the latent paged cache, computed in latent space for every
// row (prefill and decode): kv_b_proj's key rows W_k[h] are absorbed into each head's query (q_c = W_k[h]^T q_nope)
// and its value rows W_v[h] into the output (W_v[h] o_c), so the cache holds one row of kv_lora_rank + rope floats
// per token and is never expanded per head. The kernels, in the order mla.rs launches them:
//   mla_latent_append  block per row: c normalised by kv_a_layernorm, the shared key rotated, written to the row's
//                      cache slot;
//   mla_absorb_query   block per (row, head): the head's query in latent space;
//   mla_attend         block per (row, group of heads, split of the keys): softmax attention of the group's heads
//                      over the latent rows, each key row read once for the whole group (o_c = sum p_j c_j);
//   attention_combine  (attention.cu) when the keys were split: the splits' partials merged into o_c;
//   mla_expand         block per (row, head): the output W_v[h] o_c.
#include "common.cuh"

// Rotates the rope features of `in` into `out` at position `pos`: pairs (2i, 2i + 1) when `interleaved`, else
// (i, i + half), by the angle pos * inv_freq[i], cos and sin times `scale`; threads stride over the pairs.
__device__ __forceinline__ void rotate_rope(const float* __restrict__ in, float* __restrict__ out, int rope_dim,
                                            uint32_t pos, const float* __restrict__ inv_freq, int interleaved,
                                            float scale) {
    const int half = rope_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float sin_angle, cos_angle;
        sincosf(static_cast<float>(pos) * inv_freq[i], &sin_angle, &cos_angle);
        cos_angle *= scale;
        sin_angle *= scale;
        const float x_a = in[a], x_b = in[b];
        out[a] = x_a * cos_angle - x_b * sin_angle;
        out[b] = x_b * cos_angle + x_a * sin_angle;
    }
}

// Block per row of `compressed` ([rows, rank + rope_dim]): RMSNorm of c times kv_norm, then the rotated shared key,
// into the pool row of slot row_slot[row].
extern "C" __global__ void mla_latent_append(const float* __restrict__ compressed, const float* __restrict__ kv_norm,
                                             int rank, int rope_dim, float eps, const uint32_t* __restrict__ positions,
                                             const float* __restrict__ inv_freq, int interleaved, float rope_scale,
                                             const uint32_t* __restrict__ row_slot, float* __restrict__ pool) {
    wait_for_previous_kernel();
    const int row = blockIdx.x, width = rank + rope_dim;
    const float* in = compressed + static_cast<size_t>(row) * width;
    float* out = pool + static_cast<size_t>(row_slot[row]) * width;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) squares += in[i] * in[i];
    const float inv_rms = rsqrtf(block_sum(squares) / static_cast<float>(rank) + eps);
    for (int i = threadIdx.x; i < rank; i += blockDim.x) out[i] = in[i] * inv_rms * kv_norm[i];
    rotate_rope(in + rank, out + rank, rope_dim, positions[row], inv_freq, interleaved, rope_scale);
}

// kv_b_proj's weight (r, c) of its `cols` columns: bf16 (`bf16` not null), or an E4M3 byte times its block's f32
// scale (an FP8 checkpoint's kv_b_proj, read as stored: the product is the CPU reference's dequantized weight).
struct KvB {
    const uint16_t* bf16;
    const uint8_t* fp8;
    const float* scales;
    int cols, block_rows, block_cols;
    __device__ __forceinline__ float at(size_t r, int c) const {
        const size_t i = r * cols + c;
        if (bf16 != nullptr) return bf16_to_float(bf16[i]);
        const int scales_per_row = (cols + block_cols - 1) / block_cols;
        return fp8_e4m3_to_float(fp8[i]) * scales[(r / block_rows) * scales_per_row + c / block_cols];
    }
};

// Block per (row, head) of a chunk of rows starting at `first_row`: the head's query in latent space, q_lat[row,
// head] = [W_k[h]^T q_nope, rope(q_rope)] (width = rank + rope_dim), threads over the features of c so a warp reads
// consecutive weights of one kv_b row.
extern "C" __global__ void mla_absorb_query(const float* __restrict__ q, const uint16_t* __restrict__ kv_b_bf16,
                                           const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales,
                                           int block_rows, int block_cols, const uint32_t* __restrict__ row_pos,
                                           int first_row, const float* __restrict__ inv_freq, int interleaved,
                                           float rope_scale, int heads, int rank, int nope, int rope_dim, int v_dim,
                                           float* __restrict__ q_lat) {
    wait_for_previous_kernel();
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int chunk_row = blockIdx.x, row = first_row + chunk_row, head = blockIdx.y, width = rank + rope_dim;
    const float* q_head = q + (static_cast<size_t>(row) * heads + head) * (nope + rope_dim);
    float* out = q_lat + (static_cast<size_t>(chunk_row) * heads + head) * width;
    const size_t w_k = static_cast<size_t>(head) * (nope + v_dim);
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nope; ++i) acc += q_head[i] * kv_b.at(w_k + i, c);
        out[c] = acc;
    }
    rotate_rope(q_head + nope, out + rank, rope_dim, row_pos[row], inv_freq, interleaved, rope_scale);
}

// Block per (row of the chunk, group of MLA_GROUP_HEADS heads, split of the keys), MLA_ATTEND_THREADS threads:
// causal attention of the group's latent queries over keys [split * split_len, (split + 1) * split_len) of the
// row's 0..=pos, read through its block table MLA_KEYS_PER_TILE at a time into shared memory, where every head of
// the group scores them (the heads share each key row: the cache is read once per group, not once per head). Per
// tile: scores (a thread takes 2 heads x 2 keys over a quarter of the features; the quarters meet by shuffles), an
// online softmax per head in f32 (a thread per head), then o_c += p c_j (a thread keeps 4 heads x 8 features of
// o_c). One split writes o_c normalised to oc[row, head]; several write partials (max in natural units,
// denominator, unnormalised o_c) in attention_combine's layout. Shared rows are padded to a multiple of 4 floats
// plus 4 (float4 loads, keys of a quarter-warp on different banks), the padding zero.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_attend(const float* __restrict__ q_lat, const float* __restrict__ pool, const uint32_t* __restrict__ row_pos,
               const uint32_t* __restrict__ row_table, const uint32_t* __restrict__ block_tables, int first_row,
               int heads, int rank, int width, float scale, int split_len, float* __restrict__ oc,
               float* __restrict__ partial_out, float* __restrict__ partial_stats) {
    wait_for_previous_kernel();
    constexpr int G = MLA_GROUP_HEADS, KT = MLA_KEYS_PER_TILE;
    static_assert(G == 16 && KT == 16 && MLA_ATTEND_THREADS == 256, "the thread roles below assume these");
    extern __shared__ float4 shared4[];
    const int stride = (width + 3) / 4 * 4 + 4, stride4 = stride / 4, width4 = (width + 3) / 4;
    float* queries = reinterpret_cast<float*>(shared4);  // [G][stride]
    float* keys = queries + G * stride;                  // [KT][stride]
    float* probs = keys + KT * stride;                   // [KT][G], key-major
    float* scores = probs + KT * G;                      // [G][KT + 1]
    float* correction = scores + G * (KT + 1);           // [G]
    float* run_max = correction + G;                     // [G]
    float* run_total = run_max + G;                      // [G]
    const int chunk_row = blockIdx.x, row = first_row + chunk_row, head0 = blockIdx.y * G, split = blockIdx.z;
    const int splits = gridDim.z, t = threadIdx.x;
    const int group_heads = min(G, heads - head0);
    for (int i = t; i < G * stride; i += blockDim.x) {
        const int h = i / stride, c = i - h * stride;
        queries[i] = h < group_heads && c < width
                         ? q_lat[(static_cast<size_t>(chunk_row) * heads + head0 + h) * width + c]
                         : 0.0f;
    }
    for (int i = t; i < KT * stride; i += blockDim.x) keys[i] = 0.0f;
    if (t < G) {
        run_max[t] = -INFINITY;
        run_total[t] = 0.0f;
    }
    const int len = static_cast<int>(row_pos[row]) + 1;
    const int begin = split * split_len, end = min(len, begin + split_len);
    const uint32_t* table = block_tables + row_table[row];
    // Score roles: heads h0, h0 + 1 and keys j0, j0 + 1, features quarter (float4 steps part, part + 4, ...).
    const int part = t & 3, h0 = 2 * ((t >> 2) >> 3), j0 = 2 * ((t >> 2) & 7);
    // Output roles: heads 4 * quad .. + 3, float4 slots f and f + 64 of o_c.
    const int quad = t >> 6, f = t & 63, rank4 = rank / 4;
    float4 acc[4][2];
#pragma unroll
    for (int h = 0; h < 4; ++h)
        for (int s = 0; s < 2; ++s) acc[h][s] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4* q4 = reinterpret_cast<const float4*>(queries);
    const float4* k4 = reinterpret_cast<const float4*>(keys);
    __syncthreads();
    for (int tile = begin; tile < end; tile += KT) {
        const int tile_keys = min(KT, end - tile);
        for (int j = 0; j < tile_keys; ++j) {
            const int p = tile + j;
            const float* key = pool + (static_cast<size_t>(table[p / KV_BLOCK_SIZE]) * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE) * width;
            for (int c = t; c < width; c += blockDim.x) keys[j * stride + c] = key[c];
        }
        __syncthreads();
        float s00 = 0.0f, s01 = 0.0f, s10 = 0.0f, s11 = 0.0f;
        for (int x = part; x < width4; x += 4) {
            const float4 qa = q4[h0 * stride4 + x], qb = q4[(h0 + 1) * stride4 + x];
            const float4 ka = k4[j0 * stride4 + x], kb = k4[(j0 + 1) * stride4 + x];
            s00 += qa.x * ka.x + qa.y * ka.y + qa.z * ka.z + qa.w * ka.w;
            s01 += qa.x * kb.x + qa.y * kb.y + qa.z * kb.z + qa.w * kb.w;
            s10 += qb.x * ka.x + qb.y * ka.y + qb.z * ka.z + qb.w * ka.w;
            s11 += qb.x * kb.x + qb.y * kb.y + qb.z * kb.z + qb.w * kb.w;
        }
#pragma unroll
        for (int offset = 1; offset < 4; offset <<= 1) {
            s00 += __shfl_xor_sync(0xffffffffu, s00, offset);
            s01 += __shfl_xor_sync(0xffffffffu, s01, offset);
            s10 += __shfl_xor_sync(0xffffffffu, s10, offset);
            s11 += __shfl_xor_sync(0xffffffffu, s11, offset);
        }
        if (part == 0) {
            scores[h0 * (KT + 1) + j0] = s00 * scale;
            scores[h0 * (KT + 1) + j0 + 1] = s01 * scale;
            scores[(h0 + 1) * (KT + 1) + j0] = s10 * scale;
            scores[(h0 + 1) * (KT + 1) + j0 + 1] = s11 * scale;
        }
        __syncthreads();
        if (t < G) {
            float tile_max = -INFINITY;
            for (int j = 0; j < tile_keys; ++j) tile_max = fmaxf(tile_max, scores[t * (KT + 1) + j]);
            const float new_max = fmaxf(run_max[t], tile_max);
            const float corr = expf(run_max[t] - new_max);
            float sum = 0.0f;
            for (int j = 0; j < KT; ++j) {
                const float p = j < tile_keys ? expf(scores[t * (KT + 1) + j] - new_max) : 0.0f;
                probs[j * G + t] = p;
                sum += p;
            }
            run_total[t] = run_total[t] * corr + sum;
            run_max[t] = new_max;
            correction[t] = corr;
        }
        __syncthreads();
        const float4 corr = reinterpret_cast<const float4*>(correction)[quad];
        const float corrs[4] = {corr.x, corr.y, corr.z, corr.w};
#pragma unroll
        for (int h = 0; h < 4; ++h)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                acc[h][s].x *= corrs[h];
                acc[h][s].y *= corrs[h];
                acc[h][s].z *= corrs[h];
                acc[h][s].w *= corrs[h];
            }
        const float4* p4 = reinterpret_cast<const float4*>(probs);
        for (int j = 0; j < tile_keys; ++j) {
            const float4 p = p4[j * (G / 4) + quad];
            const float ps[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if (f + 64 * s >= rank4) continue;
                const float4 k = k4[j * stride4 + f + 64 * s];
#pragma unroll
                for (int h = 0; h < 4; ++h) {
                    acc[h][s].x = fmaf(ps[h], k.x, acc[h][s].x);
                    acc[h][s].y = fmaf(ps[h], k.y, acc[h][s].y);
                    acc[h][s].z = fmaf(ps[h], k.z, acc[h][s].z);
                    acc[h][s].w = fmaf(ps[h], k.w, acc[h][s].w);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int in_group = 4 * quad + h, head = head0 + in_group;
        if (in_group >= group_heads) continue;
        const size_t pair = static_cast<size_t>(chunk_row) * heads + head;
        const float total = run_total[in_group];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int slot = f + 64 * s;
            if (slot >= rank4) continue;
            float4 o = acc[h][s];
            if (splits == 1) {
                o = make_float4(o.x / total, o.y / total, o.z / total, o.w / total);
                reinterpret_cast<float4*>(oc + pair * rank)[slot] = o;
            } else {
                reinterpret_cast<float4*>(partial_out + (pair * splits + split) * rank)[slot] = o;
            }
        }
        if (splits > 1 && f == 0) {
            partial_stats[2 * (pair * splits + split)] = run_max[in_group];
            partial_stats[2 * (pair * splits + split) + 1] = total;
        }
    }
}

// Block per (row, head) of the chunk, MLA_ATTEND_THREADS threads: the head's output W_v[h] o_c into out[row, head
// * v_dim ...] (out is the whole call's; rows from first_row), a warp per output feature.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_expand(const float* __restrict__ oc, const uint16_t* __restrict__ kv_b_bf16,
               const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales, int block_rows,
               int block_cols, int first_row, int heads, int rank, int nope, int v_dim, float* __restrict__ out) {
    wait_for_previous_kernel();
    __shared__ float o_c[MLA_MAX_RANK];
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int chunk_row = blockIdx.x, head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float* src = oc + (static_cast<size_t>(chunk_row) * heads + head) * rank;
    for (int c = threadIdx.x; c < rank; c += blockDim.x) o_c[c] = src[c];
    __syncthreads();
    const size_t w_v = static_cast<size_t>(head) * (nope + v_dim) + nope;
    for (int d = warp; d < v_dim; d += warps) {
        float sum = 0.0f;
        for (int c = lane; c < rank; c += 32) sum += kv_b.at(w_v + d, c) * o_c[c];
        sum = warp_sum(sum);
        if (lane == 0) out[(static_cast<size_t>(first_row + chunk_row) * heads + head) * v_dim + d] = sum;
    }
}
