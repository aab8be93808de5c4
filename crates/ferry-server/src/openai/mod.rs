//! The OpenAI renderer: chat completions (reasoning in `reasoning_content`, tool calls in `tool_calls`) and text
//! completions over the protocol-neutral layer (chat.rs, generation.rs), each as one JSON object or as server-sent
//! events ending with `data: [DONE]`; logprobs ride with the text of the tokens they are about (sampling.rs renders
//! them). A request for `n` choices runs them as `n` generations of its prompt (of each prompt of a batch of text
//! completions: [`Choices`]), merged into one response by their `index`.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::{json, Map, Value};

use crate::body::Body;
use crate::chat::check_model_name;
use crate::error::ApiError;
use crate::generation::{
    admit, record_refusal, Finish, FinishReason, Generation, Output, Piece, PieceParser, PromptScore, Slot,
};
use crate::params::{checked_request_id, ChatBody, CompletionBody, OpenAiOptions};
use crate::sampling;
use crate::{unix_seconds, AppState, LoadedModel};
use ferry_core::engine::{Request, TokenLogprobs};
use sse::{respond_streamed, RunningUsage};

mod sse;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// How a response of one request is written: the fields every object repeats and what the request asked of it.
struct Renderer {
    endpoint: Endpoint,
    /// The request's id (given, or fresh), the base of `id`.
    request_id: String,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Every chunk carries the usage so far (vLLM's `continuous_usage_stats`).
    continuous_usage: bool,
    /// vLLM's `return_token_ids`: token ids ride with the text.
    return_token_ids: bool,
    /// How logprobs name tokens (vLLM's `return_tokens_as_token_ids`).
    token_names: sampling::TokenNames,
    /// The answer carries the reasoning (vLLM's `include_reasoning`).
    include_reasoning: bool,
    /// The model may reason: a whole chat answer then says `reasoning_content: null` when it did not.
    splits_reasoning: bool,
    /// The model whose tokens logprobs name.
    tokens_of: Arc<LoadedModel>,
    /// The alternatives each token shows when the request asked for logprobs (an echoed prompt's too).
    logprobs_asked: Option<usize>,
    /// vLLM's `prompt_logprobs`: the alternatives each prompt token shows, when asked for.
    prompt_logprobs: Option<usize>,
    /// Per choice, where its next token starts in a text completion's output (its logprobs' `text_offset`).
    text_offsets: Vec<Cell<usize>>,
}

/// New output: reasoning and content joined in order, and tool calls in OpenAI's shape: whole calls in a plain
/// answer, the calls' deltas in a streamed chunk (a call's first delta has its index, id, type and name with
/// arguments "", the next ones pieces of its arguments).
#[derive(Default)]
struct Text {
    reasoning: String,
    content: String,
    tool_calls: Vec<Value>,
}

impl Text {
    /// Adds choice `choice`'s new pieces.
    fn add(&mut self, renderer: &Renderer, choice: usize, pieces: &[Piece], streamed: bool) {
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) if renderer.include_reasoning => self.reasoning += text,
                Piece::Reasoning(_) => {}
                Piece::Content(text) => self.content += text,
                Piece::ToolCallStart { index, name } => {
                    let mut call = json!({
                        "id": renderer.tool_call_id(choice, *index), "type": "function",
                        "function": {"name": name, "arguments": ""},
                    });
                    if streamed {
                        call["index"] = (*index).into();
                    }
                    self.tool_calls.push(call);
                }
                Piece::ToolCallArguments { index, fragment } => {
                    // A plain answer's call takes the piece, as does this chunk's arguments delta of the call
                    // (not its first delta, whose arguments are "").
                    let call = match streamed {
                        true => self
                            .tool_calls
                            .last_mut()
                            .filter(|call| call["index"] == *index && call.get("id").is_none()),
                        false => self.tool_calls.get_mut(*index),
                    };
                    match call.and_then(|call| call.pointer_mut("/function/arguments")) {
                        Some(Value::String(arguments)) => arguments.push_str(fragment),
                        _ => self
                            .tool_calls
                            .push(json!({"index": index, "function": {"arguments": fragment}})),
                    }
                }
            }
        }
    }

    /// One streamed chunk's output of choice `choice`.
    fn of(renderer: &Renderer, choice: usize, pieces: &[Piece]) -> Text {
        let mut text = Text::default();
        text.add(renderer, choice, pieces, true);
        text
    }

    fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// A text completion's prompt as an echoing choice repeats it before its output (`echo`): the prompt as the model
/// read it and, when logprobs were asked for, its tokens, the first without a logprob.
struct Echo {
    text: String,
    tokens: Vec<(u32, Option<TokenLogprobs>)>,
}

fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::EndOfTurn | FinishReason::StopString(_) => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
    }
}

/// The usage of a response whose choices ended so, `per_prompt` a prompt: each prompt once (as its first choice
/// computed it, the others reusing its blocks), the completions of all; a chat answer's with the tokens its
/// choices reasoned in (`completion_tokens_details.reasoning_tokens`, as OpenAI reports them).
fn usage(endpoint: Endpoint, finishes: &[Finish], per_prompt: usize) -> Value {
    let firsts = || finishes.iter().step_by(per_prompt.max(1));
    let prompt: usize = firsts().map(|f| f.prompt_tokens).sum();
    let cached: usize = firsts().map(|f| f.cached_tokens).sum();
    let completion: usize = finishes.iter().map(|f| f.completion_tokens).sum();
    let mut usage = json!({
        "prompt_tokens": prompt,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    if endpoint == Endpoint::Chat {
        let reasoning: usize = finishes.iter().map(|f| f.reasoning_tokens).sum();
        usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
    }
    usage
}

impl Renderer {
    /// The renderer of a response of `choices` choices.
    fn new(
        state: &AppState,
        endpoint: Endpoint,
        (options, choices): (&OpenAiOptions, usize),
        splits_reasoning: bool,
        (model, logprobs): (&Arc<LoadedModel>, Option<usize>),
    ) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Text => "cmpl",
        };
        let request_id = options
            .request_id
            .clone()
            .unwrap_or_else(|| format!("{:016x}", response_id()));
        Renderer {
            endpoint,
            id: format!("{prefix}-{request_id}"),
            request_id,
            created: unix_seconds(),
            model: state.0.config.served_model_name.clone(),
            include_usage: options.include_usage,
            continuous_usage: options.continuous_usage,
            return_token_ids: options.return_token_ids,
            token_names: options.token_names,
            include_reasoning: options.include_reasoning,
            splits_reasoning,
            tokens_of: model.clone(),
            logprobs_asked: logprobs,
            prompt_logprobs: options.prompt_logprobs,
            text_offsets: (0..choices).map(|_| Cell::new(0)).collect(),
        }
    }

    /// The `logprobs` field of choice `choice` holding these tokens (after an echoed prompt's): null unless the
    /// request asked for logprobs.
    fn logprobs(&self, choice: usize, echo: Option<&Echo>, tokens: &[(u32, TokenLogprobs)]) -> Value {
        if self.logprobs_asked.is_none() {
            return Value::Null;
        }
        let model = &self.tokens_of;
        match self.endpoint {
            Endpoint::Chat => sampling::chat_json(model, tokens, self.token_names),
            Endpoint::Text => {
                let text_offset = &self.text_offsets[choice];
                let mut offset = text_offset.get();
                let prompt = echo
                    .into_iter()
                    .flat_map(|e| e.tokens.iter().map(|(id, lp)| (*id, lp.as_ref())));
                let generated = tokens.iter().map(|(id, lp)| (*id, Some(lp)));
                let rendered = sampling::completion_json(model, prompt.chain(generated), &mut offset, self.token_names);
                text_offset.set(offset);
                rendered
            }
        }
    }

    /// vLLM's `prompt_logprobs` of a prompt scored so, when the request asked for them.
    fn prompt_scores(&self, scores: &[PromptScore]) -> Option<Value> {
        let top = self.prompt_logprobs?;
        Some(sampling::prompt_logprobs_json(&self.tokens_of, scores, top))
    }

    /// The id of choice `choice`'s call `index`, unique within the response (whose id it carries) and so within
    /// the process.
    fn tool_call_id(&self, choice: usize, index: usize) -> String {
        let response = self.id.rsplit('-').next().unwrap_or_default();
        format!("call_{response}{choice:02x}{index:02x}")
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.endpoint, streamed) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Text, _) => "text_completion",
        }
    }

    /// Choice `index`'s new output (with the logprobs of its tokens), as a chat delta or message, or a text
    /// fragment (after its echoed prompt, when `echo` holds it).
    fn choice(
        &self,
        index: usize,
        (echo, text): (Option<&Echo>, &Text),
        tokens: &[(u32, TokenLogprobs)],
        finish_reason: Option<&str>,
        streamed: bool,
    ) -> Value {
        let logprobs = self.logprobs(index, echo, tokens);
        match self.endpoint {
            Endpoint::Text => {
                let text = echo.map_or(String::new(), |e| e.text.clone()) + &text.content;
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            Endpoint::Chat => {
                let mut message = Map::new();
                if !streamed {
                    message.insert("role".into(), "assistant".into());
                }
                if !streamed && text.content.is_empty() && !text.tool_calls.is_empty() {
                    // OpenAI's content when the answer is tool calls alone.
                    message.insert("content".into(), Value::Null);
                } else if !streamed || !text.content.is_empty() {
                    message.insert("content".into(), text.content.clone().into());
                }
                if !text.reasoning.is_empty() {
                    message.insert("reasoning_content".into(), text.reasoning.clone().into());
                } else if !streamed && self.splits_reasoning && self.include_reasoning {
                    message.insert("reasoning_content".into(), Value::Null);
                }
                if !text.tool_calls.is_empty() {
                    message.insert("tool_calls".into(), text.tool_calls.clone().into());
                }
                let key = if streamed { "delta" } else { "message" };
                json!({"index": index, key: message, "logprobs": logprobs, "finish_reason": finish_reason})
            }
        }
    }

    /// A choice with its tokens' ids (`token_ids`) and, where given, its prompt's (a text completion's choices
    /// name their prompts'), when the request asked for ids.
    fn with_ids(&self, mut choice: Value, ids: &[u32], prompt_ids: Option<&[u32]>) -> Value {
        if self.return_token_ids {
            choice["token_ids"] = ids.into();
            if let Some(prompt_ids) = prompt_ids {
                choice["prompt_token_ids"] = prompt_ids.into();
            }
        }
        choice
    }

    fn envelope(&self, choices: Vec<Value>, streamed: bool) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("id".into(), self.id.clone().into());
        out.insert("object".into(), self.object(streamed).into());
        out.insert("created".into(), self.created.into());
        out.insert("model".into(), self.model.clone().into());
        out.insert("choices".into(), choices.into());
        out
    }

    /// One streamed chunk holding `choice`, with `running` (the usage so far) when the request asked for it in
    /// every chunk, else a null usage when it asked for a usage chunk.
    fn chunk_body(&self, choice: Value, running: &RunningUsage) -> Map<String, Value> {
        let mut body = self.envelope(vec![choice], true);
        if self.include_usage {
            let usage = match self.continuous_usage {
                true => running.json(),
                false => Value::Null,
            };
            body.insert("usage".into(), usage);
        }
        body
    }

    fn chunk(&self, choice: Value, running: &RunningUsage) -> SseEvent {
        SseEvent::default().data(Value::Object(self.chunk_body(choice, running)).to_string())
    }

    /// The chunks that open a streamed chat answer, one a choice, the first with the prompt's ids when asked.
    fn opening(&self, running: &RunningUsage, prompt_ids: Option<&[u32]>) -> Vec<SseEvent> {
        match self.endpoint {
            Endpoint::Chat => (0..self.text_offsets.len())
                .map(|index| {
                    let opening = json!({
                        "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                        "finish_reason": null,
                    });
                    let mut body = self.chunk_body(opening, running);
                    if let (0, Some(ids)) = (index, prompt_ids) {
                        body.insert("prompt_token_ids".into(), ids.into());
                    }
                    SseEvent::default().data(Value::Object(body).to_string())
                })
                .collect(),
            Endpoint::Text => vec![],
        }
    }
}

/// A response id unique within the process (a counter) and across restarts (the clock), bit-mixed so ids do not
/// look sequential.
pub(crate) fn response_id() -> u64 {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15))
    .wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// One choice's next output, with the logprobs and ids of the tokens it generated since its last one.
struct ChoiceOutput {
    index: usize,
    output: Output,
    logprobs: Vec<(u32, TokenLogprobs)>,
    token_ids: Vec<u32>,
    /// The prompt's tokens' scores, with the choice's first output (when the request asked for them).
    prompt_logprobs: Vec<PromptScore>,
}

/// The choices of one response, `per_prompt` for each of its prompts (choice `p * per_prompt + j` is prompt p's
/// j-th), their outputs in the order they come. With the prefix cache, a prompt's first choice is submitted at
/// once, the others once it has produced its first output: its prompt's blocks are in the cache by then, so they
/// start from them rather than each computing the prompt again; without it, all at once, to be batched together.
/// All are admitted together.
struct Choices {
    outputs: SelectAll<BoxStream<'static, ChoiceOutput>>,
    /// Per prompt, the choices not submitted yet: index, place, request and parser.
    waiting: Vec<Vec<(usize, Slot, Request, PieceParser)>>,
    model: Arc<LoadedModel>,
    per_prompt: usize,
    count: usize,
    /// The prompts' tokens, each counted once.
    prompt_tokens: usize,
    /// Each prompt's token ids.
    prompt_ids: Vec<Vec<u32>>,
    /// Each prompt as the model read it, when the choices echo it (a text completion's `echo`).
    echoes: Option<Vec<String>>,
}

impl Choices {
    /// Admits `per_prompt` generations of each of `prompts` (a 503 when the server has no room for all) and
    /// submits each prompt's first. With a seed, a prompt's choice j samples from seed + j: the response is
    /// reproducible and a prompt's choices differ.
    fn start(
        state: &AppState,
        model: &Arc<LoadedModel>,
        per_prompt: usize,
        prompts: Vec<(Request, PieceParser)>,
        echo: bool,
    ) -> Result<Choices, ApiError> {
        let count = choice_count(state, per_prompt, prompts.len())?;
        let read = |request: &Request| {
            model
                .tokenizer
                .decode(&request.prompt_ids, false)
                .map_err(|e| ApiError::internal(format!("echoing the prompt: {e}")))
        };
        let echoes = match echo {
            true => Some(
                prompts
                    .iter()
                    .map(|(request, _)| read(request))
                    .collect::<Result<_, _>>()?,
            ),
            false => None,
        };
        let prompt_tokens = prompts.iter().map(|(request, _)| request.prompt_ids.len()).sum();
        let prompt_ids = prompts.iter().map(|(request, _)| request.prompt_ids.clone()).collect();
        let mut slots = admit(state, count)?.into_iter();
        let mut outputs = SelectAll::new();
        let mut waiting = Vec::with_capacity(prompts.len());
        for (p, (request, parser)) in prompts.into_iter().enumerate() {
            let mut slot = || slots.next().expect("a slot admitted for every choice");
            let first = slot();
            // A prompt's scores are the same for each of its choices: its first computes them, the others only where
            // an echo shows them with each choice's first chunk.
            let rescored = echo && request.logprobs.is_some();
            let rest = (1..per_prompt)
                .map(|j| {
                    let mut request = request.clone();
                    request.sampling.seed = request.sampling.seed.map(|seed| seed.wrapping_add(j as u64));
                    if !rescored {
                        request.prompt_logprobs = None;
                    }
                    (p * per_prompt + j, slot(), request, parser.clone())
                })
                .collect();
            outputs.push(outputs_of(
                p * per_prompt,
                Generation::submit(first, model, request, parser),
            ));
            waiting.push(rest);
        }
        let mut choices = Choices {
            outputs,
            waiting,
            model: model.clone(),
            per_prompt,
            count,
            prompt_tokens,
            prompt_ids,
            echoes,
        };
        if !model.prefix_cache {
            for group in 0..choices.waiting.len() {
                choices.submit_waiting(group);
            }
        }
        Ok(choices)
    }

    /// A text completion's choice `index` names its prompt's ids (chat responses name theirs once, at the top).
    fn text_prompt_ids(&self, renderer: &Renderer, index: usize) -> Option<&[u32]> {
        match renderer.endpoint {
            Endpoint::Text => self.prompt_ids.get(index / self.per_prompt).map(Vec::as_slice),
            Endpoint::Chat => None,
        }
    }

    /// Choice `index`'s echoed prompt (None unless the choices echo theirs), with its tokens when the request asked
    /// for `logprobs` alternatives: the first without a logprob, the others as `scored` (the prompt scores the
    /// choice heard) has them.
    fn echo(&self, index: usize, scored: &[PromptScore], logprobs: Option<usize>) -> Option<Echo> {
        let prompt = index / self.per_prompt;
        let text = self.echoes.as_ref()?.get(prompt)?.clone();
        let tokens = match (logprobs, self.prompt_ids[prompt].first()) {
            (Some(top), Some(&first)) => {
                let score = |s: &PromptScore| {
                    let mut logprobs = s.logprobs.clone();
                    logprobs.top.truncate(top);
                    (s.id, Some(logprobs))
                };
                std::iter::once((first, None)).chain(scored.iter().map(score)).collect()
            }
            _ => vec![],
        };
        Some(Echo { text, tokens })
    }

    /// Submits prompt `group`'s choices not submitted yet.
    fn submit_waiting(&mut self, group: usize) {
        for (index, slot, request, parser) in self.waiting[group].drain(..) {
            let generation = Generation::submit(slot, &self.model, request, parser);
            self.outputs.push(outputs_of(index, generation));
        }
    }

    /// The next output of any choice; None once every choice ended.
    async fn next(&mut self) -> Option<ChoiceOutput> {
        let next = self.outputs.next().await;
        if let Some(next) = &next {
            if !matches!(next.output, Output::Failed(_)) {
                self.submit_waiting(next.index / self.per_prompt);
            }
        }
        next
    }
}

/// How many choices `prompts` prompts of `per_prompt` choices each make: a 400 naming `n` past what the server runs
/// or queues at once.
fn choice_count(state: &AppState, per_prompt: usize, prompts: usize) -> Result<usize, ApiError> {
    let limit = state.0.config.max_in_flight;
    match per_prompt.checked_mul(prompts) {
        Some(count) if count <= limit => Ok(count),
        _ => Err(ApiError::invalid_param(
            "n",
            format!(
                "{prompts} prompts of {per_prompt} choices each are more than the {limit} requests this server runs \
                 or queues at once"
            ),
        )),
    }
}

/// Generation `index`'s outputs, each with the logprobs of its new tokens.
fn outputs_of(index: usize, generation: Generation) -> BoxStream<'static, ChoiceOutput> {
    stream::unfold(generation, move |mut generation| async move {
        let output = generation.next().await?;
        let next = ChoiceOutput {
            index,
            output,
            logprobs: generation.take_logprobs(),
            token_ids: generation.take_token_ids(),
            prompt_logprobs: generation.take_prompt_logprobs(),
        };
        Some((next, generation))
    })
    .boxed()
}

/// Waits for every choice and answers with one JSON object.
async fn respond_whole(renderer: Renderer, mut choices: Choices) -> Response {
    let count = choices.count;
    let mut texts: Vec<Text> = (0..count).map(|_| Text::default()).collect();
    let mut tokens: Vec<Vec<(u32, TokenLogprobs)>> = vec![vec![]; count];
    let mut ids: Vec<Vec<u32>> = vec![vec![]; count];
    let mut prompts_scored: Vec<Vec<PromptScore>> = vec![vec![]; count];
    let mut finishes: Vec<Option<Finish>> = vec![None; count];
    while let Some(ChoiceOutput {
        index,
        output,
        logprobs,
        token_ids,
        prompt_logprobs,
    }) = choices.next().await
    {
        tokens[index].extend(logprobs);
        prompts_scored[index].extend(prompt_logprobs);
        ids[index].extend(token_ids);
        match output {
            Output::Pieces(pieces) => texts[index].add(&renderer, index, &pieces, false),
            Output::Finished(pieces, finish) => {
                texts[index].add(&renderer, index, &pieces, false);
                finishes[index] = Some(finish);
            }
            Output::Failed(error) => return error.into_response(),
        }
    }
    let Some(finishes) = finishes.into_iter().collect::<Option<Vec<Finish>>>() else {
        return ApiError::internal("generation failed: a choice ended without finishing").into_response();
    };
    let rendered = (0..count)
        .map(|i| {
            let echo = choices.echo(i, &prompts_scored[i], renderer.logprobs_asked);
            let mut choice = renderer.choice(
                i,
                (echo.as_ref(), &texts[i]),
                &tokens[i],
                Some(finish_reason(&finishes[i].reason)),
                false,
            );
            let first_of_prompt = i / choices.per_prompt * choices.per_prompt;
            let scored = &prompts_scored[first_of_prompt];
            if let (Endpoint::Text, Some(scores)) = (renderer.endpoint, renderer.prompt_scores(scored)) {
                choice["prompt_logprobs"] = scores;
            }
            renderer.with_ids(choice, &ids[i], choices.text_prompt_ids(&renderer, i))
        })
        .collect();
    let mut body = renderer.envelope(rendered, false);
    if let (true, Endpoint::Chat, [prompt]) = (renderer.return_token_ids, renderer.endpoint, &choices.prompt_ids[..]) {
        body.insert("prompt_token_ids".into(), prompt.as_slice().into());
    }
    // A chat answer's one prompt, scored by its first choice.
    if let (Endpoint::Chat, Some(scores)) = (renderer.endpoint, renderer.prompt_scores(&prompts_scored[0])) {
        body.insert("prompt_logprobs".into(), scores);
    }
    body.insert("usage".into(), usage(renderer.endpoint, &finishes, choices.per_prompt));
    Json(Value::Object(body)).into_response()
}

/// A request read, admitted and submitted: how to render it, its choices, and whether to stream it.
type Started = (Renderer, Choices, bool);

async fn respond(state: AppState, started: Result<Started, ApiError>) -> Response {
    let (renderer, choices, stream) = match started {
        Ok(started) => started,
        Err(error) => {
            record_refusal(&state, &error);
            return error.into_response();
        }
    };
    // Checked printable ASCII (params.rs), so always a header value.
    let request_id = HeaderValue::from_str(&renderer.request_id).ok();
    let mut response = match stream {
        true => respond_streamed(renderer, choices),
        false => respond_whole(renderer, choices).await,
    };
    if let Some(id) = request_id {
        response.headers_mut().insert(REQUEST_ID_HEADER, id);
    }
    response
}

/// The header that names a request (vLLM's; it wins over the body's `request_id`) and that the answer carries back.
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// The OpenAI options of a body, with the `X-Request-Id` header's id, if sent, as the request's.
fn with_header_id(mut options: OpenAiOptions, headers: &HeaderMap) -> Result<OpenAiOptions, ApiError> {
    if let Some(value) = headers.get(REQUEST_ID_HEADER) {
        let id = String::from_utf8_lossy(value.as_bytes()).into_owned();
        options.request_id = Some(checked_request_id("X-Request-Id", id)?);
    }
    Ok(options)
}

fn start_chat(state: &AppState, body: &[u8], headers: &HeaderMap) -> Result<Started, ApiError> {
    let ChatBody { chat, options } = ChatBody::parse(&Body::parse(body)?)?;
    let options = with_header_id(options, headers)?;
    check_model_name(state, options.model.as_deref())?;
    let model = state.model()?;
    let (request, parser) = chat
        .prepare(&model)
        .and_then(|prompt| prompt.start(state, &model, &chat.params, "messages"))
        .map_err(|e| options.as_sent(e))?;
    let splits_reasoning = parser.splits_reasoning();
    let choices = Choices::start(state, &model, options.choices, vec![(request, parser)], false)?;
    let renderer = Renderer::new(
        state,
        Endpoint::Chat,
        (&options, choices.count),
        splits_reasoning,
        (&model, chat.params.logprobs),
    );
    Ok((renderer, choices, chat.params.stream))
}

fn start_text(state: &AppState, body: &[u8], headers: &HeaderMap) -> Result<Started, ApiError> {
    let CompletionBody {
        prompts,
        params,
        echo,
        options,
    } = CompletionBody::parse(&Body::parse(body)?)?;
    let options = with_header_id(options, headers)?;
    check_model_name(state, options.model.as_deref())?;
    // Before any prompt is tokenized.
    choice_count(state, options.choices, prompts.len())?;
    let model = state.model()?;
    let prompts = prompts
        .into_iter()
        .map(|prompt| prompt.prepare(&model)?.start(state, &model, &params, "prompt"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| options.as_sent(e))?;
    let choices = Choices::start(state, &model, options.choices, prompts, echo)?;
    let renderer = Renderer::new(
        state,
        Endpoint::Text,
        (&options, choices.count),
        false,
        (&model, params.logprobs),
    );
    Ok((renderer, choices, params.stream))
}

pub async fn chat_completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let started = crate::prompt_work::off_runtime(&state, move |state| start_chat(state, &body, &headers)).await;
    respond(state, started).await
}

pub async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let started = crate::prompt_work::off_runtime(&state, move |state| start_text(state, &body, &headers)).await;
    respond(state, started).await
}
