//! `ferry cache-sim`: replays a routing trace through one expert cache of N slots shared by all MoE layers, under
//! every eviction policy (or those asked for) beside Belady's optimum, at one or more cache sizes, so a user can size
//! the cache and we can measure each policy's regret (its misses beyond Belady's). `--prefill-every T` interleaves
//! a new prompt's prefill every T tokens, to measure what prefill-aware admission keeps of the decode working set.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ferry_core::moe::{
    Access, Belady, EvictionPolicy, ExpertCache, ExpertKey, LayerCounts, PolicyChoice, RoutingTrace,
};

#[derive(clap::Args)]
pub struct CacheSimArgs {
    /// A routing trace, as `--record-routing` or bench/locality_trace.py writes it.
    #[arg(long)]
    trace: PathBuf,
    /// Cache slots (one expert each), shared by all MoE layers; several sizes separated by commas.
    #[arg(long, required = true, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    slots: Vec<u32>,
    /// Eviction policies to compare (default: every one): `default`, or `lru`/`lrfu` followed by any of `+floors`
    /// and `+prefill`; several separated by commas. Belady's optimum is always replayed as the yardstick.
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    policy: Vec<PolicyChoice>,
    /// Every this many tokens, a new prompt's prefill joins that token's step: in every MoE layer, after the
    /// token's own experts, every other expert of the layer is used once by the prefill.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    prefill_every: Option<u32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_policy(name: &str) -> Result<PolicyChoice, String> {
    name.parse().map_err(|e: ferry_core::Error| e.to_string())
}

/// One replay's counts: per MoE layer over all accesses, and over decode accesses alone.
struct Replay {
    layers: Vec<LayerCounts>,
    decode: LayerCounts,
}

impl Replay {
    /// Hits and misses over all layers.
    fn total(&self) -> LayerCounts {
        self.layers
            .iter()
            .fold(LayerCounts::default(), |total, layer| LayerCounts {
                hits: total.hits + layer.hits,
                misses: total.misses + layer.misses,
            })
    }
}

/// The trace's accesses in simulator order (token, then layer, then router order), with a prefill's accesses after
/// the token's own in each layer of every `prefill_every`-th token (from the first).
fn accesses(trace: &RoutingTrace, prefill_every: Option<u32>) -> Vec<(ExpertKey, Access)> {
    let header = trace.header();
    let mut sequence = Vec::new();
    for token in 0..trace.num_tokens() {
        let prefill = prefill_every.is_some_and(|every| token % every as usize == 0);
        for layer in 0..header.num_layers {
            let routed = trace.routed(token, layer);
            sequence.extend(routed.iter().map(|&expert| ((layer, expert), Access::Decode)));
            if prefill {
                let others = (0..header.num_experts).filter(|expert| !routed.contains(expert));
                sequence.extend(others.map(|expert| ((layer, expert), Access::Prefill)));
            }
        }
    }
    sequence
}

/// Feeds `sequence` to a cache of `slots` slots under `policy`, one access at a time.
fn replay(sequence: &[(ExpertKey, Access)], slots: u32, policy: Box<dyn EvictionPolicy>) -> Result<Replay> {
    let mut cache = ExpertCache::new(slots, policy);
    let mut decode = LayerCounts::default();
    for &(key, access) in sequence {
        let hit = cache.access_as(key, access)?;
        if access == Access::Decode {
            decode.hits += u64::from(hit);
            decode.misses += u64::from(!hit);
        }
    }
    Ok(Replay {
        layers: cache.layer_counts().to_vec(),
        decode,
    })
}

/// One policy's replay at one cache size.
struct Row {
    slots: u32,
    /// Its name, or `belady`.
    policy: String,
    is_default: bool,
    replay: Replay,
    /// Misses beyond Belady's at the same size.
    regret: u64,
    /// Misses over Belady's (1 when both are 0).
    miss_ratio: f64,
}

fn simulate(trace: &RoutingTrace, args: &CacheSimArgs) -> Result<Vec<Row>> {
    let header = trace.header();
    let sequence = accesses(trace, args.prefill_every);
    let policies = if args.policy.is_empty() {
        PolicyChoice::all()
    } else {
        args.policy.clone()
    };
    let mut rows = Vec::new();
    for &slots in &args.slots {
        let belady = Belady::new(sequence.iter().map(|&(key, _)| key));
        let optimum = replay(&sequence, slots, Box::new(belady))?;
        let best = optimum.total().misses;
        let mut row = |policy: String, is_default: bool, replay: Replay| {
            let misses = replay.total().misses;
            rows.push(Row {
                slots,
                policy,
                is_default,
                replay,
                regret: misses - best,
                miss_ratio: if best == 0 { 1.0 } else { misses as f64 / best as f64 },
            });
        };
        row("belady".into(), false, optimum);
        for &choice in &policies {
            let policy = choice.build(slots, header.num_layers, header.top_k);
            row(
                choice.to_string(),
                choice == PolicyChoice::DEFAULT,
                replay(&sequence, slots, policy)?,
            );
        }
    }
    Ok(rows)
}

pub fn run(args: CacheSimArgs) -> Result<()> {
    let trace = RoutingTrace::read(&args.trace)?;
    if trace.num_tokens() == 0 {
        bail!("{}: the trace holds no tokens, only a header", args.trace.display());
    }
    let rows = simulate(&trace, &args).with_context(|| format!("replaying {}", args.trace.display()))?;
    let header = trace.header();
    // Written through a handle, not println!, so a closed pipe (`| head`) is an error rather than a panic.
    let mut out = std::io::stdout().lock();
    if args.json {
        let results: Vec<serde_json::Value> = rows
            .iter()
            .map(|row| {
                let total = row.replay.total();
                let layers: Vec<serde_json::Value> = row
                    .replay
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(layer, counts)| {
                        serde_json::json!({
                            "layer": layer,
                            "hits": counts.hits,
                            "misses": counts.misses,
                            "hit_rate": counts.hit_rate(),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "slots": row.slots,
                    "policy": row.policy,
                    "default": row.is_default,
                    "accesses": total.hits + total.misses,
                    "hits": total.hits,
                    "misses": total.misses,
                    "hit_rate": total.hit_rate(),
                    "decode_hit_rate": row.replay.decode.hit_rate(),
                    "regret": row.regret,
                    "miss_ratio": row.miss_ratio,
                    "layers": layers,
                })
            })
            .collect();
        let summary = serde_json::json!({
            "trace": args.trace.display().to_string(),
            "tokens": trace.num_tokens(),
            "num_layers": header.num_layers,
            "num_experts": header.num_experts,
            "top_k": header.top_k,
            "prefill_every": args.prefill_every,
            "results": results,
        });
        writeln!(out, "{summary}")?;
        return Ok(());
    }
    let experts = u64::from(header.num_layers) * u64::from(header.num_experts);
    writeln!(
        out,
        "trace  {} tokens, {} MoE layers x {} experts, top-{}{}",
        trace.num_tokens(),
        header.num_layers,
        header.num_experts,
        header.top_k,
        args.prefill_every
            .map(|every| format!(", a prefill of every expert every {every} tokens"))
            .unwrap_or_default()
    )?;
    writeln!(
        out,
        "{:>6} {:>6}  {:<24} {:>9} {:>11} {:>10} {:>10} {:>7}",
        "slots", "share", "policy", "hit rate", "decode hit", "misses", "regret", "x best"
    )?;
    for row in &rows {
        let total = row.replay.total();
        let name = if row.is_default {
            format!("{} (default)", row.policy)
        } else {
            row.policy.clone()
        };
        writeln!(
            out,
            "{:>6} {:>5.1}%  {name:<24} {:>8.2}% {:>10.2}% {:>10} {:>10} {:>7.3}",
            row.slots,
            100.0 * f64::from(row.slots) / experts as f64,
            100.0 * total.hit_rate(),
            100.0 * row.replay.decode.hit_rate(),
            total.misses,
            row.regret,
            row.miss_ratio
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use ferry_core::moe::{RoutingTraceWriter, TraceHeader};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;

    /// Writes a trace of `tokens` (per token, per layer, the routed ids) and reads it back.
    fn trace(num_experts: u32, tokens: &[Vec<Vec<u32>>]) -> RoutingTrace {
        let header = TraceHeader {
            num_layers: tokens[0].len() as u32,
            num_experts,
            top_k: tokens[0][0].len() as u32,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let mut writer = RoutingTraceWriter::create(&path, header).unwrap();
        for token in tokens {
            writer.record_token(token).unwrap();
        }
        writer.finish().unwrap();
        RoutingTrace::read(&path).unwrap()
    }

    /// The policy `name` (or Belady's) replayed over `trace`'s decode accesses.
    fn run(trace: &RoutingTrace, slots: u32, name: &str) -> Replay {
        let sequence = accesses(trace, None);
        let policy: Box<dyn EvictionPolicy> = match name {
            "belady" => Box::new(Belady::new(sequence.iter().map(|&(key, _)| key))),
            name => name
                .parse::<PolicyChoice>()
                .unwrap()
                .build(slots, trace.header().num_layers, 8),
        };
        replay(&sequence, slots, policy).unwrap()
    }

    fn hits_per_layer(trace: &RoutingTrace, slots: u32, policy: &str) -> Vec<(u64, u64)> {
        run(trace, slots, policy)
            .layers
            .iter()
            .map(|layer| (layer.hits, layer.misses))
            .collect()
    }

    #[test]
    fn one_layer_by_hand() {
        // One layer, top-1: accesses 0 1 2 0 1 3 0 1 2 3, 3 slots.
        let ids = [0, 1, 2, 0, 1, 3, 0, 1, 2, 3];
        let tokens: Vec<Vec<Vec<u32>>> = ids.iter().map(|&e| vec![vec![e]]).collect();
        let trace = trace(4, &tokens);
        // LRU: 0 1 2 miss; 0 1 hit; 3 misses and evicts 2 (used at 2); 0 1 hit; 2 misses, evicts 3;
        // 3 misses, evicts 0. 4 hits.
        assert_eq!(hits_per_layer(&trace, 3, "lru"), vec![(4, 6)]);
        // Belady: 0 1 2 miss; 0 1 hit; 3 misses at time 5 and evicts 2 (next at 8; 0 at 6, 1 at 7); 0 1 hit;
        // 2 misses at time 8 and evicts 0 or 1 (neither used again); 3 hits. 5 hits.
        assert_eq!(hits_per_layer(&trace, 3, "belady"), vec![(5, 5)]);
    }

    #[test]
    fn a_cache_smaller_than_a_tokens_working_set() {
        // One layer, top-3, every token routed to 0 1 2; 2 slots cannot hold one token's experts.
        let trace = trace(3, &vec![vec![vec![0, 1, 2]]; 3]);
        // LRU cycles through 3 keys in 2 slots and never hits.
        assert_eq!(hits_per_layer(&trace, 2, "lru"), vec![(0, 9)]);
        // Belady, accesses 0 1 2 | 0 1 2 | 0 1 2: at 2 it evicts 1 (next at 4; 0 at 3), 0 hits; at 4 it evicts
        // 0 (next at 6; 2 at 5), 2 hits; at 6 it evicts 2 (next at 8; 1 at 7), 1 hits; at 8 both residents are
        // never used again (a tie: either gives the same count). 3 hits.
        assert_eq!(hits_per_layer(&trace, 2, "belady"), vec![(3, 6)]);
        // With room for the working set only the first token misses.
        assert_eq!(hits_per_layer(&trace, 3, "lru"), vec![(6, 3)]);
    }

    #[test]
    fn layers_compete_for_one_pool() {
        // Two layers, top-2, the same ids in both: four distinct keys per token.
        let token = vec![vec![0, 1], vec![0, 1]];
        let trace = trace(2, &vec![token; 2]);
        // 4 slots hold both layers: the second token hits everywhere.
        assert_eq!(hits_per_layer(&trace, 4, "lru"), vec![(2, 2), (2, 2)]);
        // 3 slots: LRU evicts each key just before its reuse (a cycle of 4 over 3 slots).
        assert_eq!(hits_per_layer(&trace, 3, "lru"), vec![(0, 4), (0, 4)]);
        // Belady, accesses (0,0) (0,1) (1,0) (1,1) | (0,0) (0,1) (1,0) (1,1): at 3 it evicts (1,0) (next at 6);
        // (0,0) and (0,1) hit; at 6 it evicts (0,0) or (0,1) (never used again); (1,1) hits. 3 hits.
        assert_eq!(hits_per_layer(&trace, 3, "belady"), vec![(2, 2), (1, 3)]);
    }

    #[test]
    fn belady_hits_at_least_as_often_as_lru_on_random_traces() {
        let mut rng = StdRng::seed_from_u64(4);
        for _ in 0..50 {
            let (num_layers, num_experts, top_k) = (rng.random_range(1..4), rng.random_range(4..12), 2);
            let tokens: Vec<Vec<Vec<u32>>> = (0..100)
                .map(|_| {
                    (0..num_layers)
                        .map(|_| {
                            rand::seq::index::sample(&mut rng, num_experts, top_k)
                                .into_iter()
                                .map(|e| e as u32)
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let trace = trace(num_experts as u32, &tokens);
            let slots = rng.random_range(1..(num_layers * num_experts) as u32);
            let lru = run(&trace, slots, "lru").total();
            let belady = run(&trace, slots, "belady").total();
            assert_eq!(lru.hits + lru.misses, (100 * num_layers * top_k) as u64);
            assert!(
                belady.hits >= lru.hits,
                "{slots} slots: Belady {belady:?} < LRU {lru:?}"
            );
        }
    }

    #[test]
    fn a_prefill_uses_every_other_expert_after_the_tokens_own() {
        // Two layers of 3 experts, top-1, three tokens; a prefill every 2 tokens (tokens 0 and 2).
        let trace = trace(
            3,
            &[vec![vec![0], vec![1]], vec![vec![2], vec![2]], vec![vec![1], vec![0]]],
        );
        let decode = |layer, expert| ((layer, expert), Access::Decode);
        let prefill = |layer, expert| ((layer, expert), Access::Prefill);
        assert_eq!(
            accesses(&trace, Some(2)),
            vec![
                decode(0, 0),
                prefill(0, 1),
                prefill(0, 2),
                decode(1, 1),
                prefill(1, 0),
                prefill(1, 2),
                decode(0, 2),
                decode(1, 2),
                decode(0, 1),
                prefill(0, 0),
                prefill(0, 2),
                decode(1, 0),
                prefill(1, 1),
                prefill(1, 2),
            ]
        );
        assert_eq!(accesses(&trace, None).len(), 6);
    }

    #[test]
    fn prefill_aware_admission_keeps_the_decode_working_set_through_a_prefill() {
        // Two layers of 4 experts, top-1, every token routed to expert 0 of both; 5 slots; a prefill every 4 tokens.
        let trace = trace(4, &vec![vec![vec![0], vec![0]]; 8]);
        let sequence = accesses(&trace, Some(4));
        let decode_misses = |name: &str| {
            let policy = name.parse::<PolicyChoice>().unwrap().build(5, 2, 1);
            replay(&sequence, 5, policy).unwrap().decode.misses
        };
        // LRU: the two first uses, and after each prefill (tokens 0 and 4) layer 0's expert 0, which layer 1's
        // sweep evicted as the least recently used.
        assert_eq!(decode_misses("lru"), 4);
        // On probation, layer 0's prefill-only keys make room for layer 1's: only the first uses miss.
        assert_eq!(decode_misses("lru+prefill"), 2);
    }
}
