//! Request bodies of the OpenAI API (chat and text completions) read into the protocol-neutral request (chat.rs).
//! Every field is read through [`Body`], so each mistake is a 400 naming the field, and a field this server does not
//! implement is a 400 naming it too, never a 200 that ignored it (the few that ask nothing of a server are listed in
//! [`NO_ACTION_FIELDS`]).

use ferry_core::engine::{validate_stop_strings, MAX_TOP_LOGPROBS};
use ferry_core::loader::{ChatEnding, ChatMessage};
use serde_json::{Map, Value};

use crate::body::{wrong_type, Body};
use crate::chat::{ChatRequest, GenerationParams, Prompt};
use crate::error::ApiError;
use crate::sampling;
use crate::tools::request::parse_tool_calls;
use crate::tools::ToolRequest;
pub use vllm::cache_salt;
use vllm::{bad_words, min_tokens, repetition_penalty, token_id_list, MAX_ALLOWED_TOKEN_IDS, MAX_STOP_TOKEN_IDS};

mod vllm;

/// Fields accepted although nothing reads them, because by their nature they ask nothing of this server.
pub const NO_ACTION_FIELDS: &[&str] = &[
    // An end-user id that OpenAI keeps for abuse monitoring; a self-hosted server has no such monitoring.
    "user",
    // Its successor, likewise.
    "safety_identifier",
    // A hint that routes requests sharing a prefix to one cache; this server's prefix cache finds shared prefixes by
    // their tokens (vLLM's `cache_salt` is what separates tenants).
    "prompt_cache_key",
];

/// What an OpenAI body says besides the neutral request.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiOptions {
    pub model: Option<String>,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` (vLLM's): the usage so far in every chunk too.
    pub continuous_usage: bool,
    /// `n`: how many choices to generate for the prompt (1 when not given).
    pub choices: usize,
    /// The structured output came as vLLM's `structured_outputs`: errors about it name that field.
    pub structured_outputs: bool,
    /// vLLM's `return_token_ids`: the prompt's and each choice's token ids with the text.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name tokens `token_id:{id}`.
    pub token_names: sampling::TokenNames,
    /// vLLM's `include_reasoning` (chat; true unless false): the answer carries the model's reasoning
    /// (`reasoning_content`); false leaves it out (it is still generated and counted).
    pub include_reasoning: bool,
    /// vLLM's `prompt_logprobs`: each prompt token's logprob, rank and this many most likely alternatives, with
    /// the answer (not with a stream, as vLLM).
    pub prompt_logprobs: Option<usize>,
    /// vLLM's `request_id`: the base of the response's id (`chatcmpl-{request_id}`), returned in its `X-Request-Id`
    /// header and written in its access log line, so a caller can find its request in the server's log (an
    /// `X-Request-Id` request header wins over it, as in vLLM); a fresh one when neither is given.
    pub request_id: Option<String>,
}

impl OpenAiOptions {
    /// An error of the neutral layer about the structured output, named as the request sent it.
    pub fn as_sent(&self, mut error: ApiError) -> ApiError {
        const FIELD: &str = "structured_outputs";
        if self.structured_outputs && error.param.as_deref() == Some("response_format") {
            error.message = error.message.replace("response_format", FIELD);
            error.param = Some(FIELD.into());
        }
        error
    }
}

#[derive(Clone, Debug)]
pub struct ChatBody {
    pub chat: ChatRequest,
    pub options: OpenAiOptions,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionBody {
    /// One prompt or several (a batch: each gets `n` choices, in prompt order).
    pub prompts: Vec<Prompt>,
    pub params: GenerationParams,
    /// Each choice repeats its prompt before its output, with the prompt's tokens' logprobs when `logprobs` asks
    /// for logprobs (`echo`).
    pub echo: bool,
    pub options: OpenAiOptions,
}

/// The fields chat and text completions share. `max_tokens_fields` are the names that set the output limit, in
/// order of preference.
fn generation_params(body: &Body, max_tokens_fields: &[&str]) -> Result<GenerationParams, ApiError> {
    let mut max_tokens = None;
    for name in max_tokens_fields {
        max_tokens = max_tokens.or(body.positive(name)?);
    }
    let top_k = match body.integer("top_k")? {
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
    let top_p = body.number_in("top_p", 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(ApiError::invalid_param("top_p", "`top_p` must be greater than 0"));
    }
    let stop = body.strings("stop", true)?;
    validate_stop_strings("stop", &stop).map_err(|message| ApiError::invalid_param("stop", message))?;
    Ok(GenerationParams {
        max_tokens,
        temperature: body.number_in("temperature", 0.0, 2.0)?,
        top_p,
        top_k,
        seed: body.integer("seed")?.map(|s| s as u64),
        stop,
        presence_penalty: body.number_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: body.number_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        min_p: body.number_in("min_p", 0.0, 1.0)?,
        repetition_penalty: repetition_penalty(body)?,
        logit_bias: sampling::logit_bias(body)?,
        // Chat and text completions spell it differently: their parsers fill it in (and a text completion's
        // `echo` the prompt's).
        logprobs: None,
        prompt_logprobs: None,
        response_format: match (sampling::response_format(body)?, sampling::structured_outputs(body)?) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid_param(
                    "structured_outputs",
                    "`structured_outputs` and `response_format` cannot both constrain the output",
                ))
            }
            (format, structured) => format.or(structured),
        },
        ignore_eos: body.boolean("ignore_eos")?,
        stop_token_ids: token_id_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS)?,
        allowed_token_ids: token_id_list(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)?,
        bad_words: bad_words(body)?,
        truncate_prompt_tokens: body.positive("truncate_prompt_tokens")?,
        include_stop_string: body.boolean("include_stop_str_in_output")?,
        keep_special_tokens: match body.raw("skip_special_tokens") {
            None | Some(Value::Null) => false,
            Some(_) => !body.boolean("skip_special_tokens")?,
        },
        min_tokens: min_tokens(body, max_tokens)?,
        cache_salt: cache_salt(body)?,
        priority: body.integer("priority")?.unwrap_or(0),
        stream: body.boolean("stream")?,
    })
}

fn options(body: &Body) -> Result<OpenAiOptions, ApiError> {
    let (include_usage, continuous_usage) = match body.object("stream_options")? {
        None => (false, false),
        Some(options) => {
            let options = Body::nested(options.clone(), "stream_options.".into());
            let include_usage = options.boolean("include_usage")?;
            let continuous_usage = options.boolean("continuous_usage_stats")?;
            options.refuse_unread(&[])?;
            if continuous_usage && !include_usage {
                return Err(ApiError::invalid_param(
                    "stream_options.continuous_usage_stats",
                    "`stream_options.continuous_usage_stats` puts the usage in every chunk of a stream that has it: \
                     it needs `stream_options.include_usage`",
                ));
            }
            (include_usage, continuous_usage)
        }
    };
    let prompt_logprobs = match body.integer("prompt_logprobs")? {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid_param(
                "prompt_logprobs",
                format!("`prompt_logprobs` must be between 0 and {MAX_TOP_LOGPROBS} alternatives a token, got {n}"),
            ))
        }
    };
    if prompt_logprobs.is_some() && body.boolean("stream")? {
        return Err(ApiError::invalid_param(
            "prompt_logprobs",
            "`prompt_logprobs` are given with a whole answer, not with a stream",
        ));
    }
    Ok(OpenAiOptions {
        prompt_logprobs,
        model: body.string("model")?,
        include_usage,
        continuous_usage,
        choices: body.positive("n")?.unwrap_or(1),
        structured_outputs: body.get("structured_outputs").is_some(),
        return_token_ids: body.boolean("return_token_ids")?,
        token_names: match body.boolean("return_tokens_as_token_ids")? {
            true => sampling::TokenNames::Ids,
            false => sampling::TokenNames::Text,
        },
        // A chat answer's; text completions have no reasoning apart.
        include_reasoning: true,
        request_id: body
            .string("request_id")?
            .map(|id| checked_request_id("request_id", id))
            .transpose()?,
    })
}

/// At most this many bytes of a request id: it becomes part of the response's id, an HTTP header and a log field.
const MAX_REQUEST_ID_BYTES: usize = 128;

/// `id` as a request id (`field` names where it came from): 1 to [`MAX_REQUEST_ID_BYTES`] printable ASCII characters,
/// no spaces, so that it is a valid header value and one field of the log line.
pub fn checked_request_id(field: &str, id: String) -> Result<String, ApiError> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::invalid_param(
            field,
            format!(
                "`{field}` must be 1 to {MAX_REQUEST_ID_BYTES} printable ASCII characters without spaces, got {}",
                crate::error::quote(&id)
            ),
        ));
    }
    Ok(id)
}

/// A message's content: a string, null, or a list of parts of which the text ones are joined.
fn message_content(message: &Body) -> Result<String, ApiError> {
    let param = message.param("content");
    match message.raw("content") {
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

fn chat_message(index: usize, message: &Value) -> Result<ChatMessage, ApiError> {
    let m = message
        .as_object()
        .ok_or_else(|| wrong_type(&format!("messages[{index}]"), "an object", message))?;
    let m = Body::nested(m.clone(), format!("messages[{index}]."));
    let role = match m.raw("role") {
        Some(Value::String(role)) if CHAT_ROLES.contains(&role.as_str()) => role.clone(),
        Some(Value::String(role)) => return Err(unknown_role(index, role)),
        Some(other) => return Err(wrong_type(&format!("messages[{index}].role"), "a string", other)),
        None => {
            return Err(ApiError::invalid_param(
                &format!("messages[{index}].role"),
                format!("`messages[{index}].role` is required"),
            ))
        }
    };
    let content = message_content(&m)?;
    let tool_calls = parse_tool_calls(&m)?;
    if !tool_calls.is_empty() && role != "assistant" {
        let param = m.param("tool_calls");
        return Err(ApiError::invalid_param(
            &param,
            "only assistant messages carry `tool_calls`",
        ));
    }
    let tool_call_id = m.string("tool_call_id")?;
    if tool_call_id.is_some() && role != "tool" {
        let param = m.param("tool_call_id");
        return Err(ApiError::invalid_param(
            &param,
            "only tool messages carry `tool_call_id`",
        ));
    }
    // An earlier turn's reasoning, as vLLM takes it back (tools/history.rs gives it to the template).
    let thinking = m.string("reasoning_content")?;
    if thinking.is_some() && role != "assistant" {
        let param = m.param("reasoning_content");
        return Err(ApiError::invalid_param(
            &param,
            "only assistant messages carry `reasoning_content`",
        ));
    }
    m.refuse_unread(&[])?;
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id,
        thinking,
    })
}

/// `messages`: a non-empty array of messages.
pub fn messages(body: &Body) -> Result<Vec<ChatMessage>, ApiError> {
    let messages = body.nonempty_array("messages", "an array of messages")?;
    messages.iter().enumerate().map(|(i, m)| chat_message(i, m)).collect()
}

/// `chat_template_kwargs`: variables for the chat template.
pub fn template_kwargs(body: &Body) -> Result<Map<String, Value>, ApiError> {
    Ok(body.object("chat_template_kwargs")?.cloned().unwrap_or_default())
}

/// How a chat prompt ends, from vLLM's `add_generation_prompt` and `continue_final_message`: in a new assistant turn
/// (the default), as the last message ends, or continuing the last message.
pub fn chat_ending(add_generation_prompt: bool, continue_final_message: bool) -> Result<ChatEnding, ApiError> {
    match (add_generation_prompt, continue_final_message) {
        (true, false) => Ok(ChatEnding::GenerationPrompt),
        (false, false) => Ok(ChatEnding::LastMessage),
        (false, true) => Ok(ChatEnding::ContinueLastMessage),
        (true, true) => Err(ApiError::invalid_param(
            "continue_final_message",
            "`continue_final_message` continues the last message, so `add_generation_prompt` must be false",
        )),
    }
}

impl ChatBody {
    pub fn parse(body: &Body) -> Result<Self, ApiError> {
        let add_generation_prompt = match body.raw("add_generation_prompt") {
            None | Some(Value::Null) => true,
            Some(_) => body.boolean("add_generation_prompt")?,
        };
        let mut chat = ChatRequest {
            messages: messages(body)?,
            template_kwargs: template_kwargs(body)?,
            thinking: None,
            thinking_budget: None,
            reasoning_effort: crate::chat::reasoning_effort(body)?,
            tools: ToolRequest::parse(body)?,
            params: GenerationParams {
                logprobs: sampling::chat_logprobs(body)?,
                ..generation_params(body, &["max_completion_tokens", "max_tokens"])?
            },
            ending: chat_ending(add_generation_prompt, body.boolean("continue_final_message")?)?,
        };
        let mut options = options(body)?;
        chat.params.prompt_logprobs = options.prompt_logprobs;
        options.include_reasoning = match body.raw("include_reasoning") {
            None | Some(Value::Null) => true,
            Some(_) => body.boolean("include_reasoning")?,
        };
        body.refuse_unread(NO_ACTION_FIELDS)?;
        Ok(ChatBody { chat, options })
    }
}

impl CompletionBody {
    pub fn parse(body: &Body) -> Result<Self, ApiError> {
        let bad_prompt = || {
            ApiError::invalid_param(
                "prompt",
                "`prompt` must be a string, an array of token ids, or an array of those (a batch of prompts)",
            )
        };
        let token_ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
            items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(bad_prompt))
                .collect()
        };
        let prompts = match body.raw("prompt") {
            None | Some(Value::Null) => return Err(ApiError::invalid_param("prompt", "`prompt` is required")),
            Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
            Some(Value::Array(items)) if items.is_empty() => return Err(bad_prompt()),
            Some(Value::Array(ids)) if ids.iter().all(Value::is_number) => vec![Prompt::TokenIds(token_ids(ids)?)],
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(ids) if !ids.is_empty() => Ok(Prompt::TokenIds(token_ids(ids)?)),
                    _ => Err(bad_prompt()),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(bad_prompt()),
        };
        let echo = body.boolean("echo")?;
        let logprobs = sampling::completion_logprobs(body)?;
        let options = options(body)?;
        let params = GenerationParams {
            logprobs,
            // Scored for the echo's logprobs, vLLM's prompt_logprobs, or both (as many alternatives as either asks).
            prompt_logprobs: logprobs.filter(|_| echo).max(options.prompt_logprobs),
            ..generation_params(body, &["max_tokens"])?
        };
        body.refuse_unread(NO_ACTION_FIELDS)?;
        Ok(CompletionBody {
            prompts,
            params,
            echo,
            options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<ChatBody, ApiError> {
        ChatBody::parse(&Body::new(body.as_object().unwrap().clone()))
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
            "seed": 3, "stop": "x", "presence_penalty": 1, "frequency_penalty": -1, "n": 3,
            "stream": true, "stream_options": {"include_usage": true},
            "chat_template_kwargs": {"enable_thinking": false},
            "user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "agent-7"
        }))
        .unwrap();
        assert_eq!(body.chat.messages[1].content, "hi there");
        assert_eq!(body.chat.messages[2].content, "");
        let p = &body.chat.params;
        assert_eq!(p.max_tokens, Some(5), "max_completion_tokens wins");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.seed),
            (Some(0.5), Some(0.9), None, Some(3))
        );
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert!(p.stream && body.options.include_usage);
        assert_eq!(body.options.choices, 3);
        assert_eq!(
            chat(json!({"messages": [{"role": "user", "content": "hi"}]}))
                .unwrap()
                .options
                .choices,
            1
        );
        assert_eq!(body.chat.template_kwargs["enable_thinking"], json!(false));
        let salted = chat(json!({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-7"}));
        assert_eq!(salted.unwrap().chat.params.cache_salt.as_deref(), Some("tenant-7"));
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
            ("n", json!(0)),
            ("n", json!(1.5)),
            ("stop", json!([1])),
            ("presence_penalty", json!(2.5)),
            ("frequency_penalty", json!(-3)),
            ("stream", json!("yes")),
            ("chat_template_kwargs", json!([])),
            ("seed", json!(1.5)),
            ("model", json!(3)),
            ("cache_salt", json!("")),
            ("cache_salt", json!(7)),
            ("priority", json!("high")),
            ("priority", json!(1.5)),
        ] {
            let mut body = json!({"messages": user});
            body[name] = value.clone();
            assert_eq!(param_of(body), Some(name.to_string()), "{name} = {value}");
        }
        for (options, param) in [
            (json!({"include_usage": "yes"}), "stream_options.include_usage"),
            (
                json!({"continuous_usage_stats": true}),
                "stream_options.continuous_usage_stats",
            ),
        ] {
            let body = json!({"messages": user, "stream_options": options});
            assert_eq!(param_of(body), Some(param.to_string()));
        }
    }

    #[test]
    fn a_field_this_server_does_not_implement_is_refused_by_name() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (name, value) in [("suffix", json!("x")), ("best_of", json!(2)), ("functions", json!([]))] {
            let mut body = json!({"messages": user});
            body[name] = value;
            let error = chat(body).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(name));
            assert!(error.message.contains("not supported"), "{}", error.message);
        }
        let named = json!({"messages": [{"role": "user", "content": "hi", "name": "ann"}]});
        assert_eq!(param_of(named), Some("messages[0].name".into()));
        for no_action in NO_ACTION_FIELDS {
            let mut body = json!({"messages": user});
            body[*no_action] = json!("x");
            chat(body).unwrap();
        }
        chat(json!({"messages": user, "logprobs": null})).expect("null is not sent");
    }

    #[test]
    fn stop_strings_are_bounded_in_count_and_length() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let most = vec!["s".repeat(256); 16];
        assert_eq!(
            chat(json!({"messages": user, "stop": most}))
                .unwrap()
                .chat
                .params
                .stop
                .len(),
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
        for stop in [json!(""), json!(["END", ""])] {
            let error = chat(json!({"messages": user, "stop": stop})).unwrap_err();
            assert_eq!(error.param, Some("stop".into()));
            assert!(error.message.contains("is empty"), "{}", error.message);
        }
    }

    #[test]
    fn bad_words_are_read_without_leading_space_and_bounded() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let words = |value: Value| chat(json!({"messages": user, "bad_words": value})).map(|b| b.chat.params.bad_words);
        assert_eq!(words(json!([" ferry", "boat "])).unwrap(), ["ferry", "boat "]);
        assert_eq!(words(json!([])).unwrap(), Vec::<String>::new());
        for (value, says) in [
            (json!("ferry"), "an array of strings"),
            (json!(["ferry", "  "]), "`bad_words[1]` is blank"),
            (json!(vec!["w"; 65]), "at most 64"),
            (json!(["w".repeat(257)]), "at most 256"),
        ] {
            let error = words(value).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("bad_words"));
            assert!(error.message.contains(says), "{}", error.message);
        }
    }

    #[test]
    fn a_role_no_template_renders_is_refused_with_its_index() {
        let roles = ["system", "user", "assistant", "tool"];
        let known: Vec<Value> = roles.iter().map(|r| json!({"role": r, "content": "x"})).collect();
        assert_eq!(chat(json!({"messages": known})).unwrap().chat.messages.len(), 4);
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
    fn completion_prompts_are_text_or_token_ids_one_or_a_batch() {
        let parse = |v: Value| CompletionBody::parse(&Body::new(v.as_object().unwrap().clone()));
        let text = |t: &str| Prompt::Text(t.into());
        assert_eq!(parse(json!({"prompt": "hi"})).unwrap().prompts, vec![text("hi")]);
        assert_eq!(parse(json!({"prompt": ["hi"]})).unwrap().prompts, vec![text("hi")]);
        assert_eq!(
            parse(json!({"prompt": [1, 2]})).unwrap().prompts,
            vec![Prompt::TokenIds(vec![1, 2])]
        );
        assert_eq!(
            parse(json!({"prompt": [[3]]})).unwrap().prompts,
            vec![Prompt::TokenIds(vec![3])]
        );
        assert_eq!(
            parse(json!({"prompt": ["a", [4, 5], "b"]})).unwrap().prompts,
            vec![text("a"), Prompt::TokenIds(vec![4, 5]), text("b")]
        );
        for bad in [
            json!({}),
            json!({"prompt": 3}),
            json!({"prompt": []}),
            json!({"prompt": ["a", []]}),
            json!({"prompt": ["a", 5]}),
            json!({"prompt": [-1]}),
            json!({"prompt": [[1], [-1]]}),
        ] {
            assert_eq!(parse(bad.clone()).unwrap_err().param, Some("prompt".into()), "{bad}");
        }
        // `echo` asks for the prompt's logprobs only with logprobs.
        let echoed = parse(json!({"prompt": "x", "echo": true})).unwrap();
        assert!(echoed.echo && echoed.params.prompt_logprobs.is_none());
        let scored = parse(json!({"prompt": "x", "echo": true, "logprobs": 2})).unwrap();
        assert_eq!(scored.params.prompt_logprobs, Some(2));
        assert_eq!(
            parse(json!({"prompt": "x", "logprobs": 2}))
                .unwrap()
                .params
                .prompt_logprobs,
            None
        );
        assert_eq!(
            parse(json!({"prompt": "x", "echo": "yes"})).unwrap_err().param,
            Some("echo".into())
        );
    }
}
