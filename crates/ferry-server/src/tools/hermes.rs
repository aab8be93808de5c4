//! Hermes tool calls (Qwen3, Qwen2.5): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`. The body is
//! one JSON object, read whole when the call closes, so its arguments come out in one piece, checked.

use serde_json::{Map, Value};

use super::{tool, CallBody, ToolEvent, ToolSpec};

#[derive(Clone)]
pub struct HermesCall;

impl CallBody for HermesCall {
    fn boxed_clone(&self) -> Box<dyn CallBody + Send> {
        Box::new(self.clone())
    }

    fn feed(&mut self, _text: &str, _tools: &[ToolSpec], _index: usize, _out: &mut Vec<ToolEvent>) {}

    fn close(&mut self, raw: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) -> bool {
        let Ok(Value::Object(call)) = serde_json::from_str::<Value>(raw.trim()) else {
            return false;
        };
        let Some(Value::String(name)) = call.get("name") else {
            return false;
        };
        if tool(tools, name).is_none() {
            return false;
        }
        let arguments = match call.get("arguments") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(arguments)) => arguments.clone(),
            // Some models write the arguments as a JSON string, as OpenAI's API carries them.
            Some(Value::String(text)) => match serde_json::from_str(text) {
                Ok(Value::Object(arguments)) => arguments,
                _ => return false,
            },
            Some(_) => return false,
        };
        out.push(ToolEvent::Start {
            index,
            name: name.clone(),
        });
        out.push(ToolEvent::Arguments {
            index,
            fragment: Value::Object(arguments).to_string(),
        });
        true
    }
}
