//! Memory plans for an expert-parallel group of GPUs (issue 19): one per GPU, each [`plan_memory`]'s for the
//! share of the model that GPU holds.

use super::{gpu_kv_bytes_per_token, plan_memory, BudgetRequest, MemoryPlan};
use crate::model::{ModelInfo, ModelSpec};
use crate::{Error, Result};

/// The plans of an expert-parallel group of `ranks` GPUs, one per GPU under the same budget: each GPU holds the
/// dense part, its workspace and the KV cache whole, and its share of the routed experts
/// ([`ModelInfo::rank_share`]), resident or offloaded as its plan says. Every rank runs the same steps (the first
/// rank's step size: its share is the largest) over the same KV blocks, so every plan keeps the group's smallest KV.
/// One rank: [`plan_memory`]'s plan.
pub fn plan_group(
    info: &ModelInfo,
    spec: &ModelSpec,
    request: &BudgetRequest,
    ranks: usize,
) -> Result<Vec<MemoryPlan>> {
    if ranks == 0 {
        return Err(Error::Config("a plan for no GPUs".into()));
    }
    if ranks > 1 && info.num_experts < ranks {
        return Err(Error::Config(format!(
            "{ranks} GPUs share the routed experts by expert parallelism, and this model has {} a layer: at most \
             that many GPUs",
            info.num_experts
        )));
    }
    let first = plan_memory(&info.rank_share(ranks, 0), spec, request)?;
    let same_steps = BudgetRequest {
        max_batch_tokens: Some(first.step_tokens),
        ..request.clone()
    };
    let mut plans = vec![first];
    for rank in 1..ranks {
        plans.push(plan_memory(&info.rank_share(ranks, rank), spec, &same_steps)?);
    }
    let kv_tokens = plans.iter().map(|p| p.kv_tokens).min().unwrap_or(0);
    let kv_per_token = gpu_kv_bytes_per_token(info).max(1);
    for plan in &mut plans {
        plan.kv_tokens = kv_tokens;
        plan.kv_bytes = kv_tokens as u64 * kv_per_token;
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::plan::{parse_size, OffloadMode};
    use crate::loader::{DType, WeightFormat};
    use crate::model::spec_for;

    fn q30() -> (ModelInfo, ModelSpec) {
        let path = format!("{}/../../bench/q30.json", env!("CARGO_MANIFEST_DIR"));
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let spec = spec_for(config["model_type"].as_str().unwrap(), &config).unwrap();
        let format = WeightFormat {
            dtype: DType::BF16,
            experts_fp8: None,
            dense_fp8: None,
        };
        (ModelInfo::new(&spec, format), spec)
    }

    fn request(budget: &str) -> BudgetRequest {
        BudgetRequest {
            budget_bytes: parse_size(budget).unwrap(),
            mode: OffloadMode::Auto,
            slots: None,
            kv_reserve_tokens: 8192,
            max_batch_tokens: None,
            snapshot_slots: 0,
        }
    }

    #[test]
    fn the_ranks_shares_make_up_the_model() {
        let (info, _) = q30();
        assert_eq!(info.rank_share(1, 0).expert_bank_bytes, info.expert_bank_bytes);
        for ranks in [2, 3, 5] {
            let shares: Vec<ModelInfo> = (0..ranks).map(|r| info.rank_share(ranks, r)).collect();
            assert_eq!(shares.iter().map(|s| s.num_experts).sum::<usize>(), info.num_experts);
            assert_eq!(
                shares.iter().map(|s| s.expert_bank_bytes).sum::<u64>(),
                info.expert_bank_bytes
            );
            // Dealt out in turn: no share is more than one expert a layer larger than another.
            let (most, fewest) = (shares[0].num_experts, shares[ranks - 1].num_experts);
            assert!(most - fewest <= 1, "{ranks} ranks: {most} and {fewest}");
            assert!(shares.iter().all(|s| s.dense_bytes == info.dense_bytes));
        }
    }

    #[test]
    fn one_gpu_plans_as_plan_memory_does() {
        let (info, spec) = q30();
        for budget in ["22.3GiB", "80GiB"] {
            let plans = plan_group(&info, &spec, &request(budget), 1).unwrap();
            assert_eq!(plans, vec![plan_memory(&info, &spec, &request(budget)).unwrap()]);
        }
    }

    #[test]
    fn two_gpus_hold_what_one_must_offload() {
        let (info, spec) = q30();
        // q30's bank (about 57 GB) does not fit one 40 GiB card beside the rest; half of it fits each of two.
        let budget = request("40GiB");
        assert!(plan_memory(&info, &spec, &budget).unwrap().offload);
        let plans = plan_group(&info, &spec, &budget, 2).unwrap();
        assert_eq!(plans.len(), 2);
        assert!(plans.iter().all(|p| !p.offload));
        assert_eq!(
            plans.iter().map(|p| p.expert_bytes).sum::<u64>(),
            info.expert_bank_bytes
        );
        // The same steps and KV on both: what the group's shared blocks need.
        assert_eq!(plans[0].step_tokens, plans[1].step_tokens);
        assert_eq!(plans[0].kv_tokens, plans[1].kv_tokens);
        for plan in &plans {
            let used = plan.dense_bytes + plan.workspace_bytes + plan.expert_bytes + plan.kv_bytes;
            assert!(used <= budget.budget_bytes, "{used} over the budget");
        }
        // On 16 GiB cards the shares are offloaded, each GPU's cache holding its own experts.
        let plans = plan_group(&info, &spec, &request("16GiB"), 2).unwrap();
        assert!(plans.iter().all(|p| p.offload && p.slots >= info.num_experts / 2));
    }

    #[test]
    fn more_gpus_than_experts_a_layer_is_an_error() {
        let (info, spec) = q30();
        let error = plan_group(&info, &spec, &request("80GiB"), info.num_experts + 1).unwrap_err();
        assert!(error.to_string().contains("at most that many GPUs"), "{error}");
        assert!(plan_group(&info, &spec, &request("80GiB"), 0).is_err());
    }
}
