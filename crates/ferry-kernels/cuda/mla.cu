// Multi-head latent attention (DeepSeek-V3's MLA) over the latent paged cache, computed in latent space for every
// row (prefill and decode): kv_b_proj's key rows W_k[h] are absorbed into each head's query (q_c = W_k[h]^T q_nope)
// and its value rows W_v[h] into the output (W_v[h] o_c), so the cache holds one row of kv_lora_rank + rope floats
// per token and is never expanded per head. The kernels, in the order mla.rs launches them:
//   mla_latent_append  block per row: c normalised by kv_a_layernorm, the shared key rotated, written to the row's
//                      cache slot;
//   mla_absorb_query   block per (head, chunk of rows): the head's query in latent space;
//   mla_attend         block per (row, group of heads, split of the keys): softmax attention of the group's heads
//                      over the latent rows on tensor cores, each key row read once for the whole group
//                      (o_c = sum p_j c_j);
//   attention_combine  (attention.cu) when the keys were split: the splits' partials merged into o_c;
//   mla_expand         block per (head, chunk of rows): the output W_v[h] o_c.
#include "common.cuh"
#include "tensor_core.cuh"

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
    // The scale of weights (r, c .. c + 3); 1 for bf16. In two halves for callers that hoist them out of their
    // loops (the divisions cost more than the loads they scale): where row r's scale blocks start, the block of
    // column c.
    __device__ __forceinline__ float scale(int r, int c) const { return scale_at(scale_row(r), scale_column(c)); }
    __device__ __forceinline__ int scale_row(int r) const {
        return bf16 != nullptr ? 0 : r / block_rows * ((cols + block_cols - 1) / block_cols);
    }
    __device__ __forceinline__ int scale_column(int c) const { return bf16 != nullptr ? 0 : c / block_cols; }
    __device__ __forceinline__ float scale_at(int row, int column) const {
        return bf16 != nullptr ? 1.0f : scales[row + column];
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

// One block's rows of mla_absorb_query, R of them (1 in decode, MLA_CHUNK_ROWS in longer rounds; `rows` of them
// real): each weight, loaded once, serves every row. A thread takes 4 columns of c over half of W_k[h]'s rows (4
// weights a load); the halves meet in shared memory.
template <int R>
__device__ __forceinline__ void absorb_chunk(const float* __restrict__ q, const KvB& kv_b,
                                             const uint32_t* __restrict__ row_pos, int first_row, int chunk_row0,
                                             int rows, int head, const float* __restrict__ inv_freq, int interleaved,
                                             float rope_scale, int heads, int rank, int nope, int rope_dim, int v_dim,
                                             float* __restrict__ q_lat, float4 (*upper)[MLA_MAX_RANK / 4]) {
    const int width = rank + rope_dim, q_width = nope + rope_dim;
    const float* q_head = q + (static_cast<size_t>(first_row + chunk_row0) * heads + head) * q_width;
    const size_t q_row_step = static_cast<size_t>(heads) * q_width;
    const int w_k = head * (nope + v_dim);
    const int quad = threadIdx.x & 127, half = threadIdx.x >> 7, c = 4 * quad;
    float4 acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < rank) {
        // The scale changes only where the rows cross a scale block.
        int scale_row = -1;
        float scale = 1.0f;
        // A decode row keeps 8 weight loads in flight; a chunk's rows have the work to hide 4.
#pragma unroll(R == 1 ? 8 : 4)
        for (int i = half; i < nope; i += 2) {
            if (kv_b.bf16 == nullptr && (w_k + i) / kv_b.block_rows != scale_row) {
                scale_row = (w_k + i) / kv_b.block_rows;
                scale = kv_b.scale(w_k + i, c);
            }
            float w[4];
            kv_b.load4(w_k + i, c, scale, w);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float x = r < rows ? q_head[r * q_row_step + i] : 0.0f;
                acc[r].x = fmaf(x, w[0], acc[r].x);
                acc[r].y = fmaf(x, w[1], acc[r].y);
                acc[r].z = fmaf(x, w[2], acc[r].z);
                acc[r].w = fmaf(x, w[3], acc[r].w);
            }
        }
    }
    if (half == 1 && c < rank)
#pragma unroll
        for (int r = 0; r < R; ++r) upper[r][quad] = acc[r];
    __syncthreads();
    if (half == 0 && c < rank)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= rows) break;
            // Four stores: a row of q_lat (rank + rope_dim floats) need not start 16-byte aligned.
            float* out = q_lat + (static_cast<size_t>(chunk_row0 + r) * heads + head) * width;
            const float4 u = upper[r][quad];
            out[c] = acc[r].x + u.x;
            out[c + 1] = acc[r].y + u.y;
            out[c + 2] = acc[r].z + u.z;
            out[c + 3] = acc[r].w + u.w;
        }
    for (int r = 0; r < rows; ++r) {
        float* out = q_lat + (static_cast<size_t>(chunk_row0 + r) * heads + head) * width;
        rotate_rope(q_head + r * q_row_step + nope, out + rank, rope_dim, row_pos[first_row + chunk_row0 + r],
                    inv_freq, interleaved, rope_scale);
    }
}

// Block per (head, chunk of MLA_CHUNK_ROWS rows) of a round of `round_rows` rows starting at `first_row`,
// MLA_ATTEND_THREADS threads: the head's query in latent space for the chunk's rows, q_lat[row, head] =
// [W_k[h]^T q_nope, rope(q_rope)] (width = rank + rope_dim), W_k[h] read once for the chunk.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_absorb_query(const float* __restrict__ q, const uint16_t* __restrict__ kv_b_bf16,
                     const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales, int block_rows,
                     int block_cols, const uint32_t* __restrict__ row_pos, int first_row, int round_rows,
                     const float* __restrict__ inv_freq, int interleaved, float rope_scale, int heads, int rank,
                     int nope, int rope_dim, int v_dim, float* __restrict__ q_lat) {
    wait_for_previous_kernel();
    static_assert(MLA_ATTEND_THREADS == 256 && MLA_MAX_RANK == 512, "two row halves of 128 column quads");
    __shared__ float4 upper[MLA_CHUNK_ROWS][MLA_MAX_RANK / 4];
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int head = blockIdx.x, chunk_row0 = blockIdx.y * MLA_CHUNK_ROWS;
    const int rows = min(MLA_CHUNK_ROWS, round_rows - chunk_row0);
    if (rows == 1)
        absorb_chunk<1>(q, kv_b, row_pos, first_row, chunk_row0, rows, head, inv_freq, interleaved, rope_scale,
                        heads, rank, nope, rope_dim, v_dim, q_lat, upper);
    else
        absorb_chunk<MLA_CHUNK_ROWS>(q, kv_b, row_pos, first_row, chunk_row0, rows, head, inv_freq, interleaved,
                                     rope_scale, heads, rank, nope, rope_dim, v_dim, q_lat, upper);
}

// Block per (row of the round, group of MLA_GROUP_HEADS heads, split of the keys), MLA_ATTEND_THREADS threads:
// causal attention of the group's latent queries over keys [split * split_len, (split + 1) * split_len) of the
// row's 0..=pos, on tensor cores. The group's 16 heads are the m of m16n8k8 products (3xTF32, f32 accumulators,
// tensor_core.cuh); the keys are read through the row's block table MLA_KEYS_PER_TILE at a time into shared
// memory, once for the whole group. Per tile: the keys' slots, then their rows (cp.async); scores S = Q K^T, warp w
// taking keys 8 (w & 1) .. + 7 over a quarter (w >> 1) of the features, the quarters summed in shared memory; the
// online softmax in f32, warp w for heads 2w and 2w + 1 (a lane per key); then O += P V with V the keys' first
// `rank` features, warp w owning output columns 8 (w + 8i) .. + 7. One split writes o_c normalised to oc[row, head];
// several write partials (max in natural units, denominator, unnormalised o_c) in attention_combine's layout.
// Shared rows are padded with zeros to a multiple of 32 floats plus 4: the score operands' fragment loads then fall
// on distinct banks.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS, 2)
    mla_attend(const float* __restrict__ q_lat, const float* __restrict__ pool, const uint32_t* __restrict__ row_pos,
               const uint32_t* __restrict__ row_table, const uint32_t* __restrict__ block_tables, int first_row,
               int heads, int rank, int width, float scale, int split_len, float* __restrict__ oc,
               float* __restrict__ partial_out, float* __restrict__ partial_stats) {
    wait_for_previous_kernel();
    constexpr int G = MLA_GROUP_HEADS, KT = MLA_KEYS_PER_TILE, PS = KT + 4, QUARTERS = 4;
    static_assert(G == 16 && KT == 16 && MLA_ATTEND_THREADS == 256 && MLA_MAX_RANK == 512,
                  "the warp roles below assume these: 2 key n-tiles x 4 feature quarters, 8 column tiles a warp");
    extern __shared__ float4 shared4[];
    const int stride = (width + 31) / 32 * 32 + 4;
    float* queries = reinterpret_cast<float*>(shared4);         // [G][stride]
    float* keys = queries + G * stride;                         // [KT][stride]
    float* score_parts = keys + KT * stride;                    // [QUARTERS][G][KT]
    float* probs = score_parts + QUARTERS * G * KT;             // [G][PS]
    float* correction = probs + G * PS;                         // [G]
    float* run_max = correction + G;                            // [G], written at the end
    float* run_total = run_max + G;                             // [G], written at the end
    uint32_t* slots = reinterpret_cast<uint32_t*>(run_total + G);  // [KT]
    const int chunk_row = blockIdx.x, row = first_row + chunk_row, head0 = blockIdx.y * G, split = blockIdx.z;
    const int splits = gridDim.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int group_heads = min(G, heads - head0);
    for (int i = tid; i < G * stride; i += blockDim.x) {
        const int h = i / stride, c = i - h * stride;
        queries[i] = h < group_heads && c < width
                         ? q_lat[(static_cast<size_t>(chunk_row) * heads + head0 + h) * width + c]
                         : 0.0f;
    }
    // Zero keys: the padding past `width` stays so, and rows past a short tile's end hold finite values.
    for (int i = tid; i < KT * stride; i += blockDim.x) keys[i] = 0.0f;
    const int len = static_cast<int>(row_pos[row]) + 1;
    const int begin = split * split_len, end = min(len, begin + split_len);
    const uint32_t* table = block_tables + row_table[row];
    // Score roles: keys 8 * key_tile + (0..7) over k-steps [first_step, last_step) of the features.
    const int key_tile = warp & 1, quarter = warp >> 1;
    const int steps = (width + 7) / 8, per_quarter = (steps + QUARTERS - 1) / QUARTERS;
    const int first_step = quarter * per_quarter, last_step = min(steps, first_step + per_quarter);
    // Softmax roles: head soft_head, key soft_key (a lane each); the running max and denominator of the head.
    const int soft_head = 2 * warp + (lane >> 4), soft_key = lane & 15;
    float head_max = -INFINITY, head_total = 0.0f;
    // Output roles: column tiles warp + 8i (8 columns each) of o_c, rows g and g + 8 of the group.
    constexpr int COLUMN_TILES = MLA_MAX_RANK / 8 / 8;
    const int column_tiles = rank / 8;
    float acc[COLUMN_TILES][4];
#pragma unroll
    for (int i = 0; i < COLUMN_TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const bool vector_rows = (width & 3) == 0;
    for (int tile = begin; tile < end; tile += KT) {
        const int tile_keys = min(KT, end - tile);
        if (tid < tile_keys) {
            const int p = tile + tid;
            slots[tid] = table[p / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE;
        }
        __syncthreads();
        if (vector_rows) {
            const int width4 = width / 4;
            for (int i = tid; i < tile_keys * width4; i += blockDim.x) {
                const int j = i / width4, x = i - j * width4;
                cp_async_16(keys + j * stride + 4 * x, pool + static_cast<size_t>(slots[j]) * width + 4 * x, true);
            }
            commit_copies();
            wait_copies(0);
        } else {
            for (int i = tid; i < tile_keys * width; i += blockDim.x) {
                const int j = i / width, c = i - j * width;
                keys[j * stride + c] = pool[static_cast<size_t>(slots[j]) * width + c];
            }
        }
        __syncthreads();
        {
            // hi*hi apart from the cross terms: two independent accumulation chains.
            float main_part[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cross_part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const float* key_row = keys + (8 * key_tile + g) * stride;
            for (int step = first_step; step < last_step; ++step) {
                const int c0 = 8 * step;
                uint32_t q_hi[4], q_lo[4], k0_hi, k0_lo, k1_hi, k1_lo;
                load_a_split(queries + c0, stride, 1, g, t, q_hi, q_lo);
                split_tf32(key_row[c0 + t], k0_hi, k0_lo);
                split_tf32(key_row[c0 + t + 4], k1_hi, k1_lo);
                mma_tf32(main_part, q_hi, k0_hi, k1_hi);
                mma_tf32(cross_part, q_hi, k0_lo, k1_lo);
                mma_tf32(cross_part, q_lo, k0_hi, k1_hi);
            }
            float* part = score_parts + quarter * G * KT + 8 * key_tile + 2 * t;
            part[g * KT] = main_part[0] + cross_part[0];
            part[g * KT + 1] = main_part[1] + cross_part[1];
            part[(g + 8) * KT] = main_part[2] + cross_part[2];
            part[(g + 8) * KT + 1] = main_part[3] + cross_part[3];
        }
        __syncthreads();
        {
            float s = -INFINITY;
            if (soft_key < tile_keys) {
                s = 0.0f;
#pragma unroll
                for (int q = 0; q < QUARTERS; ++q) s += score_parts[(q * G + soft_head) * KT + soft_key];
                s *= scale;
            }
            // Reductions over the 16 lanes of a head (xor offsets below 16 stay in the half-warp).
            float tile_max = s;
#pragma unroll
            for (int offset = 1; offset < 16; offset <<= 1)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
            const float new_max = fmaxf(head_max, tile_max);
            const float p = expf(s - new_max);
            float sum = p;
#pragma unroll
            for (int offset = 1; offset < 16; offset <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            const float corr = expf(head_max - new_max);
            head_total = head_total * corr + sum;
            head_max = new_max;
            probs[soft_head * PS + soft_key] = p;
            if (soft_key == 0) correction[soft_head] = corr;
        }
        __syncthreads();
        {
            const float corr_low = correction[g], corr_high = correction[g + 8];
#pragma unroll
            for (int i = 0; i < COLUMN_TILES; ++i) {
                acc[i][0] *= corr_low;
                acc[i][1] *= corr_low;
                acc[i][2] *= corr_high;
                acc[i][3] *= corr_high;
            }
#pragma unroll
            for (int k0 = 0; k0 < KT; k0 += 8) {
                uint32_t p_hi[4], p_lo[4];
                load_a_split(probs + k0, PS, 1, g, t, p_hi, p_lo);
                const float* v0 = keys + (k0 + t) * stride + g;
                const float* v1 = v0 + 4 * stride;
#pragma unroll
                for (int i = 0; i < COLUMN_TILES; ++i) {
                    const int n0 = 8 * (warp + 8 * i);
                    if (warp + 8 * i >= column_tiles) break;
                    uint32_t b0_hi, b0_lo, b1_hi, b1_lo;
                    split_tf32(v0[n0], b0_hi, b0_lo);
                    split_tf32(v1[n0], b1_hi, b1_lo);
                    mma_tf32(acc[i], p_lo, b0_hi, b1_hi);
                    mma_tf32(acc[i], p_hi, b0_lo, b1_lo);
                    mma_tf32(acc[i], p_hi, b0_hi, b1_hi);
                }
            }
        }
        __syncthreads();
    }
    if (soft_key == 0) {
        run_max[soft_head] = head_max;
        run_total[soft_head] = head_total;
    }
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int in_group = g + 8 * half;
        if (in_group >= group_heads) continue;
        const size_t pair = static_cast<size_t>(chunk_row) * heads + head0 + in_group;
        const float total = run_total[in_group];
#pragma unroll
        for (int i = 0; i < COLUMN_TILES; ++i) {
            if (warp + 8 * i >= column_tiles) break;
            const int column = 8 * (warp + 8 * i) + 2 * t;
            float2 o = make_float2(acc[i][2 * half], acc[i][2 * half + 1]);
            if (splits == 1) {
                o.x /= total;
                o.y /= total;
                *reinterpret_cast<float2*>(oc + pair * rank + column) = o;
            } else {
                *reinterpret_cast<float2*>(partial_out + (pair * splits + split) * rank + column) = o;
            }
        }
    }
    if (splits > 1 && tid < group_heads) {
        const size_t pair = static_cast<size_t>(chunk_row) * heads + head0 + tid;
        partial_stats[2 * (pair * splits + split)] = run_max[tid];
        partial_stats[2 * (pair * splits + split) + 1] = run_total[tid];
    }
}

// One block's rows of mla_expand, R of them (1 in decode, MLA_CHUNK_ROWS in longer rounds; `rows` of them real),
// their o_c in shared memory: each weight, loaded once, serves every row. A warp takes 4 output features at once
// (every load of their weight rows in flight together), lanes over c in quads.
template <int R>
__device__ __forceinline__ void expand_chunk(const float* __restrict__ oc, const KvB& kv_b, int first_row,
                                             int chunk_row0, int rows, int head, int heads, int rank, int nope,
                                             int v_dim, float* __restrict__ out, float4 (*o_c)[MLA_MAX_RANK / 4]) {
    constexpr int FEATURES = 4, STEPS = MLA_MAX_RANK / 128;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, rank4 = rank / 4;
    for (int i = threadIdx.x; i < R * rank4; i += blockDim.x) {
        const int r = i / rank4, x = i - r * rank4;
        o_c[r][x] = r < rows ? reinterpret_cast<const float4*>(
                                   oc + (static_cast<size_t>(chunk_row0 + r) * heads + head) * rank)[x]
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();
    const int w_v = head * (nope + v_dim) + nope;
    int scale_column[STEPS];
#pragma unroll
    for (int step = 0; step < STEPS; ++step) scale_column[step] = kv_b.scale_column(4 * lane + 128 * step);
    for (int d0 = warp * FEATURES; d0 < v_dim; d0 += warps * FEATURES) {
        float sum[FEATURES][R] = {};
        int scale_row[FEATURES];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) scale_row[f] = kv_b.scale_row(w_v + d0 + f);
#pragma unroll
        for (int step = 0; step < STEPS; ++step) {
            const int c = 4 * lane + 128 * step;
            if (c >= rank) continue;
            float w[FEATURES][4];
#pragma unroll
            for (int f = 0; f < FEATURES; ++f) {
                if (d0 + f < v_dim)
                    kv_b.load4(w_v + d0 + f, c, kv_b.scale_at(scale_row[f], scale_column[step]), w[f]);
                else
                    w[f][0] = w[f][1] = w[f][2] = w[f][3] = 0.0f;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4 x = o_c[r][c / 4];
#pragma unroll
                for (int f = 0; f < FEATURES; ++f) sum[f][r] += w[f][0] * x.x + w[f][1] * x.y + w[f][2] * x.z + w[f][3] * x.w;
            }
        }
#pragma unroll
        for (int f = 0; f < FEATURES; ++f)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float total = warp_sum(sum[f][r]);
                if (lane == 0 && d0 + f < v_dim && r < rows)
                    out[(static_cast<size_t>(first_row + chunk_row0 + r) * heads + head) * v_dim + d0 + f] = total;
            }
    }
}

// Block per (head, chunk of MLA_CHUNK_ROWS rows) of the round, MLA_ATTEND_THREADS threads: the head's output
// W_v[h] o_c for the chunk's rows into out[row, head * v_dim ...] (out is the whole call's; rows from first_row),
// W_v[h] read once for the chunk.
extern "C" __global__ void __launch_bounds__(MLA_ATTEND_THREADS)
    mla_expand(const float* __restrict__ oc, const uint16_t* __restrict__ kv_b_bf16,
               const uint8_t* __restrict__ kv_b_fp8, const float* __restrict__ kv_b_scales, int block_rows,
               int block_cols, int first_row, int round_rows, int heads, int rank, int nope, int v_dim,
               float* __restrict__ out) {
    wait_for_previous_kernel();
    __shared__ float4 o_c[MLA_CHUNK_ROWS][MLA_MAX_RANK / 4];
    const KvB kv_b{kv_b_bf16, kv_b_fp8, kv_b_scales, rank, block_rows, block_cols};
    const int head = blockIdx.x, chunk_row0 = blockIdx.y * MLA_CHUNK_ROWS;
    const int rows = min(MLA_CHUNK_ROWS, round_rows - chunk_row0);
    if (rows == 1)
        expand_chunk<1>(oc, kv_b, first_row, chunk_row0, rows, head, heads, rank, nope, v_dim, out, o_c);
    else
        expand_chunk<MLA_CHUNK_ROWS>(oc, kv_b, first_row, chunk_row0, rows, head, heads, rank, nope, v_dim, out,
                                     o_c);
}
