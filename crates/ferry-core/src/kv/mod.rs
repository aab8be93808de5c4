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
pub mod prefix;
pub mod recurrent;

pub use blocks::{BlockAllocator, Reused};
pub use prefix::PrefixStats;
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
    /// For what starts and ends no sequence: growing, and prefix caching's lookups and publishing. Sequences
    /// start and end through [`alloc_seq`](Self::alloc_seq) and [`free_seq`](Self::free_seq), which also keep
    /// their recurrent state.
    fn blocks_mut(&mut self) -> &mut BlockAllocator;
    /// Whether sequences carry recurrent state (a hybrid model): a cached prefix is then reusable only as far as
    /// a saved state goes.
    fn has_recurrent_state(&self) -> bool;
    /// Takes blocks for `seq` to hold `tokens` positions in all, ahead of the batch that writes them
    /// ([`BlockAllocator::grow`]); false, taking nothing, when too few are free.
    #[must_use = "a sequence that could not grow must not be given the tokens"]
    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool;
}

/// A running sequence's handle into the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// What one attention layer keeps per token: `num_kv_heads` keys and as many values, of `head_dim` each; or, in a
/// latent layer (multi-head latent attention, DeepSeek-V3's MLA), one row of `head_dim` features (the compressed kv
/// and the shared RoPE key, which every head expands on its own) and no values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub latent: bool,
}

impl KvLayerSpec {
    /// A layer of `num_kv_heads` keys and values of `head_dim` each.
    pub fn heads(num_kv_heads: usize, head_dim: usize) -> Self {
        KvLayerSpec {
            num_kv_heads,
            head_dim,
            latent: false,
        }
    }

    /// A latent layer of `width` features per token.
    pub fn latent(width: usize) -> Self {
        KvLayerSpec {
            num_kv_heads: 1,
            head_dim: width,
            latent: true,
        }
    }

    /// Features of one token's keys (a latent layer's whole row).
    pub fn width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Features of one token's values: none in a latent layer.
    pub fn value_width(&self) -> usize {
        match self.latent {
            true => 0,
            false => self.width(),
        }
    }

    /// Features one token keeps in this layer, keys and values together.
    pub fn features_per_token(&self) -> usize {
        self.width() + self.value_width()
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

/// One sequence's own part of the host cache (its keys and values live in the shared pools, by block).
struct HostSeq {
    /// Per Gated DeltaNet layer.
    recurrent: Vec<RecurrentLayer>,
}

/// The KV cache in host memory (the CPU backend's), laid out as the device cache is: per attention layer, keys and
/// values by token slot (block * [`BLOCK_SIZE`] + offset) of the blocks its [`BlockAllocator`] hands out, so
/// sequences share cached prefix blocks here too. The pools grow to the highest block used, not the capacity.
pub struct HostKv {
    spec: KvSpec,
    blocks: BlockAllocator,
    /// Per attention layer, `[slots, width]` rows.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Indexed like the allocator's sequences.
    seqs: Vec<Option<HostSeq>>,
    /// Recurrent-state snapshots by slot (prefix caching of a hybrid model).
    snapshots: Vec<Option<Vec<RecurrentLayer>>>,
}

/// One sequence's keys and values in one attention layer, by position.
pub struct LayerView<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    blocks: &'a [u32],
    width: usize,
    value_width: usize,
    len: usize,
}

impl LayerView<'_> {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slot(&self, pos: usize) -> usize {
        self.blocks[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE
    }

    /// The keys of position `pos` (`kv_heads * head_dim`; a latent layer's row).
    pub fn key(&self, pos: usize) -> &[f32] {
        let slot = self.slot(pos);
        &self.keys[slot * self.width..(slot + 1) * self.width]
    }

    /// The values of position `pos` (empty in a latent layer).
    pub fn value(&self, pos: usize) -> &[f32] {
        let slot = self.slot(pos);
        &self.values[slot * self.value_width..(slot + 1) * self.value_width]
    }
}

impl HostKv {
    pub fn new(spec: KvSpec) -> Self {
        let blocks = BlockAllocator::new(BLOCK_SIZE, spec.capacity_tokens.div_ceil(BLOCK_SIZE));
        HostKv {
            keys: vec![Vec::new(); spec.layers.len()],
            values: vec![Vec::new(); spec.layers.len()],
            spec,
            blocks,
            seqs: Vec::new(),
            snapshots: Vec::new(),
        }
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
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
        self.blocks.extend(slices)?;
        let mut highest = 0;
        for &(seq, _, _) in slices {
            highest = highest.max(self.blocks.blocks(seq)?.iter().max().map_or(0, |&b| b as usize + 1));
        }
        for (layer, spec) in self.spec.layers.iter().enumerate() {
            let slots = highest * BLOCK_SIZE;
            if self.keys[layer].len() < slots * spec.width() {
                self.keys[layer].resize(slots * spec.width(), 0.0);
                self.values[layer].resize(slots * spec.value_width(), 0.0);
            }
        }
        Ok(())
    }

    /// The shape of attention layer `layer`'s keys and values.
    pub fn layer_spec(&self, layer: usize) -> Result<KvLayerSpec> {
        self.spec
            .layers
            .get(layer)
            .copied()
            .ok_or_else(|| Error::Kv(format!("no KV layer {layer} of {}", self.spec.layers.len())))
    }

    /// Writes rows of keys and values of `seq` at `layer` from `start_pos`: the last positions its batch reserved.
    /// A latent layer takes its rows as `keys` and no values.
    pub fn append(&mut self, seq: SeqId, layer: usize, start_pos: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let spec = self.layer_spec(layer)?;
        let (width, value_width) = (spec.width(), spec.value_width());
        let rows = keys.len() / width;
        if !keys.len().is_multiple_of(width) || values.len() != rows * value_width {
            return Err(Error::Shape(format!(
                "{} keys and {} values for KV layer {layer}, rows of {width} and {value_width}",
                keys.len(),
                values.len()
            )));
        }
        let reserved = self.blocks.seq_len(seq);
        if start_pos + rows != reserved {
            return Err(Error::Kv(format!(
                "sequence {} has {reserved} positions reserved, layer {layer} writes {rows} from position {start_pos}",
                seq.0
            )));
        }
        for r in 0..rows {
            let slot = self.blocks.slot(seq, start_pos + r)? as usize;
            self.keys[layer][slot * width..(slot + 1) * width].copy_from_slice(&keys[r * width..(r + 1) * width]);
            self.values[layer][slot * value_width..(slot + 1) * value_width]
                .copy_from_slice(&values[r * value_width..(r + 1) * value_width]);
        }
        Ok(())
    }

    /// The recurrent state of `seq` in Gated DeltaNet layer `layer`.
    pub fn recurrent(&mut self, seq: SeqId, layer: usize) -> Result<&mut RecurrentLayer> {
        self.seq_mut(seq)?
            .recurrent
            .get_mut(layer)
            .ok_or_else(|| Error::Kv(format!("no recurrent state for layer {layer}")))
    }

    /// The keys and values of `seq` at `layer`, every position it holds.
    pub fn layer(&self, seq: SeqId, layer: usize) -> Result<LayerView<'_>> {
        let spec = self.layer_spec(layer)?;
        Ok(LayerView {
            keys: &self.keys[layer],
            values: &self.values[layer],
            blocks: self.blocks.blocks(seq)?,
            width: spec.width(),
            value_width: spec.value_width(),
            len: self.blocks.seq_len(seq),
        })
    }

    /// Copies `seq`'s recurrent state into snapshot slot `slot`.
    pub fn save_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        let state = self.seq_mut(seq)?.recurrent.clone();
        if self.snapshots.len() <= slot {
            self.snapshots.resize_with(slot + 1, || None);
        }
        self.snapshots[slot] = Some(state);
        Ok(())
    }

    /// Replaces `seq`'s recurrent state with snapshot `slot`'s.
    pub fn restore_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        let state = self
            .snapshots
            .get(slot)
            .and_then(Option::clone)
            .ok_or_else(|| Error::Kv(format!("no recurrent-state snapshot in slot {slot}")))?;
        self.seq_mut(seq)?.recurrent = state;
        Ok(())
    }
}

impl KvCache for HostKv {
    fn alloc_seq(&mut self) -> SeqId {
        let recurrent = match &self.spec.recurrent {
            Some(r) => vec![RecurrentLayer::new(r); r.num_layers],
            None => Vec::new(),
        };
        let seq = self.blocks.alloc_seq();
        let index = seq.0 as usize;
        if self.seqs.len() <= index {
            self.seqs.resize_with(index + 1, || None);
        }
        self.seqs[index] = Some(HostSeq { recurrent });
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

    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        &mut self.blocks
    }

    fn has_recurrent_state(&self) -> bool {
        self.spec.recurrent.is_some()
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
                KvLayerSpec::heads(1, 2),
                KvLayerSpec::heads(2, 4),
                KvLayerSpec::latent(3),
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
        assert_eq!(kv.layer(a, 1).unwrap().len(), 3);
        assert_eq!(kv.layer(a, 1).unwrap().key(2), &[1.0; 8]);
        kv.append(a, 2, 0, &[3.0; 9], &[]).unwrap();
        assert_eq!(
            (kv.layer(a, 2).unwrap().key(1), kv.layer(a, 2).unwrap().value(1)),
            (&[3.0; 3][..], &[][..]),
            "a latent layer keeps one row of 3 per token and no values"
        );
        assert!(
            matches!(kv.append(a, 2, 0, &[3.0; 9], &[3.0; 9]), Err(Error::Shape(_))),
            "a latent layer takes no values"
        );
        assert!(kv.layer(a, 3).is_err(), "three KV layers");
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
