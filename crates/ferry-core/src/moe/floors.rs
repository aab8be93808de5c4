//! Per-layer floors over any eviction policy: a layer holding no more than its floor of slots gives none up while a
//! key of another layer can be evicted instead. One pool shared by all layers lets a layer whose routing churns
//! (or the sweep of a prefill through every layer) push a quieter layer out entirely; the floor keeps each layer a
//! minimum working set (e.g. one token's top-k).

use std::collections::HashSet;

use super::policy::{Access, EvictionPolicy, ExpertKey};

/// `inner`'s choices, except that keys of layers at or below `floor` resident keys are passed over while another
/// victim exists. The cache chooses all of a plan's victims before evicting any, so within one plan the floor is
/// checked against the counts before that plan.
///
/// Cost per call: the inner policy's, plus O(1) for use and eviction; a victim search also skips the keys of layers
/// at their floor (at most layers x floor) before it falls back to `inner`'s unconstrained choice.
pub struct LayerFloors<P> {
    inner: P,
    floor: u32,
    resident: HashSet<ExpertKey>,
    /// Resident keys per MoE layer.
    per_layer: Vec<u32>,
}

impl<P: EvictionPolicy> LayerFloors<P> {
    pub fn new(inner: P, floor: u32) -> Self {
        LayerFloors {
            inner,
            floor,
            resident: HashSet::new(),
            per_layer: Vec::new(),
        }
    }

    fn at_floor(&self, layer: u32) -> bool {
        self.per_layer.get(layer as usize).is_none_or(|&n| n <= self.floor)
    }
}

impl<P: EvictionPolicy> EvictionPolicy for LayerFloors<P> {
    fn on_access(&mut self, key: ExpertKey, now: u64, access: Access) {
        if self.resident.insert(key) {
            let layer = key.0 as usize;
            if self.per_layer.len() <= layer {
                self.per_layer.resize(layer + 1, 0);
            }
            self.per_layer[layer] += 1;
        }
        self.inner.on_access(key, now, access);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if self.resident.remove(&key) {
            self.per_layer[key.0 as usize] -= 1;
        }
        self.inner.on_evict(key);
    }

    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.inner
            .choose_victim(&|key| pinned(key) || self.at_floor(key.0))
            .or_else(|| self.inner.choose_victim(pinned))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::Lru;

    fn nothing_pinned(_: ExpertKey) -> bool {
        false
    }

    #[test]
    fn a_layer_at_its_floor_keeps_its_keys_while_others_can_give() {
        let mut floors = LayerFloors::new(Lru::new(), 1);
        floors.on_access((0, 1), 0, Access::Decode);
        floors.on_access((1, 1), 1, Access::Decode);
        floors.on_access((1, 2), 2, Access::Decode);
        // LRU would evict (0, 1), layer 0's only key: layer 1's oldest goes instead.
        assert_eq!(floors.choose_victim(&nothing_pinned), Some((1, 1)));
        floors.on_access((0, 2), 3, Access::Decode);
        // Layer 0 now holds two keys, above its floor: plain LRU order again.
        assert_eq!(floors.choose_victim(&nothing_pinned), Some((0, 1)));
    }

    #[test]
    fn with_every_other_key_pinned_the_floor_gives_way() {
        let mut floors = LayerFloors::new(Lru::new(), 1);
        floors.on_access((0, 1), 0, Access::Decode);
        floors.on_access((1, 1), 1, Access::Decode);
        floors.on_access((1, 2), 2, Access::Decode);
        assert_eq!(floors.choose_victim(&|key| key.0 == 1), Some((0, 1)));
        floors.on_evict((1, 1));
        // Both layers at their floor: LRU's choice.
        assert_eq!(floors.choose_victim(&nothing_pinned), Some((0, 1)));
    }
}
