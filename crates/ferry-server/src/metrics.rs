//! Prometheus metrics: request outcomes, token counts, latency histograms, and the engine's state (running and
//! queued requests, KV blocks, decode speed) read at scrape time. Each server has its own recorder, so several
//! servers in one process (the tests) do not mix their numbers.

use ferry_core::engine::EngineStatus;
use metrics::{counter, gauge, histogram, with_local_recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

const TTFT: &str = "ferry_time_to_first_token_seconds";
const ITL: &str = "ferry_inter_token_latency_seconds";

pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl Metrics {
    pub fn new() -> Self {
        let ttft_buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
        let itl_buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(TTFT.into()), &ttft_buckets)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ITL.into()), &itl_buckets))
            .expect("bucket lists are not empty")
            .build_recorder();
        let handle = recorder.handle();
        Metrics { recorder, handle }
    }

    fn record(&self, f: impl FnOnce()) {
        with_local_recorder(&self.recorder, f)
    }

    /// A request ended: `outcome` is stop, length, error (in the engine), cancelled (the client left), rejected
    /// (queue full), invalid (a 4xx before generation) or unavailable (the model was loading).
    pub fn request_done(&self, outcome: &'static str, prompt_tokens: usize, completion_tokens: usize) {
        self.record(|| {
            counter!("ferry_requests_total", "outcome" => outcome).increment(1);
            counter!("ferry_prompt_tokens_total").increment(prompt_tokens as u64);
            counter!("ferry_completion_tokens_total").increment(completion_tokens as u64);
        });
    }

    pub fn time_to_first_token(&self, seconds: f64) {
        self.record(|| histogram!(TTFT).record(seconds));
    }

    pub fn inter_token_latency(&self, seconds: f64) {
        self.record(|| histogram!(ITL).record(seconds));
    }

    /// The Prometheus text, with the engine's gauges as they are now (None while the model loads).
    pub fn render(&self, engine: Option<EngineStatus>) -> String {
        let status = engine.unwrap_or_default();
        self.record(|| {
            let s = status.scheduler;
            gauge!("ferry_running_requests").set(s.running as f64);
            gauge!("ferry_queued_requests").set(s.queued as f64);
            gauge!("ferry_kv_blocks_used").set(s.kv_blocks_used as f64);
            gauge!("ferry_kv_blocks_total").set(s.kv_blocks_total as f64);
            gauge!("ferry_decode_tokens_per_second").set(status.decode_tokens_per_s);
            counter!("ferry_preemptions_total").absolute(s.preemptions);
            gauge!("ferry_kv_blocks_cached").set(s.kv_blocks_cached as f64);
            counter!("ferry_prefix_cache_queries_total").absolute(s.prefix.queries);
            counter!("ferry_prefix_cache_queried_tokens_total").absolute(s.prefix.queried_tokens);
            counter!("ferry_prefix_cache_hit_tokens_total").absolute(s.prefix.hit_tokens);
            counter!("ferry_prefix_cache_evicted_blocks_total").absolute(s.prefix.evicted_blocks);
            counter!("ferry_prefix_cache_evicted_snapshots_total").absolute(s.prefix.evicted_snapshots);
            if let Some(offload) = &status.offload {
                counter!("ferry_expert_cache_hits_total").absolute(offload.hits());
                counter!("ferry_expert_cache_misses_total").absolute(offload.misses());
                counter!("ferry_expert_cache_bytes_copied_total").absolute(offload.bytes_copied);
                counter!("ferry_expert_cpu_lane_experts_total").absolute(offload.host_experts);
                counter!("ferry_expert_cpu_lane_bytes_total").absolute(offload.host_bytes);
                gauge!("ferry_expert_cpu_lane_gb_per_second").set(offload.host_gb_s());
                gauge!("ferry_expert_link_gb_per_second").set(offload.link_gb_s());
            }
        });
        self.handle.render()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::moe::OffloadStats;

    #[test]
    fn expert_cache_counters_appear_only_under_offload() {
        let metrics = Metrics::new();
        let resident = metrics.render(Some(EngineStatus::default()));
        assert!(!resident.contains("ferry_expert_cache"), "{resident}");
        let offload = OffloadStats {
            layer_hits: vec![20, 10],
            layer_misses: vec![4, 6],
            bytes_copied: 4096,
            host_experts: 3,
            host_bytes: 3000,
            host_ns: 1000,
            ..OffloadStats::default()
        };
        let offloaded = metrics.render(Some(EngineStatus {
            offload: Some(offload),
            ..EngineStatus::default()
        }));
        for line in [
            "ferry_expert_cache_hits_total 30",
            "ferry_expert_cache_misses_total 10",
            "ferry_expert_cache_bytes_copied_total 4096",
            "ferry_expert_cpu_lane_experts_total 3",
            "ferry_expert_cpu_lane_bytes_total 3000",
            "ferry_expert_cpu_lane_gb_per_second 3",
        ] {
            assert!(offloaded.contains(line), "no {line:?} in\n{offloaded}");
        }
    }

    #[test]
    fn prefix_cache_counters_come_from_the_scheduler() {
        let mut status = EngineStatus::default();
        status.scheduler.kv_blocks_cached = 7;
        status.scheduler.prefix = ferry_core::kv::PrefixStats {
            queries: 3,
            queried_tokens: 300,
            hit_tokens: 128,
            evicted_blocks: 2,
            evicted_snapshots: 1,
        };
        let text = Metrics::new().render(Some(status));
        for line in [
            "ferry_kv_blocks_cached 7",
            "ferry_prefix_cache_queries_total 3",
            "ferry_prefix_cache_queried_tokens_total 300",
            "ferry_prefix_cache_hit_tokens_total 128",
            "ferry_prefix_cache_evicted_blocks_total 2",
            "ferry_prefix_cache_evicted_snapshots_total 1",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
    }
}
