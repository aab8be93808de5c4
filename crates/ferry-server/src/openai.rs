//! The two generation endpoints: chat completions (through the chat template, with reasoning split out) and text
//! completions, each plain or streamed. Both validate, tokenize and submit the same way and read the same engine
//! events; they differ only in the JSON they write.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_core::engine::{Event, Request, RequestId, SamplingParams, StopRules};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::ApiError;
use crate::params::{json_object, ChatBody, CompletionBody, GenerationParams, Prompt};
use crate::reasoning::{ReasoningParser, Split};
use crate::{unix_seconds, AppState, LoadedModel};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// The fields every response object of one request repeats.
struct ResponseMeta {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl ResponseMeta {
    fn object(&self, streamed: bool) -> &'static str {
        match (self.endpoint, streamed) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Text, _) => "text_completion",
        }
    }

    /// One choice's worth of new output, as a chat delta or a text fragment.
    fn choice(&self, split: &Split, finish_reason: Option<&str>, streamed: bool) -> Value {
        match self.endpoint {
            Endpoint::Text => json!({
                "index": 0, "text": split.content, "logprobs": null, "finish_reason": finish_reason,
            }),
            Endpoint::Chat => {
                let mut message = serde_json::Map::new();
                if !streamed {
                    message.insert("role".into(), "assistant".into());
                }
                if !streamed || !split.content.is_empty() {
                    message.insert("content".into(), split.content.clone().into());
                }
                if !split.reasoning.is_empty() {
                    message.insert("reasoning_content".into(), split.reasoning.clone().into());
                }
                let key = if streamed { "delta" } else { "message" };
                json!({"index": 0, key: message, "logprobs": null, "finish_reason": finish_reason})
            }
        }
    }

    fn envelope(&self, choices: Vec<Value>, streamed: bool) -> serde_json::Map<String, Value> {
        let mut out = serde_json::Map::new();
        out.insert("id".into(), self.id.clone().into());
        out.insert("object".into(), self.object(streamed).into());
        out.insert("created".into(), self.created.into());
        out.insert("model".into(), self.model.clone().into());
        out.insert("choices".into(), choices.into());
        out
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// A request admitted to the engine. Dropping it before the engine finished (the client went away) cancels the
/// request, which frees its KV at once.
struct InFlight {
    state: AppState,
    model: Arc<LoadedModel>,
    id: RequestId,
    prompt_tokens: usize,
    completion_tokens: usize,
    done: bool,
    submitted: Instant,
    last_token: Option<Instant>,
}

impl InFlight {
    /// Records latency metrics for one generated token.
    fn on_token(&mut self) {
        let now = Instant::now();
        let metrics = &self.state.0.metrics;
        match self.last_token {
            None => metrics.time_to_first_token((now - self.submitted).as_secs_f64()),
            Some(previous) => metrics.inter_token_latency((now - previous).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.completion_tokens += 1;
    }

    fn finish(&mut self, outcome: &'static str) {
        self.done = true;
        self.state
            .0
            .metrics
            .request_done(outcome, self.prompt_tokens, self.completion_tokens);
        tracing::info!(
            request = self.id.0,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            seconds = format!("{:.3}", self.submitted.elapsed().as_secs_f64()),
            "{outcome}"
        );
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.done {
            self.model.engine.cancel(self.id);
            self.finish("cancelled");
        }
        self.state.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A validated request, ready for the engine, and what its response needs.
struct Prepared {
    model: Arc<LoadedModel>,
    params: GenerationParams,
    meta: ResponseMeta,
    /// Splits `<think>` reasoning out of chat output.
    reasoning: Option<ReasoningParser>,
}

/// Builds the engine request for `prompt_ids`, refusing a prompt that leaves no room in the context window.
fn engine_request(model: &LoadedModel, params: &GenerationParams, prompt_ids: Vec<u32>) -> Result<Request, ApiError> {
    let window = model.max_model_len;
    if prompt_ids.len() >= window {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "this model's maximum context length is {window} tokens, but the prompt has {} tokens \
                 (and at least one token must be generated)",
                prompt_ids.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = window - prompt_ids.len();
    let defaults = model.defaults;
    let request = Request {
        max_tokens: params.max_tokens.unwrap_or(room).min(room),
        sampling: SamplingParams {
            temperature: params.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_p: params.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k: params.top_k.or(defaults.top_k),
            min_p: 0.0,
            seed: params.seed,
        },
        presence_penalty: params.presence_penalty,
        frequency_penalty: params.frequency_penalty,
        repetition_penalty: 1.0,
        logit_bias: Vec::new(),
        logprobs: None,
        constraint: None,
        stop_strings: params.stop.clone(),
        stop: StopRules {
            eos_token_ids: model.eos_token_ids.clone(),
            ignore_eos: params.ignore_eos,
        },
        prompt_ids,
    };
    request
        .validate(window, model.vocab_size)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(request)
}

fn check_model_name(state: &AppState, params: &GenerationParams) -> Result<(), ApiError> {
    let served = &state.0.config.served_model_name;
    match &params.model {
        Some(name) if name != served => Err(ApiError::model_not_found(name, served)),
        _ => Ok(()),
    }
}

fn meta(state: &AppState, endpoint: Endpoint) -> ResponseMeta {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Text => "cmpl",
    };
    ResponseMeta {
        endpoint,
        id: format!("{prefix}-{:016x}", response_id()),
        created: unix_seconds(),
        model: state.0.config.served_model_name.clone(),
    }
}

/// A response id unique within the process (a counter) and across restarts (the clock), bit-mixed so ids do not
/// look sequential.
fn response_id() -> u64 {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15))
    .wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

fn prepare_chat(state: &AppState, body: &[u8]) -> Result<(Prepared, Request), ApiError> {
    let body = ChatBody::parse(&json_object(body)?)?;
    check_model_name(state, &body.params)?;
    let model = state.model()?;
    let tokenizer = &model.tokenizer;
    if !tokenizer.has_chat_template() {
        return Err(ApiError::invalid(
            "this model has no chat template; use /v1/completions",
        ));
    }
    let prompt = tokenizer
        .apply_chat_template(&body.messages, true, &body.chat_template_kwargs)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let prompt_ids = tokenizer
        .encode(&prompt, false)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let reasoning = model.splits_reasoning().then(|| ReasoningParser::new(&prompt));
    let request = engine_request(&model, &body.params, prompt_ids)?;
    let prepared = Prepared {
        model,
        params: body.params,
        meta: meta(state, Endpoint::Chat),
        reasoning,
    };
    Ok((prepared, request))
}

fn prepare_text(state: &AppState, body: &[u8]) -> Result<(Prepared, Request), ApiError> {
    let body = CompletionBody::parse(&json_object(body)?)?;
    check_model_name(state, &body.params)?;
    let model = state.model()?;
    let prompt_ids = match body.prompt {
        Prompt::TokenIds(ids) => ids,
        Prompt::Text(text) => model
            .tokenizer
            .encode(&text, true)
            .map_err(|e| ApiError::internal(e.to_string()))?,
    };
    let request = engine_request(&model, &body.params, prompt_ids).map_err(|mut e| {
        if e.param.as_deref() == Some("messages") {
            e.param = Some("prompt".into());
        }
        e
    })?;
    let prepared = Prepared {
        model,
        params: body.params,
        meta: meta(state, Endpoint::Text),
        reasoning: None,
    };
    Ok((prepared, request))
}

/// Admits the request (or refuses it with a 503 when the queue is full) and hands it to the engine.
fn submit(
    state: &AppState,
    model: &Arc<LoadedModel>,
    request: Request,
) -> Result<(InFlight, UnboundedReceiver<Event>), ApiError> {
    let limit = state.0.config.max_in_flight;
    if state.0.in_flight.fetch_add(1, Ordering::AcqRel) >= limit {
        state.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        state.0.metrics.request_done("rejected", request.prompt_ids.len(), 0);
        return Err(ApiError::unavailable(
            format!("the server is busy: {limit} requests are running or queued; retry later"),
            "queue_full",
        ));
    }
    let (sender, events) = unbounded_channel();
    let prompt_tokens = request.prompt_ids.len();
    let id = model
        .engine
        .submit(request, Box::new(move |event| sender.send(event).is_ok()));
    let in_flight = InFlight {
        state: state.clone(),
        model: model.clone(),
        id,
        prompt_tokens,
        completion_tokens: 0,
        done: false,
        submitted: Instant::now(),
        last_token: None,
    };
    Ok((in_flight, events))
}

fn split_text(reasoning: &mut Option<ReasoningParser>, text: &str) -> Split {
    match reasoning {
        Some(parser) => parser.push(text),
        None => Split {
            reasoning: String::new(),
            content: text.to_string(),
        },
    }
}

fn flush_text(reasoning: &mut Option<ReasoningParser>) -> Split {
    reasoning.as_mut().map(ReasoningParser::finish).unwrap_or_default()
}

fn engine_failure(message: String) -> ApiError {
    ApiError::internal(format!("generation failed: {message}"))
}

/// Waits for the whole generation and answers with one JSON object.
async fn respond_whole(
    mut prepared: Prepared,
    mut in_flight: InFlight,
    mut events: UnboundedReceiver<Event>,
) -> Response {
    let mut output = Split::default();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token { text, .. } => {
                in_flight.on_token();
                let split = split_text(&mut prepared.reasoning, &text);
                output.reasoning += &split.reasoning;
                output.content += &split.content;
            }
            Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let rest = flush_text(&mut prepared.reasoning);
                output.reasoning += &rest.reasoning;
                output.content += &rest.content;
                in_flight.finish(reason.as_str());
                let meta = &prepared.meta;
                let mut choice = meta.choice(&output, Some(reason.as_str()), false);
                if prepared.reasoning.is_some() && output.reasoning.is_empty() {
                    choice["message"]["reasoning_content"] = Value::Null;
                }
                let mut body = meta.envelope(vec![choice], false);
                body.insert("usage".into(), usage(prompt_tokens, completion_tokens));
                return Json(Value::Object(body)).into_response();
            }
            Event::Failed { message } => {
                in_flight.finish("error");
                return engine_failure(message).into_response();
            }
        }
    }
    in_flight.finish("error");
    engine_failure("the engine stopped".into()).into_response()
}

/// What the event stream of one streamed request needs between events.
struct StreamState {
    prepared: Prepared,
    in_flight: InFlight,
    events: UnboundedReceiver<Event>,
    ended: bool,
}

impl StreamState {
    fn chunk(&self, split: &Split, finish: Option<&str>) -> SseEvent {
        let meta = &self.prepared.meta;
        let mut body = meta.envelope(vec![meta.choice(split, finish, true)], true);
        if self.prepared.params.include_usage {
            body.insert("usage".into(), Value::Null);
        }
        SseEvent::default().data(Value::Object(body).to_string())
    }

    /// The SSE events for the next engine event (none when a token released no text yet).
    async fn next_events(&mut self) -> Option<Vec<SseEvent>> {
        if self.ended {
            return None;
        }
        let Some(event) = self.events.recv().await else {
            self.ended = true;
            self.in_flight.finish("error");
            let error = engine_failure("the engine stopped".into());
            return Some(vec![SseEvent::default().data(error.body().to_string()), done()]);
        };
        Some(match event {
            Event::Token { text, .. } => {
                self.in_flight.on_token();
                let split = split_text(&mut self.prepared.reasoning, &text);
                match split.content.is_empty() && split.reasoning.is_empty() {
                    true => vec![],
                    false => vec![self.chunk(&split, None)],
                }
            }
            Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                self.ended = true;
                self.in_flight.finish(reason.as_str());
                let rest = flush_text(&mut self.prepared.reasoning);
                let mut out = vec![];
                if !rest.content.is_empty() || !rest.reasoning.is_empty() {
                    out.push(self.chunk(&rest, None));
                }
                out.push(self.chunk(&Split::default(), Some(reason.as_str())));
                if self.prepared.params.include_usage {
                    let mut body = self.prepared.meta.envelope(vec![], true);
                    body.insert("usage".into(), usage(prompt_tokens, completion_tokens));
                    out.push(SseEvent::default().data(Value::Object(body).to_string()));
                }
                out.push(done());
                out
            }
            Event::Failed { message } => {
                self.ended = true;
                self.in_flight.finish("error");
                let error = engine_failure(message);
                vec![SseEvent::default().data(error.body().to_string()), done()]
            }
        })
    }
}

fn done() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

/// Streams the generation as server-sent events ending with `data: [DONE]`.
fn respond_streamed(prepared: Prepared, in_flight: InFlight, events: UnboundedReceiver<Event>) -> Response {
    let state = StreamState {
        prepared,
        in_flight,
        events,
        ended: false,
    };
    let opening = match state.prepared.meta.endpoint {
        Endpoint::Chat => {
            let meta = &state.prepared.meta;
            let mut body = meta.envelope(
                vec![json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})],
                true,
            );
            if state.prepared.params.include_usage {
                body.insert("usage".into(), Value::Null);
            }
            vec![SseEvent::default().data(Value::Object(body).to_string())]
        }
        Endpoint::Text => vec![],
    };
    let rest = stream::unfold(state, |mut state| async move {
        let events = state.next_events().await?;
        Some((events, state))
    });
    let all = stream::iter([opening])
        .chain(rest)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::default()).into_response()
}

async fn generate(state: AppState, prepared: Result<(Prepared, Request), ApiError>) -> Response {
    let (prepared, request) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let outcome = match e.status.is_client_error() {
                true => "invalid",
                false => "unavailable",
            };
            state.0.metrics.request_done(outcome, 0, 0);
            return e.into_response();
        }
    };
    let (in_flight, events) = match submit(&state, &prepared.model, request) {
        Ok(admitted) => admitted,
        Err(e) => return e.into_response(),
    };
    match prepared.params.stream {
        true => respond_streamed(prepared, in_flight, events),
        false => respond_whole(prepared, in_flight, events).await,
    }
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    let prepared = prepare_chat(&state, &body);
    generate(state, prepared).await
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    let prepared = prepare_text(&state, &body);
    generate(state, prepared).await
}
