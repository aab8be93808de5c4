//! The scheduler on a fake model whose next token depends on the whole history (so a wrong position or a bad
//! recompute shows): batching, chunked prefill, preemption, cancellation, failure isolation, refusals.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;

use super::*;
use crate::engine::emit::tests::Letters;
use crate::engine::{argmax, FinishReason, SamplingParams};
use crate::kv::{BlockAllocator, KvCache};

const VOCAB: usize = 16;
/// A prompt holding this token makes the forward pass fail; this one makes it panic.
const FAILS: u32 = 15;
const PANICS: u32 = 14;

/// A paged cache that keeps the token each slot holds, and for a fake hybrid, each sequence's "recurrent state":
/// how many tokens it has seen and their sum.
struct FakeKv {
    blocks: BlockAllocator,
    /// Sequences started and not yet ended.
    live: HashSet<SeqId>,
    /// The token in each physical slot (block * block size + offset).
    slots: HashMap<u32, u32>,
    /// None: attention only.
    states: Option<HashMap<SeqId, (usize, u32)>>,
    snapshots: HashMap<usize, (usize, u32)>,
}

impl KvCache for FakeKv {
    fn alloc_seq(&mut self) -> SeqId {
        let seq = self.blocks.alloc_seq();
        self.live.insert(seq);
        if let Some(states) = &mut self.states {
            states.insert(seq, (0, 0));
        }
        seq
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.blocks.free_seq(seq);
        self.live.remove(&seq);
        if let Some(states) = &mut self.states {
            states.remove(&seq);
        }
    }

    fn blocks(&self) -> &BlockAllocator {
        &self.blocks
    }

    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        &mut self.blocks
    }

    fn has_recurrent_state(&self) -> bool {
        self.states.is_some()
    }

    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.blocks.grow(seq, tokens)
    }
}

/// Next token = (sum of the tokens in the sequence's KV blocks) mod 13, plus, for a fake hybrid, 3 x its state's
/// sum: depends on the whole history, so a wrong KV position or block, a lost token, a bad recompute or a wrong
/// restored state changes the output. Takes each batch's blocks as a real cache does (a batch the scheduler did
/// not grow the blocks for fails) and checks every slice starts where its sequence (and its state) ends.
struct FakeModel {
    kv: FakeKv,
    batches: Vec<Vec<usize>>,
    /// Steps that brought back only each row's argmax.
    argmax_steps: usize,
}

impl FakeModel {
    /// A cache of `blocks` blocks of 4 tokens.
    fn new(blocks: usize) -> Self {
        let kv = FakeKv {
            blocks: BlockAllocator::new(4, blocks),
            live: HashSet::new(),
            slots: HashMap::new(),
            states: None,
            snapshots: HashMap::new(),
        };
        FakeModel {
            kv,
            batches: Vec::new(),
            argmax_steps: 0,
        }
    }

    /// With prefix caching (and `snapshot_slots` for a hybrid, whose sequences then keep a state).
    fn caching(blocks: usize, hybrid: bool, snapshot_slots: usize) -> Self {
        let mut model = FakeModel::new(blocks);
        model.kv.blocks.enable_prefix_cache(snapshot_slots);
        model.kv.states = hybrid.then(HashMap::new);
        model
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
            let fed = &ids[row..row + slice.len];
            row += slice.len;
            for (pos, &token) in (slice.start_pos..).zip(fed) {
                self.kv.slots.insert(self.kv.blocks.slot(slice.seq, pos)?, token);
            }
            let end = slice.start_pos + slice.len;
            let mut next = (0..end)
                .map(|pos| Ok(self.kv.slots[&self.kv.blocks.slot(slice.seq, pos)?]))
                .sum::<Result<u32>>()?;
            if let Some(states) = &mut self.kv.states {
                let state = states.get_mut(&slice.seq).expect("allocated sequence");
                assert_eq!(state.0, slice.start_pos, "slice starts where the state ends");
                *state = (end, state.1 + fed.iter().sum::<u32>());
                next += 3 * state.1;
            }
            logits.extend((0..VOCAB as u32).map(|t| if t == next % 13 { 1.0 } else { 0.0 }));
        }
        Ok(logits)
    }

    fn forward_argmax(&mut self, ids: &[u32], batch: &[SeqSlice], cols: usize) -> Result<Vec<u32>> {
        self.argmax_steps += 1;
        let logits = self.forward(ids, batch)?;
        Ok(logits.chunks(VOCAB).map(|row| argmax(&row[..cols]) as u32).collect())
    }

    fn save_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        let state = self.kv.states.as_ref().expect("a hybrid")[&seq];
        self.kv.snapshots.insert(slot, state);
        Ok(())
    }

    fn restore_state(&mut self, seq: SeqId, slot: usize) -> Result<()> {
        let snapshot = self.kv.snapshots[&slot];
        self.kv.states.as_mut().expect("a hybrid").insert(seq, snapshot);
        Ok(())
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
        policy: SchedulingPolicy::Fcfs,
    };
    Scheduler::new(config, FakeModel::new(blocks), Arc::new(Letters)).unwrap()
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    Request::new(prompt.to_vec(), max_tokens)
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
/// The text a request wrote and the event that ended it (its prompt's logprobs, if asked for, passed over).
fn outcome(rx: &mpsc::Receiver<Event>) -> (String, Event) {
    let mut text = String::new();
    for event in rx.try_iter() {
        match event {
            Event::Token { text: piece, .. } => text.push_str(&piece),
            Event::PromptToken { .. } => {}
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
    assert!(s.executor.kv.live.is_empty(), "every sequence was freed");
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
    assert!(s.executor.kv.live.is_empty());
}

/// A scheduler of `scheduler(..)`'s kind serving by priority.
fn by_priority(max_running: usize, blocks: usize) -> Scheduler<FakeModel> {
    let config = SchedulerConfig {
        policy: SchedulingPolicy::Priority,
        ..scheduler(max_running, 64, blocks).config().clone()
    };
    Scheduler::new(config, FakeModel::new(blocks), Arc::new(Letters)).unwrap()
}

fn prioritised(prompt: &[u32], max_tokens: usize, priority: i64) -> Request {
    Request {
        priority,
        ..request(prompt, max_tokens)
    }
}

/// Steps `s` until idle; the step at which each of `rxs` finished, and its text.
fn finishing_steps(s: &mut Scheduler<FakeModel>, rxs: &[mpsc::Receiver<Event>]) -> Vec<(usize, String)> {
    let mut done: Vec<Option<(usize, String)>> = vec![None; rxs.len()];
    let mut texts = vec![String::new(); rxs.len()];
    for step in 0..400 {
        if s.is_idle() {
            break;
        }
        s.step();
        for (i, rx) in rxs.iter().enumerate() {
            for event in rx.try_iter() {
                match event {
                    Event::Token { text, .. } => texts[i].push_str(&text),
                    Event::Finished { .. } => done[i] = Some((step, texts[i].clone())),
                    other => panic!("{other:?}"),
                }
            }
        }
    }
    done.into_iter().map(|d| d.expect("finished")).collect()
}

#[test]
fn priority_scheduling_serves_lower_priorities_first_then_by_arrival() {
    let mut s = by_priority(1, 16);
    let rxs: Vec<_> = [(0, 5), (1, -1), (2, 5), (3, 0)]
        .into_iter()
        .map(|(id, priority)| submit(&mut s, id, prioritised(&[1, 2, 3], 3, priority)))
        .collect();
    let finished: Vec<usize> = finishing_steps(&mut s, &rxs)
        .into_iter()
        .map(|(step, _)| step)
        .collect();
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by_key(|&i| finished[i]);
    assert_eq!(order, [1, 3, 0, 2]);
}

#[test]
fn under_priority_scheduling_kv_shortage_preempts_the_lowest_priority() {
    // As when_kv_runs_out_the_newest_is_preempted_and_recomputed, but the older request has the lower priority:
    // it is the one preempted, so the newer finishes first; first come first served does the opposite.
    for (policy, newer_first) in [(SchedulingPolicy::Priority, true), (SchedulingPolicy::Fcfs, false)] {
        let mut s = match policy {
            SchedulingPolicy::Priority => by_priority(2, 4),
            SchedulingPolicy::Fcfs => scheduler(2, 64, 4),
        };
        let priority = |p| if policy == SchedulingPolicy::Priority { p } else { 0 };
        let older = submit(&mut s, 0, prioritised(&[1, 2, 3, 4, 5], 7, priority(1)));
        let newer = submit(&mut s, 1, prioritised(&[6, 7, 8, 9, 10], 7, priority(0)));
        let finished = finishing_steps(&mut s, &[older, newer]);
        assert!(s.stats().preemptions > 0, "{policy:?}");
        assert_eq!(finished[1].0 < finished[0].0, newer_first, "{policy:?}: {finished:?}");
        assert_eq!(finished[0].1, alone(&[1, 2, 3, 4, 5], 7));
        assert_eq!(finished[1].1, alone(&[6, 7, 8, 9, 10], 7));
    }
}

#[test]
fn first_come_first_served_refuses_a_priority() {
    let mut s = scheduler(1, 64, 16);
    let (tx, _rx) = mpsc::channel();
    let error = s
        .submit(
            RequestId(0),
            prioritised(&[1], 2, 3),
            Box::new(move |e| tx.send(e).is_ok()),
        )
        .unwrap_err();
    assert!(error.to_string().contains("--scheduling-policy priority"), "{error}");
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
    assert_eq!(s.executor.kv.live.len(), 1);
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
        cached_tokens: 0,
        reason,
        prompt_tokens: 1,
        completion_tokens,
    };
    assert_eq!(outcome(&eos), ("bc".into(), finished(FinishReason::Stop, 3)));
    assert_eq!(
        outcome(&stopped),
        ("bc".into(), finished(FinishReason::StopString(0), 4))
    );
    assert_eq!(outcome(&full).1, finished(FinishReason::Length, 6));
    assert!(s.executor.kv.live.is_empty());
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
        assert!(s.executor.kv.live.is_empty());
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
        policy: SchedulingPolicy::Fcfs,
    };
    let err = Scheduler::new(config, FakeModel::new(3), Arc::new(Letters))
        .err()
        .unwrap();
    assert!(err.to_string().contains("hold 12 tokens"), "{err}");
}

/// Greedy requests' steps bring back only each row's argmax; a step with a request that samples, asks for
/// logprobs or has a penalty brings back the logits. The greedy text is the same either way.
#[test]
fn steps_of_greedy_requests_bring_back_only_the_argmax() {
    let run = |greedy: Request, other: Option<Request>| {
        let mut s = scheduler(2, 64, 16);
        let greedy_rx = submit(&mut s, 0, greedy);
        let other_rx = other.map(|r| submit(&mut s, 1, r));
        run_to_idle(&mut s);
        let text = outcome(&greedy_rx).0;
        (text, other_rx.map(|rx| outcome(&rx).0), s.executor.argmax_steps)
    };
    let (alone_text, _, argmax_steps) = run(request(&[1, 2, 3], 6), None);
    assert_eq!(argmax_steps, 6, "the prompt's step and five decode steps");
    let mut sampled = request(&[4, 5], 6);
    sampled.sampling = SamplingParams {
        temperature: 0.8,
        seed: Some(7),
        ..SamplingParams::default()
    };
    let mut logprobs = request(&[4, 5], 6);
    logprobs.logprobs = Some(2);
    let mut penalised = request(&[4, 5], 6);
    penalised.presence_penalty = 0.5;
    for other in [sampled, logprobs, penalised] {
        let (text, _, argmax_steps) = run(request(&[1, 2, 3], 6), Some(other));
        assert_eq!(text, alone_text);
        assert_eq!(argmax_steps, 0, "every step had a row that needs its logits");
    }
    let (text, other_text, argmax_steps) = run(request(&[1, 2, 3], 6), Some(request(&[4, 5], 6)));
    assert_eq!((text, argmax_steps), (alone_text, 6));
    assert_eq!(other_text.as_deref(), Some(alone(&[4, 5], 6).as_str()));
}

mod prefix;
