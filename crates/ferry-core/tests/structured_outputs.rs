//! Structured outputs on a real model with random weights (the qwen3_moe fixture, on the CPU backend): whatever a
//! random model would say, every `json_schema` output must parse and validate against its schema, and every
//! `json_object` output must be a JSON object, for greedy and sampled requests batched together.

mod engine_common;

use std::path::Path;
use std::sync::Arc;

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::Backend;
use ferry_core::engine::{
    Event, FinishReason, GrammarCompiler, ModelExecutor, Request, ResponseFormat, SamplingParams, Scheduler,
    SchedulerConfig, SchedulingPolicy,
};
use ferry_core::loader::{Checkpoint, Tokenizer};
use ferry_core::model::Model;
use serde_json::{json, Value};

const MAX_TOKENS: usize = 160;

/// Generates under `format` for each prompt, greedy and at temperature 1 with a few seeds, all in one scheduler;
/// returns each output's text and how it finished.
fn generate(format: &ResponseFormat) -> Vec<(String, FinishReason)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let backend = CpuBackend;
    let model = Model::load(&backend, &checkpoint).unwrap();
    let vocab_size = model.spec.vocab_size;
    let kv = backend.new_kv(model.kv_spec(1024)).unwrap();
    let tokenizer = Arc::new(Tokenizer::load(&dir).unwrap().unwrap());
    let eos = checkpoint.eos_token_ids();
    let constraint = GrammarCompiler::new(&tokenizer, &eos, vocab_size)
        .unwrap()
        .compile(format)
        .unwrap();
    let mut scheduler = Scheduler::new(
        SchedulerConfig {
            max_running: 8,
            max_queued: 8,
            step_tokens: 256,
            max_model_len: 256,
            sampled_vocab: None,
            policy: SchedulingPolicy::Fcfs,
        },
        ModelExecutor::new(backend, model, kv),
        tokenizer,
    )
    .unwrap();
    let samplings = [None, Some(1), Some(2), Some(3), Some(4)];
    let requests = samplings.iter().enumerate().map(|(i, seed)| {
        let prompt: Vec<u32> = (0..7 + i as u32).map(|t| (t * 41 + 3) % 500).collect();
        let mut request = Request::new(prompt, MAX_TOKENS);
        if let Some(seed) = seed {
            request.sampling = SamplingParams {
                temperature: 1.0,
                seed: Some(*seed),
                ..SamplingParams::default()
            };
        }
        request.stop.eos_token_ids = eos.clone();
        request.constraint = Some(constraint.clone());
        request
    });
    engine_common::run_to_the_end(&mut scheduler, requests)
        .into_iter()
        .map(|events| {
            let mut text = String::new();
            for event in events {
                match event {
                    Event::Token { text: piece, .. } => text.push_str(&piece),
                    Event::Finished { reason, .. } => return (text, reason),
                    Event::Failed { message } => panic!("{message}"),
                    Event::PromptToken { .. } => panic!("prompt logprobs were not asked for"),
                }
            }
            panic!("no end after {text:?}")
        })
        .collect()
}

/// Checks `value` against the part of JSON Schema these tests use (type, enum, properties, required,
/// additionalProperties: false, items, minItems/maxItems, minimum/maximum, maxLength).
fn check(value: &Value, schema: &Value) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{value} {why} ({schema})"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            return fail("is not in the enum");
        }
    }
    let Some(kind) = schema.get("type").and_then(Value::as_str) else {
        return Ok(());
    };
    let bound = |key: &str| schema.get(key).and_then(Value::as_i64);
    match (kind, value) {
        ("object", Value::Object(fields)) => {
            let properties = schema["properties"].as_object().unwrap();
            for name in schema["required"].as_array().unwrap() {
                if !fields.contains_key(name.as_str().unwrap()) {
                    return fail(&format!("lacks {name}"));
                }
            }
            for (name, field) in fields {
                match properties.get(name) {
                    Some(sub) => check(field, sub)?,
                    None => return fail(&format!("has the extra property {name}")),
                }
            }
        }
        ("array", Value::Array(items)) => {
            let len = items.len() as i64;
            if bound("minItems").is_some_and(|min| len < min) || bound("maxItems").is_some_and(|max| len > max) {
                return fail("has the wrong number of items");
            }
            for item in items {
                check(item, &schema["items"])?;
            }
        }
        ("integer", Value::Number(n)) if n.is_i64() => {
            let n = n.as_i64().unwrap();
            if bound("minimum").is_some_and(|min| n < min) || bound("maximum").is_some_and(|max| n > max) {
                return fail("is out of bounds");
            }
        }
        ("string", Value::String(s)) => {
            if bound("maxLength").is_some_and(|max| s.chars().count() as i64 > max) {
                return fail("is too long");
            }
        }
        ("boolean", Value::Bool(_)) => {}
        _ => return fail(&format!("is not of type {kind}")),
    }
    Ok(())
}

fn object(properties: Value) -> Value {
    let required: Vec<&String> = properties.as_object().unwrap().keys().collect();
    json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false})
}

#[test]
fn json_schema_output_from_a_random_model_always_validates() {
    let schemas = [
        object(json!({"answer": {"enum": ["yes", "no", "maybe"]}})),
        object(json!({"person": object(json!({
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        }))})),
        object(json!({"tags": {
            "type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3,
        }})),
        object(json!({"n": {"type": "integer", "minimum": -5, "maximum": 300}, "ok": {"type": "boolean"}})),
    ];
    for schema in schemas {
        for (text, finish) in generate(&ResponseFormat::JsonSchema(schema.clone())) {
            assert_eq!(finish, FinishReason::Stop, "{text:?} was cut short under {schema}");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            check(&value, &schema).unwrap();
        }
    }
}

#[test]
fn json_object_output_from_a_random_model_is_an_object() {
    // Any object allows keys and strings without end, which a random model may not close within max_tokens
    // (as with OpenAI, such an output ends with `length`); what ends of itself must parse as an object.
    let outputs = generate(&ResponseFormat::JsonObject);
    let complete: Vec<&String> = outputs
        .iter()
        .filter(|(_, finish)| *finish == FinishReason::Stop)
        .map(|(text, _)| text)
        .collect();
    assert!(complete.len() >= outputs.len() / 2, "{outputs:?}");
    for text in complete {
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value.is_object(), "{text}");
    }
    for (text, _) in &outputs {
        assert!(text.starts_with('{'), "{text:?}");
    }
}
