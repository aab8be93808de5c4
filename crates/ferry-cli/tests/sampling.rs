//! The sampling surface of `ferry serve` over real HTTP on the bundled fixture (random weights): logprobs in
//! OpenAI's chat and completions shapes (plain and streamed), `logit_bias` moving greedy's choice, `min_p` and
//! `repetition_penalty` accepted, `response_format` output that validates, `allowed_token_ids` and `bad_words`
//! narrowing the output, logprobs naming tokens by id (`return_tokens_as_token_ids`), and bad values refused by
//! name.

mod common;

use common::Server;
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 6, "temperature": 0,
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

fn ok(server: &Server, path: &str, body: &Value) -> Value {
    let (status, response) = server.post(path, body);
    assert_eq!(status, 200, "{response}");
    response
}

/// `text`'s token ids, without special tokens, by the server's `/tokenize`.
fn token_ids(server: &Server, text: &str) -> Vec<u64> {
    let tokenized = ok(
        server,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    serde_json::from_value(tokenized["tokens"].clone()).unwrap()
}

#[test]
fn chat_logprobs_rank_greedys_choice_first_and_stream_the_same() {
    let server = Server::start(&[]);
    let body = chat(json!({"logprobs": true, "top_logprobs": 3}));
    let response = ok(&server, "/v1/chat/completions", &body);
    let content = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        response["usage"]["completion_tokens"],
        "{response}"
    );
    for entry in &content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        // Greedy's token is the most likely one: first among the alternatives, with the same logprob.
        assert_eq!(
            (&top[0]["token"], &top[0]["logprob"]),
            (&entry["token"], &entry["logprob"])
        );
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).unwrap();
        assert_eq!(String::from_utf8_lossy(&bytes), entry["token"].as_str().unwrap());
    }
    let text: String = content.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(text, response["choices"][0]["message"]["content"].as_str().unwrap());
    // Streamed: the same entries, spread over the chunks.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = server.post_stream("/v1/chat/completions", &streamed);
    let streamed_entries: Vec<Value> = chunks
        .iter()
        .filter(|c| *c != "[DONE]")
        .filter_map(|c| {
            serde_json::from_str::<Value>(c).unwrap()["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(streamed_entries, content);
    // Not asked: null.
    let plain = ok(&server, "/v1/chat/completions", &chat(json!({})));
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
}

#[test]
fn completion_logprobs_have_openais_legacy_shape() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "logprobs": 2});
    let response = ok(&server, "/v1/completions", &body);
    let choice = &response["choices"][0];
    let logprobs = &choice["logprobs"];
    let tokens: Vec<String> = serde_json::from_value(logprobs["tokens"].clone()).unwrap();
    assert_eq!(tokens.len(), 5, "{logprobs}");
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
    let offsets: Vec<usize> = serde_json::from_value(logprobs["text_offset"].clone()).unwrap();
    let mut expected = 0;
    for (offset, token) in offsets.iter().zip(&tokens) {
        assert_eq!(*offset, expected);
        expected += token.len();
    }
    for (i, token) in tokens.iter().enumerate() {
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        assert!((2..=3).contains(&top.len()), "{top:?}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(
            logprobs["token_logprobs"][i].as_f64().unwrap(),
            best,
            "greedy took the best"
        );
        assert_eq!(top[token.as_str()].as_f64().unwrap(), best);
    }
}

#[test]
fn tokens_as_token_ids_name_each_logprob_by_its_id() {
    let server = Server::start(&[]);
    // Text completions: the same answer, its tokens and top_logprobs keys as `token_id:{id}` of the ids the
    // answer's return_token_ids gives, its offsets still counting the text.
    let body = json!({"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "logprobs": 2,
                      "return_token_ids": true});
    let by_text = ok(&server, "/v1/completions", &body);
    let mut asked = body.clone();
    asked["return_tokens_as_token_ids"] = json!(true);
    let by_id = ok(&server, "/v1/completions", &asked);
    let (text_choice, id_choice) = (&by_text["choices"][0], &by_id["choices"][0]);
    assert_eq!(id_choice["text"], text_choice["text"]);
    let ids: Vec<u64> = serde_json::from_value(id_choice["token_ids"].clone()).unwrap();
    let names: Vec<String> = serde_json::from_value(id_choice["logprobs"]["tokens"].clone()).unwrap();
    assert_eq!(names, ids.iter().map(|id| format!("token_id:{id}")).collect::<Vec<_>>());
    assert_eq!(
        id_choice["logprobs"]["text_offset"],
        text_choice["logprobs"]["text_offset"]
    );
    for (i, name) in names.iter().enumerate() {
        let top = id_choice["logprobs"]["top_logprobs"][i].as_object().unwrap();
        assert!(top.contains_key(name.as_str()), "{top:?}");
        assert!(top.keys().all(|k| k.starts_with("token_id:")), "{top:?}");
    }
    // Chat: each entry's token and its alternatives' likewise, the bytes those of the name.
    let chat_body = chat(
        json!({"logprobs": true, "top_logprobs": 2, "return_tokens_as_token_ids": true,
                                "return_token_ids": true}),
    );
    let answer = ok(&server, "/v1/chat/completions", &chat_body);
    let ids: Vec<u64> = serde_json::from_value(answer["choices"][0]["token_ids"].clone()).unwrap();
    let content = answer["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), ids.len());
    for (entry, id) in content.iter().zip(&ids) {
        let name = format!("token_id:{id}");
        assert_eq!(entry["token"], json!(name));
        assert_eq!(entry["bytes"], json!(name.as_bytes()));
        assert!(entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|alt| alt["token"].as_str().unwrap().starts_with("token_id:")));
    }
    let (status, error) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "return_tokens_as_token_ids": "yes"}),
    );
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (400, Some("return_tokens_as_token_ids"))
    );
}

#[test]
fn logit_bias_against_greedys_first_token_changes_it() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Once upon", "max_tokens": 1, "temperature": 0, "logprobs": 0});
    let first = ok(&server, "/v1/completions", &body);
    let tokenized = ok(&server, "/tokenize", &json!({"prompt": first["choices"][0]["text"]}));
    let id = tokenized["tokens"][0].as_u64().unwrap();
    let mut biased = body.clone();
    biased["logit_bias"] = json!({ id.to_string(): -100 });
    let second = ok(&server, "/v1/completions", &biased);
    assert_ne!(second["choices"][0]["text"], first["choices"][0]["text"], "{second}");
    // min_p and repetition_penalty are accepted and generate.
    let mut other = body.clone();
    other["min_p"] = json!(0.1);
    other["repetition_penalty"] = json!(1.3);
    ok(&server, "/v1/completions", &other);
}

#[test]
fn json_schema_output_validates_and_json_object_output_is_an_object() {
    let server = Server::start(&[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["answer", "count"],
        "additionalProperties": false,
    });
    // The schema is enforced whether `strict` is true or false (as vLLM does). Thinking off: the random model,
    // let think first (a_structured_output_comes_after_the_thinking), would not stop within max_tokens.
    let no_thinking = json!({"enable_thinking": false});
    for (temperature, strict) in [(0.0, true), (1.0, false)] {
        let format =
            json!({"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": strict}});
        let body = chat(
            json!({"response_format": format, "max_tokens": 60, "temperature": temperature, "seed": 3,
            "chat_template_kwargs": no_thinking}),
        );
        let response = ok(&server, "/v1/chat/completions", &body);
        assert_eq!(response["choices"][0]["finish_reason"], "stop", "{response}");
        let text = response["choices"][0]["message"]["content"].as_str().unwrap();
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(["yes", "no"].contains(&value["answer"].as_str().unwrap()), "{value}");
        assert!((1..=9).contains(&value["count"].as_i64().unwrap()), "{value}");
        assert_eq!(value.as_object().unwrap().len(), 2, "{value}");
    }
    let body = chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 100,
        "chat_template_kwargs": no_thinking}));
    let response = ok(&server, "/v1/chat/completions", &body);
    let text = response["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with('{'), "{text:?}");
    if response["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text:?}");
    }
}

/// A model that reasons may think before the JSON a structured output asks for: the grammar lets its thinking come
/// first (here a bias toward `<think>`, and a larger one toward `</think>`, makes it open and close it at once), and
/// what follows is the schema's.
#[test]
fn a_structured_output_comes_after_the_thinking() {
    let server = Server::start(&[]);
    let id = |text: &str| ok(&server, "/tokenize", &json!({"prompt": text}))["tokens"][0].to_string();
    let bias = json!({ id("<think>"): 50, id("</think>"): 100 });
    let schema = json!({
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": false,
    });
    let format = json!({"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}});
    let body = chat(json!({"response_format": format, "max_tokens": 30, "logit_bias": bias, "logprobs": true}));
    let response = ok(&server, "/v1/chat/completions", &body);
    let choice = &response["choices"][0];
    let tokens: Vec<&str> = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens[..2], ["<think>", "</think>"], "{response}");
    let text = choice["message"]["content"].as_str().unwrap();
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(["yes", "no"].contains(&value["answer"].as_str().unwrap()), "{value}");
}

#[test]
fn stop_token_ids_end_the_output_and_min_tokens_holds_them_back() {
    let server = Server::start(&[]);
    // Sampled with a seed (the random model's greedy output repeats itself): the same tokens every time.
    let body = json!({"prompt": "Once upon", "max_tokens": 8, "temperature": 1, "seed": 2, "ignore_eos": true,
                      "logprobs": 0});
    let free = ok(&server, "/v1/completions", &body);
    let tokens: Vec<String> = serde_json::from_value(free["choices"][0]["logprobs"]["tokens"].clone()).unwrap();
    // A token from the third on that is one token alone and new to the output: it will end it.
    let id_of = |text: &str| token_ids(&server, text);
    let (at, id) = (2..tokens.len())
        .find_map(|k| match id_of(&tokens[k])[..] {
            [id] if !tokens[..k].contains(&tokens[k]) => Some((k, id)),
            _ => None,
        })
        .expect("a token that is one token alone");
    let mut stopped = body.clone();
    stopped["stop_token_ids"] = json!([id]);
    let answer = ok(&server, "/v1/completions", &stopped);
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{answer}");
    assert_eq!(
        choice["text"],
        tokens[..at].concat(),
        "the stop token's text is not output"
    );
    assert_eq!(answer["usage"]["completion_tokens"], at + 1);
    // With min_tokens past it, the stop token is out of the running at that position: the output goes on.
    stopped["min_tokens"] = json!(at + 1);
    let answer = ok(&server, "/v1/completions", &stopped);
    let later: Vec<String> = serde_json::from_value(answer["choices"][0]["logprobs"]["tokens"].clone()).unwrap();
    assert!(later.len() > at + 1, "{answer}");
    assert_eq!(later[..at], tokens[..at]);
    assert_ne!(later[at], tokens[at]);
}

#[test]
fn a_stop_string_can_stay_in_the_output_and_special_tokens_can_write_their_text() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Once upon", "max_tokens": 8, "temperature": 1, "seed": 2, "ignore_eos": true});
    let free = ok(&server, "/v1/completions", &body);
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string from the middle of the output: cut before it, or after it when it is kept.
    let stop = "ear";
    let at = text.find(stop).expect("the seeded output holds the stop string");
    let mut stopped = body.clone();
    stopped["stop"] = json!([stop]);
    let cut = ok(&server, "/v1/completions", &stopped);
    assert_eq!(cut["choices"][0]["text"], text[..at], "{cut}");
    stopped["include_stop_str_in_output"] = json!(true);
    let kept = ok(&server, "/v1/completions", &stopped);
    assert_eq!(kept["choices"][0]["text"], text[..at + stop.len()], "{kept}");
    assert_eq!(kept["choices"][0]["finish_reason"], "stop");

    // A special token forced by logit_bias writes nothing, unless skip_special_tokens is false.
    let start = ok(&server, "/tokenize", &json!({"prompt": "<|im_start|>"}))["tokens"][0].clone();
    let mut forced = json!({"prompt": "Once upon", "max_tokens": 2, "temperature": 0, "ignore_eos": true});
    forced["logit_bias"] = json!({ start.to_string(): 100 });
    let skipped = ok(&server, "/v1/completions", &forced);
    assert_eq!(skipped["choices"][0]["text"], "", "{skipped}");
    forced["skip_special_tokens"] = json!(false);
    let written = ok(&server, "/v1/completions", &forced);
    assert_eq!(written["choices"][0]["text"], "<|im_start|><|im_start|>", "{written}");
}

#[test]
fn structured_outputs_constrain_to_a_choice_a_regex_a_grammar_or_a_schema() {
    let server = Server::start(&[]);
    let text = |structured: Value| -> String {
        let body = json!({"prompt": "Once upon", "max_tokens": 12, "temperature": 1, "seed": 5,
                          "structured_outputs": structured});
        ok(&server, "/v1/completions", &body)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let choice = text(json!({"choice": ["ferry", "boat"]}));
    assert!(["ferry", "boat"].contains(&choice.as_str()), "{choice:?}");
    let digits = text(json!({"regex": "[0-9]{3}-[a-c]"}));
    assert!(
        digits.len() == 5 && digits[..3].bytes().all(|b| b.is_ascii_digit()) && "abc".contains(&digits[4..]),
        "{digits:?}"
    );
    let grammar = text(json!({"grammar": "start: \"<\" (\"x\" | \"y\") \">\""}));
    assert!(["<x>", "<y>"].contains(&grammar.as_str()), "{grammar:?}");
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                        "additionalProperties": false});
    let json_text = text(json!({"json": schema.to_string()}));
    let value: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| panic!("{json_text:?}: {e}"));
    assert!(value["ok"].is_boolean(), "{value}");
    // In a chat, after the model's thinking (ended at once by the bias: a random model thinks forever).
    let id = |text: &str| ok(&server, "/tokenize", &json!({"prompt": text}))["tokens"][0].to_string();
    let bias = json!({ id("<think>"): 50, id("</think>"): 100 });
    let body = chat(json!({"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 30, "logit_bias": bias}));
    let answer = ok(&server, "/v1/chat/completions", &body);
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(["yes", "no"].contains(&content), "{answer}");

    for (structured, extra) in [
        (json!({"regex": "a", "choice": ["b"]}), json!({})),
        (json!({}), json!({})),
        (json!({"regex": "(unclosed"}), json!({})),
        (
            json!({"choice": ["a"]}),
            json!({"response_format": {"type": "json_object"}}),
        ),
    ] {
        let mut body = chat(extra);
        body["structured_outputs"] = structured.clone();
        let (status, error) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{structured}: {error}");
        assert_eq!(error["error"]["param"], "structured_outputs", "{structured}: {error}");
    }
    let (status, error) = server.post(
        "/v1/chat/completions",
        &chat(json!({"structured_outputs": {"choice": []}})),
    );
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("structured_outputs.choice")),
        "{error}"
    );
}

#[test]
fn only_allowed_token_ids_come_out() {
    let server = Server::start(&[]);
    let first_token = |text: &str| {
        ok(
            &server,
            "/tokenize",
            &json!({"prompt": text, "add_special_tokens": false}),
        )["tokens"][0]
            .clone()
    };
    let allowed = [first_token("ferry"), first_token(" boat")];
    let texts: Vec<Value> = allowed
        .iter()
        .map(|id| ok(&server, "/detokenize", &json!({"tokens": [id]}))["prompt"].clone())
        .collect();
    let body = json!({"prompt": "Once upon", "max_tokens": 6, "temperature": 1, "seed": 4, "ignore_eos": true,
                      "allowed_token_ids": allowed, "logprobs": 0});
    let narrow = ok(&server, "/v1/completions", &body);
    let tokens: Vec<Value> = serde_json::from_value(narrow["choices"][0]["logprobs"]["tokens"].clone()).unwrap();
    assert_eq!(tokens.len(), 6);
    assert!(
        tokens.iter().all(|t| texts.contains(t)),
        "{tokens:?} not among {texts:?}"
    );
    let (status, error) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "allowed_token_ids": allowed, "structured_outputs": {"choice": ["a"]}}),
    );
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("allowed_token_ids")),
        "{error}"
    );
}

#[test]
fn truncate_prompt_tokens_keeps_the_prompts_end() {
    let server = Server::start(&["--max-model-len", "64"]);
    let ids: Vec<u32> = (100..200).collect();
    let greedy = |prompt: &[u32], extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        server.post("/v1/completions", &body)
    };
    // 100 tokens do not fit a 64-token context; their last 20 do, and answer as those 20 alone.
    assert_eq!(greedy(&ids, json!({})).0, 400);
    let (status, cut) = greedy(&ids, json!({"truncate_prompt_tokens": 20}));
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["prompt_tokens"], 20);
    let (_, tail) = greedy(&ids[80..], json!({}));
    assert_eq!(cut["choices"][0]["text"], tail["choices"][0]["text"]);
    assert_eq!(
        greedy(&ids, json!({"truncate_prompt_tokens": 0})).1["error"]["param"],
        "truncate_prompt_tokens"
    );
}

#[test]
fn return_token_ids_gives_the_prompts_and_each_choices_ids_plain_and_streamed() {
    let server = Server::start(&[]);
    // Chat: the prompt's ids once, at the top; each choice's ids decode to its text.
    let body = chat(
        json!({"return_token_ids": true, "max_tokens": 6, "n": 2, "temperature": 1, "seed": 1,
                           "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let whole = ok(&server, "/v1/chat/completions", &body);
    let tokenized = ok(
        &server,
        "/tokenize",
        &json!({"messages": body["messages"],
                                                     "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(whole["prompt_token_ids"], tokenized["tokens"], "{whole}");
    for choice in whole["choices"].as_array().unwrap() {
        assert_eq!(choice["token_ids"].as_array().unwrap().len(), 6, "{choice}");
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/chat/completions", &streamed);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["prompt_token_ids"], tokenized["tokens"]);
    for (i, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<Value> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == i)
            .flat_map(|c| c["token_ids"].as_array().cloned().unwrap_or_default())
            .collect();
        assert_eq!(Value::from(ids), choice["token_ids"], "choice {i}");
    }
    // Text completions: each choice names its prompt's ids; without the field, no ids.
    let text = json!({"prompt": ["Once upon", "Ferries"], "max_tokens": 3, "temperature": 0, "return_token_ids": true});
    let whole = ok(&server, "/v1/completions", &text);
    for (i, prompt) in ["Once upon", "Ferries"].iter().enumerate() {
        let ids = ok(&server, "/tokenize", &json!({"prompt": prompt}))["tokens"].clone();
        assert_eq!(whole["choices"][i]["prompt_token_ids"], ids);
        let decoded = ok(
            &server,
            "/detokenize",
            &json!({"tokens": whole["choices"][i]["token_ids"]}),
        );
        assert_eq!(decoded["prompt"], whole["choices"][i]["text"]);
    }
    let plain = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 3}),
    );
    assert!(plain["choices"][0].get("token_ids").is_none() && plain.get("prompt_token_ids").is_none());
}

#[test]
fn bad_sampling_values_are_400s_naming_the_field() {
    let server = Server::start(&[]);
    let schema_of = |schema: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
    for (field, value, param) in [
        ("logit_bias", json!({"abc": 1}), "logit_bias"),
        ("logit_bias", json!({"1": 101}), "logit_bias"),
        ("logit_bias", json!({"100000": 1}), "logit_bias"),
        ("top_logprobs", json!(21), "top_logprobs"),
        ("min_p", json!(1.5), "min_p"),
        ("repetition_penalty", json!(0), "repetition_penalty"),
        ("stop_token_ids", json!([1, -2]), "stop_token_ids"),
        ("stop_token_ids", json!(5), "stop_token_ids"),
        ("stop_token_ids", json!([100000]), "stop_token_ids"),
        ("stop_token_ids", json!(vec![1; 257]), "stop_token_ids"),
        ("allowed_token_ids", json!([100000]), "allowed_token_ids"),
        ("allowed_token_ids", json!("1"), "allowed_token_ids"),
        ("min_tokens", json!(-1), "min_tokens"),
        ("min_tokens", json!(7), "min_tokens"),
        ("include_stop_str_in_output", json!(1), "include_stop_str_in_output"),
        ("skip_special_tokens", json!("no"), "skip_special_tokens"),
        ("response_format", json!({"type": "yaml"}), "response_format.type"),
        (
            "response_format",
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            "response_format",
            schema_of(json!({"type": "nonsense"})),
            "response_format",
        ),
        (
            "response_format",
            schema_of(json!(true)),
            "response_format.json_schema.schema",
        ),
    ] {
        let mut body = chat(json!({}));
        body[field] = value;
        if field == "top_logprobs" {
            body["logprobs"] = json!(true);
        }
        let (status, error) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{field}: {error}");
        assert_eq!(error["error"]["param"], param, "{error}");
    }
    // A grammar may allow nothing but the end, which min_tokens would hold back.
    let constrained = chat(json!({"min_tokens": 2, "response_format": {"type": "json_object"}}));
    let (status, error) = server.post("/v1/chat/completions", &constrained);
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("min_tokens")),
        "{error}"
    );
    let (status, error) = server.post("/v1/chat/completions", &chat(json!({"top_logprobs": 2})));
    assert_eq!((status, error["error"]["param"].clone()), (400, json!("top_logprobs")));
    let text = json!({"prompt": "hi", "max_tokens": 2, "logprobs": 6});
    let (status, error) = server.post("/v1/completions", &text);
    assert_eq!((status, error["error"]["param"].clone()), (400, json!("logprobs")));
}

#[test]
fn a_bad_word_greedy_would_write_is_not_written() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 0});
    let tokens_of = |response: &Value| -> Vec<String> {
        serde_json::from_value(response["choices"][0]["logprobs"]["tokens"].clone()).unwrap()
    };
    let greedy = tokens_of(&ok(&server, "/v1/completions", &body));
    // The word of greedy's first token: banned as it reads alone and after a space, so neither token comes out.
    let word = greedy[0].trim().to_string();
    assert!(!word.is_empty(), "{greedy:?}");
    let mut banned = body.clone();
    banned["bad_words"] = json!([word]);
    let answer = ok(&server, "/v1/completions", &banned);
    let without = tokens_of(&answer);
    assert_eq!(without.len(), 6);
    for text in [word.clone(), format!(" {word}")] {
        let ids = token_ids(&server, &text);
        if ids.len() == 1 {
            let spelled = ok(&server, "/detokenize", &json!({"tokens": ids}))["prompt"].clone();
            assert!(!without.iter().any(|t| json!(t) == spelled), "{spelled} in {without:?}");
        }
    }
    assert_ne!(without[0], greedy[0], "greedy's first token is the word itself");
    // Streamed: the same tokens.
    let mut streamed = banned.clone();
    streamed["stream"] = json!(true);
    let text: String = server
        .post_stream("/v1/completions", &streamed)
        .iter()
        .filter(|c| *c != "[DONE]")
        .map(|c| {
            serde_json::from_str::<Value>(c).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(text, answer["choices"][0]["text"].as_str().unwrap());
    let (status, error) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "bad_words": [word], "structured_outputs": {"choice": ["a"]}}),
    );
    assert_eq!(
        (status, &error["error"]["param"]),
        (400, &json!("bad_words")),
        "{error}"
    );
}
