//! A streamed response: `response.created` and `response.in_progress` (the response in progress, no output), the
//! output items' events (output.rs), then `response.completed` (or `response.incomplete`, cut by
//! `max_output_tokens`) with the whole response; an engine failure ends the stream with an `error` event. Every
//! event is named by its `type` and numbered by `sequence_number` from 0.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::{status, OutputItems, ResponseMeta};
use crate::generation::{Generation, Output};

/// Numbers events in the order sent.
#[derive(Default)]
struct Sequence(u64);

impl Sequence {
    fn event(&mut self, mut data: Value) -> SseEvent {
        data["sequence_number"] = self.0.into();
        self.0 += 1;
        let name = data["type"].as_str().unwrap_or("message").to_string();
        SseEvent::default().event(name).data(data.to_string())
    }
}

/// The stream's state between outputs.
struct Streaming {
    meta: ResponseMeta,
    items: OutputItems,
    sequence: Sequence,
    generation: Generation,
}

impl Streaming {
    /// The events for the next output.
    fn events(&mut self, output: Output) -> Vec<SseEvent> {
        let mut events = vec![];
        match output {
            Output::Pieces(pieces) => self.items.token(&pieces, &self.generation.take_logprobs(), &mut events),
            Output::Finished(pieces, finish) => {
                self.items.pieces(&pieces, &mut events);
                let status = status(&finish);
                self.items.close(status, &mut events);
                let response = self.meta.object(self.items.items(), Some(&finish));
                self.meta.kept(&response);
                events.push(json!({"type": format!("response.{status}"), "response": response}));
            }
            Output::Failed(error) => events.push(json!({
                "type": "error", "code": error.code, "message": error.message, "param": error.param,
            })),
        }
        events.into_iter().map(|event| self.sequence.event(event)).collect()
    }
}

/// Streams the response as server-sent events.
pub fn respond(meta: ResponseMeta, generation: Generation) -> Response {
    let mut sequence = Sequence::default();
    let in_progress = meta.object(vec![], None);
    let opening = vec![
        sequence.event(json!({"type": "response.created", "response": in_progress})),
        sequence.event(json!({"type": "response.in_progress", "response": in_progress})),
    ];
    let items = meta.items();
    let state = Streaming {
        meta,
        items,
        sequence,
        generation,
    };
    let rest = stream::unfold(state, |mut state| async move {
        let output = state.generation.next().await?;
        Some((state.events(output), state))
    });
    let all = stream::iter([opening])
        .chain(rest)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::default()).into_response()
}
