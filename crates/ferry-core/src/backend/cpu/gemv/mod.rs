//! CPU matrix-vector kernels: `out = x · Wᵀ` for f32 activations and F32 / F16 / BF16 / FP8 (E4M3) weights.
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
//! FP8 weights come with per-block scales ([`BlockScales`]): every path converts E4M3 bytes to f32 in registers
//! (`scalar` by the exact conversion; AVX2 and AVX-512 zero-extend, place the magnitude bits as an f32's and
//! multiply by 2^120, NaN bytes blended in), and the driver runs the kernel once per block of columns and adds
//! each block's dot product times its scale (f32 accumulation throughout; per channel, one block per row).
//!
//! MXFP4 weights (gpt-oss's experts) are multiplied by cpu/mxfp4.rs: with up to four tokens every path but
//! `scalar` reads them packed (`mxfp4_fused`: a nibble lookup in a block-scaled table in registers, no f32
//! copy of the rows, 7.6x the widening product's rate for one token on one core of the development machine);
//! otherwise rows are widened to f32 and go through the F32 kernels.
//!
//! The automatic choice is the first available of `avx512`, `avx2`, `scalar`: the `vdpbf16ps` kernel is built and
//! tested but slower and less exact on the CPU measured (see [`AUTO_USES_DPBF16`]). The environment variable
//! `FERRY_GEMV_ISA` (`scalar`, `avx2`, `avx512`, `avx512bf16`) picks a path instead; unset or empty, the automatic
//! choice. It is read once; a value that names no path, or a path this CPU lacks, is an error
//! ([`check_isa_env`]), not a fallback.
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
//!
//! # Layout
//!
//! This file holds the entry points, the choice of path and the contract of a block kernel ([`BlockFn`],
//! [`Kernels`]); `driver` runs a path's kernels over a matrix (shape checks, threads, tiles), `bf16_split` lays
//! out the activations for `vdpbf16ps`, and `scalar`, `avx2`, `avx512`, `avx512bf16` hold each path's kernels
//! (`prefetch` the software prefetch the x86 kernels share; `mxfp4_fused` the packed MXFP4 products);
//! `kernel_tests` checks every path the CPU has against an f64 reference.

use std::sync::OnceLock;

use crate::{Error, Result};

/// Builds the [`Kernels`] table of a block kernel generic over `<R, T>` (used by the kernel files); `f<G>` passes
/// `G` as the kernel's first generic argument, before `R` and `T`.
macro_rules! kernel_table {
    ($name:expr, $fmt:expr, $f:ident $(<$g:ident>)?, rows = $r:literal, tokens = $t:literal) => {
        Kernels {
            name: $name,
            x_format: $fmt,
            rows: $r,
            tokens: $t,
            multi: [$f::<$($g,)? $r, 1>, $f::<$($g,)? $r, 2>, $f::<$($g,)? $r, 3>, $f::<$($g,)? $r, 4>],
            single: [$f::<$($g,)? 1, 1>, $f::<$($g,)? 1, 2>, $f::<$($g,)? 1, 3>, $f::<$($g,)? 1, 4>],
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod bf16_split;
mod driver;
#[cfg(test)]
mod fp8_tests;
#[cfg(test)]
mod kernel_tests;
#[cfg(target_arch = "x86_64")]
mod mxfp4_fused;
#[cfg(target_arch = "x86_64")]
mod prefetch;
mod scalar;

/// Stored dtype of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
    /// E4M3, always with [`BlockScales`].
    F8E4M3,
}

impl WeightDType {
    /// Bytes per stored element.
    pub const fn size_bytes(self) -> usize {
        match self {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::BF16 => 2,
            WeightDType::F8E4M3 => 1,
        }
    }
}

/// The scales of an FP8 matrix `[n_rows, k]`: weight `(r, c)` is its E4M3 value times scale
/// `(r / block_rows, c / block_cols)` of a row-major `[n_rows.div_ceil(block_rows), k.div_ceil(block_cols)]` grid
/// of little-endian f32 (`bytes`, unaligned allowed).
#[derive(Clone, Copy, Debug)]
pub struct BlockScales<'a> {
    pub bytes: &'a [u8],
    pub block_rows: usize,
    pub block_cols: usize,
}

impl BlockScales<'_> {
    /// The scale of weight row `row`'s column block `block`, in a grid `per_row` blocks wide.
    fn get(&self, row: usize, block: usize, per_row: usize) -> f32 {
        let at = 4 * ((row / self.block_rows) * per_row + block);
        f32::from_le_bytes(self.bytes[at..at + 4].try_into().expect("four bytes"))
    }
}

/// How a weight matrix is stored: its element dtype and, for FP8, its scales. A plain [`WeightDType`] converts
/// into an unscaled encoding.
#[derive(Clone, Copy, Debug)]
pub struct WeightEncoding<'a> {
    pub dtype: WeightDType,
    pub scales: Option<BlockScales<'a>>,
}

impl From<WeightDType> for WeightEncoding<'_> {
    fn from(dtype: WeightDType) -> Self {
        WeightEncoding { dtype, scales: None }
    }
}

/// `out[m*n_rows + r] = sum_k x[m*k + kk] * W[r, kk]` for every token `m` in `0..m_tokens`, `r` in `0..n_rows`.
///
/// `w` is the raw little-endian bytes of a row-major `[n_rows, k]` matrix in `encoding` (a [`WeightDType`], or an
/// FP8 one with its [`BlockScales`]); it may point into a memory-mapped file and need not be aligned. `x` is f32 `[m_tokens, k]`; `out` is f32 `[m_tokens, n_rows]` and
/// is overwritten. Multithreaded with rayon over blocks of rows (run serially when the matrix is small); each weight
/// row is read from memory once for all tokens.
///
/// # Panics
/// If `x.len() != m_tokens * k`, `w.len() != n_rows * k * dtype.size_bytes()` or `out.len() != m_tokens * n_rows`
/// (callers validate shapes, so these are programmer errors), if FP8 weights come without scales (or other weights
/// with them) or with too few, and if `FERRY_GEMV_ISA` is invalid (callers check it first with
/// [`check_isa_env`]). `k == 0` is allowed and gives zeros.
pub fn matmul<'a>(
    x: &[f32],
    m_tokens: usize,
    k: usize,
    w: &[u8],
    encoding: impl Into<WeightEncoding<'a>>,
    n_rows: usize,
    out: &mut [f32],
) {
    driver::run(selected_isa(), x, m_tokens, k, w, encoding.into(), n_rows, out, true);
}

/// Same as [`matmul`], on the calling thread only: for callers already inside a rayon task (e.g. one task per
/// expert). Same panics.
pub fn matmul_serial<'a>(
    x: &[f32],
    m_tokens: usize,
    k: usize,
    w: &[u8],
    encoding: impl Into<WeightEncoding<'a>>,
    n_rows: usize,
    out: &mut [f32],
) {
    driver::run(selected_isa(), x, m_tokens, k, w, encoding.into(), n_rows, out, false);
}

/// Name of the kernel [`matmul`] uses for `dtype` on this machine, e.g. `"avx512 bf16 (shift)"`. Panics as
/// [`matmul`] does on an invalid `FERRY_GEMV_ISA`.
pub fn kernel_name(dtype: WeightDType) -> &'static str {
    kernels(selected_isa(), dtype).name
}

/// A product of MXFP4 rows with a few tokens: `(x, tokens, k, w, n, rows, out)` as [`mxfp4_fused`]'s functions
/// say.
pub(super) type Mxfp4RowsFn = fn(&[f32], usize, usize, &[u8], usize, std::ops::Range<usize>, &mut [f32]);

/// Most tokens a [`Mxfp4RowsFn`] takes.
#[cfg(target_arch = "x86_64")]
pub(super) use mxfp4_fused::MXFP4_FUSED_TOKENS;
#[cfg(not(target_arch = "x86_64"))]
pub(super) const MXFP4_FUSED_TOKENS: usize = 0;

/// The selected path's MXFP4 product that reads the packed rows in registers ([`mxfp4_fused`]: the `avx512`
/// kernel on both AVX-512 paths, the `avx2` one on its own), or none on `scalar`, where cpu/mxfp4.rs widens a
/// tile of rows to f32 and runs the F32 kernel instead.
pub(super) fn mxfp4_fused() -> Option<Mxfp4RowsFn> {
    mxfp4_fused_on(selected_isa())
}

/// Every packed MXFP4 product this CPU can run, by its path's name, whichever path is selected: for the tests.
#[cfg(test)]
pub(super) fn mxfp4_fused_kernels() -> Vec<(&'static str, Mxfp4RowsFn)> {
    Isa::ALL
        .into_iter()
        .filter(|&isa| available(isa))
        .filter_map(|isa| Some((isa.name(), mxfp4_fused_on(isa)?)))
        .collect()
}

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn mxfp4_fused_on(isa: Isa) -> Option<Mxfp4RowsFn> {
    #[cfg(target_arch = "x86_64")]
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 => return Some(mxfp4_fused::avx512_rows),
        Isa::Avx2 => return Some(mxfp4_fused::avx2_rows),
        Isa::Scalar => {}
    }
    None
}

/// Checks `FERRY_GEMV_ISA`: [`Error::Config`] naming the variable, its value and the valid choices when it names
/// no kernel path or one this CPU lacks. The products cannot return that error, so whoever runs them calls this
/// first (the CLI does when it opens a backend); the variable is read once per process.
pub fn check_isa_env() -> Result<()> {
    match selection() {
        Ok(_) => Ok(()),
        Err(message) => Err(Error::Config(message.clone())),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Choice of path.

/// The environment variable that picks a kernel path instead of the automatic choice.
const ISA_ENV: &str = "FERRY_GEMV_ISA";

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

    /// The path's name in `FERRY_GEMV_ISA`.
    fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The CPU features the path needs, as the error for a CPU without them says.
    fn needs(self) -> &'static str {
        match self {
            Isa::Scalar => "nothing",
            Isa::Avx2 => "avx2, fma and f16c",
            Isa::Avx512 => "avx512f, avx512bw and avx512vl",
            Isa::Avx512Bf16 => "avx512f, avx512bw, avx512vl and avx512bf16",
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

/// The path for `FERRY_GEMV_ISA = requested` (`None` when unset) on a CPU that can run the paths `available`
/// accepts: the named path (trimmed, any case), or the best available one when unset or empty (`avx512bf16` only
/// if [`AUTO_USES_DPBF16`]). `Err` says what is wrong with the value, naming the variable and the valid choices.
fn choose_isa(requested: Option<&str>, available: impl Fn(Isa) -> bool) -> std::result::Result<Isa, String> {
    let name = requested.map(|s| s.trim().to_ascii_lowercase()).unwrap_or_default();
    if name.is_empty() {
        let auto = if AUTO_USES_DPBF16 { Isa::Avx512Bf16 } else { Isa::Avx512 };
        return Ok(Isa::ALL
            .into_iter()
            .filter(|&i| i <= auto && available(i))
            .max()
            .unwrap_or(Isa::Scalar));
    }
    let list = |isas: &mut dyn Iterator<Item = Isa>| isas.map(Isa::name).collect::<Vec<_>>().join(", ");
    let value = requested.unwrap_or_default();
    let Some(isa) = Isa::ALL.into_iter().find(|i| i.name() == name) else {
        return Err(format!(
            "{ISA_ENV}={value:?} names no CPU GEMV kernel path (valid: {}; unset for the automatic choice)",
            list(&mut Isa::ALL.into_iter())
        ));
    };
    if !available(isa) {
        return Err(format!(
            "{ISA_ENV}={value:?}: this CPU lacks {} (paths it can run: {})",
            isa.needs(),
            list(&mut Isa::ALL.into_iter().filter(|&i| available(i)))
        ));
    }
    Ok(isa)
}

/// The path in use, or what is wrong with `FERRY_GEMV_ISA`: read and detected once.
fn selection() -> &'static std::result::Result<Isa, String> {
    static SELECTION: OnceLock<std::result::Result<Isa, String>> = OnceLock::new();
    SELECTION.get_or_init(|| {
        // A value that is not Unicode cannot name a path: its lossy form is reported as unknown.
        let requested = std::env::var_os(ISA_ENV).map(|v| v.to_string_lossy().into_owned());
        choose_isa(requested.as_deref(), available)
    })
}

/// The path the products use. Panics on an invalid `FERRY_GEMV_ISA`, which [`check_isa_env`] reports first.
fn selected_isa() -> Isa {
    match selection() {
        Ok(isa) => *isa,
        Err(message) => panic!("{message}"),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Block kernels: the contract every path's kernels follow, and their tables.

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
    /// k.div_ceil(32)` bytes; see [`bf16_split::split_bf16`].
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

fn kernels(isa: Isa, dtype: WeightDType) -> &'static Kernels {
    use WeightDType::*;
    #[cfg(target_arch = "x86_64")]
    {
        match (isa, dtype) {
            (Isa::Scalar, _) => {}
            (Isa::Avx2, F32) => return &avx2::F32_KERNELS,
            (Isa::Avx2, F16) => return &avx2::F16_KERNELS,
            (Isa::Avx2, BF16) => return &avx2::BF16_KERNELS,
            (Isa::Avx2, F8E4M3) => return &avx2::F8_KERNELS,
            (Isa::Avx512 | Isa::Avx512Bf16, F8E4M3) => return &avx512::F8_KERNELS,
            (Isa::Avx512 | Isa::Avx512Bf16, F32) => return &avx512::F32_KERNELS,
            (Isa::Avx512 | Isa::Avx512Bf16, F16) => return &avx512::F16_KERNELS,
            (Isa::Avx512, BF16) => return &avx512::BF16_KERNELS,
            (Isa::Avx512Bf16, BF16) => return &avx512bf16::BF16_KERNELS,
        }
    }
    let _ = isa;
    match dtype {
        F32 => &scalar::F32_KERNELS,
        F16 => &scalar::F16_KERNELS,
        BF16 => &scalar::BF16_KERNELS,
        F8E4M3 => &scalar::F8_KERNELS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_env_names_each_path() {
        let all = |_: Isa| true;
        for isa in Isa::ALL {
            assert_eq!(choose_isa(Some(isa.name()), all), Ok(isa));
        }
        assert_eq!(choose_isa(Some(" AVX2 "), all), Ok(Isa::Avx2));
    }

    #[test]
    fn isa_env_unset_or_empty_is_the_automatic_choice() {
        let up_to = |best: Isa| move |i: Isa| i <= best;
        for requested in [None, Some(""), Some("  ")] {
            assert_eq!(choose_isa(requested, up_to(Isa::Avx512Bf16)), Ok(Isa::Avx512));
            assert_eq!(choose_isa(requested, up_to(Isa::Avx2)), Ok(Isa::Avx2));
            assert_eq!(choose_isa(requested, up_to(Isa::Scalar)), Ok(Isa::Scalar));
        }
    }

    #[test]
    fn isa_env_unknown_value_is_an_error() {
        let err = choose_isa(Some("avx3"), |_| true).unwrap_err();
        assert_eq!(
            err,
            "FERRY_GEMV_ISA=\"avx3\" names no CPU GEMV kernel path (valid: scalar, avx2, avx512, avx512bf16; unset \
             for the automatic choice)"
        );
    }

    #[test]
    fn isa_env_path_the_cpu_lacks_is_an_error() {
        let err = choose_isa(Some("avx512"), |i| i <= Isa::Avx2).unwrap_err();
        assert_eq!(
            err,
            "FERRY_GEMV_ISA=\"avx512\": this CPU lacks avx512f, avx512bw and avx512vl (paths it can run: scalar, avx2)"
        );
    }
}
