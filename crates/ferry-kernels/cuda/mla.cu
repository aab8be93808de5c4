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

// kv_b_proj ([rows, cols], cols a multiple of 32): bf16 (`bf16` not null), or E4M3 bytes times their block's f32
// scale (an FP8 checkpoint's kv_b_proj, read as stored: the product is the CPU reference's dequantized weight;
// mla.rs checks that a scale block's columns are a multiple of 4). Read four consecutive weights at a time (one
// 4-byte or 8-byte load), columns c .. c + 3 with c a multiple of 4, which share one scale. 32-bit indices: the
// matrix is far below 2^31 weights, and a 64-bit division per load would cost more than the load.
struct KvB {
    const uint16_t* bf16;
    const uint8_t* fp8;
    const float* scales;
    int cols, block_rows, block_cols;
    // The scale of weights (r, c .. c + 3); 1 for bf16.
    __device__ __forceinline__ float scale(int r, int c) const {
        if (bf16 != nullptr) return 1.0f;
        const int scales_per_row = (cols + block_cols - 1) / block_cols;
        return scales[(r / block_rows) * scales_per_row + c / block_cols];
    }
    // Weights (r, c .. c + 3), times `scale` (this->scale(r, c), which a caller hoists out of its loops).
    __device__ __forceinline__ void load4(int r, int c, float scale, float (&w)[4]) const {
        const uint32_t i = static_cast<uint32_t>(r) * cols + c;
        if (bf16 != nullptr) {
            const uint2 bits = *reinterpret_cast<const uint2*>(bf16 + i);
            w[0] = __uint_as_float(bits.x << 16);
            w[1] = __uint_as_float(bits.x & 0xffff0000u);
            w[2] = __uint_as_float(bits.y << 16);
            w[3] = __uint_as_float(bits.y & 0xffff0000u);
            return;
        }
        fp8x4_e4m3_to_float(*reinterpret_cast<const uint32_t*>(fp8 + i), w);
#pragma unroll
        for (int e = 0; e < 4; ++e) w[e] *= scale;
    }
};

// Block per (row, head) of a round of rows starting at `first_row`, MLA_ATTEND_THREADS threads: the head's query
// in latent space, q_lat[row, head] = [W_k[h]^T q_nope, rope(q_rope)] (width = rank + rope_dim). A thread takes 4
// columns of c over half of W_k[h]'s rows (4 weights a load, 8 loads in flight); the halves meet in shared memory.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_absorb_query(const float* __restrict__ q, const uint16_t* __restrict__ kv_b_bf16,
                     const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales, int block_rows,
                     int block_cols, const uint32_t* __restrict__ row_pos, int first_row,
                     const float* __restrict__ inv_freq, int interleaved, float rope_scale, int heads, int rank,
                     int nope, int rope_dim, int v_dim, float* __restrict__ q_lat) {
    wait_for_previous_kernel();
    static_assert(MLA_ATTEND_THREADS == 256 && MLA_MAX_RANK == 512, "two row halves of 128 column quads");
    __shared__ float4 upper[MLA_MAX_RANK / 4];
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int chunk_row = blockIdx.x, row = first_row + chunk_row, head = blockIdx.y, width = rank + rope_dim;
    const float* q_head = q + (static_cast<size_t>(row) * heads + head) * (nope + rope_dim);
    float* out = q_lat + (static_cast<size_t>(chunk_row) * heads + head) * width;
    const int w_k = head * (nope + v_dim);
    const int quad = threadIdx.x & 127, half = threadIdx.x >> 7, c = 4 * quad;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < rank) {
        // The scale changes only where the rows cross a scale block.
        int scale_row = -1;
        float scale = 1.0f;
#pragma unroll 8
        for (int i = half; i < nope; i += 2) {
            if (kv_b.bf16 == nullptr && (w_k + i) / kv_b.block_rows != scale_row) {
                scale_row = (w_k + i) / kv_b.block_rows;
                scale = kv_b.scale(w_k + i, c);
            }
            float w[4];
            kv_b.load4(w_k + i, c, scale, w);
            const float x = q_head[i];
            acc.x = fmaf(x, w[0], acc.x);
            acc.y = fmaf(x, w[1], acc.y);
            acc.z = fmaf(x, w[2], acc.z);
            acc.w = fmaf(x, w[3], acc.w);
        }
    }
    if (half == 1 && c < rank) upper[quad] = acc;
    __syncthreads();
    if (half == 0 && c < rank) {
        // Four stores: a row of q_lat (rank + rope_dim floats) need not start 16-byte aligned.
        const float4 u = upper[quad];
        out[c] = acc.x + u.x;
        out[c + 1] = acc.y + u.y;
        out[c + 2] = acc.z + u.z;
        out[c + 3] = acc.w + u.w;
    }
    rotate_rope(q_head + nope, out + rank, rope_dim, row_pos[row], inv_freq, interleaved, rope_scale);
}

// Block per (row of the round, group of MLA_GROUP_HEADS heads, split of the keys), MLA_ATTEND_THREADS threads:
// causal attention of the group's latent queries over keys [split * split_len, (split + 1) * split_len) of the
// row's 0..=pos, read through its block table MLA_KEYS_PER_TILE at a time into shared memory, where every head of
// the group scores them (the cache is read once per group, not once per head). Per tile: the keys' slots, then
// their rows (all loads of the tile in flight at once); scores, warp w taking heads 2w and 2w + 1 (a lane 2 heads x
// 2 keys over a quarter of the features; the quarters meet by shuffles) and, still in the warp, the online softmax
// of both heads in f32; then o_c += p c_j, a thread keeping 4 heads x 8 features. One split writes o_c normalised
// to oc[row, head]; several write partials (max in natural units, denominator, unnormalised o_c) in
// attention_combine's layout. Shared rows are padded to a multiple of 4 floats plus 4 (float4 reads; keys of a
// quarter-warp on different banks), the padding zero.
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
    float* correction = probs + KT * G;                  // [G]
    float* run_max = correction + G;                     // [G], written at the end
    float* run_total = run_max + G;                      // [G], written at the end
    uint32_t* slots = reinterpret_cast<uint32_t*>(run_total + G);  // [KT]
    const int chunk_row = blockIdx.x, row = first_row + chunk_row, head0 = blockIdx.y * G, split = blockIdx.z;
    const int splits = gridDim.z, t = threadIdx.x, lane = t & 31;
    const int group_heads = min(G, heads - head0);
    for (int i = t; i < G * stride; i += blockDim.x) {
        const int h = i / stride, c = i - h * stride;
        queries[i] = h < group_heads && c < width
                         ? q_lat[(static_cast<size_t>(chunk_row) * heads + head0 + h) * width + c]
                         : 0.0f;
    }
    for (int i = t; i < KT * stride; i += blockDim.x) keys[i] = 0.0f;
    const int len = static_cast<int>(row_pos[row]) + 1;
    const int begin = split * split_len, end = min(len, begin + split_len);
    const uint32_t* table = block_tables + row_table[row];
    // Score roles: warp w's heads h0 = 2w and h0 + 1; keys j0 = 2 * (lane / 4) and j0 + 1; features quarter part.
    const int part = lane & 3, h0 = 2 * (t >> 5), j0 = 2 * (lane >> 2);
    float max0 = -INFINITY, max1 = -INFINITY, total0 = 0.0f, total1 = 0.0f;
    // Output roles: heads 4 * quad .. + 3, float4 slots f and f + 64 of o_c.
    const int quad = t >> 6, f = t & 63, rank4 = rank / 4;
    float4 acc[4][2];
#pragma unroll
    for (int h = 0; h < 4; ++h)
        for (int s = 0; s < 2; ++s) acc[h][s] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4* q4 = reinterpret_cast<const float4*>(queries);
    const float4* k4 = reinterpret_cast<const float4*>(keys);
    for (int tile = begin; tile < end; tile += KT) {
        const int tile_keys = min(KT, end - tile);
        if (t < tile_keys) {
            const int p = tile + t;
            slots[t] = table[p / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE;
        }
        __syncthreads();
        if ((width & 3) == 0) {
            for (int i = t; i < tile_keys * width4; i += blockDim.x) {
                const int j = i / width4, x = i - j * width4;
                shared4[(G + j) * stride4 + x] = reinterpret_cast<const float4*>(pool + static_cast<size_t>(slots[j]) * width)[x];
            }
        } else {
            for (int i = t; i < tile_keys * width; i += blockDim.x) {
                const int j = i / width, c = i - j * width;
                keys[j * stride + c] = pool[static_cast<size_t>(slots[j]) * width + c];
            }
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
        // Keys past the tile's end (stale rows) score -inf: probability 0.
        const bool valid0 = j0 < tile_keys, valid1 = j0 + 1 < tile_keys;
        s00 = valid0 ? s00 * scale : -INFINITY;
        s01 = valid1 ? s01 * scale : -INFINITY;
        s10 = valid0 ? s10 * scale : -INFINITY;
        s11 = valid1 ? s11 * scale : -INFINITY;
        const float new0 = fmaxf(max0, warp_max(fmaxf(s00, s01))), new1 = fmaxf(max1, warp_max(fmaxf(s10, s11)));
        const float p00 = expf(s00 - new0), p01 = expf(s01 - new0), p10 = expf(s10 - new1), p11 = expf(s11 - new1);
        // Each key's probabilities are held by its 4 quarter lanes: count them once.
        const float sum0 = warp_sum(part == 0 ? p00 + p01 : 0.0f), sum1 = warp_sum(part == 0 ? p10 + p11 : 0.0f);
        const float corr0 = expf(max0 - new0), corr1 = expf(max1 - new1);
        total0 = total0 * corr0 + sum0;
        total1 = total1 * corr1 + sum1;
        max0 = new0;
        max1 = new1;
        if (part == 0) {
            probs[j0 * G + h0] = p00;
            probs[(j0 + 1) * G + h0] = p01;
            probs[j0 * G + h0 + 1] = p10;
            probs[(j0 + 1) * G + h0 + 1] = p11;
        }
        if (lane == 0) {
            correction[h0] = corr0;
            correction[h0 + 1] = corr1;
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
    if (lane == 0) {
        run_max[h0] = max0;
        run_max[h0 + 1] = max1;
        run_total[h0] = total0;
        run_total[h0 + 1] = total1;
    }
    __syncthreads();
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

// Block per (row, head) of the round, MLA_ATTEND_THREADS threads: the head's output W_v[h] o_c into out[row, head *
// v_dim ...] (out is the whole call's; rows from first_row). A warp takes 4 output features at once (every load of
// their weight rows in flight together), lanes over c in quads.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_expand(const float* __restrict__ oc, const uint16_t* __restrict__ kv_b_bf16,
               const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales, int block_rows,
               int block_cols, int first_row, int heads, int rank, int nope, int v_dim, float* __restrict__ out) {
    wait_for_previous_kernel();
    constexpr int ROWS = 4, STEPS = MLA_MAX_RANK / 128;
    __shared__ float o_c[MLA_MAX_RANK];
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int chunk_row = blockIdx.x, head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float* src = oc + (static_cast<size_t>(chunk_row) * heads + head) * rank;
    for (int c = threadIdx.x; c < rank; c += blockDim.x) o_c[c] = src[c];
    __syncthreads();
    const int w_v = head * (nope + v_dim) + nope;
    float* dst = out + (static_cast<size_t>(first_row + chunk_row) * heads + head) * v_dim;
    for (int d0 = warp * ROWS; d0 < v_dim; d0 += warps * ROWS) {
        float sum[ROWS] = {};
#pragma unroll
        for (int step = 0; step < STEPS; ++step) {
            const int c = 4 * lane + 128 * step;
            if (c >= rank) continue;
            const float4 x = reinterpret_cast<const float4*>(o_c)[c / 4];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (d0 + r >= v_dim) continue;
                float w[4];
                kv_b.load4(w_v + d0 + r, c, kv_b.scale(w_v + d0 + r, c), w);
                sum[r] += w[0] * x.x + w[1] * x.y + w[2] * x.z + w[3] * x.w;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float total = warp_sum(sum[r]);
            if (lane == 0 && d0 + r < v_dim) dst[d0 + r] = total;
        }
    }
}
