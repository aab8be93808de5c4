//! The KV cache in device memory: per layer, a key pool and a value pool of `BLOCK_SIZE`-token blocks, handed
//! to sequences by a [`BlockAllocator`] as they grow.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::cuda_err;
use crate::backend::SeqSlice;
use crate::kv::{BlockAllocator, KvCache, KvSpec, SeqId};
use crate::{Error, Result};

pub const BLOCK_SIZE: usize = 16;

pub struct DeviceKv {
    blocks: BlockAllocator,
    keys: Vec<CudaSlice<f32>>,
    values: Vec<CudaSlice<f32>>,
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
}

impl DeviceKv {
    pub fn new(stream: &Arc<CudaStream>, spec: KvSpec) -> Result<Self> {
        let num_blocks = spec.capacity_tokens.div_ceil(BLOCK_SIZE).max(1);
        let pool_len = num_blocks * BLOCK_SIZE * spec.num_kv_heads * spec.head_dim;
        let pool = || -> Result<CudaSlice<f32>> {
            stream
                .alloc_zeros::<f32>(pool_len)
                .map_err(cuda_err("allocating the KV cache"))
        };
        Ok(DeviceKv {
            blocks: BlockAllocator::new(BLOCK_SIZE, num_blocks),
            keys: (0..spec.num_layers).map(|_| pool()).collect::<Result<_>>()?,
            values: (0..spec.num_layers).map(|_| pool()).collect::<Result<_>>()?,
        })
    }

    pub fn block_size(&self) -> usize {
        self.blocks.block_size()
    }

    pub(super) fn layer_pools(&self, layer: usize) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Takes the blocks the batch's new tokens need (all or none) and uploads the batch's metadata.
    pub fn prepare(&mut self, stream: &Arc<CudaStream>, batch: &[SeqSlice]) -> Result<DeviceBatch> {
        let mut needed = 0;
        for s in batch {
            needed += self.blocks.blocks_needed(s.seq, s.start_pos, s.len)?;
        }
        if needed > self.blocks.free_blocks() {
            return Err(Error::Kv(format!(
                "full: the batch needs {needed} blocks of {BLOCK_SIZE} tokens, {} of {} are free",
                self.blocks.free_blocks(),
                self.blocks.num_blocks()
            )));
        }
        let (mut positions, mut row_slot, mut row_table, mut block_tables) = (vec![], vec![], vec![], vec![]);
        for s in batch {
            self.blocks.extend(s.seq, s.start_pos, s.len)?;
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
        })
    }
}

impl KvCache for DeviceKv {
    fn alloc_seq(&mut self) -> SeqId {
        self.blocks.alloc_seq()
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.blocks.free_seq(seq);
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.blocks.seq_len(seq)
    }

    fn used_tokens(&self) -> usize {
        self.blocks.used_tokens()
    }

    fn capacity_tokens(&self) -> usize {
        self.blocks.num_blocks() * BLOCK_SIZE
    }
}
