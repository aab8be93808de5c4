//! `ferry serve`'s Anthropic Messages API over real HTTP on the bundled fixture: a plain message and its event
//! stream agree and the events come in Anthropic's order, count_tokens counts what generation consumes, stop
//! sequences end with `stop_sequence`, `x-api-key` is the key, and every error is in Anthropic's shape.

mod common;

use common::{Server, KEY};
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

/// A streamed response's events: (event name, data).
fn events(text: &str) -> Vec<(String, Value)> {
    let mut out = vec![];
    let mut name = None;
    for line in text.lines() {
        if let Some(event) = line.strip_prefix("event: ") {
            name = Some(event.to_string());
        } else if let Some(data) = line.strip_prefix("data: ") {
            let data: Value = serde_json::from_str(data).unwrap();
            let name = name.take().expect("every data line has its event line");
            assert_eq!(data["type"], name.as_str(), "the event name is the data's type");
            out.push((name, data));
        }
    }
    out
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
                    _ => ("text", "text_delta"),
                };
                assert_eq!(data["delta"]["type"], delta_type);
                block[key] = format!(
                    "{}{}",
                    block[key].as_str().unwrap(),
                    data["delta"][key].as_str().unwrap()
                )
                .into();
            }
            "content_block_stop" => {
                assert_eq!(data["index"], open.take().expect("a stop closes an open block"));
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
    assert_eq!(counted, json!({"input_tokens": whole["usage"]["input_tokens"]}));

    let (status, text) = post(&server, "/v1/messages", &message(json!({"stream": true})));
    assert_eq!(status, 200, "{text}");
    let events = events(&text);
    let streamed = message_from_stream(&events);
    assert_eq!(
        streamed["id"].as_str().unwrap().len(),
        whole["id"].as_str().unwrap().len()
    );
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        whole["usage"]["input_tokens"]
    );
    for key in ["content", "stop_reason", "stop_sequence", "usage"] {
        assert_eq!(streamed[key], whole[key], "{key}");
    }
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
            true => message_from_stream(&events(&post(&server, "/v1/messages", &request).1)),
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
