//! The key/value cache: what a running sequence keeps of its past tokens, per attention layer.
//!
//! Sequences get a [`SeqId`] when they start and give it back when they end; their keys and values grow as they
//! do, up to the cache's token capacity, after which appending fails with a clear error instead of growing.
//! [`BlockPool`] counts that capacity in fixed-size blocks for the scheduler, which grows a sequence's blocks
//! before each step so that the cache itself is never asked for more than it has.

mod blocks;

pub use blocks::BlockPool;

use crate::{Error, Result};

/// A running sequence's handle into the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// The shape of a KV cache.
#[derive(Clone, Debug)]
pub struct KvSpec {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens the cache may hold across all sequences.
    pub capacity_tokens: usize,
}

impl KvSpec {
    pub fn bytes_per_token(&self, bytes_per_value: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value
    }
}

/// What a scheduler needs of any backend's KV cache: sequence handles to take and give back.
pub trait SeqStore {
    fn alloc_seq(&mut self) -> SeqId;
    /// Frees everything `seq` holds at once; its id may be handed out again.
    fn free_seq(&mut self, seq: SeqId);
}

impl SeqStore for HostKv {
    fn alloc_seq(&mut self) -> SeqId {
        HostKv::alloc_seq(self)
    }

    fn free_seq(&mut self, seq: SeqId) {
        HostKv::free_seq(self, seq)
    }
}

/// One sequence's keys and values in host memory: per layer, `[positions, kv_heads * head_dim]` rows.
#[derive(Default)]
struct HostSeq {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

/// The KV cache in host memory (the CPU backend's).
pub struct HostKv {
    spec: KvSpec,
    seqs: Vec<Option<HostSeq>>,
}

impl HostKv {
    pub fn new(spec: KvSpec) -> Self {
        HostKv {
            spec,
            seqs: Vec::new(),
        }
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    pub fn alloc_seq(&mut self) -> SeqId {
        let fresh = HostSeq {
            keys: vec![Vec::new(); self.spec.num_layers],
            values: vec![Vec::new(); self.spec.num_layers],
        };
        match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = Some(fresh);
                SeqId(i as u32)
            }
            None => {
                self.seqs.push(Some(fresh));
                SeqId(self.seqs.len() as u32 - 1)
            }
        }
    }

    pub fn free_seq(&mut self, seq: SeqId) {
        if let Some(slot) = self.seqs.get_mut(seq.0 as usize) {
            *slot = None;
        }
    }

    fn row_width(&self) -> usize {
        self.spec.num_kv_heads * self.spec.head_dim
    }

    /// Tokens cached for `seq` (in layer 0, which every forward writes first).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seq(seq)
            .map_or(0, |s| s.keys[0].len() / self.row_width())
    }

    pub fn used_tokens(&self) -> usize {
        let width = self.row_width();
        self.seqs
            .iter()
            .flatten()
            .map(|s| s.keys[0].len() / width)
            .sum()
    }

    fn seq(&self, seq: SeqId) -> Result<&HostSeq> {
        self.seqs
            .get(seq.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))
    }

    /// Appends `rows` rows of keys and values to `seq` at `layer`; the sequence must be at `start_pos`.
    pub fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        start_pos: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let width = self.row_width();
        let new_tokens = keys.len() / width;
        if layer == 0 && self.used_tokens() + new_tokens > self.spec.capacity_tokens {
            return Err(Error::Kv(format!(
                "full: {} tokens cached, {new_tokens} more do not fit in a capacity of {}",
                self.used_tokens(),
                self.spec.capacity_tokens
            )));
        }
        let entry = self
            .seqs
            .get_mut(seq.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))?;
        let cached = entry.keys[layer].len() / width;
        if cached != start_pos {
            return Err(Error::Kv(format!(
                "sequence {} has {cached} cached tokens at layer {layer}, batch starts at position {start_pos}",
                seq.0
            )));
        }
        entry.keys[layer].extend_from_slice(keys);
        entry.values[layer].extend_from_slice(values);
        Ok(())
    }

    /// All cached keys and values of `seq` at `layer`.
    pub fn layer(&self, seq: SeqId, layer: usize) -> Result<(&[f32], &[f32])> {
        let s = self.seq(seq)?;
        Ok((&s.keys[layer], &s.values[layer]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity_tokens: usize) -> KvSpec {
        KvSpec {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 2,
            capacity_tokens,
        }
    }

    #[test]
    fn sequences_grow_and_free_their_slots() {
        let mut kv = HostKv::new(spec(8));
        let a = kv.alloc_seq();
        let b = kv.alloc_seq();
        kv.append(a, 0, 0, &[1.0; 6], &[2.0; 6]).unwrap();
        kv.append(a, 1, 0, &[1.0; 6], &[2.0; 6]).unwrap();
        assert_eq!(kv.seq_len(a), 3);
        assert_eq!(kv.seq_len(b), 0);
        assert!(
            kv.append(a, 0, 0, &[1.0; 2], &[1.0; 2]).is_err(),
            "wrong start position"
        );
        kv.free_seq(a);
        assert_eq!(kv.used_tokens(), 0);
        assert_eq!(kv.alloc_seq(), a, "a freed slot is reused");
    }

    #[test]
    fn a_full_cache_is_an_error_not_a_crash() {
        let mut kv = HostKv::new(spec(2));
        let a = kv.alloc_seq();
        let err = kv.append(a, 0, 0, &[0.0; 6], &[0.0; 6]).unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
    }
}
