//! The protocol-neutral request: what a chat or text generation asks for, whichever API it came through (OpenAI's
//! chat and text completions, Anthropic's messages), and how it becomes an engine request: the chat template
//! rendered, the prompt tokenized and checked against the context window, the sampling defaults filled in, the
//! output constrained (a `response_format`, or forced tool calls) and the thinking bounded (a thinking budget).
//!
//! A thinking budget on a model that does not reason (no `<think>` tokens its template uses) bounds nothing: the
//! model writes no thinking, which is within any budget, so the request is served as it is (documented in README).
//!
//! Not here: reading a protocol's JSON (params.rs, anthropic/), admission and output (generation.rs).

use ferry_core::engine::{Request, ResponseFormat, SamplingParams, StopRules, ThinkingBudget};
use ferry_core::loader::{ChatEnding, ChatMessage, ChatPrompt};
use serde_json::{Map, Value};

use crate::body::Body;
use crate::error::ApiError;
use crate::generation::PieceParser;
use crate::reasoning::ReasoningParser;
use crate::tools::forced::{self, Thinking};
use crate::tools::harmony::HarmonyParser;
use crate::tools::history::HistoryFormat;
use crate::tools::{ToolCallFormat, ToolRequest};
use crate::{sampling, AppState, LoadedModel};

/// What every generation asks of the engine, in either protocol.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationParams {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// (token id, bias) added to the logits.
    pub logit_bias: Vec<(u32, f32)>,
    /// Each token's logprob and this many alternatives; None: no logprobs.
    pub logprobs: Option<usize>,
    /// Each prompt token's logprob (after the first) and this many alternatives (a text completion's `echo` with
    /// `logprobs`); None: none.
    pub prompt_logprobs: Option<usize>,
    /// Constrained decoding; compiled for the served model where the request is started.
    pub response_format: Option<ResponseFormat>,
    /// Generate past end-of-sequence tokens (vLLM's extension; benchmarks use it to fix the output length).
    pub ignore_eos: bool,
    /// More tokens that end the output (vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Only these tokens may be generated (vLLM's `allowed_token_ids`); empty: any.
    pub allowed_token_ids: Vec<u32>,
    /// Words never generated (vLLM's `bad_words`), tokenized where the request is made ([`bad_word_sequences`]).
    pub bad_words: Vec<String>,
    /// Only the prompt's last this many tokens are read (vLLM's `truncate_prompt_tokens`).
    pub truncate_prompt_tokens: Option<usize>,
    /// No end before this many tokens (vLLM's `min_tokens`; see [`StopRules::min_tokens`]).
    pub min_tokens: usize,
    /// The stop string that ends the output stays in it (vLLM's `include_stop_str_in_output`).
    pub include_stop_string: bool,
    /// Special tokens write their text (vLLM's `skip_special_tokens: false`).
    pub keep_special_tokens: bool,
    /// Prefix-cache blocks are shared only with requests of this salt (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
    /// vLLM's `priority`: under priority scheduling, lower is served first.
    pub priority: i64,
    /// Answer as a stream of events rather than one object.
    pub stream: bool,
}

/// A conversation to continue.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Variables for the chat template beyond the messages (OpenAI's `chat_template_kwargs`).
    pub template_kwargs: Map<String, Value>,
    /// The template's thinking switch (`enable_thinking`), when the protocol sets it; it wins over the kwargs.
    pub thinking: Option<bool>,
    /// Most tokens of thinking before the end of thinking is forced (Anthropic's `budget_tokens`).
    pub thinking_budget: Option<usize>,
    /// How hard the model reasons, for templates that take it (gpt-oss's); it wins over the kwargs.
    pub reasoning_effort: Option<ReasoningEffort>,
    /// The tools offered, what the model may do with them, and so how its output is parsed for calls.
    pub tools: ToolRequest,
    pub params: GenerationParams,
    /// Whether the model answers in a new turn (the default) or continues the last message, an assistant's.
    pub ending: ChatEnding,
}

/// A reasoning effort, and what a template that takes none makes of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasoningEffort {
    /// `low`, `medium` or `high`: the efforts gpt-oss's template knows.
    pub level: String,
    /// Whether a template that takes no effort refuses the request (OpenAI's `reasoning_effort`, asked of this
    /// model) or renders without it (Anthropic's `output_config.effort`, which clients such as Claude Code send
    /// to every model).
    pub required: bool,
}

impl ReasoningEffort {
    /// An effort the template must take.
    pub fn required(level: String) -> Self {
        ReasoningEffort { level, required: true }
    }
}

const REASONING_EFFORT: &str = "reasoning_effort";

/// `reasoning_effort`: `low`, `medium` or `high`, the efforts gpt-oss's template knows.
pub fn reasoning_effort(body: &Body) -> Result<Option<ReasoningEffort>, ApiError> {
    let effort = body.string(REASONING_EFFORT)?;
    match effort.as_deref() {
        None | Some("low" | "medium" | "high") => Ok(effort.map(ReasoningEffort::required)),
        Some(other) => Err(ApiError::invalid_param(
            REASONING_EFFORT,
            format!("`reasoning_effort` is \"{other}\"; expected \"low\", \"medium\" or \"high\""),
        )),
    }
}

/// What a text completion starts from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
}

/// A prompt ready for the engine, with the output parsing its rendering calls for.
pub struct PreparedPrompt {
    pub ids: Vec<u32>,
    pub parser: PieceParser,
    /// The grammar of the forced tool calls (llguidance's Lark), when `tool_choice` forces calls.
    pub tool_grammar: Option<String>,
    pub thinking_budget: Option<ThinkingBudget>,
    /// Where the output starts with respect to the model's thinking: a structured output comes after it.
    pub thinking: Thinking,
}

/// A 404 when the request names a model other than the one served (a request naming none gets it).
pub fn check_model_name(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    let served = &state.0.config.served_model_name;
    match requested {
        Some(name) if name != served => Err(ApiError::model_not_found(name, served)),
        _ => Ok(()),
    }
}

impl ChatRequest {
    /// The chat template's output for this conversation and its token ids, ending as `ending` says. Prompt text
    /// that cannot fit the context is refused by its bytes before anything is rendered; special-token text inside
    /// contents is tokenized as the operator chose. A message to continue must be the assistant's last, without tool
    /// calls.
    pub fn encode(&self, model: &LoadedModel, ending: ChatEnding) -> Result<ChatPrompt, ApiError> {
        if ending == ChatEnding::ContinueLastMessage {
            match self.messages.last() {
                Some(last) if last.role == "assistant" && last.tool_calls.is_empty() => {}
                _ => {
                    return Err(ApiError::invalid_param(
                        "messages",
                        "only a last message from the assistant, without tool calls, can be continued",
                    ))
                }
            }
            if model.tool_call_format == Some(ToolCallFormat::Harmony) {
                return Err(ApiError::invalid_param(
                    "messages",
                    "this model writes in Harmony's channels, whose messages cannot be continued",
                ));
            }
        }
        let content_bytes = self.messages.iter().map(|m| m.content.len()).sum();
        crate::prompt_work::check_prompt_bytes(model, content_bytes, "messages")?;
        let tokenizer = &model.tokenizer;
        if !tokenizer.has_chat_template() {
            return Err(ApiError::invalid(
                "this model has no chat template; use /v1/completions",
            ));
        }
        let tools = self.tools.template_tools();
        // A template without a tool section would drop the tools without a word.
        if !tools.is_empty() && !tokenizer.chat_template_mentions("tools") {
            return Err(ApiError::invalid_param(
                "tools",
                "this model's chat template does not render tools",
            ));
        }
        let mut kwargs = self.template_kwargs.clone();
        if let Some(thinking) = self.thinking {
            kwargs.insert("enable_thinking".into(), thinking.into());
        }
        if let Some(effort) = &self.reasoning_effort {
            if tokenizer.chat_template_mentions(REASONING_EFFORT) {
                kwargs.insert(REASONING_EFFORT.into(), effort.level.clone().into());
            } else if effort.required {
                return Err(ApiError::invalid_param(
                    REASONING_EFFORT,
                    "this model's chat template takes no reasoning effort",
                ));
            }
        }
        let messages = HistoryFormat::of(model).adapt(&self.messages)?;
        tokenizer
            .encode_chat(&messages, &tools, ending, &kwargs, model.special_tokens_in_content)
            .map_err(|e| match e {
                ferry_core::Error::ChatTemplate(_) => ApiError::invalid_param("messages", e.to_string()),
                _ => ApiError::internal(e.to_string()),
            })
    }

    /// Rendered with the generation prompt and tokenized.
    pub fn prepare(&self, model: &LoadedModel) -> Result<PreparedPrompt, ApiError> {
        let ChatPrompt { text, ids } = self.encode(model, self.ending)?;
        let reasoning = model.splits_reasoning().then(|| ReasoningParser::new(&text));
        let starts_inside = reasoning.as_ref().is_some_and(ReasoningParser::in_reasoning);
        let switched_off = self.thinking == Some(false)
            || (self.thinking.is_none() && self.template_kwargs.get("enable_thinking") == Some(&Value::Bool(false)));
        let thinking = match (reasoning.is_some(), starts_inside, switched_off) {
            (false, _, _) => Thinking::Off,
            (true, true, _) => Thinking::Inside,
            (true, false, true) => Thinking::Off,
            (true, false, false) => Thinking::Optional {
                open: model.tokenizer.token_id("<think>"),
            },
        };
        let tool_grammar = match (self.tools.choice.forces_calls(), model.tool_call_format) {
            (false, _) => None,
            (true, Some(format)) => Some(forced::grammar(&self.tools, format, thinking)),
            (true, None) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "this model's chat template names no tool call format to force (see --tool-call-parser)",
                ))
            }
        };
        let tokenizer = &model.tokenizer;
        let thinking_budget = match (
            self.thinking_budget,
            tokenizer.token_id("<think>"),
            tokenizer.token_id("</think>"),
        ) {
            (Some(max_tokens), Some(start_id), Some(end_id)) if reasoning.is_some() => Some(ThinkingBudget {
                max_tokens,
                start_id,
                end_id,
                starts_inside,
            }),
            _ => None,
        };
        // Under a grammar, thinking can only come first: a `<think>` inside a forced call or a structured output
        // is its text.
        let reasoning = match tool_grammar.is_some() || self.params.response_format.is_some() {
            true => reasoning.map(|parser| parser.leading_only(matches!(thinking, Thinking::Optional { .. }))),
            false => reasoning,
        };
        let calls = self.tools.parser(model.tool_call_format);
        let parser = match model.tool_call_format {
            // Harmony's channels carry the reasoning and the answer too, calls offered or not.
            Some(ToolCallFormat::Harmony) => {
                PieceParser::harmony(HarmonyParser::new(|token| model.tokenizer.token_id(token), calls))
            }
            _ => PieceParser::new(reasoning, calls),
        };
        Ok(PreparedPrompt {
            ids,
            parser,
            tool_grammar,
            thinking_budget,
            thinking,
        })
    }
}

impl PreparedPrompt {
    /// The engine request for this prompt under `params`, and the parser of its output: its output constrained by
    /// `response_format` or the forced tool calls' grammar (not both), its thinking bounded. Errors name
    /// `prompt_field` for a prompt that leaves no room in the context window.
    pub fn start(
        self,
        state: &AppState,
        model: &LoadedModel,
        params: &GenerationParams,
        prompt_field: &str,
    ) -> Result<(Request, PieceParser), ApiError> {
        let mut request = engine_request(model, params, self.ids, prompt_field)?;
        let compiler = &state.0.grammar;
        request.constraint = match (&params.response_format, self.tool_grammar) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "a forced `tool_choice` and `response_format` cannot both constrain the output",
                ))
            }
            (Some(format), None) => Some(sampling::constraint(
                compiler,
                model,
                &forced::after_thinking(format, self.thinking),
                "response_format",
            )?),
            (None, Some(grammar)) => Some(sampling::constraint(
                compiler,
                model,
                &ResponseFormat::Lark(grammar),
                "tools",
            )?),
            (None, None) => None,
        };
        // A grammar may allow nothing but the end that min_tokens holds back, none of the allowed tokens, or only
        // banned words.
        for (field, narrows) in [
            ("min_tokens", params.min_tokens > 0),
            ("allowed_token_ids", !params.allowed_token_ids.is_empty()),
            ("bad_words", !params.bad_words.is_empty()),
        ] {
            if narrows && request.constraint.is_some() {
                return Err(ApiError::invalid_param(
                    field,
                    format!("`{field}` cannot be combined with `response_format` or a forced `tool_choice`"),
                ));
            }
        }
        request.thinking_budget = self.thinking_budget;
        Ok((request, self.parser))
    }
}

impl Prompt {
    pub fn prepare(self, model: &LoadedModel) -> Result<PreparedPrompt, ApiError> {
        let ids = match self {
            Prompt::TokenIds(ids) => ids,
            Prompt::Text(text) => {
                crate::prompt_work::check_prompt_bytes(model, text.len(), "prompt")?;
                tokenize(model, &text, true)?
            }
        };
        Ok(PreparedPrompt {
            ids,
            parser: PieceParser::new(None, None),
            tool_grammar: None,
            thinking_budget: None,
            // A completion's text is the model's own: a structured output constrains it from its first token.
            thinking: Thinking::Off,
        })
    }
}

/// `text`'s token ids; the tokenizer failing on valid UTF-8 is the server's fault, not the caller's.
pub fn tokenize(model: &LoadedModel, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
    model
        .tokenizer
        .encode(text, add_special_tokens)
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// vLLM's `bad_words` as the token sequences the engine bans: each word as it reads at the start of a text and
/// after a space (mid-text, where most tokenizers fold the space into the word's first token), each distinct
/// tokenization once.
fn bad_word_sequences(model: &LoadedModel, words: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    for word in words {
        for text in [word.clone(), format!(" {word}")] {
            let ids = tokenize(model, &text, false)?;
            if !ids.is_empty() && !sequences.contains(&ids) {
                sequences.push(ids);
            }
        }
    }
    Ok(sequences)
}

/// The engine request for `prompt_ids`, refusing a prompt that leaves no room in the context window (the error
/// names `prompt_field`, where the prompt came from).
fn engine_request(
    model: &LoadedModel,
    params: &GenerationParams,
    mut prompt_ids: Vec<u32>,
    prompt_field: &str,
) -> Result<Request, ApiError> {
    if let Some(keep) = params.truncate_prompt_tokens {
        prompt_ids.drain(..prompt_ids.len().saturating_sub(keep));
    }
    let window = model.max_model_len;
    if prompt_ids.len() >= window {
        return Err(ApiError::invalid_param(
            prompt_field,
            format!(
                "this model's maximum context length is {window} tokens, but the prompt has {} tokens \
                 (and at least one token must be generated)",
                prompt_ids.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let in_vocabulary =
        |field: &str, mut ids: std::slice::Iter<'_, u32>| match ids.find(|&&id| id as usize >= model.vocab_size) {
            Some(id) => Err(ApiError::invalid_param(
                field,
                format!(
                    "`{field}`: token id {id} is outside the vocabulary (size {})",
                    model.vocab_size
                ),
            )),
            None => Ok(()),
        };
    let biased: Vec<u32> = params.logit_bias.iter().map(|&(id, _)| id).collect();
    in_vocabulary("logit_bias", biased.iter())?;
    in_vocabulary("stop_token_ids", params.stop_token_ids.iter())?;
    in_vocabulary("allowed_token_ids", params.allowed_token_ids.iter())?;
    if params.priority != 0 && !model.priority_scheduling {
        return Err(ApiError::invalid_param(
            "priority",
            "`priority` is served only under priority scheduling (`ferry serve --scheduling-policy priority`)",
        ));
    }
    if params.keep_special_tokens && model.tool_call_format == Some(ToolCallFormat::Harmony) {
        // Harmony's parser puts the markers (special tokens) back itself.
        return Err(ApiError::invalid_param(
            "skip_special_tokens",
            "this model writes in Harmony's channels, whose special tokens are read, not written out",
        ));
    }
    let room = window - prompt_ids.len();
    let defaults = model.defaults;
    let request = Request {
        max_tokens: params.max_tokens.unwrap_or(room).min(room),
        sampling: SamplingParams {
            temperature: params.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_p: params.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k: params.top_k.or(defaults.top_k),
            min_p: params.min_p.unwrap_or(0.0),
            seed: params.seed,
        },
        presence_penalty: params.presence_penalty,
        frequency_penalty: params.frequency_penalty,
        repetition_penalty: params.repetition_penalty.unwrap_or(1.0),
        logit_bias: params.logit_bias.clone(),
        allowed_token_ids: params.allowed_token_ids.clone(),
        bad_words: bad_word_sequences(model, &params.bad_words)?,
        logprobs: params.logprobs,
        prompt_logprobs: params.prompt_logprobs,
        constraint: None,
        stop_strings: params.stop.clone(),
        stop: StopRules {
            eos_token_ids: model.eos_token_ids.clone(),
            ignore_eos: params.ignore_eos,
            stop_token_ids: params.stop_token_ids.clone(),
            min_tokens: params.min_tokens,
            include_stop_string: params.include_stop_string,
        },
        skip_special_tokens: !params.keep_special_tokens,
        cache_salt: params.cache_salt.clone(),
        priority: params.priority,
        thinking_budget: None,
        prompt_ids,
    };
    request
        .validate(window, model.vocab_size)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(request)
}
