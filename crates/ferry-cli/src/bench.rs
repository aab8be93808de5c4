//! `ferry bench`: prefill and decode speed of a model on a backend, against the bound the machine's measured
//! ceilings allow. Prints a table and writes the results as JSON.
//!
//! Workload: one prompt of `--prompt-tokens` random tokens, prefilled in chunks (prefill tok/s, time to first
//! token), then `--decode-tokens` greedy steps of that sequence (decode at batch 1), then `--concurrency` sequences
//! decoding together (aggregate tok/s). Bounds at batch 1: all resident, the memory bandwidth over the bytes one
//! token reads; under expert offload, the measured host-to-device bandwidth over the expert bytes one token misses.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use ferry_core::backend::profiled::{OpTime, Profiled};
use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::argmax;
use ferry_core::kv::{KvCache, SeqId};
use ferry_core::loader::Checkpoint;
use ferry_core::model::{Model, ModelInfo};
use ferry_core::moe::OffloadStats;
use ferry_core::moe::{MemoryPlan, RoutingTap, RoutingTrace, TraceHeader, TraceRecorder, TraceReplayer};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::device::{open_backend, Backends, Device, ModelArgs, OffloadArgs};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    offload: OffloadArgs,
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

/// The memory the all-resident bound is computed against.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryCeiling {
    pub what: String,
    pub gb_s: f64,
}

/// Expert offload during the batch-1 decode.
#[derive(Debug, Serialize)]
struct OffloadReport {
    slots: usize,
    hit_rate: f64,
    /// Expert bytes copied over PCIe per decoded token.
    bytes_missed_per_token: f64,
    achieved_pcie_gb_s: f64,
    measured_h2d_gb_s: f64,
    /// Measured host-to-device bandwidth over the bytes missed per token.
    pcie_bound_tok_s: f64,
    achieved_over_pcie_bound: f64,
    layer_hit_rates: Vec<f64>,
    bank_pinned: bool,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    ferry_commit: &'static str,
    date: String,
    backend: String,
    model: String,
    model_info: ModelInfo,
    memory_plan: Option<MemoryPlan>,
    routing: String,
    load_seconds: f64,
    prompt_tokens: usize,
    /// Prefill chunk: tokens one forward pass carries at most.
    step_tokens: usize,
    prefill_tok_s: f64,
    ttft_seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    long_prefill: Option<Prefill>,
    decode_tokens: usize,
    decode_tok_s_batch1: f64,
    /// Seconds the host spends issuing one batch-1 decode step (the rest of the step is waiting for the device).
    decode_host_seconds_per_token: f64,
    concurrency: usize,
    decode_tok_s_aggregate: f64,
    /// Bytes of weights one decoded token reads at batch 1.
    bytes_per_token: u64,
    memory_ceiling: MemoryCeiling,
    decode_bound_tok_s: f64,
    decode_achieved_over_bound: f64,
    offload: Option<OffloadReport>,
    peak_gpu_memory_bytes: Option<u64>,
    /// With --profile: per phase (prefill, decode_batch1, decode_concurrent), where the time went.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    profile: Vec<(&'static str, Vec<OpTime>)>,
}

/// One prompt's prefill, up to its first token.
#[derive(Debug, Serialize)]
struct Prefill {
    prompt_tokens: usize,
    prefill_tok_s: f64,
    ttft_seconds: f64,
}

/// What the backend-independent part of the bench needs from the machine.
struct Machine<'a> {
    /// Tokens one forward pass carries at most: the prefill chunk.
    step_tokens: usize,
    backends: &'a Backends,
    h2d_gb_s: Option<f64>,
}

impl Machine<'_> {
    fn gpu_memory_used(&self) -> Option<u64> {
        match self.backends {
            Backends::Cuda(cuda) => cuda.memory_info().ok().map(|(free, total)| (total - free) as u64),
            Backends::Cpu(_) => None,
        }
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        match self.backends {
            Backends::Cuda(cuda) => cuda.offload_stats(),
            Backends::Cpu(_) => None,
        }
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    let checkpoint = args.model.open()?;
    let (backends, plan) = open_backend(args.device, &args.offload, &checkpoint)?;
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
    report.memory_plan = plan;
    print_report(&report);
    if let Some(path) = &args.output {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn replaying(replay: &mut Option<TraceReplayer>) -> Option<&mut dyn RoutingTap> {
    replay.as_mut().map(|r| r as &mut dyn RoutingTap)
}

/// Logits of each slice's last token -> its greedy next token.
fn greedy<B: Backend>(be: &B, logits: &B::Tensor) -> Result<Vec<u32>> {
    let (rows, vocab) = be.shape(logits);
    let host = be.to_host(logits)?;
    Ok((0..rows)
        .map(|r| argmax(&host[r * vocab..(r + 1) * vocab]) as u32)
        .collect())
}

/// Prefills `prompt` into `seq` in chunks of `chunk_tokens`; returns its first token and how long that took.
fn prefill<B: Backend>(
    be: &B,
    model: &Model<B>,
    kv: &mut B::Kv,
    seq: SeqId,
    prompt: &[u32],
    chunk_tokens: usize,
    replay: &mut Option<TraceReplayer>,
) -> Result<(u32, Prefill)> {
    let started = Instant::now();
    let mut logits = None;
    for (i, chunk) in prompt.chunks(chunk_tokens).enumerate() {
        let slice = SeqSlice {
            seq,
            start_pos: i * chunk_tokens,
            len: chunk.len(),
        };
        logits = Some(model.forward_routed(be, chunk, &[slice], kv, replaying(replay))?);
    }
    let token = greedy(be, &logits.context("an empty prompt")?)?[0];
    let ttft = started.elapsed().as_secs_f64();
    Ok((
        token,
        Prefill {
            prompt_tokens: prompt.len(),
            prefill_tok_s: prompt.len() as f64 / ttft,
            ttft_seconds: ttft,
        },
    ))
}

fn bench_on<B: Backend>(
    be: &B,
    checkpoint: &Checkpoint,
    args: &BenchArgs,
    machine: &Machine,
    ceiling: &MemoryCeiling,
    phase_done: impl Fn(&'static str),
) -> Result<BenchReport> {
    let started = Instant::now();
    let model = Model::load(be, checkpoint)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let spec = &model.spec;
    let info = ModelInfo::new(spec, checkpoint.weight_dtype());
    tracing::info!("loaded {} on {} in {load_seconds:.1} s", spec.model_type, be.name());
    let mut peak = machine.gpu_memory_used();
    let track = |peak: &mut Option<u64>| {
        if let Some(used) = machine.gpu_memory_used() {
            *peak = Some(peak.map_or(used, |p| p.max(used)));
        }
    };
    let header = TraceHeader {
        num_layers: info.num_moe_layers as u32,
        num_experts: info.num_experts as u32,
        top_k: info.experts_per_token as u32,
    };
    let mut replay = args
        .routing_trace
        .as_ref()
        .map(|p| TraceReplayer::new(RoutingTrace::read(p)?))
        .transpose()?;

    let short_prompt = 16;
    // The long prompt runs after the others have freed their KV.
    let capacity = (args.prompt_tokens + args.decode_tokens + args.concurrency * (short_prompt + args.decode_tokens))
        .max(args.long_prompt_tokens.unwrap_or(0))
        + 64;
    let mut kv = be.new_kv(model.kv_spec(capacity))?;
    let mut rng = StdRng::seed_from_u64(0);
    let mut random_ids = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(0..spec.vocab_size as u32))
            .collect::<Vec<u32>>()
    };

    // Prefill one long prompt in chunks; the first token comes with it.
    let seq = kv.alloc_seq();
    let prompt = random_ids(args.prompt_tokens);
    let (mut token, first_prefill) = prefill(be, &model, &mut kv, seq, &prompt, machine.step_tokens, &mut replay)?;
    track(&mut peak);
    phase_done("prefill");

    // Random weights fall into a loop under greedy decoding (the same token, the same experts, every step), which
    // would measure a cache that always hits. On synthetic weights each step's input is a fresh random token
    // instead: routing then varies as real text makes it.
    let synthetic = args.model.synthetic.is_some();

    // Decode that sequence at batch 1.
    let mut recorder = args
        .record_routing
        .as_ref()
        .map(|p| TraceRecorder::create(p, header))
        .transpose()?;
    let before = machine.offload_stats();
    let started = Instant::now();
    let mut host = std::time::Duration::ZERO;
    for pos in prompt.len()..prompt.len() + args.decode_tokens {
        let slice = SeqSlice {
            seq,
            start_pos: pos,
            len: 1,
        };
        let issued = Instant::now();
        let tap: Option<&mut dyn RoutingTap> = match (&mut recorder, &mut replay) {
            (Some(r), _) => Some(r),
            (None, Some(r)) => Some(r),
            (None, None) => None,
        };
        let logits = model.forward_routed(be, &[token], &[slice], &mut kv, tap)?;
        host += issued.elapsed();
        let greedy_token = greedy(be, &logits)?[0];
        token = if synthetic { random_ids(1)[0] } else { greedy_token };
    }
    let decode_seconds = started.elapsed().as_secs_f64();
    let decode_batch1 = args.decode_tokens as f64 / decode_seconds;
    let offload = offload_report(
        before,
        machine.offload_stats(),
        args.decode_tokens,
        decode_seconds,
        decode_batch1,
        machine.h2d_gb_s,
    );
    if let Some(recorder) = recorder {
        recorder.finish()?;
    }
    track(&mut peak);
    phase_done("decode_batch1");
    kv.free_seq(seq);

    // Decode `concurrency` sequences together.
    let seqs: Vec<_> = (0..args.concurrency).map(|_| kv.alloc_seq()).collect();
    let prompts: Vec<u32> = random_ids(short_prompt * args.concurrency);
    let slices: Vec<SeqSlice> = seqs
        .iter()
        .map(|&seq| SeqSlice {
            seq,
            start_pos: 0,
            len: short_prompt,
        })
        .collect();
    let mut tokens = greedy(
        be,
        &model.forward_routed(be, &prompts, &slices, &mut kv, replaying(&mut replay))?,
    )?;
    let started = Instant::now();
    for step in 0..args.decode_tokens {
        let slices: Vec<SeqSlice> = seqs
            .iter()
            .map(|&seq| SeqSlice {
                seq,
                start_pos: short_prompt + step,
                len: 1,
            })
            .collect();
        let greedy_tokens = greedy(
            be,
            &model.forward_routed(be, &tokens, &slices, &mut kv, replaying(&mut replay))?,
        )?;
        tokens = if synthetic {
            random_ids(args.concurrency)
        } else {
            greedy_tokens
        };
    }
    let decode_aggregate = (args.decode_tokens * args.concurrency) as f64 / started.elapsed().as_secs_f64();
    track(&mut peak);
    phase_done("decode_concurrent");
    for seq in seqs {
        kv.free_seq(seq);
    }

    let long_prefill = match args.long_prompt_tokens {
        Some(tokens) => {
            let seq = kv.alloc_seq();
            let (_, long) = prefill(
                be,
                &model,
                &mut kv,
                seq,
                &random_ids(tokens),
                machine.step_tokens,
                &mut replay,
            )?;
            kv.free_seq(seq);
            track(&mut peak);
            phase_done("long_prefill");
            Some(long)
        }
        None => None,
    };

    let bytes_per_token = info.params_active_per_token * checkpoint.weight_dtype().size() as u64;
    let bound = ceiling.gb_s * 1e9 / bytes_per_token as f64;
    Ok(BenchReport {
        ferry_commit: env!("FERRY_GIT_COMMIT"),
        date: civil_date(),
        backend: be.name(),
        model: checkpoint.dir.display().to_string(),
        model_info: info,
        memory_plan: None,
        routing: match &args.routing_trace {
            Some(p) => format!("replayed from {}", p.display()),
            None => "the model's router".into(),
        },
        load_seconds,
        prompt_tokens: first_prefill.prompt_tokens,
        step_tokens: machine.step_tokens,
        prefill_tok_s: first_prefill.prefill_tok_s,
        ttft_seconds: first_prefill.ttft_seconds,
        long_prefill,
        decode_tokens: args.decode_tokens,
        decode_tok_s_batch1: decode_batch1,
        decode_host_seconds_per_token: host.as_secs_f64() / args.decode_tokens as f64,
        concurrency: args.concurrency,
        decode_tok_s_aggregate: decode_aggregate,
        bytes_per_token,
        decode_bound_tok_s: bound,
        decode_achieved_over_bound: decode_batch1 / bound,
        memory_ceiling: ceiling.clone(),
        offload,
        peak_gpu_memory_bytes: peak,
        profile: Vec::new(),
    })
}

/// The offload counters' change over a decode of `tokens` tokens in `seconds`, against the PCIe bound.
fn offload_report(
    before: Option<OffloadStats>,
    after: Option<OffloadStats>,
    tokens: usize,
    seconds: f64,
    tok_s: f64,
    h2d_gb_s: Option<f64>,
) -> Option<OffloadReport> {
    let (before, after, h2d) = (before?, after?, h2d_gb_s?);
    let delta = |a: &[u64], b: &[u64]| -> Vec<u64> {
        a.iter()
            .zip(b.iter().chain(std::iter::repeat(&0)))
            .map(|(x, y)| x - y)
            .collect()
    };
    let hits = delta(&after.layer_hits, &before.layer_hits);
    let misses = delta(&after.layer_misses, &before.layer_misses);
    let all_hits: u64 = hits.iter().sum();
    let all = all_hits + misses.iter().sum::<u64>();
    let bytes = (after.bytes_copied - before.bytes_copied) as f64;
    let bytes_missed_per_token = bytes / tokens as f64;
    let pcie_bound = h2d * 1e9 / bytes_missed_per_token.max(1.0);
    Some(OffloadReport {
        slots: after.slots,
        hit_rate: if all == 0 { 0.0 } else { all_hits as f64 / all as f64 },
        bytes_missed_per_token,
        achieved_pcie_gb_s: bytes / seconds / 1e9,
        measured_h2d_gb_s: h2d,
        pcie_bound_tok_s: pcie_bound,
        achieved_over_pcie_bound: tok_s / pcie_bound,
        layer_hit_rates: hits
            .iter()
            .zip(&misses)
            .map(|(&h, &m)| if h + m == 0 { 0.0 } else { h as f64 / (h + m) as f64 })
            .collect(),
        bank_pinned: after.bank_pinned,
    })
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock (Howard Hinnant's civil-from-days).
fn civil_date() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

fn print_report(r: &BenchReport) {
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let mut rows = vec![
        ("backend", r.backend.clone()),
        ("model", format!("{} ({})", r.model, r.model_info.model_type)),
        ("routing", r.routing.clone()),
        ("load", format!("{:.1} s", r.load_seconds)),
        (
            "prefill",
            format!(
                "{:.0} tok/s ({} tokens, in chunks of {})",
                r.prefill_tok_s, r.prompt_tokens, r.step_tokens
            ),
        ),
        ("time to first token", format!("{:.3} s", r.ttft_seconds)),
    ];
    if let Some(long) = &r.long_prefill {
        rows.push((
            "prefill, long prompt",
            format!(
                "{:.0} tok/s ({} tokens; first token after {:.2} s)",
                long.prefill_tok_s, long.prompt_tokens, long.ttft_seconds
            ),
        ));
    }
    rows.extend([
        (
            "decode, batch 1",
            format!(
                "{:.1} tok/s (host issues a step in {:.2} ms)",
                r.decode_tok_s_batch1,
                r.decode_host_seconds_per_token * 1e3
            ),
        ),
        (
            "decode, concurrent",
            format!(
                "{:.1} tok/s aggregate ({} sequences)",
                r.decode_tok_s_aggregate, r.concurrency
            ),
        ),
        ("bytes per token", format!("{:.2} GB", r.bytes_per_token as f64 / 1e9)),
        (
            "memory ceiling",
            format!("{:.0} GB/s ({})", r.memory_ceiling.gb_s, r.memory_ceiling.what),
        ),
        (
            "resident bound, batch 1",
            format!(
                "{:.1} tok/s ({:.1} % achieved)",
                r.decode_bound_tok_s,
                100.0 * r.decode_achieved_over_bound
            ),
        ),
    ]);
    if let Some(p) = &r.memory_plan {
        rows.push((
            "GPU memory plan",
            format!(
                "dense {}, workspace {}, experts {}, KV {} ({} tokens)",
                gib(p.dense_bytes),
                gib(p.workspace_bytes),
                gib(p.expert_bytes),
                gib(p.kv_bytes),
                p.kv_tokens
            ),
        ));
    }
    if let Some(o) = &r.offload {
        rows.push((
            "expert cache",
            format!("{} slots, hit rate {:.1} %", o.slots, 100.0 * o.hit_rate),
        ));
        rows.push(("missed per token", format!("{:.2} GB", o.bytes_missed_per_token / 1e9)));
        rows.push((
            "PCIe",
            format!(
                "{:.1} GB/s achieved, {:.1} GB/s measured H2D",
                o.achieved_pcie_gb_s, o.measured_h2d_gb_s
            ),
        ));
        rows.push((
            "PCIe bound, batch 1",
            format!(
                "{:.1} tok/s ({:.1} % achieved)",
                o.pcie_bound_tok_s,
                100.0 * o.achieved_over_pcie_bound
            ),
        ));
    }
    rows.push(("peak GPU memory", r.peak_gpu_memory_bytes.map_or("-".into(), gib)));
    for (name, value) in rows {
        println!("{name:<26}{value}");
    }
    for (phase, ops) in &r.profile {
        println!("profile: {phase}");
        for op in ops {
            println!("  {:<24}{:>8} calls {:>10.3} ms", op.op, op.calls, op.seconds * 1e3);
        }
    }
}
