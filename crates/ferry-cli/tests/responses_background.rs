//! The Responses API's `background` mode over real HTTP: a response answered at once as in progress, generated
//! after, and read with `GET /v1/responses/{id}` as a whole request would have answered it; cancelled while in
//! progress (`POST /v1/responses/{id}/cancel`), which frees its place; and the requests it cannot serve refused.

mod common;

use std::time::{Duration, Instant};

use common::{Server, KEY};
use serde_json::{json, Value};

/// `GET /v1/responses/{id}` until the response is no longer in progress.
fn finished(server: &Server, id: &str) -> Value {
    let started = Instant::now();
    loop {
        let (status, text) = server.get(&format!("/v1/responses/{id}"), Some(KEY));
        assert_eq!(status, 200, "{text}");
        let object: Value = serde_json::from_str(&text).unwrap();
        if object["status"] != "in_progress" {
            return object;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "still in progress: {object}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_background_response_is_read_later_as_a_whole_one_answers() {
    let server = Server::start(&[]);
    let body = json!({"input": "Tell me about ferries.", "max_output_tokens": 12, "temperature": 0});
    let (status, whole) = server.post("/v1/responses", &body);
    assert_eq!(status, 200, "{whole}");
    let mut background = body.clone();
    background["background"] = json!(true);
    let (status, answered) = server.post("/v1/responses", &background);
    assert_eq!(status, 200, "{answered}");
    assert_eq!(
        (&answered["status"], &answered["background"]),
        (&json!("in_progress"), &json!(true))
    );
    let id = answered["id"].as_str().unwrap();
    let read = finished(&server, id);
    assert_eq!(read["status"], whole["status"], "{read}");
    assert_eq!(read["output"][0]["content"], whole["output"][0]["content"], "{read}");
    assert_eq!(read["usage"]["output_tokens"], whole["usage"]["output_tokens"]);
    // Ended, it cannot be cancelled.
    let (status, error) = server.post(&format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(status, 400, "{error}");
}

#[test]
fn a_cancelled_background_response_stops_and_stays_cancelled() {
    let server = Server::start(&[]);
    let body = json!({"input": "Tell me everything.", "max_output_tokens": 3000, "temperature": 0,
                      "background": true});
    let (status, answered) = server.post("/v1/responses", &body);
    assert_eq!(status, 200, "{answered}");
    let id = answered["id"].as_str().unwrap();
    let started = Instant::now();
    while server.metric("ferry_running_requests") < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the background generation never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, cancelled) = server.post(&format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    // It stays so: its generation is not kept when it would have ended.
    std::thread::sleep(Duration::from_millis(300));
    let (_, text) = server.get(&format!("/v1/responses/{id}"), Some(KEY));
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["status"],
        "cancelled",
        "{text}"
    );
    let (status, _) = server.post(&format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(status, 400, "cancelled once");
    // Its place in the engine is free.
    let started = Instant::now();
    while server.metric("ferry_kv_blocks_used") > 0.0 || server.metric("ferry_running_requests") > 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the cancelled generation still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, error) = server.post("/v1/responses/resp_0123/cancel", &json!({}));
    assert_eq!(status, 404, "{error}");
}

#[test]
fn a_background_response_must_be_kept_and_cannot_stream() {
    let server = Server::start(&[]);
    for extra in [json!({"store": false}), json!({"stream": true})] {
        let mut body = json!({"input": "Hi.", "background": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, error) = server.post("/v1/responses", &body);
        assert_eq!(
            (status, error["error"]["param"].clone()),
            (400, json!("background")),
            "{extra}"
        );
    }
}
