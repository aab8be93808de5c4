//! `auto`'s guard: how a decode step splits its misses, chosen by what whole steps took each way. The split
//! planner's model ([`super::plan_split`], calibrated as it runs) prices each layer's lanes, but not every cost the
//! lane puts on a step (waking threads, the stream's wait for the host, the cores its workers hold); on the H200 the
//! calibrated split gave the lane steps that ran at less than half the link's speed under locality, and too little
//! of uniform steps, where the startup rates' split ran 24 % faster than the link alone. The guard needs no model:
//! per batch size, an exponentially weighted mean of the step time of each [`Regime`]; the fastest runs, and each
//! other one is tried again one step in [`EXPLORE_EVERY`], so that a change (another routing, a busier host) is
//! seen. Pure arithmetic over observations; no clock, no device.

/// How a decode step's misses are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// By the planner on the calibrated rates.
    Calibrated,
    /// By the planner on the startup (or `ferry doctor`) rates alone, as `hybrid` does.
    Startup,
    /// Every miss crosses the link.
    LinkOnly,
}

const REGIMES: [Regime; 3] = [Regime::Calibrated, Regime::Startup, Regime::LinkOnly];

/// Steps of each regime measured, in turn, before the guard trusts its means.
pub const WARMUP_STEPS: u32 = 4;
/// One step in this many runs a regime that is not the fastest (each in turn), to follow changes.
pub const EXPLORE_EVERY: u32 = 32;
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
        self.seconds = (self.seconds * self.weight * keep + seconds) / (self.weight * keep + 1.0);
        self.weight = self.weight * keep + 1.0;
        self.observed = self.observed.saturating_add(1);
    }
}

/// Every regime at one batch size, and the steps chosen there.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    means: [Mean; 3],
    steps: u32,
    explored: u32,
}

impl Bucket {
    fn choose(&mut self) -> Regime {
        self.steps = self.steps.wrapping_add(1);
        // Each regime's warm-up first, the least observed first.
        let least = (0..REGIMES.len()).min_by_key(|&i| self.means[i].observed).unwrap_or(0);
        if self.means[least].observed < WARMUP_STEPS {
            return REGIMES[least];
        }
        let fastest = (0..REGIMES.len())
            .min_by(|&a, &b| self.means[a].seconds.total_cmp(&self.means[b].seconds))
            .unwrap_or(0);
        if !self.steps.is_multiple_of(EXPLORE_EVERY) {
            return REGIMES[fastest];
        }
        // The others in turn.
        self.explored = self.explored.wrapping_add(1);
        let others: Vec<usize> = (0..REGIMES.len()).filter(|&i| i != fastest).collect();
        REGIMES[others[self.explored as usize % others.len()]]
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
            let at = REGIMES.iter().position(|&r| r == regime).unwrap_or(0);
            self.bucket(rows).means[at].add(seconds);
        }
    }

    /// The mean step seconds of `regime` at `rows` rows, once observed.
    pub fn mean(&self, rows: usize, regime: Regime) -> Option<f64> {
        let bucket = self.buckets.get(rows.max(1) - 1)?;
        let mean = bucket.means[REGIMES.iter().position(|&r| r == regime)?];
        (mean.observed > 0).then_some(mean.seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` decode steps of `rows` rows whose time in each regime `cost` gives; returns how many ran in
    /// each regime (calibrated, startup, link only).
    fn run(guard: &mut LaneGuard, rows: usize, steps: u32, cost: impl Fn(Regime) -> f64) -> [u32; 3] {
        let mut ran = [0; 3];
        for _ in 0..steps {
            let regime = guard.choose(rows);
            ran[REGIMES.iter().position(|&r| r == regime).unwrap()] += 1;
            guard.observe(rows, regime, cost(regime));
        }
        ran
    }

    /// q30 on the H200 under locality, batch 1: auto (calibrated) 20.2 tok/s, hybrid (startup) 32.9, offload 44.7.
    fn locality(regime: Regime) -> f64 {
        match regime {
            Regime::Calibrated => 1.0 / 20.2,
            Regime::Startup => 1.0 / 32.9,
            Regime::LinkOnly => 1.0 / 44.7,
        }
    }

    /// The same under uniform routing: 15.9, 21.0 and 17.0 tok/s.
    fn uniform(regime: Regime) -> f64 {
        match regime {
            Regime::Calibrated => 1.0 / 15.9,
            Regime::Startup => 1.0 / 21.0,
            Regime::LinkOnly => 1.0 / 17.0,
        }
    }

    /// Steps that explore, after the warm-up, in `steps` steps.
    fn explorations(steps: u32) -> u32 {
        (3 * WARMUP_STEPS + 1..=steps)
            .filter(|s| s.is_multiple_of(EXPLORE_EVERY))
            .count() as u32
    }

    #[test]
    fn the_fastest_regime_runs_and_the_others_only_to_be_measured_again() {
        for (cost, fastest) in [(locality as fn(Regime) -> f64, 2), (uniform, 1)] {
            let mut guard = LaneGuard::default();
            let ran = run(&mut guard, 1, 640, cost);
            let slower: u32 = (0..3).filter(|&i| i != fastest).map(|i| ran[i]).sum();
            assert_eq!(slower, 2 * WARMUP_STEPS + explorations(640), "{ran:?}");
            assert!(ran[fastest] > 600, "{ran:?}");
        }
    }

    #[test]
    fn a_change_of_routing_is_followed() {
        let mut guard = LaneGuard::default();
        run(&mut guard, 1, 640, locality);
        // Uniform routing from here: the link-only steps slow down until the startup split is the faster.
        run(&mut guard, 1, 4 * EXPLORE_EVERY, uniform);
        let ran = run(&mut guard, 1, 4 * EXPLORE_EVERY, uniform);
        assert!(ran[1] >= 4 * EXPLORE_EVERY - 4, "{ran:?}");
    }

    #[test]
    fn batch_sizes_are_measured_apart_and_bad_times_are_ignored() {
        let mut guard = LaneGuard::default();
        run(&mut guard, 1, 200, locality);
        run(&mut guard, 4, 200, uniform);
        guard.observe(4, Regime::Startup, f64::NAN);
        guard.observe(4, Regime::Startup, -1.0);
        let mean = |rows, regime| guard.mean(rows, regime).unwrap();
        assert!(mean(1, Regime::LinkOnly) < mean(1, Regime::Startup));
        assert!(mean(4, Regime::Startup) < mean(4, Regime::LinkOnly));
        assert!((mean(4, Regime::Startup) - 1.0 / 21.0).abs() < 1e-12);
        assert_eq!(guard.mean(2, Regime::LinkOnly), None);
    }
}
