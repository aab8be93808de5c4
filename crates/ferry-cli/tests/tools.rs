//! Forced tool calls over OpenAI's chat completions (`tool_choice` "required", a named function, or
//! `allowed_tools`), plain and streamed: on the scripted checkpoint they are the calls the model makes unforced; on a
//! random model, in each format that tags its calls (Hermes, Qwen XML, GLM-4.5, DeepSeek-V3.1), every answer is calls
//! of declared tools (the allowed ones) with arguments valid under their schemas. (Harmony's forced calls:
//! scripts/openai_client_test.py.) Also vLLM's `include_reasoning: false`, which leaves the reasoning out.

mod common;

use std::path::Path;

use common::{chat, Server, KEY};
use serde_json::{json, Value};

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    path.to_str().unwrap().to_string()
}

fn serve(model: &str, extra: &[&str]) -> Server {
    let model = fixture(model);
    Server::start_serving(&[&["--model", model.as_str(), "--api-key", KEY], extra].concat())
}

fn weather(city: Value) -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": city, "days": {"type": "integer", "minimum": 1,
        "maximum": 9}}, "required": ["city"], "additionalProperties": false}}})
}

/// A tool without arguments; closed, or a random model may write keys of its own until `max_tokens`.
fn clock() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
        "additionalProperties": false}}})
}

/// (name, arguments) of each call in an answer's `tool_calls`, the arguments parsed from their JSON text.
fn calls_of(tool_calls: &Value) -> Vec<(String, Value)> {
    tool_calls
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|call| {
                    let arguments = call["function"]["arguments"].as_str().unwrap();
                    let arguments = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments}: {e}"));
                    (call["function"]["name"].as_str().unwrap().to_string(), arguments)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A whole answer: its content, calls and finish reason.
fn answer(server: &Server, body: &Value) -> (Value, Vec<(String, Value)>, String) {
    let (status, response) = server.post("/v1/chat/completions", body);
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    let message = &choice["message"];
    let finish = choice["finish_reason"].as_str().unwrap().to_string();
    (message["content"].clone(), calls_of(&message["tool_calls"]), finish)
}

/// The same from a streamed answer: the content joined, the calls' deltas put together.
fn streamed_answer(server: &Server, body: &Value) -> (String, Vec<(String, Value)>, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut content = String::new();
    let mut calls: Vec<Value> = vec![];
    let mut finish = String::new();
    for data in server.post_stream("/v1/chat/completions", &body) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        content += delta["content"].as_str().unwrap_or_default();
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                assert!(call["id"].is_string() && call["function"]["name"].is_string(), "{call}");
                calls.push(json!({"function": {"name": call["function"]["name"], "arguments": ""}}));
            }
            let arguments = calls[index]["function"]["arguments"].as_str().unwrap().to_string();
            let fragment = call["function"]["arguments"].as_str().unwrap_or_default();
            calls[index]["function"]["arguments"] = (arguments + fragment).into();
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = reason.to_string();
        }
    }
    (content, calls_of(&Value::Array(calls)), finish)
}

#[test]
fn forced_choices_give_the_calls_the_scripted_model_makes_unforced_plain_and_streamed() {
    let server = serve("tool_calls_qwen3_xml", &[]);
    let question = "What is the weather in Paris and Oslo?";
    let tools = json!([clock(), weather(json!({"type": "string"}))]);
    let body = |extra: Value| {
        let mut body = chat(question, json!({"tools": tools, "max_tokens": 200, "temperature": 0}));
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let (_, unforced, finish) = answer(&server, &body(json!({})));
    assert_eq!(finish, "tool_calls");
    let expected = vec![
        ("get_weather".to_string(), json!({"city": "Paris", "days": 3})),
        ("get_weather".to_string(), json!({"city": "Oslo"})),
    ];
    assert_eq!(unforced, expected);

    let required = body(json!({"tool_choice": "required"}));
    let (content, calls, finish) = answer(&server, &required);
    assert_eq!(
        (content, calls, finish.as_str()),
        (Value::Null, expected.clone(), "tool_calls")
    );
    let (content, calls, finish) = streamed_answer(&server, &required);
    assert_eq!(
        (content.as_str(), calls, finish.as_str()),
        ("", expected.clone(), "tool_calls")
    );

    // Named, one call only: the model's first.
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let named = body(json!({"tool_choice": named, "parallel_tool_calls": false}));
    let (_, calls, finish) = answer(&server, &named);
    assert_eq!((calls, finish.as_str()), (expected[..1].to_vec(), "tool_calls"));
    let (_, calls, _) = streamed_answer(&server, &named);
    assert_eq!(calls, expected[..1].to_vec());

    // Two choices: each makes the scripted calls, with ids of its own.
    let (status, whole) = server.post("/v1/chat/completions", &body(json!({"n": 2})));
    assert_eq!(status, 200, "{whole}");
    let mut ids = vec![];
    for (i, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            (choice["index"].clone(), &choice["finish_reason"]),
            (json!(i), &json!("tool_calls"))
        );
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        let named: Vec<(String, Value)> = calls
            .iter()
            .map(|c| {
                let arguments = c["function"]["arguments"].as_str().unwrap();
                (
                    c["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(arguments).unwrap(),
                )
            })
            .collect();
        assert_eq!(named, expected, "choice {i}");
        ids.extend(calls.iter().map(|c| c["id"].as_str().unwrap().to_string()));
    }
    assert_eq!(ids.len(), 4);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "every call has an id of its own: {whole}");
}

#[test]
fn include_reasoning_false_leaves_the_reasoning_out_plain_and_streamed() {
    // The scripted Hermes checkpoint thinks, says a sentence, then calls the tool.
    let server = serve("tool_calls_hermes", &[]);
    let body = |include: Option<bool>| {
        let mut body = chat(
            "What is the weather in Paris?",
            json!({"tools": [weather(json!({"type": "string"}))], "max_tokens": 200, "temperature": 0}),
        );
        if let Some(include) = include {
            body["include_reasoning"] = json!(include);
        }
        body
    };
    let reasoning_of = |body: &Value| -> (Value, String) {
        let (_, whole) = server.post("/v1/chat/completions", body);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let deltas: String = server
            .post_stream("/v1/chat/completions", &streamed)
            .iter()
            .filter(|data| *data != "[DONE]")
            .filter_map(|data| {
                let chunk: Value = serde_json::from_str(data).unwrap();
                chunk["choices"][0]["delta"]["reasoning_content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        (
            whole["choices"][0]["message"]
                .get("reasoning_content")
                .cloned()
                .unwrap_or(Value::Null),
            deltas,
        )
    };
    for include in [None, Some(true)] {
        let (whole, streamed) = reasoning_of(&body(include));
        assert_eq!(whole, json!("\nThe user wants the weather.\n"), "{include:?}");
        assert_eq!(streamed, "\nThe user wants the weather.\n");
    }
    assert_eq!(reasoning_of(&body(Some(false))), (Value::Null, String::new()));
    // Either way the reasoning was generated, and the usage counts it, as the Responses API does for the same answer.
    let reasoning_tokens = |body: &Value| {
        let (_, whole) = server.post("/v1/chat/completions", body);
        let usage = &whole["usage"];
        let reasoning = usage["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
        assert!(
            reasoning > 0 && reasoning < usage["completion_tokens"].as_u64().unwrap(),
            "{usage}"
        );
        reasoning
    };
    let counted = reasoning_tokens(&body(None));
    assert_eq!(reasoning_tokens(&body(Some(false))), counted);
    let (_, response) = server.post(
        "/v1/responses",
        &json!({"model": "tiny", "input": "What is the weather in Paris?", "max_output_tokens": 200,
                "temperature": 0, "tools": [{"type": "function", "name": "get_weather",
                "parameters": weather(json!({"type": "string"}))["function"]["parameters"]}]}),
    );
    assert_eq!(
        response["usage"]["output_tokens_details"]["reasoning_tokens"],
        json!(counted),
        "{response}"
    );
    // The rest of the answer is the same.
    let (content, calls, finish) = answer(&server, &body(Some(false)));
    assert_eq!(
        answer(&server, &body(None)),
        (content.clone(), calls.clone(), finish.clone())
    );
    assert_eq!(
        streamed_answer(&server, &body(Some(false))),
        streamed_answer(&server, &body(None))
    );
    assert_eq!(
        calls,
        [("get_weather".to_string(), json!({"city": "Paris", "days": 3}))]
    );
    let (status, error) = server.post(
        "/v1/chat/completions",
        &body(None)
            .as_object()
            .map(|b| {
                let mut b = b.clone();
                b.insert("include_reasoning".into(), json!("no"));
                Value::Object(b)
            })
            .unwrap(),
    );
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (400, Some("include_reasoning"))
    );
}

#[test]
fn allowed_tools_narrow_the_calls_forced_or_not() {
    let allowed = |mode: &str, name: &str| {
        json!({"type": "allowed_tools", "allowed_tools": {"mode": mode,
            "tools": [{"type": "function", "function": {"name": name}}]}})
    };
    // The scripted model calls the weather twice: so it does with only the weather allowed, forced or not.
    let server = serve("tool_calls_qwen3_xml", &[]);
    let tools = json!([clock(), weather(json!({"type": "string"}))]);
    let body = |extra: Value| {
        let mut body = chat(
            "What is the weather in Paris and Oslo?",
            json!({"tools": tools, "max_tokens": 200, "temperature": 0}),
        );
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let expected = vec![
        ("get_weather".to_string(), json!({"city": "Paris", "days": 3})),
        ("get_weather".to_string(), json!({"city": "Oslo"})),
    ];
    let (status, all) = server.post("/v1/chat/completions", &body(json!({})));
    assert_eq!(status, 200, "{all}");
    for mode in ["auto", "required"] {
        let narrowed = body(json!({"tool_choice": allowed(mode, "get_weather")}));
        let (_, calls, finish) = answer(&server, &narrowed);
        assert_eq!((calls, finish.as_str()), (expected.clone(), "tool_calls"), "{mode}");
        let (_, calls, _) = streamed_answer(&server, &narrowed);
        assert_eq!(calls, expected, "{mode}, streamed");
        let (_, response) = server.post("/v1/chat/completions", &narrowed);
        let (prompt, all_prompt) = (&response["usage"]["prompt_tokens"], &all["usage"]["prompt_tokens"]);
        match mode {
            "auto" => assert!(prompt.as_u64() < all_prompt.as_u64(), "only the weather is offered"),
            _ => assert_eq!(prompt, all_prompt, "every tool is offered; the grammar narrows"),
        }
    }
    // A random model forced to call only the clock calls only the clock.
    let server = serve("qwen3_moe", &[]);
    for seed in 0..3 {
        let forced = chat(
            "Weather?",
            json!({"tools": tools, "tool_choice": allowed("required", "get_time"), "max_tokens": 400,
                "temperature": 1, "seed": seed, "chat_template_kwargs": {"enable_thinking": false}}),
        );
        let (_, calls, finish) = answer(&server, &forced);
        assert_eq!(finish, "tool_calls", "{calls:?}");
        assert!(calls.iter().all(|(name, _)| name == "get_time"), "{calls:?}");
    }
}

/// Checks calls against the tools [`clock`] and [`weather`] with `cities`.
fn assert_valid(calls: &[(String, Value)], cities: &[&str], parallel: bool) {
    assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{calls:?}");
    for (name, arguments) in calls {
        let arguments = arguments.as_object().unwrap_or_else(|| panic!("{arguments}"));
        match name.as_str() {
            "get_time" => {}
            "get_weather" => {
                assert!(cities.contains(&arguments["city"].as_str().unwrap()), "{arguments:?}");
                if let Some(days) = arguments.get("days") {
                    assert!((1..=9).contains(&days.as_i64().unwrap()), "{arguments:?}");
                }
                assert!(arguments.keys().all(|k| k == "city" || k == "days"), "{arguments:?}");
            }
            other => panic!("a call of {other}, which is not offered"),
        }
    }
}

#[test]
fn a_random_model_forced_to_call_calls_declared_tools_with_valid_arguments_in_every_tagged_format() {
    let cities = ["Paris", "Oslo", "Lima"];
    let tools = json!([clock(), weather(json!({"type": "string", "enum": cities}))]);
    let template = |file: &str| fixture(&format!("chat_templates/{file}"));
    let (xml, glm) = (template("qwen3_5.jinja"), template("glm4_5.jinja"));
    // Hermes (Qwen3's own template), the XML and GLM-4.5 formats by their templates, and DeepSeek-V3.1's by the
    // parser's name (its template renders no tool definitions, so Qwen3's offers the tools).
    let extras = [
        vec![],
        vec!["--chat-template", xml.as_str()],
        vec!["--chat-template", glm.as_str()],
        vec!["--tool-call-parser", "deepseek_v31"],
    ];
    for extra in extras {
        let server = serve("qwen3_moe", &extra);
        for seed in 0..6 {
            let parallel = seed % 2 == 0;
            let body = chat(
                "Weather?",
                json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel,
                    "chat_template_kwargs": {"enable_thinking": false},
                    "max_tokens": 800, "temperature": 1, "seed": seed}),
            );
            let (content, calls, finish) = answer(&server, &body);
            assert_eq!((&content, finish.as_str()), (&Value::Null, "tool_calls"), "{calls:?}");
            assert_valid(&calls, &cities, parallel);
            let (content, streamed, _) = streamed_answer(&server, &body);
            assert_eq!(
                (content.as_str(), &streamed),
                ("", &calls),
                "seeded: the stream says the same"
            );
        }
    }
}

#[test]
fn forced_choices_that_cannot_be_served_are_400s_naming_the_field() {
    let server = serve("qwen3_moe", &[]);
    let tools = json!([weather(json!({"type": "string"}))]);
    let cases = [
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true}}]}),
            "tools[0].function.strict",
        ),
    ];
    for (extra, param) in cases {
        let (status, response) = server.post("/v1/chat/completions", &chat("hi", extra.clone()));
        assert_eq!(status, 400, "{extra}: {response}");
        assert_eq!(response["error"]["param"], param, "{extra}: {response}");
    }
}
