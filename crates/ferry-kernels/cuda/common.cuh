// Helpers shared by ferry's kernels. Activations are f32; weights are bf16 stored as raw 16-bit words.
#pragma once
#include <stdint.h>

__device__ __forceinline__ float bf16_to_float(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round-to-nearest-even f32 -> bf16 bits (NaN kept quiet).
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Columns one warp covers per k-step: 32 lanes x 8 bf16 weights, one 16-byte copy each.
constexpr int WARP_STEP_COLS = 256;
// A warp's weights travel through shared memory in two stages of STAGE_COPIES 16-byte copies per lane (whole
// k-steps of every row the warp sums), so one stage is in flight while the other is summed. Asynchronous copies
// are issued ahead of their use whatever the instruction scheduler does, where register loads get scheduled next to
// their first use and keep too few bytes in flight to reach DRAM bandwidth. Fewer, larger stages cost fewer waits.
constexpr int STAGE_COPIES = 4;
// One warp's staging slots (4 KiB): [stage][copy][lane], so a warp's copy into one slot is 512 contiguous bytes.
typedef uint4 WarpStaging[2][STAGE_COPIES][32];

// 16 bytes global -> shared, cached in L2 only: weights are read once per product, so they leave L1 to the
// activations, which every row reads.
__device__ __forceinline__ void copy16_async(uint4* dst, const uint16_t* src) {
    const uint32_t shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(src) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most PENDING committed groups of this thread's copies are still in flight.
template <int PENDING>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// Dot products of ROWS bf16 weight rows of length k with the same TOKENS f32 activation rows (x + t * x_stride),
// computed by one warp over the k-steps of WARP_STEP_COLS columns slice, slice + slices, ... (slices warps share
// the rows when k is split). Each activation value loaded serves all ROWS rows. acc[r][t] ends as the lane's
// partial sum; the caller reduces across the warp and the slices. Rows or activations not 16-byte aligned (k not
// a multiple of 8, odd strides) take a scalar path, which leaves the staging slots unused.
template <int ROWS, int TOKENS>
__device__ __forceinline__ void warp_rows_dot(const uint16_t* const (&w)[ROWS], const float* __restrict__ x,
                                              int x_stride, int k, int slice, int slices, WarpStaging& staging,
                                              float (&acc)[ROWS][TOKENS]) {
    static_assert(STAGE_COPIES % ROWS == 0, "a stage holds whole k-steps of every row");
    constexpr int STEPS = STAGE_COPIES / ROWS;  // k-steps per stage
    const int lane = threadIdx.x & 31;
    uintptr_t addresses = reinterpret_cast<uintptr_t>(x);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) addresses |= reinterpret_cast<uintptr_t>(w[r]);
    if ((addresses & 15) == 0 && (k & 7) == 0 && (x_stride & 3) == 0) {
        const int steps = (k + WARP_STEP_COLS - 1) / WARP_STEP_COLS;
        const int own_steps = slice < steps ? (steps - 1 - slice) / slices + 1 : 0;
        const int chunks = (own_steps + STEPS - 1) / STEPS;
        // The lane's first column in step s of the warp's chunk c (its k-steps c * STEPS .. c * STEPS + STEPS - 1);
        // columns at or past k (the last, partial k-step, or steps past the warp's own) are neither copied nor used.
        auto column = [&](int c, int s) { return (slice + (c * STEPS + s) * slices) * WARP_STEP_COLS + lane * 8; };
        // Into the stage summed in the previous iteration, if any.
        auto fetch = [&](int c) {
#pragma unroll
            for (int s = 0; s < STEPS; ++s) {
                const int col = column(c, s);
                if (col < k) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) copy16_async(&staging[c & 1][s * ROWS + r][lane], w[r] + col);
                }
            }
            commit_copies();
        };
        if (chunks > 0) fetch(0);
        for (int c = 0; c < chunks; ++c) {
            if (c + 1 < chunks) {
                fetch(c + 1);
                wait_copies<1>();
            } else {
                wait_copies<0>();
            }
#pragma unroll
            for (int s = 0; s < STEPS; ++s) {
                const int col = column(c, s);
                if (col >= k) break;
                float wf[ROWS][8];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const uint4 packed = staging[c & 1][s * ROWS + r][lane];
                    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        wf[r][2 * j] = __uint_as_float(words[j] << 16);
                        wf[r][2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
                    }
                }
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) {
                    const float* xt = x + static_cast<size_t>(t) * x_stride + col;
                    const float4 a = __ldg(reinterpret_cast<const float4*>(xt));
                    const float4 b = __ldg(reinterpret_cast<const float4*>(xt + 4));
                    const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][j], xv[j], acc[r][t]);
                }
            }
        }
    } else {
        for (int col = slice * 32 + lane; col < k; col += slices * 32) {
            float wv[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wv[r] = bf16_to_float(w[r][col]);
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                const float xv = x[static_cast<size_t>(t) * x_stride + col];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
            }
        }
    }
}
