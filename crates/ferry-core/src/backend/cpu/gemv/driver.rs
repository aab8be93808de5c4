//! Runs one path's block kernels over a whole matrix: checks the shapes, lays out the activations in the kernels'
//! format, splits the rows over rayon tasks and walks each task's rows and tokens in kernel-sized blocks, token
//! tile by token tile; for FP8 weights, block of columns by block of columns, each block's products times its
//! scale. Not for the arithmetic itself: that is the kernels' (one file per path).

use rayon::prelude::*;

use super::bf16_split::prepare_bf16_split;
use super::{available, kernels, Block, BlockScales, Isa, Kernels, WeightDType, WeightEncoding, XFormat, MAX_R, MAX_T};

/// Rows per rayon task are chosen so that a task reads at least this many weight bytes.
const MIN_TASK_BYTES: usize = 64 << 10;
/// Rayon tasks per thread (load balance).
const TASKS_PER_THREAD: usize = 8;
/// Activations of one token tile (re-read once per row block) are kept under this size, so they stay in L2.
const X_TILE_BYTES: usize = 256 << 10;

/// [`super::matmul`] on path `isa`, on rayon's threads when `parallel` (else the calling thread). Same panics,
/// and `isa` must be available.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    encoding: WeightEncoding,
    n_rows: usize,
    out: &mut [f32],
    parallel: bool,
) {
    let dtype = encoding.dtype;
    let row_bytes = k
        .checked_mul(dtype.size_bytes())
        .expect("gemv: k * dtype size overflows usize");
    let x_len = m.checked_mul(k).expect("gemv: m_tokens * k overflows usize");
    let w_len = n_rows
        .checked_mul(row_bytes)
        .expect("gemv: n_rows * k * dtype size overflows usize");
    let out_len = m.checked_mul(n_rows).expect("gemv: m_tokens * n_rows overflows usize");
    assert_eq!(
        x.len(),
        x_len,
        "gemv: x has {} values, expected m_tokens ({m}) * k ({k})",
        x.len()
    );
    assert_eq!(
        w.len(),
        w_len,
        "gemv: w has {} bytes, expected n_rows ({n_rows}) * k ({k}) * {dtype:?} size",
        w.len()
    );
    assert_eq!(
        out.len(),
        out_len,
        "gemv: out has {} values, expected m_tokens ({m}) * n_rows ({n_rows})",
        out.len()
    );
    assert!(available(isa), "gemv: {isa:?} kernels are not supported by this CPU");
    let scales = encoding.scales.map(|s| {
        assert!(s.block_rows > 0 && s.block_cols > 0, "gemv: empty FP8 scale blocks");
        let grid = n_rows.div_ceil(s.block_rows) * k.div_ceil(s.block_cols);
        assert_eq!(
            s.bytes.len(),
            4 * grid,
            "gemv: {} scale bytes, expected {grid} f32",
            s.bytes.len()
        );
        Scaled {
            scales: s,
            per_row: k.div_ceil(s.block_cols),
            first_row: 0,
        }
    });
    assert_eq!(
        scales.is_some(),
        dtype == WeightDType::F8E4M3,
        "gemv: {dtype:?} weights with scales {:?}",
        encoding.scales
    );
    if out.is_empty() {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }

    let kern = kernels(isa, dtype);
    let split;
    let (xb, x_stride): (&[u8], usize) = match kern.x_format {
        // SAFETY: any initialized memory is a valid `[u8]`; same pointer, same byte length, shorter lifetime.
        XFormat::F32 => (
            unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), x.len() * 4) },
            k * 4,
        ),
        XFormat::Bf16Split => {
            split = prepare_bf16_split(x, m, k);
            // SAFETY: as above, for the `u16` buffer.
            let b = unsafe { std::slice::from_raw_parts(split.as_ptr().cast::<u8>(), split.len() * 2) };
            (b, k.div_ceil(32) * 128)
        }
    };

    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    let r = kern.rows;
    let min_rows = MIN_TASK_BYTES.div_ceil(row_bytes).next_multiple_of(r);
    let rows_per_task = n_rows
        .div_ceil(threads * TASKS_PER_THREAD)
        .next_multiple_of(r)
        .max(min_rows);
    if threads <= 1 || rows_per_task >= n_rows {
        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(n_rows).collect();
        drive(kern, xb, x_stride, k, w, row_bytes, scales, &mut outs);
        return;
    }
    // Task b computes rows [b * rows_per_task, ..) for every token: collect its slice of each token's output row.
    let n_tasks = n_rows.div_ceil(rows_per_task);
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..n_tasks).map(|_| Vec::with_capacity(m)).collect();
    for token_out in out.chunks_exact_mut(n_rows) {
        for (task, part) in tasks.iter_mut().zip(token_out.chunks_mut(rows_per_task)) {
            task.push(part);
        }
    }
    tasks
        .into_par_iter()
        .zip(w.par_chunks(rows_per_task * row_bytes))
        .enumerate()
        .for_each(|(task, (mut outs, w_part))| {
            let scales = scales.map(|s| Scaled {
                first_row: task * rows_per_task,
                ..s
            });
            drive(kern, xb, x_stride, k, w_part, row_bytes, scales, &mut outs);
        });
}

/// An FP8 matrix's scales as one call of [`drive`] reads them: its rows start at weight row `first_row`.
#[derive(Clone, Copy)]
struct Scaled<'a> {
    scales: BlockScales<'a>,
    /// Column blocks per row of the scale grid.
    per_row: usize,
    first_row: usize,
}

/// Computes `outs[t][r]` for all tokens `t` and rows `r` of `w` (`outs[t].len()` rows, `row_bytes` each), `x`
/// holding `outs.len()` tokens in `kern.x_format`, `x_stride` bytes apart; FP8 rows times their `scales`.
#[allow(clippy::too_many_arguments)]
fn drive(
    kern: &Kernels,
    x: &[u8],
    x_stride: usize,
    k: usize,
    w: &[u8],
    row_bytes: usize,
    scales: Option<Scaled>,
    outs: &mut [&mut [f32]],
) {
    let m = outs.len();
    let rows = outs.first().map_or(0, |o| o.len());
    assert!(rows * row_bytes <= w.len() && m * x_stride <= x.len() && outs.iter().all(|o| o.len() == rows));

    // Token tiles: all row blocks run over one tile before the next, so a tile's activations stay in L2 while the
    // weights stream through (with few tokens there is a single tile and the weights are read exactly once).
    let tile_max = (X_TILE_BYTES / x_stride).max(1).next_multiple_of(kern.tokens);
    let n_tiles = m.div_ceil(tile_max);
    let tile = m.div_ceil(n_tiles).next_multiple_of(kern.tokens);

    let mut res: Block = [[0.0; MAX_T]; MAX_R];
    let mut t0 = 0;
    while t0 < m {
        let t_end = (t0 + tile).min(m);
        let mut r = 0;
        while r < rows {
            let (nr, fns) = if rows - r >= kern.rows {
                (kern.rows, &kern.multi)
            } else {
                (1, &kern.single)
            };
            let wp = w[r * row_bytes..].as_ptr();
            let mut t = t0;
            while t < t_end {
                let nt = (t_end - t).min(kern.tokens);
                let xp = x[t * x_stride..].as_ptr();
                match scales {
                    // SAFETY: `kernels` only hands out tables of the path `run` checked to be available; rows
                    // r..r + nr of `row_bytes >= k * size` bytes lie in `w`, tokens t..t + nt of `x_stride` bytes
                    // (each holding k values in the kernel's format) lie in `x` (asserted above), nt <= kern.tokens.
                    None => unsafe { fns[nt - 1](wp, row_bytes, xp, x_stride, k, &mut res) },
                    Some(s) => scaled_blocks(kern, fns[nt - 1], wp, row_bytes, xp, x_stride, k, s, r, nr, &mut res),
                }
                for (i, row) in res.iter().enumerate().take(nr) {
                    for (j, &v) in row.iter().enumerate().take(nt) {
                        outs[t + j][r + i] = v;
                    }
                }
                t += nt;
            }
            r += nr;
        }
        t0 = t_end;
    }
}

/// `res[i][j]` = the dot product of row `r + i` (of `nr`) and token `j` as the sum over column blocks of the
/// kernel's product over the block times the block's scale. `kernel` reads 1-byte weights and f32 activations.
#[allow(clippy::too_many_arguments)]
fn scaled_blocks(
    kern: &Kernels,
    kernel: super::BlockFn,
    wp: *const u8,
    row_bytes: usize,
    xp: *const u8,
    x_stride: usize,
    k: usize,
    s: Scaled,
    r: usize,
    nr: usize,
    res: &mut Block,
) {
    assert_eq!(kern.x_format, XFormat::F32, "FP8 kernels read f32 activations");
    let mut sum: Block = [[0.0; MAX_T]; MAX_R];
    let mut block = [[0.0; MAX_T]; MAX_R];
    let bc = s.scales.block_cols;
    for (b, c0) in (0..k).step_by(bc).enumerate() {
        // SAFETY: as for the unscaled call: columns c0..c0 + len of the same rows (one byte each) and of the same
        // tokens (four bytes each) lie inside what `drive` checked.
        unsafe {
            kernel(
                wp.add(c0),
                row_bytes,
                xp.add(4 * c0),
                x_stride,
                bc.min(k - c0),
                &mut block,
            )
        };
        for (i, (sum_r, block_r)) in sum.iter_mut().zip(&block).enumerate().take(nr) {
            let scale = s.scales.get(s.first_row + r + i, b, s.per_row);
            for (o, v) in sum_r.iter_mut().zip(block_r) {
                *o += v * scale;
            }
        }
    }
    *res = sum;
}
