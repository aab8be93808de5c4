//! The machine's data-movement and compute ceilings, measured on the GPU (`ferry doctor`; `ferry bench` uses
//! them for its bounds): pinned host-to-device and device-to-host copy bandwidth, device-to-device copy
//! bandwidth (bytes read plus written: what HBM moves), and cuBLAS bf16 GEMM throughput (the backend's own GEMM,
//! as the prefill's products run it); and the two lanes of expert offload measured at once (`measure_lanes`): the
//! link's copy rate while the CPU lane computes, and the CPU lane's rate while the link copies, which the split
//! planner of `--moe-strategy hybrid|auto` is given.

use cudarc::driver::{sys, CudaSlice};
use serde::Serialize;

use std::time::{Duration, Instant};

use super::launch::ptr;
use super::memory::keep_freed_memory_pooled;
use super::{cuda_err, Bf16Matrix, CudaBackend};
use crate::backend::cpu::gemv::WeightDType;
use crate::backend::cpu::lane::{HostLane, LaneExpert, LaneWork};
use crate::backend::ExpertActivation;
use crate::Result;

#[derive(Clone, Debug, Serialize)]
pub struct GpuCeilings {
    pub h2d_pinned_gb_s: f64,
    pub d2h_pinned_gb_s: f64,
    /// Bytes read plus bytes written per second.
    pub d2d_copy_gb_s: f64,
    pub bf16_gemm_tflop_s: f64,
}

const COPY_BYTES: usize = 1 << 30;
const REPEATS: usize = 5;

impl CudaBackend {
    /// Median milliseconds of `REPEATS` runs of `work` on the backend's stream, timed with device events.
    fn time_ms(&self, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
        work()?; // warm-up
        let mut times = Vec::with_capacity(REPEATS);
        for _ in 0..REPEATS {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
            let end = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
            start.record(&self.stream).map_err(cuda_err("event record"))?;
            work()?;
            end.record(&self.stream).map_err(cuda_err("event record"))?;
            end.synchronize().map_err(cuda_err("event sync"))?;
            times.push(start.elapsed_ms(&end).map_err(cuda_err("event time"))? as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[REPEATS / 2])
    }

    pub fn measure_ceilings(&self) -> Result<GpuCeilings> {
        // Plain pinned memory (not write-combined): what an expert bank read by the CPU too would use.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(COPY_BYTES, 0) }.map_err(cuda_err("pinning"))?;
        host.as_mut_slice().map_err(cuda_err("pinned memory"))?.fill(1);
        let mut device: CudaSlice<u8> = self.alloc(COPY_BYTES)?;
        let mut other: CudaSlice<u8> = self.alloc(COPY_BYTES)?;
        let gb_s = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;

        let h2d = self.time_ms(|| self.stream.memcpy_htod(&host, &mut device).map_err(cuda_err("H2D")))?;
        let d2h = self.time_ms(|| self.stream.memcpy_dtoh(&device, &mut host).map_err(cuda_err("D2H")))?;
        let d2d = self.time_ms(|| self.stream.memcpy_dtod(&device, &mut other).map_err(cuda_err("D2D")))?;

        let n = 8192usize;
        let a: CudaSlice<u16> =
            self.copy_to_device(&(0..n * n).map(|i| 0x3c00 + (i % 61) as u16).collect::<Vec<_>>())?;
        let c: CudaSlice<f32> = self.alloc(n * n)?;
        let a_matrix = Bf16Matrix {
            data: ptr(&a),
            rows: n,
            cols: n,
        };
        let gemm = self.time_ms(|| self.gemm_bf16(ptr(&a), n, a_matrix, ptr(&c), n, false))?;
        drop((host, device, other, a, c));
        // Give the measurement's buffers back to the driver: they are no part of what a model needs.
        keep_freed_memory_pooled(&self.ctx)?;
        Ok(GpuCeilings {
            h2d_pinned_gb_s: gb_s(COPY_BYTES, h2d),
            d2h_pinned_gb_s: gb_s(COPY_BYTES, d2h),
            d2d_copy_gb_s: gb_s(2 * COPY_BYTES, d2d),
            bf16_gemm_tflop_s: 2.0 * (n as f64).powi(3) / (gemm * 1e-3) / 1e12,
        })
    }
}

/// The expert offload's two lanes, measured together.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct LaneCeilings {
    /// Pinned host-to-device copies while the CPU lane computes, GB/s.
    pub link_gb_s: f64,
    /// The CPU lane over one-row experts while the link copies, GB/s of expert weights.
    pub cpu_gb_s: f64,
    /// The CPU lane alone: each row beyond the first adds this share of the one-row time (8-row experts timed
    /// against one-row ones).
    pub cpu_row_cost: f64,
    pub cpu_threads: usize,
}

/// The measured expert shape: Qwen3-30B-A3B's (hidden 2048, intermediate 768), bf16.
const LANE_HIDDEN: usize = 2048;
const LANE_INTER: usize = 768;

impl CudaBackend {
    /// Measures both lanes of expert offload: the CPU lane over `experts` experts of the measured shape (more than
    /// the last-level cache holds) one row each, alone and at 8 rows, then again while `copy_bytes` of pinned
    /// memory cross the link in 64 MiB copies, both timed over the same interval.
    pub fn measure_lanes(&self, experts: usize, copy_bytes: usize) -> Result<LaneCeilings> {
        let mut lane = HostLane::new(HostLane::default_threads())?;
        let matrix = LANE_INTER * LANE_HIDDEN * 2;
        let mut bank =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(3 * matrix * experts, 0) }.map_err(cuda_err("pinning"))?;
        // bf16 values near 1 (0x3f80 little-endian, a few mantissa bits varied): finite products.
        for (i, byte) in bank
            .as_mut_slice()
            .map_err(cuda_err("pinned memory"))?
            .iter_mut()
            .enumerate()
        {
            *byte = if i % 2 == 0 { (i / 2 % 7) as u8 } else { 0x3f };
        }
        let bank = bank.as_slice().map_err(cuda_err("pinned memory"))?;
        let lane_experts: Vec<LaneExpert> = bank
            .chunks_exact(3 * matrix)
            .map(|block| LaneExpert {
                gate: &block[..matrix],
                up: &block[matrix..2 * matrix],
                down: &block[2 * matrix..],
                dtype: WeightDType::BF16,
                gate_bias: None,
                up_bias: None,
                down_bias: None,
            })
            .collect();
        let x = vec![0.01f32; 8 * LANE_HIDDEN];
        let one_row: Vec<(u32, u32)> = (0..experts as u32).map(|e| (0, e)).collect();
        let eight_rows: Vec<(u32, u32)> = (0..experts as u32).flat_map(|e| (0..8).map(move |r| (r, e))).collect();
        let mut out = vec![0.0f32; eight_rows.len() * LANE_HIDDEN];
        let mut time = |pairs: &[(u32, u32)], lane: &mut HostLane| -> Result<Duration> {
            let work = LaneWork {
                x: &x,
                hidden: LANE_HIDDEN,
                inter: LANE_INTER,
                activation: ExpertActivation::SiluGlu,
                experts: &lane_experts,
                pairs,
            };
            Ok(lane.compute(&work, &mut out[..pairs.len() * LANE_HIDDEN], || ())?.1)
        };
        time(&one_row, &mut lane)?; // warm-up
        let median = |lane: &mut HostLane, time: &mut dyn FnMut(&mut HostLane) -> Result<Duration>| -> Result<f64> {
            let mut runs = (0..REPEATS)
                .map(|_| time(lane).map(|d| d.as_secs_f64()))
                .collect::<Result<Vec<_>>>()?;
            runs.sort_by(f64::total_cmp);
            Ok(runs[REPEATS / 2])
        };
        let single = median(&mut lane, &mut |lane| time(&one_row, lane))?;
        let eight = median(&mut lane, &mut |lane| time(&eight_rows, lane))?;
        let cpu_row_cost = ((eight / single - 1.0) / 7.0).max(0.0);

        // Both at once: queue the copies, then run the lane until they have landed.
        let piece = (64usize << 20).min(copy_bytes.max(1));
        let host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(piece, 0) }.map_err(cuda_err("pinning"))?;
        let mut device: CudaSlice<u8> = self.alloc(piece)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
        let end = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
        start.record(&self.stream).map_err(cuda_err("event record"))?;
        let pieces = copy_bytes.div_ceil(piece);
        for _ in 0..pieces {
            self.stream.memcpy_htod(&host, &mut device).map_err(cuda_err("H2D"))?;
        }
        end.record(&self.stream).map_err(cuda_err("event record"))?;
        let (mut lane_s, mut lane_bytes) = (0.0, 0usize);
        let began = Instant::now();
        while !end.try_is_complete().map_err(cuda_err("event"))? || lane_bytes == 0 {
            lane_s += time(&one_row, &mut lane)?.as_secs_f64();
            lane_bytes += experts * 3 * matrix;
            if began.elapsed() > Duration::from_secs(30) {
                break;
            }
        }
        end.synchronize().map_err(cuda_err("event sync"))?;
        let link_ms = start.elapsed_ms(&end).map_err(cuda_err("event time"))? as f64;
        drop((host, device));
        keep_freed_memory_pooled(&self.ctx)?;
        Ok(LaneCeilings {
            link_gb_s: (pieces * piece) as f64 / (link_ms * 1e-3) / 1e9,
            cpu_gb_s: lane_bytes as f64 / lane_s / 1e9,
            cpu_row_cost,
            cpu_threads: lane.threads(),
        })
    }
}
