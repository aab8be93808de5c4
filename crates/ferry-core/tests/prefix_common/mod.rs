//! What the prefix-cache tests share (tests/prefix_cache.rs on the CPU, tests/cuda_prefix.rs on the GPU): prompts
//! whose prefixes are cached in every way that matters, and running them through one scheduler on any backend,
//! with prefix caching on or off, to compare the greedy tokens of cached and cold answers.

use std::path::Path;
use std::sync::{mpsc, Arc};

use ferry_core::backend::Backend;
use ferry_core::engine::{Event, ModelExecutor, Request, RequestId, Scheduler, SchedulerConfig, SchedulingPolicy};
use ferry_core::kv::{KvCache, BLOCK_SIZE};
use ferry_core::loader::Checkpoint;
use ferry_core::model::{spec_for, Model};

const MAX_TOKENS: usize = 10;

/// A 40-token prompt (2.5 blocks), the same again, a longer one it is a prefix of (so the shared prefix ends
/// mid-block), and that one changed inside its second block.
fn prompts() -> Vec<Vec<u32>> {
    let base: Vec<u32> = (0..40u32).map(|t| (t * 37 + 11) % 500).collect();
    let mut longer = base.clone();
    longer.extend((0..13u32).map(|t| (t * 53 + 7) % 500));
    let mut diverging = longer.clone();
    diverging[20] = (diverging[20] + 1) % 500;
    vec![base.clone(), base, longer, diverging]
}

/// Runs `prompts` one after another through one scheduler; each one's greedy tokens and cached prompt tokens.
fn answers<B: Backend>(
    backend: B,
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    caching: bool,
    step_tokens: usize,
) -> Vec<(Vec<u32>, usize)> {
    let model = Model::load(&backend, checkpoint).unwrap();
    let mut kv = backend.new_kv(model.kv_spec(512)).unwrap();
    if caching {
        let snapshots = if kv.has_recurrent_state() { 4 } else { 0 };
        kv.blocks_mut().enable_prefix_cache(snapshots);
    }
    let tokenizer = Arc::new(ferry_core::loader::Tokenizer::load(&checkpoint.dir).unwrap().unwrap());
    let config = SchedulerConfig {
        max_running: 2,
        max_queued: 2,
        step_tokens,
        max_model_len: 128,
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    let mut scheduler = Scheduler::new(config, ModelExecutor::new(backend, model, kv), tokenizer).unwrap();
    let mut out = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let (tx, rx) = mpsc::channel();
        let request = Request::new(prompt.clone(), MAX_TOKENS);
        scheduler
            .submit(RequestId(i as u64), request, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        while !scheduler.is_idle() {
            scheduler.step();
        }
        let mut ids = Vec::new();
        let mut cached = None;
        for event in rx.try_iter() {
            match event {
                Event::Token { id, .. } => ids.push(id),
                Event::Finished { cached_tokens, .. } => cached = Some(cached_tokens),
                Event::Failed { message } => panic!("{message}"),
                Event::PromptToken { .. } => panic!("prompt logprobs were not asked for"),
            }
        }
        out.push((ids, cached.expect("finished")));
    }
    out
}

/// Checks `fixtures`/`name`'s cached answers against its cold ones on backends `backend` makes, whole and in
/// chunks.
pub fn check_family<B: Backend>(fixtures: &Path, name: &str, backend: impl Fn() -> B) {
    let checkpoint = Checkpoint::open(&fixtures.join(name)).unwrap();
    let prompts = prompts();
    let cold = answers(backend(), &checkpoint, &prompts, false, 256);
    assert!(cold.iter().all(|(_, cached)| *cached == 0));
    let hybrid = spec_for(&checkpoint.model_type, &checkpoint.config)
        .unwrap()
        .gated_delta_net
        .is_some();
    // Two whole blocks of the 40-token prompt; of the diverging one, the first block, or for a hybrid nothing (its
    // state was saved only at the earlier prompts' ends).
    let expected_cached = [0, 32, 32, if hybrid { 0 } else { BLOCK_SIZE }];
    for step_tokens in [256, 7] {
        let cached = answers(backend(), &checkpoint, &prompts, true, step_tokens);
        for (i, ((ids, cached), (cold_ids, _))) in cached.iter().zip(&cold).enumerate() {
            assert_eq!(
                ids, cold_ids,
                "{name}, prompt {i}, steps of {step_tokens}: cached vs cold"
            );
            assert_eq!(
                *cached, expected_cached[i],
                "{name}, prompt {i}, steps of {step_tokens}"
            );
        }
    }
}
