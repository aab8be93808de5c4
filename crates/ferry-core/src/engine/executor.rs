//! What the scheduler runs a step on: a model, its backend and its KV cache behind one small trait, so that the
//! scheduling logic is tested without a model.

use crate::backend::{Backend, SeqSlice};
use crate::kv::{KvCache, SeqId};
use crate::model::Model;
use crate::moe::OffloadStats;
use crate::Result;

pub trait Executor: Send {
    fn vocab_size(&self) -> usize;
    fn alloc_seq(&mut self) -> SeqId;
    fn free_seq(&mut self, seq: SeqId);
    /// Runs one batch (`ids` are the rows of `batch`'s slices, in order) and returns the logits of each slice's
    /// last token, `batch.len()` rows of `vocab_size()` values one after another.
    fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<Vec<f32>>;
    /// The expert offload's counters, when experts are offloaded.
    fn offload_stats(&self) -> Option<OffloadStats> {
        None
    }
}

/// A [`Model`] on its backend with the KV cache of every running sequence.
pub struct ModelExecutor<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub kv: B::Kv,
}

impl<B: Backend> Executor for ModelExecutor<B> {
    fn offload_stats(&self) -> Option<OffloadStats> {
        self.backend.offload_stats()
    }

    fn vocab_size(&self) -> usize {
        self.model.spec.vocab_size
    }

    fn alloc_seq(&mut self) -> SeqId {
        self.kv.alloc_seq()
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.kv.free_seq(seq)
    }

    fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<Vec<f32>> {
        let logits = self.model.forward(&self.backend, ids, batch, &mut self.kv)?;
        self.backend.to_host(&logits)
    }
}
