//! The Harmony parser on gpt-oss outputs, fed whole, at every split point and one character at a time.

use serde_json::json;

use super::*;
use crate::tools::{ToolCallFormat, ToolSpec};

fn calls(parallel: bool) -> ToolCallParser {
    let weather = ToolSpec::function("get_weather", None, json!({"type": "object"}));
    ToolCallParser::new(ToolCallFormat::Harmony, vec![weather], parallel)
}

#[derive(Debug, Default, PartialEq)]
struct Outcome {
    reasoning: String,
    content: String,
    /// (name, arguments joined)
    calls: Vec<(String, String)>,
}

fn run(tools: bool, pieces: &[&str]) -> Outcome {
    let mut parser = HarmonyParser::new(|_| None, tools.then(|| calls(true)));
    let mut out = vec![];
    for piece in pieces {
        out.extend(parser.push(piece));
    }
    out.extend(parser.finish());
    let mut outcome = Outcome::default();
    for piece in out {
        match piece {
            Piece::Reasoning(text) => outcome.reasoning += &text,
            Piece::Content(text) => outcome.content += &text,
            Piece::ToolCallStart { index, name } => {
                assert_eq!(index, outcome.calls.len());
                outcome.calls.push((name, String::new()));
            }
            Piece::ToolCallArguments { index, fragment } => outcome.calls[index].1 += &fragment,
        }
    }
    assert_eq!(parser.calls(), outcome.calls.len());
    outcome
}

/// The outcome of `text` whole, after checking that every way of cutting it gives the same.
fn parse(tools: bool, text: &str) -> Outcome {
    let whole = run(tools, &[text]);
    for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        assert_eq!(run(tools, &[&text[..cut], &text[cut..]]), whole, "cut at {cut}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(tools, &pieces), whole, "one character at a time");
    whole
}

fn outcome(reasoning: &str, content: &str, calls: &[(&str, &str)]) -> Outcome {
    Outcome {
        reasoning: reasoning.into(),
        content: content.into(),
        calls: calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect(),
    }
}

#[test]
fn analysis_is_reasoning_and_final_is_content() {
    let text = "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>\
                Hello! <b>ok</b><|return|>";
    assert_eq!(parse(false, text), outcome("User says hi.", "Hello! <b>ok</b>", &[]));
}

#[test]
fn a_commentary_message_to_a_function_is_a_call() {
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 3}<|call|>";
    let call = ("get_weather", "{\"city\": \"Paris\", \"days\": 3}");
    assert_eq!(parse(true, text), outcome("Need the weather.", "", &[call]));
    // The recipient may come before the channel, and the arguments may be empty.
    let early = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|><|call|>";
    assert_eq!(parse(true, early), outcome("", "", &[("get_weather", "{}")]));
}

#[test]
fn messages_to_anyone_else_stay_reasoning() {
    let builtin = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis to=browser.search \
                   code<|message|>{\"query\": \"x\"}<|call|>";
    assert_eq!(parse(true, builtin), outcome("a{\"query\": \"x\"}", "", &[]));
    let not_offered = "<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>";
    assert_eq!(parse(false, not_offered), outcome("{}", "", &[]));
    let unknown = "<|channel|>commentary to=functions.launch<|message|>{}<|call|>";
    assert_eq!(parse(true, unknown), outcome("{}", "", &[]));
}

#[test]
fn a_preamble_is_content_and_calls_after_it_are_numbered() {
    let text = "<|channel|>commentary<|message|>Checking two cities.<|end|><|start|>assistant to=functions.get_weather\
                <|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|end|><|start|>assistant to=functions.\
                get_weather<|channel|>commentary json<|message|>{\"city\": \"Rome\"}<|call|>";
    let calls = [
        ("get_weather", "{\"city\": \"Oslo\"}"),
        ("get_weather", "{\"city\": \"Rome\"}"),
    ];
    assert_eq!(parse(true, text), outcome("", "Checking two cities.", &calls));
}

#[test]
fn the_end_of_generation_closes_a_body_and_plain_text_is_content() {
    let cut = "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Oslo\"}";
    assert_eq!(
        parse(true, cut),
        outcome("", "", &[("get_weather", "{\"city\": \"Oslo\"}")])
    );
    assert_eq!(parse(false, "no harmony < here"), outcome("", "no harmony < here", &[]));
    assert_eq!(parse(false, "<|channel|>final"), outcome("", "", &[]));
}

#[test]
fn markup_tokens_are_known_by_id() {
    let parser = HarmonyParser::new(
        |token| MARKERS.iter().position(|m| *m == token).map(|i| 100 + i as u32),
        None,
    );
    assert_eq!(parser.marker(100), Some(START));
    assert_eq!(parser.marker(102), Some(MESSAGE));
    assert_eq!(parser.marker(7), None);
}
