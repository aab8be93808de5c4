//! `ferry serve`'s Anthropic Messages API over real HTTP on the bundled fixture: a plain message and its event
//! stream agree and the events come in Anthropic's order, count_tokens counts what generation consumes, stop
//! sequences end with `stop_sequence`, `x-api-key` is the key, and every error is in Anthropic's shape.

mod common;

use common::{named_events, Server, KEY};
use serde_json::{json, Value};

const ANTHROPIC_HEADERS: [(&str, &str); 3] = [
    ("x-api-key", KEY),
    ("anthropic-version", "2023-06-01"),
    ("Content-Type", "application/json"),
];

/// A POST as Anthropic's clients send it: status and body.
fn post(server: &Server, path: &str, body: &Value) -> (u16, String) {
    let stream = server.send_with_headers("POST", path, Some(&body.to_string()), &ANTHROPIC_HEADERS);
    Server::response(stream)
}

fn post_json(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post(server, path, body);
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn message(extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about ferries."}],
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The text of a message's blocks of `kind` ("text" or "thinking"), joined.
fn block_text(message: &Value, kind: &str) -> String {
    message["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|block| block["type"] == kind)
        .map(|block| block[kind].as_str().unwrap())
        .collect()
}

/// Checks the stream's order (message_start, ping, then blocks opened, filled and closed one at a time,
/// message_delta, message_stop) and returns the message it spells: its content blocks, stop reason and usage.
fn message_from_stream(events: &[(String, Value)]) -> Value {
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names[..2], ["message_start", "ping"], "{names:?}");
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"], "{names:?}");
    let mut message = events[0].1["message"].clone();
    assert_eq!(message["content"], json!([]));
    assert_eq!(message["stop_reason"], Value::Null);
    let mut open: Option<usize> = None;
    let mut blocks: Vec<Value> = vec![];
    for (name, data) in &events[2..events.len() - 2] {
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block opens only after the last one closed: {names:?}");
                assert_eq!(data["index"], blocks.len());
                open = Some(blocks.len());
                blocks.push(data["content_block"].clone());
            }
            "content_block_delta" => {
                let index = open.expect("a delta inside a block");
                assert_eq!(data["index"], index);
                let block = &mut blocks[index];
                let (key, delta_type) = match block["type"].as_str().unwrap() {
                    "thinking" => ("thinking", "thinking_delta"),
                    // The input's JSON text, parsed once the block closes.
                    "tool_use" => ("partial_json", "input_json_delta"),
                    _ => ("text", "text_delta"),
                };
                if block[key].is_null() {
                    block[key] = "".into();
                }
                assert_eq!(data["delta"]["type"], delta_type);
                block[key] = format!(
                    "{}{}",
                    block[key].as_str().unwrap(),
                    data["delta"][key].as_str().unwrap()
                )
                .into();
            }
            "content_block_stop" => {
                let index = open.take().expect("a stop closes an open block");
                assert_eq!(data["index"], index);
                let block = blocks[index].as_object_mut().unwrap();
                if let Some(json) = block.remove("partial_json") {
                    block.insert("input".into(), serde_json::from_str(json.as_str().unwrap()).unwrap());
                }
            }
            "ping" => {}
            other => panic!("unexpected event {other}: {names:?}"),
        }
    }
    assert_eq!(open, None, "every block is closed before message_delta");
    let delta = &events[events.len() - 2].1;
    message["content"] = blocks.into();
    message["stop_reason"] = delta["delta"]["stop_reason"].clone();
    message["stop_sequence"] = delta["delta"]["stop_sequence"].clone();
    message["usage"] = delta["usage"].clone();
    message
}

#[test]
fn a_message_and_its_stream_agree_and_count_tokens_counts_the_prompt() {
    let server = Server::start(&[]);
    let request = message(json!({}));
    let (status, whole) = post_json(&server, "/v1/messages", &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(
        (whole["type"].clone(), whole["role"].clone()),
        (json!("message"), json!("assistant"))
    );
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"), "{whole}");
    assert_eq!(whole["model"], "tiny");
    assert_eq!(whole["stop_reason"], "max_tokens");
    assert_eq!(whole["stop_sequence"], Value::Null);
    assert_eq!(whole["usage"]["output_tokens"], 24);

    let (status, counted) = post_json(&server, "/v1/messages/count_tokens", &request);
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted, json!({"input_tokens": prompt_tokens(&whole["usage"])}));

    let (status, text) = post(&server, "/v1/messages", &message(json!({"stream": true})));
    assert_eq!(status, 200, "{text}");
    let events = named_events(&text);
    let streamed = message_from_stream(&events);
    assert_eq!(
        streamed["id"].as_str().unwrap().len(),
        whole["id"].as_str().unwrap().len()
    );
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        prompt_tokens(&whole["usage"])
    );
    for key in ["content", "stop_reason", "stop_sequence"] {
        assert_eq!(streamed[key], whole[key], "{key}");
    }
    // The same prompt again: its full blocks come from the prefix cache, which Anthropic counts apart.
    let usage = &streamed["usage"];
    assert_eq!(prompt_tokens(usage), prompt_tokens(&whole["usage"]));
    assert_eq!(usage["output_tokens"], whole["usage"]["output_tokens"]);
    assert!(usage["cache_read_input_tokens"].as_u64().unwrap() > 0, "{usage}");
}

/// The prompt's tokens as Anthropic's usage splits them: those read from the cache apart from the rest.
#[test]
fn a_last_assistant_message_is_continued_here_and_with_openais_continue_final_message() {
    let server = Server::start(&[]);
    let conversation = json!([
        {"role": "user", "content": "Tell me about ferries."},
        {"role": "assistant", "content": "Ferries are"},
    ]);
    // The prompt ends inside the assistant's message: the template's end of the turn is not there.
    let continuing = json!({"messages": conversation, "add_generation_prompt": false, "continue_final_message": true});
    let (status, tokenized) = server.post("/tokenize", &continuing);
    assert_eq!(status, 200, "{tokenized}");
    let ids = tokenized["tokens"].clone();
    let (_, text) = server.post("/detokenize", &json!({"tokens": ids}));
    assert!(text["prompt"].as_str().unwrap().ends_with("\nFerries are"), "{text}");
    let (_, whole) = server.post(
        "/tokenize",
        &json!({"messages": conversation, "add_generation_prompt": false}),
    );
    assert!(whole["count"].as_u64() > tokenized["count"].as_u64(), "{whole}");
    // Both APIs continue it as a completion of those ids does.
    let (_, completion) = server.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 8, "temperature": 0}),
    );
    let continuation = completion["choices"][0]["text"].as_str().unwrap();
    assert!(!continuation.is_empty());
    let (status, anthropic) = post_json(
        &server,
        "/v1/messages",
        &message(json!({"messages": conversation, "max_tokens": 8})),
    );
    assert_eq!(status, 200, "{anthropic}");
    assert_eq!(block_text(&anthropic, "text"), continuation, "{anthropic}");
    let mut openai = continuing.clone();
    openai["max_tokens"] = json!(8);
    openai["temperature"] = json!(0);
    let (status, chat) = server.post("/v1/chat/completions", &openai);
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["choices"][0]["message"]["content"], continuation);
    // Only an assistant's last message can be continued, and not in a new turn too.
    let mut user_last = openai.clone();
    user_last["messages"] = json!([{"role": "user", "content": "hi"}]);
    let (status, error) = server.post("/v1/chat/completions", &user_last);
    assert_eq!((status, &error["error"]["param"]), (400, &json!("messages")), "{error}");
    let mut both = openai.clone();
    both["add_generation_prompt"] = json!(true);
    let (status, error) = server.post("/v1/chat/completions", &both);
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("continue_final_message")),
        "{error}"
    );
}

fn prompt_tokens(usage: &Value) -> Value {
    json!(usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap())
}

#[test]
fn a_stop_sequence_ends_the_message_and_is_named() {
    let server = Server::start(&[]);
    let (status, whole) = post_json(&server, "/v1/messages", &message(json!({})));
    assert_eq!(status, 200, "{whole}");
    let text = match block_text(&whole, "text") {
        text if text.chars().count() >= 8 => text,
        _ => block_text(&whole, "thinking"),
    };
    // A few characters from the middle of what greedy decoding wrote: the same request stops there.
    let stop: String = text.chars().skip(text.chars().count() / 2).take(3).collect();
    assert!(!stop.trim().is_empty(), "no text to stop on: {whole}");
    for stream in [false, true] {
        let request = message(json!({"stop_sequences": [stop, "never generated \u{1F6A2}"], "stream": stream}));
        let stopped = match stream {
            false => post_json(&server, "/v1/messages", &request).1,
            true => message_from_stream(&named_events(&post(&server, "/v1/messages", &request).1)),
        };
        assert_eq!(stopped["stop_reason"], "stop_sequence", "{stopped}");
        assert_eq!(stopped["stop_sequence"], stop.as_str(), "{stopped}");
        assert!(stopped["usage"]["output_tokens"].as_u64().unwrap() < 24, "{stopped}");
        let all = format!("{}{}", block_text(&stopped, "thinking"), block_text(&stopped, "text"));
        assert!(
            !all.contains(&stop),
            "the stop sequence is not part of the output: {stopped}"
        );
    }
}

/// An Anthropic error body: `{"type": "error", "error": {"type", "message"}}`.
fn assert_anthropic_error((status, body): (u16, String), expected_status: u16, kind: &str) -> String {
    assert_eq!(status, expected_status, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    assert_eq!(error["type"], "error", "{body}");
    assert_eq!(error["error"]["type"], kind, "{body}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.len() > 5, "{body}");
    message.to_string()
}

#[test]
fn errors_on_the_anthropic_routes_are_in_anthropic_shape() {
    let server = Server::start(&["--max-model-len", "64"]);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, needle) in [
        (json!({"model": "tiny", "messages": user}), "max_tokens"),
        (json!({"model": "tiny", "max_tokens": 5}), "messages"),
        (
            json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
            ]}]}),
            "text-only",
        ),
        (
            json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "ferry ".repeat(100)}]}),
            "maximum context length",
        ),
        (
            json!({"model": "tiny", "max_tokens": 5, "messages": user, "temperature": 3}),
            "temperature",
        ),
    ] {
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            // Counting needs no max_tokens, and counts a prompt of any length.
            if path.ends_with("count_tokens") && ["max_tokens", "maximum context length"].contains(&needle) {
                continue;
            }
            let message = assert_anthropic_error(post(&server, path, &body), 400, "invalid_request_error");
            assert!(message.contains(needle), "{path} {body}: {message}");
        }
    }
    let other_model = json!({"model": "claude-x", "max_tokens": 5, "messages": user});
    assert_anthropic_error(post(&server, "/v1/messages", &other_model), 404, "not_found_error");
    let request = json!({"model": "tiny", "max_tokens": 5, "messages": user}).to_string();
    for headers in [
        vec![("x-api-key", "wrong"), ("Content-Type", "application/json")],
        vec![("Content-Type", "application/json")],
    ] {
        let stream = server.send_with_headers("POST", "/v1/messages", Some(&request), &headers);
        assert_anthropic_error(Server::response(stream), 401, "authentication_error");
    }
    let stream = server.send_with_headers(
        "POST",
        "/v1/messages",
        Some(&request),
        &[("x-api-key", KEY), ("Content-Type", "text/plain")],
    );
    assert_anthropic_error(Server::response(stream), 415, "invalid_request_error");
    assert_anthropic_error(
        post(&server, "/v1/messages/batches", &json!({})),
        404,
        "not_found_error",
    );
    // The OpenAI routes keep OpenAI's shape, and the server still answers.
    let (status, error) = server.post("/v1/chat/completions", &json!({"model": "tiny"}));
    assert_eq!((status, error["error"]["param"].clone()), (400, json!("messages")));
    let (status, body) = post_json(
        &server,
        "/v1/messages",
        &json!({"model": "tiny", "max_tokens": 2, "messages": user}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(!server.log().contains("panicked"));
}

/// Structured outputs: `output_config.format`'s schema holds for the answer, which follows the model's thinking
/// (here ended by its budget), plain and streamed; a schema that cannot be compiled is a 400 naming
/// `output_config.format`.
#[test]
fn an_output_format_constrains_the_answer_plain_and_streamed() {
    let server = Server::start(&[]);
    let schema = json!({
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["answer", "count"],
        "additionalProperties": false,
    });
    let format = |schema: Value| json!({"output_config": {"format": {"type": "json_schema", "schema": schema}}});
    let mut request = message(format(schema));
    request["max_tokens"] = json!(80);
    request["thinking"] = json!({"type": "enabled", "budget_tokens": 8});
    let whole = message_plain_and_streamed(&server, &request);
    assert_eq!(whole["stop_reason"], "end_turn", "{whole}");
    assert!(!block_text(&whole, "thinking").is_empty(), "{whole}");
    let text = block_text(&whole, "text");
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(["yes", "no"].contains(&value["answer"].as_str().unwrap()), "{value}");
    assert!((1..=9).contains(&value["count"].as_i64().unwrap()), "{value}");
    assert_eq!(value.as_object().unwrap().len(), 2, "{value}");

    let (status, error) = post_json(&server, "/v1/messages", &message(format(json!({"type": "nonsense"}))));
    assert_eq!(status, 400, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("`output_config.format`"), "{message}");
}

/// The calls of a message: (name, input) of its tool_use blocks, each id checked.
fn tool_uses(message: &Value) -> Vec<(String, Value)> {
    let blocks = message["content"].as_array().unwrap();
    blocks
        .iter()
        .filter(|block| block["type"] == "tool_use")
        .map(|block| {
            assert!(block["id"].as_str().unwrap().starts_with("toolu_"), "{block}");
            (block["name"].as_str().unwrap().to_string(), block["input"].clone())
        })
        .collect()
}

#[test]
fn a_model_that_calls_a_tool_answers_with_tool_use_blocks_plain_and_streamed() {
    check_tool_use("tool_calls_hermes");
}

#[test]
fn a_harmony_model_thinks_then_calls_a_tool() {
    let whole = check_tool_use("tool_calls_harmony");
    assert_eq!(
        block_text(&whole, "thinking"),
        "The user wants the weather in Paris.",
        "{whole}"
    );
    assert_eq!(
        tool_uses(&whole),
        [("get_weather".to_string(), json!({"city": "Paris", "days": 3}))]
    );
}

/// A scripted checkpoint's tool calls as tool_use blocks, plain and streamed alike, and back in the history; the
/// plain answer.
fn check_tool_use(fixture: &str) -> Value {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(fixture);
    let server = Server::start_serving(&["--model", fixture.to_str().unwrap(), "--api-key", KEY]);
    let weather = json!({"name": "get_weather", "description": "The weather forecast for a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}});
    let question = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let request = json!({"model": "tiny", "max_tokens": 200, "tools": [weather], "messages": question});
    let (status, whole) = post_json(&server, "/v1/messages", &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
    let calls = tool_uses(&whole);
    assert!(
        !calls.is_empty()
            && calls
                .iter()
                .all(|(name, input)| name == "get_weather" && input["city"].is_string()),
        "{whole}"
    );

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(&server, "/v1/messages", &streamed);
    assert_eq!(status, 200, "{text}");
    let streamed = message_from_stream(&named_events(&text));
    assert_eq!(streamed["stop_reason"], "tool_use");
    assert_eq!(tool_uses(&streamed), calls);

    // The calls and their results go back in the history, as an agent sends them.
    let tool_use_blocks: Vec<Value> = whole["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .cloned()
        .collect();
    let results: Vec<Value> = tool_use_blocks
        .iter()
        .map(|call| json!({"type": "tool_result", "tool_use_id": call["id"], "content": "sunny"}))
        .collect();
    let mut history = request.clone();
    history["messages"] =
        json!([question[0], {"role": "assistant", "content": tool_use_blocks}, {"role": "user", "content": results}]);
    let (status, counted) = post_json(&server, "/v1/messages/count_tokens", &history);
    assert_eq!(status, 200, "{counted}");
    let (status, again) = post_json(&server, "/v1/messages", &history);
    assert_eq!(status, 200, "{again}");
    assert_eq!(prompt_tokens(&again["usage"]), counted["input_tokens"]);
    assert!(
        counted["input_tokens"].as_u64() > prompt_tokens(&whole["usage"]).as_u64(),
        "the history grew the prompt"
    );
    whole
}

fn tool_fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    path.to_str().unwrap().to_string()
}

fn weather_tool(city: Value) -> Value {
    json!({"name": "get_weather", "description": "The forecast for a city.", "input_schema": {"type": "object",
        "properties": {"city": city, "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city"],
        "additionalProperties": false}})
}

/// A message and its stream: the stream's message checked equal to the plain one (ids aside), returned.
fn message_plain_and_streamed(server: &Server, request: &Value) -> Value {
    let (status, whole) = post_json(server, "/v1/messages", request);
    assert_eq!(status, 200, "{whole}");
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(server, "/v1/messages", &streamed);
    assert_eq!(status, 200, "{text}");
    let streamed = message_from_stream(&named_events(&text));
    assert_eq!(streamed["stop_reason"], whole["stop_reason"], "{streamed}");
    assert_eq!(tool_uses(&streamed), tool_uses(&whole), "{streamed}");
    assert_eq!(block_text(&streamed, "text"), block_text(&whole, "text"));
    whole
}

#[test]
fn forced_tool_choices_answer_with_the_tool_use_blocks_the_model_writes_unforced() {
    let server = Server::start_serving(&["--model", &tool_fixture("tool_calls_qwen3_xml"), "--api-key", KEY]);
    let question = json!([{"role": "user", "content": "What is the weather in Paris and Oslo?"}]);
    let request = |choice: Value| {
        json!({"model": "tiny", "max_tokens": 200, "tools": [weather_tool(json!({"type": "string"}))],
            "messages": question, "tool_choice": choice})
    };
    let unforced = message_plain_and_streamed(&server, &request(json!({"type": "auto"})));
    let expected = vec![
        ("get_weather".to_string(), json!({"city": "Paris", "days": 3})),
        ("get_weather".to_string(), json!({"city": "Oslo"})),
    ];
    assert_eq!(tool_uses(&unforced), expected);
    let any = message_plain_and_streamed(&server, &request(json!({"type": "any"})));
    assert_eq!(
        (tool_uses(&any), &any["stop_reason"]),
        (expected.clone(), &json!("tool_use"))
    );
    assert_eq!(
        block_text(&any, "thinking"),
        block_text(&unforced, "thinking"),
        "it thought first"
    );
    let named = json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true});
    let named = message_plain_and_streamed(&server, &request(named));
    assert_eq!(tool_uses(&named), expected[..1].to_vec());
}

/// A random model under Qwen3.5's template (which opens `<think>` itself), greedy: it thinks until max_tokens.
fn thinking_random_model() -> Server {
    let template = std::path::Path::new(&tool_fixture("tool_calls_qwen3_xml")).join("chat_template.jinja");
    Server::start_serving(&[
        "--model",
        &tool_fixture("qwen3_moe"),
        "--api-key",
        KEY,
        "--chat-template",
        template.to_str().unwrap(),
    ])
}

#[test]
fn a_spent_thinking_budget_ends_the_thinking_and_the_answer_follows() {
    let server = thinking_random_model();
    let unbounded = json!({"thinking": {"type": "adaptive"}, "max_tokens": 40});
    let (status, unbounded) = post_json(&server, "/v1/messages", &message(unbounded));
    assert_eq!(status, 200, "{unbounded}");
    assert_eq!(unbounded["stop_reason"], "max_tokens", "{unbounded}");
    assert_eq!(
        block_text(&unbounded, "text"),
        "",
        "the model never stops thinking by itself: {unbounded}"
    );
    let bounded = json!({"thinking": {"type": "enabled", "budget_tokens": 6}, "max_tokens": 40});
    let (status, bounded) = post_json(&server, "/v1/messages", &message(bounded));
    assert_eq!(status, 200, "{bounded}");
    let (thought, all_thought) = (block_text(&bounded, "thinking"), block_text(&unbounded, "thinking"));
    assert!(
        !thought.is_empty() && thought.len() < all_thought.len() && all_thought.starts_with(&thought),
        "the first 6 tokens of the same thinking: {thought:?} of {all_thought:?}"
    );
    assert!(!block_text(&bounded, "text").is_empty(), "an answer follows: {bounded}");

    // Forced to call a tool, it thinks within its budget, then calls.
    let cities = json!({"type": "string", "enum": ["Paris", "Oslo"]});
    let forced = message(
        json!({"thinking": {"type": "enabled", "budget_tokens": 8}, "max_tokens": 300,
        "tools": [weather_tool(cities)], "tool_choice": {"type": "any"}}),
    );
    let forced = message_plain_and_streamed(&server, &forced);
    assert_eq!(forced["stop_reason"], "tool_use", "{forced}");
    let calls = tool_uses(&forced);
    assert!(!calls.is_empty(), "{forced}");
    for (name, input) in calls {
        assert_eq!(name, "get_weather");
        assert!(["Paris", "Oslo"].contains(&input["city"].as_str().unwrap()), "{input}");
    }
}

/// `output_config.effort` reaches gpt-oss's template as its reasoning effort (its system message names it, so the
/// prompt's length follows it; none is the template's own medium, and max is high), and a model whose template
/// takes none serves the request as if it were not there.
#[test]
fn an_effort_reaches_a_template_that_takes_one_and_the_others_go_without() {
    let count = |server: &Server, effort: Option<&str>| -> u64 {
        let mut request = message(json!({}));
        if let Some(effort) = effort {
            request["output_config"] = json!({"effort": effort});
        }
        let (status, counted) = post_json(server, "/v1/messages/count_tokens", &request);
        assert_eq!(status, 200, "{effort:?}: {counted}");
        counted["input_tokens"].as_u64().unwrap()
    };
    let harmony = Server::start_serving(&["--model", &tool_fixture("tool_calls_harmony"), "--api-key", KEY]);
    let [low, medium, high, max, none] =
        [Some("low"), Some("medium"), Some("high"), Some("max"), None].map(|effort| count(&harmony, effort));
    assert_ne!(low, medium, "the effort changed nothing in the prompt");
    assert_eq!((none, max), (medium, high));
    let plain = Server::start(&[]);
    assert_eq!(count(&plain, Some("max")), count(&plain, None));
}

#[test]
fn harmonys_markers_are_read_not_written_out_and_its_messages_are_not_continued() {
    let harmony = Server::start_serving(&["--model", &tool_fixture("tool_calls_harmony"), "--api-key", KEY]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let (status, error) = harmony.post(
        "/v1/chat/completions",
        &json!({"messages": user, "skip_special_tokens": false}),
    );
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("skip_special_tokens")),
        "{error}"
    );
    let prefill = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]);
    let (status, error) = post_json(&harmony, "/v1/messages", &message(json!({"messages": prefill})));
    assert_eq!(status, 400, "{error}");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("Harmony"),
        "{error}"
    );
}
