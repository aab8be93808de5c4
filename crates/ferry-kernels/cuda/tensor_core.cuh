// Tensor-core helpers shared by the attention kernels: f32 operands taken in 3xTF32 (hi*hi + hi*lo + lo*hi, f32
// accumulators) by m16n8k8 products, and an asynchronous global -> shared copy that may zero-fill instead
// (common.cuh's commit_copies and wait_copies complete it).
#pragma once
#include <stdint.h>

// 16 bytes global -> shared without passing through registers; with `fill` false nothing is read and the 16
// bytes are zeroed (keys past the end of a split: zero values keep 0 * v finite).
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, bool fill) {
    const uint32_t dst_shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}

// x = hi + lo in tf32 parts: hi is x rounded to tf32 (to nearest, ties away from zero: add half of the 13 dropped
// bits' unit, then drop them; two integer operations where cvt.rna.tf32.f32 costs several), lo = x - hi exactly
// (|lo| <= 2^-11 |x|), which the tensor cores read as tf32 by ignoring its low 13 bits: lo * hi then errs by at most
// 2^-21 |x hi|, like the lo * lo left out.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// m16n8k8 products: A 16 x 8 (row-major), B 8 x 8 (column-major), C 16 x 8, f32 accumulators. In a warp, lane
// = 4 * g + t holds A's (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B's (t, g), (t + 4, g); C's (g, 2t..2t+1),
// (g + 8, 2t..2t+1).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of a matrix whose element (i, j) is m[i * row_step + j * col_step], split.
__device__ __forceinline__ void load_a_split(const float* m, int row_step, int col_step, int g, int t,
                                             uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    split_tf32(m[g * row_step + t * col_step], hi[0], lo[0]);
    split_tf32(m[(g + 8) * row_step + t * col_step], hi[1], lo[1]);
    split_tf32(m[g * row_step + (t + 4) * col_step], hi[2], lo[2]);
    split_tf32(m[(g + 8) * row_step + (t + 4) * col_step], hi[3], lo[3]);
}
