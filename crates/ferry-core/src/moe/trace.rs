//! Routing traces: which experts the router chose, per token and MoE layer, recorded by generate/bench and replayed
//! by the cache simulator and by benchmarks that want realistic locality.
//!
//! The format is JSON lines: a header `{"num_layers": L, "num_experts": E, "top_k": k}` (L counts MoE layers
//! only), then one line per token: a list of L lists, each the k expert ids of that layer in router order.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::policy::ExpertKey;
use crate::{Error, Result};

/// The shape every token line of a trace has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    /// MoE layers (dense layers route nothing and are not listed).
    pub num_layers: u32,
    pub num_experts: u32,
    pub top_k: u32,
}

impl TraceHeader {
    fn check(&self) -> std::result::Result<(), String> {
        if self.num_layers == 0 {
            return Err("num_layers is 0".into());
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return Err(format!(
                "top_k {} is not between 1 and num_experts {}",
                self.top_k, self.num_experts
            ));
        }
        Ok(())
    }

    /// Checks one token's routing against the header: the layer count, k ids per layer, each id in range and
    /// listed once (a router's top-k never repeats an expert).
    fn check_token(&self, layers: &[impl AsRef<[u32]>]) -> std::result::Result<(), String> {
        if layers.len() != self.num_layers as usize {
            return Err(format!(
                "{} layers listed, the header says {}",
                layers.len(),
                self.num_layers
            ));
        }
        for (layer, experts) in layers.iter().enumerate() {
            let experts = experts.as_ref();
            if experts.len() != self.top_k as usize {
                return Err(format!(
                    "layer {layer} lists {} experts, the header's top_k is {}",
                    experts.len(),
                    self.top_k
                ));
            }
            for (position, &expert) in experts.iter().enumerate() {
                if expert >= self.num_experts {
                    return Err(format!(
                        "layer {layer} routes to expert {expert}, out of range for num_experts {}",
                        self.num_experts
                    ));
                }
                if experts[..position].contains(&expert) {
                    return Err(format!("layer {layer} lists expert {expert} twice"));
                }
            }
        }
        Ok(())
    }
}

/// Writes a trace as tokens are routed. Buffered; `finish` flushes and reports any error, and a writer dropped
/// without `finish` still flushes what it can (without panicking).
pub struct RoutingTraceWriter {
    path: PathBuf,
    header: TraceHeader,
    out: BufWriter<File>,
    tokens: u64,
}

impl RoutingTraceWriter {
    /// Creates (or truncates) `path` and writes the header.
    pub fn create(path: impl Into<PathBuf>, header: TraceHeader) -> Result<Self> {
        let path = path.into();
        header.check().map_err(|message| Error::file(&path, message))?;
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut writer = RoutingTraceWriter {
            path,
            header,
            out: BufWriter::new(file),
            tokens: 0,
        };
        writer.write_line(&header)?;
        Ok(writer)
    }

    /// Appends one token: for each MoE layer, its routed expert ids in router order.
    pub fn record_token(&mut self, layers: &[impl AsRef<[u32]>]) -> Result<()> {
        self.header
            .check_token(layers)
            .map_err(|message| Error::file(&self.path, format!("token {}: {message}", self.tokens)))?;
        let layers: Vec<&[u32]> = layers.iter().map(AsRef::as_ref).collect();
        self.write_line(&layers)?;
        self.tokens += 1;
        Ok(())
    }

    /// Flushes the trace to the file.
    pub fn finish(mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }

    /// Writes `value` as one compact JSON line.
    fn write_line(&mut self, value: &impl Serialize) -> Result<()> {
        serde_json::to_writer(&mut self.out, value).map_err(|e| Error::file(&self.path, e.to_string()))?;
        self.out.write_all(b"\n").map_err(|e| Error::io(&self.path, e))
    }
}

/// A whole trace in memory: the routed ids of every token, layer and rank in one flat array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTrace {
    header: TraceHeader,
    /// `[token][layer][rank]`, `top_k` ids per (token, layer).
    routed: Vec<u32>,
}

impl RoutingTrace {
    /// Reads and checks a trace file; an error names the file and the line at fault.
    pub fn read(path: impl AsRef<Path>) -> Result<RoutingTrace> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Self::parse(BufReader::new(file), path)
    }

    fn parse(reader: impl BufRead, path: &Path) -> Result<RoutingTrace> {
        let at_line = |number: usize, message: String| Error::file(path, format!("line {number}: {message}"));
        let mut lines = reader.lines();
        let header_line = match lines.next() {
            Some(line) => line.map_err(|e| Error::io(path, e))?,
            None => return Err(Error::file(path, "empty, expected a header line")),
        };
        let header: TraceHeader = serde_json::from_str(&header_line).map_err(|e| {
            at_line(
                1,
                format!("not a trace header ({{\"num_layers\", \"num_experts\", \"top_k\"}}): {e}"),
            )
        })?;
        header.check().map_err(|message| at_line(1, message))?;
        let mut routed = Vec::new();
        for (index, line) in lines.enumerate() {
            let number = index + 2;
            let line = line.map_err(|e| Error::io(path, e))?;
            let layers: Vec<Vec<u32>> = serde_json::from_str(&line)
                .map_err(|e| at_line(number, format!("not a list of expert-id lists: {e}")))?;
            header
                .check_token(&layers)
                .map_err(|message| at_line(number, message))?;
            routed.extend(layers.into_iter().flatten());
        }
        Ok(RoutingTrace { header, routed })
    }

    pub fn header(&self) -> TraceHeader {
        self.header
    }

    pub fn num_tokens(&self) -> usize {
        self.routed.len() / (self.header.num_layers * self.header.top_k) as usize
    }

    /// The expert ids `token` was routed to in MoE layer `layer`, in router order. Panics if either is out of
    /// range (`num_tokens()`, the header's `num_layers`), as slice indexing does.
    pub fn routed(&self, token: usize, layer: u32) -> &[u32] {
        let k = self.header.top_k as usize;
        let start = (token * self.header.num_layers as usize + layer as usize) * k;
        &self.routed[start..start + k]
    }

    /// Every (layer, expert) the trace uses, one at a time in simulator order: by token, then layer, then router
    /// order.
    pub fn accesses(&self) -> impl Iterator<Item = ExpertKey> + '_ {
        let k = self.header.top_k as usize;
        let num_layers = self.header.num_layers as usize;
        self.routed
            .iter()
            .enumerate()
            .map(move |(index, &expert)| (((index / k) % num_layers) as u32, expert))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: TraceHeader = TraceHeader {
        num_layers: 2,
        num_experts: 4,
        top_k: 2,
    };

    fn parse(text: &str) -> Result<RoutingTrace> {
        RoutingTrace::parse(text.as_bytes(), Path::new("t.jsonl"))
    }

    fn parse_error(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn a_written_trace_reads_back_with_accesses_in_simulator_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let mut writer = RoutingTraceWriter::create(&path, HEADER).unwrap();
        writer.record_token(&[vec![3, 1], vec![0, 2]]).unwrap();
        writer.record_token(&[[1, 0].as_slice(), &[2, 3]]).unwrap();
        writer.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"num_layers\":2,\"num_experts\":4,\"top_k\":2}\n[[3,1],[0,2]]\n[[1,0],[2,3]]\n"
        );
        let trace = RoutingTrace::read(&path).unwrap();
        assert_eq!(trace.header(), HEADER);
        assert_eq!(trace.num_tokens(), 2);
        assert_eq!(trace.routed(1, 0), &[1, 0]);
        assert_eq!(trace.routed(0, 1), &[0, 2]);
        assert_eq!(
            trace.accesses().collect::<Vec<_>>(),
            vec![(0, 3), (0, 1), (1, 0), (1, 2), (0, 1), (0, 0), (1, 2), (1, 3)]
        );
    }

    #[test]
    fn a_dropped_writer_flushes_what_it_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let mut writer = RoutingTraceWriter::create(&path, HEADER).unwrap();
        writer.record_token(&[vec![0, 1], vec![2, 3]]).unwrap();
        drop(writer);
        assert_eq!(RoutingTrace::read(&path).unwrap().num_tokens(), 1);
    }

    #[test]
    fn the_writer_rejects_a_token_that_does_not_fit_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = RoutingTraceWriter::create(dir.path().join("t.jsonl"), HEADER).unwrap();
        let error = writer.record_token(&[vec![0, 1]]).unwrap_err().to_string();
        assert!(error.contains("token 0: 1 layers listed, the header says 2"), "{error}");
        let header = TraceHeader { top_k: 5, ..HEADER };
        let error = RoutingTraceWriter::create(dir.path().join("u.jsonl"), header)
            .err()
            .unwrap();
        assert!(error.to_string().contains("top_k 5"), "{error}");
    }

    #[test]
    fn a_trace_with_a_header_only_has_no_tokens() {
        let trace = parse("{\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2}\n").unwrap();
        assert_eq!(trace.num_tokens(), 0);
        assert_eq!(trace.accesses().count(), 0);
    }

    #[test]
    fn bad_traces_are_errors_that_name_the_line_at_fault() {
        let header = "{\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2}";
        let good = "[[0, 1], [2, 3]]";
        let cases = [
            (String::new(), "t.jsonl: empty, expected a header line"),
            ("[[0]]".to_string(), "line 1: not a trace header"),
            (
                "{\"num_layers\": 2, \"top_k\": 2}".to_string(),
                "line 1: not a trace header",
            ),
            (
                "{\"num_layers\": 1, \"num_experts\": 4, \"top_k\": 0}".to_string(),
                "line 1: top_k 0 is not between 1 and num_experts 4",
            ),
            (
                "{\"num_layers\": 0, \"num_experts\": 4, \"top_k\": 1}".to_string(),
                "line 1: num_layers is 0",
            ),
            (
                format!("{header}\n{good}\n[[0, 1]]"),
                "line 3: 1 layers listed, the header says 2",
            ),
            (
                format!("{header}\n{good}\n{good}\n[[0, 1], [2]]"),
                "line 4: layer 1 lists 1 experts, the header's top_k is 2",
            ),
            (
                format!("{header}\n[[0, 4], [2, 3]]"),
                "line 2: layer 0 routes to expert 4, out of range for num_experts 4",
            ),
            (
                format!("{header}\n[[0, 1], [3, 3]]"),
                "line 2: layer 1 lists expert 3 twice",
            ),
            (
                format!("{header}\n[[0, -1], [2, 3]]"),
                "line 2: not a list of expert-id lists",
            ),
            (
                format!("{header}\n{good}\n[[0, 1], [2, 3]"),
                "line 3: not a list of expert-id lists",
            ),
            (format!("{header}\n\n{good}"), "line 2: not a list of expert-id lists"),
        ];
        for (text, expected) in cases {
            let error = parse_error(&text);
            assert!(
                error.contains(expected),
                "{text:?}: {error:?} does not contain {expected:?}"
            );
        }
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let error = RoutingTrace::read("/nonexistent/trace.jsonl").unwrap_err().to_string();
        assert!(error.starts_with("/nonexistent/trace.jsonl: "), "{error}");
    }
}
