//! The XML tool calls of Qwen3-Coder, Qwen3.5 and Qwen3.6:
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n...</function>\n</tool_call>`.
//!
//! Values are bare text; the tool's JSON schema says what each is (`"3"` is `3` for an integer parameter, objects
//! and arrays are parsed as JSON, strings stay strings). The call starts once `<function=NAME>` is whole and each
//! parameter becomes a piece of the arguments once its `</parameter>` is seen.

use super::arg_value::{argument_fragment, arguments_end};
use super::{opens_with, tool, CallBody, ToolEvent, ToolSpec};

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

#[derive(Clone, Default)]
pub struct XmlCall {
    buffer: String,
    /// The function, once `<function=NAME>` named a known one.
    function: Option<String>,
    parameters: usize,
    /// Not a call: the body does not open with a known `<function=...>`.
    invalid: bool,
    /// After `</function>`: the rest of the body is ignored.
    done: bool,
}

impl XmlCall {
    /// Reads what is whole in the buffer; stops at the first incomplete element.
    fn advance(&mut self, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        while !self.invalid && !self.done {
            let text = self.buffer.trim_start();
            if text.is_empty() {
                return;
            }
            let skipped = self.buffer.len() - text.len();
            let Some(function) = &self.function else {
                if !opens_with(text, FUNCTION) {
                    self.invalid = true;
                    return;
                }
                let Some(end) = text.find('>') else { return };
                let name = text[FUNCTION.len()..end].trim().to_string();
                if tool(tools, &name).is_none() {
                    self.invalid = true;
                    return;
                }
                out.push(ToolEvent::Start {
                    index,
                    name: name.clone(),
                });
                self.function = Some(name);
                self.buffer.drain(..skipped + end + 1);
                continue;
            };
            if text.starts_with(FUNCTION_END) {
                self.done = true;
                return;
            }
            if text.starts_with(PARAMETER) {
                let Some(name_end) = text.find('>') else { return };
                let Some(value_end) = text[name_end..].find(PARAMETER_END).map(|at| name_end + at) else {
                    return;
                };
                let name = text[PARAMETER.len()..name_end].trim();
                let raw = &text[name_end + 1..value_end];
                // The template writes a newline on each side of the value.
                let raw = raw.strip_prefix('\n').unwrap_or(raw);
                let raw = raw.strip_suffix('\n').unwrap_or(raw);
                let fragment = argument_fragment(self.parameters, raw, tool(tools, function), name);
                out.push(ToolEvent::Arguments { index, fragment });
                self.parameters += 1;
                let consumed = skipped + value_end + PARAMETER_END.len();
                self.buffer.drain(..consumed);
                continue;
            }
            if opens_with(text, FUNCTION_END) || opens_with(text, PARAMETER) {
                return;
            }
            // Stray text between parameters: skipped up to the next tag.
            let next = text[1..].find('<').map_or(text.len(), |at| at + 1);
            self.buffer.drain(..skipped + next);
        }
    }
}

impl CallBody for XmlCall {
    fn boxed_clone(&self) -> Box<dyn CallBody + Send> {
        Box::new(self.clone())
    }

    fn feed(&mut self, text: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        if self.done || self.invalid {
            return;
        }
        self.buffer.push_str(text);
        self.advance(tools, index, out);
    }

    fn close(&mut self, _raw: &str, _tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) -> bool {
        if self.function.is_none() {
            return false;
        }
        // A parameter left open when generation ended is dropped; the arguments stay a JSON object.
        out.push(ToolEvent::Arguments {
            index,
            fragment: arguments_end(self.parameters).into(),
        });
        true
    }
}
