//! Watching and steering a model's routing: [`RoutingTap`] sees every MoE layer's choice during a forward pass.
//! [`TraceRecorder`] writes it to a routing trace (`--record-routing`); [`TraceReplayer`] replaces the router's
//! choice with a recorded one (`--routing-trace`), so benchmarks on synthetic weights see real locality, and can
//! guess each next layer's choice for the offload's prefetch as a predictor of a given precision would
//! (`--routing-guess-precision`); [`HeldRouting`] routes every step as one token of a trace, so that nothing is left
//! to copy after its first.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use super::trace::{RoutingTrace, RoutingTraceWriter, TraceHeader};
use crate::{Error, Result};

pub trait RoutingTap {
    /// Whether [`routed`](Self::routed) needs the router's own choice (which costs a copy to the host per layer).
    fn wants_router_choice(&self) -> bool;
    /// MoE layer `layer` routed `rows` rows to `top_k` experts each (`routed`, `[rows * top_k]`, when asked for).
    /// Returning ids replaces the router's choice for this layer.
    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, routed: Option<&[u32]>) -> Result<Option<Vec<u32>>>;
    /// A guess of how MoE layer `layer` will route the `rows` rows now at the layer before it, for the offload to
    /// copy ahead (the router's own guess when a tap replaces its choices would not predict them). None: no guess.
    fn guess(&mut self, _layer: usize, _rows: usize, _top_k: usize) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// Whether [`routed`](Self::routed) replaces the router's choices (then only [`guess`](Self::guess) may guess
    /// them).
    fn replays(&self) -> bool {
        false
    }
}

/// Writes each row of each forward pass as one token of a routing trace (rows in batch order: use it with one
/// sequence at a time).
pub struct TraceRecorder {
    writer: Option<RoutingTraceWriter>,
    num_layers: usize,
    layers: Vec<Vec<u32>>,
}

impl TraceRecorder {
    pub fn create(path: impl Into<PathBuf>, header: TraceHeader) -> Result<Self> {
        Ok(TraceRecorder {
            writer: Some(RoutingTraceWriter::create(path, header)?),
            num_layers: header.num_layers as usize,
            layers: Vec::new(),
        })
    }

    pub fn finish(mut self) -> Result<()> {
        match self.writer.take() {
            Some(writer) => writer.finish(),
            None => Ok(()),
        }
    }
}

impl RoutingTap for TraceRecorder {
    fn wants_router_choice(&self) -> bool {
        true
    }

    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, routed: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
        let ids = routed.ok_or_else(|| Error::Cache("the recorder was not given the router's choice".into()))?;
        if layer == 0 {
            self.layers.clear();
        }
        self.layers.push(ids.to_vec());
        if layer + 1 == self.num_layers {
            let writer = self
                .writer
                .as_mut()
                .ok_or_else(|| Error::Cache("the trace is finished".into()))?;
            for r in 0..rows {
                let token: Vec<&[u32]> = self.layers.iter().map(|l| &l[r * top_k..(r + 1) * top_k]).collect();
                writer.record_token(&token)?;
            }
        }
        Ok(None)
    }
}

/// Routes each row as the trace's next token did, going round to the trace's start when it runs out; with
/// [`TraceReplayer::with_guesses`], also guesses each next layer's routing as a predictor of a given precision would.
pub struct TraceReplayer {
    trace: RoutingTrace,
    next_token: usize,
    guesses: Option<Guesses>,
}

/// Next-layer guesses drawn from the trace: each of a row's true experts kept with probability `precision`, the
/// others replaced by experts the row does not use in that layer, drawn uniformly. A real model's router applied
/// one layer early makes such guesses; on synthetic weights under a replayed trace nothing else can.
struct Guesses {
    precision: f64,
    rng: StdRng,
}

impl TraceReplayer {
    pub fn new(trace: RoutingTrace) -> Result<Self> {
        if trace.num_tokens() == 0 {
            return Err(Error::Cache("the routing trace has no tokens".into()));
        }
        Ok(TraceReplayer {
            trace,
            next_token: 0,
            guesses: None,
        })
    }

    /// Guesses each next layer's experts with `precision` (0 to 1) of them right, drawn from `seed`.
    pub fn with_guesses(mut self, precision: f64, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&precision) {
            return Err(Error::Cache(format!(
                "a guess precision of {precision} is not between 0 and 1"
            )));
        }
        self.guesses = Some(Guesses {
            precision,
            rng: StdRng::seed_from_u64(seed),
        });
        Ok(self)
    }
}

/// `trace`'s experts for `layer` of the `rows` rows from token `next_token` on, or an error naming a trace of
/// another shape.
fn true_routes(
    trace: &RoutingTrace,
    next_token: usize,
    layer: usize,
    rows: usize,
    top_k: usize,
) -> Result<Vec<&[u32]>> {
    let header = trace.header();
    if header.top_k as usize != top_k || layer >= header.num_layers as usize {
        return Err(Error::Cache(format!(
            "the routing trace is for {} MoE layers of top-{}, not this model's layer {layer} of top-{top_k}",
            header.num_layers, header.top_k
        )));
    }
    let tokens = trace.num_tokens();
    Ok((0..rows)
        .map(|r| trace.routed((next_token + r) % tokens, layer as u32))
        .collect())
}

impl RoutingTap for TraceReplayer {
    fn wants_router_choice(&self) -> bool {
        false
    }

    fn replays(&self) -> bool {
        true
    }

    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, _: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
        let ids = true_routes(&self.trace, self.next_token, layer, rows, top_k)?.concat();
        if layer + 1 == self.trace.header().num_layers as usize {
            self.next_token = (self.next_token + rows) % self.trace.num_tokens();
        }
        Ok(Some(ids))
    }

    fn guess(&mut self, layer: usize, rows: usize, top_k: usize) -> Result<Option<Vec<u32>>> {
        let Some(Guesses { precision, rng }) = self.guesses.as_mut() else {
            return Ok(None);
        };
        let truth = true_routes(&self.trace, self.next_token, layer, rows, top_k)?;
        let experts = self.trace.header().num_experts;
        let mut ids = Vec::with_capacity(rows * top_k);
        for row in truth {
            let wrong: Vec<bool> = row.iter().map(|_| !rng.random_bool(*precision)).collect();
            let others: Vec<u32> = (0..experts).filter(|e| !row.contains(e)).collect();
            let mut replacements = others.choose_multiple(rng, wrong.iter().filter(|&&w| w).count());
            // Where the layer has too few other experts to replace them all, the rest stay right.
            ids.extend(row.iter().zip(&wrong).map(|(&e, &w)| {
                if w {
                    replacements.next().copied().unwrap_or(e)
                } else {
                    e
                }
            }));
        }
        Ok(Some(ids))
    }
}

/// Routes every row of every step as one token of a trace was routed, layer by layer, and guesses each next layer
/// so too: from its second step on, every expert a step needs is resident, so a decode under it times a step with
/// nothing to copy (`ferry bench`'s resident step, against which an offloaded decode's overlap is judged).
pub struct HeldRouting {
    /// The held token's experts, per MoE layer.
    layers: Vec<Vec<u32>>,
}

impl HeldRouting {
    /// Holds the routing of `trace`'s first token.
    pub fn first_token_of(trace: &RoutingTrace) -> Result<Self> {
        if trace.num_tokens() == 0 {
            return Err(Error::Cache("the routing trace has no tokens".into()));
        }
        let layers = trace.header().num_layers;
        Ok(HeldRouting {
            layers: (0..layers).map(|layer| trace.routed(0, layer).to_vec()).collect(),
        })
    }

    /// The held experts of `layer` for each of `rows` rows, or an error naming a model of another shape.
    fn rows(&self, layer: usize, rows: usize, top_k: usize) -> Result<Vec<u32>> {
        match self.layers.get(layer) {
            Some(experts) if experts.len() == top_k => Ok(experts.repeat(rows)),
            _ => Err(Error::Cache(format!(
                "the held routing is for {} MoE layers of top-{}, not this model's layer {layer} of top-{top_k}",
                self.layers.len(),
                self.layers.first().map_or(0, Vec::len)
            ))),
        }
    }
}

impl RoutingTap for HeldRouting {
    fn wants_router_choice(&self) -> bool {
        false
    }

    fn replays(&self) -> bool {
        true
    }

    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, _: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
        self.rows(layer, rows, top_k).map(Some)
    }

    fn guess(&mut self, layer: usize, rows: usize, top_k: usize) -> Result<Option<Vec<u32>>> {
        self.rows(layer, rows, top_k).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trace a recorder writes of `forwards` through a model of 2 MoE layers of 8 experts, top-2: each forward
    /// its rows and the ids of both layers.
    fn recorded(forwards: &[(usize, &[u32], &[u32])]) -> RoutingTrace {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let header = TraceHeader {
            num_layers: 2,
            num_experts: 8,
            top_k: 2,
        };
        let mut recorder = TraceRecorder::create(&path, header).unwrap();
        for &(rows, first, second) in forwards {
            assert_eq!(recorder.routed(0, rows, 2, Some(first)).unwrap(), None);
            recorder.routed(1, rows, 2, Some(second)).unwrap();
        }
        recorder.finish().unwrap();
        RoutingTrace::read(&path).unwrap()
    }

    #[test]
    fn recorded_forward_passes_replay_as_they_were_routed() {
        // One forward of 2 rows, then one of 1 row.
        let trace = recorded(&[(2, &[1, 2, 3, 4], &[5, 6, 7, 0]), (1, &[7, 1], &[2, 3])]);
        assert_eq!(trace.num_tokens(), 3);
        assert_eq!((trace.routed(1, 0), trace.routed(1, 1)), (&[3, 4][..], &[7, 0][..]));
        let mut replayer = TraceReplayer::new(trace).unwrap();
        assert_eq!(replayer.routed(0, 3, 2, None).unwrap(), Some(vec![1, 2, 3, 4, 7, 1]));
        assert_eq!(replayer.routed(1, 3, 2, None).unwrap(), Some(vec![5, 6, 7, 0, 2, 3]));
        // The trace ran out: it starts again.
        assert_eq!(replayer.routed(0, 1, 2, None).unwrap(), Some(vec![1, 2]));
        assert!(replayer.routed(0, 1, 3, None).is_err(), "a trace of another top-k");
    }

    #[test]
    fn a_held_routing_routes_and_guesses_every_row_as_the_traces_first_token() {
        let trace = recorded(&[(1, &[1, 2], &[5, 6]), (1, &[3, 4], &[7, 0])]);
        let mut held = HeldRouting::first_token_of(&trace).unwrap();
        for _ in 0..3 {
            assert_eq!(held.routed(0, 2, 2, None).unwrap(), Some(vec![1, 2, 1, 2]));
            assert_eq!(held.guess(1, 1, 2).unwrap(), Some(vec![5, 6]));
            assert_eq!(held.routed(1, 1, 2, None).unwrap(), Some(vec![5, 6]));
        }
        assert!(held.routed(2, 1, 2, None).is_err(), "a third layer");
        assert!(held.routed(0, 1, 3, None).is_err(), "another top-k");
    }

    #[test]
    fn guesses_keep_the_true_experts_at_the_precision_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let header = TraceHeader {
            num_layers: 2,
            num_experts: 64,
            top_k: 4,
        };
        let mut recorder = TraceRecorder::create(&path, header).unwrap();
        let tokens = 500;
        for t in 0..tokens {
            let ids: Vec<u32> = (0..2 * 4).map(|i| ((t * 7 + i * 11) % 64) as u32).collect();
            recorder.routed(0, 1, 4, Some(&ids[..4])).unwrap();
            recorder.routed(1, 1, 4, Some(&ids[4..])).unwrap();
        }
        recorder.finish().unwrap();
        let trace = RoutingTrace::read(&path).unwrap();
        let mut plain = TraceReplayer::new(trace.clone()).unwrap();
        assert_eq!(plain.guess(1, 1, 4).unwrap(), None, "no guesses unless asked");
        assert!(TraceReplayer::new(trace.clone()).unwrap().with_guesses(1.5, 0).is_err());
        for precision in [0.0, 0.9, 1.0] {
            let mut replayer = TraceReplayer::new(trace.clone())
                .unwrap()
                .with_guesses(precision, 7)
                .unwrap();
            let (mut right, mut guessed) = (0, 0);
            for _ in 0..tokens {
                replayer.routed(0, 1, 4, None).unwrap();
                // Layer 1's guess, made while layer 0 computes, against what layer 1 then routes.
                let guess = replayer.guess(1, 1, 4).unwrap().unwrap();
                let truth = replayer.routed(1, 1, 4, None).unwrap().unwrap();
                assert_eq!(guess.len(), 4);
                let mut distinct = guess.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(distinct.len(), 4, "{guess:?} repeats an expert");
                right += guess.iter().filter(|e| truth.contains(e)).count();
                guessed += guess.len();
            }
            let measured = right as f64 / guessed as f64;
            assert!(
                (measured - precision).abs() < 0.03,
                "precision {precision}: measured {measured}"
            );
        }
        assert!(plain.guess(2, 1, 4).is_ok(), "no guesses: nothing to check");
        let mut guessing = TraceReplayer::new(trace).unwrap().with_guesses(0.5, 0).unwrap();
        assert!(guessing.guess(2, 1, 4).is_err(), "a layer past the trace's");
    }
}
