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

// Dot product of one bf16 weight row with up to MAX_TOKENS f32 activation rows, computed by one warp.
// Each lane takes 8 consecutive weights per step (one 16-byte load when the row is 16-byte aligned).
// acc[t] ends as the lane's partial sum for token t; the caller reduces across the warp.
template <int MAX_TOKENS>
__device__ __forceinline__ void warp_row_dot(const uint16_t* __restrict__ w_row, const float* __restrict__ x,
                                             int k, int x_stride, int tokens, float acc[MAX_TOKENS]) {
    const int lane = threadIdx.x & 31;
    const bool aligned = ((reinterpret_cast<uintptr_t>(w_row) | reinterpret_cast<uintptr_t>(x)) & 15) == 0 &&
                         (x_stride & 3) == 0;
    int kk = 0;
    if (aligned) {
        // Unrolled so several 16-byte loads per lane are in flight: a GEMV is bound by memory latency otherwise.
#pragma unroll 4
        for (kk = lane * 8; kk + 8 <= k; kk += 32 * 8) {
            const uint4 packed = *reinterpret_cast<const uint4*>(w_row + kk);
            const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
            float w[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w[2 * i] = __uint_as_float(words[i] << 16);
                w[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            }
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; ++t) {
                if (t < tokens) {
                    const float* xt = x + static_cast<size_t>(t) * x_stride + kk;
                    const float4 a = *reinterpret_cast<const float4*>(xt);
                    const float4 b = *reinterpret_cast<const float4*>(xt + 4);
                    acc[t] = fmaf(w[0], a.x, acc[t]);
                    acc[t] = fmaf(w[1], a.y, acc[t]);
                    acc[t] = fmaf(w[2], a.z, acc[t]);
                    acc[t] = fmaf(w[3], a.w, acc[t]);
                    acc[t] = fmaf(w[4], b.x, acc[t]);
                    acc[t] = fmaf(w[5], b.y, acc[t]);
                    acc[t] = fmaf(w[6], b.z, acc[t]);
                    acc[t] = fmaf(w[7], b.w, acc[t]);
                }
            }
        }
        // The vector loop stops at the last whole group of 8 this lane owns; the remainder is below.
        kk = (k / 8) * 8;
        for (int i = kk + lane; i < k; i += 32) {
            const float wv = bf16_to_float(w_row[i]);
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; ++t)
                if (t < tokens) acc[t] = fmaf(wv, x[static_cast<size_t>(t) * x_stride + i], acc[t]);
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            const float wv = bf16_to_float(w_row[i]);
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; ++t)
                if (t < tokens) acc[t] = fmaf(wv, x[static_cast<size_t>(t) * x_stride + i], acc[t]);
        }
    }
}
