//! A streamed Anthropic message: `message_start`, a `ping`, then per content block `content_block_start`, its
//! `content_block_delta`s (`thinking_delta`, `text_delta`, a `tool_use` block's `input_json_delta`s) and
//! `content_block_stop`, then `message_delta` with the
//! stop reason and usage and `message_stop`; `ping`s keep an idle stream alive, and an engine failure ends it with
//! an `error` event.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::{error_body, stop_reason, usage, MessageMeta};
use crate::generation::{Generation, Output, Piece};

fn event(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

fn ping() -> SseEvent {
    event("ping", json!({"type": "ping"}))
}

/// Which content block is open, so that a piece of another kind closes it and opens the next.
#[derive(Default)]
struct Blocks {
    /// The open block's kind (`"thinking"` or `"text"`) and index.
    open: Option<(&'static str, usize)>,
    /// The index the next block gets.
    next: usize,
}

impl Blocks {
    /// The events for one piece: a block change if its kind differs from the open block's (each tool call opens a
    /// block of its own), then its delta.
    fn piece(&mut self, meta: &MessageMeta, piece: &Piece, out: &mut Vec<SseEvent>) {
        let (kind, delta) = match piece {
            Piece::Reasoning(text) => ("thinking", json!({"type": "thinking_delta", "thinking": text})),
            Piece::Content(text) => ("text", json!({"type": "text_delta", "text": text})),
            Piece::ToolCallStart { index, name } => {
                let block = json!({"type": "tool_use", "id": meta.tool_use_id(*index), "name": name, "input": {}});
                self.open("tool_use", block, out);
                return;
            }
            Piece::ToolCallArguments { fragment, .. } => (
                "tool_use",
                json!({"type": "input_json_delta", "partial_json": fragment}),
            ),
        };
        let index = match self.open {
            Some((open, index)) if open == kind => index,
            _ => {
                let block = match kind {
                    "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                    _ => json!({"type": "text", "text": ""}),
                };
                self.open(kind, block, out)
            }
        };
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    /// Closes the open block and opens `block`; returns its index.
    fn open(&mut self, kind: &'static str, block: Value, out: &mut Vec<SseEvent>) -> usize {
        self.close(out);
        let index = self.next;
        self.next += 1;
        self.open = Some((kind, index));
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((_, index)) = self.open.take() {
            out.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }
}

/// The events for the next output.
fn events(blocks: &mut Blocks, meta: &MessageMeta, output: Output) -> Vec<SseEvent> {
    let mut out = vec![];
    match output {
        Output::Pieces(pieces) => pieces.iter().for_each(|piece| blocks.piece(meta, piece, &mut out)),
        Output::Finished(pieces, finish) => {
            pieces.iter().for_each(|piece| blocks.piece(meta, piece, &mut out));
            blocks.close(&mut out);
            let (reason, sequence) = stop_reason(&finish.reason);
            out.push(event(
                "message_delta",
                json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(&finish),
                }),
            ));
            out.push(event("message_stop", json!({"type": "message_stop"})));
        }
        Output::Failed(error) => out.push(event("error", error_body(error.status, &error.message))),
    }
    out
}

/// Streams the message as server-sent events.
pub fn respond(meta: MessageMeta, input_tokens: usize, generation: Generation) -> Response {
    let start = json!({"type": "message_start", "message": meta.message(vec![], None, input_tokens)});
    let opening = vec![event("message_start", start), ping()];
    let rest = stream::unfold(
        (Blocks::default(), meta, generation),
        |(mut blocks, meta, mut generation)| async move {
            let output = generation.next().await?;
            Some((events(&mut blocks, &meta, output), (blocks, meta, generation)))
        },
    );
    let all = stream::iter([opening])
        .chain(rest)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::new().event(ping())).into_response()
}
