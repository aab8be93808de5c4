//! A generation's life after its request was read, whichever protocol renders it: admission (a 503 past the
//! in-flight limit), submission to the engine, and the output as protocol-neutral [`Output`]s: the engine's text
//! turned into [`Piece`]s (reasoning split out, then tool calls parsed out of the rest), then how it finished and
//! what it used. Dropping a [`Generation`]
//! before it finished (the client went away) cancels it in the engine, which frees its KV at once.
//!
//! Not here: reading requests (chat.rs, params.rs, anthropic/), JSON and event shapes (openai/, anthropic/).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ferry_core::engine::{self, Event, Request, RequestId, TokenLogprobs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::ApiError;
use crate::reasoning::{ReasoningParser, Split};
use crate::tools::harmony::HarmonyParser;
use crate::tools::{ToolCallParser, ToolEvent};
use crate::{AppState, LoadedModel};

/// A part of the output, in the order generated. Consecutive pieces of one kind continue each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text inside the model's `<think>` reasoning.
    Reasoning(String),
    /// The answer's text.
    Content(String),
    /// A tool call begins: its index among the answer's calls and the function's name.
    ToolCallStart { index: usize, name: String },
    /// The next piece of a call's arguments (a JSON object's text once joined).
    ToolCallArguments { index: usize, fragment: String },
}

/// Why a generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn (an end-of-sequence token).
    EndOfTurn,
    /// One of the request's stop strings was generated (it is not part of the output).
    StopString(String),
    /// `max_tokens` or the context window was reached.
    Length,
    /// The model ended its turn after calling tools.
    ToolCalls,
}

/// The end of a generation that succeeded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    /// Of the prompt tokens, those whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Of the completion tokens, those the model reasoned in ([`PieceParser::reasoning_tokens`]).
    pub reasoning_tokens: usize,
}

/// What a generation produces next.
#[derive(Debug)]
pub enum Output {
    /// New output (none while the engine holds text back: an incomplete character, a possible stop string or tag).
    Pieces(Vec<Piece>),
    /// The last pieces, then how it ended; nothing follows.
    Finished(Vec<Piece>, Finish),
    /// The engine failed the request; nothing follows.
    Failed(ApiError),
}

/// Turns the engine's text into pieces: reasoning split from content, then tool calls out of the content, so that
/// a call written while reasoning stays reasoning; or, for Harmony's channels, all three by one parser.
#[derive(Clone)]
pub struct PieceParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
    harmony: Option<HarmonyParser>,
    reasoning_tokens: usize,
}

impl PieceParser {
    /// `reasoning` splits `<think>` reasoning out, for models that reason; `tools` parses tool calls, for requests
    /// that offer tools.
    pub fn new(reasoning: Option<ReasoningParser>, tools: Option<ToolCallParser>) -> Self {
        PieceParser {
            reasoning,
            tools,
            harmony: None,
            reasoning_tokens: 0,
        }
    }

    /// Output in Harmony's channels.
    pub fn harmony(parser: HarmonyParser) -> Self {
        PieceParser {
            reasoning: None,
            tools: None,
            harmony: Some(parser),
            reasoning_tokens: 0,
        }
    }

    /// Tool calls in the output so far.
    fn tool_calls(&self) -> usize {
        match &self.harmony {
            Some(harmony) => harmony.calls(),
            None => self.tools.as_ref().map_or(0, ToolCallParser::calls),
        }
    }

    /// Whether the output may hold reasoning.
    pub fn splits_reasoning(&self) -> bool {
        self.reasoning.is_some() || self.harmony.is_some()
    }

    /// Whether the output is in the model's reasoning.
    fn in_reasoning(&self) -> bool {
        match &self.harmony {
            Some(harmony) => harmony.in_reasoning(),
            None => self.reasoning.as_ref().is_some_and(ReasoningParser::in_reasoning),
        }
    }

    /// Tokens so far that the model reasoned in: those that gave reasoning, or gave nothing while the output was in
    /// its reasoning (text held back, the tag that ends the reasoning).
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Token `id`'s text: the markup a Harmony model writes in special tokens is given back (the engine's text
    /// leaves special tokens out).
    fn push_token(&mut self, id: u32, text: &str) -> Vec<Piece> {
        let was_reasoning = self.in_reasoning();
        let marker = self.harmony.as_ref().and_then(|h| h.marker(id));
        let pieces = self.push(marker.unwrap_or(text));
        if pieces.iter().any(|p| matches!(p, Piece::Reasoning(_))) || (pieces.is_empty() && was_reasoning) {
            self.reasoning_tokens += 1;
        }
        pieces
    }

    fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.push(text);
        }
        let pieces = match &mut self.reasoning {
            Some(parser) => {
                let split = parser.push(text);
                pieces(split, parser.in_reasoning())
            }
            None if text.is_empty() => vec![],
            None => vec![Piece::Content(text.to_string())],
        };
        self.parse_tool_calls(pieces, false)
    }

    /// Whatever was held back, at the end.
    fn finish(&mut self) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.finish();
        }
        let pieces = self
            .reasoning
            .as_mut()
            .map_or_else(Vec::new, |parser| pieces(parser.finish(), parser.in_reasoning()));
        self.parse_tool_calls(pieces, true)
    }

    /// Content pieces through the tool call parser (`last`: the end of the output, which closes an open call).
    fn parse_tool_calls(&mut self, pieces: Vec<Piece>, last: bool) -> Vec<Piece> {
        let Some(tools) = &mut self.tools else {
            return pieces;
        };
        let mut out = vec![];
        for piece in pieces {
            match piece {
                Piece::Content(text) => out.extend(tools.push(&text).into_iter().map(Piece::from)),
                other => out.push(other),
            }
        }
        if last {
            out.extend(tools.finish().into_iter().map(Piece::from));
        }
        out
    }
}

impl From<ToolEvent> for Piece {
    fn from(event: ToolEvent) -> Self {
        match event {
            ToolEvent::Content(text) => Piece::Content(text),
            ToolEvent::Start { index, name } => Piece::ToolCallStart { index, name },
            ToolEvent::Arguments { index, fragment } => Piece::ToolCallArguments { index, fragment },
        }
    }
}

/// A split's parts as pieces in the order generated: the one the parser ended in came last.
fn pieces(split: Split, ends_in_reasoning: bool) -> Vec<Piece> {
    let reasoning = (!split.reasoning.is_empty()).then_some(Piece::Reasoning(split.reasoning));
    let content = (!split.content.is_empty()).then_some(Piece::Content(split.content));
    match ends_in_reasoning {
        true => content.into_iter().chain(reasoning).collect(),
        false => reasoning.into_iter().chain(content).collect(),
    }
}

/// A place among the requests the server runs or queues at once ([`admit`]), given back when dropped.
pub struct Slot {
    state: AppState,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Admits `n` requests at once (the choices of one response), or none: a 503 when fewer than `n` places are free.
pub fn admit(state: &AppState, n: usize) -> Result<Vec<Slot>, ApiError> {
    let limit = state.0.config.max_in_flight;
    if state.0.in_flight.fetch_add(n, Ordering::AcqRel) + n > limit {
        state.0.in_flight.fetch_sub(n, Ordering::AcqRel);
        return Err(ApiError::unavailable(
            format!("the server is busy: {limit} requests are running or queued; retry later"),
            QUEUE_FULL,
        ));
    }
    Ok((0..n).map(|_| Slot { state: state.clone() }).collect())
}

/// A request admitted to the engine, until its last event. Dropping it before the engine finished cancels it
/// (and then gives its place back).
struct InFlight {
    slot: Slot,
    model: Arc<LoadedModel>,
    id: RequestId,
    prompt_tokens: usize,
    completion_tokens: usize,
    done: bool,
    submitted: Instant,
    last_token: Option<Instant>,
}

impl InFlight {
    /// Records latency metrics for one generated token.
    fn on_token(&mut self) {
        let now = Instant::now();
        let metrics = &self.slot.state.0.metrics;
        match self.last_token {
            None => metrics.time_to_first_token((now - self.submitted).as_secs_f64()),
            Some(previous) => metrics.inter_token_latency((now - previous).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.completion_tokens += 1;
    }

    fn finish(&mut self, outcome: &'static str) {
        self.done = true;
        self.slot
            .state
            .0
            .metrics
            .request_done(outcome, self.prompt_tokens, self.completion_tokens);
        crate::access::record_generation(outcome, self.prompt_tokens, self.completion_tokens);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.done {
            self.model.engine.cancel(self.id);
            self.finish("cancelled");
        }
    }
}

/// The error code of a request refused because the server is full.
const QUEUE_FULL: &str = "queue_full";

/// Counts a request refused before it reached the engine, by the kind of refusal.
pub fn record_refusal(state: &AppState, error: &ApiError) {
    let outcome = match (error.code, error.status.is_client_error()) {
        (Some(QUEUE_FULL), _) => "rejected",
        (_, true) => "invalid",
        (_, false) => "unavailable",
    };
    state.0.metrics.request_done(outcome, 0, 0);
}

/// One admitted request's output.
pub struct Generation {
    in_flight: InFlight,
    events: UnboundedReceiver<Event>,
    parser: PieceParser,
    /// The request's stop strings, which the engine names by index when one ends the output.
    stop_strings: Vec<String>,
    ended: bool,
    /// Logprobs of the tokens generated since a renderer last took them (when the request asked for them).
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// The tokens generated since a renderer last took them.
    token_ids: Vec<u32>,
    /// Scores of the prompt's tokens after its first, until a renderer takes them (when the request asked).
    prompt_logprobs: Vec<PromptScore>,
}

/// A prompt token's score as the engine sent it (`Request::prompt_logprobs`): its logprob and alternatives, and its
/// rank among the vocabulary (1: the most likely).
#[derive(Clone, Debug)]
pub struct PromptScore {
    pub id: u32,
    pub logprobs: TokenLogprobs,
    pub rank: usize,
}

impl Generation {
    /// Admits the request (a 503 when the server is full) and hands it to the engine.
    pub fn start(
        state: &AppState,
        model: &Arc<LoadedModel>,
        request: Request,
        parser: PieceParser,
    ) -> Result<Generation, ApiError> {
        let slot = admit(state, 1)?.pop().expect("one slot admitted");
        Ok(Generation::submit(slot, model, request, parser))
    }

    /// Hands a request admitted to `slot` to the engine.
    pub fn submit(slot: Slot, model: &Arc<LoadedModel>, request: Request, parser: PieceParser) -> Generation {
        let (sender, events) = unbounded_channel();
        let prompt_tokens = request.prompt_ids.len();
        let stop_strings = request.stop_strings.clone();
        let id = model
            .engine
            .submit(request, Box::new(move |event| sender.send(event).is_ok()));
        let in_flight = InFlight {
            slot,
            model: model.clone(),
            id,
            prompt_tokens,
            completion_tokens: 0,
            done: false,
            submitted: Instant::now(),
            last_token: None,
        };
        Generation {
            in_flight,
            events,
            parser,
            stop_strings,
            logprobs: vec![],
            token_ids: vec![],
            prompt_logprobs: vec![],
            ended: false,
        }
    }

    /// The next output; None once it finished or failed. Prompt tokens' logprobs are kept for
    /// [`Self::take_prompt_logprobs`]: they all come before the first output.
    pub async fn next(&mut self) -> Option<Output> {
        if self.ended {
            return None;
        }
        let event = loop {
            match self.events.recv().await {
                Some(Event::PromptToken { id, logprobs, rank }) => {
                    self.prompt_logprobs.push(PromptScore { id, logprobs, rank })
                }
                Some(event) => break event,
                None => return Some(self.fail("the engine stopped".into())),
            }
        };
        Some(match event {
            Event::Token { id, text, logprobs } => {
                self.in_flight.on_token();
                self.logprobs.extend(logprobs.map(|lp| (id, lp)));
                self.token_ids.push(id);
                Output::Pieces(self.parser.push_token(id, &text))
            }
            Event::Finished {
                reason,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                self.ended = true;
                self.in_flight.finish(reason.as_str());
                // The parser first: the end of the output may close a tool call.
                let pieces = self.parser.finish();
                let finish = Finish {
                    reason: self.finish_reason(reason),
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    reasoning_tokens: self.parser.reasoning_tokens(),
                };
                Output::Finished(pieces, finish)
            }
            Event::Failed { message } => self.fail(message),
            // Kept by the loop above; one could only come out of order.
            Event::PromptToken { .. } => self.fail("a prompt token's logprob came after the output began".into()),
        })
    }

    /// The scores of the prompt's tokens after its first, once (empty unless the request asked for them).
    pub fn take_prompt_logprobs(&mut self) -> Vec<PromptScore> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// The logprobs of the tokens generated since the last call, in order.
    pub fn take_logprobs(&mut self) -> Vec<(u32, TokenLogprobs)> {
        std::mem::take(&mut self.logprobs)
    }

    /// The ids of the tokens generated since the last call, in order.
    pub fn take_token_ids(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.token_ids)
    }

    fn fail(&mut self, message: String) -> Output {
        self.ended = true;
        self.in_flight.finish("error");
        Output::Failed(ApiError::internal(format!("generation failed: {message}")))
    }

    /// A turn the model ended: by calling tools if it called any.
    fn end_of_turn(&self) -> FinishReason {
        match self.parser.tool_calls() {
            0 => FinishReason::EndOfTurn,
            _ => FinishReason::ToolCalls,
        }
    }

    /// The engine's reason in the protocols' terms: an end-of-sequence token or a complete grammar (forced tool
    /// calls) ends the turn.
    fn finish_reason(&self, reason: engine::FinishReason) -> FinishReason {
        match reason {
            engine::FinishReason::Length => FinishReason::Length,
            engine::FinishReason::Stop => self.end_of_turn(),
            engine::FinishReason::StopString(index) => {
                FinishReason::StopString(self.stop_strings.get(index).cloned().unwrap_or_default())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_tokens_are_those_that_reason_or_are_held_back_while_reasoning() {
        let mut parser = PieceParser::new(Some(ReasoningParser::new("<|im_start|>assistant\n<think>\n")), None);
        // Reasoning; a part of the closing tag, held back; the rest of it, which gives nothing; then content.
        for (text, reasoning) in [("so", 1), ("</thi", 2), ("nk>", 3), ("\n\nyes", 3), (" no", 3)] {
            parser.push_token(0, text);
            assert_eq!(parser.reasoning_tokens(), reasoning, "after {text:?}");
        }
        let mut plain = PieceParser::new(None, None);
        plain.push_token(0, "");
        plain.push_token(0, "hi");
        assert_eq!(plain.reasoning_tokens(), 0);
    }

    #[test]
    fn pieces_keep_reasoning_before_content_and_drop_empty_text() {
        let mut plain = PieceParser::new(None, None);
        assert_eq!(plain.push(""), vec![]);
        assert_eq!(plain.push("hi"), vec![Piece::Content("hi".into())]);
        let mut thinking = PieceParser::new(Some(ReasoningParser::new("<|im_start|>assistant\n<think>\n")), None);
        assert_eq!(
            thinking.push("so</think>\n\nyes"),
            vec![Piece::Reasoning("so".into()), Piece::Content("yes".into())]
        );
        assert_eq!(thinking.push(" <thi"), vec![Piece::Content(" ".into())]);
        let mut opens = PieceParser::new(Some(ReasoningParser::new("<|im_start|>assistant\n")), None);
        assert_eq!(
            opens.push("ok<think>hm"),
            vec![Piece::Content("ok".into()), Piece::Reasoning("hm".into())]
        );
        assert_eq!(thinking.finish(), vec![Piece::Content("<thi".into())]);
    }

    #[test]
    fn tool_calls_are_parsed_after_reasoning_and_not_inside_it() {
        use crate::tools::{ToolCallFormat, ToolSpec};
        let tools = vec![ToolSpec::function("f", None, serde_json::json!({}))];
        let calls = ToolCallParser::new(ToolCallFormat::Hermes, tools, true);
        // Qwen3.5's generation prompt opens <think>.
        let reasoning = ReasoningParser::new("<|im_start|>assistant\n<think>\n");
        let mut parser = PieceParser::new(Some(reasoning), Some(calls));
        let mut pieces = vec![];
        for text in [
            "maybe <tool_call>{\"name\": \"f\"}</tool_call>",
            "</thi",
            "nk>\n\nok <tool_",
            "call>",
            "{\"name\": \"f\"}",
        ] {
            pieces.extend(parser.push(text));
        }
        pieces.extend(parser.finish());
        let expected = vec![
            Piece::Reasoning("maybe <tool_call>{\"name\": \"f\"}</tool_call>".into()),
            Piece::Content("ok".into()),
            Piece::ToolCallStart {
                index: 0,
                name: "f".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "{}".into(),
            },
        ];
        assert_eq!(pieces, expected);
        assert_eq!(parser.tool_calls(), 1);
    }
}
