//! `ferry bench`: prefill and decode speed of a model on a backend, against the bound the machine's measured
//! ceilings allow. Prints a table and writes the results as JSON.
//!
//! Workload: one prompt of `--prompt-tokens` random tokens (prefill tok/s, time to first token), then
//! `--decode-tokens` greedy steps of that sequence (decode at batch 1), then `--concurrency` sequences decoding
//! together (aggregate tok/s). The decode bound at batch 1 is the memory bandwidth over the bytes one token
//! reads (dense weights and the routed experts of every MoE layer).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use ferry_core::backend::profiled::{OpTime, Profiled};
use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::argmax;
use ferry_core::kv::KvCache;
use ferry_core::loader::Checkpoint;
use ferry_core::model::{Model, ModelInfo};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::device::{open_backend, Device, ModelArgs};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Tokens of the prefill prompt.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// Greedy decode steps, at batch 1 and again with `--concurrency` sequences.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Sequences decoding together in the batched measurement.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Write the results as JSON here (e.g. bench/results/q30-resident.json).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Wait for the device after every op and report where the time goes (slows everything down).
    #[arg(long)]
    profile: bool,
}

/// The memory the bound is computed against.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryCeiling {
    pub what: String,
    pub gb_s: f64,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    ferry_commit: &'static str,
    date: String,
    backend: String,
    model: String,
    model_info: ModelInfo,
    load_seconds: f64,
    prompt_tokens: usize,
    prefill_tok_s: f64,
    ttft_seconds: f64,
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
    peak_gpu_memory_bytes: Option<u64>,
    /// With --profile: per phase (prefill, decode_batch1, decode_concurrent), where the time went.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    profile: Vec<(&'static str, Vec<OpTime>)>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let checkpoint = args.model.open()?;
    let backends = open_backend(args.device)?;
    let report = crate::with_backend!(backends, be => {
        let ceiling = memory_ceiling(&backends)?;
        if args.profile {
            let profiled = Profiled::new(be);
            let phases = std::cell::RefCell::new(Vec::new());
            let mut report = bench_on(&profiled, &checkpoint, &args, ceiling, || peak_gpu_memory(&backends), |phase| {
                phases.borrow_mut().push((phase, profiled.take_report()))
            })?;
            report.profile = phases.into_inner();
            Ok::<_, anyhow::Error>(report)
        } else {
            bench_on(be, &checkpoint, &args, ceiling, || peak_gpu_memory(&backends), |_| {})
        }
    })?;
    print_report(&report);
    if let Some(path) = &args.output {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn memory_ceiling(backends: &crate::device::Backends) -> Result<MemoryCeiling> {
    Ok(match backends {
        crate::device::Backends::Cuda(cuda) => MemoryCeiling {
            what: "device copy bandwidth (read + write), measured".into(),
            gb_s: cuda.measure_ceilings()?.d2d_copy_gb_s,
        },
        crate::device::Backends::Cpu(_) => MemoryCeiling {
            what: "host memory read bandwidth, measured".into(),
            gb_s: ferry_core::backend::cpu::measure_read_bandwidth(1 << 30),
        },
    })
}

fn peak_gpu_memory(backends: &crate::device::Backends) -> Option<u64> {
    match backends {
        crate::device::Backends::Cuda(cuda) => cuda.memory_info().ok().map(|(free, total)| (total - free) as u64),
        crate::device::Backends::Cpu(_) => None,
    }
}

/// Logits of each slice's last token -> its greedy next token.
fn greedy<B: Backend>(be: &B, logits: &B::Tensor) -> Result<Vec<u32>> {
    let (rows, vocab) = be.shape(logits);
    let host = be.to_host(logits)?;
    Ok((0..rows)
        .map(|r| argmax(&host[r * vocab..(r + 1) * vocab]) as u32)
        .collect())
}

fn bench_on<B: Backend>(
    be: &B,
    checkpoint: &Checkpoint,
    args: &BenchArgs,
    ceiling: MemoryCeiling,
    gpu_memory_used: impl Fn() -> Option<u64>,
    phase_done: impl Fn(&'static str),
) -> Result<BenchReport> {
    let started = Instant::now();
    let model = Model::load(be, checkpoint)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let spec = &model.spec;
    let info = ModelInfo::new(spec, checkpoint.weight_dtype());
    tracing::info!("loaded {} on {} in {load_seconds:.1} s", spec.model_type, be.name());
    let mut peak = gpu_memory_used();
    let track = |peak: &mut Option<u64>| {
        if let Some(used) = gpu_memory_used() {
            *peak = Some(peak.map_or(used, |p| p.max(used)));
        }
    };

    let short_prompt = 16;
    let capacity =
        args.prompt_tokens + args.decode_tokens + args.concurrency * (short_prompt + args.decode_tokens) + 64;
    let mut kv = be.new_kv(model.kv_spec(capacity))?;
    let mut rng = StdRng::seed_from_u64(0);
    let mut random_ids = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(0..spec.vocab_size as u32))
            .collect::<Vec<u32>>()
    };

    // Prefill one long prompt; the first token comes with it.
    let seq = kv.alloc_seq();
    let prompt = random_ids(args.prompt_tokens);
    let started = Instant::now();
    let logits = model.forward(
        be,
        &prompt,
        &[SeqSlice {
            seq,
            start_pos: 0,
            len: prompt.len(),
        }],
        &mut kv,
    )?;
    let mut token = greedy(be, &logits)?[0];
    let ttft = started.elapsed().as_secs_f64();
    track(&mut peak);
    phase_done("prefill");

    // Decode that sequence at batch 1.
    let started = Instant::now();
    let mut host = std::time::Duration::ZERO;
    for pos in prompt.len()..prompt.len() + args.decode_tokens {
        let slice = SeqSlice {
            seq,
            start_pos: pos,
            len: 1,
        };
        let issued = Instant::now();
        let logits = model.forward(be, &[token], &[slice], &mut kv)?;
        host += issued.elapsed();
        token = greedy(be, &logits)?[0];
    }
    let decode_batch1 = args.decode_tokens as f64 / started.elapsed().as_secs_f64();
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
    let mut tokens = greedy(be, &model.forward(be, &prompts, &slices, &mut kv)?)?;
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
        tokens = greedy(be, &model.forward(be, &tokens, &slices, &mut kv)?)?;
    }
    let decode_aggregate = (args.decode_tokens * args.concurrency) as f64 / started.elapsed().as_secs_f64();
    track(&mut peak);
    phase_done("decode_concurrent");

    let bytes_per_token = info.params_active_per_token * checkpoint.weight_dtype().size() as u64;
    let bound = ceiling.gb_s * 1e9 / bytes_per_token as f64;
    Ok(BenchReport {
        ferry_commit: env!("FERRY_GIT_COMMIT"),
        date: chrono_free_date(),
        backend: be.name(),
        model: checkpoint.dir.display().to_string(),
        model_info: info,
        load_seconds,
        prompt_tokens: args.prompt_tokens,
        prefill_tok_s: args.prompt_tokens as f64 / ttft,
        ttft_seconds: ttft,
        decode_tokens: args.decode_tokens,
        decode_tok_s_batch1: decode_batch1,
        decode_host_seconds_per_token: host.as_secs_f64() / args.decode_tokens as f64,
        concurrency: args.concurrency,
        decode_tok_s_aggregate: decode_aggregate,
        bytes_per_token,
        decode_bound_tok_s: bound,
        decode_achieved_over_bound: decode_batch1 / bound,
        memory_ceiling: ceiling,
        peak_gpu_memory_bytes: peak,
        profile: Vec::new(),
    })
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock.
fn chrono_free_date() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
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
    let rows = [
        ("backend", r.backend.clone()),
        ("model", format!("{} ({})", r.model, r.model_info.model_type)),
        ("load", format!("{:.1} s", r.load_seconds)),
        (
            "prefill",
            format!("{:.0} tok/s ({} tokens)", r.prefill_tok_s, r.prompt_tokens),
        ),
        ("time to first token", format!("{:.3} s", r.ttft_seconds)),
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
        ("decode bound, batch 1", format!("{:.1} tok/s", r.decode_bound_tok_s)),
        (
            "achieved / bound",
            format!("{:.1} %", 100.0 * r.decode_achieved_over_bound),
        ),
        (
            "peak GPU memory",
            r.peak_gpu_memory_bytes
                .map_or("-".into(), |b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)),
        ),
    ];
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
