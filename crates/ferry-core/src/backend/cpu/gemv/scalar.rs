//! The `scalar` path: portable kernels for any architecture, 8 independent partial sums per dot product (plain
//! Rust that the compiler may vectorize for the target's baseline). The path where no SIMD path is available,
//! and the only one outside x86-64.

use super::{Block, Kernels, XFormat};

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;
const F8: u8 = 3;
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
        BF16 => f32::from_bits(u32::from(u16::from_le_bytes(p.add(2 * i).cast::<[u8; 2]>().read())) << 16),
        _ => crate::loader::fp8_e4m3_to_f32(p.add(i).read()),
    }
}

/// The block kernel for weights of dtype `D`.
///
/// # Safety
/// See [`super::BlockFn`]; `x` holds f32 values aligned to 4 bytes.
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

pub(super) static F32_KERNELS: Kernels = kernel_table!("scalar f32", XFormat::F32, block<F32>, rows = 1, tokens = 4);
pub(super) static F16_KERNELS: Kernels = kernel_table!("scalar f16", XFormat::F32, block<F16>, rows = 1, tokens = 4);
pub(super) static BF16_KERNELS: Kernels = kernel_table!("scalar bf16", XFormat::F32, block<BF16>, rows = 1, tokens = 4);
pub(super) static F8_KERNELS: Kernels =
    kernel_table!("scalar fp8 e4m3 (scale)", XFormat::F32, block<F8>, rows = 1, tokens = 4);
