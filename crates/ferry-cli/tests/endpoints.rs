//! `ferry serve`'s endpoints around generation over real HTTP on the bundled fixture: the model card, vLLM's
//! tokenize and detokenize (counting what generation consumes), OpenAI fields the server does not implement refused
//! by name, CORS only for the origins the operator allowed (and still JSON-only), and `--chat-template`.

mod common;

use std::process::Command;

use common::{Server, KEY};
use serde_json::{json, Value};

#[test]
fn the_model_card_and_tokenize_detokenize() {
    let server = Server::start(&["--max-model-len", "512"]);
    let (status, body) = server.get("/v1/models/tiny", Some(KEY));
    assert_eq!(status, 200, "{body}");
    let card: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (card["id"].clone(), card["object"].clone()),
        (json!("tiny"), json!("model"))
    );
    assert_eq!(card["max_model_len"], 512);
    let (status, body) = server.get("/v1/models/other", Some(KEY));
    assert_eq!(status, 404, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "model_not_found", "{body}");

    let prompt = "The quick brown fox";
    let (status, tokenized) = server.post("/tokenize", &json!({"model": "tiny", "prompt": prompt}));
    assert_eq!(status, 200, "{tokenized}");
    assert_eq!(tokenized["max_model_len"], 512);
    let tokens = tokenized["tokens"].as_array().unwrap().clone();
    assert_eq!(tokenized["count"], tokens.len());
    let (status, completion) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1}));
    assert_eq!(status, 200, "{completion}");
    assert_eq!(completion["usage"]["prompt_tokens"], tokens.len());
    let (status, detokenized) = server.post("/detokenize", &json!({"model": "tiny", "tokens": tokens}));
    assert_eq!(status, 200, "{detokenized}");
    assert_eq!(detokenized, json!({"prompt": prompt}));

    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let (status, tokenized) = server.post("/tokenize", &json!({"messages": messages}));
    assert_eq!(status, 200, "{tokenized}");
    let (status, chat) = server.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 1}));
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["usage"]["prompt_tokens"], tokenized["count"]);
    let without_prompt = json!({"messages": messages, "add_generation_prompt": false});
    let (_, shorter) = server.post("/tokenize", &without_prompt);
    assert!(shorter["count"].as_u64() < tokenized["count"].as_u64(), "{shorter}");

    for (path, body, param) in [
        ("/tokenize", json!({}), "messages"),
        ("/tokenize", json!({"prompt": 3}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "x", "return_token_strs": true}),
            "return_token_strs",
        ),
        ("/detokenize", json!({"tokens": [1, -1]}), "tokens[1]"),
        ("/detokenize", json!({"tokens": [1_000_000_000]}), "tokens[0]"),
        ("/detokenize", json!({}), "tokens"),
    ] {
        let (status, error) = server.post(path, &body);
        assert_eq!(
            (status, error["error"]["param"].clone()),
            (400, json!(param)),
            "{path} {body}: {error}"
        );
    }
    let (status, error) = server.post("/tokenize", &json!({"model": "other", "prompt": "x"}));
    assert_eq!(
        (status, error["error"]["code"].clone()),
        (404, json!("model_not_found"))
    );
}

#[test]
fn openai_fields_the_server_does_not_implement_are_refused_by_name() {
    let server = Server::start(&[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (path, field, value) in [
        ("/v1/chat/completions", "functions", json!([{"name": "f"}])),
        ("/v1/completions", "suffix", json!("end")),
        ("/v1/completions", "best_of", json!(2)),
    ] {
        let mut body = match path {
            "/v1/completions" => json!({"prompt": "hi", "max_tokens": 2}),
            _ => json!({"messages": user, "max_tokens": 2}),
        };
        body[field] = value;
        let (status, error) = server.post(path, &body);
        assert_eq!(status, 400, "{field}: {error}");
        assert_eq!(error["error"]["param"], field, "{error}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains("not supported"),
            "{error}"
        );
    }
    let with_user = json!({"messages": user, "max_tokens": 2, "user": "someone", "logprobs": null});
    assert_eq!(server.post("/v1/chat/completions", &with_user).0, 200);
}

const APP: &str = "http://app.example";

/// A CORS preflight from `origin` for a JSON POST with a key: status and head.
fn preflight(server: &Server, origin: &str) -> (u16, String) {
    let stream = server.send_with_headers(
        "OPTIONS",
        "/v1/chat/completions",
        None,
        &[
            ("Origin", origin),
            ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", "authorization, content-type"),
        ],
    );
    let (status, head, _) = Server::response_with_head(stream);
    (status, head.to_ascii_lowercase())
}

#[test]
fn cors_answers_only_the_allowed_origins_and_bodies_stay_json_only() {
    let server = Server::start(&["--allowed-origins", APP]);
    let (status, head) = preflight(&server, APP);
    assert_eq!(status, 200, "{head}");
    assert!(head.contains(&format!("access-control-allow-origin: {APP}")), "{head}");
    assert!(head.contains("access-control-allow-methods"), "{head}");
    let (_, head) = preflight(&server, "http://evil.example");
    assert!(!head.contains("access-control-allow-origin"), "{head}");

    let request = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let bearer = format!("Bearer {KEY}");
    let post = |content_type: &str| {
        let stream = server.send_with_headers(
            "POST",
            "/v1/chat/completions",
            Some(&request),
            &[
                ("Origin", APP),
                ("Authorization", &bearer),
                ("Content-Type", content_type),
            ],
        );
        Server::response_with_head(stream)
    };
    let (status, head, body) = post("application/json");
    assert_eq!(status, 200, "{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("access-control-allow-origin: {APP}")),
        "{head}"
    );
    let (status, _, body) = post("text/plain");
    assert_eq!(status, 415, "an allowed origin still sends JSON only: {body}");

    let closed = Server::start(&[]);
    let (_, head) = preflight(&closed, APP);
    assert!(
        !head.contains("access-control-allow-origin"),
        "CORS is off by default: {head}"
    );
}

#[test]
fn a_chat_template_file_overrides_the_checkpoint_s() {
    let dir = std::env::temp_dir().join(format!("ferry-chat-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}[assistant] {% endif %}",
    )
    .unwrap();
    let server = Server::start(&["--chat-template", template.to_str().unwrap()]);
    let (status, tokenized) = server.post("/tokenize", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(status, 200, "{tokenized}");
    let (_, text) = server.post("/detokenize", &json!({"tokens": tokenized["tokens"]}));
    assert_eq!(text["prompt"], "[user] hi\n[assistant] ");

    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}never closed").unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    for (file, needle) in [(dir.join("missing.jinja"), "missing.jinja"), (broken, "broken.jinja")] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["serve", "--model", fixture.to_str().unwrap(), "--port", "0"])
            .args(["--chat-template", file.to_str().unwrap()])
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains(needle) && stderr.contains("--chat-template"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
