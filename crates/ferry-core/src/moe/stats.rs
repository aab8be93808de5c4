//! The expert offload's counters, one type for every reader: `ferry bench` reports them, /metrics exports their
//! totals, the GPU tests check them. Whatever backend offloads experts fills it in.

use serde::Serialize;

use super::cache::LayerCounts;

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
    /// Of `copies`, those made ahead of a layer's router by a prefetch.
    pub prefetched: u64,
}

impl OffloadStats {
    pub fn hits(&self) -> u64 {
        self.layer_hits.iter().sum()
    }

    pub fn misses(&self) -> u64 {
        self.layer_misses.iter().sum()
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
