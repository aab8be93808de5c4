//! `ferry serve`: the OpenAI-compatible server. It binds first, so /health answers (503, with progress) while the
//! checkpoint is fetched and loaded; then the engine thread starts and /health turns 200. On SIGINT or SIGTERM it
//! stops accepting, closes every connection not serving a request at once, and lets the responses under way
//! (streams included) finish.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::http::HeaderValue;
use ferry_core::backend::Backend;
use ferry_core::engine::plan::{MemoryPlan, PREFIX_SNAPSHOT_SLOTS};
use ferry_core::engine::{EngineHandle, ModelExecutor, Scheduler, SchedulerConfig, SchedulingPolicy};
use ferry_core::kv::KvCache;
use ferry_core::loader::{Checkpoint, Tokenizer};
use ferry_core::model::Model;
use ferry_server::{AppState, ConnectionLimits, LoadedModel, SamplingDefaults, ServerConfig, ToolCallParserChoice};

use crate::device::{kv_budget_tokens, open_backend, Backends, Device, OffloadArgs};
use crate::doctor_lanes::StrategyArgs;
use crate::hub;
use crate::progress::LoadProgress;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A Hugging Face checkpoint directory, or a hub repo id (owner/name) fetched into the Hugging Face cache.
    #[arg(long, required_unless_present = "synthetic", conflicts_with = "synthetic")]
    model: Option<String>,
    /// Serve the model a config.json describes with seeded random weights (no files): full-size serving
    /// benchmarks without a download. Needs --tokenizer.
    #[arg(long, requires = "tokenizer")]
    synthetic: Option<PathBuf>,
    /// A directory whose tokenizer.json (and tokenizer_config.json) serves a --synthetic model.
    #[arg(long, requires = "synthetic")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    expert_dtype: crate::device::ExpertDtypeArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and /v1/models lists. Default: the --model argument.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests generating at once (the running batch).
    #[arg(long, default_value_t = 4)]
    max_running_requests: usize,
    /// Requests waiting for a place in the batch; more are refused with 503.
    #[arg(long, default_value_t = 64)]
    max_queued_requests: usize,
    /// Prompt plus output tokens per request. Default: the model's context window.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Tokens the KV cache holds across all requests (at least --max-model-len; a device backend allocates it
    /// up front). Default on a GPU: what the memory budget leaves for KV; on the CPU: --max-model-len x
    /// --max-running-requests, so preemption is a last resort, within half the host memory the weights leave.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// Tokenize special-token text inside chat message contents (`<|im_end|>`) as plain text, as OpenAI's API
    /// does, so a message cannot end its turn and open another role's. Default: control tokens, as transformers'
    /// and vLLM's tokenization of the rendered template gives them.
    #[arg(long)]
    no_special_tokens_in_content: bool,
    /// How tool calls are read out of the model's output: hermes (`<tool_call>{"name": ..., "arguments":
    /// ...}</tool_call>`, Qwen3, Qwen2.5), qwen3_xml (`<tool_call><function=NAME><parameter=P>...`,
    /// Qwen3-Coder, Qwen3.5, Qwen3.6), glm45 (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`,
    /// GLM-4.5, GLM-4.6), deepseek_v31 (`<｜tool▁calls▁begin｜>...`, DeepSeek-V3.1), harmony (gpt-oss's channels,
    /// which also carry its reasoning and answer) or none. Default: the format the chat template uses.
    #[arg(long, value_parser = |name: &str| name.parse::<ToolCallParserChoice>())]
    tool_call_parser: Option<ToolCallParserChoice>,
    /// Browser origins allowed to call the API cross-site (CORS), comma-separated, e.g. http://localhost:3000;
    /// `*` allows any. Default: none, so no web page can call the API.
    #[arg(long, value_delimiter = ',', value_parser = parse_origin)]
    allowed_origins: Vec<HeaderValue>,
    /// A Jinja chat template file that replaces the checkpoint's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    offload: OffloadArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// Compute every prompt from scratch: no reuse of the KV blocks (and hybrid models' saved states) of earlier
    /// requests' prefixes.
    #[arg(long)]
    no_prefix_cache: bool,
    /// The order requests are served in: `fcfs` (arrival) or `priority` (by each request's `priority`, lower
    /// first, then arrival; the last in that order is preempted first when the KV cache runs short).
    #[arg(long, value_enum, default_value_t = SchedulingPolicyArg::Fcfs)]
    scheduling_policy: SchedulingPolicyArg,
    #[command(flatten)]
    limits: ConnectionArgs,
}

/// `--scheduling-policy`: vLLM's names.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum SchedulingPolicyArg {
    Fcfs,
    Priority,
}

/// How long clients may take, and how many connections may be open.
#[derive(clap::Args)]
struct ConnectionArgs {
    /// Connections open at once (keep it below the open-file limit, `ulimit -n`). At the cap, the connection idle
    /// the longest is closed to make room; when all are serving requests, new ones wait.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Seconds a client has to send a request's whole head, from its first byte.
    #[arg(long, default_value = "10", value_parser = seconds)]
    header_read_timeout: Duration,
    /// Seconds a request's body may take to arrive, from the end of its head; a 408 after.
    #[arg(long, default_value = "60", value_parser = seconds)]
    body_read_timeout: Duration,
    /// Seconds a connection with no request under way stays open.
    #[arg(long, default_value = "30", value_parser = seconds)]
    keep_alive_timeout: Duration,
    /// Seconds the engine may go without finishing a step while it has requests before /health reports it
    /// unhealthy (one step of a large prefill on a CPU can take long).
    #[arg(long, default_value = "120", value_parser = seconds)]
    engine_stall_timeout: Duration,
}

/// A positive number of seconds.
fn seconds(text: &str) -> Result<Duration, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!("`{text}` is not a positive number of seconds")),
    }
}

/// An origin as the `Origin` header carries it.
fn parse_origin(origin: &str) -> Result<HeaderValue, String> {
    HeaderValue::from_str(origin).map_err(|_| format!("{origin:?} is not an origin such as http://localhost:3000"))
}

impl ServeArgs {
    /// What the model is called in the log and, by default, on the API.
    fn model_label(&self) -> String {
        match (&self.model, &self.synthetic) {
            (Some(model), _) => model.clone(),
            (None, Some(config)) => config.display().to_string(),
            (None, None) => String::new(),
        }
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.max_running_requests == 0 {
        bail!("--max-running-requests must be at least 1");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let address = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    let bound: SocketAddr = listener.local_addr()?;
    let state = AppState::new(ServerConfig {
        served_model_name: args.served_model_name.clone().unwrap_or_else(|| args.model_label()),
        api_key: args.api_key.clone(),
        max_in_flight: args.max_running_requests + args.max_queued_requests,
        body_read_timeout: args.limits.body_read_timeout,
        engine_stall_timeout: args.limits.engine_stall_timeout,
        allowed_origins: args.allowed_origins.clone(),
    });
    tracing::info!("listening on http://{bound} (loading {})", args.model_label());
    let limits = ConnectionLimits {
        max_connections: args.limits.max_connections as usize,
        header_read_timeout: args.limits.header_read_timeout,
        keep_alive_timeout: args.limits.keep_alive_timeout,
    };
    let server = ferry_server::serve(listener, ferry_server::router(state.clone()), limits, shutdown_signal());
    let loading = tokio::task::spawn_blocking({
        let state = state.clone();
        move || load(&args, &state).map(|model| state.set_ready(model))
    });
    tokio::pin!(server);
    tokio::select! {
        served = &mut server => return served.context("the server failed"),
        loaded = loading => loaded.context("the loader panicked")??,
    }
    tracing::info!("ready on http://{bound}");
    server.await.context("the server failed")
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down");
}

/// Fetches (if a repo id) and loads the checkpoint, and starts the engine thread.
fn load(args: &ServeArgs, state: &AppState) -> Result<LoadedModel> {
    let mut checkpoint = match (&args.model, &args.synthetic, &args.tokenizer) {
        (Some(model), _, _) => {
            let dir = hub::resolve(model, &mut |stage, progress| {
                tracing::info!("{stage}");
                state.set_loading(stage, progress);
            })?;
            state.set_loading(format!("loading weights from {}", dir.display()), 0.0);
            Checkpoint::open(&dir)?
        }
        (None, Some(config), Some(tokenizer_dir)) => {
            state.set_loading(format!("making synthetic weights for {}", config.display()), 0.0);
            let mut checkpoint = Checkpoint::synthetic(config, 0)?;
            checkpoint.tokenizer = Some(
                Tokenizer::load(tokenizer_dir)?
                    .with_context(|| format!("no tokenizer.json in {}", tokenizer_dir.display()))?,
            );
            checkpoint
        }
        _ => bail!("give --model, or --synthetic with --tokenizer"),
    };
    args.expert_dtype.apply(&mut checkpoint);
    let eos_token_ids = checkpoint.eos_token_ids();
    let mut tokenizer = checkpoint
        .tokenizer
        .take()
        .context("the checkpoint has no tokenizer.json, which the server needs")?;
    if let Some(path) = &args.chat_template {
        let template =
            std::fs::read_to_string(path).with_context(|| format!("cannot read --chat-template {}", path.display()))?;
        tokenizer
            .set_chat_template(template)
            .with_context(|| format!("--chat-template {} does not compile", path.display()))?;
    }
    let tokenizer = Arc::new(tokenizer);
    // One request of --max-model-len tokens must fit the KV cache, so the budget keeps at least that much for it.
    let mut offload = args.offload.clone();
    if let Some(n) = args.max_model_len {
        offload.kv_reserve_tokens = offload.kv_reserve_tokens.max(n);
    }
    if !args.no_prefix_cache {
        offload.snapshot_slots = PREFIX_SNAPSHOT_SLOTS;
    }
    let (backends, plan) = open_backend(args.device, &offload, args.strategy.moe_strategy, &checkpoint)?;
    let plan = plan.as_ref();
    let mut shown = LoadProgress::new(&args.model_label());
    let mut progress = |done: usize, total: usize| {
        shown.update(done, total);
        state.set_loading(
            format!("loading layers ({done}/{total})"),
            done as f64 / total.max(1) as f64,
        );
    };
    let (engine, max_model_len, vocab_size) = match backends {
        Backends::Cpu(backend) => start_engine(backend, &checkpoint, tokenizer.clone(), args, plan, &mut progress)?,
        Backends::Cuda(backend) => start_engine(*backend, &checkpoint, tokenizer.clone(), args, plan, &mut progress)?,
        Backends::CudaGroup(group) => start_engine(*group, &checkpoint, tokenizer.clone(), args, plan, &mut progress)?,
    };
    let defaults = &checkpoint.generation;
    let tool_call_format = args.tool_call_parser.unwrap_or_default().format(&tokenizer);
    tracing::info!("tool calls parsed as {tool_call_format:?}");
    Ok(LoadedModel {
        engine,
        eos_token_ids,
        max_token_bytes: ferry_server::longest_token_bytes(&tokenizer),
        tokenizer,
        max_model_len,
        vocab_size,
        defaults: SamplingDefaults {
            temperature: defaults.temperature,
            top_p: defaults.top_p,
            top_k: defaults.top_k,
        },
        special_tokens_in_content: !args.no_special_tokens_in_content,
        tool_call_format,
        prefix_cache: !args.no_prefix_cache,
        priority_scheduling: args.scheduling_policy == SchedulingPolicyArg::Priority,
    })
}

/// Loads the model on `backend` and starts the engine thread; returns it with the context length and vocabulary
/// size the server validates requests against. `plan`: how a GPU budget was divided (None on the CPU); `progress`
/// hears each layer loaded.
fn start_engine<B: Backend + 'static>(
    backend: B,
    checkpoint: &Checkpoint,
    tokenizer: Arc<Tokenizer>,
    args: &ServeArgs,
    plan: Option<&MemoryPlan>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(EngineHandle, usize, usize)> {
    let started = std::time::Instant::now();
    // The most tokens the KV cache may hold.
    let kv_budget = match args.kv_cache_tokens {
        Some(n) => n,
        None => kv_budget_tokens(plan, checkpoint)?,
    };
    let model = Model::load_with_progress(&backend, checkpoint, progress)?;
    let window = model.spec.max_position_embeddings;
    let max_model_len = match args.max_model_len {
        Some(n) if n > window => bail!("--max-model-len {n} is beyond the model's context window of {window}"),
        Some(n) if n < 2 => bail!("--max-model-len must leave room for a prompt token and an output token"),
        Some(n) => n,
        // Unasked, the context is what the KV cache can hold, up to the model's window.
        None => match kv_budget {
            kv if kv < window => {
                tracing::warn!(
                    "the KV cache holds {kv} tokens, so requests get a context of {kv} of the model's {window}; \
                     --max-model-len with a larger --kv-cache-tokens (or, on a GPU, --gpu-memory-budget or \
                     --kv-reserve-tokens) asks for more"
                );
                kv
            }
            _ => window,
        },
    };
    let kv_tokens = match args.kv_cache_tokens {
        Some(n) if n < max_model_len => {
            bail!("--kv-cache-tokens {n} cannot hold one request of --max-model-len {max_model_len}")
        }
        Some(n) => n,
        // A GPU cache is allocated up front, so it takes the whole plan; the CPU's grows with its sequences.
        None if plan.is_some() => kv_budget,
        None => {
            (max_model_len.saturating_mul(args.max_running_requests)).clamp(max_model_len, kv_budget.max(max_model_len))
        }
    };
    let mut kv = backend.new_kv(model.kv_spec(kv_tokens))?;
    if !args.no_prefix_cache {
        // The snapshot slots the GPU plan kept room for; on the CPU, as many in host memory.
        let slots = match kv.has_recurrent_state() {
            true => plan.map_or(PREFIX_SNAPSHOT_SLOTS, |p| p.snapshot_slots),
            false => 0,
        };
        kv.blocks_mut().enable_prefix_cache(slots);
    }
    tracing::info!(
        "loaded {} on {} in {:.2?}; context {max_model_len}, KV {} blocks of {} tokens, prefix cache {}",
        model.spec.model_type,
        backend.name(),
        started.elapsed(),
        kv.blocks().num_blocks(),
        kv.blocks().block_size(),
        if args.no_prefix_cache { "off" } else { "on" }
    );
    let vocab_size = model.spec.vocab_size;
    let scheduler = Scheduler::new(
        SchedulerConfig {
            max_running: args.max_running_requests,
            max_queued: args.max_queued_requests,
            // Running decodes first, then prefill chunks fill the step: the workspace was sized for this many.
            step_tokens: args.offload.step_tokens(plan),
            max_model_len,
            sampled_vocab: args.synthetic.is_some().then(|| tokenizer.vocab_size()),
            policy: match args.scheduling_policy {
                SchedulingPolicyArg::Fcfs => SchedulingPolicy::Fcfs,
                SchedulingPolicyArg::Priority => SchedulingPolicy::Priority,
            },
        },
        ModelExecutor::new(backend, model, kv),
        tokenizer,
    )?;
    let engine = EngineHandle::spawn(scheduler).context("cannot start the engine thread")?;
    Ok((engine, max_model_len, vocab_size))
}
