//! Software prefetch along the weight rows, shared by the x86 kernels (`avx2`, `avx512`, `avx512bf16`).

use std::arch::x86_64::*;

/// Software prefetch distance along each weight row. With the hardware prefetchers alone the kernels streamed
/// experts from RAM at ~86% of the measured read bandwidth (one expert per core, m = 1 and 4); prefetching 512
/// bytes ahead gained 7-12% (1024 about as much, 2048 less).
const PREFETCH: usize = 512;

/// Prefetches the cache line `PREFETCH` bytes past byte `off` of each of the `R` rows at `w`, `ws` bytes apart.
/// Called once per 64 bytes of row. Addresses past the matrix are harmless: prefetches never fault.
#[inline(always)]
pub(super) fn prefetch_rows<const R: usize>(w: *const u8, ws: usize, off: usize) {
    for r in 0..R {
        // SAFETY: a prefetch is only a hint; it does not dereference the pointer and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(r * ws + off + PREFETCH).cast()) };
    }
}
