//! Request bodies of the OpenAI API, read field by field from JSON so that every mistake is a 400 that names the
//! field (`param`) and says what was expected. Unknown fields are ignored, as OpenAI's clients send many.

use ferry_core::engine::validate_stop_strings;
use ferry_core::loader::ChatMessage;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tools::request::parse_tool_calls;
use crate::tools::ToolRequest;

/// Fields shared by chat and text completions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationParams {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub stream: bool,
    pub include_usage: bool,
    /// Generate past end-of-sequence tokens (vLLM's extension; benchmarks use it to fix the output length).
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct ChatBody {
    pub messages: Vec<ChatMessage>,
    pub tools: ToolRequest,
    pub chat_template_kwargs: Map<String, Value>,
    pub params: GenerationParams,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionBody {
    pub prompt: Prompt,
    pub params: GenerationParams,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn wrong_type(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_param(name, format!("`{name}` must be {expected}, got {}", type_name(got)))
}

/// A field's value; null counts as absent.
pub(crate) fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn number(obj: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| wrong_type(name, "a number", v)),
    }
}

fn number_in(obj: &Map<String, Value>, name: &str, low: f64, high: f64) -> Result<Option<f32>, ApiError> {
    match number(obj, name)? {
        Some(x) if !(low..=high).contains(&x) => Err(ApiError::invalid_param(
            name,
            format!("`{name}` must be between {low} and {high}, got {x}"),
        )),
        x => Ok(x.map(|x| x as f32)),
    }
}

fn integer(obj: &Map<String, Value>, name: &str) -> Result<Option<i64>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match (v.as_i64(), v.as_u64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(_)) => Err(ApiError::invalid_param(name, format!("`{name}` is too large"))),
            _ => Err(wrong_type(name, "an integer", v)),
        },
    }
}

fn boolean(obj: &Map<String, Value>, name: &str) -> Result<bool, ApiError> {
    match field(obj, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(wrong_type(name, "a boolean", v)),
    }
}

fn string(obj: &Map<String, Value>, name: &str) -> Result<Option<String>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong_type(name, "a string", v)),
    }
}

/// The body as a JSON object, or a 400 that says why not.
pub fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            type_name(&other)
        ))),
        Err(e) => Err(ApiError::invalid(format!("the request body is not valid JSON: {e}"))),
    }
}

impl GenerationParams {
    /// `max_tokens_fields` are the names that set the output limit, in order of preference.
    fn parse(obj: &Map<String, Value>, max_tokens_fields: &[&str]) -> Result<Self, ApiError> {
        if let Some(n) = integer(obj, "n")? {
            if n != 1 {
                return Err(ApiError::invalid_param(
                    "n",
                    format!("only one choice per request is supported (`n` = 1), got {n}"),
                ));
            }
        }
        let mut max_tokens = None;
        for name in max_tokens_fields {
            if let Some(n) = integer(obj, name)? {
                if n < 1 {
                    return Err(ApiError::invalid_param(
                        name,
                        format!("`{name}` must be at least 1, got {n}"),
                    ));
                }
                max_tokens = max_tokens.or(Some(n as usize));
            }
        }
        let top_k = match integer(obj, "top_k")? {
            // -1 and 0 both mean no limit (vLLM and HF conventions).
            None | Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("`top_k` must be -1 (no limit) or positive, got {k}"),
                ))
            }
        };
        let top_p = number_in(obj, "top_p", 0.0, 1.0)?;
        if top_p == Some(0.0) {
            return Err(ApiError::invalid_param("top_p", "`top_p` must be greater than 0"));
        }
        let seed = integer(obj, "seed")?.map(|s| s as u64);
        let stop = match field(obj, "stop") {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type("stop", "a string or an array of strings", other)),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(wrong_type("stop", "a string or an array of strings", other)),
        };
        validate_stop_strings(&stop).map_err(|message| ApiError::invalid_param("stop", message))?;
        let include_usage = match field(obj, "stream_options") {
            None => false,
            Some(Value::Object(options)) => boolean(options, "include_usage").map_err(|_| {
                ApiError::invalid_param("stream_options", "`stream_options.include_usage` must be a boolean")
            })?,
            Some(other) => return Err(wrong_type("stream_options", "an object", other)),
        };
        Ok(GenerationParams {
            model: string(obj, "model")?,
            max_tokens,
            temperature: number_in(obj, "temperature", 0.0, 2.0)?,
            top_p,
            top_k,
            seed,
            stop,
            presence_penalty: number_in(obj, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            frequency_penalty: number_in(obj, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            stream: boolean(obj, "stream")?,
            include_usage,
            ignore_eos: boolean(obj, "ignore_eos")?,
        })
    }
}

/// A message's content: a string, null, or a list of parts of which the text ones are joined.
fn message_content(index: usize, content: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => Ok(text.as_str()),
                    _ => Err(ApiError::invalid_param(
                        &param,
                        "only text content parts (`{\"type\": \"text\", \"text\": ...}`) are supported",
                    )),
                },
            )
            .collect(),
        Some(other) => Err(wrong_type(&param, "a string or an array of content parts", other)),
    }
}

/// The roles the chat templates render; a template skips a message of any other role, which would shorten the
/// prompt without a word.
const CHAT_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// Longest part of an unknown role quoted back, so that the error does not echo unbounded input.
const QUOTED_ROLE_CHARS: usize = 64;

fn unknown_role(index: usize, role: &str) -> ApiError {
    let quoted: String = role.chars().take(QUOTED_ROLE_CHARS).collect();
    let cut = if quoted.len() < role.len() { "…" } else { "" };
    ApiError::invalid_param(
        &format!("messages[{index}].role"),
        format!(
            "`messages[{index}].role` is \"{quoted}\"{cut}; the supported roles are {}",
            CHAT_ROLES.join(", ")
        ),
    )
}

impl ChatBody {
    pub fn parse(obj: &Map<String, Value>) -> Result<Self, ApiError> {
        let messages = match obj.get("messages") {
            None | Some(Value::Null) => return Err(ApiError::invalid_param("messages", "`messages` is required")),
            Some(Value::Array(list)) if list.is_empty() => {
                return Err(ApiError::invalid_param("messages", "`messages` must not be empty"))
            }
            Some(Value::Array(list)) => list,
            Some(other) => return Err(wrong_type("messages", "an array of messages", other)),
        };
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let m = m
                    .as_object()
                    .ok_or_else(|| wrong_type(&format!("messages[{i}]"), "an object", m))?;
                let role = match m.get("role") {
                    Some(Value::String(role)) if CHAT_ROLES.contains(&role.as_str()) => role.clone(),
                    Some(Value::String(role)) => return Err(unknown_role(i, role)),
                    Some(other) => return Err(wrong_type(&format!("messages[{i}].role"), "a string", other)),
                    None => {
                        return Err(ApiError::invalid_param(
                            &format!("messages[{i}].role"),
                            format!("`messages[{i}].role` is required"),
                        ))
                    }
                };
                let mut message = ChatMessage::text(&role, &message_content(i, m.get("content"))?);
                if let Some(calls) = field(m, "tool_calls") {
                    if role != "assistant" {
                        return Err(ApiError::invalid_param(
                            &format!("messages[{i}].tool_calls"),
                            "only assistant messages carry `tool_calls`",
                        ));
                    }
                    message.tool_calls = parse_tool_calls(&format!("messages[{i}]"), calls)?;
                }
                message.tool_call_id = match field(m, "tool_call_id") {
                    None => None,
                    Some(Value::String(id)) if role == "tool" => Some(id.clone()),
                    Some(Value::String(_)) => {
                        return Err(ApiError::invalid_param(
                            &format!("messages[{i}].tool_call_id"),
                            "only tool messages carry `tool_call_id`",
                        ))
                    }
                    Some(other) => return Err(wrong_type(&format!("messages[{i}].tool_call_id"), "a string", other)),
                };
                Ok(message)
            })
            .collect::<Result<_, _>>()?;
        let chat_template_kwargs = match field(obj, "chat_template_kwargs") {
            None => Map::new(),
            Some(Value::Object(kwargs)) => kwargs.clone(),
            Some(other) => return Err(wrong_type("chat_template_kwargs", "an object", other)),
        };
        Ok(ChatBody {
            messages,
            tools: ToolRequest::parse(obj)?,
            chat_template_kwargs,
            params: GenerationParams::parse(obj, &["max_completion_tokens", "max_tokens"])?,
        })
    }
}

impl CompletionBody {
    pub fn parse(obj: &Map<String, Value>) -> Result<Self, ApiError> {
        let bad_prompt = || {
            ApiError::invalid_param(
                "prompt",
                "`prompt` must be a string, an array of token ids, or an array holding one of those",
            )
        };
        let token_ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
            items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(bad_prompt))
                .collect()
        };
        let prompt = match obj.get("prompt") {
            None | Some(Value::Null) => return Err(ApiError::invalid_param("prompt", "`prompt` is required")),
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(items)) => match items.as_slice() {
                [Value::String(s)] => Prompt::Text(s.clone()),
                [Value::Array(ids)] => Prompt::TokenIds(token_ids(ids)?),
                ids if !ids.is_empty() && ids.iter().all(Value::is_number) => Prompt::TokenIds(token_ids(ids)?),
                _ => {
                    return Err(ApiError::invalid_param(
                        "prompt",
                        "one prompt per request is supported: a string or an array of token ids",
                    ))
                }
            },
            Some(_) => return Err(bad_prompt()),
        };
        if boolean(obj, "echo")? {
            return Err(ApiError::invalid_param("echo", "`echo` is not supported"));
        }
        Ok(CompletionBody {
            prompt,
            params: GenerationParams::parse(obj, &["max_tokens"])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<ChatBody, ApiError> {
        ChatBody::parse(body.as_object().unwrap())
    }

    fn param_of(body: Value) -> Option<String> {
        chat(body).unwrap_err().param
    }

    #[test]
    fn a_full_chat_request_is_read() {
        let body = chat(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null}
            ],
            "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
            "seed": 3, "stop": "x", "presence_penalty": 1, "frequency_penalty": -1, "n": 1,
            "stream": true, "stream_options": {"include_usage": true},
            "chat_template_kwargs": {"enable_thinking": false}
        }))
        .unwrap();
        assert_eq!(body.messages[1].content, "hi there");
        assert_eq!(body.messages[2].content, "");
        let p = &body.params;
        assert_eq!(p.max_tokens, Some(5), "max_completion_tokens wins");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.seed),
            (Some(0.5), Some(0.9), None, Some(3))
        );
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert!(p.stream && p.include_usage);
        assert_eq!(body.chat_template_kwargs["enable_thinking"], json!(false));
    }

    #[test]
    fn every_bad_field_is_named() {
        let user = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(param_of(json!({})), Some("messages".into()));
        assert_eq!(param_of(json!({"messages": "hi"})), Some("messages".into()));
        assert_eq!(param_of(json!({"messages": []})), Some("messages".into()));
        assert_eq!(
            param_of(json!({"messages": [{"content": "x"}]})),
            Some("messages[0].role".into())
        );
        assert_eq!(
            param_of(json!({"messages": [{"role": "user", "content": 5}]})),
            Some("messages[0].content".into())
        );
        for (name, value) in [
            ("max_tokens", json!(-1)),
            ("max_tokens", json!("10")),
            ("max_completion_tokens", json!(0)),
            ("temperature", json!(-0.1)),
            ("temperature", json!("hot")),
            ("top_p", json!(1.5)),
            ("top_p", json!(0)),
            ("top_k", json!(-2)),
            ("n", json!(2)),
            ("stop", json!([1])),
            ("presence_penalty", json!(2.5)),
            ("frequency_penalty", json!(-3)),
            ("stream", json!("yes")),
            ("stream_options", json!({"include_usage": "yes"})),
            ("chat_template_kwargs", json!([])),
            ("seed", json!(1.5)),
            ("model", json!(3)),
        ] {
            let mut body = json!({"messages": user});
            body[name] = value.clone();
            assert_eq!(param_of(body), Some(name.to_string()), "{name} = {value}");
        }
    }

    #[test]
    fn stop_strings_are_bounded_in_count_and_length() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let most = vec!["s".repeat(256); 16];
        assert_eq!(
            chat(json!({"messages": user, "stop": most})).unwrap().params.stop.len(),
            16
        );
        for stop in [json!(vec!["s"; 17]), json!(["s".repeat(257)]), json!("s".repeat(257))] {
            let error = chat(json!({"messages": user, "stop": stop})).unwrap_err();
            assert_eq!(error.param, Some("stop".into()));
            assert!(
                error.message.contains("16") || error.message.contains("256"),
                "{}",
                error.message
            );
        }
    }

    #[test]
    fn a_role_no_template_renders_is_refused_with_its_index() {
        let roles = ["system", "user", "assistant", "tool"];
        let known: Vec<Value> = roles.iter().map(|r| json!({"role": r, "content": "x"})).collect();
        assert_eq!(chat(json!({"messages": known})).unwrap().messages.len(), 4);
        for (role, index) in [("", 0), ("wizard", 1), ("User", 1)] {
            let mut messages = vec![json!({"role": "user", "content": "x"})];
            messages.insert(index, json!({"role": role, "content": "y"}));
            let error = chat(json!({"messages": messages})).unwrap_err();
            assert_eq!(error.param, Some(format!("messages[{index}].role")));
            assert!(error.message.contains(&format!("\"{role}\"")), "{}", error.message);
        }
        let long = "r".repeat(10_000);
        let error = chat(json!({"messages": [{"role": long, "content": "x"}]})).unwrap_err();
        assert!(
            error.message.len() < 300,
            "the role is not echoed whole: {}",
            error.message.len()
        );
    }

    #[test]
    fn completion_prompts_are_text_or_token_ids() {
        let parse = |v: Value| CompletionBody::parse(v.as_object().unwrap());
        assert_eq!(
            parse(json!({"prompt": "hi"})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse(json!({"prompt": ["hi"]})).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse(json!({"prompt": [1, 2]})).unwrap().prompt,
            Prompt::TokenIds(vec![1, 2])
        );
        assert_eq!(
            parse(json!({"prompt": [[3]]})).unwrap().prompt,
            Prompt::TokenIds(vec![3])
        );
        for bad in [
            json!({}),
            json!({"prompt": 3}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": [-1]}),
        ] {
            assert_eq!(parse(bad).unwrap_err().param, Some("prompt".into()));
        }
        assert_eq!(
            parse(json!({"prompt": "x", "echo": true})).unwrap_err().param,
            Some("echo".into())
        );
    }

    #[test]
    fn malformed_json_is_a_400() {
        assert!(json_object(b"{\"a\":").unwrap_err().message.contains("not valid JSON"));
        assert!(json_object(b"[1]").unwrap_err().message.contains("JSON object"));
    }
}
