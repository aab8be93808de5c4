//! Continuous batching: requests join and leave the running batch between steps; each step feeds every running
//! decode one token and fills the rest of a token budget with chunks of prompts still being prefilled, so one long
//! prompt never freezes the other streams.
//!
//! Requests are served in arrival order, or under [`SchedulingPolicy::Priority`] by their priority first (lower
//! first, as vLLM's `priority`), then arrival: the queue is admitted, and each step's token budget given, in that
//! order. KV is counted in the cache's blocks ([`crate::kv::BlockAllocator`], through [`Executor::kv`]), taken as a
//! sequence grows. When a decode finds no free block, the last running request in that order is preempted: its KV
//! is freed and it goes back to the queue, to be recomputed from its prompt and the tokens it had generated. The
//! first is never preempted, and the cache holds at least one whole context window, so it always finishes. A
//! forward pass that fails is retried one request at a time, so a failing request fails alone.
//!
//! With prefix caching on (the cache's [`crate::kv::BlockAllocator::enable_prefix_cache`]), a request starts after
//! the longest prefix of its tokens whose blocks are cached, always leaving its last token to compute; the blocks it
//! fills are published after each step. A hybrid model resumes only where its recurrent state was saved: after
//! the last full block of every prompt and every [`ANCHOR_EVERY_BLOCKS`] blocks of a long one. Those anchors must
//! be the end of a forward slice, so a chunk that would cross the prompt's last block boundary stops there, and a
//! chunk that does not end the prompt ends on a block boundary.
//!
//! What a request may ask is request.rs's business, what becomes of its logits emit.rs's.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::emit::Emitter;
use super::executor::Executor;
use super::logprobs::token_logprobs;
use super::request::{Event, EventSink, Request, RequestId};
use crate::backend::SeqSlice;
use crate::kv::{PrefixStats, SeqId};
use crate::loader::TextDecoder;
use crate::{Error, Result};
use prefix::{anchored_chunk, start_seq};

/// A hybrid model's prompt saves its recurrent state at least this often (in blocks) besides its end: each
/// snapshot costs a copy of the whole state (about 63 MiB for Qwen3.6-35B-A3B, as much as ~1,600 tokens of its KV)
/// and a slot, so only long prompts get intermediate ones. 256 blocks (4,096 tokens) is the offloaded step, so an
/// offloaded prefill's chunks end on anchors anyway, and a prompt that diverges mid-way recomputes at most that much.
pub const ANCHOR_EVERY_BLOCKS: usize = 256;

/// The order requests are served in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// Arrival order; every request's priority must be 0.
    #[default]
    Fcfs,
    /// By [`Request::priority`] (lower first), then arrival (vLLM's `--scheduling-policy priority`).
    Priority,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_running: usize,
    /// Requests waiting for a place in the running batch at most (beyond `max_running`); more are refused.
    pub max_queued: usize,
    /// Tokens one step runs at most: a token per running decode, prefill chunks fill the rest.
    pub step_tokens: usize,
    /// Prompt plus generated tokens of one request at most.
    pub max_model_len: usize,
    /// Sample only ids below this: a synthetic model serving with a borrowed tokenizer that cannot decode the rest
    /// of its vocabulary (the model still computes every logit). None: the whole vocabulary.
    pub sampled_vocab: Option<usize>,
    pub policy: SchedulingPolicy,
}

/// A request the scheduler holds, queued or running.
struct Sequence {
    id: RequestId,
    /// Where it is served: (its priority, or 0 under FCFS; its arrival), the smallest first.
    order: (i64, u64),
    request: Request,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose keys and values are in the KV cache.
    computed: usize,
    /// Prompt tokens found in the prefix cache when it was first admitted (None until then).
    cached: Option<usize>,
    /// Where its recurrent state was last saved (or restored from), for a hybrid model's anchors.
    last_anchor: usize,
    kv: Option<SeqId>,
    emitter: Emitter,
    sink: EventSink,
    /// Runs in a batch of its own, until it has recomputed its tokens: a batch it was in failed.
    solo: bool,
    /// Under `prompt_logprobs`, the next prompt token whose logprob is to be sent (the first has none): a prompt
    /// recomputed after a preemption sends none twice.
    next_scored: usize,
}

impl Sequence {
    /// Whether the step after position `computed` should score the next prompt token: prompt logprobs were asked
    /// for and that token is a prompt token.
    fn scores_prompt(&self) -> bool {
        self.request.prompt_logprobs.is_some() && self.computed + 1 < self.request.prompt_ids.len()
    }

    /// Sends the logprob of prompt token `computed` (the next one) under `logits`, the last position's, unless it
    /// was sent before; false once nobody listens.
    fn send_prompt_logprobs(&mut self, logits: &[f32]) -> bool {
        let (next, top) = (self.computed, self.request.prompt_logprobs.unwrap_or(0));
        if next < self.next_scored {
            return true;
        }
        self.next_scored = next + 1;
        let id = self.request.prompt_ids[next];
        let logit = logits[id as usize];
        (self.sink)(Event::PromptToken {
            id,
            logprobs: token_logprobs(logits, id, top),
            rank: 1 + logits.iter().filter(|&&l| l > logit).count(),
        })
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.request.prompt_ids.len()
    }

    /// Whether a step computing its next `len` tokens needs no more of its logits than their argmax: its token is
    /// the argmax ([`Emitter::argmax_decides`]), or, with prompt tokens still to compute, the logits go unused
    /// (unless they score the prompt).
    fn argmax_decides(&self, len: usize) -> bool {
        match self.pending() > len {
            true => !self.scores_prompt(),
            false => self.emitter.argmax_decides(&self.request, self.generated()),
        }
    }

    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    fn kv(&self) -> SeqId {
        self.kv.expect("running sequences hold KV")
    }
}

/// What a step brings back: every row's last logits, or, when each row's token is their argmax, those alone.
enum StepScores {
    Logits(Vec<f32>),
    Argmax(Vec<u32>),
}

/// One row's part of [`StepScores`] (its logits cut to the sampled vocabulary).
enum RowScores<'a> {
    Logits(&'a [f32]),
    Argmax(u32),
}

/// Counts a metrics exporter reads between steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub running: usize,
    pub queued: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Requests preempted (KV freed, to be recomputed) since the start.
    pub preemptions: u64,
    /// Prefix caching's counters (all zero when it is off).
    pub prefix: PrefixStats,
    /// Cached blocks no request reads, kept for later prompts (counted free: evicted when room is needed).
    pub kv_blocks_cached: usize,
}

/// What one step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
}

pub struct Scheduler<E: Executor> {
    config: SchedulerConfig,
    executor: E,
    decoder: Arc<dyn TextDecoder>,
    /// Both in serving order ([`Sequence::order`]): the queue's first is admitted first, the running batch's last
    /// preempted first.
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    preemptions: u64,
    /// Requests submitted so far: the next one's arrival.
    arrivals: u64,
}

impl<E: Executor> Scheduler<E> {
    /// The executor's KV cache must hold a whole context window, so that the oldest request can always finish.
    pub fn new(config: SchedulerConfig, executor: E, decoder: Arc<dyn TextDecoder>) -> Result<Self> {
        let blocks = executor.kv().blocks();
        if blocks.capacity_tokens() < config.max_model_len {
            return Err(Error::Kv(format!(
                "{} blocks of {} tokens hold {} tokens, less than the context window of {}",
                blocks.num_blocks(),
                blocks.block_size(),
                blocks.capacity_tokens(),
                config.max_model_len
            )));
        }
        if config.max_running == 0 || config.step_tokens == 0 {
            return Err(Error::Config(
                "the scheduler needs at least one running request and one token per step".into(),
            ));
        }
        Ok(Scheduler {
            config,
            executor,
            decoder,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            arrivals: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn executor(&self) -> &E {
        &self.executor
    }

    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.executor
    }

    pub fn vocab_size(&self) -> usize {
        self.executor.vocab_size()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The expert cache's running totals, when the executor offloads experts.
    pub fn offload_stats(&self) -> Option<crate::moe::OffloadStats> {
        self.executor.offload_stats()
    }

    pub fn stats(&self) -> SchedulerStats {
        let blocks = self.executor.kv().blocks();
        SchedulerStats {
            running: self.running.len(),
            queued: self.waiting.len(),
            kv_blocks_used: blocks.used_blocks(),
            kv_blocks_total: blocks.num_blocks(),
            preemptions: self.preemptions,
            prefix: blocks.prefix_stats().unwrap_or_default(),
            kv_blocks_cached: blocks.cached_blocks(),
        }
    }

    /// Queues a request; its events go to `sink`. An invalid request or a full queue is refused: `sink` gets a
    /// `Failed` event with the reason, which is also returned.
    pub fn submit(&mut self, id: RequestId, request: Request, mut sink: EventSink) -> Result<()> {
        let refusal = request
            .validate(self.config.max_model_len, self.executor.vocab_size())
            .err()
            .or_else(|| {
                (request.priority != 0 && self.config.policy == SchedulingPolicy::Fcfs).then(|| {
                    Error::Request(
                        "priority is only taken under priority scheduling (--scheduling-policy priority)".into(),
                    )
                })
            })
            .or_else(|| {
                let held = self.waiting.len() + self.running.len();
                (held >= self.config.max_running + self.config.max_queued).then(|| {
                    Error::Request(format!(
                        "the queue is full ({} requests running, {} waiting)",
                        self.running.len(),
                        self.waiting.len()
                    ))
                })
            });
        if let Some(error) = refusal {
            sink(Event::Failed {
                message: error.to_string(),
            });
            return Err(error);
        }
        self.arrivals += 1;
        self.queue(Sequence {
            id,
            order: (request.priority, self.arrivals),
            tokens: request.prompt_ids.clone(),
            computed: 0,
            cached: None,
            last_anchor: 0,
            kv: None,
            emitter: Emitter::new(&request),
            request,
            sink,
            solo: false,
            next_scored: 1,
        });
        Ok(())
    }

    /// Drops a request wherever it is; its KV is freed at once. Unknown ids (already finished) are ignored.
    pub fn cancel(&mut self, id: RequestId) {
        self.waiting.retain(|s| s.id != id);
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            self.free_kv(&mut seq);
        }
    }

    fn free_kv(&mut self, seq: &mut Sequence) {
        if let Some(kv) = seq.kv.take() {
            self.executor.kv_mut().free_seq(kv);
        }
        seq.computed = 0;
        seq.last_anchor = 0;
    }

    /// Puts `seq` in the queue in serving order.
    fn queue(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|s| s.order < seq.order);
        self.waiting.insert(at, seq);
    }

    /// Moves the last running request in serving order back to the queue, freeing its KV.
    fn preempt_last(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            tracing::debug!(
                "KV full: preempting request {} ({} tokens to recompute)",
                seq.id.0,
                seq.tokens.len()
            );
            self.free_kv(&mut seq);
            self.queue(seq);
            self.preemptions += 1;
        }
    }

    /// Moves queued requests into the running batch while there is a place and KV for their first chunk (a
    /// preempted request would otherwise be readmitted only to be preempted again).
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            let first_chunk = next.pending().min(self.config.step_tokens);
            let blocks = self.executor.kv().blocks();
            if blocks.blocks_for(first_chunk) > blocks.free_blocks() {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            let mut kv = start_seq(self.executor.kv_mut(), &seq.request);
            // A prompt whose logprobs are asked for is computed whole: each position's logits score the next.
            let reused = match seq.request.prompt_logprobs {
                Some(_) => Ok(0),
                None => self.reuse_prefix(kv, &seq.tokens),
            };
            let reused = match reused {
                Ok(reused) => reused,
                Err(e) => {
                    // Reusing is an optimisation: start afresh (a failed restore may have left cached blocks
                    // attached) and compute the prompt.
                    tracing::warn!(
                        "request {}: the prefix cache failed ({e}); computing its prompt",
                        seq.id.0
                    );
                    self.executor.kv_mut().free_seq(kv);
                    kv = start_seq(self.executor.kv_mut(), &seq.request);
                    0
                }
            };
            seq.kv = Some(kv);
            seq.computed = reused;
            seq.last_anchor = reused;
            seq.cached.get_or_insert(reused.min(seq.request.prompt_ids.len()));
            let at = self.running.partition_point(|s| s.order < seq.order);
            self.running.insert(at, seq);
        }
    }

    /// Picks this step's slices (index into `running`, tokens to feed) and grows their KV blocks, preempting the
    /// last running requests in serving order until something can run.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        loop {
            let planned = match self.running.iter().position(|s| s.solo) {
                Some(i) => self.plan_solo(i),
                None => self.plan_batch(),
            };
            if !planned.is_empty() {
                return planned;
            }
            if self.running.len() <= 1 {
                // One request alone cannot outgrow a cache that holds a context window; never spin if it does.
                if let Some(mut seq) = self.running.pop() {
                    self.free_kv(&mut seq);
                    (seq.sink)(Event::Failed {
                        message: "the KV cache cannot hold this request".into(),
                    });
                }
                return Vec::new();
            }
            self.preempt_last();
        }
    }

    /// Grows `seq`'s blocks for a chunk of at most `budget` of its pending tokens, as many as the free blocks
    /// allow; the chunk's length (0: nothing can run).
    fn grow_chunk(&mut self, i: usize, budget: usize) -> usize {
        let seq = &self.running[i];
        let kv = self.executor.kv_mut();
        let room = kv.blocks().max_tokens_for(seq.kv()).saturating_sub(seq.computed);
        // A forward pass gives the logits of a slice's last token: a prompt being scored goes a token a step.
        let budget = if seq.scores_prompt() { budget.min(1) } else { budget };
        let mut len = seq.pending().min(budget).min(room);
        if kv.has_recurrent_state() && kv.blocks().caches_prefixes() {
            len = anchored_chunk(
                seq.computed,
                len,
                seq.request.prompt_ids.len(),
                kv.blocks().block_size(),
            );
        }
        match len > 0 && kv.grow(seq.kv(), seq.computed + len) {
            true => len,
            false => 0,
        }
    }

    /// A batch of request `i` alone (it was in a batch that failed).
    fn plan_solo(&mut self, i: usize) -> Vec<(usize, usize)> {
        match self.grow_chunk(i, self.config.step_tokens) {
            0 => Vec::new(),
            len => vec![(i, len)],
        }
    }

    /// Every decode's token, then prefill chunks in arrival order while the token budget and free blocks last.
    /// Empty when the decodes need more blocks than are free.
    fn plan_batch(&mut self) -> Vec<(usize, usize)> {
        let blocks = self.executor.kv().blocks();
        let decode_blocks: usize = self
            .running
            .iter()
            .filter(|s| s.pending() == 1)
            .map(|s| blocks.shortfall(s.kv(), s.computed + 1))
            .sum();
        if decode_blocks > blocks.free_blocks() {
            return Vec::new();
        }
        let mut plan = Vec::new();
        let mut budget = self.config.step_tokens;
        for (i, seq) in self.running.iter().enumerate() {
            if seq.pending() == 1 && budget > 0 && self.executor.kv_mut().grow(seq.kv(), seq.computed + 1) {
                plan.push((i, 1));
                budget -= 1;
            }
        }
        for i in 0..self.running.len() {
            if self.running[i].pending() > 1 && budget > 0 {
                let len = self.grow_chunk(i, budget);
                if len > 0 {
                    plan.push((i, len));
                    budget -= len;
                }
            }
        }
        plan.sort_unstable();
        plan
    }

    /// Runs one step: admits waiting requests, runs a batch, samples and streams the tokens of requests whose
    /// pending tokens are all computed, and retires finished ones.
    pub fn step(&mut self) -> StepReport {
        self.admit();
        let plan = self.plan();
        if plan.is_empty() {
            return StepReport::default();
        }
        let mut ids = Vec::new();
        let mut slices = Vec::with_capacity(plan.len());
        for &(i, len) in &plan {
            let seq = &self.running[i];
            ids.extend_from_slice(&seq.tokens[seq.computed..seq.computed + len]);
            slices.push(SeqSlice {
                seq: seq.kv(),
                start_pos: seq.computed,
                len,
            });
        }
        let vocab = self.executor.vocab_size();
        let sampled = self.config.sampled_vocab.map_or(vocab, |n| n.min(vocab));
        // When every row's token is its logits' argmax (or its logits go unused), the argmax is taken where the
        // logits are and only the ids come back.
        let by_argmax = plan.iter().all(|&(i, len)| self.running[i].argmax_decides(len));
        let executor = &mut self.executor;
        let result = catch_unwind(AssertUnwindSafe(|| match by_argmax {
            true => executor.forward_argmax(&ids, &slices, sampled).map(StepScores::Argmax),
            false => executor.forward(&ids, &slices).map(StepScores::Logits),
        }))
        .unwrap_or_else(|_| Err(Error::Request("internal error in the forward pass".into())));
        let scores = match result {
            Ok(scores) => scores,
            Err(e) => {
                self.isolate_failure(&plan, e);
                return StepReport::default();
            }
        };
        let mut report = StepReport::default();
        let mut retired = Vec::new();
        for (row, &(i, len)) in plan.iter().enumerate() {
            let scores_prompt = self.running[i].scores_prompt();
            self.running[i].computed += len;
            self.cache_prefix(i);
            let seq = &mut self.running[i];
            if seq.pending() > 0 {
                report.prefill_tokens += len;
                if let (true, StepScores::Logits(logits)) = (scores_prompt, &scores) {
                    if !seq.send_prompt_logprobs(&logits[row * vocab..(row + 1) * vocab]) {
                        retired.push((i, None));
                    }
                }
                continue;
            }
            if len == 1 {
                report.decode_tokens += 1;
            } else {
                report.prefill_tokens += len;
            }
            // Recomputed alone up to its next token, it is not what failed the batch: back to the shared batch.
            seq.solo = false;
            let row_scores = match &scores {
                StepScores::Logits(logits) => RowScores::Logits(&logits[row * vocab..row * vocab + sampled]),
                StepScores::Argmax(ids) => RowScores::Argmax(ids[row]),
            };
            match self.emit_next_token(i, row_scores) {
                Next::Running => {}
                Next::Finished(event) => retired.push((i, Some(event))),
                Next::ListenerGone => retired.push((i, None)),
            }
        }
        for (i, last_event) in retired.into_iter().rev() {
            let mut seq = self.running.remove(i);
            self.free_kv(&mut seq);
            if let Some(event) = last_event {
                (seq.sink)(event);
            }
        }
        report
    }

    /// Samples running request `i`'s next token from its last position's scores and hands it to its sink.
    fn emit_next_token(&mut self, i: usize, scores: RowScores<'_>) -> Next {
        let seq = &mut self.running[i];
        let (decoder, max_model_len) = (self.decoder.as_ref(), self.config.max_model_len);
        let emitted = match scores {
            RowScores::Logits(logits) => {
                seq.emitter
                    .next_token(&seq.request, &mut seq.tokens, logits, decoder, max_model_len)
            }
            RowScores::Argmax(id) => {
                seq.emitter
                    .next_token_from_argmax(&seq.request, &mut seq.tokens, id, decoder, max_model_len)
            }
        };
        let emitted = match emitted {
            Ok(emitted) => emitted,
            Err(e) => return Next::Finished(Event::Failed { message: e.to_string() }),
        };
        let token = Event::Token {
            id: emitted.id,
            text: emitted.text,
            logprobs: emitted.logprobs,
        };
        if !(seq.sink)(token) {
            return Next::ListenerGone;
        }
        match emitted.finish {
            None => Next::Running,
            Some(reason) => {
                let (prompt_tokens, cached_tokens) = (seq.request.prompt_ids.len(), seq.cached.unwrap_or(0));
                tracing::info!(
                    "request {} finished: {prompt_tokens} prompt tokens, {cached_tokens} from the prefix cache \
                     ({:.0}%), {} generated",
                    seq.id.0,
                    100.0 * cached_tokens as f64 / prompt_tokens as f64,
                    seq.generated()
                );
                Next::Finished(Event::Finished {
                    reason,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens: seq.generated(),
                })
            }
        }
    }

    /// A batch failed: alone, its request fails; together, every member is recomputed in a batch of its own.
    fn isolate_failure(&mut self, plan: &[(usize, usize)], error: Error) {
        if let [(i, _)] = plan {
            let mut seq = self.running.remove(*i);
            tracing::warn!("request {} failed: {error}", seq.id.0);
            self.free_kv(&mut seq);
            (seq.sink)(Event::Failed {
                message: error.to_string(),
            });
            return;
        }
        tracing::warn!(
            "a batch of {} requests failed ({error}); retrying each alone",
            plan.len()
        );
        for &(i, _) in plan {
            let seq = &mut self.running[i];
            if let Some(kv) = seq.kv.take() {
                let cache = self.executor.kv_mut();
                cache.free_seq(kv);
                seq.kv = Some(start_seq(cache, &seq.request));
            }
            seq.computed = 0;
            seq.solo = true;
        }
    }
}

/// What became of a request after a token.
enum Next {
    Running,
    /// Done; the event is its last.
    Finished(Event),
    /// Its listener is gone: drop it silently.
    ListenerGone,
}

mod prefix;
#[cfg(test)]
mod tests;
