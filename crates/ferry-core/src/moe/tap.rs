//! Watching and steering a model's routing: [`RoutingTap`] sees every MoE layer's choice during a forward pass.
//! [`TraceRecorder`] writes it to a routing trace (`--record-routing`); [`TraceReplayer`] replaces the router's
//! choice with a recorded one (`--routing-trace`), so benchmarks on synthetic weights see real locality.

use std::path::PathBuf;

use super::trace::{RoutingTrace, RoutingTraceWriter, TraceHeader};
use crate::{Error, Result};

pub trait RoutingTap {
    /// Whether [`routed`](Self::routed) needs the router's own choice (which costs a copy to the host per layer).
    fn wants_router_choice(&self) -> bool;
    /// MoE layer `layer` routed `rows` rows to `top_k` experts each (`routed`, `[rows * top_k]`, when asked for).
    /// Returning ids replaces the router's choice for this layer.
    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, routed: Option<&[u32]>) -> Result<Option<Vec<u32>>>;
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

/// Routes each row as the trace's next token did, going round to the trace's start when it runs out.
pub struct TraceReplayer {
    trace: RoutingTrace,
    next_token: usize,
}

impl TraceReplayer {
    pub fn new(trace: RoutingTrace) -> Result<Self> {
        if trace.num_tokens() == 0 {
            return Err(Error::Cache("the routing trace has no tokens".into()));
        }
        Ok(TraceReplayer { trace, next_token: 0 })
    }
}

impl RoutingTap for TraceReplayer {
    fn wants_router_choice(&self) -> bool {
        false
    }

    fn routed(&mut self, layer: usize, rows: usize, top_k: usize, _: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
        let header = self.trace.header();
        if header.top_k as usize != top_k || layer >= header.num_layers as usize {
            return Err(Error::Cache(format!(
                "the routing trace is for {} MoE layers of top-{}, not this model's layer {layer} of top-{top_k}",
                header.num_layers, header.top_k
            )));
        }
        let tokens = self.trace.num_tokens();
        let ids = (0..rows)
            .flat_map(|r| {
                self.trace
                    .routed((self.next_token + r) % tokens, layer as u32)
                    .iter()
                    .copied()
            })
            .collect();
        if layer + 1 == header.num_layers as usize {
            self.next_token = (self.next_token + rows) % tokens;
        }
        Ok(Some(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_forward_passes_replay_as_they_were_routed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let header = TraceHeader {
            num_layers: 2,
            num_experts: 8,
            top_k: 2,
        };
        let mut recorder = TraceRecorder::create(&path, header).unwrap();
        // One forward of 2 rows, then one of 1 row.
        assert_eq!(recorder.routed(0, 2, 2, Some(&[1, 2, 3, 4])).unwrap(), None);
        recorder.routed(1, 2, 2, Some(&[5, 6, 7, 0])).unwrap();
        recorder.routed(0, 1, 2, Some(&[7, 1])).unwrap();
        recorder.routed(1, 1, 2, Some(&[2, 3])).unwrap();
        recorder.finish().unwrap();

        let trace = RoutingTrace::read(&path).unwrap();
        assert_eq!(trace.num_tokens(), 3);
        assert_eq!((trace.routed(1, 0), trace.routed(1, 1)), (&[3, 4][..], &[7, 0][..]));
        let mut replayer = TraceReplayer::new(trace).unwrap();
        assert_eq!(replayer.routed(0, 3, 2, None).unwrap(), Some(vec![1, 2, 3, 4, 7, 1]));
        assert_eq!(replayer.routed(1, 3, 2, None).unwrap(), Some(vec![5, 6, 7, 0, 2, 3]));
        // The trace ran out: it starts again.
        assert_eq!(replayer.routed(0, 1, 2, None).unwrap(), Some(vec![1, 2]));
        assert!(replayer.routed(0, 1, 3, None).is_err(), "a trace of another top-k");
    }
}
