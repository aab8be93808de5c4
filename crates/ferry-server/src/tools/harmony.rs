//! OpenAI's Harmony format (gpt-oss). The output is a sequence of messages, each a header and a body:
//! `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`. A body in
//! the `analysis` channel is reasoning, one in `final` the answer, one in `commentary` addressed
//! `to=functions.NAME` (in the header, before or after the channel) a call of tool NAME whose body is the
//! arguments' JSON (`<|call|>` ends it), one in `commentary` addressed to no one a preamble the user sees. Messages
//! to anyone else (built-in tools this server does not run, tools not offered) stay reasoning.
//!
//! Harmony's markup tokens are special tokens, which the engine's text leaves out: each is given back by its id
//! ([`HarmonyParser::marker`]) and read as text. Calls go to the tool call parser in the shape of DeepSeek's
//! (named_json.rs), which numbers them and streams their arguments.

use super::named_json::{CALL_BEGIN, CALL_END, SEPARATOR};
use super::{first_tag, partial_tag_len, ToolCallParser};
use crate::generation::Piece;

pub const CHANNEL: &str = "<|channel|>";
const START: &str = "<|start|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
const CONSTRAIN: &str = "<|constrain|>";
const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];
/// What ends a body: its end tokens, or (a model that left the end out) the next message's start.
const BODY_ENDS: [&str; 4] = [END, CALL, RETURN, START];
const FUNCTIONS: &str = "functions.";

/// Where a message's body goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    Call,
}

#[derive(Clone)]
pub struct HarmonyParser {
    /// The markup tokens' ids.
    markers: Vec<(u32, &'static str)>,
    /// Reads the calls, when the request offered tools.
    calls: Option<ToolCallParser>,
    pending: String,
    /// The body being read; None while a header is.
    body: Option<Body>,
}

impl HarmonyParser {
    /// `token_id`: the tokenizer's id of a token (gpt-oss's has each marker as one special token).
    pub fn new(token_id: impl Fn(&str) -> Option<u32>, calls: Option<ToolCallParser>) -> Self {
        let markers = MARKERS
            .iter()
            .filter_map(|&marker| Some((token_id(marker)?, marker)))
            .collect();
        HarmonyParser {
            markers,
            calls,
            pending: String::new(),
            body: None,
        }
    }

    /// The markup token `id` stands for, if it is one.
    pub fn marker(&self, id: u32) -> Option<&'static str> {
        self.markers
            .iter()
            .find(|(marker_id, _)| *marker_id == id)
            .map(|(_, m)| *m)
    }

    /// Whether the body being read is reasoning (the `analysis` channel's).
    pub fn in_reasoning(&self) -> bool {
        self.body == Some(Body::Reasoning)
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls.as_ref().map_or(0, ToolCallParser::calls)
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = vec![];
        loop {
            let Some(body) = self.body else {
                let Some(at) = self.pending.find(MESSAGE) else {
                    return out;
                };
                let header: String = self.pending.drain(..at + MESSAGE.len()).collect();
                self.body = Some(self.open(&header[..at], &mut out));
                continue;
            };
            if let Some((at, tag)) = first_tag(&self.pending, &BODY_ENDS) {
                let text: String = self.pending.drain(..at + tag.len()).collect();
                self.emit(body, &text[..at], &mut out);
                if body == Body::Call {
                    self.call_text(CALL_END, &mut out);
                }
                self.body = None;
                continue;
            }
            let held = partial_tag_len(&self.pending, &BODY_ENDS);
            let ready: String = self.pending.drain(..self.pending.len() - held).collect();
            self.emit(body, &ready, &mut out);
            return out;
        }
    }

    /// The end of generation: the open body takes what is held back and an open call is closed; a header never
    /// finished is dropped, unless it holds no markup at all (a model that does not write Harmony): then it is the
    /// answer.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        let rest = std::mem::take(&mut self.pending);
        match self.body.take() {
            Some(body) => self.emit(body, &rest, &mut out),
            None if !rest.contains("<|") => self.emit(Body::Content, &rest, &mut out),
            None => {}
        }
        if let Some(calls) = &mut self.calls {
            out.extend(calls.finish().into_iter().map(Piece::from));
        }
        out
    }

    /// Where the body after `header` goes; a call is started.
    fn open(&mut self, header: &str, out: &mut Vec<Piece>) -> Body {
        let channel = header.split(CHANNEL).nth(1).map(first_word).unwrap_or_default();
        let recipient = header.split("to=").nth(1).map(first_word);
        match recipient {
            Some(recipient) => {
                let name = recipient.strip_prefix(FUNCTIONS).unwrap_or_default();
                match self.calls.as_ref().is_some_and(|calls| calls.knows(name)) {
                    true => {
                        self.call_text(&format!("{CALL_BEGIN}{name}{SEPARATOR}"), out);
                        Body::Call
                    }
                    false => Body::Reasoning,
                }
            }
            None if channel == "analysis" => Body::Reasoning,
            None => Body::Content,
        }
    }

    fn emit(&mut self, body: Body, text: &str, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        match body {
            Body::Reasoning => out.push(Piece::Reasoning(text.to_string())),
            Body::Content => out.push(Piece::Content(text.to_string())),
            Body::Call => self.call_text(text, out),
        }
    }

    fn call_text(&mut self, text: &str, out: &mut Vec<Piece>) {
        if let Some(calls) = &mut self.calls {
            out.extend(calls.push(text).into_iter().map(Piece::from));
        }
    }
}

/// The header word at the start of `text`: up to whitespace or the next markup.
fn first_word(text: &str) -> &str {
    let text = text.trim_start();
    let end = text.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(text.len());
    &text[..end]
}

#[cfg(test)]
mod tests;
