//! Calls written as a name, a separator and the arguments' JSON text: DeepSeek-V3.1's
//! `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (a group of them between
//! `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`), and Harmony's call messages, which harmony.rs hands over in
//! the same shape. The call starts once the separator is seen and the arguments stream as they are written.

use super::{start_call, CallBody, ToolEvent, ToolSpec};

pub const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
pub const CALL_END: &str = "<｜tool▁call▁end｜>";
pub const SEPARATOR: &str = "<｜tool▁sep｜>";
pub const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub const CALLS_END: &str = "<｜tool▁calls▁end｜>";

#[derive(Clone, Default)]
pub struct NamedJsonCall {
    /// The name as far as it was written, until the separator.
    name: String,
    started: bool,
    /// Not a call: the name is no known tool's.
    invalid: bool,
    arguments_sent: bool,
}

impl NamedJsonCall {
    fn arguments(&mut self, text: &str, index: usize, out: &mut Vec<ToolEvent>) {
        let text = match self.arguments_sent {
            true => text,
            false => text.trim_start(),
        };
        if !text.is_empty() {
            self.arguments_sent = true;
            out.push(ToolEvent::Arguments {
                index,
                fragment: text.to_string(),
            });
        }
    }
}

impl CallBody for NamedJsonCall {
    fn boxed_clone(&self) -> Box<dyn CallBody + Send> {
        Box::new(self.clone())
    }

    fn feed(&mut self, text: &str, tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) {
        if self.invalid {
            return;
        }
        if self.started {
            self.arguments(text, index, out);
            return;
        }
        self.name.push_str(text);
        let Some(at) = self.name.find(SEPARATOR) else { return };
        let arguments = self.name.split_off(at + SEPARATOR.len());
        self.started = start_call(tools, self.name[..at].trim(), index, out);
        self.invalid = !self.started;
        if self.started {
            self.arguments(&arguments, index, out);
        }
    }

    fn close(&mut self, _raw: &str, _tools: &[ToolSpec], index: usize, out: &mut Vec<ToolEvent>) -> bool {
        if self.started && !self.arguments_sent {
            self.arguments("{}", index, out);
        }
        self.started
    }
}
