//! The XML tool calls of Qwen3-Coder, Qwen3.5 and Qwen3.6:
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n...</function>\n</tool_call>`.
//!
//! Values are bare text; the tool's JSON schema says what each is (`"3"` is `3` for an integer parameter, objects
//! and arrays are parsed as JSON, strings stay strings). The call starts once `<function=NAME>` is whole and each
//! parameter becomes a piece of the arguments once its `</parameter>` is seen.

use serde_json::Value;

use super::{tool, CallBody, ToolEvent, ToolSpec};

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

#[derive(Default)]
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

/// Whether `text` could still grow into `tag` or already starts with it.
fn opens_with(text: &str, tag: &str) -> bool {
    text.starts_with(tag) || tag.starts_with(text)
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
                let schema = tool(tools, function).and_then(|t| t.parameters.get("properties")?.get(name));
                let separator = if self.parameters == 0 { "{" } else { "," };
                let fragment = format!("{separator}{}:{}", Value::from(name), convert(raw, schema));
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
        let fragment = if self.parameters == 0 { "{}" } else { "}" };
        out.push(ToolEvent::Arguments {
            index,
            fragment: fragment.into(),
        });
        true
    }
}

/// A parameter's text as the JSON value its schema asks for; text that does not read as any of the schema's
/// types stays a string, as does a parameter the schema does not describe.
fn convert(raw: &str, schema: Option<&Value>) -> Value {
    let types: Vec<&str> = match schema.and_then(|s| s.get("type")) {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    for kind in types {
        let value = match kind {
            "string" => Some(Value::from(raw)),
            "integer" => raw.trim().parse::<i64>().ok().map(Value::from),
            "number" => match raw.trim().parse::<i64>() {
                Ok(n) => Some(Value::from(n)),
                Err(_) => raw
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .and_then(|x| serde_json::Number::from_f64(x).map(Value::Number)),
            },
            "boolean" => match raw.trim().to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "null" => (raw.trim() == "null").then_some(Value::Null),
            "object" => serde_json::from_str(raw).ok().filter(Value::is_object),
            "array" => serde_json::from_str(raw).ok().filter(Value::is_array),
            _ => None,
        };
        if let Some(value) = value {
            return value;
        }
    }
    Value::from(raw)
}
