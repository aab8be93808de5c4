//! The endpoints around generation: the model list and card (`GET /v1/models`, `GET /v1/models/{id}`), and vLLM's
//! `POST /tokenize` (a prompt, or messages through the chat template) and `POST /detokenize`.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::body::{wrong_type, Body};
use crate::chat::{check_model_name, tokenize, ChatRequest};
use crate::error::ApiError;
use crate::params::{chat_ending, messages, template_kwargs, NO_ACTION_FIELDS};
use crate::AppState;

/// The served model as OpenAI describes a model (with vLLM's `max_model_len`, null while it loads).
fn model_card(state: &AppState) -> Value {
    let max_model_len = state.model().ok().map(|m| m.max_model_len);
    json!({
        "id": state.0.config.served_model_name,
        "object": "model",
        "created": state.0.started_at,
        "owned_by": "ferry",
        "max_model_len": max_model_len,
    })
}

pub async fn models(State(state): State<AppState>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let served = &state.0.config.served_model_name;
    match &id == served {
        true => Json(model_card(&state)).into_response(),
        false => ApiError::model_not_found(&id, served).into_response(),
    }
}

/// `{"prompt", "add_special_tokens" (default true)}` or `{"messages", "add_generation_prompt" (default true),
/// "continue_final_message" (default false), "add_special_tokens" (default false), "chat_template_kwargs"}` ->
/// `{"count", "max_model_len", "tokens"}`.
fn tokenized(state: &AppState, body: &[u8]) -> Result<Value, ApiError> {
    let body = Body::parse(body)?;
    check_model_name(state, body.string("model")?.as_deref())?;
    let model = state.model()?;
    let flag = |name: &str, default: bool| -> Result<bool, ApiError> {
        match body.get(name) {
            None => Ok(default),
            Some(_) => body.boolean(name),
        }
    };
    let tokens = match (body.get("prompt"), body.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "send `prompt` or `messages`, not both",
            ))
        }
        (Some(Value::String(prompt)), None) => tokenize(&model, prompt, flag("add_special_tokens", true)?)?,
        (Some(other), None) => return Err(wrong_type("prompt", "a string", other)),
        (None, _) => {
            let chat = ChatRequest {
                messages: messages(&body)?,
                template_kwargs: template_kwargs(&body)?,
                ..ChatRequest::default()
            };
            let ending = chat_ending(
                flag("add_generation_prompt", true)?,
                flag("continue_final_message", false)?,
            )?;
            let prompt = chat.encode(&model, ending)?;
            match flag("add_special_tokens", false)? {
                true => tokenize(&model, &prompt.text, true)?,
                false => prompt.ids,
            }
        }
    };
    body.refuse_unread(NO_ACTION_FIELDS)?;
    Ok(json!({"count": tokens.len(), "max_model_len": model.max_model_len, "tokens": tokens}))
}

/// `{"tokens": [ids]}` -> `{"prompt": text}`.
fn detokenized(state: &AppState, body: &[u8]) -> Result<Value, ApiError> {
    let body = Body::parse(body)?;
    check_model_name(state, body.string("model")?.as_deref())?;
    let model = state.model()?;
    let vocab = model.tokenizer.vocab_size();
    let ids = match body.get("tokens") {
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                item.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .filter(|&id| (id as usize) < vocab)
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            &format!("tokens[{i}]"),
                            format!("`tokens[{i}]` must be a token id below {vocab}"),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(wrong_type("tokens", "an array of token ids", other)),
        None => return Err(ApiError::invalid_param("tokens", "`tokens` is required")),
    };
    body.refuse_unread(NO_ACTION_FIELDS)?;
    let prompt = model
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(json!({"prompt": prompt}))
}

pub async fn tokenize_route(State(state): State<AppState>, body: Bytes) -> Response {
    match crate::prompt_work::off_runtime(&state, move |state| tokenized(state, &body)).await {
        Ok(answer) => Json(answer).into_response(),
        Err(error) => error.into_response(),
    }
}

pub async fn detokenize_route(State(state): State<AppState>, body: Bytes) -> Response {
    match crate::prompt_work::off_runtime(&state, move |state| detokenized(state, &body)).await {
        Ok(answer) => Json(answer).into_response(),
        Err(error) => error.into_response(),
    }
}
