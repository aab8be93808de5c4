//! The Anthropic renderer: `POST /v1/messages` (one message object, or its event stream) and
//! `POST /v1/messages/count_tokens` over the protocol-neutral layer (chat.rs, generation.rs), and errors in
//! Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`) on these routes, whoever raised them.
//!
//! Not here: reading the request (request.rs), the event stream's sequence (stream.rs).

mod request;
mod stream;
mod tools;

use std::sync::Arc;

use axum::body::{to_bytes, Body as HttpBody, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::body::Body;
use crate::chat::check_model_name;
use crate::error::ApiError;
use crate::generation::{record_refusal, Finish, FinishReason, Generation, Output, Piece};
use crate::openai::response_id;
use crate::tools::history::{HistoryFormat, HistoryReasoning};
use crate::{AppState, LoadedModel};
use request::{MessagesBody, Purpose};

/// The routes whose errors are rendered in Anthropic's shape.
const ROUTE_PREFIX: &str = "/v1/messages";

/// Longest error body re-rendered; the server's own errors are far shorter.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Anthropic's error type for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Re-renders any error response on the Anthropic routes (the guard's 401 and 415, a 404, the handlers' own) from
/// the server's OpenAI shape into Anthropic's.
pub async fn errors_in_anthropic_shape(request: Request, next: Next) -> Response {
    if !request.uri().path().starts_with(ROUTE_PREFIX) {
        return next.run(request).await;
    }
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = to_bytes(body, ERROR_BODY_LIMIT).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|error| error["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    let body = error_body(status, &message).to_string();
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, HttpBody::from(body))
}

fn stop_reason(reason: &FinishReason) -> (&'static str, Option<&str>) {
    match reason {
        FinishReason::EndOfTurn => ("end_turn", None),
        FinishReason::StopString(stop) => ("stop_sequence", Some(stop)),
        FinishReason::Length => ("max_tokens", None),
        FinishReason::ToolCalls => ("tool_use", None),
    }
}

/// The request, read against the loaded model (whether its template renders earlier reasoning decides what thinking
/// blocks become).
fn read(state: &AppState, body: &[u8], purpose: Purpose) -> Result<(Arc<LoadedModel>, MessagesBody), ApiError> {
    let body = Body::parse(body)?;
    let model = state.model()?;
    let keeps_reasoning = HistoryFormat::of(&model).reasoning != HistoryReasoning::Unrendered;
    let messages = MessagesBody::parse(&body, purpose, keeps_reasoning)?;
    check_model_name(state, Some(&messages.model))?;
    Ok((model, messages))
}

/// A message's content blocks from its pieces: consecutive pieces of one kind make one block; each tool call is a
/// `tool_use` block whose `input` is its arguments.
fn content_blocks(meta: &MessageMeta, pieces: &[Piece]) -> Vec<Value> {
    let mut blocks: Vec<Value> = vec![];
    // (block, arguments' text) of each tool call
    let mut calls: Vec<(usize, String)> = vec![];
    for piece in pieces {
        let (kind, key, text) = match piece {
            Piece::Reasoning(text) => ("thinking", "thinking", text),
            Piece::Content(text) => ("text", "text", text),
            Piece::ToolCallStart { index, name } => {
                calls.push((blocks.len(), String::new()));
                blocks.push(json!({"type": "tool_use", "id": meta.tool_use_id(*index), "name": name, "input": {}}));
                continue;
            }
            Piece::ToolCallArguments { fragment, .. } => {
                if let Some((_, arguments)) = calls.last_mut() {
                    arguments.push_str(fragment);
                }
                continue;
            }
        };
        match blocks.last_mut() {
            Some(last) if last["type"] == kind => {
                let joined = format!("{}{text}", last[key].as_str().unwrap_or_default());
                last[key] = joined.into();
            }
            _ if kind == "thinking" => blocks.push(json!({"type": kind, key: text, "signature": ""})),
            _ => blocks.push(json!({"type": kind, key: text})),
        }
    }
    for (block, arguments) in calls {
        // The tool call parser's arguments are always a JSON object.
        blocks[block]["input"] = serde_json::from_str(&arguments).unwrap_or_else(|_| json!({}));
    }
    blocks
}

/// Anthropic counts the prompt tokens read from the cache apart from `input_tokens`: the prompt is their sum.
fn usage(finish: &Finish) -> Value {
    json!({
        "input_tokens": finish.prompt_tokens - finish.cached_tokens,
        "cache_read_input_tokens": finish.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": finish.completion_tokens,
    })
}

/// The fields every message object of one response repeats.
struct MessageMeta {
    id: String,
    model: String,
}

impl MessageMeta {
    /// A `tool_use` block's id, unique within the message (whose id it carries) and so within the process.
    fn tool_use_id(&self, index: usize) -> String {
        format!("toolu_{}{index:02x}", self.id.trim_start_matches("msg_"))
    }

    fn message(&self, content: Vec<Value>, finish: Option<&Finish>, input_tokens: usize) -> Value {
        let (stop_reason, stop_sequence) = match finish.map(|f| stop_reason(&f.reason)) {
            Some((reason, sequence)) => (Some(reason), sequence),
            None => (None, None),
        };
        let usage = match finish {
            Some(finish) => usage(finish),
            None => json!({"input_tokens": input_tokens, "output_tokens": 0}),
        };
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage,
        })
    }
}

async fn respond_whole(meta: MessageMeta, mut generation: Generation) -> Response {
    let mut pieces = vec![];
    while let Some(output) = generation.next().await {
        match output {
            Output::Pieces(new) => pieces.extend(new),
            Output::Finished(last, finish) => {
                pieces.extend(last);
                let message = meta.message(content_blocks(&meta, &pieces), Some(&finish), finish.prompt_tokens);
                return Json(message).into_response();
            }
            Output::Failed(error) => return error.into_response(),
        }
    }
    ApiError::internal("generation failed: no output").into_response()
}

/// An error of the neutral layer named in this API's terms: the structured output is `output_config.format`.
fn in_anthropic_terms(mut error: ApiError) -> ApiError {
    const FORMAT: &str = "output_config.format";
    if error.param.as_deref() == Some("response_format") {
        error.message = error.message.replace("response_format", FORMAT);
        error.param = Some(FORMAT.into());
    }
    error
}

/// A request read, admitted and submitted: how to render it, its prompt's length, its output, whether to stream it.
type Started = (MessageMeta, usize, Generation, bool);

fn start(state: &AppState, body: &[u8]) -> Result<Started, ApiError> {
    let (model, messages) = read(state, body, Purpose::Generate)?;
    let chat = &messages.chat;
    let prompt = chat.prepare(&model)?;
    let input_tokens = prompt.ids.len();
    let (request, parser) = prompt
        .start(state, &model, &chat.params, "messages")
        .map_err(in_anthropic_terms)?;
    let generation = Generation::start(state, &model, request, parser)?;
    let meta = MessageMeta {
        id: format!("msg_{:016x}", response_id()),
        model: state.0.config.served_model_name.clone(),
    };
    Ok((meta, input_tokens, generation, chat.params.stream))
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, body: Bytes) -> Response {
    match crate::prompt_work::off_runtime(&state, move |state| start(state, &body)).await {
        Ok((meta, input_tokens, generation, true)) => stream::respond(meta, input_tokens, generation),
        Ok((meta, _, generation, false)) => respond_whole(meta, generation).await,
        Err(error) => {
            record_refusal(&state, &error);
            error.into_response()
        }
    }
}

/// `POST /v1/messages/count_tokens`: the tokens the same request to /v1/messages would prompt the model with.
pub async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Response {
    let counted = crate::prompt_work::off_runtime(&state, move |state| {
        let (model, messages) = read(state, &body, Purpose::CountTokens)?;
        Ok(messages.chat.prepare(&model)?.ids.len())
    })
    .await;
    match counted {
        Ok(input_tokens) => Json(json!({"input_tokens": input_tokens})).into_response(),
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_pieces_of_a_kind_make_one_block() {
        let pieces = [
            Piece::Reasoning("a".into()),
            Piece::Reasoning("b".into()),
            Piece::Content("c".into()),
            Piece::Content("d".into()),
        ];
        let meta = MessageMeta {
            id: "msg_00ab".into(),
            model: "m".into(),
        };
        assert_eq!(
            content_blocks(&meta, &pieces),
            vec![
                json!({"type": "thinking", "thinking": "ab", "signature": ""}),
                json!({"type": "text", "text": "cd"}),
            ]
        );
        assert_eq!(content_blocks(&meta, &[]), Vec::<Value>::new());
        let calls = [
            Piece::Content("c".into()),
            Piece::ToolCallStart {
                index: 0,
                name: "f".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "{\"a\":".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "1}".into(),
            },
            Piece::ToolCallStart {
                index: 1,
                name: "g".into(),
            },
            Piece::ToolCallArguments {
                index: 1,
                fragment: "{}".into(),
            },
        ];
        assert_eq!(
            content_blocks(&meta, &calls),
            vec![
                json!({"type": "text", "text": "c"}),
                json!({"type": "tool_use", "id": "toolu_00ab00", "name": "f", "input": {"a": 1}}),
                json!({"type": "tool_use", "id": "toolu_00ab01", "name": "g", "input": {}}),
            ]
        );
    }

    #[test]
    fn statuses_map_to_anthropic_error_types() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (415, "invalid_request_error"),
            (500, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
    }
}
