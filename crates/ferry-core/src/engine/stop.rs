//! Stop strings over streamed text: text is released only once it cannot be the start of a stop string, so a
//! client never sees part of a stop string that later completes. All of a request's stop strings are matched in one
//! Aho-Corasick scan that resumes where the last piece ended, so each piece costs time in its own length, whatever
//! the number of stop strings.

/// At most this many stop strings per request: OpenAI allows 4; a few more serve clients that list every end marker
/// of several chat formats, while a bound keeps one request's automaton small.
pub const MAX_STOP_STRINGS: usize = 16;
/// At most this many bytes per stop string: end markers are short, and a bound keeps the automaton's size (and the
/// text it can hold back) small.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// Checks a request's stop strings (its field `field`) against the bounds above; an empty one is refused too (it
/// would match before any text, so no request means it). The error names the field and the bound.
pub fn validate_stop_strings(field: &str, stops: &[String]) -> Result<(), String> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(format!(
            "`{field}` holds {} strings; at most {MAX_STOP_STRINGS} are allowed",
            stops.len()
        ));
    }
    if let Some(index) = stops.iter().position(String::is_empty) {
        return Err(format!(
            "`{field}[{index}]` is empty; a stop string needs at least one character"
        ));
    }
    match stops.iter().map(String::len).max() {
        Some(longest) if longest > MAX_STOP_STRING_BYTES => Err(format!(
            "`{field}` holds a string of {longest} bytes; each may be at most {MAX_STOP_STRING_BYTES} bytes"
        )),
        _ => Ok(()),
    }
}

const ROOT: usize = 0;

/// A node of the stop strings' trie: the bytes read on the way from the root spell a prefix of some stop string.
#[derive(Clone, Debug, Default)]
struct Node {
    /// Outgoing edges by byte; at most one per stop string, so a short list.
    children: Vec<(u8, usize)>,
    /// The node of the longest proper suffix of this node's prefix that is itself a prefix of some stop string.
    fail: usize,
    /// Length of this node's prefix.
    depth: usize,
    /// Length of the longest stop string that ends this node's prefix, 0 if none.
    longest_stop: usize,
    /// That stop string's index in the list given to [`StopStrings::new`].
    stop_index: usize,
}

#[derive(Clone, Debug)]
pub struct StopStrings {
    nodes: Vec<Node>,
    /// The node of the longest suffix of the text read so far that is a prefix of some stop string; its depth is how
    /// much of `pending` is held back.
    state: usize,
    /// Text not yet released because its end could begin a stop string.
    pending: String,
}

impl Default for StopStrings {
    fn default() -> Self {
        StopStrings::new(Vec::new())
    }
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        let mut nodes = vec![Node::default()];
        for (index, stop) in stops.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            let mut at = ROOT;
            for &byte in stop.as_bytes() {
                at = match nodes[at].children.iter().find(|&&(b, _)| b == byte) {
                    Some(&(_, child)) => child,
                    None => {
                        let depth = nodes[at].depth + 1;
                        nodes.push(Node {
                            depth,
                            ..Node::default()
                        });
                        let child = nodes.len() - 1;
                        nodes[at].children.push((byte, child));
                        child
                    }
                };
            }
            if nodes[at].longest_stop == 0 {
                nodes[at].longest_stop = stop.len();
                nodes[at].stop_index = index;
            }
        }
        // Failure links breadth first, so that a node's failure (shallower) is complete before the node is.
        let mut queue = std::collections::VecDeque::from([ROOT]);
        while let Some(parent) = queue.pop_front() {
            for i in 0..nodes[parent].children.len() {
                let (byte, child) = nodes[parent].children[i];
                let fail = if parent == ROOT {
                    ROOT
                } else {
                    Self::step(&nodes, nodes[parent].fail, byte)
                };
                nodes[child].fail = fail;
                if nodes[child].longest_stop == 0 {
                    nodes[child].longest_stop = nodes[fail].longest_stop;
                    nodes[child].stop_index = nodes[fail].stop_index;
                }
                queue.push_back(child);
            }
        }
        StopStrings {
            nodes,
            state: ROOT,
            pending: String::new(),
        }
    }

    /// The node reached from `at` by reading `byte`: the longest prefix of a stop string that the text so far ends
    /// with.
    fn step(nodes: &[Node], mut at: usize, byte: u8) -> usize {
        loop {
            if let Some(&(_, child)) = nodes[at].children.iter().find(|&&(b, _)| b == byte) {
                return child;
            }
            if at == ROOT {
                return ROOT;
            }
            at = nodes[at].fail;
        }
    }

    /// Adds a piece of text; returns the text safe to release and, when a stop string was reached, its index (the
    /// stop string and everything after it are dropped). Of several stop strings in the text, the one that starts
    /// first wins (of two starting together, the one ending first; of duplicates, the first listed).
    pub fn push(&mut self, piece: &str) -> (String, Option<usize>) {
        let start = self.pending.len();
        self.pending.push_str(piece);
        // (where it starts, its index)
        let mut first_stop: Option<(usize, usize)> = None;
        for (i, &byte) in piece.as_bytes().iter().enumerate() {
            self.state = Self::step(&self.nodes, self.state, byte);
            // The longest stop string ending here is the one ending here that starts first.
            let node = &self.nodes[self.state];
            if node.longest_stop > 0 {
                let at = start + i + 1 - node.longest_stop;
                if first_stop.is_none_or(|(first, _)| at < first) {
                    first_stop = Some((at, node.stop_index));
                }
            }
        }
        if let Some((at, index)) = first_stop {
            self.pending.truncate(at);
            self.state = ROOT;
            return (std::mem::take(&mut self.pending), Some(index));
        }
        // Stop strings and the text are UTF-8, so a suffix equal to a stop string's prefix starts and ends on
        // character boundaries.
        let released = self.pending.len() - self.nodes[self.state].depth;
        (self.pending.drain(..released).collect(), None)
    }

    /// Adds a piece of text before stop strings may end the output (vLLM's `min_tokens`): none is looked for, and
    /// the text is released as it stops being a possible start of one, so a stop string that begins here and ends
    /// in a later piece still ends the output there.
    pub fn pass(&mut self, piece: &str) -> String {
        self.pending.push_str(piece);
        for &byte in piece.as_bytes() {
            self.state = Self::step(&self.nodes, self.state, byte);
        }
        let released = self.pending.len() - self.nodes[self.state].depth;
        self.pending.drain(..released).collect()
    }

    /// The text held back, released when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        self.state = ROOT;
        std::mem::take(&mut self.pending)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`: how much of a streamed text
/// must be held back because it may be the start of `stop`.
pub fn partial_match_len(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.is_char_boundary(text.len() - n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text released and the index of the stop string that ended it.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = s.push(p);
            out.push_str(&text);
            if stopped.is_some() {
                return (out, stopped);
            }
        }
        out.push_str(&s.flush());
        (out, None)
    }

    #[test]
    fn before_stop_strings_may_end_the_output_they_are_text_and_one_begun_then_still_ends_it() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.pass("a END b E"), "a END b ");
        assert_eq!(s.push("ND c"), ("".into(), Some(0)));
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.pass("x EN"), "x ");
        assert_eq!(s.push("Dless"), ("".into(), Some(0)));
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.pass("END"), "");
        assert_eq!(s.push("ing"), ("ENDing".into(), None));
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_never_released() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("abc E"), ("abc ".into(), None));
        assert_eq!(s.push("N"), ("".into(), None));
        assert_eq!(s.push("D tail"), ("".into(), Some(0)));
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching_or_at_the_end() {
        assert_eq!(run(&["END"], &["x E", "Nd", "!"]), ("x ENd!".into(), None));
        assert_eq!(run(&["END"], &["x E"]), ("x E".into(), None));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
    }

    /// What `push` returns, computed the plain way: each stop string searched for and its partial match measured;
    /// of the stops found, the one starting first, the shortest of those, the first listed of equal ones.
    fn push_by_each_stop(stops: &[&str], pending: &mut String, piece: &str) -> (String, Option<usize>) {
        pending.push_str(piece);
        let found = stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| pending.find(s).map(|at| (at, s.len(), i)))
            .min();
        if let Some((at, _, index)) = found {
            pending.truncate(at);
            return (std::mem::take(pending), Some(index));
        }
        let held = stops.iter().map(|s| partial_match_len(pending, s)).max().unwrap_or(0);
        let released = pending.len() - held;
        (pending.drain(..released).collect(), None)
    }

    #[test]
    fn the_scan_agrees_with_searching_for_each_stop() {
        // Overlapping stops (one inside another, shared prefixes and suffixes) over every short text of their letters
        // cut into pieces every way a deterministic generator picks.
        let stops = ["aab", "ab", "abab", "ba", "bbb", "", "ca", "aé", "é"];
        let letters = ["a", "b", "c", "é"];
        let mut seed = 0x9e37_79b9_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..4000 {
            let count = 1 + next() as usize % 4;
            let chosen: Vec<&str> = (0..count).map(|_| stops[next() as usize % stops.len()]).collect();
            let mut scan = StopStrings::new(chosen.iter().map(|s| s.to_string()).collect());
            let mut pending = String::new();
            for _ in 0..6 {
                let piece: String = (0..next() % 4)
                    .map(|_| letters[next() as usize % letters.len()])
                    .collect();
                let expected = push_by_each_stop(&chosen, &mut pending, &piece);
                assert_eq!(scan.push(&piece), expected, "{chosen:?} after {piece:?}");
                if expected.1.is_some() {
                    break;
                }
            }
            assert_eq!(scan.flush(), pending, "{chosen:?}");
        }
    }

    #[test]
    fn too_many_too_long_or_empty_stops_are_named() {
        let within = vec!["s".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS];
        assert_eq!(validate_stop_strings("stop", &within), Ok(()));
        assert_eq!(validate_stop_strings("stop", &[]), Ok(()));
        let many = validate_stop_strings("stop", &vec!["s".into(); MAX_STOP_STRINGS + 1]).unwrap_err();
        assert!(many.contains("`stop`") && many.contains("17 strings"), "{many}");
        let long = validate_stop_strings("stop", &["s".repeat(MAX_STOP_STRING_BYTES + 1)]).unwrap_err();
        assert!(long.contains("`stop`") && long.contains("257 bytes"), "{long}");
        let empty = validate_stop_strings("stop_sequences", &["s".into(), String::new()]).unwrap_err();
        assert!(empty.contains("`stop_sequences[1]` is empty"), "{empty}");
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), Some(1)));
        assert_eq!(run(&["世界"], &["hi 世", "界 no"]), ("hi ".into(), Some(0)));
        assert_eq!(run(&["é!"], &["café", " ok"]), ("café ok".into(), None));
        assert_eq!(run(&["world", "lo w"], &["hello world"]), ("hel".into(), Some(1)));
        assert_eq!(run(&["lo w", "world", "lo"], &["hello world"]), ("hel".into(), Some(2)));
        assert_eq!(
            run(&["x", "world", "wor"], &["hello wor", "ld"]),
            ("hello ".into(), Some(2))
        );
    }
}
