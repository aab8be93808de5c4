//! What `ferry bench` runs: seeded random prompts (one prefilled and decoded alone, short ones decoded together, an
//! optional long one), how each step's next token is chosen (the model's greedy choice, or on synthetic weights a
//! fresh random token), and the routing taps (a trace replayed through every phase, or the batch-1 decode
//! recorded). Not how it is timed (run.rs).

use std::collections::HashMap;
use std::path::Path;

use ferry_core::backend::{Backend, SeqSlice};
use ferry_core::engine::{Executor, ModelExecutor};
use ferry_core::kv::{KvCache, SeqId, BLOCK_SIZE};
use ferry_core::model::ModelInfo;
use ferry_core::moe::{HeldRouting, OffloadStats, RoutingTap, RoutingTrace, TraceHeader, TraceRecorder, TraceReplayer};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{BenchArgs, Variant};

/// Tokens of each prompt of the concurrent decode.
const SHORT_PROMPT: usize = 16;

/// The prompts of every phase and how long each decode runs.
pub(super) struct Workload {
    pub(super) prompt: Vec<u32>,
    /// The prompts decoded together, `--concurrency` of them.
    pub(super) short_prompts: Vec<Vec<u32>>,
    pub(super) long_prompt: Option<Vec<u32>>,
    pub(super) decode_tokens: usize,
}

impl Workload {
    pub(super) fn new(args: &BenchArgs, vocab_size: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(0);
        let mut random_ids = |n: usize| {
            (0..n)
                .map(|_| rng.random_range(0..vocab_size as u32))
                .collect::<Vec<u32>>()
        };
        Workload {
            prompt: random_ids(args.prompt_tokens),
            short_prompts: (0..args.concurrency).map(|_| random_ids(SHORT_PROMPT)).collect(),
            long_prompt: args.long_prompt_tokens.map(random_ids),
            decode_tokens: args.decode_tokens,
        }
    }

    /// Tokens the KV cache is made to hold: every sequence's prompt and decode in whole blocks (the long prompt
    /// runs after the others have freed theirs), and a little more.
    pub(super) fn kv_tokens(&self) -> usize {
        let blocks = |tokens: usize| tokens.next_multiple_of(BLOCK_SIZE);
        let concurrent: usize = self
            .short_prompts
            .iter()
            .map(|p| blocks(p.len() + self.decode_tokens))
            .sum();
        let long = self.long_prompt.as_ref().map_or(0, |p| blocks(p.len()));
        (blocks(self.prompt.len() + self.decode_tokens) + concurrent).max(long) + 64
    }
}

/// The routing taps `--routing-trace` and `--record-routing` ask for.
pub(super) struct Taps {
    /// Per variant, its trace's replay through every phase (None: the model's router), each from the trace's
    /// start.
    pub(super) replays: Vec<Option<TraceReplayer>>,
    /// Per variant with a trace, its first token's routing held, for the resident step (run.rs).
    pub(super) held: Vec<Option<HeldRouting>>,
    /// Records the batch-1 decode.
    pub(super) recorder: Option<TraceRecorder>,
}

impl Taps {
    pub(super) fn new(args: &BenchArgs, variants: &[Variant], info: &ModelInfo) -> anyhow::Result<Self> {
        let header = TraceHeader {
            num_layers: info.num_moe_layers as u32,
            num_experts: info.num_experts as u32,
            top_k: info.experts_per_token as u32,
        };
        let mut traces: HashMap<&Path, RoutingTrace> = HashMap::new();
        for path in variants.iter().filter_map(|v| v.trace.as_deref()) {
            if !traces.contains_key(path) {
                traces.insert(path, RoutingTrace::read(path)?);
            }
        }
        Ok(Taps {
            replays: variants
                .iter()
                .map(|v| {
                    v.trace
                        .as_deref()
                        .map(|path| {
                            let replayer = TraceReplayer::new(traces[path].clone())?;
                            match v.guess_precision {
                                // One seed: every variant and run guesses alike.
                                Some(precision) => replayer.with_guesses(precision, 0),
                                None => Ok(replayer),
                            }
                        })
                        .transpose()
                })
                .collect::<ferry_core::Result<_>>()?,
            held: variants
                .iter()
                .map(|v| {
                    v.trace
                        .as_deref()
                        .map(|path| HeldRouting::first_token_of(&traces[path]))
                        .transpose()
                })
                .collect::<ferry_core::Result<_>>()?,
            recorder: args
                .record_routing
                .as_ref()
                .map(|p| TraceRecorder::create(p, header))
                .transpose()?,
        })
    }

    /// How `variant` routes, for its report.
    pub(super) fn routing(variant: &Variant) -> String {
        match (&variant.trace, variant.guess_precision) {
            (Some(p), None) => format!("replayed from {}", p.display()),
            (Some(p), Some(precision)) => format!(
                "replayed from {}, each next layer guessed {:.0} % right",
                p.display(),
                100.0 * precision
            ),
            (None, _) => "the model's router".into(),
        }
    }
}

/// The tap as the executor holds it.
pub(super) fn as_tap<T: RoutingTap + Send>(tap: &mut T) -> &mut (dyn RoutingTap + Send) {
    tap
}

/// The model's executor, choosing each step's next token as the workload wants. Random weights fall into a loop
/// under greedy decoding (the same token, the same experts, every step), which would measure a cache that always
/// hits; on synthetic weights each row's logits are made to pick a fresh random token instead, so that routing
/// varies as real text makes it.
pub(super) struct BenchExecutor<'t, B: Backend> {
    pub(super) model: ModelExecutor<'t, B, &'t B>,
    /// Set on synthetic weights.
    random_tokens: Option<StdRng>,
}

impl<'t, B: Backend> BenchExecutor<'t, B> {
    pub(super) fn new(model: ModelExecutor<'t, B, &'t B>, synthetic: bool) -> Self {
        BenchExecutor {
            model,
            random_tokens: synthetic.then(random_tokens),
        }
    }

    /// Chooses the same random tokens again as from the start, so that every variant of a run decodes the same.
    pub(super) fn restart_random_tokens(&mut self) {
        if let Some(rng) = &mut self.random_tokens {
            *rng = random_tokens();
        }
    }
}

/// The generator of the tokens chosen on synthetic weights.
fn random_tokens() -> StdRng {
    StdRng::seed_from_u64(1)
}

impl<B: Backend> Executor for BenchExecutor<'_, B> {
    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn kv(&self) -> &dyn KvCache {
        self.model.kv()
    }

    fn kv_mut(&mut self) -> &mut dyn KvCache {
        self.model.kv_mut()
    }

    fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> ferry_core::Result<Vec<f32>> {
        let mut logits = self.model.forward(ids, batch)?;
        if let Some(rng) = &mut self.random_tokens {
            let vocab = self.model.vocab_size();
            for row in logits.chunks_mut(vocab) {
                row[rng.random_range(0..vocab)] = f32::INFINITY;
            }
        }
        Ok(logits)
    }

    /// The argmax where the logits are, then on synthetic weights the same random token [`Self::forward`] forces
    /// (the forced token is its row's argmax when it is among the first `cols`).
    fn forward_argmax(&mut self, ids: &[u32], batch: &[SeqSlice], cols: usize) -> ferry_core::Result<Vec<u32>> {
        let mut chosen = self.model.forward_argmax(ids, batch, cols)?;
        if let Some(rng) = &mut self.random_tokens {
            let vocab = self.model.vocab_size();
            for token in &mut chosen {
                let forced = rng.random_range(0..vocab);
                if forced < cols {
                    *token = forced as u32;
                }
            }
        }
        Ok(chosen)
    }

    fn save_state(&mut self, seq: SeqId, slot: usize) -> ferry_core::Result<()> {
        self.model.save_state(seq, slot)
    }

    fn restore_state(&mut self, seq: SeqId, slot: usize) -> ferry_core::Result<()> {
        self.model.restore_state(seq, slot)
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        self.model.offload_stats()
    }
}
