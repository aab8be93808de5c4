//! The key/value cache: what a running sequence keeps of its past tokens, per attention layer, and, for hybrid
//! models, its recurrent-state slot ([`recurrent`]).
//!
//! Sequences get a [`SeqId`] when they start and give it back when they end; their keys and values grow as they
//! do, up to the cache's capacity, after which appending fails with a clear error instead of growing. The
//! recurrent state is allocated with the sequence and freed with it. Every cache counts its capacity in blocks
//! with one [`BlockAllocator`], which is also the scheduler's budget: it grows a sequence's blocks before each
//! step, so the cache is never asked for more than it has (running out is a scheduling decision, not an error
//! mid-forward).

mod blocks;
pub mod recurrent;

pub use blocks::BlockAllocator;
pub use recurrent::{RecurrentLayer, RecurrentSpec};

use crate::{Error, Result};

/// Tokens per block of a KV cache's [`BlockAllocator`] (the device cache's pages), whose size the attention kernel
/// fixes.
pub const BLOCK_SIZE: usize = ferry_kernels::constants::KV_BLOCK_SIZE;

/// What the engine needs of any backend's KV cache: sequences come and go, and the cache's blocks, the one count
/// of its capacity, say who holds how much.
pub trait KvCache: Send {
    fn alloc_seq(&mut self) -> SeqId;
    /// Ends a sequence and frees its room at once.
    fn free_seq(&mut self, seq: SeqId);
    fn blocks(&self) -> &BlockAllocator;
    /// Takes blocks for `seq` to hold `tokens` positions in all, ahead of the batch that writes them
    /// ([`BlockAllocator::grow`]); false, taking nothing, when too few are free.
    #[must_use = "a sequence that could not grow must not be given the tokens"]
    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool;
}

/// A running sequence's handle into the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// What one attention layer keeps per token: `num_kv_heads` keys and as many values, of `head_dim` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayerSpec {
    /// Features of one token's keys (or values).
    pub fn width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// The shape of a KV cache.
#[derive(Clone, Debug)]
pub struct KvSpec {
    /// Per attention layer, in order (a hybrid model's Gated DeltaNet layers keep no keys and values); layers may
    /// differ in width.
    pub layers: Vec<KvLayerSpec>,
    /// Tokens the cache may hold across all sequences.
    pub capacity_tokens: usize,
    /// Each sequence's recurrent state, for models with Gated DeltaNet layers.
    pub recurrent: Option<RecurrentSpec>,
}

/// One sequence's keys and values in host memory: per layer, `[positions, kv_heads * head_dim]` rows.
struct HostSeq {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Per Gated DeltaNet layer.
    recurrent: Vec<RecurrentLayer>,
}

/// The KV cache in host memory (the CPU backend's): its capacity is counted in blocks of [`BLOCK_SIZE`] tokens,
/// as the device cache's is, though each sequence's keys and values are one growing array per layer.
pub struct HostKv {
    spec: KvSpec,
    /// Each sequence's length and its share of the capacity; indexed like `seqs`.
    blocks: BlockAllocator,
    seqs: Vec<Option<HostSeq>>,
}

impl HostKv {
    pub fn new(spec: KvSpec) -> Self {
        let blocks = BlockAllocator::new(BLOCK_SIZE, spec.capacity_tokens.div_ceil(BLOCK_SIZE));
        HostKv {
            spec,
            blocks,
            seqs: Vec::new(),
        }
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    fn seq(&self, seq: SeqId) -> Result<&HostSeq> {
        self.seqs
            .get(seq.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut HostSeq> {
        self.seqs
            .get_mut(seq.0 as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))
    }

    /// Reserves room for a batch's slices, all or none: each must continue its sequence where it ends, and the
    /// cache must hold the new tokens.
    pub fn reserve(&mut self, slices: &[(SeqId, usize, usize)]) -> Result<()> {
        self.blocks.extend(slices)
    }

    /// The shape of attention layer `layer`'s keys and values.
    pub fn layer_spec(&self, layer: usize) -> Result<KvLayerSpec> {
        self.spec
            .layers
            .get(layer)
            .copied()
            .ok_or_else(|| Error::Kv(format!("no KV layer {layer} of {}", self.spec.layers.len())))
    }

    /// Appends rows of keys and values to `seq` at `layer`; the sequence must be at `start_pos` in that layer.
    pub fn append(&mut self, seq: SeqId, layer: usize, start_pos: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let width = self.layer_spec(layer)?.width();
        if keys.len() != values.len() || !keys.len().is_multiple_of(width) {
            return Err(Error::Shape(format!(
                "{} keys and {} values for KV layer {layer}, rows of {width}",
                keys.len(),
                values.len()
            )));
        }
        let entry = self.seq_mut(seq)?;
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

    /// The recurrent state of `seq` in Gated DeltaNet layer `layer`.
    pub fn recurrent(&mut self, seq: SeqId, layer: usize) -> Result<&mut RecurrentLayer> {
        self.seq_mut(seq)?
            .recurrent
            .get_mut(layer)
            .ok_or_else(|| Error::Kv(format!("no recurrent state for layer {layer}")))
    }

    /// All cached keys and values of `seq` at `layer`.
    pub fn layer(&self, seq: SeqId, layer: usize) -> Result<(&[f32], &[f32])> {
        self.layer_spec(layer)?;
        let s = self.seq(seq)?;
        Ok((&s.keys[layer], &s.values[layer]))
    }
}

impl KvCache for HostKv {
    fn alloc_seq(&mut self) -> SeqId {
        let recurrent = match &self.spec.recurrent {
            Some(r) => vec![RecurrentLayer::new(r); r.num_layers],
            None => Vec::new(),
        };
        let fresh = HostSeq {
            keys: vec![Vec::new(); self.spec.layers.len()],
            values: vec![Vec::new(); self.spec.layers.len()],
            recurrent,
        };
        let seq = self.blocks.alloc_seq();
        let index = seq.0 as usize;
        if self.seqs.len() <= index {
            self.seqs.resize_with(index + 1, || None);
        }
        self.seqs[index] = Some(fresh);
        seq
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.blocks.free_seq(seq);
        if let Some(slot) = self.seqs.get_mut(seq.0 as usize) {
            *slot = None;
        }
    }

    fn blocks(&self) -> &BlockAllocator {
        &self.blocks
    }

    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.blocks.grow(seq, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity_tokens: usize) -> KvSpec {
        KvSpec {
            layers: vec![
                KvLayerSpec {
                    num_kv_heads: 1,
                    head_dim: 2,
                },
                KvLayerSpec {
                    num_kv_heads: 2,
                    head_dim: 4,
                },
            ],
            capacity_tokens,
            recurrent: Some(RecurrentSpec {
                num_layers: 1,
                conv_channels: 2,
                conv_kernel: 3,
                num_heads: 1,
                k_head_dim: 2,
                v_head_dim: 2,
            }),
        }
    }

    #[test]
    fn sequences_grow_and_free_their_slots() {
        let mut kv = HostKv::new(spec(8));
        assert_eq!(
            kv.blocks().capacity_tokens(),
            BLOCK_SIZE,
            "capacity comes in whole blocks"
        );
        let a = kv.alloc_seq();
        let b = kv.alloc_seq();
        kv.reserve(&[(a, 0, 3)]).unwrap();
        kv.append(a, 0, 0, &[1.0; 6], &[2.0; 6]).unwrap();
        kv.append(a, 1, 0, &[1.0; 24], &[2.0; 24]).unwrap();
        assert!(
            matches!(kv.append(a, 1, 3, &[1.0; 6], &[2.0; 6]), Err(Error::Shape(_))),
            "layer 1's rows are 8 wide"
        );
        assert_eq!(kv.layer(a, 1).unwrap().0.len(), 24);
        assert!(kv.layer(a, 2).is_err(), "two KV layers");
        assert_eq!(kv.blocks().seq_len(a), 3);
        assert_eq!(kv.blocks().seq_len(b), 0);
        assert!(
            kv.reserve(&[(a, 0, 1)]).is_err(),
            "a batch must continue the sequence where it ends"
        );
        assert!(
            kv.append(a, 0, 0, &[1.0; 2], &[1.0; 2]).is_err(),
            "wrong start position"
        );
        kv.recurrent(a, 0).unwrap().delta[0] = 1.0;
        kv.free_seq(a);
        assert_eq!(kv.blocks().used_tokens(), 0);
        assert_eq!(kv.alloc_seq(), a, "a freed slot is reused");
        let state = kv.recurrent(a, 0).unwrap();
        assert_eq!(
            (state.conv.len(), state.delta.len()),
            (4, 4),
            "[K - 1, C] and [H, dk, dv]"
        );
        assert!(
            state.delta.iter().all(|&v| v == 0.0),
            "a reused slot starts from a fresh recurrent state"
        );
        assert!(kv.recurrent(a, 1).is_err(), "one Gated DeltaNet layer");
    }

    #[test]
    fn a_full_cache_is_an_error_not_a_crash() {
        let mut kv = HostKv::new(spec(2));
        let a = kv.alloc_seq();
        let err = kv.reserve(&[(a, 0, BLOCK_SIZE + 1)]).unwrap_err();
        assert!(err.to_string().contains("full"), "{err}");
        assert_eq!(kv.blocks().seq_len(a), 0, "a refused batch reserves nothing");
    }
}
