//! The scheduler's budget of KV capacity, counted in fixed-size blocks of token positions: a sequence holds only
//! the blocks its cached tokens fill, taken one at a time as it grows (never reserved up front for max_tokens).
//! The scheduler asks here before it runs a step, so running out of KV is a scheduling decision (wait, or preempt
//! a sequence) instead of an error in the middle of a forward pass. Pure accounting: where the blocks physically
//! live is the cache's business (the device cache's [`super::BlockAllocator`]); a pool no larger than the cache,
//! with the same block size, guarantees the cache never runs out.

use std::collections::HashMap;

use super::SeqId;

/// Free and used blocks of a KV cache of `total` blocks of `block_size` tokens.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    total: usize,
    held: HashMap<SeqId, usize>,
    used: usize,
}

impl BlockPool {
    pub fn new(block_size: usize, total: usize) -> Self {
        assert!(block_size > 0, "a KV block holds at least one token");
        BlockPool {
            block_size,
            total,
            held: HashMap::new(),
            used: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn used(&self) -> usize {
        self.used
    }

    pub fn free(&self) -> usize {
        self.total - self.used
    }

    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.total * self.block_size
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    pub fn held_by(&self, seq: SeqId) -> usize {
        self.held.get(&seq).copied().unwrap_or(0)
    }

    /// Extra blocks `seq` needs to hold `tokens` positions in all.
    pub fn shortfall(&self, seq: SeqId, tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(self.held_by(seq))
    }

    /// The most positions `seq` can hold in all with the blocks it has plus every free one.
    pub fn max_tokens_for(&self, seq: SeqId) -> usize {
        (self.held_by(seq) + self.free()) * self.block_size
    }

    /// Grows `seq` to hold `tokens` positions; false (and nothing taken) when too few blocks are free.
    pub fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        let extra = self.shortfall(seq, tokens);
        if extra > self.free() {
            return false;
        }
        *self.held.entry(seq).or_default() += extra;
        self.used += extra;
        true
    }

    /// Gives back every block of `seq`.
    pub fn release(&mut self, seq: SeqId) {
        if let Some(n) = self.held.remove(&seq) {
            self.used -= n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_take_blocks_as_they_grow_and_give_them_back() {
        let mut pool = BlockPool::new(16, 4);
        let (a, b) = (SeqId(0), SeqId(1));
        assert!(pool.grow(a, 1));
        assert_eq!((pool.used(), pool.held_by(a)), (1, 1));
        assert!(pool.grow(a, 16), "still within the first block");
        assert_eq!(pool.used(), 1);
        assert!(pool.grow(a, 17));
        assert_eq!(pool.used(), 2);
        assert!(pool.grow(b, 32));
        assert_eq!(pool.free(), 0);
        assert!(!pool.grow(a, 33), "no block left");
        assert_eq!(pool.held_by(a), 2, "a failed grow takes nothing");
        assert_eq!(pool.max_tokens_for(a), 32);
        pool.release(b);
        assert_eq!(pool.free(), 2);
        assert_eq!(pool.max_tokens_for(a), 64);
        assert!(pool.grow(a, 33));
        pool.release(a);
        assert_eq!(pool.used(), 0);
    }
}
