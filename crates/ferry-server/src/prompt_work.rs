//! Preparing a prompt (parsing the body, rendering the chat template, tokenizing) off the async runtime: on tokio's
//! blocking pool, a bounded number at once, so that one large prompt, or many, cannot keep /health and the other
//! requests' streams waiting. Before any of that work, a prompt whose text cannot fit the context is refused by its
//! byte length alone.

use std::sync::Arc;

use ferry_core::loader::Tokenizer;
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::{AppState, LoadedModel};

/// How many times the bytes a tokenizer's normalizer may fold into one token's text: NFC composes at most three
/// UTF-8 sequences into one character of a third of their bytes (Hangul jamo into a syllable).
const NORMALIZER_FOLD: usize = 3;

/// The most bytes of text one token stands for: the longest decoded entry of the vocabulary (added tokens
/// included). A prompt of `n` tokens is at most `n` times this many bytes, before normalization.
pub fn longest_token_bytes(tokenizer: &Tokenizer) -> usize {
    (0..tokenizer.vocab_size() as u32)
        .filter_map(|id| tokenizer.decode(&[id], false).ok())
        .map(|text| text.len())
        .max()
        .unwrap_or(0)
        .max(1)
}

/// Prompts prepared at once: half the cores, so that the engine and the runtime keep the rest.
pub(crate) fn workers() -> Arc<Semaphore> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Arc::new(Semaphore::new((cores / 2).max(1)))
}

/// Runs `prepare` on the blocking pool once a worker is free.
pub(crate) async fn off_runtime<T: Send + 'static>(
    state: &AppState,
    prepare: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let worker = state
        .0
        .prompt_workers
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the prompt workers are gone"))?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let _worker = worker;
        prepare(&state)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// A 400 naming `param` when `text_bytes` of prompt text cannot fit the model's context, whatever its tokens.
pub(crate) fn check_prompt_bytes(model: &LoadedModel, text_bytes: usize, param: &str) -> Result<(), ApiError> {
    let limit = model.max_model_len * model.max_token_bytes * NORMALIZER_FOLD;
    if text_bytes <= limit {
        return Ok(());
    }
    Err(ApiError::invalid_param(
        param,
        format!(
            "the prompt's text is {text_bytes} bytes, more than the {limit} bytes that can fit this model's maximum \
             context length of {} tokens",
            model.max_model_len
        ),
    )
    .with_code("context_length_exceeded"))
}
