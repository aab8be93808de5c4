//! The split planner: for one MoE layer and step, which missing experts the host computes (the CPU lane) and which
//! cross the link to the GPU, so that both lanes finish together. Pure arithmetic over a cost model, no device.
//!
//! The model. Every miss costs the link the same (`bytes / link_bytes_per_s`), and the link's copies run one after
//! another while the GPU computes the hits, so the GPU lane ends at `max(hits, copies) + one expert's compute`
//! (the last copy's work starts when it lands). The CPU lane reads each of its experts once, whatever its rows,
//! but does `rows` times the arithmetic: an expert used by `r` rows costs `bytes / cpu_bytes_per_s * (1 +
//! (r - 1) * row_cost)`, and the lane's experts run one after another on all its threads, plus a fixed cost per
//! layer (moving the rows and the products across). Since every miss costs the link the same and the CPU less the
//! fewer rows use it, the best split sends a prefix of the misses ordered by rows (fewest first) to the CPU: the
//! planner sorts once and tries every prefix length, O(misses log misses), keeping the one whose later lane ends
//! first (the shorter prefix on a tie). Zero misses on the CPU is one of the candidates, so by the model a split
//! is never slower than the link alone.

use std::collections::HashMap;

/// What one missing expert costs: its id and the rows (tokens of the batch) routed to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Miss {
    pub expert: u32,
    pub rows: usize,
}

/// The measured rates the split is planned from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaneRates {
    /// Host-to-device copy rate of the link, bytes per second.
    pub link_bytes_per_s: f64,
    /// The CPU lane's rate at one row per expert, bytes of expert weights per second.
    pub cpu_bytes_per_s: f64,
    /// Each row beyond the first adds this share of the one-row time (the arithmetic of a row against a read).
    pub cpu_row_cost: f64,
    /// Seconds the lane adds to a layer whenever it takes any expert (rows down, products up, the wake-up).
    pub cpu_fixed_s: f64,
    /// The GPU's rate over resident expert weights, bytes per second (how long the hits take).
    pub gpu_bytes_per_s: f64,
}

/// Who computes the misses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SplitRule {
    /// Every miss crosses the link (offload only).
    Link,
    /// Every miss is computed on the host.
    Cpu,
    /// The planner's split by the rates.
    Balanced(LaneRates),
    /// This share of the misses (rounded down), the fewest-row ones, goes to the CPU whatever the rates: for tests
    /// that must exercise both lanes.
    Share(f64),
}

/// One layer's split, and the lanes' predicted times.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Split {
    /// The misses the CPU computes, fewest rows first.
    pub cpu: Vec<u32>,
    /// Predicted seconds of each lane (0 for rules without rates).
    pub cpu_s: f64,
    pub gpu_s: f64,
}

/// Splits `misses` of one layer's step whose `hits` experts are already on the GPU, each expert `bytes` large.
pub fn plan_split(rule: SplitRule, misses: &[Miss], hits: usize, bytes: usize) -> Split {
    let mut order: Vec<Miss> = misses.to_vec();
    order.sort_by_key(|m| (m.rows, m.expert));
    let take = |n: usize| order[..n].iter().map(|m| m.expert).collect();
    match rule {
        SplitRule::Link => Split::default(),
        SplitRule::Cpu => Split {
            cpu: take(order.len()),
            ..Split::default()
        },
        SplitRule::Share(share) => Split {
            cpu: take(((order.len() as f64 * share.clamp(0.0, 1.0)) as usize).min(order.len())),
            ..Split::default()
        },
        SplitRule::Balanced(rates) => {
            let bytes = bytes as f64;
            let one_row_s = bytes / rates.cpu_bytes_per_s;
            let hits_s = hits as f64 * bytes / rates.gpu_bytes_per_s;
            let gpu_s = |copies: usize| {
                if copies == 0 {
                    hits_s
                } else {
                    hits_s.max(copies as f64 * bytes / rates.link_bytes_per_s) + bytes / rates.gpu_bytes_per_s
                }
            };
            let (mut best, mut best_s): (usize, (f64, f64)) = (0, (0.0, gpu_s(order.len())));
            let mut cpu_s = rates.cpu_fixed_s;
            for (n, miss) in order.iter().enumerate() {
                cpu_s += one_row_s * (1.0 + miss.rows.saturating_sub(1) as f64 * rates.cpu_row_cost);
                let times = (cpu_s, gpu_s(order.len() - n - 1));
                if times.0.max(times.1) < best_s.0.max(best_s.1) {
                    (best, best_s) = (n + 1, times);
                }
            }
            Split {
                cpu: take(best),
                cpu_s: best_s.0,
                gpu_s: best_s.1,
            }
        }
    }
}

/// The rows each distinct expert of `routed` (a step's ids, any order) is used by, in first-routed order.
pub fn rows_per_expert(routed: &[u32]) -> Vec<Miss> {
    let mut index: HashMap<u32, usize> = HashMap::new();
    let mut counts: Vec<Miss> = Vec::new();
    for &expert in routed {
        let at = *index.entry(expert).or_insert_with(|| {
            counts.push(Miss { expert, rows: 0 });
            counts.len() - 1
        });
        counts[at].rows += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// q30 on the H200: 9.4 MB experts, a 55 GB/s link, a 68 GB/s lane, 700 GB/s over resident experts.
    const H200: LaneRates = LaneRates {
        link_bytes_per_s: 55e9,
        cpu_bytes_per_s: 68e9,
        cpu_row_cost: 0.05,
        cpu_fixed_s: 20e-6,
        gpu_bytes_per_s: 700e9,
    };
    const EXPERT: usize = 9_437_184;

    fn misses(rows: &[usize]) -> Vec<Miss> {
        rows.iter()
            .enumerate()
            .map(|(e, &rows)| Miss { expert: e as u32, rows })
            .collect()
    }

    /// The best split found by trying every subset, for a handful of misses.
    fn brute_force(rates: LaneRates, misses: &[Miss], hits: usize) -> f64 {
        (0..1u32 << misses.len())
            .map(|mask| {
                let cpu: Vec<u32> = (0..misses.len())
                    .filter(|i| mask & (1 << i) != 0)
                    .map(|i| misses[i].expert)
                    .collect();
                let (cpu_s, gpu_s) = lane_times(rates, misses, &cpu, hits);
                cpu_s.max(gpu_s)
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Both lanes' times for a given set of CPU experts, written out from the model's description.
    fn lane_times(rates: LaneRates, misses: &[Miss], cpu: &[u32], hits: usize) -> (f64, f64) {
        let b = EXPERT as f64;
        let on_cpu: Vec<&Miss> = misses.iter().filter(|m| cpu.contains(&m.expert)).collect();
        let copies = misses.len() - on_cpu.len();
        let cpu_s = if on_cpu.is_empty() {
            0.0
        } else {
            rates.cpu_fixed_s
                + on_cpu
                    .iter()
                    .map(|m| b / rates.cpu_bytes_per_s * (1.0 + (m.rows - 1) as f64 * rates.cpu_row_cost))
                    .sum::<f64>()
        };
        let hits_s = hits as f64 * b / rates.gpu_bytes_per_s;
        let gpu_s = if copies == 0 {
            hits_s
        } else {
            hits_s.max(copies as f64 * b / rates.link_bytes_per_s) + b / rates.gpu_bytes_per_s
        };
        (cpu_s, gpu_s)
    }

    #[test]
    fn balanced_split_is_optimal_against_every_subset() {
        let mut state = 7u64;
        let mut next = |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        for _ in 0..200 {
            let n = 1 + next(10) as usize;
            let rows: Vec<usize> = (0..n).map(|_| 1 + next(12) as usize).collect();
            let hits = next(8) as usize;
            let rates = LaneRates {
                link_bytes_per_s: (10 + next(60)) as f64 * 1e9,
                cpu_bytes_per_s: (10 + next(100)) as f64 * 1e9,
                cpu_row_cost: next(40) as f64 / 100.0,
                ..H200
            };
            let misses = misses(&rows);
            let split = plan_split(SplitRule::Balanced(rates), &misses, hits, EXPERT);
            let (cpu_s, gpu_s) = lane_times(rates, &misses, &split.cpu, hits);
            assert!((cpu_s - split.cpu_s).abs() < 1e-12 && (gpu_s - split.gpu_s).abs() < 1e-12);
            let best = brute_force(rates, &misses, hits);
            assert!(
                cpu_s.max(gpu_s) <= best * (1.0 + 1e-12),
                "{rows:?}, {hits} hits: planned {cpu_s} / {gpu_s}, best {best}"
            );
            // Never slower than the link alone.
            assert!(cpu_s.max(gpu_s) <= lane_times(rates, &misses, &[], hits).1 * (1.0 + 1e-12));
        }
    }

    #[test]
    fn decode_on_the_h200_splits_about_evenly_and_wide_experts_stay_on_the_link() {
        // Batch 1, 8 misses of one row each: the lane's 68 GB/s against the link's 55 takes a bit over half.
        let split = plan_split(SplitRule::Balanced(H200), &misses(&[1; 8]), 0, EXPERT);
        assert_eq!(split.cpu.len(), 4, "{split:?}");
        assert!(split.cpu_s.max(split.gpu_s) < 8.0 * EXPERT as f64 / 55e9 * 0.6);
        // A prefill step: the few-row experts go to the CPU, the many-row ones over the link.
        let rows = [40, 1, 2, 60, 1, 3, 50, 45];
        let split = plan_split(SplitRule::Balanced(H200), &misses(&rows), 0, EXPERT);
        assert_eq!(split.cpu, [1, 4, 2, 5]);
    }

    #[test]
    fn a_slow_lane_takes_nothing_and_a_slow_link_everything() {
        let slow_cpu = LaneRates {
            cpu_bytes_per_s: 1e9,
            ..H200
        };
        let split = plan_split(SplitRule::Balanced(slow_cpu), &misses(&[1; 8]), 2, EXPERT);
        assert!(split.cpu.is_empty(), "{split:?}");
        let slow_link = LaneRates {
            link_bytes_per_s: 1e9,
            ..H200
        };
        let split = plan_split(SplitRule::Balanced(slow_link), &misses(&[1; 8]), 2, EXPERT);
        assert_eq!(split.cpu.len(), 8);
        // The hits alone take longer than the whole CPU share would: the lane still takes the misses.
        let split = plan_split(SplitRule::Balanced(H200), &misses(&[1; 2]), 500, EXPERT);
        assert_eq!(split.cpu.len(), 2);
    }

    #[test]
    fn fixed_rules_and_row_counts() {
        let m = misses(&[3, 1, 2, 1]);
        assert!(plan_split(SplitRule::Link, &m, 0, EXPERT).cpu.is_empty());
        assert_eq!(plan_split(SplitRule::Cpu, &m, 0, EXPERT).cpu, [1, 3, 2, 0]);
        assert_eq!(plan_split(SplitRule::Share(0.5), &m, 0, EXPERT).cpu, [1, 3]);
        assert_eq!(plan_split(SplitRule::Share(2.0), &m, 0, EXPERT).cpu.len(), 4);
        assert_eq!(
            rows_per_expert(&[5, 2, 5, 7, 2, 5]),
            [
                Miss { expert: 5, rows: 3 },
                Miss { expert: 2, rows: 2 },
                Miss { expert: 7, rows: 1 }
            ]
        );
    }
}
