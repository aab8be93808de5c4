//! The generation loop for one sequence: prefill the prompt, then decode token by token until a stop rule fires.

use super::sampler::{Sampler, SamplingParams};
use crate::backend::{Backend, SeqSlice};
use crate::model::Model;
use crate::moe::RoutingTap;
use crate::{Error, Result};

#[derive(Clone, Debug, Default)]
pub struct StopRules {
    pub eos_token_ids: Vec<u32>,
    /// Keep going past eos tokens (benchmarks and parity tests).
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    /// Prompt tokens per forward pass (at most what the backend's workspace was sized for, usually
    /// [`super::MAX_BATCH_TOKENS`]).
    pub prefill_chunk: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: StopRules,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos token was generated.
    Stop,
    /// max_tokens or the context window was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated ids only (an eos that stopped generation included).
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
}

/// Generates for one prompt. `on_step(token, logits)` sees each new token with the logits it was sampled from.
pub fn generate<B: Backend>(
    be: &B,
    model: &Model<B>,
    kv: &mut B::Kv,
    seq: crate::kv::SeqId,
    request: &GenerateRequest,
    on_step: impl FnMut(u32, &[f32]),
) -> Result<Generation> {
    generate_routed(be, model, kv, seq, request, None, on_step)
}

/// [`generate`], with `tap` seeing every MoE layer's routing (to record a routing trace).
pub fn generate_routed<B: Backend>(
    be: &B,
    model: &Model<B>,
    kv: &mut B::Kv,
    seq: crate::kv::SeqId,
    request: &GenerateRequest,
    mut tap: Option<&mut dyn RoutingTap>,
    mut on_step: impl FnMut(u32, &[f32]),
) -> Result<Generation> {
    request.sampling.validate().map_err(Error::Request)?;
    let prompt = &request.prompt_ids;
    let window = model.spec.max_position_embeddings;
    if prompt.is_empty() {
        return Err(Error::Request("the prompt is empty".into()));
    }
    if prompt.len() >= window {
        return Err(Error::Request(format!(
            "the prompt has {} tokens; the context window is {window}",
            prompt.len()
        )));
    }
    let max_tokens = request.max_tokens.min(window - prompt.len());
    let mut sampler = Sampler::new(request.sampling.clone());
    let mut tokens = Vec::with_capacity(max_tokens);
    if request.prefill_chunk == 0 {
        return Err(Error::Request("the prefill chunk is empty".into()));
    }
    // Prefill in chunks; then one token at a time.
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(request.prefill_chunk).enumerate() {
        let slice = SeqSlice {
            seq,
            start_pos: i * request.prefill_chunk,
            len: chunk.len(),
        };
        logits = be.to_host(&model.forward_routed(be, chunk, &[slice], kv, tap.as_deref_mut())?)?;
    }
    let mut pos = prompt.len();
    while tokens.len() < max_tokens {
        let token = sampler.sample(&logits);
        tokens.push(token);
        on_step(token, &logits);
        if !request.stop.ignore_eos && request.stop.eos_token_ids.contains(&token) {
            return Ok(Generation {
                token_ids: tokens,
                finish_reason: FinishReason::Stop,
            });
        }
        if tokens.len() == max_tokens {
            break;
        }
        let slice = SeqSlice {
            seq,
            start_pos: pos,
            len: 1,
        };
        logits = be.to_host(&model.forward_routed(be, &[token], &[slice], kv, tap.as_deref_mut())?)?;
        pos += 1;
    }
    Ok(Generation {
        token_ids: tokens,
        finish_reason: FinishReason::Length,
    })
}
