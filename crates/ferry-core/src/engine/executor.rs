//! What the scheduler runs a step on: a model, its backend and its KV cache behind one small trait, so that the
//! scheduling logic is tested without a model.

use std::borrow::Borrow;
use std::time::{Duration, Instant};

use crate::backend::cpu::argmax;
use crate::backend::{Backend, ForwardStep, SeqSlice};
use crate::kv::{KvCache, SeqId};
use crate::model::Model;
use crate::moe::{OffloadStats, RoutingTap};
use crate::Result;

pub trait Executor: Send {
    fn vocab_size(&self) -> usize;
    /// The KV cache the batches run on: the scheduler takes sequences and grows their blocks here.
    fn kv(&self) -> &dyn KvCache;
    fn kv_mut(&mut self) -> &mut dyn KvCache;
    /// Runs one batch (`ids` are the rows of `batch`'s slices, in order) and returns the logits of each slice's
    /// last token, `batch.len()` rows of `vocab_size()` values one after another.
    fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<Vec<f32>>;
    /// Runs one batch as [`Executor::forward`] does and returns each slice's argmax over the first `cols` logits
    /// of its last token ([`crate::backend::Backend::argmax_rows`]: where the logits are, so that a step whose
    /// tokens are all chosen greedily brings only their ids to the host). This default takes the logits to the
    /// host first.
    fn forward_argmax(&mut self, ids: &[u32], batch: &[SeqSlice], cols: usize) -> Result<Vec<u32>> {
        let logits = self.forward(ids, batch)?;
        let vocab = self.vocab_size();
        Ok(logits
            .chunks(vocab)
            .map(|row| argmax(&row[..cols.min(vocab)]) as u32)
            .collect())
    }
    /// Copies `seq`'s recurrent state into the cache's snapshot slot `slot` ([`Backend::save_state`]).
    fn save_state(&mut self, seq: SeqId, slot: usize) -> Result<()>;
    /// Replaces `seq`'s recurrent state with snapshot `slot`'s ([`Backend::restore_state`]).
    fn restore_state(&mut self, seq: SeqId, slot: usize) -> Result<()>;
    /// The expert offload's counters, when experts are offloaded.
    fn offload_stats(&self) -> Option<OffloadStats> {
        None
    }
}

/// A [`Model`] on its backend with the KV cache of every running sequence. The backend is owned (`Be = B`: the
/// server's engine thread) or borrowed (`Be = &B`: a command that keeps using it, as `ferry bench`'s profiler
/// does); `'t` bounds the routing tap's borrow.
pub struct ModelExecutor<'t, B: Backend, Be: Borrow<B> = B> {
    backend: Be,
    model: Model<B>,
    kv: B::Kv,
    tap: Option<&'t mut (dyn RoutingTap + Send)>,
    /// Time spent issuing forward passes, not counting the wait for their logits.
    issue_time: Duration,
    /// Time spent waiting for the device to finish them (their logits, or argmax, coming to the host).
    wait_time: Duration,
    /// This executor's id among the process's: a backend replays a step it captured only for the same model and
    /// cache ([`ForwardStep::owner`]).
    owner: u64,
}

impl<'t, B: Backend, Be: Borrow<B>> ModelExecutor<'t, B, Be> {
    pub fn new(backend: Be, model: Model<B>, kv: B::Kv) -> Self {
        ModelExecutor {
            backend,
            model,
            kv,
            tap: None,
            issue_time: Duration::ZERO,
            wait_time: Duration::ZERO,
            owner: ForwardStep::new_owner(),
        }
    }

    /// From the next forward pass on, `tap` sees every MoE layer's routing (recording or replaying a routing
    /// trace); None stops it.
    pub fn set_tap(&mut self, tap: Option<&'t mut (dyn RoutingTap + Send)>) {
        self.tap = tap;
    }

    /// Time the host has spent issuing forward passes so far (the rest of a step is waiting for the device, and
    /// the scheduling around it): where `ferry bench` finds the host's share of a decode step.
    pub fn issue_time(&self) -> Duration {
        self.issue_time
    }

    /// Time the host has spent waiting for forward passes to finish so far: with [`Self::issue_time`], what the
    /// rest of a step (the scheduling around it) is found from.
    pub fn wait_time(&self) -> Duration {
        self.wait_time
    }
}

impl<B: Backend, Be: Borrow<B> + Send> Executor for ModelExecutor<'_, B, Be> {
    fn vocab_size(&self) -> usize {
        self.model.spec.vocab_size
    }

    fn kv(&self) -> &dyn KvCache {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut dyn KvCache {
        &mut self.kv
    }

    fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<Vec<f32>> {
        let logits = self.logits(ids, batch)?;
        let waited = Instant::now();
        let host = self.backend.borrow().to_host(&logits);
        self.wait_time += waited.elapsed();
        host
    }

    fn forward_argmax(&mut self, ids: &[u32], batch: &[SeqSlice], cols: usize) -> Result<Vec<u32>> {
        let logits = self.logits(ids, batch)?;
        let waited = Instant::now();
        let chosen = self.backend.borrow().argmax_rows(&logits, cols);
        self.wait_time += waited.elapsed();
        chosen
    }

    fn save_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        self.backend.borrow().save_state(&mut self.kv, seq, slot)
    }

    fn restore_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        self.backend.borrow().restore_state(&mut self.kv, seq, slot)
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        self.backend.borrow().offload_stats()
    }
}

impl<B: Backend, Be: Borrow<B>> ModelExecutor<'_, B, Be> {
    /// The forward pass of one batch, issued: each slice's last logits, still on the backend.
    fn logits(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<B::Tensor> {
        let backend = self.backend.borrow();
        let issued = Instant::now();
        let logits = match self.tap.as_deref_mut() {
            // A tap reads routes on the host in the middle of the pass: eager.
            Some(tap) => self
                .model
                .forward_routed(backend, ids, batch, &mut self.kv, Some(tap))?,
            None => {
                // Checked here too: a replayed step does not run the model's own checks.
                self.model.check_batch(ids, batch)?;
                let step = ForwardStep {
                    ids,
                    batch,
                    owner: self.owner,
                    logits_width: self.model.spec.vocab_size,
                };
                let model = &self.model;
                backend.run_forward(&mut self.kv, &step, &mut |kv| model.forward(backend, ids, batch, kv))?
            }
        };
        self.issue_time += issued.elapsed();
        Ok(logits)
    }
}
