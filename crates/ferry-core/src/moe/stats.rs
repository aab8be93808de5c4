//! The expert offload's counters, one type for every reader: `ferry bench` reports them, /metrics exports their
//! totals, the GPU tests check them. Whatever backend offloads experts fills it in.

use serde::Serialize;

use super::cache::LayerCounts;
use super::lane_calibration::CalibratedRates;

/// What an expert offload holds and has done so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OffloadStats {
    pub slots: usize,
    pub bytes_per_expert: usize,
    pub bank_bytes: usize,
    pub bank_pinned: bool,
    /// Per MoE layer: hits and misses, counted per distinct expert of each step.
    pub layer_hits: Vec<u64>,
    pub layer_misses: Vec<u64>,
    pub bytes_copied: u64,
    pub copies: u64,
    /// Of `copies`, those made ahead of a layer's router by a prefetch (prefill's next-layer copies and decode's
    /// guessed copies).
    pub prefetched: u64,
    /// Prefetched copies a step then used (each counted as the miss it replaced).
    pub prefetches_used: u64,
    /// (row, k) pairs routed over all planned layers: against hits + misses (distinct experts per layer and step),
    /// how much a batch shares experts, each copied once per step.
    pub routed_pairs: u64,
    /// Decode guesses of the next layer's routing: distinct experts guessed, how many of them that layer then
    /// routed, and the distinct experts those layers routed (precision = guessed_routed / guessed, recall =
    /// guessed_routed / routed_after_guess).
    pub guessed: u64,
    pub guessed_routed: u64,
    pub routed_after_guess: u64,
    /// Guessed misses copied while the copy stream was idle, and those dropped because their layer routed first.
    pub guesses_copied: u64,
    pub guesses_dropped: u64,
    /// The host's waits for a layer's routed ids (one per MoE layer and step), and their total time: the serial
    /// point that copies and compute cannot overlap.
    pub router_waits: u64,
    pub router_wait_ns: u64,
    /// The CPU lane: the misses it computed instead of copying (distinct experts per layer and step), their (row,
    /// expert) pairs, the expert bytes it read and its busy time.
    pub host_experts: u64,
    pub host_pairs: u64,
    pub host_bytes: u64,
    pub host_ns: u64,
    /// What the CPU lane's jobs cost the pipeline, from each job's start until the stream was let go past its wait
    /// (or the job was done, when the stream did not wait): against `host_ns`, what handing the jobs over and their
    /// products back costs beyond their compute.
    pub host_pipeline_ns: u64,
    /// Under `--moe-strategy auto`, the planner's calibrated rates when read.
    pub calibrated: Option<CalibratedRates>,
    /// The link's time over each layer's demand copies (from the first queued to the last landed; a guessed copy
    /// still in flight when they were queued counts in it).
    pub link_ns: u64,
}

impl OffloadStats {
    pub fn hits(&self) -> u64 {
        self.layer_hits.iter().sum()
    }

    pub fn misses(&self) -> u64 {
        self.layer_misses.iter().sum()
    }

    /// Of the experts decode guessed for a layer, the share it routed; 0 before any guess.
    pub fn guess_precision(&self) -> f64 {
        ratio(self.guessed_routed, self.guessed)
    }

    /// Of the experts routed by layers that had a guess, the share guessed; 0 before any guess.
    pub fn guess_recall(&self) -> f64 {
        ratio(self.guessed_routed, self.routed_after_guess)
    }

    /// The CPU lane's achieved rate over the expert bytes it read, GB/s; 0 before it ran.
    pub fn host_gb_s(&self) -> f64 {
        ratio(self.host_bytes, self.host_ns)
    }

    /// The link's achieved rate over the demand copies (prefetches are not timed), GB/s; 0 before any.
    pub fn link_gb_s(&self) -> f64 {
        let demand = self.copies.saturating_sub(self.prefetched) * self.bytes_per_expert as u64;
        ratio(demand, self.link_ns)
    }

    /// Hits over accesses; 0 before any access.
    pub fn hit_rate(&self) -> f64 {
        LayerCounts {
            hits: self.hits(),
            misses: self.misses(),
        }
        .hit_rate()
    }
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}
