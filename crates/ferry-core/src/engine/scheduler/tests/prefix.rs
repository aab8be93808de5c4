//! Prefix caching in the scheduler, on the fake model (its next token reads every KV block of the sequence and,
//! as a hybrid, its state): answers from the cache equal cold ones, for prefixes that end mid-block or diverge
//! inside one, shared blocks survive cancellation, preemption and eviction of their other readers, and a hybrid
//! resumes only from saved states, its chunks cut at anchors.

use super::*;

/// Blocks of 4 tokens, so these prompts span several.
fn caching(max_running: usize, step_tokens: usize, blocks: usize, hybrid: bool) -> Scheduler<FakeModel> {
    let config = SchedulerConfig {
        max_running,
        max_queued: 16,
        step_tokens,
        max_model_len: 4 * blocks.min(400),
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    Scheduler::new(config, FakeModel::caching(blocks, hybrid, 4), Arc::new(Letters)).unwrap()
}

/// Greedy text of `prompt` computed from scratch (a scheduler without prefix caching, as large).
fn cold(prompt: &[u32], max_tokens: usize, hybrid: bool) -> String {
    let config = SchedulerConfig {
        max_running: 1,
        max_queued: 1,
        step_tokens: 64,
        max_model_len: 1600,
        sampled_vocab: None,
        policy: SchedulingPolicy::Fcfs,
    };
    let mut model = FakeModel::new(400);
    model.kv.states = hybrid.then(HashMap::new);
    let mut s = Scheduler::new(config, model, Arc::new(Letters)).unwrap();
    let rx = submit(&mut s, 0, request(prompt, max_tokens));
    run_to_idle(&mut s);
    outcome(&rx).0
}

/// Runs `prompt` alone on `s`; its text and how many prompt tokens came from the cache.
fn answer(s: &mut Scheduler<FakeModel>, id: u64, prompt: &[u32], max_tokens: usize) -> (String, usize) {
    let rx = submit(s, id, request(prompt, max_tokens));
    run_to_idle(s);
    match outcome(&rx) {
        (text, Event::Finished { cached_tokens, .. }) => (text, cached_tokens),
        (_, other) => panic!("{other:?}"),
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|t| (t * 7 + seed * 3 + t / 5) % 13).collect()
}

#[test]
fn cached_answers_equal_cold_ones() {
    for hybrid in [false, true] {
        let mut s = caching(2, 64, 64, hybrid);
        let base = prompt(18, 1);
        let (text, cached) = answer(&mut s, 0, &base, 5);
        assert_eq!((text.as_str(), cached), (cold(&base, 5, hybrid).as_str(), 0));
        // The same prompt: its full blocks but the one holding the last token (or the anchor at 16).
        let (text, cached) = answer(&mut s, 1, &base, 5);
        assert_eq!((text.as_str(), cached), (cold(&base, 5, hybrid).as_str(), 16));
        // A longer prompt whose shared prefix ends mid-block (18 tokens, blocks of 4).
        let mut longer = base.clone();
        longer.extend(prompt(9, 2));
        let (text, cached) = answer(&mut s, 2, &longer, 5);
        assert_eq!(text, cold(&longer, 5, hybrid));
        assert_eq!(
            cached, 16,
            "hybrid {hybrid}: the blocks (and anchor) before the shared prefix's partial block"
        );
        // Diverging inside the third block (position 9): only the first two blocks are shared; a hybrid has no
        // state saved there, so it shares nothing.
        let mut diverging = longer.clone();
        diverging[9] = (diverging[9] + 1) % 13;
        let (text, cached) = answer(&mut s, 3, &diverging, 5);
        assert_eq!(text, cold(&diverging, 5, hybrid));
        assert_eq!(cached, if hybrid { 0 } else { 8 });
        let stats = s.stats();
        assert_eq!(stats.prefix.queries, 4);
        assert_eq!(stats.prefix.hit_tokens, 32 + if hybrid { 0 } else { 8 });
        assert_eq!(stats.kv_blocks_used, 0, "every request ended");
        assert!(stats.kv_blocks_cached > 0, "their blocks stay cached");
    }
}

#[test]
fn a_cache_salt_shares_blocks_only_within_its_salt() {
    for hybrid in [false, true] {
        let mut s = caching(2, 64, 64, hybrid);
        let base = prompt(18, 1);
        let salted = |id: u64, salt: Option<&str>, logprobs: Option<usize>, s: &mut Scheduler<FakeModel>| {
            let mut r = request(&base, 5);
            r.cache_salt = salt.map(str::to_string);
            r.prompt_logprobs = logprobs;
            let rx = submit(s, id, r);
            run_to_idle(s);
            match outcome(&rx) {
                (text, Event::Finished { cached_tokens, .. }) => (text, cached_tokens),
                (_, other) => panic!("{other:?}"),
            }
        };
        let expected = cold(&base, 5, hybrid);
        // A prompt computed whole for its logprobs publishes its blocks under its salt too.
        assert_eq!(salted(0, Some("a"), Some(0), &mut s), (expected.clone(), 0));
        assert_eq!(salted(1, Some("a"), None, &mut s), (expected.clone(), 16));
        assert_eq!(salted(2, Some("b"), None, &mut s), (expected.clone(), 0));
        assert_eq!(salted(3, None, None, &mut s), (expected.clone(), 0));
        assert_eq!(salted(4, None, None, &mut s), (expected.clone(), 16));
        assert_eq!(salted(5, Some("b"), None, &mut s), (expected, 16));
    }
}

#[test]
fn a_hybrid_prompt_is_cut_at_its_anchors() {
    let mut s = caching(1, 64, 64, true);
    let base = prompt(18, 3);
    answer(&mut s, 0, &base, 2);
    // The prompt stops at its last block boundary (16) so its state can be saved there, then its last 2 tokens.
    assert_eq!(s.executor.batches[..3], [vec![16], vec![2], vec![1]]);
    let mut s = caching(1, 7, 64, true);
    answer(&mut s, 0, &base, 2);
    // Chunks that do not end the prompt end on a block boundary: 7 -> 4, then 4 + 7 -> 8, ...
    assert_eq!(s.executor.batches[..5], [vec![4], vec![4], vec![4], vec![4], vec![2]]);
    let mut longer = base.clone();
    longer.extend(prompt(6, 4));
    let (text, cached) = answer(&mut s, 1, &longer, 3);
    assert_eq!((text, cached), (cold(&longer, 3, true), 16));
}

#[test]
fn a_long_hybrid_prompt_saves_its_state_every_anchor_interval() {
    let interval = ANCHOR_EVERY_BLOCKS * 4;
    let mut s = caching(1, 512, 400, true);
    let long = prompt(interval + 90, 5);
    answer(&mut s, 0, &long, 2);
    // Diverging after the first interval but before the prompt's end: resumes from the anchor in between.
    let mut diverging = long.clone();
    diverging[interval + 40] = (diverging[interval + 40] + 1) % 13;
    let (text, cached) = answer(&mut s, 1, &diverging, 3);
    assert_eq!((text, cached), (cold(&diverging, 3, true), interval));
}

#[test]
fn shared_blocks_outlive_a_cancelled_or_preempted_reader() {
    for hybrid in [false, true] {
        // 16 blocks of 4 tokens: room for the shared prefix and both requests' own blocks, not much more.
        let mut s = caching(2, 64, 16, hybrid);
        let base = prompt(13, 6);
        answer(&mut s, 0, &base, 1);
        let mut a_prompt = base.clone();
        a_prompt.extend([1, 2, 3]);
        let mut b_prompt = base.clone();
        b_prompt.extend([4, 5]);
        let a = submit(&mut s, 1, request(&a_prompt, 30));
        let b = submit(&mut s, 2, request(&b_prompt, 30));
        s.step();
        s.step();
        // Both read the cached prefix; the first is cancelled, the second carries on reading it.
        s.cancel(RequestId(1));
        run_to_idle(&mut s);
        assert!(a.try_iter().all(|e| matches!(e, Event::Token { .. })));
        let (text, last) = outcome(&b);
        assert!(matches!(last, Event::Finished { cached_tokens: 12, .. }), "{last:?}");
        assert_eq!(
            text,
            cold(&b_prompt, 30, hybrid).chars().take(text.len()).collect::<String>()
        );
        // Now two long generations sharing the prefix outgrow the cache: the newest is preempted (and evicts
        // cached blocks when it comes back) while the oldest keeps reading the shared ones.
        let a = submit(&mut s, 3, request(&a_prompt, 40));
        let b = submit(&mut s, 4, request(&b_prompt, 40));
        run_to_idle(&mut s);
        assert!(s.stats().preemptions > 0, "hybrid {hybrid}");
        for (rx, p) in [(a, &a_prompt), (b, &b_prompt)] {
            let (text, last) = outcome(&rx);
            assert!(matches!(last, Event::Finished { .. }), "{last:?}");
            assert_eq!(text, cold(p, 40, hybrid)[..text.len()]);
        }
        assert_eq!(s.stats().kv_blocks_used, 0);
        assert!(s.executor.kv.live.is_empty());
    }
}

#[test]
fn many_prompts_through_a_small_cache_evict_and_stay_exact() {
    for hybrid in [false, true] {
        let mut s = caching(3, 9, 20, hybrid);
        let prompts: Vec<Vec<u32>> = (0..12)
            .map(|i| {
                let mut p = prompt(10 + (i as usize % 4) * 3, (i % 3) as u32);
                p.push(i as u32 % 13);
                p
            })
            .collect();
        let rxs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| submit(&mut s, i as u64, request(p, 6)))
            .collect();
        run_to_idle(&mut s);
        for (p, rx) in prompts.iter().zip(&rxs) {
            assert_eq!(outcome(rx).0, cold(p, 6, hybrid), "hybrid {hybrid}");
        }
        let stats = s.stats().prefix;
        assert!(stats.hit_tokens > 0 && stats.evicted_blocks > 0, "{stats:?}");
    }
}
