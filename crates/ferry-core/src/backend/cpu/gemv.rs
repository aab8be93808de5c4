//! CPU matrix-vector kernels: `out = x · Wᵀ` for f32 activations and F32 / F16 / BF16 weights.
//!
//! Every linear layer of the CPU backend goes through [`matmul`], and the CPU lane (expert misses computed straight
//! from host RAM, one rayon task per expert) goes through [`matmul_serial`]. With a handful of tokens a linear layer
//! is bound by memory bandwidth, so the kernels are built around one rule: **each weight byte is read from memory
//! once per call**, whatever the number of tokens. The SIMD kernels load four rows at a time in vector-sized
//! chunks and use every chunk for a group of up to four tokens (two with AVX2) before moving on; further token
//! groups re-read the same rows from L1/L2. Many tokens are processed in tiles whose activations fit in L2.
//!
//! # Kernels
//!
//! Chosen once per process by runtime feature detection (see [`kernel_name`]):
//!
//! | path          | needs                      | F32   | F16              | BF16                                   |
//! |---------------|----------------------------|-------|------------------|----------------------------------------|
//! | `avx512`      | avx512f/bw/vl              | FMA   | `vcvtph2ps`, FMA | zero-extend, `<< 16`, FMA              |
//! | `avx512bf16`  | the above + avx512bf16     | FMA   | `vcvtph2ps`, FMA | `vdpbf16ps` on x split in bf16 hi + lo |
//! | `avx2`        | avx2 + fma + f16c          | FMA   | `vcvtph2ps`, FMA | zero-extend, `<< 16`, FMA              |
//! | `scalar`      | nothing (any architecture) | 8 partial sums per dot product, f32                       |
//!
//! The automatic choice is the first available of `avx512`, `avx2`, `scalar`: the `vdpbf16ps` kernel is built and
//! tested but slower and less exact on the CPU measured (see [`AUTO_USES_DPBF16`]). The environment variable
//! `FERRY_GEMV_ISA` (`scalar`, `avx2`, `avx512`, `avx512bf16`) picks a path instead, or the best available one
//! below it; it is read once.
//!
//! # Accuracy
//!
//! Weight conversions are exact (f16 and bf16 values are f32 values), so all paths but `vdpbf16ps` compute the
//! dot product in f32 and differ only in the order of the additions. `vdpbf16ps` multiplies bf16 by bf16, so each
//! activation is split once per call as `hi = bf16(x)` and `lo = bf16(x - hi)` (round to nearest even; products of
//! bf16 values are exact in f32): `hi + lo` is `x` to a relative 2^-16, which keeps the result at f32 level rather
//! than bf16 level. Measured in the tests (uniform(-1, 1) data, the exact dot product of the given x and stored
//! weights in f64):
//!
//! | path             | max \|error\| / Σ\|x·w\| (k ≤ 2051) | k = 2048: \|error\| / \|exact\|, median, p90 |
//! |------------------|-----------------------------------|-------------------------------------------|
//! | f32-exact paths  | 7.5e-8                            | 2-3e-7, 1.2-2.0e-6                        |
//! | `vdpbf16ps`      | 5.5e-6                            | 2.3e-6, 1.3e-5                            |
//!
//! The tests hold every path to a rigorous bound (see `error_bound`): `n·2^-24` with `n` about `k / lanes`, plus
//! 2^-16 for `vdpbf16ps`.
//!
//! Non-finite values propagate as in an f32 dot product: a NaN in `x` or `W` gives NaN in the outputs it enters,
//! ±Inf in `x` times a non-zero weight gives ±Inf. The `vdpbf16ps` path treats bf16 subnormal weights
//! (|w| < 1.2e-38) as zero, as the instruction does.
//!
//! The AVX-512 intrinsics and target features used here are stable since Rust 1.89, the workspace's minimum.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Stored dtype of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
}

impl WeightDType {
    /// Bytes per stored element.
    pub const fn size_bytes(self) -> usize {
        match self {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::BF16 => 2,
        }
    }
}

/// `out[m*n_rows + r] = sum_k x[m*k + kk] * W[r, kk]` for every token `m` in `0..m_tokens`, `r` in `0..n_rows`.
///
/// `w` is the raw little-endian bytes of a row-major `[n_rows, k]` matrix in `dtype`; it may point into a
/// memory-mapped file and need not be aligned. `x` is f32 `[m_tokens, k]`; `out` is f32 `[m_tokens, n_rows]` and
/// is overwritten. Multithreaded with rayon over blocks of rows (run serially when the matrix is small); each weight
/// row is read from memory once for all tokens.
///
/// # Panics
/// If `x.len() != m_tokens * k`, `w.len() != n_rows * k * dtype.size_bytes()` or `out.len() != m_tokens * n_rows`
/// (callers validate shapes, so these are programmer errors). `k == 0` is allowed and gives zeros.
pub fn matmul(x: &[f32], m_tokens: usize, k: usize, w: &[u8], dtype: WeightDType, n_rows: usize, out: &mut [f32]) {
    run(selected_isa(), x, m_tokens, k, w, dtype, n_rows, out, true);
}

/// Same as [`matmul`], on the calling thread only: for callers already inside a rayon task (e.g. one task per
/// expert). Same panics.
pub fn matmul_serial(
    x: &[f32],
    m_tokens: usize,
    k: usize,
    w: &[u8],
    dtype: WeightDType,
    n_rows: usize,
    out: &mut [f32],
) {
    run(selected_isa(), x, m_tokens, k, w, dtype, n_rows, out, false);
}

/// Name of the kernel [`matmul`] uses for `dtype` on this machine, e.g. `"avx512 bf16 (shift)"`.
pub fn kernel_name(dtype: WeightDType) -> &'static str {
    kernels(selected_isa(), dtype).name
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch.

/// Instruction-set paths, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Avx512Bf16,
}

impl Isa {
    const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    fn from_name(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "avx512bf16" => Some(Isa::Avx512Bf16),
            _ => None,
        }
    }
}

/// Whether this CPU can run `isa`.
fn available(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Scalar => true,
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            Isa::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            Isa::Avx512Bf16 => available(Isa::Avx512) && is_x86_feature_detected!("avx512bf16"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        isa == Isa::Scalar
    }
}

/// Whether the automatic choice uses the `vdpbf16ps` kernel for BF16 weights on CPUs with AVX512_BF16.
///
/// Off: on the machine this was developed on (Xeon with AVX512_BF16, 2 vCPUs), `vdpbf16ps` sustains a quarter of
/// the throughput of a 512-bit FMA (1.6 against 6.4 instructions per ns, 12 independent chains). The hi/lo split
/// costs two `vdpbf16ps` per 32 weights and token, the same instruction count as two FMAs, so that kernel is
/// compute-bound from m = 2: hot cache, one core, it does 48 GB/s at m = 1 and 12.5 GB/s at m = 4 against 50-58
/// and 20-29 GB/s for the zero-extend + shift + FMA kernel; streaming experts from RAM on 2 cores (m = 4, one
/// expert per task) 17 against 20.5 GB/s of 25. It is also exact to f32 rather than to 2^-16.
/// `FERRY_GEMV_ISA=avx512bf16` selects the `vdpbf16ps` kernel.
const AUTO_USES_DPBF16: bool = false;

/// The path in use, detected once: `FERRY_GEMV_ISA` if set (or the best available path below it), else the best
/// available path (`avx512bf16` only if [`AUTO_USES_DPBF16`]).
fn selected_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let auto = if AUTO_USES_DPBF16 { Isa::Avx512Bf16 } else { Isa::Avx512 };
        let cap = std::env::var("FERRY_GEMV_ISA")
            .ok()
            .and_then(|s| Isa::from_name(&s))
            .unwrap_or(auto);
        Isa::ALL
            .into_iter()
            .filter(|&i| i <= cap && available(i))
            .max()
            .unwrap_or(Isa::Scalar)
    })
}

/// Most rows / tokens one block kernel call handles.
const MAX_R: usize = 4;
const MAX_T: usize = 4;

/// Results of one block kernel call: `[row][token]`.
type Block = [[f32; MAX_T]; MAX_R];

/// A block kernel: dot products of `R` consecutive weight rows with `T` tokens over the full `k`.
///
/// Arguments: `(w, w_stride, x, x_stride, k, res)`: `w` points at the first row, rows are `w_stride` bytes apart;
/// `x` points at the first token (in the kernel's [`XFormat`]), tokens are `x_stride` bytes apart; `res[r][t]`
/// receives the dot product of row `r` and token `t`.
///
/// # Safety
/// The CPU supports the kernel's target features; `R` rows of `k` elements are readable at `w`, `T` tokens at `x`
/// (for [`XFormat::Bf16Split`]: `k.div_ceil(32)` blocks each), and `T` is at most the table's `tokens`.
type BlockFn = unsafe fn(*const u8, usize, *const u8, usize, usize, &mut Block);

/// How the activations are handed to a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum XFormat {
    /// `x` as given: f32 `[m, k]`, stride `4k` bytes.
    F32,
    /// Per token, `k.div_ceil(32)` blocks of `[hi: 32 × bf16][lo: 32 × bf16]` (zero padded), stride `128 ·
    /// k.div_ceil(32)` bytes; see [`split_bf16`].
    Bf16Split,
}

/// The block kernels of one (path, dtype).
struct Kernels {
    name: &'static str,
    x_format: XFormat,
    /// Rows per call of `multi` (`single` does one row, for the remainder).
    rows: usize,
    /// Most tokens per call.
    tokens: usize,
    /// `multi[t - 1]` handles `rows` rows and `t` tokens.
    multi: [BlockFn; MAX_T],
    /// `single[t - 1]` handles one row and `t` tokens.
    single: [BlockFn; MAX_T],
}

macro_rules! kernel_table {
    ($name:expr, $fmt:expr, $($f:ident)::+, rows = $r:literal, tokens = $t:literal) => {
        Kernels {
            name: $name,
            x_format: $fmt,
            rows: $r,
            tokens: $t,
            multi: [$($f)::+::<$r, 1>, $($f)::+::<$r, 2>, $($f)::+::<$r, 3>, $($f)::+::<$r, 4>],
            single: [$($f)::+::<1, 1>, $($f)::+::<1, 2>, $($f)::+::<1, 3>, $($f)::+::<1, 4>],
        }
    };
}

static SCALAR_F32: Kernels = kernel_table!("scalar f32", XFormat::F32, scalar::block_f32, rows = 1, tokens = 4);
static SCALAR_F16: Kernels = kernel_table!("scalar f16", XFormat::F32, scalar::block_f16, rows = 1, tokens = 4);
static SCALAR_BF16: Kernels = kernel_table!("scalar bf16", XFormat::F32, scalar::block_bf16, rows = 1, tokens = 4);

#[cfg(target_arch = "x86_64")]
mod tables {
    use super::{x86, Kernels, XFormat};

    pub(super) static AVX2_F32: Kernels = kernel_table!("avx2 f32", XFormat::F32, x86::avx2_f32, rows = 4, tokens = 2);
    pub(super) static AVX2_F16: Kernels = kernel_table!(
        "avx2 f16 (vcvtph2ps)",
        XFormat::F32,
        x86::avx2_f16,
        rows = 4,
        tokens = 2
    );
    pub(super) static AVX2_BF16: Kernels =
        kernel_table!("avx2 bf16 (shift)", XFormat::F32, x86::avx2_bf16, rows = 4, tokens = 2);
    pub(super) static AVX512_F32: Kernels =
        kernel_table!("avx512 f32", XFormat::F32, x86::avx512_f32, rows = 4, tokens = 4);
    pub(super) static AVX512_F16: Kernels = kernel_table!(
        "avx512 f16 (vcvtph2ps)",
        XFormat::F32,
        x86::avx512_f16,
        rows = 4,
        tokens = 4
    );
    pub(super) static AVX512_BF16: Kernels = kernel_table!(
        "avx512 bf16 (shift)",
        XFormat::F32,
        x86::avx512_bf16,
        rows = 4,
        tokens = 4
    );
    pub(super) static AVX512_BF16_DP: Kernels = kernel_table!(
        "avx512bf16 bf16 (vdpbf16ps, hi+lo)",
        XFormat::Bf16Split,
        x86::avx512_bf16_dp,
        rows = 4,
        tokens = 4
    );
}

fn kernels(isa: Isa, dtype: WeightDType) -> &'static Kernels {
    use WeightDType::*;
    #[cfg(target_arch = "x86_64")]
    {
        use tables::*;
        match (isa, dtype) {
            (Isa::Scalar, _) => {}
            (Isa::Avx2, F32) => return &AVX2_F32,
            (Isa::Avx2, F16) => return &AVX2_F16,
            (Isa::Avx2, BF16) => return &AVX2_BF16,
            (Isa::Avx512 | Isa::Avx512Bf16, F32) => return &AVX512_F32,
            (Isa::Avx512 | Isa::Avx512Bf16, F16) => return &AVX512_F16,
            (Isa::Avx512, BF16) => return &AVX512_BF16,
            (Isa::Avx512Bf16, BF16) => return &AVX512_BF16_DP,
        }
    }
    let _ = isa;
    match dtype {
        F32 => &SCALAR_F32,
        F16 => &SCALAR_F16,
        BF16 => &SCALAR_BF16,
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Driver.

/// Rows per rayon task are chosen so that a task reads at least this many weight bytes.
const MIN_TASK_BYTES: usize = 64 << 10;
/// Rayon tasks per thread (load balance).
const TASKS_PER_THREAD: usize = 8;
/// Activations of one token tile (re-read once per row block) are kept under this size, so they stay in L2.
const X_TILE_BYTES: usize = 256 << 10;

#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    dtype: WeightDType,
    n_rows: usize,
    out: &mut [f32],
    parallel: bool,
) {
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
        drive(kern, xb, x_stride, k, w, row_bytes, &mut outs);
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
        .for_each(|(mut outs, w_part)| {
            drive(kern, xb, x_stride, k, w_part, row_bytes, &mut outs);
        });
}

/// Computes `outs[t][r]` for all tokens `t` and rows `r` of `w` (`outs[t].len()` rows, `row_bytes` each), `x`
/// holding `outs.len()` tokens in `kern.x_format`, `x_stride` bytes apart.
fn drive(kern: &Kernels, x: &[u8], x_stride: usize, k: usize, w: &[u8], row_bytes: usize, outs: &mut [&mut [f32]]) {
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
                // SAFETY: `kernels` only hands out tables of the path `run` checked to be available; rows
                // r..r + nr of `row_bytes >= k * size` bytes lie in `w`, tokens t..t + nt of `x_stride` bytes
                // (each holding k values in the kernel's format) lie in `x` (asserted above), nt <= kern.tokens.
                unsafe { fns[nt - 1](wp, row_bytes, x[t * x_stride..].as_ptr(), x_stride, k, &mut res) };
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

/// Splits every activation into bf16 `hi` and `lo` (see [`split_bf16`]) in the [`XFormat::Bf16Split`] layout.
fn prepare_bf16_split(x: &[f32], m: usize, k: usize) -> Vec<u16> {
    let per_token = k.div_ceil(32) * 64;
    let mut buf = vec![0u16; m * per_token];
    let body = |buf: &mut [u16]| {
        for (xt, bt) in x.chunks_exact(k).zip(buf.chunks_exact_mut(per_token)) {
            for (xc, bc) in xt.chunks(32).zip(bt.chunks_exact_mut(64)) {
                let (hi, lo) = bc.split_at_mut(32);
                for ((&v, h), l) in xc.iter().zip(hi).zip(lo) {
                    (*h, *l) = split_bf16(v);
                }
            }
        }
    };
    #[cfg(target_arch = "x86_64")]
    {
        /// The same loop compiled for AVX-512 (where LLVM vectorizes the branch-free [`split_bf16`]).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn vectorized(body: impl FnOnce(&mut [u16]), buf: &mut [u16]) {
            body(buf)
        }
        if available(Isa::Avx512) {
            // SAFETY: the CPU supports the target features (checked just above).
            unsafe { vectorized(body, &mut buf) };
            return buf;
        }
    }
    body(&mut buf);
    buf
}

/// `(hi, lo)` bf16 bits with `hi + lo ≈ v` to a relative 2^-16 (|v - hi - lo| ≤ 2^-16 |v|): `hi` is `v` rounded
/// to nearest even (truncated instead if rounding would overflow to infinity), `lo` is the exact remainder
/// `v - hi` rounded to nearest even. Non-finite `v`: `hi` is `v` (a NaN stays NaN), `lo` is 0. Branch-free so that
/// it vectorizes.
#[inline(always)]
fn split_bf16(v: f32) -> (u16, u16) {
    /// Round to nearest even on the 16 dropped bits (meaningful for finite inputs).
    #[inline(always)]
    fn round(bits: u32) -> u32 {
        bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16
    }
    let bits = v.to_bits();
    let finite = bits & 0x7f80_0000 != 0x7f80_0000;
    let rounded = round(bits);
    let hi_finite = if rounded & 0x7f80 == 0x7f80 {
        bits >> 16
    } else {
        rounded
    };
    // ±Inf keeps its bits; a NaN is quieted so that dropping the low mantissa bits cannot turn it into Inf.
    let hi_non_finite = if bits & 0x007f_ffff != 0 {
        bits | 0x0040_0000
    } else {
        bits
    } >> 16;
    let hi = if finite { hi_finite } else { hi_non_finite };
    // Exact: the bits of v below hi's precision.
    let lo = if finite { v - f32::from_bits(hi << 16) } else { 0.0 };
    (hi as u16, round(lo.to_bits()) as u16)
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar kernels (any architecture; 8 independent partial sums per dot product).

mod scalar {
    use super::Block;

    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;
    const LANES: usize = 8;

    /// Element `i` of the row at `p`, as f32.
    ///
    /// # Safety
    /// `p` points at a row of at least `i + 1` elements of dtype `D`.
    #[inline(always)]
    unsafe fn load<const D: u8>(p: *const u8, i: usize) -> f32 {
        match D {
            F32 => f32::from_le_bytes(p.add(4 * i).cast::<[u8; 4]>().read()),
            F16 => half::f16::from_bits(u16::from_le_bytes(p.add(2 * i).cast::<[u8; 2]>().read())).to_f32(),
            _ => f32::from_bits(u32::from(u16::from_le_bytes(p.add(2 * i).cast::<[u8; 2]>().read())) << 16),
        }
    }

    /// # Safety
    /// See [`super::BlockFn`]; `x` holds f32 values aligned to 4 bytes.
    #[inline(always)]
    unsafe fn block<const D: u8, const R: usize, const T: usize>(
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        k: usize,
        res: &mut Block,
    ) {
        let mut acc = [[[0f32; LANES]; T]; R];
        let xt: [&[f32]; T] = std::array::from_fn(|t| std::slice::from_raw_parts(x.add(t * xs).cast::<f32>(), k));
        let mut i = 0;
        // Full groups of LANES elements (fixed trip counts, so that the compiler can vectorize), then the tail.
        while i + LANES <= k {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let wr = w.add(r * ws);
                let wv: [f32; LANES] = std::array::from_fn(|l| load::<D>(wr, i + l));
                for (acc_rt, xv) in acc_r.iter_mut().zip(&xt) {
                    let xv: &[f32; LANES] = xv[i..i + LANES].try_into().unwrap();
                    for l in 0..LANES {
                        acc_rt[l] += xv[l] * wv[l];
                    }
                }
            }
            i += LANES;
        }
        for (l, j) in (i..k).enumerate() {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let wv = load::<D>(w.add(r * ws), j);
                for (acc_rt, xv) in acc_r.iter_mut().zip(&xt) {
                    acc_rt[l] += xv[j] * wv;
                }
            }
        }
        for (res_r, acc_r) in res.iter_mut().zip(&acc) {
            for (o, a) in res_r.iter_mut().zip(acc_r) {
                *o = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            }
        }
    }

    /// # Safety
    /// See [`super::BlockFn`].
    pub(super) unsafe fn block_f32<const R: usize, const T: usize>(
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        k: usize,
        res: &mut Block,
    ) {
        block::<F32, R, T>(w, ws, x, xs, k, res)
    }

    /// # Safety
    /// See [`super::BlockFn`].
    pub(super) unsafe fn block_f16<const R: usize, const T: usize>(
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        k: usize,
        res: &mut Block,
    ) {
        block::<F16, R, T>(w, ws, x, xs, k, res)
    }

    /// # Safety
    /// See [`super::BlockFn`].
    pub(super) unsafe fn block_bf16<const R: usize, const T: usize>(
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        k: usize,
        res: &mut Block,
    ) {
        block::<BF16, R, T>(w, ws, x, xs, k, res)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// x86-64 kernels.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Block;
    use std::arch::x86_64::*;

    /// Software prefetch distance along each weight row. With the hardware prefetchers alone the kernels streamed
    /// experts from RAM at ~86% of the measured read bandwidth (one expert per core, m = 1 and 4); prefetching 512
    /// bytes ahead gained 7-12% (1024 about as much, 2048 less).
    const PREFETCH: usize = 512;

    /// Prefetches the cache line `PREFETCH` bytes past byte `off` of each of the `R` rows at `w`, `ws` bytes apart.
    /// Called once per 64 bytes of row. Addresses past the matrix are harmless: prefetches never fault.
    #[inline(always)]
    fn prefetch_rows<const R: usize>(w: *const u8, ws: usize, off: usize) {
        for r in 0..R {
            // SAFETY: a prefetch is only a hint; it does not dereference the pointer and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(r * ws + off + PREFETCH).cast()) };
        }
    }

    // ---- AVX-512 (f32 accumulation; weights converted to f32 in registers) ----

    /// 16 weights at `p` as f32; `mask` selects the elements to load (the others read as 0 and are not touched).
    macro_rules! avx512_loaders {
        ($($name:ident($p:ident, $m:ident) => $e:expr;)*) => {$(
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            unsafe fn $name($p: *const u8, $m: __mmask16) -> __m512 {
                $e
            }
        )*};
    }
    avx512_loaders! {
        ld16_f32(p, m) => _mm512_maskz_loadu_ps(m, p.cast());
        ld16_f16(p, m) => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast()));
        ld16_bf16(p, m) => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m, p.cast()),
        )));
    }

    macro_rules! avx512_kernel {
        ($name:ident, $size:literal, $load:ident) => {
            /// # Safety
            /// See [`super::BlockFn`]; needs avx512f/bw/vl.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            pub(super) unsafe fn $name<const R: usize, const T: usize>(
                w: *const u8,
                ws: usize,
                x: *const u8,
                xs: usize,
                k: usize,
                res: &mut Block,
            ) {
                #[inline]
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn step<const R: usize, const T: usize>(
                    acc: &mut [[__m512; T]; R],
                    w: *const u8,
                    ws: usize,
                    x: *const u8,
                    xs: usize,
                    i: usize,
                    m: __mmask16,
                ) {
                    let mut wv = [_mm512_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $load(w.add(r * ws + i * $size), m);
                    }
                    for t in 0..T {
                        let xv = _mm512_maskz_loadu_ps(m, x.add(t * xs + 4 * i).cast());
                        for r in 0..R {
                            acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                        }
                    }
                }

                let mut acc = [[_mm512_setzero_ps(); T]; R];
                let mut i = 0;
                while i + 16 <= k {
                    if (i * $size) % 64 == 0 {
                        prefetch_rows::<R>(w, ws, i * $size);
                    }
                    step(&mut acc, w, ws, x, xs, i, !0);
                    i += 16;
                }
                if i < k {
                    step(&mut acc, w, ws, x, xs, i, ((1u32 << (k - i)) - 1) as __mmask16);
                }
                for (res_r, acc_r) in res.iter_mut().zip(&acc) {
                    for (o, a) in res_r.iter_mut().zip(acc_r) {
                        *o = _mm512_reduce_add_ps(*a);
                    }
                }
            }
        };
    }
    avx512_kernel!(avx512_f32, 4, ld16_f32);
    avx512_kernel!(avx512_f16, 2, ld16_f16);
    avx512_kernel!(avx512_bf16, 2, ld16_bf16);

    // ---- AVX-512 BF16: vdpbf16ps on bf16 weights and the hi/lo split of x ----

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn ld32_bf16(p: *const u8, m: __mmask32) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(m, p.cast()))
    }

    /// # Safety
    /// See [`super::BlockFn`]; `x` is in the `Bf16Split` layout; needs avx512f/bw/vl and avx512bf16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn avx512_bf16_dp<const R: usize, const T: usize>(
        w: *const u8,
        ws: usize,
        x: *const u8,
        xs: usize,
        k: usize,
        res: &mut Block,
    ) {
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
        unsafe fn step<const R: usize, const T: usize>(
            acc: &mut [[__m512; T]; R],
            acc_lo: &mut [[__m512; T]; R],
            w: *const u8,
            ws: usize,
            x: *const u8,
            xs: usize,
            i: usize,
            m: __mmask32,
        ) {
            let mut wv = [ld32_bf16(w, 0); R];
            for (r, v) in wv.iter_mut().enumerate() {
                *v = ld32_bf16(w.add(r * ws + 2 * i), m);
            }
            for t in 0..T {
                // Block i / 32 of token t: 64 bytes of hi, then 64 bytes of lo (zero padded past k).
                let xp = x.add(t * xs + 4 * i);
                let hi = ld32_bf16(xp, !0);
                let lo = ld32_bf16(xp.add(64), !0);
                for r in 0..R {
                    if SPLIT_ACC(T) {
                        acc_lo[r][t] = _mm512_dpbf16_ps(acc_lo[r][t], lo, wv[r]);
                        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], hi, wv[r]);
                    } else {
                        acc[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][t], lo, wv[r]), hi, wv[r]);
                    }
                }
            }
        }

        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut acc_lo = [[_mm512_setzero_ps(); T]; R];
        let mut i = 0;
        while i + 32 <= k {
            prefetch_rows::<R>(w, ws, 2 * i);
            step(&mut acc, &mut acc_lo, w, ws, x, xs, i, !0);
            i += 32;
        }
        if i < k {
            step(
                &mut acc,
                &mut acc_lo,
                w,
                ws,
                x,
                xs,
                i,
                ((1u64 << (k - i)) - 1) as __mmask32,
            );
        }
        for ((res_r, acc_r), lo_r) in res.iter_mut().zip(&acc).zip(&acc_lo) {
            for ((o, a), l) in res_r.iter_mut().zip(acc_r).zip(lo_r) {
                *o = _mm512_reduce_add_ps(_mm512_add_ps(*a, *l));
            }
        }
    }

    /// Whether the dpbf16 kernel keeps the `lo` products in accumulators of their own (twice the independent
    /// dependency chains; only for few tokens, where latency rather than throughput limits).
    #[allow(non_snake_case)]
    const fn SPLIT_ACC(tokens: usize) -> bool {
        tokens <= 2
    }

    // ---- AVX2 + FMA + F16C ----

    macro_rules! avx2_loaders {
        ($($name:ident($p:ident) => $e:expr;)*) => {$(
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $name($p: *const u8) -> __m256 {
                $e
            }
        )*};
    }
    avx2_loaders! {
        ld8_f32(p) => _mm256_loadu_ps(p.cast());
        ld8_f16(p) => _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        ld8_bf16(p) => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))));
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s)))
    }

    macro_rules! avx2_kernel {
        ($name:ident, $size:literal, $load:ident) => {
            /// # Safety
            /// See [`super::BlockFn`]; needs avx2, fma and f16c.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name<const R: usize, const T: usize>(
                w: *const u8,
                ws: usize,
                x: *const u8,
                xs: usize,
                k: usize,
                res: &mut Block,
            ) {
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn step<const R: usize, const T: usize>(
                    acc: &mut [[__m256; T]; R],
                    w: *const u8,
                    ws: usize,
                    x: *const u8,
                    xs: usize,
                ) {
                    let mut wv = [_mm256_setzero_ps(); R];
                    for (r, v) in wv.iter_mut().enumerate() {
                        *v = $load(w.add(r * ws));
                    }
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(x.add(t * xs).cast());
                        for r in 0..R {
                            acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                        }
                    }
                }

                let mut acc = [[_mm256_setzero_ps(); T]; R];
                let mut i = 0;
                while i + 8 <= k {
                    if (i * $size) % 64 == 0 {
                        prefetch_rows::<R>(w, ws, i * $size);
                    }
                    step(&mut acc, w.add(i * $size), ws, x.add(4 * i), xs);
                    i += 8;
                }
                if i < k {
                    // Tail: copy the last k - i (< 8) elements of each row and token into zero-padded buffers.
                    let n = k - i;
                    let mut wb = [[0u8; 8 * $size]; R];
                    for (r, b) in wb.iter_mut().enumerate() {
                        std::ptr::copy_nonoverlapping(w.add(r * ws + i * $size), b.as_mut_ptr(), n * $size);
                    }
                    let mut xb = [[0u8; 32]; T];
                    for (t, b) in xb.iter_mut().enumerate() {
                        std::ptr::copy_nonoverlapping(x.add(t * xs + 4 * i), b.as_mut_ptr(), 4 * n);
                    }
                    step(&mut acc, wb.as_ptr().cast(), 8 * $size, xb.as_ptr().cast(), 32);
                }
                for (res_r, acc_r) in res.iter_mut().zip(&acc) {
                    for (o, a) in res_r.iter_mut().zip(acc_r) {
                        *o = hsum256(*a);
                    }
                }
            }
        };
    }
    avx2_kernel!(avx2_f32, 4, ld8_f32);
    avx2_kernel!(avx2_f16, 2, ld8_f16);
    avx2_kernel!(avx2_bf16, 2, ld8_bf16);
}

// ---------------------------------------------------------------------------------------------------------------

/// Rigorous bound on `|out - exact| / Σ_k |x_k · w_k|` for one output of `isa`'s kernel for `dtype` (exact = the
/// dot product of the given f32 activations and the stored weights, in real arithmetic). With `u = 2^-24` and
/// `n` the longest chain of f32 roundings an output goes through: `n·u·1.01`, where `n = ⌈k/L⌉ + log2 L (+1 for
/// the unfused scalar products)` with `L` = 8 (scalar, AVX2) or 16 (AVX-512) lanes; for `vdpbf16ps`,
/// `2^-16 + n·u·1.01` with `n = 4·⌈k/32⌉ + 4` (the `hi + lo` split represents x to a relative 2^-16).
#[cfg(test)]
fn error_bound(isa: Isa, dtype: WeightDType, k: usize) -> f64 {
    let u = f64::powi(2.0, -24);
    let n = match (isa, dtype) {
        (Isa::Scalar, _) => k.div_ceil(8) + 3 + 1,
        (Isa::Avx2, _) => k.div_ceil(8) + 3,
        (Isa::Avx512Bf16, WeightDType::BF16) => 4 * k.div_ceil(32) + 4,
        (Isa::Avx512 | Isa::Avx512Bf16, _) => k.div_ceil(16) + 4,
    };
    let split = if (isa, dtype) == (Isa::Avx512Bf16, WeightDType::BF16) {
        f64::powi(2.0, -16)
    } else {
        0.0
    };
    split + n as f64 * u * 1.01
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    const DTYPES: [WeightDType; 3] = [WeightDType::F32, WeightDType::F16, WeightDType::BF16];

    /// xorshift64*.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        /// Uniform in [-1, 1).
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u32 << 23) as f32 - 1.0
        }
    }

    fn isas() -> Vec<Isa> {
        let v: Vec<Isa> = Isa::ALL.into_iter().filter(|&i| available(i)).collect();
        eprintln!("available gemv paths: {v:?}");
        v
    }

    /// Stores `vals` in `dtype` after `offset` padding bytes; returns the bytes and the stored values.
    fn encode(vals: &[f32], dtype: WeightDType, offset: usize) -> (Vec<u8>, Vec<f64>) {
        let mut bytes = vec![0xa5u8; offset];
        let mut dec = Vec::with_capacity(vals.len());
        for &v in vals {
            match dtype {
                WeightDType::F32 => {
                    bytes.extend_from_slice(&v.to_le_bytes());
                    dec.push(v as f64);
                }
                WeightDType::F16 => {
                    let h = f16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    dec.push(h.to_f64());
                }
                WeightDType::BF16 => {
                    let h = bf16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    dec.push(h.to_f64());
                }
            }
        }
        (bytes, dec)
    }

    /// Exact-ish (f64) products: `(sum, sum of |terms|)` per `[m, n]` output.
    fn reference(x: &[f32], m: usize, k: usize, w: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
        let mut out = vec![0.0; m * n];
        let mut abs = vec![0.0; m * n];
        for t in 0..m {
            for r in 0..n {
                for j in 0..k {
                    let p = x[t * k + j] as f64 * w[r * k + j];
                    out[t * n + r] += p;
                    abs[t * n + r] += p.abs();
                }
            }
        }
        (out, abs)
    }

    #[allow(clippy::too_many_arguments)]
    fn call(isa: Isa, parallel: bool, x: &[f32], m: usize, k: usize, w: &[u8], d: WeightDType, n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; m * n]; // poison: every value must be overwritten
        run(isa, x, m, k, w, d, n, &mut out, parallel);
        out
    }

    #[test]
    fn all_paths_match_f64_reference() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let shapes: &[(usize, usize)] = &[
            (1, 1),
            (17, 3),
            (31, 5),
            (32, 1),
            (33, 7),
            (64, 9),
            (100, 13),
            (2051, 37),
        ];
        let mut worst = std::collections::BTreeMap::new();
        for isa in isas() {
            for dtype in DTYPES {
                for &(k, n) in shapes {
                    for m in 1..=9 {
                        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
                        let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
                        let offset = [0, 1, 2][m % 3];
                        let (wb, wd) = encode(&wv, dtype, offset);
                        let (exact, abs) = reference(&x, m, k, &wd, n);
                        let bound = error_bound(isa, dtype, k);
                        for parallel in [false, true] {
                            let out = call(isa, parallel, &x, m, k, &wb[offset..], dtype, n);
                            for (i, &o) in out.iter().enumerate() {
                                let err = (o as f64 - exact[i]).abs() / abs[i];
                                // Written so that NaN fails.
                                assert!(
                                    err <= bound,
                                    "{isa:?} {dtype:?} m={m} k={k} n={n} parallel={parallel} i={i}: out {o} exact {} \
                                     normalized error {err:e} > {bound:e}",
                                    exact[i]
                                );
                                let e = worst.entry((isa, format!("{dtype:?}"), k == 2051)).or_insert(0.0f64);
                                *e = e.max(err);
                            }
                        }
                    }
                }
            }
        }
        for ((isa, dtype, big), e) in worst {
            eprintln!(
                "{isa:?} {dtype:?} {}: max normalized error {e:.2e}",
                if big { "k=2051" } else { "k<=100" }
            );
        }
    }

    /// Plain relative error |out - exact| / |exact| on k = 2048 random dot products (statistics printed with
    /// --nocapture), with a limit on the median: 1e-6 for the f32-exact paths, 5e-6 for vdpbf16ps.
    #[test]
    fn relative_error_k2048() {
        let (m, k, n) = (4, 2048, 256);
        let mut rng = Rng(42);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        for dtype in DTYPES {
            let (wb, wd) = encode(&wv, dtype, 0);
            let (exact, _) = reference(&x, m, k, &wd, n);
            for isa in isas() {
                let out = call(isa, true, &x, m, k, &wb, dtype, n);
                let mut rel: Vec<f64> = out
                    .iter()
                    .zip(&exact)
                    .map(|(&o, &e)| (o as f64 - e).abs() / e.abs().max(1e-30))
                    .collect();
                rel.sort_by(f64::total_cmp);
                let (med, p90) = (rel[rel.len() / 2], rel[rel.len() * 9 / 10]);
                eprintln!("{isa:?} {dtype:?} k=2048: relative error median {med:.2e}, p90 {p90:.2e}");
                let limit = if (isa, dtype) == (Isa::Avx512Bf16, WeightDType::BF16) {
                    5e-6
                } else {
                    1e-6
                };
                assert!(
                    med <= limit,
                    "{isa:?} {dtype:?}: median relative error {med:e} > {limit:e}"
                );
            }
        }
    }

    #[test]
    fn many_tokens_use_tiles() {
        // m large enough for several token tiles; compare against the scalar path's own f64 reference.
        let (m, k, n) = (70, 2051, 9);
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        for dtype in DTYPES {
            let (wb, wd) = encode(&wv, dtype, 2);
            let (exact, abs) = reference(&x, m, k, &wd, n);
            for isa in isas() {
                let out = call(isa, true, &x, m, k, &wb[2..], dtype, n);
                let bound = error_bound(isa, dtype, k);
                for i in 0..m * n {
                    let err = (out[i] as f64 - exact[i]).abs() / abs[i];
                    assert!(err <= bound, "{isa:?} {dtype:?} i={i}: {err:e} > {bound:e}");
                }
            }
        }
    }

    #[test]
    fn non_finite_values_propagate() {
        let (m, k, n) = (3, 67, 5);
        let mut rng = Rng(3);
        let x0: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let w0: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        for isa in isas() {
            for dtype in DTYPES {
                // NaN in x[1, 40]: token 1 is NaN everywhere, other tokens finite.
                let mut x = x0.clone();
                x[k + 40] = f32::NAN;
                let (wb, _) = encode(&w0, dtype, 1);
                let out = call(isa, false, &x, m, k, &wb[1..], dtype, n);
                for t in 0..m {
                    for r in 0..n {
                        let v = out[t * n + r];
                        assert_eq!(v.is_nan(), t == 1, "{isa:?} {dtype:?} NaN x: out[{t},{r}] = {v}");
                    }
                }
                // NaN in W[2, 66] (the tail): row 2 is NaN for every token.
                let mut w = w0.clone();
                w[2 * k + 66] = f32::NAN;
                let (wb, _) = encode(&w, dtype, 0);
                let out = call(isa, false, &x0, m, k, &wb, dtype, n);
                for t in 0..m {
                    for r in 0..n {
                        let v = out[t * n + r];
                        assert_eq!(v.is_nan(), r == 2, "{isa:?} {dtype:?} NaN w: out[{t},{r}] = {v}");
                    }
                }
                // +Inf in x[0, 3] with W[:, 3] = 0.5: token 0 is +Inf, others finite.
                let mut x = x0.clone();
                x[3] = f32::INFINITY;
                let mut w = w0.clone();
                for r in 0..n {
                    w[r * k + 3] = 0.5;
                }
                let (wb, _) = encode(&w, dtype, 0);
                let out = call(isa, false, &x, m, k, &wb, dtype, n);
                for t in 0..m {
                    for r in 0..n {
                        let v = out[t * n + r];
                        if t == 0 {
                            assert_eq!(v, f32::INFINITY, "{isa:?} {dtype:?} Inf x: out[0,{r}]");
                        } else {
                            assert!(v.is_finite(), "{isa:?} {dtype:?} Inf x: out[{t},{r}] = {v}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn split_bf16_represents_x() {
        let check = |v: f32| {
            let (h, l) = split_bf16(v);
            let (hf, lf) = (f32::from_bits(u32::from(h) << 16), f32::from_bits(u32::from(l) << 16));
            if v.is_nan() {
                assert!(hf.is_nan(), "{v}");
            } else if v.is_infinite() {
                assert_eq!((hf, lf), (v, 0.0));
            } else {
                assert!(hf.is_finite() && lf.is_finite(), "{v}: {hf} {lf}");
                let err = (v as f64 - (hf as f64 + lf as f64)).abs();
                // 2^-16 relative, plus half a bf16 subnormal ulp (2^-134) for a subnormal `lo`.
                assert!(
                    err <= v.abs() as f64 * f64::powi(2.0, -16) + f64::powi(2.0, -134),
                    "{v:e}: {hf:e} + {lf:e}, err {err:e}"
                );
            }
        };
        let mut rng = Rng(11);
        for _ in 0..100_000 {
            check(f32::from_bits(rng.next() as u32));
            check(rng.uniform());
        }
        for v in [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            check(v);
        }
        check(f32::NAN);
        check(f32::from_bits(0x7f80_0001)); // NaN whose payload is only in the low bits
    }

    #[test]
    fn degenerate_shapes() {
        for isa in isas() {
            for dtype in DTYPES {
                let mut out = vec![f32::NAN; 6];
                run(isa, &[], 2, 0, &[], dtype, 3, &mut out, true);
                assert_eq!(out, [0.0; 6]);
                run(
                    isa,
                    &[],
                    0,
                    5,
                    &[0; 60][..3 * 5 * dtype.size_bytes()],
                    dtype,
                    3,
                    &mut [],
                    true,
                );
                run(isa, &[1.0; 10], 2, 5, &[], dtype, 0, &mut [], true);
            }
        }
    }

    #[test]
    fn public_entry_points_agree() {
        let (m, k, n) = (2, 300, 200);
        let mut rng = Rng(5);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let wv: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        for dtype in DTYPES {
            let (wb, _) = encode(&wv, dtype, 0);
            let mut a = vec![f32::NAN; m * n];
            let mut b = vec![f32::NAN; m * n];
            matmul(&x, m, k, &wb, dtype, n, &mut a);
            matmul_serial(&x, m, k, &wb, dtype, n, &mut b);
            assert_eq!(a, b, "{}", kernel_name(dtype));
        }
    }

    #[test]
    #[should_panic(expected = "w has")]
    fn short_weights_panic() {
        let mut out = vec![0.0; 2];
        matmul(&[0.0; 4], 1, 4, &[0; 15], WeightDType::BF16, 2, &mut out);
    }

    #[test]
    #[should_panic(expected = "out has")]
    fn wrong_out_panics() {
        let mut out = vec![0.0; 3];
        matmul_serial(&[0.0; 4], 1, 4, &[0; 16], WeightDType::BF16, 2, &mut out);
    }
}
