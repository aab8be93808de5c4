// Prefill attention over the paged KV cache on tensor cores, flash-style: each block keeps a tile of queries in
// shared memory, streams the keys and values of their sequence through shared memory a tile at a time, and keeps
// an online softmax, so no scores matrix is ever stored. Not for decode: a batch of single rows per sequence has
// too few queries per key to feed the tensor cores, and attention.cu's split kernel reads its keys faster.
//
// Precision: queries, keys, values and probabilities are f32, and a bf16 product would lose 16 of their 24
// significant bits. Every operand is therefore split into two bf16 halves, x = hi + lo (lo the rounding error of
// hi), and each product is hi*hi + hi*lo + lo*hi, accumulated in f32 by mma.sync: about 16 significant bits per
// product (relative error near 2^-17), at three tensor-core products per f32 one.
//
// Layout of a block's work: the "m-rows" of a slice are its (row, query head of the group) pairs, m = row * group +
// head; a block takes FLASH_WARP_ROWS m-rows per warp of one slice, all sharing kv head blockIdx.y, so the heads
// of a group read each key tile once, and a decode row batched with a prefill costs one tile of group m-rows.
#include "common.cuh"

// m16n8k16 products: A 16 x 16 (row-major), B 16 x 8 (column-major), C 16 x 8, f32 accumulators. In a warp, lane
// = 4 * g + t holds A's (g, 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..); B's (2t..2t+1, g),
// (2t + 8.., g); C's (g, 2t..2t+1), (g + 8, 2t..2t+1).
static_assert(FLASH_WARP_ROWS == 16, "a warp's m-rows are one m16 product tile");

// Two floats as bf16 in one register, `first` in the low half (the lower column or k index).
__device__ __forceinline__ uint32_t pack_bf16(float first, float second) {
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(second), "f"(first));
    return packed;
}

// (first, second) = hi + lo, each a pair of bf16 in one register.
__device__ __forceinline__ void split_bf16(float first, float second, uint32_t& hi, uint32_t& lo) {
    hi = pack_bf16(first, second);
    lo = pack_bf16(first - __uint_as_float(hi << 16), second - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a * b for split operands: hi*hi + hi*lo + lo*hi.
__device__ __forceinline__ void mma_split(float (&c)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          uint32_t b0_hi, uint32_t b1_hi, uint32_t b0_lo, uint32_t b1_lo) {
    mma_bf16(c, a_lo, b0_hi, b1_hi);
    mma_bf16(c, a_hi, b0_lo, b1_lo);
    mma_bf16(c, a_hi, b0_hi, b1_hi);
}

// Four 8 x 8 bf16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(const uint16_t* row, uint32_t (&r)[4]) {
    const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

__device__ __forceinline__ uint32_t shared_word(const uint16_t* base, int index) {
    return *reinterpret_cast<const uint32_t*>(base + index);
}

// Four floats split and stored as bf16 halves at hi[at..at + 4] and lo[at..at + 4].
__device__ __forceinline__ void store_split(const float4& v, uint16_t* hi, uint16_t* lo, int at) {
    uint2 h, l;
    split_bf16(v.x, v.y, h.x, l.x);
    split_bf16(v.z, v.w, h.y, l.y);
    *reinterpret_cast<uint2*>(hi + at) = h;
    *reinterpret_cast<uint2*>(lo + at) = l;
}

struct FlashArgs {
    const float* q;
    const float* k_pool;
    const float* v_pool;
    float* out;
    const uint32_t* row_pos;
    const uint32_t* row_table;
    const uint32_t* block_tables;
    const uint32_t* slice_start_row;
    const uint32_t* slice_len;
    int slices;
    const float* sinks;
    int num_heads, num_kv_heads, head_dim;
    float scale;
    int window;
};

// bf16 per shared-memory row of D features: rows 16 bytes apart modulo 128, so that the 8 rows of a fragment load
// fall in different banks.
template <int D>
__host__ __device__ constexpr int flash_stride() {
    return D + 8;
}

// Keys k0 .. k0 + KEYS - 1 of one pool (zeros at and past key_end, and past head_dim) into shared memory as bf16
// halves, rows of flash_stride<D>() features. `offset`: the kv head's first feature in a pool row of `kv_width`.
template <int D, int KEYS, int WARPS>
__device__ __forceinline__ void load_tile(const float* __restrict__ pool, const uint32_t* __restrict__ table, int k0,
                                          int key_end, int kv_width, int offset, int head_chunks, uint16_t* hi,
                                          uint16_t* lo) {
    constexpr int CHUNKS = D / 4, THREADS = WARPS * 32, LOADS = KEYS * CHUNKS / THREADS;
    // At most 8 float4s of a thread in flight at once: more would spill the accumulators of the largest heads.
    constexpr int BATCH = LOADS < 8 ? LOADS : 8;
    static_assert(KEYS * CHUNKS % THREADS == 0 && LOADS % BATCH == 0, "every thread loads as many float4s");
#pragma unroll
    for (int first = 0; first < LOADS; first += BATCH) {
        float4 v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int i = threadIdx.x + (first + u) * THREADS, key = i / CHUNKS, chunk = i % CHUNKS, j = k0 + key;
            v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (j < key_end && chunk < head_chunks) {
                const size_t slot = table[j / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + j % KV_BLOCK_SIZE;
                v[u] = *reinterpret_cast<const float4*>(pool + slot * kv_width + offset + 4 * chunk);
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int i = threadIdx.x + (first + u) * THREADS;
            store_split(v[u], hi, lo, (i / CHUNKS) * flash_stride<D>() + 4 * (i % CHUNKS));
        }
    }
}

// One block: FLASH_WARP_ROWS m-rows per warp (WARPS warps) of one slice against kv head blockIdx.y (see the
// file's comment). D: head_dim padded up to a multiple of 16 (the padding is zeros); KEYS: keys per tile.
template <int D, int KEYS, int WARPS>
__device__ __forceinline__ void flash_attend(const FlashArgs& a) {
    static_assert(D % 16 == 0 && KEYS % 16 == 0, "whole m16n8k16 steps");
    constexpr int STRIDE = flash_stride<D>();
    constexpr int CHUNKS = D / 4;  // float4s per padded row
    constexpr int block_rows = WARPS * FLASH_WARP_ROWS;
    extern __shared__ uint4 shared_words[];
    uint16_t* q_hi = reinterpret_cast<uint16_t*>(shared_words);
    uint16_t* q_lo = q_hi + block_rows * STRIDE;
    uint16_t* k_hi = q_lo + block_rows * STRIDE;
    uint16_t* k_lo = k_hi + KEYS * STRIDE;
    uint16_t* v_hi = k_lo + KEYS * STRIDE;
    uint16_t* v_lo = v_hi + KEYS * STRIDE;
    int* found = reinterpret_cast<int*>(v_lo + KEYS * STRIDE);

    const int group = a.num_heads / a.num_kv_heads, kv_head = blockIdx.y;
    int slice, local;
    // Tiles in reverse: a slice's last tiles have the most keys, and go first.
    const auto tiles_of = [&](int len) { return (len * group + block_rows - 1) / block_rows; };
    if (!find_slice_tile(a.slice_len, a.slices, gridDim.x - 1 - blockIdx.x, tiles_of, found, slice, local)) return;
    const int start_row = a.slice_start_row[slice], len = a.slice_len[slice];
    const int m0 = local * block_rows, m_end = min(len * group, m0 + block_rows);
    const uint32_t* table = a.block_tables + a.row_table[start_row];
    const int first_pos = a.row_pos[start_row];  // a slice's rows are consecutive positions
    const int q_cols = a.num_heads * a.head_dim, kv_width = a.num_kv_heads * a.head_dim;
    const int head_chunks = a.head_dim >> 2;

    // The block's queries, split into halves; m-rows past the slice and features past head_dim are zeros.
    for (int i = threadIdx.x; i < block_rows * CHUNKS; i += WARPS * 32) {
        const int row = i / CHUNKS, chunk = i % CHUNKS, m = m0 + row;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (m < m_end && chunk < head_chunks) {
            const int head = kv_head * group + m % group;
            v = *reinterpret_cast<const float4*>(a.q + static_cast<size_t>(start_row + m / group) * q_cols +
                                                 head * a.head_dim + 4 * chunk);
        }
        store_split(v, q_hi, q_lo, row * STRIDE + 4 * chunk);
    }

    // The keys the block's rows see: from the first row's window start to the last row's position.
    const int last_pos = first_pos + (m_end - 1) / group;
    const int first_row_pos = first_pos + m0 / group;
    const int key_begin = a.window > 0 ? max(0, first_row_pos + 1 - a.window) : 0;
    const int key_end = last_pos + 1;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // This lane's two m-rows (g and g + 8 of the warp's 16): their positions, or -1 past the slice's end.
    int pos[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = m0 + warp * FLASH_WARP_ROWS + g + 8 * half;
        pos[half] = m < m_end ? first_pos + m / group : -1;
    }
    const float scale_log2 = a.scale * 1.4426950408889634f;  // scores in base 2: exp(s) = exp2(s * log2(e))

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's share

    const uint16_t* warp_q_hi = q_hi + warp * FLASH_WARP_ROWS * STRIDE;
    const uint16_t* warp_q_lo = q_lo + warp * FLASH_WARP_ROWS * STRIDE;
    for (int k0 = key_begin - key_begin % KEYS; k0 < key_end; k0 += KEYS) {
        __syncthreads();  // every warp is done with the previous tile (and, the first time, the queries are stored)
        // Keys, then values: all of a thread's loads of one pool in flight before the first store.
        load_tile<D, KEYS, WARPS>(a.k_pool, table, k0, key_end, kv_width, kv_head * a.head_dim, head_chunks, k_hi,
                                  k_lo);
        load_tile<D, KEYS, WARPS>(a.v_pool, table, k0, key_end, kv_width, kv_head * a.head_dim, head_chunks, v_hi,
                                  v_lo);
        __syncthreads();

        // Scores of the warp's 16 m-rows against the tile's keys.
        float s[KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int col = 16 * kk + 2 * t;
            const uint32_t a_hi[4] = {shared_word(warp_q_hi, g * STRIDE + col),
                                      shared_word(warp_q_hi, (g + 8) * STRIDE + col),
                                      shared_word(warp_q_hi, g * STRIDE + col + 8),
                                      shared_word(warp_q_hi, (g + 8) * STRIDE + col + 8)};
            const uint32_t a_lo[4] = {shared_word(warp_q_lo, g * STRIDE + col),
                                      shared_word(warp_q_lo, (g + 8) * STRIDE + col),
                                      shared_word(warp_q_lo, g * STRIDE + col + 8),
                                      shared_word(warp_q_lo, (g + 8) * STRIDE + col + 8)};
#pragma unroll
            for (int n = 0; n < KEYS / 8; ++n) {
                const int key_at = (8 * n + g) * STRIDE + col;
                mma_split(s[n], a_hi, a_lo, shared_word(k_hi, key_at), shared_word(k_hi, key_at + 8),
                          shared_word(k_lo, key_at), shared_word(k_lo, key_at + 8));
            }
        }

        // Online softmax, base 2: mask, new maxima, rescale what was summed so far.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int half = e >> 1, j = k0 + 8 * n + 2 * t + (e & 1);
                const bool seen = j <= pos[half] && (a.window <= 0 || j + a.window > pos[half]);
                s[n][e] = seen ? s[n][e] * scale_log2 : -INFINITY;
                tile_max[half] = fmaxf(tile_max[half], s[n][e]);
            }
        }
        float base[2], correction[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
            tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
            const float new_max = fmaxf(row_max[half], tile_max[half]);
            // A row that has seen no key yet keeps max -inf; exponents are then taken against 0 (every p is 0).
            base[half] = new_max == -INFINITY ? 0.0f : new_max;
            correction[half] = exp2f(row_max[half] - base[half]);
            row_max[half] = new_max;
            row_sum[half] *= correction[half];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= correction[0];
            o[n][1] *= correction[0];
            o[n][2] *= correction[1];
            o[n][3] *= correction[1];
        }
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - base[e >> 1]);
                row_sum[e >> 1] += s[n][e];
            }
        }

        // Values: the probabilities (C fragments of the scores) are A fragments of P * V as they lie.
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {
            uint32_t p_hi[4], p_lo[4];
            split_bf16(s[2 * kk][0], s[2 * kk][1], p_hi[0], p_lo[0]);
            split_bf16(s[2 * kk][2], s[2 * kk][3], p_hi[1], p_lo[1]);
            split_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1], p_hi[2], p_lo[2]);
            split_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3], p_hi[3], p_lo[3]);
            // Lane l addresses row 16 kk + (l & 15) of the tile, features from 8 * (l >> 4): matrices (keys 0-7,
            // features n), (keys 8-15, n), (keys 0-7, n + 8), (keys 8-15, n + 8), so r[0..1] is B of n, r[2..3] of n + 8.
            const int row_at = (16 * kk + (lane & 15)) * STRIDE + 8 * (lane >> 4);
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t b_hi[4], b_lo[4];
                ldmatrix_x4_trans(v_hi + row_at + 8 * n, b_hi);
                ldmatrix_x4_trans(v_lo + row_at + 8 * n, b_lo);
                mma_split(o[n], p_hi, p_lo, b_hi[0], b_hi[1], b_lo[0], b_lo[1]);
                mma_split(o[n + 1], p_hi, p_lo, b_hi[2], b_hi[3], b_lo[2], b_lo[3]);
            }
        }
    }

    // Denominators (the quad's shares, plus the head's sink) and the output.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float total = row_sum[half];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (pos[half] < 0) continue;
        const int m = m0 + warp * FLASH_WARP_ROWS + g + 8 * half;
        const int head = kv_head * group + m % group;
        if (a.sinks != nullptr) total += exp2f(a.sinks[head] * 1.4426950408889634f - row_max[half]);
        float* dst = a.out + static_cast<size_t>(start_row + m / group) * q_cols + head * a.head_dim;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int feature = 8 * n + 2 * t;
            if (feature < a.head_dim)
                *reinterpret_cast<float2*>(dst + feature) =
                    make_float2(o[n][2 * half] / total, o[n][2 * half + 1] / total);
        }
    }
}

// Keys per tile: FLASH_TILE_FEATURES key features (64 keys up to head_dim 64, 32 at 128, 16 at 256), so that a
// tile takes as much shared memory and as many loads per thread whatever the head.
__host__ __device__ constexpr int flash_keys_per_tile(int d) {
    return FLASH_TILE_FEATURES / d < FLASH_MAX_KEYS_PER_TILE ? FLASH_TILE_FEATURES / d : FLASH_MAX_KEYS_PER_TILE;
}

// flash_attention_d{D}_w{WARPS}: D the padded head dim (head_dim rounded up to the next kernel's), WARPS warps per
// block (2 only where 4 would need more shared memory than the GPU has: head dim 256 below sm_90's 227 KiB).
#define FLASH_ATTENTION_KERNEL(D, WARPS)                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) flash_attention_d##D##_w##WARPS(                    \
        const float* __restrict__ q, const float* __restrict__ k_pool, const float* __restrict__ v_pool,         \
        float* __restrict__ out, const uint32_t* __restrict__ row_pos, const uint32_t* __restrict__ row_table,   \
        const uint32_t* __restrict__ block_tables, const uint32_t* __restrict__ slice_start_row,                 \
        const uint32_t* __restrict__ slice_len, int slices, const float* __restrict__ sinks, int num_heads,      \
        int num_kv_heads, int head_dim, float scale, int window) {                                               \
        wait_for_previous_kernel();                                                                              \
        const FlashArgs a{q,         k_pool,          v_pool,    out,    row_pos,   row_table,                   \
                          block_tables, slice_start_row, slice_len, slices, sinks,     num_heads,                 \
                          num_kv_heads, head_dim,        scale,     window};                                      \
        flash_attend<D, flash_keys_per_tile(D), WARPS>(a);                                                        \
    }

FLASH_ATTENTION_KERNEL(16, 4)
FLASH_ATTENTION_KERNEL(32, 4)
FLASH_ATTENTION_KERNEL(64, 4)
FLASH_ATTENTION_KERNEL(128, 4)
FLASH_ATTENTION_KERNEL(256, 4)
FLASH_ATTENTION_KERNEL(256, 2)
