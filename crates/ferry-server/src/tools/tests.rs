//! The parsers on sample outputs of both formats, fed whole, at every split point, and one character at a time:
//! every way of cutting the text must give the same content and calls, and valid calls never leave markup in the
//! content.

use serde_json::{json, Value};

use super::*;

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec::function(
            "get_weather",
            None,
            json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "zip": {"type": "string"}, "scale": {"type": ["number", "null"]}}}),
        ),
        ToolSpec::function(
            "search",
            None,
            json!({"type": "object", "properties": {"filters": {"type": "object"}, "sites": {"type": "array"}}}),
        ),
    ]
}

#[derive(Debug, Default, PartialEq)]
struct Outcome {
    content: String,
    /// (name, arguments joined)
    calls: Vec<(String, String)>,
}

fn run(format: ToolCallFormat, parallel: bool, pieces: &[&str]) -> Outcome {
    let mut parser = ToolCallParser::new(format, tools(), parallel);
    let mut events = vec![];
    for piece in pieces {
        events.extend(parser.push(piece));
    }
    events.extend(parser.finish());
    let mut outcome = Outcome::default();
    for event in events {
        match event {
            ToolEvent::Content(text) => {
                assert!(!text.is_empty(), "no empty content events");
                outcome.content += &text;
            }
            ToolEvent::Start { index, name } => {
                assert_eq!(index, outcome.calls.len(), "calls are numbered in order");
                outcome.calls.push((name, String::new()));
            }
            ToolEvent::Arguments { index, fragment } => {
                assert_eq!(index + 1, outcome.calls.len(), "arguments follow their call's start");
                outcome.calls[index].1 += &fragment;
            }
        }
    }
    assert_eq!(parser.calls(), outcome.calls.len());
    outcome
}

/// The outcome of `text` whole, after checking that every way of cutting it gives the same.
fn parse(format: ToolCallFormat, parallel: bool, text: &str) -> Outcome {
    let whole = run(format, parallel, &[text]);
    let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    for &cut in &boundaries {
        let split = run(format, parallel, &[&text[..cut], &text[cut..]]);
        assert_eq!(split, whole, "cut at {cut}: {:?} | {:?}", &text[..cut], &text[cut..]);
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(format, parallel, &pieces), whole, "one character at a time");
    for (_, arguments) in &whole.calls {
        assert!(
            serde_json::from_str::<Value>(arguments).is_ok_and(|v| v.is_object()),
            "arguments are a JSON object: {arguments}"
        );
    }
    whole
}

fn outcome(content: &str, calls: &[(&str, Value)]) -> Outcome {
    Outcome {
        content: content.into(),
        calls: calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect(),
    }
}

const HERMES: ToolCallFormat = ToolCallFormat::Hermes;
const XML: ToolCallFormat = ToolCallFormat::Qwen3Xml;

#[test]
fn hermes_call_after_text() {
    let text = "Let me check.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
    assert_eq!(
        parse(HERMES, true, text),
        outcome("Let me check.", &[("get_weather", json!({"city": "Paris", "days": 3}))])
    );
}

#[test]
fn hermes_two_calls_in_a_row_then_text() {
    let text =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n\
                {\"name\": \"search\", \"arguments\": \"{\\\"sites\\\": [\\\"a\\\"]}\"}\n</tool_call>\n\nDone.\n";
    let calls = [
        ("get_weather", json!({"city": "Oslo"})),
        ("search", json!({"sites": ["a"]})),
    ];
    assert_eq!(parse(HERMES, true, text), outcome("Done.\n", &calls));
    assert_eq!(
        parse(HERMES, false, text),
        outcome("Done.\n", &calls[..1]),
        "parallel_tool_calls: false keeps the first call"
    );
}

#[test]
fn hermes_what_is_not_a_call_stays_text() {
    let malformed = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    assert_eq!(parse(HERMES, true, malformed), outcome(malformed, &[]));
    let unknown = "Hi <tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call> bye";
    assert_eq!(
        parse(HERMES, true, unknown),
        outcome(
            "Hi <tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call> bye",
            &[]
        )
    );
    let bad_arguments = "<tool_call>{\"name\": \"search\", \"arguments\": [1]}</tool_call>";
    assert_eq!(parse(HERMES, true, bad_arguments), outcome(bad_arguments, &[]));
    let plain = "if a < b and <tool> or <tool_cal then\n  x ";
    assert_eq!(parse(HERMES, true, plain), outcome(plain, &[]));
}

#[test]
fn hermes_call_cut_off_by_the_end_of_generation() {
    let closed_json = "<tool_call>\n{\"name\": \"search\"}\n";
    assert_eq!(parse(HERMES, true, closed_json), outcome("", &[("search", json!({}))]));
    let cut = "<tool_call>\n{\"name\": \"search\", \"argu";
    assert_eq!(parse(HERMES, true, cut), outcome(cut, &[]));
}

#[test]
fn xml_call_with_typed_parameters() {
    let text = "I'll look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n\
                <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=zip>\n01234\n\
                </parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=note>\n{\"a\": 1}\n</parameter>\n\
                </function>\n</tool_call>";
    let arguments = json!({"city": "New\nYork", "days": 3, "metric": true, "zip": "01234", "scale": 1.5,
                           "note": "{\"a\": 1}"});
    assert_eq!(
        parse(XML, true, text),
        outcome("I'll look.", &[("get_weather", arguments)])
    );
}

#[test]
fn xml_values_that_do_not_read_as_their_type_stay_strings() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n\
                <parameter=scale>\nnull\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        parse(XML, true, text),
        outcome("", &[("get_weather", json!({"days": "three", "scale": null}))])
    );
}

#[test]
fn xml_two_calls_with_json_values_then_text() {
    let text = "<tool_call>\n<function=search>\n<parameter=filters>\n{\"lang\": \"en\", \"n\": [1, 2]}\n</parameter>\n\
                <parameter=sites>\n[\"a.no\", 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
                <function=get_weather>\n</function>\n</tool_call>\nThat is all.";
    let calls = [
        (
            "search",
            json!({"filters": {"lang": "en", "n": [1, 2]}, "sites": ["a.no", 2]}),
        ),
        ("get_weather", json!({})),
    ];
    assert_eq!(parse(XML, true, text), outcome("That is all.", &calls));
    assert_eq!(parse(XML, false, text), outcome("That is all.", &calls[..1]));
}

#[test]
fn xml_what_is_not_a_call_stays_text() {
    let unknown = "<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(parse(XML, true, unknown), outcome(unknown, &[]));
    let no_function = "<tool_call>\nget_weather(Paris)\n</tool_call>";
    assert_eq!(parse(XML, true, no_function), outcome(no_function, &[]));
    let hermes_in_xml = "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(parse(XML, true, hermes_in_xml), outcome(hermes_in_xml, &[]));
}

#[test]
fn xml_call_cut_off_by_the_end_of_generation() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3";
    assert_eq!(
        parse(XML, true, text),
        outcome("", &[("get_weather", json!({"city": "Paris"}))])
    );
}

#[test]
fn xml_arguments_stream_one_parameter_at_a_time() {
    let mut parser = ToolCallParser::new(XML, tools(), true);
    let mut events = parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa");
    assert_eq!(
        events,
        vec![ToolEvent::Start {
            index: 0,
            name: "get_weather".into()
        }]
    );
    events = parser.push("ris\n</parameter>\n<param");
    assert_eq!(
        events,
        vec![ToolEvent::Arguments {
            index: 0,
            fragment: "{\"city\":\"Paris\"".into()
        }]
    );
    events = parser.push("eter=days>\n2\n</parameter>\n</function>\n</tool_call>");
    events.extend(parser.finish());
    let fragments: Vec<ToolEvent> = [",\"days\":2", "}"]
        .iter()
        .map(|f| ToolEvent::Arguments {
            index: 0,
            fragment: f.to_string(),
        })
        .collect();
    assert_eq!(events, fragments);
}

#[test]
fn the_parser_is_picked_from_the_template_or_named() {
    assert_eq!(
        "hermes".parse::<ToolCallParserChoice>(),
        Ok(ToolCallParserChoice::Format(HERMES))
    );
    assert_eq!(
        "qwen3_xml".parse::<ToolCallParserChoice>(),
        Ok(ToolCallParserChoice::Format(XML))
    );
    assert_eq!("none".parse::<ToolCallParserChoice>(), Ok(ToolCallParserChoice::Off));
    assert!("json".parse::<ToolCallParserChoice>().unwrap_err().contains("hermes"));
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let qwen3 = ferry_core::loader::Tokenizer::load(&fixtures.join("qwen3_moe"))
        .unwrap()
        .unwrap();
    assert_eq!(ToolCallParserChoice::FromTemplate.format(&qwen3), Some(HERMES));
    assert_eq!(ToolCallParserChoice::Off.format(&qwen3), None);
    assert_eq!(ToolCallParserChoice::Format(XML).format(&qwen3), Some(XML));
    let scratch = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures.join("qwen3_moe").join(file), scratch.path().join(file)).unwrap();
    }
    std::fs::copy(
        fixtures.join("chat_templates/qwen3_5.jinja"),
        scratch.path().join("chat_template.jinja"),
    )
    .unwrap();
    let qwen3_5 = ferry_core::loader::Tokenizer::load(scratch.path()).unwrap().unwrap();
    assert_eq!(ToolCallParserChoice::FromTemplate.format(&qwen3_5), Some(XML));
    let mixtral = ferry_core::loader::Tokenizer::load(&fixtures.join("mixtral"))
        .unwrap()
        .unwrap();
    assert_eq!(ToolCallParserChoice::FromTemplate.format(&mixtral), None);
}

const GLM: ToolCallFormat = ToolCallFormat::Glm45;
const DEEPSEEK: ToolCallFormat = ToolCallFormat::DeepSeekV31;

#[test]
fn glm_call_with_typed_arguments() {
    let text = "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New\nYork</arg_value>\n\
                <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true\
                </arg_value>\n<arg_key>note</arg_key>\n<arg_value>{\"a\": 1}</arg_value>\n</tool_call>";
    let arguments = json!({"city": "New\nYork", "days": 3, "metric": true, "note": "{\"a\": 1}"});
    assert_eq!(
        parse(GLM, true, text),
        outcome("Checking.", &[("get_weather", arguments)])
    );
}

#[test]
fn glm_calls_without_line_breaks_and_without_arguments() {
    // GLM-4.6 and later write no line breaks between the elements.
    let text = "<tool_call>search<arg_key>filters</arg_key><arg_value>{\"lang\": \"en\"}</arg_value><arg_key>sites\
                </arg_key><arg_value>[\"a.no\", 2]</arg_value></tool_call><tool_call>get_weather</tool_call>Done.";
    let calls = [
        ("search", json!({"filters": {"lang": "en"}, "sites": ["a.no", 2]})),
        ("get_weather", json!({})),
    ];
    assert_eq!(parse(GLM, true, text), outcome("Done.", &calls));
    assert_eq!(parse(GLM, false, text), outcome("Done.", &calls[..1]));
}

#[test]
fn glm_what_is_not_a_call_stays_text_and_a_cut_call_closes() {
    let unknown = "<tool_call>launch\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>";
    assert_eq!(parse(GLM, true, unknown), outcome(unknown, &[]));
    let cut = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days";
    assert_eq!(
        parse(GLM, true, cut),
        outcome("", &[("get_weather", json!({"city": "Paris"}))])
    );
}

#[test]
fn deepseek_group_of_calls_after_text() {
    // The arguments come out as written (compact here, so that they compare equal to `json!`'s text).
    let text = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":\"Paris\",\
                \"days\":3}<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"sites\":[\"a\"]}\
                <｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let calls = [
        ("get_weather", json!({"city": "Paris", "days": 3})),
        ("search", json!({"sites": ["a"]})),
    ];
    assert_eq!(parse(DEEPSEEK, true, text), outcome("Let me check.", &calls));
    assert_eq!(parse(DEEPSEEK, false, text), outcome("Let me check.", &calls[..1]));
}

#[test]
fn deepseek_unknown_tool_stays_text_and_a_cut_call_closes() {
    let unknown =
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>launch<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        parse(DEEPSEEK, true, unknown),
        outcome("<｜tool▁call▁begin｜>launch<｜tool▁sep｜>{}<｜tool▁call▁end｜>", &[])
    );
    let cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":\"Oslo\"}";
    assert_eq!(
        parse(DEEPSEEK, true, cut),
        outcome("", &[("get_weather", json!({"city": "Oslo"}))])
    );
    let no_arguments = "<｜tool▁call▁begin｜>search<｜tool▁sep｜><｜tool▁call▁end｜>";
    assert_eq!(
        parse(DEEPSEEK, true, no_arguments),
        outcome("", &[("search", json!({}))])
    );
}

#[test]
fn deepseek_arguments_stream_as_written() {
    let mut parser = ToolCallParser::new(DEEPSEEK, tools(), true);
    let mut events = parser.push("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜> {\"ci");
    events.extend(parser.push("ty\": \"Paris\"}<｜tool▁call▁end｜>"));
    let start = ToolEvent::Start {
        index: 0,
        name: "get_weather".into(),
    };
    let fragment = |f: &str| ToolEvent::Arguments {
        index: 0,
        fragment: f.into(),
    };
    assert_eq!(events, vec![start, fragment("{\"ci"), fragment("ty\": \"Paris\"}")]);
}

#[test]
fn the_new_formats_are_picked_from_their_templates_or_named() {
    for (name, format) in [
        ("glm45", GLM),
        ("deepseek_v31", DEEPSEEK),
        ("harmony", ToolCallFormat::Harmony),
    ] {
        assert_eq!(
            name.parse::<ToolCallParserChoice>(),
            Ok(ToolCallParserChoice::Format(format))
        );
    }
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for (template, format) in [
        ("glm4_5.jinja", GLM),
        ("deepseek_v3_1.jinja", DEEPSEEK),
        ("gpt_oss.jinja", ToolCallFormat::Harmony),
    ] {
        let scratch = tempfile::tempdir().unwrap();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixtures.join("qwen3_moe").join(file), scratch.path().join(file)).unwrap();
        }
        std::fs::copy(
            fixtures.join("chat_templates").join(template),
            scratch.path().join("chat_template.jinja"),
        )
        .unwrap();
        let tokenizer = ferry_core::loader::Tokenizer::load(scratch.path()).unwrap().unwrap();
        assert_eq!(
            ToolCallParserChoice::FromTemplate.format(&tokenizer),
            Some(format),
            "{template}"
        );
    }
}
