//! The KV cache in device memory: per layer, a key pool and a value pool (a latent layer: one pool of latent rows)
//! of `BLOCK_SIZE`-token blocks, handed
//! to sequences by a [`BlockAllocator`] as they grow; and, for hybrid models, each sequence's recurrent state
//! (one zeroed allocation per sequence, made when it starts: see gdn.cu for its layout) and, with prefix caching,
//! snapshots of it in slots the memory plan counted, copied on the device.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::cuda_err;
use super::flash_attention::PrefillSlices;
use super::launch::{ptr, Ptr};
use crate::backend::SeqSlice;
use crate::kv::{BlockAllocator, KvCache, KvLayerSpec, KvSpec, RecurrentSpec, SeqId, BLOCK_SIZE};
use crate::{Error, Result};

pub struct DeviceKv {
    blocks: BlockAllocator,
    layers: Vec<KvLayerSpec>,
    keys: Vec<CudaSlice<f32>>,
    values: Vec<CudaSlice<f32>>,
    recurrent: Option<RecurrentSpec>,
    /// By sequence id: the recurrent state of every Gated DeltaNet layer.
    states: Vec<Option<CudaSlice<f32>>>,
    /// By snapshot slot: a saved recurrent state, allocated when the slot is first filled.
    snapshots: Vec<Option<CudaSlice<f32>>>,
}

/// Where one Gated DeltaNet layer's state sits inside a sequence's recurrent-state allocation (in floats).
pub struct RecurrentOffsets {
    pub conv: usize,
    pub delta: usize,
}

/// The slices of a batch of a hybrid model, for the Gated DeltaNet kernels.
pub struct RecurrentBatch {
    pub(super) slices: usize,
    pub(super) row_slice: CudaSlice<u32>,
    pub(super) slice_start_row: CudaSlice<u32>,
    pub(super) slice_len: CudaSlice<u32>,
    /// `slice_len` on the host, to choose the delta-rule kernels.
    pub(super) lens: Vec<usize>,
    /// Each slice's sequence's recurrent-state base address.
    pub(super) slice_state: CudaSlice<u64>,
}

/// A batch's per-row metadata on the device, read by every layer: pointers into one buffer of u32 words that a step
/// uploads at once (see [`BatchWords`]).
pub struct DeviceBatch {
    /// The buffer the pointers point into when the batch owns it (an eager step); None when they point into a
    /// captured step's persistent inputs (graph.rs).
    _words: Option<CudaSlice<u32>>,
    pub(super) positions: Ptr<u32>,
    /// The physical token slot each row's key and value go to.
    pub(super) row_slot: Ptr<u32>,
    /// Where in `block_tables` each row's sequence's block table starts.
    pub(super) row_table: Ptr<u32>,
    /// The block tables of the batch's sequences, one after another.
    pub(super) block_tables: Ptr<u32>,
    /// The keys attention sizes its splits for: the longest sequence of the batch rounded up by [`key_span`].
    pub(super) key_span: usize,
    pub(super) recurrent: Option<RecurrentBatch>,
    /// The slices of a batch with a prefill, for the prefill attention kernel.
    pub(super) prefill: Option<PrefillSlices>,
}

/// A batch's per-row metadata on the host, laid out as the device reads it: positions, KV slots and block-table
/// starts (a word per row each), then the block tables.
pub(super) struct BatchWords {
    pub(super) words: Vec<u32>,
    pub(super) layout: BatchLayout,
}

/// Where a batch's words sit: what the device needs besides their address.
#[derive(Clone, Copy, Debug)]
pub(super) struct BatchLayout {
    pub(super) rows: usize,
    pub(super) key_span: usize,
}

impl BatchLayout {
    /// The batch on the device, its words at `base` (owned by `words` when the batch owns them).
    pub(super) fn on_device(&self, base: Ptr<u32>, words: Option<CudaSlice<u32>>) -> DeviceBatch {
        DeviceBatch {
            _words: words,
            positions: base,
            row_slot: base.offset(self.rows),
            row_table: base.offset(2 * self.rows),
            block_tables: base.offset(3 * self.rows),
            key_span: self.key_span,
            recurrent: None,
            prefill: None,
        }
    }

    /// The most words a batch of these rows takes in a cache of `num_blocks` blocks (each sequence's table at most
    /// every block).
    pub(super) fn words_for(&self, num_blocks: usize) -> usize {
        self.rows * (3 + num_blocks)
    }
}

/// The keys decode attention sizes its splits for, given the batch's longest sequence: `max_len` rounded up to a
/// multiple of an eighth of the power of two below it (at most 1/8 more; at least 256). A captured step's splits
/// hold while its sequences grow within one span, and the eager path splits the same way, so both give the same
/// bits.
pub(super) fn key_span(max_len: usize) -> usize {
    const MIN_SPAN: usize = 256;
    if max_len <= MIN_SPAN {
        return MIN_SPAN;
    }
    let below = 1usize << (usize::BITS - 1 - (max_len - 1).leading_zeros());
    max_len.next_multiple_of(below / 8)
}

impl DeviceKv {
    pub fn new(stream: &Arc<CudaStream>, spec: KvSpec) -> Result<Self> {
        let num_blocks = spec.capacity_tokens.div_ceil(BLOCK_SIZE).max(1);
        // A latent layer keeps no values: its value pool is a placeholder of one float (nothing allocates zero).
        let pool = |width: usize| -> Result<CudaSlice<f32>> {
            stream
                .alloc_zeros::<f32>((num_blocks * BLOCK_SIZE * width).max(1))
                .map_err(cuda_err("allocating the KV cache"))
        };
        Ok(DeviceKv {
            blocks: BlockAllocator::new(BLOCK_SIZE, num_blocks),
            keys: spec.layers.iter().map(|l| pool(l.width())).collect::<Result<_>>()?,
            values: spec
                .layers
                .iter()
                .map(|l| pool(l.value_width()))
                .collect::<Result<_>>()?,
            layers: spec.layers,
            recurrent: spec.recurrent,
            states: Vec::new(),
            snapshots: Vec::new(),
        })
    }

    /// Floats of one sequence's recurrent state.
    fn state_len(&self) -> Result<usize> {
        self.recurrent
            .as_ref()
            .map(|r| r.bytes_per_seq() / 4)
            .ok_or_else(|| Error::Kv("this model keeps no recurrent state".into()))
    }

    /// [`crate::backend::Backend::save_state`] on the device: one device-to-device copy on `stream`.
    pub(super) fn save_state(&mut self, stream: &Arc<CudaStream>, seq: SeqId, slot: usize) -> Result<()> {
        let len = self.state_len()?;
        let state = self
            .states
            .get(seq.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Kv(format!("sequence {} has no recurrent state to save", seq.0)))?;
        let snapshot = state_at(&mut self.snapshots, slot, stream, len)?;
        stream
            .memcpy_dtod(state, snapshot)
            .map_err(cuda_err("saving a recurrent state"))
    }

    /// [`crate::backend::Backend::restore_state`] on the device: one device-to-device copy on `stream`.
    pub(super) fn restore_state(&mut self, stream: &Arc<CudaStream>, seq: SeqId, slot: usize) -> Result<()> {
        let len = self.state_len()?;
        let snapshot = self
            .snapshots
            .get(slot)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Kv(format!("no recurrent-state snapshot in slot {slot}")))?;
        let state = state_at(&mut self.states, seq.0 as usize, stream, len)?;
        stream
            .memcpy_dtod(snapshot, state)
            .map_err(cuda_err("restoring a recurrent state"))
    }

    /// Gated DeltaNet layer `layer`'s conv and delta-rule state offsets in a sequence's recurrent state.
    pub(super) fn recurrent_offsets(&self, layer: usize) -> Result<RecurrentOffsets> {
        let r = self
            .recurrent
            .as_ref()
            .ok_or_else(|| Error::Kv("this model keeps no recurrent state".into()))?;
        let conv_len = (r.conv_kernel - 1) * r.conv_channels;
        let per_layer = conv_len + r.num_heads * r.k_head_dim * r.v_head_dim;
        Ok(RecurrentOffsets {
            conv: layer * per_layer,
            delta: layer * per_layer + conv_len,
        })
    }

    /// The recurrent state of each slice's sequence, zeroed for sequences that start with this batch.
    fn recurrent_batch(&mut self, stream: &Arc<CudaStream>, batch: &[SeqSlice]) -> Result<Option<RecurrentBatch>> {
        if self.recurrent.is_none() {
            return Ok(None);
        }
        let len = self.state_len()?;
        let (mut row_slice, mut slice_start_row, mut slice_len, mut slice_state) = (vec![], vec![], vec![], vec![]);
        for (i, s) in batch.iter().enumerate() {
            let index = s.seq.0 as usize;
            let allocated = self.states.get(index).is_some_and(Option::is_some);
            let state = state_at(&mut self.states, index, stream, len)?;
            if allocated && s.start_pos == 0 {
                stream
                    .memset_zeros(state)
                    .map_err(cuda_err("resetting a recurrent state"))?;
            }
            slice_state.push(state.device_ptr(stream).0);
            slice_start_row.push(row_slice.len() as u32);
            slice_len.push(s.len as u32);
            row_slice.extend(std::iter::repeat_n(i as u32, s.len));
        }
        let upload = |v: &[u32]| stream.clone_htod(v).map_err(cuda_err("uploading batch metadata"));
        Ok(Some(RecurrentBatch {
            slices: batch.len(),
            row_slice: upload(&row_slice)?,
            slice_start_row: upload(&slice_start_row)?,
            slice_len: upload(&slice_len)?,
            lens: batch.iter().map(|s| s.len).collect(),
            slice_state: stream
                .clone_htod(&slice_state)
                .map_err(cuda_err("uploading batch metadata"))?,
        }))
    }

    pub fn block_size(&self) -> usize {
        self.blocks.block_size()
    }

    /// Attention layer `layer`'s key and value pools, which must hold rows of `width` (kv heads times head_dim).
    pub(super) fn layer_pools(&self, layer: usize, width: usize) -> Result<(&CudaSlice<f32>, &CudaSlice<f32>)> {
        let rows = self.blocks.num_blocks() * BLOCK_SIZE;
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(keys), Some(values)) if keys.len() == rows * width && !self.layers[layer].latent => {
                Ok((keys, values))
            }
            _ => Err(Error::Shape(format!(
                "attention: KV layer {layer} of {} does not hold rows of {width}",
                self.keys.len()
            ))),
        }
    }

    /// Latent attention layer `layer`'s pool, which must hold latent rows of `width`.
    pub(super) fn latent_pool(&self, layer: usize, width: usize) -> Result<&CudaSlice<f32>> {
        let rows = self.blocks.num_blocks() * BLOCK_SIZE;
        match (self.keys.get(layer), self.layers.get(layer)) {
            (Some(latent), Some(spec)) if latent.len() == rows * width && spec.latent => Ok(latent),
            _ => Err(Error::Shape(format!(
                "mla_attention: KV layer {layer} of {} does not hold latent rows of {width}",
                self.keys.len()
            ))),
        }
    }

    /// Takes the blocks the batch's new tokens need (all or none) and lays out the batch's metadata.
    pub(super) fn batch_words(&mut self, batch: &[SeqSlice]) -> Result<BatchWords> {
        let slices: Vec<_> = batch.iter().map(|s| (s.seq, s.start_pos, s.len)).collect();
        self.blocks.extend(&slices)?;
        let rows: usize = batch.iter().map(|s| s.len).sum();
        let (mut positions, mut row_slot, mut row_table, mut block_tables) = (vec![], vec![], vec![], vec![]);
        for s in batch {
            let table_start = block_tables.len() as u32;
            block_tables.extend_from_slice(self.blocks.blocks(s.seq)?);
            for pos in s.start_pos..s.start_pos + s.len {
                positions.push(pos as u32);
                row_slot.push(self.blocks.slot(s.seq, pos)?);
                row_table.push(table_start);
            }
        }
        let mut words = positions;
        words.reserve(2 * rows + block_tables.len());
        words.extend(row_slot);
        words.extend(row_table);
        words.extend(block_tables);
        Ok(BatchWords {
            words,
            layout: BatchLayout {
                rows,
                key_span: key_span(batch.iter().map(|s| s.start_pos + s.len).max().unwrap_or(0)),
            },
        })
    }

    /// Takes the blocks the batch's new tokens need (all or none) and uploads the batch's metadata in one copy.
    pub fn prepare(&mut self, stream: &Arc<CudaStream>, batch: &[SeqSlice]) -> Result<DeviceBatch> {
        let words = self.batch_words(batch)?;
        let device = stream
            .clone_htod(&words.words)
            .map_err(cuda_err("uploading batch metadata"))?;
        let mut prepared = words.layout.on_device(ptr(&device), Some(device));
        prepared.recurrent = self.recurrent_batch(stream, batch)?;
        prepared.prefill = PrefillSlices::for_batch(stream, batch)?;
        Ok(prepared)
    }

    /// An id of this cache's pools: a captured step baked their addresses in.
    pub(super) fn pools_id(&self) -> (u64, usize) {
        (
            self.keys.first().map_or(0, |k| ptr(k).address()),
            self.blocks.num_blocks(),
        )
    }
}

/// The recurrent state at `index` of `states`, allocated (zeroed, `len` floats) if there is none yet.
fn state_at<'a>(
    states: &'a mut Vec<Option<CudaSlice<f32>>>,
    index: usize,
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<&'a mut CudaSlice<f32>> {
    if states.len() <= index {
        states.resize_with(index + 1, || None);
    }
    match &mut states[index] {
        Some(state) => Ok(state),
        empty @ None => Ok(empty.insert(
            stream
                .alloc_zeros::<f32>(len)
                .map_err(cuda_err("allocating a recurrent state"))?,
        )),
    }
}

impl KvCache for DeviceKv {
    fn alloc_seq(&mut self) -> SeqId {
        self.blocks.alloc_seq()
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.blocks.free_seq(seq);
        if let Some(state) = self.states.get_mut(seq.0 as usize) {
            *state = None;
        }
    }

    fn blocks(&self) -> &BlockAllocator {
        &self.blocks
    }

    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        &mut self.blocks
    }

    fn has_recurrent_state(&self) -> bool {
        self.recurrent.is_some()
    }

    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.blocks.grow(seq, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_span_covers_the_longest_sequence_by_at_most_an_eighth_more() {
        assert_eq!(key_span(0), 256);
        assert_eq!(key_span(256), 256);
        assert_eq!(key_span(257), 288);
        assert_eq!(key_span(4096), 4096);
        assert_eq!(key_span(4097), 4608);
        for max_len in 1..20_000 {
            let span = key_span(max_len);
            assert!(span >= max_len.max(256), "{max_len}: {span}");
            assert!(span <= (max_len + max_len / 8).max(256), "{max_len}: {span}");
            // A span holds for every length up to it, so a growing sequence keeps its graph until it passes it.
            assert_eq!(key_span(span), span, "{max_len}: {span}");
        }
    }
}
