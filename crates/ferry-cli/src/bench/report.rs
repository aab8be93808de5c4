//! What `ferry bench` reports: the JSON it writes (bench/results/*.json; scripts/device/bench.sh reads its fields)
//! and the table it prints.

use ferry_core::backend::profiled::OpTime;
use ferry_core::engine::plan::MemoryPlan;
use ferry_core::model::ModelInfo;
use ferry_core::moe::{CalibratedRates, OffloadStats};
use serde::Serialize;

/// The memory the all-resident bound is computed against.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryCeiling {
    pub what: String,
    pub gb_s: f64,
}

/// Expert offload during the batch-1 decode.
#[derive(Debug, Serialize)]
pub(super) struct OffloadReport {
    slots: usize,
    hit_rate: f64,
    /// Expert bytes copied over PCIe per decoded token.
    bytes_missed_per_token: f64,
    achieved_pcie_gb_s: f64,
    measured_h2d_gb_s: f64,
    /// Measured host-to-device bandwidth over the bytes missed per token; none when nothing crossed the link
    /// (`--moe-strategy cpu`), which then bounds nothing.
    pcie_bound_tok_s: Option<f64>,
    achieved_over_pcie_bound: Option<f64>,
    layer_hit_rates: Vec<f64>,
    bank_pinned: bool,
    /// (row, k) pairs routed per distinct expert a layer's step needed: above 1 when a batch's sequences share
    /// experts, each copied once per step.
    routed_pairs_per_expert: f64,
    /// Milliseconds per token the host waited for routed ids (one wait per MoE layer): the serial point left.
    router_wait_ms_per_token: f64,
    /// Decode guesses of the next layer's routing (the next router on this layer's input): the share of guessed
    /// experts that layer routed, and of its routed experts that were guessed.
    guess_precision: f64,
    guess_recall: f64,
    /// Guessed misses copied while the copy stream idled, dropped because their layer routed first, and
    /// prefetched copies (guessed or prefill's) that a step then used.
    guesses_copied: u64,
    guesses_dropped: u64,
    prefetches_used: u64,
    /// Per lane (`--moe-strategy`): misses copied over the link and computed by the CPU lane per decoded token
    /// (distinct experts per layer and step), the lane's (row, expert) pairs per token, and each lane's achieved
    /// rate (the link's over its demand copies' time, the CPU lane's over its busy time; 0 when unused).
    link_experts_per_token: f64,
    host_experts_per_token: f64,
    host_pairs_per_token: f64,
    host_bytes_per_token: f64,
    link_gb_s: f64,
    host_gb_s: f64,
    /// What the CPU lane's jobs cost the pipeline per decoded token (from each job's start to the stream's
    /// release), beside the lane's own busy time in `host_gb_s`.
    host_pipeline_ms_per_token: f64,
    /// Under `--moe-strategy auto`, the planner's rates as calibrated by the end of the run.
    calibrated: Option<CalibratedRates>,
    /// With a replayed trace, for the batch-1 decode: a decode step's time with every expert it needs resident
    /// (a sequence of the prompt's length decoded under one token's routing, held: nothing left to copy after its
    /// first step), the overlapped bound 1 / max(copy time a token, that step), and the decode against it.
    resident_step_ms: Option<f64>,
    overlapped_bound_tok_s: Option<f64>,
    achieved_over_overlapped_bound: Option<f64>,
}

impl OffloadReport {
    /// Adds the resident step (`seconds` a token) and the overlapped bound of a decode at `tok_s`: copies and the
    /// resident step overlapped perfectly, each token takes the longer of the two.
    pub(super) fn with_resident_step(&mut self, seconds: f64, tok_s: f64) {
        let copy_seconds = self.bytes_missed_per_token / (self.measured_h2d_gb_s * 1e9);
        let bound = 1.0 / copy_seconds.max(seconds);
        self.resident_step_ms = Some(seconds * 1e3);
        self.overlapped_bound_tok_s = Some(bound);
        self.achieved_over_overlapped_bound = Some(tok_s / bound);
    }
}

#[derive(Debug, Serialize)]
pub(super) struct BenchReport {
    pub(super) ferry_commit: &'static str,
    pub(super) date: String,
    pub(super) backend: String,
    pub(super) model: String,
    pub(super) model_info: ModelInfo,
    pub(super) memory_plan: Option<MemoryPlan>,
    /// Under expert offload, the cache's eviction policy (`--moe-cache-policy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) moe_cache_policy: Option<String>,
    /// Under expert offload, who computed the misses (`--moe-strategy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) moe_strategy: Option<String>,
    pub(super) routing: String,
    pub(super) load_seconds: f64,
    pub(super) prompt_tokens: usize,
    /// Prefill chunk: tokens one forward pass carries at most.
    pub(super) step_tokens: usize,
    pub(super) prefill_tok_s: f64,
    pub(super) ttft_seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) long_prefill: Option<Prefill>,
    pub(super) decode_tokens: usize,
    pub(super) decode_tok_s_batch1: f64,
    /// Seconds the host spends issuing one batch-1 decode step.
    pub(super) decode_host_seconds_per_token: f64,
    /// Seconds it then waits for the step to finish (its logits or their argmax on the host); the rest of a token's
    /// time is the scheduling around the step (the scheduler, the emitter), while the device has no step to run.
    pub(super) decode_wait_seconds_per_token: f64,
    pub(super) concurrency: usize,
    pub(super) decode_tok_s_aggregate: f64,
    /// Bytes of weights one decoded token reads at batch 1.
    pub(super) bytes_per_token: u64,
    pub(super) memory_ceiling: MemoryCeiling,
    pub(super) decode_bound_tok_s: f64,
    pub(super) decode_achieved_over_bound: f64,
    pub(super) offload: Option<OffloadReport>,
    /// Expert offload during the concurrent decode (its tokens counted over all sequences).
    pub(super) offload_concurrent: Option<OffloadReport>,
    pub(super) peak_gpu_memory_bytes: Option<u64>,
    /// With --profile: per phase (prefill, decode_batch1, decode_concurrent), where the time went.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) profile: Vec<(&'static str, Vec<OpTime>)>,
}

/// One prompt's prefill, up to its first token.
#[derive(Debug, Serialize)]
pub(super) struct Prefill {
    pub(super) prompt_tokens: usize,
    pub(super) prefill_tok_s: f64,
    pub(super) ttft_seconds: f64,
}

/// Bytes over nanoseconds, GB/s; 0 for no time.
fn lane_gb_s(bytes: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        bytes as f64 / ns as f64
    }
}

/// The offload counters' change over a decode of `tokens` tokens in `seconds`, against the PCIe bound.
pub(super) fn offload_report(
    before: Option<OffloadStats>,
    after: Option<OffloadStats>,
    tokens: usize,
    seconds: f64,
    tok_s: f64,
    h2d_gb_s: Option<f64>,
) -> Option<OffloadReport> {
    let (before, after, h2d) = (before?, after?, h2d_gb_s?);
    let delta = |a: &[u64], b: &[u64]| -> Vec<u64> {
        a.iter()
            .zip(b.iter().chain(std::iter::repeat(&0)))
            .map(|(x, y)| x - y)
            .collect()
    };
    let hits = delta(&after.layer_hits, &before.layer_hits);
    let misses = delta(&after.layer_misses, &before.layer_misses);
    let all_hits: u64 = hits.iter().sum();
    let all = all_hits + misses.iter().sum::<u64>();
    let bytes = (after.bytes_copied - before.bytes_copied) as f64;
    let guessed_routed = after.guessed_routed - before.guessed_routed;
    let ratio = |part: u64, whole: u64| if whole == 0 { 0.0 } else { part as f64 / whole as f64 };
    let bytes_missed_per_token = bytes / tokens as f64;
    let pcie_bound = (bytes > 0.0).then(|| h2d * 1e9 / bytes_missed_per_token);
    Some(OffloadReport {
        slots: after.slots,
        hit_rate: if all == 0 { 0.0 } else { all_hits as f64 / all as f64 },
        bytes_missed_per_token,
        achieved_pcie_gb_s: bytes / seconds / 1e9,
        measured_h2d_gb_s: h2d,
        pcie_bound_tok_s: pcie_bound,
        achieved_over_pcie_bound: pcie_bound.map(|bound| tok_s / bound),
        layer_hit_rates: hits
            .iter()
            .zip(&misses)
            .map(|(&h, &m)| if h + m == 0 { 0.0 } else { h as f64 / (h + m) as f64 })
            .collect(),
        bank_pinned: after.bank_pinned,
        routed_pairs_per_expert: ratio(after.routed_pairs - before.routed_pairs, all),
        router_wait_ms_per_token: (after.router_wait_ns - before.router_wait_ns) as f64 / 1e6 / tokens as f64,
        guess_precision: ratio(guessed_routed, after.guessed - before.guessed),
        guess_recall: ratio(guessed_routed, after.routed_after_guess - before.routed_after_guess),
        guesses_copied: after.guesses_copied - before.guesses_copied,
        guesses_dropped: after.guesses_dropped - before.guesses_dropped,
        prefetches_used: after.prefetches_used - before.prefetches_used,
        link_experts_per_token: (after.copies - before.copies) as f64 / tokens as f64,
        host_experts_per_token: (after.host_experts - before.host_experts) as f64 / tokens as f64,
        host_pairs_per_token: (after.host_pairs - before.host_pairs) as f64 / tokens as f64,
        host_bytes_per_token: (after.host_bytes - before.host_bytes) as f64 / tokens as f64,
        link_gb_s: lane_gb_s(
            (after.copies - after.prefetched - (before.copies - before.prefetched)) * after.bytes_per_expert as u64,
            after.link_ns - before.link_ns,
        ),
        host_gb_s: lane_gb_s(after.host_bytes - before.host_bytes, after.host_ns - before.host_ns),
        host_pipeline_ms_per_token: (after.host_pipeline_ns - before.host_pipeline_ns) as f64 / 1e6 / tokens as f64,
        calibrated: after.calibrated,
        resident_step_ms: None,
        overlapped_bound_tok_s: None,
        achieved_over_overlapped_bound: None,
    })
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock (Howard Hinnant's civil-from-days).
pub(super) fn civil_date() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

pub(super) fn print_report(r: &BenchReport) {
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let mut rows = vec![
        ("backend", r.backend.clone()),
        ("model", format!("{} ({})", r.model, r.model_info.model_type)),
        ("format", r.model_info.weight_dtype.clone()),
        ("routing", r.routing.clone()),
        ("load", format!("{:.1} s", r.load_seconds)),
        (
            "prefill",
            format!(
                "{:.0} tok/s ({} tokens, in chunks of {})",
                r.prefill_tok_s, r.prompt_tokens, r.step_tokens
            ),
        ),
        ("time to first token", format!("{:.3} s", r.ttft_seconds)),
    ];
    if let Some(long) = &r.long_prefill {
        rows.push((
            "prefill, long prompt",
            format!(
                "{:.0} tok/s ({} tokens; first token after {:.2} s)",
                long.prefill_tok_s, long.prompt_tokens, long.ttft_seconds
            ),
        ));
    }
    rows.extend([
        (
            "decode, batch 1",
            format!(
                "{:.1} tok/s (host issues a step in {:.2} ms, waits {:.2} ms for it, schedules {:.2} ms)",
                r.decode_tok_s_batch1,
                r.decode_host_seconds_per_token * 1e3,
                r.decode_wait_seconds_per_token * 1e3,
                (1.0 / r.decode_tok_s_batch1 - r.decode_host_seconds_per_token - r.decode_wait_seconds_per_token)
                    .max(0.0)
                    * 1e3
            ),
        ),
        (
            "decode, concurrent",
            format!(
                "{:.1} tok/s aggregate ({} sequences)",
                r.decode_tok_s_aggregate, r.concurrency
            ),
        ),
        ("bytes per token", format!("{:.2} GB", r.bytes_per_token as f64 / 1e9)),
        (
            "memory ceiling",
            format!("{:.0} GB/s ({})", r.memory_ceiling.gb_s, r.memory_ceiling.what),
        ),
        (
            "resident bound, batch 1",
            format!(
                "{:.1} tok/s ({:.1} % achieved)",
                r.decode_bound_tok_s,
                100.0 * r.decode_achieved_over_bound
            ),
        ),
    ]);
    if let Some(p) = &r.memory_plan {
        rows.push((
            "GPU memory plan",
            format!(
                "dense {}, workspace {}, experts {}, KV {} ({} tokens)",
                gib(p.dense_bytes),
                gib(p.workspace_bytes),
                gib(p.expert_bytes),
                gib(p.kv_bytes),
                p.kv_tokens
            ),
        ));
    }
    if let Some(o) = &r.offload {
        rows.push((
            "expert cache",
            format!("{} slots, hit rate {:.1} %", o.slots, 100.0 * o.hit_rate),
        ));
        rows.push(("missed per token", format!("{:.2} GB", o.bytes_missed_per_token / 1e9)));
        rows.push((
            "PCIe",
            format!(
                "{:.1} GB/s achieved, {:.1} GB/s measured H2D",
                o.achieved_pcie_gb_s, o.measured_h2d_gb_s
            ),
        ));
        rows.push((
            "PCIe bound, batch 1",
            match (o.pcie_bound_tok_s, o.achieved_over_pcie_bound) {
                (Some(bound), Some(achieved)) => format!("{bound:.1} tok/s ({:.1} % achieved)", 100.0 * achieved),
                _ => "none (nothing crossed the link)".into(),
            },
        ));
        if let (Some(step), Some(bound), Some(achieved)) = (
            o.resident_step_ms,
            o.overlapped_bound_tok_s,
            o.achieved_over_overlapped_bound,
        ) {
            rows.push((
                "overlapped bound",
                format!(
                    "{bound:.1} tok/s ({:.1} % achieved): copies under a {step:.2} ms resident step",
                    100.0 * achieved
                ),
            ));
        }
        rows.push((
            "lanes per token",
            format!(
                "link {:.1} experts at {:.1} GB/s, CPU {:.1} experts ({:.1} rows) at {:.1} GB/s",
                o.link_experts_per_token, o.link_gb_s, o.host_experts_per_token, o.host_pairs_per_token, o.host_gb_s
            ),
        ));
        rows.push((
            "router waits",
            format!("{:.2} ms per token", o.router_wait_ms_per_token),
        ));
        rows.push((
            "next-layer guesses",
            format!(
                "precision {:.1} %, recall {:.1} %; {} copied, {} dropped, {} prefetches used",
                100.0 * o.guess_precision,
                100.0 * o.guess_recall,
                o.guesses_copied,
                o.guesses_dropped,
                o.prefetches_used
            ),
        ));
    }
    if let Some(o) = &r.offload_concurrent {
        rows.push((
            "expert cache, concurrent",
            format!(
                "hit rate {:.1} %, {:.2} GB missed per token, {:.2} routed pairs per expert copied or hit",
                100.0 * o.hit_rate,
                o.bytes_missed_per_token / 1e9,
                o.routed_pairs_per_expert
            ),
        ));
    }
    rows.push(("peak GPU memory", r.peak_gpu_memory_bytes.map_or("-".into(), gib)));
    for (name, value) in rows {
        println!("{name:<26}{value}");
    }
    for (phase, ops) in &r.profile {
        println!("profile: {phase}");
        for op in ops {
            println!("  {:<24}{:>8} calls {:>10.3} ms", op.op, op.calls, op.seconds * 1e3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bytes_copied: u64, host_experts: u64) -> OffloadStats {
        OffloadStats {
            layer_hits: vec![3],
            layer_misses: vec![5],
            bytes_copied,
            host_experts,
            ..OffloadStats::default()
        }
    }

    #[test]
    fn the_pcie_bound_is_the_link_rate_over_the_bytes_copied_and_none_when_nothing_crossed() {
        let before = OffloadStats::default();
        let copied = offload_report(
            Some(before.clone()),
            Some(stats(40e9 as u64, 0)),
            10,
            2.0,
            5.0,
            Some(50.0),
        );
        let copied = copied.unwrap();
        // 4 GB a token at 50 GB/s: 12.5 tok/s, of which 5 is 40 %.
        assert_eq!(copied.pcie_bound_tok_s, Some(12.5));
        assert_eq!(copied.achieved_over_pcie_bound, Some(0.4));
        let on_the_cpu = offload_report(Some(before), Some(stats(0, 50)), 10, 2.0, 5.0, Some(50.0)).unwrap();
        assert_eq!(on_the_cpu.pcie_bound_tok_s, None);
        assert_eq!(on_the_cpu.achieved_over_pcie_bound, None);
        assert_eq!(on_the_cpu.host_experts_per_token, 5.0);
    }

    #[test]
    fn the_overlapped_bound_is_the_longer_of_a_tokens_copies_and_its_resident_step() {
        let report = || {
            offload_report(
                Some(OffloadStats::default()),
                Some(stats(40e9 as u64, 0)),
                10,
                2.0,
                5.0,
                Some(50.0),
            )
        };
        // 4 GB a token at 50 GB/s: 80 ms of copies.
        let mut copy_bound = report().unwrap();
        copy_bound.with_resident_step(0.02, 5.0);
        assert_eq!(copy_bound.overlapped_bound_tok_s, Some(12.5));
        assert_eq!(copy_bound.achieved_over_overlapped_bound, Some(0.4));
        let mut step_bound = report().unwrap();
        step_bound.with_resident_step(0.1, 5.0);
        assert_eq!(step_bound.overlapped_bound_tok_s, Some(10.0));
        assert_eq!(step_bound.achieved_over_overlapped_bound, Some(0.5));
        assert_eq!(step_bound.resident_step_ms, Some(100.0));
    }
}
