//! The expert cache against hand-worked plans, its transactions, and its policies against references: LRU
//! against a plain recency list, Belady against an exhaustive search of eviction choices.

use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;
use crate::moe::policy::{Access, Belady, Lru};
use crate::moe::PrefillAware;

fn lru_cache(num_slots: u32) -> ExpertCache {
    ExpertCache::new(num_slots, Box::new(Lru::new()))
}

/// A step's plan, committed.
fn step(cache: &mut ExpertCache, layer: u32, routed: &[u32]) -> Plan {
    let plan = cache.plan(layer, routed).unwrap();
    cache.commit(&plan).unwrap();
    plan
}

/// A prefetch's plan, committed.
fn prefetch(cache: &mut ExpertCache, layer: u32, experts: &[u32]) -> Plan {
    let plan = cache.plan_prefetch(layer, experts).unwrap();
    cache.commit(&plan).unwrap();
    plan
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
    let plan = step(&mut cache, 0, &[3, 1, 3, 2, 1]);
    assert!(plan.resident.is_empty() && plan.evicted.is_empty() && plan.elsewhere.is_empty());
    assert_eq!(plan.fetch, vec![(3, 0), (1, 1), (2, 2)]);
    let plan = step(&mut cache, 0, &[2, 5, 3]);
    assert_eq!(plan.resident, vec![(2, 2), (3, 0)]);
    assert_eq!(plan.fetch, vec![(5, 3)]);
    assert!(plan.evicted.is_empty());
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 2, misses: 4 }]);
}

#[test]
fn a_plan_never_evicts_its_own_experts_and_reuses_victims_slots() {
    let mut cache = lru_cache(3);
    step(&mut cache, 0, &[0, 1, 2]);
    // LRU order is 0, 1, 2; expert 0 is a hit of this plan, so the oldest keys outside it go: 1, then 2.
    let plan = step(&mut cache, 0, &[0, 7, 8]);
    assert_eq!(plan.resident, vec![(0, 0)]);
    assert_eq!(plan.fetch, vec![(7, 1), (8, 2)]);
    assert_eq!(plan.evicted, vec![(0, 1), (0, 2)]);
    assert_eq!(cache.slot_of((0, 1)), None);
    assert_eq!(cache.slot_of((0, 7)), Some(1));
}

#[test]
fn layers_share_the_pool_and_keep_separate_keys_and_counts() {
    let mut cache = lru_cache(2);
    step(&mut cache, 0, &[4]);
    let plan = step(&mut cache, 2, &[4]);
    assert_eq!(plan.fetch, vec![(4, 1)]);
    // The pool is full: layer 1's expert 4 takes the slot of the least recently used key, layer 0's.
    let plan = step(&mut cache, 1, &[4]);
    assert_eq!(plan.fetch, vec![(4, 0)]);
    assert_eq!(plan.evicted, vec![(0, 4)]);
    assert!(step(&mut cache, 2, &[4]).fetch.is_empty());
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
    step(&mut cache, 0, &[1]);
    let error = cache.plan(0, &[1, 2, 3, 2]).unwrap_err().to_string();
    assert!(error.contains("3 distinct experts"), "{error}");
    assert!(error.contains("2 slots"), "{error}");
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 0, misses: 1 }]);
    // Duplicates do not count against the slots.
    assert_eq!(step(&mut cache, 0, &[2, 1, 2, 1]).fetch, vec![(2, 1)]);
    assert!(ExpertCache::new(0, Box::new(Lru::new())).access((0, 0)).is_err());
}

#[test]
fn a_prefetch_spares_the_last_steps_experts_and_its_keys_count_as_misses_when_used() {
    let mut cache = lru_cache(4);
    step(&mut cache, 0, &[0, 1]);
    step(&mut cache, 1, &[0, 1]);
    // Layer 1's experts are in use; LRU order is (0,0), (0,1), (1,0), (1,1): layer 0's keys are the victims.
    let ahead = prefetch(&mut cache, 2, &[5, 6]);
    assert_eq!(ahead.fetch, vec![(5, 0), (6, 1)]);
    assert_eq!(ahead.evicted, vec![(0, 0), (0, 1)]);
    // A second prefetch still spares layer 1 and takes the oldest other keys: the first prefetch's.
    let ahead = prefetch(&mut cache, 3, &[7]);
    assert_eq!(ahead.evicted, vec![(2, 5)]);
    // Not counted when prefetched; counted as a miss when the step uses it, then as a hit.
    assert_eq!(cache.layer_counts()[2], LayerCounts::default());
    let used = step(&mut cache, 2, &[6, 9]);
    assert_eq!(used.resident, vec![(6, 1)]);
    assert_eq!(cache.layer_counts()[2], LayerCounts { hits: 0, misses: 2 });
    assert_eq!(
        cache.prefetches_used(),
        1,
        "the prefetched (2, 6) was used, (2, 5) was evicted unused"
    );
    step(&mut cache, 2, &[6]);
    assert_eq!(cache.layer_counts()[2], LayerCounts { hits: 1, misses: 2 });
    assert_eq!(
        cache.prefetches_used(),
        1,
        "a prefetched key is used once as a prefetch"
    );
}

#[test]
fn experts_shared_by_a_batchs_sequences_are_fetched_once_per_step() {
    let mut cache = lru_cache(16);
    // Four sequences, top-2 each, routed as [row 0: 3, 1], [row 1: 1, 4], [row 2: 3, 4], [row 3: 9, 1]: eight
    // (row, k) pairs on four distinct experts, each copied once.
    let plan = step(&mut cache, 0, &[3, 1, 1, 4, 3, 4, 9, 1]);
    assert_eq!(plan.fetch, vec![(3, 0), (1, 1), (4, 2), (9, 3)]);
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 0, misses: 4 }]);
    // The next step shares expert 4 and 9 with the last and 7 between its rows: one copy, for 7.
    let plan = step(&mut cache, 0, &[7, 4, 9, 7, 4, 7, 9, 4]);
    assert_eq!(plan.fetch, vec![(7, 4)]);
    assert_eq!(plan.resident, vec![(4, 2), (9, 3)]);
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 2, misses: 5 }]);
}

#[test]
fn a_prefetch_that_does_not_fit_beside_the_busy_experts_is_an_error_that_changes_nothing() {
    let mut cache = lru_cache(4);
    step(&mut cache, 0, &[0, 1, 2]);
    let error = cache.plan_prefetch(1, &[0, 1]).unwrap_err().to_string();
    assert!(error.contains("3 of layer 0 are in use"), "{error}");
    assert_eq!(cache.slot_of((1, 0)), None);
    // Prefetching the busy layer's own experts needs only the slots outside them.
    assert_eq!(prefetch(&mut cache, 0, &[1, 2, 3]).fetch, vec![(3, 3)]);
    assert_eq!(step(&mut cache, 0, &[0]).resident, vec![(0, 0)]);
}

/// Every key's slot among layers `0..layers` and experts `0..experts`.
fn slots(cache: &ExpertCache, layers: u32, experts: u32) -> Vec<Option<u32>> {
    (0..layers)
        .flat_map(|layer| (0..experts).map(move |expert| (layer, expert)))
        .map(|key| cache.slot_of(key))
        .collect()
}

#[test]
fn an_aborted_plan_leaves_the_cache_exactly_as_before() {
    let mut rng = StdRng::seed_from_u64(4);
    let (mut cache, mut twin) = (lru_cache(6), lru_cache(6));
    for cache in [&mut cache, &mut twin] {
        step(cache, 0, &[0, 1, 2]);
        step(cache, 1, &[0, 1, 2]);
        prefetch(cache, 2, &[3]);
    }
    // Plans with misses and victims, of a step and of a prefetch, given up before any copy was queued.
    let plan = cache.plan(2, &[3, 4, 5, 0]).unwrap();
    assert_eq!(plan.evicted.len(), 3);
    cache.abort(&plan, 0).unwrap();
    let ahead = cache.plan_prefetch(0, &[6, 7]).unwrap();
    assert_eq!(ahead.evicted.len(), 2);
    cache.abort(&ahead, 0).unwrap();
    assert_eq!(slots(&cache, 3, 8), slots(&twin, 3, 8));
    assert_eq!(cache.layer_counts(), twin.layer_counts());
    // The policy, the busy experts and the prefetched keys are as before too: both caches plan alike from here.
    for _ in 0..200 {
        let layer = rng.random_range(0..3);
        let routed: Vec<u32> = (0..4).map(|_| rng.random_range(0..8)).collect();
        let ahead = rng.random_bool(0.2);
        let apply = |cache: &mut ExpertCache| {
            let plan = if ahead {
                cache.plan_prefetch(layer, &routed)
            } else {
                cache.plan(layer, &routed)
            };
            // A prefetch that does not fit beside the busy experts is an error; both caches must agree on it.
            plan.and_then(|plan| cache.commit(&plan).map(|()| (plan.resident, plan.fetch, plan.evicted)))
                .map_err(|error| error.to_string())
        };
        assert_eq!(apply(&mut cache), apply(&mut twin));
    }
    assert_eq!(cache.layer_counts(), twin.layer_counts());
}

#[test]
fn a_plan_aborted_after_some_copies_frees_the_slots_they_overwrite() {
    let mut cache = lru_cache(3);
    step(&mut cache, 0, &[1, 2]);
    // Expert 3 takes the free slot 2, expert 4 the slot of (0, 1), expert 5 that of (0, 2).
    let plan = cache.plan(0, &[3, 4, 5]).unwrap();
    assert_eq!(plan.fetch, vec![(3, 2), (4, 0), (5, 1)]);
    // The copies of 3 and 4 were queued, that of 5 failed: slot 0 is overwritten, slot 1 is not.
    cache.abort(&plan, 2).unwrap();
    assert_eq!(slots(&cache, 1, 6), vec![None, None, Some(1), None, None, None]);
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 0, misses: 2 }]);
    // Both free slots are taken before any victim.
    let plan = step(&mut cache, 0, &[2, 6, 7]);
    assert_eq!(plan.resident, vec![(2, 1)]);
    assert!(plan.evicted.is_empty() && plan.fetch.len() == 2);
}

#[test]
fn a_plan_made_before_the_cache_changed_is_refused_and_changes_nothing() {
    let mut cache = lru_cache(2);
    let first = cache.plan(0, &[1]).unwrap();
    let second = cache.plan(0, &[2]).unwrap();
    // Both were planned into slot 0 of the empty cache; only one may have it.
    assert_eq!((first.fetch[0].1, second.fetch[0].1), (0, 0));
    cache.commit(&first).unwrap();
    assert!(cache.commit(&second).is_err() && cache.abort(&second, 1).is_err());
    assert!(cache.commit(&first).is_err(), "a plan commits once");
    assert_eq!(slots(&cache, 1, 3), vec![None, Some(0), None]);
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 0, misses: 1 }]);
}

#[test]
fn experts_computed_elsewhere_are_listed_neither_fetched_nor_made_resident() {
    let mut cache = lru_cache(4);
    step(&mut cache, 0, &[1]);
    // Every expert but 3 is to be computed elsewhere: 1 is resident, so it is a hit all the same; 2 and 4 are
    // kept off the device.
    let plan = cache.plan_elsewhere(0, &[2, 1, 3, 4, 2], |expert| expert != 3).unwrap();
    assert_eq!(plan.resident, vec![(1, 0)]);
    assert_eq!(plan.fetch, vec![(3, 1)]);
    assert_eq!(plan.elsewhere, vec![2, 4]);
    cache.commit(&plan).unwrap();
    assert_eq!(slots(&cache, 1, 5), vec![None, Some(0), None, Some(1), None]);
    // Misses all the same: the cache did not hold them.
    assert_eq!(cache.layer_counts(), &[LayerCounts { hits: 1, misses: 4 }]);
    // Only fetched keys take slots: two remain free for the next plan.
    assert!(step(&mut cache, 0, &[5, 6]).evicted.is_empty());
}

/// A policy that breaks its contract: it never offers a victim.
struct NoVictim;

impl EvictionPolicy for NoVictim {
    fn on_access(&mut self, _: ExpertKey, _: u64, _: Access) {}
    fn on_evict(&mut self, _: ExpertKey) {}
    fn choose_victim(&self, _: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
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
    assert_eq!(step(&mut cache, 0, &[2]).resident, vec![(2, 1)]);
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
    let plans: Vec<Plan> = steps.iter().map(|routed| step(&mut cache, 0, routed)).collect();
    // Step 3 needs a slot for expert 3 with {0, 1, 2} resident and 0 pinned: 1 is next used at time 5,
    // 2 at time 6, so 2 goes. Step 4: 1 hits, 2 misses and takes the slot of 3 (never used again; 0 is too,
    // and the larger key goes first).
    assert_eq!(plans[2].fetch, vec![(3, 2)]);
    assert_eq!(plans[2].evicted, vec![(0, 2)]);
    assert_eq!(plans[3].resident, vec![(1, 1)]);
    assert_eq!(plans[3].fetch, vec![(2, 2)]);
    assert_eq!(plans[3].evicted, vec![(0, 3)]);
}

/// A policy that records what it is told, in order, and evicts the oldest key it was told of.
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<(ExpertKey, Access)>>>);

impl EvictionPolicy for Recorder {
    fn on_access(&mut self, key: ExpertKey, _: u64, access: Access) {
        self.0.lock().unwrap().push((key, access));
    }
    fn on_evict(&mut self, _: ExpertKey) {}
    fn choose_victim(&self, _: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        None
    }
}

#[test]
fn a_batch_tells_the_policy_which_experts_only_prefill_rows_route_to() {
    let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut cache = ExpertCache::new(8, Box::new(Recorder(told.clone())));
    // Rows of top-2: a decode row (1, 2), a prefill row (2, 3), a decode row after it (3, 4).
    let plan = cache.plan_batch(0, &[1, 2, 2, 3, 3, 4], &[false, true, false]).unwrap();
    cache.commit(&plan).unwrap();
    let decode = |e| ((0, e), Access::Decode);
    assert_eq!(*told.lock().unwrap(), vec![decode(1), decode(2), decode(3), decode(4)]);
    told.lock().unwrap().clear();
    let plan = cache.plan_batch(1, &[5, 6, 6, 7], &[true, false]).unwrap();
    cache.commit(&plan).unwrap();
    assert_eq!(
        *told.lock().unwrap(),
        vec![
            ((1, 5), Access::Prefill),
            ((1, 6), Access::Decode),
            ((1, 7), Access::Decode)
        ]
    );
    // No rows given: all decode. Ids that do not divide into the rows: a shape error.
    assert!(cache.plan_batch(0, &[1, 2, 3], &[true, false]).is_err());
    told.lock().unwrap().clear();
    let plan = cache.plan_batch(2, &[1], &[]).unwrap();
    cache.commit(&plan).unwrap();
    assert_eq!(*told.lock().unwrap(), vec![((2, 1), Access::Decode)]);
}

#[test]
fn a_prefill_between_decode_steps_keeps_the_decode_working_set_under_prefill_aware_admission() {
    // Two MoE layers of 4 experts, 5 slots; the decode working set is expert 0 of each layer.
    let decode_misses = |cache: &mut ExpertCache| -> u64 {
        let before: u64 = cache.layer_counts().iter().map(|c| c.misses).sum();
        for layer in 0..2 {
            let plan = cache.plan_batch(layer, &[0], &[false]).unwrap();
            cache.commit(&plan).unwrap();
        }
        cache.layer_counts().iter().map(|c| c.misses).sum::<u64>() - before
    };
    for (policy, misses_after_prefill) in [
        (Box::new(Lru::new()) as Box<dyn EvictionPolicy>, 1),
        (Box::new(PrefillAware::new(Lru::new())), 0),
    ] {
        let mut cache = ExpertCache::new(5, policy);
        assert_eq!(decode_misses(&mut cache), 2);
        // A one-row batch of a prompt's prefill routes to every expert of both layers.
        for layer in 0..2 {
            let plan = cache.plan_batch(layer, &[0, 1, 2, 3], &[true]).unwrap();
            cache.commit(&plan).unwrap();
        }
        // LRU let layer 1's prefill evict layer 0's expert 0; on probation, layer 0's prefill-only keys went first.
        assert_eq!(decode_misses(&mut cache), misses_after_prefill);
    }
}

#[test]
fn a_prefetch_spares_the_unused_prefetches_of_its_own_layer() {
    let mut cache = lru_cache(4);
    step(&mut cache, 2, &[3]);
    step(&mut cache, 0, &[0, 1]);
    prefetch(&mut cache, 1, &[5]);
    step(&mut cache, 2, &[3]);
    step(&mut cache, 0, &[0, 1]);
    // LRU order is (1, 5), (2, 3), (0, 0), (0, 1), and layer 0's experts are in use: a second guess for layer 1,
    // copied on its own, takes (2, 3)'s slot, not the first guess's.
    assert_eq!(cache.prefetch_room(1), 1);
    let second = prefetch(&mut cache, 1, &[6]);
    assert_eq!(second.evicted, vec![(2, 3)]);
    assert_eq!(cache.prefetch_room(1), 0);
    let error = cache.plan_prefetch(1, &[7]).unwrap_err().to_string();
    assert!(error.contains("2 of layer 0 are in use and 2 prefetched"), "{error}");
    // Layer 1's step uses one guess; the other is a plain key from then on, which a step may evict.
    let used = step(&mut cache, 1, &[6, 7]);
    assert_eq!(used.evicted, vec![(1, 5)]);
    assert_eq!(cache.prefetches_used(), 1);
    assert_eq!(cache.prefetch_room(1), 2);
}
