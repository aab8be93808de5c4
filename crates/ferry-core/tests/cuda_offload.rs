//! Expert offload on the GPU (ignored unless asked for: scripts/device/gpu-tests.sh runs them on the GPU machine).
//!
//! - The offload path computes exactly what the all-resident path computes: same kernels, only where the expert
//!   weights live differs, so tokens and logits must be equal bit for bit, with a cache far smaller than the bank.
//! - Everything ferry allocates on the GPU stays under `--gpu-memory-budget`, measured with cuMemGetInfo.

use std::path::{Path, PathBuf};

use ferry_core::backend::cuda::workspace::MOE_GROUP_ROWS;
use ferry_core::backend::cuda::{CudaBackend, OffloadConfig};
use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::argmax;
use ferry_core::engine::plan::{plan_memory, BudgetRequest, OffloadMode, MAX_BATCH_TOKENS};
use ferry_core::kv::KvCache;
use ferry_core::loader::Checkpoint;
use ferry_core::model::{spec_for, Model, ModelInfo};
use ferry_core::moe::{Lru, OffloadStats};

fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(dir) => dir.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// Offload with `slots` LRU cache slots, as the CLI builds it.
fn lru(slots: usize) -> OffloadConfig {
    OffloadConfig {
        slots,
        policy: Box::new(Lru::new()),
    }
}

/// Greedy decode of `steps` tokens after `prompt`; every step's logits.
fn run(backend: &CudaBackend, checkpoint: &Checkpoint, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let model = Model::load(backend, checkpoint).unwrap();
    let mut kv = backend.new_kv(model.kv_spec(prompt.len() + steps)).unwrap();
    let seq = kv.alloc_seq();
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(MAX_BATCH_TOKENS).enumerate() {
        let slice = SeqSlice {
            seq,
            start_pos: i * MAX_BATCH_TOKENS,
            len: chunk.len(),
        };
        logits = backend
            .to_host(&model.forward(backend, chunk, &[slice], &mut kv).unwrap())
            .unwrap();
    }
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for pos in prompt.len()..prompt.len() + steps {
        let token = argmax(&logits) as u32;
        tokens.push(token);
        all.push(std::mem::take(&mut logits));
        let slice = SeqSlice {
            seq,
            start_pos: pos,
            len: 1,
        };
        logits = backend
            .to_host(&model.forward(backend, &[token], &[slice], &mut kv).unwrap())
            .unwrap();
    }
    (tokens, all)
}

/// Runs `prompt` and `steps` decode steps all-resident and offloaded with `slots` cache slots, asserts the two are
/// bit-identical, and returns the offload's counters.
fn check_offload_is_exact(
    checkpoint: &Checkpoint,
    prompt: &[u32],
    steps: usize,
    slots: usize,
    label: &str,
) -> OffloadStats {
    let resident = run(&CudaBackend::new(0).unwrap(), checkpoint, prompt, steps);
    let backend = CudaBackend::builder(0).unwrap().offload(lru(slots)).build().unwrap();
    let offloaded = run(&backend, checkpoint, prompt, steps);
    let stats = backend.offload_stats().unwrap();
    assert!(
        stats.copies > 0,
        "{label}: nothing was copied: the cache is not smaller than the bank"
    );
    assert_eq!(offloaded.0, resident.0, "{label}: tokens differ");
    for (step, (a, b)) in offloaded.1.iter().zip(&resident.1).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{label}: logits of step {step} differ"
        );
    }
    println!(
        "{label}, {slots} slots: {} tokens bit-identical; {} copies ({} prefetched), hit rate {:.2}",
        steps,
        stats.copies,
        stats.prefetched,
        stats.hit_rate()
    );
    stats
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn offload_equals_resident_for_every_fixture_family() {
    for family in [
        "qwen3_moe",
        "qwen3_moe_fused",
        "mixtral",
        "olmoe",
        "qwen2_moe",
        "qwen3_5_moe",
        "qwen3_next",
    ] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let experts = spec.moe.as_ref().unwrap().num_experts;
        // A prompt long enough to take the grouped (prefill) expert path, then decode steps.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
        // One layer's experts: every layer evicts the last; no room to prefetch the next layer beside them.
        let stats = check_offload_is_exact(&checkpoint, &prompt, 12, experts, family);
        assert_eq!(stats.prefetched, 0, "{family}");
        // Two layers' experts: the prefill chunk, which routes to all of a layer's experts, prefetches the next
        // MoE layer's (where there is one) while the slots of the layer computing are spared.
        let stats = check_offload_is_exact(&checkpoint, &prompt, 12, 2 * experts, family);
        let moe_layers = spec.num_moe_layers();
        assert_eq!(
            stats.prefetched > 0,
            moe_layers > 1,
            "{family}: {} prefetched",
            stats.prefetched
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn offload_equals_resident_for_q30_with_a_small_cache() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/q30.json");
    let config = std::env::var_os("FERRY_BENCH_DIR").map_or(config, |d| PathBuf::from(d).join("q30.json"));
    let checkpoint = Checkpoint::synthetic(&config, 0).unwrap();
    // 300 tokens route to every one of a layer's 128 experts, so each layer prefetches the next one's.
    let prompt: Vec<u32> = (0..300).map(|i| i * 1009 % 151_936).collect();
    // 256 slots of 6144 experts: a cache 24 times smaller than the bank, two layers' worth, so every prefetch
    // evicts and must spare the layer computing.
    let stats = check_offload_is_exact(&checkpoint, &prompt, 6, 256, "q30");
    assert!(stats.prefetched > 0, "q30: the prefill prefetched nothing");
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn what_ferry_allocates_stays_under_the_budget() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/q30.json");
    let config = std::env::var_os("FERRY_BENCH_DIR").map_or(config, |d| PathBuf::from(d).join("q30.json"));
    let checkpoint = Checkpoint::synthetic(&config, 0).unwrap();
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
    let info = ModelInfo::new(&spec, checkpoint.weight_dtype());
    let budget: u64 = 8 << 30;
    let request = BudgetRequest {
        budget_bytes: budget,
        mode: OffloadMode::Auto,
        slots: None,
        kv_reserve_tokens: 4096,
        max_batch_tokens: None,
        snapshot_slots: 0,
    };
    let plan = plan_memory(&info, &spec, &request).unwrap();
    assert!(plan.offload);
    assert!(
        plan.step_tokens > MOE_GROUP_ROWS,
        "the step runs its experts in several groups"
    );
    let gpu = CudaBackend::builder(0).unwrap();
    let (free_before, _) = gpu.memory_info().unwrap();
    let backend = gpu.offload(lru(plan.slots)).build().unwrap();
    let model = Model::load(&backend, &checkpoint).unwrap();
    let mut kv = backend.new_kv(model.kv_spec(plan.kv_tokens)).unwrap();
    // The largest pass the plan allows: a full prefill chunk, then decode steps.
    let seq = kv.alloc_seq();
    let prompt: Vec<u32> = (0..plan.step_tokens as u32).map(|i| i * 31 % 151_936).collect();
    let logits = model
        .forward(
            &backend,
            &prompt,
            &[SeqSlice {
                seq,
                start_pos: 0,
                len: prompt.len(),
            }],
            &mut kv,
        )
        .unwrap();
    let mut token = argmax(&backend.to_host(&logits).unwrap()) as u32;
    for pos in prompt.len()..prompt.len() + 8 {
        let logits = model
            .forward(
                &backend,
                &[token],
                &[SeqSlice {
                    seq,
                    start_pos: pos,
                    len: 1,
                }],
                &mut kv,
            )
            .unwrap();
        token = argmax(&backend.to_host(&logits).unwrap()) as u32;
    }
    let (free_after, _) = backend.memory_info().unwrap();
    let used = (free_before - free_after) as u64;
    println!(
        "budget {budget} bytes, ferry allocated {used} bytes ({:.1} %)",
        100.0 * used as f64 / budget as f64
    );
    assert!(
        used <= budget,
        "ferry allocated {used} bytes on the GPU, over its budget of {budget}"
    );
}
