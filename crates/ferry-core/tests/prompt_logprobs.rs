//! Prompt logprobs (`Request::prompt_logprobs`, OpenAI's `echo` with `logprobs`) on the qwen3_moe fixture on the
//! CPU: each prompt token after the first is scored once, in order, by the same numbers a generation gives the
//! same token at the same place; beside other requests, and across preemptions, nothing changes.

mod engine_common;

use std::path::Path;
use std::sync::Arc;

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::Backend;
use ferry_core::engine::{Event, ModelExecutor, Request, Scheduler, SchedulerConfig, SchedulingPolicy, TokenLogprobs};
use ferry_core::loader::Checkpoint;
use ferry_core::model::Model;

/// What a request heard: its prompt tokens' (id, logprobs), then its generated ones'.
#[derive(Debug, PartialEq)]
struct Heard {
    /// Each scored prompt token's rank (1: the most likely).
    ranks: Vec<usize>,
    prompt: Vec<(u32, TokenLogprobs)>,
    generated: Vec<(u32, TokenLogprobs)>,
}

/// Runs `requests` together through one scheduler whose KV holds `kv_tokens` tokens, in steps of `step_tokens`.
fn run(requests: Vec<Request>, step_tokens: usize, kv_tokens: usize) -> (Vec<Heard>, u64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let backend = CpuBackend;
    let model = Model::load(&backend, &checkpoint).unwrap();
    let kv = backend.new_kv(model.kv_spec(kv_tokens)).unwrap();
    let tokenizer = Arc::new(ferry_core::loader::Tokenizer::load(&checkpoint.dir).unwrap().unwrap());
    let config = SchedulerConfig {
        max_running: 4,
        max_queued: 4,
        step_tokens,
        max_model_len: kv_tokens.min(64),
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    let mut scheduler = Scheduler::new(config, ModelExecutor::new(backend, model, kv), tokenizer).unwrap();
    let heard = engine_common::run_to_the_end(&mut scheduler, requests)
        .into_iter()
        .map(|events| {
            let mut heard = Heard {
                ranks: vec![],
                prompt: vec![],
                generated: vec![],
            };
            for event in events {
                match event {
                    Event::PromptToken { id, logprobs, rank } => {
                        assert!(heard.generated.is_empty(), "a prompt token after a generated one");
                        heard.prompt.push((id, logprobs));
                        heard.ranks.push(rank);
                    }
                    Event::Token { id, logprobs, .. } => heard.generated.push((id, logprobs.unwrap())),
                    Event::Finished { .. } => {}
                    Event::Failed { message } => panic!("{message}"),
                }
            }
            heard
        })
        .collect();
    (heard, scheduler.stats().preemptions)
}

fn request(prompt: &[u32], max_tokens: usize, prompt_logprobs: Option<usize>) -> Request {
    let mut request = Request::new(prompt.to_vec(), max_tokens);
    request.logprobs = Some(3);
    request.prompt_logprobs = prompt_logprobs;
    request
}

#[test]
fn prompt_tokens_are_scored_as_generation_scores_them() {
    let prompt: Vec<u32> = (0..11u32).map(|t| (t * 37 + 5) % 500).collect();
    // Generate 8 greedy tokens, then score the prompt followed by them.
    let (generated, _) = run(vec![request(&prompt, 8, None)], 256, 64);
    let generated = &generated[0].generated;
    let whole: Vec<u32> = prompt
        .iter()
        .copied()
        .chain(generated.iter().map(|(id, _)| *id))
        .collect();
    let (scored, _) = run(vec![request(&whole, 1, Some(3))], 256, 64);
    let scored = &scored[0].prompt;
    assert_eq!(
        scored.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        whole[1..].to_vec(),
        "every prompt token after the first, once, in order"
    );
    // Where the generated tokens stand, their scores are the generation's, and greedy's tokens rank first.
    assert_eq!(&scored[prompt.len() - 1..], &generated[..]);
    let ranks = &run(vec![request(&whole, 1, Some(3))], 256, 64).0[0].ranks;
    assert!(ranks[prompt.len() - 1..].iter().all(|&rank| rank == 1), "{ranks:?}");
    // A token's rank counts the more likely ones: its place among the top alternatives when it is there.
    for ((id, lp), &rank) in scored.iter().zip(ranks) {
        match lp.top.iter().position(|(alt, _)| alt == id) {
            Some(place) => assert_eq!(rank, place + 1, "{lp:?}"),
            None => assert!(rank > lp.top.len(), "{lp:?}"),
        }
    }
    assert!(scored.iter().all(|(_, lp)| lp.top.len() == 3 && lp.logprob <= 0.0));
}

#[test]
fn scoring_beside_other_requests_and_across_preemptions_changes_nothing() {
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| (0..13 + 6 * i).map(|t| (t * 29 + i * 7) % 500).collect())
        .collect();
    let alone: Vec<Heard> = prompts
        .iter()
        .map(|p| run(vec![request(p, 6, Some(2))], 256, 64).0.remove(0))
        .collect();
    let requests = || prompts.iter().map(|p| request(p, 6, Some(2))).collect::<Vec<_>>();
    let (together, _) = run(requests(), 8, 256);
    assert_eq!(together, alone);
    // KV for about one request: some are preempted and recomputed, none scores a token twice.
    let (heard, preemptions) = run(requests(), 8, 40);
    assert!(preemptions > 0, "the KV was meant to run short");
    assert_eq!(heard, alone);
    // A request without prompt logprobs beside scored ones generates as it does alone.
    let plain = run(vec![request(&prompts[0], 6, None)], 256, 64).0.remove(0);
    let (mixed, _) = run(
        vec![request(&prompts[0], 6, None), request(&prompts[1], 6, Some(2))],
        8,
        256,
    );
    assert_eq!(mixed[0], plain);
}
