//! Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
//! the sequence's last n tokens, in its prompt or its own output. No weights; it pays off where
//! the output repeats its input (editing code, quoting, summarising with citations).

/// Longest suffix looked up first: a longer match predicts its continuation better.
pub const MAX_NGRAM: usize = 4;
/// Shortest suffix looked up: single tokens match too often to predict well.
pub const MIN_NGRAM: usize = 2;
/// Tokens searched back from the end, so a proposal costs at most this many comparisons per
/// n-gram length however long the sequence grows.
pub const SEARCH_WINDOW: usize = 8192;

/// Append to `out` up to `k` tokens that followed the latest earlier occurrence of the
/// longest suffix of `tokens` (from [`MAX_NGRAM`] down to [`MIN_NGRAM`] tokens) that occurs
/// earlier; nothing when no such suffix occurs.
pub fn propose(tokens: &[u32], k: usize, out: &mut Vec<u32>) {
    if k == 0 {
        return;
    }
    let len = tokens.len();
    let start = len.saturating_sub(SEARCH_WINDOW);
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Latest occurrence first: recent text predicts the next tokens best. A match must
        // end before the suffix itself, so at least one token follows it.
        let found = (start..len - n).rev().find(|&i| &tokens[i..i + n] == suffix);
        if let Some(i) = found {
            let from = i + n;
            let to = (from + k).min(len);
            out.extend_from_slice(&tokens[from..to]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proposal(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        propose(tokens, k, &mut out);
        out
    }

    #[test]
    fn continues_the_latest_earlier_occurrence_of_the_longest_suffix() {
        // "1 2 3 4" occurs earlier followed by 5 6 7; the 2-gram "3 4" also occurs later
        // followed by 9, but the longer match wins.
        let t = [1, 2, 3, 4, 5, 6, 7, 3, 4, 9, 1, 2, 3, 4];
        assert_eq!(proposal(&t, 3), [5, 6, 7]);
        // Among matches of one length, the latest: "8 8" followed by 1, then by 2.
        let t = [8, 8, 1, 0, 8, 8, 2, 0, 8, 8];
        assert_eq!(proposal(&t, 1), [2]);
    }

    #[test]
    fn stops_at_the_end_of_the_text_and_at_k() {
        // The match's continuation runs into the suffix itself: it stops where the text ends.
        let t = [5, 6, 5, 6];
        assert_eq!(proposal(&t, 8), [5, 6]);
        assert_eq!(proposal(&[1, 2, 3, 4, 5, 1, 2], 2), [3, 4]);
        assert_eq!(proposal(&[1, 2, 3, 1, 2], 0), Vec::<u32>::new());
    }

    #[test]
    fn proposes_nothing_without_a_repeated_suffix() {
        assert!(proposal(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        assert!(proposal(&[7], 4).is_empty());
        assert!(proposal(&[], 4).is_empty());
        // A single repeated token is below the shortest n-gram.
        assert!(proposal(&[1, 2, 3, 1], 4).is_empty());
    }

    #[test]
    fn looks_back_only_within_the_window() {
        let mut t: Vec<u32> = vec![1, 2, 3];
        t.extend((0..SEARCH_WINDOW as u32).map(|i| 100 + i));
        t.extend([1, 2]);
        assert!(proposal(&t, 2).is_empty(), "the only match is beyond the window");
    }
}
