//! The scheduler on real models (the qwen3_moe fixture, and the qwen3_5_moe hybrid whose Gated DeltaNet layers
//! carry recurrent state, on the CPU backend): requests batched together, prefilled in small chunks beside running
//! decodes, and preempted and recomputed when KV runs short, must generate exactly the greedy tokens each generates
//! alone.

use std::path::Path;
use std::sync::{mpsc, Arc};

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::Backend;
use ferry_core::engine::{Event, ModelExecutor, Request, RequestId, Scheduler, SchedulerConfig, SchedulingPolicy};
use ferry_core::loader::Checkpoint;
use ferry_core::model::Model;

const MAX_TOKENS: usize = 12;

fn prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|i| (0..9 + 4 * i).map(|t| (t * 37 + i * 11) % 500).collect())
        .collect()
}

/// Runs `prompts` through one scheduler whose KV cache holds `kv_tokens` tokens (in blocks of 16); returns the text
/// each streamed and how many preemptions there were.
fn scheduled(
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    step_tokens: usize,
    kv_tokens: usize,
    max_model_len: usize,
) -> (Vec<String>, u64) {
    let backend = CpuBackend;
    let model = Model::load(&backend, checkpoint).unwrap();
    let kv = backend.new_kv(model.kv_spec(kv_tokens)).unwrap();
    let tokenizer = Arc::new(ferry_core::loader::Tokenizer::load(&checkpoint.dir).unwrap().unwrap());
    let mut scheduler = Scheduler::new(
        SchedulerConfig {
            max_running: 4,
            max_queued: 4,
            step_tokens,
            max_model_len,
            sampled_vocab: None,
            policy: SchedulingPolicy::Fcfs,
        },
        ModelExecutor::new(backend, model, kv),
        tokenizer,
    )
    .unwrap();
    let receivers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt_ids)| {
            let (tx, rx) = mpsc::channel();
            // Greedy, with no eos ids: every request generates MAX_TOKENS tokens.
            let request = Request::new(prompt_ids.clone(), MAX_TOKENS);
            scheduler
                .submit(RequestId(i as u64), request, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            rx
        })
        .collect();
    for _ in 0..1000 {
        if scheduler.is_idle() {
            break;
        }
        scheduler.step();
    }
    assert!(scheduler.is_idle());
    assert_eq!(scheduler.stats().kv_blocks_used, 0);
    let texts = receivers
        .iter()
        .map(|rx| {
            let mut text = String::new();
            for event in rx.try_iter() {
                match event {
                    Event::Token { text: piece, .. } => text.push_str(&piece),
                    Event::Finished { completion_tokens, .. } => assert_eq!(completion_tokens, MAX_TOKENS),
                    Event::Failed { message } => panic!("{message}"),
                    Event::PromptToken { .. } => panic!("prompt logprobs were not asked for"),
                }
            }
            text
        })
        .collect();
    (texts, scheduler.stats().preemptions)
}

fn check_family(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let prompts = prompts();
    // Each prompt alone, whole.
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| scheduled(&checkpoint, std::slice::from_ref(p), 256, 64, 64).0.remove(0))
        .collect();
    // Whole prompts in one step, plenty of KV.
    assert_eq!(scheduled(&checkpoint, &prompts, 256, 256, 64), (expected.clone(), 0));
    // Prompts in chunks of a few tokens beside the decodes.
    assert_eq!(scheduled(&checkpoint, &prompts, 5, 256, 64), (expected.clone(), 0));
    // KV for about one context window (3 blocks of 16 tokens) shared by four requests of 21 to 33 tokens:
    // requests are preempted and recomputed.
    let (texts, preemptions) = scheduled(&checkpoint, &prompts, 7, 36, 34);
    assert_eq!(texts, expected);
    assert!(preemptions > 0, "the KV was meant to run short");
}

#[test]
fn batching_chunking_and_preemption_change_nothing() {
    check_family("qwen3_moe");
}

#[test]
fn the_same_holds_for_a_hybrid_with_recurrent_state() {
    check_family("qwen3_5_moe");
}
