//! `ferry bench`: prefill and decode speed of a model on a backend, against the bound the machine's measured
//! ceilings allow. Prints a table and writes the results as JSON.
//!
//! Workload (workload.rs): one prompt of `--prompt-tokens` random tokens, prefilled in chunks (prefill tok/s, time
//! to first token), then `--decode-tokens` greedy steps of that sequence (decode at batch 1), then `--concurrency`
//! sequences decoding together (aggregate tok/s). It runs through the engine's scheduler, as the server's requests
//! do, timed from outside (run.rs). Bounds at batch 1 (report.rs): all resident, the memory bandwidth over the bytes
//! one token reads; under expert offload, the measured host-to-device bandwidth over the expert bytes one token
//! misses, and under `offload` with a replayed trace the overlapped bound, 1 / max(that copy time, the resident
//! step), the resident step timed in the same run by a decode of the prompt's length under one token's routing
//! held (all hits).

mod report;
mod run;
mod workload;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferry_core::backend::profiled::Profiled;

use self::report::{print_report, BenchReport, MemoryCeiling};
use self::run::{bench_on, Machine};
use crate::device::{open_backend, restart_offload, Device, ExpertDtypeArgs, ModelArgs, OffloadArgs};
use crate::doctor_lanes::MoeStrategy;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    expert_dtype: ExpertDtypeArgs,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    offload: OffloadArgs,
    /// Who computes the expert cache's misses (as `ferry serve --moe-strategy`). Several, comma-separated, are
    /// measured one after another on one load, the offload started over between them.
    #[arg(long = "moe-strategy", value_enum, value_delimiter = ',', default_value = "offload")]
    moe_strategies: Vec<MoeStrategy>,
    /// Tokens of the prefill prompt.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// A longer prompt (e.g. 32768) prefilled once more at the end, on its own sequence: prefill speed and time
    /// to first token at long context. Its KV must fit too (`--kv-reserve-tokens` under a GPU budget).
    #[arg(long)]
    long_prompt_tokens: Option<usize>,
    /// Greedy decode steps, at batch 1 and again with `--concurrency` sequences.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Sequences decoding together in the batched measurement.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Route as this trace did (token by token, round and round) instead of the router: real locality on
    /// synthetic weights. Replayed routes are weighted uniformly. Given again, each trace is measured in turn on
    /// one load (with every `--moe-strategy`).
    #[arg(long, conflicts_with = "record_routing")]
    routing_trace: Vec<PathBuf>,
    /// With `--routing-trace`: guess each next MoE layer's experts for the offload's decode prefetch, this share of
    /// them right (the trace's own, the rest other experts drawn at random), as a real model's router applied one
    /// layer early would. Without it replayed steps are not guessed (the synthetic router's guess cannot predict a
    /// trace). Pre-gating predictors on real models are reported at 0.90-0.97.
    #[arg(long, requires = "routing_trace")]
    routing_guess_precision: Option<f64>,
    /// Write the router's choices during the batch-1 decode as a routing trace (for `ferry cache-sim`).
    #[arg(long)]
    record_routing: Option<PathBuf>,
    /// Write the results as JSON here (e.g. bench/results/q30-resident.json). With several traces or strategies,
    /// one file each, named after this one: `NAME-TRACE-STRATEGY.json`, each part only where it varies (TRACE:
    /// the trace file's stem).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Wait for the device after every op and report where the time goes (slows everything down).
    #[arg(long)]
    profile: bool,
}

/// One measurement of a run: the routing trace replayed (None: the model's router) and the MoE strategy.
pub(super) struct Variant {
    pub(super) trace: Option<PathBuf>,
    pub(super) strategy: MoeStrategy,
    /// With a trace: the precision of the next-layer guesses it makes (`--routing-guess-precision`).
    pub(super) guess_precision: Option<f64>,
}

impl Variant {
    /// Every trace with every strategy, trace by trace.
    fn all(args: &BenchArgs) -> Vec<Variant> {
        let traces: Vec<Option<PathBuf>> = if args.routing_trace.is_empty() {
            vec![None]
        } else {
            args.routing_trace.iter().cloned().map(Some).collect()
        };
        traces
            .into_iter()
            .flat_map(|trace| {
                args.moe_strategies.iter().map(move |&strategy| Variant {
                    guess_precision: args.routing_guess_precision.filter(|_| trace.is_some()),
                    trace: trace.clone(),
                    strategy,
                })
            })
            .collect()
    }

    /// Where this variant's JSON goes: `output`, with the trace's stem and the strategy added to its name where
    /// the run has several of them.
    fn output(&self, output: &Path, args: &BenchArgs) -> PathBuf {
        let mut name = output.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        if let Some(trace) = self.trace.as_ref().filter(|_| args.routing_trace.len() > 1) {
            name += &format!("-{}", trace.file_stem().unwrap_or_default().to_string_lossy());
        }
        if args.moe_strategies.len() > 1 {
            name += &format!("-{}", strategy_name(self.strategy));
        }
        output.with_file_name(name + ".json")
    }
}

fn strategy_name(strategy: MoeStrategy) -> String {
    format!("{strategy:?}").to_lowercase()
}

pub fn run(args: BenchArgs) -> Result<()> {
    let variants = Variant::all(&args);
    if variants.len() > 1 && args.profile {
        bail!("--profile measures one routing and one --moe-strategy at a time");
    }
    let mut checkpoint = args.model.open()?;
    args.expert_dtype.apply(&mut checkpoint);
    let (backends, plan) = open_backend(args.device, &args.offload, variants[0].strategy, &checkpoint)?;
    let (ceiling, h2d_gb_s) = match backends.gpus() {
        [gpu] => {
            let c = gpu.measure_ceilings()?;
            (
                MemoryCeiling {
                    what: "device copy bandwidth (read + write), measured".into(),
                    gb_s: c.d2d_copy_gb_s,
                },
                Some(c.h2d_pinned_gb_s),
            )
        }
        // Each GPU of a group reads the dense part and its own experts, and streams its misses over its own link:
        // the first GPU's memory bandwidth, and the links' together.
        gpus @ [first, ..] => {
            let ceilings = gpus
                .iter()
                .map(|gpu| gpu.measure_ceilings())
                .collect::<Result<Vec<_>, _>>()?;
            (
                MemoryCeiling {
                    what: format!(
                        "device copy bandwidth (read + write) of GPU 0 ({}) of {}, measured",
                        first.device_name(),
                        gpus.len()
                    ),
                    gb_s: ceilings[0].d2d_copy_gb_s,
                },
                Some(ceilings.iter().map(|c| c.h2d_pinned_gb_s).sum()),
            )
        }
        [] => (
            MemoryCeiling {
                what: "host memory read bandwidth, measured".into(),
                gb_s: ferry_core::backend::cpu::measure_read_bandwidth(1 << 30),
            },
            None,
        ),
    };
    let machine = Machine {
        step_tokens: args.offload.step_tokens(plan.as_ref()),
        backends: &backends,
        h2d_gb_s,
    };
    let restart = |variant: &Variant| restart_offload(&backends, &args.offload, variant.strategy, &checkpoint);
    let offloaded = plan.as_ref().is_some_and(|p| p.offload);
    // Each variant's report as soon as it is measured: a run cut short keeps the variants it finished.
    let finish = |variant: &Variant, mut report: BenchReport| -> Result<()> {
        report.moe_cache_policy = offloaded.then(|| args.offload.moe_cache_policy.to_string());
        report.moe_strategy = offloaded.then(|| strategy_name(variant.strategy));
        report.memory_plan = plan.clone();
        print_report(&report);
        if let Some(output) = &args.output {
            let path = variant.output(output, &args);
            std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    };
    crate::with_backend!(backends, be => {
        if args.profile {
            let profiled = Profiled::new(be);
            let phases = std::cell::RefCell::new(Vec::new());
            let phase_done = |phase| phases.borrow_mut().push((phase, profiled.take_report()));
            let finish = |variant: &Variant, mut report: BenchReport| {
                report.profile = phases.take();
                finish(variant, report)
            };
            bench_on(&profiled, &checkpoint, &args, &machine, &ceiling, &variants, restart, phase_done, finish)
        } else {
            bench_on(be, &checkpoint, &args, &machine, &ceiling, &variants, restart, |_| {}, finish)
        }
    })?;
    Ok(())
}
