//! What a caller asks of the engine and hears back: a [`Request`] (prompt, limits, sampling, stop rules), checked
//! by [`Request::validate`] before it is queued, and the [`Event`]s its [`EventSink`] receives. Not how requests are
//! scheduled (scheduler.rs) or what a step makes of a request's logits (emit.rs).

use super::constraint::Constraint;
use super::logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
use super::sampler::SamplingParams;
use super::stop::validate_stop_strings;
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

#[derive(Clone, Debug, Default)]
pub struct StopRules {
    pub eos_token_ids: Vec<u32>,
    /// Keep going past eos tokens (benchmarks and parity tests).
    pub ignore_eos: bool,
    /// More tokens that end the output as an eos token does, ignore_eos or not (vLLM's `stop_token_ids`); like an
    /// eos token, one releases no text.
    pub stop_token_ids: Vec<u32>,
    /// Nothing ends the output before this many tokens but max_tokens and the context window (vLLM's
    /// `min_tokens`): eos and stop tokens are masked out of the logits until then, and stop strings are not looked
    /// for.
    pub min_tokens: usize,
    /// A stop string that ends the output is part of it (vLLM's `include_stop_str_in_output`).
    pub include_stop_string: bool,
}

/// A bound on a reasoning model's thinking: once `max_tokens` tokens have been generated inside its thinking, the
/// next token is `end_id` (its end-of-thinking token, `</think>`), whatever the logits say, as llama.cpp's reasoning
/// budget and vLLM's thinking budget do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThinkingBudget {
    pub max_tokens: usize,
    /// The token that opens thinking (`<think>`).
    pub start_id: u32,
    pub end_id: u32,
    /// The prompt ends inside the thinking (a template that opens `<think>` itself, as Qwen3.5's does).
    pub starts_inside: bool,
}

#[derive(Clone, Debug)]
pub struct Request {
    pub prompt_ids: Vec<u32>,
    /// Generated tokens at most (the context window may end generation sooner).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// transformers' repetition penalty over the prompt and the output (1: none).
    pub repetition_penalty: f32,
    /// (token id, bias in [-100, 100]) added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be generated (vLLM's `allowed_token_ids`); empty: any.
    pub allowed_token_ids: Vec<u32>,
    /// Token sequences the output never ends with (vLLM's `bad_words`, tokenized): a sequence's last token is
    /// banned wherever the output so far ends with the rest of it (a one-token sequence: everywhere).
    pub bad_words: Vec<Vec<u32>>,
    /// Report each token's logprob and this many most likely alternatives (at most [`MAX_TOP_LOGPROBS`]); None:
    /// no logprobs.
    pub logprobs: Option<usize>,
    /// Report each prompt token's logprob (from the second on, under the model's raw logits) and this many most
    /// likely alternatives, as [`Event::PromptToken`]s before the first generated token (OpenAI's `echo` with
    /// `logprobs`). Such a prompt is computed a token a step, none of it taken from the prefix cache, so that every
    /// position's logits are seen.
    pub prompt_logprobs: Option<usize>,
    /// Structured output: only tokens this grammar allows are sampled (see constraint.rs).
    pub constraint: Option<Constraint>,
    pub stop_strings: Vec<String>,
    pub stop: StopRules,
    /// Thinking ended by force past its budget; None: the model thinks as long as it likes.
    pub thinking_budget: Option<ThinkingBudget>,
    /// Special tokens write no text (the default; vLLM's `skip_special_tokens`).
    pub skip_special_tokens: bool,
    /// The prefix cache shares this request's blocks only with requests of the same salt (vLLM's `cache_salt`:
    /// one per tenant, so that none learns from the cache's timing what another's prompts held); None: with
    /// every unsalted request.
    pub cache_salt: Option<String>,
    /// Where it is served under priority scheduling ([`crate::engine::SchedulingPolicy::Priority`]): lower first,
    /// equal ones in arrival order (vLLM's `priority`); under first-come-first-served it must be 0.
    pub priority: i64,
}

impl Request {
    /// Greedy generation of up to `max_tokens` tokens after `prompt_ids`, with no penalties, stop strings or eos
    /// ids (set the fields to ask for them).
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            prompt_ids,
            max_tokens,
            sampling: SamplingParams::default(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            allowed_token_ids: Vec::new(),
            bad_words: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            stop_strings: Vec::new(),
            stop: StopRules::default(),
            thinking_budget: None,
            skip_special_tokens: true,
            cache_salt: None,
            priority: 0,
        }
    }

    /// Rejects what no step could serve, naming the value.
    pub fn validate(&self, max_model_len: usize, vocab_size: usize) -> Result<()> {
        self.sampling.validate().map_err(Error::Request)?;
        if self.prompt_ids.is_empty() {
            return Err(Error::Request("the prompt is empty".into()));
        }
        validate_stop_strings("stop", &self.stop_strings).map_err(Error::Request)?;
        if self.cache_salt.as_deref() == Some("") {
            return Err(Error::Request("cache_salt must not be empty".into()));
        }
        if self.max_tokens == 0 {
            return Err(Error::Request("max_tokens must be at least 1".into()));
        }
        if self.prompt_ids.len() >= max_model_len {
            return Err(Error::Request(format!(
                "the prompt has {} tokens; the context window is {max_model_len}, which must leave room for at \
                 least one generated token",
                self.prompt_ids.len()
            )));
        }
        if let Some(bad) = self.prompt_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(Error::Request(format!(
                "token id {bad} is outside the vocabulary (size {vocab_size})"
            )));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(Error::Request(format!("{name} must be between -2 and 2, got {value}")));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(Error::Request(format!(
                "repetition_penalty must be greater than 0, got {}",
                self.repetition_penalty
            )));
        }
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab_size {
                return Err(Error::Request(format!(
                    "logit_bias: token id {token} is outside the vocabulary (size {vocab_size})"
                )));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(Error::Request(format!(
                    "logit_bias: the bias of token {token} must be between -100 and 100, got {bias}"
                )));
            }
        }
        for (name, ids) in [
            ("allowed_token_ids", &self.allowed_token_ids),
            ("stop_token_ids", &self.stop.stop_token_ids),
        ] {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
                return Err(Error::Request(format!(
                    "{name}: token id {bad} is outside the vocabulary (size {vocab_size})"
                )));
            }
        }
        for word in &self.bad_words {
            if word.is_empty() {
                return Err(Error::Request("bad_words: a word with no tokens".into()));
            }
            if let Some(bad) = word.iter().find(|&&id| id as usize >= vocab_size) {
                return Err(Error::Request(format!(
                    "bad_words: token id {bad} is outside the vocabulary (size {vocab_size})"
                )));
            }
        }
        if self.stop.min_tokens > self.max_tokens {
            return Err(Error::Request(format!(
                "min_tokens ({}) is more than max_tokens ({})",
                self.stop.min_tokens, self.max_tokens
            )));
        }
        // A grammar may allow none of the allowed tokens, only banned words, or nothing but the end that min_tokens
        // holds back.
        for (name, narrows) in [
            ("allowed_token_ids", !self.allowed_token_ids.is_empty()),
            ("bad_words", !self.bad_words.is_empty()),
            ("min_tokens", self.stop.min_tokens > 0),
        ] {
            if narrows && self.constraint.is_some() {
                return Err(Error::Request(format!(
                    "{name} cannot be combined with a structured output or forced tool calls"
                )));
            }
        }
        for (name, asked) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(n) = asked.filter(|&n| n > MAX_TOP_LOGPROBS) {
                return Err(Error::Request(format!(
                    "{name}: at most {MAX_TOP_LOGPROBS} alternatives per token, got {n}"
                )));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos token was generated, or the constraint's grammar is complete.
    Stop,
    /// The stop string at this index of [`Request::stop_strings`] was generated (it is not part of the output).
    StopString(usize),
    /// max_tokens or the context window was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString(_) => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a request's owner hears about it.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Token `id` was generated; `text` is what it released (empty while a character or a possible stop string is
    /// incomplete); `logprobs` when the request asked for them.
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// Prompt token `id` (the second of the prompt or a later one) had this logprob and alternatives where it
    /// stands, and this rank among the vocabulary (1: the most likely), when the request asked for prompt
    /// logprobs; each comes once, in prompt order, before any `Token`.
    PromptToken {
        id: u32,
        logprobs: TokenLogprobs,
        rank: usize,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        /// Prompt tokens found in the prefix cache, not computed.
        cached_tokens: usize,
        completion_tokens: usize,
    },
    Failed {
        message: String,
    },
}

/// Where a request's events go; returns false once nobody listens, which cancels the request.
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

#[cfg(test)]
mod tests {
    use super::*;

    fn request(prompt: &[u32]) -> Request {
        Request::new(prompt.to_vec(), 1)
    }

    /// The error `validate` gives, against a context window of 16 and a vocabulary of 16.
    fn refusal(r: Request) -> String {
        r.validate(16, 16).unwrap_err().to_string()
    }

    #[test]
    fn what_no_step_could_serve_is_refused_naming_the_value() {
        request(&[1; 15]).validate(16, 16).unwrap();
        assert!(refusal(request(&[])).contains("empty"));
        assert!(refusal(request(&[1; 16])).contains("16 tokens"));
        assert!(refusal(request(&[99])).contains("vocabulary"));
        let mut none = request(&[1]);
        none.max_tokens = 0;
        assert!(refusal(none).contains("max_tokens"));
        let mut penalised = request(&[1]);
        penalised.presence_penalty = 3.0;
        assert!(refusal(penalised).contains("presence_penalty"));
        let mut hot = request(&[1]);
        hot.sampling.temperature = -1.0;
        assert!(refusal(hot).contains("temperature"));
        let mut salted = request(&[1]);
        salted.cache_salt = Some(String::new());
        assert!(refusal(salted).contains("cache_salt"));
        let mut repeated = request(&[1]);
        repeated.repetition_penalty = 0.0;
        assert!(refusal(repeated).contains("repetition_penalty"));
        let mut biased = request(&[1]);
        biased.logit_bias = vec![(3, 100.0), (16, 1.0)];
        assert!(refusal(biased.clone()).contains("logit_bias: token id 16"));
        biased.logit_bias = vec![(3, -100.5)];
        assert!(refusal(biased).contains("logit_bias: the bias of token 3"));
        let mut curious = request(&[1]);
        curious.logprobs = Some(20);
        curious.validate(16, 16).unwrap();
        curious.logprobs = Some(21);
        assert!(refusal(curious.clone()).contains("logprobs: at most 20"));
        curious.logprobs = None;
        curious.prompt_logprobs = Some(21);
        assert!(refusal(curious).contains("prompt_logprobs: at most 20"));
        let mut stopped_everywhere = request(&[1]);
        stopped_everywhere.stop_strings = (0..190_000).map(|i| i.to_string()).collect();
        assert!(refusal(stopped_everywhere).contains("`stop`"));
        let mut stop_token = request(&[1]);
        stop_token.stop.stop_token_ids = vec![3, 16];
        assert!(refusal(stop_token).contains("stop_token_ids: token id 16"));
        let mut long = request(&[1]);
        long.stop.min_tokens = 2;
        assert!(refusal(long.clone()).contains("min_tokens (2) is more than max_tokens (1)"));
        long.max_tokens = 2;
        long.validate(16, 16).unwrap();
        let mut narrow = request(&[1]);
        narrow.allowed_token_ids = vec![2, 16];
        assert!(refusal(narrow).contains("allowed_token_ids: token id 16"));
        let mut banned = request(&[1]);
        banned.bad_words = vec![vec![2], vec![3, 16]];
        assert!(refusal(banned.clone()).contains("bad_words: token id 16"));
        banned.bad_words = vec![vec![]];
        assert!(refusal(banned).contains("bad_words: a word with no tokens"));
    }
}
