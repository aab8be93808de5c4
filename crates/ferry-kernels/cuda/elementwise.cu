// Row-wise and elementwise ops on [rows, cols] f32 activations.
#include "common.cuh"

extern "C" __global__ void embed_bf16(const uint16_t* __restrict__ table, const uint32_t* __restrict__ ids,
                                      float* __restrict__ out, int hidden) {
    wait_for_previous_kernel();
    const uint16_t* row = table + static_cast<size_t>(ids[blockIdx.x]) * hidden;
    float* o = out + static_cast<size_t>(blockIdx.x) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = bf16_to_float(row[i]);
}

// One block per `group`-wide chunk: out = x / sqrt(mean(x^2) + eps) * weight.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    float* __restrict__ out, int group, float eps) {
    wait_for_previous_kernel();
    const float* xg = x + static_cast<size_t>(blockIdx.x) * group;
    float* og = out + static_cast<size_t>(blockIdx.x) * group;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) sum += xg[i] * xg[i];
    const float inv = 1.0f / sqrtf(block_sum(sum) / group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) og[i] = xg[i] * inv * weight[i];
}

// x += y, then out = rms_norm(x) * weight, row by row (one block of 256 threads per row): the residual add and the
// next norm in one pass, with the same arithmetic as the fused residual epilogues of gemv.cu and moe.cu (common.cuh's
// store_or_add and block_rms_norm_row), so that fused and unfused give the same bits.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ y,
                                        const float* __restrict__ weight, float* __restrict__ out, int cols,
                                        float eps) {
    wait_for_previous_kernel();
    float* xr = x + static_cast<size_t>(blockIdx.x) * cols;
    const float* yr = y + static_cast<size_t>(blockIdx.x) * cols;
    // Each thread normalises the columns it added (block_rms_norm_row's), so it reads back only its own writes.
    const int stride = blockDim.x;
    for (int first = threadIdx.x; first < cols; first += ROW_LOADS * stride) {
        float sum[ROW_LOADS];
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) {
            const int i = first + j * stride;
            sum[j] = i < cols ? xr[i] + yr[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j)
            if (first + j * stride < cols) xr[first + j * stride] = sum[j];
    }
    block_rms_norm_row(xr, weight, out + static_cast<size_t>(blockIdx.x) * cols, cols, eps);
}

extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] += y[i];
}

extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias, size_t n, int cols) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] += bias[i % cols];
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

extern "C" __global__ void silu_mul(const float* __restrict__ gate, const float* __restrict__ up,
                                    float* __restrict__ out, size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        out[i] = silu(gate[i]) * up[i];
}

// out[r, i] = silu(x[r, i]) * x[r, half + i] for rows of [gate | up] (a fused gate/up product), out [rows, half].
extern "C" __global__ void silu_mul_halves(const float* __restrict__ x, int half, float* __restrict__ out,
                                           size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const size_t r = i / half, c = i % half;
        out[i] = silu(x[r * 2 * half + c]) * x[r * 2 * half + half + c];
    }
}

// x[r, :] *= sigmoid(gate[r]); one block per row.
extern "C" __global__ void sigmoid_gate(float* __restrict__ x, const float* __restrict__ gate, int cols) {
    wait_for_previous_kernel();
    const float s = 1.0f / (1.0f + expf(-gate[blockIdx.x]));
    float* row = x + static_cast<size_t>(blockIdx.x) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) row[i] *= s;
}

extern "C" __global__ void select_rows(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                                       float* __restrict__ out, int cols) {
    wait_for_previous_kernel();
    const float* src = x + static_cast<size_t>(rows[blockIdx.x]) * cols;
    float* dst = out + static_cast<size_t>(blockIdx.x) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// out[r] = the index of row r's largest value among its first `cols` (the lowest index among equals; NaN below
// every number; 0 for a row of NaN), rows `stride` apart: the greedy sampler's choice, so that only the ids cross
// to the host. One block per row; each thread keeps its best (strictly greater: its lowest index), then a warp's
// best key and the lowest index holding it by redux.sync, then the warps' through shared memory likewise.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int cols, int stride, uint32_t* __restrict__ out) {
    wait_for_previous_kernel();
    __shared__ unsigned warp_key[32];
    __shared__ int warp_index[32];
    const float* row = x + static_cast<size_t>(blockIdx.x) * stride;
    unsigned key = 0;
    int index = NO_INDEX;
#pragma unroll 8
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const unsigned k = ordered_key(row[i]);
        if (k > key) {
            key = k;
            index = i;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const WarpBest mine = warp_best(key, index);
    if (lane == 0) {
        warp_key[warp] = mine.key;
        warp_index[warp] = mine.index;
    }
    __syncthreads();
    if (warp == 0) {
        const bool held = lane < (blockDim.x >> 5);
        const WarpBest best = warp_best(held ? warp_key[lane] : 0u, held ? warp_index[lane] : NO_INDEX);
        if (lane == 0) out[blockIdx.x] = best.index == NO_INDEX ? 0u : static_cast<uint32_t>(best.index);
    }
}

// x = hi + lo with hi, lo bf16: products of bf16 are exact in f32, so two bf16 GEMMs (hi and lo) give
// f32-accurate results on the tensor cores.
extern "C" __global__ void split_bf16(const float* __restrict__ x, uint16_t* __restrict__ hi,
                                      uint16_t* __restrict__ lo, size_t n) {
    wait_for_previous_kernel();
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint16_t h = float_to_bf16(x[i]);
        hi[i] = h;
        lo[i] = float_to_bf16(x[i] - bf16_to_float(h));
    }
}

// Reads n 16-byte words of `src`, host memory the device maps (pinned memory, under unified addressing), and adds
// their 32-bit lanes into *sink so that no read can be dropped: `ferry doctor`'s rate for a kernel that reads
// expert weights straight from the host bank over the link, with no copy in between.
extern "C" __global__ void read_mapped(const uint4* __restrict__ src, size_t n, unsigned int* sink) {
    wait_for_previous_kernel();
    unsigned int sum = 0;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint4 v = src[i];
        sum += v.x + v.y + v.z + v.w;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) atomicAdd(sink, sum);
}
