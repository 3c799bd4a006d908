//! Checks on a tokenizer description before the `tokenizers` crate builds it. That crate trusts
//! its input in places: a BPE merge whose joined token is longer than every vocabulary entry
//! indexes past a buffer, a merge whose right side lacks the continuing-subword prefix
//! underflows, a syntax error inside `decoder` or a `Precompiled` normalizer without a
//! charsmap reach an `expect`. A model file is outside input, so those shapes are refused here
//! with an error naming the file and the entry, found by fuzzing (fuzz/regressions/tokenizer_*).

use serde_json::Value;

use super::{TokenizerError, load_err};

/// Normalizers Baton does not accept: `Precompiled` (SentencePiece charsmaps of T5/ALBERT-era
/// models) runs a trie over the file's bytes without bounds checks.
const REFUSED_NORMALIZERS: &[&str] = &["Precompiled"];

/// Check a parsed `tokenizer.json` before handing it to `tokenizers`.
pub(super) fn check_tokenizer_json(source_name: &str, json: &Value) -> Result<(), TokenizerError> {
    let Value::Object(top) = json else {
        return Err(load_err(source_name, "tokenizer.json is not a JSON object"));
    };
    if let Some(normalizer) = top.get("normalizer") {
        check_normalizer(source_name, normalizer, 0)?;
    }
    if let Some(model) = top.get("model") {
        check_bpe_model(source_name, model)?;
    }
    Ok(())
}

/// How deep `Sequence` normalizers may nest (real files use one level).
const MAX_NESTING: usize = 16;

fn check_normalizer(source_name: &str, n: &Value, depth: usize) -> Result<(), TokenizerError> {
    if depth > MAX_NESTING {
        return Err(load_err(source_name, "normalizer sequences nest too deeply"));
    }
    let Some(kind) = n.get("type").and_then(Value::as_str) else {
        return Ok(());
    };
    if REFUSED_NORMALIZERS.contains(&kind) {
        return Err(TokenizerError::Unsupported {
            source_name: source_name.into(),
            message: format!("normalizer '{kind}'"),
        });
    }
    if let Some(Value::Array(inner)) = n.get("normalizers") {
        for n in inner {
            check_normalizer(source_name, n, depth + 1)?;
        }
    }
    Ok(())
}

/// A BPE model's merges, in either of `tokenizers`' two spellings ("a b" or ["a", "b"]).
fn check_bpe_model(source_name: &str, model: &Value) -> Result<(), TokenizerError> {
    let is_bpe = match model.get("type").and_then(Value::as_str) {
        Some(t) => t == "BPE",
        None => model.get("merges").is_some(),
    };
    let (Some(Value::Object(vocab)), Some(Value::Array(merges))) = (model.get("vocab"), model.get("merges")) else {
        return Ok(());
    };
    if !is_bpe {
        return Ok(());
    }
    let prefix = model
        .get("continuing_subword_prefix")
        .and_then(Value::as_str)
        .unwrap_or("");
    let pairs = merges.iter().filter_map(|m| match m {
        Value::String(s) if !s.starts_with("#version") => s.split_once(' '),
        Value::Array(pair) => match pair.as_slice() {
            [Value::String(a), Value::String(b)] => Some((a.as_str(), b.as_str())),
            _ => None,
        },
        // Anything else is a type error `tokenizers` reports itself.
        _ => None,
    });
    check_merges(source_name, |t| vocab.contains_key(t), pairs, prefix)
}

/// Every merge `a b` must name two vocabulary tokens whose join (`b` without the continuing
/// prefix) is itself in the vocabulary, which is what a BPE merge means and what keeps the
/// joined token within the longest entry's length.
pub(super) fn check_merges<'a>(
    source_name: &str,
    in_vocab: impl Fn(&str) -> bool,
    merges: impl IntoIterator<Item = (&'a str, &'a str)>,
    prefix: &str,
) -> Result<(), TokenizerError> {
    let mut joined = String::new();
    for (i, (a, b)) in merges.into_iter().enumerate() {
        let bad = |why: &str| load_err(source_name, format!("merge #{i} '{a} {b}': {why}"));
        for side in [a, b] {
            if !in_vocab(side) {
                return Err(bad(&format!("'{side}' is not in the vocabulary")));
            }
        }
        let Some(rest) = b.strip_prefix(prefix) else {
            return Err(bad(&format!(
                "'{b}' does not start with the continuing prefix '{prefix}'"
            )));
        };
        joined.clear();
        joined.push_str(a);
        joined.push_str(rest);
        if !in_vocab(&joined) {
            return Err(bad(&format!("the merged token '{joined}' is not in the vocabulary")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Result<(), TokenizerError> {
        check_tokenizer_json("t.json", &v)
    }

    #[test]
    fn merges_must_join_into_the_vocabulary() {
        let ok = json!({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}});
        check(ok).unwrap();
        let pair = json!({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}});
        check(pair).unwrap();
        // The join is longer than any token: tokenizers would index past its buffer.
        let e = check(json!({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.json") && e.contains("merge #0 'a b'") && e.contains("'ab'"),
            "{e}"
        );
        let e = check(json!({"model": {"vocab": {"a": 0}, "merges": ["a c"]}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'c' is not in the vocabulary"), "{e}");
    }

    #[test]
    fn the_right_side_must_carry_the_continuing_prefix() {
        let m = |merges: Value| {
            json!({"model": {"type": "BPE", "continuing_subword_prefix": "##",
                "vocab": {"a": 0, "##b": 1, "ab": 2, "b": 3}, "merges": merges}})
        };
        check(m(json!(["a ##b"]))).unwrap();
        let e = check(m(json!(["a b"]))).unwrap_err().to_string();
        assert!(e.contains("continuing prefix '##'"), "{e}");
    }

    #[test]
    fn precompiled_normalizers_are_refused_even_in_a_sequence() {
        let e = check(json!({"normalizer": {"type": "Precompiled"}})).unwrap_err();
        assert!(matches!(e, TokenizerError::Unsupported { .. }), "{e}");
        let nested = json!({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Precompiled", "precompiled_charsmap": ""}]}});
        assert!(check(nested).is_err());
        check(json!({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]}})).unwrap();
        assert!(check(json!([1])).is_err());
    }
}
