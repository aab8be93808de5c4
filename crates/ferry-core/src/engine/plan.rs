//! Dividing a GPU memory budget (`--gpu-memory-budget`): dense weights and workspace first, then a KV floor
//! (`--kv-reserve-tokens`), then expert cache slots (as many as fit, or exactly `--moe-cache-slots`), and the rest
//! to the KV cache. When the whole model fits, nothing is offloaded (`--offload auto`). The model says how large
//! its parts are; the CUDA backend says what it allocates for them ([`crate::backend::cuda::workspace`]). Also the
//! home of the step sizes a forward pass is planned for. Pure arithmetic: nothing here touches a device.

use crate::backend::cuda::workspace::{self, ActivationShapes, KV_VALUE_BYTES};
use crate::model::{FfnKind, ModelInfo, ModelSpec};
use crate::{Error, Result};

mod group;
pub use group::plan_group;

/// The most tokens one forward pass carries: long prompts are prefilled in chunks of this many (which also bounds
/// the activation workspace a budget must hold).
pub const MAX_BATCH_TOKENS: usize = 2048;

/// Tokens of one forward pass under expert offload, unless asked otherwise. Each prefill step streams nearly the
/// whole expert bank once (its chunk routes to nearly every expert), so a step is worth making as long as the
/// layers' compute of it takes about as long as that stream, behind which the copies hide: on the H200 a q36 step
/// of 2,048 tokens computes in about 0.65 s and the 64 GB bank streams in 1.2 s (docs/perf.md).
pub const OFFLOAD_STEP_TOKENS: usize = 4096;

/// The shortest step a budget shrinks the offload step to (halving from [`OFFLOAD_STEP_TOKENS`]) when longer ones
/// leave no room for the expert slots a step needs: models with wide prefill activations (DeepSeek-V3's shape
/// holds about 1.2 MB a token) then plan on a small card, their prompts in more steps.
const MIN_OFFLOAD_STEP_TOKENS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadMode {
    /// Everything resident; an error if it does not fit.
    None,
    /// Routed experts in host RAM, the hot ones in a GPU cache.
    Experts,
    /// None when the whole model fits the budget, else Experts.
    Auto,
}

#[derive(Clone, Debug)]
pub struct BudgetRequest {
    pub budget_bytes: u64,
    pub mode: OffloadMode,
    /// Exactly this many cache slots (which, under [`OffloadMode::Auto`], offloads); None sizes the cache to fit.
    pub slots: Option<usize>,
    pub kv_reserve_tokens: usize,
    /// The most tokens one forward pass carries (the prefill chunk), which sizes the activation workspace; None:
    /// [`MAX_BATCH_TOKENS`], or when the experts are offloaded [`OFFLOAD_STEP_TOKENS`], halved as often as the
    /// budget needs to hold one layer's experts (or the asked slots) beside the workspace.
    pub max_batch_tokens: Option<usize>,
    /// Recurrent-state snapshots kept for prefix caching (0: none), each a whole sequence's state of a hybrid
    /// model (nothing for a model without recurrent state): [`PREFIX_SNAPSHOT_SLOTS`] when it is on.
    pub snapshot_slots: usize,
}

/// Recurrent-state snapshots a hybrid model keeps for prefix caching. Each is a whole sequence's state (about 63 MiB
/// for Qwen3.6-35B-A3B, as much as ~1,600 tokens of its KV): 8 keep the anchors of the latest turns of a few
/// conversations at once (a turn resumes from the previous turn's prompt end) for 0.5 GiB, taken from the expert
/// cache under offload. An evicted snapshot costs a recompute, never a wrong answer.
pub const PREFIX_SNAPSHOT_SLOTS: usize = 8;

/// How the budget is spent.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    pub offload: bool,
    /// Expert cache slots (0 when nothing is offloaded).
    pub slots: usize,
    pub kv_tokens: usize,
    pub dense_bytes: u64,
    pub workspace_bytes: u64,
    /// Bytes of experts on the GPU: the whole bank, or the cache slab.
    pub expert_bytes: u64,
    pub kv_bytes: u64,
    /// The most tokens one forward pass carries, which the workspace was sized for.
    pub step_tokens: usize,
    /// Recurrent-state snapshot slots for prefix caching, and their bytes (0 for a model without recurrent state).
    pub snapshot_slots: usize,
    pub snapshot_bytes: u64,
}

/// KV bytes per token on the GPU, in the element type the device cache stores.
pub fn gpu_kv_bytes_per_token(info: &ModelInfo) -> u64 {
    // ModelInfo counts bf16 bytes: two a value.
    info.kv_bytes_per_token_bf16 / 2 * KV_VALUE_BYTES
}

/// The activation widths of `spec` (and the largest dense FP8 matrix of `info`) that the backend's workspace
/// formula reads.
fn activation_shapes(spec: &ModelSpec, info: &ModelInfo) -> ActivationShapes {
    let widest_dense = spec
        .layers
        .iter()
        .filter_map(|layer| match &layer.ffn {
            FfnKind::Dense { intermediate } => Some(*intermediate),
            FfnKind::Moe => None,
        })
        .max()
        .unwrap_or(0);
    let (top_k, expert_intermediate, shared) = spec.moe.as_ref().map_or((0, 0, 0), |m| {
        (m.top_k, m.intermediate, m.shared_expert.map_or(0, |s| s.intermediate))
    });
    let (gdn_conv, gdn_value) = spec
        .gated_delta_net
        .as_ref()
        .map_or((0, 0), |g| (g.conv_dim(), g.value_dim()));
    ActivationShapes {
        hidden: spec.hidden_size,
        q_width: spec.num_heads * spec.head_dim,
        // MLA keeps no per-head keys or values: its rows hold the compressed key-value and query instead.
        kv_width: spec.mla.as_ref().map_or(spec.num_kv_heads * spec.head_dim, |m| {
            m.kv_lora_rank + m.qk_rope_head_dim + m.q_lora_rank.unwrap_or(0)
        }),
        widest_mlp: widest_dense.max(shared),
        gdn_conv,
        gdn_value,
        top_k,
        expert_intermediate,
        vocab: spec.vocab_size,
        largest_fp8_matrix: info.largest_fp8_dense_linear as usize,
        mla_heads_latent: spec
            .mla
            .as_ref()
            .map_or(0, |m| spec.num_heads * (m.kv_lora_rank + m.qk_rope_head_dim)),
    }
}

/// The GPU workspace of one forward pass of `rows` tokens of `spec`.
fn workspace_bytes(spec: &ModelSpec, info: &ModelInfo, rows: usize) -> u64 {
    workspace::workspace_bytes(&activation_shapes(spec, info), rows)
}

pub fn plan_memory(info: &ModelInfo, spec: &ModelSpec, request: &BudgetRequest) -> Result<MemoryPlan> {
    let dense = info.dense_bytes;
    let kv_per_token = gpu_kv_bytes_per_token(info).max(1);
    let snapshots = request.snapshot_slots as u64 * info.recurrent_state_bytes_per_seq;
    // The KV floor and the snapshots: what the budget keeps besides weights and workspace.
    let floor = request.kv_reserve_tokens as u64 * kv_per_token + snapshots;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // Dense weights, workspace and KV floor for a step of `step_tokens`, or why the budget cannot hold them.
    let fixed_for = |step_tokens: usize| -> Result<(u64, u64)> {
        let workspace = workspace_bytes(spec, info, step_tokens);
        let fixed = dense + workspace + floor;
        if fixed > request.budget_bytes {
            return Err(Error::Config(format!(
                "a budget of {:.2} GiB cannot hold the dense weights ({:.2} GiB), the workspace for {step_tokens}-token \
                 steps ({:.2} GiB) and KV for {} tokens with {} recurrent-state snapshots ({:.2} GiB)",
                gib(request.budget_bytes),
                gib(dense),
                gib(workspace),
                request.kv_reserve_tokens,
                request.snapshot_slots,
                gib(floor)
            )));
        }
        Ok((workspace, fixed))
    };
    let resident_step = request.max_batch_tokens.unwrap_or(MAX_BATCH_TOKENS);
    let (_, resident_fixed) = fixed_for(resident_step)?;
    let whole_fits = resident_fixed + info.expert_bank_bytes <= request.budget_bytes;
    let offload = match request.mode {
        OffloadMode::None if !whole_fits => {
            return Err(Error::Config(format!(
                "--offload none: the model needs {:.2} GiB with KV for {} tokens, over the {:.2} GiB budget",
                gib(resident_fixed + info.expert_bank_bytes),
                request.kv_reserve_tokens,
                gib(request.budget_bytes)
            )))
        }
        OffloadMode::None => false,
        OffloadMode::Experts => true,
        OffloadMode::Auto => !whole_fits || request.slots.is_some(),
    };
    // Under offload the longest step (from OFFLOAD_STEP_TOKENS, halving) whose workspace leaves room for the slots
    // a step needs (one layer's experts, or the asked number); where none does, the resident step, whose plan then
    // says why.
    let needed_slots = request.slots.unwrap_or(info.num_experts) as u64;
    let leaves_room = |step: usize| {
        fixed_for(step).is_ok_and(|(_, fixed)| request.budget_bytes - fixed >= needed_slots * info.bytes_per_expert)
    };
    let step_tokens = match request.max_batch_tokens {
        Some(n) => n,
        None if offload => std::iter::successors(Some(OFFLOAD_STEP_TOKENS), |&s| Some(s / 2))
            .take_while(|&s| s >= MIN_OFFLOAD_STEP_TOKENS)
            .find(|&s| leaves_room(s))
            .unwrap_or(MAX_BATCH_TOKENS),
        None => MAX_BATCH_TOKENS,
    };
    let (workspace, fixed) = fixed_for(step_tokens)?;
    let experts_total = info.num_moe_layers * info.num_experts;
    let (slots, expert_bytes) = if offload {
        let room = (request.budget_bytes - fixed) / info.bytes_per_expert.max(1);
        let slots = match request.slots {
            Some(n) if n as u64 > room => {
                return Err(Error::Config(format!(
                    "--moe-cache-slots {n} needs {:.2} GiB; {:.2} GiB is left after the dense weights, workspace and \
                     KV floor ({room} slots)",
                    gib(n as u64 * info.bytes_per_expert),
                    gib(request.budget_bytes - fixed)
                )))
            }
            Some(n) => n,
            None => (room as usize).min(experts_total),
        };
        if slots < info.num_experts {
            return Err(Error::Config(format!(
                "{slots} expert cache slots cannot hold one layer's {} experts (a prefill routes to all of them); \
                 raise the budget or lower --kv-reserve-tokens",
                info.num_experts
            )));
        }
        (slots, slots as u64 * info.bytes_per_expert)
    } else {
        (0, info.expert_bank_bytes)
    };
    let kv_tokens = ((request.budget_bytes - dense - workspace - expert_bytes - snapshots) / kv_per_token) as usize;
    Ok(MemoryPlan {
        offload,
        slots,
        kv_tokens,
        dense_bytes: dense,
        workspace_bytes: workspace,
        expert_bytes,
        kv_bytes: kv_tokens as u64 * kv_per_token,
        step_tokens,
        snapshot_slots: request.snapshot_slots,
        snapshot_bytes: snapshots,
    })
}

/// Parses a size such as `22.3GiB`, `16GB`, `512MiB` or a plain number of bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("not a size: {text:?}")))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => {
            return Err(Error::Config(format!(
                "unknown size unit {other:?} in {text:?} (use B, KiB, MiB, GiB, GB, ...)"
            )))
        }
    };
    if !(value.is_finite() && value >= 0.0) {
        return Err(Error::Config(format!("not a size: {text:?}")));
    }
    Ok((value * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::workspace::MOE_GROUP_ROWS;
    use crate::loader::{DType, Fp8Config, WeightFormat};
    use crate::model::spec_for;

    /// The model of a config.json, by its path from the repository root, with its routed experts and dense linears
    /// in FP8 when the config's quantization_config says so.
    fn model(config: &str) -> (ModelInfo, ModelSpec) {
        model_of(read_config(config))
    }

    fn read_config(config: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{}/../../{config}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn model_of(config: serde_json::Value) -> (ModelInfo, ModelSpec) {
        let spec = spec_for(config["model_type"].as_str().unwrap(), &config).unwrap();
        // A synthetic checkpoint of an FP8 config holds its dense linears in FP8 too.
        let fp8 = Fp8Config::from_config(&config).unwrap().map(|f| f.scheme);
        let format = WeightFormat {
            dtype: DType::BF16,
            experts_fp8: fp8,
            dense_fp8: fp8,
        };
        (ModelInfo::new(&spec, format), spec)
    }

    fn q30() -> (ModelInfo, ModelSpec) {
        model("bench/q30.json")
    }

    fn request(budget: &str, mode: OffloadMode, slots: Option<usize>) -> BudgetRequest {
        BudgetRequest {
            budget_bytes: parse_size(budget).unwrap(),
            mode,
            slots,
            kv_reserve_tokens: 8192,
            max_batch_tokens: None,
            snapshot_slots: 0,
        }
    }

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        assert_eq!(parse_size("22.3GiB").unwrap(), (22.3 * 1024f64.powi(3)) as u64);
        assert_eq!(parse_size("16GB").unwrap(), 16_000_000_000);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1234").unwrap(), 1234);
        assert!(parse_size("lots").is_err() && parse_size("3 parsecs").is_err() && parse_size("-1GB").is_err());
    }

    #[test]
    fn a_small_budget_offloads_and_fills_with_slots_then_kv() {
        let (info, spec) = q30();
        let plan = plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::Auto, None)).unwrap();
        assert!(plan.offload);
        let total = plan.dense_bytes + plan.workspace_bytes + plan.expert_bytes + plan.kv_bytes;
        assert!(total <= parse_size("22.3GiB").unwrap(), "the plan exceeds the budget");
        assert!(plan.kv_tokens >= 8192, "the KV floor is kept");
        // Auto sizing leaves less than one slot's worth beyond the KV floor unused.
        let floor = 8192 * gpu_kv_bytes_per_token(&info);
        let left = parse_size("22.3GiB").unwrap() - plan.dense_bytes - plan.workspace_bytes - plan.expert_bytes - floor;
        assert!(left < info.bytes_per_expert, "{left} bytes left unplanned");
        assert!(plan.slots > info.num_experts && plan.slots < info.num_moe_layers * info.num_experts);
    }

    #[test]
    fn fp8_experts_fit_about_twice_the_slots_of_bf16() {
        let (bf16, spec) = q30();
        let (fp8, _) = model("bench/q30-fp8.json");
        // 3 matrices of 768 x 2048 bytes, and 6 x 16 f32 scales each.
        assert_eq!(fp8.bytes_per_expert, 3 * (768 * 2048 + 4 * 6 * 16));
        assert_eq!(fp8.expert_bank_bytes, 48 * 128 * fp8.bytes_per_expert);
        let slots = |info: &ModelInfo| {
            plan_memory(info, &spec, &request("22.3GiB", OffloadMode::Auto, None))
                .unwrap()
                .slots
        };
        let (bf16_slots, fp8_slots) = (slots(&bf16), slots(&fp8));
        assert!(
            fp8_slots as f64 >= 1.9 * bf16_slots as f64,
            "{fp8_slots} FP8 slots against {bf16_slots} bf16"
        );
    }

    /// gpt-oss-120b's MXFP4 experts (17 bytes per 32 weights, and f32 biases) against the same model in bf16:
    /// the budget holds about 3.8 times the slots.
    #[test]
    fn mxfp4_experts_fit_about_four_times_the_slots_of_bf16() {
        let (mxfp4, spec) = model("bench/gptoss120.json");
        let mut config = read_config("bench/gptoss120.json");
        config.as_object_mut().unwrap().remove("quantization_config");
        let (bf16, _) = model_of(config);
        let biases = 4 * (2 * 2880 + 2880);
        assert_eq!(mxfp4.bytes_per_expert, 3 * 2880 * 2880 / 32 * 17 + biases);
        assert_eq!(bf16.bytes_per_expert, 3 * 2880 * 2880 * 2 + biases);
        let slots = |info: &ModelInfo| {
            plan_memory(info, &spec, &request("22.3GiB", OffloadMode::Auto, None))
                .unwrap()
                .slots
        };
        let (bf16_slots, mxfp4_slots) = (slots(&bf16), slots(&mxfp4));
        assert!(
            bf16_slots >= 128,
            "{bf16_slots} bf16 slots: fewer than one layer's experts"
        );
        let ratio = mxfp4_slots as f64 / bf16_slots as f64;
        assert!(
            (3.7..3.8).contains(&ratio),
            "{mxfp4_slots} MXFP4 slots against {bf16_slots} bf16"
        );
    }

    #[test]
    fn explicit_slots_give_the_rest_to_kv() {
        let (info, spec) = q30();
        let plan = plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::Experts, Some(1536))).unwrap();
        assert_eq!(plan.slots, 1536);
        assert_eq!(plan.expert_bytes, 1536 * info.bytes_per_expert);
        assert!(
            plan.kv_tokens > 16384,
            "1536 slots leave room for 16K tokens of KV: {}",
            plan.kv_tokens
        );
        let err = plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::Experts, Some(5000))).unwrap_err();
        assert!(err.to_string().contains("5000"), "{err}");
    }

    #[test]
    fn the_fp8_checkpoints_of_the_largest_models_plan_under_a_24_gb_card() {
        // Dense linears in FP8 as these models ship: GLM-4.5-Air and DeepSeek-V3's shape (cut to 10 layers) keep
        // KV for 16K tokens and room for every expert of a layer (a prefill routes to all of them) in 22.3 GiB.
        for config in ["bench/glm45air-fp8.json", "bench/dsv3-10layers-fp8.json"] {
            let (info, spec) = model(config);
            let bf16 = ModelInfo::new(
                &spec,
                WeightFormat {
                    dense_fp8: None,
                    ..WeightFormat {
                        dtype: DType::BF16,
                        experts_fp8: Some(crate::loader::Fp8Scheme::BLOCK_128),
                        dense_fp8: None,
                    }
                },
            );
            assert!(
                info.dense_bytes < bf16.dense_bytes * 3 / 4,
                "{config}: dense FP8 is counted as such"
            );
            let request = BudgetRequest {
                kv_reserve_tokens: 16384,
                ..request("22.3GiB", OffloadMode::Auto, None)
            };
            let plan = plan_memory(&info, &spec, &request).unwrap();
            assert!(plan.offload && plan.slots >= info.num_experts, "{config}: {plan:?}");
            assert_eq!(
                plan.step_tokens,
                [4096, 2048, 1024, 512, 256]
                    .into_iter()
                    .find(|&step| {
                        22.3 * (1u64 << 30) as f64
                            >= (info.dense_bytes
                                + workspace_bytes(&spec, &info, step)
                                + 16384 * gpu_kv_bytes_per_token(&info)
                                + info.num_experts as u64 * info.bytes_per_expert) as f64
                    })
                    .unwrap(),
                "{config}: the longest step that leaves room for a layer's experts"
            );
        }
    }

    #[test]
    fn offloaded_experts_take_longer_steps_whose_expert_workspace_stays_that_of_one_group() {
        let (info, spec) = q30();
        let resident = plan_memory(&info, &spec, &request("80GiB", OffloadMode::Auto, None)).unwrap();
        assert_eq!(resident.step_tokens, MAX_BATCH_TOKENS);
        assert_eq!(
            resident.workspace_bytes,
            workspace_bytes(&spec, &info, MAX_BATCH_TOKENS)
        );
        let offloaded = plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::Auto, None)).unwrap();
        assert_eq!(offloaded.step_tokens, OFFLOAD_STEP_TOKENS);
        assert_eq!(
            offloaded.workspace_bytes,
            workspace_bytes(&spec, &info, OFFLOAD_STEP_TOKENS)
        );
        // Past MOE_GROUP_ROWS rows the grouped expert buffers stop growing: a row costs less than below it.
        let per_row = |rows: usize| workspace_bytes(&spec, &info, rows) - workspace_bytes(&spec, &info, rows - 1);
        assert!(per_row(MOE_GROUP_ROWS + 2) < per_row(MOE_GROUP_ROWS));
        let asked = BudgetRequest {
            max_batch_tokens: Some(1024),
            ..request("22.3GiB", OffloadMode::Auto, None)
        };
        let plan = plan_memory(&info, &spec, &asked).unwrap();
        assert_eq!(
            (plan.step_tokens, plan.workspace_bytes),
            (1024, workspace_bytes(&spec, &info, 1024))
        );
        assert!(
            plan.slots > offloaded.slots,
            "a shorter step leaves more room for slots"
        );
    }

    #[test]
    fn prefix_snapshots_of_a_hybrid_come_out_of_the_budget_and_cost_an_attention_model_nothing() {
        let (info, spec) = model("bench/q36.json");
        assert!(info.recurrent_state_bytes_per_seq > 0);
        let with = |snapshot_slots| BudgetRequest {
            snapshot_slots,
            ..request("15.8GiB", OffloadMode::Auto, None)
        };
        let (none, some) = (
            plan_memory(&info, &spec, &with(0)).unwrap(),
            plan_memory(&info, &spec, &with(PREFIX_SNAPSHOT_SLOTS)).unwrap(),
        );
        let bytes = PREFIX_SNAPSHOT_SLOTS as u64 * info.recurrent_state_bytes_per_seq;
        assert_eq!(
            (some.snapshot_slots, some.snapshot_bytes),
            (PREFIX_SNAPSHOT_SLOTS, bytes)
        );
        let spent = |p: &MemoryPlan| p.dense_bytes + p.workspace_bytes + p.expert_bytes + p.kv_bytes + p.snapshot_bytes;
        assert!(spent(&some) <= parse_size("15.8GiB").unwrap());
        assert!(
            some.expert_bytes < none.expert_bytes,
            "under offload the slots pay for them"
        );
        let (info, spec) = q30();
        let (none, some) = (
            plan_memory(&info, &spec, &with(0)).unwrap(),
            plan_memory(&info, &spec, &with(PREFIX_SNAPSHOT_SLOTS)).unwrap(),
        );
        assert_eq!(some.snapshot_bytes, 0);
        assert_eq!((some.slots, some.kv_tokens), (none.slots, none.kv_tokens));
    }

    #[test]
    fn a_budget_too_small_for_the_longer_steps_workspace_keeps_the_shorter_step() {
        let (info, spec) = q30();
        let fixed = info.dense_bytes
            + workspace_bytes(&spec, &info, OFFLOAD_STEP_TOKENS)
            + 8192 * gpu_kv_bytes_per_token(&info);
        let tight = BudgetRequest {
            budget_bytes: fixed + (info.num_experts as u64 - 1) * info.bytes_per_expert,
            ..request("0", OffloadMode::Auto, None)
        };
        let plan = plan_memory(&info, &spec, &tight).unwrap();
        assert_eq!(plan.step_tokens, MAX_BATCH_TOKENS);
        assert!(plan.slots >= info.num_experts);
    }

    #[test]
    fn whole_models_that_fit_stay_resident_and_too_small_budgets_say_why() {
        let (info, spec) = q30();
        let plan = plan_memory(&info, &spec, &request("80GiB", OffloadMode::Auto, None)).unwrap();
        assert!(!plan.offload && plan.slots == 0 && plan.expert_bytes == info.expert_bank_bytes);
        assert!(plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::None, None)).is_err());
        let err = plan_memory(&info, &spec, &request("3GiB", OffloadMode::Auto, None)).unwrap_err();
        assert!(err.to_string().contains("dense weights"), "{err}");
        // Room for everything but one layer's experts at 2048-token steps: asked for such steps, the plan says
        // why it cannot; left to choose, it halves the step until a layer's experts fit.
        let fixed =
            info.dense_bytes + workspace_bytes(&spec, &info, MAX_BATCH_TOKENS) + 8192 * gpu_kv_bytes_per_token(&info);
        let short_of_a_layer = BudgetRequest {
            budget_bytes: fixed + (info.num_experts as u64 - 1) * info.bytes_per_expert,
            max_batch_tokens: Some(MAX_BATCH_TOKENS),
            ..request("0", OffloadMode::Auto, None)
        };
        let err = plan_memory(&info, &spec, &short_of_a_layer).unwrap_err();
        assert!(err.to_string().contains("slots"), "{err}");
        let chosen = BudgetRequest {
            max_batch_tokens: None,
            ..short_of_a_layer
        };
        let plan = plan_memory(&info, &spec, &chosen).unwrap();
        assert_eq!(plan.step_tokens, MAX_BATCH_TOKENS / 2);
        assert!(plan.slots >= info.num_experts);
    }

    #[test]
    fn plans_match_those_of_the_planner_before_it_left_moe() {
        // (config, budget, mode, slots, KV floor, step) -> (offload, slots, KV tokens, workspace bytes, step
        // tokens), as moe::budget computed them: moving the planner and the workspace formula changed no plan.
        type Case = (
            &'static str,
            &'static str,
            OffloadMode,
            Option<usize>,
            usize,
            Option<usize>,
        );
        type Pinned = (bool, usize, usize, u64, usize);
        let cases: [(Case, Pinned); 9] = [
            (
                ("bench/q30.json", "22.3GiB", OffloadMode::Auto, None, 8192, None),
                (true, 1826, 8198, 2018127872, 4096),
            ),
            (
                (
                    "bench/q30.json",
                    "22.3GiB",
                    OffloadMode::Experts,
                    Some(1536),
                    16384,
                    None,
                ),
                (true, 1536, 22118, 2018127872, 4096),
            ),
            (
                ("bench/q30.json", "80GiB", OffloadMode::Auto, None, 8192, None),
                (false, 0, 118613, 1514811392, 2048),
            ),
            (
                ("bench/q30.json", "22.3GiB", OffloadMode::Auto, None, 8192, Some(1024)),
                (true, 1945, 8203, 894054400, 1024),
            ),
            (
                ("bench/q36.json", "15.8GiB", OffloadMode::Auto, None, 33000, None),
                (true, 1235, 33068, 2943959040, 4096),
            ),
            (
                ("bench/q36.json", "80GiB", OffloadMode::Auto, None, 8192, None),
                (false, 0, 357236, 1945714688, 2048),
            ),
            (
                (
                    "tests/fixtures/qwen2_moe/config.json",
                    "1GiB",
                    OffloadMode::Experts,
                    None,
                    8192,
                    None,
                ),
                (true, 16, 1498266, 306200576, 4096),
            ),
            (
                (
                    "tests/fixtures/mixtral/config.json",
                    "1GiB",
                    OffloadMode::Auto,
                    Some(8),
                    8192,
                    None,
                ),
                (true, 8, 1506556, 302006272, 4096),
            ),
            (
                (
                    "tests/fixtures/qwen3_next/config.json",
                    "1GiB",
                    OffloadMode::Experts,
                    None,
                    8192,
                    None,
                ),
                (true, 24, 2925997, 324026368, 4096),
            ),
        ];
        for ((config, budget, mode, slots, kv_reserve_tokens, max_batch_tokens), expected) in cases {
            let (info, spec) = model(config);
            let request = BudgetRequest {
                budget_bytes: parse_size(budget).unwrap(),
                mode,
                slots,
                kv_reserve_tokens,
                max_batch_tokens,
                snapshot_slots: 0,
            };
            let plan = plan_memory(&info, &spec, &request).unwrap();
            let got = (
                plan.offload,
                plan.slots,
                plan.kv_tokens,
                plan.workspace_bytes,
                plan.step_tokens,
            );
            assert_eq!(got, expected, "{config}, {budget}, {mode:?}");
        }
        let (q36_info, q36) = model("bench/q36.json");
        assert_eq!(workspace_bytes(&q36, &q36_info, 1), 277196800);
        assert_eq!(workspace_bytes(&q36, &q36_info, 2049), 1946202112);
    }
}
