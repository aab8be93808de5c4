//! The assistant turns of a conversation as the served chat template reads them. The protocols' readers keep what
//! the client sent: an earlier turn's reasoning (OpenAI's `reasoning_content`, Anthropic's thinking blocks) in
//! `ChatMessage::thinking`, a call's arguments as the JSON text or the object they came as. Once the model is known,
//! [`HistoryFormat::adapt`] gives each to the template in the form it renders, as transformers would be given it:
//!
//! - reasoning in the message's `thinking` field where the template reads one (gpt-oss's, which renders it as an
//!   `analysis` message), in `<think>` tags before the content where the template splits those off (Qwen's, GLM's,
//!   DeepSeek's: each then renders or drops it as its own rules say), and a 400 naming the field where the template
//!   renders no reasoning at all;
//! - arguments as the JSON text for a template that concatenates them as a string (DeepSeek-V3.1's: the client's
//!   text as it was sent, an object written as `tojson` writes it), as an object for every other template.

use ferry_core::loader::{python_json, ChatMessage};
use serde_json::Value;

use super::named_json::CALLS_BEGIN;
use crate::error::ApiError;
use crate::LoadedModel;

/// Where a template takes an assistant's earlier reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryReasoning {
    /// The message's `thinking` field.
    Field,
    /// `<think>` tags before the content.
    Tags,
    /// Nowhere.
    Unrendered,
}

/// How the served template wants the assistant turns of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryFormat {
    pub reasoning: HistoryReasoning,
    /// The template concatenates a call's arguments as a string.
    pub arguments_as_text: bool,
}

impl HistoryFormat {
    pub fn of(model: &LoadedModel) -> Self {
        let tokenizer = &model.tokenizer;
        let reasoning = if tokenizer.chat_template_mentions("message.thinking") {
            HistoryReasoning::Field
        } else if model.splits_reasoning() {
            HistoryReasoning::Tags
        } else {
            HistoryReasoning::Unrendered
        };
        HistoryFormat {
            reasoning,
            arguments_as_text: tokenizer.chat_template_mentions(CALLS_BEGIN),
        }
    }

    /// `messages` in the forms this template reads; reasoning it cannot render is a 400 naming
    /// `messages[i].reasoning_content` (only OpenAI's reader keeps reasoning for such a template).
    pub fn adapt(&self, messages: &[ChatMessage]) -> Result<Vec<ChatMessage>, ApiError> {
        messages
            .iter()
            .enumerate()
            .map(|(i, message)| {
                let mut message = message.clone();
                match (self.reasoning, message.thinking.take()) {
                    (_, None) => {}
                    (HistoryReasoning::Field, thinking) => message.thinking = thinking,
                    (HistoryReasoning::Tags, Some(thinking)) => {
                        message.content = format!("<think>\n{thinking}\n</think>\n\n{}", message.content);
                    }
                    (HistoryReasoning::Unrendered, Some(_)) => {
                        let param = format!("messages[{i}].reasoning_content");
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("`{param}`: this model's chat template renders no earlier reasoning"),
                        ));
                    }
                }
                for call in &mut message.tool_calls {
                    call.function.arguments = self.arguments(&call.function.arguments);
                }
                Ok(message)
            })
            .collect()
    }

    /// A call's arguments (an object, or the JSON text of one: the readers check that it is) as the template reads
    /// them.
    fn arguments(&self, arguments: &Value) -> Value {
        match (self.arguments_as_text, arguments) {
            (true, Value::String(_)) | (false, Value::Object(_)) => arguments.clone(),
            (true, object) => python_json(object).into(),
            (false, Value::String(text)) => serde_json::from_str(text).unwrap_or_default(),
            (false, other) => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use ferry_core::loader::Tokenizer;
    use serde_json::json;

    use super::*;
    use crate::body::Body;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
    }

    /// OpenAI `messages` as params.rs reads them.
    fn openai(messages: Value) -> Vec<ChatMessage> {
        let body = json!({ "messages": messages });
        crate::params::messages(&Body::new(body.as_object().unwrap().clone())).unwrap()
    }

    /// A reference case's conversation (tests/fixtures/chat_templates/FAMILY.json, whose renderings
    /// ferry-core's chat_templates test holds equal to transformers') and its tools.
    fn reference(family: &str, conversation: &str) -> (Vec<ChatMessage>, Value) {
        let path = fixtures().join(format!("chat_templates/{family}.json"));
        let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let case = reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["conversation"] == conversation)
            .unwrap();
        let messages = serde_json::from_value(case["messages"].clone()).unwrap();
        (messages, case["tools"].clone())
    }

    /// The template of `template` rendered with the qwen3_moe fixture's tokenizer, as the references were made.
    fn tokenizer(template: &str) -> (tempfile::TempDir, Tokenizer) {
        let scratch = tempfile::tempdir().unwrap();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixtures().join("qwen3_moe").join(file), scratch.path().join(file)).unwrap();
        }
        let template_path = fixtures().join("chat_templates").join(template);
        std::fs::copy(template_path, scratch.path().join("chat_template.jinja")).unwrap();
        let tokenizer = Tokenizer::load(scratch.path()).unwrap().unwrap();
        (scratch, tokenizer)
    }

    /// `messages`, adapted to `format`, render as the reference conversation does, with and without the generation
    /// prompt.
    fn assert_renders_as(format: HistoryFormat, messages: Value, template: &str, family: &str, conversation: &str) {
        let (_dir, tokenizer) = tokenizer(template);
        let (expected, tools) = reference(family, conversation);
        let tools = tools.as_array().cloned().unwrap_or_default();
        let adapted = format.adapt(&openai(messages)).unwrap();
        for prompt in [true, false] {
            let render = |messages: &[ChatMessage]| {
                tokenizer
                    .apply_chat_template(messages, &tools, prompt, &Default::default())
                    .unwrap()
            };
            assert_eq!(render(&adapted), render(&expected), "{conversation}");
        }
    }

    const HARMONY: HistoryFormat = HistoryFormat {
        reasoning: HistoryReasoning::Field,
        arguments_as_text: false,
    };
    const DEEPSEEK: HistoryFormat = HistoryFormat {
        reasoning: HistoryReasoning::Tags,
        arguments_as_text: true,
    };

    #[test]
    fn openai_reasoning_and_string_arguments_reach_gpt_oss_template_as_transformers_renders_them() {
        let call_and_answer = json!([
            {"role": "user", "content": "Weather in Paris and Oslo for 3 days?"},
            {"role": "assistant", "content": "", "reasoning_content": "Paris first.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]},
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "Paris 21, Oslo 4."},
            {"role": "user", "content": "  And 3+3?  "}
        ]);
        let conversation = "thought_call_answered_later";
        assert_renders_as(HARMONY, call_and_answer, "gpt_oss.jinja", "gpt_oss", conversation);
        let answer = json!([
            {"role": "user", "content": "What is 2+2? Say \"four\" — or 4 (ünïcödé, 世界)."},
            {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."}
        ]);
        assert_renders_as(HARMONY, answer, "gpt_oss.jinja", "gpt_oss", "thought_in_last_answer");
    }

    #[test]
    fn deepseek_v3_1_gets_call_arguments_as_the_text_sent_as_transformers_renders_them() {
        let messages = json!([
            {"role": "system", "content": "You are terse.\nAnswer in one line."},
            {"role": "user", "content": "Weather in Paris and Oslo for 3 days?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3, "units": "metric"}}}]},
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
            {"role": "tool", "content": "sunny, 4 C", "tool_call_id": "call_2"},
            {"role": "assistant", "content": "Paris 21, Oslo 4."},
            {"role": "user", "content": "  And 3+3?  "}
        ]);
        let conversation = "text_arguments_parallel_calls_and_answer";
        assert_renders_as(
            DEEPSEEK,
            messages.clone(),
            "deepseek_v3_1.jinja",
            "deepseek_v3_1",
            conversation,
        );
        // Objects, as other templates read them, are refused by DeepSeek's (transformers refuses them too).
        let (_dir, deepseek) = tokenizer("deepseek_v3_1.jinja");
        let objects = HistoryFormat {
            arguments_as_text: false,
            ..DEEPSEEK
        };
        let messages = objects.adapt(&openai(messages)).unwrap();
        assert!(deepseek
            .apply_chat_template(&messages, &[], true, &Default::default())
            .is_err());
    }

    #[test]
    fn reasoning_a_template_cannot_render_is_a_400_and_other_forms_are_converted() {
        let messages = openai(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "reasoning_content": "greet", "tool_calls": [
                {"id": "c", "function": {"name": "f", "arguments": "{\"a\": [1, \"é\"]}"}}]}
        ]));
        let plain = HistoryFormat {
            reasoning: HistoryReasoning::Unrendered,
            arguments_as_text: false,
        };
        let error = plain.adapt(&messages).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("messages[1].reasoning_content"));
        let tags = HistoryFormat {
            reasoning: HistoryReasoning::Tags,
            arguments_as_text: false,
        };
        let adapted = tags.adapt(&messages).unwrap();
        assert_eq!(adapted[1].content, "<think>\ngreet\n</think>\n\nyo");
        assert_eq!(adapted[1].thinking, None);
        assert_eq!(adapted[1].tool_calls[0].function.arguments, json!({"a": [1, "é"]}));
        let text = DEEPSEEK.adapt(&tags.adapt(&messages).unwrap()).unwrap();
        assert_eq!(text[1].tool_calls[0].function.arguments, json!("{\"a\": [1, \"é\"]}"));
    }
}
