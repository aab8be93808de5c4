//! Prompt logprobs over real HTTP on the bundled fixture. A text completion's `echo`: each choice repeats its prompt
//! before its output and, with `logprobs`, scores the prompt's tokens (the first without a score) as generation
//! scores the same tokens in the same place, plain and streamed alike. vLLM's `prompt_logprobs`: each prompt
//! token's logprob, rank and alternatives, on completions and chat.

mod common;

use common::Server;
use serde_json::{json, Value};

fn ok(server: &Server, path: &str, body: &Value) -> Value {
    let (status, response) = server.post(path, body);
    assert_eq!(status, 200, "{response}");
    response
}

/// A choice's `logprobs` field as (tokens, token_logprobs, offsets).
fn legacy(logprobs: &Value) -> (Vec<String>, Vec<Value>, Vec<usize>) {
    let field = |name: &str| logprobs[name].clone();
    (
        serde_json::from_value(field("tokens")).unwrap(),
        serde_json::from_value(field("token_logprobs")).unwrap(),
        serde_json::from_value(field("text_offset")).unwrap(),
    )
}

#[test]
fn echoed_prompts_are_scored_as_generation_scores_them_plain_and_streamed() {
    let server = Server::start(&[]);
    let ids: Vec<u64> =
        serde_json::from_value(ok(&server, "/tokenize", &json!({"prompt": "Once upon a time"}))["tokens"].clone())
            .unwrap();
    // Greedy continues the prompt; echoing prompt and continuation scores the continuation as generating did.
    let body = json!({"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_token_ids": true});
    let generated = ok(&server, "/v1/completions", &body);
    let continuation: Vec<u64> = serde_json::from_value(generated["choices"][0]["token_ids"].clone()).unwrap();
    let (_, generated_scores, _) = legacy(&generated["choices"][0]["logprobs"]);
    let whole: Vec<u64> = ids.iter().chain(&continuation).copied().collect();
    let body = json!({"prompt": whole, "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": true});
    let echoed = ok(&server, "/v1/completions", &body);
    let choice = &echoed["choices"][0];
    let (tokens, scores, offsets) = legacy(&choice["logprobs"]);
    assert_eq!(tokens.len(), whole.len() + 2, "{choice}");
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
    assert!(
        scores[0].is_null() && choice["logprobs"]["top_logprobs"][0].is_null(),
        "the first prompt token"
    );
    assert!(
        scores[1..].iter().all(|s| s.as_f64().is_some_and(|s| s <= 0.0)),
        "{choice}"
    );
    assert_eq!(&scores[ids.len()..whole.len()], &generated_scores[..]);
    let mut expected = 0;
    for (offset, token) in offsets.iter().zip(&tokens) {
        assert_eq!(*offset, expected);
        expected += token.len();
    }
    assert_eq!(echoed["usage"]["prompt_tokens"], whole.len());
    assert_eq!(echoed["usage"]["completion_tokens"], 2);

    // Streamed: the prompt comes in the choice's first chunk; text and scores are the same.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks: Vec<Value> = server
        .post_stream("/v1/completions", &streamed)
        .iter()
        .filter(|c| *c != "[DONE]")
        .map(|c| serde_json::from_str(c).unwrap())
        .collect();
    let prompt_text = tokens[..whole.len()].concat();
    assert!(
        chunks[0]["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(&prompt_text),
        "{}",
        chunks[0]
    );
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, choice["text"].as_str().unwrap());
    let streamed_scores: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed_scores, scores);

    // Without logprobs: the prompt, then the output; no logprobs.
    let plain = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "echo": true}),
    );
    let text = plain["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("Once upon a time"), "{text:?}");
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    let unechoed = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(
        text,
        format!("Once upon a time{}", unechoed["choices"][0]["text"].as_str().unwrap())
    );

    // A batch of prompts, two choices each: every choice echoes its own prompt.
    let body = json!({"prompt": ["Once upon", "A time"], "n": 2, "max_tokens": 2, "temperature": 0, "echo": true,
                      "logprobs": 0});
    let batch = ok(&server, "/v1/completions", &body);
    for (i, prompt) in ["Once upon", "Once upon", "A time", "A time"].iter().enumerate() {
        let choice = &batch["choices"][i];
        assert!(choice["text"].as_str().unwrap().starts_with(prompt), "{choice}");
        assert!(choice["logprobs"]["token_logprobs"][0].is_null(), "{choice}");
    }
}

#[test]
fn vllms_prompt_logprobs_rank_each_prompt_token_with_its_alternatives() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
                      "echo": true, "logprobs": 1});
    let response = ok(&server, "/v1/completions", &body);
    let choice = &response["choices"][0];
    let scores = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        scores.len() as u64,
        response["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(scores[0].is_null());
    let (tokens, echoed, _) = legacy(&choice["logprobs"]);
    let ids: Vec<u64> =
        serde_json::from_value(ok(&server, "/tokenize", &json!({"prompt": "Once upon a time"}))["tokens"].clone())
            .unwrap();
    for (i, score) in scores.iter().enumerate().skip(1) {
        let entries = score.as_object().unwrap();
        assert!((1..=3).contains(&entries.len()), "{score}");
        let own = &entries[&ids[i].to_string()];
        // The same number the echo shows, and a rank that counts the more likely tokens.
        assert_eq!(own["logprob"], echoed[i], "{score}");
        assert_eq!(own["decoded_token"], json!(tokens[i]));
        let rank = own["rank"].as_u64().unwrap();
        let better = entries
            .values()
            .filter(|e| e["logprob"].as_f64() > own["logprob"].as_f64())
            .count() as u64;
        assert!(rank > better, "{score}");
        assert!(
            entries
                .values()
                .filter(|e| e != &own)
                .all(|e| e["rank"].as_u64().unwrap() <= 2),
            "{score}"
        );
    }
    // The echo's logprobs show their own count of alternatives: one each (and the token itself).
    assert!(choice["logprobs"]["top_logprobs"][1].as_object().unwrap().len() <= 2);

    // Chat: one list for the rendered prompt, beside the choices.
    let chat = json!({"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2,
                      "temperature": 0, "prompt_logprobs": 0});
    let answer = ok(&server, "/v1/chat/completions", &chat);
    let scores = answer["prompt_logprobs"].as_array().unwrap();
    assert_eq!(scores.len() as u64, answer["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(
        scores[1..].iter().all(|s| s.as_object().unwrap().len() == 1),
        "only the token itself"
    );

    // Several choices: one list for the prompt, computed once; each text choice of a prompt shows it.
    let mut several = chat.clone();
    several["n"] = json!(2);
    assert_eq!(
        ok(&server, "/v1/chat/completions", &several)["prompt_logprobs"],
        answer["prompt_logprobs"]
    );
    let body = json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2});
    let both = ok(&server, "/v1/completions", &body);
    assert_eq!(
        both["choices"][0]["prompt_logprobs"],
        both["choices"][1]["prompt_logprobs"]
    );
    assert_eq!(
        both["choices"][1]["prompt_logprobs"].as_array().unwrap().len() as u64,
        both["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{both}"
    );

    // Not with a stream, and within 0-20.
    for (extra, param) in [
        (json!({"stream": true}), "prompt_logprobs"),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (json!({"prompt_logprobs": -1}), "prompt_logprobs"),
    ] {
        let mut bad = chat.clone();
        bad.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, error) = server.post("/v1/chat/completions", &bad);
        assert_eq!(
            (status, error["error"]["param"].clone()),
            (400, json!(param)),
            "{extra}"
        );
    }
}
