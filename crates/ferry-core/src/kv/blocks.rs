//! Paged KV bookkeeping, the one count of a cache's capacity: the cache is cut into blocks of `block_size` token
//! slots; a sequence owns a list of blocks that grows as it does and returns to the pool when it ends. Every
//! [`super::KvCache`] keeps one, and the scheduler budgets against it: it grows a sequence's blocks before each
//! step ([`BlockAllocator::grow`]), so running out of KV is a scheduling decision (wait, or preempt a sequence)
//! instead of an error in the middle of a forward pass, and the forward pass finds its blocks already taken.
//! Pure logic: where the slots physically live is the cache's business.

use super::SeqId;
use crate::{Error, Result};

struct SeqBlocks {
    blocks: Vec<u32>,
    /// Positions written (or being written by the batch in flight); the blocks may hold more.
    len: usize,
}

pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    free: Vec<u32>,
    seqs: Vec<Option<SeqBlocks>>,
}

impl BlockAllocator {
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        assert!(block_size > 0, "a KV block holds at least one token");
        BlockAllocator {
            block_size,
            num_blocks,
            // Reversed so blocks are handed out from 0 upwards.
            free: (0..num_blocks as u32).rev().collect(),
            seqs: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
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

    /// Ends `seq`; its blocks are free at once.
    pub fn free_seq(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq.0 as usize).and_then(Option::take) {
            self.free.extend(s.blocks.into_iter().rev());
        }
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
        let s = self.seqs.get_mut(seq.0 as usize)?.as_mut()?;
        if extra > self.free.len() {
            return None;
        }
        s.blocks.extend(self.free.drain(self.free.len() - extra..).rev());
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
        if needed > self.free.len() {
            return Err(Error::Kv(format!(
                "full: the batch needs {needed} more blocks of {} tokens, {} of {} are free",
                self.block_size,
                self.free.len(),
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
