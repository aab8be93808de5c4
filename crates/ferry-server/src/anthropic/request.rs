//! Anthropic Messages request bodies read into the protocol-neutral request (chat.rs).
//!
//! As Anthropic's newer SDKs send fields this server has never heard of, unknown fields are tolerated here (unlike
//! on the OpenAI routes); fields it knows and cannot honour (image blocks, MCP servers) are a 400 naming them.
//! `thinking` maps to the chat template's thinking switch, and `budget_tokens` to the engine's thinking budget (see
//! chat.rs for a model that does not think); thinking blocks in the history go back to the template as the
//! message's reasoning, in the form it reads (tools/history.rs: gpt-oss's `thinking` field, or the `<think>` text the
//! model wrote, which templates strip from earlier turns as they do for their own output), and for a model whose
//! template renders no reasoning they are dropped, as Anthropic drops earlier turns' thinking. `output_config.format`
//! (structured outputs: `{"type": "json_schema", "schema"}`) constrains the answer as OpenAI's `response_format`
//! does, after the model's thinking; `output_config.effort` is the reasoning effort of a template that takes one
//! (gpt-oss's), and left out by the others, to which clients send it too.

use ferry_core::engine::{validate_stop_strings, ResponseFormat};
use ferry_core::loader::{ChatEnding, ChatMessage};
use serde_json::Value;

use super::tools;
use crate::body::{wrong_type, Body};
use crate::chat::{ChatRequest, GenerationParams, ReasoningEffort};
use crate::error::ApiError;
use ferry_core::loader::ToolCall;

/// Fields Anthropic defines that this server cannot honour; ignoring them would change the answer's meaning.
const REFUSED_FIELDS: [&str; 2] = ["mcp_servers", "container"];

/// A messages (or count_tokens) request.
#[derive(Clone, Debug)]
pub struct MessagesBody {
    pub model: String,
    pub chat: ChatRequest,
}

/// Whether the request is for generation (which requires `max_tokens`) or for counting tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Generate,
    CountTokens,
}

impl MessagesBody {
    /// `keeps_reasoning`: the served model's template renders earlier reasoning, so thinking blocks go back into its
    /// history.
    pub fn parse(body: &Body, purpose: Purpose, keeps_reasoning: bool) -> Result<Self, ApiError> {
        for name in REFUSED_FIELDS {
            if body.get(name).is_some() {
                return Err(ApiError::invalid_param(
                    name,
                    format!("`{name}` is not supported by this server"),
                ));
            }
        }
        let model = body
            .string("model")?
            .ok_or_else(|| ApiError::invalid_param("model", "`model` is required"))?;
        let max_tokens = body.positive("max_tokens")?;
        if purpose == Purpose::Generate && max_tokens.is_none() {
            return Err(ApiError::invalid_param("max_tokens", "`max_tokens` is required"));
        }
        let mut messages = system_message(body)?.into_iter().collect::<Vec<_>>();
        let sent = body.nonempty_array("messages", "an array of messages")?;
        for (index, message) in sent.iter().enumerate() {
            messages.extend(messages_of(index, message, keeps_reasoning)?);
        }
        let stop = body.strings("stop_sequences", false)?;
        validate_stop_strings("stop_sequences", &stop)
            .map_err(|message| ApiError::invalid_param("stop_sequences", message))?;
        let top_k = match body.integer("top_k")? {
            Some(k) if k < 1 => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("`top_k` must be at least 1, got {k}"),
                ))
            }
            k => k.map(|k| k as usize),
        };
        let top_p = body.number_in("top_p", 0.0, 1.0)?;
        if top_p == Some(0.0) {
            return Err(ApiError::invalid_param("top_p", "`top_p` must be greater than 0"));
        }
        let (thinking, thinking_budget) = thinking(body, max_tokens)?;
        let reasoning_effort = effort(body)?;
        // A last message of the assistant's is a prefill: the answer continues it.
        let ending = match messages.last() {
            Some(last) if last.role == "assistant" => ChatEnding::ContinueLastMessage,
            _ => ChatEnding::GenerationPrompt,
        };
        let chat = ChatRequest {
            messages,
            ending,
            template_kwargs: Default::default(),
            thinking,
            thinking_budget,
            reasoning_effort,
            tools: tools::tool_request(body)?,
            params: GenerationParams {
                max_tokens,
                temperature: body.number_in("temperature", 0.0, 1.0)?,
                top_p,
                top_k,
                stop,
                stream: body.boolean("stream")?,
                response_format: output_format(body)?,
                ..GenerationParams::default()
            },
        };
        Ok(MessagesBody { model, chat })
    }
}

/// `output_config.effort` (`low`, `medium`, `high`, `xhigh`, `max`) as the reasoning effort of a template that
/// takes one (gpt-oss's `low`, `medium`, `high`: the two above `high` are `high`), and left out by the others, as
/// clients send it to every model.
fn effort(body: &Body) -> Result<Option<ReasoningEffort>, ApiError> {
    let Some(config) = body.object("output_config")? else {
        return Ok(None);
    };
    let config = Body::nested(config.clone(), "output_config.".into());
    let level = match config.string("effort")?.as_deref() {
        None => return Ok(None),
        Some(level @ ("low" | "medium" | "high")) => level.to_string(),
        Some("xhigh" | "max") => "high".to_string(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "output_config.effort",
                format!(
                "`output_config.effort` is \"{other}\"; expected \"low\", \"medium\", \"high\", \"xhigh\" or \"max\""
            ),
            ))
        }
    };
    Ok(Some(ReasoningEffort { level, required: false }))
}

/// `output_config.format`: `{"type": "json_schema", "schema": {...}}`, the answer's JSON Schema; null or absent:
/// free text.
fn output_format(body: &Body) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(config) = body.object("output_config")? else {
        return Ok(None);
    };
    let format = match config.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(format) => tools::nested("output_config.format", format)?,
    };
    if format.string("type")?.as_deref() != Some("json_schema") {
        return Err(ApiError::invalid_param(
            "output_config.format.type",
            "`output_config.format.type` must be \"json_schema\"",
        ));
    }
    let schema = match format.get("schema") {
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(other) => return Err(wrong_type("output_config.format.schema", "a JSON Schema object", other)),
        None => {
            return Err(ApiError::invalid_param(
                "output_config.format.schema",
                "`output_config.format.schema` is required",
            ))
        }
    };
    format.refuse_unread(&[])?;
    Ok(Some(ResponseFormat::JsonSchema(schema)))
}

/// `system`: a string or a list of text blocks, as the conversation's first message.
fn system_message(body: &Body) -> Result<Option<ChatMessage>, ApiError> {
    let content = match body.get("system") {
        None => return Ok(None),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => {
            let texts = blocks
                .iter()
                .enumerate()
                .map(|(i, block)| match block_of(&format!("system[{i}]"), block)? {
                    Block::Text(text) => Ok(text),
                    _ => Err(ApiError::invalid_param(
                        &format!("system[{i}]"),
                        "`system` holds text blocks only",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            texts.join("\n")
        }
        Some(other) => return Err(wrong_type("system", "a string or an array of text blocks", other)),
    };
    Ok(Some(ChatMessage::text("system", &content)))
}

/// A content block this server reads.
enum Block {
    Text(String),
    Thinking(String),
    /// Thinking the model's provider encrypted: nothing a template could render.
    RedactedThinking,
    ToolUse(ToolCall),
    /// The id of the call answered, and the answer.
    ToolResult(String, String),
}

fn block_of(param: &str, block: &Value) -> Result<Block, ApiError> {
    let fields = block
        .as_object()
        .ok_or_else(|| wrong_type(param, "a content block (an object)", block))?;
    let block = Body::nested(fields.clone(), format!("{param}."));
    let text = |name: &str| -> Result<String, ApiError> {
        block.string(name)?.ok_or_else(|| {
            let param = block.param(name);
            ApiError::invalid_param(&param, format!("`{param}` is required"))
        })
    };
    match block.string("type")?.as_deref() {
        Some("text") => Ok(Block::Text(text("text")?)),
        Some("thinking") => Ok(Block::Thinking(text("thinking")?)),
        Some("redacted_thinking") => Ok(Block::RedactedThinking),
        Some(kind @ ("image" | "document")) => Err(ApiError::invalid_param(
            param,
            format!("{kind} blocks are not supported: this server serves a text-only model"),
        )),
        Some("tool_use") => Ok(Block::ToolUse(tools::tool_use(&block)?)),
        Some("tool_result") => {
            let (id, content) = tools::tool_result(&block)?;
            Ok(Block::ToolResult(id, content))
        }
        Some(kind) => Err(ApiError::invalid_param(
            param,
            format!(
                "`{param}.type` is \"{}\", which this server does not support",
                kind.chars().take(64).collect::<String>()
            ),
        )),
        None => Err(ApiError::invalid_param(
            &block.param("type"),
            format!("`{param}.type` is required"),
        )),
    }
}

/// A message as the chat messages the templates read: an assistant's text (after its thinking, for a model that
/// reasons) with its tool calls; a user's tool results as `tool` messages, then its text.
fn messages_of(index: usize, message: &Value, keeps_reasoning: bool) -> Result<Vec<ChatMessage>, ApiError> {
    let param = format!("messages[{index}]");
    let message = tools::nested(&param, message)?;
    let role = match message.string("role")?.as_deref() {
        Some(role @ ("user" | "assistant")) => role.to_string(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                &message.param("role"),
                format!("`{param}.role` must be \"user\" or \"assistant\""),
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                &message.param("role"),
                format!("`{param}.role` is required"),
            ))
        }
    };
    let blocks = match message.get("content") {
        Some(Value::String(text)) => return Ok(vec![ChatMessage::text(&role, text)]),
        Some(Value::Array(blocks)) => blocks,
        Some(other) => {
            return Err(wrong_type(
                &message.param("content"),
                "a string or an array of content blocks",
                other,
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                &message.param("content"),
                format!("`{param}.content` is required"),
            ))
        }
    };
    let mut out = vec![];
    let mut thinking = String::new();
    let mut texts = vec![];
    let mut tool_calls = vec![];
    for (i, block) in blocks.iter().enumerate() {
        let block_param = format!("{param}.content[{i}]");
        let misplaced = |what: &str| {
            Err(ApiError::invalid_param(
                &block_param,
                format!(
                    "{what} belong to {} messages",
                    match role.as_str() {
                        "user" => "assistant",
                        _ => "user",
                    }
                ),
            ))
        };
        match (block_of(&block_param, block)?, role.as_str()) {
            (Block::Text(text), _) => texts.push(text),
            (Block::Thinking(text), "assistant") => thinking += &text,
            (Block::RedactedThinking, "assistant") => {}
            (Block::ToolUse(call), "assistant") => tool_calls.push(call),
            (Block::ToolResult(id, content), "user") => out.push(ChatMessage {
                role: "tool".into(),
                content,
                tool_call_id: Some(id),
                ..Default::default()
            }),
            (Block::Thinking(_) | Block::RedactedThinking, _) => return misplaced("thinking blocks"),
            (Block::ToolUse(_), _) => return misplaced("tool_use blocks"),
            (Block::ToolResult(..), _) => return misplaced("tool_result blocks"),
        }
    }
    let content = texts.join("\n");
    let thinking = (keeps_reasoning && !thinking.is_empty()).then_some(thinking);
    // A user message of tool results alone adds no user turn of its own.
    if out.is_empty() || !content.is_empty() || !tool_calls.is_empty() || thinking.is_some() {
        out.push(ChatMessage {
            role,
            content,
            tool_calls,
            thinking,
            ..Default::default()
        });
    }
    Ok(out)
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` (N below `max_tokens`, which bounds the thinking with the
/// answer), `{"type": "adaptive"}` or `{"type": "between_tools"}` (on: the model decides), or
/// `{"type": "disabled"}`, as the template's thinking switch.
fn thinking(body: &Body, max_tokens: Option<usize>) -> Result<(Option<bool>, Option<usize>), ApiError> {
    let Some(fields) = body.object("thinking")? else {
        return Ok((None, None));
    };
    let thinking = Body::nested(fields.clone(), "thinking.".into());
    let switch = match thinking.string("type")?.as_deref() {
        Some("disabled") => Ok(Some(false)),
        // The model decides whether and how long to think, in its answer and between tool calls alike.
        Some("adaptive" | "between_tools") => match thinking.string("display")?.as_deref() {
            None | Some("summarized") => Ok(Some(true)),
            Some(_) => Err(ApiError::invalid_param(
                "thinking.display",
                "`thinking.display` may only be \"summarized\": this server returns the thinking as written",
            )),
        },
        Some("enabled") => {
            let budget = thinking.positive("budget_tokens")?.ok_or_else(|| {
                ApiError::invalid_param("thinking.budget_tokens", "`thinking.budget_tokens` is required")
            })?;
            if max_tokens.is_some_and(|max_tokens| budget >= max_tokens) {
                return Err(ApiError::invalid_param(
                    "thinking.budget_tokens",
                    "`thinking.budget_tokens` must be less than `max_tokens`",
                ));
            }
            return Ok((Some(true), Some(budget)));
        }
        _ => Err(ApiError::invalid_param(
            "thinking.type",
            "`thinking.type` must be \"enabled\", \"adaptive\", \"between_tools\" or \"disabled\"",
        )),
    };
    Ok((switch?, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: Value, splits_reasoning: bool) -> Result<MessagesBody, ApiError> {
        let body = Body::new(value.as_object().unwrap().clone());
        MessagesBody::parse(&body, Purpose::Generate, splits_reasoning)
    }

    fn param_of(value: Value) -> Option<String> {
        parse(value, true).unwrap_err().param
    }

    #[test]
    fn a_full_request_is_read_and_unknown_fields_are_tolerated() {
        let body = parse(
            json!({
                "model": "m", "max_tokens": 30,
                "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "greet", "signature": "s"},
                        {"type": "text", "text": "hello"}
                    ]},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
                ],
                "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": true,
                "thinking": {"type": "enabled", "budget_tokens": 10},
                "metadata": {"user_id": "u"}, "service_tier": "auto", "some_future_field": {"x": 1}
            }),
            true,
        )
        .unwrap();
        let roles: Vec<_> = body.chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(body.chat.messages[0].content, "be brief");
        assert_eq!(body.chat.messages[2].content, "hello");
        assert_eq!(body.chat.messages[2].thinking.as_deref(), Some("greet"));
        assert_eq!(body.chat.messages[3].content, "a\nb");
        assert_eq!(body.chat.thinking, Some(true));
        let p = &body.chat.params;
        assert_eq!(
            (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stream),
            (Some(30), Some(0.5), Some(0.9), Some(5), true)
        );
        assert_eq!(p.stop, ["END"]);
    }

    #[test]
    fn thinking_in_the_history_is_dropped_for_a_model_that_does_not_reason() {
        let thought = json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "x"},
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "text", "text": "yo"}
            ]}
        ]});
        let dropped = &parse(thought, false).unwrap().chat.messages[1];
        assert_eq!((dropped.content.as_str(), dropped.thinking.as_deref()), ("yo", None));
        let disabled = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}});
        assert_eq!(parse(disabled, true).unwrap().chat.thinking, Some(false));
        let adaptive = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}});
        assert_eq!(parse(adaptive, true).unwrap().chat.thinking, Some(true));
    }

    #[test]
    fn an_effort_is_the_templates_reasoning_effort_where_it_takes_one() {
        let with = |effort: Value| {
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"effort": effort}})
        };
        for (sent, level) in [
            ("low", "low"),
            ("medium", "medium"),
            ("high", "high"),
            ("xhigh", "high"),
            ("max", "high"),
        ] {
            let effort = parse(with(sent.into()), true).unwrap().chat.reasoning_effort;
            let wanted = ReasoningEffort {
                level: level.into(),
                required: false,
            };
            assert_eq!(effort, Some(wanted), "{sent}");
        }
        assert_eq!(parse(with(Value::Null), true).unwrap().chat.reasoning_effort, None);
        for bad in [json!("extreme"), json!(3)] {
            let error = parse(with(bad), true).unwrap_err();
            assert_eq!(
                error.param.as_deref(),
                Some("output_config.effort"),
                "{}",
                error.message
            );
        }
    }

    #[test]
    fn every_bad_field_is_named() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let with = |name: &str, value: Value| {
            let mut body = json!({"model": "m", "max_tokens": 5, "messages": user});
            body[name] = value;
            body
        };
        assert_eq!(
            param_of(json!({"model": "m", "messages": user})),
            Some("max_tokens".into())
        );
        assert_eq!(
            param_of(json!({"max_tokens": 5, "messages": user})),
            Some("model".into())
        );
        for (body, param) in [
            (with("messages", json!([])), "messages"),
            (
                with("messages", json!([{"role": "system", "content": "x"}])),
                "messages[0].role",
            ),
            (with("messages", json!([{"role": "user"}])), "messages[0].content"),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                ),
                "messages[0].content[0]",
            ),
            (
                with("messages", json!([{"role": "user", "content": [{"type": "text"}]}])),
                "messages[0].content[0].text",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]),
                ),
                "messages[0].content[0]",
            ),
            (with("system", json!([{"type": "image"}])), "system[0]"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (with("temperature", json!(1.5)), "temperature"),
            (with("top_k", json!(0)), "top_k"),
            (with("stop_sequences", json!("x")), "stop_sequences"),
            (with("stop_sequences", json!(vec!["x"; 17])), "stop_sequences"),
            (with("stop_sequences", json!(["x", ""])), "stop_sequences"),
            (with("thinking", json!({"type": "enabled"})), "thinking.budget_tokens"),
            (
                with("thinking", json!({"type": "enabled", "budget_tokens": 5})),
                "thinking.budget_tokens",
            ),
            (with("thinking", json!({"type": "sometimes"})), "thinking.type"),
            (
                with("thinking", json!({"type": "adaptive", "display": "omitted"})),
                "thinking.display",
            ),
            (
                with("output_config", json!({"format": {"type": "json_object"}})),
                "output_config.format.type",
            ),
            (
                with("output_config", json!({"format": {"type": "json_schema"}})),
                "output_config.format.schema",
            ),
            (
                with(
                    "output_config",
                    json!({"format": {"type": "json_schema", "schema": "{}"}}),
                ),
                "output_config.format.schema",
            ),
            (
                with(
                    "output_config",
                    json!({"format": {"type": "json_schema", "schema": {}, "strict": true}}),
                ),
                "output_config.format.strict",
            ),
            (with("output_config", json!({"format": []})), "output_config.format"),
            (with("tools", json!([{"name": "f"}])), "tools[0].input_schema"),
            (
                with("tools", json!([{"type": "web_search_20250305", "name": "web_search"}])),
                "tools[0].type",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
                ),
                "messages[0].content[0]",
            ),
            (with("tool_choice", json!({"type": "any"})), "tool_choice"),
            (
                with("tool_choice", json!({"type": "tool", "name": "g"})),
                "tool_choice.name",
            ),
            (with("tool_choice", json!({"type": "tool"})), "tool_choice.name"),
            (with("mcp_servers", json!([])), "mcp_servers"),
        ] {
            assert_eq!(param_of(body.clone()), Some(param.to_string()), "{body}");
        }
    }

    #[test]
    fn an_output_format_is_a_json_schema_response_format() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
        let body = json!({"model": "m", "max_tokens": 5, "messages": user,
            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}});
        let format = parse(body, true).unwrap().chat.params.response_format;
        assert_eq!(format, Some(ResponseFormat::JsonSchema(schema)));
        for config in [json!({"format": null}), json!({"effort": "high"})] {
            let body = json!({"model": "m", "max_tokens": 5, "messages": user, "output_config": config});
            assert_eq!(parse(body, true).unwrap().chat.params.response_format, None);
        }
    }

    #[test]
    fn tools_reach_the_template_and_tool_blocks_become_calls_and_tool_messages() {
        let body = parse(
            json!({"model": "m", "max_tokens": 20,
            "tools": [{"name": "get_weather", "description": "now", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "cold"}]}
                ]}
            ]}),
            false,
        )
        .unwrap();
        let tools = &body.chat.tools;
        assert!(!tools.parallel_calls);
        assert_eq!(
            tools.template_tools(),
            vec![json!({"type": "function", "function": {
                "name": "get_weather", "description": "now", "parameters": {"type": "object"}}})]
        );
        let messages = &body.chat.messages;
        let roles: Vec<_> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool"]);
        assert_eq!(messages[1].content, "checking");
        assert_eq!(messages[1].tool_calls[0].id, "toolu_1");
        assert_eq!(messages[1].tool_calls[0].function.arguments["city"], "Oslo");
        assert_eq!(
            (messages[2].content.as_str(), messages[2].tool_call_id.as_deref()),
            ("cold", Some("toolu_1"))
        );
    }

    #[test]
    fn count_tokens_needs_no_max_tokens() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let body = Body::new(body.as_object().unwrap().clone());
        let parsed = MessagesBody::parse(&body, Purpose::CountTokens, false).unwrap();
        assert_eq!(parsed.chat.params.max_tokens, None);
    }
}
