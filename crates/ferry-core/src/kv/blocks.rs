//! Paged KV bookkeeping, the one count of a cache's capacity: the cache is cut into blocks of `block_size` token
//! slots; a sequence owns a list of blocks that grows as it does and returns to the pool when it ends. Every
//! [`super::KvCache`] keeps one, and the scheduler budgets against it: it grows a sequence's blocks before each
//! step ([`BlockAllocator::grow`]), so running out of KV is a scheduling decision (wait, or preempt a sequence)
//! instead of an error in the middle of a forward pass, and the forward pass finds its blocks already taken.
//! Pure logic: where the slots physically live is the cache's business.
//!
//! With prefix caching ([`BlockAllocator::enable_prefix_cache`]), full blocks are also published under their
//! prefix's key ([`super::prefix`]) and shared read-only: a new sequence starts on the cached blocks of its prompt's
//! longest cached prefix, each block counts the sequences reading it, and a cached block no one reads stays until a
//! new block is needed. Only full blocks are shared and a sequence only writes past its last full block, into a
//! block of its own, so no block is ever written while another sequence reads it.

use super::prefix::{BlockKey, PrefixIndex, PrefixStats};
use super::SeqId;
use crate::{Error, Result};

#[derive(Clone)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// Positions written (or being written by the batch in flight); the blocks may hold more.
    len: usize,
    /// The keys of its first blocks, published or found in the prefix cache.
    keys: Vec<BlockKey>,
    /// The parent key of its first block: its salt's ([`BlockAllocator::salt_prefixes`]), or None.
    root: Option<BlockKey>,
}

/// What a sequence found in the prefix cache when it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reused {
    /// Leading tokens whose keys and values (and, for a hybrid, state) need no computing.
    pub tokens: usize,
    /// The recurrent-state snapshot slot to resume from, for a model with recurrent state.
    pub snapshot: Option<usize>,
}

#[derive(Clone)]
pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    /// Blocks holding nothing anyone may read.
    free: Vec<u32>,
    /// Per block, the sequences reading it.
    refs: Vec<u32>,
    seqs: Vec<Option<SeqBlocks>>,
    /// None: prefix caching is off.
    prefix: Option<PrefixIndex>,
}

impl BlockAllocator {
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        assert!(block_size > 0, "a KV block holds at least one token");
        BlockAllocator {
            block_size,
            num_blocks,
            // Reversed so blocks are handed out from 0 upwards.
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            seqs: Vec::new(),
            prefix: None,
        }
    }

    /// Turns prefix caching on, with `snapshot_slots` slots for recurrent-state snapshots (0 for a model without
    /// recurrent state), before any sequence starts.
    pub fn enable_prefix_cache(&mut self, snapshot_slots: usize) {
        self.prefix = Some(PrefixIndex::new(self.block_size, self.num_blocks, snapshot_slots));
    }

    /// Prefix caching's counters; None when it is off.
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(PrefixIndex::stats)
    }

    /// Cached blocks that no sequence reads (counted free: they are given up when a new block is needed).
    pub fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixIndex::evictable_blocks)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks sequences hold.
    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free_blocks()
    }

    /// Blocks a sequence may take: free ones and cached ones no sequence reads.
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.cached_blocks()
    }

    /// Tokens the whole cache holds.
    pub fn capacity_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Positions written across all sequences.
    pub fn used_tokens(&self) -> usize {
        self.seqs.iter().flatten().map(|s| s.len).sum()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    pub fn alloc_seq(&mut self) -> SeqId {
        let fresh = Some(SeqBlocks {
            blocks: Vec::new(),
            len: 0,
            keys: Vec::new(),
            root: None,
        });
        match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = fresh;
                SeqId(i as u32)
            }
            None => {
                self.seqs.push(fresh);
                SeqId(self.seqs.len() as u32 - 1)
            }
        }
    }

    /// Ends `seq`; the blocks no other sequence reads are free at once (cached ones wait in the evictable pool,
    /// its last blocks to be given up first).
    pub fn free_seq(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.get_mut(seq.0 as usize).and_then(Option::take) else {
            return;
        };
        for block in s.blocks.into_iter().rev() {
            let refs = &mut self.refs[block as usize];
            *refs -= 1;
            if *refs == 0 && !self.prefix.as_mut().is_some_and(|p| p.release(block)) {
                self.free.push(block);
            }
        }
    }

    /// A block for a new use: a free one, else the least recently read cached one.
    fn take_block(&mut self) -> Option<u32> {
        let block = self.free.pop().or_else(|| self.prefix.as_mut()?.evict())?;
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// Starts `seq`, which must hold nothing yet, on the longest cached prefix of `tokens` (the tokens that may
    /// be reused: the caller leaves out at least the last one, whose logits it needs). With `needs_snapshot` (a
    /// model with recurrent state), only as far as the deepest block with a state snapshot. Nothing is reused
    /// when prefix caching is off.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32], needs_snapshot: bool) -> Result<Reused> {
        if self.get(seq)?.len > 0 || self.held_by(seq) > 0 {
            return Err(Error::Kv(format!("sequence {} already holds tokens", seq.0)));
        }
        let root = self.get(seq)?.root;
        let Some(prefix) = self.prefix.as_mut() else {
            return Ok(Reused::default());
        };
        let hit = prefix.lookup(root, tokens, needs_snapshot);
        for &block in &hit.blocks {
            prefix.reuse(block);
            self.refs[block as usize] += 1;
        }
        let s = self.seqs[seq.0 as usize].as_mut().expect("checked above");
        s.len = hit.blocks.len() * self.block_size;
        s.blocks = hit.blocks;
        s.keys = hit.keys;
        Ok(Reused {
            tokens: s.len,
            snapshot: hit.snapshot,
        })
    }

    /// Keys `seq`'s blocks under `salt` (vLLM's `cache_salt`): it reuses and publishes cached blocks only among
    /// sequences of the same salt. Call it as the sequence starts, before it holds anything.
    pub fn salt_prefixes(&mut self, seq: SeqId, salt: &str) -> Result<()> {
        if self.get(seq)?.len > 0 || self.held_by(seq) > 0 {
            return Err(Error::Kv(format!("sequence {} already holds tokens", seq.0)));
        }
        let root = self.prefix.as_ref().map(|prefix| prefix.salt_key(salt));
        self.seqs[seq.0 as usize].as_mut().expect("checked above").root = root;
        Ok(())
    }

    /// Publishes `seq`'s full blocks that `tokens` (its tokens from position 0, at least as far as it has
    /// computed) describe, so later sequences may reuse them. A block whose prefix is already cached elsewhere
    /// stays this sequence's own.
    pub fn publish(&mut self, seq: SeqId, tokens: &[u32]) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        let Some(s) = self.seqs.get_mut(seq.0 as usize).and_then(Option::as_mut) else {
            return;
        };
        let full = s.len.min(tokens.len()) / self.block_size;
        for i in s.keys.len()..full {
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let parent = s.keys.last().copied().or(s.root);
            let key = prefix.key(parent, chunk);
            prefix.insert(s.blocks[i], key, parent, chunk);
            s.keys.push(key);
        }
    }

    /// A snapshot slot for `seq`'s recurrent state as it is now, after its last published block, which the caller
    /// fills at once; None when `seq` does not end at a published block or that prefix has a snapshot already.
    pub fn snapshot_slot(&mut self, seq: SeqId) -> Option<usize> {
        let s = self.get(seq).ok()?;
        if s.len == 0 || s.len != s.keys.len() * self.block_size {
            return None;
        }
        let key = *s.keys.last()?;
        self.prefix.as_mut()?.snapshot_slot(key)
    }

    /// Snapshot slot `slot` could not be filled: no sequence may resume from it.
    pub fn discard_snapshot(&mut self, slot: usize) {
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.discard_snapshot(slot);
        }
    }

    /// Whether prefix caching is on.
    pub fn caches_prefixes(&self) -> bool {
        self.prefix.is_some()
    }

    fn get(&self, seq: SeqId) -> Result<&SeqBlocks> {
        self.seqs
            .get(seq.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.get(seq).map_or(0, |s| s.len)
    }

    /// Blocks `seq` holds (none for an unknown sequence).
    pub fn held_by(&self, seq: SeqId) -> usize {
        self.get(seq).map_or(0, |s| s.blocks.len())
    }

    /// Extra blocks `seq` needs to hold `tokens` positions in all.
    pub fn shortfall(&self, seq: SeqId, tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(self.held_by(seq))
    }

    /// The most positions `seq` can hold in all with the blocks it has plus every free one.
    pub fn max_tokens_for(&self, seq: SeqId) -> usize {
        (self.held_by(seq) + self.free_blocks()) * self.block_size
    }

    /// Takes free blocks for `seq` to hold `tokens` positions in all (its length is unchanged: the batch that
    /// writes them extends it); false, taking nothing, when `seq` is unknown or too few blocks are free.
    #[must_use = "a sequence that could not grow must not be given the tokens"]
    pub fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.take_blocks(seq, tokens).is_some()
    }

    /// [`grow`](Self::grow), returning the grown sequence.
    fn take_blocks(&mut self, seq: SeqId, tokens: usize) -> Option<&mut SeqBlocks> {
        let extra = self.shortfall(seq, tokens);
        self.get(seq).ok()?;
        if extra > self.free_blocks() {
            return None;
        }
        let taken: Vec<u32> = (0..extra).map_while(|_| self.take_block()).collect();
        let s = self.seqs[seq.0 as usize].as_mut().expect("checked above");
        s.blocks.extend(taken);
        Some(s)
    }

    /// Blocks `seq` needs to grow by `len` tokens from `start_pos`, which must be its current length.
    fn blocks_needed(&self, seq: SeqId, start_pos: usize, len: usize) -> Result<usize> {
        let s = self.get(seq)?;
        if s.len != start_pos {
            return Err(Error::Kv(format!(
                "sequence {} holds {} tokens, the batch continues it at position {start_pos}",
                seq.0, s.len
            )));
        }
        Ok(self.shortfall(seq, start_pos + len))
    }

    /// Extends each `(seq, start_pos, len)` of a batch by `len` tokens from `start_pos` (which must be its
    /// current length), taking blocks as needed: all or none, so on failure nothing changes.
    pub fn extend(&mut self, slices: &[(SeqId, usize, usize)]) -> Result<()> {
        let mut needed = 0;
        for &(seq, start_pos, len) in slices {
            needed += self.blocks_needed(seq, start_pos, len)?;
        }
        if needed > self.free_blocks() {
            return Err(Error::Kv(format!(
                "full: the batch needs {needed} more blocks of {} tokens, {} of {} are free",
                self.block_size,
                self.free_blocks(),
                self.num_blocks
            )));
        }
        for &(seq, start_pos, len) in slices {
            if let Some(s) = self.take_blocks(seq, start_pos + len) {
                s.len = start_pos + len;
            }
        }
        Ok(())
    }

    pub fn blocks(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.get(seq)?.blocks)
    }

    /// The physical token slot of position `pos` of `seq` (block * block_size + offset).
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<u32> {
        let block = self
            .get(seq)?
            .blocks
            .get(pos / self.block_size)
            .copied()
            .ok_or_else(|| Error::Kv(format!("position {pos} of sequence {} is not allocated", seq.0)))?;
        Ok(block * self.block_size as u32 + (pos % self.block_size) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_take_blocks_as_they_grow_and_give_them_back() {
        let mut a = BlockAllocator::new(4, 3);
        let s = a.alloc_seq();
        a.extend(&[(s, 0, 5)]).unwrap();
        assert_eq!(a.used_blocks(), 2);
        assert_eq!(a.slot(s, 4).unwrap(), 4);
        a.extend(&[(s, 5, 3)]).unwrap();
        assert_eq!(a.used_blocks(), 2, "positions 5..8 fit in the second block");
        let t = a.alloc_seq();
        a.extend(&[(t, 0, 1)]).unwrap();
        assert_eq!(a.slot(t, 0).unwrap(), 8);
        let err = a.extend(&[(s, 8, 1)]).unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
        assert_eq!(a.seq_len(s), 8, "a failed extend changes nothing");
        a.free_seq(s);
        assert_eq!(a.used_blocks(), 1);
        let u = a.alloc_seq();
        assert_eq!(u, s, "the freed sequence id is reused");
        a.extend(&[(u, 0, 8)]).unwrap();
        assert!(
            a.extend(&[(t, 0, 1)]).is_err(),
            "a batch must continue a sequence at its length"
        );
    }

    #[test]
    fn a_batch_takes_its_blocks_all_or_none() {
        let mut a = BlockAllocator::new(4, 3);
        let (s, t) = (a.alloc_seq(), a.alloc_seq());
        let err = a.extend(&[(s, 0, 8), (t, 0, 5)]).unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
        assert_eq!((a.used_blocks(), a.seq_len(s), a.seq_len(t)), (0, 0, 0));
        a.extend(&[(s, 0, 8), (t, 0, 4)]).unwrap();
        assert_eq!((a.free_blocks(), a.used_tokens()), (0, 12));
    }

    #[test]
    fn grown_blocks_are_the_ones_the_batch_then_writes() {
        let mut a = BlockAllocator::new(16, 4);
        let (s, t) = (a.alloc_seq(), a.alloc_seq());
        assert!(a.grow(s, 1));
        assert_eq!((a.used_blocks(), a.held_by(s), a.seq_len(s)), (1, 1, 0));
        assert!(a.grow(s, 16), "still within the first block");
        assert_eq!(a.used_blocks(), 1);
        assert!(a.grow(s, 17));
        assert!(a.grow(t, 32));
        assert_eq!(a.free_blocks(), 0);
        assert!(!a.grow(s, 33), "no block left");
        assert_eq!(a.held_by(s), 2, "a failed grow takes nothing");
        assert_eq!(a.max_tokens_for(s), 32);
        // The batch writing the grown positions needs no block of its own: it cannot fail for room.
        a.extend(&[(s, 0, 20), (t, 0, 32)]).unwrap();
        assert_eq!((a.used_blocks(), a.used_tokens()), (4, 52));
        a.free_seq(t);
        assert_eq!(a.free_blocks(), 2);
        assert_eq!(a.max_tokens_for(s), 64);
        assert_eq!(a.shortfall(s, 40), 1);
        assert!(!a.grow(SeqId(7), 1), "an unknown sequence takes nothing");
        a.free_seq(s);
        assert_eq!(a.used_blocks(), 0);
    }
}

#[cfg(test)]
mod prefix_tests;
