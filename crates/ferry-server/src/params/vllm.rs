//! vLLM's extensions to OpenAI's request bodies that shape generation (`cache_salt`, `bad_words`, `stop_token_ids`,
//! `allowed_token_ids`, `min_tokens`, `repetition_penalty`), each read and bounded here, a 400 naming the field
//! otherwise.

use serde_json::Value;

use crate::body::Body;
use crate::error::ApiError;

/// vLLM's `cache_salt`: a non-empty string; requests share prefix-cache blocks only with requests of the same salt.
pub fn cache_salt(body: &Body) -> Result<Option<String>, ApiError> {
    const FIELD: &str = "cache_salt";
    match body.string(FIELD)? {
        Some(salt) if salt.is_empty() => Err(ApiError::invalid_param(
            FIELD,
            format!("`{FIELD}` must be a non-empty string"),
        )),
        salt => Ok(salt),
    }
}

/// At most this many `stop_token_ids`: each generated token is looked up among them.
pub(super) const MAX_STOP_TOKEN_IDS: usize = 256;
/// At most this many `bad_words`, each at most [`MAX_BAD_WORD_BYTES`] long: each step compares the output's end
/// with each word's tokens (two tokenizations a word).
const MAX_BAD_WORDS: usize = 64;
const MAX_BAD_WORD_BYTES: usize = 256;

/// vLLM's `bad_words`: words never generated as the tokens they tokenize to (chat.rs's `bad_word_sequences`), leading
/// whitespace dropped (each is banned with and without a space before it); none blank.
pub(super) fn bad_words(body: &Body) -> Result<Vec<String>, ApiError> {
    const FIELD: &str = "bad_words";
    let words = body.strings(FIELD, false)?;
    if words.len() > MAX_BAD_WORDS {
        return Err(ApiError::invalid_param(
            FIELD,
            format!(
                "`{FIELD}` holds {} words; at most {MAX_BAD_WORDS} are allowed",
                words.len()
            ),
        ));
    }
    words
        .iter()
        .enumerate()
        .map(|(i, word)| {
            let word = word.trim_start();
            if word.is_empty() {
                return Err(ApiError::invalid_param(FIELD, format!("`{FIELD}[{i}]` is blank")));
            }
            if word.len() > MAX_BAD_WORD_BYTES {
                return Err(ApiError::invalid_param(
                    FIELD,
                    format!(
                        "`{FIELD}[{i}]` has {} bytes; at most {MAX_BAD_WORD_BYTES} are allowed",
                        word.len()
                    ),
                ));
            }
            Ok(word.to_string())
        })
        .collect()
}

/// At most this many `allowed_token_ids` (a vocabulary's worth): each step keeps their logits.
pub(super) const MAX_ALLOWED_TOKEN_IDS: usize = 1 << 18;

/// A list of at most `max` token ids (vLLM's `stop_token_ids`, `allowed_token_ids`); their range is checked against
/// the model's vocabulary later.
pub(super) fn token_id_list(body: &Body, name: &str, max: usize) -> Result<Vec<u32>, ApiError> {
    let Some(value) = body.raw(name) else {
        return Ok(vec![]);
    };
    let bad = || ApiError::invalid_param(name, format!("`{name}` must be an array of token ids"));
    match value {
        Value::Null => Ok(vec![]),
        Value::Array(items) if items.len() > max => Err(ApiError::invalid_param(
            name,
            format!("`{name}` holds {} ids; at most {max} are allowed", items.len()),
        )),
        Value::Array(items) => items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(bad))
            .collect(),
        _ => Err(bad()),
    }
}

/// vLLM's `min_tokens`: at least 0, and no more than the output limit when there is one.
pub(super) fn min_tokens(body: &Body, max_tokens: Option<usize>) -> Result<usize, ApiError> {
    let min = match body.integer("min_tokens")? {
        None => return Ok(0),
        Some(n) if n < 0 => {
            return Err(ApiError::invalid_param(
                "min_tokens",
                format!("`min_tokens` must be at least 0, got {n}"),
            ))
        }
        Some(n) => n as usize,
    };
    match max_tokens {
        Some(max) if min > max => Err(ApiError::invalid_param(
            "min_tokens",
            format!("`min_tokens` ({min}) is more than the output limit ({max})"),
        )),
        _ => Ok(min),
    }
}

/// transformers' `repetition_penalty` (vLLM's extension): greater than 0, 1 for none.
pub(super) fn repetition_penalty(body: &Body) -> Result<Option<f32>, ApiError> {
    match body.number("repetition_penalty")? {
        Some(p) if !(p > 0.0 && p.is_finite()) => Err(ApiError::invalid_param(
            "repetition_penalty",
            format!("`repetition_penalty` must be greater than 0, got {p}"),
        )),
        p => Ok(p.map(|p| p as f32)),
    }
}
