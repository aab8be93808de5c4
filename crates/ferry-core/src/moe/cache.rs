//! The expert cache's bookkeeping on the host: which (layer, expert) occupies which slot of the one pool all MoE
//! layers share, and what each step must copy in. The GPU side applies a [`Plan`] (copies into slots, slot table
//! updates); this file decides it, and is pure logic.

use std::collections::{HashMap, HashSet};

use super::policy::{EvictionPolicy, ExpertKey};
use crate::{Error, Result};

/// What one MoE layer of one step needs: its distinct routed experts, each with the slot it runs from.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// (expert, slot) of the experts already resident (hits), in first-routed order.
    pub resident: Vec<(u32, u32)>,
    /// (expert, slot) of the experts to copy in (misses), in first-routed order; each slot is free or was a
    /// victim's.
    pub fetch: Vec<(u32, u32)>,
    /// Keys that lost their slot to a fetch, in the order their slots were taken. They may belong to any layer
    /// except that none is an expert of this plan.
    pub evicted: Vec<ExpertKey>,
}

/// Hits and misses of one MoE layer, counted per distinct expert of each plan (or per `access`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerCounts {
    pub hits: u64,
    pub misses: u64,
}

impl LayerCounts {
    /// Hits over accesses; 0 before any access.
    pub fn hit_rate(&self) -> f64 {
        let accesses = self.hits + self.misses;
        if accesses == 0 {
            0.0
        } else {
            self.hits as f64 / accesses as f64
        }
    }
}

/// A pool of `num_slots` equal slots shared by every MoE layer, keyed by (layer, expert), with an eviction policy.
///
/// Its clock counts keys used: the n-th key it uses (from 0) is passed to the policy's `on_access` at time n,
/// which is the index [`super::Belady`] expects when built from the same sequence.
pub struct ExpertCache {
    num_slots: u32,
    policy: Box<dyn EvictionPolicy>,
    slot_of: HashMap<ExpertKey, u32>,
    /// Unused slots, taken from the end: filled in ascending order from an empty cache.
    free_slots: Vec<u32>,
    clock: u64,
    counts: Vec<LayerCounts>,
    /// The experts of the plan being made, deduplicated in first-seen order, and the same as a set (the keys a
    /// victim search must skip). Kept between calls so the hot path does not allocate them.
    distinct: Vec<u32>,
    in_plan: HashSet<u32>,
    /// The plan `access` fills, reused for the same reason.
    access_plan: Plan,
    /// The layer of the last step plan, whose experts (`in_plan`; `busy` while a prefetch is being placed) are still
    /// being read while a prefetch for the next layer is planned, so they must not be victims of it.
    last_layer: u32,
    busy: HashSet<u32>,
    /// Keys copied in by a prefetch and not yet used by a step: their first use counts as the miss it replaced.
    prefetched: HashSet<ExpertKey>,
}

/// Whether a placement is a step's own plan (counted as hits and misses) or a prefetch ahead of it (counted when
/// its step uses it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    Step,
    Prefetch,
}

impl ExpertCache {
    pub fn new(num_slots: u32, policy: Box<dyn EvictionPolicy>) -> Self {
        ExpertCache {
            num_slots,
            policy,
            slot_of: HashMap::new(),
            free_slots: (0..num_slots).rev().collect(),
            clock: 0,
            counts: Vec::new(),
            distinct: Vec::new(),
            in_plan: HashSet::new(),
            access_plan: Plan::default(),
            last_layer: 0,
            busy: HashSet::new(),
            prefetched: HashSet::new(),
        }
    }

    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// The slot `key` occupies, if it is resident.
    pub fn slot_of(&self, key: ExpertKey) -> Option<u32> {
        self.slot_of.get(&key).copied()
    }

    /// Hits and misses so far, indexed by MoE layer (layers never planned count zero).
    pub fn layer_counts(&self) -> &[LayerCounts] {
        &self.counts
    }

    /// Plans one MoE layer of one step. `routed`: the routed expert ids of every row of the batch (duplicates
    /// allowed). Hits keep their slot; misses take a free slot or a victim's, never one of this plan's experts.
    /// An error if the layer's distinct experts outnumber the slots, in which case nothing changes.
    pub fn plan(&mut self, layer: u32, routed: &[u32]) -> Result<Plan> {
        self.distinct.clear();
        self.in_plan.clear();
        for &expert in routed {
            if self.in_plan.insert(expert) {
                self.distinct.push(expert);
            }
        }
        let mut plan = Plan::default();
        self.place_distinct(layer, &mut plan, Placement::Step)?;
        Ok(plan)
    }

    /// Plans copying `experts` of `layer` in before its step routes (a prefetch: the caller expects that step to
    /// use them), while the experts of the last step plan are still in use: victims come from neither. An error,
    /// changing nothing, if the two together outnumber the slots. Prefetched keys are not counted now; the step
    /// that first uses one counts a miss, as it would have without the prefetch.
    pub fn plan_prefetch(&mut self, layer: u32, experts: &[u32]) -> Result<Plan> {
        self.busy = std::mem::take(&mut self.in_plan);
        self.distinct.clear();
        for &expert in experts {
            if self.in_plan.insert(expert) {
                self.distinct.push(expert);
            }
        }
        let busy_outside = if layer == self.last_layer {
            self.busy.iter().filter(|expert| !self.in_plan.contains(expert)).count()
        } else {
            self.busy.len()
        };
        let mut plan = Plan::default();
        let placed = if self.distinct.len() + busy_outside > self.num_slots as usize {
            Err(Error::Cache(format!(
                "prefetching {} experts of MoE layer {layer} while {busy_outside} of layer {} are in use needs \
                 more than the cache's {} slots",
                self.distinct.len(),
                self.last_layer,
                self.num_slots
            )))
        } else {
            self.place_distinct(layer, &mut plan, Placement::Prefetch)
        };
        // The last step's experts stay in use until the next step plan: a further prefetch must spare them too.
        self.in_plan = std::mem::take(&mut self.busy);
        placed.map(|()| plan)
    }

    /// Uses one key, as a plan of that key alone would: true on a hit. The simulator replays traces with it.
    pub fn access(&mut self, key: ExpertKey) -> Result<bool> {
        self.distinct.clear();
        self.distinct.push(key.1);
        self.in_plan.clear();
        self.in_plan.insert(key.1);
        let mut plan = std::mem::take(&mut self.access_plan);
        plan.resident.clear();
        plan.fetch.clear();
        plan.evicted.clear();
        let placed = self.place_distinct(key.0, &mut plan, Placement::Step);
        let hit = !plan.resident.is_empty();
        self.access_plan = plan;
        placed.map(|()| hit)
    }

    /// Places `self.distinct` (the plan's experts, deduplicated) into slots, filling `plan`. Victims are never
    /// keys of this plan nor (during a prefetch) `busy` keys of the last step's layer.
    fn place_distinct(&mut self, layer: u32, plan: &mut Plan, placement: Placement) -> Result<()> {
        if self.distinct.len() > self.num_slots as usize {
            return Err(Error::Cache(format!(
                "MoE layer {layer} routes {} distinct experts in one step, more than the cache's {} slots",
                self.distinct.len(),
                self.num_slots
            )));
        }
        if self.counts.len() <= layer as usize {
            self.counts.resize(layer as usize + 1, LayerCounts::default());
        }
        for &expert in &self.distinct {
            let key = (layer, expert);
            if let Some(&slot) = self.slot_of.get(&key) {
                plan.resident.push((expert, slot));
                if placement == Placement::Step {
                    let counts = &mut self.counts[layer as usize];
                    if self.prefetched.remove(&key) {
                        counts.misses += 1;
                    } else {
                        counts.hits += 1;
                    }
                }
            } else {
                let slot = match self.free_slots.pop() {
                    Some(slot) => slot,
                    None => {
                        // With no more distinct experts than slots, some resident key lies outside this plan;
                        // a policy that finds none, or offers a pinned or absent key, breaks its contract.
                        let (in_plan, busy, busy_layer) = (&self.in_plan, &self.busy, self.last_layer);
                        let pinned = |key: ExpertKey| {
                            (key.0 == layer && in_plan.contains(&key.1))
                                || (key.0 == busy_layer && busy.contains(&key.1))
                        };
                        let victim = self.policy.choose_victim(&pinned).filter(|&victim| !pinned(victim));
                        let Some((victim, slot)) = victim.and_then(|v| self.slot_of.remove(&v).map(|s| (v, s))) else {
                            return Err(Error::Cache(format!(
                                "the eviction policy offered no resident victim outside MoE layer {layer}'s plan \
                                 although all {} slots are full",
                                self.num_slots
                            )));
                        };
                        self.policy.on_evict(victim);
                        self.prefetched.remove(&victim);
                        plan.evicted.push(victim);
                        slot
                    }
                };
                self.slot_of.insert(key, slot);
                plan.fetch.push((expert, slot));
                match placement {
                    Placement::Step => self.counts[layer as usize].misses += 1,
                    Placement::Prefetch => {
                        self.prefetched.insert(key);
                    }
                }
            }
            self.policy.on_access(key, self.clock);
            self.clock += 1;
        }
        if placement == Placement::Step {
            self.last_layer = layer;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;
    use crate::moe::policy::{Belady, Lru};

    fn lru_cache(num_slots: u32) -> ExpertCache {
        ExpertCache::new(num_slots, Box::new(Lru::new()))
    }

    fn hits(cache: &mut ExpertCache, sequence: &[ExpertKey]) -> u64 {
        sequence.iter().filter(|&&key| cache.access(key).unwrap()).count() as u64
    }

    fn belady_hits(num_slots: u32, sequence: &[ExpertKey]) -> u64 {
        hits(
            &mut ExpertCache::new(num_slots, Box::new(Belady::new(sequence.iter().copied()))),
            sequence,
        )
    }

    #[test]
    fn a_plan_deduplicates_in_first_seen_order_and_fills_free_slots_in_order() {
        let mut cache = lru_cache(4);
        let plan = cache.plan(0, &[3, 1, 3, 2, 1]).unwrap();
        assert_eq!(
            plan,
            Plan {
                resident: vec![],
                fetch: vec![(3, 0), (1, 1), (2, 2)],
                evicted: vec![],
            }
        );
        let plan = cache.plan(0, &[2, 5, 3]).unwrap();
        assert_eq!(plan.resident, vec![(2, 2), (3, 0)]);
        assert_eq!(plan.fetch, vec![(5, 3)]);
        assert!(plan.evicted.is_empty());
        assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 2, misses: 4 }]);
    }

    #[test]
    fn a_plan_never_evicts_its_own_experts_and_reuses_victims_slots() {
        let mut cache = lru_cache(3);
        cache.plan(0, &[0, 1, 2]).unwrap();
        // LRU order is 0, 1, 2; expert 0 is a hit of this plan, so the oldest keys outside it go: 1, then 2.
        let plan = cache.plan(0, &[0, 7, 8]).unwrap();
        assert_eq!(plan.resident, vec![(0, 0)]);
        assert_eq!(plan.fetch, vec![(7, 1), (8, 2)]);
        assert_eq!(plan.evicted, vec![(0, 1), (0, 2)]);
        assert_eq!(cache.slot_of((0, 1)), None);
        assert_eq!(cache.slot_of((0, 7)), Some(1));
    }

    #[test]
    fn layers_share_the_pool_and_keep_separate_keys_and_counts() {
        let mut cache = lru_cache(2);
        cache.plan(0, &[4]).unwrap();
        let plan = cache.plan(2, &[4]).unwrap();
        assert_eq!(plan.fetch, vec![(4, 1)]);
        // The pool is full: layer 1's expert 4 takes the slot of the least recently used key, layer 0's.
        let plan = cache.plan(1, &[4]).unwrap();
        assert_eq!(plan.fetch, vec![(4, 0)]);
        assert_eq!(plan.evicted, vec![(0, 4)]);
        assert!(cache.plan(2, &[4]).unwrap().fetch.is_empty());
        assert_eq!(
            cache.layer_counts(),
            &[
                LayerCounts { hits: 0, misses: 1 },
                LayerCounts { hits: 0, misses: 1 },
                LayerCounts { hits: 1, misses: 1 },
            ]
        );
    }

    #[test]
    fn too_many_distinct_experts_is_an_error_that_changes_nothing() {
        let mut cache = lru_cache(2);
        cache.plan(0, &[1]).unwrap();
        let error = cache.plan(0, &[1, 2, 3, 2]).unwrap_err().to_string();
        assert!(error.contains("3 distinct experts"), "{error}");
        assert!(error.contains("2 slots"), "{error}");
        assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 0, misses: 1 }]);
        // Duplicates do not count against the slots.
        assert_eq!(cache.plan(0, &[2, 1, 2, 1]).unwrap().fetch, vec![(2, 1)]);
        assert!(ExpertCache::new(0, Box::new(Lru::new())).access((0, 0)).is_err());
    }

    #[test]
    fn a_prefetch_spares_the_last_steps_experts_and_its_keys_count_as_misses_when_used() {
        let mut cache = lru_cache(4);
        cache.plan(0, &[0, 1]).unwrap();
        cache.plan(1, &[0, 1]).unwrap();
        // Layer 1's experts are in use; LRU order is (0,0), (0,1), (1,0), (1,1): layer 0's keys are the victims.
        let prefetch = cache.plan_prefetch(2, &[5, 6]).unwrap();
        assert_eq!(prefetch.fetch, vec![(5, 0), (6, 1)]);
        assert_eq!(prefetch.evicted, vec![(0, 0), (0, 1)]);
        // A second prefetch still spares layer 1 and takes the oldest other keys: the first prefetch's.
        let prefetch = cache.plan_prefetch(3, &[7]).unwrap();
        assert_eq!(prefetch.evicted, vec![(2, 5)]);
        // Not counted when prefetched; counted as a miss when the step uses it, then as a hit.
        assert_eq!(cache.layer_counts()[2], LayerCounts::default());
        let step = cache.plan(2, &[6, 9]).unwrap();
        assert_eq!(step.resident, vec![(6, 1)]);
        assert_eq!(cache.layer_counts()[2], LayerCounts { hits: 0, misses: 2 });
        cache.plan(2, &[6]).unwrap();
        assert_eq!(cache.layer_counts()[2], LayerCounts { hits: 1, misses: 2 });
    }

    #[test]
    fn a_prefetch_that_does_not_fit_beside_the_busy_experts_is_an_error_that_changes_nothing() {
        let mut cache = lru_cache(4);
        cache.plan(0, &[0, 1, 2]).unwrap();
        let error = cache.plan_prefetch(1, &[0, 1]).unwrap_err().to_string();
        assert!(error.contains("3 of layer 0 are in use"), "{error}");
        assert_eq!(cache.slot_of((1, 0)), None);
        // Prefetching the busy layer's own experts needs only the slots outside them.
        assert_eq!(cache.plan_prefetch(0, &[1, 2, 3]).unwrap().fetch, vec![(3, 3)]);
        assert_eq!(cache.plan(0, &[0]).unwrap().resident, vec![(0, 0)]);
    }

    /// A policy that breaks its contract: it never offers a victim.
    struct NoVictim;

    impl EvictionPolicy for NoVictim {
        fn on_access(&mut self, _: ExpertKey, _: u64) {}
        fn on_evict(&mut self, _: ExpertKey) {}
        fn choose_victim(&mut self, _: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
            None
        }
    }

    #[test]
    fn a_policy_without_a_victim_is_an_error_not_a_panic() {
        let mut cache = ExpertCache::new(1, Box::new(NoVictim));
        assert!(!cache.access((0, 1)).unwrap());
        let error = cache.access((0, 2)).unwrap_err().to_string();
        assert!(error.contains("no resident victim"), "{error}");
    }

    #[test]
    fn access_matches_a_plan_of_one_key() {
        let mut cache = lru_cache(2);
        assert!(!cache.access((0, 1)).unwrap());
        assert!(!cache.access((1, 1)).unwrap());
        assert!(cache.access((0, 1)).unwrap());
        assert!(!cache.access((0, 2)).unwrap());
        // (1, 1) was the least recently used and left for (0, 2).
        assert_eq!(cache.slot_of((1, 1)), None);
        assert_eq!(cache.plan(0, &[2]).unwrap().resident, vec![(2, 1)]);
    }

    /// Hits of a cache that tracks recency with a plain list: LRU by definition.
    fn reference_lru_hits(num_slots: usize, sequence: &[ExpertKey]) -> u64 {
        let mut by_recency: Vec<ExpertKey> = Vec::new();
        let mut hits = 0;
        for &key in sequence {
            if let Some(position) = by_recency.iter().position(|&k| k == key) {
                by_recency.remove(position);
                hits += 1;
            } else if by_recency.len() == num_slots {
                by_recency.remove(0);
            }
            by_recency.push(key);
        }
        hits
    }

    /// The most hits any eviction choices give, by trying them all.
    fn optimal_hits(num_slots: usize, resident: &mut Vec<ExpertKey>, sequence: &[ExpertKey]) -> u64 {
        let Some((&key, rest)) = sequence.split_first() else {
            return 0;
        };
        if resident.contains(&key) {
            return 1 + optimal_hits(num_slots, resident, rest);
        }
        if resident.len() < num_slots {
            resident.push(key);
            let best = optimal_hits(num_slots, resident, rest);
            resident.pop();
            return best;
        }
        (0..resident.len())
            .map(|victim| {
                let evicted = std::mem::replace(&mut resident[victim], key);
                let best = optimal_hits(num_slots, resident, rest);
                resident[victim] = evicted;
                best
            })
            .max()
            .unwrap()
    }

    fn random_sequence(rng: &mut StdRng, length: usize, layers: u32, experts: u32) -> Vec<ExpertKey> {
        (0..length)
            .map(|_| (rng.random_range(0..layers), rng.random_range(0..experts)))
            .collect()
    }

    #[test]
    fn lru_agrees_with_a_reference_lru_on_random_sequences() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..200 {
            let num_slots = rng.random_range(1..8);
            let sequence = random_sequence(&mut rng, 300, 3, 5);
            assert_eq!(
                hits(&mut lru_cache(num_slots as u32), &sequence),
                reference_lru_hits(num_slots, &sequence),
                "{num_slots} slots, {sequence:?}"
            );
        }
    }

    #[test]
    fn belady_is_optimal_on_every_small_random_sequence() {
        let mut rng = StdRng::seed_from_u64(2);
        for _ in 0..300 {
            let num_slots = rng.random_range(1..4);
            let sequence = random_sequence(&mut rng, 11, 2, 3);
            assert_eq!(
                belady_hits(num_slots as u32, &sequence),
                optimal_hits(num_slots, &mut Vec::new(), &sequence),
                "{num_slots} slots, {sequence:?}"
            );
        }
    }

    #[test]
    fn belady_hits_at_least_as_often_as_lru_on_random_sequences() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut strictly_better = 0;
        for _ in 0..200 {
            let num_slots = rng.random_range(1..24);
            let sequence = random_sequence(&mut rng, 2000, 4, 16);
            let lru = hits(&mut lru_cache(num_slots), &sequence);
            let belady = belady_hits(num_slots, &sequence);
            assert!(belady >= lru, "{num_slots} slots: Belady {belady} < LRU {lru}");
            strictly_better += usize::from(belady > lru);
        }
        // Random traces leave LRU room to lose; a Belady that merely equalled it would be suspect.
        assert!(
            strictly_better > 150,
            "Belady beat LRU on only {strictly_better} of 200 traces"
        );
    }

    #[test]
    fn belady_with_plans_uses_each_plans_distinct_keys_as_its_sequence() {
        // Steps of one layer; the clock advances once per distinct expert of a plan.
        let steps: [&[u32]; 4] = [&[0, 1, 0], &[2, 2], &[0, 3], &[1, 2]];
        let sequence: Vec<ExpertKey> = [[0, 1].as_slice(), &[2], &[0, 3], &[1, 2]]
            .iter()
            .flat_map(|experts| experts.iter().map(|&e| (0, e)))
            .collect();
        let mut cache = ExpertCache::new(3, Box::new(Belady::new(sequence)));
        let plans: Vec<Plan> = steps.iter().map(|routed| cache.plan(0, routed).unwrap()).collect();
        // Step 3 needs a slot for expert 3 with {0, 1, 2} resident and 0 pinned: 1 is next used at time 5,
        // 2 at time 6, so 2 goes. Step 4: 1 hits, 2 misses and takes the slot of 3 (never used again; 0 is too,
        // and the larger key goes first).
        assert_eq!(plans[2].fetch, vec![(3, 2)]);
        assert_eq!(plans[2].evicted, vec![(0, 2)]);
        assert_eq!(plans[3].resident, vec![(1, 1)]);
        assert_eq!(plans[3].fetch, vec![(2, 2)]);
        assert_eq!(plans[3].evicted, vec![(0, 3)]);
    }
}
