//! The expert cache's bookkeeping on the host: which (layer, expert) occupies which slot of the one pool all MoE
//! layers share, and what each step must copy in. Applying a plan is a transaction: [`ExpertCache::plan`] decides
//! what a step needs without changing the cache; the caller queues the copies, then [`ExpertCache::commit`]s the
//! plan, or [`ExpertCache::abort`]s it when a copy could not be queued, so the cache never believes an expert
//! resident whose copy was not queued. Pure logic: the backend that offloads experts does the copies.

use std::collections::{HashMap, HashSet};

use super::policy::{Access, EvictionPolicy, ExpertKey};
use crate::{Error, Result};

/// What one MoE layer of one step needs: its distinct routed experts, each with the slot it runs from (or, for
/// experts kept off the device, none). Made by [`ExpertCache::plan`], applied by [`ExpertCache::commit`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// (expert, slot) of the experts already resident (hits), in first-routed order.
    pub resident: Vec<(u32, u32)>,
    /// (expert, slot) of the experts to copy in (misses), in first-routed order; each slot is free or was a
    /// victim's.
    pub fetch: Vec<(u32, u32)>,
    /// Keys that lose their slot to a fetch, in the order their slots are taken (the last `evicted.len()` fetches
    /// take victims' slots, the others free ones). They may belong to any layer except that none is an expert of
    /// this plan.
    pub evicted: Vec<ExpertKey>,
    /// Missing experts the caller asked to compute elsewhere rather than fetch ([`ExpertCache::plan_elsewhere`]),
    /// in first-routed order: the misses an offloading backend's CPU lane computes.
    pub elsewhere: Vec<u32>,
    layer: u32,
    placement: Placement,
    /// Every distinct expert, in first-routed order: the order the commit tells the policy of their use.
    experts: Vec<u32>,
    /// What each of `experts` is used for: decode if any decode row routes to it.
    accesses: Vec<Access>,
    /// The cache's version the plan was made against: it commits only to that state.
    version: u64,
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
    /// The plan being made: its experts as a set, and the victims chosen so far (the keys a victim search must
    /// skip). Kept between calls so the hot path does not allocate them.
    in_plan: HashSet<u32>,
    victims: HashSet<ExpertKey>,
    /// The plan `access` fills, reused for the same reason.
    access_plan: Plan,
    /// The layer and experts of the last committed step plan: still being read while a prefetch for the next layer
    /// is planned, so they must not be victims of it.
    step_layer: u32,
    step_experts: HashSet<u32>,
    /// Keys copied in by a prefetch and not yet used by a step of their layer: their first use counts as the miss it
    /// replaced. A step of the layer makes the ones it did not use plain keys.
    prefetched: HashSet<ExpertKey>,
    /// Prefetched keys a step used.
    prefetches_used: u64,
    /// Counts the changes to which slots hold what (commits, and aborts that free slots).
    version: u64,
}

/// Whether a placement is a step's own plan (counted as hits and misses) or a prefetch ahead of it (counted when
/// its step uses it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Placement {
    #[default]
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
            in_plan: HashSet::new(),
            victims: HashSet::new(),
            access_plan: Plan::default(),
            step_layer: 0,
            step_experts: HashSet::new(),
            prefetched: HashSet::new(),
            prefetches_used: 0,
            version: 0,
        }
    }

    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// The slot `key` occupies, if it is resident.
    pub fn slot_of(&self, key: ExpertKey) -> Option<u32> {
        self.slot_of.get(&key).copied()
    }

    /// How many prefetched keys a step has used so far.
    pub fn prefetches_used(&self) -> u64 {
        self.prefetches_used
    }

    /// Hits and misses so far, indexed by MoE layer (layers never planned count zero).
    pub fn layer_counts(&self) -> &[LayerCounts] {
        &self.counts
    }

    /// Plans one MoE layer of one step, changing nothing until [`Self::commit`]. `routed`: the routed expert ids of
    /// every row of the batch (duplicates allowed). Hits keep their slot; misses take a free slot or a victim's,
    /// never one of this plan's experts. An error if the layer's distinct experts outnumber the slots.
    pub fn plan(&mut self, layer: u32, routed: &[u32]) -> Result<Plan> {
        self.plan_elsewhere(layer, routed, |_| false)
    }

    /// [`Self::plan`] for a batch whose rows are decode steps or prefill chunks: `routed` holds the ids of
    /// `prefill_rows.len()` rows, equally many per row, and an expert that only prefill rows route to is told to the
    /// policy as an [`Access::Prefill`]. With no rows given, every row is a decode step.
    pub fn plan_batch(&mut self, layer: u32, routed: &[u32], prefill_rows: &[bool]) -> Result<Plan> {
        self.plan_batch_elsewhere(layer, routed, prefill_rows, |_| false)
    }

    /// [`Self::plan_batch`], except that the missing experts for which `elsewhere` holds are not fetched but listed
    /// in [`Plan::elsewhere`], for the caller to compute off the device: they take no slot, and count as misses.
    pub fn plan_batch_elsewhere(
        &mut self,
        layer: u32,
        routed: &[u32],
        prefill_rows: &[bool],
        elsewhere: impl Fn(u32) -> bool,
    ) -> Result<Plan> {
        if !prefill_rows.is_empty() && !routed.len().is_multiple_of(prefill_rows.len()) {
            return Err(Error::Shape(format!(
                "{} routed ids are not a whole number of ids for each of {} rows",
                routed.len(),
                prefill_rows.len()
            )));
        }
        let mut plan = Plan::default();
        self.begin(routed, prefill_rows, &mut plan);
        self.place(layer, Placement::Step, &elsewhere, &mut plan)?;
        Ok(plan)
    }

    /// [`Self::plan_batch_elsewhere`] with every row a decode step.
    pub fn plan_elsewhere(&mut self, layer: u32, routed: &[u32], elsewhere: impl Fn(u32) -> bool) -> Result<Plan> {
        self.plan_batch_elsewhere(layer, routed, &[], elsewhere)
    }

    /// Plans copying `experts` of `layer` in before its step routes (a prefetch: the caller expects that step to
    /// use them), while the experts of the last committed step are still in use and earlier prefetches of `layer`
    /// wait for that step: victims come from none of them (prefetches copied one by one must not evict each
    /// other). An error if they all together outnumber the slots. Prefetched keys are not counted when committed;
    /// the step that first uses one counts a miss, as it would have without the prefetch.
    pub fn plan_prefetch(&mut self, layer: u32, experts: &[u32]) -> Result<Plan> {
        let mut plan = Plan::default();
        // A prefetch is not yet a use by a decode step: it is admitted as a prefill's keys are.
        self.begin(experts, &[true], &mut plan);
        let busy_outside = if layer == self.step_layer {
            self.step_experts
                .iter()
                .filter(|expert| !self.in_plan.contains(expert))
                .count()
        } else {
            self.step_experts.len()
        };
        let waiting = self
            .prefetched
            .iter()
            .filter(|&&(l, expert)| l == layer && !self.in_plan.contains(&expert))
            .count();
        if plan.experts.len() + busy_outside + waiting > self.num_slots as usize {
            return Err(Error::Cache(format!(
                "prefetching {} experts of MoE layer {layer} while {busy_outside} of layer {} are in use and \
                 {waiting} prefetched ones wait for their step needs more than the cache's {} slots",
                plan.experts.len(),
                self.step_layer,
                self.num_slots
            )));
        }
        self.place(layer, Placement::Prefetch, &|_| false, &mut plan)?;
        Ok(plan)
    }

    /// How many more experts of `layer` a prefetch may copy in now: the slots outside the last step's experts and
    /// the prefetches of `layer` waiting for their step.
    pub fn prefetch_room(&self, layer: u32) -> usize {
        let waiting = self.prefetched.iter().filter(|key| key.0 == layer).count();
        (self.num_slots as usize).saturating_sub(self.step_experts.len() + waiting)
    }

    /// Uses one key by a decode step, as a committed plan of that key alone would: true on a hit. The simulator
    /// replays traces with it.
    pub fn access(&mut self, key: ExpertKey) -> Result<bool> {
        self.access_as(key, Access::Decode)
    }

    /// [`Self::access`] for a use of the given kind.
    pub fn access_as(&mut self, key: ExpertKey, access: Access) -> Result<bool> {
        let mut plan = std::mem::take(&mut self.access_plan);
        self.begin(&[key.1], &[access == Access::Prefill], &mut plan);
        let applied = self
            .place(key.0, Placement::Step, &|_| false, &mut plan)
            .and_then(|()| self.commit(&plan));
        let hit = !plan.resident.is_empty();
        self.access_plan = plan;
        applied.map(|()| hit)
    }

    /// Makes `plan` the cache's state, once the copies of its fetches are queued: its fetched keys resident in
    /// their slots, its victims gone, each expert's use told to the policy in first-routed order, and a step's hits
    /// and misses counted. An error, changing nothing, if the cache changed since the plan was made.
    pub fn commit(&mut self, plan: &Plan) -> Result<()> {
        let from_free = self.check_current(plan)?;
        let layer = plan.layer;
        if self.counts.len() <= layer as usize {
            self.counts.resize(layer as usize + 1, LayerCounts::default());
        }
        self.free_slots.truncate(self.free_slots.len() - from_free);
        let step = plan.placement == Placement::Step;
        let mut fetches = plan.fetch.iter().enumerate().peekable();
        for (&expert, &access) in plan.experts.iter().zip(&plan.accesses) {
            let key = (layer, expert);
            let counts = &mut self.counts[layer as usize];
            if self.slot_of.contains_key(&key) {
                if step && self.prefetched.remove(&key) {
                    counts.misses += 1;
                    self.prefetches_used += 1;
                } else if step {
                    counts.hits += 1;
                }
            } else if let Some((index, &(_, slot))) = fetches.next_if(|(_, &(fetched, _))| fetched == expert) {
                if let Some(&victim) = index.checked_sub(from_free).and_then(|i| plan.evicted.get(i)) {
                    self.slot_of.remove(&victim);
                    self.policy.on_evict(victim);
                    self.prefetched.remove(&victim);
                }
                self.slot_of.insert(key, slot);
                if step {
                    counts.misses += 1;
                } else {
                    self.prefetched.insert(key);
                }
            } else {
                // Computed elsewhere: a miss that takes no slot. The clock still counts its use, so that a policy
                // built from the whole routed sequence stays aligned with it.
                counts.misses += 1;
                self.clock += 1;
                continue;
            }
            self.policy.on_access(key, self.clock, access);
            self.clock += 1;
        }
        if step {
            // The prefetches of this layer the step did not use are plain keys from now on: spared by no later
            // prefetch, and a hit when used.
            self.prefetched.retain(|key| key.0 != layer);
            self.step_layer = layer;
            self.step_experts.clear();
            self.step_experts.extend(&plan.experts);
        }
        self.version += 1;
        Ok(())
    }

    /// Gives `plan` up after the copies of its first `queued` fetches were queued and the next one failed. Nothing
    /// changes, except that each slot such a copy overwrites loses its victim and becomes free: the cache then
    /// believes neither the victim nor the fetched expert is there. With nothing queued, the cache is exactly as it
    /// was before the plan. An error, changing nothing, if the cache changed since the plan was made.
    pub fn abort(&mut self, plan: &Plan, queued: usize) -> Result<()> {
        let from_free = self.check_current(plan)?;
        let overwritten = &plan.evicted[..queued.saturating_sub(from_free).min(plan.evicted.len())];
        for victim in overwritten {
            if let Some(slot) = self.slot_of.remove(victim) {
                self.policy.on_evict(*victim);
                self.prefetched.remove(victim);
                self.free_slots.push(slot);
            }
        }
        if !overwritten.is_empty() {
            self.version += 1;
        }
        Ok(())
    }

    /// How many of `plan`'s fetches take free slots, or an error if `plan` was not made against the cache as it is.
    fn check_current(&self, plan: &Plan) -> Result<usize> {
        let from_free = plan.fetch.len().checked_sub(plan.evicted.len());
        match from_free {
            Some(n) if plan.version == self.version && n <= self.free_slots.len() => Ok(n),
            _ => Err(Error::Cache(
                "a plan made before the expert cache last changed cannot be applied".into(),
            )),
        }
    }

    /// Starts `plan` afresh with `routed`'s experts, deduplicated in first-seen order (also kept as a set), each a
    /// decode access unless only rows that `prefill_rows` marks (see [`Self::plan_batch`]) route to it.
    fn begin(&mut self, routed: &[u32], prefill_rows: &[bool], plan: &mut Plan) {
        plan.resident.clear();
        plan.fetch.clear();
        plan.evicted.clear();
        plan.elsewhere.clear();
        plan.experts.clear();
        plan.accesses.clear();
        self.in_plan.clear();
        let per_row = (routed.len() / prefill_rows.len().max(1)).max(1);
        let mut any_prefill = false;
        for (index, &expert) in routed.iter().enumerate() {
            let prefill = prefill_rows.get(index / per_row) == Some(&true);
            let access = if prefill { Access::Prefill } else { Access::Decode };
            if self.in_plan.insert(expert) {
                plan.experts.push(expert);
                plan.accesses.push(access);
                any_prefill |= prefill;
            } else if access == Access::Decode && any_prefill {
                // Perhaps seen first on a prefill row: a decode row's use makes it a decode access. Linear, but only
                // when a decode row follows a prefill row (the scheduler puts decodes first), over one layer's experts.
                if let Some(position) = plan.experts.iter().position(|&e| e == expert) {
                    plan.accesses[position] = Access::Decode;
                }
            }
        }
    }

    /// Decides the slots of `plan.experts` of `layer`, changing nothing in the cache. Victims are chosen in the
    /// order the fetches need them and are never keys of this plan, victims already chosen, nor (for a prefetch)
    /// the last step's experts and the waiting prefetches of `layer`.
    fn place(
        &mut self,
        layer: u32,
        placement: Placement,
        elsewhere: &dyn Fn(u32) -> bool,
        plan: &mut Plan,
    ) -> Result<()> {
        if plan.experts.len() > self.num_slots as usize {
            return Err(Error::Cache(format!(
                "MoE layer {layer} routes {} distinct experts in one step, more than the cache's {} slots",
                plan.experts.len(),
                self.num_slots
            )));
        }
        plan.layer = layer;
        plan.placement = placement;
        plan.version = self.version;
        let ExpertCache {
            num_slots,
            policy,
            slot_of,
            free_slots,
            in_plan,
            victims,
            step_layer,
            step_experts,
            prefetched,
            ..
        } = self;
        victims.clear();
        let mut free = free_slots.len();
        for &expert in &plan.experts {
            if let Some(&slot) = slot_of.get(&(layer, expert)) {
                plan.resident.push((expert, slot));
                continue;
            }
            if elsewhere(expert) {
                plan.elsewhere.push(expert);
                continue;
            }
            let slot = if free > 0 {
                free -= 1;
                free_slots[free]
            } else {
                // With no more distinct experts than slots, some resident key lies outside this plan; a policy that
                // finds none, or offers a pinned or absent key, breaks its contract.
                let pinned = |key: ExpertKey| {
                    (key.0 == layer && in_plan.contains(&key.1))
                        || (placement == Placement::Prefetch
                            && ((key.0 == *step_layer && step_experts.contains(&key.1))
                                || (key.0 == layer && prefetched.contains(&key))))
                        || victims.contains(&key)
                };
                let victim = policy.choose_victim(&pinned).filter(|&victim| !pinned(victim));
                let Some((victim, slot)) = victim.and_then(|v| slot_of.get(&v).map(|&s| (v, s))) else {
                    return Err(Error::Cache(format!(
                        "the eviction policy offered no resident victim outside MoE layer {layer}'s plan although \
                         all {num_slots} slots are full"
                    )));
                };
                victims.insert(victim);
                plan.evicted.push(victim);
                slot
            };
            plan.fetch.push((expert, slot));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
