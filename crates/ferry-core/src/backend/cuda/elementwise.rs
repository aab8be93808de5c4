//! The row-wise and elementwise ops of the CUDA backend (elementwise.cu, and gdn.cu's elementwise output gate):
//! embedding lookup, RMSNorm (alone and fused with the residual add), the residual add, SiLU-gating, the sigmoid
//! gates, row selection and each row's argmax (the greedy sampler's choice).

use cudarc::driver::CudaSlice;
use ferry_kernels::constants::{GEMV_WARPS, MOE_WARPS};

use super::launch::{grid_1d, kernel, per_row, ptr, Ptr, BLOCK_THREADS};
use super::{cuda_err, CudaBackend, CudaTensor, CudaWeight};
use crate::backend::check_argmax_cols;
use crate::{Error, Result};

kernel! {
    /// elementwise.cu's `embed_bf16`: row `ids[r]` of the bf16 table, widened, for each output row r.
    struct EmbedBf16 = "embed_bf16" {
        table: Ptr<u16>,
        ids: Ptr<u32>,
        out: Ptr<f32>,
        hidden: i32,
    }
}

kernel! {
    /// elementwise.cu's `rms_norm`: one block per `group`-wide chunk of x.
    struct RmsNorm = "rms_norm" {
        x: Ptr<f32>,
        weight: Ptr<f32>,
        out: Ptr<f32>,
        group: i32,
        eps: f32,
    }
}

kernel! {
    /// elementwise.cu's `add_rms_norm`: `x += y`, then `out = rms_norm(x) * weight`, one block of 256 threads per
    /// row.
    struct AddRmsNorm = "add_rms_norm" {
        x: Ptr<f32>,
        y: Ptr<f32>,
        weight: Ptr<f32>,
        out: Ptr<f32>,
        cols: i32,
        eps: f32,
    }
}

kernel! {
    /// elementwise.cu's `add_assign`: `x += y` over n values.
    struct AddAssign = "add_assign" {
        x: Ptr<f32>,
        y: Ptr<f32>,
        n: usize,
    }
}

kernel! {
    /// elementwise.cu's `silu_mul`: `out = silu(gate) * up` over n values.
    struct SiluMul = "silu_mul" {
        gate: Ptr<f32>,
        up: Ptr<f32>,
        out: Ptr<f32>,
        n: usize,
    }
}

kernel! {
    /// elementwise.cu's `sigmoid_gate`: `x[r, :] *= sigmoid(gate[r])`, one block per row.
    struct SigmoidGateRows = "sigmoid_gate" {
        x: Ptr<f32>,
        gate: Ptr<f32>,
        cols: i32,
    }
}

kernel! {
    /// elementwise.cu's `argmax_rows`: each row's argmax over its first `cols` values, rows `stride` apart, one
    /// block per row.
    struct ArgmaxRows = "argmax_rows" {
        x: Ptr<f32>,
        cols: i32,
        stride: i32,
        out: Ptr<u32>,
    }
}

kernel! {
    /// gdn.cu's `sigmoid_gate_elementwise`: `x[i] *= sigmoid(gate[i])` over n values.
    struct SigmoidGateElementwise = "sigmoid_gate_elementwise" {
        x: Ptr<f32>,
        gate: Ptr<f32>,
        n: usize,
    }
}

kernel! {
    /// The row copies, one block per row i, `cols` values each: elementwise.cu's `select_rows` and moe.cu's
    /// `gather_rows` (`out[i] = x[rows[i]]`).
    struct RowCopy {
        x: Ptr<f32>,
        rows: Ptr<u32>,
        out: Ptr<f32>,
        cols: i32,
    }
}

// add_rms_norm's block size is the fused residual epilogues' (gemv.cu's and moe.cu's blocks), for the same bits.
const _: () = assert!(BLOCK_THREADS as usize == GEMV_WARPS * 32 && BLOCK_THREADS as usize == MOE_WARPS * 32);

/// Threads of a block that takes a row of `cols` values: a warp per 32, at most 1024.
fn row_threads(cols: usize) -> u32 {
    (cols.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Checks that the operands of an elementwise op `op` have one shape.
fn same_shape(op: &str, x: &CudaTensor, y: &CudaTensor) -> Result<()> {
    if (x.rows, x.cols) != (y.rows, y.cols) {
        return Err(Error::Shape(format!(
            "{op}: [{}, {}] and [{}, {}]",
            x.rows, x.cols, y.rows, y.cols
        )));
    }
    Ok(())
}

pub(super) fn embed(cuda: &CudaBackend, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
    let ids_dev = cuda.copy_to_device(ids)?;
    embed_from(cuda, table, ptr(&ids_dev), ids.len())
}

/// [`embed`] of `rows` ids already on the device.
pub(super) fn embed_from(cuda: &CudaBackend, table: &CudaWeight, ids: Ptr<u32>, rows: usize) -> Result<CudaTensor> {
    let table = table.matrix()?;
    let out = cuda.tensor(rows, table.cols)?;
    let embed = EmbedBf16 {
        table: table.data,
        ids,
        out: ptr(&out.data),
        hidden: table.cols as i32,
    };
    embed.launch(cuda, per_row(rows, BLOCK_THREADS))?;
    Ok(out)
}

pub(super) fn rms_norm(
    cuda: &CudaBackend,
    x: &CudaTensor,
    weight: &CudaWeight,
    group: usize,
    eps: f32,
) -> Result<CudaTensor> {
    let out = cuda.tensor(x.rows, x.cols)?;
    let norm = RmsNorm {
        x: ptr(&x.data),
        weight: weight.vector()?,
        out: ptr(&out.data),
        group: group as i32,
        eps,
    };
    norm.launch(cuda, per_row(x.rows * x.cols / group, row_threads(group)))?;
    Ok(out)
}

pub(super) fn add_assign(cuda: &CudaBackend, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
    same_shape("add_assign", x, y)?;
    let n = x.rows * x.cols;
    let add = AddAssign {
        x: ptr(&x.data),
        y: ptr(&y.data),
        n,
    };
    add.launch(cuda, grid_1d(n, BLOCK_THREADS))
}

pub(super) fn add_rms_norm(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    y: &CudaTensor,
    weight: &CudaWeight,
    eps: f32,
) -> Result<CudaTensor> {
    same_shape("add_rms_norm", x, y)?;
    let out = cuda.tensor(x.rows, x.cols)?;
    let norm = AddRmsNorm {
        x: ptr(&x.data),
        y: ptr(&y.data),
        weight: weight.vector()?,
        out: ptr(&out.data),
        cols: x.cols as i32,
        eps,
    };
    // BLOCK_THREADS (256) per row: the block size of the fused residual epilogues (gemv.cu, moe.cu), whose norm
    // then sums in this kernel's order, so that fused and unfused give the same bits.
    norm.launch(cuda, per_row(x.rows, BLOCK_THREADS))?;
    Ok(out)
}

pub(super) fn silu_mul(cuda: &CudaBackend, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
    same_shape("silu_mul", gate, up)?;
    let out = cuda.tensor(gate.rows, gate.cols)?;
    let n = gate.rows * gate.cols;
    let silu_mul = SiluMul {
        gate: ptr(&gate.data),
        up: ptr(&up.data),
        out: ptr(&out.data),
        n,
    };
    silu_mul.launch(cuda, grid_1d(n, BLOCK_THREADS))?;
    Ok(out)
}

/// [`crate::backend::Backend::sigmoid_gate`]: per element when `gate` has x's columns, else per row.
pub(super) fn sigmoid_gate(cuda: &CudaBackend, x: &mut CudaTensor, gate: &CudaTensor) -> Result<()> {
    if gate.rows != x.rows || (gate.cols != x.cols && gate.cols != 1) {
        return Err(Error::Shape(format!(
            "sigmoid_gate: a [{}, {}] gate for [{}, {}]",
            gate.rows, gate.cols, x.rows, x.cols
        )));
    }
    if gate.cols == x.cols {
        let n = x.rows * x.cols;
        let sigmoid_gate = SigmoidGateElementwise {
            x: ptr(&x.data),
            gate: ptr(&gate.data),
            n,
        };
        return sigmoid_gate.launch(cuda, grid_1d(n, BLOCK_THREADS));
    }
    let sigmoid_gate = SigmoidGateRows {
        x: ptr(&x.data),
        gate: ptr(&gate.data),
        cols: x.cols as i32,
    };
    sigmoid_gate.launch(cuda, per_row(x.rows, BLOCK_THREADS))
}

/// [`crate::backend::Backend::argmax_rows`]: one block of 1024 threads per row; only the ids come to the host.
pub(super) fn argmax_rows(cuda: &CudaBackend, x: &CudaTensor, cols: usize) -> Result<Vec<u32>> {
    check_argmax_cols(cols, x.cols)?;
    if x.rows == 0 {
        return Ok(Vec::new());
    }
    let out: CudaSlice<u32> = cuda.alloc(x.rows)?;
    let argmax = ArgmaxRows {
        x: ptr(&x.data),
        cols: cols as i32,
        stride: x.cols as i32,
        out: ptr(&out),
    };
    argmax.launch(cuda, per_row(x.rows, 1024))?;
    cuda.stream.clone_dtoh(&out).map_err(cuda_err("copy argmax to host"))
}

pub(super) fn select_rows(cuda: &CudaBackend, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
    let rows32: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let rows_dev = cuda.copy_to_device(&rows32)?;
    let out = cuda.tensor(rows.len(), x.cols)?;
    copy_rows(cuda, "select_rows", x, &rows_dev, rows.len(), &out)?;
    Ok(out)
}

/// Runs row copy `kernel` (see [`RowCopy`]) over the `count` indices of `rows`.
pub(super) fn copy_rows(
    cuda: &CudaBackend,
    kernel: &str,
    x: &CudaTensor,
    rows: &CudaSlice<u32>,
    count: usize,
    out: &CudaTensor,
) -> Result<()> {
    let copy = RowCopy {
        x: ptr(&x.data),
        rows: ptr(rows),
        out: ptr(&out.data),
        cols: x.cols as i32,
    };
    copy.launch_kernel(cuda, kernel, per_row(count, BLOCK_THREADS))
}
