//! Prefix caching's bookkeeping, pure logic beside [`super::BlockAllocator`]: which full blocks hold which
//! token prefix, which of those no sequence reads any more (kept, evictable, least recently used first), and which
//! carry a snapshot of a hybrid model's recurrent state (the state after the block's last token).
//!
//! A full block is keyed by a hash chain: the hash of its parent block's key and its own tokens, so equal keys mean
//! equal prefixes from position 0. Each entry also keeps its tokens and its parent's key, checked on every hit, so
//! a hash collision can only cost a miss, never a wrong answer (short of a collision of two whole chains, 2^-64 per
//! pair). The hasher's keys are random per process, so a client cannot aim collisions at the table. One cache only
//! ever serves one model (it is made for that model's layer shapes), so keys carry no model fingerprint.
//!
//! Snapshots live in a fixed number of slots (the memory plan's): the cache that owns the physical states copies a
//! sequence's state into the slot [`PrefixIndex::snapshot_slot`] hands out, and back when a hit resumes from it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};

/// The key of a full block: the hash chain of every token from position 0 to the block's end.
pub type BlockKey = u64;

/// What prefix caching has done since the start, for /metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Requests that looked their prompt up.
    pub queries: u64,
    /// Tokens those lookups could have found (each prompt less its last token).
    pub queried_tokens: u64,
    /// Tokens found: their keys, values and state were reused, not computed.
    pub hit_tokens: u64,
    /// Cached blocks given up to make room for new ones.
    pub evicted_blocks: u64,
    /// Recurrent-state snapshots given up to make room for new ones (their blocks may stay cached).
    pub evicted_snapshots: u64,
}

/// A full block whose prefix is known.
#[derive(Clone)]
struct Entry {
    key: BlockKey,
    parent: Option<BlockKey>,
    tokens: Box<[u32]>,
    /// The snapshot slot holding the recurrent state after this block, if any.
    snapshot: Option<usize>,
}

/// A prefix found in the cache: its blocks, in order, and the snapshot to resume a hybrid's state from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<u32>,
    pub keys: Vec<BlockKey>,
    /// The slot holding the recurrent state after the last block (None for a model without recurrent state).
    pub snapshot: Option<usize>,
}

#[derive(Clone)]
pub struct PrefixIndex {
    hasher: RandomState,
    block_size: usize,
    by_key: HashMap<BlockKey, u32>,
    /// Per block.
    entries: Vec<Option<Entry>>,
    /// Cached blocks no sequence reads, by when they were last read: the first is evicted first.
    evictable: BTreeMap<u64, u32>,
    /// Per block, its place in `evictable`.
    evictable_at: Vec<Option<u64>>,
    clock: u64,
    /// Snapshot slots: their block (None: free), and by last use, the first given up first.
    snapshot_owner: Vec<Option<u32>>,
    snapshot_lru: BTreeMap<u64, usize>,
    snapshot_at: Vec<u64>,
    stats: PrefixStats,
}

impl PrefixIndex {
    pub fn new(block_size: usize, num_blocks: usize, snapshot_slots: usize) -> Self {
        PrefixIndex {
            hasher: RandomState::new(),
            block_size,
            by_key: HashMap::new(),
            entries: (0..num_blocks).map(|_| None).collect(),
            evictable: BTreeMap::new(),
            evictable_at: vec![None; num_blocks],
            clock: 0,
            snapshot_owner: vec![None; snapshot_slots],
            snapshot_lru: BTreeMap::new(),
            snapshot_at: vec![0; snapshot_slots],
            stats: PrefixStats::default(),
        }
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    pub fn snapshot_slots(&self) -> usize {
        self.snapshot_owner.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The key of the block holding `tokens` after the block keyed `parent` (None: the first block of an unsalted
    /// chain).
    pub fn key(&self, parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
        self.hasher.hash_one((parent, tokens))
    }

    /// The parent key of the first block of a chain salted with `salt` (vLLM's `cache_salt`): chains of different
    /// salts, or salted and not, share no block, so that one tenant's requests cannot learn from the cache's timing
    /// what another's prompts held.
    pub fn salt_key(&self, salt: &str) -> BlockKey {
        self.hasher.hash_one(("cache_salt", salt))
    }

    /// The block cached under `key`, if it holds `tokens` after `parent`.
    fn find(&self, key: BlockKey, parent: Option<BlockKey>, tokens: &[u32]) -> Option<u32> {
        let block = *self.by_key.get(&key)?;
        let entry = self.entries[block as usize].as_ref()?;
        (entry.parent == parent && *entry.tokens == *tokens).then_some(block)
    }

    /// The longest cached prefix of `tokens`' full blocks (`tokens` is what may be reused: the caller leaves out
    /// what must be computed) in the chain under `root` (a salt's key; None: unsalted). With `needs_snapshot` (a
    /// hybrid model), only up to the deepest block that carries a snapshot, since the recurrent state cannot resume
    /// anywhere else. Counts the query; takes nothing.
    pub fn lookup(&mut self, root: Option<BlockKey>, tokens: &[u32], needs_snapshot: bool) -> PrefixHit {
        let mut hit = PrefixHit {
            blocks: Vec::new(),
            keys: Vec::new(),
            snapshot: None,
        };
        let mut usable = 0;
        let mut parent = root;
        for chunk in tokens.chunks_exact(self.block_size) {
            let key = self.key(parent, chunk);
            let Some(block) = self.find(key, parent, chunk) else {
                break;
            };
            hit.blocks.push(block);
            hit.keys.push(key);
            parent = Some(key);
            let snapshot = self.entries[block as usize].as_ref().and_then(|e| e.snapshot);
            if !needs_snapshot {
                usable = hit.blocks.len();
            } else if snapshot.is_some() {
                usable = hit.blocks.len();
                hit.snapshot = snapshot;
            }
        }
        hit.blocks.truncate(usable);
        hit.keys.truncate(usable);
        if let Some(slot) = hit.snapshot {
            self.touch_snapshot(slot);
        }
        self.stats.queries += 1;
        self.stats.queried_tokens += tokens.len() as u64;
        self.stats.hit_tokens += (usable * self.block_size) as u64;
        hit
    }

    /// Records `block`, just written full with `tokens` after `parent`, under `key`; false when the key is
    /// already cached (by another sequence's copy, which stays the one found).
    pub fn insert(&mut self, block: u32, key: BlockKey, parent: Option<BlockKey>, tokens: &[u32]) -> bool {
        if self.by_key.contains_key(&key) || self.entries[block as usize].is_some() {
            return false;
        }
        self.by_key.insert(key, block);
        self.entries[block as usize] = Some(Entry {
            key,
            parent,
            tokens: tokens.into(),
            snapshot: None,
        });
        true
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.entries[block as usize].is_some()
    }

    /// `block` is read by no sequence now: cached, it waits in the evictable pool; false when it is not cached
    /// (the caller frees it).
    pub fn release(&mut self, block: u32) -> bool {
        if !self.is_cached(block) {
            return false;
        }
        let at = self.tick();
        self.evictable.insert(at, block);
        self.evictable_at[block as usize] = Some(at);
        true
    }

    /// `block` is read again: out of the evictable pool.
    pub fn reuse(&mut self, block: u32) {
        if let Some(at) = self.evictable_at[block as usize].take() {
            self.evictable.remove(&at);
        }
    }

    pub fn evictable_blocks(&self) -> usize {
        self.evictable.len()
    }

    /// Gives up the least recently read evictable block, and its snapshot, for a new use.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, block) = self.evictable.pop_first()?;
        self.evictable_at[block as usize] = None;
        let entry = self.entries[block as usize]
            .take()
            .expect("evictable blocks are cached");
        self.by_key.remove(&entry.key);
        if let Some(slot) = entry.snapshot {
            self.snapshot_owner[slot] = None;
            self.snapshot_lru.remove(&self.snapshot_at[slot]);
        }
        self.stats.evicted_blocks += 1;
        Some(block)
    }

    /// Slot `slot` holds nothing usable (filling it failed): no hit may resume from it.
    pub fn discard_snapshot(&mut self, slot: usize) {
        let Some(owner) = self.snapshot_owner.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.snapshot_lru.remove(&self.snapshot_at[slot]);
        if let Some(entry) = self.entries[owner as usize].as_mut() {
            entry.snapshot = None;
        }
    }

    fn touch_snapshot(&mut self, slot: usize) {
        self.snapshot_lru.remove(&self.snapshot_at[slot]);
        let at = self.tick();
        self.snapshot_at[slot] = at;
        self.snapshot_lru.insert(at, slot);
    }

    /// A slot for the recurrent state after the block cached under `key`, which the caller fills at once; None
    /// when the key is not cached, already has a snapshot, or there are no slots. Takes a free slot, else gives up
    /// the least recently used snapshot (its block stays cached).
    pub fn snapshot_slot(&mut self, key: BlockKey) -> Option<usize> {
        let block = *self.by_key.get(&key)?;
        if self.entries[block as usize].as_ref()?.snapshot.is_some() {
            return None;
        }
        let slot = match self.snapshot_owner.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                let (_, slot) = self.snapshot_lru.pop_first()?;
                let owner = self.snapshot_owner[slot].expect("a used slot has a block");
                if let Some(entry) = self.entries[owner as usize].as_mut() {
                    entry.snapshot = None;
                }
                self.stats.evicted_snapshots += 1;
                slot
            }
        };
        self.snapshot_owner[slot] = Some(block);
        self.entries[block as usize].as_mut()?.snapshot = Some(slot);
        self.touch_snapshot(slot);
        Some(slot)
    }
}
