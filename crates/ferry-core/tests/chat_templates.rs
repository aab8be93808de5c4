//! The real chat templates of Qwen3, Qwen3.5 (as shipped with Qwen3.6), Mixtral-Instruct and OLMoE render what HF
//! transformers' apply_chat_template renders: tests/fixtures/chat_templates/*.json hold transformers' output for a
//! set of conversations (made by scripts/make_template_refs.py), and conversations a template refuses must be
//! refused here too. The Qwen families also render tool conversations: tool definitions, assistant tool calls
//! (arguments as objects) and tool results. So do gpt-oss (Harmony, with `reasoning_effort` and earlier reasoning
//! in `thinking`), GLM-4.5 and DeepSeek-V3.1 (which refuses calls whose arguments are not a string).

use std::path::{Path, PathBuf};

use ferry_core::loader::{ChatMessage, Tokenizer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The fixture's tokenizer, with the reference file's template when it names one.
fn tokenizer_for(reference: &Value, scratch: &Path) -> Tokenizer {
    let fixture = fixtures().join(reference["fixture"].as_str().unwrap());
    let dir = match reference["template_file"].as_str() {
        None => fixture,
        Some(template) => {
            for file in ["tokenizer.json", "tokenizer_config.json"] {
                std::fs::copy(fixture.join(file), scratch.join(file)).unwrap();
            }
            let template_path = fixtures().join("..").join("..").join(template);
            std::fs::copy(template_path, scratch.join("chat_template.jinja")).unwrap();
            scratch.to_path_buf()
        }
    };
    Tokenizer::load(&dir).unwrap().unwrap()
}

fn check_family(name: &str) {
    let path = fixtures().join("chat_templates").join(format!("{name}.json"));
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer_for(&reference, scratch.path());
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 14, "{name}: too few cases");
    for case in cases {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
        let kwargs = case["chat_template_kwargs"].as_object().unwrap();
        let tools = case.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
        let rendered = tokenizer.apply_chat_template(&messages, &tools, add_generation_prompt, kwargs);
        let label = format!(
            "{name} / {} / add_generation_prompt={add_generation_prompt} / {kwargs:?}",
            case["conversation"]
        );
        match (&case["expected"], rendered) {
            (Value::String(expected), Ok(text)) => assert_eq!(mask_date(&text), mask_date(expected), "{label}"),
            (Value::Null, Err(_)) => {}
            (expected, got) => panic!("{label}: expected {expected:?}, got {got:?}"),
        }
    }
}

#[test]
fn qwen3_renders_as_transformers_does() {
    check_family("qwen3");
}

#[test]
fn gpt_oss_renders_as_transformers_does() {
    check_family("gpt_oss");
}

#[test]
fn glm4_5_renders_as_transformers_does() {
    check_family("glm4_5");
}

#[test]
fn deepseek_v3_1_renders_as_transformers_does() {
    check_family("deepseek_v3_1");
}

#[test]
fn qwen_references_include_tool_conversations() {
    for name in ["qwen3", "qwen3_5"] {
        let path = fixtures().join("chat_templates").join(format!("{name}.json"));
        let reference: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let cases = reference["cases"].as_array().unwrap();
        let with_tools = cases.iter().filter(|c| c.get("tools").is_some()).count();
        let with_calls = cases
            .iter()
            .filter(|c| c["expected"].as_str().is_some_and(|e| e.contains("<tool_call>\n")))
            .count();
        assert!(
            with_tools >= 20 && with_calls >= 20,
            "{name}: {with_tools} tool cases, {with_calls} with calls"
        );
    }
}

#[test]
fn qwen3_5_renders_as_transformers_does() {
    check_family("qwen3_5");
}

#[test]
fn mixtral_renders_as_transformers_does() {
    check_family("mixtral");
}

#[test]
fn olmoe_renders_as_transformers_does() {
    check_family("olmoe");
}

/// gpt-oss's template writes today's date: both sides are compared with it masked.
fn mask_date(text: &str) -> String {
    match text.find("Current date: ") {
        Some(at) => {
            let date = at + "Current date: ".len();
            format!("{}YYYY-MM-DD{}", &text[..date], &text[date + "YYYY-MM-DD".len()..])
        }
        None => text.to_string(),
    }
}
