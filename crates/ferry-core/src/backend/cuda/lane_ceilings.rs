//! The two lanes of expert offload measured at once (`ferry doctor`, and `--moe-strategy hybrid|auto` at startup
//! without a cached measurement): the link's copy rate while the CPU lane computes, and the CPU lane's cost while
//! the link copies, timed at a few sizes (experts per call, rows per expert) and fitted ([`fit_cpu_lane`]) into
//! the fixed cost, rate and row cost the split planner is given. Not the other ceilings (ceilings.rs).

use std::collections::VecDeque;
use std::time::Duration;

use cudarc::driver::{sys, CudaEvent, CudaSlice};
use serde::{Deserialize, Serialize};

use super::memory::keep_freed_memory_pooled;
use super::{cuda_err, CudaBackend};
use crate::backend::cpu::gemv::WeightDType;
use crate::backend::cpu::lane::{HostLane, LaneDType, LaneExpert, LaneWork};
use crate::backend::ExpertActivation;
use crate::moe::{fit_cpu_lane, CpuLaneCost, LanePoint};
use crate::{Error, Result};

/// The expert offload's two lanes, measured together.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct LaneCeilings {
    /// Pinned host-to-device copies while the CPU lane computes, GB/s.
    pub link_gb_s: f64,
    /// The CPU lane's rate beyond its fixed cost, over one-row experts while the link copies, GB/s of expert
    /// weights (the slope of the fit).
    pub cpu_gb_s: f64,
    /// What a call of the CPU lane costs whatever it computes, microseconds (the fit's intercept).
    pub cpu_fixed_us: f64,
    /// Each row beyond the first adds this share of an expert's one-row time.
    pub cpu_row_cost: f64,
    pub cpu_threads: usize,
}

impl LaneCeilings {
    /// The CPU lane's cost as the planner takes it.
    pub fn cpu_cost(&self) -> CpuLaneCost {
        CpuLaneCost {
            fixed_s: self.cpu_fixed_us * 1e-6,
            bytes_per_s: self.cpu_gb_s * 1e9,
            row_cost: self.cpu_row_cost,
        }
    }
}

/// The measured expert shape: Qwen3-30B-A3B's (hidden 2048, intermediate 768), bf16.
const LANE_HIDDEN: usize = 2048;
const LANE_INTER: usize = 768;
/// The calls timed in each round, (experts, rows per expert): one row at expert counts from a decode step's
/// share to a prefill's, which fit the fixed cost and the rate, and two many-row calls for the row cost.
const POINTS: [(usize, usize); 8] = [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (8, 4), (16, 8)];
/// Copies queued on the link are kept at least this many pieces ahead of the lane (about 10 ms at 55 GB/s), so
/// the link never idles while a lane call runs.
const LINK_PIECE_BYTES: usize = 64 << 20;
const LINK_PIECES_AHEAD: usize = 8;

impl CudaBackend {
    /// Measures both lanes of expert offload: `rounds` rounds of the CPU lane's calls at [`POINTS`] over a bank
    /// of `experts` experts of the measured shape (each call takes the next experts round-robin, so that what it
    /// reads is not still in the last-level cache, as a decode step's experts are not), while pinned copies keep
    /// the link busy the whole time. The median of each point's rounds is fitted.
    pub fn measure_lanes(&self, experts: usize, rounds: usize) -> Result<LaneCeilings> {
        let most = POINTS.iter().map(|p| p.0).max().unwrap_or(1);
        if experts < 2 * most || rounds == 0 {
            return Err(Error::Config(format!(
                "measuring the lanes needs {} experts and one round at least",
                2 * most
            )));
        }
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
                dtype: LaneDType::Gemv(WeightDType::BF16),
                scales: None,
                gate_bias: None,
                up_bias: None,
                down_bias: None,
            })
            .collect();
        let max_rows = POINTS.iter().map(|p| p.1).max().unwrap_or(1);
        let x = vec![0.01f32; max_rows * LANE_HIDDEN];
        let mut out = vec![0.0f32; most * max_rows * LANE_HIDDEN];
        let mut next_expert = 0usize;
        let mut call = |lane: &mut HostLane, (count, rows): (usize, usize)| -> Result<Duration> {
            let pairs: Vec<(u32, u32)> = (0..count)
                .flat_map(|i| {
                    let e = ((next_expert + i) % experts) as u32;
                    (0..rows as u32).map(move |r| (r, e))
                })
                .collect();
            next_expert = (next_expert + count) % experts;
            let work = LaneWork {
                x: &x,
                hidden: LANE_HIDDEN,
                inter: LANE_INTER,
                activation: ExpertActivation::SiluGlu,
                experts: &lane_experts,
                pairs: &pairs,
            };
            Ok(lane.compute(&work, &mut out[..pairs.len() * LANE_HIDDEN], || ())?.1)
        };
        for &point in &POINTS {
            call(&mut lane, point)?; // warm-up
        }

        let host =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(LINK_PIECE_BYTES, 0) }.map_err(cuda_err("pinning"))?;
        let mut device: CudaSlice<u8> = self.alloc(LINK_PIECE_BYTES)?;
        let timed = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("event"))
        };
        let start = timed()?;
        start.record(&self.stream).map_err(cuda_err("event record"))?;
        let mut in_flight: VecDeque<CudaEvent> = VecDeque::new();
        let mut pieces = 0usize;
        let mut keep_link_busy = |in_flight: &mut VecDeque<CudaEvent>| -> Result<()> {
            while let Some(front) = in_flight.front() {
                if !front.try_is_complete().map_err(cuda_err("event"))? {
                    break;
                }
                in_flight.pop_front();
            }
            while in_flight.len() < LINK_PIECES_AHEAD {
                self.stream.memcpy_htod(&host, &mut device).map_err(cuda_err("H2D"))?;
                in_flight.push_back(self.stream.record_event(None).map_err(cuda_err("event"))?);
                pieces += 1;
            }
            Ok(())
        };
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); POINTS.len()];
        for _ in 0..rounds {
            for (at, &point) in POINTS.iter().enumerate() {
                keep_link_busy(&mut in_flight)?;
                times[at].push(call(&mut lane, point)?.as_secs_f64());
            }
        }
        let end = timed()?;
        end.record(&self.stream).map_err(cuda_err("event record"))?;
        end.synchronize().map_err(cuda_err("event sync"))?;
        let link_ms = start.elapsed_ms(&end).map_err(cuda_err("event time"))? as f64;
        drop((host, device));
        keep_freed_memory_pooled(&self.ctx)?;

        let points: Vec<LanePoint> = POINTS
            .iter()
            .zip(&mut times)
            .map(|(&(experts, rows), runs)| {
                runs.sort_by(f64::total_cmp);
                LanePoint {
                    experts,
                    rows,
                    seconds: runs[runs.len() / 2],
                }
            })
            .collect();
        let cost = fit_cpu_lane(&points, 3 * matrix)
            .ok_or_else(|| Error::Config(format!("the CPU lane's timings do not fit a cost: {points:?}")))?;
        Ok(LaneCeilings {
            link_gb_s: (pieces * LINK_PIECE_BYTES) as f64 / (link_ms * 1e-3) / 1e9,
            cpu_gb_s: cost.bytes_per_s / 1e9,
            cpu_fixed_us: cost.fixed_s * 1e6,
            cpu_row_cost: cost.row_cost,
            cpu_threads: lane.threads(),
        })
    }
}
