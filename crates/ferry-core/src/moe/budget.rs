//! Dividing a GPU memory budget (`--gpu-memory-budget`): dense weights and workspace first, then a KV floor
//! (`--kv-reserve-tokens`), then expert cache slots (`--moe-cache-auto`, or exactly `--moe-cache-slots`), and the
//! rest to the KV cache. When the whole model fits, nothing is offloaded (`--offload auto`).

use crate::model::{ModelInfo, ModelSpec};
use crate::{Error, Result};

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
    /// The most tokens one forward pass carries (the prefill chunk): sizes the activation workspace.
    pub max_batch_tokens: usize,
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
    let dense_inter = spec.ffn.iter().filter_map(|f| match f {
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
        // the grouped MoE path, per (row, expert) pair (cuda/mod.rs)
        + top_k * 2 * (spec.hidden_size + inter)
        + 3 * widest_mlp
        + gdn
        // split-bf16 halves of the widest GEMM input
        + q_width.max(spec.hidden_size);
    let activations = (rows * per_row * 4) as u64;
    let logits = (8 * spec.vocab_size * 4) as u64;
    const CUBLAS_AND_POOL: u64 = 256 << 20;
    2 * activations + logits + CUBLAS_AND_POOL
}

pub fn plan_memory(info: &ModelInfo, spec: &ModelSpec, request: &BudgetRequest) -> Result<MemoryPlan> {
    let dense = info.dense_bytes;
    let workspace = workspace_bytes(spec, request.max_batch_tokens);
    let kv_per_token = gpu_kv_bytes_per_token(info).max(1);
    let floor = request.kv_reserve_tokens as u64 * kv_per_token;
    let fixed = dense + workspace + floor;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if fixed > request.budget_bytes {
        return Err(Error::Config(format!(
            "a budget of {:.2} GiB cannot hold the dense weights ({:.2} GiB), the workspace ({:.2} GiB) and KV for \
             {} tokens ({:.2} GiB)",
            gib(request.budget_bytes),
            gib(dense),
            gib(workspace),
            request.kv_reserve_tokens,
            gib(floor)
        )));
    }
    let whole_fits = fixed + info.expert_bank_bytes <= request.budget_bytes;
    let offload = match request.mode {
        OffloadMode::None if !whole_fits => {
            return Err(Error::Config(format!(
                "--offload none: the model needs {:.2} GiB with KV for {} tokens, over the {:.2} GiB budget",
                gib(fixed + info.expert_bank_bytes),
                request.kv_reserve_tokens,
                gib(request.budget_bytes)
            )))
        }
        OffloadMode::None => false,
        OffloadMode::Experts => true,
        OffloadMode::Auto => !whole_fits || request.slots.is_some(),
    };
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
            max_batch_tokens: 2048,
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
    fn whole_models_that_fit_stay_resident_and_too_small_budgets_say_why() {
        let (info, spec) = q30();
        let plan = plan_memory(&info, &spec, &request("80GiB", OffloadMode::Auto, None)).unwrap();
        assert!(!plan.offload && plan.slots == 0 && plan.expert_bytes == info.expert_bank_bytes);
        assert!(plan_memory(&info, &spec, &request("22.3GiB", OffloadMode::None, None)).is_err());
        let err = plan_memory(&info, &spec, &request("3GiB", OffloadMode::Auto, None)).unwrap_err();
        assert!(err.to_string().contains("dense weights"), "{err}");
        let err = plan_memory(&info, &spec, &request("6.2GiB", OffloadMode::Auto, None)).unwrap_err();
        assert!(err.to_string().contains("slots"), "{err}");
    }
}
