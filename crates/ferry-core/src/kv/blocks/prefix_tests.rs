//! Prefix caching in the allocator: hits at block granularity, sharing by reference count, the evictable pool,
//! snapshots; and a property-style run of random operations that checks no block is ever written, freed or given
//! to another prefix while a sequence still reads it.

use std::collections::HashMap;

use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;

const BS: usize = 4;

fn cache(blocks: usize, snapshots: usize) -> BlockAllocator {
    let mut a = BlockAllocator::new(BS, blocks);
    a.enable_prefix_cache(snapshots);
    a
}

/// Starts a sequence on `tokens` (reusing what it can), computes the rest and publishes its blocks.
fn run(a: &mut BlockAllocator, tokens: &[u32]) -> (SeqId, Reused) {
    let s = a.alloc_seq();
    let reused = a.attach_prefix(s, &tokens[..tokens.len() - 1], false).unwrap();
    a.extend(&[(s, reused.tokens, tokens.len() - reused.tokens)]).unwrap();
    a.publish(s, tokens);
    (s, reused)
}

#[test]
fn a_prompt_reuses_the_full_blocks_of_its_longest_cached_prefix() {
    let mut a = cache(16, 0);
    let prompt: Vec<u32> = (0..10).collect();
    let (first, reused) = run(&mut a, &prompt);
    assert_eq!(reused.tokens, 0, "a cold cache");
    let first_blocks = a.blocks(first).unwrap().to_vec();
    // Same 10 tokens: the two full blocks (8 tokens); the partial third is the first sequence's own.
    let (second, reused) = run(&mut a, &prompt);
    assert_eq!(reused.tokens, 8);
    assert_eq!(a.blocks(second).unwrap()[..2], first_blocks[..2], "shared, not copied");
    assert_ne!(
        a.blocks(second).unwrap()[2],
        first_blocks[2],
        "the partial block is never shared"
    );
    // Diverging inside the second block: only the first is reused.
    let mut diverging = prompt.clone();
    diverging[6] = 99;
    assert_eq!(run(&mut a, &diverging).1.tokens, 4);
    // Ending exactly on a block boundary: the last token is left to compute, so one block less.
    assert_eq!(run(&mut a, &prompt[..8]).1.tokens, 4);
    // A different first block shares nothing, even with equal later blocks.
    let mut other = prompt.clone();
    other[0] = 50;
    assert_eq!(run(&mut a, &other).1.tokens, 0);
    let stats = a.prefix_stats().unwrap();
    assert_eq!((stats.queries, stats.hit_tokens), (5, 16));
}

/// [`run`] for a sequence whose blocks are keyed under `salt`.
fn run_salted(a: &mut BlockAllocator, salt: &str, tokens: &[u32]) -> Reused {
    let s = a.alloc_seq();
    a.salt_prefixes(s, salt).unwrap();
    let reused = a.attach_prefix(s, &tokens[..tokens.len() - 1], false).unwrap();
    a.extend(&[(s, reused.tokens, tokens.len() - reused.tokens)]).unwrap();
    a.publish(s, tokens);
    reused
}

#[test]
fn salted_prompts_share_blocks_only_with_prompts_of_the_same_salt() {
    let mut a = cache(32, 0);
    let prompt: Vec<u32> = (0..10).collect();
    assert_eq!(run_salted(&mut a, "tenant-a", &prompt).tokens, 0, "a cold cache");
    assert_eq!(
        run_salted(&mut a, "tenant-a", &prompt).tokens,
        8,
        "the same salt shares"
    );
    assert_eq!(
        run_salted(&mut a, "tenant-b", &prompt).tokens,
        0,
        "another salt does not"
    );
    assert_eq!(run(&mut a, &prompt).1.tokens, 0, "nor does an unsalted prompt");
    assert_eq!(run(&mut a, &prompt).1.tokens, 8, "which shares with the unsalted");
    assert_eq!(run_salted(&mut a, "tenant-b", &prompt).tokens, 8);
    // A salt applies only to a sequence that holds nothing yet.
    let s = a.alloc_seq();
    a.extend(&[(s, 0, 3)]).unwrap();
    assert!(a.salt_prefixes(s, "late").is_err());
}

#[test]
fn cached_blocks_outlive_their_sequence_until_room_is_needed() {
    let mut a = cache(4, 0);
    let prompt: Vec<u32> = (0..9).collect();
    let (s, _) = run(&mut a, &prompt);
    a.free_seq(s);
    assert_eq!((a.used_blocks(), a.free_blocks(), a.cached_blocks()), (0, 4, 2));
    let (t, reused) = run(&mut a, &prompt);
    assert_eq!(reused.tokens, 8, "kept after its request ended");
    a.free_seq(t);
    // A sequence of 16 other tokens needs every block: the cached ones are given up, the last one first.
    let (u, _) = run(&mut a, &(100..116).collect::<Vec<_>>());
    assert_eq!(a.free_blocks(), 0);
    assert_eq!(a.prefix_stats().unwrap().evicted_blocks, 2);
    a.free_seq(u);
    assert_eq!(run(&mut a, &prompt).1.tokens, 0, "evicted blocks are not found");
}

#[test]
fn evicting_the_tail_of_a_chain_keeps_its_head() {
    let mut a = cache(4, 0);
    let prompt: Vec<u32> = (0..13).collect();
    let (s, _) = run(&mut a, &prompt);
    a.free_seq(s);
    // Its partial block is free, its three full ones cached. Two blocks are needed: the free one and the chain's
    // last; its first two stay reusable.
    let (t, _) = run(&mut a, &[200, 201, 202, 203, 204]);
    assert_eq!(a.prefix_stats().unwrap().evicted_blocks, 1);
    a.free_seq(t);
    assert_eq!(run(&mut a, &prompt).1.tokens, 8);
}

#[test]
fn a_hybrid_resumes_only_from_a_block_with_a_snapshot() {
    let mut a = cache(16, 1);
    let prompt: Vec<u32> = (0..14).collect();
    let s = a.alloc_seq();
    a.attach_prefix(s, &prompt[..13], true).unwrap();
    a.extend(&[(s, 0, 8)]).unwrap();
    a.publish(s, &prompt);
    assert_eq!(a.snapshot_slot(s), Some(0), "the state after block 2");
    assert_eq!(a.snapshot_slot(s), None, "a prefix is snapshotted once");
    a.extend(&[(s, 8, 6)]).unwrap();
    a.publish(s, &prompt);
    assert_eq!(a.snapshot_slot(s), None, "not at a block boundary");
    let t = a.alloc_seq();
    let reused = a.attach_prefix(t, &prompt[..13], true).unwrap();
    assert_eq!(
        reused,
        Reused {
            tokens: 8,
            snapshot: Some(0)
        },
        "block 3 is cached but has no state"
    );
    // With the one slot taken by a deeper anchor, the shallower one's state is given up.
    a.extend(&[(t, 8, 4)]).unwrap();
    a.publish(t, &prompt);
    assert_eq!(a.snapshot_slot(t), Some(0));
    let u = a.alloc_seq();
    assert_eq!(
        a.attach_prefix(u, &prompt[..13], true).unwrap(),
        Reused {
            tokens: 12,
            snapshot: Some(0)
        }
    );
    let v = a.alloc_seq();
    assert_eq!(
        a.attach_prefix(v, &prompt[..9], true).unwrap().tokens,
        0,
        "the anchor at 8 is gone"
    );
    assert_eq!(a.prefix_stats().unwrap().evicted_snapshots, 1);
}

#[test]
fn prefix_caching_off_reuses_nothing() {
    let mut a = BlockAllocator::new(BS, 8);
    let prompt: Vec<u32> = (0..9).collect();
    let (s, _) = run(&mut a, &prompt);
    a.free_seq(s);
    assert_eq!(a.free_blocks(), 8);
    assert_eq!(run(&mut a, &prompt).1.tokens, 0);
    assert_eq!(a.prefix_stats(), None);
}

/// What the test believes each physical block holds, written as sequences extend.
#[derive(Default)]
struct Memory {
    /// Per block, per offset, the token whose keys and values are there.
    slots: HashMap<u32, [Option<u32>; BS]>,
}

#[test]
fn random_operations_never_touch_a_block_another_sequence_reads() {
    let mut rng = StdRng::seed_from_u64(16);
    for _ in 0..40 {
        let mut a = cache(rng.random_range(6..24), rng.random_range(0..3));
        let mut memory = Memory::default();
        // Live sequences: their tokens (all of them; `seq_len` of them computed).
        let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
        for _ in 0..300 {
            match rng.random_range(0..10) {
                // Start a sequence from a small alphabet so prefixes repeat, and reuse what is cached.
                0..=2 => {
                    let len = rng.random_range(2..20);
                    let mut tokens: Vec<u32> = match live.first() {
                        Some((_, other)) if rng.random_bool(0.5) => other[..len.min(other.len())].to_vec(),
                        _ => Vec::new(),
                    };
                    while tokens.len() < len {
                        tokens.push(rng.random_range(0..3));
                    }
                    let s = a.alloc_seq();
                    let reused = a.attach_prefix(s, &tokens[..len - 1], rng.random_bool(0.3)).unwrap();
                    assert_eq!(a.seq_len(s), reused.tokens);
                    for (pos, &token) in tokens[..reused.tokens].iter().enumerate() {
                        let slot = a.slot(s, pos).unwrap() as usize;
                        let held = memory.slots[&((slot / BS) as u32)][slot % BS];
                        assert_eq!(held, Some(token), "a hit holds exactly the prompt's tokens");
                    }
                    live.push((s, tokens));
                }
                // Compute a chunk of a sequence, write it, publish, maybe snapshot.
                3..=6 if !live.is_empty() => {
                    let (s, tokens) = &live[rng.random_range(0..live.len())];
                    let start = a.seq_len(*s);
                    if start == tokens.len() {
                        continue;
                    }
                    let len = rng.random_range(1..=tokens.len() - start);
                    if a.extend(&[(*s, start, len)]).is_err() {
                        continue;
                    }
                    for (pos, &token) in tokens.iter().enumerate().skip(start).take(len) {
                        let slot = a.slot(*s, pos).unwrap();
                        let block = slot / BS as u32;
                        assert_eq!(a.refs[block as usize], 1, "a block being written has one reader");
                        assert!(!a.prefix.as_ref().unwrap().is_cached(block), "nor is it cached");
                        memory.slots.entry(block).or_default()[slot as usize % BS] = Some(token);
                    }
                    a.publish(*s, tokens);
                    if rng.random_bool(0.5) {
                        a.snapshot_slot(*s);
                    }
                }
                // End a sequence (finished, cancelled or preempted: the allocator cannot tell).
                _ if !live.is_empty() => {
                    let (s, _) = live.swap_remove(rng.random_range(0..live.len()));
                    a.free_seq(s);
                }
                _ => {}
            }
            // Every block a live sequence holds is counted once per reader, and no free or evictable block is
            // held by anyone.
            let mut readers = vec![0u32; a.num_blocks];
            for (s, _) in &live {
                for &b in a.blocks(*s).unwrap() {
                    readers[b as usize] += 1;
                }
            }
            assert_eq!(readers, a.refs);
            for &b in &a.free {
                assert_eq!(readers[b as usize], 0, "a free block is read by no one");
            }
            let evictable = a.cached_blocks();
            assert_eq!(
                a.used_blocks(),
                readers.iter().filter(|&&r| r > 0).count(),
                "used = held; {evictable} cached blocks wait to be evicted"
            );
        }
    }
}
