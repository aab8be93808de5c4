//! While the model loads, the server is up: /health answers 503 with the stage and progress, generation endpoints
//! answer an OpenAI-style 503, and the API key is still required everywhere but /health.

use std::io::{Read, Write};
use std::net::TcpStream;

use ferry_server::{router, AppState, ServerConfig};
use serde_json::Value;

fn request(address: &str, method: &str, path: &str, key: Option<&str>) -> (u16, Value) {
    let mut stream = TcpStream::connect(address).unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let body = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

#[test]
fn health_reports_progress_until_the_model_is_ready() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let state = AppState::new(ServerConfig {
        served_model_name: "m".into(),
        api_key: Some("k".into()),
        max_in_flight: 4,
        body_read_timeout: std::time::Duration::from_secs(60),
        engine_stall_timeout: std::time::Duration::from_secs(60),
        allowed_origins: vec![],
    });
    state.set_loading("downloading model-00002-of-00004.safetensors (2/4)", 0.25);
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let address = listener.local_addr().unwrap().to_string();
    runtime.spawn(async move { axum::serve(listener, router(state)).await });

    let (status, health) = request(&address, "GET", "/health", None);
    assert_eq!(status, 503);
    assert_eq!(health["status"], "loading");
    assert_eq!(health["progress"], 0.25);
    assert!(health["stage"].as_str().unwrap().contains("(2/4)"));

    let (status, error) = request(&address, "POST", "/v1/chat/completions", Some("k"));
    assert_eq!(status, 503);
    assert_eq!(error["error"]["code"], "model_loading");
    assert!(error["error"]["message"].as_str().unwrap().contains("25%"));
    assert_eq!(request(&address, "POST", "/v1/chat/completions", None).0, 401);
    let (status, models) = request(&address, "GET", "/v1/models", Some("k"));
    assert_eq!((status, models["data"][0]["id"].clone()), (200, "m".into()));
}
