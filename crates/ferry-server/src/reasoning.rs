//! Qwen-style reasoning: text between `<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.
//! Works on streamed pieces: a tag split across pieces is held back until it is whole.

use ferry_core::engine::partial_match_len;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Clone, Debug)]
pub struct ReasoningParser {
    in_reasoning: bool,
    /// At the start and just after `</think>`: the newlines the model puts before its answer (or, GLM-4.5, before
    /// its `<think>`) are dropped.
    after_close: bool,
    /// Thinking only at the start of the output (see [`ReasoningParser::leading_only`]).
    leading_only: bool,
    /// Past the point where thinking could begin: the rest is content, tags and all.
    settled: bool,
    pending: String,
}

impl ReasoningParser {
    /// `prompt` is the rendered prompt: templates that open `<think>` themselves (Qwen3.5) start generation inside
    /// the reasoning.
    pub fn new(prompt: &str) -> Self {
        let opened = prompt.rfind(OPEN);
        let closed = prompt.rfind(CLOSE);
        ReasoningParser {
            in_reasoning: opened.is_some() && opened > closed,
            after_close: true,
            leading_only: false,
            settled: false,
            pending: String::new(),
        }
    }

    /// For output whose grammar (forced tool calls) allows thinking only first, and only where `may_open`: once the
    /// thinking ended or content began, a `<think>` tag is text (inside a call's string, say), not reasoning.
    pub fn leading_only(mut self, may_open: bool) -> Self {
        self.leading_only = true;
        self.settled = !may_open && !self.in_reasoning;
        self
    }

    pub fn push(&mut self, piece: &str) -> Split {
        self.pending.push_str(piece);
        let mut out = Split::default();
        loop {
            if self.settled {
                let rest = std::mem::take(&mut self.pending);
                self.emit(&rest, &mut out);
                return out;
            }
            let tag = if self.in_reasoning { CLOSE } else { OPEN };
            if let Some(at) = self.pending.find(tag) {
                let before: String = self.pending.drain(..at + tag.len()).collect();
                self.emit(&before[..at], &mut out);
                if self.settled {
                    // Content came first (leading-only thinking): the tag is the content's text.
                    self.emit(tag, &mut out);
                    continue;
                }
                self.after_close = self.in_reasoning;
                self.settled |= self.leading_only && self.in_reasoning;
                self.in_reasoning = !self.in_reasoning;
                continue;
            }
            let held = partial_match_len(&self.pending, tag);
            let ready: String = self.pending.drain(..self.pending.len() - held).collect();
            self.emit(&ready, &mut out);
            return out;
        }
    }

    /// Whether the text pushed so far ends inside the reasoning: of a push that returns both parts, the part it ends
    /// in came last.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Whatever is held back, at the end of generation.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Split::default();
        self.emit(&rest, &mut out);
        out
    }

    fn emit(&mut self, text: &str, out: &mut Split) {
        if self.in_reasoning {
            out.reasoning.push_str(text);
            return;
        }
        let text = match self.after_close {
            true => text.trim_start_matches('\n'),
            false => text,
        };
        if !text.is_empty() {
            self.after_close = false;
            self.settled |= self.leading_only;
        }
        out.content.push_str(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(prompt: &str, pieces: &[&str]) -> Split {
        let mut parser = ReasoningParser::new(prompt);
        let mut all = Split::default();
        for piece in pieces.iter().copied() {
            let s = parser.push(piece);
            all.reasoning += &s.reasoning;
            all.content += &s.content;
        }
        let s = parser.finish();
        all.reasoning += &s.reasoning;
        all.content += &s.content;
        all
    }

    fn split(reasoning: &str, content: &str) -> Split {
        Split {
            reasoning: reasoning.into(),
            content: content.into(),
        }
    }

    #[test]
    fn thinking_goes_to_reasoning_even_when_tags_are_split() {
        let qwen3_prompt = "<|im_start|>assistant\n";
        assert_eq!(
            split_all(qwen3_prompt, &["<th", "ink>\nhmm", " ok\n</", "think>\n\nHi", "!"]),
            split("\nhmm ok\n", "Hi!")
        );
        assert_eq!(
            split_all(qwen3_prompt, &["plain ", "answer"]),
            split("", "plain answer")
        );
        assert_eq!(split_all(qwen3_prompt, &["a <thi"]), split("", "a <thi"));
    }

    #[test]
    fn templates_that_open_or_close_thinking_set_the_start() {
        let qwen3_5 = "<|im_start|>assistant\n<think>\n";
        assert_eq!(
            split_all(qwen3_5, &["why", "</think>", "\n\nbecause"]),
            split("why", "because")
        );
        let thinking_off = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        assert_eq!(split_all(thinking_off, &["answer"]), split("", "answer"));
        // DeepSeek-V3.1 opens or closes thinking by its `thinking` flag.
        let deepseek_thinking = "<｜User｜>hi<｜Assistant｜><think>";
        assert_eq!(split_all(deepseek_thinking, &["why</th", "ink>so"]), split("why", "so"));
        let deepseek_plain = "<｜User｜>hi<｜Assistant｜></think>";
        assert_eq!(split_all(deepseek_plain, &["so"]), split("", "so"));
        // GLM-4.5 writes a line break before its `<think>`, or (thinking off) finds `<think></think>` in the prompt.
        let glm = "[gMASK]<sop><|user|>\nhi<|assistant|>";
        assert_eq!(split_all(glm, &["\n<think>hm</think>", "\nok"]), split("hm", "ok"));
        let glm_off = "[gMASK]<sop><|user|>\nhi/nothink<|assistant|>\n<think></think>";
        assert_eq!(split_all(glm_off, &["\nok"]), split("", "ok"));
    }

    #[test]
    fn leading_only_thinking_ends_the_split_once_it_or_content_is_over() {
        let split_leading = |prompt: &str, may_open: bool, pieces: &[&str]| {
            let mut parser = ReasoningParser::new(prompt).leading_only(may_open);
            let mut all = Split::default();
            for piece in pieces {
                let s = parser.push(piece);
                all.reasoning += &s.reasoning;
                all.content += &s.content;
            }
            all
        };
        let qwen3 = "<|im_start|>assistant\n";
        let call = "<tool_call>{\"a\": \"<think>x</think>\"}";
        assert_eq!(
            split_leading(qwen3, true, &["<thi", "nk>hm</think>\n\n", call]),
            split("hm", call)
        );
        assert_eq!(split_leading(qwen3, true, &[call]), split("", call));
        assert_eq!(
            split_leading(qwen3, false, &["<think>", call]),
            split("", &format!("<think>{call}"))
        );
        let qwen3_5 = "<|im_start|>assistant\n<think>\n";
        assert_eq!(
            split_leading(qwen3_5, false, &["why</think>", call]),
            split("why", call)
        );
    }
}
