//! Prefix caching on the real fixture models (every family, attention and hybrid, on the CPU backend): a request
//! answered from the cache must generate exactly the greedy tokens it generates computed from scratch, whether its
//! cached prefix is a whole earlier prompt, ends mid-block inside a longer one, or diverges inside a block; and
//! whether prompts go in one step or in chunks (which a hybrid's anchors cut).

use std::path::Path;

use ferry_core::backend::cpu::CpuBackend;

mod prefix_common;

fn check_family(name: &str) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    prefix_common::check_family(&fixtures, name, || CpuBackend);
}

#[test]
fn qwen3_moe() {
    check_family("qwen3_moe");
}

#[test]
fn qwen3_moe_fused() {
    check_family("qwen3_moe_fused");
}

#[test]
fn qwen2_moe() {
    check_family("qwen2_moe");
}

#[test]
fn mixtral() {
    check_family("mixtral");
}

#[test]
fn olmoe() {
    check_family("olmoe");
}

#[test]
fn qwen3_5_moe_hybrid() {
    check_family("qwen3_5_moe");
}

#[test]
fn qwen3_5_moe_text_hybrid() {
    check_family("qwen3_5_moe_text");
}

#[test]
fn qwen3_next_hybrid() {
    check_family("qwen3_next");
}

/// The same on an expert-parallel group of two CPU ranks, whose every rank keeps its own cache of the same blocks
/// (the scheduler's bookkeeping copied from the first rank), a hybrid's state snapshots included.
#[test]
fn expert_parallel_ranks_share_the_prefix_cache() {
    use ferry_core::backend::cpu::HostSum;
    use ferry_core::backend::expert_parallel::ExpertParallel;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for name in ["qwen3_moe", "qwen3_5_moe"] {
        prefix_common::check_family(&fixtures, name, || {
            ExpertParallel::new(vec![CpuBackend, CpuBackend], Box::new(HostSum)).unwrap()
        });
    }
}
