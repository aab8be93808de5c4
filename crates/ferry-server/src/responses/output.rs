//! A response's `output` built from the generation's pieces, and the stream events that spell it: consecutive
//! reasoning makes one `reasoning` item (its text as one `reasoning_text` part; the model has no summarizer, so
//! `summary` is empty), consecutive content one `message` item (one `output_text` part), and each tool call a
//! `function_call` item. An item is opened (`response.output_item.added`, then its part's
//! `response.content_part.added`), filled (`response.reasoning_text.delta`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`) and closed (the matching `.done` events, `response.content_part.done`,
//! `response.output_item.done`) before the next one opens.
//!
//! Events are built here without their `sequence_number` (stream.rs numbers them); a plain response drops them.
//!
//! The message's logprobs (when asked for): each token's as chat shows them, in the `output_text` part and with the
//! delta its text came out in; a token counts as the message's when it spells part of the message's text
//! (`take_spelling`), so the tokens of reasoning, of markup the parsers took out and of tool calls are left out.
//!
//! `encrypted_content` (asked for by `include`) lets a client that stores nothing give the reasoning back next turn.
//! OpenAI encrypts it because its API hides the raw reasoning; this server shows the reasoning in `content` anyway,
//! so the field is the same text sealed only against other servers' blobs: a version tag, then the text's bytes in
//! hex. It is an encoding, not encryption.

use std::sync::Arc;

use ferry_core::engine::TokenLogprobs;
use serde_json::{json, Value};

use super::tools::Namespaces;
use crate::generation::Piece;
use crate::LoadedModel;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Reasoning,
    Message,
    Call,
}

/// The item being written.
struct Open {
    kind: Kind,
    id: String,
    /// The text so far: reasoning, content or the call's arguments.
    text: String,
    /// A call's ids and function (None for the other kinds).
    call: Option<Call>,
    /// A message's tokens' logprobs, when the request asked for them.
    logprobs: Vec<Value>,
}

/// A `function_call` item's `call_id`, `name` and `namespace` (for a namespace's function).
#[derive(Clone, Debug, Default)]
struct Call {
    call_id: String,
    name: String,
    namespace: Option<String>,
}

/// What begins an `encrypted_content` this server wrote.
const SEAL_TAG: &str = "ferry-reasoning-v1:";

/// A reasoning text as this server's `encrypted_content`.
pub(super) fn seal_reasoning(text: &str) -> String {
    let hex: String = text.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{SEAL_TAG}{hex}")
}

/// The text of an `encrypted_content` this server wrote, or None for anything else.
pub(super) fn unseal_reasoning(sealed: &str) -> Option<String> {
    let hex = sealed.strip_prefix(SEAL_TAG)?;
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(hex.get(at..at + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// The output items of one response, and how many generated tokens were reasoning.
pub struct OutputItems {
    /// The hex part of the response's id, which its items' ids carry.
    response: String,
    /// Finished reasoning items carry `encrypted_content`.
    encrypted_reasoning: bool,
    done: Vec<Value>,
    open: Option<Open>,
    /// The functions of the request's namespaces: a call of one names its namespace.
    namespaces: Namespaces,
    /// The model whose tokens the logprobs name, when the request asked for them.
    logprobs_of: Option<Arc<LoadedModel>>,
    /// Logprobs of tokens whose text has not come out yet (held back, or giving no text): those that spell the
    /// message's next text go to the message ([`take_spelling`]), and all are dropped when reasoning or a call comes
    /// out instead.
    pending: Vec<Value>,
}

/// A text part of an item: `reasoning_text` or `output_text` (with its tokens' logprobs).
fn part(kind: Kind, text: &str, logprobs: &[Value]) -> Value {
    match kind {
        Kind::Reasoning => json!({"type": "reasoning_text", "text": text}),
        _ => json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}),
    }
}

impl Open {
    /// The item as the response (or an `output_item` event) shows it.
    fn item(&self, status: &str) -> Value {
        let content = match self.text.is_empty() && status == "in_progress" {
            true => vec![],
            false => vec![part(self.kind, &self.text, &self.logprobs)],
        };
        match self.kind {
            Kind::Reasoning => {
                json!({"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": status})
            }
            Kind::Message => json!({
                "type": "message", "id": self.id, "role": "assistant", "status": status, "content": content,
            }),
            Kind::Call => {
                let call = self.call.clone().unwrap_or_default();
                let mut item = json!({
                    "type": "function_call", "id": self.id, "call_id": call.call_id, "name": call.name,
                    "arguments": self.text, "status": status,
                });
                if let Some(namespace) = call.namespace {
                    item["namespace"] = namespace.into();
                }
                item
            }
        }
    }
}

impl OutputItems {
    /// `logprobs_of`: the served model, when the request asked for logprobs.
    pub fn new(
        response_id: &str,
        encrypted_reasoning: bool,
        namespaces: Namespaces,
        logprobs_of: Option<Arc<LoadedModel>>,
    ) -> Self {
        OutputItems {
            response: response_id.trim_start_matches("resp_").to_string(),
            encrypted_reasoning,
            done: vec![],
            open: None,
            namespaces,
            logprobs_of,
            pending: vec![],
        }
    }

    /// The pieces of one generated token, with its logprobs (when asked for).
    pub fn token(&mut self, pieces: &[Piece], logprobs: &[(u32, TokenLogprobs)], events: &mut Vec<Value>) {
        if let Some(model) = &self.logprobs_of {
            let entries = logprobs
                .iter()
                .map(|(id, lp)| crate::sampling::token_json(model, *id, lp, crate::sampling::TokenNames::Text));
            self.pending.extend(entries);
        }
        self.pieces(pieces, events);
    }

    /// Pieces that came with no new token (the end of the output).
    pub fn pieces(&mut self, pieces: &[Piece], events: &mut Vec<Value>) {
        for piece in pieces {
            self.piece(piece, events);
        }
        // Text came out, none of it the message's (reasoning or a call): the tokens behind it are not the message's.
        if !pieces.is_empty() && !pieces.iter().any(|p| matches!(p, Piece::Content(_))) {
            self.pending.clear();
        }
    }

    fn output_index(&self) -> usize {
        self.done.len()
    }

    fn piece(&mut self, piece: &Piece, events: &mut Vec<Value>) {
        let (kind, text) = match piece {
            Piece::Reasoning(text) => (Kind::Reasoning, text),
            Piece::Content(text) => (Kind::Message, text),
            Piece::ToolCallStart { index, name } => {
                let call = Call {
                    call_id: format!("call_{}{index:02x}", self.response),
                    name: name.clone(),
                    namespace: None,
                };
                let call = match self.namespaces.split(name) {
                    Some((namespace, name)) => Call {
                        name: name.into(),
                        namespace: Some(namespace.into()),
                        ..call
                    },
                    None => call,
                };
                self.open(Kind::Call, Some(call), events);
                return;
            }
            Piece::ToolCallArguments { fragment, .. } => (Kind::Call, fragment),
        };
        match self.open.as_ref().map(|open| open.kind) {
            Some(open) if open == kind => {}
            // Arguments always follow their call's start.
            _ if kind == Kind::Call => return,
            _ => self.open(kind, None, events),
        }
        let output_index = self.output_index();
        let Some(open) = &mut self.open else { return };
        open.text.push_str(text);
        let event = match kind {
            Kind::Reasoning => json!({"type": "response.reasoning_text.delta", "content_index": 0, "delta": text}),
            Kind::Message => {
                let logprobs = take_spelling(&mut self.pending, text);
                open.logprobs.extend(logprobs.iter().cloned());
                json!({"type": "response.output_text.delta", "content_index": 0, "delta": text, "logprobs": logprobs})
            }
            Kind::Call => json!({"type": "response.function_call_arguments.delta", "delta": text}),
        };
        events.push(with_item(event, &open.id, output_index));
    }

    /// Closes the open item and opens one of `kind`.
    fn open(&mut self, kind: Kind, call: Option<Call>, events: &mut Vec<Value>) {
        self.close("completed", events);
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call => "fc",
        };
        let open = Open {
            kind,
            id: format!("{prefix}_{}{:02x}", self.response, self.output_index()),
            text: String::new(),
            call,
            logprobs: vec![],
        };
        let output_index = self.output_index();
        events.push(
            json!({"type": "response.output_item.added", "output_index": output_index,
                           "item": open.item("in_progress")}),
        );
        if kind != Kind::Call {
            let event = json!({"type": "response.content_part.added", "content_index": 0, "part": part(kind, "", &[])});
            events.push(with_item(event, &open.id, output_index));
        }
        self.open = Some(open);
    }

    /// Closes the open item with `status` (`completed`, or `incomplete` where the output was cut short).
    pub fn close(&mut self, status: &str, events: &mut Vec<Value>) {
        let Some(open) = self.open.take() else { return };
        let output_index = self.output_index();
        let text = open.text.as_str();
        let done = match open.kind {
            Kind::Reasoning => json!({"type": "response.reasoning_text.done", "content_index": 0, "text": text}),
            Kind::Message => json!({"type": "response.output_text.done", "content_index": 0, "text": text,
                                    "logprobs": open.logprobs}),
            Kind::Call => json!({"type": "response.function_call_arguments.done", "arguments": text}),
        };
        events.push(with_item(done, &open.id, output_index));
        if open.kind != Kind::Call {
            let event = json!({"type": "response.content_part.done", "content_index": 0,
                               "part": part(open.kind, text, &open.logprobs)});
            events.push(with_item(event, &open.id, output_index));
        }
        let mut item = open.item(status);
        if self.encrypted_reasoning && open.kind == Kind::Reasoning {
            item["encrypted_content"] = seal_reasoning(text).into();
        }
        events.push(json!({"type": "response.output_item.done", "output_index": output_index, "item": item}));
        self.done.push(item);
    }

    /// The items, once the last is closed.
    pub fn items(&self) -> Vec<Value> {
        self.done.clone()
    }
}

/// Takes from `pending` (token logprobs in order, each naming its token's text) the shortest run of tokens whose
/// text holds `text`, a piece of the message, and drops the tokens before it: they gave markup the parsers took out
/// (a `</think>` ending the reasoning); those after it stay pending (text held back past this piece). A token can
/// give both markup and message text; it counts as the message's. Where no run holds the text (a character split
/// between tokens shows as U+FFFD in each), all are taken.
fn take_spelling(pending: &mut Vec<Value>, text: &str) -> Vec<Value> {
    if text.is_empty() {
        return vec![];
    }
    let token = |entry: &Value| entry["token"].as_str().unwrap_or_default().to_string();
    let mut best: Option<(usize, usize)> = None;
    for start in 0..pending.len() {
        let mut spelled = String::new();
        for (end, entry) in pending.iter().enumerate().skip(start) {
            spelled.push_str(&token(entry));
            if spelled.contains(text) {
                if best.is_none_or(|(s, e)| end - start < e - s) {
                    best = Some((start, end));
                }
                break;
            }
        }
    }
    let (start, end) = best.unwrap_or((0, pending.len().saturating_sub(1)));
    let rest = pending.split_off((end + 1).min(pending.len()));
    let run = pending.split_off(start.min(pending.len()));
    *pending = rest;
    run
}

fn with_item(mut event: Value, item_id: &str, output_index: usize) -> Value {
    event["item_id"] = item_id.into();
    event["output_index"] = output_index.into();
    event
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call of `name` with `{}` for arguments, as the tool parser gives it.
    fn call(name: &str) -> [Piece; 2] {
        [
            Piece::ToolCallStart {
                index: 0,
                name: name.into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "{}".into(),
            },
        ]
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn a_call_of_a_namespaces_function_names_its_namespace() {
        let tools =
            json!({"tools": [{"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "find"}]}]});
        let body = crate::body::Body::new(tools.as_object().unwrap().clone());
        let (_, _, namespaces) = super::super::tools::tool_request(&body).unwrap();
        let mut items = OutputItems::new("resp_00ab", false, namespaces, None);
        let mut events = vec![];
        items.pieces(&call("crm.find"), &mut events);
        items.pieces(&call("find"), &mut events);
        items.close("completed", &mut events);
        let done = items.items();
        assert_eq!(
            (&done[0]["name"], &done[0]["namespace"]),
            (&json!("find"), &json!("crm"))
        );
        assert_eq!(events[0]["item"]["namespace"], "crm", "the added item says it too");
        assert!(
            done[1].get("namespace").is_none(),
            "a plain function has none: {}",
            done[1]
        );
    }

    #[test]
    fn pieces_make_items_opened_filled_and_closed_in_order() {
        let mut items = OutputItems::new("resp_00ab", false, Namespaces::default(), None);
        let mut events = vec![];
        items.token(&[Piece::Reasoning("so".into())], &[], &mut events);
        items.token(&[], &[], &mut events);
        items.token(&[Piece::Content("hi".into())], &[], &mut events);
        items.token(&[Piece::Content("!".into())], &[], &mut events);
        items.pieces(&call("f"), &mut events);
        items.close("completed", &mut events);
        assert_eq!(
            types(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(
            items.items(),
            vec![
                json!({"type": "reasoning", "id": "rs_00ab00", "summary": [], "status": "completed",
                       "content": [{"type": "reasoning_text", "text": "so"}]}),
                json!({"type": "message", "id": "msg_00ab01", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": "hi!", "annotations": [], "logprobs": []}]}),
                json!({"type": "function_call", "id": "fc_00ab02", "call_id": "call_00ab00", "name": "f",
                       "arguments": "{}", "status": "completed"}),
            ]
        );
        assert_eq!(events[8]["output_index"], 1);
        assert_eq!(events[8]["item_id"], "msg_00ab01");
    }

    #[test]
    fn reasoning_items_carry_their_text_sealed_when_asked() {
        let mut items = OutputItems::new("resp_00ab", true, Namespaces::default(), None);
        let mut events = vec![];
        items.pieces(
            &[Piece::Reasoning("ünïcode, then".into()), Piece::Content("hi".into())],
            &mut events,
        );
        items.close("completed", &mut events);
        let output = items.items();
        let sealed = output[0]["encrypted_content"].as_str().unwrap();
        assert_eq!(unseal_reasoning(sealed).as_deref(), Some("ünïcode, then"));
        assert!(
            output[1].get("encrypted_content").is_none(),
            "only reasoning items carry it"
        );
        let done = events
            .iter()
            .find(|e| e["type"] == "response.output_item.done")
            .unwrap();
        assert_eq!(done["item"]["encrypted_content"], sealed);
        for foreign in [
            "gAAAAB",
            "ferry-reasoning-v1:6",
            "ferry-reasoning-v1:zz",
            "ferry-reasoning-v1:ff",
        ] {
            assert_eq!(unseal_reasoning(foreign), None, "{foreign}");
        }
    }

    #[test]
    fn an_output_cut_short_leaves_its_last_item_incomplete() {
        let mut items = OutputItems::new("resp_1", false, Namespaces::default(), None);
        let mut events = vec![];
        items.token(&[Piece::Content("par".into())], &[], &mut events);
        items.close("incomplete", &mut events);
        assert_eq!(items.items()[0]["status"], "incomplete");
        let mut empty = OutputItems::new("resp_2", false, Namespaces::default(), None);
        empty.close("completed", &mut events);
        assert!(empty.items().is_empty());
    }

    #[test]
    fn a_message_takes_the_tokens_that_spell_its_text() {
        let entries = |tokens: &[&str]| -> Vec<Value> { tokens.iter().map(|t| json!({"token": t})).collect() };
        // Markup before the text is dropped; text held back after it stays pending.
        let mut pending = entries(&["</think>", "\n\n", "Hel", "lo", "\n<"]);
        assert_eq!(take_spelling(&mut pending, "Hello"), entries(&["Hel", "lo"]));
        assert_eq!(pending, entries(&["\n<"]));
        // A token that gives markup and text counts as the text's.
        let mut pending = entries(&["</think>", "\n\nLet me check.\n\n<tool"]);
        assert_eq!(
            take_spelling(&mut pending, "Let me check."),
            entries(&["\n\nLet me check.\n\n<tool"])
        );
        assert!(pending.is_empty());
        // The shortest run: a repeated text goes to the tokens nearest to it.
        let mut pending = entries(&["a", "b", "a"]);
        assert_eq!(take_spelling(&mut pending, "a"), entries(&["a"]));
        assert_eq!(pending, entries(&["b", "a"]));
        // No run spells it (a character split between tokens): all are taken; no text: none.
        let mut pending = entries(&["\u{fffd}", "\u{fffd}"]);
        assert_eq!(take_spelling(&mut pending, "é"), entries(&["\u{fffd}", "\u{fffd}"]));
        assert!(pending.is_empty());
        let mut pending = entries(&["x"]);
        assert!(take_spelling(&mut pending, "").is_empty());
        assert_eq!(pending, entries(&["x"]));
    }
}
