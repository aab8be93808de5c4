//! ferry-server: the OpenAI-compatible HTTP API in front of ferry's engine.
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses` (OpenAI), `POST /v1/messages`
//!   (Anthropic), plain or streamed as server-sent events, over one protocol-neutral request layer;
//!   `POST /v1/messages/count_tokens`;
//! - `GET /v1/models` and `/v1/models/{id}`, `POST /tokenize` and `/detokenize` (vLLM's), `GET /health` (503 with
//!   load progress until the model is ready, and with the reason when the engine has died or stalled), `GET
//!   /metrics` (Prometheus).
//!
//! The server binds before the model loads so that /health can report progress; [`AppState::set_ready`] hands it
//! the engine. [`serve`] accepts connections (connections.rs: cap, idle and header timeouts, shutdown). Every
//! request is logged once (access.rs), every error is OpenAI-shaped JSON (error.rs), a body must arrive within the
//! body timeout (body_timeout.rs). Requests pass the API key and JSON-only checks (guard.rs), are validated here (400
//! with the field named), rendered through the chat template and tokenized on the blocking pool (prompt_work.rs),
//! and submitted to the engine thread ([`ferry_core::engine::EngineHandle`]); a request whose client goes away is
//! cancelled and its KV freed.
//!
//! Not here: the model, the scheduler (ferry-core), argument parsing and model download (ferry-cli).

mod access;
mod anthropic;
mod body;
mod body_timeout;
mod chat;
mod conn_io;
mod connections;
mod endpoints;
mod error;
mod generation;
mod guard;
mod liveness;
mod metrics;
mod openai;
mod params;
mod prompt_work;
mod reasoning;
mod responses;
mod sampling;
mod tools;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_core::engine::EngineHandle;
use ferry_core::loader::Tokenizer;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

pub use connections::{serve, ConnectionLimits};
pub use error::ApiError;
pub use prompt_work::longest_token_bytes;
pub use tools::{ToolCallFormat, ToolCallParserChoice};

/// The largest request body read; a larger one is a 413.
pub const MAX_REQUEST_BYTES: usize = 2 << 20;

/// What the operator chose on the command line.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub served_model_name: String,
    /// Required as `Authorization: Bearer KEY` on everything but /health when set.
    pub api_key: Option<String>,
    /// Requests admitted at once: running plus queued; more get a 503.
    pub max_in_flight: usize,
    /// A request's body must arrive in full within this long of its head; a 408 otherwise.
    pub body_read_timeout: Duration,
    /// An engine with requests that finishes no step for this long is reported unhealthy on /health.
    pub engine_stall_timeout: Duration,
    /// Browser origins answered with CORS headers (`*`: any); none by default, so browsers keep web pages out.
    pub allowed_origins: Vec<HeaderValue>,
}

/// The checkpoint's sampling defaults (generation_config.json), used where a request sets none.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
}

/// A model ready to serve.
pub struct LoadedModel {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub eos_token_ids: Vec<u32>,
    pub max_model_len: usize,
    pub vocab_size: usize,
    /// The most bytes of text one token stands for ([`longest_token_bytes`]), which bounds the prompt text that
    /// can fit the context before it is tokenized.
    pub max_token_bytes: usize,
    pub defaults: SamplingDefaults,
    /// Whether special-token text inside chat message contents is read as control tokens (else as plain text).
    pub special_tokens_in_content: bool,
    /// How tool calls are read out of the output (`--tool-call-parser`, by default the chat template's format);
    /// none: a request's tools still reach the template, and calls come back as the text the model wrote.
    pub tool_call_format: Option<ToolCallFormat>,
    /// The engine reuses cached prefixes (`--no-prefix-cache` turns it off): the choices of one prompt then start
    /// after its first, from its blocks.
    pub prefix_cache: bool,
    /// The engine serves by request priority (`--scheduling-policy priority`); otherwise a non-zero `priority` is a
    /// 400.
    pub priority_scheduling: bool,
}

impl LoadedModel {
    /// Qwen-style `<think>` reasoning: the tokenizer has the tags and the chat template uses them.
    fn splits_reasoning(&self) -> bool {
        self.tokenizer.token_id("<think>").is_some()
            && self.tokenizer.token_id("</think>").is_some()
            && self.tokenizer.chat_template_mentions("<think>")
    }
}

enum LoadState {
    Loading { stage: String, progress: f64 },
    Ready(Arc<LoadedModel>),
}

struct Shared {
    config: ServerConfig,
    load: RwLock<LoadState>,
    metrics: metrics::Metrics,
    /// Requests admitted and not yet done.
    in_flight: AtomicUsize,
    /// Prompts being prepared at once (prompt_work.rs).
    prompt_workers: Arc<tokio::sync::Semaphore>,
    started_at: u64,
    /// The served model's response_format compiler, built on first use.
    grammar: sampling::Compiler,
    /// The Responses API's kept responses.
    responses: Mutex<responses::ResponseStore>,
    /// The Responses API's background responses still being generated, by id: the handle that stops each.
    background: Mutex<std::collections::HashMap<String, tokio::task::AbortHandle>>,
}

/// The server's state, shared by every handler.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl AppState {
    pub fn new(config: ServerConfig) -> Self {
        AppState(Arc::new(Shared {
            config,
            load: RwLock::new(LoadState::Loading {
                stage: "starting".into(),
                progress: 0.0,
            }),
            metrics: metrics::Metrics::new(),
            in_flight: AtomicUsize::new(0),
            prompt_workers: prompt_work::workers(),
            started_at: unix_seconds(),
            grammar: Default::default(),
            responses: Mutex::new(responses::ResponseStore::new(responses::STORE_BYTES)),
            background: Mutex::new(Default::default()),
        }))
    }

    /// Reports load progress on /health: what is happening and how far along (0 to 1).
    pub fn set_loading(&self, stage: impl Into<String>, progress: f64) {
        *self.0.load.write().unwrap_or_else(|e| e.into_inner()) = LoadState::Loading {
            stage: stage.into(),
            progress,
        };
    }

    pub fn set_ready(&self, model: LoadedModel) {
        *self.0.load.write().unwrap_or_else(|e| e.into_inner()) = LoadState::Ready(Arc::new(model));
    }

    /// The loaded model, or a 503 while it loads.
    fn model(&self) -> Result<Arc<LoadedModel>, ApiError> {
        match &*self.0.load.read().unwrap_or_else(|e| e.into_inner()) {
            LoadState::Ready(model) => Ok(model.clone()),
            LoadState::Loading { stage, progress } => Err(ApiError::unavailable(
                format!("the model is loading ({stage}, {:.0}%)", progress * 100.0),
                "model_loading",
            )),
        }
    }
}

async fn health(State(state): State<AppState>) -> Response {
    match &*state.0.load.read().unwrap_or_else(|e| e.into_inner()) {
        LoadState::Ready(model) => {
            let heartbeat = model.engine.heartbeat();
            match liveness::engine_trouble(&heartbeat, Instant::now(), state.0.config.engine_stall_timeout) {
                None => Json(serde_json::json!({"status": "ok"})).into_response(),
                Some(reason) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(serde_json::json!({"status": "unhealthy", "reason": reason})),
                )
                    .into_response(),
            }
        }
        LoadState::Loading { stage, progress } => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "loading", "stage": stage, "progress": progress})),
        )
            .into_response(),
    }
}

async fn prometheus(State(state): State<AppState>) -> Response {
    let engine = state.model().ok().map(|m| m.engine.status());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.0.metrics.render(engine),
    )
        .into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no route for {} {}",
            error::quote(request.method().as_str()),
            error::quote(request.uri().path())
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

/// Every route; /health is the one outside the guards. The API key layer wraps the JSON one, so a request without
/// the key gets a 401 whatever it sends. Around them all, outermost first: CORS when the operator allows origins
/// (it does not loosen the JSON-only rule: an allowed page may send JSON, never a form), the access log, Anthropic's
/// error shape on its routes, JSON errors, the body timeout and the body size limit.
pub fn router(state: AppState) -> Router {
    let guarded = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/input_items", get(responses::list_input_items))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(endpoints::models))
        .route("/v1/models/{id}", get(endpoints::model))
        .route("/tokenize", post(endpoints::tokenize_route))
        .route("/detokenize", post(endpoints::detokenize_route))
        .route("/metrics", get(prometheus))
        .fallback(not_found)
        .layer(middleware::from_fn(guard::require_json));
    let guarded = match &state.0.config.api_key {
        Some(key) => guarded.layer(middleware::from_fn_with_state(key.clone(), guard::require_api_key)),
        None => guarded,
    };
    let body_read_timeout = state.0.config.body_read_timeout;
    let origins = &state.0.config.allowed_origins;
    let app = Router::new()
        .route("/health", get(health))
        .merge(guarded)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .layer(middleware::from_fn_with_state(
            body_read_timeout,
            body_timeout::limit_body_time,
        ))
        .layer(middleware::from_fn(error::json_errors))
        .layer(middleware::from_fn(anthropic::errors_in_anthropic_shape))
        .layer(middleware::from_fn(access::log_requests));
    let app = match origins.is_empty() {
        true => app,
        // Outermost, so that a preflight is answered before the key check (browsers send it without the key).
        false => app.layer(cors(origins)),
    };
    app.with_state(state)
}

/// CORS for these origins: any request header a client asks for (the key, the SDKs' own), GET and POST.
fn cors(origins: &[HeaderValue]) -> CorsLayer {
    let origins = match origins.iter().any(|origin| origin == "*") {
        true => AllowOrigin::any(),
        false => AllowOrigin::list(origins.iter().cloned()),
    };
    CorsLayer::new()
        .allow_origin(origins)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers(AllowHeaders::mirror_request())
}
