//! Products with bf16 or FP8 weights, `out = x W^T (+ bias)`: decode-sized ones (up to [`GEMV_MAX_ROWS`] rows) on
//! the GEMV kernels of gemv.cu, one per row count and weight format, which read each weight once; larger ones on
//! cuBLAS's bf16 tensor cores with the f32 activations split into two bf16 halves (`x = hi + lo`), which keeps f32
//! accuracy. The one cuBLAS GEMM call of the backend ([`CudaBackend::gemm_bf16`]) is here. Decode's output
//! projections may end in the GEMV's fused residual epilogue ([`CudaBackend::matmul_add_rms_norm`]); the router's
//! GEMV with its top-k is route.rs's launch of `gemv_route_R`.
//!
//! Dense FP8 weights are read without rounding to bf16 (an E4M3 value times an f32 scale has up to 28 significant
//! bits, bf16 8: rounding every weight moved the fixtures' logits by 0.07). The GEMV dequantizes in registers and
//! accumulates in f32, scaling each run of 16 weights once. Larger products dequantize W into bf16 halves too
//! (`W = W_hi + W_lo`, 16 significant bits, exact for per-channel bf16 scales) and sum the four bf16 GEMMs in f32:
//! the weight side is then as exact as the activation split already is. Chosen over scaling per 128-column block
//! of k (exact on the weight side, but one GEMM output per block of k to keep and sum: 32x the output memory at
//! k = 4096) and over FP8 tensor cores (which round the activations to E4M3).

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaSlice, LaunchConfig};
use ferry_kernels::constants::{GEMV_MAX_ROWS, GEMV_ROWS_PER_WARP, GEMV_WARPS, WARP_STEP_BYTES};

use super::launch::{grid_1d, kernel, ptr, Ptr, BLOCK_THREADS};
use super::{blas_err, Bf16Matrix, CudaBackend, CudaTensor, Fp8Matrix};
use crate::{Error, Result};

/// gemv.cu's kernels (the kernel table's list): `gemv_bf16_R` for R = 1..=8 rows, then `gemv_fp8_R`, then
/// `gemv_route_R` (the router's product and top-k), then `dequantize_fp8`.
pub(super) const GEMV_KERNELS: [&str; 3 * GEMV_MAX_ROWS + 1] = [
    "gemv_bf16_1",
    "gemv_bf16_2",
    "gemv_bf16_3",
    "gemv_bf16_4",
    "gemv_bf16_5",
    "gemv_bf16_6",
    "gemv_bf16_7",
    "gemv_bf16_8",
    "gemv_fp8_1",
    "gemv_fp8_2",
    "gemv_fp8_3",
    "gemv_fp8_4",
    "gemv_fp8_5",
    "gemv_fp8_6",
    "gemv_fp8_7",
    "gemv_fp8_8",
    "gemv_route_1",
    "gemv_route_2",
    "gemv_route_3",
    "gemv_route_4",
    "gemv_route_5",
    "gemv_route_6",
    "gemv_route_7",
    "gemv_route_8",
    "dequantize_fp8",
];

/// The GEMV kernel for products of `rows` rows (1..=`GEMV_MAX_ROWS`) with bf16 or FP8 weights.
fn gemv_kernel(fp8: bool, rows: usize) -> &'static str {
    GEMV_KERNELS[usize::from(fp8) * GEMV_MAX_ROWS + rows - 1]
}

/// The fused router GEMV for `rows` rows (1..=`GEMV_MAX_ROWS`).
pub(super) fn gemv_route_kernel(rows: usize) -> &'static str {
    GEMV_KERNELS[2 * GEMV_MAX_ROWS + rows - 1]
}

/// Blocks a GEMV launch should have at least, so that every SM of a large GPU gets work: products with fewer rows
/// split k between the warps of a block until they do. 512 (four blocks an H200 SM) rather than 256: a block's
/// warps copy their first two stages before waiting on the kernel before them (gemv.cu), so more warps a product
/// put more of its weights in flight during that kernel.
const GEMV_MIN_BLOCKS: usize = 512;

kernel! {
    /// gemv.cu's `gemv_bf16_R` (one kernel per row count R of x): `out = x W^T (+ bias)` for W `[n, k]`, each
    /// weight row's k-steps split between `k_slices` warps; `bias` may be null. With a `residual` (else null):
    /// `residual += x W^T (+ bias)`, then `out` = each residual row's RMSNorm times `norm`, the last of the blocks
    /// (counted on `counter`) normalising.
    struct Gemv {
        x: Ptr<f32>,
        k: i32,
        w: Ptr<u16>,
        n: i32,
        k_slices: i32,
        bias: Ptr<f32>,
        out: Ptr<f32>,
        residual: Ptr<f32>,
        norm: Ptr<f32>,
        eps: f32,
        counter: Ptr<u32>,
    }
}

kernel! {
    /// gemv.cu's `gemv_fp8_R`: [`Gemv`] for an FP8 W `[n, k]` with f32 scales per `block_rows` x `block_cols`
    /// block.
    struct GemvFp8 {
        x: Ptr<f32>,
        k: i32,
        w: Ptr<u8>,
        scales: Ptr<f32>,
        block_rows: i32,
        block_cols: i32,
        n: i32,
        k_slices: i32,
        bias: Ptr<f32>,
        out: Ptr<f32>,
        residual: Ptr<f32>,
        norm: Ptr<f32>,
        eps: f32,
        counter: Ptr<u32>,
    }
}

kernel! {
    /// gemv.cu's `dequantize_fp8`: an FP8 W `[n, k]` as bf16 halves `hi + lo`, each `[n, k]`.
    struct DequantizeFp8 = "dequantize_fp8" {
        w: Ptr<u8>,
        scales: Ptr<f32>,
        block_rows: i32,
        block_cols: i32,
        n: i32,
        k: i32,
        hi: Ptr<u16>,
        lo: Ptr<u16>,
    }
}

kernel! {
    /// elementwise.cu's `add_bias`: `x[i] += bias[i % cols]` over the `n` values of x.
    struct AddBias = "add_bias" {
        x: Ptr<f32>,
        bias: Ptr<f32>,
        n: usize,
        cols: i32,
    }
}

kernel! {
    /// elementwise.cu's `split_bf16`: `x = hi + lo` over n values, both halves bf16.
    struct SplitBf16 = "split_bf16" {
        x: Ptr<f32>,
        hi: Ptr<u16>,
        lo: Ptr<u16>,
        n: usize,
    }
}

/// An f32 tensor as two bf16 halves, `x = hi + lo`, each `[rows, cols]` like the tensor.
pub(super) struct Bf16Halves {
    hi: CudaSlice<u16>,
    lo: CudaSlice<u16>,
}

impl Bf16Halves {
    /// The high half: x rounded to bf16.
    pub(super) fn hi(&self) -> Ptr<u16> {
        ptr(&self.hi)
    }

    /// The low half: what rounding to bf16 left.
    pub(super) fn lo(&self) -> Ptr<u16> {
        ptr(&self.lo)
    }
}

/// `count` products of one shape, `out_i[rows, n] = x_i[rows, k] W_i^T`, their bf16 `W_i` (`[n, k]`), bf16 `x_i`
/// and f32 `out_i` (rows n apart) read from device arrays of pointers, each pointer 16-byte aligned.
pub(super) struct BatchedProduct {
    pub(super) w: Ptr<Ptr<u16>>,
    pub(super) x: Ptr<Ptr<u16>>,
    pub(super) out: Ptr<Ptr<f32>>,
    pub(super) rows: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) count: usize,
}

/// A dense FP8 matrix dequantized to bf16 halves (`W = hi + lo`) and the buffer that holds them.
pub(super) struct Fp8Halves {
    _buffer: CudaSlice<u16>,
    halves: [Bf16Matrix; 2],
}

impl Fp8Halves {
    /// The high half: the weight rounded to bf16.
    pub(super) fn hi(&self) -> Bf16Matrix {
        self.halves[0]
    }

    /// The low half: what rounding to bf16 left.
    pub(super) fn lo(&self) -> Bf16Matrix {
        self.halves[1]
    }
}

/// A linear layer's weight as the products read it: bf16, or FP8 with its scales.
#[derive(Clone, Copy)]
pub(super) enum LinearWeight {
    Bf16(Bf16Matrix),
    Fp8(Fp8Matrix),
}

impl LinearWeight {
    /// `[rows, cols]`.
    fn shape(self) -> (usize, usize) {
        match self {
            LinearWeight::Bf16(w) => (w.rows, w.cols),
            LinearWeight::Fp8(w) => (w.rows, w.cols),
        }
    }

    /// Bytes of one weight as stored.
    fn weight_bytes(self) -> usize {
        match self {
            LinearWeight::Bf16(_) => 2,
            LinearWeight::Fp8(_) => 1,
        }
    }
}

/// Warps of a GEMV block that split each weight row's k-steps between them (1, 2, 4 or 8): more when n is small,
/// until the launch has `GEMV_MIN_BLOCKS` blocks or each warp is down to one k-step.
fn gemv_k_slices(rows: usize, n: usize, k: usize, weight_bytes: usize) -> usize {
    let rows_per_warp = GEMV_ROWS_PER_WARP[rows - 1];
    let steps = (k * weight_bytes).div_ceil(WARP_STEP_BYTES);
    let mut slices = 1;
    while slices < GEMV_WARPS
        && n.div_ceil(GEMV_WARPS / slices * rows_per_warp) < GEMV_MIN_BLOCKS
        && steps >= 2 * slices
    {
        slices *= 2;
    }
    slices
}

/// A GEMV of `rows` rows (1..=`GEMV_MAX_ROWS`) with W: how many warps split each weight row's k-steps, and the
/// grid.
pub(super) fn gemv_shape(rows: usize, w: LinearWeight) -> (i32, LaunchConfig) {
    let (n, k) = w.shape();
    let slices = gemv_k_slices(rows, n, k, w.weight_bytes());
    let block_rows = GEMV_WARPS / slices * GEMV_ROWS_PER_WARP[rows - 1];
    (slices as i32, gemv_grid(n.div_ceil(block_rows)))
}

/// The residual epilogue of [`CudaBackend::matmul_add_rms_norm`]: the residual the product is added to, and the
/// norm applied to it.
struct AddNorm {
    residual: Ptr<f32>,
    norm: Ptr<f32>,
    eps: f32,
}

/// `blocks` GEMV blocks of `GEMV_WARPS` warps.
fn gemv_grid(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (GEMV_WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// `out = x W^T (+ bias)`. An FP8 W is read exactly (see the file's comment).
    pub(super) fn matmul(&self, x: &CudaTensor, w: LinearWeight, bias: Option<Ptr<f32>>) -> Result<CudaTensor> {
        let (n, k) = w.shape();
        let out = self.product_output(x, n, k)?;
        if x.rows == 0 {
            return Ok(out);
        }
        if x.rows <= GEMV_MAX_ROWS {
            self.gemv(x, w, bias, &out, None)?;
            return Ok(out);
        }
        let halves = self.split_bf16(x)?;
        match w {
            LinearWeight::Bf16(w) => self.gemm_split(&halves, 0, x.rows, w, &out)?,
            LinearWeight::Fp8(w) => {
                let weight_halves = self.dequantize_fp8(w)?;
                self.gemm_split(&halves, 0, x.rows, weight_halves.hi(), &out)?;
                self.gemm_split_into(&halves, 0, x.rows, weight_halves.lo(), &out, true)?;
            }
        }
        self.add_bias(&out, bias)?;
        Ok(out)
    }

    /// [`crate::backend::Backend::linear_add_rms_norm`] for 1..=[`GEMV_MAX_ROWS`] rows of `x`: `residual += x W^T (+
    /// bias)` and the RMSNorm of each residual row times `norm` in one GEMV launch (gemv.cu's residual epilogue),
    /// the same bits as [`CudaBackend::matmul`] then elementwise.cu's add_rms_norm.
    pub(super) fn matmul_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: LinearWeight,
        bias: Option<Ptr<f32>>,
        residual: &mut CudaTensor,
        norm: Ptr<f32>,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (n, k) = w.shape();
        let out = self.product_output(x, n, k)?;
        if (residual.rows, residual.cols) != (out.rows, out.cols) || !(1..=GEMV_MAX_ROWS).contains(&x.rows) {
            return Err(Error::Shape(format!(
                "matmul_add_rms_norm: a [{}, {}] product into a [{}, {}] residual",
                out.rows, out.cols, residual.rows, residual.cols
            )));
        }
        let epilogue = AddNorm {
            residual: ptr(&residual.data),
            norm,
            eps,
        };
        self.gemv(x, w, bias, &out, Some(epilogue))?;
        Ok(out)
    }

    /// gemv.cu's `gemv_bf16_R` or `gemv_fp8_R` for the 1..=[`GEMV_MAX_ROWS`] rows of x into `out`, with the residual
    /// epilogue when given.
    fn gemv(
        &self,
        x: &CudaTensor,
        w: LinearWeight,
        bias: Option<Ptr<f32>>,
        out: &CudaTensor,
        epilogue: Option<AddNorm>,
    ) -> Result<()> {
        let (n, k) = w.shape();
        let (k_slices, cfg) = gemv_shape(x.rows, w);
        let AddNorm { residual, norm, eps } = epilogue.unwrap_or(AddNorm {
            residual: Ptr::null(),
            norm: Ptr::null(),
            eps: 0.0,
        });
        let (x_ptr, out_ptr, bias) = (ptr(&x.data), ptr(&out.data), bias.unwrap_or(Ptr::null()));
        let counter = ptr(&self.block_counter);
        match w {
            LinearWeight::Bf16(w) => Gemv {
                x: x_ptr,
                k: k as i32,
                w: w.data,
                n: n as i32,
                k_slices,
                bias,
                out: out_ptr,
                residual,
                norm,
                eps,
                counter,
            }
            .launch_kernel(self, gemv_kernel(false, x.rows), cfg),
            LinearWeight::Fp8(w) => {
                let [block_rows, block_cols] = w.block.map(|b| b as i32);
                GemvFp8 {
                    x: x_ptr,
                    k: k as i32,
                    w: w.data,
                    scales: w.scales,
                    block_rows,
                    block_cols,
                    n: n as i32,
                    k_slices,
                    bias,
                    out: out_ptr,
                    residual,
                    norm,
                    eps,
                    counter,
                }
                .launch_kernel(self, gemv_kernel(true, x.rows), cfg)
            }
        }
    }

    /// An uninitialised output for `x W^T` with W `[n, k]`, once x is checked to have k features.
    fn product_output(&self, x: &CudaTensor, n: usize, k: usize) -> Result<CudaTensor> {
        if x.cols != k {
            return Err(Error::Shape(format!(
                "matmul: input has {} features, weight expects {k}",
                x.cols
            )));
        }
        self.tensor(x.rows, n)
    }

    /// `out += bias` on every row, if there is a bias.
    fn add_bias(&self, out: &CudaTensor, bias: Option<Ptr<f32>>) -> Result<()> {
        if let Some(bias) = bias {
            let values = out.rows * out.cols;
            let add = AddBias {
                x: ptr(&out.data),
                bias,
                n: values,
                cols: out.cols as i32,
            };
            add.launch(self, grid_1d(values, BLOCK_THREADS))?;
        }
        Ok(())
    }

    /// An FP8 matrix as bf16 halves `W = hi + lo` (16 significant bits of each weight), in a buffer the returned
    /// matrices point into: it must outlive their use.
    pub(super) fn dequantize_fp8(&self, w: Fp8Matrix) -> Result<Fp8Halves> {
        let values = w.rows * w.cols;
        let buffer: CudaSlice<u16> = self.alloc(2 * values)?;
        let [hi, lo] = [ptr(&buffer), ptr(&buffer).offset(values)];
        let [block_rows, block_cols] = w.block.map(|b| b as i32);
        DequantizeFp8 {
            w: w.data,
            scales: w.scales,
            block_rows,
            block_cols,
            n: w.rows as i32,
            k: w.cols as i32,
            hi,
            lo,
        }
        .launch(self, grid_1d(values, BLOCK_THREADS))?;
        let matrix = |data| Bf16Matrix {
            data,
            rows: w.rows,
            cols: w.cols,
        };
        Ok(Fp8Halves {
            _buffer: buffer,
            halves: [matrix(hi), matrix(lo)],
        })
    }

    /// `x = hi + lo`, both bf16: products of bf16 are exact in f32, so a GEMM of each half, summed in f32, keeps
    /// f32 accuracy on the bf16 tensor cores.
    pub(super) fn split_bf16(&self, x: &CudaTensor) -> Result<Bf16Halves> {
        let n = x.rows * x.cols;
        let halves = Bf16Halves {
            hi: self.alloc(n)?,
            lo: self.alloc(n)?,
        };
        let split = SplitBf16 {
            x: ptr(&x.data),
            hi: ptr(&halves.hi),
            lo: ptr(&halves.lo),
            n,
        };
        split.launch(self, grid_1d(n, BLOCK_THREADS))?;
        Ok(halves)
    }

    /// `out[rows] = (hi + lo)[rows] W^T` for the rows `first_row..first_row + rows` of `x` and of `out`: two bf16
    /// tensor-core GEMMs accumulated in f32.
    pub(super) fn gemm_split(
        &self,
        x: &Bf16Halves,
        first_row: usize,
        rows: usize,
        w: Bf16Matrix,
        out: &CudaTensor,
    ) -> Result<()> {
        self.gemm_split_into(x, first_row, rows, w, out, false)
    }

    /// [`CudaBackend::gemm_split`], added to what `out`'s rows hold when `accumulate` (a weight split in halves
    /// too: FP8 experts dequantized in the grouped path).
    pub(super) fn gemm_split_into(
        &self,
        x: &Bf16Halves,
        first_row: usize,
        rows: usize,
        w: Bf16Matrix,
        out: &CudaTensor,
        accumulate: bool,
    ) -> Result<()> {
        let out_rows = ptr(&out.data).offset(first_row * out.cols);
        for (half, accumulate) in [(&x.hi, accumulate), (&x.lo, true)] {
            let input = ptr(half).offset(first_row * w.cols);
            self.gemm_bf16(input, rows, w, out_rows, out.cols, accumulate)?;
        }
        Ok(())
    }

    /// `out[rows, n] = x[rows, k] W^T (+ out when accumulating)` for bf16 x and W (`[n, k]`) and f32 out with rows
    /// `out_stride` apart: one cuBLAS bf16 tensor-core GEMM, accumulated in f32.
    pub(super) fn gemm_bf16(
        &self,
        x: Ptr<u16>,
        rows: usize,
        w: Bf16Matrix,
        out: Ptr<f32>,
        out_stride: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W^T(k x n)^T x^T.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w.data.address() as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                x.address() as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                out.address() as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                out_stride as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// [`CudaBackend::gemm_bf16`] for each of `p.count` products of one shape, added to what `out_i` holds when
    /// `accumulate`: one cuBLAS batched bf16 tensor-core GEMM, accumulated in f32 (the grouped MoE path's tiles).
    pub(super) fn gemm_bf16_batched(&self, p: &BatchedProduct, accumulate: bool) -> Result<()> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W^T(k x n)^T x^T, as in gemm_bf16.
        unsafe {
            blas_sys::cublasGemmBatchedEx(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                p.n as i32,
                p.rows as i32,
                p.k as i32,
                &alpha as *const f32 as *const _,
                p.w.address() as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                p.k as i32,
                p.x.address() as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                p.k as i32,
                &beta as *const f32 as *const _,
                p.out.address() as *const _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                p.n as i32,
                p.count as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(blas_err)
    }
}
