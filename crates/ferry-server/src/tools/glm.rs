//! GLM-4.5/4.6 tool calls: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (the
//! line breaks are optional: GLM-4.6 and later write none).
//!
//! The template writes string values as they are and every other value as JSON, so values are read back by the
//! tool's schema as the Qwen XML ones are (arg_value.rs). The call starts once its name is whole (a line break or the
//! first `<arg_key>` ends it) and each argument becomes a piece of the arguments once its `</arg_value>` is seen.

use super::arg_value::{argument_fragment, arguments_end};
use super::{opens_with, start_call, tool, CallBody, ToolEvent, ToolSpec};

const KEY: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";

#[derive(Clone, Default)]
pub struct GlmCall {
    buffer: String,
    /// The function, once its name was read and is a known tool's.
    function: Option<String>,
    arguments: usize,
    /// Not a call: the name is no known tool's.
    invalid: bool,
}

impl GlmCall {
    /// Starts the call named `name` if a tool has that name.
    fn start(&mut self, name: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        let name = name.trim();
        match start_call(tools, name, index, out) {
            true => self.function = Some(name.to_string()),
            false => self.invalid = true,
        }
    }

    /// Reads what is whole in the buffer; stops at the first incomplete element.
    fn advance(&mut self, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        while !self.invalid {
            let Some(function) = &self.function else {
                let lead = self.buffer.len() - self.buffer.trim_start().len();
                let rest = &self.buffer[lead..];
                let Some(end) = rest.find('\n').or_else(|| rest.find(KEY)).map(|at| lead + at) else {
                    return;
                };
                let name: String = self.buffer.drain(..end).collect();
                self.start(&name, tools, index, out);
                continue;
            };
            let text = self.buffer.trim_start();
            let skipped = self.buffer.len() - text.len();
            if text.is_empty() || (opens_with(text, KEY) && !text.starts_with(KEY)) {
                return;
            }
            if !text.starts_with(KEY) {
                // Stray text between arguments: skipped up to the next tag.
                let next = text[1..].find('<').map_or(text.len(), |at| at + 1);
                self.buffer.drain(..skipped + next);
                continue;
            }
            let Some(key_end) = text.find(KEY_END) else { return };
            let Some(value) = text[key_end..].find(VALUE).map(|at| key_end + at + VALUE.len()) else {
                return;
            };
            let Some(value_end) = text[value..].find(VALUE_END).map(|at| value + at) else {
                return;
            };
            let key = text[KEY.len()..key_end].trim();
            let fragment = argument_fragment(self.arguments, &text[value..value_end], tool(tools, function), key);
            out.push(ToolEvent::Arguments { index, fragment });
            self.arguments += 1;
            self.buffer.drain(..skipped + value_end + VALUE_END.len());
        }
    }
}

impl CallBody for GlmCall {
    fn boxed_clone(&self) -> Box<dyn CallBody + Send> {
        Box::new(self.clone())
    }

    fn feed(&mut self, text: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        if self.invalid {
            return;
        }
        self.buffer.push_str(text);
        self.advance(tools, index, out);
    }

    fn close(&mut self, _raw: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) -> bool {
        if self.function.is_none() && !self.invalid {
            // A call without arguments: the whole body is the name.
            let name = std::mem::take(&mut self.buffer);
            self.start(&name, tools, index, out);
        }
        if self.function.is_none() {
            return false;
        }
        // An argument left open when generation ended is dropped; the arguments stay a JSON object.
        out.push(ToolEvent::Arguments {
            index,
            fragment: arguments_end(self.arguments).into(),
        });
        true
    }
}
