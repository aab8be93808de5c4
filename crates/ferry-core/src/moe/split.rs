//! The split planner: for one MoE layer and step, which missing experts the host computes (the CPU lane) and which
//! cross the link to the GPU, so that both lanes finish together. Pure arithmetic over a cost model, no device.
//!
//! The model. Every miss costs the link the same (`bytes / link_bytes_per_s`), and the link's copies run one after
//! another while the GPU computes the hits, so the GPU lane ends at `max(hits, copies) + one expert's compute`
//! (the last copy's work starts when it lands). The CPU lane reads each of its experts once, whatever its rows,
//! but does `rows` times the arithmetic: an expert used by `r` rows costs `bytes / cpu_bytes_per_s * (1 +
//! (r - 1) * row_cost)`, and the lane's experts run one after another on all its threads, plus a fixed cost per
//! layer (waking the threads, the phases' barriers, the rows down and the products up). All three CPU terms are
//! measured ([`fit_cpu_lane`] over timed calls of a few sizes). Since every miss costs the link the same and the CPU
//! less the fewer rows use it, the best split sends a prefix of the misses ordered by rows (fewest first) to the
//! CPU: the planner sorts once and tries every prefix length, O(misses log misses), keeping the one whose later
//! lane ends first (the shorter prefix on a tie). Zero misses on the CPU is one of the candidates, so a step the
//! CPU would finish after the link alone gives the CPU nothing: by the model a split is never slower than the link
//! alone, and `hybrid` and `auto` degrade to offload step by step.

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
    /// The CPU lane's measured cost ([`fit_cpu_lane`]).
    pub cpu: CpuLaneCost,
    /// The GPU's rate over resident expert weights, bytes per second (how long the hits take).
    pub gpu_bytes_per_s: f64,
}

/// What the CPU lane costs, fitted from timed calls: `fixed_s + experts * bytes / bytes_per_s * (1 + (rows - 1) *
/// row_cost)` for a call of `experts` experts of `bytes` each used by `rows` rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuLaneCost {
    /// Seconds a call costs whatever it computes (waking the threads, the phases' barriers).
    pub fixed_s: f64,
    /// The lane's rate over one-row experts beyond the fixed cost, bytes of expert weights per second.
    pub bytes_per_s: f64,
    /// Each row beyond the first adds this share of an expert's one-row time (the arithmetic of a row against a
    /// read).
    pub row_cost: f64,
}

impl CpuLaneCost {
    /// Seconds the lane takes for experts of `bytes` used by `rows` rows each.
    pub fn seconds(&self, bytes: usize, rows: impl IntoIterator<Item = usize>) -> f64 {
        let one_row_s = bytes as f64 / self.bytes_per_s;
        self.fixed_s
            + rows
                .into_iter()
                .map(|r| one_row_s * (1.0 + r.saturating_sub(1) as f64 * self.row_cost))
                .sum::<f64>()
    }
}

/// One timed call of the CPU lane: `experts` experts, each used by `rows` rows, took `seconds`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LanePoint {
    pub experts: usize,
    pub rows: usize,
    pub seconds: f64,
}

/// The CPU lane's cost fitted to timed calls of experts `bytes` large: a least-squares line through the one-row
/// points (time against experts) gives the fixed cost (its intercept, at least 0) and the rate (its slope); each
/// many-row point then gives the row cost, and their mean is kept. `None` without one-row points at two expert
/// counts or with a slope that is not positive (timings too noisy to use).
pub fn fit_cpu_lane(points: &[LanePoint], bytes: usize) -> Option<CpuLaneCost> {
    let one_row: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.rows == 1)
        .map(|p| (p.experts as f64, p.seconds))
        .collect();
    let n = one_row.len() as f64;
    let mean_x = one_row.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = one_row.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = one_row.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = one_row.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    if one_row.len() < 2 || sxx <= 0.0 || sxy <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let fixed_s = (mean_y - slope * mean_x).max(0.0);
    let row_costs: Vec<f64> = points
        .iter()
        .filter(|p| p.rows > 1)
        .map(|p| {
            let reads = p.experts as f64 * slope;
            ((p.seconds - fixed_s - reads) / (reads * (p.rows - 1) as f64)).max(0.0)
        })
        .collect();
    let row_cost = if row_costs.is_empty() {
        0.0
    } else {
        row_costs.iter().sum::<f64>() / row_costs.len() as f64
    };
    Some(CpuLaneCost {
        fixed_s,
        bytes_per_s: bytes as f64 / slope,
        row_cost,
    })
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
    /// The planner's split by rates that the offload refines as it runs ([`super::LaneCalibration`], these the
    /// prior): what it costs each lane inside the pipeline, measured layer by layer. Planned from the rates given
    /// here, as `Balanced`; the offload hands over its calibrated ones.
    Calibrated(LaneRates),
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
        SplitRule::Balanced(rates) | SplitRule::Calibrated(rates) => {
            let one_row_s = bytes as f64 / rates.cpu.bytes_per_s;
            let bytes = bytes as f64;
            let hits_s = hits as f64 * bytes / rates.gpu_bytes_per_s;
            let gpu_s = |copies: usize| {
                if copies == 0 {
                    hits_s
                } else {
                    hits_s.max(copies as f64 * bytes / rates.link_bytes_per_s) + bytes / rates.gpu_bytes_per_s
                }
            };
            let (mut best, mut best_s): (usize, (f64, f64)) = (0, (0.0, gpu_s(order.len())));
            let mut cpu_s = rates.cpu.fixed_s;
            for (n, miss) in order.iter().enumerate() {
                cpu_s += one_row_s * (1.0 + miss.rows.saturating_sub(1) as f64 * rates.cpu.row_cost);
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

    /// q30 on the H200 as `ferry doctor` measured it (docs/perf.md, "The CPU lane"): 9.4 MB experts, the link at
    /// 46.6 GB/s and the lane at 75.7 GB/s at once, +9 % a row, and the lane's fixed cost of a layer found there
    /// (0.2 ms); 700 GB/s over resident experts.
    const H200: LaneRates = LaneRates {
        link_bytes_per_s: 46.6e9,
        cpu: CpuLaneCost {
            fixed_s: 200e-6,
            bytes_per_s: 75.7e9,
            row_cost: 0.09,
        },
        gpu_bytes_per_s: 700e9,
    };
    const EXPERT: usize = 9_437_184;

    fn misses(rows: &[usize]) -> Vec<Miss> {
        rows.iter()
            .enumerate()
            .map(|(e, &rows)| Miss { expert: e as u32, rows })
            .collect()
    }

    /// A seeded generator of integers below its argument.
    fn random(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut state = seed;
        move |n| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        }
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
            rates.cpu.fixed_s
                + on_cpu
                    .iter()
                    .map(|m| b / rates.cpu.bytes_per_s * (1.0 + (m.rows - 1) as f64 * rates.cpu.row_cost))
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
        let mut next = random(7);
        for _ in 0..200 {
            let n = 1 + next(10) as usize;
            let rows: Vec<usize> = (0..n).map(|_| 1 + next(12) as usize).collect();
            let hits = next(8) as usize;
            let rates = LaneRates {
                link_bytes_per_s: (10 + next(60)) as f64 * 1e9,
                cpu: CpuLaneCost {
                    fixed_s: next(400) as f64 * 1e-6,
                    bytes_per_s: (10 + next(100)) as f64 * 1e9,
                    row_cost: next(40) as f64 / 100.0,
                },
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
        // Batch 1, 8 misses of one row each: the lane's 75.7 GB/s against the link's 46.6 takes about half, less
        // its fixed cost.
        let link_only = lane_times(H200, &misses(&[1; 8]), &[], 0).1;
        let split = plan_split(SplitRule::Balanced(H200), &misses(&[1; 8]), 0, EXPERT);
        assert!((3..=5).contains(&split.cpu.len()), "{split:?}");
        assert!(
            split.cpu_s.max(split.gpu_s) < 0.55 * link_only,
            "{split:?} against {link_only}"
        );
        // A prefill step: the few-row experts go to the CPU, the many-row ones over the link.
        let rows = [40, 1, 2, 60, 1, 3, 50, 45];
        let split = plan_split(SplitRule::Balanced(H200), &misses(&rows), 0, EXPERT);
        assert_eq!(split.cpu, [1, 4, 2, 5]);
    }

    #[test]
    fn one_miss_under_locality_stays_on_the_link() {
        // The locality trace leaves about one miss a layer beside 7 hits: the lane's fixed cost plus the expert
        // (0.32 ms) would finish after the link's copy (0.2 ms), so the CPU gets nothing and the step is offload's.
        for rows in 1..=4 {
            let split = plan_split(SplitRule::Balanced(H200), &misses(&[rows]), 7, EXPERT);
            assert!(split.cpu.is_empty(), "{rows} rows: {split:?}");
            assert!(split.cpu_s <= split.gpu_s);
        }
        // Without the fixed cost (the first planner's 30 us) it took the miss, and lost to the link.
        let cheap = LaneRates {
            cpu: CpuLaneCost {
                fixed_s: 30e-6,
                ..H200.cpu
            },
            ..H200
        };
        let split = plan_split(SplitRule::Balanced(cheap), &misses(&[1]), 7, EXPERT);
        assert_eq!(split.cpu, [0]);
        let (real_cpu_s, _) = lane_times(H200, &misses(&[1]), &split.cpu, 7);
        assert!(real_cpu_s > lane_times(H200, &misses(&[1]), &[], 7).1);
    }

    /// Item 5 of issue 13: a 75-token prompt under uniform routing (top 8 of 128 experts, q30), a layer whose 32 of
    /// 128 cached experts (1536 slots over 48 layers) hit as chance has it. The model sends the experts few tokens
    /// use to the CPU and streams the rest; its predicted prefill of 48 such layers is what TTFT's MoE part costs.
    #[test]
    fn a_short_prompt_sends_its_rarely_used_experts_to_the_cpu() {
        let mut next = random(13);
        let mut routed: Vec<u32> = Vec::new();
        for _ in 0..75 {
            let mut token: Vec<u32> = Vec::new();
            while token.len() < 8 {
                let e = next(128) as u32;
                if !token.contains(&e) {
                    token.push(e);
                }
            }
            routed.extend(token);
        }
        let (misses, hits): (Vec<Miss>, Vec<Miss>) = rows_per_expert(&routed).into_iter().partition(|m| m.expert >= 32);
        let split = plan_split(SplitRule::Balanced(H200), &misses, hits.len(), EXPERT);
        let link_only = lane_times(H200, &misses, &[], hits.len()).1;
        let planned = split.cpu_s.max(split.gpu_s);
        let rows_of = |e: u32| misses.iter().find(|m| m.expert == e).map_or(0, |m| m.rows);
        let cpu_most = split.cpu.iter().map(|&e| rows_of(e)).max().unwrap_or(0);
        let link_least = misses
            .iter()
            .filter(|m| !split.cpu.contains(&m.expert))
            .map(|m| m.rows)
            .min()
            .unwrap_or(usize::MAX);
        eprintln!(
            "75 tokens: {} misses ({} rows at most), {} hits; the CPU takes {} (<= {cpu_most} rows); a layer {:.2} ms \
             against {:.2} ms over the link alone; 48 layers {:.3} s against {:.3} s",
            misses.len(),
            misses.iter().map(|m| m.rows).max().unwrap_or(0),
            hits.len(),
            split.cpu.len(),
            planned * 1e3,
            link_only * 1e3,
            48.0 * planned,
            48.0 * link_only
        );
        assert!(cpu_most <= link_least, "the CPU's experts are the fewest-row ones");
        assert!(split.cpu.len() * 3 >= misses.len(), "{split:?}");
        assert!(planned < 0.55 * link_only, "{planned} against {link_only}");
    }

    #[test]
    fn the_fit_recovers_the_cost_it_was_timed_at() {
        let cost = CpuLaneCost {
            fixed_s: 180e-6,
            bytes_per_s: 80e9,
            row_cost: 0.08,
        };
        let point = |experts: usize, rows: usize| LanePoint {
            experts,
            rows,
            seconds: cost.seconds(EXPERT, std::iter::repeat_n(rows, experts)),
        };
        let mut points: Vec<LanePoint> = [1, 2, 4, 8, 16, 32].iter().map(|&e| point(e, 1)).collect();
        points.extend([point(16, 8), point(8, 4)]);
        let fitted = fit_cpu_lane(&points, EXPERT).unwrap();
        assert!((fitted.fixed_s - cost.fixed_s).abs() < 1e-9, "{fitted:?}");
        assert!((fitted.bytes_per_s / cost.bytes_per_s - 1.0).abs() < 1e-9, "{fitted:?}");
        assert!((fitted.row_cost - cost.row_cost).abs() < 1e-9, "{fitted:?}");
        // Noise of a few percent moves the fit a little, not the split's order of magnitude.
        for (i, p) in points.iter_mut().enumerate() {
            p.seconds *= if i % 2 == 0 { 1.03 } else { 0.97 };
        }
        let noisy = fit_cpu_lane(&points, EXPERT).unwrap();
        assert!((noisy.fixed_s - cost.fixed_s).abs() < 60e-6, "{noisy:?}");
        assert!((noisy.bytes_per_s / cost.bytes_per_s - 1.0).abs() < 0.1, "{noisy:?}");
        // A call slower with more experts is needed at two sizes at least.
        assert_eq!(fit_cpu_lane(&points[..1], EXPERT), None);
        let flat = [1, 8].map(|experts| LanePoint {
            experts,
            rows: 1,
            seconds: 1e-3,
        });
        assert_eq!(fit_cpu_lane(&flat, EXPERT), None);
    }

    #[test]
    fn fixed_rules_and_row_counts() {
        let m = misses(&[3, 1, 2, 1]);
        assert!(plan_split(SplitRule::Link, &m, 0, EXPERT).cpu.is_empty());
        assert_eq!(plan_split(SplitRule::Cpu, &m, 0, EXPERT).cpu, [1, 3, 2, 0]);
        assert_eq!(plan_split(SplitRule::Share(0.5), &m, 0, EXPERT).cpu, [1, 3]);
        assert_eq!(plan_split(SplitRule::Share(2.0), &m, 0, EXPERT).cpu.len(), 4);
        assert_eq!(
            plan_split(SplitRule::Calibrated(H200), &m, 0, EXPERT),
            plan_split(SplitRule::Balanced(H200), &m, 0, EXPERT)
        );
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
