//! A chat response's text turned into pieces: reasoning split off first (reasoning.rs), then tool calls parsed out
//! of what is left, so that a call written while reasoning stays reasoning.

use super::{ToolCallParser, ToolEvent};
use crate::reasoning::{ReasoningParser, Split};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// A tool call begins: its index among the response's calls and the function's name.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// The next piece of a call's arguments (a JSON object's text once joined).
    ToolCallArguments {
        index: usize,
        fragment: String,
    },
}

/// The output stage of one chat response; without either parser, text is content.
pub struct OutputParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
}

impl OutputParser {
    pub fn new(reasoning: Option<ReasoningParser>, tools: Option<ToolCallParser>) -> Self {
        OutputParser { reasoning, tools }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let split = match &mut self.reasoning {
            Some(parser) => parser.push(text),
            None => Split {
                reasoning: String::new(),
                content: text.to_string(),
            },
        };
        self.pieces(split, false)
    }

    /// Whatever is held back, at the end of generation.
    pub fn finish(&mut self) -> Vec<Piece> {
        let split = self.reasoning.as_mut().map(ReasoningParser::finish).unwrap_or_default();
        self.pieces(split, true)
    }

    /// Tool calls in the output so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolCallParser::calls)
    }

    pub fn splits_reasoning(&self) -> bool {
        self.reasoning.is_some()
    }

    fn pieces(&mut self, split: Split, last: bool) -> Vec<Piece> {
        let mut out = vec![];
        if !split.reasoning.is_empty() {
            out.push(Piece::Reasoning(split.reasoning));
        }
        let Some(tools) = &mut self.tools else {
            if !split.content.is_empty() {
                out.push(Piece::Content(split.content));
            }
            return out;
        };
        let mut events = tools.push(&split.content);
        if last {
            events.extend(tools.finish());
        }
        out.extend(events.into_iter().map(|event| match event {
            ToolEvent::Content(text) => Piece::Content(text),
            ToolEvent::Start { index, name } => Piece::ToolCallStart { index, name },
            ToolEvent::Arguments { index, fragment } => Piece::ToolCallArguments { index, fragment },
        }));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{ToolCallFormat, ToolSpec};

    #[test]
    fn calls_are_parsed_after_reasoning_and_not_inside_it() {
        let tools = vec![ToolSpec::function("f", None, serde_json::json!({}))];
        let parser = ToolCallParser::new(ToolCallFormat::Hermes, tools, true);
        // Qwen3.5's generation prompt opens <think>.
        let reasoning = ReasoningParser::new("<|im_start|>assistant\n<think>\n");
        let mut output = OutputParser::new(Some(reasoning), Some(parser));
        let mut pieces = vec![];
        for piece in [
            "maybe <tool_call>{\"name\": \"f\"}</tool_call>",
            "</thi",
            "nk>\n\nok <tool_",
            "call>",
            "{\"name\": \"f\"}",
        ] {
            pieces.extend(output.push(piece));
        }
        pieces.extend(output.finish());
        let expected = vec![
            Piece::Reasoning("maybe <tool_call>{\"name\": \"f\"}</tool_call>".into()),
            Piece::Content("ok".into()),
            Piece::ToolCallStart {
                index: 0,
                name: "f".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "{}".into(),
            },
        ];
        assert_eq!(pieces, expected);
        assert_eq!(output.tool_calls(), 1);
    }
}
