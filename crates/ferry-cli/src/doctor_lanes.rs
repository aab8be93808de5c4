//! `--moe-strategy offload|hybrid|cpu|auto`: who computes the experts the GPU cache misses, and the measured lane
//! rates the split is planned from. `ferry doctor` measures the link and the CPU lane at once (the lane's fixed
//! cost, rate and row cost fitted from calls of several sizes) and writes them to a small JSON file under the
//! user's cache directory, one entry per host and GPU; `hybrid` and `auto` read it, and without an entry for this
//! machine (or with one written before the lane's cost was fitted) measure briefly at startup. Either way the
//! planner splits each step by the measured cost, so both degrade to `offload` on the steps the lane cannot
//! speed up. `hybrid` plans from that measurement alone; `auto` takes it as the prior of the offload's online
//! calibration (`moe::LaneCalibration`), which refines it by what each lane costs inside the pipeline as the
//! engine runs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferry_core::backend::cuda::LaneCeilings;
use ferry_core::moe::{plan_split, LaneRates, Miss, SplitRule};

/// Who computes the routed experts that are not in the GPU cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum MoeStrategy {
    /// Every miss is copied to the GPU over the link (PCIe).
    #[default]
    Offload,
    /// Each step's misses split between the link and the CPU lane by the rates measured at startup (or by
    /// `ferry doctor`), so both finish together; a step the lane would not speed up runs as `offload`.
    Hybrid,
    /// Every miss is computed on the host: nothing crosses the link for experts.
    Cpu,
    /// The split step by step, planned from rates calibrated as the engine runs (what each lane costs inside
    /// the pipeline, the startup measurement the prior), where that prior gives the CPU lane a share of a batch-1
    /// decode or of a short prompt's prefill on this machine; else `offload`, without starting the lane's threads.
    /// Each decode step splits its misses on the calibrated rates, on the startup ones (as `hybrid`) or not at
    /// all (as `offload`), whichever whole steps measure fastest (a guard that tries the others one step in 32).
    Auto,
}

/// The strategy's flag, for the commands that run a model.
#[derive(clap::Args, Clone, Debug)]
pub struct StrategyArgs {
    #[arg(long, value_enum, default_value_t = MoeStrategy::Offload)]
    pub moe_strategy: MoeStrategy,
}

/// The GPU's rate over resident expert weights in decode: q30 all resident decodes 193.9 tok/s on the H200 (issue
/// 12), 48 layers x 8 experts x 9.4 MB a token, about 700 GB/s. Only the hits' share of a step depends on it.
const GPU_EXPERT_BYTES_PER_S: f64 = 700e9;
/// The startup measurement when no cached one exists: 224 experts (2.1 GB), 10 rounds of the timed calls (about
/// 0.15 s on the H200 host). The experts must outgrow the last-level cache, as a decode step's do (each layer
/// reads other experts): 16 of them (150 MB) fit the H200 host's cache, and the lane measured 213 GB/s there,
/// twice what its memory reads (111 GB/s), which sent the planner's split too far to the CPU.
const BRIEF_EXPERTS: usize = 224;
const BRIEF_ROUNDS: usize = 10;
/// `ferry doctor`'s measurement: the same experts, 40 rounds.
pub const DOCTOR_EXPERTS: usize = 224;
pub const DOCTOR_ROUNDS: usize = 40;

/// The split rule for `strategy` on the GPU named `gpu`, for a model whose experts are `bytes_per_expert` large
/// and `top_k` to a token: the cached rates of this machine, else `measure(experts, rounds)` now (the GPU's
/// `CudaBackendBuilder::measure_lanes` before a backend is built, or the backend's own after).
pub fn split_rule(
    strategy: MoeStrategy,
    gpu: &str,
    measure: impl FnOnce(usize, usize) -> ferry_core::Result<LaneCeilings>,
    bytes_per_expert: usize,
    top_k: usize,
) -> Result<SplitRule> {
    let rates = match strategy {
        MoeStrategy::Offload => return Ok(SplitRule::Link),
        MoeStrategy::Cpu => return Ok(SplitRule::Cpu),
        MoeStrategy::Hybrid | MoeStrategy::Auto => {
            let ceilings = match load(gpu) {
                Some(c) => c,
                None => {
                    tracing::info!("no cached lane rates for this machine (`ferry doctor` writes them): measuring");
                    measure(BRIEF_EXPERTS, BRIEF_ROUNDS).context("measuring the offload lanes")?
                }
            };
            rates(&ceilings)
        }
    };
    let rule = match strategy {
        MoeStrategy::Auto => auto_rule(rates, bytes_per_expert, top_k),
        _ => SplitRule::Balanced(rates),
    };
    tracing::info!(
        "--moe-strategy {strategy:?}: link {:.1} GB/s, CPU lane {:.0} us + {:.1} GB/s (+{:.0} % a row): {}",
        rates.link_bytes_per_s / 1e9,
        rates.cpu.fixed_s * 1e6,
        rates.cpu.bytes_per_s / 1e9,
        rates.cpu.row_cost * 100.0,
        match rule {
            SplitRule::Link => "misses over the link",
            SplitRule::Calibrated(_) => "each step's misses split with the CPU lane, the rates calibrated as it runs",
            _ => "each step's misses split with the CPU lane by the planner",
        }
    );
    Ok(rule)
}

/// `auto`'s rule: the calibrated split, step by step, when the prior `rates` give the CPU lane any of a batch-1
/// decode step that misses all its `top_k` experts or of a short prompt's prefill (64 tokens, each expert used by
/// a few), else the link alone, without starting the lane. The planner never plans a split slower than the link
/// alone by its (calibrated) model, so by the model `auto` is never slower than `offload`, in every step.
fn auto_rule(rates: LaneRates, bytes_per_expert: usize, top_k: usize) -> SplitRule {
    let decode: Vec<Miss> = (0..top_k as u32).map(|expert| Miss { expert, rows: 1 }).collect();
    // 64 tokens over 128 experts: each routed expert is used by about top_k / 2 rows.
    let prefill: Vec<Miss> = (0..128)
        .map(|expert| Miss {
            expert,
            rows: top_k.div_ceil(2),
        })
        .collect();
    let lane_helps = [decode, prefill].iter().any(|misses| {
        !plan_split(SplitRule::Balanced(rates), misses, 0, bytes_per_expert)
            .cpu
            .is_empty()
    });
    if lane_helps {
        SplitRule::Calibrated(rates)
    } else {
        SplitRule::Link
    }
}

/// The planner's rates from measured ceilings.
fn rates(c: &LaneCeilings) -> LaneRates {
    LaneRates {
        link_bytes_per_s: c.link_gb_s * 1e9,
        cpu: c.cpu_cost(),
        gpu_bytes_per_s: GPU_EXPERT_BYTES_PER_S,
    }
}

/// `$XDG_CACHE_HOME/ferry/lanes.json`, else `~/.cache/ferry/lanes.json`.
fn cache_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("ferry").join("lanes.json"))
}

/// This machine's key in the cache: host name and GPU.
fn machine_key(gpu: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{} / {gpu}", host.trim())
}

/// Every machine's entry that parses; an entry written before a field existed (the lane's fixed cost) is left out,
/// so that machine is measured again.
fn read_all() -> BTreeMap<String, LaneCeilings> {
    let entries: BTreeMap<String, serde_json::Value> = cache_path()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    entries
        .into_iter()
        .filter_map(|(key, value)| Some((key, serde_json::from_value(value).ok()?)))
        .collect()
}

/// The cached rates of this machine with `gpu`, if `ferry doctor` measured them.
pub fn load(gpu: &str) -> Option<LaneCeilings> {
    read_all().remove(&machine_key(gpu))
}

/// Writes this machine's rates into the cache (other machines' entries kept); returns the file.
pub fn store(gpu: &str, ceilings: &LaneCeilings) -> Result<PathBuf> {
    let path = cache_path().context("no cache directory: set HOME or XDG_CACHE_HOME")?;
    let mut all = read_all();
    all.insert(machine_key(gpu), *ceilings);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&all)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_lane_only_where_the_planner_gives_it_work() {
        let h200 = LaneCeilings {
            link_gb_s: 46.6,
            cpu_gb_s: 75.7,
            cpu_fixed_us: 200.0,
            cpu_row_cost: 0.09,
            cpu_threads: 15,
        };
        let expert = 9_437_184;
        let rule = auto_rule(rates(&h200), expert, 8);
        assert!(matches!(rule, SplitRule::Calibrated(_)));
        // Chosen step by step: a locality step (one miss beside 7 hits) runs as offload, an all-miss step splits.
        let one_miss = [Miss { expert: 0, rows: 1 }];
        assert!(plan_split(rule, &one_miss, 7, expert).cpu.is_empty());
        let all_miss: Vec<Miss> = (0..8).map(|expert| Miss { expert, rows: 1 }).collect();
        assert!(!plan_split(rule, &all_miss, 0, expert).cpu.is_empty());
        let slow_host = LaneCeilings { cpu_gb_s: 0.1, ..h200 };
        assert_eq!(auto_rule(rates(&slow_host), expert, 8), SplitRule::Link);
        // A lane whose every call costs more than a layer's copies never gets work.
        let slow_start = LaneCeilings {
            cpu_fixed_us: 30_000.0,
            ..h200
        };
        assert_eq!(auto_rule(rates(&slow_start), expert, 8), SplitRule::Link);
    }

    #[test]
    fn the_cache_keeps_other_machines_and_rewrites_this_one() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: this test alone in the crate reads or writes XDG_CACHE_HOME.
        unsafe { std::env::set_var("XDG_CACHE_HOME", dir.path()) };
        let first = LaneCeilings {
            link_gb_s: 50.0,
            cpu_gb_s: 60.0,
            cpu_fixed_us: 150.0,
            cpu_row_cost: 0.1,
            cpu_threads: 15,
        };
        assert_eq!(load("GPU A"), None);
        store("GPU A", &first).unwrap();
        let second = LaneCeilings {
            link_gb_s: 25.0,
            ..first
        };
        store("GPU B", &second).unwrap();
        assert_eq!(load("GPU A"), Some(first));
        assert_eq!(load("GPU B"), Some(second));
        let rewritten = LaneCeilings {
            cpu_gb_s: 70.0,
            ..first
        };
        let path = store("GPU A", &rewritten).unwrap();
        assert_eq!(load("GPU A"), Some(rewritten));
        assert!(path.starts_with(dir.path()));
        // An entry without the lane's fixed cost (written by an older ferry) is measured again, the others kept.
        let text = std::fs::read_to_string(&path).unwrap();
        let mut all: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
        let old_key = machine_key("GPU B");
        all.get_mut(&old_key)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .remove("cpu_fixed_us");
        std::fs::write(&path, serde_json::to_string(&all).unwrap()).unwrap();
        assert_eq!(load("GPU B"), None);
        assert_eq!(load("GPU A"), Some(rewritten));
    }
}
