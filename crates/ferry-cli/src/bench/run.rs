//! Driving `ferry bench`'s workload through the engine's scheduler, the one the server runs, step by step on this
//! thread, and timing it from outside: time to first token, decode at batch 1 (and the host's share of each step),
//! decode of several sequences together, a long prompt's prefill.

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use ferry_core::backend::Backend;
use ferry_core::engine::{
    Event, Executor, ModelExecutor, NoText, Request, RequestId, Scheduler, SchedulerConfig, SchedulingPolicy,
};
use ferry_core::loader::Checkpoint;
use ferry_core::model::{Model, ModelInfo};
use ferry_core::moe::RoutingTap;

use super::report::{civil_date, offload_report, BenchReport, MemoryCeiling, OffloadReport, Prefill};
use super::workload::{as_tap, BenchExecutor, Taps, Workload};
use super::{BenchArgs, Variant};
use crate::device::Backends;
use crate::doctor_lanes::MoeStrategy;
use crate::progress::LoadProgress;

/// What the backend-independent part of the bench needs from the machine.
pub(super) struct Machine<'a> {
    /// Tokens one forward pass carries at most: the prefill chunk.
    pub(super) step_tokens: usize,
    pub(super) backends: &'a Backends,
    pub(super) h2d_gb_s: Option<f64>,
}

impl Machine<'_> {
    fn gpu_memory_used(&self) -> Option<u64> {
        let gpus = self.backends.gpus();
        if gpus.is_empty() {
            return None;
        }
        gpus.iter()
            .map(|gpu| gpu.memory_info().ok().map(|(free, total)| (total - free) as u64))
            .sum()
    }

    /// Raises `peak` to the GPU memory in use now.
    fn track(&self, peak: &mut Option<u64>) {
        if let Some(used) = self.gpu_memory_used() {
            *peak = Some(peak.map_or(used, |p| p.max(used)));
        }
    }
}

/// The requests of one phase, submitted together, and how far they have got.
struct Phase {
    events: Receiver<(usize, Event)>,
    /// Tokens each request has generated.
    generated: Vec<usize>,
    finished: usize,
}

impl Phase {
    /// Submits one greedy request per prompt, each to generate `max_tokens` tokens (no eos ids: never less).
    fn submit<E: Executor>(scheduler: &mut Scheduler<E>, prompts: &[Vec<u32>], max_tokens: usize) -> Result<Self> {
        let (sink, events) = mpsc::channel();
        for (i, prompt) in prompts.iter().enumerate() {
            let request = Request::new(prompt.clone(), max_tokens);
            let sink = sink.clone();
            scheduler.submit(
                RequestId(i as u64),
                request,
                Box::new(move |e| sink.send((i, e)).is_ok()),
            )?;
        }
        Ok(Phase {
            events,
            generated: vec![0; prompts.len()],
            finished: 0,
        })
    }

    /// Every request has its first token: its prompt is prefilled.
    fn prefilled(&self) -> bool {
        self.generated.iter().all(|&n| n > 0)
    }

    fn finished(&self) -> bool {
        self.finished == self.generated.len()
    }

    /// Steps `scheduler` until `done` holds.
    fn step_until<E: Executor>(&mut self, scheduler: &mut Scheduler<E>, done: impl Fn(&Phase) -> bool) -> Result<()> {
        while !done(self) {
            if scheduler.is_idle() {
                bail!("the engine went idle before the benchmark's requests were done");
            }
            scheduler.step();
            for (i, event) in self.events.try_iter() {
                match event {
                    Event::Token { .. } => self.generated[i] += 1,
                    Event::Finished { .. } => self.finished += 1,
                    Event::Failed { message } => bail!("a benchmark request failed: {message}"),
                    Event::PromptToken { .. } => bail!("a benchmark request was scored, which it never asks"),
                }
            }
        }
        Ok(())
    }
}

/// Prefills `prompt` alone, up to its first token (and, with `max_tokens` 1, its last).
fn prefill<E: Executor>(scheduler: &mut Scheduler<E>, prompt: &[u32], max_tokens: usize) -> Result<(Phase, Prefill)> {
    let started = Instant::now();
    let mut phase = Phase::submit(scheduler, &[prompt.to_vec()], max_tokens)?;
    phase.step_until(scheduler, Phase::prefilled)?;
    let ttft = started.elapsed().as_secs_f64();
    let prefill = Prefill {
        prompt_tokens: prompt.len(),
        prefill_tok_s: prompt.len() as f64 / ttft,
        ttft_seconds: ttft,
    };
    Ok((phase, prefill))
}

/// Loads the model on `be` and runs the workload's phases once per variant (`restart` starts the offload over
/// for each after the first; every variant replays its trace and chooses its random tokens from the start),
/// handing each variant's report to `finish` as soon as it is measured; `phase_done` is called after each phase
/// (the profiler takes its report there).
#[allow(clippy::too_many_arguments)]
pub(super) fn bench_on<B: Backend>(
    be: &B,
    checkpoint: &Checkpoint,
    args: &BenchArgs,
    machine: &Machine,
    ceiling: &MemoryCeiling,
    variants: &[Variant],
    restart: impl Fn(&Variant) -> Result<()>,
    phase_done: impl Fn(&'static str),
    finish: impl Fn(&Variant, BenchReport) -> Result<()>,
) -> Result<()> {
    let started = Instant::now();
    let mut progress = LoadProgress::new(&checkpoint.dir.display().to_string());
    let model = Model::load_with_progress(be, checkpoint, &mut |done, total| progress.update(done, total))?;
    let load_seconds = started.elapsed().as_secs_f64();
    let info = ModelInfo::new(&model.spec, checkpoint.weight_format());
    tracing::info!(
        "loaded {} on {} in {load_seconds:.1} s",
        model.spec.model_type,
        be.name()
    );
    let mut peak = machine.gpu_memory_used();
    let workload = Workload::new(args, model.spec.vocab_size);
    let mut taps = Taps::new(args, variants, &info)?;
    let kv_tokens = workload.kv_tokens();
    let kv = be.new_kv(model.kv_spec(kv_tokens))?;
    let executor = ModelExecutor::new(be, model, kv);
    let config = SchedulerConfig {
        max_running: args.concurrency.max(1),
        max_queued: 0,
        step_tokens: machine.step_tokens,
        max_model_len: kv_tokens,
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    let executor = BenchExecutor::new(executor, args.model.synthetic.is_some());
    let mut scheduler = Scheduler::new(config, executor, Arc::new(NoText))?;
    let mut recording = taps.recorder.as_mut().map(as_tap);
    let variant_taps = taps.replays.iter_mut().zip(taps.held.iter_mut());
    for (i, (variant, (replay, held))) in variants.iter().zip(variant_taps).enumerate() {
        if i > 0 {
            restart(variant)?;
            scheduler.executor_mut().restart_random_tokens();
        }
        tracing::info!(
            "measuring {}, --moe-strategy {:?}",
            Taps::routing(variant),
            variant.strategy
        );
        scheduler.executor_mut().model.set_tap(replay.as_mut().map(as_tap));
        let mut measured = measure(
            &mut scheduler,
            &workload,
            args,
            machine,
            &mut peak,
            recording.take(),
            &phase_done,
        )?;
        // The resident step under `offload` only: the lanes' strategies may leave the held experts to the CPU lane,
        // which never caches them (and a 4K prompt's rows on a few experts cost the lane minutes).
        let link_only = variant.strategy == MoeStrategy::Offload;
        if let (Some(held), Some(offload), true) = (held.as_mut(), measured.offload.as_mut(), link_only) {
            scheduler.executor_mut().model.set_tap(Some(as_tap(held)));
            if let Some(seconds) = resident_step_seconds(&mut scheduler, &workload)? {
                offload.with_resident_step(seconds, measured.decode_batch1);
            }
            phase_done("resident_step");
        }
        let bytes_per_token = info.bytes_active_per_token;
        let bound = ceiling.gb_s * 1e9 / bytes_per_token as f64;
        let report = BenchReport {
            ferry_commit: env!("FERRY_GIT_COMMIT"),
            date: civil_date(),
            backend: be.name(),
            model: checkpoint.dir.display().to_string(),
            model_info: info.clone(),
            memory_plan: None,
            moe_cache_policy: None,
            moe_strategy: None,
            routing: Taps::routing(variant),
            load_seconds,
            prompt_tokens: measured.prefill.prompt_tokens,
            step_tokens: machine.step_tokens,
            prefill_tok_s: measured.prefill.prefill_tok_s,
            ttft_seconds: measured.prefill.ttft_seconds,
            long_prefill: measured.long_prefill,
            decode_tokens: workload.decode_tokens,
            decode_tok_s_batch1: measured.decode_batch1,
            decode_host_seconds_per_token: measured.host_seconds_per_token,
            decode_wait_seconds_per_token: measured.wait_seconds_per_token,
            concurrency: args.concurrency,
            decode_tok_s_aggregate: measured.decode_aggregate,
            bytes_per_token,
            decode_bound_tok_s: bound,
            decode_achieved_over_bound: measured.decode_batch1 / bound,
            memory_ceiling: ceiling.clone(),
            offload: measured.offload,
            offload_concurrent: measured.offload_concurrent,
            peak_gpu_memory_bytes: peak,
            profile: Vec::new(),
        };
        finish(variant, report)?;
    }
    drop(scheduler);
    if let Some(recorder) = taps.recorder {
        recorder.finish()?;
    }
    Ok(())
}

/// Seconds a decode step takes with nothing to copy: a sequence of the main prompt's length prefilled and decoded
/// under the held routing now set, timed from the first step that copies nothing. Untimed steps come first: one
/// brings in what the prefill left, and a policy that weighs frequency may evict the held experts for a few more
/// (the earlier variants' favourites outrank them at first), up to as many as the decode is long. None when the
/// timed steps still copied (a split that computes misses on the CPU never caches them).
fn resident_step_seconds<B: Backend>(
    scheduler: &mut Scheduler<BenchExecutor<'_, B>>,
    workload: &Workload,
) -> Result<Option<f64>> {
    let warm_up_limit = workload.decode_tokens;
    let (mut phase, _) = prefill(scheduler, &workload.prompt, 1 + warm_up_limit + workload.decode_tokens)?;
    let missed = |s: Option<ferry_core::moe::OffloadStats>| s.map_or((0, 0), |s| (s.copies, s.host_experts));
    for _ in 0..warm_up_limit {
        let before = missed(scheduler.offload_stats());
        let next = phase.generated[0] + 1;
        phase.step_until(scheduler, |p| p.generated[0] >= next)?;
        if missed(scheduler.offload_stats()) == before {
            break;
        }
    }
    let (before, timed_from) = (missed(scheduler.offload_stats()), phase.generated[0]);
    let started = Instant::now();
    phase.step_until(scheduler, Phase::finished)?;
    let seconds = started.elapsed().as_secs_f64() / (phase.generated[0] - timed_from).max(1) as f64;
    let after = missed(scheduler.offload_stats());
    if before != after {
        tracing::warn!(
            "no resident step: the held routing's decode still copied {} experts and left {} to the CPU lane",
            after.0 - before.0,
            after.1 - before.1
        );
        return Ok(None);
    }
    Ok(Some(seconds))
}

/// What one variant's phases measured.
struct Measured {
    prefill: Prefill,
    decode_batch1: f64,
    host_seconds_per_token: f64,
    wait_seconds_per_token: f64,
    decode_aggregate: f64,
    offload: Option<OffloadReport>,
    offload_concurrent: Option<OffloadReport>,
    long_prefill: Option<Prefill>,
}

/// The workload's phases on `scheduler` as it stands: a prompt prefilled and decoded alone (its batch-1 decode
/// routed through `recording` when given), `--concurrency` short prompts decoded together, the long prompt.
fn measure<'t, B: Backend>(
    scheduler: &mut Scheduler<BenchExecutor<'t, B>>,
    workload: &Workload,
    args: &BenchArgs,
    machine: &Machine,
    peak: &mut Option<u64>,
    recording: Option<&'t mut (dyn RoutingTap + Send)>,
    phase_done: &impl Fn(&'static str),
) -> Result<Measured> {
    let decode_tokens = workload.decode_tokens;

    // Prefill one long prompt in chunks; the first token comes with it.
    let (mut phase, prefill_measured) = prefill(scheduler, &workload.prompt, decode_tokens + 1)?;
    machine.track(peak);
    phase_done("prefill");

    // Decode that sequence at batch 1.
    let recorded = recording.is_some();
    if recorded {
        scheduler.executor_mut().model.set_tap(recording);
    }
    let before = scheduler.offload_stats();
    let (issued_before, waited_before) = (
        scheduler.executor().model.issue_time(),
        scheduler.executor().model.wait_time(),
    );
    let started = Instant::now();
    phase.step_until(scheduler, Phase::finished)?;
    let decode_seconds = started.elapsed().as_secs_f64();
    let host_seconds = (scheduler.executor().model.issue_time() - issued_before).as_secs_f64();
    let wait_seconds = (scheduler.executor().model.wait_time() - waited_before).as_secs_f64();
    let decode_batch1 = decode_tokens as f64 / decode_seconds;
    let offload = offload_report(
        before,
        scheduler.offload_stats(),
        decode_tokens,
        decode_seconds,
        decode_batch1,
        machine.h2d_gb_s,
    );
    if recorded {
        scheduler.executor_mut().model.set_tap(None);
    }
    machine.track(peak);
    phase_done("decode_batch1");

    // Decode `concurrency` sequences together, once their prompts are in.
    let mut phase = Phase::submit(scheduler, &workload.short_prompts, decode_tokens + 1)?;
    phase.step_until(scheduler, Phase::prefilled)?;
    let before = scheduler.offload_stats();
    let started = Instant::now();
    phase.step_until(scheduler, Phase::finished)?;
    let concurrent_seconds = started.elapsed().as_secs_f64();
    let concurrent_tokens = decode_tokens * args.concurrency;
    let decode_aggregate = concurrent_tokens as f64 / concurrent_seconds;
    let offload_concurrent = offload_report(
        before,
        scheduler.offload_stats(),
        concurrent_tokens,
        concurrent_seconds,
        decode_aggregate,
        machine.h2d_gb_s,
    );
    machine.track(peak);
    phase_done("decode_concurrent");

    let long_prefill = match &workload.long_prompt {
        Some(prompt) => {
            let (_, long) = prefill(scheduler, prompt, 1)?;
            machine.track(peak);
            phase_done("long_prefill");
            Some(long)
        }
        None => None,
    };
    Ok(Measured {
        prefill: prefill_measured,
        decode_batch1,
        host_seconds_per_token: host_seconds / decode_tokens as f64,
        wait_seconds_per_token: wait_seconds / decode_tokens as f64,
        decode_aggregate,
        offload,
        offload_concurrent,
        long_prefill,
    })
}
