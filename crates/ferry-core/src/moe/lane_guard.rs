//! `auto`'s guard: whether the CPU lane takes part in a decode step at all, chosen by what whole steps took with and
//! without it. The split planner's model ([`super::plan_split`], calibrated as it runs) prices each layer's lanes,
//! but not every cost the lane puts on a step (waking threads, the stream's wait for the host, the cores its
//! workers hold), and on the H200 that model gave the lane a share of steps that then ran at less than half the
//! link's speed. The guard needs no model: per batch size, an exponentially weighted mean of the step time of each
//! regime, the faster one run, the other tried again one step in [`EXPLORE_EVERY`] so that a change (another
//! routing, a busier host) is seen. Pure arithmetic over observations; no clock, no device.

/// Whether a decode step may give misses to the CPU lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// The split planner decides, the lane included.
    Lane,
    /// Every miss crosses the link.
    LinkOnly,
}

/// Steps of each regime measured, alternately, before the guard trusts its means.
pub const WARMUP_STEPS: u32 = 4;
/// One step in this many runs the regime that is not the faster, to follow changes.
pub const EXPLORE_EVERY: u32 = 64;
/// Observations of a regime after which one weighs half as much.
pub const HALF_LIFE: f64 = 8.0;

/// The decayed mean step time of one regime at one batch size.
#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    weight: f64,
    seconds: f64,
    observed: u32,
}

impl Mean {
    fn add(&mut self, seconds: f64) {
        let keep = 0.5f64.powf(1.0 / HALF_LIFE);
        self.seconds = self.seconds * self.weight * keep + seconds;
        self.weight = self.weight * keep + 1.0;
        self.seconds /= self.weight;
        self.observed = self.observed.saturating_add(1);
    }
}

/// Both regimes at one batch size, and the steps chosen there.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    lane: Mean,
    link: Mean,
    steps: u32,
}

impl Bucket {
    fn mean(&mut self, regime: Regime) -> &mut Mean {
        match regime {
            Regime::Lane => &mut self.lane,
            Regime::LinkOnly => &mut self.link,
        }
    }

    fn choose(&mut self) -> Regime {
        self.steps = self.steps.wrapping_add(1);
        let warmed = |m: &Mean| m.observed >= WARMUP_STEPS;
        if !warmed(&self.lane) || !warmed(&self.link) {
            // Alternate until both have their warm-up steps, the less observed first.
            return match self.lane.observed <= self.link.observed {
                true => Regime::Lane,
                false => Regime::LinkOnly,
            };
        }
        let faster = match self.lane.seconds < self.link.seconds {
            true => Regime::Lane,
            false => Regime::LinkOnly,
        };
        match (self.steps.is_multiple_of(EXPLORE_EVERY), faster) {
            (true, Regime::Lane) => Regime::LinkOnly,
            (true, Regime::LinkOnly) => Regime::Lane,
            (false, faster) => faster,
        }
    }
}

/// The guard, per decode batch size (rows).
#[derive(Clone, Debug, Default)]
pub struct LaneGuard {
    buckets: Vec<Bucket>,
}

impl LaneGuard {
    fn bucket(&mut self, rows: usize) -> &mut Bucket {
        if self.buckets.len() < rows {
            self.buckets.resize(rows, Bucket::default());
        }
        &mut self.buckets[rows.max(1) - 1]
    }

    /// The regime for the next decode step of `rows` rows.
    pub fn choose(&mut self, rows: usize) -> Regime {
        self.bucket(rows).choose()
    }

    /// A decode step of `rows` rows in `regime` took `seconds`.
    pub fn observe(&mut self, rows: usize, regime: Regime, seconds: f64) {
        if seconds.is_finite() && seconds > 0.0 {
            self.bucket(rows).mean(regime).add(seconds);
        }
    }

    /// The mean step seconds of each regime at `rows` rows (lane, link only), once observed.
    pub fn means(&self, rows: usize) -> Option<(f64, f64)> {
        let bucket = self.buckets.get(rows.max(1) - 1)?;
        (bucket.lane.observed > 0 && bucket.link.observed > 0).then_some((bucket.lane.seconds, bucket.link.seconds))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` decode steps of `rows` rows whose time in each regime `cost` gives; returns how many ran with
    /// the lane.
    fn run(guard: &mut LaneGuard, rows: usize, steps: u32, cost: impl Fn(Regime) -> f64) -> u32 {
        let mut with_lane = 0;
        for _ in 0..steps {
            let regime = guard.choose(rows);
            with_lane += u32::from(regime == Regime::Lane);
            guard.observe(rows, regime, cost(regime));
        }
        with_lane
    }

    /// The H200's q30 under locality, batch 1: 49.5 ms a step with the lane, 22.4 without.
    fn lane_slow(regime: Regime) -> f64 {
        match regime {
            Regime::Lane => 0.0495,
            Regime::LinkOnly => 0.0224,
        }
    }

    /// Uniform routing with the lane's startup split, batch 1: 47.6 ms with it, 58.8 without.
    fn lane_fast(regime: Regime) -> f64 {
        match regime {
            Regime::Lane => 0.0476,
            Regime::LinkOnly => 0.0588,
        }
    }

    #[test]
    fn a_lane_that_slows_steps_runs_only_to_be_measured_again() {
        let mut guard = LaneGuard::default();
        let with_lane = run(&mut guard, 1, 640, lane_slow);
        // The warm-up's 4, then one step in 64 (none of them among the warm-up's 8).
        assert_eq!(with_lane, WARMUP_STEPS + 640 / EXPLORE_EVERY);
        let (lane, link) = guard.means(1).unwrap();
        assert!(lane > link, "{lane} {link}");
    }

    #[test]
    fn a_lane_that_speeds_steps_up_runs_almost_always() {
        let mut guard = LaneGuard::default();
        let with_lane = run(&mut guard, 1, 640, lane_fast);
        let without = 640 - with_lane;
        assert_eq!(without, WARMUP_STEPS + 640 / EXPLORE_EVERY);
    }

    #[test]
    fn a_change_of_routing_is_followed_within_a_few_explorations() {
        let mut guard = LaneGuard::default();
        run(&mut guard, 1, 640, lane_slow);
        // The lane becomes the faster (uniform routing): a few explored steps outweigh the old mean.
        run(&mut guard, 1, 8 * EXPLORE_EVERY, lane_fast);
        let with_lane = run(&mut guard, 1, 2 * EXPLORE_EVERY, lane_fast);
        assert!(with_lane >= 2 * EXPLORE_EVERY - 2, "{with_lane}");
    }

    #[test]
    fn batch_sizes_are_measured_apart_and_bad_times_are_ignored() {
        let mut guard = LaneGuard::default();
        run(&mut guard, 1, 200, lane_slow);
        run(&mut guard, 4, 200, lane_fast);
        guard.observe(4, Regime::Lane, f64::NAN);
        guard.observe(4, Regime::Lane, -1.0);
        let (lane1, link1) = guard.means(1).unwrap();
        let (lane4, link4) = guard.means(4).unwrap();
        assert!(lane1 > link1 && lane4 < link4);
        assert_eq!(guard.means(2), None);
    }
}
