//! Prefill-aware admission over any eviction policy: keys that only a prefill (or a prefetch) has used wait on
//! probation and are evicted first, so one new prompt's prefill, which routes to nearly every expert of every layer
//! once, displaces at most about one layer's worth of the running requests' decode working set instead of all of
//! it. A decode step's use admits a key to the inner policy; a prefill's use of a key the inner policy already holds
//! changes nothing (the prompt's sweep says nothing about what decoding will reuse).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::policy::{Access, EvictionPolicy, ExpertKey};

/// `inner` for keys a decode step has used; keys only prefill has used are kept apart, least recently used first,
/// and are the first victims.
///
/// Cost per call: the inner policy's, plus O(log p) for the p keys on probation; a victim search skips the pinned
/// keys on probation (at most the current plan's) before asking `inner`.
pub struct PrefillAware<P> {
    inner: P,
    /// Keys on probation by their last use, and the reverse.
    probation: BTreeMap<u64, ExpertKey>,
    probation_since: HashMap<ExpertKey, u64>,
    /// Resident keys `inner` holds.
    admitted: HashSet<ExpertKey>,
}

impl<P: EvictionPolicy> PrefillAware<P> {
    pub fn new(inner: P) -> Self {
        PrefillAware {
            inner,
            probation: BTreeMap::new(),
            probation_since: HashMap::new(),
            admitted: HashSet::new(),
        }
    }

    fn leave_probation(&mut self, key: ExpertKey) -> bool {
        match self.probation_since.remove(&key) {
            Some(since) => {
                self.probation.remove(&since);
                true
            }
            None => false,
        }
    }
}

impl<P: EvictionPolicy> EvictionPolicy for PrefillAware<P> {
    fn on_access(&mut self, key: ExpertKey, now: u64, access: Access) {
        match access {
            Access::Decode => {
                self.leave_probation(key);
                self.admitted.insert(key);
                self.inner.on_access(key, now, access);
            }
            Access::Prefill if self.admitted.contains(&key) => {}
            Access::Prefill => {
                self.leave_probation(key);
                self.probation.insert(now, key);
                self.probation_since.insert(key, now);
            }
        }
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if !self.leave_probation(key) && self.admitted.remove(&key) {
            self.inner.on_evict(key);
        }
    }

    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.probation
            .values()
            .copied()
            .find(|&key| !pinned(key))
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
    fn keys_only_a_prefill_used_go_first() {
        let mut policy = PrefillAware::new(Lru::new());
        policy.on_access((0, 1), 0, Access::Decode);
        policy.on_access((0, 2), 1, Access::Prefill);
        policy.on_access((0, 3), 2, Access::Prefill);
        // LRU would evict (0, 1), the decode working set: the oldest prefill-only key goes instead.
        assert_eq!(policy.choose_victim(&nothing_pinned), Some((0, 2)));
        assert_eq!(policy.choose_victim(&|key| key == (0, 2)), Some((0, 3)));
        assert_eq!(policy.choose_victim(&|key| key.1 > 1), Some((0, 1)));
    }

    #[test]
    fn a_decode_use_admits_a_key_and_a_prefill_use_does_not_refresh_one() {
        let mut policy = PrefillAware::new(Lru::new());
        policy.on_access((0, 1), 0, Access::Decode);
        policy.on_access((0, 2), 1, Access::Decode);
        policy.on_access((0, 3), 2, Access::Prefill);
        policy.on_access((0, 3), 3, Access::Decode);
        // (0, 3) left probation; a prefill touching (0, 1) leaves it the least recently decoded.
        policy.on_access((0, 1), 4, Access::Prefill);
        assert_eq!(policy.choose_victim(&nothing_pinned), Some((0, 1)));
        policy.on_evict((0, 1));
        assert_eq!(policy.choose_victim(&nothing_pinned), Some((0, 2)));
    }

    #[test]
    fn an_evicted_probation_key_is_forgotten() {
        let mut policy = PrefillAware::new(Lru::new());
        policy.on_access((0, 1), 0, Access::Prefill);
        policy.on_evict((0, 1));
        assert_eq!(policy.choose_victim(&nothing_pinned), None);
        policy.on_access((0, 1), 1, Access::Prefill);
        assert_eq!(policy.choose_victim(&nothing_pinned), Some((0, 1)));
    }
}
