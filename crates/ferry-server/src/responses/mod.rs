//! OpenAI's Responses API, `POST /v1/responses`, over the protocol-neutral layer (chat.rs, generation.rs): one
//! response object (`output` items: `reasoning`, `message`, `function_call`), or its event stream (stream.rs); kept
//! unless `store` is false (store.rs), to be continued by `previous_response_id`, read or deleted at
//! `/v1/responses/{id}`, its request's input items listed at `/v1/responses/{id}/input_items` (input_items.rs);
//! with `background`, answered at once and generated after, until done or cancelled (`/v1/responses/{id}/cancel`).
//! Errors keep the server's OpenAI shape.
//!
//! Not here: reading the request (request.rs, tools.rs), turning pieces into items and events (output.rs).

mod conversation;
mod input_items;
mod output;
mod request;
mod store;
mod stream;
mod tools;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::body::Body;
use crate::chat::{check_model_name, ChatRequest, PreparedPrompt};
use crate::error::ApiError;
use crate::generation::{record_refusal, Finish, FinishReason, Generation, Output};
use crate::openai::response_id;
use crate::tools::history::{HistoryFormat, HistoryReasoning};
use crate::{unix_seconds, AppState, LoadedModel};
pub use input_items::list as list_input_items;
use output::OutputItems;
use request::ResponsesBody;
pub(crate) use store::{ResponseStore, STORE_BYTES};
use tools::Namespaces;

/// What keeping a finished response needs: the store, the response it continued and its own input items.
struct Keep {
    state: AppState,
    previous: Option<String>,
    input: Vec<Value>,
}

/// The fields every response object of one request repeats.
struct ResponseMeta {
    id: String,
    created_at: u64,
    model: String,
    /// What the request set that the response repeats (`instructions`, `tools`, `metadata`, `store`, ...).
    echo: Map<String, Value>,
    /// Reasoning items carry `encrypted_content` (`include`).
    encrypted_reasoning: bool,
    /// The functions of the request's namespaces: their calls name the namespace.
    namespaces: Namespaces,
    /// Where the finished response is kept, unless `store` is false.
    keep: Option<Keep>,
    /// The model whose tokens the message's logprobs name, when the request asked for them.
    logprobs_of: Option<Arc<LoadedModel>>,
}

/// `usage`: the prompt (with the tokens the prefix cache held) and the output (with its reasoning).
fn usage(finish: &Finish) -> Value {
    json!({
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": finish.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    })
}

/// The response's status when it ended this way, and the status of an item it cut short.
fn status(finish: &Finish) -> &'static str {
    match finish.reason {
        FinishReason::Length => "incomplete",
        _ => "completed",
    }
}

impl ResponseMeta {
    /// The output items this response builds.
    fn items(&self) -> OutputItems {
        OutputItems::new(
            &self.id,
            self.encrypted_reasoning,
            self.namespaces.clone(),
            self.logprobs_of.clone(),
        )
    }

    /// Keeps the finished response `object`, when the request asked for it.
    fn kept(&self, object: &Value) {
        if let Some(keep) = &self.keep {
            let mut store = keep.state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
            store.insert(keep.previous.clone(), keep.input.clone(), object.clone());
        }
    }

    /// The response object: in progress (no `finish`), or finished with its output.
    fn object(&self, output: Vec<Value>, finish: Option<&Finish>) -> Value {
        let mut object = self.echo.clone();
        let (status, usage) = match finish {
            None => ("in_progress", Value::Null),
            Some(finish) => (status(finish), usage(finish)),
        };
        let incomplete_details = match status {
            "incomplete" => json!({"reason": "max_output_tokens"}),
            _ => Value::Null,
        };
        for (key, value) in [
            ("id", self.id.clone().into()),
            ("object", "response".into()),
            ("created_at", self.created_at.into()),
            ("status", status.into()),
            ("error", Value::Null),
            ("incomplete_details", incomplete_details),
            ("model", self.model.clone().into()),
            ("output", output.into()),
            ("usage", usage),
        ] {
            object.insert(key.into(), value);
        }
        Value::Object(object)
    }
}

/// An error raised by the neutral layer or the chat route's tool rules, named in this API's terms: the conversation
/// is `input`, the output format `text.format`, the effort `reasoning.effort`, a tool's fields are its own (not
/// inside `function`), a named `tool_choice` names its function in `name`, and an `allowed_tools` one holds its
/// `mode` and `tools` itself.
fn in_responses_terms(mut error: ApiError) -> ApiError {
    let Some(param) = error.param.clone() else {
        return error;
    };
    let renamed = match param.as_str() {
        param if param.starts_with("messages") => "input".to_string(),
        "response_format" => "text.format".into(),
        "reasoning_effort" => "reasoning.effort".into(),
        "tool_choice.function" | "tool_choice.function.name" => "tool_choice.name".into(),
        // An allowed_tools choice holds its mode and tools itself, each tool its name.
        param if param.starts_with("tool_choice.allowed_tools") => param
            .replacen("allowed_tools", "", 1)
            .replacen("..", ".", 1)
            .replacen(".function", "", 1)
            .trim_end_matches('.')
            .to_string(),
        param if param.starts_with("tools[") => param.replacen(".function", "", 1),
        _ => return error,
    };
    error.message = error.message.replace(&param, &renamed);
    error.param = Some(renamed);
    error
}

/// The finished response object, once `generation` has ended, or why it failed.
async fn generated(meta: &ResponseMeta, mut generation: Generation) -> Result<Value, ApiError> {
    let mut items = meta.items();
    // A whole response has no use for the events.
    let mut events = vec![];
    while let Some(output) = generation.next().await {
        events.clear();
        match output {
            Output::Pieces(pieces) => items.token(&pieces, &generation.take_logprobs(), &mut events),
            Output::Finished(pieces, finish) => {
                items.pieces(&pieces, &mut events);
                items.close(status(&finish), &mut events);
                return Ok(meta.object(items.items(), Some(&finish)));
            }
            Output::Failed(error) => return Err(error),
        }
    }
    Err(ApiError::internal("generation failed: no output"))
}

async fn respond_whole(meta: ResponseMeta, generation: Generation) -> Response {
    match generated(&meta, generation).await {
        Ok(object) => {
            meta.kept(&object);
            Json(object).into_response()
        }
        Err(error) => error.into_response(),
    }
}

/// `background`: answers at once with the response in progress (kept, so that `GET /v1/responses/{id}` reads it),
/// and generates it in a task of its own, kept again when it ends (`failed`, with the error, if it fails) unless
/// `POST /v1/responses/{id}/cancel` stopped it first. The registry of background tasks decides between the two:
/// whichever takes the response's entry out of it first has the last word.
fn respond_in_background(state: &AppState, meta: ResponseMeta, generation: Generation) -> Response {
    let in_progress = meta.object(vec![], None);
    meta.kept(&in_progress);
    let (id, task_state) = (meta.id.clone(), state.clone());
    // Registered before the task can end: it takes its own entry out under the same lock.
    let mut registry = state.0.background.lock().unwrap_or_else(|e| e.into_inner());
    let task = tokio::spawn(async move {
        let object = match generated(&meta, generation).await {
            Ok(object) => object,
            Err(error) => {
                let mut object = meta.object(vec![], None);
                object["status"] = "failed".into();
                object["error"] = json!({"code": "server_error", "message": error.message});
                object
            }
        };
        let mut registry = task_state.0.background.lock().unwrap_or_else(|e| e.into_inner());
        if registry.remove(&meta.id).is_some() {
            meta.kept(&object);
        }
    });
    registry.insert(id, task.abort_handle());
    Json(in_progress).into_response()
}

/// `truncation: "auto"`: the prompt with as few of the conversation's earliest turns left out as let it fit the
/// context window (OpenAI's API drops input items from the beginning of the conversation). The system messages
/// (`instructions`) stay, and what is kept starts at a user message, so that the template never gets a tool's
/// result or an assistant's turn without what came before it; a binary search over those starts. When not even the
/// last turn fits, the whole prompt goes on, to be refused as too long.
fn prepare_truncated(chat: &ChatRequest, model: &LoadedModel) -> Result<PreparedPrompt, ApiError> {
    let fits = |prepared: &Result<PreparedPrompt, ApiError>| match prepared {
        Ok(prompt) => prompt.ids.len() < model.max_model_len,
        // Any other error is the request's, whatever is left out.
        Err(error) => error.code != Some("context_length_exceeded"),
    };
    let whole = chat.prepare(model);
    if fits(&whole) {
        return whole;
    }
    let messages = &chat.messages;
    let system = messages
        .iter()
        .take_while(|m| m.role == "system" || m.role == "developer")
        .count();
    let starts: Vec<usize> = (system + 1..messages.len())
        .filter(|&i| messages[i].role == "user")
        .collect();
    let from = |start: usize| {
        let mut kept = chat.clone();
        kept.messages.drain(system..start);
        kept.prepare(model)
    };
    // Leaving more out never makes the prompt longer: the first start that fits is found by halving.
    let (mut low, mut high, mut found) = (0, starts.len(), None);
    while low < high {
        let middle = (low + high) / 2;
        let prepared = from(starts[middle]);
        if fits(&prepared) {
            found = Some((starts[middle], prepared));
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    match found {
        Some((start, prepared)) => {
            tracing::info!(
                "truncation: the {} earliest input messages left out to fit the context window",
                start - system
            );
            prepared
        }
        None => whole,
    }
}

/// A request read, admitted and submitted: how to render it, its output, whether to stream it.
/// A request read and submitted: its response's fields, its generation, and whether it streams or runs in the
/// background.
type Started = (ResponseMeta, Generation, bool, bool);

/// A request's own `input` as items (a string is one user message).
fn input_items(body: &Body) -> Vec<Value> {
    match body.raw("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items.clone(),
        _ => vec![],
    }
}

fn start(state: &AppState, body: &[u8]) -> Result<Started, ApiError> {
    let body = Body::parse(body)?;
    let model = state.model()?;
    // A continued conversation: the kept one, then this request's input.
    let previous = body.string("previous_response_id")?;
    let store = request::stored(&body)?;
    // Copied only when a kept conversation or this response's keeping needs it.
    let input = match previous.is_some() || store {
        true => input_items(&body),
        false => vec![],
    };
    let body = match &previous {
        None => body,
        Some(id) => {
            let store = state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
            let mut items = store
                .conversation(id)
                .map_err(|message| ApiError::invalid_param("previous_response_id", message))?;
            items.extend(input.iter().cloned());
            body.with("input", Value::Array(items))
        }
    };
    let keep = store.then(|| Keep {
        state: state.clone(),
        previous,
        input,
    });
    let keeps_reasoning = HistoryFormat::of(&model).reasoning != HistoryReasoning::Unrendered;
    let ResponsesBody {
        model: name,
        chat,
        echo,
        encrypted_reasoning,
        namespaces,
        truncate,
        background,
    } = ResponsesBody::parse(&body, keeps_reasoning)?;
    check_model_name(state, name.as_deref())?;
    let prepared = match truncate {
        true => prepare_truncated(&chat, &model),
        false => chat.prepare(&model),
    };
    let (request, parser) = prepared
        .and_then(|prompt| prompt.start(state, &model, &chat.params, "input"))
        .map_err(in_responses_terms)?;
    let generation = Generation::start(state, &model, request, parser)?;
    let logprobs_of = chat.params.logprobs.map(|_| model.clone());
    let meta = ResponseMeta {
        id: format!("resp_{:016x}", response_id()),
        created_at: unix_seconds(),
        model: state.0.config.served_model_name.clone(),
        echo,
        encrypted_reasoning,
        namespaces,
        keep,
        logprobs_of,
    };
    Ok((meta, generation, chat.params.stream, background))
}

/// `POST /v1/responses`.
pub async fn responses(State(state): State<AppState>, body: Bytes) -> Response {
    match crate::prompt_work::off_runtime(&state, move |state| start(state, &body)).await {
        Ok((meta, generation, _, true)) => respond_in_background(&state, meta, generation),
        Ok((meta, generation, true, false)) => stream::respond(meta, generation),
        Ok((meta, generation, false, false)) => respond_whole(meta, generation).await,
        Err(error) => {
            record_refusal(&state, &error);
            error.into_response()
        }
    }
}

/// `GET /v1/responses/{id}`: a kept response.
pub async fn retrieve(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let store = state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
    match store.get(&id) {
        Some(object) => Json(object.clone()).into_response(),
        None => ApiError::not_found("response", &id).into_response(),
    }
}

/// `POST /v1/responses/{id}/cancel`: stops a background response still being generated (its generation is
/// dropped, which frees its place in the engine) and keeps it as `cancelled`, which it answers with. A response that
/// is not in progress in the background cannot be cancelled: a 400, or a 404 for an id not kept.
pub async fn cancel(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let mut registry = state.0.background.lock().unwrap_or_else(|e| e.into_inner());
    let mut store = state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
    let Some(task) = registry.remove(&id) else {
        return match store.get(&id) {
            Some(_) => ApiError::invalid_param(
                "response_id",
                "only a background response still in progress can be cancelled",
            )
            .into_response(),
            None => ApiError::not_found("response", &id).into_response(),
        };
    };
    task.abort();
    let Some(mut object) = store.get(&id).cloned() else {
        return ApiError::not_found("response", &id).into_response();
    };
    object["status"] = "cancelled".into();
    store.replace(&id, object.clone());
    Json(object).into_response()
}

/// `DELETE /v1/responses/{id}`: forgets a kept response (a conversation that continued it can no longer go on).
pub async fn delete(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    // A background response still being generated stops, and is not kept when it would have ended.
    if let Some(task) = state.0.background.lock().unwrap_or_else(|e| e.into_inner()).remove(&id) {
        task.abort();
    }
    let mut store = state.0.responses.lock().unwrap_or_else(|e| e.into_inner());
    match store.remove(&id) {
        true => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        false => ApiError::not_found("response", &id).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_neutral_layers_fields_are_named_as_this_api_names_them() {
        let renamed = in_responses_terms(ApiError::invalid_param(
            "reasoning_effort",
            "this model's chat template takes no reasoning effort",
        ));
        assert_eq!(renamed.param.as_deref(), Some("reasoning.effort"));
        let renamed = in_responses_terms(ApiError::invalid_param("response_format", "`response_format`: bad"));
        assert_eq!(
            (renamed.param.as_deref(), renamed.message.as_str()),
            (Some("text.format"), "`text.format`: bad")
        );
        let renamed = in_responses_terms(ApiError::invalid_param(
            "tools[1].function.strict",
            "`tools[1].function.strict`",
        ));
        assert_eq!(
            (renamed.param.as_deref(), renamed.message.as_str()),
            (Some("tools[1].strict"), "`tools[1].strict`")
        );
        let kept = in_responses_terms(ApiError::invalid_param("tools", "x"));
        assert_eq!(kept.param.as_deref(), Some("tools"));
    }

    #[test]
    fn a_response_cut_by_its_token_limit_is_incomplete() {
        let meta = ResponseMeta {
            id: "resp_1".into(),
            created_at: 1,
            model: "m".into(),
            echo: Map::new(),
            encrypted_reasoning: false,
            namespaces: Namespaces::default(),
            keep: None,
            logprobs_of: None,
        };
        let finish = |reason| Finish {
            reason,
            prompt_tokens: 5,
            cached_tokens: 2,
            completion_tokens: 3,
            reasoning_tokens: 1,
        };
        let cut = meta.object(vec![], Some(&finish(FinishReason::Length)));
        assert_eq!(cut["status"], "incomplete");
        assert_eq!(cut["incomplete_details"], json!({"reason": "max_output_tokens"}));
        assert_eq!(
            cut["usage"],
            json!({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                   "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 8})
        );
        let done = meta.object(vec![], Some(&finish(FinishReason::ToolCalls)));
        assert_eq!(
            (done["status"].as_str(), &done["incomplete_details"]),
            (Some("completed"), &Value::Null)
        );
        assert_eq!(meta.object(vec![], None)["status"], "in_progress");
    }
}
