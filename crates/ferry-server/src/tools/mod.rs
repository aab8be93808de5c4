//! Tool calls in generated text: the formats models write them in, and an incremental parser that turns a stream
//! of text pieces into content and tool calls, never letting call markup through as content (text that could
//! begin a tag is held back until it is whole, as engine/stop.rs and reasoning.rs do).
//!
//! Each format wraps a call in an opening and a closing tag (`<tool_call>` ... `</tool_call>` but for DeepSeek's);
//! what is inside differs: Hermes JSON (hermes.rs, Qwen3/Qwen2.5), the XML of Qwen3-Coder, Qwen3.5 and Qwen3.6
//! (qwen_xml.rs), GLM-4.5's keys and values (glm.rs), DeepSeek-V3.1's name and JSON (named_json.rs). gpt-oss's
//! Harmony format writes calls as messages of their own: harmony.rs reads its channels and hands each call to this
//! parser. The request side (tool definitions, `tool_choice`, tool calls in the history) is request.rs; history.rs
//! gives the history's calls and reasoning to the template in the forms it reads.
//!
//! Not here: reasoning (`<think>`), which reasoning.rs splits off before this parser sees the text, so a call
//! written inside the reasoning stays reasoning.

mod arg_value;
pub mod forced;
mod glm;
pub mod harmony;
mod hermes;
pub mod history;
mod named_json;
mod qwen_xml;
pub mod request;

use std::str::FromStr;

use ferry_core::engine::partial_match_len;
use ferry_core::loader::Tokenizer;

pub use request::{ToolRequest, ToolSpec};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const GLM_ARGUMENT: &str = "<arg_key>";

/// How a model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>`
    Qwen3Xml,
    /// `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>` (GLM-4.5, GLM-4.6)
    Glm45,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>`
    DeepSeekV31,
    /// gpt-oss's channels: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
    Harmony,
}

/// The tags around one call, and those around a group of calls (never content).
#[derive(Clone)]
struct Markup {
    open: &'static str,
    close: &'static str,
    group: &'static [&'static str],
}

const TOOL_CALL_TAGS: Markup = Markup {
    open: OPEN,
    close: CLOSE,
    group: &[],
};

/// DeepSeek's tags; Harmony's calls are handed over in DeepSeek's shape.
const NAMED_JSON_TAGS: Markup = Markup {
    open: named_json::CALL_BEGIN,
    close: named_json::CALL_END,
    group: &[named_json::CALLS_BEGIN, named_json::CALLS_END],
};

impl ToolCallFormat {
    /// The format the chat template's tool section asks for, if it has one.
    pub fn from_template(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.chat_template_mentions(harmony::CHANNEL) {
            Some(ToolCallFormat::Harmony)
        } else if tokenizer.chat_template_mentions(named_json::CALLS_BEGIN) {
            Some(ToolCallFormat::DeepSeekV31)
        } else if tokenizer.chat_template_mentions(GLM_ARGUMENT) {
            Some(ToolCallFormat::Glm45)
        } else if tokenizer.chat_template_mentions("<function=") {
            Some(ToolCallFormat::Qwen3Xml)
        } else if tokenizer.chat_template_mentions(OPEN) {
            Some(ToolCallFormat::Hermes)
        } else {
            None
        }
    }

    fn markup(self) -> Markup {
        match self {
            ToolCallFormat::Hermes | ToolCallFormat::Qwen3Xml | ToolCallFormat::Glm45 => TOOL_CALL_TAGS,
            ToolCallFormat::DeepSeekV31 | ToolCallFormat::Harmony => NAMED_JSON_TAGS,
        }
    }
}

/// `--tool-call-parser`: the format named by the operator, none at all, or (the default) the template's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolCallParserChoice {
    #[default]
    FromTemplate,
    Off,
    Format(ToolCallFormat),
}

impl FromStr for ToolCallParserChoice {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "hermes" => Ok(ToolCallParserChoice::Format(ToolCallFormat::Hermes)),
            "qwen3_xml" => Ok(ToolCallParserChoice::Format(ToolCallFormat::Qwen3Xml)),
            "glm45" => Ok(ToolCallParserChoice::Format(ToolCallFormat::Glm45)),
            "deepseek_v31" => Ok(ToolCallParserChoice::Format(ToolCallFormat::DeepSeekV31)),
            "harmony" => Ok(ToolCallParserChoice::Format(ToolCallFormat::Harmony)),
            "none" => Ok(ToolCallParserChoice::Off),
            other => Err(format!(
                "unknown tool call parser `{other}`: expected hermes, qwen3_xml, glm45, deepseek_v31, harmony or none"
            )),
        }
    }
}

impl ToolCallParserChoice {
    pub fn format(self, tokenizer: &Tokenizer) -> Option<ToolCallFormat> {
        match self {
            ToolCallParserChoice::FromTemplate => ToolCallFormat::from_template(tokenizer),
            ToolCallParserChoice::Off => None,
            ToolCallParserChoice::Format(format) => Some(format),
        }
    }
}

/// What the parser makes of the text it is fed, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// A call begins: its index among this response's calls and the function's name.
    Start {
        index: usize,
        name: String,
    },
    /// The next piece of a call's arguments, a JSON object's text once all pieces are joined.
    Arguments {
        index: usize,
        fragment: String,
    },
}

/// The inside of one `<tool_call>` in a given format.
trait CallBody {
    /// A copy in the same state: the parser of another output of the same request continues from it.
    fn boxed_clone(&self) -> Box<dyn CallBody + Send>;
    /// Body text that is certainly before the closing tag; may emit the call's start and argument pieces.
    fn feed(&mut self, text: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>);
    /// The call ended (closing tag, or the end of generation) with `raw` its whole body. True when it was a call of
    /// a known tool, all of whose events are now out; false (only ever before any event) when it was not a call.
    fn close(&mut self, raw: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) -> bool;
}

fn body_for(format: ToolCallFormat) -> Box<dyn CallBody + Send> {
    match format {
        ToolCallFormat::Hermes => Box::new(hermes::HermesCall),
        ToolCallFormat::Qwen3Xml => Box::<qwen_xml::XmlCall>::default(),
        ToolCallFormat::Glm45 => Box::<glm::GlmCall>::default(),
        ToolCallFormat::DeepSeekV31 | ToolCallFormat::Harmony => Box::<named_json::NamedJsonCall>::default(),
    }
}

/// Starts the call of `name` (the `index`th call) if a tool has that name; false if none has.
fn start_call(tools: &[ToolSpec], name: &str, index: usize, out: &mut Vec<ToolEvent>) -> bool {
    if tool(tools, name).is_none() {
        return false;
    }
    out.push(ToolEvent::Start {
        index,
        name: name.to_string(),
    });
    true
}

/// The first of `tags` in `text` and where it is.
fn first_tag(text: &str, tags: &[&'static str]) -> Option<(usize, &'static str)> {
    tags.iter().filter_map(|&tag| text.find(tag).map(|at| (at, tag))).min()
}

/// How much of the end of `text` could be the start of one of `tags`: held back until more text says.
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    tags.iter().map(|tag| partial_match_len(text, tag)).max().unwrap_or(0)
}

/// Whether `text` could still grow into `tag` or already starts with it.
fn opens_with(text: &str, tag: &str) -> bool {
    text.starts_with(tag) || tag.starts_with(text)
}

/// The tool definition named `name`.
fn tool<'a>(tools: &'a [ToolSpec], name: &str) -> Option<&'a ToolSpec> {
    tools.iter().find(|t| t.name == name)
}

struct OpenCall {
    body: Box<dyn CallBody + Send>,
    /// The whitespace before `<tool_call>`, given back with the markup if this turns out not to be a call.
    lead: String,
    raw: String,
}

impl Clone for OpenCall {
    fn clone(&self) -> Self {
        OpenCall {
            body: self.body.boxed_clone(),
            lead: self.lead.clone(),
            raw: self.raw.clone(),
        }
    }
}

/// Splits streamed text into content and tool calls. Whitespace around calls is not content (it separates the
/// calls from the text); a `<tool_call>` that holds no call of a known tool goes out as the text it was.
#[derive(Clone)]
pub struct ToolCallParser {
    format: ToolCallFormat,
    markup: Markup,
    tools: Vec<ToolSpec>,
    /// `parallel_tool_calls: false`: calls after the first are dropped.
    single_call: bool,
    pending: String,
    call: Option<OpenCall>,
    calls: usize,
    after_call: bool,
}

impl ToolCallParser {
    pub fn new(format: ToolCallFormat, tools: Vec<ToolSpec>, parallel_calls: bool) -> Self {
        ToolCallParser {
            format,
            markup: format.markup(),
            tools,
            single_call: !parallel_calls,
            pending: String::new(),
            call: None,
            calls: 0,
            after_call: false,
        }
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Whether a tool of this name was offered.
    pub fn knows(&self, name: &str) -> bool {
        tool(&self.tools, name).is_some()
    }

    pub fn push(&mut self, piece: &str) -> Vec<ToolEvent> {
        self.pending.push_str(piece);
        let mut out = vec![];
        let markup = &self.markup;
        let tags: Vec<&'static str> = match self.call.is_some() {
            true => vec![markup.close],
            false => std::iter::once(markup.open)
                .chain(markup.group.iter().copied())
                .collect(),
        };
        if let Some((at, tag)) = first_tag(&self.pending, &tags) {
            let before: String = self.pending.drain(..at + tag.len()).collect();
            let before = &before[..at];
            match self.call.is_some() {
                true => {
                    self.feed_call(before, &mut out);
                    self.close_call(tag, &mut out);
                }
                false => {
                    let text = before.trim_end();
                    self.content(text, &mut out);
                    if tag == self.markup.open {
                        self.call = Some(OpenCall {
                            body: body_for(self.format),
                            lead: before[text.len()..].to_string(),
                            raw: String::new(),
                        });
                    } else {
                        // A group's tag: whitespace after it separates calls too.
                        self.after_call = true;
                    }
                }
            }
            // The rest is read for the tags that may follow this one.
            out.extend(self.push(""));
            return out;
        }
        let mut ready = self.pending.len() - partial_tag_len(&self.pending, &tags);
        if self.call.is_none() {
            // Whitespace before a call is not content: wait to see what follows it.
            ready = self.pending[..ready].trim_end().len();
        }
        let ready: String = self.pending.drain(..ready).collect();
        match self.call.is_some() {
            true => self.feed_call(&ready, &mut out),
            false => self.content(&ready, &mut out),
        }
        out
    }

    /// The end of generation: an unclosed call is closed (a model may stop right after its last brace), held-back
    /// text is released.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = vec![];
        let rest = std::mem::take(&mut self.pending);
        match self.call.is_some() {
            true => {
                self.feed_call(&rest, &mut out);
                self.close_call("", &mut out);
            }
            false => self.content(&rest, &mut out),
        }
        out
    }

    fn dropping_calls(&self) -> bool {
        self.single_call && self.calls > 0
    }

    fn feed_call(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let dropping = self.dropping_calls();
        let Some(call) = self.call.as_mut() else { return };
        call.raw.push_str(text);
        let mut events = vec![];
        call.body.feed(text, &self.tools, self.calls, &mut events);
        if !dropping {
            out.extend(events);
        }
    }

    /// `close` is the closing tag as it was seen (none at the end of generation), for a call that was not one.
    fn close_call(&mut self, close: &str, out: &mut Vec<ToolEvent>) {
        let dropping = self.dropping_calls();
        let Some(mut call) = self.call.take() else { return };
        let mut events = vec![];
        if call.body.close(&call.raw, &self.tools, self.calls, &mut events) {
            self.after_call = true;
            if !dropping {
                self.calls += 1;
                out.extend(events);
            }
        } else {
            let text = format!("{}{}{}{close}", call.lead, self.markup.open, call.raw);
            self.content(&text, out);
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let text = match self.after_call {
            true => text.trim_start(),
            false => text,
        };
        if text.is_empty() {
            return;
        }
        self.after_call = false;
        match out.last_mut() {
            Some(ToolEvent::Content(last)) => last.push_str(text),
            _ => out.push(ToolEvent::Content(text.to_string())),
        }
    }
}

#[cfg(test)]
mod tests;
