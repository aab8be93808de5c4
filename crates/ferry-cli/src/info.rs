//! `ferry info`: what a user needs to size a GPU cache for a checkpoint, and (`--check`) whether its weights are
//! all finite.

use anyhow::{bail, Result};
use ferry_core::loader::NonFinite;
use ferry_core::model::{spec_for, ModelInfo};

use crate::device::{ExpertDtypeArgs, ModelArgs, OffloadArgs};

#[derive(clap::Args)]
pub struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    expert_dtype: ExpertDtypeArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// With --gpu-memory-budget: how that budget would be divided, and how much of the bank the cache holds (with
    /// --gpus N, each GPU's budget, for its share of the experts).
    #[command(flatten)]
    offload: OffloadArgs,
    /// Read every weight and list the tensors holding NaN or infinite values (fails if any do).
    #[arg(long)]
    check: bool,
}

/// Bytes in the largest binary unit that keeps the number at least 1.
fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let exponent = ((n.max(1).ilog2() / 10) as usize).min(units.len() - 1);
    format!("{:.2} {}", n as f64 / (1u64 << (10 * exponent)) as f64, units[exponent])
}

/// A parameter count in thousands, millions or billions.
fn count(n: u64) -> String {
    match n {
        0..1_000_000 => format!("{:.1} K", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2} M", n as f64 / 1e6),
        _ => format!("{:.2} B", n as f64 / 1e9),
    }
}

pub fn run(args: InfoArgs) -> Result<()> {
    let mut checkpoint = args.model.open()?;
    args.expert_dtype.apply(&mut checkpoint);
    let spec = spec_for(&checkpoint.model_type, &checkpoint.config)?;
    let info = ModelInfo::new(&spec, checkpoint.weight_format());
    let plans = args
        .offload
        .budget_bytes()?
        .map(|budget| args.offload.plans(&checkpoint, budget))
        .transpose()?
        .unwrap_or_default();
    // The GPUs' experts together, against the bank.
    let cached_share = plans.iter().map(|p| p.expert_bytes).sum::<u64>() as f64 / info.expert_bank_bytes.max(1) as f64;
    let non_finite = args.check.then(|| checkpoint.weights.non_finite());
    if args.json {
        let mut out = serde_json::to_value(&info)?;
        if let Some(plan) = plans.first() {
            out["memory_plan"] = serde_json::to_value(plan)?;
            out["cached_share_of_bank"] = cached_share.into();
        }
        if plans.len() > 1 {
            out["memory_plans"] = serde_json::to_value(&plans)?;
        }
        if let Some(found) = &non_finite {
            out["non_finite"] = serde_json::to_value(found)?;
        }
        println!("{out}");
        return check_result(non_finite.as_deref());
    }
    let mut rows = vec![
        ("family", info.model_type.clone()),
        ("layers (MoE)", format!("{} ({})", info.num_layers, info.num_moe_layers)),
        (
            "experts",
            format!(
                "{} routed, top-{}{}",
                info.num_experts,
                info.experts_per_token,
                if info.shared_expert { " + 1 shared" } else { "" }
            ),
        ),
        (
            "hidden / moe intermediate",
            format!("{} / {}", info.hidden_size, info.moe_intermediate_size),
        ),
        ("weights", info.weight_dtype.clone()),
        ("parameters", count(info.params_total)),
        ("active per token", count(info.params_active_per_token)),
        ("bytes per expert", bytes(info.bytes_per_expert)),
        ("expert bank (host RAM)", bytes(info.expert_bank_bytes)),
        ("dense part (GPU)", bytes(info.dense_bytes)),
        ("KV per token (bf16)", bytes(info.kv_bytes_per_token_bf16)),
    ];
    if info.num_gated_delta_net_layers > 0 {
        rows.insert(
            2,
            (
                "token mixers",
                format!(
                    "{} attention + {} Gated DeltaNet",
                    info.num_attention_layers, info.num_gated_delta_net_layers
                ),
            ),
        );
        rows.push(("recurrent state / sequence", bytes(info.recurrent_state_bytes_per_seq)));
    }
    for (name, value) in rows {
        println!("{name:<28}{value}");
    }
    for (gpu, p) in plans.iter().enumerate() {
        if plans.len() > 1 {
            println!(
                "GPU {gpu} of {}: its {} experts a MoE layer",
                plans.len(),
                info.rank_share(plans.len(), gpu).num_experts
            );
        }
        let share = 100.0 * p.expert_bytes as f64 / info.expert_bank_bytes.max(1) as f64;
        let experts = match p.offload {
            true => format!(
                "{} cache slots ({}, {share:.1} % of the bank)",
                p.slots,
                bytes(p.expert_bytes)
            ),
            false => format!("all resident ({})", bytes(p.expert_bytes)),
        };
        println!("{:<28}{experts}", "experts under the budget");
        println!(
            "{:<28}{} ({} tokens)",
            "KV under the budget",
            bytes(p.kv_bytes),
            p.kv_tokens
        );
        println!(
            "{:<28}dense {}, workspace {} (forward passes of {} tokens at most: the prefill chunk)",
            "also on the GPU",
            bytes(p.dense_bytes),
            bytes(p.workspace_bytes),
            p.step_tokens
        );
    }
    match non_finite.as_deref() {
        Some([]) => println!("{:<28}all finite", "weights checked"),
        Some(found) => {
            for bad in found {
                println!(
                    "{:<28}{}: {} NaN, {} infinite",
                    "not finite", bad.tensor, bad.nan, bad.inf
                );
            }
        }
        None => {}
    }
    check_result(non_finite.as_deref())
}

/// `--check` fails when a weight is NaN or infinite, so scripts can gate on it.
fn check_result(non_finite: Option<&[NonFinite]>) -> Result<()> {
    match non_finite {
        Some(found) if !found.is_empty() => bail!("{} tensors hold NaN or infinite values", found.len()),
        _ => Ok(()),
    }
}
