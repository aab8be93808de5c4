//! Online calibration of the split planner's rates: what each lane costs *inside the decode pipeline*, measured
//! layer by layer while the engine runs, fed back into the [`LaneRates`] that [`plan_split`] plans from. The
//! startup or `ferry doctor` fit ([`fit_cpu_lane`], the lane timed alone) is the prior; the pipeline adds what that
//! fit cannot see (handing the job to the lane's threads, the products' way back to the stream, the stream's wait
//! for them) and what the two lanes do to each other (the link's copies slow down while the lane reads the same
//! memory). Pure arithmetic over observations; no clock, no device.
//!
//! The update rule. The CPU lane's cost stays the planner's line, `t = fixed + w * s`, in `w` one-row expert
//! equivalents (an expert used by `r` rows counts `1 + (r - 1) * row_cost`, the prior's row cost) and `s` seconds
//! per one-row expert. Each observation `(w, t)` (one layer's job and what it cost the pipeline) enters an
//! exponentially weighted least-squares fit: every new observation first multiplies the weight of all earlier ones
//! by `2^(-1 / OBSERVATION_HALF_LIFE)`, then joins with weight 1. The prior takes part as two fixed points on its
//! own line (at 1 and at [`PRIOR_SPAN`] experts, [`PRIOR_WEIGHT`] observations' weight together) that never decay:
//! before any observation the fit is the prior, with few it moves a little, and where observations cover only one
//! size (locality leaves about one miss a layer) they set the cost at that size while the prior keeps the slope
//! from being guessed. A fit whose slope is not positive keeps the prior's slope; one whose fixed cost would be
//! negative passes through the origin. The link's rate is an exponentially weighted ratio of bytes over seconds
//! with the same half-life, the prior counting as [`PRIOR_WEIGHT`] observations of its own rate.
//!
//! Since [`plan_split`] never plans a split that its rates predict slower than the link alone, a lane whose
//! calibrated cost exceeds the link's gets nothing, step by step.

use serde::Serialize;

use super::split::{CpuLaneCost, LaneRates};

/// Observations (layers the lane ran) after which one weighs half as much: about five decode steps of a 48-layer
/// model, so the fit follows a change of routing (prefill to decode, uniform to local) within a few tokens.
pub const OBSERVATION_HALF_LIFE: f64 = 256.0;
/// The prior's weight, in observations: enough that a few noisy layers cannot swing the split, little against the
/// ~370 observations' weight the decay settles at.
pub const PRIOR_WEIGHT: f64 = 8.0;
/// The prior's second point, in one-row expert equivalents (its first is at 1): a prefill step's share.
pub const PRIOR_SPAN: f64 = 16.0;

/// Weighted sums of `(x, y)` points for a least-squares line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Sums {
    weight: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Sums {
    fn add(&mut self, weight: f64, x: f64, y: f64) {
        self.weight += weight;
        self.x += weight * x;
        self.y += weight * y;
        self.xx += weight * x * x;
        self.xy += weight * x * y;
    }

    fn scale(&mut self, by: f64) {
        for sum in [&mut self.weight, &mut self.x, &mut self.y, &mut self.xx, &mut self.xy] {
            *sum *= by;
        }
    }

    fn plus(self, other: Sums) -> Sums {
        Sums {
            weight: self.weight + other.weight,
            x: self.x + other.x,
            y: self.y + other.y,
            xx: self.xx + other.xx,
            xy: self.xy + other.xy,
        }
    }
}

/// The planner's rates, refined by what the lanes cost in the pipeline (the module's doc says how).
#[derive(Clone, Debug, PartialEq)]
pub struct LaneCalibration {
    prior: LaneRates,
    /// Bytes of one expert: the lane's seconds per one-row expert are `bytes / cpu.bytes_per_s`.
    expert_bytes: f64,
    /// The prior's two points on its CPU line, in (one-row experts, seconds).
    prior_points: Sums,
    /// The decayed CPU observations.
    cpu: Sums,
    /// The decayed link observations: bytes and seconds.
    link_bytes: f64,
    link_seconds: f64,
    cpu_observations: u64,
    link_observations: u64,
}

impl LaneCalibration {
    /// Starts from `prior` (the startup or doctor fit) for experts of `expert_bytes`.
    pub fn new(prior: LaneRates, expert_bytes: usize) -> Self {
        let expert_bytes = expert_bytes.max(1) as f64;
        let seconds_per_expert = expert_bytes / prior.cpu.bytes_per_s;
        let mut prior_points = Sums::default();
        for w in [1.0, PRIOR_SPAN] {
            prior_points.add(PRIOR_WEIGHT / 2.0, w, prior.cpu.fixed_s + w * seconds_per_expert);
        }
        LaneCalibration {
            prior,
            expert_bytes,
            prior_points,
            cpu: Sums::default(),
            link_bytes: 0.0,
            link_seconds: 0.0,
            cpu_observations: 0,
            link_observations: 0,
        }
    }

    /// One layer's CPU lane job: the rows of each of its experts, and the seconds it cost the pipeline.
    pub fn observe_cpu(&mut self, rows: &[usize], seconds: f64) {
        if rows.is_empty() || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let w: f64 = rows
            .iter()
            .map(|&r| 1.0 + r.saturating_sub(1) as f64 * self.prior.cpu.row_cost)
            .sum();
        self.cpu.scale(decay());
        self.cpu.add(1.0, w, seconds);
        self.cpu_observations += 1;
    }

    /// One layer's copies over the link: `bytes` copied in `seconds` of the link's time.
    pub fn observe_link(&mut self, bytes: usize, seconds: f64) {
        if bytes == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        self.link_bytes = self.link_bytes * decay() + bytes as f64;
        self.link_seconds = self.link_seconds * decay() + seconds;
        self.link_observations += 1;
    }

    /// Layers observed so far: the CPU lane's jobs and the link's.
    pub fn observations(&self) -> (u64, u64) {
        (self.cpu_observations, self.link_observations)
    }

    /// The CPU lane's calibrated cost.
    pub fn cpu_cost(&self) -> CpuLaneCost {
        let s = self.prior_points.plus(self.cpu);
        let prior_slope = self.expert_bytes / self.prior.cpu.bytes_per_s;
        let spread = s.weight * s.xx - s.x * s.x;
        let mut slope = if spread > 0.0 {
            (s.weight * s.xy - s.x * s.y) / spread
        } else {
            prior_slope
        };
        if !(slope.is_finite() && slope > 0.0) {
            slope = prior_slope;
        }
        let mut fixed = (s.y - slope * s.x) / s.weight;
        if fixed < 0.0 {
            // Through the origin: the least-squares slope of a line without intercept, positive since every time
            // and every size is.
            fixed = 0.0;
            slope = s.xy / s.xx;
        }
        CpuLaneCost {
            fixed_s: fixed,
            bytes_per_s: self.expert_bytes / slope,
            row_cost: self.prior.cpu.row_cost,
        }
    }

    /// The link's calibrated rate, bytes per second.
    pub fn link_bytes_per_s(&self) -> f64 {
        let prior_seconds = self.expert_bytes / self.prior.link_bytes_per_s;
        (self.link_bytes + PRIOR_WEIGHT * self.expert_bytes) / (self.link_seconds + PRIOR_WEIGHT * prior_seconds)
    }

    /// The rates to plan the next step from.
    pub fn rates(&self) -> LaneRates {
        LaneRates {
            link_bytes_per_s: self.link_bytes_per_s(),
            cpu: self.cpu_cost(),
            gpu_bytes_per_s: self.prior.gpu_bytes_per_s,
        }
    }
}

/// A calibration's state as the offload's counters report it (`ferry bench`'s JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CalibratedRates {
    /// The CPU lane's fixed cost of a job and its cost per one-row expert, nanoseconds.
    pub cpu_fixed_ns: u64,
    pub cpu_ns_per_expert: u64,
    /// The link's time per expert, nanoseconds.
    pub link_ns_per_expert: u64,
    /// Layers observed: the CPU lane's jobs and the link's copies.
    pub cpu_observations: u64,
    pub link_observations: u64,
}

impl LaneCalibration {
    pub fn summary(&self) -> CalibratedRates {
        let cpu = self.cpu_cost();
        let ns = |seconds: f64| (seconds * 1e9).round() as u64;
        CalibratedRates {
            cpu_fixed_ns: ns(cpu.fixed_s),
            cpu_ns_per_expert: ns(self.expert_bytes / cpu.bytes_per_s),
            link_ns_per_expert: ns(self.expert_bytes / self.link_bytes_per_s()),
            cpu_observations: self.cpu_observations,
            link_observations: self.link_observations,
        }
    }
}

/// What an observation's weight is multiplied by when the next one arrives.
fn decay() -> f64 {
    (-std::f64::consts::LN_2 / OBSERVATION_HALF_LIFE).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::split::{plan_split, Miss, SplitRule};

    /// The prior the H200's startup fit gave (docs/perf.md, "The CPU lane"): 30 us fixed, 75.7 GB/s, +9 % a row;
    /// the link at 46.6 GB/s; q30's 9.4 MB experts.
    const PRIOR: LaneRates = LaneRates {
        link_bytes_per_s: 46.6e9,
        cpu: CpuLaneCost {
            fixed_s: 30e-6,
            bytes_per_s: 75.7e9,
            row_cost: 0.09,
        },
        gpu_bytes_per_s: 700e9,
    };
    const EXPERT: usize = 9_437_184;

    /// A seeded generator of floats in [0, 1).
    fn random(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    fn one_row_misses(n: usize) -> Vec<Miss> {
        (0..n as u32).map(|expert| Miss { expert, rows: 1 }).collect()
    }

    #[test]
    fn without_observations_the_rates_are_the_prior() {
        let calibration = LaneCalibration::new(PRIOR, EXPERT);
        let rates = calibration.rates();
        assert!((rates.cpu.fixed_s - PRIOR.cpu.fixed_s).abs() < 1e-12, "{rates:?}");
        assert!(
            (rates.cpu.bytes_per_s / PRIOR.cpu.bytes_per_s - 1.0).abs() < 1e-9,
            "{rates:?}"
        );
        assert!(
            (rates.link_bytes_per_s / PRIOR.link_bytes_per_s - 1.0).abs() < 1e-12,
            "{rates:?}"
        );
        assert_eq!(rates.cpu.row_cost, PRIOR.cpu.row_cost);
        assert_eq!(calibration.observations(), (0, 0));
        let summary = calibration.summary();
        assert_eq!((summary.cpu_fixed_ns, summary.cpu_ns_per_expert), (30_000, 124_666));
        assert_eq!(summary.link_ns_per_expert, 202_515);
    }

    /// Jobs of 1 to 16 one-row experts whose in-pipeline cost is 350 us + 9.4 MB at 60 GB/s each, 5 % noise: the
    /// fit converges on that line, far from the prior's.
    #[test]
    fn the_fit_converges_on_the_pipeline_cost() {
        let truth = CpuLaneCost {
            fixed_s: 350e-6,
            bytes_per_s: 60e9,
            row_cost: PRIOR.cpu.row_cost,
        };
        let mut calibration = LaneCalibration::new(PRIOR, EXPERT);
        let mut next = random(3);
        let mut errors = Vec::new();
        for _ in 0..4000 {
            let experts = 1 + (next() * 16.0) as usize;
            let rows = vec![1; experts];
            let seconds = truth.seconds(EXPERT, rows.iter().copied()) * (0.95 + 0.1 * next());
            calibration.observe_cpu(&rows, seconds);
            let fitted = calibration.cpu_cost();
            errors.push((fitted.fixed_s - truth.fixed_s).abs());
        }
        let fitted = calibration.cpu_cost();
        assert!((fitted.fixed_s - truth.fixed_s).abs() < 30e-6, "{fitted:?}");
        assert!(
            (fitted.bytes_per_s / truth.bytes_per_s - 1.0).abs() < 0.05,
            "{fitted:?}"
        );
        // The error shrinks as observations come: the first ten against the last thousand.
        let early = errors[..10].iter().sum::<f64>() / 10.0;
        let late = errors[3000..].iter().sum::<f64>() / 1000.0;
        assert!(late < early / 4.0, "early {early}, late {late}");
        assert_eq!(calibration.observations(), (4000, 0));
    }

    /// Many-row experts count by the prior's row cost: a job of experts used by 8 rows each costs what its
    /// one-row equivalents say, and the fit recovers the line from such jobs too.
    #[test]
    fn rows_count_as_the_prior_row_cost_says() {
        let truth = CpuLaneCost {
            fixed_s: 200e-6,
            bytes_per_s: 70e9,
            row_cost: PRIOR.cpu.row_cost,
        };
        let mut calibration = LaneCalibration::new(PRIOR, EXPERT);
        for i in 0..2000 {
            let rows = vec![1 + i % 8; 1 + i % 5];
            calibration.observe_cpu(&rows, truth.seconds(EXPERT, rows.iter().copied()));
        }
        let fitted = calibration.cpu_cost();
        let job = [8usize, 3, 1];
        let (want, got) = (
            truth.seconds(EXPERT, job.iter().copied()),
            fitted.seconds(EXPERT, job.iter().copied()),
        );
        assert!((got / want - 1.0).abs() < 0.02, "{got} against {want}: {fitted:?}");
    }

    /// The locality case of docs/perf.md: about one miss a layer, which the prior sends to the CPU (30 us + 0.125
    /// ms against the link's 0.2 ms) and which costs the pipeline 0.45 ms. After a few decode steps' observations
    /// of that one size the planner gives the lane nothing there, while an all-miss step still splits; the
    /// observations set the cost where they were taken, and the prior keeps the slope.
    #[test]
    fn a_lane_that_costs_more_than_the_link_gets_nothing() {
        let mut calibration = LaneCalibration::new(PRIOR, EXPERT);
        let one_miss = one_row_misses(1);
        let before = plan_split(SplitRule::Balanced(calibration.rates()), &one_miss, 7, EXPERT);
        assert_eq!(before.cpu, [0], "the prior takes the miss");
        let mut next = random(5);
        for _ in 0..200 {
            calibration.observe_cpu(&[1], 450e-6 * (0.9 + 0.2 * next()));
        }
        let rates = calibration.rates();
        let at_one = rates.cpu.seconds(EXPERT, [1]);
        assert!((at_one - 450e-6).abs() < 25e-6, "{rates:?}");
        let after = plan_split(SplitRule::Balanced(rates), &one_miss, 7, EXPERT);
        assert!(after.cpu.is_empty(), "{after:?}");
        // With two misses too the link alone is faster than any split by the calibrated cost.
        for n in 1..=2 {
            assert!(
                plan_split(SplitRule::Balanced(rates), &one_row_misses(n), 8 - n, EXPERT)
                    .cpu
                    .is_empty()
            );
        }
        let all_miss = plan_split(SplitRule::Balanced(rates), &one_row_misses(8), 0, EXPERT);
        assert!(!all_miss.cpu.is_empty(), "{all_miss:?}");
        // A lane whose every job costs more than a whole layer's copies gets nothing at all.
        for _ in 0..2000 {
            calibration.observe_cpu(&[1, 1, 1, 1], 5e-3);
            calibration.observe_cpu(&[1], 5e-3);
        }
        let rates = calibration.rates();
        for n in 1..=8 {
            assert!(plan_split(SplitRule::Balanced(rates), &one_row_misses(n), 0, EXPERT)
                .cpu
                .is_empty());
        }
    }

    /// Whatever the observations, the planned step is never slower than the link alone by the calibrated model.
    #[test]
    fn the_calibrated_split_never_loses_to_the_link_in_the_model() {
        let mut calibration = LaneCalibration::new(PRIOR, EXPERT);
        let mut next = random(11);
        for step in 0..3000 {
            let experts = 1 + (next() * 8.0) as usize;
            let rows: Vec<usize> = (0..experts).map(|_| 1 + (next() * 4.0) as usize).collect();
            calibration.observe_cpu(&rows, next() * 2e-3);
            calibration.observe_link(
                EXPERT * experts,
                experts as f64 * EXPERT as f64 / (30e9 + next() * 30e9),
            );
            if step % 10 != 0 {
                continue;
            }
            let rates = calibration.rates();
            let misses: Vec<Miss> = (0..experts as u32)
                .map(|expert| Miss {
                    expert,
                    rows: rows[expert as usize],
                })
                .collect();
            let hits = 8 - experts.min(8);
            let split = plan_split(SplitRule::Balanced(rates), &misses, hits, EXPERT);
            let alone = {
                let bytes = EXPERT as f64;
                (hits as f64 * bytes / rates.gpu_bytes_per_s).max(experts as f64 * bytes / rates.link_bytes_per_s)
                    + bytes / rates.gpu_bytes_per_s
            };
            assert!(
                split.cpu_s.max(split.gpu_s) <= alone * (1.0 + 1e-12),
                "{split:?} against {alone}"
            );
            assert!(rates.cpu.fixed_s >= 0.0 && rates.cpu.bytes_per_s > 0.0, "{rates:?}");
        }
    }

    /// The link under the lane achieved 44-49 GB/s where the doctor measured 46.6 alone-ish (docs/perf.md): the
    /// link's rate follows what its copies took, and ignores empty or broken observations.
    #[test]
    fn the_link_rate_follows_its_copies() {
        let mut calibration = LaneCalibration::new(PRIOR, EXPERT);
        for _ in 0..2000 {
            calibration.observe_link(3 * EXPERT, 3.0 * EXPERT as f64 / 40e9);
        }
        calibration.observe_link(0, 1.0);
        calibration.observe_link(EXPERT, 0.0);
        calibration.observe_link(EXPERT, f64::NAN);
        calibration.observe_cpu(&[], 1.0);
        calibration.observe_cpu(&[1], -1.0);
        assert!((calibration.link_bytes_per_s() / 40e9 - 1.0).abs() < 0.01);
        assert_eq!(calibration.observations(), (0, 2000));
        assert_eq!(calibration.cpu_cost(), LaneCalibration::new(PRIOR, EXPERT).cpu_cost());
    }
}
