//! `ferry serve`: the OpenAI-compatible server. It binds first, so /health answers (503, with progress) while the
//! checkpoint is fetched and loaded; then the engine thread starts and /health turns 200.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::http::HeaderValue;
use ferry_core::backend::Backend;
use ferry_core::engine::plan::MemoryPlan;
use ferry_core::engine::{EngineHandle, ModelExecutor, Scheduler, SchedulerConfig};
use ferry_core::kv::KvCache;
use ferry_core::loader::{Checkpoint, Tokenizer};
use ferry_core::model::Model;
use ferry_server::{AppState, LoadedModel, SamplingDefaults, ServerConfig};

use crate::device::{open_backend, Backends, Device, OffloadArgs};
use crate::hub::{self, HubAccess};

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
    /// --max-running-requests, so preemption is a last resort.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
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
        allowed_origins: args.allowed_origins.clone(),
    });
    tracing::info!("listening on http://{bound} (loading {})", args.model_label());
    let app = ferry_server::router(state.clone());
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .into_future();
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
            let dir = if PathBuf::from(model).is_dir() || !hub::is_repo_id(model) {
                PathBuf::from(model)
            } else {
                hub::fetch(model, &HubAccess::from_env(), &mut |stage, progress| {
                    tracing::info!("{stage}");
                    state.set_loading(stage, progress);
                })
                .with_context(|| format!("{model} is not a directory, so it was taken as a Hugging Face repo id"))?
            };
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
    let (backends, plan) = open_backend(args.device, &offload, &checkpoint)?;
    let plan = plan.as_ref();
    let (engine, max_model_len, vocab_size) = match backends {
        Backends::Cpu(backend) => start_engine(backend, &checkpoint, tokenizer.clone(), args, plan)?,
        Backends::Cuda(backend) => start_engine(*backend, &checkpoint, tokenizer.clone(), args, plan)?,
    };
    let defaults = &checkpoint.generation;
    Ok(LoadedModel {
        engine,
        eos_token_ids,
        tokenizer,
        max_model_len,
        vocab_size,
        defaults: SamplingDefaults {
            temperature: defaults.temperature,
            top_p: defaults.top_p,
            top_k: defaults.top_k,
        },
    })
}

/// Loads the model on `backend` and starts the engine thread; returns it with the context length and vocabulary
/// size the server validates requests against. `plan`: how a GPU budget was divided (None on the CPU).
fn start_engine<B: Backend + 'static>(
    backend: B,
    checkpoint: &Checkpoint,
    tokenizer: Arc<Tokenizer>,
    args: &ServeArgs,
    plan: Option<&MemoryPlan>,
) -> Result<(EngineHandle, usize, usize)> {
    let started = std::time::Instant::now();
    // On a GPU the budget's KV share sizes the cache unless --kv-cache-tokens says otherwise.
    let planned_kv_tokens = plan.map(|p| p.kv_tokens);
    let model = Model::load(&backend, checkpoint)?;
    let window = model.spec.max_position_embeddings;
    let max_model_len = match args.max_model_len {
        Some(n) if n > window => bail!("--max-model-len {n} is beyond the model's context window of {window}"),
        Some(n) if n < 2 => bail!("--max-model-len must leave room for a prompt token and an output token"),
        Some(n) => n,
        // Unasked, the context is what the KV cache can hold, up to the model's window.
        None => match args.kv_cache_tokens.or(planned_kv_tokens) {
            Some(kv) if kv < window => {
                tracing::warn!(
                    "the KV cache holds {kv} tokens, so requests get a context of {kv} of the model's {window}; \
                     --max-model-len (with a larger --gpu-memory-budget or --kv-reserve-tokens) asks for more"
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
        None => planned_kv_tokens.unwrap_or(max_model_len * args.max_running_requests),
    };
    let kv = backend.new_kv(model.kv_spec(kv_tokens))?;
    tracing::info!(
        "loaded {} on {} in {:.2?}; context {max_model_len}, KV {} blocks of {} tokens",
        model.spec.model_type,
        backend.name(),
        started.elapsed(),
        kv.blocks().num_blocks(),
        kv.blocks().block_size()
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
        },
        ModelExecutor::new(backend, model, kv),
        tokenizer,
    )?;
    let engine = EngineHandle::spawn(scheduler).context("cannot start the engine thread")?;
    Ok((engine, max_model_len, vocab_size))
}
