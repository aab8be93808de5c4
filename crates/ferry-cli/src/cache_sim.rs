//! `ferry cache-sim`: replays a routing trace through one expert cache of N slots shared by all MoE layers, so a
//! user can size the cache and we can measure a policy's regret against Belady's optimum.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ferry_core::moe::{Belady, EvictionPolicy, ExpertCache, LayerCounts, Lru, RoutingTrace};

#[derive(clap::Args)]
pub struct CacheSimArgs {
    /// A routing trace, as `--record-routing` writes it.
    #[arg(long)]
    trace: PathBuf,
    /// Cache slots (one expert each), shared by all MoE layers.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    slots: u32,
    /// Eviction policy: lru, or belady (the optimum for the trace's known future).
    #[arg(long, value_enum, default_value_t = PolicyName::Lru)]
    policy: PolicyName,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum PolicyName {
    Lru,
    Belady,
}

impl PolicyName {
    fn name(self) -> &'static str {
        match self {
            PolicyName::Lru => "lru",
            PolicyName::Belady => "belady",
        }
    }
}

/// Hits and misses of one replay, per MoE layer (every layer appears in every token of a trace).
struct Replay {
    layers: Vec<LayerCounts>,
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

/// Feeds the trace's accesses to the cache one at a time, in trace order (token, then layer, then router order).
fn replay(trace: &RoutingTrace, slots: u32, policy: PolicyName) -> Result<Replay> {
    let policy: Box<dyn EvictionPolicy> = match policy {
        PolicyName::Lru => Box::new(Lru::new()),
        PolicyName::Belady => Box::new(Belady::new(trace.accesses())),
    };
    let mut cache = ExpertCache::new(slots, policy);
    for key in trace.accesses() {
        cache.access(key)?;
    }
    Ok(Replay {
        layers: cache.layer_counts().to_vec(),
    })
}

pub fn run(args: CacheSimArgs) -> Result<()> {
    let trace = RoutingTrace::read(&args.trace)?;
    if trace.num_tokens() == 0 {
        bail!("{}: the trace holds no tokens, only a header", args.trace.display());
    }
    let replay =
        replay(&trace, args.slots, args.policy).with_context(|| format!("replaying {}", args.trace.display()))?;
    let header = trace.header();
    let total = replay.total();
    // Written through a handle, not println!, so a closed pipe (`| head`) is an error rather than a panic.
    let mut out = std::io::stdout().lock();
    if args.json {
        let layers: Vec<serde_json::Value> = replay
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
        let summary = serde_json::json!({
            "trace": args.trace.display().to_string(),
            "policy": args.policy.name(),
            "slots": args.slots,
            "tokens": trace.num_tokens(),
            "num_layers": header.num_layers,
            "num_experts": header.num_experts,
            "top_k": header.top_k,
            "accesses": total.hits + total.misses,
            "hits": total.hits,
            "misses": total.misses,
            "hit_rate": total.hit_rate(),
            "layers": layers,
        });
        writeln!(out, "{summary}")?;
        return Ok(());
    }
    let experts = u64::from(header.num_layers) * u64::from(header.num_experts);
    writeln!(
        out,
        "trace     {} tokens, {} MoE layers x {} experts, top-{}",
        trace.num_tokens(),
        header.num_layers,
        header.num_experts,
        header.top_k
    )?;
    writeln!(
        out,
        "cache     {} slots ({:.1}% of {experts} experts), {}",
        args.slots,
        100.0 * f64::from(args.slots) / experts as f64,
        args.policy.name()
    )?;
    writeln!(
        out,
        "accesses  {} ({} hits, {} misses)",
        total.hits + total.misses,
        total.hits,
        total.misses
    )?;
    writeln!(out, "hit rate  {:.2}%", 100.0 * total.hit_rate())?;
    writeln!(out, "per layer")?;
    for (layer, counts) in replay.layers.iter().enumerate() {
        writeln!(out, "  {layer:>4}  {:6.2}%", 100.0 * counts.hit_rate())?;
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

    fn hits_per_layer(trace: &RoutingTrace, slots: u32, policy: PolicyName) -> Vec<(u64, u64)> {
        replay(trace, slots, policy)
            .unwrap()
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
        assert_eq!(hits_per_layer(&trace, 3, PolicyName::Lru), vec![(4, 6)]);
        // Belady: 0 1 2 miss; 0 1 hit; 3 misses at time 5 and evicts 2 (next at 8; 0 at 6, 1 at 7); 0 1 hit;
        // 2 misses at time 8 and evicts 0 or 1 (neither used again); 3 hits. 5 hits.
        assert_eq!(hits_per_layer(&trace, 3, PolicyName::Belady), vec![(5, 5)]);
    }

    #[test]
    fn a_cache_smaller_than_a_tokens_working_set() {
        // One layer, top-3, every token routed to 0 1 2; 2 slots cannot hold one token's experts.
        let trace = trace(3, &vec![vec![vec![0, 1, 2]]; 3]);
        // LRU cycles through 3 keys in 2 slots and never hits.
        assert_eq!(hits_per_layer(&trace, 2, PolicyName::Lru), vec![(0, 9)]);
        // Belady, accesses 0 1 2 | 0 1 2 | 0 1 2: at 2 it evicts 1 (next at 4; 0 at 3), 0 hits; at 4 it evicts
        // 0 (next at 6; 2 at 5), 2 hits; at 6 it evicts 2 (next at 8; 1 at 7), 1 hits; at 8 both residents are
        // never used again (a tie: either gives the same count). 3 hits.
        assert_eq!(hits_per_layer(&trace, 2, PolicyName::Belady), vec![(3, 6)]);
        // With room for the working set only the first token misses.
        assert_eq!(hits_per_layer(&trace, 3, PolicyName::Lru), vec![(6, 3)]);
    }

    #[test]
    fn layers_compete_for_one_pool() {
        // Two layers, top-2, the same ids in both: four distinct keys per token.
        let token = vec![vec![0, 1], vec![0, 1]];
        let trace = trace(2, &vec![token; 2]);
        // 4 slots hold both layers: the second token hits everywhere.
        assert_eq!(hits_per_layer(&trace, 4, PolicyName::Lru), vec![(2, 2), (2, 2)]);
        // 3 slots: LRU evicts each key just before its reuse (a cycle of 4 over 3 slots).
        assert_eq!(hits_per_layer(&trace, 3, PolicyName::Lru), vec![(0, 4), (0, 4)]);
        // Belady, accesses (0,0) (0,1) (1,0) (1,1) | (0,0) (0,1) (1,0) (1,1): at 3 it evicts (1,0) (next at 6);
        // (0,0) and (0,1) hit; at 6 it evicts (0,0) or (0,1) (never used again); (1,1) hits. 3 hits.
        assert_eq!(hits_per_layer(&trace, 3, PolicyName::Belady), vec![(2, 2), (1, 3)]);
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
            let lru = replay(&trace, slots, PolicyName::Lru).unwrap().total();
            let belady = replay(&trace, slots, PolicyName::Belady).unwrap().total();
            assert_eq!(lru.hits + lru.misses, (100 * num_layers * top_k) as u64);
            assert!(
                belady.hits >= lru.hits,
                "{slots} slots: Belady {belady:?} < LRU {lru:?}"
            );
        }
    }
}
