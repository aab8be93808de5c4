//! Expert offload on the GPU (ignored unless asked for: scripts/device/gpu-tests.sh runs them on the GPU machine).
//!
//! - The offload path computes exactly what the all-resident path computes: same kernels, only where the expert
//!   weights live (and, in decode, in what order the experts' work starts while copies land) differs, so tokens and
//!   logits must be equal bit for bit, with a cache far smaller than the bank, with decode steps where every
//!   expert hits, where every expert misses and where both mix, and with decode prefetch on and off.
//! - Everything ferry allocates on the GPU stays under `--gpu-memory-budget`, measured with cuMemGetInfo.
//! - With the CPU lane forced on (a share of every step's misses, or all of them; one sequence or a batch of three;
//!   bf16 or FP8 banks), greedy tokens equal the all-resident run's and logits agree to 1e-3 (the parity tests' tolerance): each lane product is the same f32
//!   arithmetic as the GPU's with its dot products summed in another order (AVX-512 lanes against warp shuffles),
//!   about 1e-7 relative per product, and moe_combine sums every row's experts in router order as before.

use std::path::{Path, PathBuf};

use ferry_core::backend::cuda::workspace::MOE_GROUP_ROWS;
use ferry_core::backend::cuda::{CudaBackend, HostStagedSum, OffloadConfig};
use ferry_core::backend::expert_parallel::ExpertParallel;
use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::argmax;
use ferry_core::engine::plan::{plan_memory, BudgetRequest, MemoryPlan, OffloadMode, MAX_BATCH_TOKENS};
use ferry_core::kv::KvCache;
use ferry_core::loader::Checkpoint;
use ferry_core::model::{spec_for, FfnKind, Model, ModelInfo};
use ferry_core::moe::{CpuLaneCost, LaneRates, Lru, OffloadStats, SplitRule};

fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(dir) => dir.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// Offload with `slots` LRU cache slots and decode prefetch on or off (the CLI turns it on).
fn lru(slots: usize, decode_prefetch: bool) -> OffloadConfig {
    OffloadConfig {
        slots,
        policy: Box::new(Lru::new()),
        decode_prefetch,
    }
}

/// A greedy run: its tokens, every decode step's logits, and (under offload) the counters once the prompt is in.
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    after_prefill: Option<OffloadStats>,
}

/// Greedy decode of `steps` tokens after `prompt`.
fn run<B: Backend>(backend: &B, checkpoint: &Checkpoint, prompt: &[u32], steps: usize) -> Run {
    run_model(backend, &Model::load(backend, checkpoint).unwrap(), prompt, steps)
}

/// [`run`] of a loaded model.
fn run_model<B: Backend>(backend: &B, model: &Model<B>, prompt: &[u32], steps: usize) -> Run {
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
    let after_prefill = backend.offload_stats();
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
    Run {
        tokens,
        logits: all,
        after_prefill,
    }
}

/// What the decode steps of an offloaded run did: its counters at the end, and its hits and misses after the
/// prompt.
struct Decoded {
    stats: OffloadStats,
    hits: u64,
    misses: u64,
}

/// Runs `prompt` and `steps` decode steps all-resident and offloaded as `config` says, asserts the two are
/// bit-identical, and returns the offload's counters.
fn check_offload_is_exact(
    checkpoint: &Checkpoint,
    prompt: &[u32],
    steps: usize,
    config: OffloadConfig,
    label: &str,
) -> Decoded {
    check_offload(checkpoint, prompt, steps, config, SplitRule::Link, label)
}

/// Logits of a run with the CPU lane agree with the all-resident run's to this (absolute).
const LANE_LOGIT_TOLERANCE: f32 = 1e-3;

/// Asserts that `offloaded`, its misses split by `split`, computed what `resident` did: bit for bit over the link
/// alone, the same greedy tokens and logits within [`LANE_LOGIT_TOLERANCE`] with the CPU lane.
fn assert_same_run(offloaded: &Run, resident: &Run, split: SplitRule, label: &str) {
    assert_eq!(offloaded.tokens, resident.tokens, "{label}: tokens differ");
    for (step, (a, b)) in offloaded.logits.iter().zip(&resident.logits).enumerate() {
        let same = match split {
            SplitRule::Link => a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            _ => a.iter().zip(b).all(|(x, y)| (x - y).abs() <= LANE_LOGIT_TOLERANCE),
        };
        assert!(same, "{label}: logits of step {step} differ");
    }
}

/// Runs `prompt` and `steps` decode steps all-resident and offloaded as `config` says, with misses split by
/// `split`: bit-identical to resident over the link alone, greedy tokens equal and logits within
/// [`LANE_LOGIT_TOLERANCE`] with the CPU lane. Returns the offload's counters.
fn check_offload(
    checkpoint: &Checkpoint,
    prompt: &[u32],
    steps: usize,
    config: OffloadConfig,
    split: SplitRule,
    label: &str,
) -> Decoded {
    let slots = config.slots;
    let resident = run(&CudaBackend::new(0).unwrap(), checkpoint, prompt, steps);
    let backend = CudaBackend::builder(0)
        .unwrap()
        .offload(config)
        .split(split)
        .build()
        .unwrap();
    let offloaded = run(&backend, checkpoint, prompt, steps);
    let stats = backend.offload_stats().unwrap();
    assert!(
        stats.copies + stats.host_experts > 0,
        "{label}: nothing was missed: the cache is not smaller than the bank"
    );
    assert_same_run(&offloaded, &resident, split, label);
    let prefilled = offloaded.after_prefill.unwrap();
    let decoded = Decoded {
        hits: stats.hits() - prefilled.hits(),
        misses: stats.misses() - prefilled.misses(),
        stats,
    };
    let s = &decoded.stats;
    println!(
        "{label}, {slots} slots: {steps} tokens bit-identical; {} copies ({} prefetched, {} used), hit rate {:.2}; \
         decode {} hits, {} misses; guesses: precision {:.2}, recall {:.2}, {} copied, {} dropped; CPU lane {} \
         experts, {} pairs",
        s.copies,
        s.prefetched,
        s.prefetches_used,
        s.hit_rate(),
        decoded.hits,
        decoded.misses,
        s.guess_precision(),
        s.guess_recall(),
        s.guesses_copied,
        s.guesses_dropped,
        s.host_experts,
        s.host_pairs,
    );
    decoded
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
        "deepseek_v3",
        "glm4_moe",
        "gpt_oss",
        "gpt_oss_mxfp4",
        "qwen3_moe_fp8",
        "qwen3_5_moe_fp8_dynamic",
        "deepseek_v3_fp8",
        "glm4_moe_fp8",
    ] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let experts = spec.moe.as_ref().unwrap().num_experts;
        // A prompt long enough to take the grouped (prefill) expert path, then decode steps.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
        let moe_layers = spec.num_moe_layers();
        // A MoE layer after any other layer is guessed in decode: by the MoE layer before it, or by the dense
        // layer just before it (guess_ahead).
        let guessed_layers = spec.layers[1..].iter().any(|l| matches!(l.ffn, FfnKind::Moe));
        // One layer's experts: every layer evicts the last; no room to prefetch the next layer beside them, in
        // prefill or in decode (a guess must spare the experts of the layer computing).
        let decoded = check_offload_is_exact(&checkpoint, &prompt, 12, lru(experts, false), family);
        assert_eq!(decoded.stats.prefetched, 0, "{family}");
        assert_eq!(decoded.stats.guessed, 0, "{family}: guesses with decode prefetch off");
        // Two layers' experts: the prefill chunk, which routes to all of a layer's experts, prefetches the next
        // MoE layer's (where there is one) while the slots of the layer computing are spared; decode guesses the
        // routing of each MoE layer after the first layer and may copy what it guesses.
        let decoded = check_offload_is_exact(&checkpoint, &prompt, 12, lru(2 * experts, true), family);
        let stats = &decoded.stats;
        assert_eq!(
            stats.prefetched > 0,
            moe_layers > 1,
            "{family}: {} prefetched",
            stats.prefetched
        );
        assert_eq!(stats.guessed > 0, guessed_layers, "{family}: {} guessed", stats.guessed);
        assert!(
            stats.guessed_routed <= stats.guessed.min(stats.routed_after_guess),
            "{family}"
        );
    }
}

/// Two ranks of an expert-parallel group on GPU 0, each holding its share of every layer's experts resident or
/// offloaded.
fn two_ranks(offload: Option<(usize, SplitRule)>) -> ExpertParallel<CudaBackend> {
    let rank = || match offload {
        None => CudaBackend::new(0).unwrap(),
        Some((slots, split)) => CudaBackend::builder(0)
            .unwrap()
            .offload(lru(slots, true))
            .split(split)
            .build()
            .unwrap(),
    };
    ExpertParallel::new(vec![rank(), rank()], Box::new(HostStagedSum)).unwrap()
}

/// Expert parallelism under offload: each rank banks, caches, streams (and on its CPU lane computes) only its own
/// experts, its cache holding one layer's share, so every layer misses. Against the same two ranks with their
/// shares resident: bit for bit over the link (the grouped prefill path and decode under copies, other ranks'
/// pairs adding nothing in either), and with half of each rank's misses on its CPU lane the same greedy tokens and
/// logits within the lane's tolerance.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn expert_parallel_ranks_under_offload_equal_resident_ranks() {
    for (family, lane) in [
        ("qwen3_moe", true),
        ("qwen3_5_moe", true),
        ("deepseek_v3", false),
        ("gpt_oss_mxfp4", false),
        ("glm4_moe_fp8", false),
    ] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let share = spec.moe.as_ref().unwrap().num_experts.div_ceil(2);
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
        let resident = run(&two_ranks(None), &checkpoint, &prompt, 12);
        let splits = if lane {
            vec![SplitRule::Link, SplitRule::Share(0.5)]
        } else {
            vec![SplitRule::Link]
        };
        for split in splits {
            let label = format!("{family}, two offloaded ranks, {split:?}");
            let group = two_ranks(Some((share, split)));
            let offloaded = run(&group, &checkpoint, &prompt, 12);
            let stats = group.offload_stats().unwrap();
            assert!(stats.copies > 0, "{label}: nothing was copied");
            assert_eq!(stats.host_experts > 0, split != SplitRule::Link, "{label}");
            assert_same_run(&offloaded, &resident, split, &label);
            println!(
                "{label}: {} tokens as resident; {} copies, {} on the CPU lanes, hit rate {:.2}",
                offloaded.tokens.len(),
                stats.copies,
                stats.host_experts,
                stats.hit_rate()
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn the_cpu_lane_keeps_greedy_parity_for_every_fixture_family() {
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
        // The grouped (prefill) path and decode steps, a cache of one layer's experts: misses in every step.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
        // Half of each step's misses (the fewest-row ones) on the CPU, the rest over the link.
        let label = format!("{family}, hybrid (half the misses on the CPU)");
        let decoded = check_offload(
            &checkpoint,
            &prompt,
            12,
            lru(experts, true),
            SplitRule::Share(0.5),
            &label,
        );
        assert!(
            decoded.stats.host_experts > 0 && decoded.stats.copies > 0,
            "{label}: a lane idled"
        );
        assert!(decoded.stats.host_pairs >= decoded.stats.host_experts, "{label}");
        // Every miss on the CPU: nothing is copied, guesses included, so nothing is ever resident.
        let label = format!("{family}, cpu");
        let decoded = check_offload(&checkpoint, &prompt, 12, lru(experts, true), SplitRule::Cpu, &label);
        assert_eq!(decoded.stats.copies, 0, "{label}: an expert was copied");
        assert_eq!(decoded.hits, 0, "{label}");
        assert!(decoded.stats.host_bytes > 0 && decoded.stats.host_ns > 0, "{label}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn the_cpu_lane_keeps_greedy_parity_for_q30() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/q30.json");
    let config = std::env::var_os("FERRY_BENCH_DIR").map_or(config, |d| PathBuf::from(d).join("q30.json"));
    let checkpoint = Checkpoint::synthetic(&config, 0).unwrap();
    // 300 tokens route to every expert of a layer, most of them used by a few rows: the lane takes those.
    let prompt: Vec<u32> = (0..300).map(|i| i * 1009 % 151_936).collect();
    let decoded = check_offload(
        &checkpoint,
        &prompt,
        4,
        lru(256, true),
        SplitRule::Share(0.3),
        "q30, hybrid",
    );
    assert!(
        decoded.stats.host_experts > 0 && decoded.stats.copies > 0,
        "q30: a lane idled"
    );
}

/// `--moe-strategy auto`'s rule end to end: a prior that calls the CPU lane free sends it every miss at first; what
/// the lane's jobs then cost inside the pipeline (tens of microseconds against the link's fraction of one for a
/// fixture's tiny experts) is fed back, and the later steps' misses cross the link. Greedy parity holds across
/// the change, and the calibration's counters show both lanes observed.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn the_calibrated_split_learns_the_lanes_pipeline_cost_and_keeps_parity() {
    let checkpoint = Checkpoint::open(&fixtures().join("qwen3_moe")).unwrap();
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
    let experts = spec.moe.as_ref().unwrap().num_experts;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
    let free_lane = LaneRates {
        link_bytes_per_s: 46.6e9,
        cpu: CpuLaneCost {
            fixed_s: 0.0,
            bytes_per_s: 1e18,
            row_cost: 0.0,
        },
        gpu_bytes_per_s: 700e9,
    };
    let label = "qwen3_moe, calibrated";
    let decoded = check_offload(
        &checkpoint,
        &prompt,
        12,
        lru(experts, true),
        SplitRule::Calibrated(free_lane),
        label,
    );
    let stats = &decoded.stats;
    let calibrated = stats.calibrated.expect("a calibrated split reports its rates");
    assert!(stats.host_experts > 0, "{label}: the lane never ran: {stats:?}");
    assert!(
        stats.copies > 0,
        "{label}: the calibration never moved misses to the link: {calibrated:?}"
    );
    assert!(
        calibrated.cpu_observations > 0 && calibrated.link_observations > 0,
        "{calibrated:?}"
    );
    assert!(
        calibrated.cpu_fixed_ns + calibrated.cpu_ns_per_expert > 0,
        "{calibrated:?}"
    );
    // A job's cost to the pipeline includes its own time.
    assert!(stats.host_pipeline_ns >= stats.host_ns, "{stats:?}");
}

/// `ferry bench`'s variants on one load: the offload started over on the loaded bank, with an empty cache and
/// another split, computes what a fresh backend does (bit-identical to all-resident over the link, greedy parity
/// with the CPU lane), run after run, and its cache starts empty.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn a_restarted_offload_computes_what_a_fresh_one_does() {
    let checkpoint = Checkpoint::open(&fixtures().join("qwen3_moe")).unwrap();
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
    let experts = spec.moe.as_ref().unwrap().num_experts;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % spec.vocab_size as u32).collect();
    let steps = 8;
    let resident = run(&CudaBackend::new(0).unwrap(), &checkpoint, &prompt, steps);
    let backend = CudaBackend::builder(0)
        .unwrap()
        .offload(lru(experts, true))
        .split(SplitRule::Link)
        .build()
        .unwrap();
    let model = Model::load(&backend, &checkpoint).unwrap();
    for (i, split) in [SplitRule::Link, SplitRule::Share(0.5), SplitRule::Link]
        .into_iter()
        .enumerate()
    {
        let label = format!("qwen3_moe, run {i}, {split:?}");
        let lane_before = backend.offload_stats().unwrap().host_experts;
        if i > 0 {
            backend.restart_offload(Box::new(Lru::new()), split).unwrap();
            let fresh = backend.offload_stats().unwrap();
            assert_eq!(
                fresh.hits() + fresh.misses(),
                0,
                "{label}: the restarted cache is not empty"
            );
        }
        let offloaded = run_model(&backend, &model, &prompt, steps);
        assert_same_run(&offloaded, &resident, split, &label);
        let stats = backend.offload_stats().unwrap();
        assert!(stats.misses() > 0, "{label}: nothing was missed");
        let lane_ran = stats.host_experts > lane_before;
        assert_eq!(lane_ran, split != SplitRule::Link, "{label}: {stats:?}");
        println!(
            "{label}: {steps} tokens as all-resident; hit rate {:.2}",
            stats.hit_rate()
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn decode_steps_where_every_expert_hits_or_hits_and_misses_mix_equal_resident() {
    for family in ["qwen3_moe", "mixtral", "olmoe", "qwen3_next"] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let experts = spec.moe.as_ref().unwrap().num_experts;
        let all = experts * spec.num_moe_layers();
        // 200 tokens route to every expert of every layer: all resident once the prompt is in.
        let prompt: Vec<u32> = (0..200).map(|i| (i * 13 + 5) % spec.vocab_size as u32).collect();
        for prefetch in [false, true] {
            let label = format!("{family}, every expert fits, decode prefetch {prefetch}");
            let decoded = check_offload_is_exact(&checkpoint, &prompt, 12, lru(all, prefetch), &label);
            assert_eq!(decoded.misses, 0, "{label}: decode missed");
            assert_eq!(decoded.stats.copies, all as u64, "{label}: an expert was copied twice");
        }
        // A cache of one layer's experts and a short prompt: decode steps mix hits with misses.
        let prompt = &prompt[..6];
        let label = format!("{family}, one layer's experts");
        let decoded = check_offload_is_exact(&checkpoint, prompt, 24, lru(experts, true), &label);
        assert!(
            decoded.hits > 0 && decoded.misses > 0,
            "{label}: decode did not mix hits and misses"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn decode_steps_where_every_expert_misses_equal_resident_for_q30() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/q30.json");
    let config = std::env::var_os("FERRY_BENCH_DIR").map_or(config, |d| PathBuf::from(d).join("q30.json"));
    let checkpoint = Checkpoint::synthetic(&config, 0).unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| i * 7919 % 151_936).collect();
    // 128 slots, one layer's experts: a decode step uses 48 layers x 8 experts, so LRU has evicted each layer's
    // experts of the last step before it routes again; every decode expert misses (a guessed copy's first use
    // counts as the miss it replaced).
    for prefetch in [false, true] {
        let label = format!("q30, one layer's experts, decode prefetch {prefetch}");
        let decoded = check_offload_is_exact(&checkpoint, &prompt, 6, lru(128, prefetch), &label);
        assert_eq!(decoded.hits, 0, "{label}: decode hit");
        assert_eq!(decoded.stats.guessed > 0, prefetch, "{label}");
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
    let decoded = check_offload_is_exact(&checkpoint, &prompt, 6, lru(256, true), "q30");
    assert!(decoded.stats.prefetched > 0, "q30: the prefill prefetched nothing");
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn what_ferry_allocates_stays_under_the_budget() {
    let plan = allocate_the_largest_pass("q30.json", 8 << 30);
    assert!(
        plan.step_tokens > MOE_GROUP_ROWS,
        "the step runs its experts in several groups"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn what_ferry_allocates_for_latent_attention_stays_under_the_budget() {
    // DeepSeek-V3's shape cut to 3 dense layers and 1 MoE layer, in FP8: its workspace counts the compressed
    // key-value and query widths, not per-head keys and values.
    let plan = allocate_the_largest_pass("dsv3-4layers-fp8.json", 20 << 30);
    assert!(plan.step_tokens >= 1024, "{plan:?}");
}

/// Plans `budget` bytes for the synthetic checkpoint of the bench config `name` under offload, runs the largest
/// pass the plan allows (a full step of prompt, then decode steps) and checks that what the GPU lost to ferry
/// stays under the budget.
fn allocate_the_largest_pass(name: &str, budget: u64) -> MemoryPlan {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench").join(name);
    let config = std::env::var_os("FERRY_BENCH_DIR").map_or(config, |d| PathBuf::from(d).join(name));
    let checkpoint = Checkpoint::synthetic(&config, 0).unwrap();
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
    let info = ModelInfo::new(&spec, checkpoint.weight_format());
    let request = BudgetRequest {
        budget_bytes: budget,
        mode: OffloadMode::Auto,
        slots: None,
        kv_reserve_tokens: 4096,
        max_batch_tokens: None,
        snapshot_slots: 0,
    };
    let plan = plan_memory(&info, &spec, &request).unwrap();
    assert!(plan.offload, "{name}: {plan:?}");
    let gpu = CudaBackend::builder(0).unwrap();
    let (free_before, _) = gpu.memory_info().unwrap();
    let backend = gpu.offload(lru(plan.slots, true)).build().unwrap();
    let model = Model::load(&backend, &checkpoint).unwrap();
    let mut kv = backend.new_kv(model.kv_spec(plan.kv_tokens)).unwrap();
    let seq = kv.alloc_seq();
    let vocab = spec.vocab_size as u32;
    let prompt: Vec<u32> = (0..plan.step_tokens as u32).map(|i| i * 31 % vocab).collect();
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
        "{name}: budget {budget} bytes, ferry allocated {used} bytes ({:.1} %)",
        100.0 * used as f64 / budget as f64
    );
    assert!(
        used <= budget,
        "{name}: ferry allocated {used} bytes on the GPU, over its budget of {budget}"
    );
    plan
}

/// Greedy decode of `steps` tokens after each of `prompts`, all in one batch: the prompts prefilled in one pass
/// (one slice each), then every sequence's decode step in one pass. Each sequence's tokens and every step's logits.
fn run_batch(backend: &CudaBackend, checkpoint: &Checkpoint, prompts: &[Vec<u32>], steps: usize) -> Vec<Run> {
    let model = Model::load(backend, checkpoint).unwrap();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let mut kv = backend
        .new_kv(model.kv_spec(prompts.len() * (longest + steps)))
        .unwrap();
    let seqs: Vec<_> = prompts.iter().map(|_| kv.alloc_seq()).collect();
    let slices: Vec<SeqSlice> = seqs
        .iter()
        .zip(prompts)
        .map(|(&seq, p)| SeqSlice {
            seq,
            start_pos: 0,
            len: p.len(),
        })
        .collect();
    let tokens: Vec<u32> = prompts.concat();
    let mut logits = backend
        .to_host(&model.forward(backend, &tokens, &slices, &mut kv).unwrap())
        .unwrap();
    let vocab = logits.len() / prompts.len();
    let mut runs: Vec<Run> = prompts
        .iter()
        .map(|_| Run {
            tokens: Vec::new(),
            logits: Vec::new(),
            after_prefill: None,
        })
        .collect();
    for step in 0..steps {
        let mut next = Vec::new();
        for (run, row) in runs.iter_mut().zip(logits.chunks(vocab)) {
            let token = argmax(row) as u32;
            run.tokens.push(token);
            run.logits.push(row.to_vec());
            next.push(token);
        }
        let slices: Vec<SeqSlice> = seqs
            .iter()
            .zip(prompts)
            .map(|(&seq, p)| SeqSlice {
                seq,
                start_pos: p.len() + step,
                len: 1,
            })
            .collect();
        logits = backend
            .to_host(&model.forward(backend, &next, &slices, &mut kv).unwrap())
            .unwrap();
    }
    runs
}

/// The CPU lane works while the host goes on: it is started, the GPU's share and the stream's wait for the lane
/// are queued, and the host queues the next layers without waiting; the stream waits for the lane only before
/// moe_combine. A batch of three sequences (a prefill pass of three slices, then decode passes of three rows)
/// with a share of the misses and with all of them on the lane gives each sequence the tokens the all-resident
/// batch gives it, logits within the lane's tolerance.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn the_cpu_lane_keeps_greedy_parity_in_a_batch_without_the_host_waiting() {
    for family in ["qwen3_moe", "qwen3_5_moe"] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let experts = spec.moe.as_ref().unwrap().num_experts;
        let vocab = spec.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [(30, 7), (9, 11), (21, 5)]
            .iter()
            .map(|&(len, step)| (0..len).map(|i| (i * step + 3) % vocab).collect())
            .collect();
        let resident = run_batch(&CudaBackend::new(0).unwrap(), &checkpoint, &prompts, 10);
        for split in [SplitRule::Share(0.5), SplitRule::Cpu] {
            let label = format!("{family}, a batch of 3, {split:?}");
            let backend = CudaBackend::builder(0)
                .unwrap()
                .offload(lru(experts, true))
                .split(split)
                .build()
                .unwrap();
            let lane = run_batch(&backend, &checkpoint, &prompts, 10);
            for (seq, (a, b)) in lane.iter().zip(&resident).enumerate() {
                assert_eq!(a.tokens, b.tokens, "{label}: sequence {seq}'s tokens differ");
                for (step, (x, y)) in a.logits.iter().zip(&b.logits).enumerate() {
                    assert!(
                        x.iter().zip(y).all(|(x, y)| (x - y).abs() <= LANE_LOGIT_TOLERANCE),
                        "{label}: sequence {seq}'s logits of step {step} differ"
                    );
                }
            }
            let stats = backend.offload_stats().unwrap();
            assert!(
                stats.host_experts > 0 && stats.host_pairs > stats.host_experts,
                "{label}"
            );
            println!(
                "{label}: tokens equal; CPU lane {} experts, {} pairs, {} copies",
                stats.host_experts, stats.host_pairs, stats.copies
            );
        }
    }
}

/// The lane reads FP8 banks in place (matrices, then their scales): with every miss on the CPU, an FP8
/// checkpoint's greedy tokens equal its all-resident GPU run's (the same dense weights, the experts' FP8 products
/// in f32 on both sides), logits within the lane's tolerance.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn the_cpu_lane_computes_fp8_experts() {
    for family in ["qwen3_moe_fp8", "qwen3_5_moe_fp8_dynamic"] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        let experts = spec.moe.as_ref().unwrap().num_experts;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % spec.vocab_size as u32).collect();
        let label = format!("{family}, cpu");
        let decoded = check_offload(&checkpoint, &prompt, 12, lru(experts, true), SplitRule::Cpu, &label);
        assert_eq!(decoded.stats.copies, 0, "{label}: an expert was copied");
        assert!(decoded.stats.host_experts > 0, "{label}");
    }
}
