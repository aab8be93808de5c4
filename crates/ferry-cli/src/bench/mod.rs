//! `ferry bench`: prefill and decode speed of a model on a backend, against the bound the machine's measured
//! ceilings allow. Prints a table and writes the results as JSON.
//!
//! Workload (workload.rs): one prompt of `--prompt-tokens` random tokens, prefilled in chunks (prefill tok/s, time
//! to first token), then `--decode-tokens` greedy steps of that sequence (decode at batch 1), then `--concurrency`
//! sequences decoding together (aggregate tok/s). It runs through the engine's scheduler, as the server's requests
//! do, timed from outside (run.rs). Bounds at batch 1 (report.rs): all resident, the memory bandwidth over the bytes
//! one token reads; under expert offload, the measured host-to-device bandwidth over the expert bytes one token
//! misses.

mod report;
mod run;
mod workload;

use std::path::PathBuf;

use anyhow::{Context, Result};
use ferry_core::backend::profiled::Profiled;

use self::report::{print_report, MemoryCeiling};
use self::run::{bench_on, Machine};
use crate::device::{open_backend, Backends, Device, ModelArgs, OffloadArgs};
use crate::doctor_lanes::StrategyArgs;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    offload: OffloadArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
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
    /// synthetic weights. Replayed routes are weighted uniformly.
    #[arg(long, conflicts_with = "record_routing")]
    routing_trace: Option<PathBuf>,
    /// Write the router's choices during the batch-1 decode as a routing trace (for `ferry cache-sim`).
    #[arg(long)]
    record_routing: Option<PathBuf>,
    /// Write the results as JSON here (e.g. bench/results/q30-resident.json).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Wait for the device after every op and report where the time goes (slows everything down).
    #[arg(long)]
    profile: bool,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let checkpoint = args.model.open()?;
    let (backends, plan) = open_backend(args.device, &args.offload, args.strategy.moe_strategy, &checkpoint)?;
    let (ceiling, h2d_gb_s) = match &backends {
        Backends::Cuda(cuda) => {
            let c = cuda.measure_ceilings()?;
            (
                MemoryCeiling {
                    what: "device copy bandwidth (read + write), measured".into(),
                    gb_s: c.d2d_copy_gb_s,
                },
                Some(c.h2d_pinned_gb_s),
            )
        }
        Backends::Cpu(_) => (
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
    let mut report = crate::with_backend!(backends, be => {
        if args.profile {
            let profiled = Profiled::new(be);
            let phases = std::cell::RefCell::new(Vec::new());
            let mut report = bench_on(&profiled, &checkpoint, &args, &machine, &ceiling, |phase| {
                phases.borrow_mut().push((phase, profiled.take_report()))
            })?;
            report.profile = phases.into_inner();
            Ok::<_, anyhow::Error>(report)
        } else {
            bench_on(be, &checkpoint, &args, &machine, &ceiling, |_| {})
        }
    })?;
    report.moe_cache_policy = plan
        .as_ref()
        .filter(|p| p.offload)
        .map(|_| args.offload.moe_cache_policy.to_string());
    report.memory_plan = plan;
    print_report(&report);
    if let Some(path) = &args.output {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
