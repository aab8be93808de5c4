//! Paged KV bookkeeping: the cache is cut into blocks of `block_size` token slots; a sequence owns a list of
//! blocks that grows as it does and returns to the pool when it ends. Pure logic, shared by device caches.

use super::SeqId;
use crate::{Error, Result};

struct SeqBlocks {
    blocks: Vec<u32>,
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

    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn used_tokens(&self) -> usize {
        self.seqs.iter().flatten().map(|s| s.len).sum()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks `seq` needs to grow by `len` tokens from `start_pos`, which must be its current length.
    pub fn blocks_needed(&self, seq: SeqId, start_pos: usize, len: usize) -> Result<usize> {
        let s = self.get(seq)?;
        if s.len != start_pos {
            return Err(Error::Kv(format!(
                "sequence {} holds {} tokens, the batch continues it at position {start_pos}",
                seq.0, s.len
            )));
        }
        Ok((start_pos + len)
            .div_ceil(self.block_size)
            .saturating_sub(s.blocks.len()))
    }

    /// Extends `seq` by `len` tokens starting at `start_pos` (which must be its current length), taking blocks as
    /// needed; on failure nothing changes.
    pub fn extend(&mut self, seq: SeqId, start_pos: usize, len: usize) -> Result<()> {
        let needed = self.blocks_needed(seq, start_pos, len)?;
        if needed > self.free.len() {
            return Err(Error::Kv(format!(
                "full: {needed} more blocks of {} tokens needed, {} free of {}",
                self.block_size,
                self.free.len(),
                self.num_blocks
            )));
        }
        let taken = self.free.split_off(self.free.len() - needed);
        let s = self.seqs[seq.0 as usize]
            .as_mut()
            .expect("blocks_needed checked the sequence");
        s.blocks.extend(taken.into_iter().rev());
        s.len = start_pos + len;
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
        a.extend(s, 0, 5).unwrap();
        assert_eq!(a.used_blocks(), 2);
        assert_eq!(a.slot(s, 4).unwrap(), 4);
        a.extend(s, 5, 3).unwrap();
        assert_eq!(a.used_blocks(), 2, "positions 5..8 fit in the second block");
        let t = a.alloc_seq();
        a.extend(t, 0, 1).unwrap();
        assert_eq!(a.slot(t, 0).unwrap(), 8);
        let err = a.extend(s, 8, 1).unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
        assert_eq!(a.seq_len(s), 8, "a failed extend changes nothing");
        a.free_seq(s);
        assert_eq!(a.used_blocks(), 1);
        let u = a.alloc_seq();
        assert_eq!(u, s, "the freed sequence id is reused");
        a.extend(u, 0, 8).unwrap();
        assert!(
            a.extend(t, 0, 1).is_err(),
            "a batch must continue a sequence at its length"
        );
    }
}
