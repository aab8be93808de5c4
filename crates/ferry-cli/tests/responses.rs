//! `ferry serve`'s OpenAI Responses API (`POST /v1/responses`) over real HTTP: a response and its event stream
//! agree and the events come in order, numbered; a scripted checkpoint's reasoning and tool calls come back as
//! `reasoning` and `function_call` items and go back in `input`; a kept response is continued by
//! `previous_response_id` as the whole conversation sent again is, read, its input items listed, and deleted; what
//! the server cannot honour (a response it does not keep, unknown fields) is an OpenAI-shaped 400 naming the field;
//! the message's logprobs (`include`, `top_logprobs`) are its own tokens', whole and streamed; `truncation: "auto"`
//! leaves out as few of the earliest turns as let a long conversation fit the context window.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Server, KEY};
use serde_json::{json, Value};

fn respond(server: &Server, body: &Value) -> (u16, Value) {
    server.post("/v1/responses", body)
}

/// The events of a streamed response, checked: each named by its type and numbered in order from 0.
fn events(server: &Server, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = server.request("POST", "/v1/responses", Some(&body.to_string()), Some(KEY));
    assert_eq!(status, 200, "{text}");
    let out: Vec<Value> = common::named_events(&text).into_iter().map(|(_, data)| data).collect();
    for (number, data) in out.iter().enumerate() {
        assert_eq!(data["sequence_number"], number, "{data}");
    }
    out
}

/// The response a stream spells, checked against its events: created and in progress first, each item opened,
/// filled by deltas and closed before the next, each `.done` holding what its deltas added up to, and the items
/// done equal to the final response's output.
fn response_from_stream(events: &[Value]) -> Value {
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[..2], ["response.created", "response.in_progress"], "{types:?}");
    assert_eq!(events[0]["response"]["status"], "in_progress");
    assert_eq!(events[0]["response"]["output"], json!([]));
    let last = events.last().unwrap();
    let status = last["response"]["status"].as_str().unwrap();
    assert_eq!(last["type"], format!("response.{status}"));
    let output = last["response"]["output"].as_array().unwrap();
    let mut done = 0;
    let mut open: Option<(Value, String)> = None;
    // The open message's logprobs, as its deltas brought them.
    let mut logprobs: Vec<Value> = vec![];
    for event in &events[2..events.len() - 1] {
        let kind = event["type"].as_str().unwrap();
        if kind != "response.output_item.added" {
            let (item, _) = open
                .as_ref()
                .expect("every event but an item's opening is about the open item");
            assert_eq!(event["output_index"], done, "{event}");
            if let Some(id) = event.get("item_id") {
                assert_eq!(id, &item["id"], "{event}");
            }
        }
        match kind {
            "response.output_item.added" => {
                assert!(open.is_none(), "an item opens after the last one closed: {types:?}");
                assert_eq!(event["output_index"], done);
                assert_eq!(event["item"]["status"], "in_progress");
                open = Some((event["item"].clone(), String::new()));
                logprobs.clear();
            }
            "response.content_part.added" => assert_eq!(event["part"]["text"], ""),
            "response.reasoning_text.delta"
            | "response.output_text.delta"
            | "response.function_call_arguments.delta" => {
                open.as_mut().unwrap().1 += event["delta"].as_str().unwrap();
                if kind == "response.output_text.delta" {
                    logprobs.extend(event["logprobs"].as_array().unwrap().iter().cloned());
                }
            }
            "response.reasoning_text.done" => assert_eq!(event["text"], open.as_ref().unwrap().1.as_str()),
            "response.output_text.done" => {
                assert_eq!(event["text"], open.as_ref().unwrap().1.as_str());
                assert_eq!(event["logprobs"], json!(logprobs), "the deltas' logprobs add up");
            }
            "response.content_part.done" => assert_eq!(event["part"]["text"], open.as_ref().unwrap().1.as_str()),
            "response.function_call_arguments.done" => {
                assert_eq!(event["arguments"], open.as_ref().unwrap().1.as_str());
            }
            "response.output_item.done" => {
                open = None;
                assert_eq!(event["item"], output[done], "the item done is the response's");
                done += 1;
            }
            other => panic!("unexpected event {other}: {types:?}"),
        }
    }
    assert!(open.is_none() && done == output.len(), "{types:?}");
    last["response"].clone()
}

/// The parts of a response that do not differ between two runs of one request.
fn without_ids(response: &Value) -> Value {
    let mut response = response.clone();
    for key in ["id", "created_at", "usage"] {
        response.as_object_mut().unwrap().remove(key);
    }
    for item in response["output"].as_array_mut().unwrap() {
        item.as_object_mut().unwrap().remove("id");
        item.as_object_mut().unwrap().remove("call_id");
    }
    response
}

#[test]
fn a_response_and_its_stream_agree_and_a_cut_one_is_incomplete() {
    let server = Server::start(&[]);
    let request = json!({"model": "tiny", "input": "Tell me about ferries.", "max_output_tokens": 24,
        "temperature": 0, "instructions": "Be brief.", "metadata": {"run": "1"}});
    let (status, whole) = respond(&server, &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(
        (&whole["object"], &whole["model"]),
        (&json!("response"), &json!("tiny"))
    );
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"), "{whole}");
    assert_eq!(whole["status"], "incomplete", "{whole}");
    assert_eq!(whole["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(
        whole["store"], true,
        "kept, as OpenAI's API keeps responses unless told not to"
    );
    assert_eq!(
        (&whole["instructions"], &whole["metadata"]),
        (&json!("Be brief."), &json!({"run": "1"}))
    );
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.last().unwrap()["status"], "incomplete", "{whole}");
    let usage = &whole["usage"];
    assert_eq!(usage["output_tokens"], 24);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + 24)
    );

    let streamed = response_from_stream(&events(&server, &request));
    assert_eq!(without_ids(&streamed), without_ids(&whole));
    // The same prompt again: its full blocks come from the prefix cache.
    assert_eq!(streamed["usage"]["input_tokens"], usage["input_tokens"]);
    assert!(
        streamed["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // vLLM's cache_salt: another tenant's request finds none of it.
    let mut salted = request.clone();
    salted["cache_salt"] = json!("tenant-a");
    let (status, isolated) = respond(&server, &salted);
    assert_eq!(status, 200, "{isolated}");
    assert_eq!(
        isolated["usage"]["input_tokens_details"]["cached_tokens"], 0,
        "{isolated}"
    );
}

/// The message's tokens, each with its logprob and alternatives, checked: greedy's token first among them.
fn message_logprobs(response: &Value, alternatives: usize) -> Vec<Value> {
    let message = response["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "message")
        .expect("a message");
    let part = &message["content"][0];
    let entries = part["logprobs"].as_array().unwrap().clone();
    assert!(!entries.is_empty(), "{response}");
    for entry in &entries {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), alternatives, "{entry}");
        if let Some(first) = top.first() {
            assert_eq!(
                (&first["token"], &first["logprob"]),
                (&entry["token"], &entry["logprob"])
            );
        }
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0, "{entry}");
    }
    entries
}

/// The text a message's tokens spell.
fn spelled(entries: &[Value]) -> String {
    entries.iter().map(|e| e["token"].as_str().unwrap()).collect()
}

#[test]
fn the_messages_logprobs_are_its_tokens_and_stream_the_same() {
    let server = Server::start(&[]);
    let request = json!({"model": "tiny", "input": "Tell me about ferries.", "max_output_tokens": 8,
        "temperature": 0, "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let (status, whole) = respond(&server, &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["top_logprobs"], 2);
    let entries = message_logprobs(&whole, 2);
    assert_eq!(
        spelled(&entries),
        whole["output"][0]["content"][0]["text"].as_str().unwrap(),
        "{whole}"
    );
    assert!(entries.len() as u64 <= whole["usage"]["output_tokens"].as_u64().unwrap());
    // Streamed: each delta carries its tokens' logprobs (response_from_stream adds them up).
    let streamed = response_from_stream(&events(&server, &request));
    assert_eq!(without_ids(&streamed), without_ids(&whole));
    // `include` alone: no alternatives; `top_logprobs` alone asks for them too.
    let mut included = request.clone();
    included.as_object_mut().unwrap().remove("top_logprobs");
    let (_, included) = respond(&server, &included);
    assert_eq!(message_logprobs(&included, 0).len(), entries.len());
    let mut counted = request.clone();
    counted.as_object_mut().unwrap().remove("include");
    let (_, counted) = respond(&server, &counted);
    assert_eq!(message_logprobs(&counted, 2), entries);
    // Not asked: none.
    let (_, plain) = respond(
        &server,
        &json!({"model": "tiny", "input": "Tell me about ferries.", "max_output_tokens": 8}),
    );
    assert_eq!(plain["top_logprobs"], Value::Null);
    assert_eq!(plain["output"][0]["content"][0]["logprobs"], json!([]), "{plain}");
    for (field, value, param) in [
        ("top_logprobs", json!(21), "top_logprobs"),
        ("include", json!(["message.input_image.image_url"]), "include[0]"),
    ] {
        let mut bad = json!({"model": "tiny", "input": "hi"});
        bad[field] = value;
        let (status, error) = respond(&server, &bad);
        assert_eq!((status, &error["error"]["param"]), (400, &json!(param)), "{error}");
    }
}

#[test]
fn auto_truncation_leaves_out_the_earliest_turns_that_do_not_fit() {
    let server = Server::start(&["--max-model-len", "160"]);
    let turn = |n: usize| {
        [
            json!({"role": "user", "content": format!("Question {n}: tell me about ferries and boats and ships.")}),
            json!({"role": "assistant", "content": format!("Answer {n}: ferries carry people and cars across water.")}),
        ]
    };
    let mut conversation: Vec<Value> = (0..6).flat_map(turn).collect();
    conversation.push(json!({"role": "user", "content": "And harbours?"}));
    let request = json!({"model": "tiny", "input": conversation, "instructions": "Be brief.",
        "max_output_tokens": 4, "temperature": 0});
    let (status, error) = respond(&server, &request);
    assert_eq!(
        (status, &error["error"]["code"]),
        (400, &json!("context_length_exceeded")),
        "{error}"
    );
    assert_eq!(error["error"]["param"], "input");

    let mut auto = request.clone();
    auto["truncation"] = json!("auto");
    let (status, whole) = respond(&server, &auto);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["truncation"], "auto");
    let input_tokens = whole["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input_tokens < 160, "{whole}");
    // As few turns left out as fit: with one more turn kept, the prompt would not fit.
    let kept_turns = (0..6)
        .rev()
        .map(|first| {
            let mut kept: Vec<Value> = (first..6).flat_map(turn).collect();
            kept.push(json!({"role": "user", "content": "And harbours?"}));
            let mut shorter = request.clone();
            shorter["input"] = Value::Array(kept);
            (first, respond(&server, &shorter))
        })
        .take_while(|(_, (status, _))| *status == 200)
        .last()
        .expect("the last turn alone fits");
    let (first, (_, fitting)) = kept_turns;
    assert_eq!(
        fitting["usage"]["input_tokens"].as_u64(),
        Some(input_tokens),
        "turns {first}.. kept"
    );
    let streamed = response_from_stream(&events(&server, &auto));
    assert_eq!(streamed["usage"]["input_tokens"].as_u64(), Some(input_tokens));

    // What cannot fit even alone is still refused.
    let mut long = auto.clone();
    long["input"] = json!("ferries ".repeat(200));
    let (status, error) = respond(&server, &long);
    assert_eq!(
        (status, &error["error"]["code"]),
        (400, &json!("context_length_exceeded")),
        "{error}"
    );
}

fn tool_server(fixture: &str) -> Server {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(fixture);
    Server::start_serving(&["--model", fixture.to_str().unwrap(), "--api-key", KEY])
}

fn weather() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}})
}

#[test]
fn reasoning_and_tool_calls_come_as_items_and_go_back_in_the_input() {
    let server = tool_server("tool_calls_hermes");
    let question = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let request = json!({"model": "tiny", "input": question, "tools": [weather()],
        "include": ["message.output_text.logprobs"]});
    let (status, whole) = respond(&server, &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["status"], "completed", "{whole}");
    // The message's logprobs are its own tokens', not the reasoning's or the call's.
    let entries = message_logprobs(&whole, 0);
    let tokens: Vec<&str> = entries.iter().map(|e| e["token"].as_str().unwrap()).collect();
    // The scripted checkpoint writes the message and the call's opening as one token.
    assert_eq!(tokens, ["\n\nLet me check.\n\n<tool"], "{whole}");
    let output = whole["output"].as_array().unwrap();
    let types: Vec<&str> = output.iter().map(|item| item["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "message", "function_call"], "{whole}");
    assert_eq!(output[0]["content"][0]["text"], "\nThe user wants the weather.\n");
    assert_eq!(output[1]["content"][0]["text"], "Let me check.");
    let call = &output[2];
    assert_eq!(call["name"], "get_weather");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"), "{call}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 3}));
    let reasoning_tokens = whole["usage"]["output_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        reasoning_tokens > 0 && reasoning_tokens < whole["usage"]["output_tokens"].as_u64().unwrap(),
        "{whole}"
    );
    assert_eq!(whole["tools"][0]["name"], "get_weather");
    assert_eq!(whole["tool_choice"], "auto");

    let streamed = response_from_stream(&events(&server, &request));
    assert_eq!(without_ids(&streamed), without_ids(&whole));

    // The output and the call's result go back as the next request's input, as an agent sends them.
    let mut input = question.as_array().unwrap().clone();
    input.extend(output.iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}));
    let (status, again) = respond(&server, &json!({"model": "tiny", "input": input, "tools": [weather()]}));
    assert_eq!(status, 200, "{again}");
    assert!(again["usage"]["input_tokens"].as_u64() > whole["usage"]["input_tokens"].as_u64());

    // Forced (the cities listed: forced greedy output cannot run on in a free string), the schema enforced.
    let mut listed = weather();
    listed["parameters"]["properties"]["city"]["enum"] = json!(["Paris", "Oslo"]);
    listed["parameters"]["additionalProperties"] = json!(false);
    let forced = json!({"model": "tiny", "input": question, "tools": [listed.clone()], "tool_choice": "required",
        "parallel_tool_calls": false, "temperature": 0, "max_output_tokens": 200});
    let (status, forced) = respond(&server, &forced);
    assert_eq!(status, 200, "{forced}");
    let calls: Vec<&Value> = forced["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{forced}");
    assert_eq!(forced["tools"][0]["strict"], true);
    // allowed_tools in this API's shape, echoed as sent; its mistakes named in it.
    let choice =
        json!({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]});
    let narrowed = json!({"model": "tiny", "input": question, "tools": [listed.clone()], "tool_choice": choice,
        "parallel_tool_calls": false, "temperature": 0, "max_output_tokens": 200});
    let (status, narrowed) = respond(&server, &narrowed);
    assert_eq!(status, 200, "{narrowed}");
    assert_eq!(narrowed["tool_choice"], choice);
    assert!(
        narrowed["output"]
            .as_array()
            .unwrap()
            .iter()
            .any(|item| item["name"] == "get_weather"),
        "{narrowed}"
    );
    let wrong = json!({"model": "tiny", "input": question, "tools": [weather()],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "x"}]}});
    let (status, error) = respond(&server, &wrong);
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("tool_choice.tools[0].name")),
        "{error}"
    );
}

#[test]
fn a_kept_response_is_continued_read_and_deleted() {
    let server = Server::start(&[]);
    let first = json!({"model": "tiny", "input": "Tell me about ferries.", "instructions": "Be brief.",
        "max_output_tokens": 8, "temperature": 0});
    let (status, one) = respond(&server, &first);
    assert_eq!(status, 200, "{one}");
    let id = one["id"].as_str().unwrap();
    // Continued by its id, as the whole conversation sent again is answered (instructions are not carried over).
    let follow_up = json!({"role": "user", "content": "And boats?"});
    let continued = json!({"model": "tiny", "input": [follow_up], "previous_response_id": id,
        "max_output_tokens": 8, "temperature": 0});
    let (status, two) = respond(&server, &continued);
    assert_eq!(status, 200, "{two}");
    assert_eq!(two["previous_response_id"], *id);
    let mut conversation = vec![json!({"role": "user", "content": "Tell me about ferries."})];
    conversation.extend(one["output"].as_array().unwrap().iter().cloned());
    conversation.push(follow_up);
    let whole = json!({"model": "tiny", "input": conversation, "max_output_tokens": 8, "temperature": 0,
        "store": false});
    let (status, resent) = respond(&server, &whole);
    assert_eq!(status, 200, "{resent}");
    assert_eq!(
        two["output"][0]["content"], resent["output"][0]["content"],
        "{two} vs {resent}"
    );
    assert_eq!(two["usage"]["input_tokens"], resent["usage"]["input_tokens"]);
    // Read back as answered; a response with store false is not kept.
    let (status, read) = server.get(&format!("/v1/responses/{id}"), Some(KEY));
    assert_eq!(status, 200, "{read}");
    assert_eq!(serde_json::from_str::<Value>(&read).unwrap(), one);
    let unkept = resent["id"].as_str().unwrap();
    assert_eq!(server.get(&format!("/v1/responses/{unkept}"), Some(KEY)).0, 404);
    // The input items each request sent, newest first unless asked otherwise, a page at a time.
    let list = |response: &str, query: &str| {
        let (status, body) = server.get(&format!("/v1/responses/{response}/input_items{query}"), Some(KEY));
        (status, serde_json::from_str::<Value>(&body).unwrap())
    };
    let (status, items) = list(id, "");
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["object"], "list");
    let item = &items["data"][0];
    assert_eq!(
        (&item["type"], &item["role"], &item["content"]),
        (
            &json!("message"),
            &json!("user"),
            &json!([{"type": "input_text", "text": "Tell me about ferries."}])
        )
    );
    assert_eq!(items["first_id"], item["id"]);
    assert_eq!(list(id, "").1, items, "the same ids every time");
    let (_, own) = list(two["id"].as_str().unwrap(), "?order=asc&limit=1");
    assert_eq!(
        own["data"][0]["content"][0]["text"], "And boats?",
        "only the continuing request's own items"
    );
    assert_eq!(own["has_more"], false);
    assert_eq!(list(unkept, "").0, 404);
    let (status, error) = list(id, "?limit=0");
    assert_eq!((status, &error["error"]["param"]), (400, &json!("limit")), "{error}");
    // A streamed response is kept as its last event gave it.
    let streamed = response_from_stream(&events(&server, &first));
    let (status, read) = server.get(
        &format!("/v1/responses/{}", streamed["id"].as_str().unwrap()),
        Some(KEY),
    );
    assert_eq!((status, serde_json::from_str::<Value>(&read).unwrap()), (200, streamed));
    // Deleted, it is gone, and so is every conversation that continued it.
    let (status, deleted) = server.request("DELETE", &format!("/v1/responses/{id}"), None, Some(KEY));
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(
        serde_json::from_str::<Value>(&deleted).unwrap(),
        json!({"id": id, "object": "response", "deleted": true})
    );
    assert_eq!(server.get(&format!("/v1/responses/{id}"), Some(KEY)).0, 404);
    assert_eq!(
        server
            .request("DELETE", &format!("/v1/responses/{id}"), None, Some(KEY))
            .0,
        404
    );
    let mut after = continued.clone();
    after["previous_response_id"] = two["id"].clone();
    let (status, error) = respond(&server, &after);
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("previous_response_id")),
        "{error}"
    );
    assert!(error["error"]["message"].as_str().unwrap().contains(id), "{error}");
}

#[test]
fn what_this_server_cannot_honour_is_a_400_naming_the_field() {
    let server = Server::start(&[]);
    for (field, value) in [
        ("store", json!("yes")),
        ("previous_response_id", json!("resp_1")),
        ("include", json!("reasoning.encrypted_content")),
        ("max_output_tokens", json!(0)),
    ] {
        let mut request = json!({"model": "tiny", "input": "hi"});
        request[field] = value;
        let (status, error) = respond(&server, &request);
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["error"]["param"], field, "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }
    let (status, error) = respond(&server, &json!({"model": "tiny", "input": [{"role": "user"}]}));
    assert_eq!((status, &error["error"]["param"]), (400, &json!("input[0].content")));
    let (status, error) = respond(
        &server,
        &json!({"model": "tiny", "input": "hi", "reasoning": {"effort": "low"}}),
    );
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("reasoning.effort")),
        "Qwen3's template takes no effort: {error}"
    );
    let (status, error) = respond(&server, &json!({"model": "other", "input": "hi"}));
    assert_eq!((status, &error["error"]["code"]), (404, &json!("model_not_found")));
    let (status, _) = respond(
        &server,
        &json!({"model": "tiny", "input": "hi", "max_output_tokens": 2}),
    );
    assert_eq!(status, 200, "still serving");
    // The access log has a line for each, written once the response is done.
    let deadline = Instant::now() + Duration::from_secs(10);
    let logged = |line: &str| {
        server
            .log()
            .lines()
            .any(|l| l.contains("ferry::access") && l.contains(line))
    };
    while !(logged("POST /v1/responses 400") && logged("POST /v1/responses 200") && logged("outcome=length")) {
        assert!(Instant::now() < deadline, "no access lines:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_harmony_model_takes_an_effort_and_its_reasoning_goes_back_in_the_input() {
    let server = tool_server("tool_calls_harmony");
    let question = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let request = json!({"model": "tiny", "input": question, "tools": [weather()], "reasoning": {"effort": "low"}});
    let (status, whole) = respond(&server, &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["reasoning"]["effort"], "low");
    let output = whole["output"].as_array().unwrap();
    let types: Vec<&str> = output.iter().map(|item| item["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["reasoning", "function_call"], "{whole}");
    assert_eq!(output[0]["content"][0]["text"], "The user wants the weather in Paris.");
    let result = json!({"type": "function_call_output", "call_id": output[1]["call_id"], "output": "sunny"});
    // gpt-oss's template renders the reasoning before the call: given back, it grows the prompt.
    let mut prompts = vec![];
    for items in [&output[1..], &output[..]] {
        let mut input = question.as_array().unwrap().clone();
        input.extend(items.iter().cloned());
        input.push(result.clone());
        let (status, again) = respond(&server, &json!({"model": "tiny", "input": input, "tools": [weather()]}));
        assert_eq!(status, 200, "{again}");
        prompts.push(again["usage"]["input_tokens"].as_u64().unwrap());
    }
    assert!(prompts[1] > prompts[0], "{prompts:?}");
}
