//! Stop strings over streamed text: cut the text before the first stop string and release only
//! text that cannot turn out to be the start of one.

/// Accumulates generated text, cuts it at the first stop string, and releases only text that
/// cannot turn out to be the start of a stop string.
#[derive(Debug, Default)]
pub struct StopMatcher<'a> {
    stops: &'a [String],
    pub text: String,
    emitted: usize,
    pub matched: bool,
}

impl<'a> StopMatcher<'a> {
    /// A matcher for `stops` (may be empty).
    pub fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// Add text; returns true when a stop string is complete (text is cut before it).
    pub fn push(&mut self, delta: &str, on_text: &mut impl FnMut(&str)) -> bool {
        if self.matched || delta.is_empty() {
            return self.matched;
        }
        let search_from = self
            .text
            .len()
            .saturating_sub(self.stops.iter().map(String::len).max().unwrap_or(0));
        self.text.push_str(delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[floor_boundary(&self.text, search_from)..]
                    .find(s.as_str())
                    .map(|i| i + floor_boundary(&self.text, search_from))
            })
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.matched = true;
            self.flush(on_text);
            return true;
        }
        let safe = self.text.len() - self.held_back();
        if safe > self.emitted {
            on_text(&self.text[self.emitted..safe]);
            self.emitted = safe;
        }
        false
    }

    /// Bytes at the end of the text that are a proper prefix of some stop string.
    fn held_back(&self) -> usize {
        let mut best = 0;
        for s in self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.text.ends_with(&s[..i]) {
                    best = best.max(i);
                }
            }
        }
        best
    }

    /// Release everything not yet emitted.
    pub fn flush(&mut self, on_text: &mut impl FnMut(&str)) {
        if self.text.len() > self.emitted {
            on_text(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        let mut matched = false;
        for d in deltas {
            if m.push(d, &mut |s| out.push_str(s)) {
                matched = true;
                break;
            }
        }
        m.flush(&mut |s| out.push_str(s));
        (m.text, out, matched)
    }

    #[test]
    fn stop_string_split_across_deltas_is_cut() {
        let (text, out, matched) = run(&["\n\n"], &["Paris.", "\n", "\nThe"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("Paris.", "Paris.", true));
    }

    #[test]
    fn partial_match_is_released_when_it_fails() {
        let (text, out, matched) = run(&["END"], &["the E", "ND", "x"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("the ", "the ", true));
        let (text, out, matched) = run(&["END"], &["the E", "nd"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("the End", "the End", false));
    }

    #[test]
    fn multibyte_text_is_safe() {
        let (text, _, matched) = run(&["é!"], &["caf", "é", "!x"]);
        assert_eq!((text.as_str(), matched), ("caf", true));
    }
}
