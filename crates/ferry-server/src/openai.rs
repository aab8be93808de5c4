//! The OpenAI renderer: chat completions (reasoning in `reasoning_content`, tool calls in `tool_calls`) and text
//! completions over the
//! protocol-neutral layer (chat.rs, generation.rs), each as one JSON object or as server-sent events ending with
//! `data: [DONE]`; logprobs ride with the text of the tokens they are about (sampling.rs renders them).

use std::cell::Cell;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value};

use crate::body::Body;
use crate::chat::check_model_name;
use crate::error::ApiError;
use crate::generation::{record_refusal, Finish, FinishReason, Generation, Output, Piece};
use crate::params::{ChatBody, CompletionBody, OpenAiOptions};
use crate::sampling;
use crate::{unix_seconds, AppState, LoadedModel};
use ferry_core::engine::TokenLogprobs;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// How a response of one request is written: the fields every object repeats and what the request asked of it.
struct Renderer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// The model may reason: a whole chat answer then says `reasoning_content: null` when it did not.
    splits_reasoning: bool,
    /// The model whose tokens logprobs name, when the request asked for logprobs.
    logprobs_of: Option<Arc<LoadedModel>>,
    /// Where the next token starts in a text completion's output (its logprobs' `text_offset`).
    text_offset: Cell<usize>,
}

/// New output: reasoning and content joined in order, and tool calls in OpenAI's shape: whole calls in a plain
/// answer, the calls' deltas in a streamed chunk (a call's first delta has its index, id, type and name with
/// arguments "", the next ones pieces of its arguments).
#[derive(Default)]
struct Text {
    reasoning: String,
    content: String,
    tool_calls: Vec<Value>,
}

impl Text {
    fn add(&mut self, renderer: &Renderer, pieces: &[Piece], streamed: bool) {
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => self.reasoning += text,
                Piece::Content(text) => self.content += text,
                Piece::ToolCallStart { index, name } => {
                    let mut call = json!({
                        "id": renderer.tool_call_id(*index), "type": "function",
                        "function": {"name": name, "arguments": ""},
                    });
                    if streamed {
                        call["index"] = (*index).into();
                    }
                    self.tool_calls.push(call);
                }
                Piece::ToolCallArguments { index, fragment } => {
                    // A plain answer's call takes the piece, as does this chunk's arguments delta of the call
                    // (not its first delta, whose arguments are "").
                    let call = match streamed {
                        true => self
                            .tool_calls
                            .last_mut()
                            .filter(|call| call["index"] == *index && call.get("id").is_none()),
                        false => self.tool_calls.get_mut(*index),
                    };
                    match call.and_then(|call| call.pointer_mut("/function/arguments")) {
                        Some(Value::String(arguments)) => arguments.push_str(fragment),
                        _ => self
                            .tool_calls
                            .push(json!({"index": index, "function": {"arguments": fragment}})),
                    }
                }
            }
        }
    }

    /// One streamed chunk's output.
    fn of(renderer: &Renderer, pieces: &[Piece]) -> Text {
        let mut text = Text::default();
        text.add(renderer, pieces, true);
        text
    }

    fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::EndOfTurn | FinishReason::StopString(_) => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
    }
}

fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    })
}

impl Renderer {
    fn new(
        state: &AppState,
        endpoint: Endpoint,
        options: &OpenAiOptions,
        splits_reasoning: bool,
        logprobs_of: Option<Arc<LoadedModel>>,
    ) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Text => "cmpl",
        };
        Renderer {
            endpoint,
            id: format!("{prefix}-{:016x}", response_id()),
            created: unix_seconds(),
            model: state.0.config.served_model_name.clone(),
            include_usage: options.include_usage,
            splits_reasoning,
            logprobs_of,
            text_offset: Cell::new(0),
        }
    }

    /// The `logprobs` field of a choice holding these tokens: null unless the request asked for logprobs.
    fn logprobs(&self, tokens: &[(u32, TokenLogprobs)]) -> Value {
        let Some(model) = &self.logprobs_of else {
            return Value::Null;
        };
        match self.endpoint {
            Endpoint::Chat => sampling::chat_json(model, tokens),
            Endpoint::Text => {
                let mut offset = self.text_offset.get();
                let rendered = sampling::completion_json(model, tokens, &mut offset);
                self.text_offset.set(offset);
                rendered
            }
        }
    }

    /// A tool call's id, unique within the response (whose id it carries) and so within the process.
    fn tool_call_id(&self, index: usize) -> String {
        let response = self.id.rsplit('-').next().unwrap_or_default();
        format!("call_{response}{index:02x}")
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.endpoint, streamed) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Text, _) => "text_completion",
        }
    }

    /// One choice's worth of new output (with the logprobs of its tokens), as a chat delta or message, or a text
    /// fragment.
    fn choice(
        &self,
        text: &Text,
        tokens: &[(u32, TokenLogprobs)],
        finish_reason: Option<&str>,
        streamed: bool,
    ) -> Value {
        let logprobs = self.logprobs(tokens);
        match self.endpoint {
            Endpoint::Text => json!({
                "index": 0, "text": text.content, "logprobs": logprobs, "finish_reason": finish_reason,
            }),
            Endpoint::Chat => {
                let mut message = Map::new();
                if !streamed {
                    message.insert("role".into(), "assistant".into());
                }
                if !streamed && text.content.is_empty() && !text.tool_calls.is_empty() {
                    // OpenAI's content when the answer is tool calls alone.
                    message.insert("content".into(), Value::Null);
                } else if !streamed || !text.content.is_empty() {
                    message.insert("content".into(), text.content.clone().into());
                }
                if !text.reasoning.is_empty() {
                    message.insert("reasoning_content".into(), text.reasoning.clone().into());
                } else if !streamed && self.splits_reasoning {
                    message.insert("reasoning_content".into(), Value::Null);
                }
                if !text.tool_calls.is_empty() {
                    message.insert("tool_calls".into(), text.tool_calls.clone().into());
                }
                let key = if streamed { "delta" } else { "message" };
                json!({"index": 0, key: message, "logprobs": logprobs, "finish_reason": finish_reason})
            }
        }
    }

    fn envelope(&self, choices: Vec<Value>, streamed: bool) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("id".into(), self.id.clone().into());
        out.insert("object".into(), self.object(streamed).into());
        out.insert("created".into(), self.created.into());
        out.insert("model".into(), self.model.clone().into());
        out.insert("choices".into(), choices.into());
        out
    }

    /// One streamed chunk holding `choice` (the usage field null, when the request asked for a usage chunk).
    fn chunk(&self, choice: Value) -> SseEvent {
        let mut body = self.envelope(vec![choice], true);
        if self.include_usage {
            body.insert("usage".into(), Value::Null);
        }
        SseEvent::default().data(Value::Object(body).to_string())
    }

    /// The SSE events for the next output: a chunk of new text, or the last ones. Logprobs of tokens whose text
    /// is held back wait in `generation` for the chunk that carries it.
    fn events(&self, output: Output, generation: &mut Generation) -> Vec<SseEvent> {
        match output {
            Output::Pieces(pieces) => {
                let text = Text::of(self, &pieces);
                match text.is_empty() {
                    true => vec![],
                    false => vec![self.chunk(self.choice(&text, &generation.take_logprobs(), None, true))],
                }
            }
            Output::Finished(pieces, finish) => {
                let text = Text::of(self, &pieces);
                let tokens = generation.take_logprobs();
                let mut out = vec![];
                if !text.is_empty() || !tokens.is_empty() {
                    out.push(self.chunk(self.choice(&text, &tokens, None, true)));
                }
                let reason = finish_reason(&finish.reason);
                out.push(self.chunk(self.choice(&Text::default(), &[], Some(reason), true)));
                if self.include_usage {
                    let mut body = self.envelope(vec![], true);
                    body.insert("usage".into(), usage(&finish));
                    out.push(SseEvent::default().data(Value::Object(body).to_string()));
                }
                out.push(done());
                out
            }
            Output::Failed(error) => vec![SseEvent::default().data(error.body().to_string()), done()],
        }
    }

    /// The chunk that opens a streamed chat answer.
    fn opening(&self) -> Vec<SseEvent> {
        match self.endpoint {
            Endpoint::Chat => vec![self.chunk(json!({
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
            }))],
            Endpoint::Text => vec![],
        }
    }
}

/// A response id unique within the process (a counter) and across restarts (the clock), bit-mixed so ids do not
/// look sequential.
pub(crate) fn response_id() -> u64 {
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

fn done() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

/// Waits for the whole generation and answers with one JSON object.
async fn respond_whole(renderer: Renderer, mut generation: Generation) -> Response {
    let mut text = Text::default();
    while let Some(output) = generation.next().await {
        match output {
            Output::Pieces(pieces) => text.add(&renderer, &pieces, false),
            Output::Finished(pieces, finish) => {
                text.add(&renderer, &pieces, false);
                let tokens = generation.take_logprobs();
                let choice = renderer.choice(&text, &tokens, Some(finish_reason(&finish.reason)), false);
                let mut body = renderer.envelope(vec![choice], false);
                body.insert("usage".into(), usage(&finish));
                return Json(Value::Object(body)).into_response();
            }
            Output::Failed(error) => return error.into_response(),
        }
    }
    ApiError::internal("generation failed: no output").into_response()
}

/// Streams the generation as server-sent events ending with `data: [DONE]`.
fn respond_streamed(renderer: Renderer, generation: Generation) -> Response {
    let opening = renderer.opening();
    let rest = stream::unfold((renderer, generation), |(renderer, mut generation)| async move {
        let output = generation.next().await?;
        let events = renderer.events(output, &mut generation);
        Some((events, (renderer, generation)))
    });
    let all = stream::iter([opening])
        .chain(rest)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::default()).into_response()
}

/// A request read, admitted and submitted: how to render it, its output, and whether to stream it.
type Started = (Renderer, Generation, bool);

async fn respond(state: AppState, started: Result<Started, ApiError>) -> Response {
    match started {
        Ok((renderer, generation, true)) => respond_streamed(renderer, generation),
        Ok((renderer, generation, false)) => respond_whole(renderer, generation).await,
        Err(error) => {
            record_refusal(&state, &error);
            error.into_response()
        }
    }
}

fn start_chat(state: &AppState, body: &[u8]) -> Result<Started, ApiError> {
    let ChatBody { chat, options } = ChatBody::parse(&Body::parse(body)?)?;
    check_model_name(state, options.model.as_deref())?;
    let model = state.model()?;
    let (request, parser) = chat.prepare(&model)?.start(state, &model, &chat.params, "messages")?;
    let logprobs_of = chat.params.logprobs.map(|_| model.clone());
    let renderer = Renderer::new(state, Endpoint::Chat, &options, parser.splits_reasoning(), logprobs_of);
    let generation = Generation::start(state, &model, request, parser)?;
    Ok((renderer, generation, chat.params.stream))
}

fn start_text(state: &AppState, body: &[u8]) -> Result<Started, ApiError> {
    let CompletionBody {
        prompt,
        params,
        options,
    } = CompletionBody::parse(&Body::parse(body)?)?;
    check_model_name(state, options.model.as_deref())?;
    let model = state.model()?;
    let (request, parser) = prompt.prepare(&model)?.start(state, &model, &params, "prompt")?;
    let logprobs_of = params.logprobs.map(|_| model.clone());
    let renderer = Renderer::new(state, Endpoint::Text, &options, false, logprobs_of);
    let generation = Generation::start(state, &model, request, parser)?;
    Ok((renderer, generation, params.stream))
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    let started = crate::prompt_work::off_runtime(&state, move |state| start_chat(state, &body)).await;
    respond(state, started).await
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    let started = crate::prompt_work::off_runtime(&state, move |state| start_text(state, &body)).await;
    respond(state, started).await
}
