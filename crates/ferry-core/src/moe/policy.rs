//! Eviction policies for the expert cache: which resident expert gives up its slot when a miss needs one.
//!
//! A policy only orders keys; the slots themselves belong to [`super::ExpertCache`], which tells the policy about
//! every use and every eviction. Policies run on the decode hot path (every MoE layer of every step), so each call
//! costs O(log resident) plus the pinned keys a victim search skips, never a scan of all slots.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// An expert of one MoE layer: (MoE-layer index, expert id). The cache is shared by all layers, so the same expert
/// id in two layers is two keys.
pub type ExpertKey = (u32, u32);

/// What a use of a key serves: a running sequence's decode step, or only a prompt's prefill (or a prefetch ahead of
/// the step that will use it). A prefill routes to nearly every expert of every layer once, so a policy may keep such
/// keys from displacing the decode working set ([`super::PrefillAware`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Decode,
    Prefill,
}

/// Decides which resident key to evict. The cache calls `on_access` for every key it uses (hits and freshly loaded
/// keys alike) and `on_evict` for every key it drops, so a policy's resident set is exactly the cache's.
pub trait EvictionPolicy: Send {
    /// `key` was used (a hit, or just loaded) at logical time `now` (strictly increasing across calls), by `access`.
    fn on_access(&mut self, key: ExpertKey, now: u64, access: Access);
    /// `key` left the cache.
    fn on_evict(&mut self, key: ExpertKey);
    /// The resident key to evict next, never one in `pinned`; None if every resident key is pinned. Changes
    /// nothing: a plan chooses all its victims before any is evicted (pinning those chosen), and may be given up.
    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey>;
}

/// Least recently used: evicts the resident key whose last use is oldest.
///
/// Keys are ordered by last use in a B-tree, so every call is O(log n); a victim search walks from the oldest and
/// skips only pinned keys, which were used in the current plan and therefore sit at the newest end.
#[derive(Debug, Default)]
pub struct Lru {
    last_use: HashMap<ExpertKey, u64>,
    by_last_use: BTreeMap<u64, ExpertKey>,
}

impl Lru {
    pub fn new() -> Self {
        Self::default()
    }
}

impl EvictionPolicy for Lru {
    fn on_access(&mut self, key: ExpertKey, now: u64, _: Access) {
        if let Some(previous) = self.last_use.insert(key, now) {
            self.by_last_use.remove(&previous);
        }
        self.by_last_use.insert(now, key);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if let Some(previous) = self.last_use.remove(&key) {
            self.by_last_use.remove(&previous);
        }
    }

    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.by_last_use.values().copied().find(|&key| !pinned(key))
    }
}

/// Next-use time of a key that is never used again.
const NEVER: u64 = u64::MAX;

/// Belady's optimal policy for a future known in advance: evicts the resident key whose next use is furthest away,
/// or one never used again. No policy hits more often on the same sequence, which makes it the yardstick for
/// every online policy's regret (`ferry cache-sim`).
///
/// Built from the whole access sequence; the `now` of each `on_access` must be that access's index in the
/// sequence, which is what [`super::ExpertCache`]'s clock gives when it is fed the same sequence (one
/// `access` per key, or each plan's distinct keys in first-seen order). Among keys never used again, the largest
/// key is evicted first; any choice among them gives the same hits.
#[derive(Debug)]
pub struct Belady {
    /// For each key, the indices at which the sequence uses it, ascending.
    uses: HashMap<ExpertKey, Vec<u64>>,
    next_use: HashMap<ExpertKey, u64>,
    by_next_use: BTreeSet<(u64, ExpertKey)>,
}

impl Belady {
    /// `accesses`: every key the cache will be asked for, in order.
    pub fn new(accesses: impl IntoIterator<Item = ExpertKey>) -> Self {
        let mut uses: HashMap<ExpertKey, Vec<u64>> = HashMap::new();
        for (index, key) in accesses.into_iter().enumerate() {
            uses.entry(key).or_default().push(index as u64);
        }
        Belady {
            uses,
            next_use: HashMap::new(),
            by_next_use: BTreeSet::new(),
        }
    }

    /// The first use of `key` after time `now`.
    fn next_use_after(&self, key: ExpertKey, now: u64) -> u64 {
        let Some(uses) = self.uses.get(&key) else {
            return NEVER;
        };
        uses.get(uses.partition_point(|&index| index <= now))
            .copied()
            .unwrap_or(NEVER)
    }
}

impl EvictionPolicy for Belady {
    fn on_access(&mut self, key: ExpertKey, now: u64, _: Access) {
        let next = self.next_use_after(key, now);
        if let Some(previous) = self.next_use.insert(key, next) {
            self.by_next_use.remove(&(previous, key));
        }
        self.by_next_use.insert((next, key));
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if let Some(previous) = self.next_use.remove(&key) {
            self.by_next_use.remove(&(previous, key));
        }
    }

    fn choose_victim(&self, pinned: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.by_next_use
            .iter()
            .rev()
            .map(|&(_, key)| key)
            .find(|&key| !pinned(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nothing_pinned(_: ExpertKey) -> bool {
        false
    }

    #[test]
    fn lru_evicts_the_least_recently_used_key() {
        let mut lru = Lru::new();
        lru.on_access((0, 1), 0, Access::Decode);
        lru.on_access((0, 2), 1, Access::Decode);
        lru.on_access((1, 1), 2, Access::Decode);
        assert_eq!(lru.choose_victim(&nothing_pinned), Some((0, 1)));
        // A hit refreshes a key: (0, 1) is now the newest.
        lru.on_access((0, 1), 3, Access::Decode);
        assert_eq!(lru.choose_victim(&nothing_pinned), Some((0, 2)));
        lru.on_evict((0, 2));
        assert_eq!(lru.choose_victim(&nothing_pinned), Some((1, 1)));
    }

    #[test]
    fn lru_skips_pinned_keys_and_gives_none_when_all_are_pinned() {
        let mut lru = Lru::new();
        lru.on_access((0, 1), 0, Access::Decode);
        lru.on_access((0, 2), 1, Access::Decode);
        assert_eq!(lru.choose_victim(&|key| key == (0, 1)), Some((0, 2)));
        assert_eq!(lru.choose_victim(&|key| key.0 == 0), None);
        assert_eq!(Lru::new().choose_victim(&nothing_pinned), None);
    }

    #[test]
    fn belady_evicts_the_key_used_furthest_in_the_future() {
        // Times:      0       1       2       3       4       5
        let sequence = [(0, 1), (0, 2), (0, 3), (0, 2), (0, 1), (0, 3)];
        let mut belady = Belady::new(sequence);
        for (now, &key) in sequence[..3].iter().enumerate() {
            belady.on_access(key, now as u64, Access::Decode);
        }
        // Next uses: (0, 1) at 4, (0, 2) at 3, (0, 3) at 5.
        assert_eq!(belady.choose_victim(&nothing_pinned), Some((0, 3)));
        assert_eq!(belady.choose_victim(&|key| key == (0, 3)), Some((0, 1)));
        belady.on_access((0, 2), 3, Access::Decode);
        // (0, 2) is never used again after time 3.
        assert_eq!(belady.choose_victim(&nothing_pinned), Some((0, 2)));
        belady.on_evict((0, 2));
        assert_eq!(belady.choose_victim(&nothing_pinned), Some((0, 3)));
    }

    #[test]
    fn belady_breaks_ties_among_keys_never_used_again_by_the_largest_key() {
        let mut belady = Belady::new([(0, 5), (1, 0), (0, 7)]);
        belady.on_access((0, 5), 0, Access::Decode);
        belady.on_access((1, 0), 1, Access::Decode);
        belady.on_access((0, 7), 2, Access::Decode);
        assert_eq!(belady.choose_victim(&nothing_pinned), Some((1, 0)));
        assert_eq!(belady.choose_victim(&|key| key.0 == 1), Some((0, 7)));
    }

    #[test]
    fn belady_treats_a_key_outside_its_sequence_as_never_used_again() {
        let mut belady = Belady::new([(0, 1), (0, 1)]);
        belady.on_access((0, 1), 0, Access::Decode);
        belady.on_access((3, 3), 1, Access::Decode);
        assert_eq!(belady.choose_victim(&nothing_pinned), Some((3, 3)));
    }
}
