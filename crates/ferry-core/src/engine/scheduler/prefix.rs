//! The scheduler's side of prefix caching: a sequence starts keyed under its request's cache salt and on the
//! longest cached prefix of its tokens (a hybrid's state restored there), publishes the blocks each step fills, and
//! a hybrid saves its state at anchors, where its chunks are cut to end.

use super::{Scheduler, ANCHOR_EVERY_BLOCKS};
use crate::engine::executor::Executor;
use crate::engine::request::Request;
use crate::kv::{KvCache, SeqId};
use crate::Result;

impl<E: Executor> Scheduler<E> {
    /// Starts `kv` on the longest cached prefix of `tokens` (all but the last, whose logits are needed), restoring
    /// the recurrent state saved there; the tokens reused.
    pub(super) fn reuse_prefix(&mut self, kv: SeqId, tokens: &[u32]) -> Result<usize> {
        let cache = self.executor.kv_mut();
        let needs_snapshot = cache.has_recurrent_state();
        let reused = cache
            .blocks_mut()
            .attach_prefix(kv, &tokens[..tokens.len() - 1], needs_snapshot)?;
        if let Some(slot) = reused.snapshot {
            self.executor.restore_state(kv, slot)?;
        }
        Ok(reused.tokens)
    }

    /// After a step computed up to `seq.computed`: publishes the blocks it filled and, at an anchor of a hybrid
    /// model, saves its recurrent state.
    pub(super) fn cache_prefix(&mut self, i: usize) {
        let seq = &mut self.running[i];
        let cache = self.executor.kv_mut();
        let blocks = cache.blocks_mut();
        if !blocks.caches_prefixes() {
            return;
        }
        blocks.publish(seq.kv(), &seq.tokens);
        let block_size = blocks.block_size();
        let prompt_end = seq.request.prompt_ids.len() / block_size * block_size;
        let at_anchor = seq.computed == prompt_end
            || (seq.computed < prompt_end && seq.computed - seq.last_anchor >= ANCHOR_EVERY_BLOCKS * block_size);
        if !cache.has_recurrent_state() || !at_anchor || !seq.computed.is_multiple_of(block_size) {
            return;
        }
        let Some(slot) = cache.blocks_mut().snapshot_slot(seq.kv()) else {
            return;
        };
        seq.last_anchor = seq.computed;
        let kv = seq.kv();
        if let Err(e) = self.executor.save_state(kv, slot) {
            tracing::warn!("cannot save a recurrent-state snapshot: {e}");
            self.executor.kv_mut().blocks_mut().discard_snapshot(slot);
        }
    }
}

/// A new sequence in `cache` for `request`, its blocks keyed under the request's cache salt, if any.
pub(super) fn start_seq(cache: &mut dyn KvCache, request: &Request) -> SeqId {
    let seq = cache.alloc_seq();
    if let Some(salt) = &request.cache_salt {
        cache
            .blocks_mut()
            .salt_prefixes(seq, salt)
            .expect("a sequence just allocated holds nothing");
    }
    seq
}

/// The length of a hybrid model's chunk of `len` tokens from `computed`, cut so that it ends where an anchor can
/// be saved: at the prompt's last block boundary if it would cross it, else, if it does not end the prompt, at a
/// block boundary (unless that leaves nothing). Recomputed generated tokens are not cut.
pub(super) fn anchored_chunk(computed: usize, len: usize, prompt_len: usize, block_size: usize) -> usize {
    let end = computed + len;
    let prompt_anchor = prompt_len / block_size * block_size;
    if computed < prompt_anchor && prompt_anchor < end {
        return prompt_anchor - computed;
    }
    let aligned = end / block_size * block_size;
    match end < prompt_len && aligned > computed {
        true => aligned - computed,
        false => len,
    }
}
