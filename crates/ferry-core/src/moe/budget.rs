//! Dividing a GPU memory budget (`--gpu-memory-budget`): dense weights and workspace first, then a KV floor
//! (`--kv-reserve-tokens`), then expert cache slots (`--moe-cache-auto`, or exactly `--moe-cache-slots`), and the
//! rest to the KV cache. When the whole model fits, nothing is offloaded (`--offload auto`).

use crate::engine::MAX_BATCH_TOKENS;
use crate::model::{ModelInfo, ModelSpec};
use crate::{Error, Result};

/// Tokens of one forward pass under expert offload, unless asked otherwise. Each prefill step streams nearly the
/// whole expert bank once (its chunk routes to nearly every expert), so a step is worth making as long as the
/// layers' compute of it takes about as long as that stream, behind which the copies hide: on the H200 a q36 step
/// of 2,048 tokens computes in about 0.65 s and the 64 GB bank streams in 1.2 s (docs/perf.md).
pub const OFFLOAD_STEP_TOKENS: usize = 4096;

/// Rows the grouped (prefill) expert path takes at once: a longer step runs its experts in groups of this many
/// rows, so the expert part of the workspace stops growing with the step.
pub const MOE_GROUP_ROWS: usize = 2048;

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
    /// Exactly this many cache slots; None sizes the cache automatically.
    pub slots: Option<usize>,
    pub kv_reserve_tokens: usize,
    /// The most tokens one forward pass carries (the prefill chunk), which sizes the activation workspace; None:
    /// [`MAX_BATCH_TOKENS`], or [`OFFLOAD_STEP_TOKENS`] when the experts are offloaded.
    pub max_batch_tokens: Option<usize>,
}

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
}

/// KV bytes per token on the GPU (keys and values kept in f32).
pub fn gpu_kv_bytes_per_token(info: &ModelInfo) -> u64 {
    info.kv_bytes_per_token_bf16 * 2
}

/// Activations of one forward pass of `rows` tokens, with room for the memory pool's rounding, plus cuBLAS's
/// workspace: an upper estimate, so that what ferry allocates stays under the budget.
pub fn workspace_bytes(spec: &ModelSpec, rows: usize) -> u64 {
    let q_width = spec.num_heads * spec.head_dim;
    let kv_width = spec.num_kv_heads * spec.head_dim;
    let dense_inter = spec.layers.iter().filter_map(|l| match &l.ffn {
        crate::model::FfnKind::Dense { intermediate } => Some(*intermediate),
        crate::model::FfnKind::Moe => None,
    });
    let (top_k, inter, shared) = spec.moe.as_ref().map_or((0, 0, 0), |m| {
        (m.top_k, m.intermediate, m.shared_expert_intermediate.unwrap_or(0))
    });
    let gdn = spec
        .gated_delta_net
        .as_ref()
        .map_or(0, |g| 2 * g.conv_dim() + 3 * g.value_dim());
    let widest_mlp = dense_inter.max().unwrap_or(0).max(shared);
    let per_row = 6 * spec.hidden_size
        + 3 * q_width
        + 4 * kv_width
        + 3 * widest_mlp
        + gdn
        // split-bf16 halves of the widest GEMM input
        + q_width.max(spec.hidden_size);
    // The grouped MoE path, per (row, expert) pair of a group of at most MOE_GROUP_ROWS rows (cuda/mod.rs).
    let grouped_experts = rows.min(MOE_GROUP_ROWS) * top_k * 2 * (spec.hidden_size + inter);
    let activations = ((rows * per_row + grouped_experts) * 4) as u64;
    let logits = (8 * spec.vocab_size * 4) as u64;
    const CUBLAS_AND_POOL: u64 = 256 << 20;
    2 * activations + logits + CUBLAS_AND_POOL
}

pub fn plan_memory(info: &ModelInfo, spec: &ModelSpec, request: &BudgetRequest) -> Result<MemoryPlan> {
    let dense = info.dense_bytes;
    let kv_per_token = gpu_kv_bytes_per_token(info).max(1);
    let floor = request.kv_reserve_tokens as u64 * kv_per_token;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // Dense weights, workspace and KV floor for a step of `step_tokens`, or why the budget cannot hold them.
    let fixed_for = |step_tokens: usize| -> Result<(u64, u64)> {
        let workspace = workspace_bytes(spec, step_tokens);
        let fixed = dense + workspace + floor;
        if fixed > request.budget_bytes {
            return Err(Error::Config(format!(
                "a budget of {:.2} GiB cannot hold the dense weights ({:.2} GiB), the workspace for {step_tokens}-token \
                 steps ({:.2} GiB) and KV for {} tokens ({:.2} GiB)",
                gib(request.budget_bytes),
                gib(dense),
                gib(workspace),
                request.kv_reserve_tokens,
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
    // Under offload the longer step, unless its workspace leaves no room for the slots a step needs (one layer's
    // experts, or the asked number): then the resident step, as a budget that small had before.
    let needed_slots = request.slots.unwrap_or(info.num_experts) as u64;
    let longer_step_fits = fixed_for(OFFLOAD_STEP_TOKENS)
        .is_ok_and(|(_, fixed)| request.budget_bytes - fixed >= needed_slots * info.bytes_per_expert);
    let step_tokens = match request.max_batch_tokens {
        Some(n) => n,
        None if offload && longer_step_fits => OFFLOAD_STEP_TOKENS,
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
    let kv_tokens = ((request.budget_bytes - dense - workspace - expert_bytes) / kv_per_token) as usize;
    Ok(MemoryPlan {
        offload,
        slots,
        kv_tokens,
        dense_bytes: dense,
        workspace_bytes: workspace,
        expert_bytes,
        kv_bytes: kv_tokens as u64 * kv_per_token,
        step_tokens,
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
    use crate::model::spec_for;

    fn q30() -> (ModelInfo, ModelSpec) {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/q30.json")).unwrap();
        let spec = spec_for("qwen3_moe", &serde_json::from_str(&text).unwrap()).unwrap();
        (ModelInfo::new(&spec, crate::loader::DType::BF16), spec)
    }

    fn request(budget: &str, mode: OffloadMode, slots: Option<usize>) -> BudgetRequest {
        BudgetRequest {
            budget_bytes: parse_size(budget).unwrap(),
            mode,
            slots,
            kv_reserve_tokens: 8192,
            max_batch_tokens: None,
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
    fn offloaded_experts_take_longer_steps_whose_expert_workspace_stays_that_of_one_group() {
        let (info, spec) = q30();
        let resident = plan_memory(&info, &spec, &request("80GiB", OffloadMode::Auto, None)).unwrap();
        assert_eq!(resident.step_tokens, MAX_BATCH_TOKENS);
        assert_eq!(resident.workspace_bytes, workspace_bytes(&spec, MAX_BATCH_TOKENS));
        let offloaded = plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::Auto, None)).unwrap();
        assert_eq!(offloaded.step_tokens, OFFLOAD_STEP_TOKENS);
        assert_eq!(offloaded.workspace_bytes, workspace_bytes(&spec, OFFLOAD_STEP_TOKENS));
        // Past MOE_GROUP_ROWS rows the grouped expert buffers stop growing: a row costs less than below it.
        let per_row = |rows: usize| workspace_bytes(&spec, rows) - workspace_bytes(&spec, rows - 1);
        assert!(per_row(MOE_GROUP_ROWS + 2) < per_row(MOE_GROUP_ROWS));
        let asked = BudgetRequest {
            max_batch_tokens: Some(1024),
            ..request("22.3GiB", OffloadMode::Auto, None)
        };
        let plan = plan_memory(&info, &spec, &asked).unwrap();
        assert_eq!(
            (plan.step_tokens, plan.workspace_bytes),
            (1024, workspace_bytes(&spec, 1024))
        );
        assert!(
            plan.slots > offloaded.slots,
            "a shorter step leaves more room for slots"
        );
    }

    #[test]
    fn a_budget_too_small_for_the_longer_steps_workspace_keeps_the_shorter_step() {
        let (info, spec) = q30();
        let fixed =
            info.dense_bytes + workspace_bytes(&spec, OFFLOAD_STEP_TOKENS) + 8192 * gpu_kv_bytes_per_token(&info);
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
        // Room for everything but one layer's experts, even with the shorter step.
        let fixed = info.dense_bytes + workspace_bytes(&spec, MAX_BATCH_TOKENS) + 8192 * gpu_kv_bytes_per_token(&info);
        let short_of_a_layer = BudgetRequest {
            budget_bytes: fixed + (info.num_experts as u64 - 1) * info.bytes_per_expert,
            ..request("0", OffloadMode::Auto, None)
        };
        let err = plan_memory(&info, &spec, &short_of_a_layer).unwrap_err();
        assert!(err.to_string().contains("slots"), "{err}");
    }
}
