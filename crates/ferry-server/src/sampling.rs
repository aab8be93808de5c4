//! OpenAI's sampling surface beyond temperature and top-p: `logit_bias`, `logprobs` (chat: `logprobs` and
//! `top_logprobs`; completions: `logprobs` as a count), `min_p`, `repetition_penalty` and `response_format`, read
//! from a body (each mistake a 400 naming the field); a response format compiled for the served model; and logprobs
//! rendered in OpenAI's chat and completions shapes.
//!
//! Not here: what the engine does with them (ferry-core's engine: sampler.rs, logprobs.rs, constraint.rs).

use std::sync::{Arc, OnceLock};

use ferry_core::engine::{Constraint, GrammarCompiler, ResponseFormat, TokenLogprobs, MAX_TOP_LOGPROBS};
use serde_json::{json, Map, Value};

use crate::body::{wrong_type, Body};
use crate::error::ApiError;
use crate::generation::PromptScore;
use crate::LoadedModel;

/// Most alternatives per token a text completion may ask for (OpenAI's limit for `logprobs` there).
const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// `logit_bias`: token ids (as strings, JSON keys) to a bias in [-100, 100].
pub fn logit_bias(body: &Body) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(entries) = body.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    let param = body.param("logit_bias");
    entries
        .iter()
        .map(|(key, value)| {
            let id = key.parse::<u32>().map_err(|_| {
                ApiError::invalid_param(&param, format!("`{param}` keys must be token ids, got \"{key}\""))
            })?;
            match value.as_f64() {
                Some(bias) if (-100.0..=100.0).contains(&bias) => Ok((id, bias as f32)),
                _ => Err(ApiError::invalid_param(
                    &param,
                    format!("`{param}` values must be numbers between -100 and 100, got {value} for token {id}"),
                )),
            }
        })
        .collect()
}

/// `top_logprobs`: alternatives per token, 0 to [`MAX_TOP_LOGPROBS`] (chat's and the Responses API's field).
pub fn top_logprobs(body: &Body) -> Result<Option<usize>, ApiError> {
    match body.integer("top_logprobs")? {
        Some(n) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Err(ApiError::invalid_param(
            "top_logprobs",
            format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        )),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// Chat's `logprobs` (a boolean) and `top_logprobs` (only with `logprobs`): how many alternatives per token, or
/// None for no logprobs.
pub fn chat_logprobs(body: &Body) -> Result<Option<usize>, ApiError> {
    let wanted = body.boolean("logprobs")?;
    match (wanted, top_logprobs(body)?) {
        (false, Some(_)) => Err(ApiError::invalid_param(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        )),
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

/// A text completion's `logprobs`: how many alternatives per token (0 to 5), or None for no logprobs.
pub fn completion_logprobs(body: &Body) -> Result<Option<usize>, ApiError> {
    match body.integer("logprobs")? {
        Some(n) if !(0..=MAX_COMPLETION_LOGPROBS).contains(&n) => Err(ApiError::invalid_param(
            "logprobs",
            format!("`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {n}"),
        )),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// `response_format`: `{"type": "text"}` (None), `{"type": "json_object"}`, or `{"type": "json_schema",
/// "json_schema": {"name", "schema", "strict", "description"}}`. The schema is always enforced, `strict` or not
/// (OpenAI's strict mode, without its restrictions on schemas); `description` only describes the format.
pub fn response_format(body: &Body) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(fields) = body.object("response_format")? else {
        return Ok(None);
    };
    let format = Body::nested(fields.clone(), body.param("response_format."));
    let format_type = format.string("type")?;
    let parsed = match format_type.as_deref() {
        Some("text") => None,
        Some("json_object") => Some(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let Some(spec) = format.object("json_schema")? else {
                let param = format.param("json_schema");
                return Err(ApiError::invalid_param(&param, format!("`{param}` is required")));
            };
            let spec = Body::nested(spec.clone(), format.param("json_schema."));
            if spec.string("name")?.is_none() {
                let param = spec.param("name");
                return Err(ApiError::invalid_param(&param, format!("`{param}` is required")));
            }
            spec.boolean("strict")?;
            let schema = match spec.get("schema") {
                Some(schema @ Value::Object(_)) => schema.clone(),
                Some(other) => return Err(wrong_type(&spec.param("schema"), "a JSON Schema object", other)),
                None => {
                    let param = spec.param("schema");
                    return Err(ApiError::invalid_param(&param, format!("`{param}` is required")));
                }
            };
            spec.refuse_unread(&["description"])?;
            Some(ResponseFormat::JsonSchema(schema))
        }
        _ => {
            let param = format.param("type");
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be \"text\", \"json_object\" or \"json_schema\""),
            ));
        }
    };
    format.refuse_unread(&[])?;
    Ok(parsed)
}

/// vLLM's `structured_outputs`: exactly one of `json` (a JSON Schema, or its text), `json_object` (true), `regex`,
/// `choice` (texts) or `grammar` (llguidance's Lark syntax), as a response format.
pub fn structured_outputs(body: &Body) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(fields) = body.object("structured_outputs")? else {
        return Ok(None);
    };
    let spec = Body::nested(fields.clone(), body.param("structured_outputs."));
    let mut formats = vec![];
    if let Some(json) = spec.get("json") {
        let param = spec.param("json");
        let schema = match json {
            Value::String(text) => serde_json::from_str(text)
                .map_err(|e| ApiError::invalid_param(&param, format!("`{param}` is not JSON: {e}")))?,
            other => other.clone(),
        };
        match schema {
            Value::Object(_) => formats.push(ResponseFormat::JsonSchema(schema)),
            other => return Err(wrong_type(&param, "a JSON Schema object (or its text)", &other)),
        }
    }
    if spec.boolean("json_object")? {
        formats.push(ResponseFormat::JsonObject);
    }
    if let Some(regex) = spec.string("regex")? {
        formats.push(ResponseFormat::Regex(regex));
    }
    if spec.get("choice").is_some() {
        let choices = spec.strings("choice", false)?;
        if choices.is_empty() {
            let param = spec.param("choice");
            return Err(ApiError::invalid_param(&param, format!("`{param}` must not be empty")));
        }
        formats.push(ResponseFormat::Choice(choices));
    }
    if let Some(grammar) = spec.string("grammar")? {
        formats.push(ResponseFormat::Lark(grammar));
    }
    spec.refuse_unread(&[])?;
    match formats.len() {
        1 => Ok(formats.pop()),
        n => Err(ApiError::invalid_param(
            "structured_outputs",
            format!(
                "`structured_outputs` needs exactly one of `json`, `json_object`, `regex`, `choice` and `grammar`, \
                 got {n}"
            ),
        )),
    }
}

/// The served model's grammar compiler, built on the first structured request (a pass over the vocabulary that
/// a server never asked for structured output does not pay); an error if this tokenizer cannot have one.
pub(crate) type Compiler = OnceLock<Result<Arc<GrammarCompiler>, String>>;

/// The constraint for `format` on `model`: a 400 naming `param` (where the format came from) for a schema or
/// grammar that cannot be compiled or a model that cannot constrain its output.
pub fn constraint(
    compiler: &Compiler,
    model: &LoadedModel,
    format: &ResponseFormat,
    param: &str,
) -> Result<Constraint, ApiError> {
    let compiler = compiler
        .get_or_init(|| {
            GrammarCompiler::new(&model.tokenizer, &model.eos_token_ids, model.vocab_size)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}")))?;
    compiler
        .compile(format)
        .map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}")))
}

/// A token as OpenAI shows it: its text (a lone part of a character shows as U+FFFD) and that text's bytes.
fn token_text(model: &LoadedModel, id: u32) -> String {
    model.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// How logprobs name their tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokenNames {
    /// By their text.
    #[default]
    Text,
    /// As `token_id:{id}` (vLLM's `return_tokens_as_token_ids`): a token that is part of a character, whose text
    /// alone is U+FFFD, stays identifiable.
    Ids,
}

impl TokenNames {
    fn name(self, model: &LoadedModel, id: u32) -> String {
        match self {
            TokenNames::Text => token_text(model, id),
            TokenNames::Ids => format!("token_id:{id}"),
        }
    }
}

fn chat_entry(model: &LoadedModel, id: u32, logprob: f32, names: TokenNames) -> Map<String, Value> {
    let token = names.name(model, id);
    let bytes: Vec<u8> = token.clone().into_bytes();
    let mut entry = Map::new();
    entry.insert("token".into(), token.into());
    entry.insert("logprob".into(), logprob.into());
    entry.insert("bytes".into(), bytes.into());
    entry
}

/// One token's logprobs as chat (and the Responses API's `output_text`) shows them: `{token, logprob, bytes,
/// top_logprobs: [{token, logprob, bytes}]}`.
pub fn token_json(model: &LoadedModel, id: u32, lp: &TokenLogprobs, names: TokenNames) -> Value {
    let mut entry = chat_entry(model, id, lp.logprob, names);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(alt, logprob)| Value::Object(chat_entry(model, alt, logprob, names)))
        .collect();
    entry.insert("top_logprobs".into(), top.into());
    Value::Object(entry)
}

/// Chat's `logprobs`: `{"content": [`[`token_json`]`...]}`.
pub fn chat_json(model: &LoadedModel, tokens: &[(u32, TokenLogprobs)], names: TokenNames) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|(id, lp)| token_json(model, *id, lp, names))
        .collect();
    json!({ "content": content })
}

/// vLLM's `prompt_logprobs`: null for the prompt's first token, then for each other one `{id: {logprob, rank,
/// decoded_token}}` of the token and of its `top` most likely alternatives (ranked 1, 2, ... in that order).
pub fn prompt_logprobs_json(model: &LoadedModel, scores: &[PromptScore], top: usize) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| json!({"logprob": logprob, "rank": rank, "decoded_token": token_text(model, id)});
    let mut tokens = vec![Value::Null];
    for score in scores {
        let mut alternatives = Map::new();
        for (place, &(id, logprob)) in score.logprobs.top.iter().take(top).enumerate() {
            alternatives.insert(id.to_string(), entry(id, logprob, place + 1));
        }
        alternatives.insert(
            score.id.to_string(),
            entry(score.id, score.logprobs.logprob, score.rank),
        );
        tokens.push(Value::Object(alternatives));
    }
    Value::Array(tokens)
}

/// A text completion's `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`, offsets counted in bytes
/// from `offset` (where these tokens start in the completion); each `top_logprobs` entry holds the chosen token and
/// its alternatives. A token without logprobs (an echoed prompt's first) has null for both. Tokens are named as
/// `names` says; offsets always count the text.
pub fn completion_json<'a>(
    model: &LoadedModel,
    tokens: impl IntoIterator<Item = (u32, Option<&'a TokenLogprobs>)>,
    offset: &mut usize,
    names: TokenNames,
) -> Value {
    let mut texts = Vec::new();
    let mut logprobs = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for (id, lp) in tokens {
        offsets.push(*offset);
        *offset += token_text(model, id).len();
        let name = names.name(model, id);
        match lp {
            Some(lp) => {
                let mut top = Map::new();
                top.insert(name.clone(), lp.logprob.into());
                for &(alt, logprob) in &lp.top {
                    top.insert(names.name(model, alt), logprob.into());
                }
                logprobs.push(lp.logprob.into());
                tops.push(Value::Object(top));
            }
            None => {
                logprobs.push(Value::Null);
                tops.push(Value::Null);
            }
        }
        texts.push(name);
    }
    json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}
