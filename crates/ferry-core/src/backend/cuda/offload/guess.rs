//! The offload's next-layer guesses on the host: kept as a MoE layer hands them over, read with a layer's own ids
//! (or at once, for the first MoE layer), and their misses copied one at a time behind the layer's own copies.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr};

use super::{cuda_err, CudaRouting, NextLayerGuess, Offload, RoutingGuess};
use crate::{Error, Result};

impl Offload {
    /// Keeps `routing`, a guess of how MoE layer `layer` will route, to be read with the next layer's own ids.
    pub fn guess_next(&mut self, layer: usize, routing: CudaRouting) {
        self.guess = Some(RoutingGuess { layer, routing });
    }

    /// Reads `routing`, a guess of how MoE layer `layer` will route that no earlier layer's wait would read, at
    /// once (a wait for `compute`), and starts copying its misses: they are pumped as [`Offload::copy_guesses`]
    /// pumps a next-layer guess, and scored and dropped when the layer's own ids arrive.
    pub fn guess_now(&mut self, compute: &Arc<CudaStream>, layer: usize, routing: CudaRouting) -> Result<()> {
        let ids = self.read_ids(compute, &[&routing], None)?;
        self.guess_in_flight = None;
        self.keep_guess(layer, &ids);
        self.copy_guesses()?;
        Ok(())
    }

    /// Queues the next guessed expert's copy unless the last guessed copy is still in flight; returns whether
    /// guessed copies remain (queued now or still to queue), so that the caller knows whether polling can still
    /// start one. Cheap when there is nothing to copy: every kernel launch under offload calls it.
    pub fn copy_guesses(&mut self) -> Result<bool> {
        let Some(guess) = self.next_guess.as_mut() else {
            return Ok(false);
        };
        if guess.to_copy.is_empty() {
            return Ok(false);
        }
        if let Some(last) = &self.guess_in_flight {
            if !last.try_is_complete().map_err(cuda_err("copy event"))? {
                return Ok(true);
            }
        }
        let (layer, expert) = match guess.to_copy.pop() {
            Some(expert) => (guess.layer, expert),
            None => return Ok(false),
        };
        let more = !guess.to_copy.is_empty();
        if self.cache.slot_of((layer as u32, expert)).is_some() {
            return Ok(more);
        }
        let (Some(bank), Some(slab)) = (self.bank.as_mut(), self.slab.as_ref()) else {
            return Err(Error::Cuda(
                "expert offload used before any MoE layer was loaded".into(),
            ));
        };
        let blocks = &self
            .layers
            .get(layer)
            .ok_or_else(|| Error::Cuda(format!("no MoE layer {layer}")))?
            .bank_blocks;
        let plan = self.cache.plan_prefetch(layer as u32, &[expert])?;
        let base = slab.device_ptr(&self.copy_stream).0;
        let fetched = Self::apply(&mut self.cache, bank, blocks, &plan, base, &self.copy_stream)?;
        self.counters.copies += fetched.len() as u64;
        self.counters.prefetched += fetched.len() as u64;
        self.counters.guesses_copied += fetched.len() as u64;
        if let Some((_, event)) = fetched.into_iter().last() {
            self.guess_in_flight = Some(event);
        }
        Ok(more)
    }

    /// Keeps the guessed experts of `layer` (`ids`, as read) to copy while the host waits for that layer's router:
    /// the misses among them, as many as the cache has room for beside the experts of the layer computing (those
    /// it runs from slots and those the CPU lane computes alike), which a prefetch must spare.
    pub(super) fn keep_guess(&mut self, layer: usize, ids: &[i32]) {
        // Only this offload's experts (under expert parallelism, the others are other ranks' to guess).
        let held = |e: u32| self.layers.get(layer).is_some_and(|l| l.holds(e));
        let mut experts: Vec<u32> = Vec::new();
        for &e in ids {
            if held(e as u32) && !experts.contains(&(e as u32)) {
                experts.push(e as u32);
            }
        }
        let mut to_copy: Vec<u32> = experts
            .iter()
            .copied()
            .filter(|&e| self.cache.slot_of((layer as u32, e)).is_none())
            .collect();
        to_copy.truncate(self.cache.prefetch_room(layer as u32));
        // Copied from the end: the first guessed (the most likely) first.
        to_copy.reverse();
        self.next_guess = Some(NextLayerGuess {
            layer,
            experts,
            to_copy,
        });
    }
}
