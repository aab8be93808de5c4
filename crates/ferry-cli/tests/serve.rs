//! `ferry serve` end to end over real HTTP on the bundled fixture: plain and streamed answers agree, errors are
//! OpenAI-shaped with the right status, a full queue is refused, and a client that hangs up mid-stream frees its KV.
//! (scripts/openai_client_test.py drives the same server with the official `openai` Python package.)

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, KEY};
use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn plain_and_streamed_answers_agree_and_only_health_is_open() {
    let server = Server::start(&[]);
    assert_eq!(server.get("/health", None), (200, r#"{"status":"ok"}"#.into()));
    let (status, body) = server.get("/v1/models", None);
    assert_eq!(status, 401, "{body}");
    assert_eq!(server.get("/v1/models", Some("wrong")).0, 401);
    let (status, body) = server.get("/v1/models", Some(KEY));
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["data"][0]["id"], "tiny");

    let request = chat("Tell me about ferries.", json!({"max_tokens": 24, "temperature": 0}));
    let (status, whole) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{whole}");
    let message = &whole["choices"][0]["message"];
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.post_stream("/v1/chat/completions", &streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let field = |name: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][name].as_str())
            .collect()
    };
    assert_eq!(field("content"), message["content"].as_str().unwrap_or(""));
    assert_eq!(
        field("reasoning_content"),
        message["reasoning_content"].as_str().unwrap_or("")
    );
    let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"));
    assert_eq!(chunks.last().unwrap()["usage"], whole["usage"]);

    let text = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0});
    let (status, whole) = server.post("/v1/completions", &text);
    assert_eq!(status, 200, "{whole}");
    let mut streamed = text.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/completions", &streamed);
    let joined: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(joined, whole["choices"][0]["text"].as_str().unwrap());
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let server = Server::start(&["--max-model-len", "64"]);
    let (status, body) = server.request("POST", "/v1/chat/completions", Some("{\"messages\": ["), Some(KEY));
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert!(error["error"]["message"].as_str().unwrap().contains("not valid JSON"));

    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, param) in [
        (json!({"model": "tiny"}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (json!({"messages": [{"role": 1, "content": "x"}]}), "messages[0].role"),
        (json!({"messages": user, "max_tokens": -1}), "max_tokens"),
        (json!({"messages": user, "max_tokens": "ten"}), "max_tokens"),
        (json!({"messages": user, "temperature": -1}), "temperature"),
        (json!({"messages": user, "top_p": 2}), "top_p"),
        (json!({"messages": user, "n": 2}), "n"),
        (json!({"messages": user, "presence_penalty": 9}), "presence_penalty"),
        (json!({"messages": user, "stop": 7}), "stop"),
        (json!({"messages": user, "stop": vec!["x"; 17]}), "stop"),
        (json!({"messages": user, "stop": ["y".repeat(257)]}), "stop"),
        (json!({"messages": [{"role": "", "content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}),
            "messages[1].role",
        ),
    ] {
        let (status, error) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body} -> {error}");
        assert_eq!(error["error"]["param"], param, "{body} -> {error}");
        assert!(error["error"]["message"].as_str().unwrap().len() > 10);
    }
    let (status, error) = server.post("/v1/completions", &json!({"prompt": 5}));
    assert_eq!((status, error["error"]["param"].clone()), (400, json!("prompt")));

    let long = "ferry ".repeat(100);
    let (status, error) = server.post("/v1/chat/completions", &chat(&long, json!({})));
    assert_eq!(status, 400);
    let message = error["error"]["message"].as_str().unwrap();
    let prompt_tokens: usize = message
        .split("the prompt has ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no prompt length in {message}"));
    assert!(message.contains("64 tokens") && prompt_tokens > 64, "{message}");
    assert_eq!(error["error"]["code"], "context_length_exceeded");

    let (status, error) = server.post("/v1/chat/completions", &json!({"model": "other", "messages": user}));
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (404, json!("model_not_found"))
    );
    assert_eq!(server.get("/v1/nothing", Some(KEY)).0, 404);
    // Still serving after all of that.
    assert_eq!(
        server
            .post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})))
            .0,
        200
    );
    assert!(!server.log().contains("panicked"));
    assert_eq!(server.metric("ferry_requests_total{outcome=\"invalid\"}"), 18.0);
}

#[test]
fn a_full_queue_is_refused_and_a_client_that_hangs_up_frees_its_kv() {
    let server = Server::start(&[
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "0",
        "--kv-cache-tokens",
        "5000",
    ]);
    assert_eq!(
        server.metric("ferry_kv_blocks_total"),
        313.0,
        "5000 tokens in blocks of 16"
    );
    let long = chat("Go on and on.", json!({"max_tokens": 3000, "stream": true}));
    let stream = server.send("POST", "/v1/chat/completions", Some(&long.to_string()), Some(KEY));
    let mut reader = BufReader::new(stream);
    let mut seen = String::new();
    // The role chunk, then the first generated text.
    while seen.matches("data: {").count() < 2 {
        assert!(reader.read_line(&mut seen).unwrap() > 0, "stream ended early:\n{seen}");
    }
    // The engine publishes its state after each step, so the gauges may lag the first token by a step.
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.metric("ferry_kv_blocks_used") == 0.0 {
        assert!(Instant::now() < deadline, "no KV in use while streaming:\n{seen}");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.metric("ferry_running_requests"), 1.0);

    let (status, error) = server.post("/v1/chat/completions", &chat("me too", json!({"max_tokens": 2})));
    assert_eq!(status, 503, "{error}");
    assert_eq!(error["error"]["code"], "queue_full");
    assert_eq!(server.metric("ferry_requests_total{outcome=\"rejected\"}"), 1.0);

    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.metric("ferry_kv_blocks_used") > 0.0 {
        assert!(Instant::now() < deadline, "KV was not freed:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.metric("ferry_running_requests"), 0.0);
    assert!(server.metric("ferry_requests_total{outcome=\"cancelled\"}") >= 1.0);
    assert_eq!(
        server
            .post("/v1/chat/completions", &chat("now me", json!({"max_tokens": 2})))
            .0,
        200
    );
}

#[test]
fn a_model_that_cannot_load_ends_the_server_with_the_reason() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    for (extra, needle) in [
        (
            vec!["--kv-cache-tokens", "10", "--max-model-len", "64"],
            "--kv-cache-tokens 10 cannot hold one request",
        ),
        (
            vec!["--max-model-len", "99999"],
            "beyond the model's context window of 4096",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["serve", "--model", fixture.to_str().unwrap(), "--port", "0"])
            .args(&extra)
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}: {stderr}");
        assert!(stderr.contains(needle), "{extra:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn without_max_model_len_the_context_is_what_the_kv_cache_holds() {
    let server = Server::start(&["--kv-cache-tokens", "48"]);
    assert!(
        server.log().contains("requests get a context of 48"),
        "{}",
        server.log()
    );
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "river ".repeat(60), "max_tokens": 2}),
    );
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("maximum context length is 48 tokens"), "{message}");
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "river", "max_tokens": 4}));
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_synthetic_model_serves_with_a_borrowed_tokenizer() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let config = fixture.join("config.json");
    let server = Server::start_serving(&[
        "--synthetic",
        config.to_str().unwrap(),
        "--tokenizer",
        fixture.to_str().unwrap(),
        "--api-key",
        KEY,
    ]);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat("Hi", json!({"max_tokens": 8, "temperature": 0})),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{body}");
}

/// What a browser sends cross-site without a CORS preflight: a POST whose `Content-Type` is one of the "simple" ones
/// (a form, text/plain), or none at all.
const SIMPLE_CONTENT_TYPES: [Option<&str>; 5] = [
    Some("text/plain"),
    Some("text/plain;charset=UTF-8"),
    Some("application/x-www-form-urlencoded"),
    Some("multipart/form-data; boundary=x"),
    None,
];

/// The 415 that a POST without `Content-Type: application/json` gets.
fn assert_refused_as_not_json((status, body): (u16, String), content_type: Option<&str>) {
    assert_eq!(status, 415, "{content_type:?}: {body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(error["error"]["code"], "unsupported_media_type", "{body}");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("application/json"),
        "{body}"
    );
}

#[test]
fn without_a_key_a_web_page_cannot_drive_the_server() {
    let server = Server::start_without_key(&[]);
    let request = chat("hi", json!({"max_tokens": 2}));
    for content_type in SIMPLE_CONTENT_TYPES
        .into_iter()
        .chain([Some("application/jsonp"), Some("text/json")])
    {
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/nothing"] {
            assert_refused_as_not_json(server.post_typed(path, &request, None, content_type), content_type);
        }
    }
    // Nothing legitimate breaks: JSON with parameters or in capitals (media types are case-insensitive), and GETs.
    for content_type in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON ;charset=UTF-8",
    ] {
        let (status, body) = server.post_typed("/v1/chat/completions", &request, None, Some(content_type));
        assert_eq!(status, 200, "{content_type}: {body}");
    }
    assert_eq!(server.get("/v1/models", None).0, 200);
}

#[test]
fn with_a_key_the_key_is_checked_first_and_bodies_are_json_only_too() {
    let server = Server::start(&[]);
    let request = chat("hi", json!({"max_tokens": 2}));
    let (status, body) = server.post_typed("/v1/chat/completions", &request, Some("wrong"), Some("text/plain"));
    assert_eq!(status, 401, "{body}");
    for content_type in SIMPLE_CONTENT_TYPES {
        let response = server.post_typed("/v1/chat/completions", &request, Some(KEY), content_type);
        assert_refused_as_not_json(response, content_type);
    }
    assert_eq!(server.post("/v1/chat/completions", &request).0, 200);
}
