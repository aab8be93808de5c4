//! Stop strings over streamed text: text is released only once it cannot be the start of a stop string, so a
//! client never sees part of a stop string that later completes.

#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text not yet released because its end could begin a stop string.
    pending: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds a piece of text; returns the text safe to release and whether a stop string was reached (the stop
    /// string and everything after it are dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let first_stop = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(at) = first_stop {
            self.pending.truncate(at);
            return (std::mem::take(&mut self.pending), true);
        }
        let held = self
            .stops
            .iter()
            .map(|s| partial_match_len(&self.pending, s))
            .max()
            .unwrap_or(0);
        let released = self.pending.len() - held;
        (self.pending.drain(..released).collect(), false)
    }

    /// The text held back, released when generation ends for another reason.
    pub fn flush(&mut self) -> String {
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

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = s.push(p);
            out.push_str(&text);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_never_released() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("abc E"), ("abc ".into(), false));
        assert_eq!(s.push("N"), ("".into(), false));
        assert_eq!(s.push("D tail"), ("".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching_or_at_the_end() {
        assert_eq!(run(&["END"], &["x E", "Nd", "!"]), ("x ENd!".into(), false));
        assert_eq!(run(&["END"], &["x E"]), ("x E".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(run(&["世界"], &["hi 世", "界 no"]), ("hi ".into(), true));
        assert_eq!(run(&["é!"], &["café", " ok"]), ("café ok".into(), false));
    }
}
