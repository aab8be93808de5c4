//! The KV cache in device memory: per layer, a key pool and a value pool (a latent layer: one pool of latent rows)
//! of `BLOCK_SIZE`-token blocks, handed
//! to sequences by a [`BlockAllocator`] as they grow; and, for hybrid models, each sequence's recurrent state
//! (one zeroed allocation per sequence, made when it starts: see gdn.cu for its layout) and, with prefix caching,
//! snapshots of it in slots the memory plan counted, copied on the device.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::cuda_err;
use super::flash_attention::PrefillSlices;
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

/// A batch's per-row metadata on the device, made once per forward pass and read by every layer.
pub struct DeviceBatch {
    pub(super) positions: CudaSlice<u32>,
    /// The physical token slot each row's key and value go to.
    pub(super) row_slot: CudaSlice<u32>,
    /// Where in `block_tables` each row's sequence's block table starts.
    pub(super) row_table: CudaSlice<u32>,
    /// The block tables of the batch's sequences, one after another.
    pub(super) block_tables: CudaSlice<u32>,
    /// The longest sequence of the batch, in tokens, after it.
    pub(super) max_len: usize,
    pub(super) recurrent: Option<RecurrentBatch>,
    /// The slices of a batch with a prefill, for the prefill attention kernel.
    pub(super) prefill: Option<PrefillSlices>,
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

    /// Takes the blocks the batch's new tokens need (all or none) and uploads the batch's metadata.
    pub fn prepare(&mut self, stream: &Arc<CudaStream>, batch: &[SeqSlice]) -> Result<DeviceBatch> {
        let slices: Vec<_> = batch.iter().map(|s| (s.seq, s.start_pos, s.len)).collect();
        self.blocks.extend(&slices)?;
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
        let upload = |v: &[u32]| stream.clone_htod(v).map_err(cuda_err("uploading batch metadata"));
        Ok(DeviceBatch {
            positions: upload(&positions)?,
            row_slot: upload(&row_slot)?,
            row_table: upload(&row_table)?,
            block_tables: upload(&block_tables)?,
            max_len: batch.iter().map(|s| s.start_pos + s.len).max().unwrap_or(0),
            recurrent: self.recurrent_batch(stream, batch)?,
            prefill: PrefillSlices::for_batch(stream, batch)?,
        })
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
