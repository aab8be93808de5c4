//! `ferry generate`: one prompt in, its continuation out (streamed text, or one JSON object with `--json`), through
//! the same scheduler that serves HTTP requests, driven step by step on this thread.

use std::io::Write;
use std::sync::{mpsc, Arc};

use anyhow::{bail, Context, Result};
use ferry_core::backend::Backend;
use ferry_core::engine::{
    Event, ModelExecutor, NoText, Request, RequestId, SamplingParams, Scheduler, SchedulerConfig, SchedulingPolicy,
    StopRules,
};
use ferry_core::loader::{ChatMessage, Checkpoint, TextDecoder, Tokenizer};
use ferry_core::model::{Model, ModelInfo};
use ferry_core::moe::{RoutingTap, TraceHeader, TraceRecorder};

use crate::device::{open_backend, Device, ExpertDtypeArgs, ModelArgs, OffloadArgs};
use crate::doctor_lanes::StrategyArgs;
use crate::progress::LoadProgress;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    expert_dtype: ExpertDtypeArgs,
    /// The prompt text (tokenized with the checkpoint's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Wrap the prompt as a user message in the checkpoint's chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// The prompt as comma-separated token ids (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy. Default: the checkpoint's generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Default: the checkpoint's generation_config.json, else 1.0.
    #[arg(long)]
    top_p: Option<f32>,
    /// Default: the checkpoint's generation_config.json, else no limit.
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    offload: OffloadArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// Print one JSON object (token_ids, text, prompt_tokens, completion_tokens, finish_reason).
    #[arg(long)]
    json: bool,
    /// Write every token's routed experts, per MoE layer, as a routing trace (for `ferry cache-sim`).
    #[arg(long)]
    record_routing: Option<std::path::PathBuf>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let mut checkpoint = args.model.open()?;
    args.expert_dtype.apply(&mut checkpoint);
    let (backends, plan) = open_backend(args.device, &args.offload, args.strategy.moe_strategy, &checkpoint)?;
    let step_tokens = args.offload.step_tokens(plan.as_ref());
    let tokenizer = checkpoint.tokenizer.take().map(Arc::new);
    crate::with_backend!(backends, be => generate_on(be, &checkpoint, tokenizer.clone(), &args, step_tokens))
}

/// Runs the prompt through the engine's scheduler, alone. `step_tokens`: prompt tokens per forward pass (what the
/// GPU workspace was sized for).
fn generate_on<B: Backend>(
    backend: &B,
    checkpoint: &Checkpoint,
    tokenizer: Option<Arc<Tokenizer>>,
    args: &GenerateArgs,
    step_tokens: usize,
) -> Result<()> {
    let started = std::time::Instant::now();
    let mut progress = LoadProgress::new(&checkpoint.dir.display().to_string());
    let model = Model::load_with_progress(backend, checkpoint, &mut |done, total| progress.update(done, total))?;
    tracing::info!(
        "loaded {} from {} on {} in {:.2?}",
        model.spec.model_type,
        checkpoint.dir.display(),
        backend.name(),
        started.elapsed()
    );

    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let tokenizer = tokenizer
                .as_ref()
                .context("--prompt needs the checkpoint's tokenizer.json; use --prompt-ids without one")?;
            if args.chat {
                let messages = [ChatMessage::text("user", text)];
                let rendered = tokenizer.apply_chat_template(&messages, &[], true, &Default::default())?;
                tokenizer.encode(&rendered, false)?
            } else {
                tokenizer.encode(text, true)?
            }
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };

    let defaults = &checkpoint.generation;
    let request = Request {
        sampling: SamplingParams {
            temperature: args.temperature.or(defaults.temperature).unwrap_or(0.0),
            top_p: args.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k: args.top_k.or(defaults.top_k),
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop: StopRules {
            eos_token_ids: checkpoint.eos_token_ids(),
            ignore_eos: args.ignore_eos,
            ..StopRules::default()
        },
        ..Request::new(prompt_ids.clone(), args.max_tokens)
    };
    // This request's context: its prompt and output, within the model's window.
    let max_model_len = model
        .spec
        .max_position_embeddings
        .min(prompt_ids.len() + args.max_tokens);
    let kv = backend.new_kv(model.kv_spec(max_model_len))?;
    let mut recorder = match &args.record_routing {
        Some(path) => {
            let info = ModelInfo::new(&model.spec, checkpoint.weight_format());
            let header = TraceHeader {
                num_layers: info.num_moe_layers as u32,
                num_experts: info.num_experts as u32,
                top_k: info.experts_per_token as u32,
            };
            Some(TraceRecorder::create(path, header)?)
        }
        None => None,
    };
    let mut executor = ModelExecutor::new(backend, model, kv);
    executor.set_tap(recorder.as_mut().map(|r| r as &mut (dyn RoutingTap + Send)));
    // Text is streamed unless --json, which decodes the ids at the end.
    let streamed = tokenizer.as_ref().filter(|_| !args.json);
    let decoder: Arc<dyn TextDecoder> = match streamed {
        Some(tokenizer) => tokenizer.clone(),
        None => Arc::new(NoText),
    };
    let config = SchedulerConfig {
        max_running: 1,
        max_queued: 0,
        step_tokens,
        max_model_len,
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    let mut scheduler = Scheduler::new(config, executor, decoder)?;

    let mut stdout = std::io::stdout().lock();
    let started = std::time::Instant::now();
    let (sink, events) = mpsc::channel();
    scheduler.submit(RequestId(0), request, Box::new(move |e| sink.send(e).is_ok()))?;
    let mut token_ids = Vec::new();
    let mut finish_reason = None;
    while !scheduler.is_idle() {
        scheduler.step();
        for event in events.try_iter() {
            match event {
                Event::Token { id, text, .. } => {
                    token_ids.push(id);
                    if !text.is_empty() {
                        let _ = write!(stdout, "{text}");
                        let _ = stdout.flush();
                    }
                }
                Event::Finished { reason, .. } => finish_reason = Some(reason),
                Event::Failed { message } => bail!(message),
                Event::PromptToken { .. } => bail!("the prompt was scored, which `ferry generate` never asks"),
            }
        }
    }
    drop(scheduler);
    if let Some(recorder) = recorder {
        recorder.finish()?;
    }
    let finish_reason = finish_reason.context("the engine went idle before the request finished")?;
    let elapsed = started.elapsed().as_secs_f64();
    tracing::info!(
        "{} prompt + {} generated tokens in {elapsed:.2} s ({:.1} tok/s)",
        prompt_ids.len(),
        token_ids.len(),
        token_ids.len() as f64 / elapsed
    );

    if args.json {
        let text = tokenizer.map(|t| t.decode(&token_ids, true)).transpose()?;
        let out = serde_json::json!({
            "token_ids": token_ids,
            "text": text,
            "prompt_tokens": prompt_ids.len(),
            "completion_tokens": token_ids.len(),
            "finish_reason": finish_reason.as_str(),
        });
        writeln!(stdout, "{out}")?;
    } else if streamed.is_some() {
        writeln!(stdout)?;
    } else {
        writeln!(stdout, "{token_ids:?}")?;
    }
    Ok(())
}
