//! Expert GEMV benchmark: host memory read bandwidth vs. the CPU GEMV kernels on MoE expert shapes.
//!
//! `cargo bench --bench expert_gemv` (harness = false). Measures
//! 1. the host memory read bandwidth: a multithreaded rayon sum over a buffer of u64 (8 interleaved streams per
//!    task), 5 passes up front, then one pass before every GEMV pass (the bandwidth of a shared host drifts, so
//!    each GEMV pass is compared with the bandwidth measured just before it);
//! 2. the expert GEMV: experts with gate/up `[inter, hidden]` and down `[hidden, inter]` (default Qwen3-30B-A3B:
//!    hidden 2048, inter 768, 9.4 MB per expert in bf16), enough experts that the working set far exceeds the CPU
//!    caches, m_tokens = 1 and 4, cycling through the experts, in two modes:
//!    - `matmul`: one expert after another, each matrix split over all threads by rows ([`matmul`]);
//!    - `lane`: `FERRY_BENCH_ACTIVE` experts at a time, one rayon task per expert ([`matmul_serial`]), like the CPU
//!      lane computing a token's expert misses.
//!
//! It prints, per dtype and mode, GB/s of weight bytes read (median and best pass over all experts), the bandwidth
//! measured alongside, and their ratio.
//!
//! Environment (defaults in brackets): `FERRY_BENCH_BW_MB` [1024] bandwidth buffer; `FERRY_BENCH_WS_MB` [1024]
//! expert working set per dtype (at least `FERRY_BENCH_ACTIVE` experts); `FERRY_BENCH_HIDDEN` [2048];
//! `FERRY_BENCH_INTER` [768]; `FERRY_BENCH_DTYPES` [bf16,f16,f32] (also fp8: E4M3 with 128 x 128 block scales); `FERRY_BENCH_MS` [1,4] token counts;
//! `FERRY_BENCH_ACTIVE` [8]; `FERRY_BENCH_SECS` [1.0] least time per measurement (at least 3 passes);
//! `FERRY_GEMV_ISA` selects the kernel path (scalar, avx2, avx512, avx512bf16; see the gemv module; an unknown or
//! unavailable path stops the run).
//! Small CI run: `FERRY_BENCH_BW_MB=16 FERRY_BENCH_WS_MB=1 FERRY_BENCH_HIDDEN=256 FERRY_BENCH_INTER=128
//! FERRY_BENCH_ACTIVE=2 FERRY_BENCH_SECS=0 cargo bench --bench expert_gemv`.

use std::hint::black_box;
use std::time::Instant;

use ferry_core::backend::cpu::gemv::{
    check_isa_env, kernel_name, matmul, matmul_serial, BlockScales, WeightDType, WeightEncoding,
};
use rayon::prelude::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(s) => s.trim().parse().unwrap_or_else(|_| panic!("{name}={s:?} is not valid")),
        Err(_) => default,
    }
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A buffer of u64 whose multithreaded rayon sum measures the host memory read bandwidth.
struct BandwidthProbe {
    buf: Vec<u64>,
}

impl BandwidthProbe {
    fn new(bytes: usize) -> Self {
        let mut buf = vec![0u64; (bytes / 8).max(1)];
        buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
            for (j, v) in c.iter_mut().enumerate() {
                *v = ((i << 16) + j) as u64;
            }
        });
        BandwidthProbe { buf }
    }

    /// One pass over the buffer: GB/s. Each rayon task sums a 1 MiB chunk as 8 interleaved streams (on the VM this
    /// was written on, one sequential stream per core reaches only ~75% of what several streams do, and the GEMV
    /// kernels read 4 rows at a time).
    fn pass(&self) -> f64 {
        const STREAMS: usize = 8;
        let t = Instant::now();
        let s = self
            .buf
            .par_chunks(1 << 17)
            .map(|c| {
                let q = c.len() / STREAMS / 8 * 8;
                let parts: [&[u64]; STREAMS] = std::array::from_fn(|s| &c[s * q..(s + 1) * q]);
                let mut acc = [[0u64; 8]; STREAMS];
                for i in (0..q).step_by(8) {
                    for (a, p) in acc.iter_mut().zip(&parts) {
                        let block: &[u64; 8] = p[i..i + 8].try_into().unwrap();
                        for (a, &v) in a.iter_mut().zip(block) {
                            *a = a.wrapping_add(v);
                        }
                    }
                }
                let tail = c[STREAMS * q..].iter().fold(0u64, |a, &b| a.wrapping_add(b));
                acc.iter().flatten().fold(tail, |a, &b| a.wrapping_add(b))
            })
            .reduce(|| 0, u64::wrapping_add);
        black_box(s);
        (self.buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Fills `buf` with random finite weights of magnitude in [0.5, 1) in `dtype`.
fn fill_weights(buf: &mut [u8], dtype: WeightDType) {
    buf.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ ((i as u64 + 1) << 32);
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        match dtype {
            WeightDType::F32 => {
                for e in c.chunks_exact_mut(4) {
                    let b = (next() as u32 & 0x807f_ffff) | 0x3f00_0000;
                    e.copy_from_slice(&b.to_le_bytes());
                }
            }
            WeightDType::F16 | WeightDType::BF16 => {
                let (mask, or) = if dtype == WeightDType::F16 {
                    (0x83ffu16, 0x3800u16)
                } else {
                    (0x807f, 0x3f00)
                };
                for e in c.chunks_exact_mut(2) {
                    let b = (next() as u16 & mask) | or;
                    e.copy_from_slice(&b.to_le_bytes());
                }
            }
            // E4M3 of exponent 6 or 7 (magnitudes in [0.0078, 0.03)) and either sign: never NaN.
            WeightDType::F8E4M3 => c.iter_mut().for_each(|e| *e = (next() as u8 & 0x8f) | 0x30),
        }
    });
}

/// Scratch buffers of one expert evaluation.
struct Scratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

impl Scratch {
    fn new(m: usize, hidden: usize, inter: usize) -> Self {
        Scratch {
            gate: vec![0.0; m * inter],
            up: vec![0.0; m * inter],
            down: vec![0.0; m * hidden],
        }
    }
}

type MatmulFn = fn(&[f32], usize, usize, &[u8], WeightEncoding<'static>, usize, &mut [f32]);

/// Scales of one, as many as a 128 x 128-block FP8 matrix of the bench's shapes needs.
const UNIT_SCALES: [u8; 4 * 4096] = unit_scales();

const fn unit_scales() -> [u8; 4 * 4096] {
    let mut out = [0u8; 4 * 4096];
    let one = 1f32.to_bits().to_le_bytes();
    let mut i = 0;
    while i < out.len() {
        out[i] = one[i % 4];
        i += 1;
    }
    out
}

/// `dtype` as the kernels read an `[rows, cols]` matrix of it: FP8 with unit scales per 128 x 128 block.
fn encoding(dtype: WeightDType, rows: usize, cols: usize) -> WeightEncoding<'static> {
    let scales = (dtype == WeightDType::F8E4M3).then(|| BlockScales {
        bytes: &UNIT_SCALES[..4 * rows.div_ceil(128) * cols.div_ceil(128)],
        block_rows: 128,
        block_cols: 128,
    });
    WeightEncoding { dtype, scales }
}

/// SwiGLU expert: down(silu(gate(x)) * up(x)); `e` holds gate, up, down.
#[allow(clippy::too_many_arguments)]
fn expert(
    mm: MatmulFn,
    x: &[f32],
    m: usize,
    e: &[u8],
    dtype: WeightDType,
    hidden: usize,
    inter: usize,
    s: &mut Scratch,
) {
    let mat = hidden * inter * dtype.size_bytes();
    let (up_gate, down) = (encoding(dtype, inter, hidden), encoding(dtype, hidden, inter));
    mm(x, m, hidden, &e[..mat], up_gate, inter, &mut s.gate);
    mm(x, m, hidden, &e[mat..2 * mat], up_gate, inter, &mut s.up);
    for (g, u) in s.gate.iter_mut().zip(&s.up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
    mm(&s.gate, m, inter, &e[2 * mat..3 * mat], down, hidden, &mut s.down);
    black_box(&s.down);
}

fn main() {
    check_isa_env().unwrap_or_else(|e| panic!("{e}"));
    let bw_mb: usize = env_or("FERRY_BENCH_BW_MB", 1024);
    let ws_mb: usize = env_or("FERRY_BENCH_WS_MB", 1024);
    let hidden: usize = env_or("FERRY_BENCH_HIDDEN", 2048);
    let inter: usize = env_or("FERRY_BENCH_INTER", 768);
    let active: usize = env_or::<usize>("FERRY_BENCH_ACTIVE", 8).max(1);
    let secs: f64 = env_or("FERRY_BENCH_SECS", 1.0);
    let ms: Vec<usize> = env_list("FERRY_BENCH_MS", "1,4")
        .iter()
        .map(|s| s.parse().expect("FERRY_BENCH_MS"))
        .collect();
    let threads = rayon::current_num_threads();

    let probe = BandwidthProbe::new(bw_mb << 20);
    let mut bw: Vec<f64> = (0..5).map(|_| probe.pass()).collect();
    println!(
        "memory read bandwidth: best {:.1} GB/s, median {:.1} GB/s (rayon sum over {bw_mb} MiB of u64, 8 streams per \
         thread, 5 passes, {threads} threads)",
        bw.iter().copied().fold(0.0, f64::max),
        median(&mut bw)
    );
    println!(
        "GEMV: GB/s of weight bytes read per pass over all experts (median, best), alternated with bandwidth passes \
         (median, best); ratio = median over passes of GEMV / the bandwidth pass just before it"
    );

    for name in env_list("FERRY_BENCH_DTYPES", "bf16,f16,f32") {
        let dtype = match name.as_str() {
            "bf16" => WeightDType::BF16,
            "f16" => WeightDType::F16,
            "f32" => WeightDType::F32,
            "fp8" => WeightDType::F8E4M3,
            other => panic!("FERRY_BENCH_DTYPES: unknown dtype {other:?}"),
        };
        let expert_bytes = 3 * hidden * inter * dtype.size_bytes();
        let n_experts = ((ws_mb << 20) / expert_bytes).max(active).next_multiple_of(active);
        let mut weights = vec![0u8; n_experts * expert_bytes];
        fill_weights(&mut weights, dtype);
        println!(
            "\n{name}: kernel \"{}\", {n_experts} experts x {:.2} MB = {:.0} MB, gate/up [{inter}, {hidden}], down \
             [{hidden}, {inter}]",
            kernel_name(dtype),
            expert_bytes as f64 / 1e6,
            weights.len() as f64 / 1e6
        );

        for &m in &ms {
            let x: Vec<f32> = (0..m * hidden)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            for lane in [false, true] {
                let mut scratch: Vec<Scratch> = (0..active).map(|_| Scratch::new(m, hidden, inter)).collect();
                // One pass = every expert once; measure whole passes until `secs` have elapsed (after a warm-up pass).
                let pass = |scratch: &mut [Scratch]| {
                    if lane {
                        for group in weights.chunks(active * expert_bytes) {
                            group
                                .par_chunks(expert_bytes)
                                .zip(scratch.par_iter_mut())
                                .for_each(|(e, s)| {
                                    expert(matmul_serial, &x, m, e, dtype, hidden, inter, s);
                                });
                        }
                    } else {
                        for e in weights.chunks(expert_bytes) {
                            expert(matmul, &x, m, e, dtype, hidden, inter, &mut scratch[0]);
                        }
                    }
                };
                // Alternate one bandwidth pass and one GEMV pass (the host's bandwidth drifts; each GEMV pass is
                // compared with the bandwidth measured next to it), from a rayon worker thread as an engine running
                // its forward pass inside the pool would.
                let (mut bws, mut gemvs) = rayon::scope(|_| {
                    pass(&mut scratch);
                    let (start, mut bws, mut gemvs) = (Instant::now(), Vec::new(), Vec::new());
                    while gemvs.len() < 3 || start.elapsed().as_secs_f64() < secs {
                        bws.push(probe.pass());
                        let t = Instant::now();
                        pass(&mut scratch);
                        gemvs.push(weights.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
                    }
                    (bws, gemvs)
                });
                let mut ratios: Vec<f64> = gemvs.iter().zip(&bws).map(|(g, b)| g / b).collect();
                let n_pass = gemvs.len();
                let (g_best, g_med) = (gemvs.iter().copied().fold(0.0, f64::max), median(&mut gemvs));
                let (b_best, b_med) = (bws.iter().copied().fold(0.0, f64::max), median(&mut bws));
                let mode = if lane {
                    format!("lane ({active} experts at a time, matmul_serial)")
                } else {
                    "matmul".into()
                };
                println!(
                    "  m={m} {mode:<44} {g_med:5.1} GB/s (best {g_best:5.1})  bw {b_med:5.1} (best {b_best:5.1})  \
                     ratio {:4.2} (best/best {:4.2})  {:6.1} us/expert  [{n_pass} passes]",
                    median(&mut ratios),
                    g_best / b_best,
                    weights.len() as f64 / g_med / 1e3 / n_experts as f64,
                );
            }
        }
    }
}
