//! A response as server-sent events: each choice's output as it comes (a text completion's echoed prompt in its
//! choice's first chunk), tokens whose text is held back waiting for the chunk that carries it, the usage when
//! asked for, and `data: [DONE]`.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::{finish_reason, usage, ChoiceOutput, Choices, Echo, Renderer, Text};
use crate::generation::{Finish, Output};
use ferry_core::engine::TokenLogprobs;

fn done() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

/// The tokens of a stream so far: its prompts' and every choice's generated ones.
pub(super) struct RunningUsage {
    prompt: usize,
    completion: usize,
}

impl RunningUsage {
    pub(super) fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
        })
    }
}

/// A choice's tokens whose text is held back: their logprobs and ids.
type Held = (Vec<(u32, TokenLogprobs)>, Vec<u32>);

/// A streamed response as it goes: the logprobs and ids of each choice's tokens whose text is held back (they wait
/// for the chunk that carries it), the tokens so far, which text choices have named their prompt's ids, and how
/// each choice ended.
struct Streaming {
    renderer: Renderer,
    choices: Choices,
    held: Vec<Held>,
    running: RunningUsage,
    prompt_named: Vec<bool>,
    /// Per choice, whether its prompt is still to echo (in its first chunk).
    echo_due: Vec<bool>,
    finishes: Vec<Option<Finish>>,
    ended: bool,
}

impl Streaming {
    /// A chunk of choice `index`'s new text with the logprobs and ids held for it (and, the first time, a text
    /// completion's prompt ids).
    fn text_chunk(&mut self, index: usize, echo: Option<&Echo>, text: &Text) -> SseEvent {
        let (logprobs, ids) = std::mem::take(&mut self.held[index]);
        let renderer = &self.renderer;
        let choice = renderer.choice(index, (echo, text), &logprobs, None, true);
        let prompt_ids = match std::mem::replace(&mut self.prompt_named[index], true) {
            false => self.choices.text_prompt_ids(renderer, index),
            true => None,
        };
        renderer.chunk(renderer.with_ids(choice, &ids, prompt_ids), &self.running)
    }

    /// The SSE events for a choice's next output: a chunk of new text, or its last ones, and after the last
    /// choice's the usage (when asked for) and `[DONE]`.
    fn events(&mut self, next: ChoiceOutput) -> Vec<SseEvent> {
        let index = next.index;
        self.held[index].0.extend(next.logprobs);
        self.held[index].1.extend(next.token_ids);
        let echo = match std::mem::replace(&mut self.echo_due[index], false) {
            true => self
                .choices
                .echo(index, &next.prompt_logprobs, self.renderer.logprobs_asked),
            false => None,
        };
        match next.output {
            Output::Pieces(pieces) => {
                // One output of pieces a generated token.
                self.running.completion += 1;
                let text = Text::of(&self.renderer, index, &pieces);
                match text.is_empty() && echo.is_none() {
                    true => vec![],
                    false => vec![self.text_chunk(index, echo.as_ref(), &text)],
                }
            }
            Output::Finished(pieces, finish) => {
                let text = Text::of(&self.renderer, index, &pieces);
                let mut out = vec![];
                let held = !self.held[index].0.is_empty() || !self.held[index].1.is_empty();
                if !text.is_empty() || held || echo.is_some() {
                    out.push(self.text_chunk(index, echo.as_ref(), &text));
                }
                let renderer = &self.renderer;
                let reason = finish_reason(&finish.reason);
                let last = renderer.choice(index, (None, &Text::default()), &[], Some(reason), true);
                out.push(renderer.chunk(last, &self.running));
                self.finishes[index] = Some(finish);
                if let Some(finishes) = self.finishes.iter().cloned().collect::<Option<Vec<Finish>>>() {
                    if renderer.include_usage {
                        let mut body = renderer.envelope(vec![], true);
                        body.insert(
                            "usage".into(),
                            usage(renderer.endpoint, &finishes, self.choices.per_prompt),
                        );
                        out.push(SseEvent::default().data(Value::Object(body).to_string()));
                    }
                    out.push(done());
                    self.ended = true;
                }
                out
            }
            Output::Failed(error) => {
                self.ended = true;
                vec![SseEvent::default().data(error.body().to_string()), done()]
            }
        }
    }
}

/// Streams the choices as server-sent events ending with `data: [DONE]`.
pub(super) fn respond_streamed(renderer: Renderer, choices: Choices) -> Response {
    let running = RunningUsage {
        prompt: choices.prompt_tokens,
        completion: 0,
    };
    let chat_prompt_ids = match (renderer.return_token_ids, &choices.prompt_ids[..]) {
        (true, [prompt]) => Some(prompt.as_slice()),
        _ => None,
    };
    let opening = renderer.opening(&running, chat_prompt_ids);
    let count = choices.count;
    let echoing = choices.echoes.is_some();
    let streaming = Streaming {
        renderer,
        choices,
        held: vec![(vec![], vec![]); count],
        running,
        prompt_named: vec![false; count],
        echo_due: vec![echoing; count],
        finishes: vec![None; count],
        ended: false,
    };
    let rest = stream::unfold(streaming, |mut streaming| async move {
        if streaming.ended {
            return None;
        }
        let output = streaming.choices.next().await?;
        let events = streaming.events(output);
        Some((events, streaming))
    });
    let all = stream::iter([opening])
        .chain(rest)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::default()).into_response()
}
