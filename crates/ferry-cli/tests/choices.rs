//! `n` choices end to end over real HTTP on the bundled fixture: each choice is its seed's answer and starts from
//! the first one's cached prompt, a batch of prompts gets its choices in prompt order, more choices than the server
//! runs at once is refused by name, and a client that hangs up frees every choice.

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::{chat, Server, KEY};
use serde_json::{json, Value};

#[test]
fn n_choices_are_the_answers_of_their_seeds_share_the_prompt_and_stream_by_index() {
    let server = Server::start(&[]);
    let prompt = "Tell me about ferries. ".repeat(8);
    let sampled = |extra: Value| {
        let mut params = json!({"max_tokens": 8, "temperature": 1.0});
        params
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        chat(&prompt, params)
    };
    let request = sampled(json!({"seed": 7, "n": 3}));
    let (status, whole) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{whole}");
    // The first choice computed the prompt; the other two started from its blocks in the prefix cache.
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    let reusable = (prompt_tokens - 1) / 16 * 16;
    assert!(reusable > 0);
    assert_eq!(
        server.metric("ferry_prefix_cache_hit_tokens_total"),
        (2 * reusable) as f64
    );
    // Choice i is the answer of a one-choice request with seed 7 + i.
    let mut completion_tokens = 0;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        let (_, single) = server.post("/v1/chat/completions", &sampled(json!({"seed": 7 + i})));
        assert_eq!(choice["message"], single["choices"][0]["message"], "choice {i}");
        assert_eq!(
            choice["finish_reason"], single["choices"][0]["finish_reason"],
            "choice {i}"
        );
        assert_eq!(single["usage"]["prompt_tokens"], prompt_tokens);
        completion_tokens += single["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_ne!(
        choices[0]["message"], choices[1]["message"],
        "other seeds, other answers"
    );
    assert_eq!(whole["usage"]["completion_tokens"], completion_tokens);
    assert_eq!(whole["usage"]["total_tokens"], prompt_tokens + completion_tokens);

    // Streamed, each choice's deltas join into its answer, each choice ends once, and one usage chunk ends it all.
    let chunks = server.streamed_with_usage(&request);
    for (i, choice) in choices.iter().enumerate() {
        let of_choice = || {
            chunks
                .iter()
                .flat_map(|c| c["choices"].as_array().unwrap())
                .filter(|c| c["index"] == i)
        };
        let content: String = of_choice().filter_map(|c| c["delta"]["content"].as_str()).collect();
        let reasoning: String = of_choice()
            .filter_map(|c| c["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(
            content,
            choice["message"]["content"].as_str().unwrap_or(""),
            "choice {i}"
        );
        assert_eq!(
            reasoning,
            choice["message"]["reasoning_content"].as_str().unwrap_or(""),
            "choice {i}"
        );
        let finishes: Vec<&Value> = of_choice()
            .map(|c| &c["finish_reason"])
            .filter(|r| !r.is_null())
            .collect();
        assert_eq!(finishes, vec![&choice["finish_reason"]], "choice {i}");
    }
    let usage: Vec<&Value> = chunks.iter().map(|c| &c["usage"]).filter(|u| !u.is_null()).collect();
    assert_eq!(usage.len(), 1);
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[0][field], whole["usage"][field], "{field}");
    }

    // Text completions: each choice's logprobs count their text offsets from its own start.
    let text = json!({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 1.0,
                      "seed": 3, "n": 2, "logprobs": 1});
    let (status, whole) = server.post("/v1/completions", &text);
    assert_eq!(status, 200, "{whole}");
    for (i, choice) in whole["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["logprobs"]["text_offset"][0], 0, "{choice}");
        let mut single = text.clone();
        single["n"] = json!(1);
        single["seed"] = json!(3 + i);
        let (_, single) = server.post("/v1/completions", &single);
        assert_eq!(choice["text"], single["choices"][0]["text"], "choice {i}");
    }
}

#[test]
fn a_batch_of_prompts_gets_n_choices_each_in_prompt_order() {
    let server = Server::start(&[]);
    let prompts = ["The quick brown fox", "Ferries cross"];
    let batch = json!({"model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 1.0, "seed": 9, "n": 2});
    let (status, whole) = server.post("/v1/completions", &batch);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{whole}");
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (index, choice) in choices.iter().enumerate() {
        let (p, j) = (index / 2, index % 2);
        assert_eq!(choice["index"], index);
        let one = json!({"model": "tiny", "prompt": prompts[p], "max_tokens": 5, "temperature": 1.0, "seed": 9 + j});
        let (_, alone) = server.post("/v1/completions", &one);
        assert_eq!(choice["text"], alone["choices"][0]["text"], "prompt {p}, choice {j}");
        if j == 0 {
            prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
        }
        completion_tokens += alone["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(whole["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(whole["usage"]["completion_tokens"], completion_tokens);

    let mut streamed = batch.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/completions", &streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut texts = vec![String::new(); 4];
    for event in &events[..events.len() - 1] {
        for choice in serde_json::from_str::<Value>(event).unwrap()["choices"]
            .as_array()
            .unwrap()
        {
            texts[choice["index"].as_u64().unwrap() as usize] += choice["text"].as_str().unwrap();
        }
    }
    let whole_texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, whole_texts);
}

#[test]
fn more_choices_than_the_server_runs_at_once_is_a_400_naming_n() {
    // Without the prefix cache, a prompt's choices start together; they answer the same.
    let server = Server::start(&[
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--no-prefix-cache",
    ]);
    let (status, error) = server.post("/v1/chat/completions", &chat("hi", json!({"n": 3})));
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "n");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("more than the 2"),
        "{error}"
    );
    // However large, and however many prompts it multiplies.
    let (status, error) = server.post("/v1/chat/completions", &chat("hi", json!({"n": i64::MAX})));
    assert_eq!((status, &error["error"]["param"]), (400, &json!("n")), "{error}");
    let batch = json!({"prompt": vec!["a"; 3], "n": i64::MAX / 2});
    let (status, error) = server.post("/v1/completions", &batch);
    assert_eq!((status, &error["error"]["param"]), (400, &json!("n")), "{error}");
    let sampled = json!({"max_tokens": 4, "temperature": 1.0, "seed": 3});
    let mut two = chat("hi", sampled.clone());
    two["n"] = json!(2);
    let (status, answer) = server.post("/v1/chat/completions", &two);
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, choice) in choices.iter().enumerate() {
        let mut one = chat("hi", sampled.clone());
        one["seed"] = json!(3 + i);
        let (_, alone) = server.post("/v1/chat/completions", &one);
        assert_eq!(choice["message"], alone["choices"][0]["message"], "choice {i}");
    }
}

#[test]
fn a_client_that_hangs_up_on_n_choices_frees_them_all() {
    let server = Server::start(&["--max-running-requests", "3", "--max-queued-requests", "0"]);
    let long = chat("Go on and on.", json!({"max_tokens": 3000, "stream": true, "n": 3}));
    let stream = server.send("POST", "/v1/chat/completions", Some(&long.to_string()), Some(KEY));
    let mut reader = BufReader::new(stream);
    let mut seen = String::new();
    // The three role chunks, then text: by then the later choices were submitted too.
    while seen.matches("data: {").count() < 6 {
        assert!(reader.read_line(&mut seen).unwrap() > 0, "stream ended early:\n{seen}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.metric("ferry_running_requests") < 3.0 {
        assert!(Instant::now() < deadline, "the choices are not all running:\n{seen}");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.metric("ferry_kv_blocks_used") > 0.0 || server.metric("ferry_running_requests") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the choices were not freed:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Their places are free again.
    let again = chat("now us", json!({"max_tokens": 2, "n": 3}));
    assert_eq!(server.post("/v1/chat/completions", &again).0, 200);
}
