//! Prefix caching on the GPU (ignored unless asked for: scripts/device/gpu-tests.sh runs them on the GPU machine):
//! on the CUDA backend, all resident and with the experts offloaded, a request answered from the cache (KV blocks
//! shared on the device, a hybrid's recurrent state restored by a device-to-device copy) generates the greedy tokens
//! it generates computed from scratch, for an attention family and a hybrid one, whole and in chunks.

use std::path::{Path, PathBuf};

use ferry_core::backend::cuda::{CudaBackend, OffloadConfig};
use ferry_core::loader::Checkpoint;
use ferry_core::model::spec_for;
use ferry_core::moe::Lru;

mod prefix_common;

fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(dir) => dir.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn cached_answers_equal_cold_ones_on_the_gpu() {
    for family in ["qwen3_moe", "qwen3_5_moe"] {
        prefix_common::check_family(&fixtures(), family, || CudaBackend::new(0).unwrap());
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
fn cached_answers_equal_cold_ones_under_offload() {
    for family in ["qwen3_moe", "qwen3_5_moe"] {
        let checkpoint = Checkpoint::open(&fixtures().join(family)).unwrap();
        let spec = spec_for(&checkpoint.model_type, &checkpoint.config).unwrap();
        // One layer's experts: every layer evicts the last, so the expert cache is exercised beside the prefix cache.
        let slots = spec.moe.as_ref().unwrap().num_experts;
        prefix_common::check_family(&fixtures(), family, || {
            let offload = OffloadConfig {
                slots,
                policy: Box::new(Lru::new()),
                decode_prefetch: true,
            };
            CudaBackend::builder(0).unwrap().offload(offload).build().unwrap()
        });
    }
}
