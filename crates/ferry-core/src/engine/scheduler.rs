//! Continuous batching: requests join and leave the running batch between steps; each step feeds every running
//! decode one token and fills the rest of a token budget with chunks of prompts still being prefilled, so one long
//! prompt never freezes the other streams.
//!
//! KV is counted in the cache's blocks ([`crate::kv::BlockAllocator`], through [`Executor::kv`]), taken as a
//! sequence grows. When a decode finds no free block, the newest running request is preempted: its KV is freed and
//! it goes back to the front of the queue, to be recomputed from its prompt and the tokens it had generated. The
//! oldest request is never preempted, and the cache holds at least one whole context window, so it always
//! finishes. A forward pass that fails is retried one request at a time, so a failing request fails alone.
//!
//! What a request may ask is request.rs's business, what becomes of its logits emit.rs's.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::emit::Emitter;
use super::executor::Executor;
use super::request::{Event, EventSink, Request, RequestId};
use crate::backend::SeqSlice;
use crate::kv::SeqId;
use crate::loader::TextDecoder;
use crate::{Error, Result};

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
}

/// A request the scheduler holds, queued or running.
struct Sequence {
    id: RequestId,
    request: Request,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose keys and values are in the KV cache.
    computed: usize,
    kv: Option<SeqId>,
    emitter: Emitter,
    sink: EventSink,
    /// Runs in a batch of its own, until it has recomputed its tokens: a batch it was in failed.
    solo: bool,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.request.prompt_ids.len()
    }

    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    fn kv(&self) -> SeqId {
        self.kv.expect("running sequences hold KV")
    }
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
    waiting: VecDeque<Sequence>,
    /// In arrival order: the last is the first to be preempted.
    running: Vec<Sequence>,
    preemptions: u64,
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
        }
    }

    /// Queues a request; its events go to `sink`. An invalid request or a full queue is refused: `sink` gets a
    /// `Failed` event with the reason, which is also returned.
    pub fn submit(&mut self, id: RequestId, request: Request, mut sink: EventSink) -> Result<()> {
        let refusal = request
            .validate(self.config.max_model_len, self.executor.vocab_size())
            .err()
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
        self.waiting.push_back(Sequence {
            id,
            tokens: request.prompt_ids.clone(),
            computed: 0,
            kv: None,
            emitter: Emitter::new(&request),
            request,
            sink,
            solo: false,
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
    }

    /// Moves the newest running request back to the front of the queue, freeing its KV.
    fn preempt_newest(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            tracing::debug!(
                "KV full: preempting request {} ({} tokens to recompute)",
                seq.id.0,
                seq.tokens.len()
            );
            self.free_kv(&mut seq);
            self.waiting.push_front(seq);
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
            seq.kv = Some(self.executor.kv_mut().alloc_seq());
            self.running.push(seq);
        }
    }

    /// Picks this step's slices (index into `running`, tokens to feed) and grows their KV blocks, preempting the
    /// newest requests until something can run.
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
            self.preempt_newest();
        }
    }

    /// Grows `seq`'s blocks for a chunk of at most `budget` of its pending tokens, as many as the free blocks
    /// allow; the chunk's length (0: nothing can run).
    fn grow_chunk(&mut self, i: usize, budget: usize) -> usize {
        let seq = &self.running[i];
        let kv = self.executor.kv_mut();
        let room = kv.blocks().max_tokens_for(seq.kv()).saturating_sub(seq.computed);
        let len = seq.pending().min(budget).min(room);
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
        let executor = &mut self.executor;
        let result = catch_unwind(AssertUnwindSafe(|| executor.forward(&ids, &slices)))
            .unwrap_or_else(|_| Err(Error::Request("internal error in the forward pass".into())));
        let logits = match result {
            Ok(logits) => logits,
            Err(e) => {
                self.isolate_failure(&plan, e);
                return StepReport::default();
            }
        };
        let vocab = self.executor.vocab_size();
        let sampled = self.config.sampled_vocab.map_or(vocab, |n| n.min(vocab));
        let mut report = StepReport::default();
        let mut retired = Vec::new();
        for (row, &(i, len)) in plan.iter().enumerate() {
            let seq = &mut self.running[i];
            seq.computed += len;
            if seq.pending() > 0 {
                report.prefill_tokens += len;
                continue;
            }
            if len == 1 {
                report.decode_tokens += 1;
            } else {
                report.prefill_tokens += len;
            }
            // Recomputed alone up to its next token, it is not what failed the batch: back to the shared batch.
            seq.solo = false;
            let row_logits = &logits[row * vocab..row * vocab + sampled];
            let emitted = seq.emitter.next_token(
                &seq.request,
                &mut seq.tokens,
                row_logits,
                self.decoder.as_ref(),
                self.config.max_model_len,
            );
            let last_event = match emitted {
                Err(e) => Some(Event::Failed { message: e.to_string() }),
                Ok(emitted) => {
                    let listening = (seq.sink)(Event::Token {
                        id: emitted.id,
                        text: emitted.text,
                    });
                    match (listening, emitted.finish) {
                        (false, _) => None,
                        (true, None) => continue,
                        (true, Some(reason)) => Some(Event::Finished {
                            reason,
                            prompt_tokens: seq.request.prompt_ids.len(),
                            completion_tokens: seq.generated(),
                        }),
                    }
                }
            };
            retired.push((i, last_event));
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
                seq.kv = Some(cache.alloc_seq());
            }
            seq.computed = 0;
            seq.solo = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::mpsc;

    use super::*;
    use crate::engine::emit::tests::Letters;
    use crate::engine::{FinishReason, SamplingParams, StopRules};
    use crate::kv::{BlockAllocator, KvCache};

    const VOCAB: usize = 16;
    /// A prompt holding this token makes the forward pass fail; this one makes it panic.
    const FAILS: u32 = 15;
    const PANICS: u32 = 14;

    /// A cache of blocks that keeps each sequence's tokens.
    struct FakeKv {
        blocks: BlockAllocator,
        tokens: HashMap<SeqId, Vec<u32>>,
    }

    impl KvCache for FakeKv {
        fn alloc_seq(&mut self) -> SeqId {
            let seq = self.blocks.alloc_seq();
            self.tokens.insert(seq, Vec::new());
            seq
        }

        fn free_seq(&mut self, seq: SeqId) {
            self.blocks.free_seq(seq);
            self.tokens.remove(&seq);
        }

        fn blocks(&self) -> &BlockAllocator {
            &self.blocks
        }

        fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
            self.blocks.grow(seq, tokens)
        }
    }

    /// Next token = (sum of the sequence's tokens so far) mod 13: depends on the whole history, so a wrong KV
    /// position, a lost token or a bad recompute changes the output. Takes each batch's blocks as a real cache does
    /// (a batch the scheduler did not grow the blocks for fails) and checks every slice starts where its sequence
    /// ends.
    struct FakeModel {
        kv: FakeKv,
        batches: Vec<Vec<usize>>,
    }

    impl FakeModel {
        /// A cache of `blocks` blocks of 4 tokens.
        fn new(blocks: usize) -> Self {
            let kv = FakeKv {
                blocks: BlockAllocator::new(4, blocks),
                tokens: HashMap::new(),
            };
            FakeModel {
                kv,
                batches: Vec::new(),
            }
        }
    }

    impl Executor for FakeModel {
        fn vocab_size(&self) -> usize {
            VOCAB
        }

        fn kv(&self) -> &dyn KvCache {
            &self.kv
        }

        fn kv_mut(&mut self) -> &mut dyn KvCache {
            &mut self.kv
        }

        fn forward(&mut self, ids: &[u32], batch: &[SeqSlice]) -> Result<Vec<f32>> {
            if ids.contains(&PANICS) {
                panic!("a bug in a kernel");
            }
            if ids.contains(&FAILS) {
                return Err(Error::Request("poisoned batch".into()));
            }
            let free_before = self.kv.blocks.free_blocks();
            let slices: Vec<_> = batch.iter().map(|s| (s.seq, s.start_pos, s.len)).collect();
            self.kv.blocks.extend(&slices)?;
            assert_eq!(
                self.kv.blocks.free_blocks(),
                free_before,
                "the scheduler grew every block first"
            );
            self.batches.push(batch.iter().map(|s| s.len).collect());
            let mut logits = Vec::new();
            let mut row = 0;
            for slice in batch {
                let cached = self.kv.tokens.get_mut(&slice.seq).expect("allocated sequence");
                assert_eq!(cached.len(), slice.start_pos, "slice starts where the sequence ends");
                cached.extend_from_slice(&ids[row..row + slice.len]);
                row += slice.len;
                let next = cached.iter().sum::<u32>() % 13;
                logits.extend((0..VOCAB as u32).map(|t| if t == next { 1.0 } else { 0.0 }));
            }
            Ok(logits)
        }
    }

    fn scheduler(max_running: usize, step_tokens: usize, blocks: usize) -> Scheduler<FakeModel> {
        scheduler_sampling(max_running, step_tokens, blocks, None)
    }

    fn scheduler_sampling(
        max_running: usize,
        step_tokens: usize,
        blocks: usize,
        sampled_vocab: Option<usize>,
    ) -> Scheduler<FakeModel> {
        let config = SchedulerConfig {
            max_running,
            max_queued: 4,
            step_tokens,
            max_model_len: 16,
            sampled_vocab,
        };
        Scheduler::new(config, FakeModel::new(blocks), Arc::new(Letters)).unwrap()
    }

    fn request(prompt: &[u32], max_tokens: usize) -> Request {
        Request {
            prompt_ids: prompt.to_vec(),
            max_tokens,
            sampling: SamplingParams::default(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop_strings: vec![],
            stop: StopRules::default(),
        }
    }

    /// Submits a request and returns where its events arrive.
    fn submit(s: &mut Scheduler<FakeModel>, id: u64, r: Request) -> mpsc::Receiver<Event> {
        let (tx, rx) = mpsc::channel();
        s.submit(RequestId(id), r, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        rx
    }

    fn run_to_idle(s: &mut Scheduler<FakeModel>) {
        for _ in 0..200 {
            if s.is_idle() {
                return;
            }
            s.step();
        }
        panic!("the scheduler never went idle");
    }

    /// The text of a finished request and how it finished.
    fn outcome(rx: &mpsc::Receiver<Event>) -> (String, Event) {
        let mut text = String::new();
        for event in rx.try_iter() {
            match event {
                Event::Token { text: piece, .. } => text.push_str(&piece),
                last => return (text, last),
            }
        }
        panic!("no final event after {text:?}");
    }

    fn alone(prompt: &[u32], max_tokens: usize) -> String {
        let mut s = scheduler(1, 64, 16);
        let rx = submit(&mut s, 0, request(prompt, max_tokens));
        run_to_idle(&mut s);
        outcome(&rx).0
    }

    #[test]
    fn a_capped_vocabulary_is_never_sampled_beyond() {
        let prompt = [3u32, 4];
        assert!(
            alone(&prompt, 6).chars().any(|c| c >= 'f'),
            "the fake model picks ids past 5 here"
        );
        let mut s = scheduler_sampling(1, 64, 16, Some(5));
        let rx = submit(&mut s, 0, request(&prompt, 6));
        run_to_idle(&mut s);
        let (text, _) = outcome(&rx);
        assert_eq!(text.len(), 6);
        assert!(text.chars().all(|c| c < 'f'), "{text}");
    }

    #[test]
    fn batched_requests_generate_what_they_generate_alone() {
        let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9, 10]];
        let mut s = scheduler(2, 64, 16);
        let rxs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| submit(&mut s, i as u64, request(p, 5)))
            .collect();
        s.step();
        assert_eq!((s.stats().running, s.stats().queued), (2, 1), "two run, one waits");
        run_to_idle(&mut s);
        for (p, rx) in prompts.iter().zip(&rxs) {
            let (text, last) = outcome(rx);
            assert_eq!(text, alone(p, 5));
            assert!(matches!(
                last,
                Event::Finished {
                    reason: FinishReason::Length,
                    completion_tokens: 5,
                    ..
                }
            ));
        }
        assert_eq!(s.stats().kv_blocks_used, 0);
        assert!(s.executor.kv.tokens.is_empty(), "every sequence was freed");
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_beside_running_decodes() {
        let mut s = scheduler(2, 4, 16);
        let decoding = submit(&mut s, 0, request(&[1], 8));
        s.step();
        let long = [2u32; 11];
        let prefilling = submit(&mut s, 1, request(&long, 2));
        run_to_idle(&mut s);
        // The decode gets its token in every step while the prompt goes in chunks of the remaining budget.
        assert_eq!(
            &s.executor.batches[..5],
            [vec![1], vec![1, 3], vec![1, 3], vec![1, 3], vec![1, 2]]
        );
        assert!(s.executor.batches.iter().all(|b| b.iter().sum::<usize>() <= 4));
        assert_eq!(outcome(&decoding).0, alone(&[1], 8));
        assert_eq!(outcome(&prefilling).0, alone(&long, 2));
    }

    #[test]
    fn when_kv_runs_out_the_newest_is_preempted_and_recomputed() {
        // 4 blocks of 4 tokens: one context window (16); two requests that would need 12 each.
        let mut s = scheduler(2, 64, 4);
        let a = submit(&mut s, 0, request(&[1, 2, 3, 4, 5], 7));
        let b = submit(&mut s, 1, request(&[6, 7, 8, 9, 10], 7));
        let mut peak = 0;
        while !s.is_idle() {
            s.step();
            peak = peak.max(s.stats().kv_blocks_used);
            assert!(s.stats().kv_blocks_used <= 4);
        }
        assert_eq!(peak, 4);
        assert!(s.stats().preemptions > 0);
        assert_eq!(outcome(&a).0, alone(&[1, 2, 3, 4, 5], 7));
        assert_eq!(outcome(&b).0, alone(&[6, 7, 8, 9, 10], 7));
        assert!(s.executor.kv.tokens.is_empty());
    }

    #[test]
    fn cancelling_or_hanging_up_frees_kv_at_once() {
        let mut s = scheduler(2, 64, 16);
        let _kept = submit(&mut s, 0, request(&[1, 2, 3, 4, 5], 10));
        let hung_up = submit(&mut s, 1, request(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 10));
        s.step();
        assert_eq!(s.stats().kv_blocks_used, 2 + 3);
        s.cancel(RequestId(0));
        assert_eq!(s.stats().kv_blocks_used, 3);
        assert_eq!(s.executor.kv.tokens.len(), 1);
        drop(hung_up);
        s.step();
        assert_eq!(s.stats().kv_blocks_used, 0);
        assert!(s.is_idle());
    }

    #[test]
    fn a_request_that_stops_early_is_retired_with_its_counts() {
        // Alone, prompt [1] generates b, c, e, i, ... (running sums mod 13).
        assert_eq!(&alone(&[1], 6)[..4], "bcei");
        let mut s = scheduler(4, 64, 16);
        let mut eos = request(&[1], 6);
        eos.stop.eos_token_ids = vec![4];
        let eos = submit(&mut s, 0, eos);
        let mut stopped = request(&[1], 6);
        stopped.stop_strings = vec!["ei".into()];
        let stopped = submit(&mut s, 1, stopped);
        let full = submit(&mut s, 2, request(&[1], 6));
        run_to_idle(&mut s);
        let finished = |reason, completion_tokens| Event::Finished {
            reason,
            prompt_tokens: 1,
            completion_tokens,
        };
        assert_eq!(outcome(&eos), ("bc".into(), finished(FinishReason::Stop, 3)));
        assert_eq!(outcome(&stopped), ("bc".into(), finished(FinishReason::Stop, 4)));
        assert_eq!(outcome(&full).1, finished(FinishReason::Length, 6));
        assert!(s.executor.kv.tokens.is_empty());
    }

    #[test]
    fn a_failing_request_fails_alone() {
        for bad_token in [FAILS, PANICS] {
            let mut s = scheduler(3, 64, 16);
            let good = submit(&mut s, 0, request(&[1, 2], 4));
            let bad = submit(&mut s, 1, request(&[3, bad_token], 4));
            let other = submit(&mut s, 2, request(&[5], 4));
            run_to_idle(&mut s);
            assert_eq!(outcome(&good).0, alone(&[1, 2], 4));
            assert_eq!(outcome(&other).0, alone(&[5], 4));
            assert!(matches!(outcome(&bad).1, Event::Failed { .. }));
            assert!(s.executor.kv.tokens.is_empty());
            assert_eq!(s.stats().kv_blocks_used, 0);
        }
    }

    #[test]
    fn after_a_failed_batch_the_healthy_requests_are_batched_together_again() {
        let mut s = scheduler(3, 64, 16);
        let good = submit(&mut s, 0, request(&[1, 2], 6));
        let bad = submit(&mut s, 1, request(&[3, FAILS], 6));
        let other = submit(&mut s, 2, request(&[5], 6));
        run_to_idle(&mut s);
        assert!(matches!(outcome(&bad).1, Event::Failed { .. }));
        assert_eq!(outcome(&good).0, alone(&[1, 2], 6));
        assert_eq!(outcome(&other).0, alone(&[5], 6));
        // The batch of three failed; each member was recomputed alone (the bad one failing), then the two healthy
        // ones decode side by side again instead of one after the other.
        let mut expected = vec![vec![2], vec![1]];
        expected.extend(std::iter::repeat_n(vec![1, 1], 5));
        assert_eq!(s.executor.batches, expected);
    }

    #[test]
    fn invalid_requests_and_a_full_queue_are_refused_with_a_reason() {
        let mut s = scheduler(1, 64, 16);
        let refused = |s: &mut Scheduler<FakeModel>, id, r| {
            let (tx, rx) = mpsc::channel();
            let err = s
                .submit(RequestId(id), r, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap_err();
            assert!(matches!(rx.try_recv(), Ok(Event::Failed { .. })));
            err.to_string()
        };
        assert!(refused(&mut s, 0, request(&[99], 1)).contains("vocabulary"));
        // One running place and four queued ones.
        let _held: Vec<_> = (0..5).map(|i| submit(&mut s, i, request(&[1], 1))).collect();
        assert!(refused(&mut s, 9, request(&[1], 1)).contains("queue is full"));
    }

    #[test]
    fn a_cache_shorter_than_the_context_window_is_refused() {
        let config = SchedulerConfig {
            max_running: 1,
            max_queued: 0,
            step_tokens: 64,
            max_model_len: 16,
            sampled_vocab: None,
        };
        let err = Scheduler::new(config, FakeModel::new(3), Arc::new(Letters))
            .err()
            .unwrap();
        assert!(err.to_string().contains("hold 12 tokens"), "{err}");
    }
}
