//! Every fixture family against HF transformers' float32 reference (tests/fixtures, made by
//! scripts/make_fixtures.py): tokenization and chat template, first-step logits within 1e-3, and 16 greedy tokens
//! equal to the reference's, where a first difference is allowed only at a near tie (reference top-2 margin
//! below 2e-3), after which the continuations legitimately diverge.

use std::path::{Path, PathBuf};

use ferry_core::backend::cpu::CpuBackend;
use ferry_core::backend::cuda::CudaBackend;
use ferry_core::backend::Backend;
use ferry_core::engine::{generate, GenerateRequest, SamplingParams, StopRules};
use ferry_core::kv::KvCache;
use ferry_core::loader::{ChatMessage, Checkpoint};
use ferry_core::model::Model;
use serde::Deserialize;

const FAMILIES: &[&str] = &["qwen3_moe", "qwen3_moe_fused", "mixtral", "olmoe", "qwen2_moe"];
const LOGIT_TOLERANCE: f32 = 1e-3;
const NEAR_TIE: f32 = 2e-3;

#[derive(Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    prompt_text: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    chat_text: Option<String>,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    top2_margins: Vec<f32>,
    first_logits: Vec<f32>,
}

/// tests/fixtures, or `$FERRY_FIXTURES` where the tests run away from the source tree (the GPU machine).
fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(dir) => dir.into(),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

fn check_family<B: Backend>(backend: &B, name: &str) {
    let dir = fixtures().join(name);
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let model = Model::load(backend, &checkpoint).unwrap();
    let tokenizer = checkpoint.tokenizer.as_ref().expect("fixture has a tokenizer");
    assert!(
        reference.cases.len() >= 3,
        "{name}: expected short, long and chat cases"
    );
    for case in &reference.cases {
        let label = format!("{name}/{}", case.name);
        if let Some(text) = &case.prompt_text {
            assert_eq!(
                tokenizer.encode(text, true).unwrap(),
                case.prompt_ids,
                "{label}: tokenization"
            );
        }
        if let (Some(messages), Some(chat_text)) = (&case.messages, &case.chat_text) {
            let rendered = tokenizer
                .apply_chat_template(messages, true, &Default::default())
                .unwrap();
            assert_eq!(&rendered, chat_text, "{label}: chat template");
            assert_eq!(
                tokenizer.encode(&rendered, false).unwrap(),
                case.prompt_ids,
                "{label}: chat tokens"
            );
        }

        let mut kv = backend.new_kv(model.kv_spec(case.prompt_ids.len() + 16)).unwrap();
        let seq = kv.alloc_seq();
        let request = GenerateRequest {
            prompt_ids: case.prompt_ids.clone(),
            max_tokens: case.generated_ids.len(),
            sampling: SamplingParams::default(),
            stop: StopRules {
                eos_token_ids: vec![],
                ignore_eos: true,
            },
        };
        let mut first_logits = None;
        let out = generate(backend, &model, &mut kv, seq, &request, |_, logits| {
            first_logits.get_or_insert_with(|| logits.to_vec());
        })
        .unwrap();

        let first_logits = first_logits.unwrap();
        assert_eq!(first_logits.len(), case.first_logits.len(), "{label}: vocabulary");
        let worst = first_logits
            .iter()
            .zip(&case.first_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= LOGIT_TOLERANCE, "{label}: first-step logits differ by {worst}");

        assert_eq!(out.token_ids.len(), case.generated_ids.len(), "{label}: length");
        if let Some(i) = out.token_ids.iter().zip(&case.generated_ids).position(|(a, b)| a != b) {
            assert!(
                case.top2_margins[i] < NEAR_TIE,
                "{label}: token {i} is {} but the reference has {} (margin {})\n ours {:?}\n  ref {:?}",
                out.token_ids[i],
                case.generated_ids[i],
                case.top2_margins[i],
                out.token_ids,
                case.generated_ids
            );
        }
    }
}

#[test]
fn every_family_has_a_fixture() {
    for name in FAMILIES {
        assert!(
            fixtures().join(name).join("reference.json").exists(),
            "missing fixture {name}"
        );
    }
}

/// One test per family on the CPU (CI) and, ignored unless asked for, on the GPU (scripts/device/gpu-tests.sh).
macro_rules! parity_tests {
    ($($family:ident),*) => {
        mod cpu {
            $(#[test]
            fn $family() {
                super::check_family(&super::CpuBackend, stringify!($family));
            })*
        }
        mod cuda {
            $(#[test]
            #[ignore = "needs an NVIDIA GPU: scripts/device/gpu-tests.sh"]
            fn $family() {
                super::check_family(&super::CudaBackend::new(0).unwrap(), stringify!($family));
            })*
        }
    };
}

parity_tests!(qwen3_moe, qwen3_moe_fused, mixtral, olmoe, qwen2_moe);
