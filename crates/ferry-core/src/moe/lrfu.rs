//! LRFU (Lee et al., "LRFU: a spectrum of policies that subsumes the least recently used and least frequently used
//! policies", IEEE ToC 2001): each key's combined recency and frequency, CRF = sum over its past uses of
//! 2^(-lambda * age), and the key with the least CRF is evicted. lambda sets the half-life of a use: large, it is
//! LRU; near zero, LFU. Expert caches use it because experts differ in popularity over long stretches as well as
//! in recent use (llama.cpp's MoE cache classes experts by CRF with a half-life of 128 tokens; vLLM's expert offload
//! PR 37190 uses a frequency-weighted LRU).
//!
//! A key's CRF is kept across its evictions (at most one value per expert of the model), so a popular expert that
//! was pushed out comes back with its history.

use std::collections::{BTreeSet, HashMap};

use super::policy::{Access, EvictionPolicy, ExpertKey};

/// Evicts the resident key with the least CRF. Every call costs O(log n) plus, for a victim search, the pinned
/// keys it skips (at most the current plan's).
///
/// CRFs are compared in the log domain at a common time: log2(CRF at the last use) + lambda * (time of that use)
/// orders keys as their CRFs at any later time do (all decay by the same factor), so a key's place changes only
/// when it is used.
#[derive(Debug)]
pub struct Lrfu {
    lambda: f64,
    /// Every key ever used: its score (log2 CRF + lambda * last use), resident or not.
    score: HashMap<ExpertKey, f64>,
    /// Resident keys by score; f64 bits order as the (non-negative) scores do.
    resident: BTreeSet<(u64, ExpertKey)>,
}

impl Lrfu {
    /// A use's weight halves every `half_life` accesses (the cache's clock counts keys used).
    pub fn new(half_life: f64) -> Self {
        Lrfu {
            lambda: 1.0 / half_life.max(f64::MIN_POSITIVE),
            score: HashMap::new(),
            resident: BTreeSet::new(),
        }
    }
}

impl EvictionPolicy for Lrfu {
    fn on_access(&mut self, key: ExpertKey, now: u64, _: Access) {
        let base = self.lambda * now as f64;
        let score = match self.score.get(&key) {
            // CRF now = 1 + CRF then * 2^(-lambda * age), and score - base = log2 of CRF then decayed to now.
            Some(&previous) => {
                self.resident.remove(&(previous.to_bits(), key));
                base + (1.0 + (previous - base).exp2()).log2()
            }
            None => base,
        };
        self.score.insert(key, score);
        self.resident.insert((score.to_bits(), key));
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if let Some(&score) = self.score.get(&key) {
            self.resident.remove(&(score.to_bits(), key));
        }
    }

    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.resident.iter().map(|&(_, key)| key).find(|&key| !pinned(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nothing_pinned(_: ExpertKey) -> bool {
        false
    }

    #[test]
    fn a_frequent_key_outlives_a_more_recent_one() {
        let mut lrfu = Lrfu::new(100.0);
        for now in 0..4 {
            lrfu.on_access((0, 1), now, Access::Decode);
        }
        lrfu.on_access((0, 2), 4, Access::Decode);
        // (0, 1): CRF ~4 (four uses within a few accesses of a 100-access half-life); (0, 2): 1. LRU would evict
        // (0, 1).
        assert_eq!(lrfu.choose_victim(&nothing_pinned), Some((0, 2)));
        assert_eq!(lrfu.choose_victim(&|key| key == (0, 2)), Some((0, 1)));
    }

    #[test]
    fn with_a_short_half_life_it_is_lru() {
        let mut lrfu = Lrfu::new(0.5);
        for now in 0..4 {
            lrfu.on_access((0, 1), now, Access::Decode);
        }
        lrfu.on_access((0, 2), 4, Access::Decode);
        lrfu.on_access((0, 3), 5, Access::Decode);
        // Uses older than a few half-lives count for nothing: the oldest last use goes first.
        assert_eq!(lrfu.choose_victim(&nothing_pinned), Some((0, 1)));
        lrfu.on_access((0, 1), 6, Access::Decode);
        assert_eq!(lrfu.choose_victim(&nothing_pinned), Some((0, 2)));
    }

    #[test]
    fn history_survives_an_eviction() {
        let mut lrfu = Lrfu::new(1000.0);
        for now in 0..3 {
            lrfu.on_access((0, 1), now, Access::Decode);
        }
        lrfu.on_evict((0, 1));
        assert_eq!(lrfu.choose_victim(&nothing_pinned), None);
        lrfu.on_access((0, 2), 3, Access::Decode);
        lrfu.on_access((0, 2), 4, Access::Decode);
        // Back after its eviction, (0, 1) counts four uses against (0, 2)'s two.
        lrfu.on_access((0, 1), 5, Access::Decode);
        assert_eq!(lrfu.choose_victim(&nothing_pinned), Some((0, 2)));
    }
}
