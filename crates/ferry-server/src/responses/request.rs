//! OpenAI Responses request bodies read into the protocol-neutral request (chat.rs), field by field like params.rs:
//! each mistake a 400 naming the field, and a field this server does not implement a 400 naming it too (as on the
//! chat route).
//!
//! `input` (a string, or items: messages, an earlier turn's `function_call`s, `function_call_output`s and
//! `reasoning`) becomes the template's conversation, after `instructions` as its system message; with
//! `previous_response_id` the kept conversation comes first (mod.rs puts it in `input`; store.rs keeps it).
//! `store` (true unless false, as in OpenAI's API) says whether this response is kept. What stateless clients use
//! instead, `include: ["reasoning.encrypted_content"]`, is served too: the reasoning items carry their text in
//! `encrypted_content` (output.rs), which comes back in a later turn's `input`. `include:
//! ["message.output_text.logprobs"]` or `top_logprobs` ask for the message's logprobs (output.rs attaches them);
//! `truncation: "auto"` lets a conversation too long for the context window lose its earliest turns (mod.rs).
//!
//! Not here: the input items' conversion (conversation.rs), the tool fields (tools.rs), the response (mod.rs,
//! output.rs).

use ferry_core::engine::ResponseFormat;
use ferry_core::loader::{ChatEnding, ChatMessage};
use serde_json::{json, Map, Value};

use super::conversation::input;
use super::tools::{tool_request, Namespaces};
use crate::body::{wrong_type, Body};
use crate::chat::{ChatRequest, GenerationParams, ReasoningEffort};
use crate::error::ApiError;

/// Fields accepted although nothing reads them, because by their nature they ask nothing of this server.
const NO_ACTION_FIELDS: &[&str] = &[
    // An end-user id that OpenAI keeps for abuse monitoring, as `user` is; a self-hosted server has no such monitoring.
    "safety_identifier",
    // A hint that routes requests sharing a prefix to one cache; this server's prefix cache finds shared prefixes by
    // their tokens.
    "prompt_cache_key",
    // The client's own bookkeeping (Codex sends its installation, session and turn ids), for its analytics.
    "client_metadata",
];

/// The efforts the templates that take one (gpt-oss's) know.
const EFFORTS: [&str; 3] = ["low", "medium", "high"];

/// Most `metadata` pairs, and the longest key and value (OpenAI's limits).
const METADATA_PAIRS: usize = 16;
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;

/// A Responses request.
#[derive(Clone, Debug)]
pub struct ResponsesBody {
    pub model: Option<String>,
    pub chat: ChatRequest,
    /// The fields the response object repeats of the request (`instructions`, `tools`, `metadata`, ...).
    pub echo: Map<String, Value>,
    /// `include` asked for `reasoning.encrypted_content`.
    pub encrypted_reasoning: bool,
    /// The functions of the request's `namespace` tools, which calls name with their namespace.
    pub namespaces: Namespaces,
    /// `truncation: "auto"`: a conversation too long for the context window loses its earliest turns (mod.rs).
    pub truncate: bool,
    /// `background`: the request is answered at once, the response generated after and kept (mod.rs).
    pub background: bool,
}

/// `include` for reasoning items that carry their text for a later turn.
pub(super) const ENCRYPTED_REASONING: &str = "reasoning.encrypted_content";
/// `include` for the logprobs of the message's tokens.
const OUTPUT_LOGPROBS: &str = "message.output_text.logprobs";

/// What `include` asked for: of what OpenAI can add to a response, [`ENCRYPTED_REASONING`] and [`OUTPUT_LOGPROBS`]
/// exist here (no tool outputs, no images), so any other value is refused.
#[derive(Default)]
struct Include {
    encrypted_reasoning: bool,
    logprobs: bool,
}

fn include(body: &Body) -> Result<Include, ApiError> {
    let mut include = Include::default();
    for (index, value) in body.strings("include", false)?.iter().enumerate() {
        match value.as_str() {
            ENCRYPTED_REASONING => include.encrypted_reasoning = true,
            OUTPUT_LOGPROBS => include.logprobs = true,
            _ => {
                let param = format!("include[{index}]");
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "`{param}` is \"{}\": this server can include only \"{ENCRYPTED_REASONING}\" and \
                         \"{OUTPUT_LOGPROBS}\"",
                        crate::error::quote(value)
                    ),
                ));
            }
        }
    }
    Ok(include)
}

/// The message's logprobs: asked for by `include` or by `top_logprobs` (0 to 20 alternatives a token, which alone
/// could mean nothing else); how many alternatives, or None for none.
fn logprobs(body: &Body, included: bool) -> Result<Option<usize>, ApiError> {
    Ok(crate::sampling::top_logprobs(body)?.or(included.then_some(0)))
}

pub(super) fn required(body: &Body, name: &str) -> ApiError {
    let param = body.param(name);
    ApiError::invalid_param(&param, format!("`{param}` is required"))
}

impl ResponsesBody {
    /// `keeps_reasoning`: the served model's template renders earlier reasoning, so `reasoning` items go back into
    /// its history (for one that renders none they are dropped, as the template would drop them).
    pub fn parse(body: &Body, keeps_reasoning: bool) -> Result<Self, ApiError> {
        let previous_response_id = body.string("previous_response_id")?;
        let store = stored(body)?;
        let instructions = body.string("instructions")?;
        let mut messages: Vec<ChatMessage> = instructions
            .iter()
            .map(|text| ChatMessage::text("system", text))
            .collect();
        messages.extend(input(body, keeps_reasoning)?);
        let (tools, mut echo, namespaces) = tool_request(body)?;
        let (response_format, text) = text_format(body)?;
        let (reasoning_effort, reasoning) = reasoning(body)?;
        let max_tokens = body.positive("max_output_tokens")?;
        let temperature = body.number_in("temperature", 0.0, 2.0)?;
        let top_p = body.number_in("top_p", 0.0, 1.0)?;
        if top_p == Some(0.0) {
            return Err(ApiError::invalid_param("top_p", "`top_p` must be greater than 0"));
        }
        let user = body.string("user")?;
        let background = body.boolean("background")?;
        let stream = body.boolean("stream")?;
        if background && !store {
            return Err(ApiError::invalid_param(
                "background",
                "a background response is kept to be read later: it needs `store` true",
            ));
        }
        if background && stream {
            return Err(ApiError::invalid_param(
                "background",
                "a background response is read with GET /v1/responses/{id}; it cannot also be streamed",
            ));
        }
        echo.insert("background".into(), background.into());
        echo.insert("instructions".into(), instructions.into());
        echo.insert("max_output_tokens".into(), max_tokens.into());
        echo.insert("metadata".into(), metadata(body)?);
        echo.insert("previous_response_id".into(), previous_response_id.into());
        echo.insert("reasoning".into(), reasoning);
        echo.insert("store".into(), store.into());
        echo.insert("temperature".into(), temperature.into());
        echo.insert("text".into(), text);
        echo.insert("top_p".into(), top_p.into());
        let truncate = truncation(body)?;
        echo.insert("truncation".into(), if truncate { "auto" } else { "disabled" }.into());
        echo.insert("user".into(), user.into());
        let include = include(body)?;
        let logprobs = logprobs(body, include.logprobs)?;
        echo.insert("top_logprobs".into(), logprobs.into());
        let chat = ChatRequest {
            messages,
            // vLLM's extension, as on the chat route (e.g. Qwen3's `enable_thinking`).
            template_kwargs: crate::params::template_kwargs(body)?,
            thinking: None,
            thinking_budget: None,
            reasoning_effort,
            tools,
            ending: ChatEnding::GenerationPrompt,
            params: GenerationParams {
                max_tokens,
                temperature,
                top_p,
                response_format,
                stream,
                logprobs,
                cache_salt: crate::params::cache_salt(body)?,
                priority: body.integer("priority")?.unwrap_or(0),
                ..GenerationParams::default()
            },
        };
        let model = body.string("model")?;
        body.refuse_unread(NO_ACTION_FIELDS)?;
        Ok(ResponsesBody {
            model,
            chat,
            echo,
            encrypted_reasoning: include.encrypted_reasoning,
            namespaces,
            truncate,
            background,
        })
    }
}

/// `store`: whether the response is kept (true unless false, as in OpenAI's API).
pub fn stored(body: &Body) -> Result<bool, ApiError> {
    match body.get("store") {
        None => Ok(true),
        Some(_) => body.boolean("store"),
    }
}

/// `truncation`: `"disabled"` (the default: a conversation too long for the context window is a 400) or `"auto"`.
fn truncation(body: &Body) -> Result<bool, ApiError> {
    match body.string("truncation")?.as_deref() {
        None | Some("disabled") => Ok(false),
        Some("auto") => Ok(true),
        Some(other) => Err(ApiError::invalid_param(
            "truncation",
            format!(
                "`truncation` is \"{}\"; expected \"auto\" or \"disabled\"",
                crate::error::quote(other)
            ),
        )),
    }
}

/// `metadata`: at most 16 string pairs, echoed in the response.
fn metadata(body: &Body) -> Result<Value, ApiError> {
    let Some(pairs) = body.object("metadata")? else {
        return Ok(Value::Null);
    };
    let fits = pairs.len() <= METADATA_PAIRS
        && pairs.iter().all(|(key, value)| {
            key.chars().count() <= METADATA_KEY_CHARS
                && value
                    .as_str()
                    .is_some_and(|v| v.chars().count() <= METADATA_VALUE_CHARS)
        });
    match fits {
        true => Ok(Value::Object(pairs.clone())),
        false => Err(ApiError::invalid_param(
            "metadata",
            format!(
                "`metadata` holds at most {METADATA_PAIRS} pairs of strings, keys of at most \
                 {METADATA_KEY_CHARS} characters and values of at most {METADATA_VALUE_CHARS}"
            ),
        )),
    }
}

/// `reasoning`: `effort` for templates that take one (chat.rs checks), and `summary`, of which only `auto` is
/// served: the model has no summarizer, so the reasoning item's summary is empty and its text is given whole.
fn reasoning(body: &Body) -> Result<(Option<ReasoningEffort>, Value), ApiError> {
    let Some(fields) = body.object("reasoning")? else {
        return Ok((None, json!({"effort": null, "summary": null})));
    };
    let reasoning = Body::nested(fields.clone(), "reasoning.".into());
    let effort = reasoning.string("effort")?;
    if let Some(effort) = effort.as_deref().filter(|effort| !EFFORTS.contains(effort)) {
        return Err(ApiError::invalid_param(
            "reasoning.effort",
            format!("`reasoning.effort` is \"{effort}\"; expected \"low\", \"medium\" or \"high\""),
        ));
    }
    let summary = reasoning.string("summary")?;
    if summary.as_deref().is_some_and(|summary| summary != "auto") {
        return Err(ApiError::invalid_param(
            "reasoning.summary",
            "`reasoning.summary` may only be \"auto\": this server returns the reasoning as written, not summarized",
        ));
    }
    reasoning.refuse_unread(&[])?;
    let echo = json!({"effort": effort, "summary": summary});
    Ok((effort.map(ReasoningEffort::required), echo))
}

/// `text.format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema",
/// "strict", "description"}`, through the structured-output path (the schema is always enforced); and the `text`
/// the response repeats.
fn text_format(body: &Body) -> Result<(Option<ResponseFormat>, Value), ApiError> {
    let text_type = json!({"format": {"type": "text"}});
    let Some(fields) = body.object("text")? else {
        return Ok((None, text_type));
    };
    let text = Body::nested(fields.clone(), "text.".into());
    let Some(format_fields) = text.object("format")? else {
        text.refuse_unread(&[])?;
        return Ok((None, text_type));
    };
    let format = Body::nested(format_fields.clone(), "text.format.".into());
    let parsed = match format.string("type")?.as_deref() {
        Some("text") => None,
        Some("json_object") => Some(ResponseFormat::JsonObject),
        Some("json_schema") => {
            format.string("name")?.ok_or_else(|| required(&format, "name"))?;
            format.boolean("strict")?;
            format.string("description")?;
            match format.get("schema") {
                Some(schema @ Value::Object(_)) => Some(ResponseFormat::JsonSchema(schema.clone())),
                Some(other) => return Err(wrong_type("text.format.schema", "a JSON Schema object", other)),
                None => return Err(required(&format, "schema")),
            }
        }
        _ => {
            return Err(ApiError::invalid_param(
                "text.format.type",
                "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    };
    format.refuse_unread(&[])?;
    text.refuse_unread(&[])?;
    Ok((parsed, json!({"format": format_fields})))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: Value, keeps_reasoning: bool) -> Result<ResponsesBody, ApiError> {
        ResponsesBody::parse(&Body::new(value.as_object().unwrap().clone()), keeps_reasoning)
    }

    fn param_of(value: Value) -> Option<String> {
        parse(value, true).unwrap_err().param
    }

    #[test]
    fn a_full_request_is_read_and_echoed() {
        let body = parse(
            json!({
                "model": "m", "instructions": "be brief", "max_output_tokens": 30, "temperature": 0.5,
                "top_p": 0.9, "stream": true, "store": false, "metadata": {"k": "v"}, "user": "u",
                "prompt_cache_key": "p", "reasoning": {"effort": "low", "summary": "auto"},
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": true}},
                "chat_template_kwargs": {"enable_thinking": false},
                "input": [
                    {"role": "developer", "content": "rules"},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                    {"type": "reasoning", "id": "rs_1", "status": "completed",
                     "summary": [{"type": "summary_text", "text": "short"}],
                     "content": [{"type": "reasoning_text", "text": "greet"}]},
                    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]},
                    {"role": "user", "content": "again"}
                ]
            }),
            true,
        )
        .unwrap();
        let messages = &body.chat.messages;
        let roles: Vec<_> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "user"]);
        assert_eq!(
            (messages[3].content.as_str(), messages[3].thinking.as_deref()),
            ("hello", Some("greet"))
        );
        let p = &body.chat.params;
        assert_eq!(
            (p.max_tokens, p.temperature, p.top_p, p.stream),
            (Some(30), Some(0.5), Some(0.9), true)
        );
        assert_eq!(
            p.response_format,
            Some(ResponseFormat::JsonSchema(json!({"type": "object"})))
        );
        assert_eq!(
            body.chat.reasoning_effort,
            Some(ReasoningEffort::required("low".into()))
        );
        assert_eq!(body.chat.template_kwargs["enable_thinking"], false);
        assert_eq!(body.echo["store"], false);
        assert_eq!(body.echo["metadata"], json!({"k": "v"}));
        assert_eq!(body.echo["instructions"], "be brief");
        assert_eq!(body.echo["text"]["format"]["name"], "n");
        let plain = parse(json!({"input": "hi"}), false).unwrap();
        assert_eq!(plain.chat.messages.len(), 1);
        assert_eq!(plain.echo["text"], json!({"format": {"type": "text"}}));
        assert_eq!(plain.echo["store"], true, "store defaults to true, as in OpenAI's API");
        let continued = parse(json!({"input": "hi", "previous_response_id": "resp_1"}), false).unwrap();
        assert_eq!(continued.echo["previous_response_id"], "resp_1");
    }

    #[test]
    fn calls_and_their_outputs_become_tool_calls_and_tool_messages() {
        let body = parse(
            json!({"input": [
                {"role": "user", "content": "weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look"}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\": \"Oslo\"}", "status": "completed"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
                {"type": "function_call_output", "call_id": "call_2",
                 "output": [{"type": "input_text", "text": "warm"}]}
            ]}),
            true,
        )
        .unwrap();
        let messages = &body.chat.messages;
        let roles: Vec<_> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "tool"]);
        assert_eq!(messages[1].thinking.as_deref(), Some("look"));
        let calls = &messages[1].tool_calls;
        assert_eq!((calls[0].id.as_str(), calls[1].id.as_str()), ("call_1", "call_2"));
        assert_eq!(calls[0].function.arguments, json!("{\"city\": \"Oslo\"}"));
        assert_eq!(
            (messages[3].content.as_str(), messages[3].tool_call_id.as_deref()),
            ("warm", Some("call_2"))
        );
        let dropped = parse(
            json!({"input": [{"role": "user", "content": "x"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                {"role": "assistant", "content": "y"}]}),
            false,
        )
        .unwrap();
        assert_eq!(
            dropped.chat.messages[1].thinking, None,
            "a template without reasoning gets none"
        );
    }

    #[test]
    fn encrypted_reasoning_is_asked_by_include_and_read_back_from_input() {
        let plain = parse(json!({"input": "hi"}), true).unwrap();
        assert!(!plain.encrypted_reasoning);
        let sealed = super::super::output::seal_reasoning("weighing it");
        let body = parse(
            json!({"include": ["reasoning.encrypted_content"], "input": [
                {"role": "user", "content": "x"},
                {"type": "reasoning", "summary": [], "encrypted_content": sealed},
                {"role": "assistant", "content": "y"}]}),
            true,
        )
        .unwrap();
        assert!(body.encrypted_reasoning);
        assert_eq!(body.chat.messages[1].thinking.as_deref(), Some("weighing it"));
    }

    #[test]
    fn every_bad_field_is_named() {
        let with = |name: &str, value: Value| {
            let mut body = json!({"input": "hi"});
            body[name] = value;
            body
        };
        let item = |value: Value| json!({"input": [value]});
        for (body, param) in [
            (json!({}), "input"),
            (with("input", json!([])), "input"),
            (with("input", json!(3)), "input"),
            (with("previous_response_id", json!(1)), "previous_response_id"),
            (with("store", json!("no")), "store"),
            (with("max_output_tokens", json!(0)), "max_output_tokens"),
            (with("temperature", json!(3)), "temperature"),
            (with("top_p", json!(0)), "top_p"),
            (with("stop", json!(["x"])), "stop"),
            (with("include", json!(["message.input_image.image_url"])), "include[0]"),
            (with("top_logprobs", json!(21)), "top_logprobs"),
            (with("truncation", json!("middle")), "truncation"),
            (with("top_logprobs", json!(-1)), "top_logprobs"),
            (with("include", json!("reasoning.encrypted_content")), "include"),
            (with("metadata", json!({"k": 1})), "metadata"),
            (with("reasoning", json!({"effort": "max"})), "reasoning.effort"),
            (with("reasoning", json!({"summary": "detailed"})), "reasoning.summary"),
            (with("text", json!({"format": {"type": "yaml"}})), "text.format.type"),
            (
                with("text", json!({"format": {"type": "json_schema", "name": "n"}})),
                "text.format.schema",
            ),
            (
                with("text", json!({"format": {"type": "json_schema", "schema": {}}})),
                "text.format.name",
            ),
            (with("text", json!({"verbosity": "low"})), "text.verbosity"),
            (item(json!({"role": "tool", "content": "x"})), "input[0].role"),
            (item(json!({"role": "user"})), "input[0].content"),
            (
                item(json!({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]})),
                "input[0].content[0].type",
            ),
            (
                item(json!({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]})),
                "input[0].content[0].type",
            ),
            (item(json!({"type": "item_reference", "id": "x"})), "input[0].type"),
            (
                item(json!({"type": "function_call", "name": "f", "arguments": "{}"})),
                "input[0].call_id",
            ),
            (
                item(json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "["})),
                "input[0].arguments",
            ),
            (
                item(json!({"type": "function_call_output", "call_id": "c"})),
                "input[0].output",
            ),
            (
                item(json!({"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"})),
                "input[0].encrypted_content",
            ),
            (
                item(json!({"type": "reasoning", "summary": [], "encrypted_content": "ferry-reasoning-v1:6"})),
                "input[0].encrypted_content",
            ),
            (item(json!({"type": "reasoning", "summary": []})), "input[0]"),
            (
                item(json!({"role": "user", "content": "x", "name": "ann"})),
                "input[0].name",
            ),
        ] {
            assert_eq!(param_of(body.clone()), Some(param.to_string()), "{body}");
        }
    }
}
